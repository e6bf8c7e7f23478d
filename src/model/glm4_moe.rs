//! mlx_lm/models/glm4_moe.py: attention with optional q/k/v biases and per-head q/k RMSNorm,
//! RoPE over the first `head_dim * partial_rotary_factor` dimensions (rope_scaling is ignored,
//! as mlx-lm ignores it), dense SwiGLU MLPs in the first `first_k_dense_replace` layers and
//! GLM's sparse block in the others (MoEGate's grouped sigmoid router, plain shared experts),
//! an untied lm_head whatever tie_word_embeddings says; no make_cache of its own.

use serde::Deserialize;
use serde_json::json;

use super::layers::{
    Attention, AttentionProjections, Decoder, DecoderLayer, Dims, MoeShape, OuterLayers,
    PreNormBlock, QkNorm, RmsNorm, Rope, Router, SharedShape,
};
use crate::load::{Config, LoadResult, QuantConfig, Weights};

#[derive(Deserialize)]
struct Args {
    #[serde(flatten)]
    dims: Dims,
    #[serde(flatten)]
    moe: MoeArgs,
    rope_theta: f64,
    use_qk_norm: bool,
    attention_bias: bool,
    partial_rotary_factor: f64,
}

/// The expert settings GLM's MoE families share (glm4_moe, glm4_moe_lite).
#[derive(Deserialize)]
pub(super) struct MoeArgs {
    moe_intermediate_size: i32,
    norm_topk_prob: bool,
    n_group: i32,
    topk_group: i32,
    n_shared_experts: Option<i32>,
    pub(super) n_routed_experts: Option<i32>,
    routed_scaling_factor: f64,
    num_experts_per_tok: i32,
    pub(super) first_k_dense_replace: i64,
    topk_method: String,
}

/// The model (mlx-lm's Model class): a [`Decoder`] of its layers.
pub fn load(config: &Config, w: &mut Weights, q: &QuantConfig) -> LoadResult<Decoder> {
    let a: Args = config.args(json!({"topk_method": "noaux_tc"}))?;
    let d = &a.dims;
    // The Python dataclass requires these (rope_scaling too, which nothing reads).
    let missing = |key: &str| config.error(format!("{key} is missing from the model config"));
    let head_dim = d.head_dim.ok_or_else(|| missing("head_dim"))?;
    d.num_key_value_heads
        .ok_or_else(|| missing("num_key_value_heads"))?;
    let moe = moe_shape(&a.moe, d.hidden_size).map_err(|m| config.error(m))?;
    let rope_dims = rope_dims(head_dim, a.partial_rotary_factor).map_err(|m| config.error(m))?;
    let rope = Rope::new(rope_dims, a.rope_theta, false, None).map_err(|m| config.error(m))?;
    sanitize(w, d.num_hidden_layers, a.moe.n_routed_experts.unwrap_or(0))?;
    let mut layers = Vec::with_capacity(d.num_hidden_layers);
    for i in 0..d.num_hidden_layers {
        let p = format!("model.layers.{i}");
        let norm = |w: &mut Weights, path: &str, dims: i32| {
            RmsNorm::load(w, &format!("{p}.{path}"), dims, d.rms_norm_eps)
        };
        let sparse = moe.filter(|_| i as i64 >= a.moe.first_k_dense_replace);
        let block = PreNormBlock::load_moe(w, q, &p, d, sparse)?;
        let qk_norm = if a.use_qk_norm {
            QkNorm::BeforeTranspose {
                q: norm(w, "self_attn.q_norm", head_dim)?,
                k: norm(w, "self_attn.k_norm", head_dim)?,
            }
        } else {
            QkNorm::None
        };
        let biases = (a.attention_bias, false);
        let proj =
            AttentionProjections::load_biased(w, q, &format!("{p}.self_attn"), d, 1, biases)?;
        layers.push(DecoderLayer {
            attn: Attention {
                proj,
                qk_norm,
                rope,
                n_heads: d.num_attention_heads,
                n_kv_heads: d.kv_heads(),
                scale: (head_dim as f64).powf(-0.5) as f32,
            },
            block,
        });
    }
    Ok(Decoder {
        outer: OuterLayers::load(w, q, "", d, false)?,
        layers,
        head_dim: head_dim as usize,
    })
}

/// nn.RoPE's dimensions, `int(head_dim * partial_rotary_factor)`; a factor outside (0, 1]
/// would rotate no dimension or more than a head has.
fn rope_dims(head_dim: i32, factor: f64) -> std::result::Result<i32, String> {
    if !(factor > 0.0 && factor <= 1.0) {
        return Err(format!(
            "partial_rotary_factor is {factor}, must be in (0, 1]"
        ));
    }
    Ok((f64::from(head_dim) * factor) as i32)
}

/// The sparse block's shape, None when n_routed_experts is null (every layer dense, as in
/// mlx-lm). mlx-lm takes the expert settings unchecked: a top k outside 1..=experts makes
/// argpartition fail or pick nothing, experts not divisible into `n_group` groups (or groups of
/// one expert, whose top-2 sum fails) make the router's unflatten or topk fail, a `topk_group`
/// outside 1..=n_group keeps no group or makes argpartition fail.
pub(super) fn moe_shape(a: &MoeArgs, hidden: i32) -> std::result::Result<Option<MoeShape>, String> {
    let Some(experts) = a.n_routed_experts else {
        return Ok(None);
    };
    if experts < 1 {
        return Err(format!("n_routed_experts is {experts}, must be at least 1"));
    }
    if a.topk_method != "noaux_tc" {
        return Err(format!(
            "topk_method is {:?}, mlx-lm's GLM MoE supports only \"noaux_tc\"",
            a.topk_method
        ));
    }
    if !(1..=experts).contains(&a.num_experts_per_tok) {
        return Err(format!(
            "num_experts_per_tok is {}, must be between 1 and n_routed_experts ({experts})",
            a.num_experts_per_tok
        ));
    }
    if a.n_group < 1 || experts % a.n_group != 0 {
        return Err(format!(
            "n_group is {}, must be at least 1 and divide n_routed_experts ({experts})",
            a.n_group
        ));
    }
    if a.n_group > 1 && experts / a.n_group < 2 {
        return Err(format!(
            "n_group is {} for {experts} experts: a group needs at least 2 experts (the router \
             scores a group by its top 2)",
            a.n_group
        ));
    }
    if !(1..=a.n_group).contains(&a.topk_group) {
        return Err(format!(
            "topk_group is {}, must be between 1 and n_group ({})",
            a.topk_group, a.n_group
        ));
    }
    if a.moe_intermediate_size < 1 {
        return Err(format!(
            "moe_intermediate_size is {}, must be at least 1",
            a.moe_intermediate_size
        ));
    }
    if let Some(n) = a.n_shared_experts.filter(|&n| n < 1) {
        return Err(format!(
            "n_shared_experts is {n}, must be at least 1 (or null for none)"
        ));
    }
    if !a.routed_scaling_factor.is_finite() {
        return Err(format!(
            "routed_scaling_factor is {}, must be finite",
            a.routed_scaling_factor
        ));
    }
    Ok(Some(MoeShape {
        hidden,
        experts,
        experts_per_token: a.num_experts_per_tok,
        expert_hidden: a.moe_intermediate_size,
        router: Router::Grouped {
            n_group: a.n_group,
            topk_group: a.topk_group,
            routed_scaling_factor: a.routed_scaling_factor as f32,
            norm_topk_prob: a.norm_topk_prob,
        },
        shared: a
            .n_shared_experts
            .map(|n| SharedShape::Plain(a.moe_intermediate_size * n)),
    }))
}

/// Model.sanitize: [`stack_experts`], then drops every key that starts with
/// `model.layers.<num_hidden_layers>` (the multi-token-prediction layer; Python's plain prefix
/// test, kept as it is).
fn sanitize(w: &mut Weights, layers: usize, experts: i32) -> LoadResult<()> {
    stack_experts(w, layers, experts)?;
    let mtp = format!("model.layers.{layers}");
    let dropped: Vec<String> = w.keys().filter(|k| k.starts_with(&mtp)).cloned().collect();
    for k in dropped {
        w.take_optional(&k);
    }
    Ok(())
}

/// In each layer with expert 0's `<proj>.{weight,scales,biases}`, stacks the per-expert tensors
/// `mlp.experts.<e>.<proj>.<k>` into `mlp.switch_mlp.<proj>.<k>`, experts in order (GLM's
/// sanitize steps for its HF checkpoints).
pub(super) fn stack_experts(w: &mut Weights, layers: usize, experts: i32) -> LoadResult<()> {
    for l in 0..layers {
        let prefix = format!("model.layers.{l}.mlp");
        for m in ["gate_proj", "down_proj", "up_proj"] {
            for k in ["weight", "scales", "biases"] {
                if experts == 0 || !w.contains(&format!("{prefix}.experts.0.{m}.{k}")) {
                    continue;
                }
                let parts = (0..experts).map(|e| format!("{prefix}.experts.{e}.{m}.{k}"));
                w.stack(parts, format!("{prefix}.switch_mlp.{m}.{k}"))?;
            }
        }
    }
    Ok(())
}
