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
/// Every error names the file.
pub fn load_safetensors(path: &Path) -> Result<Safetensors> {
    let path_str = path
        .to_str()
        .ok_or_else(|| Error::Invalid(format!("{}: path is not UTF-8", path.display())))?;
    check_header(path).map_err(|e| Error::Invalid(format!("{}: {e}", path.display())))?;
    let (mut names, mut keys, mut values) = (Vec::new(), Vec::new(), Vec::new());
    let list = ffi::load_safetensors(path_str, &mut names, &mut keys, &mut values)?;
    let arrays = List::from_raw(list).into_vec()?;
    Ok(Safetensors {
        tensors: names.into_iter().zip(arrays).collect(),
        metadata: keys.into_iter().zip(values).collect(),
    })
}

/// `mx.save_safetensors(path, tensors, metadata)`, written in place at `path`, which must end in
/// ".safetensors" (MLX would append it to any other name). Callers that must not leave a
/// truncated file write through a temporary path and rename (verity_harness::atomic).
pub fn save_safetensors(
    path: &Path,
    tensors: &BTreeMap<String, Array>,
    metadata: &BTreeMap<String, String>,
) -> Result<()> {
    let path_str = path
        .to_str()
        .filter(|p| p.ends_with(".safetensors"))
        .ok_or_else(|| {
            Error::Invalid(format!(
                "{}: not a UTF-8 path ending in .safetensors",
                path.display()
            ))
        })?;
    let names: Vec<String> = tensors.keys().cloned().collect();
    let list = List::new(tensors.values());
    let keys: Vec<String> = metadata.keys().cloned().collect();
    let values: Vec<String> = metadata.values().cloned().collect();
    ffi::save_safetensors(path_str, &names, &list.raw, &keys, &values).map_err(Error::from)
}

/// Validates a safetensors file's header against its size before MLX maps it (MLX checks no
/// offsets), so a truncated, corrupt or crafted file fails at load with a message naming the
/// tensor instead of reading past the file at first use.
fn check_header(path: &Path) -> Result<()> {
    use std::io::Read;
    let unreadable = |e: std::io::Error| Error::Invalid(format!("cannot read it: {e}"));
    let bad = |m: String| Error::Invalid(format!("not a valid safetensors file: {m}"));
    let mut file = std::fs::File::open(path).map_err(unreadable)?;
    let meta = file.metadata().map_err(unreadable)?;
    if !meta.is_file() {
        return Err(Error::Invalid("is not a regular file".into()));
    }
    let size = meta.len();
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
    let mut spans = Vec::new();
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
        if end > start {
            spans.push((start, end, name));
        }
    }
    // Two tensors over the same bytes would alias: a write to one (a cache, an in-place
    // sanitize step) or a crafted file could change the other.
    spans.sort_unstable();
    for pair in spans.windows(2) {
        let ((s0, e0, a), (s1, e1, b)) = (&pair[0], &pair[1]);
        if s1 < e0 {
            return Err(bad(format!(
                "tensors {a} (bytes {s0}..{e0}) and {b} (bytes {s1}..{e1}) overlap in the data section"
            )));
        }
    }
    Ok(())
}
