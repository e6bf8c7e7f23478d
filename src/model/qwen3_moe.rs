//! mlx_lm/models/qwen3_moe.py: qwen3's attention (per-head q/k RMSNorm, no biases, RoPE without
//! scaling) with a sparse mixture-of-experts MLP in every `decoder_sparse_step`-th layer not
//! listed in `mlp_only_layers`, the dense SwiGLU MLP in the others; no make_cache of its own.

use serde::Deserialize;
use serde_json::json;

use super::layers::{
    Attention, AttentionProjections, Decoder, DecoderLayer, Dims, MoeShape, OuterLayers,
    PreNormBlock, QkNorm, RmsNorm, Rope, Router,
};
use crate::load::{Config, LoadResult, QuantConfig, Weights};

#[derive(Deserialize)]
struct Args {
    #[serde(flatten)]
    dims: Dims,
    num_experts: i32,
    num_experts_per_tok: i32,
    decoder_sparse_step: i32,
    mlp_only_layers: Vec<usize>,
    moe_intermediate_size: i32,
    norm_topk_prob: bool,
    rope_theta: f64,
}

/// The model (mlx-lm's Model class): a [`Decoder`] of its layers.
pub fn load(config: &Config, w: &mut Weights, q: &QuantConfig) -> LoadResult<Decoder> {
    let a: Args = config.args(json!({}))?;
    let d = &a.dims;
    // The Python dataclass requires these three.
    let missing = |key: &str| config.error(format!("{key} is missing from the model config"));
    let head_dim = d.head_dim.ok_or_else(|| missing("head_dim"))?;
    d.num_key_value_heads
        .ok_or_else(|| missing("num_key_value_heads"))?;
    let tied = d
        .tie_word_embeddings
        .ok_or_else(|| missing("tie_word_embeddings"))?;
    check_experts(&a).map_err(|m| config.error(m))?;
    let rope = Rope::new(head_dim, a.rope_theta, false, None).map_err(|m| config.error(m))?;
    sanitize(w, tied, a.num_experts)?;
    let moe = MoeShape {
        hidden: d.hidden_size,
        experts: a.num_experts,
        experts_per_token: a.num_experts_per_tok,
        expert_hidden: a.moe_intermediate_size,
        router: Router::Softmax {
            norm_topk_prob: a.norm_topk_prob,
        },
        shared: None,
    };
    let mut layers = Vec::with_capacity(d.num_hidden_layers);
    for i in 0..d.num_hidden_layers {
        let p = format!("model.layers.{i}");
        let norm = |w: &mut Weights, path: &str, dims: i32| {
            RmsNorm::load(w, &format!("{p}.{path}"), dims, d.rms_norm_eps)
        };
        let sparse =
            !a.mlp_only_layers.contains(&i) && (i + 1) % a.decoder_sparse_step as usize == 0;
        let block = PreNormBlock::load_moe(w, q, &p, d, sparse.then_some(moe))?;
        let qk_norm = QkNorm::BeforeTranspose {
            q: norm(w, "self_attn.q_norm", head_dim)?,
            k: norm(w, "self_attn.k_norm", head_dim)?,
        };
        layers.push(DecoderLayer {
            attn: Attention {
                proj: AttentionProjections::load(w, q, &format!("{p}.self_attn"), d, 1, false)?,
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
        outer: OuterLayers::load(w, q, "", d, tied)?,
        layers,
        head_dim: head_dim as usize,
    })
}

/// The expert settings, which mlx-lm takes unchecked: a top k outside 1..=num_experts would
/// make argpartition fail or (k = 0) pick every expert, a sparse step of 0 divides by zero.
fn check_experts(a: &Args) -> std::result::Result<(), String> {
    let layers = a.dims.num_hidden_layers;
    if a.num_experts < 1 {
        return Err(format!(
            "num_experts is {}, must be at least 1 (a qwen3_moe model without experts is a dense \
             qwen3)",
            a.num_experts
        ));
    }
    if !(1..=a.num_experts).contains(&a.num_experts_per_tok) {
        return Err(format!(
            "num_experts_per_tok is {}, must be between 1 and num_experts ({})",
            a.num_experts_per_tok, a.num_experts
        ));
    }
    if a.decoder_sparse_step < 1 {
        return Err(format!(
            "decoder_sparse_step is {}, must be at least 1",
            a.decoder_sparse_step
        ));
    }
    if a.moe_intermediate_size < 1 {
        return Err(format!(
            "moe_intermediate_size is {}, must be at least 1",
            a.moe_intermediate_size
        ));
    }
    if let Some(&bad) = a.mlp_only_layers.iter().find(|&&l| l >= layers) {
        return Err(format!(
            "mlp_only_layers lists layer {bad}, must list layers 0 to {} (num_hidden_layers is \
             {layers})",
            layers - 1
        ));
    }
    Ok(())
}

/// Model.sanitize: drops lm_head when tied, and stacks the per-expert weights of a Hugging Face
/// checkpoint (`mlp.experts.<e>.<proj>.weight`, in the layers that have expert 0's up_proj)
/// into `mlp.switch_mlp.<proj>.weight`, experts in order.
fn sanitize(w: &mut Weights, tied: bool, experts: i32) -> LoadResult<()> {
    if tied {
        w.take_optional("lm_head.weight");
    }
    let mut moe_layers: Vec<usize> = w
        .keys()
        .filter(|k| k.starts_with("model.layers.") && k.ends_with(".mlp.experts.0.up_proj.weight"))
        .filter_map(|k| k.split('.').nth(2)?.parse().ok())
        .collect();
    moe_layers.sort_unstable();
    for l in moe_layers {
        let prefix = format!("model.layers.{l}");
        for n in ["up_proj", "down_proj", "gate_proj"] {
            let parts = (0..experts).map(|e| format!("{prefix}.mlp.experts.{e}.{n}.weight"));
            w.stack(parts, format!("{prefix}.mlp.switch_mlp.{n}.weight"))?;
        }
    }
    Ok(())
}
