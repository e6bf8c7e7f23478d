//! Counters of a speculative generation, in the project's one vocabulary (docs/DESIGN.md,
//! "Speculation statistics"): rounds, drafted, accepted, per draft position, target calls.

/// Counters of one speculative generation (or a sum of several).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct SpeculationStats {
    /// Verify rounds run (rounds with drafts, plus refused rounds decoded plainly).
    pub rounds: usize,
    /// Steps the batch ran without drafts while drafting measured slower (adaptive drafts):
    /// plain steps, not rounds, so they leave the accepted length per round as it is.
    pub undrafted_steps: usize,
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
    pub from_draft: usize,
    /// Rounds the target caches could not take back (decoded without drafts instead).
    pub refused_rounds: usize,
    /// Rounds that rejected part of their drafts and so rolled the caches back.
    pub partial_rollbacks: usize,
}

impl SpeculationStats {
    /// Records a round that drafted `drafted` tokens and accepted the first `accepted`.
    pub fn record_round(&mut self, drafted: usize, accepted: usize) {
        self.rounds += 1;
        self.target_calls += 1;
        self.drafted += drafted;
        self.accepted += accepted;
        if self.drafted_by_pos.len() < drafted {
            self.drafted_by_pos.resize(drafted, 0);
            self.accepted_by_pos.resize(drafted, 0);
        }
        for i in 0..drafted {
            self.drafted_by_pos[i] += 1;
            if i < accepted {
                self.accepted_by_pos[i] += 1;
            }
        }
        if accepted < drafted {
            self.partial_rollbacks += 1;
        }
    }

    /// Records a step the batch capped to zero drafts.
    pub fn record_undrafted_step(&mut self) {
        self.undrafted_steps += 1;
        self.target_calls += 1;
    }

    /// Adds another generation's counters (a suite sums its prompts').
    pub fn add(&mut self, other: &SpeculationStats) {
        for (mine, theirs) in [
            (&mut self.drafted_by_pos, &other.drafted_by_pos),
            (&mut self.accepted_by_pos, &other.accepted_by_pos),
        ] {
            if mine.len() < theirs.len() {
                mine.resize(theirs.len(), 0);
            }
            mine.iter_mut().zip(theirs).for_each(|(m, t)| *m += t);
        }
        self.rounds += other.rounds;
        self.undrafted_steps += other.undrafted_steps;
        self.drafted += other.drafted;
        self.accepted += other.accepted;
        self.target_calls += other.target_calls;
        self.generated += other.generated;
        self.from_draft += other.from_draft;
        self.refused_rounds += other.refused_rounds;
        self.partial_rollbacks += other.partial_rollbacks;
    }

    /// accepted / drafted (0 when nothing was drafted).
    pub fn acceptance_rate(&self) -> f64 {
        ratio(self.accepted, self.drafted)
    }

    /// accepted / rounds.
    pub fn mean_accepted_len(&self) -> f64 {
        ratio(self.accepted, self.rounds)
    }

    /// generated / target_calls (0 before any call).
    pub fn tokens_per_forward(&self) -> f64 {
        ratio(self.generated, self.target_calls)
    }
}

fn ratio(a: usize, b: usize) -> f64 {
    if b == 0 {
        0.0
    } else {
        a as f64 / b as f64
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rounds_are_counted_per_position() {
        let mut s = SpeculationStats::default();
        for (d, a) in [(3, 3), (3, 1), (3, 0)] {
            s.record_round(d, a);
        }
        assert_eq!(
            (s.rounds, s.drafted, s.accepted, s.target_calls),
            (3, 9, 4, 3)
        );
        assert_eq!(s.drafted_by_pos, vec![3, 3, 3]);
        assert_eq!(s.accepted_by_pos, vec![2, 1, 1]);
        assert_eq!(s.partial_rollbacks, 2);
        assert!((s.acceptance_rate() - 4.0 / 9.0).abs() < 1e-12);
    }
}
