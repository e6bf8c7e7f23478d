//! Layers shared by the model families, each computing exactly what its mlx.nn / mlx-lm
//! counterpart computes (same ops, same order), since parity is decided at the bit level.

use mlx::fast::{self, RopeFreqs};
use mlx::{compiled, ops, Array, Dtype, Result};
use serde::Deserialize;
use serde_json::Value;

use super::{row_blocks, Forward};
use crate::cache::{KeysValues, LayerCache, Mask, Packed3};
use crate::load::{LoadError, LoadResult, QuantConfig, QuantParams, Weights};

/// The dimensions every family reads from config.json, under mlx-lm's names.
#[derive(Clone, Debug, Deserialize)]
pub struct Dims {
    pub hidden_size: i32,
    pub num_hidden_layers: usize,
    pub intermediate_size: i32,
    pub num_attention_heads: i32,
    pub num_key_value_heads: Option<i32>,
    pub head_dim: Option<i32>,
    pub rms_norm_eps: f64,
    pub vocab_size: i32,
    pub tie_word_embeddings: Option<bool>,
}

impl Dims {
    /// `head_dim`, or `hidden_size // num_attention_heads` where the config leaves it out.
    pub fn head_dim(&self) -> i32 {
        self.head_dim
            .unwrap_or(self.hidden_size / self.num_attention_heads)
    }

    /// `num_key_value_heads`, or one per attention head where the config leaves it out.
    pub fn kv_heads(&self) -> i32 {
        self.num_key_value_heads.unwrap_or(self.num_attention_heads)
    }
}

/// A quantized weight: packed values plus per-group scales (and biases in affine mode).
struct Packed {
    weight: Array,
    scales: Array,
    biases: Option<Array>,
    params: QuantParams,
}

impl Packed {
    /// `mx.quantized_matmul(x, w, scales, biases, transpose=True, group_size, bits, mode)`.
    fn matmul(&self, x: &Array) -> Result<Array> {
        let p = &self.params;
        ops::quantized_matmul(
            x,
            &self.weight,
            &self.scales,
            self.biases.as_ref(),
            true,
            p.group_size,
            p.bits,
            &p.mode,
        )
    }
}

/// A (rows x cols) weight matrix: dense as stored, dense transposed, or packed by mlx-lm's
/// quantization.
///
/// Transposed: on a CPU whose matmul is the reference BLAS (the Linux wheels), `x @ w.T` runs
/// the dot-product form of `sgemm`, one dependent addition chain per output, while `x @ t` with
/// `t = w.T` made contiguous runs the axpy form, whose additions are independent: the same sums
/// in the same order (bit-identical, [`mlx::CPU_MATMUL_IS_REFERENCE_BLAS`]) in 0.5-0.75x the
/// time. Only f32 qualifies (MLX's other CPU float matmuls are its own kernels), and only
/// without a bias (`addmm` adds the bias first in one form and last in the other).
enum Weight {
    Dense(Array),
    Transposed(Array),
    Packed(Packed),
}

impl Weight {
    /// Loads `<path>.weight` (rows x cols), or its packed form when the quantization config
    /// says the module at `path` is quantized; `transposable` allows the transposed form.
    fn load(
        w: &mut Weights,
        q: &QuantConfig,
        path: &str,
        (rows, cols): (i32, i32),
        transposable: bool,
    ) -> LoadResult<Weight> {
        Ok(match q.for_module(path, cols, w)? {
            Some(params) => Weight::Packed(Packed {
                weight: w.take(&format!("{path}.weight"))?,
                scales: w.take(&format!("{path}.scales"))?,
                biases: w.take_optional(&format!("{path}.biases")),
                params,
            }),
            None => {
                let dense = w.take_shaped(&format!("{path}.weight"), &[rows, cols])?;
                if transposable && transposing_pays(&dense) {
                    Weight::Transposed(transposed(w, &dense)?)
                } else {
                    Weight::Dense(dense)
                }
            }
        })
    }

    /// `x @ weight.T`.
    fn matmul_t(&self, x: &Array) -> Result<Array> {
        match self {
            Weight::Dense(w) => x.matmul(&w.transpose(&[])?),
            Weight::Transposed(t) => x.matmul(t),
            Weight::Packed(p) => p.matmul(x),
        }
    }

    /// The (rows x cols) shape of the matrix as stored.
    fn stored_shape(&self) -> (usize, usize) {
        let (r, c) = match self {
            Weight::Dense(w) => (w.dim(0), w.dim(1)),
            Weight::Transposed(t) => (t.dim(1), t.dim(0)),
            Weight::Packed(p) => (p.weight.dim(0), p.weight.dim(1) * 32 / p.params.bits),
        };
        (r as usize, c as usize)
    }

    /// Dense weights stacked on the rows axis (the fused projection some Python modules build):
    /// transposed when all of them are, else as stored. `None` when any is packed.
    pub(crate) fn stack_rows(weights: &[&Weight]) -> Option<Result<Weight>> {
        let transposed: Option<Vec<&Array>> = weights
            .iter()
            .map(|w| match w {
                Weight::Transposed(t) => Some(t),
                _ => None,
            })
            .collect();
        if let Some(t) = transposed {
            return Some(ops::concatenate(&t, 1).map(Weight::Transposed));
        }
        let rows: Vec<Result<Array>> = weights
            .iter()
            .map(|w| match w {
                Weight::Dense(a) => Some(Ok(a.clone())),
                Weight::Transposed(t) => Some(t.transpose(&[])),
                Weight::Packed(_) => None,
            })
            .collect::<Option<_>>()?;
        Some(
            rows.into_iter()
                .collect::<Result<Vec<_>>>()
                .and_then(|rows| {
                    ops::concatenate(&rows.iter().collect::<Vec<_>>(), 0).map(Weight::Dense)
                }),
        )
    }
}

/// Whether `dense` is an f32 matrix on a reference-BLAS CPU, where the transposed form is the
/// faster one ([`Weight`]).
fn transposing_pays(dense: &Array) -> bool {
    mlx::CPU_MATMUL_IS_REFERENCE_BLAS
        && dense.dtype() == Dtype::Float32
        && mlx::default_device() == mlx::Device::Cpu
}

/// `dense.T` made contiguous and evaluated now, so that `dense` is freed at once rather than
/// held beside its copy until the first forward pass.
fn transposed(w: &Weights, dense: &Array) -> LoadResult<Array> {
    let copy = || -> Result<Array> {
        let t = dense.transpose(&[])?.contiguous()?;
        mlx::eval([&t])?;
        Ok(t)
    };
    copy().map_err(|source| LoadError::Mlx {
        folder: w.folder().into(),
        source,
    })
}

/// mlx.nn.Linear / QuantizedLinear.
pub struct Linear {
    weight: Weight,
    bias: Option<Array>,
}

impl Linear {
    /// Loads `<path>.weight` (out_dims x in_dims, or its packed form) and `<path>.bias`.
    pub fn load(
        w: &mut Weights,
        q: &QuantConfig,
        path: &str,
        in_dims: i32,
        out_dims: i32,
        bias: bool,
    ) -> LoadResult<Linear> {
        let weight = Weight::load(w, q, path, (out_dims, in_dims), !bias)?;
        let bias = if bias {
            Some(w.take_shaped(&format!("{path}.bias"), &[out_dims])?)
        } else {
            None
        };
        Ok(Linear { weight, bias })
    }

    /// Several bias-free projections of the same input as one: their weights stacked on the
    /// output axis (as some Python modules fuse them). `None` when any is quantized.
    pub fn stacked(linears: &[&Linear]) -> Option<Result<Linear>> {
        let weights: Vec<&Weight> = linears.iter().map(|l| &l.weight).collect();
        Some(Weight::stack_rows(&weights)?.map(|weight| Linear { weight, bias: None }))
    }

    pub fn forward(&self, x: &Array) -> Result<Array> {
        Ok(match (&self.weight, &self.bias) {
            (Weight::Dense(w), Some(b)) => ops::addmm(b, x, &w.transpose(&[])?, 1.0, 1.0)?,
            (Weight::Packed(p), Some(b)) => p.matmul(x)?.add(b)?,
            // Never loaded (a bias keeps the stored form), but kept exact rather than dropped.
            (Weight::Transposed(t), Some(b)) => ops::addmm(b, x, t, 1.0, 1.0)?,
            (weight, None) => weight.matmul_t(x)?,
        })
    }
}

/// mlx.nn.Embedding / QuantizedEmbedding, including `as_linear` for tied output heads.
pub struct Embedding {
    table: Weight,
}

impl Embedding {
    /// Loads the (vocab x dims) table as stored, even where it is also the output head: the
    /// transposed form would speed that matmul up, but gathering rows from it costs a copy of
    /// the table or of the gathered rows, which shows in the peak memory.
    pub fn load(
        w: &mut Weights,
        q: &QuantConfig,
        path: &str,
        vocab: i32,
        dims: i32,
    ) -> LoadResult<Embedding> {
        Ok(Embedding {
            table: Weight::load(w, q, path, (vocab, dims), false)?,
        })
    }

    /// Rows in the table: the vocabulary size.
    pub fn vocab(&self) -> usize {
        self.table.stored_shape().0
    }

    /// Columns of the table: the hidden size.
    pub fn width(&self) -> usize {
        self.table.stored_shape().1
    }

    /// `weight[ids]` (dequantizing the gathered rows when packed).
    pub fn forward(&self, ids: &Array) -> Result<Array> {
        Ok(match &self.table {
            Weight::Dense(w) => w.take(ids, 0)?,
            Weight::Transposed(t) => t.transpose(&[])?.take(ids, 0)?,
            Weight::Packed(p) => {
                let biases = p.biases.as_ref().map(|b| b.take(ids, 0)).transpose()?;
                let q = &p.params;
                ops::dequantize(
                    &p.weight.take(ids, 0)?,
                    &p.scales.take(ids, 0)?,
                    biases.as_ref(),
                    q.group_size,
                    q.bits,
                    &q.mode,
                )?
            }
        })
    }

    /// `x @ weight.T`: the embedding used as the output projection.
    pub fn as_linear(&self, x: &Array) -> Result<Array> {
        self.table.matmul_t(x)
    }
}

/// mlx.nn.RMSNorm; Gemma's variant scales by `1 + weight`, folded in at load (the same bits
/// Python computes on every call).
pub struct RmsNorm {
    weight: Array,
    eps: f32,
}

impl RmsNorm {
    pub fn load(w: &mut Weights, path: &str, dims: i32, eps: f64) -> LoadResult<RmsNorm> {
        Ok(RmsNorm {
            weight: w.take_shaped(&format!("{path}.weight"), &[dims])?,
            eps: eps as f32,
        })
    }

    /// Gemma's RMSNorm: `rms_norm(x, 1.0 + weight, eps)`.
    pub fn load_offset(w: &mut Weights, path: &str, dims: i32, eps: f64) -> LoadResult<RmsNorm> {
        Self::load(w, path, dims, eps)?.plus_one(w)
    }

    /// This norm with `1 + weight` as its weight (Gemma's variant).
    pub fn plus_one(self, w: &Weights) -> LoadResult<RmsNorm> {
        let weight = self
            .weight
            .add_scalar(1.0)
            .map_err(|source| LoadError::Mlx {
                folder: w.folder().into(),
                source,
            })?;
        Ok(RmsNorm { weight, ..self })
    }

    pub fn forward(&self, x: &Array) -> Result<Array> {
        fast::rms_norm(x, Some(&self.weight), self.eps)
    }
}

/// nn.RoPE as mlx-lm's initialize_rope builds it for the "default" and "linear" types.
#[derive(Clone, Copy, Debug)]
pub struct Rope {
    dims: i32,
    traditional: bool,
    base: f32,
    scale: f32,
}

impl Rope {
    /// `scaling` is config.json's rope_scaling (or rope_parameters) object, if any.
    pub fn new(
        dims: i32,
        base: f64,
        traditional: bool,
        scaling: Option<&Value>,
    ) -> std::result::Result<Rope, String> {
        let kind = scaling
            .and_then(|s| s.get("type").or_else(|| s.get("rope_type")))
            .and_then(Value::as_str)
            .unwrap_or("default");
        let scale = match kind {
            // mlx-lm applies mrope as a plain RoPE: exact for text-only positions.
            "default" | "mrope" => 1.0,
            "linear" => {
                let factor = scaling
                    .and_then(|s| s.get("factor"))
                    .and_then(Value::as_f64)
                    .ok_or("linear rope scaling needs a factor")?;
                (1.0 / factor) as f32
            }
            other => return Err(format!("RoPE scaling type {other:?} is not supported yet")),
        };
        Ok(Rope {
            dims,
            traditional,
            base: base as f32,
            scale,
        })
    }

    /// `mx.fast.rope(x, dims, traditional, base, scale, offset)`.
    pub fn forward(&self, x: &Array, offset: usize) -> Result<Array> {
        fast::rope(
            x,
            self.dims,
            self.traditional,
            RopeFreqs::Base(self.base),
            self.scale,
            offset as i32,
        )
    }
}

/// Where a model applies its per-head query/key RMSNorm.
pub enum QkNorm {
    None,
    /// On (B, L, H, D), before the head transpose (qwen3).
    BeforeTranspose {
        q: RmsNorm,
        k: RmsNorm,
    },
    /// On (B, H, L, D), after it (gemma3).
    AfterTranspose {
        q: RmsNorm,
        k: RmsNorm,
    },
}

/// The q, k, v and o projections of an attention block.
pub struct AttentionProjections {
    pub q_proj: Linear,
    pub k_proj: Linear,
    pub v_proj: Linear,
    pub o_proj: Linear,
}

impl AttentionProjections {
    /// Loads `<path>.{q,k,v,o}_proj` for `d`'s heads; `q_factor` widens q_proj's output (2 when
    /// it also yields a gate).
    pub fn load(
        w: &mut Weights,
        q: &QuantConfig,
        path: &str,
        d: &Dims,
        q_factor: i32,
        bias: bool,
    ) -> LoadResult<AttentionProjections> {
        let (h, hd) = (d.hidden_size, d.head_dim());
        let (qd, kvd) = (d.num_attention_heads * hd, d.kv_heads() * hd);
        let proj = |w: &mut Weights, name: &str, i: i32, o: i32| {
            Linear::load(w, q, &format!("{path}.{name}"), i, o, bias)
        };
        Ok(AttentionProjections {
            q_proj: proj(w, "q_proj", h, q_factor * qd)?,
            k_proj: proj(w, "k_proj", h, kvd)?,
            v_proj: proj(w, "v_proj", h, kvd)?,
            o_proj: proj(w, "o_proj", qd, h)?,
        })
    }
}

/// Multi-head attention with grouped KV heads, RoPE at the cache offset, and mlx-lm's choice of
/// fused or quantized attention kernel (models/base.py scaled_dot_product_attention).
pub struct Attention {
    pub proj: AttentionProjections,
    pub qk_norm: QkNorm,
    pub rope: Rope,
    pub n_heads: i32,
    pub n_kv_heads: i32,
    /// Python computes `head_dim ** -0.5` (or the model's formula) in double.
    pub scale: f32,
}

impl Attention {
    pub fn forward(&self, x: &Array, mask: &Mask, cache: &mut LayerCache) -> crate::Result<Array> {
        let (b, l) = (x.dim(0), x.dim(1));
        let heads = |y: Array, n: i32| y.reshape(&[b, l, n, -1]);
        let p = &self.proj;
        let (mut q, mut k) = (
            heads(p.q_proj.forward(x)?, self.n_heads)?,
            heads(p.k_proj.forward(x)?, self.n_kv_heads)?,
        );
        let v = heads(p.v_proj.forward(x)?, self.n_kv_heads)?.transpose(&[0, 2, 1, 3])?;
        if let QkNorm::BeforeTranspose { q: qn, k: kn } = &self.qk_norm {
            q = qn.forward(&q)?;
            k = kn.forward(&k)?;
        }
        q = q.transpose(&[0, 2, 1, 3])?;
        k = k.transpose(&[0, 2, 1, 3])?;
        if let QkNorm::AfterTranspose { q: qn, k: kn } = &self.qk_norm {
            q = qn.forward(&q)?;
            k = kn.forward(&k)?;
        }
        let offset = cache.offset();
        let q = self.rope.forward(&q, offset)?;
        let k = self.rope.forward(&k, offset)?;
        let kv = cache.update_and_fetch(&k, &v)?;
        let out = attend(&q, &kv, self.scale, mask)?;
        Ok(p.o_proj
            .forward(&out.transpose(&[0, 2, 1, 3])?.reshape(&[b, l, -1])?)?)
    }
}

/// mlx-lm's scaled_dot_product_attention: the fused kernel for dense caches (a long chunk's
/// rows in blocks on a reference-BLAS CPU, same bits: [`row_blocks`]), the
/// quantized-matmul formulation for quantized ones. A backend without a quantized-matmul kernel
/// for the cache's shape (mlx-cuda for the fixtures' group size 32) fails naming the cache's
/// settings.
pub fn attend(q: &Array, kv: &KeysValues, scale: f32, mask: &Mask) -> crate::Result<Array> {
    match kv {
        KeysValues::Dense { keys, values } => Ok(match row_blocks::rows_per_block(q) {
            Some(block) => row_blocks::attend_in_row_blocks(q, keys, values, scale, mask, block)?,
            None => {
                fast::scaled_dot_product_attention(q, keys, values, scale, mask.as_sdpa(), None)?
            }
        }),
        KeysValues::Quantized {
            keys,
            values,
            group_size,
            bits,
        } => quantized_attention(q, keys, values, scale, mask, *group_size, *bits).map_err(|e| {
            crate::Error::Unsupported(format!(
                "attention over a {bits}-bit quantized KV cache (group size {group_size}) failed \
                 on this backend: {e}"
            ))
        }),
    }
}

/// models/base.py quantized_scaled_dot_product_attention, op for op.
fn quantized_attention(
    queries: &Array,
    keys: &Packed3,
    values: &Packed3,
    scale: f32,
    mask: &Mask,
    group_size: i32,
    bits: i32,
) -> Result<Array> {
    let qs = queries.shape();
    let (b, n_q_heads, l, d) = (qs[0], qs[1], qs[2], qs[3]);
    let n_kv_heads = keys[0].dim(-3);
    let n_repeats = n_q_heads / n_kv_heads;
    let mut q = queries.multiply_scalar(scale)?;
    let expand = |t: &Packed3| -> Result<Packed3> {
        Ok([
            t[0].expand_dims(&[-3])?,
            t[1].expand_dims(&[-3])?,
            t[2].expand_dims(&[-3])?,
        ])
    };
    let (keys, values) = if n_repeats > 1 {
        q = q.reshape(&[b, n_kv_heads, n_repeats, l, d])?;
        (expand(keys)?, expand(values)?)
    } else {
        (keys.clone(), values.clone())
    };
    let qmm = |x: &Array, t: &Packed3, transpose: bool| {
        ops::quantized_matmul(
            x,
            &t[0],
            &t[1],
            Some(&t[2]),
            transpose,
            group_size,
            bits,
            "affine",
        )
    };
    let mut scores = qmm(&q, &keys, true)?;
    let mask = match mask {
        Mask::None => None,
        Mask::Causal => {
            let (ql, kl) = (scores.dim(-2), scores.dim(-1));
            let q_idx = Array::arange((kl - ql) as f64, kl as f64, 1.0, Dtype::Int32)?;
            let k_idx = Array::arange(0.0, kl as f64, 1.0, Dtype::Int32)?;
            Some(
                q_idx
                    .expand_dims(&[1])?
                    .greater_equal(&k_idx.expand_dims(&[0])?)?,
            )
        }
        Mask::Array(m) => Some(m.clone()),
    };
    if let Some(mut m) = mask {
        if n_repeats > 1 && m.ndim() > 3 {
            m = m.expand_dims(&[-3])?;
        }
        scores = if m.dtype() == Dtype::Bool {
            let lowest = Array::scalar(finfo_min(scores.dtype()), scores.dtype())?;
            ops::r#where(&m, &scores, &lowest)?
        } else {
            scores.add(&m)?
        };
    }
    let scores = ops::softmax(&scores, &[-1], true)?;
    let out = qmm(&scores, &values, false)?;
    if n_repeats > 1 {
        out.reshape(&[b, n_q_heads, l, d])
    } else {
        Ok(out)
    }
}

/// `mx.finfo(dtype).min` as an f32 (exact for every float dtype MLX models use).
fn finfo_min(dtype: Dtype) -> f32 {
    match dtype {
        Dtype::Float16 => -65504.0,
        Dtype::Bfloat16 => f32::from_bits(0xff7f_0000),
        _ => f32::MIN,
    }
}

/// The gated MLPs: `down(act(gate(x)) * up(x))`.
pub struct GatedMlp {
    pub gate_proj: Linear,
    pub up_proj: Linear,
    pub down_proj: Linear,
    pub activation: Activation,
}

#[derive(Clone, Copy, Debug)]
pub enum Activation {
    /// mlx-lm's compiled `swiglu(gate, x)`.
    Swiglu,
    /// `nn.gelu_approx(gate) * x` (gemma).
    GeluApprox,
}

impl GatedMlp {
    pub fn load(
        w: &mut Weights,
        q: &QuantConfig,
        path: &str,
        dims: i32,
        hidden: i32,
        bias: bool,
        activation: Activation,
    ) -> LoadResult<GatedMlp> {
        Ok(GatedMlp {
            gate_proj: Linear::load(w, q, &format!("{path}.gate_proj"), dims, hidden, bias)?,
            up_proj: Linear::load(w, q, &format!("{path}.up_proj"), dims, hidden, bias)?,
            down_proj: Linear::load(w, q, &format!("{path}.down_proj"), hidden, dims, bias)?,
            activation,
        })
    }

    pub fn forward(&self, x: &Array) -> Result<Array> {
        let gate = self.gate_proj.forward(x)?;
        let up = self.up_proj.forward(x)?;
        let h = match self.activation {
            Activation::Swiglu => compiled::swiglu(&gate, &up)?,
            Activation::GeluApprox => compiled::gelu_approx(&gate)?.multiply(&up)?,
        };
        self.down_proj.forward(&h)
    }
}

/// The pre-norm residual block llama and the qwen3 hybrids share around their token mixer:
/// `h = x + mixer(input_layernorm(x)); out = h + mlp(post_attention_layernorm(h))`.
pub struct PreNormBlock {
    pub input_layernorm: RmsNorm,
    pub post_attention_layernorm: RmsNorm,
    pub mlp: GatedMlp,
}

impl PreNormBlock {
    /// Loads the norms and the SwiGLU MLP of the layer at `path`.
    pub fn load(
        w: &mut Weights,
        q: &QuantConfig,
        path: &str,
        d: &Dims,
        mlp_bias: bool,
    ) -> LoadResult<PreNormBlock> {
        let (h, eps) = (d.hidden_size, d.rms_norm_eps);
        Ok(PreNormBlock {
            input_layernorm: RmsNorm::load(w, &format!("{path}.input_layernorm"), h, eps)?,
            post_attention_layernorm: RmsNorm::load(
                w,
                &format!("{path}.post_attention_layernorm"),
                h,
                eps,
            )?,
            mlp: GatedMlp::load(
                w,
                q,
                &format!("{path}.mlp"),
                h,
                d.intermediate_size,
                mlp_bias,
                Activation::Swiglu,
            )?,
        })
    }

    pub fn forward(
        &self,
        x: &Array,
        mixer: impl FnOnce(&Array) -> crate::Result<Array>,
    ) -> crate::Result<Array> {
        let h = x.add(&mixer(&self.input_layernorm.forward(x)?)?)?;
        let r = self
            .mlp
            .forward(&self.post_attention_layernorm.forward(&h)?)?;
        Ok(h.add(&r)?)
    }
}

/// The output projection: a separate `lm_head`, or the embedding used as a linear layer.
pub enum Head {
    Tied,
    Separate(Linear),
}

/// What every decoder here has around its layers: the token embedding, the final norm, and the
/// output head.
pub struct OuterLayers {
    pub embed_tokens: Embedding,
    pub norm: RmsNorm,
    pub head: Head,
}

impl OuterLayers {
    /// Loads `<prefix>model.embed_tokens`, `<prefix>model.norm` and, unless `tied`,
    /// `<prefix>lm_head`.
    pub fn load(
        w: &mut Weights,
        q: &QuantConfig,
        prefix: &str,
        d: &Dims,
        tied: bool,
    ) -> LoadResult<OuterLayers> {
        let (h, vocab) = (d.hidden_size, d.vocab_size);
        let path = |name: &str| format!("{prefix}{name}");
        Ok(OuterLayers {
            embed_tokens: Embedding::load(w, q, &path("model.embed_tokens"), vocab, h)?,
            norm: RmsNorm::load(w, &path("model.norm"), h, d.rms_norm_eps)?,
            head: if tied {
                Head::Tied
            } else {
                Head::Separate(Linear::load(w, q, &path("lm_head"), h, vocab, false)?)
            },
        })
    }

    /// Rows of the embedding: the width of the logits.
    pub fn vocab(&self) -> usize {
        self.embed_tokens.vocab()
    }

    /// Runs the embedded input `h` through the model's `layers` layers — `layer(i, h, cache)`
    /// is layer i with its cache — keeping the hidden states `taps` asks for (tap i < layers:
    /// layer i's output; tap = layers: the final normed state), then the final norm and head.
    pub fn run(
        &self,
        mut h: Array,
        caches: &mut [LayerCache],
        layers: usize,
        taps: &[usize],
        mut layer: impl FnMut(usize, &Array, &mut LayerCache) -> crate::Result<Array>,
    ) -> crate::Result<Forward> {
        if caches.len() != layers {
            return Err(crate::error::contract(format!(
                "{} caches for a model of {layers} layers",
                caches.len()
            )));
        }
        let mut hidden: Vec<Option<Array>> = vec![None; taps.len()];
        let mut capture = |index: usize, h: &Array| {
            for (slot, _) in hidden.iter_mut().zip(taps).filter(|(_, &t)| t == index) {
                *slot = Some(h.clone());
            }
        };
        for (i, cache) in caches.iter_mut().enumerate() {
            h = layer(i, &h, cache)?;
            capture(i, &h);
        }
        let h = self.norm.forward(&h)?;
        capture(layers, &h);
        Ok(Forward {
            logits: self.logits(&h)?,
            hidden: hidden.into_iter().flatten().collect(),
        })
    }

    /// The output head over final-normed hidden states (what a drafter borrowing the target's
    /// head, such as an MTP head, projects its own states with).
    pub fn logits(&self, h: &Array) -> mlx::Result<Array> {
        match &self.head {
            Head::Tied => self.embed_tokens.as_linear(h),
            Head::Separate(lm_head) => lm_head.forward(h),
        }
    }
}
