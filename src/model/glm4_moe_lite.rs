//! mlx_lm/models/glm4_moe_lite.py: GLM-4.7-Flash. Multi-head latent attention (MLA): queries
//! through an optional low-rank `q_a`/`q_b` pair, keys and values from one latent vector per
//! token (`kv_lora_rank` wide, normed) plus `qk_rope_head_dim` RoPE'd dimensions shared by all
//! heads; the cache holds exactly those two, as one KV head (latent as keys, RoPE part as
//! values, mlx-lm's default KVCache). A multi-token forward (prefill, a speculative verify)
//! expands the latent into per-head keys and values (`embed_q`, `unembed_out`); a one-token
//! step absorbs `embed_q` into the query and `unembed_out` into the output instead, attending
//! the latent itself: the two orders round differently, so each is ported as it is, and a
//! decode forward's rows (a speculative verify) take the one-token step token by token unless
//! the forward replays mlx-lm ([`lone_rows::as_one_token_steps`]), so that speculation never
//! changes the output. The RoPE
//! part's scores enter attention as its additive mask. Then glm4_moe's blocks: dense MLPs in the
//! first `first_k_dense_replace` layers (and off `moe_layer_freq`), GLM's sparse block in the
//! others; an untied lm_head.

use mlx::{ops, Array};
use serde::Deserialize;
use serde_json::{json, Value};

use super::glm4_moe::{moe_shape, stack_experts, MoeArgs};
use super::layers::{
    attend, finfo_min, Dims, Linear, MultiLinear, OuterLayers, PreNormBlock, RmsNorm, Rope,
};
use super::lone_rows;
use super::rows::{self, LayerRows};
use super::{Forward, LanguageModel};
use crate::cache::{create_causal_mask, KeysValues, LayerCache, Mask};
use crate::error::contract;
use crate::load::{Config, LoadError, LoadResult, QuantConfig, Weights};
use crate::Result;

#[derive(Deserialize)]
struct Args {
    #[serde(flatten)]
    dims: Dims,
    #[serde(flatten)]
    moe: MoeArgs,
    moe_layer_freq: i64,
    kv_lora_rank: i32,
    q_lora_rank: Option<i32>,
    qk_rope_head_dim: i32,
    qk_nope_head_dim: i32,
    v_head_dim: i32,
    rope_theta: f64,
    rope_scaling: Option<Value>,
    attention_bias: bool,
}

/// The query projection: plain, or through the rank-`q_lora_rank` bottleneck with its norm.
enum QueryProj {
    Plain(Linear),
    LowRank {
        q_a_proj: Linear,
        q_a_layernorm: RmsNorm,
        q_b_proj: Linear,
    },
}

/// Glm4MoeLiteAttention.
struct Mla {
    q: QueryProj,
    kv_a_proj_with_mqa: Linear,
    kv_a_layernorm: RmsNorm,
    embed_q: MultiLinear,
    unembed_out: MultiLinear,
    o_proj: Linear,
    rope: Rope,
    heads: i32,
    nope: i32,
    kv_lora_rank: i32,
    scale: f32,
}

impl Mla {
    /// Every row's attention over `x` (1, T, hidden): projections and norms once over all
    /// tokens, then each row on its own cache with its mask (`masks[r]`, mlx-lm's
    /// `return_array` mask, None for one token) and its own length deciding the path.
    fn forward(&self, x: &Array, masks: &[Option<Array>], rows: &mut LayerRows) -> Result<Array> {
        let q = match &self.q {
            QueryProj::Plain(q_proj) => q_proj.forward(x)?,
            QueryProj::LowRank {
                q_a_proj,
                q_a_layernorm,
                q_b_proj,
            } => q_b_proj.forward(&q_a_layernorm.forward(&q_a_proj.forward(x)?)?)?,
        };
        let compressed = self.kv_a_proj_with_mqa.forward(x)?;
        let width = compressed.dim(-1);
        let latent =
            self.kv_a_layernorm
                .forward(&compressed.slice_axis(-1, 0, self.kv_lora_rank)?)?;
        let k_pe = compressed.slice_axis(-1, self.kv_lora_rank, width)?;
        let (q, latent, k_pe) = (
            rows.split(&q, 1)?,
            rows.split(&latent, 1)?,
            rows.split(&k_pe, 1)?,
        );
        let mut outs = Vec::with_capacity(q.len());
        for (r, cache) in rows.caches.iter_mut().enumerate() {
            outs.push(self.attend_row(&q[r], &latent[r], &k_pe[r], masks[r].as_ref(), cache)?);
        }
        Ok(self.o_proj.forward(&rows.join(outs, 1)?)?)
    }

    /// One row's attention, Glm4MoeLiteAttention.__call__ from the projections on: returns
    /// (1, L, heads * v_head_dim).
    fn attend_row(
        &self,
        q: &Array,
        latent: &Array,
        k_pe: &Array,
        mask: Option<&Array>,
        cache: &mut LayerCache,
    ) -> Result<Array> {
        let l = q.dim(1);
        if l > 1 && lone_rows::as_one_token_steps() {
            // A verify row: each token as the one-token step that plain decoding takes.
            let mut outs = Vec::with_capacity(l as usize);
            for t in 0..l {
                let token = |a: &Array| a.slice_axis(1, t, t + 1);
                outs.push(self.attend_row(
                    &token(q)?,
                    &token(latent)?,
                    &token(k_pe)?,
                    None,
                    cache,
                )?);
            }
            return Ok(ops::concatenate(&outs.iter().collect::<Vec<_>>(), 1)?);
        }
        let q = q
            .reshape(&[1, l, self.heads, -1])?
            .transpose(&[0, 2, 1, 3])?;
        let q_head = q.dim(-1);
        let q_nope = q.slice_axis(-1, 0, self.nope)?;
        let q_pe = q.slice_axis(-1, self.nope, q_head)?;
        let k_pe = k_pe.reshape(&[1, l, 1, -1])?.transpose(&[0, 2, 1, 3])?;
        let offset = cache.offset();
        let q_pe = self.rope.forward(&q_pe, offset)?;
        let k_pe = self.rope.forward(&k_pe, offset)?;
        let latent = latent.expand_dims(&[1])?;
        let (latent, k_pe) = match cache.update_and_fetch(&latent, &k_pe)? {
            KeysValues::Dense { keys, values } => (keys, values),
            KeysValues::Quantized { .. } => {
                return Err(crate::Error::Unsupported(
                    "glm4_moe_lite's latent attention over a quantized KV cache (mlx-lm's \
                     fails there too)"
                        .into(),
                ))
            }
            KeysValues::Steps(_) => {
                return Err(contract("glm4_moe_lite's caches are plain KV caches"))
            }
        };
        let mut pe_scores = q_pe
            .multiply_scalar(self.scale)?
            .matmul(&k_pe.transpose(&[0, 1, 3, 2])?)?;
        if let Some(mask) = mask {
            let lowest = Array::scalar(finfo_min(pe_scores.dtype()), pe_scores.dtype())?;
            pe_scores = ops::r#where(mask, &pe_scores, &lowest)?;
        }
        let pe_scores = Mask::Array(pe_scores);
        let out = if l == 1 {
            let q_nope = self.embed_q.forward(&q_nope, true)?;
            let kv = KeysValues::Dense {
                keys: latent.clone(),
                values: latent,
            };
            let out = attend(&q_nope, &kv, self.scale, &pe_scores)?;
            self.unembed_out.forward(&out, true)?
        } else {
            let kv = KeysValues::Dense {
                keys: self.embed_q.forward(&latent, false)?,
                values: self.unembed_out.forward(&latent, true)?,
            };
            attend(&q_nope, &kv, self.scale, &pe_scores)?
        };
        Ok(out.transpose(&[0, 2, 1, 3])?.reshape(&[1, l, -1])?)
    }
}

struct Layer {
    attn: Mla,
    block: PreNormBlock,
}

pub struct Model {
    outer: OuterLayers,
    layers: Vec<Layer>,
    kv_lora_rank: usize,
}

impl Model {
    pub fn load(config: &Config, w: &mut Weights, q: &QuantConfig) -> LoadResult<Model> {
        let a = args(config)?;
        let d = &a.dims;
        let moe = moe_shape(&a.moe, d.hidden_size).map_err(|m| config.error(m))?;
        if a.moe_layer_freq < 1 {
            return Err(config.error(format!(
                "moe_layer_freq is {}, must be at least 1",
                a.moe_layer_freq
            )));
        }
        let rope = Rope::new(
            a.qk_rope_head_dim,
            a.rope_theta,
            true,
            a.rope_scaling.as_ref(),
        )
        .map_err(|m| config.error(m))?;
        sanitize(w, &a)?;
        let mut layers = Vec::with_capacity(d.num_hidden_layers);
        for i in 0..d.num_hidden_layers {
            let p = format!("model.layers.{i}");
            let sparse = moe.filter(|_| {
                i as i64 >= a.moe.first_k_dense_replace && i as i64 % a.moe_layer_freq == 0
            });
            let block = PreNormBlock::load_moe(w, q, &p, d, sparse)?;
            let attn = load_attention(w, q, &format!("{p}.self_attn"), &a, rope)?;
            layers.push(Layer { attn, block });
        }
        Ok(Model {
            outer: OuterLayers::load(w, q, "", d, false)?,
            layers,
            kv_lora_rank: a.kv_lora_rank as usize,
        })
    }
}

/// The config under the Python dataclass's defaults, its widths checked. `head_dim`, which
/// mlx-lm never reads here, defaults to the query head width so that [`Dims`] does not ask
/// `num_attention_heads` to divide `hidden_size` (GLM-4.7-Flash: 20 heads over 2048).
fn args(config: &Config) -> LoadResult<Args> {
    let width = |key: &str, default: i64| {
        config
            .json
            .get(key)
            .and_then(Value::as_i64)
            .unwrap_or(default)
    };
    let head_dim = width("qk_nope_head_dim", 192) + width("qk_rope_head_dim", 64);
    let a: Args = config.args(json!({
        "vocab_size": 154880, "hidden_size": 2048, "intermediate_size": 10240,
        "moe_intermediate_size": 1536, "num_hidden_layers": 47, "num_attention_heads": 20,
        "num_key_value_heads": 20, "n_shared_experts": 1, "n_routed_experts": 64,
        "routed_scaling_factor": 1.8, "kv_lora_rank": 512, "q_lora_rank": 768,
        "qk_rope_head_dim": 64, "qk_nope_head_dim": 192, "v_head_dim": 256,
        "topk_method": "noaux_tc", "norm_topk_prob": true, "n_group": 1, "topk_group": 1,
        "num_experts_per_tok": 4, "moe_layer_freq": 1, "first_k_dense_replace": 1,
        "rms_norm_eps": 1e-5, "rope_theta": 1_000_000.0, "attention_bias": false,
        "head_dim": head_dim,
    }))?;
    let widths = [
        ("kv_lora_rank", a.kv_lora_rank),
        ("qk_rope_head_dim", a.qk_rope_head_dim),
        ("qk_nope_head_dim", a.qk_nope_head_dim),
        ("v_head_dim", a.v_head_dim),
        ("q_lora_rank", a.q_lora_rank.unwrap_or(1)),
    ];
    if let Some((key, v)) = widths.into_iter().find(|&(_, v)| v < 1) {
        return Err(config.error(format!("{key} is {v}, must be at least 1")));
    }
    Ok(a)
}

/// The attention of the layer at `path` (its `.self_attn`), each weight's shape checked
/// against the config's widths.
fn load_attention(
    w: &mut Weights,
    q: &QuantConfig,
    path: &str,
    a: &Args,
    rope: Rope,
) -> LoadResult<Mla> {
    let (hidden, heads, eps) = (
        a.dims.hidden_size,
        a.dims.num_attention_heads,
        a.dims.rms_norm_eps,
    );
    let q_head = a.qk_nope_head_dim + a.qk_rope_head_dim;
    let linear = |w: &mut Weights, name: &str, i: i32, o: i32, bias: bool| {
        Linear::load(w, q, &format!("{path}.{name}"), i, o, bias)
    };
    let q_proj = match a.q_lora_rank {
        None => QueryProj::Plain(linear(w, "q_proj", hidden, heads * q_head, false)?),
        Some(rank) => QueryProj::LowRank {
            q_a_proj: linear(w, "q_a_proj", hidden, rank, a.attention_bias)?,
            q_a_layernorm: RmsNorm::load(w, &format!("{path}.q_a_layernorm"), rank, eps)?,
            q_b_proj: linear(w, "q_b_proj", rank, heads * q_head, false)?,
        },
    };
    let kv_width = a.kv_lora_rank + a.qk_rope_head_dim;
    let multi = |w: &mut Weights, name: &str, i: i32, o: i32| {
        MultiLinear::load(w, q, &format!("{path}.{name}"), heads, i, o)
    };
    let mut scale = f64::from(q_head).powf(-0.5);
    if let Some(s) = &a.rope_scaling {
        let mscale_all_dim = s
            .get("mscale_all_dim")
            .and_then(Value::as_f64)
            .unwrap_or(0.0);
        let factor = s.get("factor").and_then(Value::as_f64).unwrap_or(1.0);
        if mscale_all_dim != 0.0 && factor > 1.0 {
            let m = 0.1 * mscale_all_dim * factor.ln() + 1.0;
            scale = scale * m * m;
        }
    }
    Ok(Mla {
        q: q_proj,
        kv_a_proj_with_mqa: linear(w, "kv_a_proj_with_mqa", hidden, kv_width, a.attention_bias)?,
        kv_a_layernorm: RmsNorm::load(w, &format!("{path}.kv_a_layernorm"), a.kv_lora_rank, eps)?,
        embed_q: multi(w, "embed_q", a.qk_nope_head_dim, a.kv_lora_rank)?,
        unembed_out: multi(w, "unembed_out", a.kv_lora_rank, a.v_head_dim)?,
        o_proj: linear(w, "o_proj", heads * a.v_head_dim, hidden, a.attention_bias)?,
        rope,
        heads,
        nope: a.qk_nope_head_dim,
        kv_lora_rank: a.kv_lora_rank,
        scale: scale as f32,
    })
}

/// Model.sanitize: drops the multi-token-prediction layers (keys `<x>.layers.<n>.…` with
/// n >= num_hidden_layers), stacks each layer's per-expert tensors, and splits each HF
/// `kv_b_proj` (heads x (nope + v) rows over the latent) into `embed_q` (the nope rows,
/// transposed) and `unembed_out` (the v rows), through a dequantize and a requantize with the
/// bits and group size its packing implies when it is quantized.
fn sanitize(w: &mut Weights, a: &Args) -> LoadResult<()> {
    let layers = a.dims.num_hidden_layers;
    let mtp = |k: &str| {
        let parts: Vec<&str> = k.split('.').collect();
        parts.len() >= 3
            && parts[1] == "layers"
            && parts[2].parse::<usize>().is_ok_and(|i| i >= layers)
    };
    w.drop_where(mtp);
    stack_experts(w, layers, a.moe.n_routed_experts.unwrap_or(0))?;
    for l in 0..layers {
        let prefix = format!("model.layers.{l}.self_attn");
        if let Some(kv_b) = w.take_optional(&format!("{prefix}.kv_b_proj.weight")) {
            split_kv_b(w, &prefix, kv_b, a)?;
        }
    }
    Ok(())
}

/// One layer's kv_b_proj into embed_q and unembed_out ([`sanitize`]).
fn split_kv_b(w: &mut Weights, prefix: &str, kv_b: Array, a: &Args) -> LoadResult<()> {
    let folder = w.folder().to_path_buf();
    let mlx = |source| LoadError::Mlx {
        folder: folder.clone(),
        source,
    };
    let packing = match w.take_optional(&format!("{prefix}.kv_b_proj.scales")) {
        Some(scales) => {
            let biases = format!("{prefix}.kv_b_proj.biases");
            let biases = w.take_optional(&biases).ok_or_else(|| w.missing(&biases))?;
            let dims = a.kv_lora_rank;
            let bits = kv_b.dim(-1) * 32 / dims;
            let group_size = dims / scales.dim(-1).max(1);
            Some((scales, biases, bits, group_size))
        }
        None => None,
    };
    let v = match &packing {
        Some((scales, biases, bits, group_size)) => {
            ops::dequantize(&kv_b, scales, Some(biases), *group_size, *bits, "affine")
                .map_err(mlx)?
        }
        None => kv_b,
    };
    let heads = a.dims.num_attention_heads;
    let expected = [heads * (a.qk_nope_head_dim + a.v_head_dim), a.kv_lora_rank];
    if v.shape() != expected {
        return Err(w.config_error(format!(
            "{prefix}.kv_b_proj holds a {:?} matrix, but num_attention_heads x \
             (qk_nope_head_dim + v_head_dim) by kv_lora_rank is {expected:?}",
            v.shape()
        )));
    }
    let (wk, wv) = head_matrices(&v, heads, a.qk_nope_head_dim).map_err(mlx)?;
    for (name, m) in [("embed_q", wk), ("unembed_out", wv)] {
        match &packing {
            Some((_, _, bits, group_size)) => {
                let parts = ops::quantize(&m, *group_size, *bits, "affine").map_err(mlx)?;
                for (k, part) in ["weight", "scales", "biases"].into_iter().zip(parts) {
                    w.insert(format!("{prefix}.{name}.{k}"), part);
                }
            }
            None => w.insert(format!("{prefix}.{name}.weight"), m),
        }
    }
    Ok(())
}

/// kv_b_proj's (heads * (nope + v), latent) matrix as embed_q's (heads, latent, nope) and
/// unembed_out's (heads, v, latent), contiguous as sanitize makes them.
fn head_matrices(v: &Array, heads: i32, nope: i32) -> mlx::Result<(Array, Array)> {
    let v = v.reshape(&[heads, -1, v.dim(-1)])?;
    let wk = v
        .slice_axis(1, 0, nope)?
        .transpose(&[0, 2, 1])?
        .contiguous()?;
    let wv = v.slice_axis(1, nope, v.dim(1))?.contiguous()?;
    Ok((wk, wv))
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
        let masks = rows::masks(rows, lens, 0, None)?
            .into_iter()
            .zip(rows.iter().zip(lens))
            .map(|(mask, (r, &n))| as_array(mask, n, r[0].offset()))
            .collect::<Result<Vec<_>>>()?;
        let layers = self.layers.len();
        self.outer.run(h, rows, lens, layers, taps, |i, x, rows| {
            let layer = &self.layers[i];
            layer
                .block
                .forward(x, |x| layer.attn.forward(x, &masks, rows))
        })
    }

    fn num_layers(&self) -> usize {
        self.layers.len()
    }

    fn attention_head_dim(&self) -> usize {
        self.kv_lora_rank
    }

    fn quantizes_kv(&self) -> bool {
        false
    }

    fn one_token_path(&self) -> bool {
        true
    }

    fn own_caches(&self) -> Option<Vec<LayerCache>> {
        None
    }

    fn outer(&self) -> &OuterLayers {
        &self.outer
    }
}

/// `cache.make_mask(N, return_array=True)`: the causal case as the boolean array
/// `create_causal_mask(N, offset)` (whose shape is what a rotating cache's own array has when
/// its window is not reached), no mask for one token.
fn as_array(mask: Mask, n: usize, offset: usize) -> Result<Option<Array>> {
    Ok(match mask {
        Mask::None => None,
        Mask::Causal => Some(create_causal_mask(n, offset, None)?),
        Mask::Array(m) => Some(m),
        Mask::Steps(_) => return Err(contract("glm4_moe_lite's caches are plain KV caches")),
    })
}
