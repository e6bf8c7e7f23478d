//! mlx-lm's RotatingKVCache (sliding windows and max_kv_size): a ring buffer of `max_size`
//! slots whose first `keep` slots are never overwritten. Multi-token updates re-order it in
//! time and let it grow to `max_size - 1 + S` so every new query sees a full window.
//!
//! A speculative round past the window overwrites slots its rejected tokens must give back,
//! which mlx-lm's trim cannot do (it moves the cursor and leaves the slots stale, mlx-lm
//! #1914). A decode forward whose tokens must each get their one-token step's bits writes them
//! one at a time instead ([`RotatingKvCache::update_each_token`]: the ring each step would read,
//! in its slot order); during a round the cache keeps the ring as it stood before each such
//! write (the arrays are immutable, so that is a handle each), and taking back the rejected
//! tail restores the ring its kept tokens left: the state plain decoding reaches, to the bit.

use mlx::{ops, Array, Dtype};

use super::kv::{seq, write_seq, zeros_like_steps};
use super::mask::create_causal_mask;
use super::rollback::round_written;
use super::{Mask, STEP};
use crate::{error::contract, Result};

#[derive(Clone)]
pub struct RotatingKvCache {
    /// The (keys, values) ring buffers; None before the first update.
    pub(crate) kv: Option<(Array, Array)>,
    /// Tokens seen in total.
    pub offset: usize,
    pub max_size: usize,
    pub keep: usize,
    /// The physical write cursor.
    pub(crate) idx: usize,
    /// The open speculative round.
    round: Option<Round>,
}

/// The ring as it stood: its buffers, offset and cursor.
#[derive(Clone)]
struct Ring {
    kv: Option<(Array, Array)>,
    offset: usize,
    idx: usize,
}

#[derive(Clone)]
struct Round {
    /// The offset when the round began.
    start: usize,
    /// The ring before each of the round's one-token writes; None once a multi-token update
    /// wrote in the round (whose tail only a trim can take back, exact until the ring wraps).
    before: Option<Vec<Ring>>,
}

/// What a one-token update (`_update_in_place`) moves: the tokens seen, the cursor and the
/// buffer's length.
#[derive(Clone, Copy)]
struct Cursor {
    offset: usize,
    idx: usize,
    len: usize,
}

/// How one one-token update changes the buffer before writing: zero slots appended, the oldest
/// unkept slots dropped, and the slot it writes.
struct Placement {
    grow: usize,
    trim: usize,
    slot: usize,
}

impl Cursor {
    /// Moves past one one-token update of a ring of `max_size` keeping `keep` slots.
    fn advance(&mut self, max_size: usize, keep: usize) -> Placement {
        let mut grow = 0;
        if self.len == 0 || (self.offset >= self.len && self.len < max_size) {
            grow = (STEP as usize).min(max_size - self.offset);
            self.len += grow;
            self.idx = self.offset;
        }
        let trim = self.len.saturating_sub(max_size);
        if trim > 0 {
            self.len = max_size;
            self.idx = max_size;
        }
        if self.idx == max_size {
            self.idx = keep;
        }
        let slot = self.idx;
        self.offset += 1;
        self.idx += 1;
        Placement { grow, trim, slot }
    }

    /// The mask of a one-token query at this position (make_mask(1, window)).
    fn mask(&self, max_size: usize, window: Option<usize>) -> Result<Mask> {
        let Some(window) = window else {
            return Ok(Mask::None);
        };
        if self.offset >= window && max_size > window {
            let idx = if self.idx >= max_size { 0 } else { self.idx };
            let mask_size = if self.offset < max_size {
                self.offset + 1
            } else {
                max_size
            };
            let positions = Array::arange(0.0, mask_size as f64, 1.0, Dtype::Int32)?;
            let mask = positions.greater_equal(&Array::from_i32((mask_size - window) as i32))?;
            return Ok(Mask::Array(roll(&mask, idx + 1)?));
        }
        Ok(Mask::None)
    }
}

impl RotatingKvCache {
    pub fn new(max_size: usize, keep: usize) -> RotatingKvCache {
        RotatingKvCache {
            kv: None,
            offset: 0,
            max_size,
            keep,
            idx: 0,
            round: None,
        }
    }

    fn cursor(&self) -> Cursor {
        Cursor {
            offset: self.offset,
            idx: self.idx,
            len: self.len(),
        }
    }

    fn len(&self) -> usize {
        self.kv.as_ref().map_or(0, |(k, _)| k.dim(2) as usize)
    }

    /// `_trim`: keep the first `keep` slots, drop the next `trim_size`, append `append`.
    fn trim_buffer(&self, trim_size: i32, v: &Array, append: Option<&Array>) -> mlx::Result<Array> {
        let keep = self.keep as i32;
        let mut parts = if trim_size > 0 {
            vec![seq(v, 0, keep)?, seq(v, trim_size + keep, v.dim(2))?]
        } else {
            vec![v.clone()]
        };
        if let Some(a) = append {
            parts.push(a.clone());
        }
        ops::concatenate(&parts.iter().collect::<Vec<_>>(), 2)
    }

    /// `_temporal_order`: the buffer in time order, unused tail sliced off.
    fn temporal_order(&self, v: &Array) -> mlx::Result<Array> {
        let (idx, keep) = (self.idx as i32, self.keep as i32);
        let n = v.dim(2);
        if idx == n {
            Ok(v.clone())
        } else if (self.idx) < self.offset {
            let parts = [seq(v, 0, keep)?, seq(v, idx, n)?, seq(v, keep, idx)?];
            ops::concatenate(&parts.iter().collect::<Vec<_>>(), 2)
        } else {
            seq(v, 0, idx)
        }
    }

    fn update_concat(&mut self, keys: &Array, values: &Array) -> Result<(Array, Array)> {
        if let Some(round) = &mut self.round {
            round.before = None;
        }
        let kv = match self.kv.take() {
            Some((k, v)) => {
                let k = self.temporal_order(&k)?;
                let v = self.temporal_order(&v)?;
                self.idx = k.dim(2) as usize;
                let trim_size = self.idx as i32 - self.max_size as i32 + 1;
                (
                    self.trim_buffer(trim_size, &k, Some(keys))?,
                    self.trim_buffer(trim_size, &v, Some(values))?,
                )
            }
            None => (keys.clone(), values.clone()),
        };
        self.offset += keys.dim(2) as usize;
        self.idx = kv.0.dim(2) as usize;
        self.kv = Some(kv.clone());
        Ok(kv)
    }

    fn update_in_place(&mut self, keys: &Array, values: &Array) -> Result<(Array, Array)> {
        if let Some(before) = self.round.as_mut().and_then(|r| r.before.as_mut()) {
            before.push(Ring {
                kv: self.kv.clone(),
                offset: self.offset,
                idx: self.idx,
            });
        }
        let mut cursor = self.cursor();
        let place = cursor.advance(self.max_size, self.keep);
        let (mut k, mut v) = match self.kv.take() {
            Some((k, v)) if place.grow > 0 => {
                let (new_k, new_v) = zeros_like_steps(keys, values, place.grow as i32)?;
                (
                    ops::concatenate(&[&k, &new_k], 2)?,
                    ops::concatenate(&[&v, &new_v], 2)?,
                )
            }
            Some(kv) => kv,
            None => zeros_like_steps(keys, values, place.grow as i32)?,
        };
        if place.trim > 0 {
            k = self.trim_buffer(place.trim as i32, &k, None)?;
            v = self.trim_buffer(place.trim as i32, &v, None)?;
        }
        let (k, v) = (
            write_seq(&k, keys, place.slot as i32)?,
            write_seq(&v, values, place.slot as i32)?,
        );
        self.offset = cursor.offset;
        self.idx = cursor.idx;
        let fetched = if (self.offset as i32) < k.dim(2) {
            let n = self.offset as i32;
            (seq(&k, 0, n)?, seq(&v, 0, n)?)
        } else {
            (k.clone(), v.clone())
        };
        self.kv = Some((k, v));
        Ok(fetched)
    }

    pub fn update_and_fetch(&mut self, keys: &Array, values: &Array) -> Result<(Array, Array)> {
        if keys.dim(2) == 1 {
            self.update_in_place(keys, values)
        } else {
            self.update_concat(keys, values)
        }
    }

    /// Appends `keys` and `values` (B, H, S, D) one token at a time, as S one-token steps would,
    /// returning the keys and values each step reads (in the ring's slot order).
    pub fn update_each_token(
        &mut self,
        keys: &Array,
        values: &Array,
    ) -> Result<Vec<(Array, Array)>> {
        (0..keys.dim(2))
            .map(|t| self.update_in_place(&seq(keys, t, t + 1)?, &seq(values, t, t + 1)?))
            .collect()
    }

    /// The masks of `n` one-token steps from here, one for each token
    /// [`RotatingKvCache::update_each_token`] writes.
    pub fn step_masks(&self, n: usize, window: Option<usize>) -> Result<Vec<Mask>> {
        let mut cursor = self.cursor();
        (0..n)
            .map(|_| {
                let mask = cursor.mask(self.max_size, window);
                cursor.advance(self.max_size, self.keep);
                mask
            })
            .collect()
    }

    pub fn make_mask(&self, n: usize, window: Option<usize>) -> Result<Mask> {
        if n > 1 {
            let window = window.unwrap_or(self.max_size);
            let offset = (self.max_size - 1).min(self.offset);
            return if offset + n > window {
                Ok(Mask::Array(create_causal_mask(n, offset, Some(window))?))
            } else {
                Ok(Mask::Causal)
            };
        }
        self.cursor().mask(self.max_size, window)
    }

    /// Keys and values in temporal order, as a multi-token update would see them.
    pub fn temporal(&self) -> Result<Option<(Array, Array)>> {
        let Some((k, v)) = &self.kv else {
            return Ok(None);
        };
        let n = (self.offset as i32).min(k.dim(2));
        let (k, v) = (self.temporal_order(k)?, self.temporal_order(v)?);
        Ok(Some((
            seq(&k, 0, n.min(k.dim(2)))?,
            seq(&v, 0, n.min(v.dim(2)))?,
        )))
    }

    pub fn state(&self) -> Vec<&Array> {
        self.kv.iter().flat_map(|(k, v)| [k, v]).collect()
    }

    /// mlx-lm's trim: moves the offset and cursor back (exact only while trimmable).
    pub fn trim(&mut self, n: usize) -> usize {
        let n = n.min(self.offset);
        self.offset -= n;
        self.idx = self.idx.saturating_sub(n);
        n
    }

    /// Opens a round at the current offset.
    pub(crate) fn begin_round(&mut self) {
        self.round = Some(Round {
            start: self.offset,
            before: Some(Vec::new()),
        });
    }

    /// Closes the round keeping all but its last `reject` tokens: restores the ring its kept
    /// tokens left when every token of the round was written alone, else trims (exact only
    /// while the ring has not wrapped, and refused after).
    pub(crate) fn end_round(&mut self, reject: usize) -> Result<usize> {
        let round = self.round.take();
        let written = round_written(round.as_ref().map(|r| r.start), self.offset, reject)?;
        if reject == 0 {
            return Ok(0);
        }
        match round.and_then(|r| r.before) {
            Some(before) if before.len() == written => {
                let ring = before[written - reject].clone();
                (self.kv, self.offset, self.idx) = (ring.kv, ring.offset, ring.idx);
                Ok(reject)
            }
            _ if self.offset > self.max_size => Err(contract(format!(
                "the rotating cache wrapped during a round written several tokens at a time \
                 ({} tokens in a window of {}); its evicted entries cannot be restored",
                self.offset, self.max_size
            ))),
            _ => Ok(self.trim(reject)),
        }
    }
}

/// `mx.roll(x, shift)` for a 1-D array.
fn roll(x: &Array, shift: usize) -> mlx::Result<Array> {
    let n = x.dim(0) as usize;
    let shift = (shift % n) as i32;
    if shift == 0 {
        return Ok(x.clone());
    }
    let n = n as i32;
    ops::concatenate(
        &[
            &x.slice_axis(0, n - shift, n)?,
            &x.slice_axis(0, 0, n - shift)?,
        ],
        0,
    )
}
