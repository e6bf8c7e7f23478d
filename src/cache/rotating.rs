//! mlx-lm's RotatingKVCache (sliding windows and max_kv_size): a ring buffer of `max_size`
//! slots whose first `keep` slots are never overwritten. Multi-token updates re-order it in
//! time and let it grow to `max_size - 1 + S` so every new query sees a full window.

use mlx::{ops, Array, Dtype};

use super::kv::{seq, write_seq, zeros_like_steps};
use super::mask::create_causal_mask;
use super::{Mask, STEP};
use crate::Result;

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
    /// The offset when the open speculative round began.
    pub(crate) round_start: Option<usize>,
}

impl RotatingKvCache {
    pub fn new(max_size: usize, keep: usize) -> RotatingKvCache {
        RotatingKvCache {
            kv: None,
            offset: 0,
            max_size,
            keep,
            idx: 0,
            round_start: None,
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
        let s = keys.dim(2) as usize;
        let prev = self.offset;
        if self.kv.is_none() || (prev >= self.len() && self.len() < self.max_size) {
            let new_size = (STEP as usize).min(self.max_size - prev) as i32;
            let (new_k, new_v) = zeros_like_steps(keys, values, new_size)?;
            self.kv = Some(match self.kv.take() {
                Some((k, v)) => (
                    ops::concatenate(&[&k, &new_k], 2)?,
                    ops::concatenate(&[&v, &new_v], 2)?,
                ),
                None => (new_k, new_v),
            });
            self.idx = prev;
        }
        let (mut k, mut v) = self.kv.take().expect("allocated above");
        let trim_size = k.dim(2) - self.max_size as i32;
        if trim_size > 0 {
            k = self.trim_buffer(trim_size, &k, None)?;
            v = self.trim_buffer(trim_size, &v, None)?;
            self.idx = self.max_size;
        }
        if self.idx == self.max_size {
            self.idx = self.keep;
        }
        let (k, v) = (
            write_seq(&k, keys, self.idx as i32)?,
            write_seq(&v, values, self.idx as i32)?,
        );
        self.offset += s;
        self.idx += s;
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
        let Some(window) = window else {
            return Ok(Mask::None);
        };
        if self.offset >= window && self.max_size > window {
            let idx = if self.idx >= self.max_size {
                0
            } else {
                self.idx
            };
            let mask_size = if self.offset < self.max_size {
                self.offset + 1
            } else {
                self.max_size
            };
            let positions = Array::arange(0.0, mask_size as f64, 1.0, Dtype::Int32)?;
            let mask = positions.greater_equal(&Array::from_i32((mask_size - window) as i32))?;
            return Ok(Mask::Array(roll(&mask, idx + 1)?));
        }
        Ok(Mask::None)
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
