//! The sparse mixture-of-experts blocks of mlx_lm/models/qwen3_moe.py, qwen3_next.py (which
//! qwen3_5 and qwen3_5_moe import) and glm4_moe.py: a router picks each token's top k experts
//! and weighs them, the weighted sum of those experts' SwitchGLU outputs is the block's output
//! plus, where the family has one, a shared expert every token goes through. qwen3's router is
//! a softmax over a linear gate; GLM's is MoEGate (sigmoid scores, a bias that steers the
//! choice only, whole groups of experts dropped before the top k).

use mlx::{compiled, ops, Array, Result};

use super::{Activation, GatedMlp, Linear, SwitchGlu};
use crate::load::{LoadResult, QuantConfig, Weights};
use crate::model::router_margin;

/// How a sparse block picks and weighs a token's experts (checked by the family).
#[derive(Clone, Copy, Debug)]
pub enum Router {
    /// qwen3_moe and qwen3_next: softmax over `gate(x)`, the top k of it, renormalised to sum
    /// to 1 when `norm_topk_prob`.
    Softmax { norm_topk_prob: bool },
    /// glm4_moe's MoEGate (`group_expert_select`): `n_group` groups of experts, of which the
    /// `topk_group` with the highest top-2 sums stay eligible.
    Grouped {
        n_group: i32,
        topk_group: i32,
        routed_scaling_factor: f32,
        norm_topk_prob: bool,
    },
}

/// The shared expert beside the routed ones, with its hidden width.
#[derive(Clone, Copy, Debug)]
pub enum SharedShape {
    /// qwen3_next's `shared_expert`, scaled by `sigmoid(shared_expert_gate(x))`.
    Gated(i32),
    /// glm4_moe's `shared_experts`, added as it is.
    Plain(i32),
}

/// How a sparse block is shaped, as the family's config gives it (checked by the family).
#[derive(Clone, Copy, Debug)]
pub struct MoeShape {
    pub hidden: i32,
    pub experts: i32,
    pub experts_per_token: i32,
    pub expert_hidden: i32,
    pub router: Router,
    /// None for qwen3_moe's block, which has none.
    pub shared: Option<SharedShape>,
}

/// The shared expert as loaded; `gate` is qwen3_next's sigmoid gate.
struct SharedExpert {
    mlp: GatedMlp,
    gate: Option<Linear>,
}

/// Qwen3MoeSparseMoeBlock, Qwen3NextSparseMoeBlock or glm4_moe's MoE.
pub struct SparseMoe {
    /// The router's linear map (glm4_moe's MoEGate weight, which is no nn.Linear and so is
    /// never quantized).
    gate: Linear,
    router: Router,
    /// MoEGate's `e_score_correction_bias` (experts), which the grouped router alone has.
    correction: Option<Array>,
    switch_mlp: SwitchGlu,
    /// Boxed, so that a block without one stays near a dense MLP's size.
    shared: Option<Box<SharedExpert>>,
    top_k: i32,
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
    /// Loads the router `<path>.gate` (with its `e_score_correction_bias` for the grouped
    /// router), the experts `<path>.switch_mlp` and the shared expert: `<path>.shared_expert`
    /// with its gate `<path>.shared_expert_gate`, or `<path>.shared_experts`.
    pub fn load(
        w: &mut Weights,
        q: &QuantConfig,
        path: &str,
        s: MoeShape,
    ) -> LoadResult<SparseMoe> {
        let mlp = |w: &mut Weights, name: &str, hidden: i32| {
            let p = format!("{path}.{name}");
            GatedMlp::load(w, q, &p, s.hidden, hidden, false, Activation::Swiglu)
        };
        let shared = match s.shared {
            Some(SharedShape::Gated(hidden)) => Some(SharedExpert {
                mlp: mlp(w, "shared_expert", hidden)?,
                gate: Some(Linear::load(
                    w,
                    q,
                    &format!("{path}.shared_expert_gate"),
                    s.hidden,
                    1,
                    false,
                )?),
            }),
            Some(SharedShape::Plain(hidden)) => Some(SharedExpert {
                mlp: mlp(w, "shared_experts", hidden)?,
                gate: None,
            }),
            None => None,
        };
        let gate_path = format!("{path}.gate");
        let (gate, correction) = match s.router {
            Router::Softmax { .. } => (
                Linear::load(w, q, &gate_path, s.hidden, s.experts, false)?,
                None,
            ),
            Router::Grouped { .. } => {
                let unquantized = QuantConfig::default();
                let gate = Linear::load(w, &unquantized, &gate_path, s.hidden, s.experts, false)?;
                let bias_path = format!("{gate_path}.e_score_correction_bias");
                (gate, Some(w.take_shaped(&bias_path, &[s.experts])?))
            }
        };
        Ok(SparseMoe {
            gate,
            router: s.router,
            correction,
            switch_mlp: SwitchGlu::load(
                w,
                q,
                &format!("{path}.switch_mlp"),
                s.hidden,
                s.expert_hidden,
                s.experts,
            )?,
            shared: shared.map(Box::new),
            top_k: s.experts_per_token,
        })
    }

    /// The block's `__call__`, op for op. The top k come from argpartition, so the order of a
    /// token's k experts is argpartition's, which the sum over them inherits. qwen3_moe and
    /// glm4_moe cast the sum back to the experts' dtype, qwen3_next does not: its sum already
    /// has that dtype (the softmax keeps its input's), so the cast changes nothing there, while
    /// GLM's f32 scores widen a bf16 sum that the cast narrows again.
    pub fn forward(&self, x: &Array) -> Result<Array> {
        let gates = self.gate.forward(x)?;
        let (inds, scores) = match self.router {
            Router::Grouped {
                n_group,
                topk_group,
                routed_scaling_factor,
                norm_topk_prob,
            } => {
                let bias = self
                    .correction
                    .as_ref()
                    .expect("the grouped router is loaded with its correction bias");
                router_margin::note_grouped(&gates, bias, self.top_k, n_group, topk_group)?;
                compiled::group_expert_select(
                    &gates,
                    bias,
                    self.top_k,
                    n_group,
                    topk_group,
                    routed_scaling_factor,
                    norm_topk_prob,
                )?
            }
            Router::Softmax { norm_topk_prob } => self.softmax_top_k(&gates, norm_topk_prob)?,
        };
        let y = self.switch_mlp.forward(x, &inds)?;
        let y = y
            .multiply(&scores.expand_dims(&[-1])?)?
            .sum(&[-2], false)?
            .astype(y.dtype())?;
        let Some(shared) = &self.shared else {
            return Ok(y);
        };
        let shared_y = shared.mlp.forward(x)?;
        match &shared.gate {
            Some(gate) => y.add(&gate.forward(x)?.sigmoid()?.multiply(&shared_y)?),
            None => y.add(&shared_y),
        }
    }

    /// qwen3's router over the gate's output: softmax, argpartition's top k, optionally
    /// renormalised.
    fn softmax_top_k(&self, gates: &Array, norm_topk_prob: bool) -> Result<(Array, Array)> {
        let gates = ops::softmax(gates, &[-1], true)?;
        let k = self.top_k;
        router_margin::note_top_k(&gates, k)?;
        let experts = gates.dim(-1);
        let inds = ops::argpartition(&gates, -k, -1)?
            .slice_axis(-1, experts - k, experts)?
            .stop_gradient()?;
        let mut scores = ops::take_along_axis(&gates, &inds, -1)?;
        if norm_topk_prob {
            scores = scores.divide(&scores.sum(&[-1], true)?)?;
        }
        Ok((inds, scores))
    }
}
