//! Acceptance suites (`golden/accept/*.toml`, format `verity-accept/1`) and their baselines:
//! what `verity accept` runs and what a run is compared with. "Acceptance" here always means
//! speculative acceptance: the share of drafted tokens the target accepted.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::stats::SpecStats;

pub const SUITE_FORMAT: &str = "verity-accept/1";
pub const BASELINE_FORMAT: &str = "verity-accept-baseline/1";

/// Where a suite's drafts come from.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "lowercase")]
pub enum Source {
    /// A draft model folder (repository-relative).
    Model { model: String },
    /// Prompt lookup over n-grams of `min..=max` tokens.
    Ngram { min: usize, max: usize },
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
}

/// Summed statistics per num_draft_tokens, as committed next to a suite.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Baseline {
    pub format: String,
    pub stats: BTreeMap<usize, SpecStats>,
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

impl Suite {
    pub fn load(path: &Path) -> Result<Suite, AcceptError> {
        let text = std::fs::read_to_string(path).map_err(|e| invalid(path, e.to_string()))?;
        let suite: Suite = toml::from_str(&text).map_err(|e| invalid(path, e.to_string()))?;
        if suite.format != SUITE_FORMAT {
            return Err(invalid(
                path,
                format!("format {:?}, expected {SUITE_FORMAT:?}", suite.format),
            ));
        }
        if suite.prompts.is_empty() || suite.prompts.iter().any(Vec::is_empty) {
            return Err(invalid(path, "prompts must be non-empty token lists"));
        }
        if suite.num_draft_tokens.is_empty() || suite.max_tokens == 0 {
            return Err(invalid(path, "needs num_draft_tokens and max_tokens > 0"));
        }
        Ok(suite)
    }

    /// The suite's committed baseline: `<suite>.baseline.json` next to it.
    pub fn baseline_path(path: &Path) -> PathBuf {
        path.with_extension("baseline.json")
    }
}

impl Baseline {
    pub fn new(stats: BTreeMap<usize, SpecStats>) -> Baseline {
        Baseline {
            format: BASELINE_FORMAT.into(),
            stats,
        }
    }

    pub fn load(path: &Path) -> Result<Baseline, AcceptError> {
        let text = std::fs::read_to_string(path).map_err(|e| invalid(path, e.to_string()))?;
        let b: Baseline = serde_json::from_str(&text).map_err(|e| invalid(path, e.to_string()))?;
        if b.format != BASELINE_FORMAT {
            return Err(invalid(
                path,
                format!("format {:?}, expected {BASELINE_FORMAT:?}", b.format),
            ));
        }
        Ok(b)
    }

    pub fn save(&self, path: &Path) -> Result<(), AcceptError> {
        let text = serde_json::to_string_pretty(self).map_err(|e| invalid(path, e.to_string()))?;
        std::fs::write(path, text + "\n").map_err(|e| invalid(path, e.to_string()))
    }
}
