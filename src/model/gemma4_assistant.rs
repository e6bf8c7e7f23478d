//! mlx-vlm's Gemma 4 assistant drafter (mlx_vlm/speculative/drafters/gemma4_assistant/,
//! model_type "gemma4_assistant"): a few Gemma 4 decoder layers that own no keys or values.
//! Each attends over the target's, those of the target's last layer of its own kind (sliding
//! or full), from the position of the target's last cached token. One step reads
//! `[target_embed(token) * embed_scale, previous state]`, projects it down to its own width
//! (`pre_projection`), runs the layers and the norm, and returns its own tied embedding's
//! logits and the state projected back to the target's width (`post_projection`), which the
//! next step chains on.
//!
//! Not supported (refused at load, naming the key): the centroid-routed output head
//! (`use_ordered_embeddings`, the E2B / E4B drafters' MaskedEmbedder) and MoE layers.

use std::path::Path;

use mlx::{fast, ops, Array};
use serde::Deserialize;
use serde_json::{json, Map, Value};

use super::gemma4_rope::LayerRope;
use super::gemma4_text::{FULL, SLIDING};
use super::layers::{Activation, Dims, Embedding, GatedMlp, Linear, RmsNorm};
use crate::load::{load_config, Config, LoadResult, QuantConfig, Weights};
use crate::Result;

#[derive(Deserialize)]
struct Args {
    backbone_hidden_size: usize,
    use_ordered_embeddings: bool,
    tie_word_embeddings: bool,
    block_size: usize,
    text_config: Map<String, Value>,
}

#[derive(Deserialize)]
struct TextArgs {
    #[serde(flatten)]
    dims: Dims,
    global_head_dim: Option<i32>,
    rope_traditional: bool,
    rope_parameters: Option<Map<String, Value>>,
    sliding_window_pattern: usize,
    hidden_size_per_layer_input: Option<i32>,
    enable_moe_block: bool,
    layer_types: Option<Vec<String>>,
}

/// One decoder layer without key or value projections (`DecoderLayer(kv_shared_only=True)`).
struct Layer {
    kind: String,
    q_proj: Linear,
    o_proj: Linear,
    q_norm: RmsNorm,
    rope: LayerRope,
    n_heads: i32,
    head_dim: i32,
    mlp: GatedMlp,
    input_layernorm: RmsNorm,
    post_attention_layernorm: RmsNorm,
    pre_feedforward_layernorm: RmsNorm,
    post_feedforward_layernorm: RmsNorm,
    layer_scalar: Array,
}

pub struct Gemma4Assistant {
    embed_tokens: Embedding,
    /// None when tied to `embed_tokens`.
    lm_head: Option<Linear>,
    layers: Vec<Layer>,
    norm: RmsNorm,
    pre_projection: Linear,
    post_projection: Linear,
    /// The target's hidden size, which the projections map from and back to.
    pub backbone_hidden_size: usize,
    pub vocab_size: usize,
    /// The block (drafts + 1) the drafter was trained for: mlx-vlm's ceiling below which a
    /// larger requested block is used only while the drafter's drafts are mostly accepted.
    pub block_size: usize,
}

impl Gemma4Assistant {
    pub fn load(dir: &Path) -> LoadResult<Gemma4Assistant> {
        let config = load_config(dir)?;
        let kind = config.model_type()?;
        if kind != "gemma4_assistant" {
            return Err(config.error(format!(
                "model_type {kind:?} is not a Gemma 4 assistant drafter (\"gemma4_assistant\")"
            )));
        }
        // Gemma4AssistantConfig's defaults.
        let a: Args = config.args(json!({
            "backbone_hidden_size": 1536, "use_ordered_embeddings": false,
            "tie_word_embeddings": true, "block_size": 4,
        }))?;
        if a.use_ordered_embeddings {
            return Err(config.error(
                "use_ordered_embeddings is true: the centroid-routed output head (MaskedEmbedder) \
                 is not supported; only drafters with a dense output head are",
            ));
        }
        if a.block_size < 2 {
            return Err(config.error(format!(
                "block_size is {}, must be at least 2 (a round's token and one draft)",
                a.block_size
            )));
        }
        let text = Config {
            path: config.path.clone(),
            json: a.text_config.clone(),
        };
        // TextConfig's defaults (mlx_vlm/models/gemma4/config.py).
        let t: TextArgs = text.args(json!({
            "hidden_size": 1536, "num_hidden_layers": 35, "intermediate_size": 6144,
            "num_attention_heads": 8, "head_dim": 256, "global_head_dim": 512,
            "rms_norm_eps": 1e-6, "vocab_size": 262144, "num_key_value_heads": 1,
            "rope_traditional": false, "sliding_window_pattern": 5,
            "hidden_size_per_layer_input": 256, "enable_moe_block": false,
        }))?;
        if t.enable_moe_block {
            return Err(text.error(
                "text_config.enable_moe_block is true: MoE drafter layers are not supported",
            ));
        }
        let mut w = Weights::load(dir)?;
        let model = Self::build(&text, &a, &t, &mut w)?;
        w.finish()?;
        Ok(model)
    }

    fn build(c: &Config, a: &Args, t: &TextArgs, w: &mut Weights) -> LoadResult<Gemma4Assistant> {
        let q = QuantConfig::from_config(c)?;
        let d = &t.dims;
        let n = d.num_hidden_layers;
        let types = match &t.layer_types {
            Some(types) => types.clone(),
            None if t.sliding_window_pattern == 0 => {
                return Err(c.error("text_config.sliding_window_pattern is 0, must be at least 1"))
            }
            None => (0..n)
                .map(|i| {
                    let p = t.sliding_window_pattern;
                    if i % p == p - 1 { FULL } else { SLIDING }.to_string()
                })
                .collect(),
        };
        if types.len() != n || types.iter().any(|k| k != SLIDING && k != FULL) {
            return Err(c.error(format!(
                "text_config.layer_types is {types:?}, must name \"{SLIDING}\" or \"{FULL}\" \
                 for each of the {n} layers"
            )));
        }
        let rope_params = t.rope_parameters.clone().unwrap_or_default();
        let (h, eps) = (d.hidden_size, d.rms_norm_eps);
        // The per-layer input gates exist in a checkpoint but never run (no per-layer input).
        if t.hidden_size_per_layer_input.unwrap_or(0) != 0 {
            w.drop_where(|k| k.contains(".per_layer_") || k.contains(".post_per_layer_input_norm"));
        }
        let mut layers = Vec::with_capacity(n);
        for (i, kind) in types.into_iter().enumerate() {
            let p = format!("model.layers.{i}");
            let hd = match t.global_head_dim {
                Some(g) if kind == FULL && g != 0 => g,
                _ => d.head_dim(),
            };
            if hd < 1 {
                return Err(c.error(format!(
                    "the {kind} layers' head dimension is {hd}, must be at least 1"
                )));
            }
            let params = rope_params.get(&kind).cloned().unwrap_or(json!({}));
            let rope = LayerRope::new(hd, t.rope_traditional, &params)
                .map_err(|m| c.error(format!("text_config.rope_parameters.{kind}: {m}")))?;
            let heads = d.num_attention_heads;
            let norm = |w: &mut Weights, name: &str, dims: i32| {
                RmsNorm::load(w, &format!("{p}.{name}"), dims, eps)
            };
            layers.push(Layer {
                q_proj: Linear::load(
                    w,
                    &q,
                    &format!("{p}.self_attn.q_proj"),
                    h,
                    heads * hd,
                    false,
                )?,
                o_proj: Linear::load(
                    w,
                    &q,
                    &format!("{p}.self_attn.o_proj"),
                    heads * hd,
                    h,
                    false,
                )?,
                q_norm: norm(w, "self_attn.q_norm", hd)?,
                rope,
                n_heads: heads,
                head_dim: hd,
                mlp: GatedMlp::load(
                    w,
                    &q,
                    &format!("{p}.mlp"),
                    h,
                    d.intermediate_size,
                    false,
                    Activation::Geglu,
                )?,
                input_layernorm: norm(w, "input_layernorm", h)?,
                post_attention_layernorm: norm(w, "post_attention_layernorm", h)?,
                pre_feedforward_layernorm: norm(w, "pre_feedforward_layernorm", h)?,
                post_feedforward_layernorm: norm(w, "post_feedforward_layernorm", h)?,
                layer_scalar: w.take_shaped(&format!("{p}.layer_scalar"), &[1])?,
                kind,
            });
        }
        let backbone = a.backbone_hidden_size as i32;
        let tied = a.tie_word_embeddings;
        if tied {
            // sanitize: a tied checkpoint's lm_head is dropped.
            w.take_optional("lm_head.weight");
        }
        Ok(Gemma4Assistant {
            embed_tokens: Embedding::load(w, &q, "model.embed_tokens", d.vocab_size, h)?,
            lm_head: if tied {
                None
            } else {
                Some(Linear::load(w, &q, "lm_head", h, d.vocab_size, false)?)
            },
            layers,
            norm: RmsNorm::load(w, "model.norm", h, eps)?,
            pre_projection: Linear::load(w, &q, "pre_projection", 2 * backbone, h, false)?,
            post_projection: Linear::load(w, &q, "post_projection", h, backbone, false)?,
            backbone_hidden_size: a.backbone_hidden_size,
            vocab_size: d.vocab_size as usize,
            block_size: a.block_size,
        })
    }

    /// Each layer's kind, head dimension and query heads, in order (what the target must
    /// serve: crate::validate::gemma4_assistant).
    pub fn layer_shapes(&self) -> impl Iterator<Item = (&str, usize, usize)> {
        self.layers
            .iter()
            .map(|l| (l.kind.as_str(), l.head_dim as usize, l.n_heads as usize))
    }

    /// One drafter pass (`_forward_hidden` and the head) over `input` (1, 1, 2 x backbone):
    /// the scaled target embedding of the last token next to the previous state. `kv` holds
    /// each layer's keys and values (1, kv_heads, S, head_dim), all visible; `position` is the
    /// queries' RoPE offset. Returns the next state (1, 1, backbone) and the logits (1, V).
    pub fn step(
        &self,
        input: &Array,
        kv: &[(Array, Array)],
        position: usize,
    ) -> Result<(Array, Array)> {
        let mut h = self.pre_projection.forward(input)?;
        for (layer, (keys, values)) in self.layers.iter().zip(kv) {
            let x = layer.input_layernorm.forward(&h)?;
            let (b, l) = (x.dim(0), x.dim(1));
            let q = layer
                .q_proj
                .forward(&x)?
                .reshape(&[b, l, layer.n_heads, -1])?;
            let q = layer.q_norm.forward(&q)?.transpose(&[0, 2, 1, 3])?;
            let q = layer.rope.forward(&q, position)?;
            let o = fast::scaled_dot_product_attention(
                &q,
                keys,
                values,
                1.0,
                fast::SdpaMask::None,
                None,
            )?;
            let o = o.transpose(&[0, 2, 1, 3])?.reshape(&[b, l, -1])?;
            let r = layer
                .post_attention_layernorm
                .forward(&layer.o_proj.forward(&o)?)?;
            let mid = h.add(&r)?;
            let r = layer
                .mlp
                .forward(&layer.pre_feedforward_layernorm.forward(&mid)?)?;
            let out = mid.add(&layer.post_feedforward_layernorm.forward(&r)?)?;
            h = out.multiply(&layer.layer_scalar)?;
        }
        let h = self.norm.forward(&h)?;
        let state = self.post_projection.forward(&h)?;
        let last = h.squeeze(&[1])?;
        let logits = match &self.lm_head {
            Some(head) => head.forward(&last)?,
            None => self.embed_tokens.as_linear(&last)?,
        };
        Ok((state, logits))
    }
}

/// The concatenated drafter input of one step.
pub fn step_input(embedded: &Array, state: &Array) -> Result<Array> {
    Ok(ops::concatenate(&[embedded, state], -1)?)
}
