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

/// `mx.save_safetensors(path, tensors, metadata)`, written exactly at `path` and atomically:
/// into a temporary file in the same folder (created here first, so a folder that cannot be
/// written fails with the OS's reason), then renamed over `path`. MLX itself would append
/// ".safetensors" to any other name and write in place, leaving a truncated file if killed.
pub fn save_safetensors(
    path: &Path,
    tensors: &BTreeMap<String, Array>,
    metadata: &BTreeMap<String, String>,
) -> Result<()> {
    let fail = Error::Invalid;
    if path.is_dir() {
        return Err(fail("is a directory".into()));
    }
    let name = path
        .file_name()
        .and_then(|n| n.to_str())
        .ok_or_else(|| fail("not a UTF-8 file name".into()))?;
    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d,
        _ => Path::new("."),
    };
    let tmp = dir.join(format!(".{name}.{}.tmp.safetensors", std::process::id()));
    std::fs::File::create(&tmp)
        .map_err(|e| fail(format!("cannot write in {}: {e}", dir.display())))?;
    let tmp_str = tmp
        .to_str()
        .ok_or_else(|| fail("path is not UTF-8".into()))?;
    let names: Vec<String> = tensors.keys().cloned().collect();
    let list = List::new(tensors.values());
    let keys: Vec<String> = metadata.keys().cloned().collect();
    let values: Vec<String> = metadata.values().cloned().collect();
    let written = ffi::save_safetensors(tmp_str, &names, &list.raw, &keys, &values)
        .map_err(Error::from)
        .and_then(|()| std::fs::rename(&tmp, path).map_err(|e| fail(e.to_string())));
    if written.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    written
}
