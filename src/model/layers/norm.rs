//! RMSNorm (with Gemma's `1 + weight` variant) and where a model applies it to queries and
//! keys.

use mlx::{fast, Array, Result};

use crate::load::{LoadError, LoadResult, Weights};

/// mlx.nn.RMSNorm; Gemma's variant scales by `1 + weight`, folded in at load (the same bits
/// Python computes on every call).
pub struct RmsNorm {
    weight: Array,
    eps: f32,
}

impl RmsNorm {
    pub fn load(w: &mut Weights, path: &str, dims: i32, eps: f64) -> LoadResult<RmsNorm> {
        Ok(RmsNorm {
            weight: w.take_shaped(&format!("{path}.weight"), &[dims])?,
            eps: eps as f32,
        })
    }

    /// Gemma's RMSNorm: `rms_norm(x, 1.0 + weight, eps)`.
    pub fn load_offset(w: &mut Weights, path: &str, dims: i32, eps: f64) -> LoadResult<RmsNorm> {
        Self::load(w, path, dims, eps)?.plus_one(w)
    }

    /// This norm with `1 + weight` as its weight (Gemma's variant).
    pub fn plus_one(self, w: &Weights) -> LoadResult<RmsNorm> {
        let weight = self
            .weight
            .add_scalar(1.0)
            .map_err(|source| LoadError::Mlx {
                folder: w.folder().into(),
                source,
            })?;
        Ok(RmsNorm { weight, ..self })
    }

    pub fn forward(&self, x: &Array) -> Result<Array> {
        fast::rms_norm(x, Some(&self.weight), self.eps)
    }
}

/// Where a model applies its per-head query/key RMSNorm.
pub enum QkNorm {
    None,
    /// On (B, L, H, D), before the head transpose (qwen3).
    BeforeTranspose {
        q: RmsNorm,
        k: RmsNorm,
    },
    /// On (B, H, L, D), after it (gemma3).
    AfterTranspose {
        q: RmsNorm,
        k: RmsNorm,
    },
}
