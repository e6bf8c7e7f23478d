//! The sparse mixture-of-experts blocks of mlx_lm/models/qwen3_moe.py and qwen3_next.py (which
//! qwen3_5 and qwen3_5_moe import): a linear router, a softmax over the experts, the top k of
//! them per token (optionally renormalised), the weighted sum of those experts' SwitchGLU
//! outputs and, in qwen3_next's block, a shared expert every token goes through, scaled by a
//! sigmoid gate of its own.

use mlx::{ops, Array, Result};

use super::{Activation, GatedMlp, Linear, SwitchGlu};
use crate::load::{LoadResult, QuantConfig, Weights};

/// How a sparse block is shaped, as the family's config gives it (checked by the family).
#[derive(Clone, Copy, Debug)]
pub struct MoeShape {
    pub hidden: i32,
    pub experts: i32,
    pub experts_per_token: i32,
    pub expert_hidden: i32,
    pub norm_topk_prob: bool,
    /// The hidden width of qwen3_next's shared expert; None for qwen3_moe's block, which has
    /// none.
    pub shared_expert_hidden: Option<i32>,
}

/// Qwen3NextSparseMoeBlock's shared expert: `sigmoid(shared_expert_gate(x)) * shared_expert(x)`.
struct SharedExpert {
    mlp: GatedMlp,
    gate: Linear,
}

/// Qwen3MoeSparseMoeBlock, or Qwen3NextSparseMoeBlock when it has a shared expert.
pub struct SparseMoe {
    gate: Linear,
    switch_mlp: SwitchGlu,
    /// Boxed, so that a block without one stays near a dense MLP's size.
    shared: Option<Box<SharedExpert>>,
    top_k: i32,
    norm_topk_prob: bool,
}

/// A layer's MLP: dense, or the sparse block of the layers a family gives experts.
pub enum Mlp {
    Dense(GatedMlp),
    Sparse(SparseMoe),
}

impl Mlp {
    pub fn forward(&self, x: &Array) -> Result<Array> {
        match self {
            Mlp::Dense(m) => m.forward(x),
            Mlp::Sparse(m) => m.forward(x),
        }
    }
}

impl SparseMoe {
    /// Loads the router `<path>.gate`, the experts `<path>.switch_mlp` and, when the shape has
    /// one, `<path>.shared_expert` with its gate `<path>.shared_expert_gate`.
    pub fn load(
        w: &mut Weights,
        q: &QuantConfig,
        path: &str,
        s: MoeShape,
    ) -> LoadResult<SparseMoe> {
        let shared = match s.shared_expert_hidden {
            Some(hidden) => Some(Box::new(SharedExpert {
                mlp: GatedMlp::load(
                    w,
                    q,
                    &format!("{path}.shared_expert"),
                    s.hidden,
                    hidden,
                    false,
                    Activation::Swiglu,
                )?,
                gate: Linear::load(
                    w,
                    q,
                    &format!("{path}.shared_expert_gate"),
                    s.hidden,
                    1,
                    false,
                )?,
            })),
            None => None,
        };
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
            shared,
            top_k: s.experts_per_token,
            norm_topk_prob: s.norm_topk_prob,
        })
    }

    /// The block's `__call__`, op for op. The top k come from argpartition, so the order of a
    /// token's k experts is argpartition's, which the sum over them inherits. qwen3_moe casts
    /// the sum back to the experts' dtype, qwen3_next does not; the sum already has that dtype
    /// (the router's softmax keeps its input's), so the cast changes nothing in either.
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
        let y = y
            .multiply(&scores.expand_dims(&[-1])?)?
            .sum(&[-2], false)?
            .astype(y.dtype())?;
        match &self.shared {
            Some(shared) => {
                let shared_y = shared.mlp.forward(x)?;
                y.add(&shared.gate.forward(x)?.sigmoid()?.multiply(&shared_y)?)
            }
            None => Ok(y),
        }
    }
}
