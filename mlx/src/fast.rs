//! `mlx::core::fast`: the fused ops mlx-lm calls through `mx.fast`. On the CPU wheel they fall
//! back to op graphs, but calling them with mlx-lm's exact arguments keeps Metal builds on the
//! same fused kernels Python uses (docs/parity-notes.md, G9).

use crate::ffi::bridge as ffi;
use crate::ops::{ptr, wrap};
use crate::{Array, Result};

/// `mx.fast.rms_norm(x, weight, eps)`.
pub fn rms_norm(x: &Array, weight: Option<&Array>, eps: f32) -> Result<Array> {
    // SAFETY: the pointer is null or borrowed from a live array for the call's duration.
    wrap(unsafe { ffi::rms_norm(x.ffi(), ptr(weight), eps) })
}

/// `mx.fast.layer_norm(x, weight, bias, eps)`.
pub fn layer_norm(
    x: &Array,
    weight: Option<&Array>,
    bias: Option<&Array>,
    eps: f32,
) -> Result<Array> {
    // SAFETY: as above.
    wrap(unsafe { ffi::layer_norm(x.ffi(), ptr(weight), ptr(bias), eps) })
}

/// Where the rotation frequencies of [`rope`] come from.
#[derive(Clone, Copy, Debug)]
pub enum RopeFreqs<'a> {
    /// `base=...`: frequencies `base ** (-2i / dims)`.
    Base(f32),
    /// `freqs=...`: precomputed (llama3, yarn and other scaled variants).
    Freqs(&'a Array),
}

/// `mx.fast.rope(x, dims, traditional=, base= | freqs=, scale=, offset=)`.
pub fn rope(
    x: &Array,
    dims: i32,
    traditional: bool,
    freqs: RopeFreqs<'_>,
    scale: f32,
    offset: i32,
) -> Result<Array> {
    let (base, freqs) = match freqs {
        RopeFreqs::Base(b) => (b, None),
        RopeFreqs::Freqs(f) => (0.0, Some(f)),
    };
    // SAFETY: as above.
    wrap(unsafe { ffi::rope(x.ffi(), dims, traditional, base, scale, offset, ptr(freqs)) })
}

/// [`rope`] with one offset per batch element: `offset=offsets`, an int32 array of shape
/// (B,) for `x` of shape (B, ..., L, D) (mlx-lm's batch caches pass their per-row offsets so).
pub fn rope_at(
    x: &Array,
    dims: i32,
    traditional: bool,
    freqs: RopeFreqs<'_>,
    scale: f32,
    offsets: &Array,
) -> Result<Array> {
    let (base, freqs) = match freqs {
        RopeFreqs::Base(b) => (b, None),
        RopeFreqs::Freqs(f) => (0.0, Some(f)),
    };
    // SAFETY: as above.
    wrap(unsafe {
        ffi::rope_at(
            x.ffi(),
            dims,
            traditional,
            base,
            scale,
            offsets.ffi(),
            ptr(freqs),
        )
    })
}

/// The `mask` argument of [`scaled_dot_product_attention`].
#[derive(Clone, Copy, Debug)]
pub enum SdpaMask<'a> {
    /// `mask=None`.
    None,
    /// `mask="causal"` (bottom-right aligned).
    Causal,
    /// A boolean (True = attend) or additive mask array.
    Array(&'a Array),
}

/// `mx.fast.scaled_dot_product_attention(q, k, v, scale=, mask=, sinks=)`; q (B, H, L, D),
/// k and v (B, H_kv, S, D).
pub fn scaled_dot_product_attention(
    queries: &Array,
    keys: &Array,
    values: &Array,
    scale: f32,
    mask: SdpaMask<'_>,
    sinks: Option<&Array>,
) -> Result<Array> {
    let (mode, array) = match mask {
        SdpaMask::None => ("", None),
        SdpaMask::Causal => ("causal", None),
        SdpaMask::Array(a) => ("array", Some(a)),
    };
    // SAFETY: as above.
    wrap(unsafe {
        ffi::scaled_dot_product_attention(
            queries.ffi(),
            keys.ffi(),
            values.ffi(),
            scale,
            mode,
            ptr(array),
            ptr(sinks),
        )
    })
}

/// One-query attention of B rows in one call on CUDA: row b's query `queries[b]` (B, H, 1, D)
/// over the first `extents[b]` keys and values of slot `slots[b]` of a shared (slots, H_kv,
/// capacity, D) cache, with the float operations of MLX's vector kernels in their order (one pass
/// up to 1024 keys, two beyond: include/rows_attention.h). `scales_log2` are the scale times
/// log2(e) as the one-pass and the two-pass kernel round it; `two_pass` adds the two-pass
/// kernels, needed when a row has more than 1024 keys. CUDA only: other backends fail at
/// evaluation.
pub fn rows_attention(
    queries: &Array,
    keys: &Array,
    values: &Array,
    slots: &Array,
    extents: &Array,
    scales_log2: (f32, f32),
    two_pass: bool,
) -> Result<Array> {
    wrap(ffi::rows_attention(
        queries.ffi(),
        keys.ffi(),
        values.ffi(),
        slots.ffi(),
        extents.ffi(),
        scales_log2.0,
        scales_log2.1,
        two_pass,
    ))
}

/// How the row-product kernel splits its work: each warp computes one output for `rows` rows
/// per load of its weight row, loading `ahead` tiles of that row at a time. Neither changes a
/// row's arithmetic, only how many warps there are and how many loads each has in flight.
#[derive(Clone, Copy, Debug)]
pub struct RowTiling {
    pub rows: i32,
    pub ahead: i32,
}

/// `quantized_matmul(x, w, scales, biases, transpose=True)` in affine mode for `x` (rows, K) in
/// one call on CUDA, each row with the float operations of MLX's qmv for a lone row, every
/// packed weight row loaded once per `tiling.rows` rows (include/row_products.h).
/// `bits` 4 or 8. CUDA only: other backends fail at evaluation.
pub fn rows_qmv(
    x: &Array,
    w: &Array,
    scales: &Array,
    biases: &Array,
    group_size: i32,
    bits: i32,
    tiling: RowTiling,
) -> Result<Array> {
    wrap(ffi::rows_qmv(
        x.ffi(),
        w.ffi(),
        scales.ffi(),
        biases.ffi(),
        group_size,
        bits,
        tiling.rows,
        tiling.ahead,
    ))
}
