//! The committed fixture models and tokenizer are exactly what oracles/build_fixtures.sh
//! (and, for the trained weights, oracles/train.sh) produced: golden/models/SHA256SUMS lists
//! every file with its hash, and no file is missing, changed or unlisted.

use std::collections::BTreeMap;
use std::fs;
use std::path::{Path, PathBuf};

use sha2::{Digest, Sha256};

mod support;

fn golden() -> PathBuf {
    support::root().join("golden")
}

fn files_under(dir: &Path, base: &Path, out: &mut Vec<String>) {
    for entry in fs::read_dir(dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display())) {
        let path = entry.unwrap().path();
        if path.is_dir() {
            files_under(&path, base, out);
        } else {
            out.push(
                path.strip_prefix(base)
                    .unwrap()
                    .to_string_lossy()
                    .into_owned(),
            );
        }
    }
}

#[test]
fn every_fixture_file_matches_sha256sums() {
    let root = golden();
    let sums =
        fs::read_to_string(root.join("models/SHA256SUMS")).expect("golden/models/SHA256SUMS");
    let listed: BTreeMap<String, String> = sums
        .lines()
        .map(|l| {
            let (hash, path) = l
                .split_once("  ")
                .unwrap_or_else(|| panic!("bad line: {l}"));
            (path.to_string(), hash.to_string())
        })
        .collect();
    let mut present = Vec::new();
    files_under(&root.join("models"), &root, &mut present);
    files_under(&root.join("tokenizer"), &root, &mut present);
    present.retain(|p| p != "models/SHA256SUMS");
    present.sort();

    let mut problems = Vec::new();
    for path in &present {
        match listed.get(path) {
            None => problems.push(format!("{path}: not in SHA256SUMS")),
            Some(want) => {
                let got = format!("{:x}", Sha256::digest(fs::read(root.join(path)).unwrap()));
                if &got != want {
                    problems.push(format!("{path}: sha256 {got}, SHA256SUMS says {want}"));
                }
            }
        }
    }
    for path in listed.keys() {
        if !present.contains(path) {
            problems.push(format!("{path}: listed but missing"));
        }
    }
    assert!(
        listed.len() > 100,
        "SHA256SUMS lists only {} files",
        listed.len()
    );
    assert!(
        problems.is_empty(),
        "fixtures differ from SHA256SUMS:\n{}",
        problems.join("\n")
    );
}

#[test]
fn golden_stays_under_60_mb() {
    let mut files = Vec::new();
    let root = golden();
    files_under(&root, &root, &mut files);
    let bytes: u64 = files
        .iter()
        .map(|f| fs::metadata(root.join(f)).unwrap().len())
        .sum();
    assert!(
        bytes < 60 * 1024 * 1024,
        "golden/ holds {:.1} MB",
        bytes as f64 / 1048576.0
    );
}
