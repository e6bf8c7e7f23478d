//! Qwen3.5's MTP head as a draft source, with the bookkeeping of mlx-vlm's Qwen3_5MTPDraftModel
//! (mlx_vlm/speculative/drafters/qwen3_5_mtp/qwen3_5_mtp.py). It taps the target's final
//! post-norm hidden state and runs in `PrefillMode::Full`:
//!
//! - prefill (`prefill_from_target_hidden`, 222-245): one head pass over (first token, the
//!   last prompt row's hidden) at position 0; its output is the seed. mlx-vlm prefills the
//!   target in chunks, so only the last prompt row reaches the drafter, as here.
//! - draft (`draft_block`, 396-439): the first draft is picked from the seed (no head pass),
//!   each further one from a head pass over (previous draft, previous head output); mlx-vlm's
//!   block size is the drafts plus one.
//! - commit (`accept_verified_tokens`, 247-283): of the entries drafting appended, the first
//!   `min(accepted, appended)` stay (with their head-chained hidden states) and the rest are
//!   trimmed through the rollback contract; then one pass appends the accepted drafts not yet
//!   in the cache and the target's own token, each paired with the target's verified hidden row
//!   it follows (all accepted: the last draft and the bonus token). Its last output is the new
//!   seed.
//!
//! The row convention is predict-2-ahead: an entry (t_{i+1}, h_i) pairs a token with the hidden
//! state it was sampled from, and the head's output there predicts t_{i+2}. Draft tokens are
//! picked as the target would sample (`DraftContext::sample`; greedy is the output head's
//! argmax, as mlx-vlm's), lazily when a round starts, which keeps the random draws in
//! mlx-vlm's order.

use mlx::{Array, Dtype};

use super::{DraftContext, DraftSource, PrefillMode, Verified};
use crate::cache::{begin_round, end_round, rollback_plan, LayerCache, Rollback};
use crate::generate::token_array;
use crate::model::lone_rows;
use crate::model::mtp::MtpHead;
use crate::model::LanguageModel;
use crate::{validate, Error, Result};

pub struct MtpDrafter<'m> {
    target: &'m dyn LanguageModel,
    head: &'m dyn MtpHead,
    caches: Vec<LayerCache>,
    /// The head's last output (1, 1, H), from which the next round's first draft is picked.
    seed: Option<Array>,
    /// This round's drafts and how many entries drafting appended to the caches.
    round: Option<(Vec<u32>, usize)>,
}

impl<'m> MtpDrafter<'m> {
    /// The target's own MTP head as a drafter, after checking the pair (crate::validate::mtp).
    pub fn new(target: &'m dyn LanguageModel) -> Result<MtpDrafter<'m>> {
        Ok(Self::with_head(target, validate::mtp(target)?))
    }

    /// `head` drafting for `target`, a pair already checked: a split folder's head
    /// (crate::validate::mtp_folder) or the target's own.
    pub fn with_head(target: &'m dyn LanguageModel, head: &'m dyn MtpHead) -> MtpDrafter<'m> {
        MtpDrafter {
            target,
            head,
            caches: head.make_cache(),
            seed: None,
            round: None,
        }
    }

    /// The head's KV caches (for the rollback properties).
    pub fn caches(&self) -> &[LayerCache] {
        &self.caches
    }

    /// One head pass over `tokens` and the hidden rows (1, L, H) they follow; returns the
    /// output's last row (1, 1, H).
    fn step(&mut self, tokens: &[u32], hidden: &Array) -> Result<Array> {
        let ids = token_array(tokens)?.expand_dims(&[0])?;
        let embedded = self.target.outer().embed_tokens.forward(&ids)?;
        let out = self.head.forward(&embedded, hidden, &mut self.caches)?;
        let l = out.dim(1);
        Ok(out.slice_axis(1, l - 1, l)?)
    }

    /// The token the target would sample from the head state `h` (1, 1, H) after `drafted`.
    fn pick(&self, h: &Array, drafted: &[u32], ctx: &mut DraftContext<'_>) -> Result<u32> {
        let logits = self.target.outer().logits(&h.squeeze(&[1])?)?;
        Ok(ctx
            .sample(&logits, drafted)?
            .astype(Dtype::Uint32)?
            .item::<u32>()?)
    }

    /// The final-state tap: the only one this source reads.
    fn tapped<'a>(&self, rows: &'a [Array]) -> Result<&'a Array> {
        rows.first().ok_or_else(|| {
            crate::error::contract("the MTP drafter got no hidden rows from the target")
        })
    }
}

impl DraftSource for MtpDrafter<'_> {
    fn taps(&self) -> Vec<usize> {
        vec![self.target.num_layers()]
    }

    fn prefill_mode(&self) -> PrefillMode {
        PrefillMode::Full
    }

    fn prefill(&mut self, _prompt: &[u32], ctx: &mut DraftContext<'_>) -> Result<()> {
        let hidden = self.tapped(ctx.anchor)?.clone();
        self.caches = self.head.make_cache();
        self.seed = Some(self.step(&[ctx.last], &hidden)?);
        Ok(())
    }

    fn draft(&mut self, n: usize, ctx: &mut DraftContext<'_>) -> Result<Vec<u32>> {
        if n == 0
            || matches!(
                rollback_plan(&self.caches, n, lone_rows::exact_decode()),
                Rollback::Refuse(_)
            )
        {
            return Ok(Vec::new());
        }
        begin_round(&mut self.caches);
        let mut drafts = Vec::with_capacity(n);
        // mlx-vlm drafts from (last token, anchor row) when it holds no seed.
        let (mut token, mut h) = match self.seed.take() {
            Some(seed) => {
                let token = self.pick(&seed, &drafts, ctx)?;
                drafts.push(token);
                (token, seed)
            }
            None => (ctx.last, self.tapped(ctx.anchor)?.clone()),
        };
        let mut appended = 0;
        while drafts.len() < n {
            h = self.step(&[token], &h)?;
            appended += 1;
            token = self.pick(&h, &drafts, ctx)?;
            drafts.push(token);
        }
        self.round = Some((drafts.clone(), appended));
        Ok(drafts)
    }

    fn commit(&mut self, round: &Verified<'_>) -> Result<()> {
        let keep = match self.round.take() {
            Some((drafts, appended)) => {
                let keep = round.accepted.min(appended);
                end_round(&mut self.caches, appended - keep)?;
                drafts[keep..round.accepted].to_vec()
            }
            None => Vec::new(),
        };
        self.replay(keep, round)
    }
}

impl MtpDrafter<'_> {
    /// Appends `tokens` (the accepted drafts drafting did not append) and the target's token,
    /// each paired with the verified row it follows; the last output becomes the seed.
    fn replay(&mut self, mut tokens: Vec<u32>, round: &Verified<'_>) -> Result<()> {
        let first = round.accepted - tokens.len();
        tokens.extend(round.next);
        if tokens.is_empty() {
            return Ok(());
        }
        let rows = self.tapped(round.hidden)?;
        let end = first + tokens.len();
        if end > rows.dim(1) as usize {
            return Err(Error::Contract(format!(
                "{} verified rows for MTP entries up to row {end}",
                rows.dim(1)
            )));
        }
        let hidden = rows.slice_axis(1, first as i32, end as i32)?;
        self.seed = Some(self.step(&tokens, &hidden)?);
        Ok(())
    }
}
