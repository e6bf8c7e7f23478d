//! Gemma 4's RoPE per layer kind (mlx_lm/models/gemma4_text.py, `initialize_rope` with its
//! ProportionalRoPE): the text model's layers and the assistant drafter's share it.

use mlx::fast::{self, RopeFreqs};
use mlx::{Array, Dtype};
use serde_json::Value;

use super::layers::Rope;

/// A layer's RoPE: nn.RoPE for the "default" and "linear" types, mlx-lm's ProportionalRoPE
/// (precomputed frequencies, the unrotated tail at infinity) for "proportional".
pub(crate) enum LayerRope {
    Plain(Rope),
    Proportional {
        dims: i32,
        traditional: bool,
        freqs: Array,
    },
}

impl LayerRope {
    /// initialize_rope(head_dim, traditional, rope_theta, params) for one layer type.
    pub(crate) fn new(
        dims: i32,
        traditional: bool,
        params: &Value,
    ) -> std::result::Result<LayerRope, String> {
        let base = params
            .get("rope_theta")
            .map_or(Some(10000.0), Value::as_f64)
            .ok_or("rope_theta must be a number")?;
        let kind = params
            .get("type")
            .or_else(|| params.get("rope_type"))
            .and_then(Value::as_str);
        if kind != Some("proportional") {
            return Rope::new(dims, base, traditional, Some(params)).map(LayerRope::Plain);
        }
        let number = |key: &str| {
            params
                .get(key)
                .map_or(Some(1.0), Value::as_f64)
                .ok_or(format!("{key} must be a number"))
        };
        let (factor, partial) = (number("factor")?, number("partial_rotary_factor")?);
        let rotated = (f64::from(dims) * partial) as i32;
        if !(0..=dims).contains(&rotated) {
            return Err(format!(
                "partial_rotary_factor is {partial}, must be between 0 and 1"
            ));
        }
        let freqs = proportional_freqs(dims, rotated, base as f32, factor as f32)
            .map_err(|e| e.to_string())?;
        Ok(LayerRope::Proportional {
            dims,
            traditional,
            freqs,
        })
    }

    /// `rope(x, offset=mx.array(cache.offset))`.
    pub(crate) fn forward(&self, x: &Array, offset: usize) -> mlx::Result<Array> {
        match self {
            LayerRope::Plain(rope) => rope.forward(x, offset),
            LayerRope::Proportional {
                dims,
                traditional,
                freqs,
            } => fast::rope(
                x,
                *dims,
                *traditional,
                RopeFreqs::Freqs(freqs),
                1.0,
                offset as i32,
            ),
        }
    }
}

/// ProportionalRoPE's `_freqs`: `factor * base ** (arange(0, rotated, 2) / dims)`, then
/// `(dims - rotated) // 2` infinities (those pairs never rotate), all f32.
fn proportional_freqs(dims: i32, rotated: i32, base: f32, factor: f32) -> mlx::Result<Array> {
    let exponents = Array::arange(0.0, f64::from(rotated), 2.0, Dtype::Float32)?
        .divide(&Array::from_f32(dims as f32))?;
    let rotating = Array::from_f32(base)
        .power(&exponents)?
        .multiply_scalar(factor)?;
    let still = Array::full(
        &[(dims - rotated) / 2],
        &Array::from_f32(f32::INFINITY),
        Dtype::Float32,
    )?;
    mlx::ops::concatenate(&[&rotating, &still], 0)
}
