//! What golden/ declares about backends, read once per run: the tolerances of teacher-forced
//! replays across backends (`golden/tolerances.toml`), the backend bugs that explain a failure
//! (`golden/known-backend-bugs.toml`), and the cases a backend cannot run at all
//! (`[[unsupported]]` in `golden/MANIFEST.toml`).

use std::path::{Path, PathBuf};

use serde::Deserialize;

use crate::trace::Trace;

pub const TOLERANCES_FORMAT: &str = "verity-tolerances/1";

/// What kind of model a trace runs, as far as cross-backend rounding goes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum ModelClass {
    /// Attention models with float weights.
    Dense,
    /// Attention models with quantized weights.
    Quantized,
    /// Gated-DeltaNet hybrids: the recurrent state accumulates rounding over the sequence.
    Hybrid,
}

impl ModelClass {
    pub fn name(self) -> &'static str {
        match self {
            ModelClass::Dense => "dense",
            ModelClass::Quantized => "quantized",
            ModelClass::Hybrid => "hybrid",
        }
    }
}

/// How far a teacher-forced replay may deviate from the oracle: per step, and on average over
/// a trace (rounding scatters around zero; a wrong engine shifts every step).
#[derive(Clone, Copy, Debug, PartialEq, Deserialize)]
pub struct Limits {
    /// |engine logprob - oracle logprob| of the oracle's token at any step.
    pub step: f32,
    /// The same, averaged over the trace's steps.
    pub mean: f32,
}

/// The tolerances measured for one pair of backends (either direction), per model class.
#[derive(Clone, Debug, Deserialize)]
pub struct PairTolerance {
    pub backends: [String; 2],
    pub dense: Limits,
    pub quantized: Limits,
    pub hybrid: Limits,
    /// How close a mixture-of-experts router's choice may come to another before this pair's
    /// rounding may flip it: a teacher-forced judgement stops at the first step whose forward
    /// had an expert margin below it (the k-th best router score minus the next).
    #[serde(default)]
    pub router_margin: Option<f32>,
}

impl PairTolerance {
    fn get(&self, class: ModelClass) -> Limits {
        match class {
            ModelClass::Dense => self.dense,
            ModelClass::Quantized => self.quantized,
            ModelClass::Hybrid => self.hybrid,
        }
    }

    fn joins(&self, a: &str, b: &str) -> bool {
        let [x, y] = &self.backends;
        (x == a && y == b) || (x == b && y == a)
    }
}

#[derive(Clone, Debug, Deserialize)]
struct TolerancesFile {
    format: String,
    pair: Vec<PairTolerance>,
    #[serde(default)]
    incomparable: Vec<Incomparable>,
}

/// Models whose rounding on one path no tolerance bounds usefully on another: their traces are
/// judged only where verity takes the oracle's path (tier A on the backend that recorded them),
/// and reported as not comparable on any other backend, or on their own where a known engine gap
/// lowers them to teacher-forced scoring, with why.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Incomparable {
    pub id: String,
    pub summary: String,
    /// Repository-relative model folders (the trace's target).
    pub models: Vec<String>,
    /// The manifest variants it concerns (the second component of a case id); all where absent.
    #[serde(default)]
    pub variants: Option<Vec<String>>,
}

/// A backend bug that makes a trace fail, with the reproducer that tells when it is fixed.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct BackendBug {
    pub id: String,
    pub backend: String,
    pub summary: String,
    /// Repository-relative model folders whose traces it breaks (as target or draft).
    pub models: Vec<String>,
    pub reproducer: String,
}

#[derive(Clone, Debug, Deserialize)]
struct BugsFile {
    bug: Vec<BackendBug>,
}

/// A path verity knowingly computes differently from the oracle on a backend (another kernel
/// for the same math), so that backend's own traces of these models cannot be bit-exact: they
/// are judged teacher-forced (tier B) instead, and the report names the gap.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EngineGap {
    pub id: String,
    pub backend: String,
    pub summary: String,
    /// Repository-relative model folders whose traces it concerns.
    pub models: Vec<String>,
    /// The manifest variants it concerns (the second component of a case id); all where absent.
    #[serde(default)]
    pub variants: Option<Vec<String>>,
}

#[derive(Clone, Debug, Deserialize)]
struct GapsFile {
    gap: Vec<EngineGap>,
}

/// An upstream misbehaviour of an oracle (golden/known-oracle-bugs.toml): a trace it applies to
/// records the oracle's wrong output, so it is judged at tier C (verity speculative ≡ verity
/// plain) instead of against the oracle's tokens.
#[derive(Clone, Debug, Deserialize)]
pub struct OracleBug {
    pub id: String,
    pub summary: String,
    pub reproducer: String,
    /// Which traces it applies to; a bug without conditions applies to none (it concerns a
    /// path no trace records).
    #[serde(default)]
    pub when: Option<Conditions>,
}

/// When an oracle bug applies to a trace: every listed condition holds.
#[derive(Clone, Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Conditions {
    /// The trace's oracle tool (e.g. "mlx_lm.server").
    pub tool: Option<String>,
    /// The trace's draft kind ("model", "mtp", "dflash").
    pub draft: Option<Vec<String>>,
    /// Fixture names of the trace's target model (the last path component).
    pub models: Option<Vec<String>>,
    /// Processor or sampler parameters of which at least one is set and non-zero.
    pub params_set: Option<Vec<String>>,
}

impl Conditions {
    fn hold(&self, trace: &Trace) -> bool {
        let draft_kind = trace.draft.as_ref().map(|d| match d {
            crate::trace::Draft::Model { .. } => "model",
            crate::trace::Draft::Mtp { .. } => "mtp",
            crate::trace::Draft::Dflash { .. } => "dflash",
        });
        let fixture = trace.model.rsplit('/').next().unwrap_or(&trace.model);
        let set = |name: &String| {
            let p = &trace.params;
            p.processors
                .get(name)
                .or_else(|| p.sampler.get(name))
                .is_some_and(|v| !v.is_null() && v.as_f64() != Some(0.0))
        };
        self.tool.as_ref().is_none_or(|t| *t == trace.oracle.tool)
            && self
                .draft
                .as_ref()
                .is_none_or(|kinds| draft_kind.is_some_and(|k| kinds.iter().any(|x| x == k)))
            && self
                .models
                .as_ref()
                .is_none_or(|m| m.iter().any(|x| x == fixture))
            && self.params_set.as_ref().is_none_or(|ps| ps.iter().any(set))
    }
}

#[derive(Clone, Debug, Deserialize)]
struct OracleBugsFile {
    bug: Vec<OracleBug>,
}

/// Manifest cases a backend cannot run, and the error it gives: the cases of the listed
/// variants and of the listed models (each list, where given, must match).
#[derive(Clone, Debug, Deserialize)]
pub struct Unsupported {
    pub backend: String,
    #[serde(default)]
    pub variants: Option<Vec<String>>,
    /// Fixture names (the first component of a case id).
    #[serde(default)]
    pub models: Option<Vec<String>>,
    pub error: String,
    pub why: String,
}

impl Unsupported {
    fn matches(&self, model: &str, variant: &str) -> bool {
        let listed = |list: &Option<Vec<String>>, name: &str| {
            list.as_ref().is_none_or(|l| l.iter().any(|x| x == name))
        };
        listed(&self.models, model) && listed(&self.variants, variant)
    }
}

#[derive(Clone, Debug, Deserialize)]
struct ManifestFile {
    #[serde(default)]
    unsupported: Vec<Unsupported>,
}

/// How a trace is judged when replayed on another backend.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Tolerance {
    pub limits: Limits,
    /// Whether this pair of backends was measured (else the largest measured for the class).
    pub measured: bool,
}

#[derive(Clone, Debug)]
pub struct Registry {
    tolerances: Vec<PairTolerance>,
    incomparable: Vec<Incomparable>,
    bugs: Vec<BackendBug>,
    gaps: Vec<EngineGap>,
    oracle_bugs: Vec<OracleBug>,
    unsupported: Vec<Unsupported>,
}

#[derive(Debug, thiserror::Error)]
#[error("{path}: {message}")]
pub struct RegistryError {
    path: PathBuf,
    message: String,
}

fn read<T: for<'de> Deserialize<'de>>(path: &Path) -> Result<T, RegistryError> {
    let error = |message: String| RegistryError {
        path: path.to_path_buf(),
        message,
    };
    let text = std::fs::read_to_string(path).map_err(|e| error(e.to_string()))?;
    toml::from_str(&text).map_err(|e| error(e.to_string()))
}

impl Registry {
    /// Reads the five files under `golden`.
    pub fn load(golden: &Path) -> Result<Registry, RegistryError> {
        let path = golden.join("tolerances.toml");
        let tolerances: TolerancesFile = read(&path)?;
        if tolerances.format != TOLERANCES_FORMAT {
            return Err(RegistryError {
                path,
                message: format!(
                    "format {:?}, expected {TOLERANCES_FORMAT:?}",
                    tolerances.format
                ),
            });
        }
        let bugs: BugsFile = read(&golden.join("known-backend-bugs.toml"))?;
        let gaps: GapsFile = read(&golden.join("known-engine-gaps.toml"))?;
        let manifest: ManifestFile = read(&golden.join("MANIFEST.toml"))?;
        let oracle_bugs: OracleBugsFile = read(&golden.join("known-oracle-bugs.toml"))?;
        Ok(Registry {
            tolerances: tolerances.pair,
            incomparable: tolerances.incomparable,
            bugs: bugs.bug,
            gaps: gaps.gap,
            oracle_bugs: oracle_bugs.bug,
            unsupported: manifest.unsupported,
        })
    }

    /// The tolerance for a trace recorded on `recorded` and replayed on `replayed`: the
    /// measured one of that pair, or for a pair never measured the largest measured for the
    /// class.
    pub fn tolerance(&self, recorded: &str, replayed: &str, class: ModelClass) -> Tolerance {
        match self.tolerances.iter().find(|p| p.joins(recorded, replayed)) {
            Some(p) => Tolerance {
                limits: p.get(class),
                measured: true,
            },
            None => {
                let widest = |f: fn(Limits) -> f32| {
                    self.tolerances
                        .iter()
                        .map(|p| f(p.get(class)))
                        .fold(0.0, f32::max)
                };
                Tolerance {
                    limits: Limits {
                        step: widest(|l| l.step),
                        mean: widest(|l| l.mean),
                    },
                    measured: false,
                }
            }
        }
    }

    /// The router margin of the pair (see [`PairTolerance::router_margin`]); for a pair never
    /// measured, the largest measured.
    pub fn router_margin(&self, recorded: &str, replayed: &str) -> Option<f32> {
        match self.tolerances.iter().find(|p| p.joins(recorded, replayed)) {
            Some(p) => p.router_margin,
            None => self
                .tolerances
                .iter()
                .filter_map(|p| p.router_margin)
                .reduce(f32::max),
        }
    }

    /// The bug that explains a failure of `trace` between `recorded` and `replayed`, if one of
    /// them is the bug's backend and the trace runs one of its models.
    pub fn bug_for(&self, trace: &Trace, recorded: &str, replayed: &str) -> Option<&BackendBug> {
        let draft = match &trace.draft {
            Some(crate::trace::Draft::Model { model, .. }) => Some(model.as_str()),
            _ => None,
        };
        self.bugs.iter().find(|b| {
            (b.backend == recorded || b.backend == replayed)
                && b.models
                    .iter()
                    .any(|m| *m == trace.model || Some(m.as_str()) == draft)
        })
    }

    /// Why `trace`'s model is not judged teacher-forced (on a backend other than its own, or on
    /// its own under a known engine gap), if it is not.
    pub fn incomparable_for(&self, trace: &Trace) -> Option<&Incomparable> {
        self.incomparable
            .iter()
            .find(|i| i.models.contains(&trace.model) && among(&i.variants, trace))
    }

    /// The known oracle bug whose conditions `trace` meets, if any.
    pub fn oracle_bug_for(&self, trace: &Trace) -> Option<&OracleBug> {
        self.oracle_bugs
            .iter()
            .find(|b| b.when.as_ref().is_some_and(|c| c.hold(trace)))
    }

    /// The engine gap that keeps `trace`, recorded on `backend`, from tier A there, if any.
    pub fn gap_for(&self, trace: &Trace, backend: &str) -> Option<&EngineGap> {
        self.gaps.iter().find(|g| {
            g.backend == backend && g.models.contains(&trace.model) && among(&g.variants, trace)
        })
    }

    /// Why `backend` cannot run `trace`'s case, if the manifest says so.
    pub fn unsupported(&self, trace: &Trace, backend: &str) -> Option<&Unsupported> {
        let mut parts = trace.id.split('/');
        let (model, variant) = (parts.next()?, parts.next()?);
        self.unsupported
            .iter()
            .find(|u| u.backend == backend && u.matches(model, variant))
    }
}

/// Whether `trace`'s variant (the second component of its case id) is among `variants`, where
/// absent meaning all.
fn among(variants: &Option<Vec<String>>, trace: &Trace) -> bool {
    let variant = trace.id.split('/').nth(1).unwrap_or_default();
    variants
        .as_ref()
        .is_none_or(|v| v.iter().any(|x| x == variant))
}
