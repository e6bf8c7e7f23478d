//! A prompt cache file against the model and the request that will continue from it. A cache
//! written for another model, or with other KV settings, would run without complaint and
//! produce garbage (or index past a buffer), so it is refused before any compute, naming the
//! layer and the mismatch. The expected layout comes from a probe: the model's own fresh
//! caches after one token, whose state shapes are what this model writes.

use mlx::Array;

use crate::cache::LayerCache;
use crate::error::invalid;
use crate::model::LanguageModel;
use crate::request::GenerateParams;
use crate::Result;

/// Checks `caches` (read from `file`) against what `model` builds for `p`: the layer count,
/// each layer's cache kind and settings, its tensors' head and channel dimensions and dtype,
/// and its offsets against its buffers.
pub fn prompt_cache(
    file: &str,
    model: &dyn LanguageModel,
    caches: &[LayerCache],
    p: &GenerateParams,
) -> Result<()> {
    if caches.len() != model.num_caches() {
        return Err(invalid(
            &format!("{file}: the number of cache layers"),
            caches.len(),
            &format!("this model has {} layer caches", model.num_caches()),
        ));
    }
    let mut probe = model.make_cache(p.max_kv_size);
    model.forward(&Array::from_slice(&[0i32], &[1, 1])?, &mut probe, &[])?;
    for (i, (found, fresh)) in caches.iter().zip(&probe).enumerate() {
        layer(found, fresh, p).map_err(|why| {
            crate::Error::Params(format!(
                "{file}: layer {i}: {why} (was the cache written for another model or other \
                 KV settings?)"
            ))
        })?;
    }
    Ok(())
}

/// Why one layer's cache does not fit, if it does not.
fn layer(found: &LayerCache, fresh: &LayerCache, p: &GenerateParams) -> Result<(), String> {
    match (found, fresh) {
        (LayerCache::Kv(f), LayerCache::Kv(e)) => {
            if let (Some((k, _)), Some((ek, _))) = (&f.kv, &e.kv) {
                dense_fits(k, ek)?;
                fits_offset(f.offset, k)?;
            }
            Ok(())
        }
        (LayerCache::QuantizedKv(f), LayerCache::Kv(e)) => {
            if let Some(q) = &p.kv_quantization {
                if (q.bits, q.group_size) != (f.bits, f.group_size) {
                    return Err(format!(
                        "a {}-bit KV cache in groups of {}, the request asks for {} bits in groups of {}",
                        f.bits, f.group_size, q.bits, q.group_size
                    ));
                }
            }
            if let (Some(([packed, scales, _], _)), Some((ek, _))) = (&f.kv, &e.kv) {
                let d = ek.dim(3);
                let want_packed = d * f.bits / 32;
                let want_groups = d / f.group_size.max(1);
                let (s, sc) = (packed.shape(), scales.shape());
                if s.len() != 4 || s[0] != 1 || s[1] != ek.dim(1) || s[3] != want_packed {
                    return Err(format!(
                        "quantized keys of shape {s:?}, this model's would be (1, {}, L, {want_packed})",
                        ek.dim(1)
                    ));
                }
                if sc.len() != 4 || sc[3] != want_groups {
                    return Err(format!(
                        "key scales of shape {sc:?}, expected {want_groups} groups per head"
                    ));
                }
                fits_offset(f.offset, packed)?;
            }
            Ok(())
        }
        (LayerCache::Rotating(f), LayerCache::Rotating(e)) => {
            if (f.max_size, f.keep) != (e.max_size, e.keep) {
                return Err(format!(
                    "a rotating cache of {} tokens keeping {}, this request's holds {} keeping {}",
                    f.max_size, f.keep, e.max_size, e.keep
                ));
            }
            if let (Some((k, _)), Some((ek, _))) = (&f.kv, &e.kv) {
                dense_fits(k, ek)?;
                if k.dim(2) as usize > f.max_size || f.idx > k.dim(2) as usize {
                    return Err(format!(
                        "a ring buffer of {} slots with cursor {} in a cache of {} tokens",
                        k.dim(2),
                        f.idx,
                        f.max_size
                    ));
                }
            }
            Ok(())
        }
        (LayerCache::Recurrent(f), LayerCache::Recurrent(e)) => {
            if let (Some(f), Some(e)) = (f.current(), e.current()) {
                for (name, a, b) in [("conv", &f.conv, &e.conv), ("state", &f.state, &e.state)] {
                    if a.shape() != b.shape() || a.dtype() != b.dtype() {
                        return Err(format!(
                            "recurrent {name} of shape {:?} ({:?}), this model's is {:?} ({:?})",
                            a.shape(),
                            a.dtype(),
                            b.shape(),
                            b.dtype()
                        ));
                    }
                }
            }
            Ok(())
        }
        (found, fresh) => Err(format!(
            "a {} cache, this model and request use a {} cache here",
            kind(found),
            kind(fresh)
        )),
    }
}

fn kind(c: &LayerCache) -> &'static str {
    match c {
        LayerCache::Kv(_) => "plain KV",
        LayerCache::Rotating(_) => "rotating KV (--max-kv-size or a sliding window)",
        LayerCache::QuantizedKv(_) => "quantized KV",
        LayerCache::Recurrent(_) => "recurrent (gated-DeltaNet)",
        LayerCache::Batch(_) => "batch KV",
        LayerCache::RecurrentRows(_) => "batch recurrent",
    }
}

/// Keys (1, H, L, D) with this model's H, D and dtype.
fn dense_fits(keys: &Array, expected: &Array) -> Result<(), String> {
    let (s, e) = (keys.shape(), expected.shape());
    if s.len() != 4 || s[0] != 1 || s[1] != e[1] || s[3] != e[3] || keys.dtype() != expected.dtype()
    {
        return Err(format!(
            "keys of shape {s:?} ({:?}), this model's are (1, {}, L, {}) ({:?})",
            keys.dtype(),
            e[1],
            e[3],
            expected.dtype()
        ));
    }
    Ok(())
}

/// An offset within the buffer it indexes.
fn fits_offset(offset: usize, buffer: &Array) -> Result<(), String> {
    let len = buffer.dim(2) as usize;
    if offset > len {
        return Err(format!("offset {offset} past its buffer of {len} tokens"));
    }
    Ok(())
}
