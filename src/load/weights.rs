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
        let mut sources: BTreeMap<String, &PathBuf> = BTreeMap::new();
        let mut mlx_saved = BTreeSet::new();
        for file in &files {
            let loaded = mlx::io::load_safetensors(file).map_err(LoadError::Weights)?;
            // A NaN or an infinity would reach every logit: the run would end at once as "stop"
            // with empty text. Checked from the bytes, before MLX reads them.
            if let Some(key) = mlx::io::non_finite_tensor(file).map_err(LoadError::Weights)? {
                return Err(LoadError::BadTensor {
                    path: file.clone(),
                    key,
                    problem: "holds NaN or infinite values; every weight must be finite".into(),
                });
            }
            // Read everything now, as mlx-lm does unless lazy, so I/O errors surface at load.
            let arrays: Vec<&Array> = loaded.tensors.values().collect();
            mlx::eval(arrays).map_err(|e| LoadError::BadSafetensors {
                path: file.clone(),
                message: e.to_string(),
            })?;
            if loaded.metadata.get("format").map(String::as_str) == Some("mlx") {
                mlx_saved.extend(loaded.tensors.keys().cloned());
            }
            for (key, a) in loaded.tensors {
                if let Some(first) = sources.insert(key.clone(), file) {
                    return Err(LoadError::BadTensor {
                        path: file.clone(),
                        key,
                        problem: format!(
                            "is also in {}: no two weight files may hold the same tensor",
                            first.display()
                        ),
                    });
                }
                tensors.insert(key, a);
            }
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

    /// Adds a tensor a sanitize step built (e.g. per-expert weights stacked into one).
    pub fn insert(&mut self, key: String, a: Array) {
        self.tensors.insert(key, a);
    }

    /// Takes the tensors `keys` and adds them stacked along a new first axis as `into`: a
    /// sanitize step's per-expert tensors stacked into a SwitchGLU's, experts in order.
    pub fn stack(
        &mut self,
        keys: impl IntoIterator<Item = String>,
        into: String,
    ) -> Result<(), LoadError> {
        let parts = keys
            .into_iter()
            .map(|k| self.take(&k))
            .collect::<Result<Vec<_>, _>>()?;
        let stacked = mlx::ops::stack(&parts.iter().collect::<Vec<_>>(), 0).map_err(|source| {
            LoadError::Mlx {
                folder: self.folder.clone(),
                source,
            }
        })?;
        self.tensors.insert(into, stacked);
        Ok(())
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
                allowed: match (packed, a.dtype()) {
                    (true, _) => "uint32 (a quantized weight: it has .scales)",
                    (false, Uint32) => {
                        "float16, bfloat16 or float32 (a uint32 weight is packed by quantization \
                         and needs its .scales beside it, which is missing)"
                    }
                    (false, _) => "float16, bfloat16 or float32",
                },
            });
        }
    }
    Ok(())
}
