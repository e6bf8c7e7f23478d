//! The official OpenAI Python SDK against `verity serve` (nextest profile `sdk`, run by .ci/run
//! after it installs the SDK into target/sdk-venv): tests/server_sdk.py makes chat, streaming,
//! logprobs, completion, json_schema and bad requests through the SDK's own types, and this test
//! checks what it parsed against the same requests sent as raw HTTP; on qwen3-chat it makes a
//! tool call round trip (a call, the tool's result sent back, the answer). The SDK's Python is
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

/// What tests/server_sdk.py prints against `s` (its arguments after the base URL).
fn run_sdk(s: &Server, args: &[&str]) -> Value {
    let python = sdk_python();
    let out = Command::new(&python)
        .arg(root().join("tests/server_sdk.py"))
        .arg(&s.base)
        .args(args)
        .output()
        .unwrap_or_else(|e| panic!("{}: {e} (install the SDK: see .ci/run)", python.display()));
    assert!(
        out.status.success(),
        "{}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).unwrap()
}

#[test]
fn the_openai_sdk_talks_to_verity_serve() {
    let s = Server::start(&model_dir("qwen3-target"), &[]);
    let sdk = run_sdk(&s, &[]);

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

/// The SDK's tool call round trip on qwen3-chat, checked against the same requests as raw HTTP:
/// the call it parsed, the answer to the tool's result (whose prompt renders the assistant's
/// call and the tool message), the streamed call, and a call forced by tool_choice.
#[test]
fn the_openai_sdk_makes_a_tool_call_round_trip() {
    let s = Server::start(&model_dir("qwen3-chat"), &[]);
    let sdk = run_sdk(&s, &["tools"]);
    let weather = json!({"type": "function", "function": {
        "name": "get_weather", "description": "The weather in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}});
    let ask = json!([{"role": "user", "content": "What is the weather in Paris?"}]);
    let raw = s.ok(
        "/v1/chat/completions",
        &json!({"messages": ask, "tools": [weather], "max_tokens": 96}),
    );
    let message = &raw["choices"][0]["message"];
    let call = &message["tool_calls"][0];
    assert_eq!(raw["choices"][0]["finish_reason"], "tool_calls");
    assert_eq!(sdk["call"]["finish_reason"], "tool_calls");
    assert_eq!(sdk["call"]["name"], call["function"]["name"]);
    assert_eq!(sdk["call"]["arguments"], call["function"]["arguments"]);
    assert_eq!(sdk["call"]["type"], "function");
    assert_eq!(sdk["call"]["calls"], 1);
    assert_eq!(sdk["call"]["content"], message["content"]);
    assert_eq!(sdk["call"]["reasoning"], message["reasoning"]);
    let arguments: Value = serde_json::from_str(call["function"]["arguments"].as_str().unwrap())
        .expect("the arguments are JSON");
    assert!(arguments["city"].is_string(), "{arguments}");

    // The SDK sent back its own message with the call and the tool's result.
    let messages = &sdk["answer"]["messages"];
    assert_eq!(
        messages[1]["tool_calls"][0]["function"]["name"],
        "get_weather"
    );
    assert_eq!(messages[2]["role"], "tool");
    let raw = s.ok(
        "/v1/chat/completions",
        &json!({"messages": messages, "tools": [weather], "max_tokens": 96}),
    );
    let answer = raw["choices"][0]["message"]["content"].as_str().unwrap();
    assert!(!answer.is_empty());
    assert!(
        raw["choices"][0]["message"].get("tool_calls").is_none(),
        "{raw}"
    );
    assert_eq!(sdk["answer"]["content"], answer);
    assert_eq!(sdk["answer"]["finish_reason"], "stop");
    assert_eq!(
        sdk["answer"]["prompt_tokens"],
        raw["usage"]["prompt_tokens"]
    );

    assert_eq!(sdk["stream_call"]["finish_reason"], "tool_calls");
    assert_eq!(
        sdk["stream_call"]["calls"],
        json!([{"index": 0, "name": call["function"]["name"], "arguments": call["function"]["arguments"]}])
    );
    assert_eq!(sdk["forced"]["name"], "get_weather");
    assert_eq!(sdk["forced"]["finish_reason"], "tool_calls");
    assert!(
        sdk["forced"]["arguments"]["city"].is_string(),
        "{}",
        sdk["forced"]
    );
}
