//! The weight matrix in its dense, transposed and packed forms, and mlx.nn.Linear over it;
//! the weight is shared with the embedding table, which is stored the same way.

use mlx::{ops, Array, Dtype, Result};

use crate::load::{LoadError, LoadResult, QuantConfig, QuantParams, Weights};
use crate::model::lone_rows;

/// A quantized weight: packed values plus per-group scales (and biases in affine mode).
pub(super) struct Packed {
    pub(super) weight: Array,
    pub(super) scales: Array,
    pub(super) biases: Option<Array>,
    pub(super) params: QuantParams,
}

impl Packed {
    /// `mx.quantized_matmul(x, w, scales, biases, transpose=True, group_size, bits, mode)`;
    /// each row by the one-row kernel inside a lone-row forward ([`lone_rows`]).
    fn matmul(&self, x: &Array) -> Result<Array> {
        let p = &self.params;
        if lone_rows::active() && lone_rows::rows(x) > 1 {
            return lone_rows::quantized(
                x,
                &self.weight,
                &self.scales,
                self.biases.as_ref(),
                p.group_size,
                p.bits,
                &p.mode,
                self.weight.dim(0),
            );
        }
        ops::quantized_matmul(
            x,
            &self.weight,
            &self.scales,
            self.biases.as_ref(),
            true,
            p.group_size,
            p.bits,
            &p.mode,
        )
    }
}

/// A (rows x cols) weight matrix: dense as stored, dense transposed, or packed by mlx-lm's
/// quantization.
///
/// Transposed: on a CPU whose matmul is the reference BLAS (the Linux wheels), `x @ w.T` runs
/// the dot-product form of `sgemm`, one dependent addition chain per output, while `x @ t` with
/// `t = w.T` made contiguous runs the axpy form, whose additions are independent: the same sums
/// in the same order (bit-identical, [`mlx::CPU_MATMUL_IS_REFERENCE_BLAS`]) in 0.5-0.75x the
/// time. Only f32 qualifies (MLX's other CPU float matmuls are its own kernels), and only
/// without a bias (`addmm` adds the bias first in one form and last in the other).
pub(super) enum Weight {
    Dense(Array),
    Transposed(Array),
    Packed(Packed),
}

impl Weight {
    /// Loads `<path>.weight` (rows x cols), or its packed form when the quantization config
    /// says the module at `path` is quantized; `transposable` allows the transposed form.
    pub(super) fn load(
        w: &mut Weights,
        q: &QuantConfig,
        path: &str,
        (rows, cols): (i32, i32),
        transposable: bool,
    ) -> LoadResult<Weight> {
        Ok(match q.for_module(path, cols, w)? {
            Some(params) => Weight::Packed(Packed {
                weight: w.take(&format!("{path}.weight"))?,
                scales: w.take(&format!("{path}.scales"))?,
                biases: w.take_optional(&format!("{path}.biases")),
                params,
            }),
            None => {
                let dense = w.take_shaped(&format!("{path}.weight"), &[rows, cols])?;
                if transposable && transposing_pays(&dense) {
                    Weight::Transposed(transposed(w, &dense)?)
                } else {
                    Weight::Dense(dense)
                }
            }
        })
    }

    /// `x @ weight.T`; each row by the one-row kernel inside a lone-row forward
    /// ([`lone_rows`]; the transposed form exists on the CPU only).
    pub(super) fn matmul_t(&self, x: &Array) -> Result<Array> {
        match self {
            Weight::Dense(w) if lone_rows::active() && lone_rows::rows(x) > 1 => {
                lone_rows::dense(x, &w.transpose(&[])?)
            }
            Weight::Dense(w) => x.matmul(&w.transpose(&[])?),
            Weight::Transposed(t) => x.matmul(t),
            Weight::Packed(p) => p.matmul(x),
        }
    }

    /// The (rows x cols) shape of the matrix as stored.
    pub(super) fn stored_shape(&self) -> (usize, usize) {
        let (r, c) = match self {
            Weight::Dense(w) => (w.dim(0), w.dim(1)),
            Weight::Transposed(t) => (t.dim(1), t.dim(0)),
            Weight::Packed(p) => (p.weight.dim(0), p.weight.dim(1) * 32 / p.params.bits),
        };
        (r as usize, c as usize)
    }

    /// Dense weights stacked on the rows axis (the fused projection some Python modules build):
    /// transposed when all of them are, else as stored. `None` when any is packed.
    fn stack_rows(weights: &[&Weight]) -> Option<Result<Weight>> {
        let transposed: Option<Vec<&Array>> = weights
            .iter()
            .map(|w| match w {
                Weight::Transposed(t) => Some(t),
                _ => None,
            })
            .collect();
        if let Some(t) = transposed {
            return Some(ops::concatenate(&t, 1).map(Weight::Transposed));
        }
        let rows: Vec<Result<Array>> = weights
            .iter()
            .map(|w| match w {
                Weight::Dense(a) => Some(Ok(a.clone())),
                Weight::Transposed(t) => Some(t.transpose(&[])),
                Weight::Packed(_) => None,
            })
            .collect::<Option<_>>()?;
        Some(
            rows.into_iter()
                .collect::<Result<Vec<_>>>()
                .and_then(|rows| {
                    ops::concatenate(&rows.iter().collect::<Vec<_>>(), 0).map(Weight::Dense)
                }),
        )
    }
}

/// Whether `dense` is an f32 matrix on a reference-BLAS CPU, where the transposed form is the
/// faster one ([`Weight`]).
fn transposing_pays(dense: &Array) -> bool {
    mlx::CPU_MATMUL_IS_REFERENCE_BLAS
        && dense.dtype() == Dtype::Float32
        && mlx::default_device() == mlx::Device::Cpu
}

/// `dense.T` made contiguous and evaluated now, so that `dense` is freed at once rather than
/// held beside its copy until the first forward pass.
fn transposed(w: &Weights, dense: &Array) -> LoadResult<Array> {
    let copy = || -> Result<Array> {
        let t = dense.transpose(&[])?.contiguous()?;
        mlx::eval([&t])?;
        Ok(t)
    };
    copy().map_err(|source| LoadError::Mlx {
        folder: w.folder().into(),
        source,
    })
}

/// mlx.nn.Linear / QuantizedLinear.
pub struct Linear {
    weight: Weight,
    bias: Option<Array>,
}

impl Linear {
    /// Loads `<path>.weight` (out_dims x in_dims, or its packed form) and `<path>.bias`.
    pub fn load(
        w: &mut Weights,
        q: &QuantConfig,
        path: &str,
        in_dims: i32,
        out_dims: i32,
        bias: bool,
    ) -> LoadResult<Linear> {
        let weight = Weight::load(w, q, path, (out_dims, in_dims), !bias)?;
        let bias = if bias {
            Some(w.take_shaped(&format!("{path}.bias"), &[out_dims])?)
        } else {
            None
        };
        Ok(Linear { weight, bias })
    }

    /// Several bias-free projections of the same input as one: their weights stacked on the
    /// output axis (as some Python modules fuse them). `None` when any is quantized.
    pub fn stacked(linears: &[&Linear]) -> Option<Result<Linear>> {
        let weights: Vec<&Weight> = linears.iter().map(|l| &l.weight).collect();
        Some(Weight::stack_rows(&weights)?.map(|weight| Linear { weight, bias: None }))
    }

    pub fn forward(&self, x: &Array) -> Result<Array> {
        if let (Weight::Dense(_), Some(_)) = (&self.weight, &self.bias) {
            if lone_rows::active() && lone_rows::rows(x) > 1 {
                return self.forward_each_row(x);
            }
        }
        Ok(match (&self.weight, &self.bias) {
            (Weight::Dense(w), Some(b)) => ops::addmm(b, x, &w.transpose(&[])?, 1.0, 1.0)?,
            (Weight::Packed(p), Some(b)) => p.matmul(x)?.add(b)?,
            // Never loaded (a bias keeps the stored form), but kept exact rather than dropped.
            (Weight::Transposed(t), Some(b)) => ops::addmm(b, x, t, 1.0, 1.0)?,
            (weight, None) => weight.matmul_t(x)?,
        })
    }

    /// A dense projection with a bias, one `addmm` per row (the one-token step's call): the
    /// batched gemv has no bias form.
    fn forward_each_row(&self, x: &Array) -> Result<Array> {
        let k = x.dim(-1);
        let flat = x.reshape(&[lone_rows::rows(x), 1, k])?;
        let parts = (0..flat.dim(0))
            .map(|r| self.forward(&flat.slice_axis(0, r, r + 1)?))
            .collect::<Result<Vec<_>>>()?;
        let out = ops::concatenate(&parts.iter().collect::<Vec<_>>(), 0)?;
        let mut shape = x.shape();
        *shape.last_mut().expect("a matrix operand") = out.dim(-1);
        out.reshape(&shape)
    }
}
