//! Per-layer caches, each a faithful copy of its mlx-lm class (models/cache.py), because the
//! cache layout decides which keys a query sees and so the bits of every later logit. The
//! rollback contract (`rollback`) says how each kind takes a speculative round back; prompt
//! cache files (`prompt_file`) are mlx-lm's format.

mod batch_kv;
mod gated_delta;
mod kv;
mod mask;
mod prompt_file;
mod quantized;
mod recurrent;
mod rollback;
mod rotating;

pub use batch_kv::{first_batch, plan_step, BatchKvCache, RowsKv, StepLayout};
pub use gated_delta::{gated_delta_update, normalize_qk, Recurrence, RecurrentStep};
pub use kv::KvCache;
pub use mask::{attention_mask, create_causal_mask, Mask};
pub use prompt_file::{load_prompt_cache, save_prompt_cache};
pub use quantized::{Packed3, QuantizedKvCache};
pub use recurrent::{RecurrentCache, RecurrentState};
pub use rollback::{begin_round, end_round, rollback_plan, Rollback};
pub use rotating::RotatingKvCache;

use mlx::{Array, Dtype};

use crate::{error::contract, Error, Result};

/// Allocation granularity of the growable caches (mlx-lm's `step`).
pub(crate) const STEP: i32 = 256;

/// Whether KV buffers of `dtype` keys keep their capacity off multiples of [`STEP`]. On CUDA in
/// half precision MLX runs a one-token step over at least 256 keys sliced out of a buffer of
/// such a capacity through cuDNN's decode kernel (`use_cudnn_for_decoding`,
/// mlx/backend/cuda/scaled_dot_product_attention.cpp), whose bits change from run to run
/// inside a model (known backend bug cuda-half-decode-nondeterministic), and any other step
/// through its vector kernel, which the shared batch cache repeats row by row. So verity's own
/// decoding gives such a buffer one position more; golden replay keeps mlx-lm's buffers.
pub(crate) fn off_cudnn_decode(dtype: Dtype) -> bool {
    matches!(dtype, Dtype::Float16 | Dtype::Bfloat16)
        && crate::model::lone_rows::exact_decode()
        && crate::model::lone_rows::cuda_or_any_device()
}

/// The positions a KV buffer of `dtype` keys allocates to hold `needed` ([`off_cudnn_decode`]).
pub(crate) fn buffer_positions(needed: i32, dtype: Dtype) -> i32 {
    needed + i32::from(needed % STEP == 0 && off_cudnn_decode(dtype))
}

/// One layer's cache. Cloning is cheap: arrays share their (immutable) buffers.
#[derive(Clone)]
pub enum LayerCache {
    Kv(KvCache),
    Rotating(RotatingKvCache),
    QuantizedKv(QuantizedKvCache),
    Recurrent(RecurrentCache),
    /// Every row's KV cache of a batch decode step, in one buffer ([`BatchKvCache`]): the batch
    /// passes its rows' caches as one such row, and only attention's batch path reads it.
    Batch(BatchKvCache),
    /// Every row's recurrent cache of one layer, side by side: where a hybrid model's batch
    /// holds its attention layers' rows in [`BatchKvCache`]s, its recurrent layers' rows sit
    /// here, in the same row order, and step together
    /// ([`RecurrentCache::advance_together`]).
    RecurrentRows(Vec<RecurrentCache>),
}

/// The keys and values attention reads after an update.
pub enum KeysValues {
    Dense {
        keys: Array,
        values: Array,
    },
    /// (packed, scales, biases) triples, as mx.quantize returns them.
    Quantized {
        keys: Packed3,
        values: Packed3,
        group_size: i32,
        bits: i32,
    },
    /// What each of several one-token steps reads, in order
    /// ([`RotatingKvCache::update_each_token`]).
    Steps(Vec<(Array, Array)>),
}

/// Quantized-KV settings of a generation (mlx-lm's kv_bits / kv_group_size / quantized_kv_start).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KvQuantization {
    pub bits: i32,
    pub group_size: i32,
    pub start: usize,
}

impl LayerCache {
    /// Tokens seen so far (the RoPE offset of the next token); a batch cache's longest row's
    /// (each row's own: [`BatchKvCache::offsets`]).
    pub fn offset(&self) -> usize {
        match self {
            LayerCache::Kv(c) => c.offset,
            LayerCache::Rotating(c) => c.offset,
            LayerCache::QuantizedKv(c) => c.offset,
            LayerCache::Recurrent(c) => c.seen,
            LayerCache::Batch(c) => c.offsets().into_iter().max().unwrap_or(0),
            LayerCache::RecurrentRows(rows) => rows.iter().map(|c| c.seen).max().unwrap_or(0),
        }
    }

    /// Appends this step's keys and values (B, H, S, D) and returns what attention reads.
    pub fn update_and_fetch(&mut self, keys: &Array, values: &Array) -> Result<KeysValues> {
        let dense = |(keys, values)| KeysValues::Dense { keys, values };
        match self {
            LayerCache::Kv(c) => c.update_and_fetch(keys, values).map(dense),
            LayerCache::Rotating(c) => c.update_and_fetch(keys, values).map(dense),
            LayerCache::QuantizedKv(c) => c.update_and_fetch(keys, values),
            LayerCache::Recurrent(_) | LayerCache::RecurrentRows(_) => {
                Err(contract("an attention layer was given a recurrent cache"))
            }
            LayerCache::Batch(_) => Err(contract(
                "a batch cache is written by attention's batch path only",
            )),
        }
    }

    /// The attention mask for `n` new queries (mlx-lm's `cache.make_mask`).
    pub fn make_mask(&self, n: usize, window: Option<usize>) -> Result<Mask> {
        match self {
            LayerCache::Kv(c) => mask::attention_mask(n, c.offset, window),
            LayerCache::QuantizedKv(c) => mask::attention_mask(n, c.offset, window),
            LayerCache::Rotating(c) => c.make_mask(n, window),
            LayerCache::Recurrent(_) | LayerCache::RecurrentRows(_) => Ok(Mask::None),
            // Attention's batch path builds each row's own mask.
            LayerCache::Batch(_) => Ok(Mask::None),
        }
    }

    /// The keys and values attention can see, in temporal order and dequantized (B, H, S, D);
    /// None for an empty or a recurrent cache. For inspection and tests.
    pub fn visible(&self) -> Result<Option<(Array, Array)>> {
        match self {
            LayerCache::Kv(c) => Ok(match &c.kv {
                Some((k, v)) => {
                    let n = c.offset as i32;
                    Some((kv::seq(k, 0, n)?, kv::seq(v, 0, n)?))
                }
                None => None,
            }),
            LayerCache::QuantizedKv(c) => c.dequantized(),
            LayerCache::Rotating(c) => c.temporal(),
            LayerCache::Recurrent(_) | LayerCache::Batch(_) | LayerCache::RecurrentRows(_) => {
                Ok(None)
            }
        }
    }

    /// Drops the last `n` tokens of a KV cache (capped at its length, as mlx-lm's trim). Other
    /// kinds cannot trim exactly outside a round and refuse.
    pub fn trim(&mut self, n: usize) -> Result<usize> {
        match self {
            LayerCache::Kv(c) => Ok(c.trim(n)),
            LayerCache::QuantizedKv(c) => Ok(c.trim(n)),
            LayerCache::Rotating(_)
            | LayerCache::Recurrent(_)
            | LayerCache::Batch(_)
            | LayerCache::RecurrentRows(_) => {
                Err(contract("only KV caches trim outside a speculative round"))
            }
        }
    }

    /// Whether a prefill that goes on from this cache computes what one prefill of the whole
    /// would (a prefix cache's question). Not so for a window with kept slots (max_kv_size's
    /// four) filled past its size: the next multi-token update attends the kept keys next to
    /// the window's last ones, as mlx-lm's mask places keys by slot (`make_mask`, offset capped
    /// at max_size - 1), where one prefill of the whole never let them in.
    pub fn resumes_exactly(&self) -> bool {
        match self {
            LayerCache::Rotating(c) => c.keep == 0 || c.offset < c.max_size,
            _ => true,
        }
    }

    /// The arrays to evaluate after a prefill chunk (mlx-lm's `c.state`).
    pub fn state(&self) -> Vec<&Array> {
        match self {
            LayerCache::Kv(c) => c.state(),
            LayerCache::Rotating(c) => c.state(),
            LayerCache::QuantizedKv(c) => c.state(),
            LayerCache::Recurrent(c) => c.state(),
            LayerCache::Batch(c) => c.state(),
            LayerCache::RecurrentRows(rows) => {
                rows.iter().flat_map(RecurrentCache::state).collect()
            }
        }
    }

    /// mlx-lm's maybe_quantize_kv_cache for one layer: a KV cache whose offset reached
    /// `start` becomes a quantized one (once; other kinds are left alone, except that a
    /// rotating cache refuses as mlx-lm does).
    fn maybe_quantize(&mut self, q: &KvQuantization) -> Result<()> {
        match self {
            LayerCache::Kv(c) if c.offset >= q.start => {
                *self = LayerCache::QuantizedKv(c.to_quantized(q.group_size, q.bits)?);
                Ok(())
            }
            LayerCache::Rotating(c) if c.offset >= q.start => Err(Error::Unsupported(
                "a rotating (sliding-window) KV cache cannot be quantized (mlx-lm: RotatingKVCache \
                 Quantization NYI)"
                    .into(),
            )),
            _ => Ok(()),
        }
    }
}

/// mlx-lm's maybe_quantize_kv_cache over a model's caches: every KV cache that reached
/// `q.start` tokens becomes a quantized one. Nothing happens without `q`.
pub fn quantize_due(caches: &mut [LayerCache], q: Option<&KvQuantization>) -> Result<()> {
    match q {
        Some(q) => caches.iter_mut().try_for_each(|c| c.maybe_quantize(q)),
        None => Ok(()),
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

/// Evaluates every cache's state (mlx-lm's `mx.eval([c.state for c in cache])`).
pub fn eval_state(caches: &[LayerCache]) -> Result<()> {
    Ok(mlx::eval(caches.iter().flat_map(LayerCache::state))?)
}
