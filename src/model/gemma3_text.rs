//! mlx_lm/models/gemma3_text.py: sliding-window layers (every `sliding_window_pattern`-th is
//! global), Gemma's `1 + weight` RMSNorms around attention and MLP, a GELU MLP, and the input
//! embedding scaled by sqrt(hidden) rounded to bf16.

use mlx::{Array, Dtype};
use serde::Deserialize;
use serde_json::{json, Value};

use super::layers::{
    Activation, Attention, AttentionProjections, Dims, GatedMlp, OuterLayers, QkNorm, RmsNorm, Rope,
};
use super::rows::{self, LayerRows};
use super::{Forward, LanguageModel};
use crate::cache::{KvCache, LayerCache, Mask, RotatingKvCache};
use crate::load::{Config, LoadResult, QuantConfig, Weights};
use crate::Result;

#[derive(Deserialize)]
struct Args {
    #[serde(flatten)]
    dims: Dims,
    rope_theta: f64,
    rope_local_base_freq: f64,
    query_pre_attn_scalar: f64,
    sliding_window: usize,
    sliding_window_pattern: usize,
    rope_scaling: Option<Value>,
}

struct Block {
    attn: Attention,
    mlp: GatedMlp,
    input_layernorm: RmsNorm,
    post_attention_layernorm: RmsNorm,
    pre_feedforward_layernorm: RmsNorm,
    post_feedforward_layernorm: RmsNorm,
}

/// The compiled `clip_residual`: a plain sum, except that float16 sums are formed in f32 and
/// clipped to the float16 range.
fn clip_residual(x: &Array, y: &Array) -> mlx::Result<Array> {
    if x.dtype() != Dtype::Float16 {
        return x.add(y);
    }
    let bound = Array::from_f32(65504.0);
    let sum = x.astype(Dtype::Float32)?.add(&y.astype(Dtype::Float32)?)?;
    mlx::ops::clip(&sum, Some(&bound.negative()?), Some(&bound))?.astype(Dtype::Float16)
}

impl Block {
    fn forward(&self, x: &Array, masks: &[Mask], rows: &mut LayerRows) -> Result<Array> {
        let r = self
            .attn
            .forward(&self.input_layernorm.forward(x)?, masks, rows)?;
        let h = clip_residual(x, &self.post_attention_layernorm.forward(&r)?)?;
        let r = self
            .mlp
            .forward(&self.pre_feedforward_layernorm.forward(&h)?)?;
        Ok(clip_residual(
            &h,
            &self.post_feedforward_layernorm.forward(&r)?,
        )?)
    }
}

pub struct Model {
    outer: OuterLayers,
    layers: Vec<Block>,
    embed_scale: f32,
    head_dim: usize,
    window: usize,
    pattern: usize,
}

impl Model {
    pub fn load(config: &Config, w: &mut Weights, q: &QuantConfig) -> LoadResult<Model> {
        // The Python dataclass defaults (gemma3_text.ModelArgs).
        let a: Args = config.args(json!({
            "hidden_size": 1152, "num_hidden_layers": 26, "intermediate_size": 6912,
            "num_attention_heads": 4, "head_dim": 256, "rms_norm_eps": 1.0e-6,
            "vocab_size": 262144, "num_key_value_heads": 1, "rope_theta": 1_000_000.0,
            "rope_local_base_freq": 10_000.0, "query_pre_attn_scalar": 256.0,
            "sliding_window": 512, "sliding_window_pattern": 6,
        }))?;
        let d = &a.dims;
        if a.sliding_window == 0 {
            return Err(config.error("sliding_window must be at least 1"));
        }
        if a.sliding_window_pattern == 0 || a.sliding_window_pattern > d.num_hidden_layers {
            return Err(
                config.error("sliding_window_pattern must be between 1 and the layer count")
            );
        }
        let (hd, eps) = (d.head_dim(), d.rms_norm_eps);
        let scale = a.query_pre_attn_scalar.powf(-0.5) as f32;
        let local =
            Rope::new(hd, a.rope_local_base_freq, false, None).map_err(|m| config.error(m))?;
        let global = Rope::new(hd, a.rope_theta, false, a.rope_scaling.as_ref())
            .map_err(|m| config.error(m))?;
        let mut layers = Vec::with_capacity(d.num_hidden_layers);
        for i in 0..d.num_hidden_layers {
            let p = format!("model.layers.{i}");
            let sliding = (i + 1) % a.sliding_window_pattern != 0;
            let norm = |w: &mut Weights, name: &str, dims: i32| {
                RmsNorm::load_offset(w, &format!("{p}.{name}"), dims, eps)
            };
            let attn = Attention {
                proj: AttentionProjections::load(w, q, &format!("{p}.self_attn"), d, 1, false)?,
                qk_norm: QkNorm::AfterTranspose {
                    q: norm(w, "self_attn.q_norm", hd)?,
                    k: norm(w, "self_attn.k_norm", hd)?,
                },
                rope: if sliding { local } else { global },
                n_heads: d.num_attention_heads,
                n_kv_heads: d.kv_heads(),
                scale,
            };
            let h = d.hidden_size;
            layers.push(Block {
                attn,
                mlp: GatedMlp::load(
                    w,
                    q,
                    &format!("{p}.mlp"),
                    h,
                    d.intermediate_size,
                    false,
                    Activation::GeluApprox,
                )?,
                input_layernorm: norm(w, "input_layernorm", h)?,
                post_attention_layernorm: norm(w, "post_attention_layernorm", h)?,
                pre_feedforward_layernorm: norm(w, "pre_feedforward_layernorm", h)?,
                post_feedforward_layernorm: norm(w, "post_feedforward_layernorm", h)?,
            });
        }
        // sanitize: the head is tied exactly when lm_head.weight is absent.
        let tied = !w.contains("lm_head.weight");
        let mut outer = OuterLayers::load(w, q, "", d, tied)?;
        outer.norm = outer.norm.plus_one(w)?;
        Ok(Model {
            outer,
            layers,
            // Python rounds `hidden_size**0.5` to bf16 (mx.array(.., mx.bfloat16)) every call.
            embed_scale: (d.hidden_size as f64).sqrt() as f32,
            head_dim: d.head_dim() as usize,
            window: a.sliding_window,
            pattern: a.sliding_window_pattern,
        })
    }

    fn is_global(&self, layer: usize) -> bool {
        layer % self.pattern == self.pattern - 1
    }
}

impl LanguageModel for Model {
    fn forward_rows(
        &self,
        ids: &Array,
        rows: &mut [&mut [LayerCache]],
        lens: &[usize],
        taps: &[usize],
    ) -> Result<Forward> {
        let h = self.outer.embed_tokens.forward(ids)?;
        let scale = Array::scalar(self.embed_scale, Dtype::Bfloat16)?.astype(h.dtype())?;
        let h = h.multiply(&scale)?;
        let global_masks = rows::masks(rows, lens, self.pattern - 1, None)?;
        let sliding_masks = if self.pattern > 1 {
            rows::masks(rows, lens, 0, Some(self.window))?
        } else {
            Vec::new()
        };
        let layers = self.layers.len();
        self.outer.run(h, rows, lens, layers, taps, |i, h, rows| {
            let masks = if self.is_global(i) {
                &global_masks
            } else {
                &sliding_masks
            };
            self.layers[i].forward(h, masks, rows)
        })
    }

    fn num_layers(&self) -> usize {
        self.layers.len()
    }

    fn attention_head_dim(&self) -> usize {
        self.head_dim
    }

    fn own_caches(&self) -> Option<Vec<LayerCache>> {
        let cache = |i| {
            if self.is_global(i) {
                LayerCache::Kv(KvCache::default())
            } else {
                LayerCache::Rotating(RotatingKvCache::new(self.window, 0))
            }
        };
        Some((0..self.layers.len()).map(cache).collect())
    }

    fn outer(&self) -> &OuterLayers {
        &self.outer
    }
}
