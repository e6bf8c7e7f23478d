//! The `verity` binary end to end: the divergence report on a trace corrupted by the test
//! itself, and one clear error line with exit code 2 for each kind of bad input.

use std::fs;
use std::path::{Path, PathBuf};
use std::process::Output;

use serde_json::Value;

mod support;

use support::{root, verity_cpu as verity};

/// A fresh scratch folder laid out like a repository root.
struct Scratch(PathBuf);

impl Scratch {
    fn new(name: &str) -> Scratch {
        let dir = std::env::temp_dir().join(format!("verity-cli-{name}-{}", std::process::id()));
        let _ = fs::remove_dir_all(&dir);
        fs::create_dir_all(dir.join("golden/models")).unwrap();
        Scratch(dir)
    }

    /// Copies a fixture model folder into the scratch root.
    fn copy_model(&self, name: &str) -> PathBuf {
        let from = root().join("golden/models").join(name);
        let to = self.0.join("golden/models").join(name);
        fs::create_dir_all(&to).unwrap();
        for entry in fs::read_dir(&from).unwrap() {
            let entry = entry.unwrap();
            fs::copy(entry.path(), to.join(entry.file_name())).unwrap();
        }
        to
    }

    fn write_json(&self, name: &str, value: &Value) -> PathBuf {
        let path = self.0.join(name);
        fs::write(&path, serde_json::to_string_pretty(value).unwrap()).unwrap();
        path
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = fs::remove_dir_all(&self.0);
    }
}

fn root_arg() -> String {
    root().to_string_lossy().into_owned()
}

fn golden(id: &str) -> Value {
    let path = root().join("golden/traces").join(format!("{id}.json"));
    serde_json::from_str(&fs::read_to_string(&path).unwrap()).unwrap()
}

/// `verity generate --model <model> --prompt hi`.
fn generate_hi(model: &str) -> Output {
    verity(&["generate", "--model", model, "--prompt", "hi"])
}

/// Asserts exit code 2 and a single `error:` line on stderr containing every `needle`.
fn assert_one_error_line(out: &Output, needles: &[&str]) {
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "stderr: {stderr}");
    let lines: Vec<&str> = stderr.lines().collect();
    assert_eq!(lines.len(), 1, "expected one error line, got: {stderr}");
    assert!(lines[0].starts_with("error: "), "{stderr}");
    for n in needles {
        assert!(lines[0].contains(n), "{n:?} missing from: {stderr}");
    }
}

const TRACE: &str = "qwen3-target/greedy/code";

/// `verity replay` on `trace` written to a scratch file: (exit code, stdout).
fn replay(trace: &Value) -> (Option<i32>, String) {
    let scratch = Scratch::new("replay");
    let path = scratch.write_json("trace.json", trace);
    let out = verity(&["replay", path.to_str().unwrap(), "--root", &root_arg()]);
    (
        out.status.code(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
    )
}

/// Asserts that `stdout` contains every one of `needles`.
fn assert_contains(stdout: &str, needles: &[&str]) {
    for n in needles {
        assert!(stdout.contains(n), "{n:?} missing from: {stdout}");
    }
}

#[test]
fn a_corrupted_trace_gets_a_divergence_report() {
    let mut trace = golden(TRACE);
    // Change the oracle's token at step 5 to its runner-up, with the runner-up's logprob, as a
    // real divergence would look (an inconsistent step would be refused as a corrupt trace).
    let step = &mut trace["steps"][5];
    let runner_up = step["top"][1][0].as_u64().unwrap();
    let original = step["token"].as_u64().unwrap();
    step["token"] = runner_up.into();
    step["logprob"] = step["top"][1][1].clone();
    let (code, stdout) = replay(&trace);
    assert_eq!(code, Some(1), "{stdout}");
    assert_contains(
        &stdout,
        &[
            &format!("FAIL {TRACE}: first difference at step 5 of"),
            &format!("token: oracle {runner_up}, engine {original}"),
            "oracle top-1/top-2 margin at step 5:",
            "text diff (- oracle, + engine):",
        ],
    );
    assert!(
        stdout.contains("[-") || stdout.contains("{+"),
        "the diff marks a change: {stdout}"
    );
}

#[test]
fn a_corrupted_logprob_is_a_tier_a_failure_naming_the_bits() {
    let mut trace = golden(TRACE);
    // One bit off, in the chosen logprob and in its top-k entry alike, so the trace stays
    // consistent and only the bits differ.
    let step = &mut trace["steps"][2];
    let lp = step["logprob"].as_f64().unwrap() as f32;
    let off = Value::from(f32::from_bits(lp.to_bits() + 1) as f64);
    step["logprob"] = off.clone();
    let token = step["token"].clone();
    for entry in step["top"].as_array_mut().unwrap() {
        if entry[0] == token {
            entry[1] = off.clone();
        }
    }
    let (code, stdout) = replay(&trace);
    assert_eq!(code, Some(1), "{stdout}");
    assert_contains(&stdout, &["first difference at step 2", "logprob of token"]);
}

#[test]
fn check_on_a_trace_folder_prints_the_suite_table() {
    let scratch = Scratch::new("table");
    let traces = scratch.0.join("traces");
    fs::create_dir_all(&traces).unwrap();
    fs::write(
        traces.join("a.json"),
        serde_json::to_string(&golden(TRACE)).unwrap(),
    )
    .unwrap();
    let out = verity(&[
        "check",
        "--traces",
        traces.to_str().unwrap(),
        "--root",
        &root_arg(),
    ]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(0), "{stdout}");
    assert_contains(&stdout, &["suite", "all traces pass"]);
}

/// `cache-prompt --out x.bin` writes exactly x.bin (MLX alone would write x.bin.safetensors),
/// replaces a file already there whole, removes the temporary file a killed earlier run left
/// and leaves none of its own, and `generate` continues from it.
#[test]
fn cache_prompt_writes_exactly_the_named_file() {
    let scratch = Scratch::new("cache-out");
    let model = root().join("golden/models/qwen3");
    let out = scratch.0.join("x.bin");
    fs::write(&out, "an older file").unwrap();
    // No process has this id, so its temporary file is a killed writer's.
    let killed = verity_harness::atomic::temp_path(&out, i32::MAX as u32 - 1, ".safetensors");
    fs::write(killed.unwrap(), "half a cache").unwrap();
    let args = |m: &Path| {
        vec![
            "cache-prompt".to_string(),
            "--model".into(),
            m.to_string_lossy().into_owned(),
            "--tokens".into(),
            "1,2,3".into(),
            "--out".into(),
            out.to_string_lossy().into_owned(),
        ]
    };
    let written = verity(&args(&model).iter().map(String::as_str).collect::<Vec<_>>());
    assert!(
        written.status.success(),
        "{}",
        String::from_utf8_lossy(&written.stderr)
    );
    let names: Vec<String> = fs::read_dir(&scratch.0)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    assert!(
        names.iter().all(|n| n == "x.bin" || n == "golden"),
        "{names:?}"
    );
    assert!(names.contains(&"x.bin".to_string()));
    assert!(
        fs::read(&out).unwrap().len() > 1000,
        "the old file was not replaced"
    );
    let generated = verity(&[
        "generate",
        "--model",
        &model.to_string_lossy(),
        "--prompt-cache-file",
        &out.to_string_lossy(),
        "-m",
        "3",
    ]);
    assert!(
        generated.status.success(),
        "{}",
        String::from_utf8_lossy(&generated.stderr)
    );
}

#[test]
fn a_missing_model_folder_is_one_error_line() {
    let out = generate_hi("no/such/model");
    assert_one_error_line(&out, &["no/such/model", "no such model folder"]);
}

/// `verity generate` on a copy of the llama fixture whose `file` went through `edit`.
fn generate_with_edited_llama(file: &str, edit: impl FnOnce(Vec<u8>) -> Vec<u8>) -> Output {
    let scratch = Scratch::new("edited-llama");
    let model = scratch.copy_model("llama");
    let path = model.join(file);
    fs::write(&path, edit(fs::read(&path).unwrap())).unwrap();
    generate_hi(model.to_str().unwrap())
}

#[test]
fn a_truncated_safetensors_file_is_one_error_line() {
    let out = generate_with_edited_llama("model.safetensors", |mut bytes| {
        bytes.truncate(bytes.len() / 2);
        bytes
    });
    assert_one_error_line(&out, &["model.safetensors", "truncated"]);
}

#[test]
fn an_unknown_model_type_is_one_error_line() {
    let out = generate_with_edited_llama("config.json", |bytes| {
        let mut config: Value = serde_json::from_slice(&bytes).unwrap();
        config["model_type"] = "transformer_xl".into();
        config.to_string().into_bytes()
    });
    assert_one_error_line(
        &out,
        &["config.json", "unknown model_type \"transformer_xl\""],
    );
}

#[test]
fn a_trace_of_an_unknown_format_is_one_error_line() {
    let scratch = Scratch::new("format");
    let mut trace = golden(TRACE);
    trace["format"] = "verity-trace/99".into();
    let path = scratch.write_json("future.json", &trace);
    let out = verity(&["replay", path.to_str().unwrap(), "--root", &root_arg()]);
    assert_one_error_line(
        &out,
        &["future.json", "unknown trace format \"verity-trace/99\""],
    );
}

#[test]
fn a_trace_that_is_not_json_is_one_error_line() {
    let scratch = Scratch::new("not-json");
    let path = scratch.0.join("garbage.json");
    fs::write(&path, "{ this is not json").unwrap();
    let out = verity(&["replay", path.to_str().unwrap(), "--root", &root_arg()]);
    assert_one_error_line(&out, &["garbage.json", "not a verity trace"]);
}

#[test]
fn generate_streams_the_same_tokens_as_the_golden_trace() {
    // The greedy chat golden of the trained target: `verity generate` must print its text.
    let trace = golden("qwen3-target/greedy/chat");
    let model = root().join("golden/models/qwen3-target");
    let prompt = trace["prompt"]["text"].as_str().unwrap();
    let max = trace["params"]["max_tokens"].as_u64().unwrap().to_string();
    let out = verity(&[
        "generate",
        "--model",
        model.to_str().unwrap(),
        "--prompt",
        prompt,
        "--max-tokens",
        &max,
    ]);
    assert_eq!(
        out.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let stdout = String::from_utf8_lossy(&out.stdout);
    // The recorder's `text` decodes every step; an EOS step is not printed (as in mlx-lm).
    let expected = trace["text"].as_str().unwrap();
    let expected = if trace["finish_reason"] == "stop" {
        expected.trim_end_matches("<|im_end|>")
    } else {
        expected
    };
    assert_eq!(stdout.trim_end_matches('\n'), expected);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("tokens-per-sec") && stderr.contains("Peak memory"),
        "{stderr}"
    );
}

/// `bench rows` on the CPU: every case, both ways, keeps every row and step of plain decoding
/// alone and repeats its bits on another run, and plain decoding repeats its own; it exits 0.
#[test]
fn bench_rows_reports_rows_and_repeats_on_the_cpu() {
    let model = root().join("golden/models/qwen3-target");
    let model = model.to_string_lossy();
    let out = verity(&[
        "bench",
        "rows",
        "--model",
        &model,
        "--prompts",
        "2",
        "--max-tokens",
        "4",
        "--draft-tokens",
        "1",
        "--runs",
        "1",
        "--json",
    ]);
    assert_eq!(
        out.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let report: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(report["plain_repeats"], true);
    let cases = report["cases"].as_array().unwrap();
    assert_eq!(cases.len(), 10, "5 cases, each with both kernels");
    for case in cases {
        assert_eq!(case["rows_equal"], case["rows"], "{case}");
        assert_eq!(case["bits_equal"], case["steps"], "{case}");
        assert_eq!(case["repeats"], 1, "{case}");
        assert_eq!(case["runs"], 1, "{case}");
    }
}

/// `verity bench speed` on `model` alone with the shortest rows and `extra` flags; its JSON.
fn bench_speed_json(model: &Path, extra: &[&str]) -> Value {
    let model = model.to_string_lossy();
    let mut args = vec!["bench", "speed", "--model", &model];
    args.extend_from_slice(extra);
    args.extend([
        "--no-mlx-lm",
        "--runs",
        "1",
        "--prompt-lens",
        "16",
        "--decode-tokens",
        "4",
        "--json",
    ]);
    let out = verity(&args);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).unwrap()
}

/// `bench speed` runs every row and prints the table (verity alone: the oracle venv is not part
/// of the test setup). No timing is asserted: speed is judged by the bench, never by a test.
#[test]
fn bench_speed_prints_every_row() {
    let model = root().join("golden/models/qwen3-target");
    let draft = root().join("golden/models/qwen3-draft");
    let dflash = root().join("golden/models/qwen3-target-dflash");
    // The drafter named adds its row between plain and n-gram (one drafter per run).
    let drafters = [
        ("--draft-model", &draft, "text prompt, draft model k=3"),
        ("--draft-dflash", &dflash, "text prompt, DFlash drafter"),
    ];
    for (flag, dir, row) in drafters {
        let doc = bench_speed_json(&model, &[flag, &dir.to_string_lossy()]);
        let rows: Vec<&str> = doc["rows"]
            .as_array()
            .unwrap()
            .iter()
            .map(|r| r["row"].as_str().unwrap())
            .collect();
        assert_eq!(
            rows,
            [
                "prefill 16",
                "ttft 16",
                "decode after 16",
                "  build per token after 16",
                "  enqueue per token after 16",
                "  wait per token after 16",
                "peak memory 16, prefill",
                "peak memory 16",
                "text prompt, plain",
                row,
                "text prompt, n-gram k=3",
                "text prompt, regex grammar",
                "cold start (load + 1 token)",
            ]
        );
        for r in doc["rows"].as_array().unwrap() {
            let median = r["verity"]["median"].as_f64().unwrap();
            assert!(median.is_finite() && median > 0.0, "{r}");
            assert!(r["mlx_lm"].is_null());
        }
        assert!(doc["floor_tok_s"].as_f64().unwrap() > 0.0);
    }
}

/// The bandwidth floor counts the bytes a decode step reads: a dense model's every weight, a
/// mixture of experts' expert weights only for the share of experts a token uses (qwen3_moe's
/// fixture: 2 of 8, stored one tensor an expert as Hugging Face does).
#[test]
fn bench_speeds_floor_counts_the_experts_a_token_reads() {
    let weight_bytes = |name: &str| {
        let model = root().join("golden/models").join(name);
        let doc = bench_speed_json(&model, &[]);
        let file = std::fs::metadata(model.join("model.safetensors"))
            .unwrap()
            .len();
        (doc["weight_bytes"].as_u64().unwrap(), file)
    };
    let (dense, file) = weight_bytes("llama");
    assert!(
        dense < file && dense > file - 16 * 1024,
        "{dense} of {file}"
    );
    let (moe, file) = weight_bytes("qwen3_moe");
    // Most of the fixture is its experts: reading a quarter of them is about half the file.
    assert!(
        moe < file * 6 / 10 && moe > file * 4 / 10,
        "{moe} of {file}"
    );
}

/// `verity bench serve` hands verity serve any drafter the draft flags name (mlx_lm.server has
/// none but a draft model): Qwen3.5's MTP head drafts in every round.
#[test]
fn bench_serve_speculates_with_any_drafter() {
    let model = root().join("golden/models/qwen3_5");
    let out = verity(&[
        "bench",
        "serve",
        "--model",
        &model.to_string_lossy(),
        "--draft-mtp",
        "--num-draft-tokens",
        "2",
        "--clients",
        "2",
        "--requests",
        "2",
        "--max-tokens",
        "6",
        "--no-mlx-lm",
        "--python",
        "python3",
        "--json",
    ]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    let doc: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(doc["mlx_lm_speculates"], false, "{doc}");
    let level = &doc["levels"][0];
    assert_eq!(level["verity"]["completion_tokens"], 12, "{level}");
    // Drafts in every round, at most the two asked for (fewer where max_tokens is near).
    let drafted = level["verity"]["engine"]["drafted_per_round"]
        .as_f64()
        .unwrap();
    assert!(drafted > 1.0 && drafted <= 2.0, "{level}");
}

/// An mlx_lm.server that exits before listening (here a Python without mlx_lm) is reported
/// with the last lines it wrote to stderr, as bad input.
#[test]
fn bench_serve_says_why_mlx_lm_server_did_not_start() {
    use std::os::unix::fs::PermissionsExt;
    let dir = Scratch::new("python-without-mlx-lm");
    let python = dir.0.join("python");
    let script = "#!/bin/sh\necho \"ModuleNotFoundError: No module named 'mlx_lm'\" >&2\nexit 1\n";
    fs::write(&python, script).unwrap();
    fs::set_permissions(&python, fs::Permissions::from_mode(0o755)).unwrap();
    let model = root().join("golden/models/qwen3-target");
    let out = verity(&[
        "bench",
        "serve",
        "--model",
        &model.to_string_lossy(),
        "--python",
        &python.to_string_lossy(),
        "--clients",
        "1",
    ]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    let line = stderr.lines().find(|l| l.starts_with("error:")).unwrap();
    assert!(
        line.contains(&format!("{} -m mlx_lm.server", python.display())),
        "{line}"
    );
    assert!(line.contains("No module named 'mlx_lm'"), "{line}");
}

/// `verity bench serve`'s bad counts are refused before any server starts, naming the flag.
#[test]
fn bench_serve_refuses_bad_counts() {
    let model = root().join("golden/models/qwen3-target");
    let draft = root().join("golden/models/qwen3-draft");
    let (model, draft) = (model.to_string_lossy(), draft.to_string_lossy());
    for (flags, needle) in [
        (&["--clients", "1,0"][..], "--clients is [1, 0]"),
        (&["--requests", "0"], "--requests is 0"),
        (
            &["--draft-model", &draft, "--num-draft-tokens", "0"],
            "--num-draft-tokens is 0",
        ),
    ] {
        let mut args = vec!["bench", "serve", "--model", &model, "--no-mlx-lm"];
        args.extend(flags);
        assert_one_error_line(&verity(&args), &[needle, "at least 1"]);
    }
}

/// `verity bench serve` against verity alone: a server child on loopback, the client driver
/// (stdlib Python) at each level, one report per level with every request answered and the
/// engine's step counters over it, and the server's log on stderr at RUST_LOG's level.
#[test]
fn bench_serve_reports_every_level() {
    let model = root().join("golden/models/qwen3-target");
    mlx::jit::isolate_per_test_slot();
    let mut bench = std::process::Command::new(env!("CARGO_BIN_EXE_verity"));
    bench.env("RUST_LOG", "info").args([
        "--device",
        "cpu",
        "bench",
        "serve",
        "--model",
        &model.to_string_lossy(),
        "--clients",
        "1,3",
        "--requests",
        "3",
        "--max-tokens",
        "4",
        "--no-mlx-lm",
        "--python",
        "python3",
        "--json",
    ]);
    let out = bench.output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    // Every request the server answered, the warm-up rounds' (two per client) included.
    let finished = stderr.lines().filter(|l| l.contains(": finished ")).count();
    assert_eq!(finished, 2 * (1 + 3) + 2 * 3, "{stderr}");
    let doc: Value = serde_json::from_slice(&out.stdout).unwrap();
    let levels = doc["levels"].as_array().unwrap();
    let clients: Vec<u64> = levels
        .iter()
        .map(|l| l["clients"].as_u64().unwrap())
        .collect();
    assert_eq!(clients, [1, 3]);
    for l in levels {
        let v = &l["verity"];
        assert_eq!(v["requests"], 3, "{l}");
        assert_eq!(v["completion_tokens"], 12, "{l}");
        assert!(v["errors"].as_array().unwrap().is_empty(), "{l}");
        assert!(v["tok_s"].as_f64().unwrap() > 0.0, "{l}");
        assert!(l["mlx_lm"].is_null() && l["ratio"].is_null(), "{l}");
        // The engine's counters over the level, inside the wall time: one row-step per token,
        // and one more per request, the step ahead enqueued before its last token was read.
        let e = &v["engine"];
        let steps = e["steps"].as_f64().unwrap();
        let row_steps = steps * e["rows_per_step"].as_f64().unwrap();
        assert!((row_steps - 15.0).abs() < 1e-9, "{l}");
        if l["clients"] == 1 {
            assert_eq!(steps, 15.0, "{l}");
        }
        let in_steps = e["seconds_in_steps"].as_f64().unwrap();
        let wall = e["wall_s"].as_f64().unwrap();
        assert!(in_steps > 0.0 && in_steps <= wall, "{l}");
        // The wall time splits into the steps, the phases outside them and the idle rest.
        let outside: f64 = ["join", "keep", "finish"]
            .map(|p| e["seconds_outside_steps"][p].as_f64().unwrap())
            .iter()
            .sum();
        let idle = e["seconds_idle"].as_f64().unwrap();
        assert!((in_steps + outside + idle - wall).abs() < 1e-9, "{l}");
        assert!(e["accepted_per_round"].is_null(), "{l}");
    }
}
