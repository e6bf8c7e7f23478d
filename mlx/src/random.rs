//! `mlx::core::random` with explicit keys only.
//!
//! Python keeps one global key per thread: `mx.random.seed(s)` sets it to `key(s)` and every
//! keyless draw does `state, sub = split(state)` and uses `sub`. Inside `mx::compile` a C++
//! global key would be baked in as a constant (docs/parity-notes.md, G5), so verity never uses
//! it: callers hold a [`KeySequence`] and pass each draw's key explicitly.

use crate::ffi::bridge as ffi;
use crate::ops::wrap;
use crate::{Array, Dtype, Result};

/// `mx.random.key(seed)`: a (2,) uint32 key `[seed >> 32, seed & 0xffffffff]`.
pub fn key(seed: u64) -> Result<Array> {
    wrap(ffi::random_key(seed))
}

/// `mx.random.split(key, num)`: (num, 2) keys.
pub fn split(key: &Array, num: i32) -> Result<Array> {
    wrap(ffi::random_split(key.ffi(), num))
}

/// `mx.random.split(key)` as a pair `(next_state, subkey)`, as Python's key sequence uses it.
pub fn split_pair(key: &Array) -> Result<(Array, Array)> {
    let both = split(key, 2)?;
    Ok((
        both.take(&Array::from_i32(0), 0)?,
        both.take(&Array::from_i32(1), 0)?,
    ))
}

/// `mx.random.uniform(shape=, dtype=, key=)` on [0, 1).
pub fn uniform(shape: &[i32], dtype: Dtype, key: &Array) -> Result<Array> {
    wrap(ffi::random_uniform(shape, dtype as u8, key.ffi()))
}

/// `mx.random.normal(shape=, dtype=, key=)`.
pub fn normal(shape: &[i32], dtype: Dtype, key: &Array) -> Result<Array> {
    wrap(ffi::random_normal(shape, dtype as u8, key.ffi()))
}

/// `mx.random.gumbel(shape=, dtype=, key=)`.
pub fn gumbel(shape: &[i32], dtype: Dtype, key: &Array) -> Result<Array> {
    wrap(ffi::random_gumbel(shape, dtype as u8, key.ffi()))
}

/// `mx.random.categorical(logits, axis, key=)`. MLX picks the inverse-CDF path for exactly one
/// distribution with a non-empty output shape and the Gumbel path otherwise, so the same key
/// samples differently for a (1, V) and a (3, V) input (docs/parity-notes.md, "Random numbers").
pub fn categorical(logits: &Array, axis: i32, key: &Array) -> Result<Array> {
    wrap(ffi::random_categorical(logits.ffi(), axis, key.ffi()))
}

/// Python's global key sequence, made explicit: `seed` then one `split` per draw.
#[derive(Clone, Debug)]
pub struct KeySequence {
    state: Array,
}

impl KeySequence {
    /// `mx.random.seed(seed)`.
    pub fn new(seed: u64) -> Result<KeySequence> {
        Ok(KeySequence { state: key(seed)? })
    }

    /// The key for the next draw: `state, sub = split(state); return sub`.
    pub fn next_key(&mut self) -> Result<Array> {
        let (state, sub) = split_pair(&self.state)?;
        self.state = state;
        Ok(sub)
    }
}
