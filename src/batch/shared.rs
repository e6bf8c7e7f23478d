//! The batch's shared caches: while its rows' caches are plain KV caches, one buffer per layer
//! holds every row's ([`BatchKvCache`]), and the draft caches of the rows that draft with one
//! draft model one buffer per layer of that model. Rows join between steps and take their
//! caches back out when they leave or when the rows can no longer share.

use std::ptr;

use mlx::Dtype;

use super::{Batch, Decoder, Row};
use crate::bundle::ModelBundle;
use crate::cache::{eval_state, first_batch, BatchKvCache, KvCache, LayerCache, RecurrentCache};
use crate::{error::contract, Result};

/// The rows that draft with one draft model, their draft caches in one buffer per layer.
pub(super) struct DraftGroup<'m> {
    pub(super) model: &'m ModelBundle,
    /// The rows' ids, in the buffer's row order (the batch's row order).
    pub(super) ids: Vec<usize>,
    pub(super) caches: Vec<LayerCache>,
}

impl DraftGroup<'_> {
    /// Row `id`'s row in the buffers.
    pub(super) fn row_of(&self, id: usize) -> Option<usize> {
        self.ids.iter().position(|&i| i == id)
    }

    /// The tokens row `r`'s draft caches hold.
    pub(super) fn offset(&self, r: usize) -> usize {
        offsets(&self.caches)[r]
    }
}

/// Whether every cache of `caches` is a filled plain KV cache, or, where `recurrent` allows,
/// a recurrent cache holding a state.
fn filled(caches: &[LayerCache], recurrent: bool) -> bool {
    caches.iter().all(|c| match c {
        LayerCache::Kv(kv) => kv.kv.is_some(),
        LayerCache::Recurrent(r) => recurrent && r.current().is_some(),
        _ => false,
    })
}

/// A row's offset: its first KV layer's (a recurrent layer's count of tokens is not kept by a
/// prompt cache file).
fn kv_offset(caches: &[LayerCache]) -> usize {
    (caches.iter())
        .find(|c| matches!(c, LayerCache::Kv(_)))
        .map_or(0, LayerCache::offset)
}

/// One buffer per attention layer and the rows' recurrent caches side by side per recurrent
/// layer, holding `rows`' caches in order.
fn gather(rows: &[Vec<LayerCache>]) -> Result<Vec<LayerCache>> {
    let layers = rows.first().map_or(0, Vec::len);
    (0..layers)
        .map(|l| match rows.first().map(|c| &c[l]) {
            Some(LayerCache::Recurrent(_)) => {
                let own = rows.iter().map(|c| recurrent(&c[l]).cloned());
                Ok(LayerCache::RecurrentRows(own.collect::<Result<_>>()?))
            }
            _ => {
                let own = rows.iter().map(|c| plain_kv(&c[l]));
                Ok(LayerCache::Batch(BatchKvCache::gather(
                    &own.collect::<Result<Vec<_>>>()?,
                )?))
            }
        })
        .collect()
}

/// A row's cache of one layer as the plain KV cache a shared buffer takes in.
fn plain_kv(c: &LayerCache) -> Result<&KvCache> {
    match c {
        LayerCache::Kv(kv) => Ok(kv),
        _ => Err(contract(
            "a row joins shared caches with a cache other than plain KV where its rows' are",
        )),
    }
}

/// A row's cache of one layer as the recurrent cache shared caches keep beside the others'.
fn recurrent(c: &LayerCache) -> Result<&RecurrentCache> {
    match c {
        LayerCache::Recurrent(r) => Ok(r),
        _ => Err(contract(
            "a row joins shared caches with a cache other than recurrent where its rows' are",
        )),
    }
}

/// `shared`'s batch cache of every attention layer.
fn batch_caches(shared: &mut [LayerCache]) -> impl Iterator<Item = &mut BatchKvCache> {
    shared.iter_mut().filter_map(|layer| match layer {
        LayerCache::Batch(b) => Some(b),
        _ => None,
    })
}

/// Row `row`'s own caches, taken back out of `shared`, evaluated now so that the copies hold
/// none of the shared buffers the next step writes in place.
fn leave(shared: &mut [LayerCache], row: usize) -> Result<Vec<LayerCache>> {
    let caches = (shared.iter_mut())
        .map(|layer| match layer {
            LayerCache::Batch(b) => Ok(LayerCache::Kv(b.leave(row)?)),
            LayerCache::RecurrentRows(rows) => Ok(LayerCache::Recurrent(rows.remove(row))),
            _ => Err(contract("shared caches hold batch caches only")),
        })
        .collect::<Result<Vec<_>>>()?;
    eval_state(&caches)?;
    Ok(caches)
}

/// Adds `row`'s caches to `shared` as its last row.
fn join(shared: &mut [LayerCache], row: &[LayerCache]) -> Result<()> {
    for (layer, c) in shared.iter_mut().zip(row) {
        match layer {
            LayerCache::Batch(b) => b.join(plain_kv(c)?)?,
            LayerCache::RecurrentRows(rows) => rows.push(recurrent(c)?.clone()),
            _ => return Err(contract("shared caches hold batch caches only")),
        }
    }
    Ok(())
}

/// Frees row `row`'s slots in `shared` without copying its caches out.
fn drop_row(shared: &mut [LayerCache], row: usize) {
    for layer in shared {
        match layer {
            LayerCache::Batch(b) => b.drop_row(row),
            LayerCache::RecurrentRows(rows) => {
                rows.remove(row);
            }
            _ => {}
        }
    }
}

/// Takes back the last `n` tokens of row `row` in `shared` (only KV layers can: a recurrent
/// row takes a round back with [`end_round`], or a token from the state it kept,
/// `Batch::give_back`).
pub(super) fn trim(shared: &mut [LayerCache], row: usize, n: usize) -> Result<()> {
    if shared
        .iter()
        .any(|c| matches!(c, LayerCache::RecurrentRows(_)))
    {
        return Err(contract(
            "shared recurrent rows take a round back with end_round",
        ));
    }
    for b in batch_caches(shared) {
        b.trim(row, n)?;
    }
    Ok(())
}

/// Closes row `row`'s speculative round in `shared`, taking back its `rejected` last tokens:
/// its KV slots' extents go back, its recurrent layers restore their snapshots and replay the
/// kept tokens (`RecurrentCache::end_round`), as its own caches would.
pub(super) fn end_round(shared: &mut [LayerCache], row: usize, rejected: usize) -> Result<()> {
    for layer in shared {
        match layer {
            LayerCache::Batch(b) => b.trim(row, rejected)?,
            LayerCache::RecurrentRows(rows) => {
                rows[row].end_round(rejected)?;
            }
            _ => return Err(contract("shared caches hold batch caches only")),
        }
    }
    Ok(())
}

/// How many rows `shared` holds.
fn rows_in(shared: &[LayerCache]) -> usize {
    match shared.first() {
        Some(LayerCache::Batch(b)) => b.rows(),
        Some(LayerCache::RecurrentRows(rows)) => rows.len(),
        _ => 0,
    }
}

/// Whether a buffer outgrew its rows (a long row left): gathering them afresh pads less.
fn outgrown(shared: &[LayerCache]) -> bool {
    first_batch(shared).is_some_and(BatchKvCache::outgrown)
}

/// The element type of the keys of `caches` (shared or a row's own), if it holds any.
fn key_dtype(caches: &[LayerCache]) -> Option<Dtype> {
    caches.iter().find_map(|c| match c {
        LayerCache::Batch(c) => Some(c.dtype()),
        LayerCache::Kv(c) => c.kv.as_ref().map(|(k, _)| k.dtype()),
        _ => None,
    })
}

/// Whether rows of `offsets` whose next step feeds up to `rounds` tokens each keep their lone
/// attention in one buffer of `dtype` keys ([`BatchKvCache::keeps_lone_attention`]).
fn keeps_lone_attention(dtype: Option<Dtype>, offsets: &[usize], rounds: &[usize]) -> bool {
    let keys = offsets.iter().zip(rounds).map(|(o, r)| o + r).max();
    dtype.is_none_or(|d| BatchKvCache::keeps_lone_attention(d, keys.unwrap_or(0)))
}

/// The rows' offsets in a shared buffer.
fn offsets(shared: &[LayerCache]) -> Vec<usize> {
    first_batch(shared).map_or_else(Vec::new, BatchKvCache::offsets)
}

impl<'m> Row<'m> {
    /// The draft model this row drafts with through a draft model's rounds, if any.
    pub(super) fn draft_model(&self) -> Option<&'m ModelBundle> {
        match &self.decoder {
            Decoder::Speculative { drafter, .. } => drafter.draft_model(),
            Decoder::Plain(_) => None,
        }
    }

    /// The row's own draft caches (a draft model's rounds), if any.
    fn draft_caches(&mut self) -> Option<&mut Vec<LayerCache>> {
        match &mut self.decoder {
            Decoder::Speculative { source, .. } => Some(source.stepped()?.caches_mut()),
            Decoder::Plain(_) => None,
        }
    }

    /// The most tokens the row's next step feeds.
    fn max_round(&self) -> usize {
        match &self.decoder {
            Decoder::Plain(_) => 1,
            Decoder::Speculative { speculator, .. } => speculator.max_round(),
        }
    }

    /// Whether the row's caches may sit in a shared buffer: it quantizes no KV cache and its
    /// draft source does not read the target's caches.
    fn may_share(&self) -> bool {
        match &self.decoder {
            Decoder::Plain(p) => p.params.kv_quantization.is_none(),
            Decoder::Speculative {
                speculator, source, ..
            } => !speculator.quantizes_kv() && !source.reads_target_caches(),
        }
    }
}

impl<'m> Batch<'m> {
    /// The tokens row `at`'s target caches hold (its row of the shared ones, or its own).
    pub(super) fn target_offset(&self, at: usize) -> usize {
        match &self.shared {
            Some(shared) if at < rows_in(shared) => offsets(shared)[at],
            _ => kv_offset(self.rows[at].decoder.caches()),
        }
    }

    /// The rows already in the shared caches (the first ones; later rows joined since).
    pub(super) fn shared_rows(&self) -> usize {
        self.shared.as_deref().map_or(0, rows_in)
    }

    /// Whether the next step's rows can share one KV cache per attention layer (and sit side
    /// by side in each recurrent layer): two or more, every one that may share
    /// ([`Row::may_share`]), on a model whose layers read batch caches, every row not yet
    /// shared holding filled plain KV caches (and recurrent states), their
    /// lengths close enough for one buffer ([`BatchKvCache::fits`]) and short enough that each
    /// keeps its lone attention.
    fn can_share(&self) -> bool {
        let shared = self.shared_rows();
        let mut lens = self.shared.as_deref().map(offsets).unwrap_or_default();
        let mut dtype = self.shared.as_deref().and_then(key_dtype);
        for row in &self.rows[shared..] {
            let caches = row.decoder.caches();
            if !filled(caches, true) {
                return false;
            }
            lens.push(kv_offset(caches));
            dtype = dtype.or(key_dtype(caches));
        }
        let rounds: Vec<usize> = self.rows.iter().map(Row::max_round).collect();
        self.may_share
            && self.model.attends_batch_caches()
            && self.rows.len() > 1
            && self.rows.iter().all(Row::may_share)
            && BatchKvCache::fits(&lens)
            && keeps_lone_attention(dtype, &lens, &rounds)
    }

    /// Before a step: the rows that joined since move into the shared caches (gathered when
    /// there are none yet), or every row takes its caches back when they can no longer share;
    /// likewise the draft caches of each draft model's rows.
    pub(super) fn arrange_shared(&mut self) -> Result<()> {
        self.arrange_drafts()?;
        let outgrown = self.shared.as_deref().is_some_and(outgrown);
        if outgrown || !self.can_share() {
            for at in (0..self.shared_rows()).rev() {
                self.take_shared(at)?;
            }
            if !self.can_share() {
                return Ok(());
            }
        }
        let from = self.shared_rows();
        let joining: Vec<Vec<LayerCache>> = self.rows[from..]
            .iter_mut()
            .map(|row| std::mem::take(row.decoder.caches_mut()))
            .collect();
        match &mut self.shared {
            None => self.shared = Some(gather(&joining)?),
            Some(shared) => {
                for caches in &joining {
                    join(shared, caches)?;
                }
            }
        }
        Ok(())
    }

    /// Row `at` takes its own caches (and its draft caches) back out of the shared ones.
    pub(super) fn take_shared(&mut self, at: usize) -> Result<()> {
        self.out_of_shared(at, true, true)
    }

    /// Row `at` leaves the batch: its slots are freed, and only caches that outlive it are
    /// copied out of the shared ones (`keep`: a plain row's, which the server keeps for its
    /// prefix cache), never its draft caches. Copying a leaving speculative row's target and
    /// draft layers cost a copy of each and a wait for the device.
    pub(super) fn leave_shared(&mut self, at: usize, keep: bool) -> Result<()> {
        self.out_of_shared(at, keep, false)
    }

    /// Row `at` out of the shared caches and its draft group, copying its own caches out where
    /// `target` (and its draft caches where `drafts`) say so.
    fn out_of_shared(&mut self, at: usize, target: bool, drafts: bool) -> Result<()> {
        self.out_of_draft_group(at, drafts)?;
        if at >= self.shared_rows() {
            return Ok(());
        }
        let shared = self
            .shared
            .as_mut()
            .expect("a shared row implies shared caches");
        if target {
            *self.rows[at].decoder.caches_mut() = leave(shared, at)?;
        } else {
            drop_row(shared, at);
        }
        if self.shared_rows() == 0 {
            self.shared = None;
        }
        Ok(())
    }

    /// Opens the speculative rounds of the rows in the shared caches on their recurrent layers
    /// there (their KV slots need no mark: [`end_round`] sets a row's extent back by the
    /// tokens it rejects), as each row's speculator opens the round on caches of its own.
    pub(super) fn begin_shared_rounds(&mut self) {
        let Some(shared) = &mut self.shared else {
            return;
        };
        for (at, row) in self.rows.iter().enumerate().take(rows_in(shared)) {
            if !matches!(row.decoder, Decoder::Speculative { .. }) {
                continue;
            }
            for layer in shared.iter_mut() {
                if let LayerCache::RecurrentRows(rows) = layer {
                    rows[at].begin_round();
                }
            }
        }
    }

    /// Whether the rows drafting with `model` can share its caches: two or more, every one
    /// that may share, on a model whose attention reads a batch cache, every row not yet in
    /// its group holding filled plain KV draft caches, their lengths close enough for one
    /// buffer and short enough that each keeps its lone attention.
    fn can_share_drafts(&mut self, model: &ModelBundle) -> bool {
        let group = self.draft_groups.iter().find(|g| ptr::eq(g.model, model));
        let mut lens = group.map(|g| offsets(&g.caches)).unwrap_or_default();
        let mut dtype = group.and_then(|g| key_dtype(&g.caches));
        let (mut rounds, mut shareable) = (Vec::new(), true);
        // The group's rows first, in its order, as `lens` has them.
        let members = group.map(|g| g.ids.clone()).unwrap_or_default();
        for id in &members {
            let row = self.rows.iter().find(|r| r.id == *id);
            rounds.push(row.map_or(1, Row::max_round));
        }
        for row in self.rows.iter_mut() {
            if !row.draft_model().is_some_and(|m| ptr::eq(m, model)) {
                continue;
            }
            shareable &= row.may_share();
            if members.contains(&row.id) {
                continue;
            }
            rounds.push(row.max_round());
            match row.draft_caches() {
                Some(c) if filled(c, false) => {
                    lens.push(kv_offset(c));
                    dtype = dtype.or(key_dtype(c));
                }
                _ => shareable = false,
            }
        }
        self.may_share
            && shareable
            && rounds.len() > 1
            && model.model().attends_batch_caches()
            && BatchKvCache::fits(&lens)
            && keeps_lone_attention(dtype, &lens, &rounds)
    }

    /// Each draft model's rows that can share its caches move into its group (gathered when
    /// there is none yet); a group whose rows can no longer share hands their caches back.
    fn arrange_drafts(&mut self) -> Result<()> {
        for g in (0..self.draft_groups.len()).rev() {
            let model = self.draft_groups[g].model;
            if outgrown(&self.draft_groups[g].caches) || !self.can_share_drafts(model) {
                self.dissolve_draft_group(g)?;
            }
        }
        let mut models: Vec<&'m ModelBundle> = Vec::new();
        for m in self.rows.iter().filter_map(Row::draft_model) {
            if !models.iter().any(|known| ptr::eq(*known, m)) {
                models.push(m);
            }
        }
        for model in models {
            if !self.can_share_drafts(model) {
                continue;
            }
            let group = self
                .draft_groups
                .iter()
                .position(|g| ptr::eq(g.model, model));
            let in_group =
                |id: usize| group.is_some_and(|g| self.draft_groups[g].row_of(id).is_some());
            let joining: Vec<usize> = self
                .rows
                .iter()
                .filter(|r| r.draft_model().is_some_and(|m| ptr::eq(m, model)) && !in_group(r.id))
                .map(|r| r.id)
                .collect();
            let mut caches = Vec::with_capacity(joining.len());
            for row in self.rows.iter_mut().filter(|r| joining.contains(&r.id)) {
                let own = row
                    .draft_caches()
                    .expect("a row drafting with a draft model");
                caches.push(std::mem::take(own));
            }
            match group {
                Some(g) => {
                    let group = &mut self.draft_groups[g];
                    for c in &caches {
                        join(&mut group.caches, c)?;
                    }
                    group.ids.extend(joining);
                }
                None => self.draft_groups.push(DraftGroup {
                    model,
                    ids: joining,
                    caches: gather(&caches)?,
                }),
            }
        }
        Ok(())
    }

    /// Every row of draft group `g` takes its draft caches back; the group is gone.
    fn dissolve_draft_group(&mut self, g: usize) -> Result<()> {
        let DraftGroup {
            ids, mut caches, ..
        } = self.draft_groups.remove(g);
        for (r, id) in ids.iter().enumerate().rev() {
            let own = leave(&mut caches, r)?;
            if let Some(row) = self.rows.iter_mut().find(|row| row.id == *id) {
                *row.draft_caches()
                    .expect("a row drafting with a draft model") = own;
            }
        }
        Ok(())
    }

    /// Row `at` out of its draft group, if it is in one, its draft caches copied back out
    /// where `copy` says so (a group left with one row is dissolved: a lone row drafts alone,
    /// over caches of its own).
    fn out_of_draft_group(&mut self, at: usize, copy: bool) -> Result<()> {
        let id = self.rows[at].id;
        let Some(g) = self
            .draft_groups
            .iter()
            .position(|g| g.row_of(id).is_some())
        else {
            return Ok(());
        };
        let group = &mut self.draft_groups[g];
        let r = group.row_of(id).expect("a member");
        if copy {
            let own = leave(&mut group.caches, r)?;
            *self.rows[at]
                .draft_caches()
                .expect("a row drafting with a draft model") = own;
        } else {
            drop_row(&mut group.caches, r);
        }
        group.ids.remove(r);
        let left = group.ids.len();
        if left < 2 {
            self.dissolve_draft_group(g)?;
        }
        Ok(())
    }
}
