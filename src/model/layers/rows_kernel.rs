//! When a batch step may attend all its rows in one call on CUDA (`mlx::fast::rows_attention`)
//! rather than with a call per row: only where that call gives every row the bits of the call
//! its lone step makes. A lone one-query step on CUDA runs MLX's vector kernels (head_dim 64, 96
//! or 128: one pass up to 1024 keys, two beyond), whose float operations the rows kernels repeat
//! in their order; since that copies another library's arithmetic, each process checks it once
//! per element type and head size against MLX's own call, for short and long rows, before any
//! batch trusts it. A libmlx that rounds otherwise keeps the call per row. A lone speculative
//! verify takes the same call ([`each_query`]): its queries are rows over one slot, each up to
//! its own position, where it would otherwise make a call per query.
//!
//! At head_dim 32 MLX has no vector kernel: it attends one query unfused, a product, a softmax
//! and a cuBLAS product per call, whose bits no kernel can repeat for a batch's rows, so each row
//! took calls of its own, launch-bound on the fixtures' shapes. There verity's own decoding
//! ([`lone_rows::exact_decode`]) attends a lone step's query through the rows kernels too
//! ([`alone`]), with MLX's vector-kernel arithmetic at that size: alone or in a batch, a query
//! takes the same kernel, so its bits are its lone step's by construction. Golden replay keeps
//! MLX's unfused call; the check here is that the kernel agrees with it to rounding.

use std::f64::consts::LOG2_E;

use mlx::{fast, ops, random, Array, Dtype, Result};

use crate::cache::{Mask, RowsKv};
use crate::model::kernel_checks::KernelChecks;
use crate::model::lone_rows;

/// How a kernel rounds the attention scale into base 2 (the two MLX kernels differ).
#[derive(Clone, Copy, Debug)]
enum Log2e {
    /// `scale * M_LOG2E`: the product in double, rounded to float.
    Double,
    /// `scale * 1.44269504089f`: the product in float (that literal is log2(e) as a float).
    Float,
}

impl Log2e {
    fn times(self, scale: f32) -> f32 {
        match self {
            Log2e::Double => (scale as f64 * LOG2_E) as f32,
            Log2e::Float => scale * std::f32::consts::LOG2_E,
        }
    }
}

/// How the one-pass and the two-pass kernels round the scale, where they match MLX's.
type Rounding = (Log2e, Log2e);

/// How MLX's vector kernels round it (mlx/backend/cuda/scaled_dot_product_attention.cu on
/// mlx-cuda 0.32.4), the rounding of the head sizes it has no vector kernel for.
const VECTOR_KERNELS: Rounding = (Log2e::Double, Log2e::Float);

/// Whether MLX's CUDA backend attends one query of this head size with its vector kernels.
fn mlx_vector_kernel(head_dim: i32) -> bool {
    matches!(head_dim, 64 | 96 | 128)
}

/// Whether verity's own decoding attends one query of this head size through the rows kernels,
/// alone and in a batch, where MLX would call its unfused attention ([module docs](self)).
fn own_vector_kernel(head_dim: i32) -> bool {
    head_dim == 32 && lone_rows::exact_decode()
}

/// The rounding found per (element type, head_dim), once per process.
static CHECKS: KernelChecks<(Dtype, i32), Rounding> = KernelChecks::new(
    "one-call batch attention (element type, head_dim)",
    "rows attend with MLX's own calls, a call each",
);

/// How to call `fast::rows_attention` for one batch step.
pub struct OneCall {
    pub scales_log2: (f32, f32),
    pub two_pass: bool,
}

/// The one call for queries `q` (rows, heads, 1, head_dim) at `scale` over `kv` (after this
/// step's write), where it gives each row its lone call's bits; None otherwise.
pub fn one_call(q: &Array, scale: f32, kv: &RowsKv) -> Option<OneCall> {
    let (dtype, head_dim) = (q.dtype(), q.dim(3));
    let fits = kernel_takes(q, &kv.keys, &kv.values)
        && (mlx_vector_kernel(head_dim) || own_vector_kernel(head_dim));
    if !fits {
        return None;
    }
    rounding(dtype, head_dim).map(|(one, two)| OneCall {
        scales_log2: (one.times(scale), two.times(scale)),
        two_pass: kv.query_extents.iter().any(|&e| e > 1024),
    })
}

/// One query `q` (1, heads, 1, head_dim) over all of `keys` and `values` (1, kv_heads, keys,
/// head_dim) through the rows kernels, where verity's own decoding attends a query of that head
/// size so ([`own_vector_kernel`]); None where MLX's own call is the lone step's.
pub fn alone(
    q: &Array,
    keys: &Array,
    values: &Array,
    scale: f32,
    mask: &Mask,
) -> Result<Option<Array>> {
    let takes =
        own_vector_kernel(q.dim(3)) && matches!(mask, Mask::None | Mask::Causal) && q.dim(2) == 1;
    if !takes {
        return Ok(None);
    }
    each_query(q, keys, values, scale)
}

/// Causal queries `q` (1, heads, L, head_dim), the last L positions of `keys` and `values` (1,
/// kv_heads, keys, head_dim), in one call of the rows kernels, each query a row over the keys up
/// to its own position: a lone verify's queries with the bits of the one-token steps at those
/// positions, as a batch's call gives them ([`one_call`]'s conditions); None otherwise.
pub fn each_query(q: &Array, keys: &Array, values: &Array, scale: f32) -> Result<Option<Array>> {
    let (queries, key_len, head_dim) = (q.dim(2), keys.dim(2), q.dim(3));
    // The queries as the rows axis (one query already is one row).
    let per_query = |y: &Array| match queries {
        1 => Ok(y.clone()),
        _ => y.transpose(&[2, 1, 0, 3]),
    };
    let rows = per_query(q)?;
    let fits = kernel_takes(&rows, keys, values)
        && (mlx_vector_kernel(head_dim) || own_vector_kernel(head_dim))
        && q.dim(0) == 1
        && keys.dim(0) == 1;
    let Some(r) = fits.then(|| rounding(q.dtype(), head_dim)).flatten() else {
        return Ok(None);
    };
    let extents: Vec<i32> = (0..queries).map(|t| key_len - (queries - 1 - t)).collect();
    let out = fast::rows_attention(
        &rows,
        keys,
        values,
        &Array::from_slice(&vec![0i32; queries as usize], &[queries])?,
        &Array::from_slice(&extents, &[queries])?,
        (r.0.times(scale), r.1.times(scale)),
        key_len > 1024,
    )?;
    per_query(&out).map(Some)
}

/// Whether the rows kernels take queries `q` (rows, heads, 1, head_dim) over `keys` and
/// `values` (slots, kv_heads, capacity, head_dim) on this device: CUDA, floats of one element
/// type, a head size shared by all three, grouped query heads.
fn kernel_takes(q: &Array, keys: &Array, values: &Array) -> bool {
    let dtype = q.dtype();
    mlx::default_is_cuda()
        && matches!(dtype, Dtype::Float32 | Dtype::Float16 | Dtype::Bfloat16)
        && keys.dtype() == dtype
        && values.dtype() == dtype
        && keys.dim(3) == q.dim(3)
        && values.shape() == keys.shape()
        && q.dim(1) % keys.dim(1) == 0
}

/// Whether the rows kernels matched MLX's call on this process's libmlx for `dtype` and
/// `head_dim` (checked on the first ask): bit for bit where MLX has a vector kernel, to
/// rounding where the rows kernels stand in for its unfused call.
pub fn verified(dtype: Dtype, head_dim: i32) -> bool {
    rounding(dtype, head_dim).is_some()
}

fn rounding(dtype: Dtype, head_dim: i32) -> Option<Rounding> {
    CHECKS.outcome((dtype, head_dim), || {
        if mlx_vector_kernel(head_dim) {
            find_rounding(dtype, head_dim)
        } else {
            near_unfused_calls(dtype, head_dim)
        }
    })
}

/// [`VECTOR_KERNELS`]' rounding, where the rows kernels agree with MLX's unfused attention to
/// within two percent on rows short and long: that checks the kernel computes attention at this
/// head size (its bits cannot be MLX's, and MLX rounds its scores to the element type first).
fn near_unfused_calls(dtype: Dtype, head_dim: i32) -> Result<Option<Rounding>> {
    let extents = [1, 37, 1025, 2100];
    let (together, alone) = together_and_alone(dtype, head_dim, &extents, VECTOR_KERNELS)?;
    let as_f32 = |a: Array| a.astype(Dtype::Float32)?.to_vec::<f32>();
    let near = (as_f32(together)?.iter().zip(as_f32(alone)?))
        .all(|(&a, b)| (a - b).abs() <= 0.02 * (1.0 + b.abs()));
    Ok(near.then_some(VECTOR_KERNELS))
}

/// The scale roundings under which rows of random keys (short ones, then short and long ones
/// together; two query heads per KV head) get MLX's bits through the rows kernels.
fn find_rounding(dtype: Dtype, head_dim: i32) -> Result<Option<Rounding>> {
    let both = [Log2e::Double, Log2e::Float];
    let matches = |extents: &[i32], r: Rounding| matches_lone_calls(dtype, head_dim, extents, r);
    let mut one = None;
    for r in both {
        if matches(&[1, 37, 300, 1024], (r, r))? {
            one = Some(r);
            break;
        }
    }
    let Some(one) = one else {
        return Ok(None);
    };
    for two in both {
        if matches(&[1, 1025, 300, 2100], (one, two))? {
            return Ok(Some((one, two)));
        }
    }
    Ok(None)
}

fn matches_lone_calls(dtype: Dtype, head_dim: i32, extents: &[i32], r: Rounding) -> Result<bool> {
    let (together, alone) = together_and_alone(dtype, head_dim, extents, r)?;
    Ok(together.to_bytes()? == alone.to_bytes()?)
}

/// Rows of random keys (`extents` of them each; two query heads per KV head) attended in one
/// call of the rows kernels under rounding `r`, and each alone by MLX's own call.
fn together_and_alone(
    dtype: Dtype,
    head_dim: i32,
    extents: &[i32],
    r: Rounding,
) -> Result<(Array, Array)> {
    let normal = |shape: &[i32], seed: u64| -> Result<Array> {
        random::normal(shape, Dtype::Float32, &random::key(seed)?)?.astype(dtype)
    };
    let rows = extents.len() as i32;
    let q = normal(&[rows, 2, 1, head_dim], 1)?;
    let keys = normal(&[rows, 1, 2304, head_dim], 2)?;
    let values = normal(&[rows, 1, 2304, head_dim], 3)?;
    let scale = (head_dim as f64).powf(-0.5) as f32;
    let slots: Vec<i32> = (0..rows).collect();
    let together = fast::rows_attention(
        &q,
        &keys,
        &values,
        &Array::from_slice(&slots, &[rows])?,
        &Array::from_slice(extents, &[rows])?,
        (r.0.times(scale), r.1.times(scale)),
        extents.iter().any(|&e| e > 1024),
    )?;
    let alone = extents
        .iter()
        .enumerate()
        .map(|(i, &e)| {
            let i = i as i32;
            let own = |a: &Array| a.slice_axis(0, i, i + 1)?.slice_axis(2, 0, e);
            fast::scaled_dot_product_attention(
                &q.slice_axis(0, i, i + 1)?,
                &own(&keys)?,
                &own(&values)?,
                scale,
                fast::SdpaMask::None,
                None,
            )
        })
        .collect::<Result<Vec<_>>>()?;
    let alone = ops::concatenate(&alone.iter().collect::<Vec<_>>(), 0)?;
    Ok((together, alone))
}
