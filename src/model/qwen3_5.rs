//! mlx_lm/models/qwen3_5.py: the qwen3_next hybrid with split DeltaNet projections, read from
//! a vision-language checkpoint (text part under `text_config`). Vision weights are dropped;
//! HF-layout checkpoints get their conv weights transposed and norms shifted by +1. The `mtp.*`
//! weights, which mlx-lm drops, become the model's multi-token-prediction head
//! (crate::model::qwen3_5_mtp's head, a [`MtpHead`]), loaded as mlx-vlm's MTP splitter loads them
//! (mlx_vlm/speculative/drafters/mtp_split.py).

use mlx::Array;
use serde::Deserialize;
use serde_json::{json, Map, Value};

use super::layers::{Dims, MoeShape, OuterLayers, Rope};
use super::mtp::MtpHead;
use super::qwen3_5_mtp::{QwenMtpHead, MTP_SHIFTED_NORMS};
use super::qwen3_next::{self, LinearDims, Projections, Shape};
use super::{Forward, LanguageModel};
use crate::cache::LayerCache;
use crate::load::{Config, LoadResult, QuantConfig, Weights};
use crate::Result;

/// qwen3_5.TextModelArgs, as qwen3_5 and qwen3_5_moe read it.
#[derive(Deserialize)]
pub(crate) struct TextArgs {
    #[serde(flatten)]
    pub dims: Dims,
    #[serde(flatten)]
    linear: LinearDims,
    attention_bias: bool,
    full_attention_interval: usize,
    pub num_experts: i32,
    pub num_experts_per_tok: i32,
    pub moe_intermediate_size: i32,
    pub shared_expert_intermediate_size: i32,
    pub norm_topk_prob: bool,
    rope_parameters: Option<Map<String, Value>>,
    /// Decoder layers of the MTP head (mlx-vlm reads 1 when absent:
    /// mlx_vlm/speculative/drafters/qwen3_5_mtp/qwen3_5_mtp.py:31).
    pub mtp_num_hidden_layers: usize,
}

/// The norms mlx-lm shifts by +1 in HF-layout checkpoints (the gated DeltaNet norm excluded).
const SHIFTED_NORMS: [&str; 5] = [
    ".input_layernorm.weight",
    ".post_attention_layernorm.weight",
    "model.norm.weight",
    ".q_norm.weight",
    ".k_norm.weight",
];

/// Model.sanitize's renaming: keys to the `language_model.` scheme, vision dropped, the `mtp.*`
/// keys kept as they are.
pub(crate) fn to_language_model_keys(w: &mut Weights) {
    w.rename(|k| {
        if k.starts_with("vision_tower") || k.starts_with("model.visual") {
            return None;
        }
        if k.starts_with("mtp.") {
            return Some(k.to_string());
        }
        Some(if let Some(rest) = k.strip_prefix("model.language_model") {
            format!("language_model.model{rest}")
        } else if k.starts_with("language_model.") {
            k.to_string()
        } else {
            format!("language_model.{k}")
        })
    });
}

/// TextModel.sanitize on renamed keys: for HF layout (conv weights stored (C, 1, K)) conv
/// transposed, norms + 1. The `mtp.*` norms get + 1 unless their file is tagged
/// `"format": "mlx"`, which mlx-vlm's splitter trusts to mean already converted
/// (MTPSplitter.transform, mtp_split.py:196-204, `on_mlx_source` only strips the prefix).
fn sanitize(w: &mut Weights, tied: bool) -> LoadResult<()> {
    let mtp_converted = w.keys().any(|k| k.starts_with("mtp.") && w.saved_by_mlx(k));
    if tied {
        w.take_optional("language_model.lm_head.weight");
    }
    let hf_layout = w
        .keys()
        .filter(|k| k.contains("conv1d.weight"))
        .any(|k| w.peek(k).is_some_and(|a| a.dim(-1) != 1));
    w.map(|k, v| {
        if k.starts_with("mtp.") {
            let norm = v.ndim() == 1 && MTP_SHIFTED_NORMS.iter().any(|s| k.ends_with(s));
            return if norm && !mtp_converted {
                v.add_scalar(1.0)
            } else {
                Ok(v)
            };
        }
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
    let a = text_args(config)?;
    if a.num_experts > 0 {
        return Err(config.error("mixture-of-experts qwen3_5 layers are not supported yet"));
    }
    to_language_model_keys(w);
    build(config, &a, w, q, None)
}

/// The text config with the Python dataclass defaults (qwen3_5.TextModelArgs).
pub(crate) fn text_args(config: &Config) -> LoadResult<TextArgs> {
    config.text_args(json!({
        "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
        "num_attention_heads": 32, "rms_norm_eps": 1e-6, "vocab_size": 151936,
        "num_key_value_heads": 8, "linear_num_value_heads": 64, "linear_num_key_heads": 16,
        "linear_key_head_dim": 192, "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4,
        "tie_word_embeddings": false, "attention_bias": false, "full_attention_interval": 4,
        "num_experts": 0, "num_experts_per_tok": 0, "moe_intermediate_size": 0,
        "shared_expert_intermediate_size": 0, "norm_topk_prob": true, "mtp_num_hidden_layers": 1,
    }))
}

/// The partial rotary embedding of `rope_parameters` (mlx-lm's defaults when absent), shared by
/// the decoder and the MTP head, in-folder or split.
pub(crate) fn rope(config: &Config, a: &TextArgs) -> LoadResult<Rope> {
    let mut rope_params = a.rope_parameters.clone().unwrap_or_else(|| {
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
    Rope::new(
        (a.dims.head_dim() as f64 * factor) as i32,
        theta,
        false,
        Some(&scaling),
    )
    .map_err(|m| config.error(m))
}

/// Builds the model from keys already in the `language_model.` scheme: TextModel.sanitize,
/// the MTP head where `mtp.*` weights remain, and the hybrid layers, each layer's MLP the
/// sparse block `moe` when given.
pub(crate) fn build(
    config: &Config,
    a: &TextArgs,
    w: &mut Weights,
    q: &QuantConfig,
    moe: Option<MoeShape>,
) -> LoadResult<Model> {
    let rope = rope(config, a)?;
    let tied = a.dims.tie_word_embeddings.unwrap_or(false);
    sanitize(w, tied)?;
    let mtp = if w.keys().any(|k| k.starts_with("mtp.")) {
        Some(QwenMtpHead::load(w, q, a, rope, config, "mtp.")?)
    } else {
        None
    };
    let text = qwen3_next::Model::build(
        Shape {
            dims: &a.dims,
            linear: &a.linear,
            attention_bias: a.attention_bias,
            rope,
            tied,
            interval: a.full_attention_interval,
            moe,
            projections: Projections::Split,
            prefix: "language_model.",
            config,
        },
        w,
        q,
    )?;
    Ok(Model { text, mtp })
}

/// The Qwen3.5 text model with the MTP head its checkpoint may carry.
pub struct Model {
    text: qwen3_next::Model,
    mtp: Option<QwenMtpHead>,
}

impl LanguageModel for Model {
    fn forward_rows(
        &self,
        ids: &Array,
        rows: &mut [&mut [LayerCache]],
        lens: &[usize],
        taps: &[usize],
    ) -> Result<Forward> {
        self.text.forward_rows(ids, rows, lens, taps)
    }

    fn num_layers(&self) -> usize {
        self.text.num_layers()
    }

    fn own_caches(&self) -> Option<Vec<LayerCache>> {
        self.text.own_caches()
    }

    fn outer(&self) -> &OuterLayers {
        self.text.outer()
    }

    fn attends_batch_caches(&self) -> bool {
        self.text.attends_batch_caches()
    }

    fn attention_head_dim(&self) -> usize {
        self.text.attention_head_dim()
    }

    fn mtp_head(&self) -> Option<&dyn MtpHead> {
        self.mtp.as_ref().map(|h| h as &dyn MtpHead)
    }
}
