//! Safetensors through MLX's own loader, the one `mx.load` uses.

use std::collections::BTreeMap;
use std::path::Path;

use crate::array::List;
use crate::ffi::bridge as ffi;
use crate::{Array, Error, Result};

/// Tensors and string metadata of one safetensors file, keyed by name (sorted).
pub struct Safetensors {
    pub tensors: BTreeMap<String, Array>,
    pub metadata: BTreeMap<String, String>,
}

/// `mx.load(path)` for a .safetensors file. Tensors load lazily from the file when evaluated.
pub fn load_safetensors(path: &Path) -> Result<Safetensors> {
    let path_str = path
        .to_str()
        .ok_or_else(|| Error::Invalid(format!("{}: path is not UTF-8", path.display())))?;
    let (mut names, mut keys, mut values) = (Vec::new(), Vec::new(), Vec::new());
    let list = ffi::load_safetensors(path_str, &mut names, &mut keys, &mut values)?;
    let arrays = List::from_raw(list).into_vec()?;
    Ok(Safetensors {
        tensors: names.into_iter().zip(arrays).collect(),
        metadata: keys.into_iter().zip(values).collect(),
    })
}

/// `mx.save_safetensors(path, tensors, metadata)`.
pub fn save_safetensors(
    path: &Path,
    tensors: &BTreeMap<String, Array>,
    metadata: &BTreeMap<String, String>,
) -> Result<()> {
    let path_str = path
        .to_str()
        .ok_or_else(|| Error::Invalid(format!("{}: path is not UTF-8", path.display())))?;
    let names: Vec<String> = tensors.keys().cloned().collect();
    let list = List::new(tensors.values());
    let keys: Vec<String> = metadata.keys().cloned().collect();
    let values: Vec<String> = metadata.values().cloned().collect();
    Ok(ffi::save_safetensors(
        path_str, &names, &list.raw, &keys, &values,
    )?)
}
