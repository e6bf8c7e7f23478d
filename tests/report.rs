//! The HTML parity report as a person sees it: `verity check --html` on a set with one trace
//! that diverges (its step-5 token replaced by the runner-up, consistently, as a real divergence
//! looks) and one recorded on another backend (teacher-forced, so it has a deviation chart),
//! opened in headless Chromium. The parsed page must hold the suite tables, the diff view with
//! the first difference marked and the charts; the screenshot must not be blank. It runs in the
//! nextest `report` profile (Debian's chromium package, which .ci/run installs for it).

use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;

use serde_json::Value;

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// Headless Chromium on the page, with the flags this machine's closed network needs.
fn chromium(profile: &Path, args: &[&str], page: &Path) -> std::process::Output {
    let out = Command::new("chromium")
        .args([
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-quic",
            "--no-first-run",
            "--disable-background-networking",
            "--disable-component-update",
            "--disable-sync",
            &format!("--user-data-dir={}", profile.display()),
        ])
        .args(args)
        .arg(format!("file://{}", page.display()))
        .output()
        .expect("chromium runs (apt-get install chromium; .ci/run installs it)");
    assert!(
        out.status.success(),
        "chromium: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

/// The share of pixels of the PNG at `path` that are not near-white.
fn inked_share(path: &Path) -> f64 {
    let decoder = png::Decoder::new(std::io::BufReader::new(fs::File::open(path).unwrap()));
    let mut reader = decoder.read_info().unwrap();
    let mut buf = vec![0; reader.output_buffer_size()];
    let info = reader.next_frame(&mut buf).unwrap();
    let channels = info.color_type.samples();
    let pixels = &buf[..info.buffer_size()];
    let inked = pixels
        .chunks_exact(channels)
        .filter(|p| p.iter().take(3).any(|&c| c < 200))
        .count();
    inked as f64 / (pixels.len() / channels) as f64
}

/// Runs verity's `verb args...` on the CPU against the repository root; it must exit 1 (`why`).
fn exits_1(args: &[&std::ffi::OsStr], why: &str) {
    let (verb, rest) = args.split_first().unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_verity"))
        .args(["--device", "cpu"])
        .arg(verb)
        .arg("--root")
        .arg(root())
        .args(rest)
        .output()
        .unwrap();
    assert_eq!(
        out.status.code(),
        Some(1),
        "{why}: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

#[test]
fn the_html_report_renders_tables_a_diff_and_charts_in_chromium() {
    let scratch = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("report");
    let _ = fs::remove_dir_all(&scratch);
    let (here, other) = (scratch.join("cpu"), scratch.join("cuda"));
    fs::create_dir_all(&here).unwrap();
    fs::create_dir_all(&other).unwrap();
    let greedy = root().join("golden/traces/qwen3-target/greedy");
    for name in ["code.json", "chat.json"] {
        fs::copy(greedy.join(name), here.join(name)).unwrap();
    }
    let mut bad: Value =
        serde_json::from_str(&fs::read_to_string(greedy.join("unicode.json")).unwrap()).unwrap();
    let step = &mut bad["steps"][5];
    step["token"] = step["top"][1][0].clone();
    step["logprob"] = step["top"][1][1].clone();
    fs::write(here.join("unicode.json"), bad.to_string()).unwrap();
    let cuda = root().join("golden/traces-cuda/qwen3-target/greedy/code.json");
    fs::copy(cuda, other.join("code.json")).unwrap();

    // An acceptance run against a baseline its last draft position fell below.
    let mut baseline: Value = serde_json::from_str(
        &fs::read_to_string(root().join("golden/accept/noisy-draft.baseline.json")).unwrap(),
    )
    .unwrap();
    let row = &mut baseline["acceptance"]["3"]["accepted_by_pos"];
    row[2] = row[1].clone();
    fs::write(scratch.join("baseline.json"), baseline.to_string()).unwrap();
    let accept = scratch.join("accept.json");
    let suite = root().join("golden/accept/noisy-draft.toml");
    let edited = scratch.join("baseline.json");
    exits_1(
        &[
            "accept".as_ref(),
            "--suite".as_ref(),
            suite.as_os_str(),
            "--baseline".as_ref(),
            edited.as_os_str(),
            "--json".as_ref(),
            accept.as_os_str(),
        ],
        "the last position regressed",
    );

    let page = scratch.join("report.html");
    exits_1(
        &[
            "check".as_ref(),
            "--traces".as_ref(),
            here.as_os_str(),
            "--traces".as_ref(),
            other.as_os_str(),
            "--html".as_ref(),
            page.as_os_str(),
            "--accept".as_ref(),
            accept.as_os_str(),
        ],
        "one trace diverges",
    );

    let dom =
        String::from_utf8(chromium(&scratch.join("dom"), &["--dump-dom"], &page).stdout).unwrap();
    let count = |needle: &str| dom.matches(needle).count();
    assert_eq!(count("<table class=\"suites\">"), 2, "one table per set");
    assert_eq!(count("<tr class=\"suite fail\">"), 1);
    assert_eq!(count("<details class=\"trace\""), 4);
    assert_eq!(
        count("<details class=\"trace\" open=\"\">"),
        1,
        "the failure is open"
    );
    assert_eq!(
        count("class=\"d\""),
        2,
        "the first difference, in both columns"
    );
    assert_eq!(count("class=\"chart margins\""), 4);
    assert_eq!(count("class=\"chart deviations\""), 1);
    assert_eq!(count("class=\"chart acceptance\""), 1);
    assert_eq!(count("class=\"rate\""), 3, "one bar per draft position");
    assert_eq!(
        count("fill=\"#c62828\""),
        1,
        "the regressed position alone is red"
    );
    assert_eq!(count("<pre class=\"regressed\">"), 1);

    let shot = scratch.join("report.png");
    chromium(
        &scratch.join("shot"),
        &[
            "--window-size=1280,1200",
            &format!("--screenshot={}", shot.display()),
        ],
        &page,
    );
    let inked = inked_share(&shot);
    assert!(inked > 0.02, "the screenshot is nearly blank: {inked}");
}
