//! Prompt cache files in mlx-lm's `save_prompt_cache` format (models/cache.py), so a cache
//! written by mlx-lm loads here and one written here loads in mlx-lm.
//!
//! One safetensors file. Tensors are `tree_flatten([c.state for c in cache])`: layer i's state
//! entries as "i.0", "i.1", ... (nested tuples as "i.0.0"). Ints become 0-d arrays and None an
//! empty array, both listed in the metadata. Metadata is `tree_flatten([user, classes,
//! scalars])`: "0.<key>" user entries, "1.<i>" the class name of layer i, "2.0" = "" and
//! "2.<n>.0" / "2.<n>.1" the (tensor key, "scalar" | "none" | "string") pairs.

use std::collections::BTreeMap;
use std::path::Path;

use mlx::{Array, Dtype};

use super::{
    KvCache, LayerCache, Packed3, QuantizedKvCache, RecurrentCache, RecurrentState, RotatingKvCache,
};
use crate::error::PromptFileError;

/// One state entry of a layer, in the order mlx-lm's `state` property lists them.
enum Entry {
    Array(Array),
    Triple(Packed3),
    Int(i64),
    None,
}

fn class_name(c: &LayerCache) -> &'static str {
    match c {
        LayerCache::Kv(_) => "KVCache",
        LayerCache::Rotating(_) => "RotatingKVCache",
        LayerCache::QuantizedKv(_) => "QuantizedKVCache",
        LayerCache::Recurrent(_) => "ArraysCache",
        LayerCache::Batch(_) => "BatchKVCache",
        LayerCache::RecurrentRows(_) => "ArraysCache",
    }
}

/// A pair of buffers as two entries (None, None when the cache is still empty).
fn pair<T: Clone>(kv: &Option<(T, T)>, entry: fn(T) -> Entry) -> [Entry; 2] {
    match kv {
        Some((k, v)) => [entry(k.clone()), entry(v.clone())],
        None => [Entry::None, Entry::None],
    }
}

/// A layer's `state` as mlx-lm would return it. ArraysCache's state is
/// `[[conv, recurrent], left_padding, lengths]`, flattened here into keys "0.0", "0.1", 1, 2.
fn state(c: &LayerCache) -> Vec<(String, Entry)> {
    // The buffers, then the integer fields, keyed "0", "1", ... in the order of `state`.
    let entries = |[k, v]: [Entry; 2], ints: &[usize]| {
        [k, v]
            .into_iter()
            .chain(ints.iter().map(|&i| Entry::Int(i as i64)))
            .enumerate()
            .map(|(i, e)| (i.to_string(), e))
            .collect()
    };
    match c {
        LayerCache::Kv(c) => entries(pair(&c.kv, Entry::Array), &[c.offset]),
        LayerCache::Rotating(c) => entries(
            pair(&c.kv, Entry::Array),
            &[c.offset, c.keep, c.max_size, c.idx],
        ),
        LayerCache::QuantizedKv(c) => entries(
            pair(&c.kv, Entry::Triple),
            &[c.offset, c.group_size as usize, c.bits as usize],
        ),
        LayerCache::Recurrent(c) => {
            let [conv, state] = match c.current() {
                Some(s) => [Entry::Array(s.conv.clone()), Entry::Array(s.state.clone())],
                None => [Entry::None, Entry::None],
            };
            vec![
                ("0.0".into(), conv),
                ("0.1".into(), state),
                ("1".into(), Entry::None),
                ("2".into(), Entry::None),
            ]
        }
        // Refused by save_prompt_cache before any state is read.
        LayerCache::Batch(_) | LayerCache::RecurrentRows(_) => Vec::new(),
    }
}

/// Writes `caches` (one per layer) and `metadata` in mlx-lm's format.
pub fn save_prompt_cache(
    path: &Path,
    caches: &[LayerCache],
    metadata: &BTreeMap<String, String>,
) -> Result<(), PromptFileError> {
    let p = path.display().to_string();
    let mlx_err = |source| PromptFileError::Mlx {
        path: p.clone(),
        source,
    };
    let mut tensors = BTreeMap::new();
    let mut meta: BTreeMap<String, String> = metadata
        .iter()
        .map(|(k, v)| (format!("0.{k}"), v.clone()))
        .collect();
    meta.insert("2.0".into(), String::new());
    let mut scalars = 0;
    let mut tag = |meta: &mut BTreeMap<String, String>, key: &str, kind: &str| {
        scalars += 1;
        meta.insert(format!("2.{scalars}.0"), key.to_string());
        meta.insert(format!("2.{scalars}.1"), kind.to_string());
    };
    if (caches.iter()).any(|c| matches!(c, LayerCache::Batch(_) | LayerCache::RecurrentRows(_))) {
        return Err(PromptFileError::Format {
            path: p,
            message: "a batch cache holds several sequences; save each row's own caches".into(),
        });
    }
    for (i, c) in caches.iter().enumerate() {
        meta.insert(format!("1.{i}"), class_name(c).into());
        for (sub, entry) in state(c) {
            let key = format!("{i}.{sub}");
            match entry {
                Entry::Array(a) => {
                    tensors.insert(key, a);
                }
                Entry::Triple(t) => {
                    for (j, a) in t.into_iter().enumerate() {
                        tensors.insert(format!("{key}.{j}"), a);
                    }
                }
                Entry::Int(v) => {
                    tensors.insert(
                        key.clone(),
                        Array::scalar_int(v, Dtype::Int32).map_err(mlx_err)?,
                    );
                    tag(&mut meta, &key, "scalar");
                }
                Entry::None => {
                    tensors.insert(
                        key.clone(),
                        Array::zeros(&[0], Dtype::Float32).map_err(mlx_err)?,
                    );
                    tag(&mut meta, &key, "none");
                }
            }
        }
    }
    // MLX insists on the extension, so the temporary file gets it too.
    verity_harness::atomic::write_with(path, ".safetensors", |tmp| {
        mlx::io::save_safetensors(tmp, &tensors, &meta).map_err(std::io::Error::other)
    })
    .map_err(|source| PromptFileError::Io { path: p, source })
}

/// The tensors of a prompt cache file, taken by key.
struct Reader {
    path: String,
    tensors: BTreeMap<String, Array>,
    /// Tensor key -> "scalar" | "none" | "string" for converted non-array state entries.
    kinds: BTreeMap<String, String>,
}

impl Reader {
    fn bad(&self, message: String) -> PromptFileError {
        PromptFileError::Format {
            path: self.path.clone(),
            message,
        }
    }

    /// An array entry, or None where mlx-lm stored None.
    fn array(&mut self, key: &str) -> Result<Option<Array>, PromptFileError> {
        let a = self
            .tensors
            .remove(key)
            .ok_or_else(|| self.bad(format!("missing tensor {key}")))?;
        match self.kinds.get(key).map(String::as_str) {
            Some("none") => Ok(None),
            Some(other) => Err(self.bad(format!("tensor {key} is a {other}, expected an array"))),
            None => Ok(Some(a)),
        }
    }

    /// A (packed, scales, biases) triple stored as "<key>.0" .. "<key>.2", or None.
    fn triple(&mut self, key: &str) -> Result<Option<Packed3>, PromptFileError> {
        if self.kinds.get(key).map(String::as_str) == Some("none") {
            return self.array(key).map(|_| None);
        }
        let parts = [
            self.array(&format!("{key}.0"))?,
            self.array(&format!("{key}.1"))?,
            self.array(&format!("{key}.2"))?,
        ];
        match parts {
            [Some(w), Some(s), Some(b)] => Ok(Some([w, s, b])),
            _ => Err(self.bad(format!("{key}: incomplete quantized triple"))),
        }
    }

    /// Two entries that are both present or both None (a cache's keys and values).
    fn both<T>(
        &self,
        layer: usize,
        a: Option<T>,
        b: Option<T>,
    ) -> Result<Option<(T, T)>, PromptFileError> {
        match (a, b) {
            (Some(a), Some(b)) => Ok(Some((a, b))),
            (None, None) => Ok(None),
            _ => Err(self.bad(format!(
                "layer {layer}: one of its two state tensors is missing"
            ))),
        }
    }

    /// A non-negative integer scalar entry.
    fn int(&mut self, key: &str) -> Result<usize, PromptFileError> {
        if self.kinds.get(key).map(String::as_str) != Some("scalar") {
            return Err(self.bad(format!("{key} should be an integer scalar")));
        }
        let a = self
            .tensors
            .remove(key)
            .ok_or_else(|| self.bad(format!("missing tensor {key}")))?;
        let v = a
            .astype(Dtype::Int64)
            .and_then(|a| a.item::<i64>())
            .map_err(|e| self.bad(format!("{key}: {e}")))?;
        usize::try_from(v).map_err(|_| self.bad(format!("{key} is negative")))
    }
}

/// Reads a prompt cache written by mlx-lm (or by [`save_prompt_cache`]): the per-layer caches
/// and the user metadata.
pub fn load_prompt_cache(
    path: &Path,
) -> Result<(Vec<LayerCache>, BTreeMap<String, String>), PromptFileError> {
    let p = path.display().to_string();
    let file = mlx::io::load_safetensors(path).map_err(PromptFileError::Unreadable)?;
    let meta = file.metadata;
    let user = meta
        .iter()
        .filter_map(|(k, v)| k.strip_prefix("0.").map(|k| (k.to_string(), v.clone())))
        .collect();
    let mut r = Reader {
        path: p,
        tensors: file.tensors,
        kinds: BTreeMap::new(),
    };
    for (k, v) in &meta {
        if let Some(n) = k
            .strip_prefix("2.")
            .and_then(|rest| rest.strip_suffix(".0"))
        {
            let kind = meta
                .get(&format!("2.{n}.1"))
                .ok_or_else(|| r.bad(format!("scalar entry {n} has no type")))?;
            r.kinds.insert(v.clone(), kind.clone());
        }
    }
    let mut caches = Vec::new();
    for i in 0.. {
        let Some(class) = meta.get(&format!("1.{i}")) else {
            break;
        };
        let cache = match class.as_str() {
            "KVCache" => {
                let (k, v) = (r.array(&format!("{i}.0"))?, r.array(&format!("{i}.1"))?);
                LayerCache::Kv(KvCache {
                    kv: r.both(i, k, v)?,
                    offset: r.int(&format!("{i}.2"))?,
                    round_start: None,
                })
            }
            "RotatingKVCache" => {
                let mut c =
                    RotatingKvCache::new(r.int(&format!("{i}.4"))?, r.int(&format!("{i}.3"))?);
                let (k, v) = (r.array(&format!("{i}.0"))?, r.array(&format!("{i}.1"))?);
                c.kv = r.both(i, k, v)?;
                c.offset = r.int(&format!("{i}.2"))?;
                c.idx = r.int(&format!("{i}.5"))?;
                LayerCache::Rotating(c)
            }
            "QuantizedKVCache" => {
                let mut c = QuantizedKvCache::new(
                    r.int(&format!("{i}.3"))? as i32,
                    r.int(&format!("{i}.4"))? as i32,
                );
                let (k, v) = (r.triple(&format!("{i}.0"))?, r.triple(&format!("{i}.1"))?);
                c.kv = r.both(i, k, v)?;
                c.offset = r.int(&format!("{i}.2"))?;
                LayerCache::QuantizedKv(c)
            }
            "ArraysCache" => {
                let conv = r.array(&format!("{i}.0.0"))?;
                let state = r.array(&format!("{i}.0.1"))?;
                for sub in [1, 2] {
                    if r.array(&format!("{i}.{sub}"))?.is_some() {
                        return Err(r.bad(format!(
                            "layer {i}: a batched ArraysCache (with padding) is not supported"
                        )));
                    }
                }
                let state = r
                    .both(i, conv, state)?
                    .map(|(conv, state)| RecurrentState { conv, state });
                LayerCache::Recurrent(RecurrentCache::from_state(state))
            }
            other => return Err(r.bad(format!("layer {i}: cache class {other} is not supported"))),
        };
        caches.push(cache);
    }
    if caches.is_empty() {
        return Err(r.bad("no cache layers (not an mlx-lm prompt cache file)".into()));
    }
    Ok((caches, user))
}
