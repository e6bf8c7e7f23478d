//! mlx-lm's QuantizedKVCache: keys and values stored as (packed, scales, biases) triples, with
//! mlx-lm's quantized attention reading them (models/base.py).

use mlx::{ops, Array, Dtype, Result};

use super::kv::{seq, write_seq};
use super::{KeysValues, STEP};

#[derive(Clone)]
pub struct QuantizedKvCache {
    pub(crate) keys: Option<[Array; 3]>,
    pub(crate) values: Option<[Array; 3]>,
    pub offset: usize,
    pub group_size: i32,
    pub bits: i32,
    /// The offset when the open speculative round began.
    pub(crate) round_start: Option<usize>,
}

fn triple(parts: Vec<Array>) -> Result<[Array; 3]> {
    parts
        .try_into()
        .map_err(|_| mlx::Error::Invalid("affine quantize returns three arrays".into()))
}

fn map3(t: &[Array; 3], f: impl Fn(&Array) -> Result<Array>) -> Result<[Array; 3]> {
    Ok([f(&t[0])?, f(&t[1])?, f(&t[2])?])
}

impl QuantizedKvCache {
    pub fn new(group_size: i32, bits: i32) -> QuantizedKvCache {
        QuantizedKvCache {
            keys: None,
            values: None,
            offset: 0,
            group_size,
            bits,
            round_start: None,
        }
    }

    fn capacity(&self) -> i32 {
        self.keys.as_ref().map_or(0, |k| k[0].dim(2))
    }

    pub fn update_and_fetch(&mut self, keys: &Array, values: &Array) -> Result<KeysValues> {
        let ks = keys.shape();
        let (b, h, s) = (ks[0], ks[1], ks[2]);
        let prev = self.offset as i32;
        if self.keys.is_none() || prev + s > self.capacity() {
            let el_per_int = 32 / self.bits;
            let new_steps = (STEP + s - 1) / STEP * STEP;
            let init = |dim: i32| -> Result<[Array; 3]> {
                Ok([
                    Array::zeros(&[b, h, new_steps, dim / el_per_int], Dtype::Uint32)?,
                    Array::zeros(&[b, h, new_steps, dim / self.group_size], keys.dtype())?,
                    Array::zeros(&[b, h, new_steps, dim / self.group_size], keys.dtype())?,
                ])
            };
            let expand = |x: &Array| -> Result<Array> {
                let fresh = Array::zeros(&[b, h, new_steps, x.dim(-1)], x.dtype())?;
                ops::concatenate(&[x, &fresh], -2)
            };
            match (self.keys.take(), self.values.take()) {
                (Some(mut k), Some(mut v)) => {
                    if prev % STEP != 0 {
                        k = map3(&k, |x| seq(x, 0, prev))?;
                        v = map3(&v, |x| seq(x, 0, prev))?;
                    }
                    self.keys = Some(map3(&k, expand)?);
                    self.values = Some(map3(&v, expand)?);
                }
                _ => {
                    self.keys = Some(init(ks[3])?);
                    self.values = Some(init(values.dim(3))?);
                }
            }
        }
        self.offset += s as usize;
        let qk = triple(ops::quantize(keys, self.group_size, self.bits, "affine")?)?;
        let qv = triple(ops::quantize(values, self.group_size, self.bits, "affine")?)?;
        let (k, v) = (self.keys.take().unwrap(), self.values.take().unwrap());
        let mut nk = Vec::with_capacity(3);
        let mut nv = Vec::with_capacity(3);
        for i in 0..3 {
            nk.push(write_seq(&k[i], &qk[i], prev)?);
            nv.push(write_seq(&v[i], &qv[i], prev)?);
        }
        self.keys = Some(triple(nk)?);
        self.values = Some(triple(nv)?);
        let (k, v) = (self.keys.as_ref().unwrap(), self.values.as_ref().unwrap());
        let offset = self.offset as i32;
        let (keys, values) = if offset == k[0].dim(2) {
            (k.clone(), v.clone())
        } else {
            (
                map3(k, |x| seq(x, 0, offset))?,
                map3(v, |x| seq(x, 0, offset))?,
            )
        };
        Ok(KeysValues::Quantized {
            keys,
            values,
            group_size: self.group_size,
            bits: self.bits,
        })
    }

    pub fn state(&self) -> Vec<&Array> {
        self.keys
            .iter()
            .chain(self.values.iter())
            .flatten()
            .collect()
    }

    /// Drops the last `n` tokens (capped at the offset); returns how many were dropped.
    pub fn trim(&mut self, n: usize) -> usize {
        let n = n.min(self.offset);
        self.offset -= n;
        n
    }
}
