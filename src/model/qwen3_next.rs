//! mlx_lm/models/qwen3_next.py: a hybrid of gated-DeltaNet (linear attention) layers and, every
//! `full_attention_interval`-th layer, gated full attention with partial RoPE. qwen3_5 reuses
//! these layers (its Python file imports them from here) with split input projections.

use mlx::{compiled, ops, Array};
use serde::Deserialize;
use serde_json::{json, Value};

use super::layers::{
    attend_rows, AttentionProjections, Dims, Linear, MoeShape, OuterLayers, PreNormBlock, RmsNorm,
    Rope,
};
use super::rows::{self, LayerRows};
use super::{lone_rows, stacked_recurrence, Forward, LanguageModel};
use crate::cache::{KvCache, LayerCache, Mask, Recurrence, RecurrentCache};
use crate::error::contract;
use crate::load::{Config, LoadResult, QuantConfig, Weights};
use crate::Result;

#[derive(Deserialize)]
struct Args {
    #[serde(flatten)]
    dims: Dims,
    #[serde(flatten)]
    linear: LinearDims,
    num_experts: usize,
    rope_theta: f64,
    partial_rotary_factor: f64,
    attention_bias: bool,
    rope_scaling: Option<Value>,
    full_attention_interval: usize,
}

/// The gated-DeltaNet dimensions both hybrids read from their configs.
#[derive(Deserialize)]
pub(crate) struct LinearDims {
    pub linear_num_value_heads: i32,
    pub linear_num_key_heads: i32,
    pub linear_key_head_dim: i32,
    pub linear_value_head_dim: i32,
    pub linear_conv_kernel_dim: i32,
}

/// How a gated-DeltaNet layer projects its input.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(crate) enum Projections {
    /// qwen3_next: `in_proj_qkvz` and `in_proj_ba`, interleaved per key-head group.
    Fused,
    /// qwen3_5: separate `in_proj_qkv`, `in_proj_z`, `in_proj_b`, `in_proj_a`.
    Split,
}

/// How a hybrid model is built, as the loaders of qwen3_next and qwen3_5 read it from their
/// configs.
pub(crate) struct Shape<'a> {
    pub dims: &'a Dims,
    pub linear: &'a LinearDims,
    pub attention_bias: bool,
    pub rope: Rope,
    pub tied: bool,
    pub interval: usize,
    /// Every layer's sparse MLP (qwen3_5 with experts), or None for the dense one.
    pub moe: Option<MoeShape>,
    pub projections: Projections,
    /// Module path prefix ("" for qwen3_next, "language_model." for qwen3_5).
    pub prefix: &'a str,
    pub config: &'a Config,
}

/// Full attention with an output gate: q_proj yields [query | gate] per head.
struct GatedAttention {
    proj: AttentionProjections,
    q_norm: RmsNorm,
    k_norm: RmsNorm,
    rope: Rope,
    n_heads: i32,
    n_kv_heads: i32,
    scale: f32,
}

impl GatedAttention {
    /// Loads `<layer>.self_attn.*` (q_proj yielding query and gate, q/k norms).
    fn load(
        w: &mut Weights,
        q: &QuantConfig,
        layer: &str,
        d: &Dims,
        rope: Rope,
        bias: bool,
    ) -> LoadResult<GatedAttention> {
        let (head_dim, eps) = (d.head_dim(), d.rms_norm_eps);
        let norm = |w: &mut Weights, name: &str| {
            RmsNorm::load(w, &format!("{layer}.self_attn.{name}"), head_dim, eps)
        };
        Ok(GatedAttention {
            proj: AttentionProjections::load(w, q, &format!("{layer}.self_attn"), d, 2, bias)?,
            q_norm: norm(w, "q_norm")?,
            k_norm: norm(w, "k_norm")?,
            rope,
            n_heads: d.num_attention_heads,
            n_kv_heads: d.kv_heads(),
            scale: (head_dim as f64).powf(-0.5) as f32,
        })
    }

    /// Every row's gated attention over `x` (1, T, H): projections, gate and norms once over
    /// all rows, then [`attend_rows`].
    fn forward(&self, x: &Array, masks: &[Mask], rows: &mut LayerRows) -> Result<Array> {
        let (b, l) = (x.dim(0), x.dim(1));
        let p = &self.proj;
        let q_out = p.q_proj.forward(x)?.reshape(&[b, l, self.n_heads, -1])?;
        let mut halves = ops::split(&q_out, 2, -1)?.into_iter();
        let (queries, gate) = (halves.next().unwrap(), halves.next().unwrap());
        let gate = gate.reshape(&[b, l, -1])?;
        let keys = p.k_proj.forward(x)?;
        let values = p.v_proj.forward(x)?;
        let queries = self.q_norm.forward(&queries)?.transpose(&[0, 2, 1, 3])?;
        let keys = self
            .k_norm
            .forward(&keys.reshape(&[b, l, self.n_kv_heads, -1])?)?
            .transpose(&[0, 2, 1, 3])?;
        let values = values
            .reshape(&[b, l, self.n_kv_heads, -1])?
            .transpose(&[0, 2, 1, 3])?;
        let out = attend_rows(
            &self.rope, self.scale, &queries, &keys, &values, masks, rows,
        )?
        .transpose(&[0, 2, 1, 3])?
        .reshape(&[b, l, -1])?;
        Ok(p.o_proj.forward(&out.multiply(&gate.sigmoid()?)?)?)
    }
}

enum InputProjection {
    Fused {
        qkvz: Linear,
        ba: Linear,
    },
    Split {
        qkv: Linear,
        z: Linear,
        b: Linear,
        a: Linear,
    },
}

/// The gated-DeltaNet mixer: projections, a causal depthwise conv over the last K tokens, the
/// gated delta rule, a gated RMSNorm, and the output projection.
struct GatedDeltaNet {
    proj: InputProjection,
    recurrence: Recurrence,
    norm: RmsNorm,
    out_proj: Linear,
}

impl GatedDeltaNet {
    /// The conv input rows, z, b and a for this step.
    fn project(&self, x: &Array) -> mlx::Result<(Array, Array, Array, Array)> {
        let (bsz, s) = (x.dim(0), x.dim(1));
        let r = &self.recurrence;
        let (nk, dn, nv, dv) = (r.k_heads, r.k_dim, r.v_heads, r.v_dim);
        match &self.proj {
            InputProjection::Fused { qkvz, ba } => {
                // fix_query_key_value_ordering
                let mixed = qkvz.forward(x)?.reshape(&[bsz, s, nk, -1])?;
                let mixed_ba = ba.forward(x)?.reshape(&[bsz, s, nk, -1])?;
                let parts = ops::split_sections(&mixed, &[dn, 2 * dn, 2 * dn + nv / nk * dv], -1)?;
                let ba_parts = ops::split_sections(&mixed_ba, &[nv / nk], -1)?;
                let (q, k, v, z) = (&parts[0], &parts[1], &parts[2], &parts[3]);
                let v = v.reshape(&[bsz, s, -1, dv])?;
                let z = z.reshape(&[bsz, s, -1, dv])?;
                let b = ba_parts[0].reshape(&[bsz, s, nv])?;
                let a = ba_parts[1].reshape(&[bsz, s, nv])?;
                let flat = |t: &Array| t.reshape(&[bsz, s, -1]);
                let mixed_qkv = ops::concatenate(&[&flat(q)?, &flat(k)?, &flat(&v)?], -1)?;
                Ok((mixed_qkv, z, b, a))
            }
            InputProjection::Split { qkv, z, b, a } => Ok((
                qkv.forward(x)?,
                z.forward(x)?.reshape(&[bsz, s, nv, dv])?,
                b.forward(x)?,
                a.forward(x)?,
            )),
        }
    }

    /// Every row's mixer over `x` (1, T, H): the projections, the gated norm and the output
    /// projection once over all rows, the conv and the delta rule row by row over the row's
    /// own recurrent state, or, for a batch decode step whose kernels give each row its own
    /// bits there (the CPU's; a GPU's where [`stacked_recurrence`] found so), once over the
    /// rows' stacked states.
    fn forward(&self, x: &Array, rows: &mut LayerRows, layer: usize) -> Result<Array> {
        let (bsz, s) = (x.dim(0), x.dim(1));
        let (mixed_qkv, z, b, a) = self.project(x)?;
        let together = if rows.one_token_each()
            && (!lone_rows::active()
                || stacked_recurrence::exact(&self.recurrence, mixed_qkv.dtype(), s))
        {
            let each = |t: &Array| t.reshape(&[s, 1, -1]);
            let (qkv, a, b) = (each(&mixed_qkv)?, each(&a)?, each(&b)?);
            let mut caches = recurrent_caches(rows, layer)?;
            RecurrentCache::advance_together(&mut caches, &self.recurrence, &qkv, &a, &b)?
        } else {
            None
        };
        let out = match together {
            Some(y) => y.reshape(&[bsz, s, self.recurrence.v_heads, self.recurrence.v_dim])?,
            None => {
                let (qkv, b, a) = (
                    rows.split(&mixed_qkv, 1)?,
                    rows.split(&b, 1)?,
                    rows.split(&a, 1)?,
                );
                let mut outs = Vec::with_capacity(qkv.len());
                for (r, cache) in recurrent_caches(rows, layer)?.into_iter().enumerate() {
                    outs.push(cache.advance(&self.recurrence, &qkv[r], &a[r], &b[r])?);
                }
                rows.join(outs, 1)?
            }
        };
        // Qwen3NextRMSNormGated: precise_swiglu(out, z, rms_norm(out)).
        let normed = self.norm.forward(&out)?;
        let out = compiled::precise_swiglu(&out, &z, &normed)?;
        Ok(self.out_proj.forward(&out.reshape(&[bsz, s, -1])?)?)
    }
}

/// Each row's cache of recurrent layer `layer`: its own, or its row of the batch's.
fn recurrent_caches<'r>(
    rows: &'r mut LayerRows,
    layer: usize,
) -> Result<Vec<&'r mut RecurrentCache>> {
    let mut caches = Vec::with_capacity(rows.lens().len());
    for cache in &mut rows.caches {
        match &mut **cache {
            LayerCache::Recurrent(cache) => caches.push(cache),
            LayerCache::RecurrentRows(each) => caches.extend(each.iter_mut()),
            _ => return Err(contract(format!("layer {layer} needs a recurrent cache"))),
        }
    }
    Ok(caches)
}

/// A full-attention decoder layer on its own (gated attention, then the SwiGLU block), as a
/// Qwen3.5 MTP head stacks them (mlx_vlm/speculative/drafters/qwen3_5_mtp/qwen3_5_mtp.py:34-50
/// builds Qwen3_5DecoderLayer with full_attention_interval=1).
pub(crate) struct AttentionLayer {
    attention: GatedAttention,
    block: PreNormBlock,
}

impl AttentionLayer {
    /// Loads `<layer>.self_attn.*`, the norms and `<layer>.mlp.*`.
    pub fn load(
        w: &mut Weights,
        q: &QuantConfig,
        layer: &str,
        d: &Dims,
        rope: Rope,
        bias: bool,
    ) -> LoadResult<AttentionLayer> {
        Ok(AttentionLayer {
            attention: GatedAttention::load(w, q, layer, d, rope, bias)?,
            block: PreNormBlock::load(w, q, layer, d, false)?,
        })
    }

    /// The layer over `x` (B, L, H) with its KV cache; positions continue from the cache's
    /// offset.
    pub fn forward(&self, x: &Array, cache: &mut LayerCache) -> Result<Array> {
        let len = [x.dim(1) as usize];
        let masks = [cache.make_mask(len[0], None)?];
        self.block.forward(x, |x| {
            self.attention
                .forward(x, &masks, &mut LayerRows::one(cache, &len))
        })
    }
}

enum Mixer {
    Linear(GatedDeltaNet),
    Attention(GatedAttention),
}

struct DecoderLayer {
    mixer: Mixer,
    block: PreNormBlock,
}

pub struct Model {
    outer: OuterLayers,
    layers: Vec<DecoderLayer>,
    fa_idx: usize,
    head_dim: usize,
}

impl Model {
    pub fn load(config: &Config, w: &mut Weights, q: &QuantConfig) -> LoadResult<Model> {
        let a: Args = config.args(json!({
            "attention_bias": false, "full_attention_interval": 4,
        }))?;
        let d = &a.dims;
        if a.num_experts > 0 {
            return Err(config.error("mixture-of-experts qwen3_next layers are not supported yet"));
        }
        // The Python dataclass requires these (llama's loader derives them).
        let missing = |key: &str| config.error(format!("{key} is missing from the model config"));
        let head_dim = d.head_dim.ok_or_else(|| missing("head_dim"))?;
        d.num_key_value_heads
            .ok_or_else(|| missing("num_key_value_heads"))?;
        let rope_dims = (head_dim as f64 * a.partial_rotary_factor) as i32;
        let rope = Rope::new(rope_dims, a.rope_theta, false, a.rope_scaling.as_ref())
            .map_err(|m| config.error(m))?;
        let tied = d.tie_word_embeddings.unwrap_or(false);
        // sanitize is a no-op for checkpoints without per-expert HF keys (mlx-lm returns early).
        if tied {
            w.take_optional("lm_head.weight");
        }
        Model::build(
            Shape {
                dims: d,
                linear: &a.linear,
                attention_bias: a.attention_bias,
                rope,
                tied,
                interval: a.full_attention_interval,
                moe: None,
                projections: Projections::Fused,
                prefix: "",
                config,
            },
            w,
            q,
        )
    }

    pub(crate) fn build(s: Shape<'_>, w: &mut Weights, q: &QuantConfig) -> LoadResult<Model> {
        let (d, ld) = (s.dims, s.linear);
        if s.interval == 0 || s.interval > d.num_hidden_layers {
            return Err(s
                .config
                .error("full_attention_interval must be between 1 and the layer count"));
        }
        let (k_heads, v_heads) = (ld.linear_num_key_heads, ld.linear_num_value_heads);
        if k_heads <= 0 || v_heads % k_heads != 0 {
            return Err(s
                .config
                .error("linear_num_value_heads must be a multiple of linear_num_key_heads"));
        }
        let (h, eps) = (d.hidden_size, d.rms_norm_eps);
        let mut layers = Vec::with_capacity(d.num_hidden_layers);
        for i in 0..d.num_hidden_layers {
            let p = format!("{}model.layers.{i}", s.prefix);
            let lin = |w: &mut Weights, name: &str, i_dim: i32, o_dim: i32| {
                Linear::load(
                    w,
                    q,
                    &format!("{p}.linear_attn.{name}"),
                    i_dim,
                    o_dim,
                    false,
                )
            };
            let norm = |w: &mut Weights, name: &str, dims: i32| {
                RmsNorm::load(w, &format!("{p}.{name}"), dims, eps)
            };
            let mixer = if (i + 1) % s.interval != 0 {
                let (k_dim, v_dim) = (ld.linear_key_head_dim, ld.linear_value_head_dim);
                let (key_dim, value_dim) = (k_heads * k_dim, v_heads * v_dim);
                let conv_dim = 2 * key_dim + value_dim;
                let proj = match s.projections {
                    Projections::Fused => InputProjection::Fused {
                        qkvz: lin(w, "in_proj_qkvz", h, 2 * key_dim + 2 * value_dim)?,
                        ba: lin(w, "in_proj_ba", h, 2 * v_heads)?,
                    },
                    Projections::Split => InputProjection::Split {
                        qkv: lin(w, "in_proj_qkv", h, conv_dim)?,
                        z: lin(w, "in_proj_z", h, value_dim)?,
                        b: lin(w, "in_proj_b", h, v_heads)?,
                        a: lin(w, "in_proj_a", h, v_heads)?,
                    },
                };
                let tensor = |w: &mut Weights, name: &str, shape: &[i32]| {
                    w.take_shaped(&format!("{p}.linear_attn.{name}"), shape)
                };
                Mixer::Linear(GatedDeltaNet {
                    proj,
                    recurrence: Recurrence {
                        conv_weight: tensor(
                            w,
                            "conv1d.weight",
                            &[conv_dim, ld.linear_conv_kernel_dim, 1],
                        )?,
                        a_log: tensor(w, "A_log", &[v_heads])?,
                        dt_bias: tensor(w, "dt_bias", &[v_heads])?,
                        k_heads,
                        v_heads,
                        k_dim,
                        v_dim,
                        conv_kernel: ld.linear_conv_kernel_dim,
                    },
                    norm: norm(w, "linear_attn.norm", v_dim)?,
                    out_proj: lin(w, "out_proj", value_dim, h)?,
                })
            } else {
                Mixer::Attention(GatedAttention::load(w, q, &p, d, s.rope, s.attention_bias)?)
            };
            layers.push(DecoderLayer {
                mixer,
                block: PreNormBlock::load_moe(w, q, &p, d, s.moe)?,
            });
        }
        Ok(Model {
            outer: OuterLayers::load(w, q, s.prefix, d, s.tied)?,
            layers,
            fa_idx: s.interval - 1,
            head_dim: d.head_dim() as usize,
        })
    }
}

impl LanguageModel for Model {
    /// The gated-DeltaNet layers advance each row's own recurrent state, the attention layers
    /// attend as every family's do (crate::model::layers::attend_rows); the rest runs once
    /// over all rows.
    fn forward_rows(
        &self,
        ids: &Array,
        rows: &mut [&mut [LayerCache]],
        lens: &[usize],
        taps: &[usize],
    ) -> Result<Forward> {
        let h = self.outer.embed_tokens.forward(ids)?;
        let fa_masks = rows::masks(rows, lens, self.fa_idx, None)?;
        let layers = self.layers.len();
        self.outer.run(h, rows, lens, layers, taps, |i, h, rows| {
            let layer = &self.layers[i];
            layer.block.forward(h, |x| match &layer.mixer {
                Mixer::Attention(m) => m.forward(x, &fa_masks, rows),
                Mixer::Linear(m) => m.forward(x, rows, i),
            })
        })
    }

    fn num_layers(&self) -> usize {
        self.layers.len()
    }

    fn attends_batch_caches(&self) -> bool {
        true
    }

    fn attention_head_dim(&self) -> usize {
        self.head_dim
    }

    fn own_caches(&self) -> Option<Vec<LayerCache>> {
        let cache = |l: &DecoderLayer| match l.mixer {
            Mixer::Linear(_) => LayerCache::Recurrent(RecurrentCache::default()),
            Mixer::Attention(_) => LayerCache::Kv(KvCache::default()),
        };
        Some(self.layers.iter().map(cache).collect())
    }

    fn outer(&self) -> &OuterLayers {
        &self.outer
    }
}
