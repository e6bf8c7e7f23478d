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

#[cfg(test)]
mod tests {
    use super::*;

    fn scratch(name: &str) -> std::path::PathBuf {
        let dir = std::env::temp_dir().join(format!("verity-atomic-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        dir
    }

    fn names(dir: &Path) -> Vec<String> {
        let mut names: Vec<String> = std::fs::read_dir(dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        names.sort();
        names
    }

    #[test]
    fn replaces_the_file_whole_and_leaves_no_temporary() {
        let dir = scratch("replace");
        let path = dir.join("a.json");
        std::fs::write(&path, "old").unwrap();
        write(&path, b"new contents").unwrap();
        assert_eq!(std::fs::read_to_string(&path).unwrap(), "new contents");
        assert_eq!(names(&dir), ["a.json"]);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_failed_write_keeps_the_old_file_and_leaves_no_temporary() {
        let dir = scratch("fail");
        let path = dir.join("a.json");
        std::fs::write(&path, "old").unwrap();
        // A directory at the path, and a folder that does not exist.
        let blocked = dir.join("sub");
        std::fs::create_dir_all(blocked.join("inner")).unwrap();
        assert!(write(&blocked, b"x").is_err());
        assert!(write(&dir.join("missing/a.json"), b"x").is_err());
        assert_eq!(std::fs::read_to_string(&path).unwrap(), "old");
        assert_eq!(names(&dir), ["a.json", "sub"]);
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
