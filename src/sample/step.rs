//! The step sampler: processors -> grammar mask -> logprobs -> sample, in the order mlx-lm's
//! `_step` applies them, holding the token history the processors read, the explicit random
//! keys, and the request's grammar.

use mlx::{ops, Array};

use super::keys::{KeySchedule, SampleKeys};
use super::{LogitsProcessors, Sampler};
use crate::grammar::Constraint;
use crate::Result;

/// Whether a step's logits are masked by the request's grammar.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Masking {
    /// The target's own steps: only what the grammar allows.
    Grammar,
    /// Draft proposals: drafts run unconstrained; the target's verify walk masks them.
    Unconstrained,
}

pub struct StepSampler {
    sampler: Sampler,
    processors: LogitsProcessors,
    keys: Option<SampleKeys>,
    /// Every token fed to the model so far (generate_step's `tokens`), when a processor reads
    /// it; when none does (a logit bias), only the first tokens fed, which say that there is a
    /// history: mlx-lm applies processors only once one is.
    history: Option<Array>,
    constraint: Option<Constraint>,
}

impl StepSampler {
    /// `seed` seeds the keys `schedule` draws with (`mx.random.seed(seed)` for a key
    /// sequence); sampling without one is refused by the sampler, since it could not be
    /// replayed.
    pub fn new(
        sampler: Sampler,
        processors: LogitsProcessors,
        seed: Option<u64>,
        schedule: KeySchedule,
        constraint: Option<Constraint>,
    ) -> Result<StepSampler> {
        let keys = seed.map(|s| SampleKeys::new(schedule, s)).transpose()?;
        Ok(StepSampler {
            sampler,
            processors,
            keys,
            history: None,
            constraint,
        })
    }

    /// Hands the grammar state back (after a request).
    pub fn take_constraint(&mut self) -> Option<Constraint> {
        self.constraint.take()
    }

    pub fn is_constrained(&self) -> bool {
        self.constraint.is_some()
    }

    /// Whether any logits processor is active (they then need a history per position).
    pub fn has_processors(&self) -> bool {
        !self.processors.is_empty()
    }

    /// Whether it samples by argmax (temperature 0), drawing no keys.
    pub fn is_greedy(&self) -> bool {
        self.sampler.is_greedy()
    }

    /// Whether a processor reads the token history (a penalty): each draft must then be read
    /// before the next is sampled.
    pub fn reads_history(&self) -> bool {
        self.processors.reads_history()
    }

    /// Whether a step's token is the argmax of its logits plus at most a fixed bias: greedy,
    /// no grammar, and no processor but a logit bias over distinct ids (a batch samples such
    /// rows together, [`StepSampler::argmax_bias`]).
    pub fn samples_by_argmax(&self) -> bool {
        self.argmax_after_bias() && !self.is_constrained()
    }

    /// Whether a token is the argmax of its logits plus at most a fixed bias, the grammar aside
    /// (a draft's, which no grammar masks).
    pub fn argmax_after_bias(&self) -> bool {
        self.is_greedy() && (!self.has_processors() || self.processors.is_bias())
    }

    /// The (1, V) row an argmax step adds to logits of V = `vocab` and `dtype` first
    /// ([`LogitsProcessors::as_bias`]), None when it adds nothing.
    pub fn argmax_bias(&self, vocab: i32, dtype: mlx::Dtype) -> Result<Option<Array>> {
        self.processors.as_bias(vocab, dtype)
    }

    /// Whether the grammar is complete (only EOS may follow).
    pub fn grammar_stopped(&self) -> bool {
        self.constraint.as_ref().is_some_and(Constraint::is_stopped)
    }

    /// Advances the grammar over an emitted token.
    pub fn advance_grammar(&mut self, token: u32) -> Result<()> {
        match &mut self.constraint {
            Some(c) => Ok(c.consume(token)?),
            None => Ok(()),
        }
    }

    /// Takes back the last `n` sampled positions that were not emitted: out of the grammar,
    /// and out of positioned keys (so the next draw samples the next emitted position).
    pub fn rewind(&mut self, n: usize) -> Result<()> {
        if let Some(keys) = &mut self.keys {
            keys.rewind(n);
        }
        match &mut self.constraint {
            Some(c) => Ok(c.rollback(n)?),
            None => Ok(()),
        }
    }

    /// Appends tokens the model has just been fed to the processors' history (generate_step's
    /// `tokens`: the uncached prompt, then every fed-back sample).
    pub fn extend_history(&mut self, tokens: &Array) -> Result<()> {
        if self.processors.is_empty() || tokens.size() == 0 {
            return Ok(());
        }
        if !self.processors.reads_history() {
            self.history.get_or_insert_with(|| tokens.clone());
            return Ok(());
        }
        self.history = Some(match &self.history {
            Some(h) => mlx::ops::concatenate(&[h, tokens], 0)?,
            None => tokens.clone(),
        });
        Ok(())
    }

    /// The one way logits become samplable: (1, V) logits through the processors, as if
    /// `unrecorded` had been fed after the recorded history (a speculative position's own
    /// prefix; empty in plain decoding), then through the grammar mask unless `masking` says
    /// the step is a draft's. Processors see nothing before any history, as in mlx-lm.
    pub fn process(
        &mut self,
        logits: &Array,
        unrecorded: &[u32],
        masking: Masking,
    ) -> Result<Array> {
        let processed = match self.history_with(unrecorded)? {
            Some(history) if !self.processors.is_empty() => {
                self.processors.apply(&history, logits)?
            }
            _ => logits.clone(),
        };
        match (&mut self.constraint, masking) {
            (Some(c), Masking::Grammar) => Ok(c.mask(&processed)?),
            _ => Ok(processed),
        }
    }

    /// The recorded history followed by `unrecorded`, or None while both are empty.
    fn history_with(&self, unrecorded: &[u32]) -> Result<Option<Array>> {
        if unrecorded.is_empty() || self.processors.is_empty() {
            return Ok(self.history.clone());
        }
        let ids: Vec<i32> = unrecorded.iter().map(|&t| t as i32).collect();
        let extra = Array::from_slice(&ids, &[ids.len() as i32])?;
        Ok(Some(match &self.history {
            Some(h) if self.processors.reads_history() => mlx::ops::concatenate(&[h, &extra], 0)?,
            Some(h) => h.clone(),
            None => extra,
        }))
    }

    /// `logits - logsumexp(logits, keepdims=True)` over all axes, as generate_step writes it.
    pub fn logprobs(logits: &Array) -> Result<Array> {
        Ok(logits.subtract(&logits.logsumexp(&[], true)?)?)
    }

    /// Samples one token per row of `logprobs`.
    pub fn sample(&mut self, logprobs: &Array) -> Result<Array> {
        self.sampler.sample(logprobs, self.keys.as_mut())
    }

    /// Samples a DFlash block's drafts from the drafter's (rows, V) logits, row i as draft
    /// `offset + i` of the round. Under positioned keys (and a temperature) each is drawn from
    /// the logits themselves with the key of the position it proposes, as mlx-vlm's DFlash loop
    /// does (`_PositionedDraftSampler`, speculative/dflash.py), so a draft the target would
    /// sample at that position is proposed; no key is consumed (the target draws the same
    /// positions next). Otherwise as [`StepSampler::sample_draft`] over their logprobs.
    pub fn sample_draft_at(&mut self, logits: &Array, offset: usize) -> Result<Array> {
        match self.keys {
            Some(SampleKeys::Positioned { seed, next }) if !self.is_greedy() => {
                self.sampler.sample_positioned(logits, seed, next + offset)
            }
            _ => {
                let logprobs = logits.subtract(&logits.logsumexp(&[-1], true)?)?;
                self.sample_draft(&logprobs)
            }
        }
    }

    /// Picks a draft token from a draft source's logprobs: as the target samples, except under
    /// positioned keys, where drafts are greedy (mlx-vlm's MTP loop, speculative/mtp.py:785):
    /// the target's draw at a position does not depend on the drafts, so they need no keys.
    pub fn sample_draft(&mut self, logprobs: &Array) -> Result<Array> {
        match self.keys {
            Some(SampleKeys::Positioned { .. }) => Ok(ops::argmax(logprobs, -1, false)?),
            _ => self.sample(logprobs),
        }
    }
}
