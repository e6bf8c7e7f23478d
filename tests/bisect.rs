//! `verity bisect` end to end on a throwaway repository: a clone of this one with three new
//! commits, the middle one an off-by-one in the draft model's cache rewind that lowers
//! acceptance (output stays correct). Bisect measures the baseline at the clone's first commit and
//! must name exactly that commit. It runs in the
//! nextest `e2e` profile. The probes build into one target folder kept under target/tmp, so
//! after the first run only the clone's own crates are rebuilt. It is not this checkout's target
//! folder: cargo names a path crate's artifacts by its path within the workspace, so the clone's
//! builds would take the place of this checkout's own and be taken for them.

use std::path::{Path, PathBuf};
use std::process::Command;

fn git(dir: &Path, args: &[&str]) -> String {
    let out = Command::new("git")
        .arg("-C")
        .arg(dir)
        .args(args)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "git {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).trim().to_string()
}

fn commit(repo: &Path, message: &str) -> String {
    git(repo, &["commit", "-qam", message]);
    git(repo, &["rev-parse", "HEAD"])
}

fn append(path: &Path, line: &str) {
    let text = std::fs::read_to_string(path).unwrap();
    std::fs::write(path, text + line + "\n").unwrap();
}

#[test]
fn bisect_names_the_commit_that_lowered_acceptance() {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    let tmp = PathBuf::from(env!("CARGO_TARGET_TMPDIR"));
    let scratch = tmp.join("bisect-demo");
    let _ = std::fs::remove_dir_all(&scratch);
    std::fs::create_dir_all(&scratch).unwrap();
    let repo = scratch.join("repo");
    git(&scratch, &["clone", "-q", &root.to_string_lossy(), "repo"]);
    git(&repo, &["config", "user.email", "demo@verity.invalid"]);
    git(&repo, &["config", "user.name", "bisect demo"]);
    let good = git(&repo, &["rev-parse", "HEAD"]);

    append(&repo.join("README.md"), "\nA harmless change.");
    commit(&repo, "docs: a harmless change");
    let rewind = repo.join("src/speculative/draft_model.rs");
    let source = std::fs::read_to_string(&rewind).unwrap();
    let correct = "let kept_drafts = accepted.min(drafted - 1);";
    assert!(
        source.contains(correct),
        "the draft rewind moved; update this test"
    );
    std::fs::write(
        &rewind,
        source.replace(
            correct,
            "let kept_drafts = accepted.min(drafted - 1).saturating_sub(1);",
        ),
    )
    .unwrap();
    let culprit = commit(&repo, "speculative: trim the draft cache differently");
    append(&repo.join("README.md"), "Another harmless change.");
    let bad = commit(&repo, "docs: another harmless change");

    let suite = "golden/accept/noisy-draft.toml";
    let out = Command::new(env!("CARGO_BIN_EXE_verity"))
        .args([
            "bisect", "--good", &good, "--bad", &bad, "--suite", suite, "--repo",
        ])
        .arg(&repo)
        .arg("--target-dir")
        .arg(tmp.join("bisect-demo-target"))
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    // The probes' progress, for `--success-output immediate` and CI logs.
    eprintln!("{stderr}");
    assert!(out.status.success(), "{stdout}\n{stderr}");
    assert!(
        stdout.contains(&format!(
            "first bad commit: {culprit} speculative: trim the draft cache differently\n"
        )),
        "{stdout}"
    );
    // The verdict says by how much, overall and at the positions past the tolerance.
    let verdict = stdout
        .lines()
        .find(|l| l.starts_with("suite noisy-draft, k=3: acceptance "))
        .unwrap_or_else(|| panic!("no verdict line: {stdout}"));
    assert!(
        verdict.contains(" -> ") && verdict.contains("(position "),
        "{verdict}"
    );
    // Each probe is reported as it goes: the commit, its build, its acceptance.
    let short = git(&repo, &["rev-parse", "--short", &culprit]);
    for line in [
        format!(": {short} speculative: trim the draft cache differently"),
        "  building (cargo build --release)".to_string(),
        "  regressed: k=3: acceptance ".to_string(),
        "  good: k=3: acceptance ".to_string(),
    ] {
        assert!(stderr.contains(&line), "no {line:?} in\n{stderr}");
    }
    assert!(stderr.lines().any(|l| l.starts_with("probe 1")), "{stderr}");
    // The baseline is measured at --good, in a scratch file that is not worth naming.
    let good_short = git(&repo, &["rev-parse", "--short", &good]);
    assert!(
        stderr.contains(&format!(
            "baseline: measured at --good {good} ({good_short} "
        )),
        "{stderr}"
    );
    assert!(!stderr.contains("verity-bisect-"), "{stderr}");
    std::fs::remove_dir_all(&scratch).unwrap();
}
