//! mlx_lm/models/qwen3_5.py: the qwen3_next hybrid with split DeltaNet projections, read from
//! a vision-language checkpoint (text part under `text_config`). Vision and MTP weights are
//! dropped; HF-layout checkpoints get their conv weights transposed and norms shifted by +1.

use serde::Deserialize;
use serde_json::{json, Map, Value};

use super::layers::{Dims, Rope};
use super::qwen3_next::{LinearDims, Model, Projections, Shape};
use crate::load::{Config, LoadResult, QuantConfig, Weights};

#[derive(Deserialize)]
struct TextArgs {
    #[serde(flatten)]
    dims: Dims,
    #[serde(flatten)]
    linear: LinearDims,
    attention_bias: bool,
    full_attention_interval: usize,
    num_experts: usize,
    rope_parameters: Option<Map<String, Value>>,
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
fn sanitize(w: &mut Weights, tied: bool) -> LoadResult<()> {
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

pub fn load(config: &Config, w: &mut Weights, q: &QuantConfig) -> LoadResult<Model> {
    // The Python dataclass defaults (qwen3_5.TextModelArgs).
    let a: TextArgs = config.text_args(json!({
        "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
        "num_attention_heads": 32, "rms_norm_eps": 1e-6, "vocab_size": 151936,
        "num_key_value_heads": 8, "linear_num_value_heads": 64, "linear_num_key_heads": 16,
        "linear_key_head_dim": 192, "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4,
        "tie_word_embeddings": false, "attention_bias": false, "full_attention_interval": 4,
        "num_experts": 0,
    }))?;
    if a.num_experts > 0 {
        return Err(config.error("mixture-of-experts qwen3_5 layers are not supported yet"));
    }
    let mut rope_params = a.rope_parameters.unwrap_or_else(|| {
        let defaults = json!({"type": "default", "mrope_section": [11, 11, 10],
                              "rope_theta": 100000, "partial_rotary_factor": 0.25});
        defaults.as_object().cloned().unwrap_or_default()
    });
    if !rope_params.contains_key("type") {
        if let Some(t) = rope_params.remove("rope_type") {
            rope_params.insert("type".into(), t);
        }
    }
    let param = |key: &str, default: f64| {
        rope_params
            .get(key)
            .and_then(Value::as_f64)
            .unwrap_or(default)
    };
    let (factor, theta) = (
        param("partial_rotary_factor", 0.25),
        param("rope_theta", 100000.0),
    );
    let scaling = Value::Object(rope_params.clone());
    let rope = Rope::new(
        (a.dims.head_dim() as f64 * factor) as i32,
        theta,
        false,
        Some(&scaling),
    )
    .map_err(|m| config.error(m))?;
    let tied = a.dims.tie_word_embeddings.unwrap_or(false);
    sanitize(w, tied)?;
    Model::build(
        Shape {
            dims: &a.dims,
            linear: &a.linear,
            attention_bias: a.attention_bias,
            rope,
            tied,
            interval: a.full_attention_interval,
            projections: Projections::Split,
            prefix: "language_model.",
            config,
        },
        w,
        q,
    )
}
