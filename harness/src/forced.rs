//! Tier B across backends, teacher-forced: the engine is fed the oracle's own tokens (prompt and
//! emitted), so every step is compared on the oracle's prefix and one rounding difference early
//! cannot cascade into a different text. Each step's distribution is judged against the
//! oracle's: the oracle token's logprob within the tolerance, the oracle's top-k clear of the
//! cut-off present in the engine's, and the engine's top choice equal to the oracle's except at
//! a near-tie (counted and shown).

use crate::compare::{margin, Divergence, DivergenceKind};
use crate::registry::Limits;
use crate::topk::{top_agrees, top_deviation, within};
use crate::trace::{Step, Trace};

/// The oracle's top-1/top-2 margin at which a flip of the top choice is a near-tie: a flip
/// needs the two logprobs to move towards each other, each by up to the tolerance.
pub fn near_tie_margin(tolerance: f32) -> f32 {
    2.0 * tolerance
}

/// What a teacher-forced replay showed.
#[derive(Clone, Debug, PartialEq)]
pub struct ForcedCheck {
    /// |engine logprob - oracle logprob| of the oracle's token, per step compared.
    pub deviations: Vec<f32>,
    /// The largest |engine logprob - oracle logprob| of the oracle's other top entries above
    /// its cut-off, per step compared: the top-k check holds them to the same tolerance, so
    /// the tolerance must be derived from them too.
    pub top_deviations: Vec<f32>,
    /// Steps where the engine's top choice differed from the oracle's at a near-tie.
    pub near_ties: Vec<usize>,
    /// The first step out of tolerance, if any.
    pub failure: Option<Divergence>,
}

impl ForcedCheck {
    /// The largest deviation and its step (0 at step 0 when nothing was compared).
    pub fn max_deviation(&self) -> (f32, usize) {
        self.deviations.iter().enumerate().fold(
            (0.0, 0),
            |(m, at), (i, &d)| if d > m { (d, i) } else { (m, at) },
        )
    }

    /// The mean deviation over the steps compared (0 when none were).
    pub fn mean_deviation(&self) -> f32 {
        let n = self.deviations.len().max(1) as f32;
        self.deviations.iter().sum::<f32>() / n
    }
}

/// Judges a teacher-forced replay. `scored[i]` is the engine's view of step i: `token` is the
/// oracle's token, `logprob` the engine's logprob of it, `top` the engine's best entries. Every
/// step is compared against `limits.step`; the first failure is kept; a trace whose steps all
/// pass but whose mean deviation exceeds `limits.mean` fails as a systematic shift.
pub fn judge_forced(trace: &Trace, scored: &[Step], limits: Limits) -> ForcedCheck {
    let tolerance = limits.step;
    let mut check = ForcedCheck {
        deviations: Vec::with_capacity(scored.len()),
        top_deviations: Vec::with_capacity(scored.len()),
        near_ties: Vec::new(),
        failure: None,
    };
    if scored.len() != trace.steps.len() {
        check.failure = Some(divergence(
            trace,
            scored.len().min(trace.steps.len()),
            DivergenceKind::Length {
                oracle: trace.steps.len(),
                engine: scored.len(),
            },
        ));
    }
    for (i, (oracle, engine)) in trace.steps.iter().zip(scored).enumerate() {
        let deviation = (engine.logprob - oracle.logprob).abs();
        check.deviations.push(deviation);
        check
            .top_deviations
            .push(top_deviation(&oracle.top, &engine.top));
        let problem = if !within(deviation, tolerance) {
            Some(DivergenceKind::Logprob {
                token: oracle.token,
                oracle: oracle.logprob,
                engine: engine.logprob,
            })
        } else if !top_agrees(&oracle.top, &engine.top, tolerance) {
            Some(DivergenceKind::Top {
                oracle: oracle.top.clone(),
                engine: engine.top.clone(),
            })
        } else {
            match (oracle.top.first(), engine.top.first()) {
                (Some(o), Some(e)) if o.0 != e.0 => {
                    if margin(oracle).is_some_and(|m| m <= near_tie_margin(tolerance)) {
                        check.near_ties.push(i);
                        None
                    } else {
                        Some(DivergenceKind::Token {
                            oracle: o.0,
                            engine: e.0,
                        })
                    }
                }
                _ => None,
            }
        };
        if let (Some(kind), None) = (problem, &check.failure) {
            check.failure = Some(divergence(trace, i, kind));
        }
    }
    let mean = check.mean_deviation();
    if check.failure.is_none() && !within(mean, limits.mean) {
        let kind = DivergenceKind::MeanLogprob {
            mean,
            tolerance: limits.mean,
        };
        check.failure = Some(divergence(trace, check.max_deviation().1, kind));
    }
    check
}

fn divergence(trace: &Trace, step: usize, kind: DivergenceKind) -> Divergence {
    let oracle_margin = trace.steps.get(step).and_then(margin);
    Divergence {
        step,
        kind,
        oracle_margin,
        near_tie: false,
    }
}

/// Greedy speculative acceptance replayed: given the draft model's greedy choice for each
/// emitted token's position (conditioned on the prompt and the emitted tokens before it),
/// mlx-lm's rounds of `num_draft_tokens` drafts are re-run over the trace's emitted tokens and
/// the emitted tokens that would have come from the draft are counted (its `from_draft`).
pub fn replayed_from_draft(trace: &Trace, draft_choice: &[u32], num_draft_tokens: usize) -> usize {
    let emitted = trace.tokens();
    let (mut at, mut from_draft) = (0, 0);
    while at < emitted.len() {
        let want = num_draft_tokens.min(trace.params.max_tokens - at);
        let accepted = (at..emitted.len().min(at + want))
            .take_while(|&i| draft_choice.get(i) == Some(&emitted[i]))
            .count();
        from_draft += accepted;
        at += accepted + 1;
    }
    from_draft
}

/// How far the replayed count of accepted drafts may be from the oracle's: 10% of it, and at
/// least 2 tokens (a near-tie in the draft flips one round).
pub fn acceptance_agrees(oracle: usize, replayed: usize) -> bool {
    let allowed = (oracle as f64 * 0.10).max(2.0);
    (oracle as f64 - replayed as f64).abs() <= allowed
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::trace::Trace;

    /// One recorded step: token, logprob, top alternatives.
    type StepSpec<'a> = (u32, f32, &'a [(u32, f32)]);

    fn trace(steps: &[StepSpec], from_draft: &[bool]) -> Trace {
        let steps: Vec<serde_json::Value> = steps
            .iter()
            .zip(from_draft.iter().chain(std::iter::repeat(&false)))
            .map(|((t, lp, top), fd)| {
                serde_json::json!({"token": t, "logprob": lp, "top": top, "from_draft": fd})
            })
            .collect();
        let n = steps.len();
        let doc = serde_json::json!({
            "format": "verity-trace/1", "id": "m/v/p",
            "oracle": {"tool": "mlx-lm", "tool_version": "0", "mlx_version": "0", "device": "cpu"},
            "model": "m", "prompt": {"tokens": [1]},
            "params": {"max_tokens": n, "seed": null, "sampler": {}, "processors": {},
                       "prefill_step_size": 2048, "max_kv_size": null, "kv_bits": null,
                       "kv_group_size": 64, "quantized_kv_start": 5000},
            "steps": steps, "finish_reason": "length", "generation_tokens": n,
        });
        Trace::parse(&doc.to_string(), std::path::Path::new("t.json")).unwrap()
    }

    fn limits(step: f32) -> Limits {
        Limits { step, mean: step }
    }

    fn step(token: u32, lp: f32, top: &[(u32, f32)]) -> Step {
        Step {
            token,
            logprob: lp,
            top: top.to_vec(),
            from_draft: false,
        }
    }

    #[test]
    fn within_tolerance_passes_and_records_the_deviation() {
        let t = trace(&[(3, -0.5, &[(3, -0.5), (4, -1.5)])], &[]);
        let c = judge_forced(
            &t,
            &[step(3, -0.504, &[(3, -0.504), (4, -1.49)])],
            limits(0.01),
        );
        assert_eq!(c.failure, None);
        assert!((c.max_deviation().0 - 0.004).abs() < 1e-6);
    }

    #[test]
    fn a_logprob_beyond_tolerance_fails() {
        let t = trace(&[(3, -0.5, &[(3, -0.5), (4, -1.5)])], &[]);
        let c = judge_forced(
            &t,
            &[step(3, -0.53, &[(3, -0.53), (4, -1.5)])],
            limits(0.01),
        );
        assert!(matches!(
            c.failure.map(|d| d.kind),
            Some(DivergenceKind::Logprob { .. })
        ));
    }

    #[test]
    fn a_flip_is_a_near_tie_only_at_a_near_tie() {
        let tied = trace(&[(3, -0.690, &[(3, -0.690), (4, -0.695)])], &[]);
        let flipped = [step(3, -0.693, &[(4, -0.692), (3, -0.693)])];
        let c = judge_forced(&tied, &flipped, limits(0.01));
        assert_eq!((c.failure, c.near_ties), (None, vec![0]));
        let clear = trace(&[(3, -0.2, &[(3, -0.2), (4, -1.7)])], &[]);
        let c = judge_forced(
            &clear,
            &[step(3, -0.2, &[(4, -0.1), (3, -0.2)])],
            limits(0.01),
        );
        assert!(c.failure.is_some());
    }

    #[test]
    fn a_shift_within_the_step_tolerance_fails_on_average() {
        let steps: Vec<StepSpec> = (0..4).map(|t| (t, -1.0, &[][..])).collect();
        let t = trace(&steps, &[]);
        let shifted: Vec<Step> = (0..4).map(|t| step(t, -1.008, &[])).collect();
        let c = judge_forced(
            &t,
            &shifted,
            Limits {
                step: 0.01,
                mean: 0.005,
            },
        );
        assert!(matches!(
            c.failure.map(|d| d.kind),
            Some(DivergenceKind::MeanLogprob { .. })
        ));
    }

    #[test]
    fn replayed_rounds_count_the_leading_matches_per_round() {
        // 5 tokens at k = 2: round 1 accepts the drafts at 0 and 1 (the target's token is 2),
        // round 2 misses at 3 (the target's token), round 3 may draft only the last token (4,
        // max_tokens) and matches it: 3 tokens from the draft.
        let steps: Vec<StepSpec> = (10..15).map(|t| (t, 0.0, &[][..])).collect();
        let t = trace(&steps, &[]);
        assert_eq!(replayed_from_draft(&t, &[10, 11, 99, 98, 14], 2), 3);
        assert!(acceptance_agrees(20, 18) && !acceptance_agrees(20, 17));
    }
}
