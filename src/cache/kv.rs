//! mlx-lm's KVCache: a buffer grown in 256-slot steps, written in place, read up to `offset`.

use mlx::{ops, Array, Result};

use super::{QuantizedKvCache, STEP};

#[derive(Clone, Default)]
pub struct KvCache {
    pub(crate) keys: Option<Array>,
    pub(crate) values: Option<Array>,
    pub offset: usize,
    /// The offset when the open speculative round began.
    pub(crate) round_start: Option<usize>,
}

/// `a[..., start:stop, :]` on a (B, H, S, D) array.
pub(crate) fn seq(a: &Array, start: i32, stop: i32) -> Result<Array> {
    a.slice_axis(2, start, stop)
}

/// `a[..., start:stop, :] = update` on a (B, H, S, D) array.
pub(crate) fn write_seq(a: &Array, update: &Array, start: i32) -> Result<Array> {
    let shape = a.shape();
    let stop = start + update.dim(2);
    a.slice_update(
        update,
        &[0, 0, start, 0],
        &[shape[0], shape[1], stop, shape[3]],
        &[1, 1, 1, 1],
    )
}

impl KvCache {
    pub fn capacity(&self) -> i32 {
        self.keys.as_ref().map_or(0, |k| k.dim(2))
    }

    pub fn update_and_fetch(&mut self, keys: &Array, values: &Array) -> Result<(Array, Array)> {
        let prev = self.offset as i32;
        let s = keys.dim(2);
        if self.keys.is_none() || prev + s > self.capacity() {
            let ks = keys.shape();
            let n_steps = (STEP + s - 1) / STEP;
            let new_k = Array::zeros(&[ks[0], ks[1], n_steps * STEP, ks[3]], keys.dtype())?;
            let new_v = Array::zeros(
                &[ks[0], ks[1], n_steps * STEP, values.dim(3)],
                values.dtype(),
            )?;
            match (self.keys.take(), self.values.take()) {
                (Some(mut k), Some(mut v)) => {
                    if prev % STEP != 0 {
                        k = seq(&k, 0, prev)?;
                        v = seq(&v, 0, prev)?;
                    }
                    self.keys = Some(ops::concatenate(&[&k, &new_k], 2)?);
                    self.values = Some(ops::concatenate(&[&v, &new_v], 2)?);
                }
                _ => {
                    self.keys = Some(new_k);
                    self.values = Some(new_v);
                }
            }
        }
        self.offset += s as usize;
        let (k, v) = (self.keys.as_ref().unwrap(), self.values.as_ref().unwrap());
        self.keys = Some(write_seq(k, keys, prev)?);
        self.values = Some(write_seq(v, values, prev)?);
        self.keys_and_values()
    }

    fn keys_and_values(&self) -> Result<(Array, Array)> {
        let (k, v) = (self.keys.as_ref().unwrap(), self.values.as_ref().unwrap());
        let offset = self.offset as i32;
        if offset < k.dim(2) {
            Ok((seq(k, 0, offset)?, seq(v, 0, offset)?))
        } else {
            Ok((k.clone(), v.clone()))
        }
    }

    pub fn state(&self) -> Vec<&Array> {
        self.keys.iter().chain(self.values.iter()).collect()
    }

    /// Drops the last `n` tokens (capped at the offset); returns how many were dropped.
    pub fn trim(&mut self, n: usize) -> usize {
        let n = n.min(self.offset);
        self.offset -= n;
        n
    }

    /// KVCache.to_quantized: quantizes the whole buffer, unused capacity included.
    pub fn to_quantized(&self, group_size: i32, bits: i32) -> Result<QuantizedKvCache> {
        let quantize = |a: &Array| -> Result<[Array; 3]> {
            let q = ops::quantize(a, group_size, bits, "affine")?;
            let [w, s, b]: [Array; 3] = q
                .try_into()
                .map_err(|_| mlx::Error::Invalid("affine quantize returns three arrays".into()))?;
            Ok([w, s, b])
        };
        let mut out = QuantizedKvCache::new(group_size, bits);
        out.offset = self.offset;
        if let (Some(k), Some(v)) = (&self.keys, &self.values) {
            out.keys = Some(quantize(k)?);
            out.values = Some(quantize(v)?);
        }
        Ok(out)
    }
}
