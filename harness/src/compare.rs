//! Judges an engine's run of a trace against the oracle's steps, under the trace's parity tier.

use std::fmt;

use crate::trace::{FinishReason, Step, Tier, Trace};

/// What an engine produced when it replayed a trace.
#[derive(Clone, Debug, PartialEq)]
pub struct Generation {
    pub steps: Vec<Step>,
    pub finish_reason: FinishReason,
}

impl Generation {
    pub fn tokens(&self) -> Vec<u32> {
        self.steps.iter().map(|s| s.token).collect()
    }
}

/// A divergence whose oracle top-1/top-2 logprob margin is at most this is a near-tie under
/// tier A: the tokens were nearly equally likely, so a last-bit difference upstream could flip
/// the choice. (A tier B trace uses twice its logprob tolerance, when larger.)
pub const NEAR_TIE_MARGIN: f32 = 1e-5;

#[derive(Clone, Debug, PartialEq)]
pub enum Verdict {
    Pass,
    /// Tier B only: tokens diverged where the oracle itself was at a near-tie. Accepted.
    NearTie(Divergence),
    Fail(Divergence),
}

impl Verdict {
    pub fn is_failure(&self) -> bool {
        matches!(self, Verdict::Fail(_))
    }

    pub fn divergence(&self) -> Option<&Divergence> {
        match self {
            Verdict::Pass => None,
            Verdict::NearTie(d) | Verdict::Fail(d) => Some(d),
        }
    }
}

/// The first place the engine differs from the oracle.
#[derive(Clone, Debug, PartialEq)]
pub struct Divergence {
    /// 0-based step index (for length differences: the first step one side lacks).
    pub step: usize,
    pub kind: DivergenceKind,
    /// The oracle's top-1 minus top-2 logprob at `step`, when the oracle has that step.
    pub oracle_margin: Option<f32>,
    /// Whether `oracle_margin` makes this a near-tie.
    pub near_tie: bool,
}

#[derive(Clone, Debug, PartialEq)]
pub enum DivergenceKind {
    Token {
        oracle: u32,
        engine: u32,
    },
    Logprob {
        token: u32,
        oracle: f32,
        engine: f32,
    },
    Top {
        oracle: Vec<(u32, f32)>,
        engine: Vec<(u32, f32)>,
    },
    FromDraft {
        oracle: bool,
        engine: bool,
    },
    /// Teacher-forced: every step within the step tolerance, but the mean deviation is not.
    MeanLogprob {
        mean: f32,
        tolerance: f32,
    },
    Length {
        oracle: usize,
        engine: usize,
    },
    FinishReason {
        oracle: FinishReason,
        engine: FinishReason,
    },
}

impl fmt::Display for DivergenceKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            DivergenceKind::Token { oracle, engine } => {
                write!(f, "token: oracle {oracle}, engine {engine}")
            }
            DivergenceKind::Logprob { token, oracle, engine } => write!(
                f,
                "logprob of token {token}: oracle {oracle:?} ({:#010x}), engine {engine:?} ({:#010x}), diff {:e}",
                oracle.to_bits(),
                engine.to_bits(),
                engine - oracle
            ),
            DivergenceKind::Top { oracle, engine } => {
                write!(f, "top-k: oracle {oracle:?}, engine {engine:?}")
            }
            DivergenceKind::FromDraft { oracle, engine } => {
                write!(f, "from_draft: oracle {oracle}, engine {engine}")
            }
            DivergenceKind::MeanLogprob { mean, tolerance } => write!(
                f,
                "mean |Δ logprob| over the trace {mean:e} exceeds {tolerance:e}: a shift of every \
                 step, not rounding"
            ),
            DivergenceKind::Length { oracle, engine } => {
                write!(f, "length: oracle generated {oracle} tokens, engine {engine}")
            }
            DivergenceKind::FinishReason { oracle, engine } => {
                write!(f, "finish reason: oracle {oracle}, engine {engine}")
            }
        }
    }
}

/// The oracle's top-1 minus top-2 logprob at a step.
pub fn margin(step: &Step) -> Option<f32> {
    match step.top.as_slice() {
        [(_, a), (_, b), ..] => Some(a - b),
        _ => None,
    }
}

/// Compares a free-running replay on the trace's own backend with the trace, under the trace's
/// tier (replays on another backend are teacher-forced: see [`crate::forced`]).
pub fn compare(trace: &Trace, run: &Generation) -> Verdict {
    let parity = &trace.parity;
    let tier = parity.tier;
    let tolerance = parity.logprob_tolerance.unwrap_or(0.0) as f32;
    let near_tie_margin = match tier {
        Tier::A => NEAR_TIE_MARGIN,
        Tier::B => NEAR_TIE_MARGIN.max(2.0 * tolerance),
    };
    let diverged = |step: usize, kind: DivergenceKind| {
        let oracle_margin = trace.steps.get(step).and_then(margin);
        let near_tie = oracle_margin.is_some_and(|m| m <= near_tie_margin);
        let d = Divergence {
            step,
            kind,
            oracle_margin,
            near_tie,
        };
        let token_flip = matches!(d.kind, DivergenceKind::Token { .. });
        if tier == Tier::B && near_tie && token_flip {
            Verdict::NearTie(d)
        } else {
            Verdict::Fail(d)
        }
    };
    for (i, (want, got)) in trace.steps.iter().zip(&run.steps).enumerate() {
        if want.token != got.token {
            return diverged(
                i,
                DivergenceKind::Token {
                    oracle: want.token,
                    engine: got.token,
                },
            );
        }
        let logprob_ok = match tier {
            Tier::A => want.logprob.to_bits() == got.logprob.to_bits(),
            Tier::B => (want.logprob - got.logprob).abs() <= tolerance,
        };
        if !logprob_ok {
            let kind = DivergenceKind::Logprob {
                token: want.token,
                oracle: want.logprob,
                engine: got.logprob,
            };
            return diverged(i, kind);
        }
        if !top_matches(tier, tolerance, &want.top, &got.top) {
            let kind = DivergenceKind::Top {
                oracle: want.top.clone(),
                engine: got.top.clone(),
            };
            return diverged(i, kind);
        }
        if want.from_draft != got.from_draft {
            let kind = DivergenceKind::FromDraft {
                oracle: want.from_draft,
                engine: got.from_draft,
            };
            return diverged(i, kind);
        }
    }
    if trace.steps.len() != run.steps.len() {
        let kind = DivergenceKind::Length {
            oracle: trace.steps.len(),
            engine: run.steps.len(),
        };
        return diverged(trace.steps.len().min(run.steps.len()), kind);
    }
    if trace.finish_reason != run.finish_reason {
        let kind = DivergenceKind::FinishReason {
            oracle: trace.finish_reason,
            engine: run.finish_reason,
        };
        return diverged(trace.steps.len().saturating_sub(1), kind);
    }
    Verdict::Pass
}

/// Tier A: identical ids and bits. Tier B: the oracle's entries clear of the cut-off are in the
/// engine's list within the tolerance ([`crate::topk::top_agrees`]).
fn top_matches(tier: Tier, tolerance: f32, oracle: &[(u32, f32)], engine: &[(u32, f32)]) -> bool {
    match tier {
        Tier::A => {
            oracle.len() == engine.len()
                && oracle
                    .iter()
                    .zip(engine)
                    .all(|(a, b)| a.0 == b.0 && a.1.to_bits() == b.1.to_bits())
        }
        Tier::B => crate::topk::top_agrees(oracle, engine, tolerance),
    }
}
