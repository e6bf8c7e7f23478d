//! Files written whole or not at all: the contents go to a temporary file in the same folder,
//! which is then renamed over the target, so a run killed mid-write never leaves a truncated
//! baseline, expectation or report where a valid one was.

use std::io::Write;
use std::path::Path;

/// Writes `contents` to `path` atomically (temporary file + rename in the same folder).
pub fn write(path: &Path, contents: &[u8]) -> std::io::Result<()> {
    if path.is_dir() {
        return Err(std::io::Error::other("is a directory"));
    }
    let name = path
        .file_name()
        .ok_or_else(|| std::io::Error::other("has no file name"))?
        .to_string_lossy();
    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d,
        _ => Path::new("."),
    };
    let tmp = dir.join(format!(".{name}.{}.tmp", std::process::id()));
    let written = std::fs::File::create(&tmp)
        .and_then(|mut f| f.write_all(contents).and_then(|()| f.sync_all()))
        .and_then(|()| std::fs::rename(&tmp, path));
    if written.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    written
}
