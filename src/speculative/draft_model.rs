//! A smaller model as the draft source, with mlx-lm's draft bookkeeping: the draft model is
//! prefilled with the prompt minus its last token, drafts with the request's sampler, and after
//! a round keeps what it fed up to the accepted drafts; when every draft was accepted, the last
//! one (sampled but never fed) is fed next round together with the target's bonus token.
//!
//! In a batch, the rows that draft with the same model draft together ([`draft_together`]):
//! each draft step is one packed forward over every row's next token, instead of one forward
//! per row, which on a GPU is what a draft step costs.

use mlx::{Array, Dtype};

use super::{DraftContext, DraftPrefix, DraftSource, Verified};
use crate::cache::{
    begin_round, end_round, plan_step, quantize_due, rollback_plan, LayerCache, Rollback,
};
use crate::generate::{forward_tokens, last_logits, prefill, token_array};
use crate::model::{lone_rows, Forward, LanguageModel};
use crate::sample::argmax_rows;
use crate::{Error, Result};

pub struct DraftModel<'m> {
    model: &'m dyn LanguageModel,
    caches: Vec<LayerCache>,
    /// Prompt tokens the caches already hold (from a prefix cache).
    cached: usize,
    /// Tokens the draft model has not been fed yet.
    pending: Vec<u32>,
    /// This round's drafts and how many tokens were fed to the draft model for them.
    round: Option<(Vec<u32>, usize)>,
    /// The tokens the last commit took back from the caches.
    taken_back: usize,
    /// The last of the tokens a batch fed ahead of the round's verdict, which the caches hold
    /// and whose next draft waits on the device ([`SteppedDraft::fed_ahead`]).
    ahead: Option<u32>,
}

impl<'m> DraftModel<'m> {
    pub fn new(model: &'m dyn LanguageModel) -> DraftModel<'m> {
        Self::resume(model, model.make_cache(None), 0)
    }

    /// A draft model whose `caches` already hold the first `cached` prompt tokens (a prefix
    /// cache's copy, stored together with the target's): its prefill feeds only the rest.
    pub fn resume(
        model: &'m dyn LanguageModel,
        caches: Vec<LayerCache>,
        cached: usize,
    ) -> DraftModel<'m> {
        DraftModel {
            model,
            caches,
            cached,
            pending: Vec::new(),
            round: None,
            taken_back: 0,
            ahead: None,
        }
    }

    /// The model's next-token logits (1, V) after feeding the 1-D token ids `tokens`, as a
    /// decode forward ([`lone_rows::decode_rows`]) as [`draft_together`] runs it: on a GPU a
    /// round's pending tokens (the last draft and the bonus token) then get the kernels they get
    /// beside other rows, so a row drafts alone what it drafts in a batch.
    fn step(&mut self, tokens: &Array, ctx: &DraftContext<'_>) -> Result<Array> {
        let kv = ctx.params.kv_quantization.as_ref();
        let logits =
            lone_rows::decode_rows(|| forward_tokens(self.model, &mut self.caches, tokens, kv))?;
        Ok(last_logits(&logits)?)
    }
}

/// A draft model's round as whoever steps the model opens and closes it ([`draft_together`],
/// or [`DraftSource::draft`] alone). A trait, so that a batch reaches a row's draft model
/// through its `dyn DraftSource` ([`DraftSource::stepped`]).
pub trait SteppedDraft {
    /// Opens a round of `n` drafts on the draft caches: the tokens to feed first (those still
    /// pending), or None when the round drafts nothing (`n` is 0, or the caches could not take
    /// the round back).
    fn open_round(&mut self, n: usize) -> Option<Vec<u32>>;

    /// The draft model's caches, which each draft step updates (empty while a batch holds them
    /// in a buffer shared with other rows).
    fn caches_mut(&mut self) -> &mut Vec<LayerCache>;

    /// The drafts of the round `open_round` opened.
    fn close_round(&mut self, drafts: &[u32]);

    /// How many tokens the last round's commit took back from the caches: a batch holding them
    /// in a shared buffer takes them back there.
    fn taken_back(&self) -> usize;

    /// After a round of one draft is committed: a batch fed the caches `fed` (the target's
    /// greedy tokens at the round's two positions) before the verdict was read, and holds the
    /// draft that follows the kept ones (`batch::draft_ahead`). The tokens still to be fed
    /// are a prefix of `fed`, so the caches hold them now; returns how many of `fed` follow
    /// them, which the batch takes back.
    fn fed_ahead(&mut self, fed: &[u32]) -> Result<usize>;

    /// Whether the caches hold tokens fed ahead whose draft the next round takes as its own
    /// (then the round feeds nothing first); they are the batch's from here.
    fn take_ahead(&mut self) -> bool;

    /// Whether the caches hold tokens fed ahead whose draft is dropped: the last of them is
    /// pending again, and the caller takes it back from the caches.
    fn drop_ahead(&mut self) -> bool;
}

impl SteppedDraft for DraftModel<'_> {
    fn open_round(&mut self, n: usize) -> Option<Vec<u32>> {
        let fed = self.pending.len() + n.saturating_sub(1);
        if n == 0
            || matches!(
                rollback_plan(&self.caches, fed, lone_rows::exact_decode()),
                Rollback::Refuse(_)
            )
        {
            return None;
        }
        begin_round(&mut self.caches);
        self.round = Some((Vec::new(), fed));
        Some(std::mem::take(&mut self.pending))
    }

    fn caches_mut(&mut self) -> &mut Vec<LayerCache> {
        &mut self.caches
    }

    fn close_round(&mut self, drafts: &[u32]) {
        if let Some((kept, _)) = &mut self.round {
            kept.extend_from_slice(drafts);
        }
    }

    fn taken_back(&self) -> usize {
        self.taken_back
    }

    fn fed_ahead(&mut self, fed: &[u32]) -> Result<usize> {
        let kept = self.pending.len();
        if kept == 0 || !fed.starts_with(&self.pending) || self.ahead.is_some() {
            return Err(Error::Contract(format!(
                "tokens {fed:?} fed ahead do not start with the pending {:?}",
                self.pending
            )));
        }
        self.ahead = self.pending.pop();
        self.pending.clear();
        Ok(fed.len() - kept)
    }

    fn take_ahead(&mut self) -> bool {
        self.ahead.take().is_some()
    }

    fn drop_ahead(&mut self) -> bool {
        let Some(last) = self.ahead.take() else {
            return false;
        };
        self.pending = vec![last];
        true
    }
}

/// Draft caches that a batch holds for several rows in one buffer per layer
/// ([`crate::cache::BatchKvCache`]): the rows drafting together are rows `rows[r]` of it, in
/// ascending order, of its `len` rows.
pub struct SharedDraftCaches<'a> {
    pub caches: &'a mut [LayerCache],
    pub rows: Vec<usize>,
    pub len: usize,
}

/// Drafts for several requests that draft with the same `model`, each row `(source, its
/// context, drafts wanted)`: one packed forward per draft step over the rows still drafting
/// (crate::model::rows, the lone-row kernels on a GPU), each row sampling its draft from its
/// own logits with its own sampler (the greedy rows without processors together,
/// [`argmax_rows`]); over the rows' own caches, or over `shared` ones (the other rows there
/// take no token). Wherever the packed forward gives each row its lone bits (the CPU), every
/// row drafts what it drafts alone. The host waits once per round, for every row's drafts,
/// unless a row's processors read its drafts as they come.
pub fn draft_together(
    model: &dyn LanguageModel,
    rows: &mut [(&mut dyn SteppedDraft, DraftContext<'_>, usize)],
    shared: Option<SharedDraftCaches<'_>>,
) -> Result<Vec<Vec<u32>>> {
    let unread = draft_unread(model, rows, shared)?;
    let drafts = unread.read()?;
    for ((source, _, _), drafts) in rows.iter_mut().zip(&drafts) {
        source.close_round(drafts);
    }
    Ok(drafts)
}

/// The drafts of rows that drafted together, still on the device: each draft step's sampled
/// tokens with the rows it holds. A batch feeds them to its verify forward as they are, so that
/// the host builds the verify while the device drafts and waits once a round, for the drafts
/// and the verdict together; it then closes each row's round with its drafts as read.
pub struct UnreadDrafts {
    /// Every step's tokens (uint32), in order.
    steps: Vec<Array>,
    /// Where each row's drafts sit in [`UnreadDrafts::tokens`], in order.
    positions: Vec<Vec<usize>>,
}

impl UnreadDrafts {
    /// One draft for each of `tokens`' (R,) rows ([`draft_ahead`]'s).
    pub fn one_each(tokens: Array) -> UnreadDrafts {
        let rows = tokens.dim(0) as usize;
        UnreadDrafts::new(vec![((0..rows).collect(), tokens)], rows)
    }

    /// The drafts of `rows` rows from each step's tokens with the rows they hold.
    fn new(steps: Vec<(Vec<usize>, Array)>, rows: usize) -> UnreadDrafts {
        let mut positions = vec![Vec::new(); rows];
        let mut at = 0;
        for (held, _) in &steps {
            for (i, &r) in held.iter().enumerate() {
                positions[r].push(at + i);
            }
            at += held.len();
        }
        let steps = steps.into_iter().map(|(_, tokens)| tokens).collect();
        UnreadDrafts { steps, positions }
    }

    /// Every draft, step after step, in one (T,) uint32 array; None when no row drafted.
    pub fn tokens(&self) -> Result<Option<Array>> {
        let tokens: Vec<&Array> = self.steps.iter().collect();
        Ok(match tokens[..] {
            [] => None,
            [one] => Some(one.clone()),
            _ => Some(mlx::ops::concatenate(&tokens, 0)?),
        })
    }

    /// Where row `r`'s drafts sit in [`UnreadDrafts::tokens`], in order.
    pub fn positions(&self, r: usize) -> &[usize] {
        &self.positions[r]
    }

    /// Each row's drafts, given [`UnreadDrafts::tokens`] as read back.
    pub fn split(&self, tokens: &[u32]) -> Vec<Vec<u32>> {
        (self.positions.iter())
            .map(|at| at.iter().map(|&i| tokens[i]).collect())
            .collect()
    }

    /// Each row's drafts, waiting for the device.
    fn read(&self) -> Result<Vec<Vec<u32>>> {
        let tokens = match self.tokens()? {
            Some(t) => t.to_vec::<u32>()?,
            None => Vec::new(),
        };
        Ok(self.split(&tokens))
    }
}

/// The next draft of each row of `shared` (R rows, every one drafting by argmax after its row
/// of `biases(vocab, dtype)`), fed ahead of its round's verdict: `fed` (1, 2R) holds each row's two
/// verified positions' greedy tokens, which the draft caches take as a decode forward (the
/// lone-row kernels on a GPU, as a round's pending tokens get them); where row r's draft was
/// `accepted` (R,) its next draft follows the second token, else the first, whose successor
/// its caller takes back once the verdict is read. Nothing here waits for the device.
pub fn draft_ahead(
    model: &dyn LanguageModel,
    shared: &mut [LayerCache],
    fed: &Array,
    accepted: &Array,
    biases: &dyn Fn(i32, Dtype) -> Result<Vec<Option<Array>>>,
) -> Result<Array> {
    let rows = accepted.dim(0);
    let lens = vec![2; rows as usize];
    plan_step(shared, &lens)?;
    let logits = lone_rows::decode_rows(|| model.forward_rows(fed, &mut [shared], &lens, &[]))?
        .logits
        .squeeze(&[0])?;
    let at: Vec<i32> = (0..2 * rows).collect();
    let biases: Vec<Option<Array>> = (biases(logits.dim(1), logits.dtype())?.into_iter())
        .flat_map(|b| [b.clone(), b])
        .collect();
    let (tokens, _) = argmax_rows(&logits, &at, &biases)?;
    let firsts: Vec<i32> = (0..rows).map(|r| 2 * r).collect();
    let picked = Array::from_slice(&firsts, &[rows])?.add(&accepted.astype(Dtype::Int32)?)?;
    Ok(tokens.take(&picked, 0)?)
}

/// [`draft_together`]'s draft steps, enqueued and not read: the rows' rounds stay open until
/// their drafts are read and closed ([`SteppedDraft::close_round`]).
pub fn draft_unread(
    model: &dyn LanguageModel,
    rows: &mut [(&mut dyn SteppedDraft, DraftContext<'_>, usize)],
    mut shared: Option<SharedDraftCaches<'_>>,
) -> Result<UnreadDrafts> {
    // Each row's next input: its pending tokens first, then its last draft.
    let mut next: Vec<Option<Next>> = rows
        .iter_mut()
        .map(|(source, _, n)| {
            let pending = source.open_round(*n)?;
            Some(token_array(&pending).map(Next::Own))
        })
        .map(Option::transpose)
        .collect::<mlx::Result<_>>()?;
    catch_up(model, rows, &mut next, shared.as_mut())?;
    // The last step's tokens of the rows sampled together, which their `Next::Together` index.
    let mut together: Option<Array> = None;
    // Every step's sampled tokens (uint32), each with the rows it holds, in order.
    let mut steps: Vec<(Vec<usize>, Array)> = Vec::new();
    let mut drafted = vec![0; rows.len()];
    let mut read: Vec<Vec<u32>> = vec![Vec::new(); rows.len()];
    loop {
        let live: Vec<usize> = (0..rows.len())
            .filter(|&r| next[r].is_some() && drafted[r] < rows[r].2)
            .collect();
        if live.is_empty() {
            break;
        }
        let (ids, lens) = inputs(&live, &next, together.as_ref())?;
        let logits = lone_rows::decode_rows(|| {
            forward_picked(model, rows, shared.as_mut(), &live, &lens, &ids)
        })?
        .logits
        .squeeze(&[0])?;
        let mut ends = Vec::with_capacity(live.len());
        let mut end = 0;
        for (&r, &len) in live.iter().zip(&lens) {
            end += len as i32;
            ends.push(end - 1);
            let (source, ctx, _) = &mut rows[r];
            quantize_due(source.caches_mut(), ctx.params.kv_quantization.as_ref())?;
            drafted[r] += 1;
        }
        let (by_argmax, alone): (Vec<usize>, Vec<usize>) =
            (0..live.len()).partition(|&i| rows[live[i]].1.samples_by_argmax());
        let first = steps.len();
        together = None;
        if !by_argmax.is_empty() {
            let at: Vec<i32> = by_argmax.iter().map(|&i| ends[i]).collect();
            let (vocab, dtype) = (logits.dim(1), logits.dtype());
            let biases = (by_argmax.iter())
                .map(|&i| rows[live[i]].1.argmax_bias(vocab, dtype))
                .collect::<Result<Vec<_>>>()?;
            let (tokens, _) = argmax_rows(&logits, &at, &biases)?;
            for (j, &i) in by_argmax.iter().enumerate() {
                next[live[i]] = Some(Next::Together(j));
            }
            steps.push((by_argmax.iter().map(|&i| live[i]).collect(), tokens.clone()));
            together = Some(tokens);
        }
        for i in alone {
            let r = live[i];
            let last = logits.slice_axis(0, ends[i], ends[i] + 1)?;
            let token = rows[r].1.sample(&last, &read[r])?;
            next[r] = Some(Next::Own(token.clone()));
            steps.push((vec![r], token.astype(Dtype::Uint32)?));
        }
        let step: Vec<&Array> = steps[first..].iter().map(|(_, t)| t).collect();
        // The rows whose processors read the drafts read theirs after one wait for all.
        if live.iter().any(|&r| rows[r].1.needs_draft_ids()) {
            mlx::eval(step)?;
            for (held, token) in &steps[first..] {
                if let [r] = held[..] {
                    if rows[r].1.needs_draft_ids() {
                        read[r].push(token.item::<u32>()?);
                    }
                }
            }
        } else {
            mlx::async_eval(step)?;
        }
    }
    Ok(UnreadDrafts::new(steps, rows.len()))
}

/// Pending tokens from which a greedy row's draft caches catch up before its round. A round
/// leaves at most two (the last draft and the target's bonus token); more pile up only while
/// a row's rounds draft nothing (`--adaptive-drafts` choosing plain steps, a cache that could
/// not take a round back).
const CATCH_UP_FROM: i32 = 3;

/// Feeds all but the last of the pending tokens of each row that has [`CATCH_UP_FROM`] or more
/// and drafts by argmax over plain KV caches, in one packed forward with MLX's own kernels
/// (its logits are never read, so never computed): the lone-row kernels would give each of
/// those tokens a one-token step's kernels, hundreds of them after a long stretch of plain
/// steps. Those rows' drafts then may differ from the drafts a one-token catch-up would give,
/// which only their acceptance sees: a greedy row emits the same tokens whatever it drafts.
fn catch_up(
    model: &dyn LanguageModel,
    rows: &mut [(&mut dyn SteppedDraft, DraftContext<'_>, usize)],
    next: &mut [Option<Next>],
    shared: Option<&mut SharedDraftCaches<'_>>,
) -> Result<()> {
    let mut behind = Vec::new();
    for (r, (source, ctx, _)) in rows.iter_mut().enumerate() {
        let Some(Next::Own(tokens)) = &mut next[r] else {
            continue;
        };
        let len = tokens.dim(0);
        let plain_kv = (source.caches_mut().iter()).all(|c| matches!(c, LayerCache::Kv(_)));
        if len < CATCH_UP_FROM || !ctx.samples_by_argmax() || !(shared.is_some() || plain_kv) {
            continue;
        }
        behind.push((r, tokens.slice_axis(0, 0, len - 1)?));
        *tokens = tokens.slice_axis(0, len - 1, len)?;
    }
    if behind.is_empty() {
        return Ok(());
    }
    let lens: Vec<usize> = behind.iter().map(|(_, t)| t.dim(0) as usize).collect();
    let heads: Vec<Array> = (behind.iter())
        .map(|(_, t)| t.astype(Dtype::Int32))
        .collect::<mlx::Result<_>>()?;
    let ids = mlx::ops::concatenate(&heads.iter().collect::<Vec<_>>(), 0)?.expand_dims(&[0])?;
    let picked: Vec<usize> = behind.iter().map(|(r, _)| *r).collect();
    lone_rows::oracle_kernels(|| forward_picked(model, rows, shared, &picked, &lens, &ids))?;
    for &r in &picked {
        let (source, ctx, _) = &mut rows[r];
        quantize_due(source.caches_mut(), ctx.params.kv_quantization.as_ref())?;
    }
    Ok(())
}

/// One packed forward of `ids` (1, T) over the rows `picked` (ascending), row `picked[i]`
/// taking `lens[i]` tokens: over `shared` caches (the other rows there take none) or over the
/// picked rows' own.
fn forward_picked(
    model: &dyn LanguageModel,
    rows: &mut [(&mut dyn SteppedDraft, DraftContext<'_>, usize)],
    shared: Option<&mut SharedDraftCaches<'_>>,
    picked: &[usize],
    lens: &[usize],
    ids: &Array,
) -> Result<Forward> {
    match shared {
        Some(shared) => {
            let mut all = vec![0; shared.len];
            for (&r, &len) in picked.iter().zip(lens) {
                all[shared.rows[r]] = len;
            }
            plan_step(shared.caches, &all)?;
            model.forward_rows(ids, &mut [&mut shared.caches[..]], &all, &[])
        }
        None => {
            let mut caches: Vec<&mut [LayerCache]> = (rows.iter_mut().enumerate())
                .filter(|(r, _)| picked.contains(r))
                .map(|(_, (source, _, _))| &mut source.caches_mut()[..])
                .collect();
            model.forward_rows(ids, &mut caches, lens, &[])
        }
    }
}

/// A drafting row's next input.
enum Next {
    /// Its own tokens (1-D).
    Own(Array),
    /// Token `j` of the rows sampled together last step.
    Together(usize),
}

/// The packed (1, T) input of the `live` rows and each one's token count: the tokens sampled
/// together last step as they are when those rows alone, in order, are live.
fn inputs(
    live: &[usize],
    next: &[Option<Next>],
    together: Option<&Array>,
) -> Result<(Array, Vec<usize>)> {
    let fed = |r: usize| next[r].as_ref().expect("a live row has an input");
    let whole = together.filter(|t| {
        t.dim(0) as usize == live.len()
            && live
                .iter()
                .enumerate()
                .all(|(j, &r)| matches!(fed(r), Next::Together(i) if *i == j))
    });
    if let Some(tokens) = whole {
        let ids = tokens.astype(Dtype::Int32)?.expand_dims(&[0])?;
        return Ok((ids, vec![1; live.len()]));
    }
    let fed: Vec<Array> = live
        .iter()
        .map(|&r| match fed(r) {
            Next::Own(tokens) => tokens.astype(Dtype::Int32),
            Next::Together(j) => {
                let tokens = together.expect("rows sampled together last step");
                tokens
                    .slice_axis(0, *j as i32, *j as i32 + 1)?
                    .astype(Dtype::Int32)
            }
        })
        .collect::<mlx::Result<_>>()?;
    let lens = fed.iter().map(|a| a.dim(0) as usize).collect();
    let ids = mlx::ops::concatenate(&fed.iter().collect::<Vec<_>>(), 0)?.expand_dims(&[0])?;
    Ok((ids, lens))
}

impl DraftSource for DraftModel<'_> {
    fn prefill(&mut self, prompt: &[u32], ctx: &mut DraftContext<'_>) -> Result<()> {
        let (last, head) = prompt
            .split_last()
            .ok_or_else(|| Error::Params("the prompt is empty".into()))?;
        let rest = head.get(self.cached..).ok_or_else(|| {
            Error::Contract(format!(
                "the draft caches hold {} tokens, more than the prompt's {}",
                self.cached,
                head.len()
            ))
        })?;
        prefill(
            self.model,
            &mut self.caches,
            &token_array(rest)?,
            ctx.params,
            |_| Ok(()),
        )?;
        self.pending = vec![*last];
        Ok(())
    }

    fn draft(&mut self, n: usize, ctx: &mut DraftContext<'_>) -> Result<Vec<u32>> {
        let Some(pending) = self.open_round(n) else {
            return Ok(Vec::new());
        };
        let mut input = token_array(&pending)?;
        let mut drafts = Vec::with_capacity(n);
        if ctx.needs_draft_ids() {
            for _ in 0..n {
                let logits = self.step(&input, ctx)?;
                let token = ctx.sample(&logits, &drafts)?;
                let token = token.astype(Dtype::Uint32)?.item::<u32>()?;
                drafts.push(token);
                input = token_array(&[token])?;
            }
        } else {
            // As mlx-lm's _draft_generate: each sampled draft is fed back as an array and
            // enqueued at once, so the round waits for the host only once, for all of them.
            let mut sampled = Vec::with_capacity(n);
            for _ in 0..n {
                let logits = self.step(&input, ctx)?;
                input = ctx.sample(&logits, &[])?;
                mlx::async_eval([&input])?;
                sampled.push(input.clone());
            }
            let sampled: Vec<&Array> = sampled.iter().collect();
            drafts = mlx::ops::concatenate(&sampled, 0)?
                .astype(Dtype::Uint32)?
                .to_vec::<u32>()?;
        }
        self.close_round(&drafts);
        Ok(drafts)
    }

    fn commit(&mut self, round: &Verified<'_>) -> Result<()> {
        let (drafted, accepted, next) = (round.drafted, round.accepted, round.next);
        self.taken_back = 0;
        let Some((drafts, fed)) = self.round.take() else {
            // Nothing drafted this round: the target's token joins what is still to be fed.
            self.pending.extend(next);
            return Ok(());
        };
        debug_assert_eq!(drafts.len(), drafted);
        // Fed: the pending tokens and drafts 1..n-1. Keep the pending ones and the accepted drafts.
        let kept_drafts = accepted.min(drafted - 1);
        let pending_fed = fed - (drafted - 1);
        self.taken_back = fed - pending_fed - kept_drafts;
        end_round(&mut self.caches, self.taken_back)?;
        self.pending = if accepted == drafted {
            vec![drafts[drafted - 1]]
        } else {
            Vec::new()
        };
        self.pending.extend(next);
        Ok(())
    }

    fn draft_model(&self) -> Option<&dyn LanguageModel> {
        Some(self.model)
    }

    fn stepped(&mut self) -> Option<&mut dyn SteppedDraft> {
        Some(self)
    }

    fn prefix(&self, _context: &[Array]) -> Result<Option<DraftPrefix>> {
        Ok(Some(DraftPrefix::Caches(self.caches.clone())))
    }
}
