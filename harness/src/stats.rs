//! Speculation statistics in the format baselines are committed in, in the project's one
//! vocabulary (docs/DESIGN.md, "Speculation statistics"), and the comparison with a baseline
//! that `verity accept` (and so `git bisect run`) is driven by.

use serde::{Deserialize, Serialize};

/// Counters of one speculative generation (or a sum of several).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct SpecStats {
    /// Verify rounds run (rounds with drafts, plus refused rounds decoded plainly).
    pub rounds: usize,
    /// Tokens proposed by the draft source.
    pub drafted: usize,
    /// Proposals the target accepted.
    pub accepted: usize,
    /// Proposals at draft position i (0-based).
    pub drafted_by_pos: Vec<usize>,
    /// Acceptances at draft position i.
    pub accepted_by_pos: Vec<usize>,
    /// Target forward passes after the prompt.
    pub target_calls: usize,
    /// Tokens emitted.
    pub generated: usize,
    /// Emitted tokens that were accepted drafts (mlx-lm's `from_draft`); fewer than `accepted`
    /// when a request ends inside a round.
    #[serde(default)]
    pub from_draft: usize,
    /// Rounds the target caches could not take back (decoded without drafts instead).
    pub refused_rounds: usize,
    /// Rounds that rejected part of their drafts and so rolled the caches back.
    pub partial_rollbacks: usize,
}

impl SpecStats {
    /// Adds another generation's counters.
    pub fn add(&mut self, other: &SpecStats) {
        for (mine, theirs) in [
            (&mut self.drafted_by_pos, &other.drafted_by_pos),
            (&mut self.accepted_by_pos, &other.accepted_by_pos),
        ] {
            if mine.len() < theirs.len() {
                mine.resize(theirs.len(), 0);
            }
            for (m, t) in mine.iter_mut().zip(theirs) {
                *m += t;
            }
        }
        self.rounds += other.rounds;
        self.drafted += other.drafted;
        self.accepted += other.accepted;
        self.target_calls += other.target_calls;
        self.generated += other.generated;
        self.from_draft += other.from_draft;
        self.refused_rounds += other.refused_rounds;
        self.partial_rollbacks += other.partial_rollbacks;
    }

    /// accepted / drafted.
    pub fn acceptance_rate(&self) -> f64 {
        ratio(self.accepted, self.drafted)
    }

    /// accepted / rounds.
    pub fn mean_accepted_len(&self) -> f64 {
        ratio(self.accepted, self.rounds)
    }

    /// from_draft / generated: the share of emitted tokens that came from the draft (the
    /// fraction mlx-lm reports through `from_draft`).
    pub fn from_draft_fraction(&self) -> f64 {
        ratio(self.from_draft, self.generated)
    }

    /// generated / target_calls.
    pub fn tokens_per_forward(&self) -> f64 {
        ratio(self.generated, self.target_calls)
    }

    /// accepted_by_pos[i] / drafted_by_pos[i].
    pub fn acceptance_at(&self, pos: usize) -> f64 {
        ratio(
            self.accepted_by_pos.get(pos).copied().unwrap_or(0),
            self.drafted_by_pos.get(pos).copied().unwrap_or(0),
        )
    }
}

fn ratio(a: usize, b: usize) -> f64 {
    if b == 0 {
        0.0
    } else {
        a as f64 / b as f64
    }
}

/// How far acceptance may fall before it counts as a regression.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct Tolerance {
    /// The overall acceptance rate may fall at most this fraction below the baseline.
    pub overall_rtol: f64,
    /// Each position's acceptance rate may fall at most this far below the baseline's
    /// (absolute; positions with few drafts are noisy).
    pub per_position_floor: f64,
}

impl Default for Tolerance {
    fn default() -> Self {
        Tolerance {
            overall_rtol: 0.05,
            per_position_floor: 0.10,
        }
    }
}

/// Why a run counts as a regression against its baseline; empty means it does not.
pub fn regressions(baseline: &SpecStats, run: &SpecStats, tol: &Tolerance) -> Vec<String> {
    let mut out = Vec::new();
    let (b, r) = (baseline.acceptance_rate(), run.acceptance_rate());
    if r < b * (1.0 - tol.overall_rtol) {
        out.push(format!(
            "acceptance rate {r:.4} is below the baseline {b:.4} by more than {:.0}%",
            tol.overall_rtol * 100.0
        ));
    }
    for pos in 0..baseline.drafted_by_pos.len() {
        let (b, r) = (baseline.acceptance_at(pos), run.acceptance_at(pos));
        if r < b - tol.per_position_floor {
            out.push(format!(
                "position {pos}: acceptance {r:.4} is below the baseline {b:.4} - {:.2}",
                tol.per_position_floor
            ));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Statistics of rounds given as (drafted, accepted), each emitting accepted + 1 tokens.
    fn stats(rounds: &[(usize, usize)]) -> SpecStats {
        let width = rounds.iter().map(|r| r.0).max().unwrap_or(0);
        let mut s = SpecStats {
            drafted_by_pos: vec![0; width],
            accepted_by_pos: vec![0; width],
            ..SpecStats::default()
        };
        for &(d, a) in rounds {
            s.rounds += 1;
            s.target_calls += 1;
            s.drafted += d;
            s.accepted += a;
            s.generated += a + 1;
            (0..d).for_each(|i| s.drafted_by_pos[i] += 1);
            (0..a).for_each(|i| s.accepted_by_pos[i] += 1);
        }
        s
    }

    #[test]
    fn the_ratios_are_computed_as_defined() {
        let s = stats(&[(3, 3), (3, 1), (3, 0)]);
        assert!((s.acceptance_rate() - 4.0 / 9.0).abs() < 1e-12);
        assert!((s.mean_accepted_len() - 4.0 / 3.0).abs() < 1e-12);
        assert!((s.tokens_per_forward() - 7.0 / 3.0).abs() < 1e-12);
        assert!((s.acceptance_at(1) - 1.0 / 3.0).abs() < 1e-12);
        let mut sum = s.clone();
        sum.add(&s);
        assert_eq!(sum.accepted_by_pos, vec![4, 2, 2]);
    }

    #[test]
    fn a_drop_beyond_tolerance_is_a_regression_and_within_it_is_not() {
        let base = stats(&[(4, 4), (4, 2), (4, 3), (4, 1)]);
        assert!(regressions(&base, &base, &Tolerance::default()).is_empty());
        let worse = stats(&[(4, 2), (4, 1), (4, 1), (4, 0)]);
        let found = regressions(&base, &worse, &Tolerance::default());
        assert!(
            found.iter().any(|m| m.contains("acceptance rate")),
            "{found:?}"
        );
        assert!(
            found.iter().any(|m| m.starts_with("position 0")),
            "{found:?}"
        );
    }
}
