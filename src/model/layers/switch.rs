//! mlx-lm's switch_layers.py: SwitchLinear (one weight matrix per expert; each token is
//! multiplied by the matrices of the experts it picked, through `gather_mm` or `gather_qmm`) and
//! SwitchGLU over three of them, with the sort by expert that mlx-lm does for many tokens.

use mlx::{ops, Array, Dtype, Result};

use super::multi_linear::Stacked;
use super::Activation;
use crate::load::{LoadError, LoadResult, QuantConfig, Weights};

/// SwitchGLU sorts the (token, expert) pairs by expert once there are this many
/// (`indices.size >= 64`); fewer are gathered in token order.
const SORT_FROM: usize = 64;

/// switch_layers.SwitchLinear / QuantizedSwitchLinear without a bias (SwitchGLU's default).
pub struct SwitchLinear {
    weights: Stacked,
}

impl SwitchLinear {
    /// Loads `<path>.weight` (experts x out_dims x in_dims, or its packed form with `.scales` and
    /// `.biases`), each shape checked against the config.
    pub fn load(
        w: &mut Weights,
        q: &QuantConfig,
        path: &str,
        experts: i32,
        in_dims: i32,
        out_dims: i32,
    ) -> LoadResult<SwitchLinear> {
        let weights = Stacked::load(w, q, path, (experts, out_dims, in_dims))?;
        if let Stacked::Dense(weight) = &weights {
            // MLX's CPU gather_mm computes float32 only; anything else fails at the first
            // forward, deep in a generation, with MLX's bare "Currently only supports float32".
            if mlx::default_device() == mlx::Device::Cpu && weight.dtype() != Dtype::Float32 {
                return Err(LoadError::TensorDtype {
                    folder: w.folder().to_path_buf(),
                    key: format!("{path}.weight"),
                    dtype: format!("{:?}", weight.dtype()),
                    allowed: "float32 on the CPU, whose gather_mm computes float32 only (run \
                              on a GPU, or convert or quantize the model)",
                });
            }
        }
        Ok(SwitchLinear { weights })
    }

    /// `x` (..., 1, in_dims) times the matrix of expert `indices[...]`, broadcasting `x`'s batch
    /// axes against the indices'; `sorted` tells MLX the indices ascend.
    pub fn forward(&self, x: &Array, indices: &Array, sorted: bool) -> Result<Array> {
        match &self.weights {
            Stacked::Dense(w) => ops::gather_mm(x, &w.transpose(&[0, 2, 1])?, indices, sorted),
            Stacked::Packed {
                weight,
                scales,
                biases,
                params,
            } => ops::gather_qmm(
                x,
                weight,
                scales,
                biases.as_ref(),
                indices,
                true,
                params.group_size,
                params.bits,
                &params.mode,
                sorted,
            ),
        }
    }
}

/// switch_layers.SwitchGLU: `down(act(gate(x), up(x)))` per picked expert, SwiGLU unless the
/// model passes another activation (gemma4_text's GeGLU).
pub struct SwitchGlu {
    pub gate_proj: SwitchLinear,
    pub up_proj: SwitchLinear,
    pub down_proj: SwitchLinear,
    pub activation: Activation,
}

impl SwitchGlu {
    /// Loads `<path>.{gate,up,down}_proj` for `experts` experts of `hidden` units over `dims`.
    pub fn load(
        w: &mut Weights,
        q: &QuantConfig,
        path: &str,
        dims: i32,
        hidden: i32,
        experts: i32,
    ) -> LoadResult<SwitchGlu> {
        let proj = |w: &mut Weights, name: &str, i: i32, o: i32| {
            SwitchLinear::load(w, q, &format!("{path}.{name}"), experts, i, o)
        };
        Ok(SwitchGlu {
            gate_proj: proj(w, "gate_proj", dims, hidden)?,
            up_proj: proj(w, "up_proj", dims, hidden)?,
            down_proj: proj(w, "down_proj", hidden, dims)?,
            activation: Activation::Swiglu,
        })
    }

    /// Every token of `x` (..., dims) through each of its experts `indices` (..., k): returns
    /// (..., k, dims), SwitchGLU.__call__ op for op.
    pub fn forward(&self, x: &Array, indices: &Array) -> Result<Array> {
        let mut x = x.expand_dims(&[-2, -3])?;
        let indices = indices.stop_gradient()?;
        let do_sort = indices.size() >= SORT_FROM;
        let mut idx = indices.clone();
        let mut inv_order = None;
        if do_sort {
            (x, idx, inv_order) = gather_sort(&x, &indices)?;
        }
        let x_up = self.up_proj.forward(&x, &idx, do_sort)?;
        let x_gate = self.gate_proj.forward(&x, &idx, do_sort)?;
        let mut x =
            self.down_proj
                .forward(&self.activation.apply(&x_gate, &x_up)?, &idx, do_sort)?;
        if let Some(inv_order) = inv_order {
            x = scatter_unsort(&x, &inv_order, &indices.shape())?;
        }
        x.squeeze(&[-2])
    }
}

/// switch_layers._gather_sort: the (token, expert) pairs in expert order, each with its token's
/// row of `x`, and the permutation that restores token order.
fn gather_sort(x: &Array, indices: &Array) -> Result<(Array, Array, Option<Array>)> {
    let m = indices.dim(-1);
    let indices = indices.flatten(0, -1)?;
    let order = ops::argsort(&indices, -1)?;
    let inv_order = ops::argsort(&order, -1)?;
    let rows = order.floor_divide(&Array::scalar_int(i64::from(m), order.dtype())?)?;
    Ok((
        x.flatten(0, -3)?.take(&rows, 0)?,
        indices.take(&order, 0)?,
        Some(inv_order),
    ))
}

/// switch_layers._scatter_unsort: rows back in token order, the leading axis unflattened to
/// the indices' `shape`.
fn scatter_unsort(x: &Array, inv_order: &Array, shape: &[i32]) -> Result<Array> {
    let x = x.take(inv_order, 0)?;
    let mut unflattened = shape.to_vec();
    unflattened.extend(&x.shape()[1..]);
    x.reshape(&unflattened)
}
