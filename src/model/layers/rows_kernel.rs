//! When a batch step may attend all its rows in one call on CUDA (`mlx::fast::rows_attention`)
//! rather than with a call per row: only where that call gives every row the bits of the call
//! its lone step makes. A lone one-query step on CUDA runs MLX's vector kernels (head_dim 64, 96
//! or 128: one pass up to 1024 keys, two beyond), whose float operations the rows kernels repeat
//! in their order; since that copies another library's arithmetic, each process checks it once
//! per element type and head size against MLX's own call, for short and long rows, before any
//! batch trusts it. A libmlx that rounds otherwise keeps the call per row.

use std::f64::consts::LOG2_E;

use mlx::{fast, ops, random, Array, Dtype, Result};

use crate::cache::RowsKv;
use crate::model::kernel_checks::KernelChecks;

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

/// The rounding found per (element type, head_dim), once per process.
static CHECKS: KernelChecks<(Dtype, i32), Rounding> = KernelChecks::new(
    "one-call batch attention (element type, head_dim)",
    "batch rows attend with a call each",
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
    let fits = mlx::default_is_cuda()
        && matches!(head_dim, 64 | 96 | 128)
        && kv.keys.dim(3) == head_dim
        && kv.values.dim(3) == head_dim
        && q.dim(1) % kv.keys.dim(1) == 0
        && matches!(dtype, Dtype::Float32 | Dtype::Float16 | Dtype::Bfloat16)
        && kv.keys.dtype() == dtype;
    if !fits {
        return None;
    }
    rounding(dtype, head_dim).map(|(one, two)| OneCall {
        scales_log2: (one.times(scale), two.times(scale)),
        two_pass: kv.query_extents.iter().any(|&e| e > 1024),
    })
}

/// Whether the rows kernels matched MLX's call on this process's libmlx for `dtype` and
/// `head_dim` (checked on the first ask).
pub fn verified(dtype: Dtype, head_dim: i32) -> bool {
    rounding(dtype, head_dim).is_some()
}

fn rounding(dtype: Dtype, head_dim: i32) -> Option<Rounding> {
    CHECKS.outcome((dtype, head_dim), || find_rounding(dtype, head_dim))
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
    Ok(together.to_bytes()? == alone.to_bytes()?)
}
