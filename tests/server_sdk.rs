//! The official OpenAI Python SDK against `verity serve` (nextest profile `sdk`, run by .ci/run
//! after it installs the SDK into target/sdk-venv): tests/server_sdk.py makes chat, streaming,
//! logprobs, completion, json_schema and bad requests through the SDK's own types, and this test
//! checks what it parsed against the same requests sent as raw HTTP. The SDK's Python is
//! target/sdk-venv/bin/python, or VERITY_SDK_PYTHON; a missing one is a failure.

mod server_client;
mod support;

use std::path::PathBuf;
use std::process::Command;

use serde_json::{json, Value};
use server_client::Server;
use support::{model_dir, root};

fn sdk_python() -> PathBuf {
    std::env::var_os("VERITY_SDK_PYTHON")
        .map(PathBuf::from)
        .unwrap_or_else(|| root().join("target/sdk-venv/bin/python"))
}

#[test]
fn the_openai_sdk_talks_to_verity_serve() {
    let s = Server::start(&model_dir("qwen3-target"), &[]);
    let python = sdk_python();
    let out = Command::new(&python)
        .arg(root().join("tests/server_sdk.py"))
        .arg(&s.base)
        .output()
        .unwrap_or_else(|e| panic!("{}: {e} (install the SDK: see .ci/run)", python.display()));
    assert!(
        out.status.success(),
        "{}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    let sdk: Value = serde_json::from_slice(&out.stdout).unwrap();

    let messages = json!([{"role": "user", "content": "What does the function os.path.join do?"}]);
    let raw = s.ok(
        "/v1/chat/completions",
        &json!({"messages": messages, "max_tokens": 24}),
    );
    let content = raw["choices"][0]["message"]["content"].as_str().unwrap();
    assert!(!content.is_empty());
    assert_eq!(sdk["chat"]["content"], content);
    assert_eq!(
        sdk["chat"]["finish_reason"],
        raw["choices"][0]["finish_reason"]
    );
    assert_eq!(
        sdk["chat"]["completion_tokens"],
        raw["usage"]["completion_tokens"]
    );
    assert_eq!(sdk["chat"]["prompt_tokens"], raw["usage"]["prompt_tokens"]);
    assert_eq!(sdk["stream"]["content"], content);
    assert_eq!(
        sdk["stream"]["finish_reason"],
        raw["choices"][0]["finish_reason"]
    );
    assert_eq!(
        sdk["stream"]["completion_tokens"],
        raw["usage"]["completion_tokens"]
    );

    let raw = s.ok(
        "/v1/chat/completions",
        &json!({"messages": messages, "max_tokens": 6, "logprobs": true, "top_logprobs": 3}),
    );
    let entries = raw["choices"][0]["logprobs"]["content"].as_array().unwrap();
    let sdk_entries = sdk["logprobs"].as_array().unwrap();
    assert_eq!(sdk_entries.len(), entries.len());
    for (s_e, e) in sdk_entries.iter().zip(entries) {
        assert_eq!(s_e["token"], e["token"]);
        assert_eq!(
            s_e["logprob"].as_f64().unwrap() as f32,
            e["logprob"].as_f64().unwrap() as f32
        );
        let top: Vec<&Value> = e["top_logprobs"]
            .as_array()
            .unwrap()
            .iter()
            .map(|t| &t["token"])
            .collect();
        assert_eq!(
            s_e["top"].as_array().unwrap().iter().collect::<Vec<_>>(),
            top
        );
    }

    let raw = s.ok(
        "/v1/completions",
        &json!({"prompt": "def read_config(path):", "max_tokens": 16}),
    );
    assert_eq!(sdk["completion"]["text"], raw["choices"][0]["text"]);
    assert_eq!(
        sdk["completion"]["finish_reason"],
        raw["choices"][0]["finish_reason"]
    );

    assert!(
        sdk["json"] == json!({"pick": "red"}) || sdk["json"] == json!({"pick": "green"}),
        "{}",
        sdk["json"]
    );
    assert_eq!(
        sdk["bad"],
        json!({"status": 400, "param": "temperature", "type": "invalid_request_error"})
    );
}
