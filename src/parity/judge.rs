//! Judging a golden trace on the backend this process runs on: a trace recorded here is
//! replayed free-running under its own tier; one recorded on another backend is replayed
//! teacher-forced under cross-backend tier B, at the tolerance golden/tolerances.toml gives for
//! the pair and the model's class. A case this backend cannot run is reported with the
//! manifest's reason, and a failure a known backend bug explains is reported as explained. A
//! trace of this backend that a known engine gap keeps from tier A is teacher-forced too, and
//! reported as explained when it holds there.

use std::rc::Rc;

use verity_harness::forced::{acceptance_agrees, judge_forced, ForcedCheck};
use verity_harness::registry::{ModelClass, Registry, Tolerance};
use verity_harness::report::{divergence_report, forced_report, Status};
use verity_harness::trace::Trace;
use verity_harness::{compare, Generation as Run, Verdict};

use super::replay::{replay, replay_forced, ForcedRun};
use super::Models;
use crate::bundle::ModelBundle;
use crate::Result;

/// How a trace was replayed and what that showed.
pub enum Outcome {
    /// Recorded on this backend: replayed free-running under the trace's own tier.
    Replayed { run: Run, verdict: Verdict },
    /// Recorded on another backend: replayed teacher-forced.
    Forced {
        run: ForcedRun,
        check: ForcedCheck,
        tolerance: Tolerance,
        class: ModelClass,
        /// For a greedy speculative trace: the oracle's and the replayed count of emitted
        /// tokens that came from the draft.
        acceptance: Option<(usize, usize)>,
    },
    /// A known oracle bug applies: the oracle's tokens are wrong, so verity's speculative run
    /// is held to verity's plain run on the same prompt and params (tier C).
    TierC {
        bug: String,
        speculative: Vec<u32>,
        plain: Vec<u32>,
    },
    /// This backend cannot run the case: the manifest's error and reason.
    Unsupported(String),
}

pub struct Judgement {
    /// The backend the trace was recorded on and the one it was replayed on.
    pub recorded: String,
    pub replayed: String,
    pub outcome: Outcome,
    /// A failure's registered explanation (a known backend bug).
    pub explained_by: Option<String>,
    /// Why a trace of this backend was judged at tier B (a known engine gap).
    pub lowered_by: Option<String>,
    bundle: Option<Rc<ModelBundle>>,
}

/// The class of a model folder for cross-backend tolerances.
pub fn model_class(bundle: &ModelBundle) -> ModelClass {
    let model_type = bundle.config.model_type().unwrap_or_default();
    if matches!(model_type, "qwen3_next" | "qwen3_5") {
        ModelClass::Hybrid
    } else if bundle.config.json.contains_key("quantization") {
        ModelClass::Quantized
    } else {
        ModelClass::Dense
    }
}

/// Replays `trace` on `backend` and judges it.
pub fn judge(
    trace: &Trace,
    models: &mut Models,
    backend: &str,
    registry: &Registry,
) -> Result<Judgement> {
    let recorded = trace.oracle.device.clone();
    let mut judgement = Judgement {
        recorded: recorded.clone(),
        replayed: backend.to_string(),
        outcome: Outcome::Unsupported(String::new()),
        explained_by: None,
        lowered_by: None,
        bundle: None,
    };
    if let Some(u) = registry.unsupported(trace, backend) {
        judgement.outcome = Outcome::Unsupported(format!("{} ({})", u.why, u.error));
        return Ok(judgement);
    }
    if let Some(bug) = registry.oracle_bug_for(trace) {
        let bug = format!("known oracle bug {}: {}", bug.id, bug.summary);
        if trace.params.temperature() > 0.0 || trace.draft.is_none() {
            judgement.outcome =
                Outcome::Unsupported(format!("{bug} (tier C needs a greedy speculative trace)"));
            return Ok(judgement);
        }
        let (speculative, bundle) = replay(trace, models)?;
        let plain_trace = Trace {
            draft: None,
            ..trace.clone()
        };
        let (plain, _) = replay(&plain_trace, models)?;
        judgement.outcome = Outcome::TierC {
            bug,
            speculative: speculative.tokens(),
            plain: plain.tokens(),
        };
        judgement.bundle = Some(bundle);
        return Ok(judgement);
    }
    let gap = registry
        .gap_for(trace, backend)
        .filter(|_| recorded == backend);
    judgement.lowered_by = gap.map(|g| format!("known engine gap {}: {}", g.id, g.summary));
    let (outcome, bundle) = if recorded == backend && gap.is_none() {
        let (run, bundle) = replay(trace, models)?;
        let verdict = compare(trace, &run);
        (Outcome::Replayed { run, verdict }, bundle)
    } else {
        let (run, bundle) = replay_forced(trace, models)?;
        let class = model_class(&bundle);
        let tolerance = registry.tolerance(&recorded, backend, class);
        let check = judge_forced(trace, &run.scored, tolerance.limits);
        let acceptance = run.from_draft.map(|r| (oracle_from_draft(trace), r));
        let outcome = Outcome::Forced {
            run,
            check,
            tolerance,
            class,
            acceptance,
        };
        (outcome, bundle)
    };
    judgement.outcome = outcome;
    judgement.bundle = Some(bundle);
    if judgement.failed() {
        judgement.explained_by = registry.bug_for(trace, &recorded, backend).map(|b| {
            format!(
                "known backend bug {}: {} (reproducer: {})",
                b.id, b.summary, b.reproducer
            )
        });
    }
    Ok(judgement)
}

/// The oracle's count of emitted tokens that came from the draft.
fn oracle_from_draft(trace: &Trace) -> usize {
    trace.steps.iter().filter(|s| s.from_draft).count()
}

impl Judgement {
    /// Whether the replay itself failed (before any explanation).
    fn failed(&self) -> bool {
        match &self.outcome {
            Outcome::Replayed { verdict, .. } => verdict.is_failure(),
            Outcome::Forced {
                check, acceptance, ..
            } => {
                check.failure.is_some()
                    || acceptance
                        .is_some_and(|(oracle, replayed)| !acceptance_agrees(oracle, replayed))
            }
            Outcome::TierC {
                speculative, plain, ..
            } => speculative != plain,
            Outcome::Unsupported(_) => false,
        }
    }

    pub fn status(&self) -> Status {
        match (&self.outcome, self.failed(), &self.explained_by) {
            (Outcome::Unsupported(_), _, _) | (_, true, Some(_)) => Status::Explained,
            (_, true, None) => Status::Fail,
            (Outcome::TierC { .. }, false, _) => Status::TierC,
            _ if self.lowered_by.is_some() => Status::Explained,
            (
                Outcome::Replayed {
                    verdict: Verdict::NearTie(_),
                    ..
                },
                _,
                _,
            ) => Status::NearTie,
            (Outcome::Forced { check, .. }, _, _) if !check.near_ties.is_empty() => Status::NearTie,
            _ => Status::Pass,
        }
    }

    /// The known oracle bug a tier C judgement names.
    pub fn oracle_bug(&self) -> Option<String> {
        match &self.outcome {
            Outcome::TierC { bug, .. } => Some(bug.clone()),
            _ => None,
        }
    }

    /// Token ids to text with the trace's model, for reports.
    pub fn decode(&self, ids: &[u32]) -> String {
        self.bundle
            .as_ref()
            .map_or_else(|| format!("{ids:?}"), |b| b.decode(ids))
    }

    /// The report of anything but a clean pass.
    pub fn report(&self, trace: &Trace) -> Option<String> {
        let decode = |ids: &[u32]| self.decode(ids);
        let mut out = match &self.outcome {
            Outcome::Replayed { run, verdict } => {
                verdict.divergence()?;
                divergence_report(trace, run, verdict, &decode)
            }
            Outcome::Forced {
                run,
                check,
                tolerance,
                acceptance,
                ..
            } => {
                if self.status() == Status::Pass {
                    return None;
                }
                let mut out = forced_report(trace, &run.scored, check, tolerance.limits, &decode);
                if let Some((oracle, replayed)) = acceptance {
                    out.push_str(&format!(
                        "  accepted drafts: oracle {oracle}, replayed {replayed}{}\n",
                        if acceptance_agrees(*oracle, *replayed) {
                            ""
                        } else {
                            " (out of tolerance)"
                        }
                    ));
                }
                out
            }
            Outcome::TierC {
                bug,
                speculative,
                plain,
            } => {
                if speculative == plain {
                    return None;
                }
                let at = speculative
                    .iter()
                    .zip(plain)
                    .position(|(a, b)| a != b)
                    .unwrap_or(speculative.len().min(plain.len()));
                format!(
                    "TIER C FAIL {}: verity speculative differs from verity plain at token {at}\n  \
                     speculative: {:?}\n  plain:       {:?}\n  ({bug})\n",
                    trace.id,
                    self.decode(&speculative[at..]),
                    self.decode(&plain[at..]),
                )
            }
            Outcome::Unsupported(why) => {
                format!("UNSUPPORTED {} on {}: {why}\n", trace.id, self.replayed)
            }
        };
        if let Some(e) = &self.explained_by {
            out.push_str(&format!("  explained: {e}\n"));
        }
        if let Some(g) = &self.lowered_by {
            out.push_str(&format!("  tier B, not A: {g}\n"));
        }
        Some(out)
    }
}
