//! Judging an engine's answer for a golden trace, whatever engine gave it: which way a trace is
//! judged on a backend ([`plan`]), and the judgement of each way's answer under the trace's tier,
//! the cross-backend tolerances and the known-bug registry. `verity check` runs verity's engine
//! for the answer; `verity judge score` reads it from another engine's responses (docs/judge.md),
//! so both give the same verdict for the same answer.
//!
//! A trace recorded on the backend it is judged on is generated free-running under its own tier;
//! one recorded on another backend is scored teacher-forced under cross-backend tier B, at the
//! tolerance golden/tolerances.toml gives for the pair and the model's class. A case the backend
//! cannot run is reported with the manifest's reason, and a failure a known backend bug explains
//! is reported as explained. A trace of this backend that a known engine gap keeps from tier A
//! is teacher-forced too, and reported as explained when it holds there, unless its model is one
//! no tolerance holds off the oracle's path (`[[incomparable]]`). A trace under a known
//! oracle bug is judged at tier C: the engine's speculative run against its own plain run.

use crate::compare::{compare, Generation, Verdict};
use crate::forced::{acceptance_agrees, judge_forced, replayed_from_draft, ForcedCheck};
use crate::registry::{ModelClass, Registry, Tolerance};
use crate::report::{divergence_report, forced_report, Status};
use crate::trace::{Draft, Step, Trace};

/// How a trace is judged on a backend, decided before the engine runs.
#[derive(Clone, Debug, PartialEq)]
pub enum Plan {
    /// The backend cannot run the case (`[[unsupported]]` in golden/MANIFEST.toml): why.
    Skip(String),
    /// A known oracle bug applies: the engine's speculative tokens are held to its plain ones.
    TierC { bug: String },
    /// Free-running generation under the trace's own tier.
    Generate,
    /// Teacher-forced scoring of the oracle's tokens (tier B); `lowered_by` names the known
    /// engine gap that keeps a trace of this backend from tier A.
    Score { lowered_by: Option<String> },
}

/// Which way `trace` is judged on `backend`.
pub fn plan(trace: &Trace, backend: &str, registry: &Registry) -> Plan {
    if let Some(u) = registry.unsupported(trace, backend) {
        return Plan::Skip(format!("{} ({})", u.why, u.error));
    }
    if let Some(bug) = registry.oracle_bug_for(trace) {
        let bug = format!("known oracle bug {}: {}", bug.id, bug.summary);
        if trace.params.temperature() > 0.0 || trace.draft.is_none() {
            return Plan::Skip(format!("{bug} (tier C needs a greedy speculative trace)"));
        }
        return Plan::TierC { bug };
    }
    let own = trace.oracle.device == backend;
    let gap = registry.gap_for(trace, backend).filter(|_| own);
    if let Some(i) = registry.incomparable_for(trace) {
        if !own {
            return Plan::Skip(format!(
                "not comparable across backends ({}): {}",
                i.id, i.summary
            ));
        }
        if let Some(g) = gap {
            return Plan::Skip(format!(
                "not comparable teacher-forced ({}, lowered from tier A by known engine gap {}): {}",
                i.id, g.id, i.summary
            ));
        }
    }
    match gap {
        None if own => Plan::Generate,
        gap => Plan::Score {
            lowered_by: gap.map(|g| format!("known engine gap {}: {}", g.id, g.summary)),
        },
    }
}

/// Whether a teacher-forced judgement of `trace` also checks speculative acceptance: for a
/// greedy trace with a draft model and no logit bias or penalties, the draft model's greedy
/// choice at every emitted position replays mlx-lm's rounds (see [`replayed_from_draft`]).
pub fn scores_drafts(trace: &Trace) -> bool {
    let p = &trace.params;
    let set = |name: &str| p.processors.get(name).is_some_and(|v| !v.is_null());
    let greedy = p.temperature() == 0.0
        && p.processors
            .get("logit_bias")
            .is_none_or(|v| v.is_null() || v.as_object().is_some_and(|o| o.is_empty()));
    let plain = ![
        "repetition_penalty",
        "presence_penalty",
        "frequency_penalty",
    ]
    .into_iter()
    .any(set);
    matches!(trace.draft, Some(Draft::Model { .. })) && greedy && plain
}

/// Where a teacher-forced judgement stops short of the trace's end, and why: from `step` on,
/// the other backend's logprobs may be no rounding of the engine's (verity's expert routers
/// came within the rounding of another choice there), so only the steps before it are judged.
#[derive(Clone, Debug, PartialEq)]
pub struct Cut {
    pub step: usize,
    pub why: String,
}

/// How a trace was judged and what that showed.
pub enum Outcome {
    /// Generated free-running under the trace's own tier.
    Replayed { run: Generation, verdict: Verdict },
    /// Scored teacher-forced.
    Forced {
        /// Per step: the oracle's token, the engine's logprob of it, the engine's best entries.
        scored: Vec<Step>,
        check: ForcedCheck,
        tolerance: Tolerance,
        class: ModelClass,
        /// For a greedy speculative trace: the oracle's and the replayed count of emitted
        /// tokens that came from the draft (not replayed past a cut).
        acceptance: Option<(usize, usize)>,
        /// Where judging stopped short of the trace's end.
        cut: Option<Cut>,
    },
    /// A known oracle bug applies: the oracle's tokens are wrong, so the engine's speculative
    /// run is held to its plain run on the same prompt and params (tier C).
    TierC {
        bug: String,
        speculative: Vec<u32>,
        plain: Vec<u32>,
    },
    /// This backend cannot run the case: the manifest's error and reason.
    Unsupported(String),
}

pub struct Judgement {
    /// The backend the trace was recorded on and the one it was judged on.
    pub recorded: String,
    pub replayed: String,
    pub outcome: Outcome,
    /// A failure's registered explanation (a known backend bug).
    pub explained_by: Option<String>,
    /// Why a trace of this backend was judged at tier B (a known engine gap).
    pub lowered_by: Option<String>,
}

impl Judgement {
    fn new(trace: &Trace, backend: &str, outcome: Outcome, lowered_by: Option<String>) -> Self {
        Judgement {
            recorded: trace.oracle.device.clone(),
            replayed: backend.to_string(),
            outcome,
            explained_by: None,
            lowered_by,
        }
    }

    /// A case `backend` cannot run ([`Plan::Skip`]).
    pub fn skipped(trace: &Trace, backend: &str, why: String) -> Self {
        Judgement::new(trace, backend, Outcome::Unsupported(why), None)
    }

    /// A tier C judgement: the engine's speculative and plain tokens ([`Plan::TierC`]).
    pub fn tier_c(
        trace: &Trace,
        backend: &str,
        bug: String,
        speculative: Vec<u32>,
        plain: Vec<u32>,
    ) -> Self {
        let outcome = Outcome::TierC {
            bug,
            speculative,
            plain,
        };
        Judgement::new(trace, backend, outcome, None)
    }

    /// A free-running run judged under the trace's tier ([`Plan::Generate`]).
    pub fn generated(trace: &Trace, backend: &str, registry: &Registry, run: Generation) -> Self {
        let verdict = compare(trace, &run);
        let outcome = Outcome::Replayed { run, verdict };
        Judgement::new(trace, backend, outcome, None).explained(trace, registry)
    }

    /// A teacher-forced scoring judged at the pair's tolerance for `class` ([`Plan::Score`]);
    /// `draft_choice` is the draft model's greedy choice per emitted position, where
    /// [`scores_drafts`] asks for it; with a `cut`, only the steps before it are judged.
    #[allow(clippy::too_many_arguments)]
    pub fn scored(
        trace: &Trace,
        backend: &str,
        registry: &Registry,
        lowered_by: Option<String>,
        class: ModelClass,
        mut scored: Vec<Step>,
        draft_choice: Option<&[u32]>,
        cut: Option<Cut>,
    ) -> Self {
        let tolerance = registry.tolerance(&trace.oracle.device, backend, class);
        let judged;
        let trace = match &cut {
            Some(c) => {
                let mut head = trace.clone();
                head.steps.truncate(c.step);
                scored.truncate(c.step);
                judged = head;
                &judged
            }
            None => trace,
        };
        let check = judge_forced(trace, &scored, tolerance.limits);
        let acceptance = match (&trace.draft, draft_choice, &cut) {
            (
                Some(Draft::Model {
                    num_draft_tokens, ..
                }),
                Some(choice),
                None,
            ) => Some((
                trace.steps.iter().filter(|s| s.from_draft).count(),
                replayed_from_draft(trace, choice, *num_draft_tokens),
            )),
            _ => None,
        };
        let outcome = Outcome::Forced {
            scored,
            check,
            tolerance,
            class,
            acceptance,
            cut,
        };
        Judgement::new(trace, backend, outcome, lowered_by).explained(trace, registry)
    }

    /// Names the known backend bug that explains a failure, if one does.
    fn explained(mut self, trace: &Trace, registry: &Registry) -> Self {
        if self.failed() {
            self.explained_by = registry
                .bug_for(trace, &self.recorded, &self.replayed)
                .map(|b| {
                    format!(
                        "known backend bug {}: {} (reproducer: {})",
                        b.id, b.summary, b.reproducer
                    )
                });
        }
        self
    }

    /// Whether the run itself failed (before any explanation).
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
            // Cut before its first step: nothing was judged.
            (Outcome::Forced { cut: Some(c), .. }, _, _) if c.step == 0 => Status::Explained,
            (
                Outcome::Replayed {
                    verdict: Verdict::NearTie(_),
                    ..
                },
                _,
                _,
            ) => Status::NearTie,
            (Outcome::Forced { check, cut, .. }, _, _)
                if !check.near_ties.is_empty() || cut.is_some() =>
            {
                Status::NearTie
            }
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

    /// The report of anything but a clean pass; `decode` turns token ids into text with the
    /// trace's tokenizer.
    pub fn report(&self, trace: &Trace, decode: &dyn Fn(&[u32]) -> String) -> Option<String> {
        let mut out = match &self.outcome {
            Outcome::Replayed { run, verdict } => {
                verdict.divergence()?;
                divergence_report(trace, run, verdict, decode)
            }
            Outcome::Forced {
                scored,
                check,
                tolerance,
                acceptance,
                cut,
                ..
            } => {
                if self.status() == Status::Pass {
                    return None;
                }
                if let Some(c) = cut.as_ref().filter(|c| c.step == 0) {
                    return Some(format!(
                        "NOT JUDGED {} on {}: {}\n",
                        trace.id, self.replayed, c.why
                    ));
                }
                let mut head = trace.clone();
                if let Some(c) = cut {
                    head.steps.truncate(c.step);
                }
                let mut out = forced_report(&head, scored, check, tolerance.limits, decode);
                if let Some(c) = cut {
                    out.push_str(&format!(
                        "  judged the first {} of {} steps: {}\n",
                        c.step,
                        trace.steps.len(),
                        c.why
                    ));
                }
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
                    "TIER C FAIL {}: speculative differs from plain at token {at}\n  \
                     speculative: {:?}\n  plain:       {:?}\n  ({bug})\n",
                    trace.id,
                    decode(&speculative[at..]),
                    decode(&plain[at..]),
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
