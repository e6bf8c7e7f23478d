//! mlx-lm's sampling (sample_utils.py): the sampler's filter chain, the logits processors, and
//! the step that joins them so plain and speculative decoding sample through one path.

mod processors;
mod sampler;

pub use processors::LogitsProcessors;
pub use sampler::Sampler;

use mlx::random::KeySequence;

use crate::grammar::{Constraint, GrammarError};

fn grammar_error(e: GrammarError) -> mlx::Error {
    mlx::Error::Invalid(e.to_string())
}
use mlx::{Array, Result};

/// processors -> logprobs -> sample, in the order mlx-lm's `_step` applies them. Holds the
/// token history the processors read and the explicit random key sequence.
pub struct StepSampler {
    pub sampler: Sampler,
    pub processors: LogitsProcessors,
    keys: Option<KeySequence>,
    history: Option<Array>,
    constraint: Option<Constraint>,
}

impl StepSampler {
    /// `seed` seeds the key sequence like `mx.random.seed(seed)`; sampling without one
    /// (temp > 0) is refused by [`Sampler::new`]'s caller, since it could not be replayed.
    pub fn new(
        sampler: Sampler,
        processors: LogitsProcessors,
        seed: Option<u64>,
    ) -> Result<StepSampler> {
        let keys = seed.map(KeySequence::new).transpose()?;
        Ok(StepSampler {
            sampler,
            processors,
            keys,
            history: None,
            constraint: None,
        })
    }

    /// Constrains every step to `constraint`'s grammar (processors, then the mask).
    pub fn with_constraint(mut self, constraint: Option<Constraint>) -> StepSampler {
        self.constraint = constraint;
        self
    }

    /// Hands the grammar state back (after a request).
    pub fn take_constraint(&mut self) -> Option<Constraint> {
        self.constraint.take()
    }

    pub fn is_constrained(&self) -> bool {
        self.constraint.is_some()
    }

    /// Whether the grammar is complete (only EOS may follow).
    pub fn grammar_stopped(&self) -> bool {
        self.constraint.as_ref().is_some_and(Constraint::is_stopped)
    }

    /// Advances the grammar over an emitted token.
    pub fn accept(&mut self, token: u32) -> Result<()> {
        match &mut self.constraint {
            Some(c) => c.consume(token).map_err(grammar_error),
            None => Ok(()),
        }
    }

    /// Takes the last `n` accepted tokens back out of the grammar.
    pub fn rollback_grammar(&mut self, n: usize) -> Result<()> {
        match &mut self.constraint {
            Some(c) => c.rollback(n).map_err(grammar_error),
            None => Ok(()),
        }
    }

    fn masked(&mut self, logits: Array) -> Result<Array> {
        match &mut self.constraint {
            Some(c) => c.mask(&logits).map_err(grammar_error),
            None => Ok(logits),
        }
    }

    /// Appends tokens the model has just been fed to the processors' history (generate_step's
    /// `tokens`: the uncached prompt, then every fed-back sample).
    pub fn extend_history(&mut self, tokens: &Array) -> Result<()> {
        if self.processors.is_empty() || tokens.size() == 0 {
            return Ok(());
        }
        self.history = Some(match &self.history {
            Some(h) => mlx::ops::concatenate(&[h, tokens], 0)?,
            None => tokens.clone(),
        });
        Ok(())
    }

    /// Whether any logits processor is active (they then need a history per position).
    pub fn has_processors(&self) -> bool {
        !self.processors.is_empty()
    }

    /// Applies the processors as if `extra` had been fed after the history (a speculative
    /// position's own prefix), without recording it.
    pub fn process_after(&mut self, extra: &[u32], logits: &Array) -> Result<Array> {
        let processed = self.processed_after(extra, logits)?;
        self.masked(processed)
    }

    /// Like [`Self::process_after`] without the grammar mask: drafts run unconstrained.
    pub fn process_draft(&self, extra: &[u32], logits: &Array) -> Result<Array> {
        self.processed_after(extra, logits)
    }

    fn processed_after(&self, extra: &[u32], logits: &Array) -> Result<Array> {
        if self.processors.is_empty() {
            return Ok(logits.clone());
        }
        let ids: Vec<i32> = extra.iter().map(|&t| t as i32).collect();
        let extra = Array::from_slice(&ids, &[ids.len() as i32])?;
        let history = match &self.history {
            Some(h) => mlx::ops::concatenate(&[h, &extra], 0)?,
            None => extra,
        };
        if history.size() == 0 {
            return Ok(logits.clone());
        }
        self.processors.apply(&history, logits)
    }

    /// Applies the processors (no-op before any history), then the grammar mask, to (1, V)
    /// logits.
    pub fn process(&mut self, logits: &Array) -> Result<Array> {
        let processed = match &self.history {
            Some(h) if !self.processors.is_empty() => self.processors.apply(h, logits)?,
            _ => logits.clone(),
        };
        self.masked(processed)
    }

    /// `logits - logsumexp(logits, keepdims=True)` over all axes, as generate_step writes it.
    pub fn logprobs(logits: &Array) -> Result<Array> {
        logits.subtract(&logits.logsumexp(&[], true)?)
    }

    /// Samples one token per row of `logprobs`.
    pub fn sample(&mut self, logprobs: &Array) -> Result<Array> {
        self.sampler.sample(logprobs, self.keys.as_mut())
    }
}
