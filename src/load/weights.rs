//! The tensors of a model folder, consumed by name as the model is built so that a missing,
//! mis-shaped or unused tensor is an error naming it (mlx-lm loads with strict=True).

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

use mlx::Array;

use super::LoadError;

pub struct Weights {
    folder: PathBuf,
    tensors: BTreeMap<String, Array>,
    /// Names (as loaded) of the tensors from files whose metadata says `"format": "mlx"`: some
    /// sanitize steps trust that tag to mean "already converted" (mlx-vlm's MTP splitter).
    mlx_saved: BTreeSet<String>,
}

impl Weights {
    /// Loads every `model*.safetensors` in `dir` (mlx-lm's glob; the index json is not needed).
    pub fn load(dir: &Path) -> Result<Weights, LoadError> {
        let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
            .map_err(|_| LoadError::MissingFolder(dir.to_path_buf()))?
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| {
                let name = p.file_name().and_then(|n| n.to_str()).unwrap_or("");
                name.starts_with("model") && name.ends_with(".safetensors")
            })
            .collect();
        files.sort();
        if files.is_empty() {
            return Err(LoadError::NoWeights(dir.to_path_buf()));
        }
        let mut tensors = BTreeMap::new();
        let mut mlx_saved = BTreeSet::new();
        for file in &files {
            check_safetensors(file)?;
            let loaded =
                mlx::io::load_safetensors(file).map_err(|e| LoadError::BadSafetensors {
                    path: file.clone(),
                    message: e.to_string(),
                })?;
            // Read everything now, as mlx-lm does unless lazy, so I/O errors surface at load.
            let arrays: Vec<&Array> = loaded.tensors.values().collect();
            mlx::eval(arrays).map_err(|e| LoadError::BadSafetensors {
                path: file.clone(),
                message: e.to_string(),
            })?;
            if loaded.metadata.get("format").map(String::as_str) == Some("mlx") {
                mlx_saved.extend(loaded.tensors.keys().cloned());
            }
            tensors.extend(loaded.tensors);
        }
        check_dtypes(dir, &tensors)?;
        Ok(Weights {
            folder: dir.to_path_buf(),
            tensors,
            mlx_saved,
        })
    }

    /// Whether the tensor named `key` when loaded came from a file tagged `"format": "mlx"`.
    pub fn saved_by_mlx(&self, key: &str) -> bool {
        self.mlx_saved.contains(key)
    }

    pub fn folder(&self) -> &Path {
        &self.folder
    }

    pub fn contains(&self, key: &str) -> bool {
        self.tensors.contains_key(key)
    }

    pub fn peek(&self, key: &str) -> Option<&Array> {
        self.tensors.get(key)
    }

    pub fn keys(&self) -> impl Iterator<Item = &String> {
        self.tensors.keys()
    }

    /// Removes and returns a tensor.
    pub fn take(&mut self, key: &str) -> Result<Array, LoadError> {
        self.tensors.remove(key).ok_or_else(|| self.missing(key))
    }

    /// Removes a tensor and checks its shape.
    pub fn take_shaped(&mut self, key: &str, shape: &[i32]) -> Result<Array, LoadError> {
        let a = self.take(key)?;
        let found = a.shape();
        if found != shape {
            return Err(LoadError::TensorShape {
                folder: self.folder.clone(),
                key: key.into(),
                expected: shape.to_vec(),
                found,
            });
        }
        Ok(a)
    }

    /// Removes a tensor if present.
    pub fn take_optional(&mut self, key: &str) -> Option<Array> {
        self.tensors.remove(key)
    }

    /// Renames every tensor with `f`, dropping those it maps to None (sanitize steps).
    pub fn rename(&mut self, f: impl Fn(&str) -> Option<String>) {
        let old = std::mem::take(&mut self.tensors);
        self.tensors = old
            .into_iter()
            .filter_map(|(k, v)| f(&k).map(|k| (k, v)))
            .collect();
    }

    /// Replaces every tensor with `f(name, tensor)` (sanitize steps that transform values).
    pub fn map(&mut self, f: impl Fn(&str, Array) -> mlx::Result<Array>) -> Result<(), LoadError> {
        let old = std::mem::take(&mut self.tensors);
        for (k, v) in old {
            let v = f(&k, v).map_err(|source| LoadError::Mlx {
                folder: self.folder.clone(),
                source,
            })?;
            self.tensors.insert(k, v);
        }
        Ok(())
    }

    /// Drops every tensor whose name satisfies `pred` (sanitize steps).
    pub fn drop_where(&mut self, pred: impl Fn(&str) -> bool) {
        self.tensors.retain(|k, _| !pred(k));
    }

    /// Fails if any tensor was not consumed.
    pub fn finish(self) -> Result<(), LoadError> {
        if self.tensors.is_empty() {
            return Ok(());
        }
        let mut keys: Vec<&str> = self.tensors.keys().map(String::as_str).collect();
        let more = keys.len().saturating_sub(8);
        keys.truncate(8);
        let mut list = keys.join(", ");
        if more > 0 {
            list.push_str(&format!(" and {more} more"));
        }
        Err(LoadError::UnexpectedTensors {
            folder: self.folder,
            keys: list,
        })
    }

    pub fn missing(&self, key: &str) -> LoadError {
        LoadError::MissingTensor {
            folder: self.folder.clone(),
            key: key.into(),
        }
    }

    pub fn config_error(&self, message: String) -> LoadError {
        LoadError::BadConfig {
            path: self.folder.join("config.json"),
            message,
        }
    }
}

/// Every tensor holds floats, except the packed uint32 weights of a quantized layer (those with
/// `.scales` beside them): an integer tensor where the model computes with floats would be
/// reinterpreted, not converted.
fn check_dtypes(dir: &Path, tensors: &BTreeMap<String, Array>) -> Result<(), LoadError> {
    use mlx::Dtype::{Bfloat16, Float16, Float32, Uint32};
    for (key, a) in tensors {
        let packed = key
            .strip_suffix(".weight")
            .is_some_and(|stem| tensors.contains_key(&format!("{stem}.scales")));
        let ok = match a.dtype() {
            Float16 | Bfloat16 | Float32 => !packed,
            Uint32 => packed,
            _ => false,
        };
        if !ok {
            return Err(LoadError::TensorDtype {
                folder: dir.to_path_buf(),
                key: key.clone(),
                dtype: format!("{:?}", a.dtype()),
                allowed: if packed {
                    "uint32 (a quantized weight: it has .scales)"
                } else {
                    "float16, bfloat16 or float32"
                },
            });
        }
    }
    Ok(())
}

/// Validates a safetensors file's header against its size before MLX maps it, so a truncated
/// or corrupt file fails at load with a clear message instead of at first use.
fn check_safetensors(path: &Path) -> Result<(), LoadError> {
    use std::io::Read;
    let bad = |message: String| LoadError::BadSafetensors {
        path: path.to_path_buf(),
        message,
    };
    let mut file = std::fs::File::open(path).map_err(|e| bad(e.to_string()))?;
    let size = file.metadata().map_err(|e| bad(e.to_string()))?.len();
    let mut len = [0u8; 8];
    file.read_exact(&mut len)
        .map_err(|_| bad("shorter than its 8-byte header length".into()))?;
    let header_len = u64::from_le_bytes(len);
    if header_len > size.saturating_sub(8) {
        return Err(bad(format!(
            "header length {header_len} exceeds the file size {size}"
        )));
    }
    let mut header = vec![0u8; header_len as usize];
    file.read_exact(&mut header)
        .map_err(|e| bad(e.to_string()))?;
    let header: serde_json::Map<String, serde_json::Value> = serde_json::from_slice(&header)
        .map_err(|e| bad(format!("header is not a JSON object: {e}")))?;
    let data_len = size - 8 - header_len;
    for (name, info) in &header {
        if name == "__metadata__" {
            continue;
        }
        let end = info
            .get("data_offsets")
            .and_then(|o| o.get(1))
            .and_then(serde_json::Value::as_u64)
            .ok_or_else(|| bad(format!("tensor {name} has no data_offsets")))?;
        let dtype = info
            .get("dtype")
            .and_then(serde_json::Value::as_str)
            .unwrap_or("");
        let width = match dtype {
            "BOOL" | "U8" | "I8" => 1,
            "F16" | "BF16" | "U16" | "I16" => 2,
            "F32" | "U32" | "I32" => 4,
            "F64" | "U64" | "I64" => 8,
            other => return Err(bad(format!("tensor {name} has unknown dtype {other:?}"))),
        };
        let elements = info
            .get("shape")
            .and_then(serde_json::Value::as_array)
            .and_then(|s| {
                s.iter()
                    .map(serde_json::Value::as_u64)
                    .product::<Option<u64>>()
            })
            .ok_or_else(|| bad(format!("tensor {name} has no valid shape")))?;
        let start = info
            .get("data_offsets")
            .and_then(|o| o.get(0))
            .and_then(serde_json::Value::as_u64)
            .unwrap_or(u64::MAX);
        if end < start || end - start != elements.saturating_mul(width) {
            return Err(bad(format!(
                "tensor {name}: {dtype} x {elements} elements needs {} bytes, its data_offsets span {}",
                elements.saturating_mul(width),
                end.saturating_sub(start)
            )));
        }
        if end > data_len {
            return Err(bad(format!(
                "tensor {name} ends at byte {end} of the data section, which holds {data_len} (truncated?)"
            )));
        }
    }
    Ok(())
}
