//! mlx_lm/models/qwen3_5.py: the qwen3_next hybrid with split DeltaNet projections, read from
//! a vision-language checkpoint (text part under `text_config`). Vision and MTP weights are
//! dropped; HF-layout checkpoints get their conv weights transposed and norms shifted by +1.

use serde::Deserialize;
use serde_json::{Map, Value};

use super::layers::Rope;
use super::qwen3_next::{Model, Projections, Spec};
use crate::load::{Config, LoadError, QuantConfig, Weights};

#[derive(Deserialize)]
struct TextArgs {
    #[serde(default = "d_hidden")]
    hidden_size: i32,
    #[serde(default = "d_intermediate")]
    intermediate_size: i32,
    #[serde(default = "d_layers")]
    num_hidden_layers: usize,
    #[serde(default = "d_heads")]
    num_attention_heads: i32,
    #[serde(default = "d_eps")]
    rms_norm_eps: f64,
    #[serde(default = "d_vocab")]
    vocab_size: i32,
    #[serde(default = "d_kv_heads")]
    num_key_value_heads: i32,
    #[serde(default = "d_v_heads")]
    linear_num_value_heads: i32,
    #[serde(default = "d_k_heads")]
    linear_num_key_heads: i32,
    #[serde(default = "d_k_dim")]
    linear_key_head_dim: i32,
    #[serde(default = "d_v_dim")]
    linear_value_head_dim: i32,
    #[serde(default = "d_conv")]
    linear_conv_kernel_dim: i32,
    #[serde(default)]
    tie_word_embeddings: bool,
    #[serde(default)]
    attention_bias: bool,
    head_dim: Option<i32>,
    #[serde(default = "d_interval")]
    full_attention_interval: usize,
    #[serde(default)]
    num_experts: usize,
    rope_parameters: Option<Map<String, Value>>,
}

// The Python dataclass defaults (qwen3_5.TextModelArgs).
fn d_hidden() -> i32 {
    4096
}
fn d_intermediate() -> i32 {
    14336
}
fn d_layers() -> usize {
    32
}
fn d_heads() -> i32 {
    32
}
fn d_eps() -> f64 {
    1e-6
}
fn d_vocab() -> i32 {
    151936
}
fn d_kv_heads() -> i32 {
    8
}
fn d_v_heads() -> i32 {
    64
}
fn d_k_heads() -> i32 {
    16
}
fn d_k_dim() -> i32 {
    192
}
fn d_v_dim() -> i32 {
    128
}
fn d_conv() -> i32 {
    4
}
fn d_interval() -> usize {
    4
}

/// The norms mlx-lm shifts by +1 in HF-layout checkpoints (the gated DeltaNet norm excluded).
const SHIFTED_NORMS: [&str; 5] = [
    ".input_layernorm.weight",
    ".post_attention_layernorm.weight",
    "model.norm.weight",
    ".q_norm.weight",
    ".k_norm.weight",
];

/// Model.sanitize then TextModel.sanitize: keys to the `language_model.` scheme, vision and MTP
/// dropped, and for HF layout (conv weights stored (C, 1, K)) conv transposed, norms + 1.
fn sanitize(w: &mut Weights, tied: bool) -> Result<(), LoadError> {
    w.rename(|k| {
        if k.starts_with("vision_tower") || k.starts_with("model.visual") || k.contains("mtp.") {
            return None;
        }
        Some(if let Some(rest) = k.strip_prefix("model.language_model") {
            format!("language_model.model{rest}")
        } else if k.starts_with("language_model.") {
            k.to_string()
        } else {
            format!("language_model.{k}")
        })
    });
    if tied {
        w.take_optional("language_model.lm_head.weight");
    }
    let hf_layout = w
        .keys()
        .filter(|k| k.contains("conv1d.weight"))
        .any(|k| w.peek(k).is_some_and(|a| a.dim(-1) != 1));
    w.map(|k, v| {
        if k.contains("conv1d.weight") && v.dim(-1) != 1 {
            return v.moveaxis(2, 1);
        }
        if hf_layout && v.ndim() == 1 && SHIFTED_NORMS.iter().any(|s| k.ends_with(s)) {
            return v.add_scalar(1.0);
        }
        Ok(v)
    })
}

pub fn load(config: &Config, w: &mut Weights, q: &QuantConfig) -> Result<Model, LoadError> {
    let a: TextArgs = config.parse_text()?;
    if a.num_experts > 0 {
        return Err(config.error("mixture-of-experts qwen3_5 layers are not supported yet"));
    }
    let mut rope_params = a.rope_parameters.unwrap_or_else(|| {
        serde_json::from_str(
            r#"{"type": "default", "mrope_section": [11, 11, 10], "rope_theta": 100000, "partial_rotary_factor": 0.25}"#,
        )
        .expect("valid default rope parameters")
    });
    if !rope_params.contains_key("type") {
        if let Some(t) = rope_params.remove("rope_type") {
            rope_params.insert("type".into(), t);
        }
    }
    let factor = rope_params
        .get("partial_rotary_factor")
        .and_then(Value::as_f64)
        .unwrap_or(0.25);
    let theta = rope_params
        .get("rope_theta")
        .and_then(Value::as_f64)
        .unwrap_or(100000.0);
    let head_dim = a.head_dim.unwrap_or(a.hidden_size / a.num_attention_heads);
    let scaling = Value::Object(rope_params);
    let rope = Rope::new(
        (head_dim as f64 * factor) as i32,
        theta,
        false,
        Some(&scaling),
    )
    .map_err(|m| config.error(m))?;
    sanitize(w, a.tie_word_embeddings)?;
    Model::build(
        Spec {
            hidden: a.hidden_size,
            layers: a.num_hidden_layers,
            intermediate: a.intermediate_size,
            heads: a.num_attention_heads,
            kv_heads: a.num_key_value_heads,
            head_dim,
            v_heads: a.linear_num_value_heads,
            k_heads: a.linear_num_key_heads,
            k_dim: a.linear_key_head_dim,
            v_dim: a.linear_value_head_dim,
            conv_kernel: a.linear_conv_kernel_dim,
            eps: a.rms_norm_eps,
            vocab: a.vocab_size,
            attention_bias: a.attention_bias,
            rope,
            tied: a.tie_word_embeddings,
            interval: a.full_attention_interval,
            projections: Projections::Split,
            prefix: "language_model.",
            config,
        },
        w,
        q,
    )
}
