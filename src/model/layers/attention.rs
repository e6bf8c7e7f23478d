//! Attention: the q/k/v/o projections, the block that runs them with its norms and RoPE, and
//! mlx-lm's scaled dot-product attention over dense or quantized KV caches.

use mlx::{fast, ops, Array, Dtype, Result};

use super::{rows_kernel, Dims, Linear, QkNorm, Rope};
use crate::cache::{attention_mask, BatchKvCache, KeysValues, LayerCache, Mask, Packed3};
use crate::load::{LoadResult, QuantConfig, Weights};
use crate::model::rows::{self, LayerRows};
use crate::model::{lone_rows, row_blocks};

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
        Self::load_biased(w, q, path, d, q_factor, (bias, bias))
    }

    /// [`AttentionProjections::load`] with biases on q, k and v as `biases.0` says and on o as
    /// `biases.1` says (glm4_moe's `attention_bias` leaves o_proj without one).
    pub fn load_biased(
        w: &mut Weights,
        q: &QuantConfig,
        path: &str,
        d: &Dims,
        q_factor: i32,
        (qkv_bias, o_bias): (bool, bool),
    ) -> LoadResult<AttentionProjections> {
        let (h, hd) = (d.hidden_size, d.head_dim());
        let (qd, kvd) = (d.num_attention_heads * hd, d.kv_heads() * hd);
        let proj = |w: &mut Weights, name: &str, i: i32, o: i32, bias: bool| {
            Linear::load(w, q, &format!("{path}.{name}"), i, o, bias)
        };
        Ok(AttentionProjections {
            q_proj: proj(w, "q_proj", h, q_factor * qd, qkv_bias)?,
            k_proj: proj(w, "k_proj", h, kvd, qkv_bias)?,
            v_proj: proj(w, "v_proj", h, kvd, qkv_bias)?,
            o_proj: proj(w, "o_proj", qd, h, o_bias)?,
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
    /// The attention of every row over `x` (1, T, H): projections and q/k norms once over all
    /// rows, then [`attend_rows`].
    pub fn forward(&self, x: &Array, masks: &[Mask], rows: &mut LayerRows) -> crate::Result<Array> {
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
        let out = attend_rows(&self.rope, self.scale, &q, &k, &v, masks, rows)?;
        Ok(p.o_proj
            .forward(&out.transpose(&[0, 2, 1, 3])?.reshape(&[b, l, -1])?)?)
    }
}

/// Every row's queries over its own cache: `q`, `k`, `v` (1, heads, T, head_dim) after any
/// norms, the rows' tokens along axis 2. RoPE at each row's cache offset, the row's cache
/// update and its attention with its mask (`masks[r]`), row by row; a step of one token per row
/// makes the rows the batch axis, (B, heads, 1, head_dim), so that one RoPE call rotates them
/// all ([`Rope::forward_at`], each row's own bits). Returns (1, heads, T, head_dim).
pub fn attend_rows(
    rope: &Rope,
    scale: f32,
    q: &Array,
    k: &Array,
    v: &Array,
    masks: &[Mask],
    rows: &mut LayerRows,
) -> crate::Result<Array> {
    let lens = rows.lens();
    if let [LayerCache::Batch(cache)] = rows.caches.as_mut_slice() {
        return attend_batch(rope, scale, q, k, v, cache, lens);
    }
    let mut outs = Vec::with_capacity(masks.len());
    if rows.one_token_each() {
        let per_row = |y: &Array| y.transpose(&[2, 1, 0, 3]);
        let offsets: Vec<i32> = rows.caches.iter().map(|c| c.offset() as i32).collect();
        let offsets = Array::from_slice(&offsets, &[offsets.len() as i32])?;
        let q = rope.forward_at(&per_row(q)?, &offsets)?;
        let k = rope.forward_at(&per_row(k)?, &offsets)?;
        let v = per_row(v)?;
        for (r, cache) in rows.caches.iter_mut().enumerate() {
            let row = |y: &Array| y.slice_axis(0, r as i32, r as i32 + 1);
            let kv = cache.update_and_fetch(&row(&k)?, &row(&v)?)?;
            outs.push(attend(&row(&q)?, &kv, scale, &masks[r])?);
        }
        let out = ops::concatenate(&outs.iter().collect::<Vec<_>>(), 0)?;
        return Ok(per_row(&out)?);
    }
    let (q, k, v) = (rows.split(q, 2)?, rows.split(k, 2)?, rows.split(v, 2)?);
    for (r, cache) in rows.caches.iter_mut().enumerate() {
        let offset = cache.offset();
        let q = rope.forward(&q[r], offset)?;
        let k = rope.forward(&k[r], offset)?;
        let kv = rows::update_row(cache, &k, &v[r])?;
        let plain = matches!(**cache, LayerCache::Kv(_));
        outs.push(attend_row(&q, &kv, scale, &masks[r], plain)?);
    }
    rows.join(outs, 2)
}

/// A batch step over one [`BatchKvCache`], row r taking `lens[r]` tokens ((1, heads, T,
/// head_dim), the rows' tokens in turn): RoPE at each token's position, one write for every
/// token, and one attention call where CUDA gives every query its one-token step's bits in one
/// ([`rows_kernel::one_call`]); else each row's call (or calls) over its own keys, what its lone
/// step or verify makes ([`attend_row`]).
fn attend_batch(
    rope: &Rope,
    scale: f32,
    q: &Array,
    k: &Array,
    v: &Array,
    cache: &mut BatchKvCache,
    lens: &[usize],
) -> crate::Result<Array> {
    let per_query = |y: &Array| y.transpose(&[2, 1, 0, 3]);
    let layout = cache.step_layout(lens)?;
    let q = rope.forward_at(&per_query(q)?, &layout.positions)?;
    let k = rope.forward_at(&per_query(k)?, &layout.positions)?;
    let kv = cache.append(&k, &per_query(v)?, &layout)?;
    let out = if let Some(call) = rows_kernel::one_call(&q, scale, &kv) {
        fast::rows_attention(
            &q,
            &kv.keys,
            &kv.values,
            &kv.slots,
            &kv.extents,
            call.scales_log2,
            call.two_pass,
        )?
    } else {
        let mut start = 0;
        let mut outs = Vec::with_capacity(lens.len());
        for (r, &n) in lens.iter().enumerate().filter(|(_, &n)| n > 0) {
            let (keys, values) = kv.row(r)?;
            let end = start + n as i32;
            let q = per_query(&q.slice_axis(0, start, end)?)?;
            let offset = kv.row_extents[r] - n;
            let mask = attention_mask(n, offset, None)?;
            let out = attend_row(&q, &KeysValues::Dense { keys, values }, scale, &mask, true)?;
            outs.push(per_query(&out)?);
            start = end;
        }
        ops::concatenate(&outs.iter().collect::<Vec<_>>(), 0)?
    };
    Ok(per_query(&out)?)
}

/// One row's attention over the keys and values its cache returned: [`attend`], or, on the
/// lone-row path over a plain KV cache (`plain_kv`) with a causal mask, each query over its own
/// key extent ([`attend_each_query`]).
pub fn attend_row(
    q: &Array,
    kv: &KeysValues,
    scale: f32,
    mask: &Mask,
    plain_kv: bool,
) -> crate::Result<Array> {
    let each_query = lone_rows::active() && plain_kv && matches!(mask, Mask::Causal);
    match kv {
        KeysValues::Dense { keys, values } if each_query => {
            Ok(attend_each_query(q, keys, values, scale)?)
        }
        _ => attend(q, kv, scale, mask),
    }
}

/// Causal attention of `q`'s L queries (1, heads, L, head_dim), the last L of the keys, each
/// over the keys up to its own position with the bits of the call a one-token step makes at that
/// position ([`lone_rows`]): on CUDA all in one call of the rows kernels where they repeat that
/// call ([`rows_kernel::each_query`]), else one call per query.
fn attend_each_query(q: &Array, keys: &Array, values: &Array, scale: f32) -> Result<Array> {
    if let Some(out) = rows_kernel::each_query(q, keys, values, scale)? {
        return Ok(out);
    }
    let (l, key_len) = (q.dim(2), keys.dim(2));
    let steps = (0..l)
        .map(|i| {
            let extent = key_len - (l - 1 - i);
            Ok((
                keys.slice_axis(2, 0, extent)?,
                values.slice_axis(2, 0, extent)?,
            ))
        })
        .collect::<Result<Vec<_>>>()?;
    let masks: Vec<Mask> = (0..l).map(|_| Mask::None).collect();
    query_by_query(q, &steps, &masks, scale)
}

/// One attention call over dense keys: MLX's fused call, or for a query of a head size MLX
/// attends unfused, the rows kernels' call that a batch makes for it too ([`rows_kernel::alone`]).
fn one_call(q: &Array, keys: &Array, values: &Array, scale: f32, mask: &Mask) -> Result<Array> {
    match rows_kernel::alone(q, keys, values, scale, mask)? {
        Some(out) => Ok(out),
        None => fast::scaled_dot_product_attention(q, keys, values, scale, mask.as_sdpa()?, None),
    }
}

/// Query t of `q` (1, heads, T, head_dim) over `steps[t]`'s keys and values with `masks[t]`,
/// one attention call each, joined on the query axis.
fn query_by_query(
    q: &Array,
    steps: &[(Array, Array)],
    masks: &[Mask],
    scale: f32,
) -> Result<Array> {
    let outs = steps
        .iter()
        .zip(masks)
        .enumerate()
        .map(|(t, ((keys, values), mask))| {
            let t = t as i32;
            one_call(&q.slice_axis(2, t, t + 1)?, keys, values, scale, mask)
        })
        .collect::<Result<Vec<_>>>()?;
    ops::concatenate(&outs.iter().collect::<Vec<_>>(), 2)
}

/// mlx-lm's scaled_dot_product_attention: the fused kernel for dense caches (a long chunk's
/// rows in blocks on a reference-BLAS CPU, same bits: [`row_blocks`]; on CUDA a head_dim-32
/// query of verity's own decoding through the rows kernels, [`one_call`]), the
/// quantized-matmul formulation for quantized ones, and for one-token steps' keys
/// ([`KeysValues::Steps`]) each query as its step attends. A backend without a quantized-matmul
/// kernel for the cache's shape (mlx-cuda for the fixtures' group size 32) fails naming the
/// cache's settings.
pub fn attend(q: &Array, kv: &KeysValues, scale: f32, mask: &Mask) -> crate::Result<Array> {
    match kv {
        KeysValues::Dense { keys, values } => Ok(match row_blocks::rows_per_block(q) {
            Some(block) => row_blocks::attend_in_row_blocks(q, keys, values, scale, mask, block)?,
            None => one_call(q, keys, values, scale, mask)?,
        }),
        KeysValues::Steps(steps) => attend_steps(q, steps, scale, mask),
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

/// Query t of `q` (1, heads, T, head_dim) over what one-token step t read, with that step's
/// mask: T calls, each the one its step makes.
fn attend_steps(
    q: &Array,
    steps: &[(Array, Array)],
    scale: f32,
    mask: &Mask,
) -> crate::Result<Array> {
    let masks = match mask {
        Mask::Steps(masks) if masks.len() == steps.len() && q.dim(2) == steps.len() as i32 => masks,
        _ => {
            return Err(crate::error::contract(format!(
                "{} queries over the keys of {} one-token steps without a mask for each",
                q.dim(2),
                steps.len()
            )))
        }
    };
    Ok(query_by_query(q, steps, masks, scale)?)
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
        Mask::Steps(_) => {
            return Err(mlx::Error::Invalid(
                "one-token steps' masks given to a quantized KV cache's attention".into(),
            ))
        }
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
pub fn finfo_min(dtype: Dtype) -> f32 {
    match dtype {
        Dtype::Float16 => -65504.0,
        Dtype::Bfloat16 => f32::from_bits(0xff7f_0000),
        _ => f32::MIN,
    }
}
