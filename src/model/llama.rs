//! mlx_lm/models/llama.py: pre-norm decoder with grouped-query attention, SwiGLU MLP, optional
//! sliding-window layers, tied or separate output head. qwen3 reuses it with q/k norms.

use mlx::Array;
use serde::Deserialize;
use serde_json::{json, Value};

use super::layers::{
    Attention, AttentionProjections, Dims, OuterLayers, PreNormBlock, QkNorm, RmsNorm, Rope,
};
use super::rows;
use super::{Forward, LanguageModel};
use crate::cache::{KvCache, LayerCache, RotatingKvCache};
use crate::load::{Config, LoadResult, QuantConfig, Weights};
use crate::Result;

#[derive(Deserialize)]
struct Args {
    #[serde(flatten)]
    dims: Dims,
    attention_bias: bool,
    mlp_bias: bool,
    rope_theta: f64,
    rope_traditional: bool,
    rope_scaling: Option<Value>,
    layer_types: Option<Vec<String>>,
    sliding_window: Option<usize>,
}

/// One decoder layer: attention in a pre-norm residual block.
struct Block {
    attn: Attention,
    block: PreNormBlock,
    sliding: bool,
}

/// How a llama-family model is built, as the loaders of llama and qwen3 read it from their
/// configs.
pub(crate) struct Shape<'a> {
    pub dims: &'a Dims,
    pub rope: Rope,
    pub tied: bool,
    pub attention_bias: bool,
    pub mlp_bias: bool,
    pub qk_norm: bool,
    pub layer_types: Vec<String>,
    pub sliding_window: Option<usize>,
    /// Whether the Python class defines its own make_cache (llama does, qwen3 does not).
    pub own_make_cache: bool,
    pub config: &'a Config,
}

pub struct Model {
    outer: OuterLayers,
    layers: Vec<Block>,
    sliding_window: Option<usize>,
    head_dim: usize,
    fa_idx: usize,
    swa_idx: Option<usize>,
    own_make_cache: bool,
}

impl Model {
    pub fn load(config: &Config, w: &mut Weights, q: &QuantConfig) -> LoadResult<Model> {
        let a: Args = config.args(json!({
            "attention_bias": false, "mlp_bias": false, "rope_theta": 10000.0,
            "rope_traditional": false,
        }))?;
        let tied = a.dims.tie_word_embeddings.unwrap_or(true);
        let rope = Rope::new(
            a.dims.head_dim(),
            a.rope_theta,
            a.rope_traditional,
            a.rope_scaling.as_ref(),
        )
        .map_err(|m| config.error(m))?;
        // sanitize: drop precomputed rotary frequencies, and lm_head when tied.
        w.drop_where(|k| k.contains("self_attn.rotary_emb.inv_freq"));
        if tied {
            w.take_optional("lm_head.weight");
        }
        let layers = a.dims.num_hidden_layers;
        Model::build(
            Shape {
                dims: &a.dims,
                rope,
                tied,
                attention_bias: a.attention_bias,
                mlp_bias: a.mlp_bias,
                qk_norm: false,
                layer_types: a
                    .layer_types
                    .unwrap_or_else(|| vec!["full_attention".into(); layers]),
                sliding_window: a.sliding_window,
                own_make_cache: true,
                config,
            },
            w,
            q,
        )
    }

    pub(crate) fn build(s: Shape<'_>, w: &mut Weights, q: &QuantConfig) -> LoadResult<Model> {
        let d = s.dims;
        if s.layer_types.len() != d.num_hidden_layers {
            return Err(s.config.error("layer_types must list one type per layer"));
        }
        let fa_idx = s
            .layer_types
            .iter()
            .position(|t| t == "full_attention")
            .ok_or_else(|| s.config.error("no full_attention layer in layer_types"))?;
        let swa_idx = s.layer_types.iter().position(|t| t == "sliding_attention");
        if s.sliding_window == Some(0) {
            return Err(s.config.error("sliding_window must be at least 1"));
        }
        if swa_idx.is_some() && s.sliding_window.is_none() {
            return Err(s
                .config
                .error("sliding_attention layers need sliding_window"));
        }
        let head_dim = d.head_dim();
        let mut layers = Vec::with_capacity(d.num_hidden_layers);
        for (i, kind) in s.layer_types.iter().enumerate() {
            let p = format!("model.layers.{i}");
            let norm = |w: &mut Weights, name: &str| {
                RmsNorm::load(
                    w,
                    &format!("{p}.self_attn.{name}"),
                    head_dim,
                    d.rms_norm_eps,
                )
            };
            let qk_norm = if s.qk_norm {
                QkNorm::BeforeTranspose {
                    q: norm(w, "q_norm")?,
                    k: norm(w, "k_norm")?,
                }
            } else {
                QkNorm::None
            };
            let proj = AttentionProjections::load(
                w,
                q,
                &format!("{p}.self_attn"),
                d,
                1,
                s.attention_bias,
            )?;
            layers.push(Block {
                attn: Attention {
                    proj,
                    qk_norm,
                    rope: s.rope,
                    n_heads: d.num_attention_heads,
                    n_kv_heads: d.kv_heads(),
                    scale: (head_dim as f64).powf(-0.5) as f32,
                },
                block: PreNormBlock::load(w, q, &p, d, s.mlp_bias)?,
                sliding: kind == "sliding_attention",
            });
        }
        Ok(Model {
            outer: OuterLayers::load(w, q, "", d, s.tied)?,
            layers,
            sliding_window: s.sliding_window,
            head_dim: d.head_dim() as usize,
            fa_idx,
            swa_idx,
            own_make_cache: s.own_make_cache,
        })
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
        let fa_masks = rows::masks(rows, lens, self.fa_idx, None)?;
        let swa_masks = match self.swa_idx {
            Some(i) => rows::masks(rows, lens, i, self.sliding_window)?,
            None => Vec::new(),
        };
        let layers = self.layers.len();
        self.outer.run(h, rows, lens, layers, taps, |i, h, rows| {
            let layer = &self.layers[i];
            let masks = if layer.sliding { &swa_masks } else { &fa_masks };
            layer
                .block
                .forward(h, |x| layer.attn.forward(x, masks, rows))
        })
    }

    fn num_layers(&self) -> usize {
        self.layers.len()
    }

    /// Sliding layers over plain KV caches need each row's window mask, which one shared
    /// buffer's attention does not apply.
    fn attends_batch_caches(&self) -> bool {
        self.swa_idx.is_none()
    }

    fn attention_head_dim(&self) -> usize {
        self.head_dim
    }

    fn own_caches(&self) -> Option<Vec<LayerCache>> {
        let layers = self
            .layers
            .iter()
            .map(|l| match (l.sliding, self.sliding_window) {
                (true, Some(w)) => LayerCache::Rotating(RotatingKvCache::new(w, 0)),
                _ => LayerCache::Kv(KvCache::default()),
            });
        self.own_make_cache.then(|| layers.collect())
    }

    fn outer(&self) -> &OuterLayers {
        &self.outer
    }
}
