//! `verity judge` end to end: verity's own engine answered through the protocol's files gets
//! the very document `verity check --json` gives; the goldens' own steps as an engine's answers
//! pass, one changed token diverges (exit 1) with the report naming the step; each kind of bad
//! response is refused with exit 2 naming the case. The default run uses a few cases (--only);
//! the mlx-lm adapter over the whole CPU set runs in the nextest profile `mlx-lm` (its
//! Python is oracles/.venv/bin/python, or VERITY_ORACLE_PYTHON; a missing one is a failure).

use std::fs;
use std::path::PathBuf;
use std::process::{Command, Output};

use serde_json::{json, Value};

mod support;

use support::{oracle_python, root, verity_cpu as verity};

/// A scratch folder for one test's files.
struct Scratch(PathBuf);

impl Scratch {
    fn new(name: &str) -> Scratch {
        let dir = std::env::temp_dir().join(format!("verity-judge-{name}-{}", std::process::id()));
        let _ = fs::remove_dir_all(&dir);
        fs::create_dir_all(&dir).unwrap();
        Scratch(dir)
    }

    fn path(&self, name: &str) -> String {
        self.0.join(name).to_string_lossy().into_owned()
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

fn succeeded(out: &Output, what: &str) {
    assert!(
        out.status.success(),
        "{what}: {}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

/// `verity judge export --only <only>` into the scratch folder; returns the requests.
fn export(s: &Scratch, only: &str) -> Vec<Value> {
    let out = verity(&[
        "judge",
        "export",
        "--root",
        &root_arg(),
        "--only",
        only,
        "--out",
        &s.path("requests.jsonl"),
    ]);
    succeeded(&out, "export");
    read_lines(&s.path("requests.jsonl"))
}

fn read_lines(path: &str) -> Vec<Value> {
    fs::read_to_string(path)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

fn write_lines(path: &str, lines: &[Value]) {
    let text: String = lines.iter().map(|l| format!("{l}\n")).collect();
    fs::write(path, text).unwrap();
}

fn score(s: &Scratch, json: bool) -> Output {
    let (requests, responses) = (s.path("requests.jsonl"), s.path("responses.jsonl"));
    let mut args = vec!["judge", "score", &requests, &responses, "--root"];
    let root = root_arg();
    args.push(&root);
    if json {
        args.push("--json");
    }
    verity(&args)
}

fn json_doc(out: &Output, what: &str) -> Value {
    serde_json::from_slice(&out.stdout).unwrap_or_else(|e| {
        panic!(
            "{what}: not JSON ({e}): {}",
            String::from_utf8_lossy(&out.stderr)
        )
    })
}

/// The cases verity's answers through the files are checked on: a speculative trace of this
/// backend (from_draft flags) and of CUDA (teacher-forced, with the draft model's choices), a
/// known oracle bug's tier C and a batch row.
const SUBSETS: [&str; 3] = [
    "qwen3-target/spec-k1/chat",
    "qwen3-target/spec-repetition/chat",
    "qwen3-target/batch/chat",
];

#[test]
fn verity_through_the_files_gets_checks_verdicts() {
    for only in SUBSETS {
        let s = Scratch::new("respond");
        let requests = export(&s, only);
        assert!(!requests.is_empty(), "{only}");
        let out = verity(&[
            "judge",
            "respond",
            &s.path("requests.jsonl"),
            "--root",
            &root_arg(),
            "--out",
            &s.path("responses.jsonl"),
        ]);
        succeeded(&out, "respond");
        let judged = score(&s, true);
        let checked = verity(&["check", "--root", &root_arg(), "--only", only, "--json"]);
        assert_eq!(judged.status.code(), checked.status.code(), "{only}");
        assert_eq!(
            json_doc(&judged, "judge score"),
            json_doc(&checked, "check"),
            "{only}"
        );
    }
}

/// The oracle's own answer to a request, from its golden trace: the steps it generated, or
/// its view of the tokens to score.
fn oracle_answer(request: &Value) -> Value {
    let file = root().join(request["trace"].as_str().unwrap());
    let trace: Value = serde_json::from_str(&fs::read_to_string(file).unwrap()).unwrap();
    let steps = trace["steps"].as_array().unwrap();
    match request["mode"].as_str().unwrap() {
        "generate" => json!({
            "id": request["id"],
            "steps": steps,
            "finish_reason": trace["finish_reason"],
        }),
        "score" => json!({
            "id": request["id"],
            "scored": steps
                .iter()
                .map(|s| json!({"logprob": s["logprob"], "top": s["top"]}))
                .collect::<Vec<_>>(),
        }),
        mode => panic!("{}: no oracle answer for a {mode} request", request["id"]),
    }
}

/// A greedy plain case of both sets: generated here, teacher-forced for CUDA.
const PLAIN: &str = "qwen3-target/greedy/chat.json";

/// Exports [`PLAIN`] and writes the oracle's own answers; returns them and the requests.
fn oracle_files(s: &Scratch) -> (Vec<Value>, Vec<Value>) {
    let requests = export(s, PLAIN);
    let modes: Vec<&str> = requests
        .iter()
        .map(|r| r["mode"].as_str().unwrap())
        .collect();
    assert_eq!(modes, ["generate", "score"], "{requests:?}");
    let responses: Vec<Value> = requests.iter().map(oracle_answer).collect();
    write_lines(&s.path("responses.jsonl"), &responses);
    (requests, responses)
}

#[test]
fn the_oracles_own_answers_pass_and_a_changed_token_diverges_at_its_step() {
    let s = Scratch::new("diverge");
    let (_, mut responses) = oracle_files(&s);
    let out = score(&s, false);
    assert_eq!(
        out.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&out.stdout)
    );
    // Step 3 emits the oracle's second choice instead, with that choice's logprob: a valid
    // answer that differs.
    let at = 3;
    let step = &mut responses[0]["steps"][at];
    let (token, logprob) = (step["top"][1][0].clone(), step["top"][1][1].clone());
    step["token"] = token;
    step["logprob"] = logprob;
    write_lines(&s.path("responses.jsonl"), &responses);
    let out = score(&s, false);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(1), "{stdout}");
    let id = PLAIN.trim_end_matches(".json");
    assert!(
        stdout.contains(&format!("FAIL {id}: first difference at step {at} ")),
        "{stdout}"
    );
    let doc = json_doc(&score(&s, true), "score --json");
    assert_eq!(doc["failed"], 1);
    assert_eq!(doc["traces"][0]["status"], "fail");
}

/// Asserts exit 2 and one `error:` line naming every needle.
fn refused(out: &Output, what: &str, needles: &[&str]) {
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{what}: {stderr}");
    let lines: Vec<&str> = stderr.lines().collect();
    assert_eq!(lines.len(), 1, "{what}: one error line, got {stderr}");
    for needle in needles {
        assert!(
            lines[0].contains(needle),
            "{what}: no {needle:?} in {stderr}"
        );
    }
}

#[test]
fn each_kind_of_bad_response_is_refused_naming_the_case() {
    let s = Scratch::new("bad");
    let (requests, good) = oracle_files(&s);
    let generated = requests[0]["id"].as_str().unwrap();
    let scored = requests[1]["id"].as_str().unwrap();
    let vocab = requests[0]["vocab_size"].as_u64().unwrap();
    let max_tokens = requests[0]["params"]["max_tokens"].as_u64().unwrap() as usize;
    type Corrupt = Box<dyn Fn(&mut Vec<Value>)>;
    let cases: Vec<(&str, &str, Corrupt, &[&str])> = vec![
        (
            "missing",
            scored,
            Box::new(|r| {
                r.pop();
            }),
            &["no response"],
        ),
        (
            "unknown",
            "traces/no-such/case",
            Box::new(|r| r[0]["id"] = json!("traces/no-such/case")),
            &["not in the requests"],
        ),
        (
            "duplicate",
            generated,
            Box::new(|r| r.push(r[0].clone())),
            &["answered twice"],
        ),
        (
            "steps",
            generated,
            // A "length" answer short of max_tokens, or a "stop" one past it.
            Box::new(move |r| {
                let steps = r[0]["steps"].as_array().unwrap().len();
                if steps == max_tokens {
                    let first = r[0]["steps"][0].clone();
                    r[0]["steps"].as_array_mut().unwrap().push(first);
                    r[0]["finish_reason"] = json!("stop");
                } else {
                    r[0]["finish_reason"] = json!("length");
                }
            }),
            &["steps", "max_tokens"],
        ),
        (
            "scored",
            scored,
            Box::new(|r| {
                r[1]["scored"].as_array_mut().unwrap().pop();
            }),
            &["scored has", "tokens to score"],
        ),
        (
            "positive",
            generated,
            Box::new(|r| r[0]["steps"][2]["logprob"] = json!(0.5)),
            &["steps[2]", "0.5", "at most 0"],
        ),
        (
            "vocabulary",
            scored,
            Box::new(move |r| r[1]["scored"][1]["top"][4][0] = json!(vocab)),
            &["scored[1].top[4]", "past the vocabulary"],
        ),
        (
            "order",
            generated,
            Box::new(|r| {
                let top = r[0]["steps"][0]["top"].as_array_mut().unwrap();
                top.swap(0, 1);
            }),
            &["steps[0]", "not in order"],
        ),
    ];
    for (what, case, corrupt, needles) in cases {
        let mut responses = good.clone();
        corrupt(&mut responses);
        write_lines(&s.path("responses.jsonl"), &responses);
        let mut needles = needles.to_vec();
        needles.push(case);
        refused(&score(&s, false), what, &needles);
    }
    // Python's json module writes NaN bare; the refusal still names the case and the value.
    let mut responses = good.clone();
    let sentinel = -123.25;
    responses[0]["steps"][1]["logprob"] = json!(sentinel);
    write_lines(&s.path("responses.jsonl"), &responses);
    let text = fs::read_to_string(s.path("responses.jsonl")).unwrap();
    let text = text.replacen(&sentinel.to_string(), "NaN", 1);
    fs::write(s.path("responses.jsonl"), text).unwrap();
    refused(
        &score(&s, false),
        "NaN",
        &[generated, "steps[1]", "NaN", "finite"],
    );
}

/// mlx-lm itself, answering every CPU golden through the protocol (oracles/judge_mlx_lm.py):
/// every mlx-lm case it generates comes out at tier A, and it declines only the cases it
/// cannot run (mlx-vlm's drafters and positioned keys) and the tier C ones (its own bug).
#[test]
fn mlx_lm_answers_through_the_protocol_at_tier_a() {
    let s = Scratch::new("mlx-lm");
    let traces = root().join("golden/traces");
    let out = verity(&[
        "judge",
        "export",
        "--root",
        &root_arg(),
        "--traces",
        &traces.to_string_lossy(),
        "--out",
        &s.path("requests.jsonl"),
    ]);
    succeeded(&out, "export");
    let python = oracle_python();
    let out = Command::new(&python)
        .arg(root().join("oracles/judge_mlx_lm.py"))
        .args([s.path("requests.jsonl"), s.path("responses.jsonl")])
        .output()
        .unwrap_or_else(|e| panic!("{}: {e} (run oracles/venv.sh)", python.display()));
    succeeded(&out, "oracles/judge_mlx_lm.py");
    let requests = read_lines(&s.path("requests.jsonl"));
    let responses = read_lines(&s.path("responses.jsonl"));
    let doc = json_doc(&score(&s, true), "score --json");
    let traces = doc["traces"].as_array().unwrap();
    assert_eq!(traces.len(), requests.len());
    let mut tier_a = 0;
    for ((request, response), judged) in requests.iter().zip(&responses).zip(traces) {
        let id = request["id"].as_str().unwrap();
        assert_eq!(response["id"], request["id"]);
        let unsupported = response["unsupported"].as_str();
        let mlx_lm = request["oracle"]["tool"] == "mlx-lm";
        match (request["mode"].as_str().unwrap(), unsupported) {
            ("generate", None) if mlx_lm => {
                assert_eq!(judged["status"], "pass", "{id}: {}", judged["report"]);
                assert_eq!(request["tier"], "A", "{id}");
                tier_a += 1;
            }
            ("tier-c", Some(why)) => assert!(why.contains("oracle with the bug"), "{id}: {why}"),
            (_, Some(why)) if !mlx_lm => {
                assert!(why.contains("mlx-lm"), "{id}: {why}");
            }
            (_, None) if !mlx_lm => assert_ne!(judged["status"], "fail", "{id}"),
            (mode, answer) => panic!("{id}: a {mode} mlx-lm case answered {answer:?}"),
        }
    }
    let declined = responses.iter().filter(|r| r["unsupported"].is_string());
    eprintln!(
        "mlx-lm: {tier_a} mlx-lm goldens at tier A of {} requests; {} declined",
        requests.len(),
        declined.count()
    );
    assert!(tier_a > 0);
}
