//! mlx_lm/models/qwen3_5_moe.py: qwen3_5 (its Model class, unchanged) whose sanitize also
//! splits the fused experts of a Hugging Face checkpoint. With `num_experts > 0` every layer's
//! MLP is qwen3_next's sparse block with its sigmoid-gated shared expert; qwen3_5 ignores
//! `decoder_sparse_step` and `mlp_only_layers`. The `mtp.*` weights are dropped, as mlx-lm's
//! TextModel.sanitize drops them (verity's qwen3_5 keeps them for mlx-vlm's MTP drafter, whose
//! head has no experts).

use super::layers::{MoeShape, Router, SharedShape};
use super::qwen3_5::{self, Model, TextArgs};
use crate::load::{Config, LoadError, LoadResult, QuantConfig, Weights};

pub fn load(config: &Config, w: &mut Weights, q: &QuantConfig) -> LoadResult<Model> {
    let a = qwen3_5::text_args(config)?;
    let moe = moe_shape(&a).map_err(|m| config.error(m))?;
    w.drop_where(|k| k.contains("mtp."));
    qwen3_5::to_language_model_keys(w);
    if let Some(s) = moe {
        split_experts(w, a.dims.num_hidden_layers, s)?;
    }
    qwen3_5::build(config, &a, w, q, moe)
}

/// The sparse block's shape, None where the config has no experts (mlx-lm then builds dense
/// MLPs). mlx-lm takes the expert settings unchecked: a top k outside 1..=num_experts would
/// make argpartition fail or (k = 0) pick every expert, and a shared expert of width 0 needs
/// zero-sized weights no checkpoint has.
fn moe_shape(a: &TextArgs) -> Result<Option<MoeShape>, String> {
    if a.num_experts < 0 {
        return Err(format!(
            "num_experts is {}, must be 0 (dense MLPs) or more",
            a.num_experts
        ));
    }
    if a.num_experts == 0 {
        return Ok(None);
    }
    if !(1..=a.num_experts).contains(&a.num_experts_per_tok) {
        return Err(format!(
            "num_experts_per_tok is {}, must be between 1 and num_experts ({})",
            a.num_experts_per_tok, a.num_experts
        ));
    }
    for (key, value) in [
        ("moe_intermediate_size", a.moe_intermediate_size),
        (
            "shared_expert_intermediate_size",
            a.shared_expert_intermediate_size,
        ),
    ] {
        if value < 1 {
            return Err(format!(
                "{key} is {value}, must be at least 1 when num_experts is {}",
                a.num_experts
            ));
        }
    }
    Ok(Some(MoeShape {
        hidden: a.dims.hidden_size,
        experts: a.num_experts,
        experts_per_token: a.num_experts_per_tok,
        expert_hidden: a.moe_intermediate_size,
        router: Router::Softmax {
            norm_topk_prob: a.norm_topk_prob,
        },
        shared: Some(SharedShape::Gated(a.shared_expert_intermediate_size)),
    }))
}

/// Model.sanitize's expert split: a layer with the fused `mlp.experts.gate_up_proj`
/// (experts, 2 x hidden, dims) gets its first half as `switch_mlp.gate_proj`, its second as
/// `switch_mlp.up_proj`, and `mlp.experts.down_proj` as `switch_mlp.down_proj`. Layers with
/// neither are already in mlx-lm's layout; a layer with one needs the other, as in mlx-lm
/// (a KeyError, or an unexpected weight at its strict load).
fn split_experts(w: &mut Weights, layers: usize, s: MoeShape) -> LoadResult<()> {
    let mlx = |w: &Weights, source| LoadError::Mlx {
        folder: w.folder().into(),
        source,
    };
    for l in 0..layers {
        let prefix = format!("language_model.model.layers.{l}.mlp");
        let (gate_up_key, down_key) = (
            format!("{prefix}.experts.gate_up_proj"),
            format!("{prefix}.experts.down_proj"),
        );
        if !w.contains(&gate_up_key) && !w.contains(&down_key) {
            continue;
        }
        let mid = s.expert_hidden;
        let gate_up = w.take_shaped(&gate_up_key, &[s.experts, 2 * mid, s.hidden])?;
        let down = w.take_shaped(&down_key, &[s.experts, s.hidden, mid])?;
        let gate = gate_up.slice_axis(-2, 0, mid).map_err(|e| mlx(w, e))?;
        let up = gate_up
            .slice_axis(-2, mid, 2 * mid)
            .map_err(|e| mlx(w, e))?;
        w.insert(format!("{prefix}.switch_mlp.gate_proj.weight"), gate);
        w.insert(format!("{prefix}.switch_mlp.up_proj.weight"), up);
        w.insert(format!("{prefix}.switch_mlp.down_proj.weight"), down);
    }
    Ok(())
}
