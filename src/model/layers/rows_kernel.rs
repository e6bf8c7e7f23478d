//! When a batch step may attend all its rows in one CUDA kernel (`mlx::fast::rows_attention`)
//! rather than with a call per row: only where that kernel gives every row the bits of the call
//! its lone step makes. A lone one-query step on CUDA runs MLX's one-pass vector kernel (head_dim
//! 64, 96 or 128, at most 1024 keys), whose float operations the kernel repeats in their order;
//! since that is a copy of another library's arithmetic, each process checks it once per element
//! type and head size against MLX's own call before any batch trusts it, and a libmlx that rounds
//! otherwise keeps the call per row.

use std::collections::HashMap;
use std::sync::Mutex;

use mlx::{fast, ops, random, Array, Device, Dtype, Result};

/// The check's outcome per (element type, head_dim), once per process.
static CHECKED: Mutex<Option<HashMap<(Dtype, i32), bool>>> = Mutex::new(None);

/// Whether the one kernel gives each of `extents`' rows (keys after this step's write) of
/// queries `q` (rows, heads, 1, head_dim) its lone call's bits.
pub fn usable(q: &Array, extents: &[usize]) -> Result<bool> {
    let (dtype, head_dim) = (q.dtype(), q.dim(3));
    let shape_fits = mlx::default_device() == Device::Gpu
        && Device::Gpu.name() == "cuda"
        && matches!(head_dim, 64 | 96 | 128)
        && matches!(dtype, Dtype::Float32 | Dtype::Float16 | Dtype::Bfloat16)
        && extents.iter().all(|&e| e <= 1024);
    if !shape_fits {
        return Ok(false);
    }
    verified(dtype, head_dim)
}

/// Whether the kernel matched MLX's call on this process's libmlx for `dtype` and `head_dim`
/// (checked on the first ask).
pub fn verified(dtype: Dtype, head_dim: i32) -> Result<bool> {
    let mut checked = CHECKED.lock().unwrap_or_else(|e| e.into_inner());
    let checked = checked.get_or_insert_with(HashMap::new);
    if let Some(&ok) = checked.get(&(dtype, head_dim)) {
        return Ok(ok);
    }
    let ok = matches_lone_calls(dtype, head_dim)?;
    if !ok {
        tracing::warn!(
            "the one-kernel batch attention differs from MLX's own call for {dtype:?} at head_dim \
             {head_dim}: batch rows attend with a call each"
        );
    }
    checked.insert((dtype, head_dim), ok);
    Ok(ok)
}

/// Three rows of random keys (extents 1, 37 and 300; two query heads per KV head) through the
/// kernel and through one scaled_dot_product_attention call each, compared bit for bit.
fn matches_lone_calls(dtype: Dtype, head_dim: i32) -> Result<bool> {
    let normal = |shape: &[i32], seed: u64| -> Result<Array> {
        random::normal(shape, Dtype::Float32, &random::key(seed)?)?.astype(dtype)
    };
    let extents = [1, 37, 300];
    let rows = extents.len() as i32;
    let q = normal(&[rows, 2, 1, head_dim], 1)?;
    let keys = normal(&[rows, 1, 512, head_dim], 2)?;
    let values = normal(&[rows, 1, 512, head_dim], 3)?;
    let scale = (head_dim as f64).powf(-0.5) as f32;
    let together = fast::rows_attention(
        &q,
        &keys,
        &values,
        &Array::from_slice(&[0, 1, 2], &[rows])?,
        &Array::from_slice(&extents, &[rows])?,
        scale,
    )?;
    let alone = extents
        .iter()
        .enumerate()
        .map(|(r, &e)| {
            let own = |a: &Array| a.slice_axis(0, r as i32, r as i32 + 1)?.slice_axis(2, 0, e);
            fast::scaled_dot_product_attention(
                &q.slice_axis(0, r as i32, r as i32 + 1)?,
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
