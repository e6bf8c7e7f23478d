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
    header(path).map_err(|e| Error::Invalid(format!("{}: {e}", path.display())))?;
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

/// One tensor's place in a safetensors file.
pub struct TensorSpan {
    pub name: String,
    /// The safetensors dtype name ("BF16", "F32", ...).
    pub dtype: String,
    /// Absolute byte offsets in the file.
    pub start: u64,
    pub end: u64,
}

/// Reads a safetensors file's header and validates it against the file's size before MLX maps
/// it (MLX checks no offsets), so a truncated, corrupt or crafted file fails at load with a
/// message naming the tensor instead of reading past the file at first use. The spans come
/// back sorted by offset.
pub fn header(path: &Path) -> Result<Vec<TensorSpan>> {
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
            spans.push(TensorSpan {
                name: name.clone(),
                dtype: dtype.to_string(),
                start: 8 + header_len + start,
                end: 8 + header_len + end,
            });
        }
    }
    // Two tensors over the same bytes would alias: a write to one (a cache, an in-place
    // sanitize step) or a crafted file could change the other.
    spans.sort_unstable_by_key(|t| (t.start, t.end));
    for pair in spans.windows(2) {
        let (a, b) = (&pair[0], &pair[1]);
        if b.start < a.end {
            return Err(bad(format!(
                "tensors {} (bytes {}..{}) and {} (bytes {}..{}) overlap",
                a.name, a.start, a.end, b.name, b.start, b.end
            )));
        }
    }
    Ok(spans)
}

/// The first float tensor of `path` (by offset) holding a NaN or an infinity, found from its
/// bytes (an exponent of all ones) before MLX reads them: MLX's own reductions cost 2-3x the
/// load on a CPU, and a sum can overflow for finite float16 values. The pass is split over the
/// cores and leaves the file in the page cache for MLX's read that follows.
pub fn non_finite_tensor(path: &Path) -> Result<Option<String>> {
    use std::os::unix::fs::FileExt;
    use std::sync::atomic::{AtomicUsize, Ordering};
    const PIECE: u64 = 1 << 22;
    let spans = header(path).map_err(|e| Error::Invalid(format!("{}: {e}", path.display())))?;
    // (span index, byte range, exponent mask, element width) per piece of at most PIECE bytes.
    let mut pieces = Vec::new();
    for (i, t) in spans.iter().enumerate() {
        let (mask, width) = match t.dtype.as_str() {
            "F32" => (0x7f80_0000, 4),
            "BF16" => (0x7f80, 2),
            "F16" => (0x7c00, 2),
            _ => continue,
        };
        let mut at = t.start;
        while at < t.end {
            let end = (at + PIECE).min(t.end);
            pieces.push((i, at, end, mask, width));
            at = end;
        }
    }
    let file = std::fs::File::open(path)
        .map_err(|e| Error::Invalid(format!("{}: cannot read it: {e}", path.display())))?;
    let next = AtomicUsize::new(0);
    let first = AtomicUsize::new(usize::MAX);
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get().min(8));
    let failed = std::thread::scope(|scope| {
        let workers: Vec<_> = (0..threads)
            .map(|_| {
                scope.spawn(|| -> std::io::Result<()> {
                    let mut buf = vec![0u8; PIECE as usize];
                    loop {
                        let n = next.fetch_add(1, Ordering::Relaxed);
                        let Some(&(span, start, end, mask, width)) = pieces.get(n) else {
                            return Ok(());
                        };
                        if span >= first.load(Ordering::Relaxed) {
                            continue;
                        }
                        let chunk = &mut buf[..(end - start) as usize];
                        file.read_exact_at(chunk, start)?;
                        if has_special(chunk, mask, width) {
                            first.fetch_min(span, Ordering::Relaxed);
                        }
                    }
                })
            })
            .collect();
        workers
            .into_iter()
            .map(|w| w.join().expect("the scan does not panic"))
            .find_map(std::result::Result::err)
    });
    if let Some(e) = failed {
        return Err(Error::Invalid(format!(
            "{}: cannot read it: {e}",
            path.display()
        )));
    }
    Ok(spans.into_iter().nth(first.into_inner()).map(|t| t.name))
}

/// Whether any little-endian element of `bytes` has every exponent bit of `mask` set. An OR over
/// the whole chunk, with no early exit, which the compiler vectorizes.
fn has_special(bytes: &[u8], mask: u32, width: usize) -> bool {
    match width {
        4 => bytes
            .chunks_exact(4)
            .map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]) & mask == mask)
            .fold(false, |a, x| a | x),
        _ => bytes
            .chunks_exact(2)
            .map(|b| u32::from(u16::from_le_bytes([b[0], b[1]])) & mask == mask)
            .fold(false, |a, x| a | x),
    }
}

#[cfg(test)]
mod tests {
    use super::has_special;

    #[test]
    fn the_scan_finds_nan_and_infinity_and_passes_the_largest_finite_values() {
        let f32s = |v: &[f32]| v.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>();
        // bf16 is the top half of an f32; f16 has its own exponent field.
        let bf16s = |v: &[f32]| {
            v.iter()
                .flat_map(|x| ((x.to_bits() >> 16) as u16).to_le_bytes())
                .collect::<Vec<u8>>()
        };
        let f16s = |v: &[u16]| v.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>();
        let finite = [0.0, -1.5, f32::MAX, f32::MIN, f32::MIN_POSITIVE];
        assert!(!has_special(&f32s(&finite), 0x7f80_0000, 4));
        assert!(!has_special(&bf16s(&finite), 0x7f80, 2));
        // 65504 (the largest f16), -0.0, the smallest subnormal.
        assert!(!has_special(&f16s(&[0x7bff, 0x8000, 0x0001]), 0x7c00, 2));
        for special in [f32::NAN, f32::INFINITY, f32::NEG_INFINITY] {
            let v = [1.0, special, 2.0];
            assert!(has_special(&f32s(&v), 0x7f80_0000, 4), "{special}");
            assert!(has_special(&bf16s(&v), 0x7f80, 2), "{special}");
        }
        // f16 +inf, -inf and a NaN.
        for special in [0x7c00u16, 0xfc00, 0x7e00] {
            assert!(has_special(&f16s(&[0x3c00, special]), 0x7c00, 2));
        }
    }
}
