//! A DFlash block drafter as a draft source, with the round bookkeeping of mlx-vlm's
//! `_dflash_rounds` (mlx_vlm/speculative/dflash.py). It taps the target layers its config names
//! and runs in `PrefillMode::FullContext`: the drafter's context starts as the taps over every
//! prompt row.
//!
//! - draft: one drafter pass over `[last, mask x (bs - 1)]` after the context rows not yet in
//!   its caches; rows 1.. are the drafts. The block size `bs` follows mlx-vlm's adaptive policy
//!   (`_dflash_next_block_size`): the configured block is a ceiling, cut by the request's
//!   remaining budget, shrunk while acceptance is poor and grown back while it is strong.
//! - commit: the verified rows up to the target's own token (`accepted + 1` rows) become the
//!   next context. The drafter's caches only ever hold context, so a rejected draft leaves
//!   nothing to take back.
//!
//! The same drafter can run as a chain ([`DflashDrafter::chained`]): one pass per draft, each
//! with the drafts picked so far in place of their masks. That is the block-vs-chain probe: a
//! block drafter earns its one pass per round when its acceptance per position is close to what
//! the chain of passes gets (`verity accept` on a suite with `chain = true`).

use mlx::{ops, Array, Dtype};

use super::{DraftContext, DraftPrefix, DraftSource, PrefillMode, Verified};
use crate::cache::LayerCache;
use crate::generate::token_array;
use crate::model::dflash::DflashModel;
use crate::model::LanguageModel;
use crate::{validate, Result};

/// mlx-vlm's `dflash_min_block_size` default: the policy never shrinks a block below it.
const MIN_BLOCK: usize = 4;
/// Rounds of history the policy looks at.
const WINDOW: usize = 8;

pub struct DflashDrafter<'m> {
    target: &'m dyn LanguageModel,
    model: &'m DflashModel,
    caches: Vec<LayerCache>,
    /// The target's taps over the prompt rows a prefix cache restored (one (1, P, H) array per
    /// tap; none when fresh): the context before the rows the target prefills now.
    restored: Vec<Array>,
    /// Tapped target rows (1, R, taps x H) the next draft feeds as context.
    pending: Option<Array>,
    /// (accepted, drafted) per round, for the block-size policy.
    history: Vec<(usize, usize)>,
    /// One pass per draft instead of one per block (the probe).
    chain: bool,
}

impl<'m> DflashDrafter<'m> {
    /// `model` drafting for `target`, after checking the pair (crate::validate::dflash).
    pub fn new(target: &'m dyn LanguageModel, model: &'m DflashModel) -> Result<DflashDrafter<'m>> {
        validate::dflash(target, model)?;
        Ok(DflashDrafter {
            target,
            model,
            caches: model.make_cache(),
            restored: Vec::new(),
            pending: None,
            history: Vec::new(),
            chain: false,
        })
    }

    /// The drafter resuming a prefix cache's entry: `taps` are the target's over its rows
    /// (what [`DraftSource::prefix`] gave).
    pub fn resumed(self, taps: Vec<Array>) -> DflashDrafter<'m> {
        DflashDrafter {
            restored: taps,
            ..self
        }
    }

    /// The restored taps followed by `rows` (one array per tap, along the rows; none when
    /// the target prefilled no rows).
    fn after_restored(&self, rows: &[Array]) -> Result<Vec<Array>> {
        if self.restored.is_empty() || rows.is_empty() {
            return Ok(if rows.is_empty() {
                self.restored.clone()
            } else {
                rows.to_vec()
            });
        }
        Ok(self
            .restored
            .iter()
            .zip(rows)
            .map(|(before, now)| ops::concatenate(&[before, now], 1))
            .collect::<mlx::Result<_>>()?)
    }

    /// The drafter run as a chain: one pass per draft, pass j seeing the drafts before it in
    /// place of their masks (for the block-vs-chain probe; the block size policy is the same).
    pub fn chained(
        target: &'m dyn LanguageModel,
        model: &'m DflashModel,
    ) -> Result<DflashDrafter<'m>> {
        Ok(DflashDrafter {
            chain: true,
            ..Self::new(target, model)?
        })
    }

    /// The drafter's KV caches (context only).
    pub fn caches(&self) -> &[LayerCache] {
        &self.caches
    }

    /// One drafter pass over `block` after `context`: the target's logits (bs - 1, V) at the
    /// block's rows 1.., whose picks are the drafts.
    fn pass(&mut self, block: &[u32], context: &Array) -> Result<Array> {
        let ids = token_array(block)?.expand_dims(&[0])?;
        let embedded = self.target.outer().embed_tokens.forward(&ids)?;
        let h = self.model.forward(&embedded, context, &mut self.caches)?;
        let rows = h.slice_axis(1, 1, block.len() as i32)?.squeeze(&[0])?;
        Ok(self.target.outer().logits(&rows)?)
    }

    /// The chain: pass j starts from the caches as they were before the round, with the drafts
    /// picked so far in place of their masks, and its row j is draft j.
    fn chain_drafts(
        &mut self,
        mut block: Vec<u32>,
        context: &Array,
        ctx: &mut DraftContext<'_>,
    ) -> Result<Vec<u32>> {
        let before = self.caches.clone();
        let mut drafts = Vec::with_capacity(block.len() - 1);
        for j in 1..block.len() {
            self.caches = before.clone();
            let logits = self.pass(&block, context)?;
            let row = logits.slice_axis(0, j as i32 - 1, j as i32)?;
            let token = ctx
                .sample_at_positions(&row, &drafts)?
                .astype(Dtype::Uint32)?;
            drafts.push(token.item::<u32>()?);
            block[j] = drafts[j - 1];
        }
        Ok(drafts)
    }

    /// Appends a round's (1, R, taps x H) context rows to those not yet fed.
    fn push_context(&mut self, rows: Array) -> Result<()> {
        self.pending = Some(match self.pending.take() {
            Some(prev) => ops::concatenate(&[&prev, &rows], 1)?,
            None => rows,
        });
        Ok(())
    }
}

/// mlx-vlm's `_dflash_next_block_size` for a drafter without an initial block size or a
/// preference for the requested one (qwen3_dflash): `total` is the ceiling already cut by the
/// budget; `history` the (accepted, drafted) rounds so far.
pub fn next_block_size(history: &[(usize, usize)], total: usize) -> usize {
    if total <= 1 {
        return total;
    }
    let start = history.len().saturating_sub(WINDOW);
    let recent: Vec<(usize, usize)> = history[start..]
        .iter()
        .copied()
        .filter(|&(_, d)| d > 0)
        .collect();
    let Some(&(_, last_drafted)) = recent.last() else {
        return total;
    };
    let current = total.min((last_drafted + 1).max(2));
    let floor = total.min(MIN_BLOCK);
    let accepted: usize = recent.iter().map(|&(a, _)| a).sum();
    let drafted: usize = recent.iter().map(|&(_, d)| d).sum();
    let rate = accepted as f64 / drafted as f64;
    let mean = accepted as f64 / recent.len() as f64;
    let shrink = |by_half: bool| {
        let smaller = if by_half { current / 2 } else { current - 2 };
        floor.max(total.min(smaller))
    };
    if rate < 0.30 || mean < 2.0 {
        return shrink(current >= 8);
    }
    if rate < 0.50 {
        return shrink(false);
    }
    let full_hits = recent.iter().filter(|&&(a, d)| a >= d).count();
    if rate >= 0.85 && full_hits as f64 / recent.len() as f64 >= 0.75 {
        return total.min(current + 2);
    }
    total.min(current)
}

impl DraftSource for DflashDrafter<'_> {
    fn taps(&self) -> Vec<usize> {
        self.model.target_layer_ids.clone()
    }

    fn prefill_mode(&self) -> PrefillMode {
        PrefillMode::FullContext
    }

    fn prefill(&mut self, _prompt: &[u32], ctx: &mut DraftContext<'_>) -> Result<()> {
        self.caches = self.model.make_cache();
        self.history.clear();
        self.pending = None;
        let anchor = self.after_restored(ctx.anchor)?;
        let rows = ops::concatenate(&anchor.iter().collect::<Vec<_>>(), -1)?;
        self.push_context(rows)
    }

    fn prefix(&self, context: &[Array]) -> Result<Option<DraftPrefix>> {
        Ok(Some(DraftPrefix::Taps(self.after_restored(context)?)))
    }

    fn context_rows(&self) -> usize {
        self.restored.first().map_or(0, |t| t.dim(1) as usize)
    }

    fn draft(&mut self, n: usize, ctx: &mut DraftContext<'_>) -> Result<Vec<u32>> {
        // The executor's limit is the block ceiling (mlx-vlm's draft_block_size) cut by the
        // budget: the verify input is the last token and the drafts.
        let bs = next_block_size(&self.history, n + 1);
        if bs <= 1 {
            return Ok(Vec::new());
        }
        let context = self.pending.take().ok_or_else(|| {
            crate::error::contract("a DFlash round started with no target rows to draft from")
        })?;
        let mut block = vec![self.model.mask_token_id; bs];
        block[0] = ctx.last;
        if self.chain {
            return self.chain_drafts(block, &context, ctx);
        }
        let logits = self.pass(&block, &context)?;
        if !ctx.needs_draft_ids() {
            let drafts = ctx
                .sample_at_positions(&logits, &[])?
                .astype(Dtype::Uint32)?;
            return Ok(drafts.to_vec::<u32>()?);
        }
        let mut drafts = Vec::with_capacity(bs - 1);
        for i in 0..bs as i32 - 1 {
            let row = logits.slice_axis(0, i, i + 1)?;
            let token = ctx
                .sample_at_positions(&row, &drafts)?
                .astype(Dtype::Uint32)?;
            drafts.push(token.item::<u32>()?);
        }
        Ok(drafts)
    }

    fn commit(&mut self, round: &Verified<'_>) -> Result<()> {
        self.history.push((round.accepted, round.drafted));
        let rows = ops::concatenate(&round.hidden.iter().collect::<Vec<_>>(), -1)?;
        let keep = (round.accepted + 1).min(rows.dim(1) as usize);
        self.push_context(rows.slice_axis(1, 0, keep as i32)?)
    }
}

#[cfg(test)]
mod tests {
    use super::next_block_size;

    #[test]
    fn the_policy_starts_at_the_ceiling_and_follows_acceptance() {
        assert_eq!(next_block_size(&[], 8), 8);
        assert_eq!(next_block_size(&[(7, 7)], 1), 1);
        // Poor acceptance halves a block of 8 or more, then steps down by 2 to the floor of 4.
        assert_eq!(next_block_size(&[(0, 7)], 8), 4);
        assert_eq!(next_block_size(&[(0, 9)], 16), 5);
        assert_eq!(next_block_size(&[(1, 5)], 16), 4);
        // Middling acceptance (mean >= 2, rate in [0.3, 0.5)) steps down by 2.
        assert_eq!(next_block_size(&[(3, 7)], 8), 6);
        // Strong acceptance with full hits grows by 2 up to the ceiling.
        assert_eq!(next_block_size(&[(5, 5)], 16), 8);
        assert_eq!(next_block_size(&[(7, 7)], 8), 8);
        // Good but not full: the block stays.
        assert_eq!(next_block_size(&[(4, 5), (3, 5)], 16), 6);
        // Rounds without drafts do not count; only the last eight rounds do.
        assert_eq!(next_block_size(&[(0, 0)], 8), 8);
        let mut history = vec![(0, 7); 8];
        history.extend([(7, 7); 8]);
        assert_eq!(next_block_size(&history, 16), 10);
    }
}
