//! The committed fixture models and tokenizer are exactly what oracles/build_fixtures.sh
//! (and, for the trained weights, oracles/train.sh) produced: golden/models/SHA256SUMS lists
//! every file with its hash, and no file is missing, changed or unlisted. The weights of a
//! derived folder (one with a derivation.json) are not shipped: its SHA256SUMS line is what
//! verity's materialised copy must hash to. golden/ as a whole stays small, and what it says
//! of verity (the tests a known oracle bug names) resolves.

use std::collections::BTreeMap;
use std::fs;
use std::path::{Path, PathBuf};

use sha2::{Digest, Sha256};
use verity::parity::derived::{self, DerivedError};
use verity::parity::Models;

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

/// SHA256SUMS as a map from path (relative to golden/) to hash.
fn listed() -> BTreeMap<String, String> {
    let sums =
        fs::read_to_string(golden().join("models/SHA256SUMS")).expect("golden/models/SHA256SUMS");
    sums.lines()
        .map(|l| {
            let (hash, path) = l
                .split_once("  ")
                .unwrap_or_else(|| panic!("bad line: {l}"));
            (path.to_string(), hash.to_string())
        })
        .collect()
}

/// The names of the fixture folders whose weights are derived.
fn derived_folders() -> Vec<String> {
    let mut names: Vec<String> = fs::read_dir(golden().join("models"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.join(derived::DERIVATION).is_file())
        .map(|p| p.file_name().unwrap().to_string_lossy().into_owned())
        .collect();
    names.sort();
    names
}

fn sha256(path: &Path) -> String {
    format!("{:x}", Sha256::digest(fs::read(path).unwrap()))
}

#[test]
fn every_fixture_file_matches_sha256sums() {
    let root = golden();
    let listed = listed();
    let derived_weights: Vec<String> = derived_folders()
        .iter()
        .map(|name| format!("models/{name}/model.safetensors"))
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
                let got = sha256(&root.join(path));
                if &got != want {
                    problems.push(format!("{path}: sha256 {got}, SHA256SUMS says {want}"));
                }
            }
        }
    }
    for path in listed.keys() {
        match (present.contains(path), derived_weights.contains(path)) {
            (false, false) => problems.push(format!("{path}: listed but missing")),
            (true, true) => problems.push(format!("{path}: derived, but shipped")),
            _ => {}
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

/// The derived weights verity materialises are the recorded ones, bit for bit: the materialiser
/// checks each against SHA256SUMS, and this checks its result independently.
#[test]
fn derived_weights_materialise_to_their_listed_hash() {
    support::on_cpu();
    let listed = listed();
    let names = derived_folders();
    assert_eq!(
        names,
        [
            "qwen3-target-noise0.1",
            "qwen3-target-noise0.3",
            "qwen3-target-noise1.0"
        ]
    );
    for name in &names {
        let dir = support::model_dir(name);
        assert!(
            dir.ends_with(format!("{}/{name}", derived::CACHE)),
            "{dir:?}"
        );
        let want = &listed[&format!("models/{name}/model.safetensors")];
        assert_eq!(&sha256(&dir.join("model.safetensors")), want, "{name}");
    }
}

/// A scratch repository root holding qwen3-target, its noise0.1 copy (its golden folder, without
/// weights) and a SHA256SUMS with the copy's line, which `edit` may change.
fn scratch_root(name: &str, edit: impl FnOnce(&Path)) -> PathBuf {
    let scratch =
        std::env::temp_dir().join(format!("verity-derived-{name}-{}", std::process::id()));
    let _ = fs::remove_dir_all(&scratch);
    let models = scratch.join("golden/models");
    for folder in ["qwen3-target", "qwen3-target-noise0.1"] {
        let to = models.join(folder);
        fs::create_dir_all(&to).unwrap();
        for entry in fs::read_dir(golden().join("models").join(folder)).unwrap() {
            let entry = entry.unwrap();
            fs::copy(entry.path(), to.join(entry.file_name())).unwrap();
        }
    }
    let key = "models/qwen3-target-noise0.1/model.safetensors";
    fs::write(
        models.join("SHA256SUMS"),
        format!("{}  {key}\n", listed()[key]),
    )
    .unwrap();
    edit(&models.join("qwen3-target-noise0.1"));
    scratch
}

fn resolve_in(scratch: &Path) -> Result<PathBuf, DerivedError> {
    derived::resolve(
        &scratch.join("golden/models/qwen3-target-noise0.1"),
        &scratch.join(derived::CACHE),
    )
}

#[test]
fn a_copy_that_differs_from_sha256sums_is_refused_and_a_stale_one_replaced() {
    support::on_cpu();
    let wrong = "0".repeat(64);
    let scratch = scratch_root("mismatch", |dir| {
        let sums = dir.parent().unwrap().join("SHA256SUMS");
        let text = fs::read_to_string(&sums).unwrap();
        let (right, _) = text.split_once("  ").unwrap();
        fs::write(&sums, text.replace(right, &wrong)).unwrap();
    });
    let err = resolve_in(&scratch).unwrap_err();
    let weights = scratch
        .join(derived::CACHE)
        .join("qwen3-target-noise0.1/model.safetensors");
    let message = err.to_string();
    let right = &listed()["models/qwen3-target-noise0.1/model.safetensors"];
    assert!(matches!(err, DerivedError::Mismatch { .. }), "{err:?}");
    for part in [&weights.display().to_string(), &wrong, right] {
        assert!(message.contains(part.as_str()), "no {part} in {message}");
    }
    assert!(!weights.exists(), "a mismatching copy was kept");

    // A copy already in the cache that is not the listed one (stale, truncated) is rebuilt.
    let scratch = scratch_root("stale", |_| {});
    let weights = scratch
        .join(derived::CACHE)
        .join("qwen3-target-noise0.1/model.safetensors");
    fs::create_dir_all(weights.parent().unwrap()).unwrap();
    fs::write(&weights, "stale").unwrap();
    resolve_in(&scratch).unwrap();
    assert_eq!(&sha256(&weights), right);
    fs::remove_dir_all(&scratch).unwrap();
}

#[test]
fn a_bad_derivation_json_is_refused_naming_the_file_and_value() {
    support::on_cpu();
    let cases: [(&str, &str, &[&str]); 6] = [
        ("not-json", "{", &["not a derivation"]),
        (
            "negative-sigma",
            r#""sigma": 0.1"#,
            &["sigma is -0.5", "finite number above 0"],
        ),
        ("missing-seed", r#""seed": 101,"#, &["missing field `seed`"]),
        (
            "unknown-source",
            r#""source": "qwen3-target""#,
            &[r#"source is "no-such-model""#],
        ),
        (
            "escaping-source",
            r#""source": "qwen3-target""#,
            &[r#"source is "../models/qwen3-target""#],
        ),
        ("other-method", r#""method": "per tensor"#, &["method is"]),
    ];
    for (name, find, expected) in cases {
        let scratch = scratch_root(name, |dir| {
            let path = dir.join(derived::DERIVATION);
            let text = fs::read_to_string(&path).unwrap();
            assert!(text.contains(find), "{name}: {find} not in {text}");
            let replacement = match name {
                "not-json" => "{{".to_string(),
                "negative-sigma" => r#""sigma": -0.5"#.to_string(),
                "missing-seed" => String::new(),
                "unknown-source" => r#""source": "no-such-model""#.to_string(),
                "escaping-source" => r#""source": "../models/qwen3-target""#.to_string(),
                _ => r#""method": "elementwise"#.to_string(),
            };
            fs::write(&path, text.replacen(find, &replacement, 1)).unwrap();
        });
        let err = resolve_in(&scratch).unwrap_err();
        let message = err.to_string();
        assert!(
            matches!(err, DerivedError::BadDerivation { .. }),
            "{name}: {err:?}"
        );
        assert!(message.contains("derivation.json"), "{name}: {message}");
        for part in expected {
            assert!(message.contains(part), "{name}: no {part:?} in {message}");
        }
        assert!(!scratch
            .join(derived::CACHE)
            .join("qwen3-target-noise0.1/model.safetensors")
            .exists());
        fs::remove_dir_all(&scratch).unwrap();
    }
}

/// Without its derivation.json a folder is a plain one, and the loader says what it lacks.
#[test]
fn a_missing_derivation_json_leaves_a_folder_without_weights() {
    support::on_cpu();
    let scratch = scratch_root("missing", |dir| {
        fs::remove_file(dir.join(derived::DERIVATION)).unwrap();
    });
    let message = match Models::new(&scratch).get("golden/models/qwen3-target-noise0.1") {
        Ok(_) => panic!("a folder without weights or derivation.json loaded"),
        Err(e) => e.to_string(),
    };
    assert!(
        message.contains("qwen3-target-noise0.1") && message.contains("no model*.safetensors"),
        "{message}"
    );
    fs::remove_dir_all(&scratch).unwrap();
}

/// Every known oracle bug names the tests that show verity's behaviour (`verity = "tests/F.rs
/// NAME ...; ..."`): each must be a test function in that file, so renaming a test cannot leave
/// an entry pointing at nothing.
#[test]
fn known_oracle_bugs_name_tests_that_exist() {
    let text = fs::read_to_string(golden().join("known-oracle-bugs.toml")).unwrap();
    let bugs: toml::Value = toml::from_str(&text).unwrap();
    let mut named = 0;
    for bug in bugs["bug"].as_array().unwrap() {
        let id = bug["id"].as_str().unwrap();
        let verity = bug["verity"]
            .as_str()
            .unwrap_or_else(|| panic!("{id}: no verity test named"));
        for reference in verity.split(';') {
            let mut words = reference.split_whitespace();
            let (file, test) = (words.next().unwrap(), words.next().unwrap());
            let source = fs::read_to_string(support::root().join(file))
                .unwrap_or_else(|e| panic!("{id}: {file}: {e}"));
            assert!(
                source.contains(&format!("fn {test}(")),
                "{id}: {file} has no test {test}"
            );
            named += 1;
        }
    }
    assert!(named > 0, "no known oracle bug names a test");
}
