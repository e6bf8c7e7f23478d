//! The seam between the executor and a draft source: what a source is told and what it may use.

use mlx::Array;

use crate::cache::LayerCache;
use crate::generate::GenerateParams;
use crate::model::LanguageModel;
use crate::sample::{Masking, StepSampler};
use crate::Result;

/// What a draft source may use while drafting: the request's sampler (its random key sequence
/// is shared with the target, in mlx-lm's order) and generation parameters.
pub struct DraftContext<'a> {
    pub(crate) sampler: &'a mut StepSampler,
    pub params: &'a GenerateParams,
    /// The last emitted token, which the drafts continue.
    pub(crate) last: u32,
}

impl DraftContext<'_> {
    /// Samples one token from a draft model's (1, V) logits as the target would sample after
    /// the last emitted token and `drafted`: processors, logprobs, sampler. Drafts are not
    /// constrained by a grammar; the target's verify walk is.
    pub fn sample(&mut self, logits: &Array, drafted: &[u32]) -> Result<Array> {
        let mut fed = vec![self.last];
        fed.extend(drafted);
        let logits = self.sampler.process(logits, &fed, Masking::Unconstrained)?;
        let logprobs = logits.subtract(&logits.logsumexp(&[-1], true)?)?;
        self.sampler.sample(&logprobs)
    }
}

/// A source of draft tokens, one per request.
pub trait DraftSource {
    /// Called once with the whole prompt before the first round.
    fn prefill(&mut self, prompt: &[u32], ctx: &mut DraftContext<'_>) -> Result<()>;

    /// Proposes up to `n` tokens to follow the committed sequence. The returned length is
    /// authoritative: fewer (or none) is fine.
    fn draft(&mut self, n: usize, ctx: &mut DraftContext<'_>) -> Result<Vec<u32>>;

    /// The round's outcome: of the `drafted` proposals the first `accepted` were emitted,
    /// followed by the target's own token `next` (None when the request ended first).
    fn commit(&mut self, drafted: usize, accepted: usize, next: Option<u32>) -> Result<()>;

    /// The draft model this source runs, if any, so the executor can check it against the
    /// target before anything runs.
    fn draft_model(&self) -> Option<&dyn LanguageModel> {
        None
    }

    /// The draft model's caches, if the source has any (for a prefix cache to keep after the
    /// prefill).
    fn caches(&self) -> Option<&[LayerCache]> {
        None
    }
}
