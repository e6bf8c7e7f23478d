//! When a lone-row product may compute all its rows in one call that loads each weight row
//! once for up to 8 rows (`mlx::fast::rows_gemv`, `mlx::fast::rows_qmv`), rather than through
//! MLX's own calls, which read the whole weight once per row: a 32-row step of the 0.6B bf16
//! shape spent 11 ms reading its weights 32 times on an H100, and an 8-row step of the 4B 4-bit
//! shape 24.5 ms (docs/gpu-rows.md). The calls repeat the float operations of MLX's gemv and
//! qmv, another library's arithmetic, so each process checks them once per operand types and
//! shape, on the weight at hand, against MLX's own one-row product before any batch trusts
//! them; a libmlx that computes otherwise keeps the slower forms.

use std::collections::HashMap;
use std::sync::Mutex;

use mlx::{fast, ops, random, Array, Dtype, Result};

/// How each kernel splits its work (rows per weight load, loads in flight), the fastest of
/// those timed on an H100 over the 0.6B bf16 and 4B 4-bit shapes' products at 8 and 32 rows
/// (docs/gpu-rows.md).
const DENSE_TILING: fast::RowTiling = fast::RowTiling { rows: 8, ahead: 4 };
const PACKED_TILING: fast::RowTiling = fast::RowTiling { rows: 8, ahead: 4 };

/// Rows the check multiplies: more than the kernels take per load, so that a second group of
/// rows, and one cut short, are checked too.
const CHECKED_ROWS: i32 = 11;

/// What a check covered: element type, K, N, and for a packed weight its group size and bits.
type Shape = (Dtype, i32, i32, Option<(i32, i32)>);

/// Whether the check passed, per shape, once per process.
static CHECKED: Mutex<Option<HashMap<Shape, bool>>> = Mutex::new(None);

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

fn float_type(dtype: Dtype) -> bool {
    matches!(dtype, Dtype::Float32 | Dtype::Float16 | Dtype::Bfloat16)
}

/// `x @ w.T` for `x` (rows, K) and a row-major weight `w` (N, K) in one call, where that gives
/// every row the bits of its lone product; None where it may not (not CUDA, another element
/// type, or the check failed).
pub fn dense(x: &Array, w: &Array) -> Result<Option<Array>> {
    let fits = mlx::default_is_cuda() && float_type(x.dtype()) && w.dtype() == x.dtype();
    let shape = (x.dtype(), w.dim(1), w.dim(0), None);
    if !fits
        || !verified(shape, || {
            matches_lone_products(x.dtype(), w.dim(1), w, None)
        })
    {
        return Ok(None);
    }
    Ok(Some(fast::rows_gemv(x, w, elements_per_lane(w.dim(1)), DENSE_TILING)?))
}

/// An affine-quantized weight as `quantized_matmul` takes it (transposed).
pub struct Packed<'a> {
    pub weight: &'a Array,
    pub scales: &'a Array,
    pub biases: &'a Array,
    pub group_size: i32,
    pub bits: i32,
}

impl Packed<'_> {
    fn product(&self, x: &Array) -> Result<Array> {
        fast::rows_qmv(
            x,
            self.weight,
            self.scales,
            self.biases,
            self.group_size,
            self.bits,
            PACKED_TILING,
        )
    }

    fn lone_product(&self, row: &Array) -> Result<Array> {
        ops::quantized_matmul(
            row,
            self.weight,
            self.scales,
            Some(self.biases),
            true,
            self.group_size,
            self.bits,
            "affine",
        )
    }
}

/// `quantized_matmul(x, w, ...)` for `x` (rows, K) in one call, where that gives every row the
/// bits of its lone product; None where it may not (not CUDA, 4 or 8 bits, group size 32, 64 or
/// 128 and K a multiple of 16, or the check failed).
pub fn quantized(x: &Array, w: &Packed) -> Result<Option<Array>> {
    let k = x.dim(1);
    let fits = mlx::default_is_cuda()
        && float_type(x.dtype())
        && w.scales.dtype() == x.dtype()
        && w.biases.dtype() == x.dtype()
        && matches!(w.bits, 4 | 8)
        && matches!(w.group_size, 32 | 64 | 128)
        && k % 16 == 0;
    let shape = (x.dtype(), k, w.weight.dim(0), Some((w.group_size, w.bits)));
    if !fits
        || !verified(shape, || {
            matches_lone_products(x.dtype(), k, w.weight, Some(w))
        })
    {
        return Ok(None);
    }
    Ok(Some(w.product(x)?))
}

/// Whether the check for `shape` passed, running it the first time.
fn verified(shape: Shape, check: impl FnOnce() -> Result<bool>) -> bool {
    let mut checked = CHECKED.lock().unwrap_or_else(|e| e.into_inner());
    let checked = checked.get_or_insert_with(HashMap::new);
    if let Some(&found) = checked.get(&shape) {
        return found;
    }
    // A kernel that does not build or run here is one that does not match.
    let found = check().unwrap_or_else(|e| {
        tracing::warn!("a one-call lone-row product failed on this libmlx: {e}");
        false
    });
    if !found {
        tracing::warn!(
            "the one-call lone-row product differs from MLX's one-row kernel for {:?} at K {} \
             N {} (quantized as {:?}): batch rows keep MLX's own calls",
            shape.0,
            shape.1,
            shape.2,
            shape.3
        );
    }
    checked.insert(shape, found);
    found
}

/// Whether random rows times the weight through the rows kernel get the bits of each row's
/// own product, as a lone decode step computes it: `w` dense, or the packed weight `packed`.
fn matches_lone_products(dtype: Dtype, k: i32, w: &Array, packed: Option<&Packed>) -> Result<bool> {
    let x = random::normal(&[CHECKED_ROWS, k], Dtype::Float32, &random::key(7)?)?.astype(dtype)?;
    let wt = w.transpose(&[1, 0])?;
    let (together, alone) = match packed {
        Some(p) => (p.product(&x)?, rows_alone(&x, |row| p.lone_product(row))?),
        None => (
            fast::rows_gemv(&x, w, elements_per_lane(k), DENSE_TILING)?,
            rows_alone(&x, |row| row.matmul(&wt))?,
        ),
    };
    Ok(together.to_bytes()? == alone.to_bytes()?)
}

/// `x`'s rows each through `product` alone, stacked again.
fn rows_alone(x: &Array, product: impl Fn(&Array) -> Result<Array>) -> Result<Array> {
    let alone = (0..x.dim(0))
        .map(|r| product(&x.slice_axis(0, r, r + 1)?))
        .collect::<Result<Vec<_>>>()?;
    ops::concatenate(&alone.iter().collect::<Vec<_>>(), 0)
}
