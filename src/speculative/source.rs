//! The seam between the executor and a draft source: what a source is told and what it may use.
//!
//! A source that drafts from the target's hidden states (a native drafter such as an MTP head)
//! declares the target layers it taps; the executor then runs every target forward with those
//! taps and hands the source the rows it needs: the anchor row when drafting, the verified rows
//! on commit. The target itself (its embedding and output head, `LanguageModel::outer`) is the
//! source's to borrow when it is built.

use mlx::Array;

use super::draft_model::SteppedDraft;
use super::DraftPrefix;
use crate::cache::LayerCache;
use crate::generate::GenerateParams;
use crate::model::LanguageModel;
use crate::sample::{Masking, StepSampler};
use crate::Result;

/// How the target takes the prompt before the first round.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PrefillMode {
    /// mlx-lm's speculative_generate_step: the prompt minus its last token; the last token is
    /// verified together with the first round's drafts. `prefill` is called before the target's.
    Head,
    /// mlx-vlm's speculative loop: the target takes the whole prompt (its last token alone, as
    /// plain decoding does), the first token is sampled from the last row and emitted, and only
    /// then is the source prefilled, with that token as `last` and the last row's taps as the
    /// anchor (mlx_vlm/speculative/mtp.py, `_mtp_rounds`).
    Full,
    /// mlx-vlm's DFlash loop: as `Full`, but the target's prefill keeps the taps of every
    /// prompt row, and the source's prefill gets them all as its anchor, one (1, P, H) array
    /// per tap (mlx_vlm/speculative/utils.py, SpeculativePrefill).
    FullContext,
}

/// What a draft source may use while drafting: the request's sampler (its random key sequence
/// is shared with the target, in mlx-lm's order) and generation parameters.
pub struct DraftContext<'a> {
    pub(crate) sampler: &'a mut StepSampler,
    pub params: &'a GenerateParams,
    /// The last emitted token, which the drafts continue.
    pub last: u32,
    /// The target's hidden states at the position `last` was sampled from, one (1, 1, H) row
    /// per tap in the order of `DraftSource::taps` (in `PrefillMode::FullContext`'s prefill:
    /// every prompt row); empty when the source taps nothing or before the target has run
    /// (prefill in `PrefillMode::Head`).
    pub anchor: &'a [Array],
    /// The target's caches, read-only, holding every token before `last` (a drafter that
    /// attends over the target's keys and values borrows them here; nothing may write them).
    pub target: &'a [LayerCache],
}

impl<'a> DraftContext<'a> {
    /// A context for driving a source outside the executor (the rollback properties feed a
    /// source chosen outcomes); the executor builds its own.
    pub fn new(
        sampler: &'a mut StepSampler,
        params: &'a GenerateParams,
        last: u32,
        anchor: &'a [Array],
    ) -> DraftContext<'a> {
        DraftContext {
            sampler,
            params,
            last,
            anchor,
            target: &[],
        }
    }

    /// The same context with the target's caches to borrow.
    pub fn with_target(self, target: &'a [LayerCache]) -> DraftContext<'a> {
        DraftContext { target, ..self }
    }

    /// Whether sampling reads the drafted token ids (a penalty over the history): a source
    /// must then read each draft before sampling the next.
    pub fn needs_draft_ids(&self) -> bool {
        self.sampler.reads_history()
    }

    /// Whether a draft is the argmax of its logits plus at most a fixed bias (greedy, no
    /// processor but a logit bias; drafts are never masked), so that rows may draft together
    /// ([`crate::sample::argmax_rows`]).
    pub fn samples_by_argmax(&self) -> bool {
        self.sampler.argmax_after_bias()
    }

    /// The (1, V) row a draft's logits of V = `vocab` and `dtype` take before the argmax, None
    /// when none ([`StepSampler::argmax_bias`]).
    pub fn argmax_bias(&self, vocab: i32, dtype: mlx::Dtype) -> Result<Option<Array>> {
        self.sampler.argmax_bias(vocab, dtype)
    }

    /// Samples one token from a draft model's (1, V) logits as the target would sample after
    /// the last emitted token and `drafted`: processors, logprobs, sampler (greedy under
    /// positioned keys, StepSampler::sample_draft). Drafts are not constrained by a grammar;
    /// the target's verify walk is.
    pub fn sample(&mut self, logits: &Array, drafted: &[u32]) -> Result<Array> {
        let mut fed = vec![self.last];
        fed.extend(drafted);
        let logits = self.sampler.process(logits, &fed, Masking::Unconstrained)?;
        let logprobs = logits.subtract(&logits.logsumexp(&[-1], true)?)?;
        self.sampler.sample_draft(&logprobs)
    }

    /// Samples a block drafter's drafts from its (rows, V) logits, row i continuing the last
    /// emitted token and `drafted` (processors as in [`DraftContext::sample`]): under
    /// positioned keys each row is drawn with the key of the position it proposes, as mlx-vlm's
    /// DFlash loop draws it (StepSampler::sample_draft_at); otherwise as `sample`.
    pub fn sample_at_positions(&mut self, logits: &Array, drafted: &[u32]) -> Result<Array> {
        let mut fed = vec![self.last];
        fed.extend(drafted);
        let logits = self.sampler.process(logits, &fed, Masking::Unconstrained)?;
        self.sampler.sample_draft_at(&logits, drafted.len())
    }
}

/// A round's outcome as the source is told it.
pub struct Verified<'a> {
    /// Drafts this round proposed (and the target verified).
    pub drafted: usize,
    /// How many of them were emitted, in order.
    pub accepted: usize,
    /// The target's own token after them; None when the request ended first.
    pub next: Option<u32>,
    /// The target's hidden states over the verified input `[last, drafts...]`, one (1, k+1, H)
    /// array per tap: row i is where the token after input i was sampled from. Empty when the
    /// source taps nothing.
    pub hidden: &'a [Array],
}

/// A source of draft tokens, one per request.
pub trait DraftSource {
    /// The target hidden states this source needs (crate::model::Forward::hidden: tap i below
    /// the layer count is layer i's output, tap = layer count the final normed state).
    fn taps(&self) -> Vec<usize> {
        Vec::new()
    }

    /// How the target takes the prompt.
    fn prefill_mode(&self) -> PrefillMode {
        PrefillMode::Head
    }

    /// Called once with the whole prompt before the first round (see `PrefillMode` for when).
    fn prefill(&mut self, prompt: &[u32], ctx: &mut DraftContext<'_>) -> Result<()>;

    /// Proposes up to `n` tokens to follow the committed sequence. The returned length is
    /// authoritative: fewer (or none) is fine.
    fn draft(&mut self, n: usize, ctx: &mut DraftContext<'_>) -> Result<Vec<u32>>;

    /// The round's outcome (also after a round without drafts).
    fn commit(&mut self, round: &Verified<'_>) -> Result<()>;

    /// Whether drafting reads the target's caches (`DraftContext::target`): a batch then keeps
    /// this row's caches its own rather than in a buffer shared with other rows.
    fn reads_target_caches(&self) -> bool {
        false
    }

    /// The draft model this source runs, if any, so the executor can check it against the
    /// target before anything runs.
    fn draft_model(&self) -> Option<&dyn LanguageModel> {
        None
    }

    /// What a prefix cache keeps of this source once the target holds the prompt but its
    /// last token: a draft model's caches, or a `FullContext` source's taps over those rows
    /// (`context`: the target's taps over the rows prefilled now, one array per tap). None
    /// for a source that keeps nothing across requests.
    fn prefix(&self, _context: &[Array]) -> Result<Option<DraftPrefix>> {
        Ok(None)
    }

    /// The prompt rows whose taps a `FullContext` source already holds (restored from a
    /// prefix cache): the target's prefill starts after them.
    fn context_rows(&self) -> usize {
        0
    }

    /// The draft model's rounds, for a source that drafts by stepping its draft model: a batch
    /// then steps every row's model together ([`super::draft_model::draft_together`]) instead
    /// of calling `draft` per row.
    fn stepped(&mut self) -> Option<&mut dyn SteppedDraft> {
        None
    }
}
