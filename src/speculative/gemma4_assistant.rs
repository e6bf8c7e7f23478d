//! Gemma 4's assistant drafter as a draft source, driven as mlx-vlm's MTP round loop drives it
//! (mlx_vlm/speculative/mtp.py, `_mtp_rounds`; drafters/gemma4_assistant/gemma4_assistant.py,
//! `draft_block`). It runs in `PrefillMode::Full` and taps the target's final post-norm hidden
//! state (mlx-vlm's `speculative_draft_hidden`).
//!
//! - draft: from (the last token, the anchor row it was sampled from), `n` chained passes,
//!   each reading the scaled target embedding of the previous token next to the previous pass's
//!   projected state, at the RoPE position of the target's last cached token, over the keys
//!   and values the target's caches hold now. They are borrowed through
//!   `DraftContext::target` (no copy, never written): the drafter owns no cache, so a rejected
//!   draft leaves nothing to take back, and the next round reads the target's caches as the
//!   rollback left them, which is mlx-vlm's verify K/V sliced to the accepted rows.
//! - the block: a requested block above the drafter's `block_size` is used only while at least
//!   65% of the last 32 rounds (after 8) accepted `block_size - 1` drafts
//!   (`_effective_mtp_block_size`); otherwise the round drafts `block_size - 1`.
//!
//! - sampled drafts: under mlx-vlm's positioned sampler the target's draws are keyed by
//!   position, but the drafter's go through the sampler's plain `__call__` (top-k, then top-p
//!   or `categorical(logits * (1 / temp))`) on MLX's global key, which mlx_vlm.generate seeds
//!   with the request's seed; so the drafter draws from its own key sequence seeded so
//!   (`Sampler::draw_with_key`). Other sampling (greedy, mlx-lm's key sequence) drafts as the
//!   target would sample (`DraftContext::sample`).
//!
//! Past a sliding window the drafter reads the window's last `max_size` keys, which the target's
//! rotating caches hold in time order only until they wrap (`LayerCache::visible` orders them),
//! and its rounds are taken back exactly where the target writes a verify one token at a time
//! (crate::cache::RotatingKvCache). mlx-vlm swaps in a BufferedRotatingKVCache there, whose
//! mask lets the drafter see 15 of a window's 16 keys (docs/fixture-pitfalls.md): past a
//! window its drafts are not verity's, and only speculation ≡ plain is checked there.

use mlx::random::KeySequence;
use mlx::{Array, Dtype};

use super::{DraftContext, DraftSource, PrefillMode, Verified};
use crate::cache::LayerCache;
use crate::error::contract;
use crate::generate::token_array;
use crate::model::gemma4_assistant::{step_input, Gemma4Assistant};
use crate::model::LanguageModel;
use crate::sample::{KeySchedule, Sampler};
use crate::{validate, Error, Result};

/// `_effective_mtp_block_size`'s window of recent rounds, its warm-up and its hit rate.
const RECENT: usize = 32;
const WARM_UP: usize = 8;
const HIT_RATE: f64 = 0.65;

/// Each drafter layer's keys and values, and the position of the target's last cached token.
type Shared = (Vec<(Array, Array)>, usize);

pub struct AssistantDrafter<'m> {
    target: &'m dyn LanguageModel,
    model: &'m Gemma4Assistant,
    /// For each drafter layer, the target cache it reads.
    caches: Vec<usize>,
    embed_scale: f32,
    /// Accepted drafts per round (mlx-vlm's `accept_lens`).
    accepted: Vec<usize>,
    /// The key sequence of sampled drafts under positioned keys, and the sampler they draw with.
    keys: Option<(KeySequence, Sampler)>,
}

impl<'m> AssistantDrafter<'m> {
    /// `model` drafting for `target`, after checking the pair (crate::validate::gemma4_assistant).
    pub fn new(
        target: &'m dyn LanguageModel,
        model: &'m Gemma4Assistant,
    ) -> Result<AssistantDrafter<'m>> {
        let (caches, embed_scale) = validate::gemma4_assistant(target, model)?;
        Ok(AssistantDrafter {
            target,
            model,
            caches,
            embed_scale,
            accepted: Vec::new(),
            keys: None,
        })
    }

    /// The drafts this round takes of the `n` offered (the block-size policy above).
    fn block(&self, n: usize) -> usize {
        let total = n + 1;
        let configured = self.model.block_size.min(total);
        if total <= configured || configured <= 1 {
            return n;
        }
        if self.accepted.len() < WARM_UP {
            return configured - 1;
        }
        let recent = &self.accepted[self.accepted.len().saturating_sub(RECENT)..];
        let hits = recent.iter().filter(|&&a| a + 1 >= configured).count();
        if (hits as f64) / (recent.len() as f64) < HIT_RATE {
            configured - 1
        } else {
            n
        }
    }

    /// Each drafter layer's keys and values, as the target's caches hold them (a sliding
    /// window's last `max_size`: what a query at the last cached token's position sees), and
    /// that position.
    fn shared(&self, target: &[LayerCache]) -> Result<Shared> {
        let mut kv = Vec::with_capacity(self.caches.len());
        let mut offset = 0;
        for &i in &self.caches {
            let cache = target.get(i).ok_or_else(|| {
                contract(format!(
                    "the assistant drafter reads target cache {i} of {}",
                    target.len()
                ))
            })?;
            let window = match cache {
                LayerCache::Rotating(c) => Some(c.max_size as i32),
                LayerCache::Kv(_) => None,
                _ => {
                    return Err(Error::Unsupported(
                        "the Gemma 4 assistant drafter over a quantized KV cache".into(),
                    ))
                }
            };
            let (keys, values) = cache.visible()?.ok_or_else(|| {
                contract("the assistant drafter drafts before the target holds any token")
            })?;
            let last = |a: &Array| match window {
                Some(w) if a.dim(2) > w => a.slice_axis(2, a.dim(2) - w, a.dim(2)),
                _ => Ok(a.clone()),
            };
            kv.push((last(&keys)?, last(&values)?));
            offset = cache.offset();
        }
        Ok((kv, offset.saturating_sub(1)))
    }
}

impl DraftSource for AssistantDrafter<'_> {
    fn taps(&self) -> Vec<usize> {
        vec![self.target.num_layers()]
    }

    fn prefill_mode(&self) -> PrefillMode {
        PrefillMode::Full
    }

    fn reads_target_caches(&self) -> bool {
        true
    }

    fn prefill(&mut self, _prompt: &[u32], ctx: &mut DraftContext<'_>) -> Result<()> {
        self.accepted.clear();
        let p = ctx.params;
        self.keys = match p.seed {
            Some(seed) if p.keys == KeySchedule::Positioned && p.sampler.temp > 0.0 => {
                Some((KeySequence::new(seed)?, Sampler::new(p.sampler.clone())))
            }
            _ => None,
        };
        Ok(())
    }

    fn draft(&mut self, n: usize, ctx: &mut DraftContext<'_>) -> Result<Vec<u32>> {
        let n = self.block(n);
        if n == 0 {
            return Ok(Vec::new());
        }
        let (kv, position) = self.shared(ctx.target)?;
        let mut state = ctx
            .anchor
            .first()
            .ok_or_else(|| contract("the assistant drafter got no hidden row from the target"))?
            .clone();
        let mut token = ctx.last;
        let mut drafts = Vec::with_capacity(n);
        while drafts.len() < n {
            let ids = token_array(&[token])?.expand_dims(&[0])?;
            let embedded = self
                .target
                .outer()
                .embed_tokens
                .forward(&ids)?
                .multiply_scalar(self.embed_scale)?;
            let (next, logits) = self
                .model
                .step(&step_input(&embedded, &state)?, &kv, position)?;
            state = next;
            let sampled = match &mut self.keys {
                Some((keys, sampler)) => sampler.draw_with_key(&logits, &keys.next_key()?)?,
                None => ctx.sample(&logits, &drafts)?,
            };
            token = sampled.astype(Dtype::Uint32)?.item::<u32>()?;
            drafts.push(token);
        }
        Ok(drafts)
    }

    fn commit(&mut self, round: &Verified<'_>) -> Result<()> {
        if round.drafted > 0 {
            self.accepted.push(round.accepted);
        }
        Ok(())
    }
}
