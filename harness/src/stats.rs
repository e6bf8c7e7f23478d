//! Speculative acceptance as baselines keep it (per draft position, in the project's one
//! vocabulary: docs/DESIGN.md, "Speculation statistics"), and the comparison with a baseline
//! that `verity accept` and `verity bisect` judge a run by.

use std::fmt;

use serde::{Deserialize, Serialize};

/// What a baseline keeps of a speculative run at one num_draft_tokens: drafts and acceptances
/// per draft position, and the tokens emitted (of which `from_draft` were accepted drafts,
/// mlx-lm's measure). The totals are sums over positions, so they cannot disagree.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Acceptance {
    /// Proposals at draft position i (0-based).
    pub drafted_by_pos: Vec<usize>,
    /// Acceptances at draft position i.
    pub accepted_by_pos: Vec<usize>,
    /// Tokens emitted.
    pub generated: usize,
    /// Emitted tokens that were accepted drafts.
    pub from_draft: usize,
}

impl Acceptance {
    /// Adds another run's counts.
    pub fn add(&mut self, other: &Acceptance) {
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
        self.generated += other.generated;
        self.from_draft += other.from_draft;
    }

    /// The counts any run of a `k`-token drafter gives: one count per draft position, at most
    /// as many acceptances as proposals, neither rising with the position (a position is only
    /// drafted, and only accepted, after the one before it), and no more emitted drafts than
    /// accepted ones or emitted tokens. A baseline that breaks this was edited, not measured.
    pub fn check(&self, k: usize) -> Result<(), String> {
        let (d, a) = (&self.drafted_by_pos, &self.accepted_by_pos);
        if d.len() != k || a.len() != k {
            return Err(format!(
                "drafted_by_pos has {} and accepted_by_pos {} counts, k={k} needs {k} each",
                d.len(),
                a.len()
            ));
        }
        if let Some(i) = (0..k).find(|&i| a[i] > d[i]) {
            return Err(format!("position {i} accepts {} of {} drafts", a[i], d[i]));
        }
        for (name, counts) in [("drafted_by_pos", d), ("accepted_by_pos", a)] {
            if let Some(i) = (1..k).find(|&i| counts[i] > counts[i - 1]) {
                return Err(format!(
                    "{name} rises from {} at position {} to {} at position {i}",
                    counts[i - 1],
                    i - 1,
                    counts[i]
                ));
            }
        }
        if self.from_draft > self.accepted() || self.from_draft > self.generated {
            return Err(format!(
                "from_draft {} exceeds the accepted drafts ({}) or the generated tokens ({})",
                self.from_draft,
                self.accepted(),
                self.generated
            ));
        }
        Ok(())
    }

    /// Proposals in all.
    pub fn drafted(&self) -> usize {
        self.drafted_by_pos.iter().sum()
    }

    /// Acceptances in all.
    pub fn accepted(&self) -> usize {
        self.accepted_by_pos.iter().sum()
    }

    /// accepted / drafted.
    pub fn rate(&self) -> f64 {
        ratio(self.accepted(), self.drafted())
    }

    /// accepted_by_pos[i] / drafted_by_pos[i].
    pub fn rate_at(&self, pos: usize) -> f64 {
        ratio(
            self.accepted_by_pos.get(pos).copied().unwrap_or(0),
            self.drafted_by_pos.get(pos).copied().unwrap_or(0),
        )
    }

    /// from_draft / generated: the share of emitted tokens that came from the draft (the
    /// fraction mlx-lm reports through `from_draft`).
    pub fn from_draft_fraction(&self) -> f64 {
        ratio(self.from_draft, self.generated)
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

/// One way a run fell below its baseline past the tolerance: what `verity accept` prints (its
/// `Display`) and `verity bisect` reports figure by figure.
#[derive(Clone, Debug, PartialEq)]
pub enum Regression {
    /// The overall acceptance rate fell more than `rtol` (relative) below the baseline's.
    Overall { baseline: f64, run: f64, rtol: f64 },
    /// Draft position `pos` (0-based) fell more than `floor` (absolute) below the baseline's.
    Position {
        pos: usize,
        baseline: f64,
        run: f64,
        floor: f64,
    },
}

impl fmt::Display for Regression {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match *self {
            Regression::Overall { baseline, run, rtol } => write!(
                f,
                "acceptance rate {run:.4} is below the baseline {baseline:.4} by more than {:.0}%",
                rtol * 100.0
            ),
            Regression::Position {
                pos,
                baseline,
                run,
                floor,
            } => write!(
                f,
                "position {pos}: acceptance {run:.4} is below the baseline {baseline:.4} - {floor:.2}"
            ),
        }
    }
}

/// How a run regressed against its baseline; empty means it does not.
pub fn regressions(baseline: &Acceptance, run: &Acceptance, tol: &Tolerance) -> Vec<Regression> {
    let mut out = Vec::new();
    let (b, r) = (baseline.rate(), run.rate());
    if r < b * (1.0 - tol.overall_rtol) {
        out.push(Regression::Overall {
            baseline: b,
            run: r,
            rtol: tol.overall_rtol,
        });
    }
    for pos in 0..baseline.drafted_by_pos.len() {
        let (b, r) = (baseline.rate_at(pos), run.rate_at(pos));
        if r < b - tol.per_position_floor {
            out.push(Regression::Position {
                pos,
                baseline: b,
                run: r,
                floor: tol.per_position_floor,
            });
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Rounds given as (drafted, accepted), each emitting accepted + 1 tokens.
    fn acceptance(rounds: &[(usize, usize)]) -> Acceptance {
        let width = rounds.iter().map(|r| r.0).max().unwrap_or(0);
        let mut s = Acceptance {
            drafted_by_pos: vec![0; width],
            accepted_by_pos: vec![0; width],
            ..Acceptance::default()
        };
        for &(d, a) in rounds {
            s.generated += a + 1;
            s.from_draft += a;
            (0..d).for_each(|i| s.drafted_by_pos[i] += 1);
            (0..a).for_each(|i| s.accepted_by_pos[i] += 1);
        }
        s
    }

    #[test]
    fn the_rates_are_computed_as_defined() {
        let s = acceptance(&[(3, 3), (3, 1), (3, 0)]);
        assert_eq!((s.drafted(), s.accepted()), (9, 4));
        assert!((s.rate() - 4.0 / 9.0).abs() < 1e-12);
        assert!((s.rate_at(1) - 1.0 / 3.0).abs() < 1e-12);
        assert!((s.from_draft_fraction() - 4.0 / 7.0).abs() < 1e-12);
        let mut sum = s.clone();
        sum.add(&acceptance(&[(4, 4)]));
        assert_eq!(sum.accepted_by_pos, vec![3, 2, 2, 1]);
        assert_eq!(sum.generated, 12);
    }

    #[test]
    fn a_drop_beyond_tolerance_is_a_regression_and_within_it_is_not() {
        let base = acceptance(&[(4, 4), (4, 2), (4, 3), (4, 1)]);
        assert!(regressions(&base, &base, &Tolerance::default()).is_empty());
        let worse = acceptance(&[(4, 2), (4, 1), (4, 1), (4, 0)]);
        let found = regressions(&base, &worse, &Tolerance::default());
        assert!(
            found
                .iter()
                .any(|m| matches!(m, Regression::Overall { .. })),
            "{found:?}"
        );
        assert!(
            found
                .iter()
                .any(|m| matches!(m, Regression::Position { pos: 0, .. })),
            "{found:?}"
        );
        assert_eq!(
            found[0].to_string(),
            "acceptance rate 0.2500 is below the baseline 0.6250 by more than 5%"
        );
    }
}
