//! Rotary position embeddings, built from config.json's rope settings.

use mlx::fast::{self, RopeFreqs};
use mlx::{Array, Result};
use serde_json::Value;

/// nn.RoPE as mlx-lm's initialize_rope builds it for the "default" and "linear" types.
#[derive(Clone, Copy, Debug)]
pub struct Rope {
    dims: i32,
    traditional: bool,
    base: f32,
    scale: f32,
}

impl Rope {
    /// `scaling` is config.json's rope_scaling (or rope_parameters) object, if any.
    pub fn new(
        dims: i32,
        base: f64,
        traditional: bool,
        scaling: Option<&Value>,
    ) -> std::result::Result<Rope, String> {
        if !(base.is_finite() && base > 0.0) {
            return Err(format!(
                "the RoPE base (rope_theta) is {base}, must be a finite number > 0"
            ));
        }
        if dims < 1 {
            return Err(format!(
                "the RoPE dimensions are {dims} (head_dim x partial_rotary_factor), must be at \
                 least 1"
            ));
        }
        let kind = scaling
            .and_then(|s| s.get("type").or_else(|| s.get("rope_type")))
            .and_then(Value::as_str)
            .unwrap_or("default");
        let scale = match kind {
            // mlx-lm applies mrope as a plain RoPE: exact for text-only positions.
            "default" | "mrope" => 1.0,
            "linear" => {
                let factor = scaling
                    .and_then(|s| s.get("factor"))
                    .and_then(Value::as_f64)
                    .ok_or("linear rope scaling needs a factor")?;
                (1.0 / factor) as f32
            }
            other => return Err(format!("RoPE scaling type {other:?} is not supported yet")),
        };
        Ok(Rope {
            dims,
            traditional,
            base: base as f32,
            scale,
        })
    }

    /// [`Rope::forward`] for a batch of rows `x` (B, heads, L, D), row b at `offsets[b]`
    /// (int32, (B,)): each row gets the bits it gets alone.
    pub fn forward_at(&self, x: &Array, offsets: &Array) -> Result<Array> {
        fast::rope_at(
            x,
            self.dims,
            self.traditional,
            RopeFreqs::Base(self.base),
            self.scale,
            offsets,
        )
    }

    /// `mx.fast.rope(x, dims, traditional, base, scale, offset)`.
    pub fn forward(&self, x: &Array, offset: usize) -> Result<Array> {
        fast::rope(
            x,
            self.dims,
            self.traditional,
            RopeFreqs::Base(self.base),
            self.scale,
            offset as i32,
        )
    }
}
