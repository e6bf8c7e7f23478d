//! Per-layer caches, each a faithful copy of its mlx-lm class (models/cache.py), because the
//! cache layout decides which keys a query sees and so the bits of every later logit.

mod kv;
mod mask;
mod prompt_file;
mod quantized;
mod recurrent;
mod rollback;
mod rotating;

pub use kv::KvCache;
pub use mask::{create_causal_mask, Mask};
pub use prompt_file::{load_prompt_cache, save_prompt_cache, PromptFileError};
pub use quantized::QuantizedKvCache;
pub use recurrent::RecurrentCache;
pub use rollback::{begin_round, end_round, rollback_plan, Rollback};
pub use rotating::RotatingKvCache;

use mlx::{Array, Result};

/// Allocation granularity of the growable caches (mlx-lm's `step`).
pub(crate) const STEP: i32 = 256;

/// One layer's cache. Cloning is cheap: arrays share their (immutable) buffers.
#[derive(Clone)]
pub enum LayerCache {
    Kv(KvCache),
    Rotating(RotatingKvCache),
    QuantizedKv(QuantizedKvCache),
    Recurrent(RecurrentCache),
}

/// The keys and values attention reads after an update.
pub enum KeysValues {
    Dense {
        keys: Array,
        values: Array,
    },
    /// (packed, scales, biases) triples, as mx.quantize returns them.
    Quantized {
        keys: [Array; 3],
        values: [Array; 3],
        group_size: i32,
        bits: i32,
    },
}

/// Quantized-KV settings of a generation (mlx-lm's kv_bits / kv_group_size / quantized_kv_start).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KvQuantization {
    pub bits: i32,
    pub group_size: i32,
    pub start: usize,
}

impl LayerCache {
    /// Tokens seen so far (the RoPE offset of the next token).
    pub fn offset(&self) -> usize {
        match self {
            LayerCache::Kv(c) => c.offset,
            LayerCache::Rotating(c) => c.offset,
            LayerCache::QuantizedKv(c) => c.offset,
            LayerCache::Recurrent(c) => c.seen,
        }
    }

    /// Appends this step's keys and values (B, H, S, D) and returns what attention reads.
    pub fn update_and_fetch(&mut self, keys: &Array, values: &Array) -> Result<KeysValues> {
        match self {
            LayerCache::Kv(c) => {
                let (keys, values) = c.update_and_fetch(keys, values)?;
                Ok(KeysValues::Dense { keys, values })
            }
            LayerCache::Rotating(c) => {
                let (keys, values) = c.update_and_fetch(keys, values)?;
                Ok(KeysValues::Dense { keys, values })
            }
            LayerCache::QuantizedKv(c) => c.update_and_fetch(keys, values),
            LayerCache::Recurrent(_) => Err(mlx::Error::Invalid(
                "an attention layer was given a recurrent cache".into(),
            )),
        }
    }

    /// The attention mask for `n` new queries (mlx-lm's `cache.make_mask`).
    pub fn make_mask(&self, n: usize, window: Option<usize>) -> Result<Mask> {
        match self {
            LayerCache::Kv(c) => mask::attention_mask(n, c.offset, window),
            LayerCache::QuantizedKv(c) => mask::attention_mask(n, c.offset, window),
            LayerCache::Rotating(c) => c.make_mask(n, window),
            LayerCache::Recurrent(_) => Ok(Mask::None),
        }
    }

    /// The keys and values attention can see, in temporal order and dequantized (B, H, S, D);
    /// None for an empty or a recurrent cache. For inspection and tests.
    pub fn visible(&self) -> Result<Option<(Array, Array)>> {
        match self {
            LayerCache::Kv(c) => match (&c.keys, &c.values) {
                (Some(k), Some(v)) => {
                    let n = c.offset as i32;
                    Ok(Some((kv::seq(k, 0, n)?, kv::seq(v, 0, n)?)))
                }
                _ => Ok(None),
            },
            LayerCache::QuantizedKv(c) => match (&c.keys, &c.values) {
                (Some(k), Some(v)) if c.offset > 0 => {
                    let n = c.offset as i32;
                    let deq = |t: &[Array; 3]| -> Result<Array> {
                        let part = |i: usize| kv::seq(&t[i], 0, n);
                        mlx::ops::dequantize(
                            &part(0)?,
                            &part(1)?,
                            Some(&part(2)?),
                            c.group_size,
                            c.bits,
                            "affine",
                        )
                    };
                    Ok(Some((deq(k)?, deq(v)?)))
                }
                _ => Ok(None),
            },
            LayerCache::Rotating(c) => c.temporal(),
            LayerCache::Recurrent(_) => Ok(None),
        }
    }

    /// Drops the last `n` tokens of a KV cache (capped at its length, as mlx-lm's trim). Other
    /// kinds cannot trim exactly outside a round and refuse.
    pub fn trim(&mut self, n: usize) -> Result<usize> {
        match self {
            LayerCache::Kv(c) => Ok(c.trim(n)),
            LayerCache::QuantizedKv(c) => Ok(c.trim(n)),
            LayerCache::Rotating(_) | LayerCache::Recurrent(_) => Err(mlx::Error::Invalid(
                "only KV caches trim outside a speculative round".into(),
            )),
        }
    }

    /// The arrays to evaluate after a prefill chunk (mlx-lm's `c.state`).
    pub fn state(&self) -> Vec<&Array> {
        match self {
            LayerCache::Kv(c) => c.state(),
            LayerCache::Rotating(c) => c.state(),
            LayerCache::QuantizedKv(c) => c.state(),
            LayerCache::Recurrent(c) => c.state(),
        }
    }

    /// mlx-lm's maybe_quantize_kv_cache for one layer: a KV cache whose offset reached
    /// `start` becomes a quantized one (once; other kinds are left alone, except that a
    /// rotating cache refuses as mlx-lm does).
    pub fn maybe_quantize(&mut self, q: &KvQuantization) -> Result<()> {
        match self {
            LayerCache::Kv(c) if c.offset >= q.start => {
                let mut quantized = c.to_quantized(q.group_size, q.bits)?;
                quantized.round_start = c.round_start;
                *self = LayerCache::QuantizedKv(quantized);
                Ok(())
            }
            LayerCache::Rotating(c) if c.offset >= q.start => Err(mlx::Error::Invalid(
                "a rotating (sliding-window) KV cache cannot be quantized (mlx-lm: RotatingKVCache \
                 Quantization NYI)"
                    .into(),
            )),
            _ => Ok(()),
        }
    }
}

/// mlx-lm's make_prompt_cache for a model without its own make_cache: rotating caches keeping
/// the first 4 tokens when `max_kv_size` is set, plain KV caches otherwise.
pub fn default_caches(layers: usize, max_kv_size: Option<usize>) -> Vec<LayerCache> {
    (0..layers)
        .map(|_| match max_kv_size {
            Some(size) => LayerCache::Rotating(RotatingKvCache::new(size, 4)),
            None => LayerCache::Kv(KvCache::default()),
        })
        .collect()
}
