//! mlx-lm's QuantizedKVCache: keys and values stored as (packed, scales, biases) triples, with
//! mlx-lm's quantized attention reading them (models/base.py).

use mlx::{ops, Array, Dtype};

use super::kv::{seq, write_seq};
use super::{KeysValues, STEP};
use crate::{error::contract, Result};

/// A quantized tensor as `mx.quantize` returns it in affine mode: (packed, scales, biases).
pub type Packed3 = [Array; 3];

#[derive(Clone)]
pub struct QuantizedKvCache {
    /// The quantized (keys, values) buffers; None before the first update.
    pub(crate) kv: Option<(Packed3, Packed3)>,
    pub offset: usize,
    pub group_size: i32,
    pub bits: i32,
    /// The offset when the open speculative round began.
    pub(crate) round_start: Option<usize>,
}

fn map3(t: &Packed3, f: impl Fn(&Array) -> mlx::Result<Array>) -> mlx::Result<Packed3> {
    Ok([f(&t[0])?, f(&t[1])?, f(&t[2])?])
}

impl QuantizedKvCache {
    pub fn new(group_size: i32, bits: i32) -> QuantizedKvCache {
        QuantizedKvCache {
            kv: None,
            offset: 0,
            group_size,
            bits,
            round_start: None,
        }
    }

    fn capacity(&self) -> i32 {
        self.kv.as_ref().map_or(0, |(k, _)| k[0].dim(2))
    }

    /// `mx.quantize(a, group_size, bits)` in affine mode.
    pub(crate) fn quantize(&self, a: &Array) -> Result<Packed3> {
        ops::quantize(a, self.group_size, self.bits, "affine")?
            .try_into()
            .map_err(|_| contract("affine quantize returns three arrays"))
    }

    pub fn update_and_fetch(&mut self, keys: &Array, values: &Array) -> Result<KeysValues> {
        let ks = keys.shape();
        let (b, h, s) = (ks[0], ks[1], ks[2]);
        let prev = self.offset as i32;
        if self.kv.is_none() || prev + s > self.capacity() {
            let el_per_int = 32 / self.bits;
            let new_steps = (STEP + s - 1) / STEP * STEP;
            let init = |dim: i32| -> mlx::Result<Packed3> {
                Ok([
                    Array::zeros(&[b, h, new_steps, dim / el_per_int], Dtype::Uint32)?,
                    Array::zeros(&[b, h, new_steps, dim / self.group_size], keys.dtype())?,
                    Array::zeros(&[b, h, new_steps, dim / self.group_size], keys.dtype())?,
                ])
            };
            let expand = |x: &Array| -> mlx::Result<Array> {
                let fresh = Array::zeros(&[b, h, new_steps, x.dim(-1)], x.dtype())?;
                ops::concatenate(&[x, &fresh], -2)
            };
            self.kv = Some(match self.kv.take() {
                Some((mut k, mut v)) => {
                    if prev % STEP != 0 {
                        k = map3(&k, |x| seq(x, 0, prev))?;
                        v = map3(&v, |x| seq(x, 0, prev))?;
                    }
                    (map3(&k, expand)?, map3(&v, expand)?)
                }
                None => (init(ks[3])?, init(values.dim(3))?),
            });
        }
        self.offset += s as usize;
        let (qk, qv) = (self.quantize(keys)?, self.quantize(values)?);
        let (k, v) = self.kv.take().expect("allocated above");
        let write = |buf: &Packed3, new: &Packed3| -> mlx::Result<Packed3> {
            Ok([
                write_seq(&buf[0], &new[0], prev)?,
                write_seq(&buf[1], &new[1], prev)?,
                write_seq(&buf[2], &new[2], prev)?,
            ])
        };
        let (k, v) = (write(&k, &qk)?, write(&v, &qv)?);
        let offset = self.offset as i32;
        let (keys, values) = if offset == k[0].dim(2) {
            (k.clone(), v.clone())
        } else {
            (
                map3(&k, |x| seq(x, 0, offset))?,
                map3(&v, |x| seq(x, 0, offset))?,
            )
        };
        self.kv = Some((k, v));
        Ok(KeysValues::Quantized {
            keys,
            values,
            group_size: self.group_size,
            bits: self.bits,
        })
    }

    /// The visible keys and values, dequantized.
    pub(crate) fn dequantized(&self) -> Result<Option<(Array, Array)>> {
        let Some((k, v)) = self.kv.as_ref().filter(|_| self.offset > 0) else {
            return Ok(None);
        };
        let n = self.offset as i32;
        let deq = |t: &Packed3| -> mlx::Result<Array> {
            let part = |i: usize| seq(&t[i], 0, n);
            ops::dequantize(
                &part(0)?,
                &part(1)?,
                Some(&part(2)?),
                self.group_size,
                self.bits,
                "affine",
            )
        };
        Ok(Some((deq(k)?, deq(v)?)))
    }

    pub fn state(&self) -> Vec<&Array> {
        self.kv
            .iter()
            .flat_map(|(k, v)| k.iter().chain(v.iter()))
            .collect()
    }

    /// Drops the last `n` tokens (capped at the offset); returns how many were dropped.
    pub fn trim(&mut self, n: usize) -> usize {
        let n = n.min(self.offset);
        self.offset -= n;
        n
    }
}
