//! The sparse mixture-of-experts block of mlx_lm/models/qwen3_moe.py: a linear router, a softmax
//! over the experts, the top k of them per token (optionally renormalised), and the weighted sum
//! of those experts' SwitchGLU outputs.

use mlx::{ops, Array, Result};

use super::{Linear, SwitchGlu};
use crate::load::{LoadResult, QuantConfig, Weights};

/// How a sparse block is shaped, as the family's config gives it (checked by the family).
#[derive(Clone, Copy, Debug)]
pub struct MoeShape {
    pub hidden: i32,
    pub experts: i32,
    pub experts_per_token: i32,
    pub expert_hidden: i32,
    pub norm_topk_prob: bool,
}

/// Qwen3MoeSparseMoeBlock.
pub struct SparseMoe {
    gate: Linear,
    switch_mlp: SwitchGlu,
    top_k: i32,
    norm_topk_prob: bool,
}

impl SparseMoe {
    /// Loads the router `<path>.gate` and the experts `<path>.switch_mlp`.
    pub fn load(
        w: &mut Weights,
        q: &QuantConfig,
        path: &str,
        s: MoeShape,
    ) -> LoadResult<SparseMoe> {
        Ok(SparseMoe {
            gate: Linear::load(w, q, &format!("{path}.gate"), s.hidden, s.experts, false)?,
            switch_mlp: SwitchGlu::load(
                w,
                q,
                &format!("{path}.switch_mlp"),
                s.hidden,
                s.expert_hidden,
                s.experts,
            )?,
            top_k: s.experts_per_token,
            norm_topk_prob: s.norm_topk_prob,
        })
    }

    /// Qwen3MoeSparseMoeBlock.__call__, op for op. The top k come from argpartition, so the
    /// order of a token's k experts is argpartition's, which the sum over them inherits.
    pub fn forward(&self, x: &Array) -> Result<Array> {
        let gates = ops::softmax(&self.gate.forward(x)?, &[-1], true)?;
        let k = self.top_k;
        let experts = gates.dim(-1);
        let inds = ops::argpartition(&gates, -k, -1)?
            .slice_axis(-1, experts - k, experts)?
            .stop_gradient()?;
        let mut scores = ops::take_along_axis(&gates, &inds, -1)?;
        if self.norm_topk_prob {
            scores = scores.divide(&scores.sum(&[-1], true)?)?;
        }
        let y = self.switch_mlp.forward(x, &inds)?;
        y.multiply(&scores.expand_dims(&[-1])?)?
            .sum(&[-2], false)?
            .astype(y.dtype())
    }
}
