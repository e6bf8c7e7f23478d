//! Acceptance suites (`golden/accept/*.toml`, format `verity-accept/1`) and their baselines:
//! what `verity accept` runs and what a run is compared with. "Acceptance" here always means
//! speculative acceptance: the share of drafted tokens the target accepted.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::stats::Acceptance;

pub const SUITE_FORMAT: &str = "verity-accept/1";
pub const BASELINE_FORMAT: &str = "verity-accept-baseline/3";

/// Where a suite's drafts come from.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "lowercase")]
pub enum Source {
    /// A draft model folder (repository-relative).
    Model { model: String },
    /// Prompt lookup over n-grams of `min..=max` tokens.
    Ngram { min: usize, max: usize },
    /// The target's own multi-token-prediction head (Qwen3.5 `mtp.*`), drafting as mlx-vlm's
    /// MTP loop does.
    Mtp,
    /// A DFlash block drafter folder (repository-relative), drafting as mlx-vlm's DFlash loop
    /// does; num_draft_tokens + 1 is the block ceiling. With `chain`, the drafter runs one pass
    /// per draft (the block-vs-chain probe).
    Dflash {
        model: String,
        #[serde(default)]
        chain: bool,
    },
}

impl std::fmt::Display for Source {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Source::Model { model } => write!(f, "draft model {model}"),
            Source::Ngram { min, max } => write!(f, "prompt lookup, n-grams of {min}..={max}"),
            Source::Mtp => write!(f, "the target's MTP head"),
            Source::Dflash { model, chain } => {
                let pass = if *chain { ", one pass per draft" } else { "" };
                write!(f, "DFlash drafter {model}{pass}")
            }
        }
    }
}

#[derive(Clone, Debug, Deserialize)]
pub struct Suite {
    pub format: String,
    /// Repository-relative target model folder.
    pub target: String,
    pub source: Source,
    pub num_draft_tokens: Vec<usize>,
    pub max_tokens: usize,
    /// Prompt token ids (templates already applied).
    pub prompts: Vec<Vec<u32>>,
    /// What the oracle measured on the same prompts, for display.
    #[serde(default)]
    pub oracle: Option<OracleAcceptance>,
}

#[derive(Clone, Debug, Deserialize)]
pub struct OracleAcceptance {
    /// mlx-lm's from_draft fraction (accepted / emitted) per num_draft_tokens.
    pub from_draft: BTreeMap<String, f64>,
    /// Where the oracle reports its rounds (mlx-vlm's draft_lens and accept_lens): per
    /// num_draft_tokens, the rounds that drafted each position, summed over the prompts.
    #[serde(default)]
    pub drafted_by_pos: BTreeMap<String, Vec<usize>>,
    /// Per num_draft_tokens, the rounds that accepted each position.
    #[serde(default)]
    pub accepted_by_pos: BTreeMap<String, Vec<usize>>,
}

impl OracleAcceptance {
    /// How the oracle's per-position counts at `k` differ from `run`'s: None when it has
    /// none for `k`, else one line per differing counter (empty: equal).
    pub fn by_position_mismatches(&self, k: usize, run: &Acceptance) -> Option<Vec<String>> {
        let key = k.to_string();
        let drafted = self.drafted_by_pos.get(&key)?;
        let accepted = self.accepted_by_pos.get(&key)?;
        let mut out = Vec::new();
        for (what, oracle, ours) in [
            ("drafted", drafted, &run.drafted_by_pos),
            ("accepted", accepted, &run.accepted_by_pos),
        ] {
            if oracle != ours {
                out.push(format!(
                    "{what} by position {ours:?}, the oracle's {oracle:?}"
                ));
            }
        }
        Some(out)
    }
}

/// A suite's acceptance per num_draft_tokens, as committed next to it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Baseline {
    pub format: String,
    /// The suite it was measured on (the suite file's stem).
    pub suite: String,
    pub acceptance: BTreeMap<usize, Acceptance>,
}

#[derive(Debug, thiserror::Error)]
pub enum AcceptError {
    #[error("{path}: {message}")]
    Invalid { path: PathBuf, message: String },
}

fn invalid(path: &Path, message: impl Into<String>) -> AcceptError {
    AcceptError::Invalid {
        path: path.to_path_buf(),
        message: message.into(),
    }
}

/// Reads and parses `path`, then checks that its declared format is `expected`.
fn read<T, E: std::fmt::Display>(
    path: &Path,
    expected: &str,
    parse: impl Fn(&str) -> Result<T, E>,
    format: impl Fn(&T) -> &str,
) -> Result<T, AcceptError> {
    let text = std::fs::read_to_string(path).map_err(|e| invalid(path, e.to_string()))?;
    let value = parse(&text).map_err(|e| invalid(path, e.to_string()))?;
    match format(&value) {
        f if f == expected => Ok(value),
        f => Err(invalid(
            path,
            format!("format {f:?}, expected {expected:?}"),
        )),
    }
}

impl Suite {
    pub fn load(path: &Path) -> Result<Suite, AcceptError> {
        let suite: Suite = read(
            path,
            SUITE_FORMAT,
            |t| toml::from_str(t),
            |s: &Suite| &s.format,
        )?;
        if suite.prompts.is_empty() || suite.prompts.iter().any(Vec::is_empty) {
            return Err(invalid(path, "prompts must be non-empty token lists"));
        }
        if suite.num_draft_tokens.is_empty() || suite.max_tokens == 0 {
            return Err(invalid(path, "needs num_draft_tokens and max_tokens > 0"));
        }
        let mut ks = suite.num_draft_tokens.clone();
        ks.sort_unstable();
        ks.dedup();
        if ks.len() != suite.num_draft_tokens.len() || ks[0] == 0 {
            return Err(invalid(
                path,
                format!(
                    "num_draft_tokens {:?} must be distinct and at least 1",
                    suite.num_draft_tokens
                ),
            ));
        }
        if let Some(o) = &suite.oracle {
            let keys = |m: &BTreeMap<String, Vec<usize>>| m.keys().cloned().collect::<Vec<_>>();
            if keys(&o.drafted_by_pos) != keys(&o.accepted_by_pos) {
                return Err(invalid(
                    path,
                    "oracle.drafted_by_pos and oracle.accepted_by_pos must name the same k",
                ));
            }
            for (k, drafted) in &o.drafted_by_pos {
                let accepted = &o.accepted_by_pos[k];
                let fits = drafted.len() == accepted.len()
                    && drafted.iter().zip(accepted).all(|(d, a)| a <= d);
                if !fits {
                    return Err(invalid(
                        path,
                        format!(
                            "oracle k={k}: accepted_by_pos {accepted:?} must pair with \
                             drafted_by_pos {drafted:?}, each at most its count"
                        ),
                    ));
                }
            }
        }
        Ok(suite)
    }

    /// The suite's name: its file's stem.
    pub fn name(path: &Path) -> String {
        path.file_stem()
            .map(|s| s.to_string_lossy().into_owned())
            .unwrap_or_default()
    }

    /// The suite's committed baseline: `<suite>.baseline.json` next to it.
    pub fn baseline_path(path: &Path) -> PathBuf {
        path.with_extension("baseline.json")
    }
}

impl Baseline {
    pub fn new(suite: String, acceptance: BTreeMap<usize, Acceptance>) -> Baseline {
        Baseline {
            format: BASELINE_FORMAT.into(),
            suite,
            acceptance,
        }
    }

    /// Reads the baseline at `path` and checks that it covers `suite_path`'s suite: named
    /// after it, with a row for every num_draft_tokens it runs and no other (a baseline that
    /// compares nothing must not pass).
    pub fn load_for(
        path: &Path,
        suite_path: &Path,
        suite: &Suite,
    ) -> Result<Baseline, AcceptError> {
        let b: Baseline = read(
            path,
            BASELINE_FORMAT,
            |t| serde_json::from_str(t),
            |b: &Baseline| &b.format,
        )?;
        let name = Suite::name(suite_path);
        if b.suite != name {
            return Err(invalid(
                path,
                format!("is the baseline of suite {:?}, not {name:?}", b.suite),
            ));
        }
        let wanted: Vec<usize> = {
            let mut ks = suite.num_draft_tokens.clone();
            ks.sort_unstable();
            ks
        };
        let has: Vec<usize> = b.acceptance.keys().copied().collect();
        if has != wanted {
            return Err(invalid(
                path,
                format!("has rows for num_draft_tokens {has:?}, suite {name:?} runs {wanted:?}"),
            ));
        }
        for (k, row) in &b.acceptance {
            row.check(*k)
                .map_err(|e| invalid(path, format!("acceptance k={k}: {e}")))?;
        }
        Ok(b)
    }

    pub fn save(&self, path: &Path) -> Result<(), AcceptError> {
        let text = serde_json::to_string_pretty(self).map_err(|e| invalid(path, e.to_string()))?;
        crate::atomic::write(path, (text + "\n").as_bytes())
            .map_err(|e| invalid(path, e.to_string()))
    }
}
