//! When a lone-row dense product may compute all its rows in one call that loads each weight
//! row once for up to 8 rows (`mlx::fast::rows_gemv`), rather than through the batched gemv,
//! which reads the whole weight once per row: a 32-row step of the 0.6B bf16 shape spent 11 ms
//! reading its weights 32 times on an H100 (docs/gpu-rows.md). The call repeats the float
//! operations of MLX's gemv, another library's arithmetic, so each process checks it once per
//! element type and shape, on the weight at hand, against MLX's own one-row product before any
//! batch trusts it; a libmlx that computes otherwise keeps the batched gemv.

use std::collections::HashMap;
use std::sync::Mutex;

use mlx::{fast, ops, random, Array, Dtype, Result};

/// Rows the check multiplies: more than the 8 the kernel takes at once, so that its second
/// group of rows is checked too.
const CHECKED_ROWS: i32 = 11;

/// Whether the check passed, per (element type, K, N).
type Checked = HashMap<(Dtype, i32, i32), bool>;

/// The check's outcome, once per process and shape.
static CHECKED: Mutex<Option<Checked>> = Mutex::new(None);

/// The elements each lane takes per step in MLX's gemv for rows K wide (aligned operands).
fn elements_per_lane(k: i32) -> i32 {
    if k % 128 == 0 {
        4
    } else if k % 64 == 0 {
        2
    } else {
        1
    }
}

/// `x @ w.T` for `x` (rows, K) and a row-major weight `w` (N, K) in one call, where that gives
/// every row the bits of its lone product; None where it may not (not CUDA, another element
/// type, or the check failed).
pub fn product(x: &Array, w: &Array) -> Result<Option<Array>> {
    let dtype = x.dtype();
    let fits = mlx::default_is_cuda()
        && matches!(dtype, Dtype::Float32 | Dtype::Float16 | Dtype::Bfloat16)
        && w.dtype() == dtype;
    if !fits || !verified(x, w) {
        return Ok(None);
    }
    Ok(Some(fast::rows_gemv(x, w, elements_per_lane(w.dim(1)))?))
}

fn verified(x: &Array, w: &Array) -> bool {
    let key = (x.dtype(), w.dim(1), w.dim(0));
    let mut checked = CHECKED.lock().unwrap_or_else(|e| e.into_inner());
    let checked = checked.get_or_insert_with(HashMap::new);
    if let Some(&found) = checked.get(&key) {
        return found;
    }
    // A kernel that does not build or run here is one that does not match.
    let found = matches_lone_products(x.dtype(), w).unwrap_or_else(|e| {
        tracing::warn!("the one-call lone-row product failed on this libmlx: {e}");
        false
    });
    if !found {
        tracing::warn!(
            "the one-call lone-row product differs from MLX's gemv for {:?} at K {} N {}: \
             batch rows keep the batched gemv",
            key.0,
            key.1,
            key.2
        );
    }
    checked.insert(key, found);
    found
}

/// Whether random rows times `w` through the rows kernel get the bits of each row's own
/// product, as a lone decode step computes it.
fn matches_lone_products(dtype: Dtype, w: &Array) -> Result<bool> {
    let k = w.dim(1);
    let x = random::normal(&[CHECKED_ROWS, k], Dtype::Float32, &random::key(7)?)?.astype(dtype)?;
    let together = fast::rows_gemv(&x, w, elements_per_lane(k))?;
    let wt = w.transpose(&[1, 0])?;
    let alone = (0..CHECKED_ROWS)
        .map(|r| x.slice_axis(0, r, r + 1)?.matmul(&wt))
        .collect::<Result<Vec<_>>>()?;
    let alone = ops::concatenate(&alone.iter().collect::<Vec<_>>(), 0)?;
    Ok(together.to_bytes()? == alone.to_bytes()?)
}
