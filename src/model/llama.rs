//! mlx_lm/models/llama.py: pre-norm decoder with grouped-query attention, SwiGLU MLP, optional
//! sliding-window layers, tied or separate output head. qwen3 reuses it with q/k norms.

use mlx::Array;
use serde::Deserialize;
use serde_json::Value;

use super::layers::{
    Activation, Attention, Embedding, GatedMlp, Head, Linear, OuterLayers, QkNorm, RmsNorm, Rope,
    Taps,
};
use super::{Forward, LanguageModel};
use crate::cache::{default_caches, KvCache, LayerCache, Mask, RotatingKvCache};
use crate::load::{Config, LoadError, QuantConfig, Weights};
use crate::Result;

#[derive(Deserialize)]
struct Args {
    hidden_size: i32,
    num_hidden_layers: usize,
    intermediate_size: i32,
    num_attention_heads: i32,
    rms_norm_eps: f64,
    vocab_size: i32,
    head_dim: Option<i32>,
    num_key_value_heads: Option<i32>,
    #[serde(default)]
    attention_bias: bool,
    #[serde(default)]
    mlp_bias: bool,
    #[serde(default = "default_rope_theta")]
    rope_theta: f64,
    #[serde(default)]
    rope_traditional: bool,
    rope_scaling: Option<Value>,
    #[serde(default = "default_true")]
    tie_word_embeddings: bool,
    layer_types: Option<Vec<String>>,
    sliding_window: Option<usize>,
}

fn default_rope_theta() -> f64 {
    10000.0
}

fn default_true() -> bool {
    true
}

/// `h = x + attn(norm(x)); out = h + mlp(norm(h))`.
pub struct Block {
    pub attn: Attention,
    pub mlp: GatedMlp,
    pub input_layernorm: RmsNorm,
    pub post_attention_layernorm: RmsNorm,
    pub sliding: bool,
}

impl Block {
    fn forward(&self, x: &Array, mask: &Mask, cache: &mut LayerCache) -> Result<Array> {
        let r = self
            .attn
            .forward(&self.input_layernorm.forward(x)?, mask, cache)?;
        let h = x.add(&r)?;
        let r = self
            .mlp
            .forward(&self.post_attention_layernorm.forward(&h)?)?;
        Ok(h.add(&r)?)
    }
}

/// The shape of a llama-family model, as the loaders of llama and qwen3 read it from their
/// configs.
pub(crate) struct Shape<'a> {
    pub hidden: i32,
    pub layers: usize,
    pub intermediate: i32,
    pub heads: i32,
    pub kv_heads: i32,
    pub head_dim: i32,
    pub eps: f64,
    pub vocab: i32,
    pub bias: bool,
    pub mlp_bias: bool,
    pub rope: Rope,
    pub tied: bool,
    pub qk_norm: bool,
    pub layer_types: Vec<String>,
    pub sliding_window: Option<usize>,
    pub own_make_cache: bool,
    pub config: &'a Config,
}

pub struct Model {
    outer: OuterLayers,
    layers: Vec<Block>,
    sliding_window: Option<usize>,
    fa_idx: usize,
    swa_idx: Option<usize>,
    own_make_cache: bool,
}

impl Model {
    pub fn load(
        config: &Config,
        w: &mut Weights,
        q: &QuantConfig,
    ) -> std::result::Result<Model, LoadError> {
        let a: Args = config.parse()?;
        let head_dim = a.head_dim.unwrap_or(a.hidden_size / a.num_attention_heads);
        let rope = Rope::new(
            head_dim,
            a.rope_theta,
            a.rope_traditional,
            a.rope_scaling.as_ref(),
        )
        .map_err(|m| config.error(m))?;
        // sanitize: drop precomputed rotary frequencies, and lm_head when tied.
        w.drop_where(|k| k.contains("self_attn.rotary_emb.inv_freq"));
        if a.tie_word_embeddings {
            w.take_optional("lm_head.weight");
        }
        Model::build(
            Shape {
                hidden: a.hidden_size,
                layers: a.num_hidden_layers,
                intermediate: a.intermediate_size,
                heads: a.num_attention_heads,
                kv_heads: a.num_key_value_heads.unwrap_or(a.num_attention_heads),
                head_dim,
                eps: a.rms_norm_eps,
                vocab: a.vocab_size,
                bias: a.attention_bias,
                mlp_bias: a.mlp_bias,
                rope,
                tied: a.tie_word_embeddings,
                qk_norm: false,
                layer_types: a
                    .layer_types
                    .unwrap_or_else(|| vec!["full_attention".into(); a.num_hidden_layers]),
                sliding_window: a.sliding_window,
                own_make_cache: true,
                config,
            },
            w,
            q,
        )
    }

    pub(crate) fn build(
        s: Shape<'_>,
        w: &mut Weights,
        q: &QuantConfig,
    ) -> std::result::Result<Model, LoadError> {
        if s.layer_types.len() != s.layers {
            return Err(s.config.error("layer_types must list one type per layer"));
        }
        let fa_idx = s
            .layer_types
            .iter()
            .position(|t| t == "full_attention")
            .ok_or_else(|| s.config.error("no full_attention layer in layer_types"))?;
        let swa_idx = s.layer_types.iter().position(|t| t == "sliding_attention");
        if swa_idx.is_some() && s.sliding_window.is_none() {
            return Err(s
                .config
                .error("sliding_attention layers need sliding_window"));
        }
        let scale = (s.head_dim as f64).powf(-0.5) as f32;
        let mut layers = Vec::with_capacity(s.layers);
        for (i, kind) in s.layer_types.iter().enumerate() {
            let p = format!("model.layers.{i}");
            let qk_norm = if s.qk_norm {
                QkNorm::BeforeTranspose {
                    q: RmsNorm::load(w, &format!("{p}.self_attn.q_norm"), s.head_dim, s.eps)?,
                    k: RmsNorm::load(w, &format!("{p}.self_attn.k_norm"), s.head_dim, s.eps)?,
                }
            } else {
                QkNorm::None
            };
            let (qd, kvd) = (s.heads * s.head_dim, s.kv_heads * s.head_dim);
            let attn = Attention {
                q_proj: Linear::load(w, q, &format!("{p}.self_attn.q_proj"), s.hidden, qd, s.bias)?,
                k_proj: Linear::load(
                    w,
                    q,
                    &format!("{p}.self_attn.k_proj"),
                    s.hidden,
                    kvd,
                    s.bias,
                )?,
                v_proj: Linear::load(
                    w,
                    q,
                    &format!("{p}.self_attn.v_proj"),
                    s.hidden,
                    kvd,
                    s.bias,
                )?,
                o_proj: Linear::load(w, q, &format!("{p}.self_attn.o_proj"), qd, s.hidden, s.bias)?,
                qk_norm,
                rope: s.rope,
                n_heads: s.heads,
                n_kv_heads: s.kv_heads,
                scale,
            };
            layers.push(Block {
                attn,
                mlp: GatedMlp::load(
                    w,
                    q,
                    &format!("{p}.mlp"),
                    s.hidden,
                    s.intermediate,
                    s.mlp_bias,
                    Activation::Swiglu,
                )?,
                input_layernorm: RmsNorm::load(
                    w,
                    &format!("{p}.input_layernorm"),
                    s.hidden,
                    s.eps,
                )?,
                post_attention_layernorm: RmsNorm::load(
                    w,
                    &format!("{p}.post_attention_layernorm"),
                    s.hidden,
                    s.eps,
                )?,
                sliding: kind == "sliding_attention",
            });
        }
        Ok(Model {
            outer: OuterLayers {
                embed_tokens: Embedding::load(w, q, "model.embed_tokens", s.vocab, s.hidden)?,
                norm: RmsNorm::load(w, "model.norm", s.hidden, s.eps)?,
                head: if s.tied {
                    Head::Tied
                } else {
                    Head::Separate(Linear::load(w, q, "lm_head", s.hidden, s.vocab, false)?)
                },
            },
            layers,
            sliding_window: s.sliding_window,
            fa_idx,
            swa_idx,
            own_make_cache: s.own_make_cache,
        })
    }
}

impl LanguageModel for Model {
    fn forward(
        &self,
        inputs: &Array,
        caches: &mut [LayerCache],
        taps: &[usize],
    ) -> Result<Forward> {
        let mut h = self.outer.embed_tokens.forward(inputs)?;
        let n = h.dim(1) as usize;
        let fa_mask = caches[self.fa_idx].make_mask(n, None)?;
        let swa_mask = match self.swa_idx {
            Some(i) => caches[i].make_mask(n, self.sliding_window)?,
            None => Mask::None,
        };
        let mut taps = Taps::new(taps, self.layers.len());
        for (i, (layer, cache)) in self.layers.iter().zip(caches.iter_mut()).enumerate() {
            let mask = if layer.sliding { &swa_mask } else { &fa_mask };
            h = layer.forward(&h, mask, cache)?;
            taps.capture(i, &h);
        }
        self.outer.finish(&h, taps)
    }

    fn make_cache(&self, max_kv_size: Option<usize>) -> Vec<LayerCache> {
        if !self.own_make_cache {
            return default_caches(self.layers.len(), max_kv_size);
        }
        self.layers
            .iter()
            .map(|l| match (l.sliding, self.sliding_window) {
                (true, Some(w)) => LayerCache::Rotating(RotatingKvCache::new(w, 0)),
                _ => LayerCache::Kv(KvCache::default()),
            })
            .collect()
    }

    fn vocab_size(&self) -> usize {
        self.outer.vocab()
    }

    fn num_layers(&self) -> usize {
        self.layers.len()
    }

    fn ignores_max_kv_size(&self) -> bool {
        self.own_make_cache
    }
}
