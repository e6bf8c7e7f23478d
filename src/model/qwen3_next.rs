//! mlx_lm/models/qwen3_next.py: a hybrid of gated-DeltaNet (linear attention) layers and, every
//! `full_attention_interval`-th layer, gated full attention with partial RoPE. qwen3_5 reuses
//! these layers (its Python file imports them from here) with split input projections.

use mlx::{compiled, ops, Array};
use serde::Deserialize;
use serde_json::Value;

use super::layers::{
    attend, Activation, Embedding, GatedMlp, Head, Linear, OuterLayers, RmsNorm, Rope, Taps,
};
use super::{Forward, LanguageModel};
use crate::cache::{KvCache, LayerCache, Mask, Recurrence, RecurrentCache};
use crate::error::contract;
use crate::load::{Config, LoadError, QuantConfig, Weights};
use crate::Result;

#[derive(Deserialize)]
struct Args {
    hidden_size: i32,
    num_hidden_layers: usize,
    intermediate_size: i32,
    num_attention_heads: i32,
    linear_num_value_heads: i32,
    linear_num_key_heads: i32,
    linear_key_head_dim: i32,
    linear_value_head_dim: i32,
    linear_conv_kernel_dim: i32,
    num_experts: usize,
    rms_norm_eps: f64,
    vocab_size: i32,
    num_key_value_heads: i32,
    rope_theta: f64,
    partial_rotary_factor: f64,
    head_dim: i32,
    #[serde(default)]
    tie_word_embeddings: bool,
    #[serde(default)]
    attention_bias: bool,
    rope_scaling: Option<Value>,
    #[serde(default = "default_interval")]
    full_attention_interval: usize,
}

fn default_interval() -> usize {
    4
}

/// How a gated-DeltaNet layer projects its input.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(crate) enum Projections {
    /// qwen3_next: `in_proj_qkvz` and `in_proj_ba`, interleaved per key-head group.
    Fused,
    /// qwen3_5: separate `in_proj_qkv`, `in_proj_z`, `in_proj_b`, `in_proj_a`.
    Split,
}

/// The shape of a hybrid model, as the loaders of qwen3_next and qwen3_5 read it from their
/// configs.
pub(crate) struct Shape<'a> {
    pub hidden: i32,
    pub layers: usize,
    pub intermediate: i32,
    pub heads: i32,
    pub kv_heads: i32,
    pub head_dim: i32,
    pub v_heads: i32,
    pub k_heads: i32,
    pub k_dim: i32,
    pub v_dim: i32,
    pub conv_kernel: i32,
    pub eps: f64,
    pub vocab: i32,
    pub attention_bias: bool,
    pub rope: Rope,
    pub tied: bool,
    pub interval: usize,
    pub projections: Projections,
    /// Module path prefix ("" for qwen3_next, "language_model." for qwen3_5).
    pub prefix: &'a str,
    pub config: &'a Config,
}

/// Full attention with an output gate: q_proj yields [query | gate] per head.
struct GatedAttention {
    q_proj: Linear,
    k_proj: Linear,
    v_proj: Linear,
    o_proj: Linear,
    q_norm: RmsNorm,
    k_norm: RmsNorm,
    rope: Rope,
    n_heads: i32,
    n_kv_heads: i32,
    scale: f32,
}

impl GatedAttention {
    fn forward(&self, x: &Array, mask: &Mask, cache: &mut LayerCache) -> Result<Array> {
        let (b, l) = (x.dim(0), x.dim(1));
        let q_out = self.q_proj.forward(x)?.reshape(&[b, l, self.n_heads, -1])?;
        let mut halves = ops::split(&q_out, 2, -1)?.into_iter();
        let (queries, gate) = (halves.next().unwrap(), halves.next().unwrap());
        let gate = gate.reshape(&[b, l, -1])?;
        let keys = self.k_proj.forward(x)?;
        let values = self.v_proj.forward(x)?;
        let queries = self.q_norm.forward(&queries)?.transpose(&[0, 2, 1, 3])?;
        let keys = self
            .k_norm
            .forward(&keys.reshape(&[b, l, self.n_kv_heads, -1])?)?
            .transpose(&[0, 2, 1, 3])?;
        let values = values
            .reshape(&[b, l, self.n_kv_heads, -1])?
            .transpose(&[0, 2, 1, 3])?;
        let offset = cache.offset();
        let queries = self.rope.forward(&queries, offset)?;
        let keys = self.rope.forward(&keys, offset)?;
        let kv = cache.update_and_fetch(&keys, &values)?;
        let out = attend(&queries, &kv, self.scale, mask)?
            .transpose(&[0, 2, 1, 3])?
            .reshape(&[b, l, -1])?;
        Ok(self.o_proj.forward(&out.multiply(&gate.sigmoid()?)?)?)
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

    fn forward(&self, x: &Array, cache: &mut RecurrentCache) -> Result<Array> {
        let (bsz, s) = (x.dim(0), x.dim(1));
        let (mixed_qkv, z, b, a) = self.project(x)?;
        let out = cache.advance(&self.recurrence, &mixed_qkv, &a, &b)?;
        // Qwen3NextRMSNormGated: precise_swiglu(out, z, rms_norm(out)).
        let normed = self.norm.forward(&out)?;
        let out = compiled::precise_swiglu(&out, &z, &normed)?;
        Ok(self.out_proj.forward(&out.reshape(&[bsz, s, -1])?)?)
    }
}

enum Mixer {
    Linear(GatedDeltaNet),
    Attention(GatedAttention),
}

struct DecoderLayer {
    mixer: Mixer,
    mlp: GatedMlp,
    input_layernorm: RmsNorm,
    post_attention_layernorm: RmsNorm,
}

pub struct Model {
    outer: OuterLayers,
    layers: Vec<DecoderLayer>,
    fa_idx: usize,
}

impl Model {
    pub fn load(
        config: &Config,
        w: &mut Weights,
        q: &QuantConfig,
    ) -> std::result::Result<Model, LoadError> {
        let a: Args = config.parse()?;
        if a.num_experts > 0 {
            return Err(config.error("mixture-of-experts qwen3_next layers are not supported yet"));
        }
        let rope_dims = (a.head_dim as f64 * a.partial_rotary_factor) as i32;
        let rope = Rope::new(rope_dims, a.rope_theta, false, a.rope_scaling.as_ref())
            .map_err(|m| config.error(m))?;
        // sanitize is a no-op for checkpoints without per-expert HF keys (mlx-lm returns early).
        if a.tie_word_embeddings {
            w.take_optional("lm_head.weight");
        }
        Model::build(
            Shape {
                hidden: a.hidden_size,
                layers: a.num_hidden_layers,
                intermediate: a.intermediate_size,
                heads: a.num_attention_heads,
                kv_heads: a.num_key_value_heads,
                head_dim: a.head_dim,
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
                projections: Projections::Fused,
                prefix: "",
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
        if s.interval == 0 || s.interval > s.layers {
            return Err(s
                .config
                .error("full_attention_interval must be between 1 and the layer count"));
        }
        if s.k_heads <= 0 || s.v_heads % s.k_heads != 0 {
            return Err(s
                .config
                .error("linear_num_value_heads must be a multiple of linear_num_key_heads"));
        }
        let pre = s.prefix;
        let (h, eps) = (s.hidden, s.eps);
        let mut layers = Vec::with_capacity(s.layers);
        for i in 0..s.layers {
            let p = format!("{pre}model.layers.{i}");
            let lin = |w: &mut Weights, name: &str, i_dim: i32, o_dim: i32, bias: bool| {
                Linear::load(w, q, &format!("{p}.{name}"), i_dim, o_dim, bias)
            };
            let mixer = if (i + 1) % s.interval != 0 {
                let (key_dim, value_dim) = (s.k_heads * s.k_dim, s.v_heads * s.v_dim);
                let conv_dim = 2 * key_dim + value_dim;
                let proj = match s.projections {
                    Projections::Fused => InputProjection::Fused {
                        qkvz: lin(
                            w,
                            "linear_attn.in_proj_qkvz",
                            h,
                            2 * key_dim + 2 * value_dim,
                            false,
                        )?,
                        ba: lin(w, "linear_attn.in_proj_ba", h, 2 * s.v_heads, false)?,
                    },
                    Projections::Split => InputProjection::Split {
                        qkv: lin(w, "linear_attn.in_proj_qkv", h, conv_dim, false)?,
                        z: lin(w, "linear_attn.in_proj_z", h, value_dim, false)?,
                        b: lin(w, "linear_attn.in_proj_b", h, s.v_heads, false)?,
                        a: lin(w, "linear_attn.in_proj_a", h, s.v_heads, false)?,
                    },
                };
                Mixer::Linear(GatedDeltaNet {
                    proj,
                    recurrence: Recurrence {
                        conv_weight: w.take_shaped(
                            &format!("{p}.linear_attn.conv1d.weight"),
                            &[conv_dim, s.conv_kernel, 1],
                        )?,
                        a_log: w.take_shaped(&format!("{p}.linear_attn.A_log"), &[s.v_heads])?,
                        dt_bias: w
                            .take_shaped(&format!("{p}.linear_attn.dt_bias"), &[s.v_heads])?,
                        k_heads: s.k_heads,
                        v_heads: s.v_heads,
                        k_dim: s.k_dim,
                        v_dim: s.v_dim,
                        conv_kernel: s.conv_kernel,
                    },
                    norm: RmsNorm::load(w, &format!("{p}.linear_attn.norm"), s.v_dim, eps)?,
                    out_proj: lin(w, "linear_attn.out_proj", value_dim, h, false)?,
                })
            } else {
                let (qd, kvd) = (s.heads * s.head_dim, s.kv_heads * s.head_dim);
                let bias = s.attention_bias;
                Mixer::Attention(GatedAttention {
                    q_proj: lin(w, "self_attn.q_proj", h, 2 * qd, bias)?,
                    k_proj: lin(w, "self_attn.k_proj", h, kvd, bias)?,
                    v_proj: lin(w, "self_attn.v_proj", h, kvd, bias)?,
                    o_proj: lin(w, "self_attn.o_proj", qd, h, bias)?,
                    q_norm: RmsNorm::load(w, &format!("{p}.self_attn.q_norm"), s.head_dim, eps)?,
                    k_norm: RmsNorm::load(w, &format!("{p}.self_attn.k_norm"), s.head_dim, eps)?,
                    rope: s.rope,
                    n_heads: s.heads,
                    n_kv_heads: s.kv_heads,
                    scale: (s.head_dim as f64).powf(-0.5) as f32,
                })
            };
            layers.push(DecoderLayer {
                mixer,
                mlp: GatedMlp::load(
                    w,
                    q,
                    &format!("{p}.mlp"),
                    h,
                    s.intermediate,
                    false,
                    Activation::Swiglu,
                )?,
                input_layernorm: RmsNorm::load(w, &format!("{p}.input_layernorm"), h, eps)?,
                post_attention_layernorm: RmsNorm::load(
                    w,
                    &format!("{p}.post_attention_layernorm"),
                    h,
                    eps,
                )?,
            });
        }
        Ok(Model {
            outer: OuterLayers {
                embed_tokens: Embedding::load(
                    w,
                    q,
                    &format!("{pre}model.embed_tokens"),
                    s.vocab,
                    h,
                )?,
                norm: RmsNorm::load(w, &format!("{pre}model.norm"), h, eps)?,
                head: if s.tied {
                    Head::Tied
                } else {
                    Head::Separate(Linear::load(
                        w,
                        q,
                        &format!("{pre}lm_head"),
                        h,
                        s.vocab,
                        false,
                    )?)
                },
            },
            layers,
            fa_idx: s.interval - 1,
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
        let fa_mask = caches[self.fa_idx].make_mask(h.dim(1) as usize, None)?;
        let mut taps = Taps::new(taps, self.layers.len());
        for (i, (layer, cache)) in self.layers.iter().zip(caches.iter_mut()).enumerate() {
            let x = layer.input_layernorm.forward(&h)?;
            let r = match (&layer.mixer, cache) {
                (Mixer::Linear(m), LayerCache::Recurrent(c)) => m.forward(&x, c)?,
                (Mixer::Attention(m), c) => m.forward(&x, &fa_mask, c)?,
                (Mixer::Linear(_), _) => {
                    return Err(contract(format!("layer {i} needs a recurrent cache")))
                }
            };
            let h1 = h.add(&r)?;
            h = h1.add(
                &layer
                    .mlp
                    .forward(&layer.post_attention_layernorm.forward(&h1)?)?,
            )?;
            taps.capture(i, &h);
        }
        self.outer.finish(&h, taps)
    }

    fn make_cache(&self, _max_kv_size: Option<usize>) -> Vec<LayerCache> {
        self.layers
            .iter()
            .map(|l| match l.mixer {
                Mixer::Linear(_) => LayerCache::Recurrent(RecurrentCache::default()),
                Mixer::Attention(_) => LayerCache::Kv(KvCache::default()),
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
        true
    }
}
