//! mlx-lm's KVCache: a buffer grown in 256-slot steps, written in place, read up to `offset`
//! (on CUDA in half precision one slot more, [`super::off_cudnn_decode`]).

use mlx::{ops, Array};

use super::{buffer_positions, QuantizedKvCache, STEP};
use crate::Result;

#[derive(Clone, Default)]
pub struct KvCache {
    /// The (keys, values) buffers, (B, H, capacity, D); None before the first update.
    pub(crate) kv: Option<(Array, Array)>,
    pub offset: usize,
    /// The offset when the open speculative round began.
    pub(crate) round_start: Option<usize>,
}

/// `a[..., start:stop, :]` on a (B, H, S, D) array.
pub(crate) fn seq(a: &Array, start: i32, stop: i32) -> mlx::Result<Array> {
    a.slice_axis(2, start, stop)
}

/// `a[..., start:stop, :] = update` on a (B, H, S, D) array.
pub(crate) fn write_seq(a: &Array, update: &Array, start: i32) -> mlx::Result<Array> {
    let shape = a.shape();
    let stop = start + update.dim(2);
    a.slice_update(
        update,
        &[0, 0, start, 0],
        &[shape[0], shape[1], stop, shape[3]],
        &[1, 1, 1, 1],
    )
}

/// Zeroed (B, H, n, D) buffers shaped like `keys` and `values`.
pub(crate) fn zeros_like_steps(keys: &Array, values: &Array, n: i32) -> Result<(Array, Array)> {
    let ks = keys.shape();
    Ok((
        Array::zeros(&[ks[0], ks[1], n, ks[3]], keys.dtype())?,
        Array::zeros(&[ks[0], ks[1], n, values.dim(3)], values.dtype())?,
    ))
}

impl KvCache {
    pub fn capacity(&self) -> i32 {
        self.kv.as_ref().map_or(0, |(k, _)| k.dim(2))
    }

    pub fn update_and_fetch(&mut self, keys: &Array, values: &Array) -> Result<(Array, Array)> {
        let prev = self.offset as i32;
        let s = keys.dim(2);
        if self.kv.is_none() || prev + s > self.capacity() {
            let n_steps = (STEP + s - 1) / STEP;
            let kept = match self.kv {
                Some(_) if prev % STEP != 0 => prev,
                _ => self.capacity(),
            };
            let grown = buffer_positions(kept + n_steps * STEP, keys.dtype()) - kept;
            let (new_k, new_v) = zeros_like_steps(keys, values, grown)?;
            self.kv = Some(match self.kv.take() {
                Some((mut k, mut v)) => {
                    if prev % STEP != 0 {
                        k = seq(&k, 0, prev)?;
                        v = seq(&v, 0, prev)?;
                    }
                    (
                        ops::concatenate(&[&k, &new_k], 2)?,
                        ops::concatenate(&[&v, &new_v], 2)?,
                    )
                }
                None => (new_k, new_v),
            });
        }
        self.offset += s as usize;
        let (k, v) = self.kv.take().expect("allocated above");
        let (k, v) = (write_seq(&k, keys, prev)?, write_seq(&v, values, prev)?);
        let offset = self.offset as i32;
        let fetched = if offset < k.dim(2) {
            (seq(&k, 0, offset)?, seq(&v, 0, offset)?)
        } else {
            (k.clone(), v.clone())
        };
        self.kv = Some((k, v));
        Ok(fetched)
    }

    pub fn state(&self) -> Vec<&Array> {
        self.kv.iter().flat_map(|(k, v)| [k, v]).collect()
    }

    /// Drops the last `n` tokens (capped at the offset); returns how many were dropped.
    pub fn trim(&mut self, n: usize) -> usize {
        let n = n.min(self.offset);
        self.offset -= n;
        n
    }

    /// KVCache.to_quantized: quantizes the whole buffer, unused capacity included.
    pub fn to_quantized(&self, group_size: i32, bits: i32) -> Result<QuantizedKvCache> {
        let mut out = QuantizedKvCache::new(group_size, bits);
        out.offset = self.offset;
        out.round_start = self.round_start;
        if let Some((k, v)) = &self.kv {
            out.kv = Some((out.quantize(k)?, out.quantize(v)?));
        }
        Ok(out)
    }
}
