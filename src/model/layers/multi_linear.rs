//! A stack of weight matrices, one per head or per expert, as stored or packed by mlx-lm's
//! quantization, and mlx_lm/models/mla.py's MultiLinear over it (MLA's per-head projections
//! in and out of the latent KV; SwitchLinear stacks its experts the same way).

use mlx::{ops, Array, Result};

use crate::load::{LoadResult, QuantConfig, QuantParams, Weights};

/// (count, out_dims, in_dims) matrices, dense or packed along `in_dims`.
pub(super) enum Stacked {
    Dense(Array),
    Packed {
        weight: Array,
        scales: Array,
        biases: Option<Array>,
        params: QuantParams,
    },
}

impl Stacked {
    /// Loads `<path>.weight` (count x out_dims x in_dims, or its packed form with `.scales`
    /// and `.biases`), each shape checked against the config.
    pub(super) fn load(
        w: &mut Weights,
        q: &QuantConfig,
        path: &str,
        (count, out_dims, in_dims): (i32, i32, i32),
    ) -> LoadResult<Stacked> {
        Ok(match q.for_module(path, in_dims, w)? {
            Some(params) => {
                let groups = [count, out_dims, in_dims / params.group_size];
                let words = [count, out_dims, in_dims * params.bits / 32];
                let biases = if w.contains(&format!("{path}.biases")) {
                    Some(w.take_shaped(&format!("{path}.biases"), &groups)?)
                } else {
                    None
                };
                Stacked::Packed {
                    weight: w.take_shaped(&format!("{path}.weight"), &words)?,
                    scales: w.take_shaped(&format!("{path}.scales"), &groups)?,
                    biases,
                    params,
                }
            }
            None => Stacked::Dense(
                w.take_shaped(&format!("{path}.weight"), &[count, out_dims, in_dims])?,
            ),
        })
    }
}

/// mla.py's MultiLinear / QuantizedMultiLinear: `num_heads` matrices (out_dims x in_dims).
pub struct MultiLinear {
    weights: Stacked,
}

impl MultiLinear {
    /// Loads `<path>.weight` for `heads` heads mapping `in_dims` to `out_dims`.
    pub fn load(
        w: &mut Weights,
        q: &QuantConfig,
        path: &str,
        heads: i32,
        in_dims: i32,
        out_dims: i32,
    ) -> LoadResult<MultiLinear> {
        Ok(MultiLinear {
            weights: Stacked::load(w, q, path, (heads, out_dims, in_dims))?,
        })
    }

    /// `x @ weight.swapaxes(-1, -2)` (`transpose`, in_dims to out_dims) or `x @ weight`
    /// (out_dims to in_dims), the head axis broadcast against `x`'s; `quantized_matmul` with
    /// the same flag when packed.
    pub fn forward(&self, x: &Array, transpose: bool) -> Result<Array> {
        match &self.weights {
            Stacked::Dense(w) if transpose => x.matmul(&w.transpose(&[0, 2, 1])?),
            Stacked::Dense(w) => x.matmul(w),
            Stacked::Packed {
                weight,
                scales,
                biases,
                params,
            } => ops::quantized_matmul(
                x,
                weight,
                scales,
                biases.as_ref(),
                transpose,
                params.group_size,
                params.bits,
                &params.mode,
            ),
        }
    }
}
