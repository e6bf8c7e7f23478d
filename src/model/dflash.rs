//! A DFlash block drafter, mlx-vlm's DFlashDraftModel
//! (mlx_vlm/speculative/drafters/qwen3_dflash/dflash.py, config in config.py there): it drafts
//! a whole block in one pass. The target's hidden states at `target_layer_ids` (concatenated on
//! the last axis) go through `fc` and `hidden_norm` to become the context; every layer projects
//! the context to keys and values once (one fused matmul over all layers, as
//! `_project_context_kv`), which the layer's KV cache keeps. The block `[bonus, mask, ...]` is
//! embedded by the target's embedding and attends, without a causal mask unless the config asks
//! for one, over the cached context and itself; the target's output head turns rows 1.. into
//! the drafts. The drafter owns no embedding or head.

use std::path::Path;

use mlx::{ops, Array};
use serde::Deserialize;
use serde_json::{json, Value};

use super::layers::{AttentionProjections, Dims, Linear, PreNormBlock, RmsNorm, Rope};
use crate::cache::{default_caches, LayerCache, Mask};
use crate::load::{load_config, Config, LoadError, LoadResult, QuantConfig, Weights};
use crate::Result;

/// The DFlash fields of config.json, after mlx-vlm's DFlashConfig.from_dict folds the nested
/// `dflash_config` into the top level.
#[derive(Deserialize)]
struct Args {
    #[serde(flatten)]
    dims: Dims,
    rope_theta: f64,
    rope_scaling: Option<Value>,
    block_size: usize,
    mask_token_id: u32,
    target_layer_ids: Vec<usize>,
    runtime_block_size: Option<usize>,
    is_causal: bool,
    layer_types: Vec<String>,
    draft_window_size: Option<usize>,
    attention_sink_bias: bool,
    final_logit_softcapping: Option<f64>,
}

/// DFlashConfig's dataclass defaults for the fields a checkpoint may leave out.
fn defaults() -> Value {
    json!({
        "rope_theta": 10000000.0,
        "rope_scaling": null,
        "block_size": 16,
        "mask_token_id": 248070,
        "target_layer_ids": [1, 8, 15, 22, 29],
        "runtime_block_size": null,
        "is_causal": false,
        "layer_types": [],
        "draft_window_size": null,
        "attention_sink_bias": false,
        "final_logit_softcapping": null,
    })
}

/// The drafter type mlx-vlm resolves a checkpoint to (mlx_vlm/utils.py, get_model_type): a
/// DFlash checkpoint names its target's family in model_type and carries a `dflash_config`, so
/// qwen3 + dflash_config is "qwen3_dflash"; a projector_type "dspark" or a Markov rank makes it
/// a DSpark drafter. A config without a `dflash_config` is no drafter at all.
fn drafter_kind(config: &Config) -> LoadResult<String> {
    let model_type = config.model_type()?.to_lowercase();
    let Some(nested) = config.json.get("dflash_config") else {
        return Err(config.error(format!(
            "model_type {model_type:?} without a dflash_config is not a DFlash drafter \
             (verity knows qwen3_dflash: model_type \"qwen3\" with a dflash_config)"
        )));
    };
    let rank = |v: Option<&Value>| v.and_then(Value::as_i64).unwrap_or(0);
    let dspark = nested.get("projector_type").and_then(Value::as_str) == Some("dspark")
        || rank(config.json.get("markov_rank")).max(rank(nested.get("markov_rank"))) > 0;
    Ok(if dspark {
        "dspark".into()
    } else {
        format!("{model_type}_dflash")
    })
}

/// DFlashConfig.from_dict: `dflash_config` keys override the top-level ones.
fn flatten(config: &mut Config) {
    let Some(Value::Object(nested)) = config.json.remove("dflash_config") else {
        return;
    };
    for key in [
        "mask_token_id",
        "target_layer_ids",
        "runtime_block_size",
        "draft_window_size",
        "attention_sink_bias",
    ] {
        if let Some(v) = nested.get(key) {
            config.json.insert(key.into(), v.clone());
        }
    }
    if let Some(v) = nested.get("causal") {
        config.json.insert("is_causal".into(), v.clone());
    }
}

/// One drafter layer: DFlashAttention inside the pre-norm residual block.
struct DflashLayer {
    attn: AttentionProjections,
    q_norm: RmsNorm,
    k_norm: RmsNorm,
    block: PreNormBlock,
}

pub struct DflashModel {
    fc: Linear,
    hidden_norm: RmsNorm,
    layers: Vec<DflashLayer>,
    norm: RmsNorm,
    rope: Rope,
    /// Every layer's k_proj then v_proj weights stacked: the context's keys and values for all
    /// layers come from one matmul.
    context_kv: Linear,
    n_heads: i32,
    n_kv_heads: i32,
    scale: f32,
    causal: bool,
    /// The trained block size (drafts + 1), capped by `runtime_block_size`.
    pub block_size: usize,
    pub mask_token_id: u32,
    /// The target layers whose outputs the drafter reads, in layer order.
    pub target_layer_ids: Vec<usize>,
    pub hidden_size: usize,
    pub vocab_size: usize,
}

impl DflashModel {
    /// Loads a drafter folder (config.json, safetensors).
    pub fn load(dir: &Path) -> LoadResult<DflashModel> {
        let mut config = load_config(dir)?;
        let kind = drafter_kind(&config)?;
        if kind != "qwen3_dflash" {
            return Err(config.error(format!(
                "{kind:?} is not a DFlash drafter verity knows (qwen3_dflash: model_type \
                 \"qwen3\" with a dflash_config)"
            )));
        }
        flatten(&mut config);
        let a: Args = config.args(defaults())?;
        check_supported(&config, &a)?;
        let mut w = Weights::load(dir)?;
        w.rename(|k| Some(k.strip_prefix("model.").unwrap_or(k).to_string()));
        let model = Self::build(&config, &a, &mut w)?;
        w.finish()?;
        Ok(model)
    }

    fn build(config: &Config, a: &Args, w: &mut Weights) -> LoadResult<DflashModel> {
        let d = &a.dims;
        let q = QuantConfig::from_config(config)?;
        let (h, eps, hd) = (d.hidden_size, d.rms_norm_eps, d.head_dim());
        let rope = Rope::new(hd, a.rope_theta, false, a.rope_scaling.as_ref())
            .map_err(|m| config.error(m))?;
        let layers = (0..d.num_hidden_layers)
            .map(|i| {
                let path = format!("layers.{i}");
                let attn_path = format!("{path}.self_attn");
                Ok(DflashLayer {
                    attn: AttentionProjections::load(w, &q, &attn_path, d, 1, false)?,
                    q_norm: RmsNorm::load(w, &format!("{attn_path}.q_norm"), hd, eps)?,
                    k_norm: RmsNorm::load(w, &format!("{attn_path}.k_norm"), hd, eps)?,
                    block: PreNormBlock::load(w, &q, &path, d, false)?,
                })
            })
            .collect::<LoadResult<Vec<_>>>()?;
        let context_kv = stacked_kv_weights(w, &layers)?;
        let taps = a.target_layer_ids.len() as i32;
        Ok(DflashModel {
            fc: Linear::load(w, &q, "fc", taps * h, h, false)?,
            hidden_norm: RmsNorm::load(w, "hidden_norm", h, eps)?,
            norm: RmsNorm::load(w, "norm", h, eps)?,
            layers,
            rope,
            context_kv,
            n_heads: d.num_attention_heads,
            n_kv_heads: d.kv_heads(),
            scale: (f64::from(hd)).powf(-0.5) as f32,
            causal: a.is_causal,
            block_size: a
                .runtime_block_size
                .map_or(a.block_size, |r| a.block_size.min(r.max(1))),
            mask_token_id: a.mask_token_id,
            target_layer_ids: a.target_layer_ids.clone(),
            hidden_size: h as usize,
            vocab_size: d.vocab_size as usize,
        })
    }

    /// Fresh caches: one plain KV cache per layer, holding context keys and values only.
    pub fn make_cache(&self) -> Vec<LayerCache> {
        default_caches(self.layers.len(), None)
    }

    /// DFlashDraftModel._hidden: `block` (1, L, H) is the embedded block, `context` (1, S,
    /// taps x H) the target's tapped rows not yet in `caches` (S >= 1); returns the post-norm
    /// states (1, L, H). The context sits at the caches' offset, the block right after it.
    pub fn forward(
        &self,
        block: &Array,
        context: &Array,
        caches: &mut [LayerCache],
    ) -> Result<Array> {
        let h_ctx = self.hidden_norm.forward(&self.fc.forward(context)?)?;
        let projected = self.context_kv.forward(&h_ctx)?;
        let width = projected.dim(2) / (2 * self.layers.len() as i32);
        let chunk = |i: usize| projected.slice_axis(2, i as i32 * width, (i as i32 + 1) * width);
        let mut h = block.clone();
        for (i, (layer, cache)) in self.layers.iter().zip(caches).enumerate() {
            let (keys, values) = (chunk(2 * i)?, chunk(2 * i + 1)?);
            h = layer
                .block
                .forward(&h, |x| self.attend(layer, x, &keys, &values, cache))?;
        }
        Ok(self.norm.forward(&h)?)
    }

    /// DFlashAttention: the block's queries over the cached context plus the block itself.
    fn attend(
        &self,
        layer: &DflashLayer,
        x: &Array,
        ctx_keys: &Array,
        ctx_values: &Array,
        cache: &mut LayerCache,
    ) -> Result<Array> {
        let (b, l, s) = (x.dim(0), x.dim(1), ctx_keys.dim(1));
        let heads = |y: &Array, len: i32, n: i32| y.reshape(&[b, len, n, -1]);
        let t = |y: Array| y.transpose(&[0, 2, 1, 3]);
        let p = &layer.attn;
        let q = t(layer
            .q_norm
            .forward(&heads(&p.q_proj.forward(x)?, l, self.n_heads)?)?)?;
        let ctx_k = t(layer
            .k_norm
            .forward(&heads(ctx_keys, s, self.n_kv_heads)?)?)?;
        let ctx_v = t(heads(ctx_values, s, self.n_kv_heads)?)?;
        let prop_k =
            t(layer
                .k_norm
                .forward(&heads(&p.k_proj.forward(x)?, l, self.n_kv_heads)?)?)?;
        let prop_v = t(heads(&p.v_proj.forward(x)?, l, self.n_kv_heads)?)?;
        let offset = cache.offset();
        let q = self.rope.forward(&q, offset + s as usize)?;
        let ctx_k = self.rope.forward(&ctx_k, offset)?;
        let prop_k = self.rope.forward(&prop_k, offset + s as usize)?;
        let (keys, values) = match cache.update_and_fetch(&ctx_k, &ctx_v)? {
            crate::cache::KeysValues::Dense { keys, values } => (keys, values),
            _ => return Err(crate::error::contract("a DFlash cache is a plain KV cache")),
        };
        let keys = ops::concatenate(&[&keys, &prop_k], 2)?;
        let values = ops::concatenate(&[&values, &prop_v], 2)?;
        let mask = if self.causal {
            Mask::Causal
        } else {
            Mask::None
        };
        let out = mlx::fast::scaled_dot_product_attention(
            &q,
            &keys,
            &values,
            self.scale,
            mask.as_sdpa()?,
            None,
        )?;
        Ok(p.o_proj.forward(&t(out)?.reshape(&[b, l, -1])?)?)
    }
}

/// The fused context projection `_project_context_kv` builds on first use: k_proj, v_proj of
/// every layer, stacked on the output axis.
fn stacked_kv_weights(w: &Weights, layers: &[DflashLayer]) -> LoadResult<Linear> {
    let projections: Vec<&Linear> = layers
        .iter()
        .flat_map(|l| [&l.attn.k_proj, &l.attn.v_proj])
        .collect();
    Linear::stacked(&projections)
        .ok_or_else(|| w.config_error("a quantized DFlash drafter is not supported".into()))?
        .map_err(|source| LoadError::Mlx {
            folder: w.folder().into(),
            source,
        })
}

/// The DFlashConfig options verity does not implement, refused at load.
fn check_supported(config: &Config, a: &Args) -> LoadResult<()> {
    if a.layer_types.iter().any(|t| t != "full_attention") {
        return Err(config.error(
            "layer_types other than \"full_attention\" (sliding drafter layers) are not supported",
        ));
    }
    let refuse = |what: &str| Err(config.error(format!("{what} is not supported")));
    if a.draft_window_size.is_some_and(|w| w > 0) {
        return refuse("draft_window_size (a windowed drafter cache)");
    }
    if a.attention_sink_bias {
        return refuse("attention_sink_bias");
    }
    if a.final_logit_softcapping.is_some() {
        return refuse("final_logit_softcapping");
    }
    if a.block_size < 2 {
        return Err(config.error(format!(
            "block_size is {}, must be at least 2 (the bonus token and one draft)",
            a.block_size
        )));
    }
    if a.target_layer_ids.is_empty() || a.target_layer_ids.windows(2).any(|p| p[0] >= p[1]) {
        return Err(config.error(format!(
            "target_layer_ids is {:?}, must be non-empty and strictly increasing",
            a.target_layer_ids
        )));
    }
    Ok(())
}
