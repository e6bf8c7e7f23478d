//! The rows of a packed batch forward. B sequences' new tokens are laid end to end on one token
//! axis, (1, T) with T the sum of the rows' lengths, and every sequence keeps its own caches:
//! no padding, no shared offset. Everything that treats tokens one by one (embedding, norms,
//! projections, MLPs, the output head) runs once over all T tokens; what mixes tokens of one
//! sequence (attention over its cache, a recurrence) runs row by row on that row's segment,
//! exactly as the sequence alone would run it (a decode step's recurrence, where the kernels
//! allow, once over the rows' stacked states: `RecurrentCache::advance_together`).
//!
//! So a row's bits are its lone request's wherever the token-wise kernels give each token the
//! same bits whatever tokens surround it, which MLX's CPU kernels over the reference BLAS do
//! (tests/batch.rs). A single row takes the lone request's graph itself: nothing is sliced or
//! joined. A batch decode step of plain KV caches may pass its rows' caches as one row of
//! [`LayerCache::Batch`] caches instead (one per layer, each holding every row: the batch's
//! `lens` still one per row), which attention reads with one write and, on CUDA, one call
//! (`crate::cache::BatchKvCache`); a hybrid model's recurrent layers then hold their rows'
//! caches side by side ([`LayerCache::RecurrentRows`]).

use mlx::{ops, Array};

use crate::cache::{KeysValues, LayerCache, Mask};
use crate::error::contract;
use crate::model::lone_rows;
use crate::Result;

/// One layer's view of the rows: each row's cache for the layer and its token count.
pub struct LayerRows<'a> {
    pub caches: Vec<&'a mut LayerCache>,
    lens: &'a [usize],
}

impl<'a> LayerRows<'a> {
    /// Layer `layer`'s caches of every row.
    pub(crate) fn at(rows: &'a mut [&mut [LayerCache]], lens: &'a [usize], layer: usize) -> Self {
        LayerRows {
            caches: rows.iter_mut().map(|r| &mut r[layer]).collect(),
            lens,
        }
    }

    /// The rows' lengths alone, for a layer that keeps no cache of its own.
    pub(crate) fn without_caches(lens: &'a [usize]) -> Self {
        LayerRows {
            caches: Vec::new(),
            lens,
        }
    }

    /// One sequence's view: its cache of the layer, `lens` its one length.
    pub fn one(cache: &'a mut LayerCache, lens: &'a [usize]) -> Self {
        LayerRows {
            caches: vec![cache],
            lens,
        }
    }

    /// Each row's token count.
    pub fn lens(&self) -> &'a [usize] {
        self.lens
    }

    /// Whether there are several rows, each of one token (a batch decode step).
    pub fn one_token_each(&self) -> bool {
        self.lens.len() > 1 && self.lens.iter().all(|&l| l == 1)
    }

    /// The rows' segments of `x` along its token axis `axis` (1 for (1, T, ...)); `x` itself
    /// for one row.
    pub fn split(&self, x: &Array, axis: i32) -> Result<Vec<Array>> {
        if self.lens.len() == 1 {
            return Ok(vec![x.clone()]);
        }
        let mut start = 0;
        let mut parts = Vec::with_capacity(self.lens.len());
        for &len in self.lens {
            let end = start + len as i32;
            parts.push(x.slice_axis(axis, start, end)?);
            start = end;
        }
        Ok(parts)
    }

    /// The rows' outputs joined along the token axis `axis`; the one output itself for one
    /// row.
    pub fn join(&self, mut parts: Vec<Array>, axis: i32) -> Result<Array> {
        if parts.len() == 1 {
            return Ok(parts.pop().expect("one part"));
        }
        Ok(ops::concatenate(&parts.iter().collect::<Vec<_>>(), axis)?)
    }
}

/// Checks that `rows` and `lens` describe the same rows, each with `layers` caches, and that
/// `tokens` (the packed axis) is their total length.
pub(crate) fn check(
    rows: &[&mut [LayerCache]],
    lens: &[usize],
    layers: usize,
    tokens: usize,
) -> Result<()> {
    if let [only] = rows {
        let batch_rows = only.iter().find_map(|c| match c {
            LayerCache::Batch(c) => Some(c.rows()),
            LayerCache::RecurrentRows(c) => Some(c.len()),
            _ => None,
        });
        if let Some(batch_rows) = batch_rows {
            // A row of a batch cache may take no token this step (a draft step of rows that
            // draft different numbers of tokens).
            let layer_rows = |c: &LayerCache| match c {
                LayerCache::Batch(c) => c.rows() == batch_rows,
                LayerCache::RecurrentRows(c) => c.len() == batch_rows,
                _ => false,
            };
            if only.len() != layers
                || !only.iter().all(layer_rows)
                || batch_rows != lens.len()
                || tokens == 0
                || tokens != lens.iter().sum::<usize>()
            {
                return Err(contract(format!(
                    "batch caches of {batch_rows} rows and {} layers for row lengths {lens:?} \
                     ({tokens} tokens) in a model of {layers} layers",
                    only.len()
                )));
            }
            return Ok(());
        }
    }
    if rows.is_empty() || rows.len() != lens.len() {
        return Err(contract(format!(
            "{} rows of caches for {} row lengths",
            rows.len(),
            lens.len()
        )));
    }
    if let Some(r) = rows.iter().position(|r| r.len() != layers) {
        return Err(contract(format!(
            "row {r} has {} caches for a model of {layers} layers",
            rows[r].len()
        )));
    }
    let total: usize = lens.iter().sum();
    if total != tokens || lens.contains(&0) {
        return Err(contract(format!(
            "row lengths {lens:?} do not pack {tokens} tokens (each row needs at least one)"
        )));
    }
    Ok(())
}

/// Every row's mask for its new tokens, from its cache of layer `layer` (mlx-lm builds one mask
/// per kind of layer from the first layer of that kind); each token's own where a rotating
/// cache takes them one at a time ([`update_row`]).
pub fn masks(
    rows: &[&mut [LayerCache]],
    lens: &[usize],
    layer: usize,
    window: Option<usize>,
) -> Result<Vec<Mask>> {
    rows.iter()
        .zip(lens)
        .map(|(r, &n)| match &r[layer] {
            LayerCache::Rotating(c) if n > 1 && lone_rows::as_one_token_steps() => {
                Ok(Mask::Steps(c.step_masks(n, window)?))
            }
            cache => cache.make_mask(n, window),
        })
        .collect()
}

/// A row's cache update for its new keys and values (B, H, S, D): in a decode forward whose
/// tokens must each get their one-token step's bits ([`lone_rows::as_one_token_steps`]), a
/// rotating cache takes them one at a time, as its one-token steps would, and returns what each
/// step reads; so a verify past a sliding window attends each key in the slot order plain
/// decoding sees it, and the round can be taken back exactly.
pub fn update_row(cache: &mut LayerCache, keys: &Array, values: &Array) -> Result<KeysValues> {
    match cache {
        LayerCache::Rotating(c) if keys.dim(2) > 1 && lone_rows::as_one_token_steps() => {
            Ok(KeysValues::Steps(c.update_each_token(keys, values)?))
        }
        cache => cache.update_and_fetch(keys, values),
    }
}
