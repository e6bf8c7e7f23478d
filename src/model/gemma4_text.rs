//! mlx_lm/models/gemma4_text.py: sliding and full attention layers with their own head widths,
//! KV-head counts and RoPE (a proportional, partial one on full layers), q/k norms and a
//! scale-free v norm, attention scale 1; per-layer input embeddings gated into every layer; a
//! compiled GeGLU MLP, double-wide in the KV-shared layers; a learned per-layer scalar; and
//! soft-capped logits.
//!
//! The last `num_kv_shared_layers` layers own no cache: each reads the keys and values (and
//! the RoPE offset) that the last earlier layer of its type fetched from its cache in the same
//! forward, as mlx-lm's `previous_kvs` does. So the cache list is mlx-lm's make_cache, one
//! cache per owning layer, and a rollback trims only those.
//!
//! With `enable_moe_block`, each layer adds a sparse block beside its MLP (gemma4_moe.rs).

use mlx::fast;
use mlx::{compiled, Array};
use serde::Deserialize;
use serde_json::{json, Map, Value};

use super::gemma4_moe::{split_experts, Moe, MoeSizes};
use super::gemma4_rope::LayerRope;
use super::layers::{attend_row, Activation, Dims, GatedMlp, Linear, OuterLayers, RmsNorm};
use super::rows::{self, LayerRows};
use super::{Forward, KvSharing, LanguageModel, SharedKv};
use crate::cache::{KeysValues, KvCache, LayerCache, Mask, RotatingKvCache};
use crate::error::contract;
use crate::load::{Config, LoadResult, QuantConfig, Weights};
use crate::{Error, Result};

pub(crate) const SLIDING: &str = "sliding_attention";
pub(crate) const FULL: &str = "full_attention";

#[derive(Deserialize)]
struct Args {
    #[serde(flatten)]
    dims: Dims,
    global_head_dim: Option<i32>,
    num_global_key_value_heads: Option<i32>,
    num_kv_shared_layers: usize,
    hidden_size_per_layer_input: Option<i32>,
    vocab_size_per_layer_input: i32,
    rope_traditional: bool,
    rope_parameters: Option<Map<String, Value>>,
    sliding_window: usize,
    sliding_window_pattern: usize,
    attention_k_eq_v: bool,
    final_logit_softcapping: Option<f64>,
    use_double_wide_mlp: bool,
    enable_moe_block: bool,
    num_experts: Option<i32>,
    top_k_experts: Option<i32>,
    moe_intermediate_size: Option<i32>,
    layer_types: Option<Vec<String>>,
}

/// One row's keys and values as an owning layer fetched them from its cache, with the offset
/// its RoPE used: what the KV-shared layers of its type attend over.
struct RowKv {
    kv: KeysValues,
    offset: usize,
    /// Whether the owner's cache is a plain KV cache (the lone-row kernel choice).
    plain: bool,
}

/// The owning layers' key and value projections (`v_proj` absent under attention_k_eq_v,
/// where the raw keys are the values).
struct OwnKv {
    k_proj: Linear,
    v_proj: Option<Linear>,
    k_norm: RmsNorm,
}

struct Attention {
    q_proj: Linear,
    o_proj: Linear,
    q_norm: RmsNorm,
    /// None in the KV-shared layers.
    kv: Option<OwnKv>,
    rope: LayerRope,
    n_heads: i32,
    n_kv_heads: i32,
    head_dim: i32,
    eps: f32,
}

impl Attention {
    /// The attention of every row; an owning layer returns the keys and values it fetched,
    /// a KV-shared layer attends over `shared`, its owner's.
    fn forward(
        &self,
        x: &Array,
        masks: &[Mask],
        rows: &mut LayerRows,
        shared: Option<&[RowKv]>,
    ) -> Result<(Array, Option<Vec<RowKv>>)> {
        let (b, l) = (x.dim(0), x.dim(1));
        let heads = |y: Array, n: i32| y.reshape(&[b, l, n, -1]);
        let q = heads(self.q_proj.forward(x)?, self.n_heads)?;
        let q = self.q_norm.forward(&q)?.transpose(&[0, 2, 1, 3])?;
        let qs = rows.split(&q, 2)?;
        let mut outs = Vec::with_capacity(qs.len());
        let fetched = match (&self.kv, shared) {
            (_, Some(shared)) => {
                for (q, s) in qs.iter().zip(shared) {
                    if matches!(s.kv, KeysValues::Quantized { .. }) {
                        return Err(Error::Unsupported(
                            "gemma4_text's KV-shared layers over a quantized KV cache (mlx-lm \
                             hands the owner's quantized keys to mx.fast.scaled_dot_product_\
                             attention, which fails)"
                                .into(),
                        ));
                    }
                    let q = self.rope.forward(q, s.offset)?;
                    outs.push(attend_row(&q, &s.kv, 1.0, &masks[outs.len()], s.plain)?);
                }
                None
            }
            (Some(own), None) => {
                let raw_k = heads(own.k_proj.forward(x)?, self.n_kv_heads)?;
                let raw_v = match &own.v_proj {
                    Some(v_proj) => heads(v_proj.forward(x)?, self.n_kv_heads)?,
                    None => raw_k.clone(),
                };
                let k = own.k_norm.forward(&raw_k)?.transpose(&[0, 2, 1, 3])?;
                // RMSNormNoScale.
                let v = fast::rms_norm(&raw_v, None, self.eps)?.transpose(&[0, 2, 1, 3])?;
                let (ks, vs) = (rows.split(&k, 2)?, rows.split(&v, 2)?);
                let mut kvs = Vec::with_capacity(qs.len());
                for (r, cache) in rows.caches.iter_mut().enumerate() {
                    let offset = cache.offset();
                    let k = self.rope.forward(&ks[r], offset)?;
                    let q = self.rope.forward(&qs[r], offset)?;
                    let kv = rows::update_row(cache, &k, &vs[r])?;
                    let plain = matches!(**cache, LayerCache::Kv(_));
                    outs.push(attend_row(&q, &kv, 1.0, &masks[r], plain)?);
                    kvs.push(RowKv { kv, offset, plain });
                }
                Some(kvs)
            }
            (None, None) => {
                return Err(contract(
                    "a KV-shared gemma4_text layer ran before its owner".to_string(),
                ))
            }
        };
        let out = rows.join(outs, 2)?;
        let out = out.transpose(&[0, 2, 1, 3])?.reshape(&[b, l, -1])?;
        Ok((self.o_proj.forward(&out)?, fetched))
    }
}

/// A layer's per-layer input gate: `h + norm(projection(gelu_approx(gate(h)) * input))`.
struct PerLayerGate {
    gate: Linear,
    projection: Linear,
    norm: RmsNorm,
}

struct Block {
    attn: Attention,
    mlp: GatedMlp,
    input_layernorm: RmsNorm,
    post_attention_layernorm: RmsNorm,
    pre_feedforward_layernorm: RmsNorm,
    post_feedforward_layernorm: RmsNorm,
    per_layer: Option<PerLayerGate>,
    moe: Option<Moe>,
    layer_scalar: Array,
    full: bool,
    /// The layer whose keys and values this one attends over (itself unless KV-shared).
    owner: usize,
}

impl Block {
    fn forward(
        &self,
        x: &Array,
        masks: &[Mask],
        rows: &mut LayerRows,
        shared: Option<&[RowKv]>,
        per_layer_input: Option<&Array>,
    ) -> Result<(Array, Option<Vec<RowKv>>)> {
        let (r, fetched) =
            self.attn
                .forward(&self.input_layernorm.forward(x)?, masks, rows, shared)?;
        let h = x.add(&self.post_attention_layernorm.forward(&r)?)?;
        let mut r = self
            .mlp
            .forward(&self.pre_feedforward_layernorm.forward(&h)?)?;
        if let Some(moe) = &self.moe {
            let r1 = moe.post_feedforward_layernorm_1.forward(&r)?;
            let x2 = moe.pre_feedforward_layernorm_2.forward(&h)?;
            let r2 = moe
                .post_feedforward_layernorm_2
                .forward(&moe.forward(&h, &x2)?)?;
            r = r1.add(&r2)?;
        }
        let mut h = h.add(&self.post_feedforward_layernorm.forward(&r)?)?;
        if let (Some(p), Some(input)) = (&self.per_layer, per_layer_input) {
            let gate = compiled::gelu_approx(&p.gate.forward(&h)?)?.multiply(input)?;
            let gate = p.norm.forward(&p.projection.forward(&gate)?)?;
            h = h.add(&gate)?;
        }
        Ok((h.multiply(&self.layer_scalar)?, fetched))
    }
}

/// The per-layer input embeddings and their projection from the hidden state.
struct PerLayerInputs {
    embed: super::layers::Embedding,
    model_projection: Linear,
    projection_norm: RmsNorm,
    width: i32,
}

pub struct Model {
    outer: OuterLayers,
    layers: Vec<Block>,
    per_layer: Option<PerLayerInputs>,
    embed_scale: f32,
    window: usize,
    /// Layers that own a cache (all but the KV-shared ones).
    owners: usize,
    /// The sliding layers' head_dim (mlx-lm's `head_dim` property; full layers may be wider).
    head_dim: usize,
}

impl Model {
    pub fn load(config: &Config, w: &mut Weights, q: &QuantConfig) -> LoadResult<Model> {
        // The Python dataclass defaults (gemma4_text.ModelArgs).
        let a: Args = config.args(json!({
            "hidden_size": 1536, "num_hidden_layers": 35, "intermediate_size": 6144,
            "num_attention_heads": 8, "head_dim": 256, "global_head_dim": 512,
            "rms_norm_eps": 1.0e-6, "vocab_size": 262144, "vocab_size_per_layer_input": 262144,
            "num_key_value_heads": 1, "num_kv_shared_layers": 20,
            "hidden_size_per_layer_input": 256, "rope_traditional": false,
            "sliding_window": 512, "sliding_window_pattern": 5, "attention_k_eq_v": false,
            "final_logit_softcapping": 30.0, "use_double_wide_mlp": true,
            "enable_moe_block": false, "tie_word_embeddings": true,
        }))?;
        let d = &a.dims;
        let n = d.num_hidden_layers;
        let moe_sizes = MoeSizes::from_config(
            a.enable_moe_block,
            a.num_experts,
            a.top_k_experts,
            a.moe_intermediate_size,
        )
        .map_err(|m| config.error(m))?;
        if a.num_kv_shared_layers >= n {
            return Err(config.error(format!(
                "num_kv_shared_layers is {}, must be below num_hidden_layers ({n})",
                a.num_kv_shared_layers
            )));
        }
        if a.sliding_window == 0 {
            return Err(config.error("sliding_window is 0, must be at least 1"));
        }
        let types = match &a.layer_types {
            Some(t) => t.clone(),
            None => {
                if a.sliding_window_pattern == 0 {
                    return Err(config.error("sliding_window_pattern is 0, must be at least 1"));
                }
                let p = a.sliding_window_pattern;
                (0..n)
                    .map(|i| if i % p == p - 1 { FULL } else { SLIDING }.to_string())
                    .collect()
            }
        };
        if types.len() != n {
            return Err(config.error(format!(
                "layer_types has {} entries, must have one per layer ({n})",
                types.len()
            )));
        }
        if let Some(t) = types.iter().find(|t| *t != SLIDING && *t != FULL) {
            return Err(config.error(format!(
                "layer_types holds {t:?}, must hold only \"{SLIDING}\" and \"{FULL}\""
            )));
        }
        let owners = n - a.num_kv_shared_layers;
        let owner_of = |i: usize| -> LoadResult<usize> {
            if i < owners {
                return Ok(i);
            }
            (0..owners)
                .rev()
                .find(|&j| types[j] == types[i])
                .ok_or_else(|| {
                    config.error(format!(
                        "layer {i} is KV-shared (num_kv_shared_layers is {}) but no earlier \
                         layer is a {}, whose cache it would read",
                        a.num_kv_shared_layers, types[i]
                    ))
                })
        };
        let owners_of = (0..n).map(owner_of).collect::<LoadResult<Vec<_>>>()?;
        let rope_params = a.rope_parameters.clone().unwrap_or_else(|| {
            let v = json!({
                FULL: {"partial_rotary_factor": 0.25, "rope_theta": 1_000_000.0,
                       "rope_type": "proportional"},
                SLIDING: {"partial_rotary_factor": 1.0, "rope_theta": 10_000.0,
                          "rope_type": "default"},
            });
            v.as_object().cloned().unwrap_or_default()
        });
        let eps = d.rms_norm_eps;
        let global_kv_heads = match a.num_global_key_value_heads {
            Some(h) if a.attention_k_eq_v => {
                if h < 1 || d.num_attention_heads % h != 0 {
                    return Err(config.error(format!(
                        "num_global_key_value_heads is {h}, must be at least 1 and divide \
                         num_attention_heads ({})",
                        d.num_attention_heads
                    )));
                }
                h
            }
            _ => d.kv_heads(),
        };
        let per_layer_width = a.hidden_size_per_layer_input.filter(|&p| p != 0);
        if let Some(p) = per_layer_width.filter(|&p| p < 0) {
            return Err(config.error(format!(
                "hidden_size_per_layer_input is {p}, must be 0 (none) or more"
            )));
        }
        let h = d.hidden_size;
        // mlx-lm widens the MLPs of the KV-shared layers (there is always an owning layer).
        let double_from = if a.use_double_wide_mlp { owners } else { n };
        drop_unused(w, owners);
        split_experts(w)?;
        let mut layers = Vec::with_capacity(n);
        for (i, kind) in types.iter().enumerate() {
            let p = format!("model.layers.{i}");
            let full = kind == FULL;
            let hd = match a.global_head_dim {
                Some(g) if full && g != 0 => g,
                _ => d.head_dim(),
            };
            if hd < 1 {
                return Err(config.error(format!(
                    "the {kind} layers' head dimension is {hd}, must be at least 1"
                )));
            }
            let k_eq_v = a.attention_k_eq_v && full;
            let n_kv_heads = if k_eq_v {
                global_kv_heads
            } else {
                d.kv_heads()
            };
            let params = rope_params.get(kind).cloned().unwrap_or(json!({}));
            let rope = LayerRope::new(hd, a.rope_traditional, &params)
                .map_err(|m| config.error(format!("rope_parameters.{kind}: {m}")))?;
            let lin = |w: &mut Weights, name: &str, i: i32, o: i32| {
                Linear::load(w, q, &format!("{p}.{name}"), i, o, false)
            };
            let norm = |w: &mut Weights, name: &str, dims: i32| {
                RmsNorm::load(w, &format!("{p}.{name}"), dims, eps)
            };
            let kv = if i < owners {
                Some(OwnKv {
                    k_proj: lin(w, "self_attn.k_proj", h, n_kv_heads * hd)?,
                    v_proj: if k_eq_v {
                        None
                    } else {
                        Some(lin(w, "self_attn.v_proj", h, n_kv_heads * hd)?)
                    },
                    k_norm: norm(w, "self_attn.k_norm", hd)?,
                })
            } else {
                None
            };
            let heads = d.num_attention_heads;
            let attn = Attention {
                q_proj: lin(w, "self_attn.q_proj", h, heads * hd)?,
                o_proj: lin(w, "self_attn.o_proj", heads * hd, h)?,
                q_norm: norm(w, "self_attn.q_norm", hd)?,
                kv,
                rope,
                n_heads: heads,
                n_kv_heads,
                head_dim: hd,
                eps: eps as f32,
            };
            let wide = if i >= double_from { 2 } else { 1 };
            let mlp = GatedMlp::load(
                w,
                q,
                &format!("{p}.mlp"),
                h,
                wide * d.intermediate_size,
                false,
                Activation::Geglu,
            )?;
            let per_layer = match per_layer_width {
                Some(pw) => Some(PerLayerGate {
                    gate: lin(w, "per_layer_input_gate", h, pw)?,
                    projection: lin(w, "per_layer_projection", pw, h)?,
                    norm: norm(w, "post_per_layer_input_norm", h)?,
                }),
                None => None,
            };
            let moe = moe_sizes
                .map(|m| Moe::load(w, q, &p, h, m, eps))
                .transpose()?;
            layers.push(Block {
                attn,
                mlp,
                moe,
                input_layernorm: norm(w, "input_layernorm", h)?,
                post_attention_layernorm: norm(w, "post_attention_layernorm", h)?,
                pre_feedforward_layernorm: norm(w, "pre_feedforward_layernorm", h)?,
                post_feedforward_layernorm: norm(w, "post_feedforward_layernorm", h)?,
                per_layer,
                layer_scalar: w.take_shaped(&format!("{p}.layer_scalar"), &[1])?,
                full,
                owner: owners_of[i],
            });
        }
        let per_layer = match per_layer_width {
            Some(pw) => {
                if a.vocab_size_per_layer_input < d.vocab_size {
                    return Err(config.error(format!(
                        "vocab_size_per_layer_input is {}, must be at least vocab_size ({}): \
                         every token id indexes the per-layer embedding",
                        a.vocab_size_per_layer_input, d.vocab_size
                    )));
                }
                let total = n as i32 * pw;
                Some(PerLayerInputs {
                    embed: super::layers::Embedding::load(
                        w,
                        q,
                        "model.embed_tokens_per_layer",
                        a.vocab_size_per_layer_input,
                        total,
                    )?,
                    model_projection: Linear::load(
                        w,
                        q,
                        "model.per_layer_model_projection",
                        h,
                        total,
                        false,
                    )?,
                    projection_norm: RmsNorm::load(w, "model.per_layer_projection_norm", pw, eps)?,
                    width: pw,
                })
            }
            None => None,
        };
        let tied = d.tie_word_embeddings.unwrap_or(true);
        let mut outer = OuterLayers::load(w, q, "", d, tied)?;
        outer.softcap = match a.final_logit_softcapping {
            Some(c) if !(c.is_finite() && c > 0.0) => {
                return Err(config.error(format!(
                    "final_logit_softcapping is {c}, must be a finite number > 0 (or null)"
                )))
            }
            c => c.map(|c| c as f32),
        };
        Ok(Model {
            outer,
            layers,
            per_layer,
            embed_scale: f64::from(h).sqrt() as f32,
            window: a.sliding_window,
            owners,
            head_dim: d.head_dim() as usize,
        })
    }

    /// `_get_per_layer_inputs` and `_project_per_layer_inputs` for the ids `ids` and the
    /// scaled embeddings `h`: (B, L, layers, width).
    fn per_layer_inputs(&self, p: &PerLayerInputs, ids: &Array, h: &Array) -> Result<Array> {
        let (b, l, n) = (h.dim(0), h.dim(1), self.layers.len() as i32);
        let shape = [b, l, n, p.width];
        let inputs = p
            .embed
            .forward(ids)?
            .multiply_scalar(f64::from(p.width).sqrt() as f32)?
            .reshape(&shape)?;
        let hidden = f64::from(h.dim(-1));
        let projected = p
            .model_projection
            .forward(h)?
            .multiply_scalar(hidden.powf(-0.5) as f32)?
            .reshape(&shape)?;
        let projected = p.projection_norm.forward(&projected)?;
        Ok(projected
            .add(&inputs)?
            .multiply_scalar(2f64.powf(-0.5) as f32)?)
    }
}

/// mlx-lm's sanitize: drops the rotary tables and activation ranges some checkpoints carry, and
/// the key/value weights of the KV-shared layers (from `owners` on), which never run.
fn drop_unused(w: &mut Weights, owners: usize) {
    let ignored = [
        "self_attn.rotary_emb",
        "input_max",
        "input_min",
        "output_max",
        "output_min",
    ];
    w.drop_where(|k| {
        if ignored.iter().any(|s| k.contains(s)) {
            return true;
        }
        let kv = [
            ".self_attn.k_proj",
            ".self_attn.v_proj",
            ".self_attn.k_norm",
        ];
        let layer = k
            .split("layers.")
            .nth(1)
            .and_then(|r| r.split('.').next())
            .and_then(|i| i.parse::<usize>().ok());
        kv.iter().any(|s| k.contains(s)) && layer.is_some_and(|i| i >= owners)
    });
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
        let h = h.multiply_scalar(self.embed_scale)?;
        let per_layer = match &self.per_layer {
            Some(p) => Some(self.per_layer_inputs(p, ids, &h)?),
            None => None,
        };
        // Checked before the masks read the rows' caches (run_with_caches checks again).
        rows::check(rows, lens, self.owners, h.dim(1) as usize)?;
        // One mask per layer type, from the first layer of that type (an owning layer).
        let first = |full: bool| self.layers.iter().position(|l| l.full == full);
        let full_masks = match first(true) {
            Some(i) => rows::masks(rows, lens, i, None)?,
            None => Vec::new(),
        };
        let sliding_masks = match first(false) {
            Some(i) => rows::masks(rows, lens, i, Some(self.window))?,
            None => Vec::new(),
        };
        let mut fetched: Vec<Option<Vec<RowKv>>> = (0..self.layers.len()).map(|_| None).collect();
        let shape = (self.layers.len(), self.owners);
        self.outer
            .run_with_caches(h, rows, lens, shape, taps, |i, h, rows| {
                let layer = &self.layers[i];
                let masks = if layer.full {
                    &full_masks
                } else {
                    &sliding_masks
                };
                let input = match &per_layer {
                    Some(p) => Some(p.slice_axis(2, i as i32, i as i32 + 1)?.squeeze(&[2])?),
                    None => None,
                };
                let shared = (layer.owner != i).then(|| fetched[layer.owner].as_deref());
                let (h, kvs) = layer.forward(h, masks, rows, shared.flatten(), input.as_ref())?;
                fetched[i] = kvs;
                Ok(h)
            })
    }

    fn num_layers(&self) -> usize {
        self.layers.len()
    }

    fn num_caches(&self) -> usize {
        self.owners
    }

    fn attention_head_dim(&self) -> usize {
        self.head_dim
    }

    fn own_caches(&self) -> Option<Vec<LayerCache>> {
        let cache = |l: &Block| {
            if l.full {
                LayerCache::Kv(KvCache::default())
            } else {
                LayerCache::Rotating(RotatingKvCache::new(self.window, 0))
            }
        };
        Some(self.layers[..self.owners].iter().map(cache).collect())
    }

    fn outer(&self) -> &OuterLayers {
        &self.outer
    }

    fn kv_sharing(&self) -> Option<KvSharing> {
        let last = |full: bool| self.layers.iter().rposition(|l| l.full == full);
        let kinds = [(SLIDING, false), (FULL, true)]
            .into_iter()
            .filter_map(|(kind, full)| {
                let l = &self.layers[last(full)?];
                let attn = &self.layers[l.owner].attn;
                Some(SharedKv {
                    kind: kind.to_string(),
                    cache: l.owner,
                    head_dim: attn.head_dim as usize,
                    kv_heads: attn.n_kv_heads as usize,
                })
            })
            .collect();
        Some(KvSharing {
            embed_scale: self.embed_scale,
            kinds,
        })
    }
}
