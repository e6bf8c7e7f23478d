//! Files written whole or not at all. The contents go to a hidden temporary file in the target's
//! folder (`.verity-<pid>.<name>`, plus a suffix a writer may need), which is synced, renamed
//! over the target and made durable by syncing the folder: a run killed mid-write never leaves a
//! truncated baseline, expectation or prompt cache where a valid one was, and the temporary file
//! a killed run leaves behind is removed by the next write to the same target.
//!
//! Only regular files and new paths are written: renaming over a FIFO, a device, a socket or a
//! symbolic link would silently replace the node with a regular file.

use std::fs::{self, File};
use std::io::{self, Write};
use std::path::{Path, PathBuf};

/// The prefix of every temporary file this module names.
const TEMP_PREFIX: &str = ".verity-";

/// Writes `contents` to `path` atomically.
pub fn write(path: &Path, contents: &[u8]) -> io::Result<()> {
    write_with(path, "", |tmp| File::create(tmp)?.write_all(contents))
}

/// Writes `path` atomically through `fill`, which must create the file it is given (a path in
/// the same folder: the target's name, then `suffix` unless the name already ends with it, for
/// writers such as MLX's that insist on an extension) and write it completely.
pub fn write_with(
    path: &Path,
    suffix: &str,
    fill: impl FnOnce(&Path) -> io::Result<()>,
) -> io::Result<()> {
    check_target(path)?;
    let (dir, name) = split(path)?;
    remove_stale(dir, name);
    let tmp = temp_path(path, std::process::id(), suffix)?;
    let written = fill(&tmp)
        .and_then(|()| File::open(&tmp)?.sync_all())
        .and_then(|()| fs::rename(&tmp, path))
        .and_then(|()| sync_folder(dir));
    if written.is_err() {
        let _ = fs::remove_file(&tmp);
    }
    written
}

/// Fails unless `path` could be written: its folder exists, and the path is absent or a
/// regular file. Verbs call this before their work, so a bad output path costs nothing.
pub fn check_target(path: &Path) -> io::Result<()> {
    let (dir, _) = split(path)?;
    if !dir.is_dir() {
        return Err(io::Error::new(
            io::ErrorKind::NotFound,
            format!("its folder {} does not exist", dir.display()),
        ));
    }
    match fs::symlink_metadata(path) {
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(e),
        Ok(m) if m.file_type().is_file() => Ok(()),
        Ok(m) => Err(io::Error::other(format!(
            "is {}; only a regular file or a new path is written",
            node_kind(&m.file_type())
        ))),
    }
}

fn split(path: &Path) -> io::Result<(&Path, &str)> {
    let name = path
        .file_name()
        .and_then(|n| n.to_str())
        .ok_or_else(|| io::Error::other("has no UTF-8 file name"))?;
    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d,
        _ => Path::new("."),
    };
    Ok((dir, name))
}

fn node_kind(t: &fs::FileType) -> &'static str {
    use std::os::unix::fs::FileTypeExt;
    if t.is_dir() {
        "a directory"
    } else if t.is_symlink() {
        "a symbolic link"
    } else if t.is_fifo() {
        "a FIFO"
    } else if t.is_char_device() {
        "a character device"
    } else if t.is_block_device() {
        "a block device"
    } else if t.is_socket() {
        "a socket"
    } else {
        "not a regular file"
    }
}

/// Removes the temporary files of earlier writes to `name` whose process has exited (a write
/// still running in another process keeps its file).
fn remove_stale(dir: &Path, name: &str) {
    let Ok(entries) = fs::read_dir(dir) else {
        return;
    };
    for entry in entries.flatten() {
        if let Some(pid) = temp_owner(&entry.file_name().to_string_lossy(), name) {
            if pid != std::process::id() && !alive(pid) {
                let _ = fs::remove_file(entry.path());
            }
        }
    }
}

/// The process id in `file`, when `file` is this module's temporary name for `name`.
fn temp_owner(file: &str, name: &str) -> Option<u32> {
    let (pid, rest) = file.strip_prefix(TEMP_PREFIX)?.split_once('.')?;
    let suffix = rest.strip_prefix(name)?;
    let own =
        pid.bytes().all(|b| b.is_ascii_digit()) && (suffix.is_empty() || suffix.starts_with('.'));
    own.then(|| pid.parse().ok())?
}

fn alive(pid: u32) -> bool {
    let Ok(pid) = i32::try_from(pid) else {
        return false;
    };
    // SAFETY: signal 0 only asks whether the process exists; nothing is sent.
    let r = unsafe { libc::kill(pid, 0) };
    r == 0 || io::Error::last_os_error().raw_os_error() != Some(libc::ESRCH)
}

/// Makes the rename durable. A file system that cannot sync a folder (some network mounts
/// answer EINVAL) still renamed atomically, so that answer is not an error.
fn sync_folder(dir: &Path) -> io::Result<()> {
    match File::open(dir)?.sync_all() {
        Err(e) if e.raw_os_error() == Some(libc::EINVAL) => Ok(()),
        r => r,
    }
}

/// The temporary path a write to `path` with `suffix` from process `pid` uses (public for
/// tests that plant a killed writer's file).
pub fn temp_path(path: &Path, pid: u32, suffix: &str) -> io::Result<PathBuf> {
    let (dir, name) = split(path)?;
    let suffix = if name.ends_with(suffix) { "" } else { suffix };
    Ok(dir.join(format!("{TEMP_PREFIX}{pid}.{name}{suffix}")))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::FileTypeExt;

    fn scratch(name: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("verity-atomic-{name}-{}", std::process::id()));
        let _ = fs::remove_dir_all(&dir);
        fs::create_dir_all(&dir).unwrap();
        dir
    }

    fn names(dir: &Path) -> Vec<String> {
        let mut names: Vec<String> = fs::read_dir(dir)
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
        fs::write(&path, "old").unwrap();
        write(&path, b"new contents").unwrap();
        assert_eq!(fs::read_to_string(&path).unwrap(), "new contents");
        assert_eq!(names(&dir), ["a.json"]);
        fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_failed_write_keeps_the_old_file_and_leaves_no_temporary() {
        let dir = scratch("fail");
        let path = dir.join("a.json");
        fs::write(&path, "old").unwrap();
        // A directory at the path, a folder that does not exist, and a fill that fails.
        let blocked = dir.join("sub");
        fs::create_dir_all(blocked.join("inner")).unwrap();
        assert!(write(&blocked, b"x").is_err());
        assert!(write(&dir.join("missing/a.json"), b"x").is_err());
        let failed = write_with(&path, "", |tmp| {
            fs::write(tmp, "half")?;
            Err(io::Error::other("disk full"))
        });
        assert!(failed.is_err());
        assert_eq!(fs::read_to_string(&path).unwrap(), "old");
        assert_eq!(names(&dir), ["a.json", "sub"]);
        fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn special_files_and_links_are_refused_and_kept() {
        let dir = scratch("special");
        let fifo = dir.join("fifo");
        let c = std::ffi::CString::new(fifo.to_str().unwrap()).unwrap();
        // SAFETY: a valid NUL-terminated path.
        assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
        let target = dir.join("real.json");
        fs::write(&target, "kept").unwrap();
        let link = dir.join("link.json");
        std::os::unix::fs::symlink(&target, &link).unwrap();
        for (path, kind) in [
            (fifo.as_path(), "a FIFO"),
            (link.as_path(), "a symbolic link"),
            (Path::new("/dev/null"), "a character device"),
        ] {
            let e = write(path, b"x").unwrap_err().to_string();
            assert!(e.contains(kind), "{}: {e}", path.display());
        }
        assert!(fs::symlink_metadata(&fifo).unwrap().file_type().is_fifo());
        assert!(fs::symlink_metadata(&link)
            .unwrap()
            .file_type()
            .is_symlink());
        assert_eq!(fs::read_to_string(&target).unwrap(), "kept");
        fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_dead_writers_temporary_is_removed_and_a_live_ones_kept() {
        let dir = scratch("stale");
        let path = dir.join("c.safetensors");
        // No process has this id (above every system's pid limit).
        let dead = temp_path(&path, i32::MAX as u32 - 1, "").unwrap();
        let dead_suffixed = temp_path(&dir.join("c"), i32::MAX as u32 - 2, ".x").unwrap();
        let live = temp_path(&path, 1, "").unwrap();
        let other = temp_path(&dir.join("d.safetensors"), i32::MAX as u32 - 1, "").unwrap();
        for p in [&dead, &dead_suffixed, &live, &other] {
            fs::write(p, "partial").unwrap();
        }
        write(&path, b"whole").unwrap();
        write(&dir.join("c"), b"whole").unwrap();
        let mut want = vec![
            "c".to_string(),
            "c.safetensors".to_string(),
            live.file_name().unwrap().to_string_lossy().into_owned(),
            other.file_name().unwrap().to_string_lossy().into_owned(),
        ];
        want.sort();
        assert_eq!(names(&dir), want);
        fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn temp_names_parse_only_as_this_modules_own() {
        assert_eq!(temp_owner(".verity-12.a.json", "a.json"), Some(12));
        assert_eq!(
            temp_owner(".verity-12.a.json.safetensors", "a.json"),
            Some(12)
        );
        assert_eq!(temp_owner(".verity-12.a.jsonl", "a.json"), None);
        assert_eq!(temp_owner(".verity-12.b.json", "a.json"), None);
        assert_eq!(temp_owner(".verity-x1.a.json", "a.json"), None);
        assert_eq!(temp_owner(".verity-12a.json", "a.json"), None);
        assert_eq!(temp_owner("a.json", "a.json"), None);
    }
}
