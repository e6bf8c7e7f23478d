//! `verity serve` over real HTTP: each test starts the real binary on 127.0.0.1 port 0 (reading
//! the bound address from its stdout) on a fixture model and talks to it with an HTTP client.
//! Greedy output is checked against `verity generate`, streaming against non-streaming,
//! speculative against plain, and every refusal for its 400 body.

mod server_client;
mod support;

use std::io::{BufRead, BufReader};
use std::process::Command;
use std::sync::Arc;
use std::thread;

use serde_json::{json, Map, Value};
use server_client::Server;
use support::model_dir;
use verity::tokenizer::Tokenizer;

const TARGET: &str = "qwen3-target";

fn chat(content: &str, max_tokens: usize) -> Value {
    json!({"model": "m", "messages": [{"role": "user", "content": content}], "max_tokens": max_tokens})
}

fn content(v: &Value) -> &str {
    v["choices"][0]["message"]["content"].as_str().unwrap()
}

fn finish(v: &Value) -> &str {
    v["choices"][0]["finish_reason"].as_str().unwrap()
}

/// Usage without the cached-token detail (which a warm prefix cache changes).
fn counts(usage: &Value) -> [u64; 3] {
    ["prompt_tokens", "completion_tokens", "total_tokens"].map(|k| usage[k].as_u64().unwrap())
}

fn completion_tokens(v: &Value) -> u64 {
    v["usage"]["completion_tokens"].as_u64().unwrap()
}

/// The concatenated delta text, the finish reason and the usage of a chat stream.
fn joined(chunks: &[Value]) -> (String, String, Value) {
    let mut text = String::new();
    let mut finish = None;
    let mut usage = Value::Null;
    for c in chunks {
        if let Some(choice) = c["choices"].get(0) {
            text.push_str(choice["delta"]["content"].as_str().unwrap_or(""));
            if let Some(f) = choice["finish_reason"].as_str() {
                assert!(finish.is_none(), "two finish reasons");
                finish = Some(f.to_string());
            }
        } else {
            usage = c["usage"].clone();
        }
    }
    (text, finish.expect("a finish reason"), usage)
}

#[test]
fn health_and_models_answer() {
    let s = Server::start(&model_dir(TARGET), &[]);
    assert_eq!(s.get("/health"), (200, json!({"status": "ok"})));
    let (status, models) = s.get("/v1/models");
    assert_eq!(status, 200);
    assert_eq!(models["object"], "list");
    assert!(models["data"][0]["id"].as_str().unwrap().ends_with(TARGET));
    let (status, body) = s.get("/v1/nothing");
    assert_eq!(status, 404);
    assert_eq!(body["error"]["code"], "unknown_url");
}

#[test]
fn greedy_chat_equals_verity_generate() {
    let prompt = "Write a function that reads a file.";
    let out = Command::new(env!("CARGO_BIN_EXE_verity"))
        .args([
            "--device", "cpu", "generate", "-m", "40", "--prompt", prompt, "--model",
        ])
        .arg(model_dir(TARGET))
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let stdout = String::from_utf8(out.stdout).unwrap();
    let expected = stdout.strip_suffix('\n').unwrap();
    let stderr = String::from_utf8(out.stderr).unwrap();
    let generated: u64 = stderr
        .lines()
        .find_map(|l| l.strip_prefix("Generation: "))
        .and_then(|l| l.split(' ').next())
        .unwrap()
        .parse()
        .unwrap();

    let s = Server::start(&model_dir(TARGET), &[]);
    let v = s.ok("/v1/chat/completions", &chat(prompt, 40));
    assert!(!expected.is_empty());
    assert_eq!(content(&v), expected);
    assert_eq!(completion_tokens(&v), generated);
    assert_eq!(v["object"], "chat.completion");
    let stats = &v["verity_stats"];
    assert_eq!(stats["completion_tokens"].as_u64(), Some(generated));
    assert!(stats["decode_tokens_per_second"].as_f64().unwrap() > 0.0);
}

#[test]
fn streaming_equals_non_streaming() {
    let s = Server::start(&model_dir(TARGET), &[]);
    for (path, body) in [
        ("/v1/chat/completions", chat("Tell me about rivers.", 48)),
        ("/v1/chat/completions", {
            let mut b = chat("Count to ten.", 60);
            b["temperature"] = json!(0.8);
            b["seed"] = json!(7);
            b
        }),
        (
            "/v1/completions",
            json!({"prompt": "def main():", "max_tokens": 30}),
        ),
    ] {
        let whole = s.ok(path, &body);
        let mut streamed = body.clone();
        streamed["stream"] = json!(true);
        streamed["stream_options"] = json!({"include_usage": true});
        let chunks = s.stream(path, &streamed);
        if path == "/v1/completions" {
            let text: String = chunks
                .iter()
                .filter_map(|c| c["choices"].get(0)?["text"].as_str())
                .collect();
            assert_eq!(text, whole["choices"][0]["text"].as_str().unwrap());
            assert_eq!(
                counts(&chunks.last().unwrap()["usage"]),
                counts(&whole["usage"])
            );
        } else {
            let (text, fin, usage) = joined(&chunks);
            assert_eq!(text, content(&whole));
            assert_eq!(fin, finish(&whole));
            assert_eq!(counts(&usage), counts(&whole["usage"]));
            assert!(chunks
                .iter()
                .all(|c| c["object"] == "chat.completion.chunk"));
        }
    }
}

#[test]
fn max_tokens_and_stop_sequences_are_exact() {
    let s = Server::start(&model_dir(TARGET), &[]);
    // EOS (ids 0 and 2) banned, so the text runs to max_tokens.
    let no_eos = json!({"2": -100, "0": -100});
    let mut body = chat("Write a function that reads a file.", 32);
    body["logit_bias"] = no_eos.clone();
    body["logprobs"] = json!(true);
    let full = s.ok("/v1/chat/completions", &body);
    assert_eq!(finish(&full), "length");
    assert_eq!(completion_tokens(&full), 32);
    let text = content(&full).to_string();
    let ids: Vec<u64> = full["choices"][0]["logprobs"]["content"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["id"].as_u64().unwrap())
        .collect();
    assert_eq!(ids.len(), 32);

    // A stop sequence from the middle of the text, spanning a token boundary.
    let chars: Vec<char> = text.chars().collect();
    let stop: String = chars[chars.len() / 2..chars.len() / 2 + 3].iter().collect();
    let cut = &text[..text.find(&stop).unwrap()];
    // The token whose text completes the first occurrence of the stop sequence.
    let detok = |n: usize| {
        let mut t = String::new();
        for e in &full["choices"][0]["logprobs"]["content"]
            .as_array()
            .unwrap()[..n]
        {
            t.push_str(e["token"].as_str().unwrap());
        }
        t
    };
    let stopping = (1..=ids.len()).find(|&n| detok(n).contains(&stop)).unwrap();

    for stream in [false, true] {
        let mut b = chat("Write a function that reads a file.", 32);
        b["logit_bias"] = no_eos.clone();
        b["stop"] = json!(["never in this text", stop]);
        b["stream"] = json!(stream);
        b["stream_options"] = json!({"include_usage": true});
        let (got, fin, usage) = if stream {
            joined(&s.stream("/v1/chat/completions", &b))
        } else {
            let v = s.ok("/v1/chat/completions", &b);
            (
                content(&v).to_string(),
                finish(&v).to_string(),
                v["usage"].clone(),
            )
        };
        assert_eq!(got, cut, "stream {stream}");
        assert_eq!(fin, "stop");
        assert_eq!(usage["completion_tokens"].as_u64(), Some(stopping as u64));
    }
}

#[test]
fn logprobs_are_sorted_and_name_the_chosen_token() {
    let s = Server::start(&model_dir(TARGET), &[]);
    let mut body = chat("Name three colours.", 12);
    body["logprobs"] = json!(true);
    body["top_logprobs"] = json!(5);
    let v = s.ok("/v1/chat/completions", &body);
    let entries = v["choices"][0]["logprobs"]["content"].as_array().unwrap();
    assert_eq!(entries.len() as u64, completion_tokens(&v));
    for e in entries {
        let top = e["top_logprobs"].as_array().unwrap();
        assert_eq!(top.len(), 5);
        for pair in top.windows(2) {
            let (a, b) = (
                pair[0]["logprob"].as_f64().unwrap(),
                pair[1]["logprob"].as_f64().unwrap(),
            );
            assert!(
                a > b || (a == b && pair[0]["id"].as_u64() < pair[1]["id"].as_u64()),
                "{top:?}"
            );
        }
        // Greedy: the chosen token is the most likely one.
        assert_eq!(e["id"], top[0]["id"]);
        assert_eq!(e["logprob"], top[0]["logprob"]);
        assert!(e["logprob"].as_f64().unwrap() <= 0.0);
    }
}

#[test]
fn response_format_json_schema_constrains_the_output() {
    let s = Server::start(&model_dir(TARGET), &[]);
    let mut body = chat("Pick one.", 64);
    body["response_format"] = json!({"type": "json_schema", "json_schema": {"name": "pick", "schema": {
        "type": "object",
        "properties": {"pick": {"enum": ["red", "green"]}},
        "required": ["pick"],
        "additionalProperties": false,
    }}});
    let v = s.ok("/v1/chat/completions", &body);
    assert_eq!(finish(&v), "stop");
    let parsed: Value = serde_json::from_str(content(&v)).unwrap();
    assert!(
        parsed == json!({"pick": "red"}) || parsed == json!({"pick": "green"}),
        "{parsed}"
    );
}

/// `tool_choice` forcing a call (mlx_lm.server has no such grammar, so there is no golden): the
/// answer is one call whose arguments validate against the tool's parameters schema, finished
/// as "tool_calls", and with a draft model it is the same call token for token and logprob bit
/// for bit (grammar + speculation ≡ grammar alone), greedy and sampled.
#[test]
fn a_forced_tool_call_follows_the_schema_and_speculation_keeps_it() {
    let template = support::root().join("golden/models/qwen3-chat/chat_template.jinja");
    let template = template.to_str().unwrap();
    let draft = model_dir("qwen3-draft");
    let plain = Server::start(&model_dir(TARGET), &["--chat-template", template]);
    let spec = Server::start(
        &model_dir(TARGET),
        &[
            "--chat-template",
            template,
            "--draft-model",
            draft.to_str().unwrap(),
            "--num-draft-tokens",
            "3",
        ],
    );
    let trip = json!({"type": "object", "properties": {
        "city": {"enum": ["Paris", "Rome", "Oslo"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 9}},
        "required": ["city", "days"], "additionalProperties": false});
    let clock = json!({"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}},
        "required": ["zone"], "additionalProperties": false});
    let tools = json!([
        {"type": "function", "function": {"name": "plan_trip", "parameters": trip}},
        {"type": "function", "function": {"name": "get_time", "parameters": clock}},
    ]);
    let named = json!({"type": "function", "function": {"name": "plan_trip"}});
    for (choice, temperature) in [(named.clone(), 0.0), (json!("required"), 0.0), (named, 0.9)] {
        let body = json!({"messages": [{"role": "user", "content": "Where should I go?"}],
            "tools": tools, "tool_choice": choice, "max_tokens": 96, "temperature": temperature,
            "seed": 7, "logprobs": true});
        let a = plain.ok("/v1/chat/completions", &body);
        let b = spec.ok("/v1/chat/completions", &body);
        assert_eq!(finish(&a), "tool_calls", "{a}");
        let calls = a["choices"][0]["message"]["tool_calls"].as_array().unwrap();
        assert_eq!(calls.len(), 1, "{a}");
        let name = calls[0]["function"]["name"].as_str().unwrap();
        let arguments: Value =
            serde_json::from_str(calls[0]["function"]["arguments"].as_str().unwrap()).unwrap();
        let schema = if name == "plan_trip" { &trip } else { &clock };
        assert!(choice == "required" || name == "plan_trip", "{a}");
        assert!(
            jsonschema::is_valid(schema, &arguments),
            "{name}: {arguments}"
        );
        let tokens = |v: &Value| -> Vec<(Value, f32)> {
            v["choices"][0]["logprobs"]["content"]
                .as_array()
                .unwrap()
                .iter()
                .map(|e| (e["id"].clone(), e["logprob"].as_f64().unwrap() as f32))
                .collect()
        };
        assert_eq!(tokens(&a), tokens(&b), "{choice}: speculative differs");
        let message = |v: &Value| {
            let mut m = v["choices"][0]["message"].clone();
            m["tool_calls"][0].as_object_mut().unwrap().remove("id");
            m
        };
        assert_eq!(message(&a), message(&b));
    }
}

/// Under tool_choice "auto" every call the model starts is held to a given tool's schema:
/// qwen3-chat was trained to call get_weather for Paris, and a schema that allows only Rome or
/// Oslo makes its call one of those, while its reasoning and text stay its own; an n-gram
/// drafter gives the same answer token for token and logprob bit for bit, greedy and sampled.
#[test]
fn calls_the_model_starts_follow_the_schema_and_speculation_keeps_them() {
    let plain = Server::start(&model_dir("qwen3-chat"), &[]);
    let spec = Server::start(&model_dir("qwen3-chat"), &["--draft-ngram"]);
    let cities = json!({"type": "object", "properties": {"city": {"enum": ["Rome", "Oslo"]}},
        "required": ["city"], "additionalProperties": false});
    let tools =
        json!([{"type": "function", "function": {"name": "get_weather", "parameters": cities}}]);
    for (temperature, seed) in [(0.0, 0), (1.0, 1), (1.0, 2)] {
        let body = json!({"messages": [{"role": "user", "content": "What is the weather in Paris?"}],
            "tools": tools, "max_tokens": 96, "temperature": temperature, "seed": seed,
            "logprobs": true});
        let a = plain.ok("/v1/chat/completions", &body);
        let b = spec.ok("/v1/chat/completions", &body);
        assert_eq!(finish(&a), "tool_calls", "{a}");
        let message = &a["choices"][0]["message"];
        assert!(
            message["reasoning"].as_str().is_some_and(|r| !r.is_empty()),
            "{a}"
        );
        assert_eq!(message["reasoning_content"], message["reasoning"], "{a}");
        let calls = message["tool_calls"].as_array().unwrap();
        assert_eq!(calls.len(), 1, "{a}");
        let arguments: Value =
            serde_json::from_str(calls[0]["function"]["arguments"].as_str().unwrap()).unwrap();
        assert!(jsonschema::is_valid(&cities, &arguments), "{arguments}");
        let tokens = |v: &Value| -> Vec<(Value, f32)> {
            v["choices"][0]["logprobs"]["content"]
                .as_array()
                .unwrap()
                .iter()
                .map(|e| (e["id"].clone(), e["logprob"].as_f64().unwrap() as f32))
                .collect()
        };
        assert_eq!(
            tokens(&a),
            tokens(&b),
            "temperature {temperature}: n-grams differ"
        );
    }
}

#[test]
fn speculative_serving_equals_plain() {
    let plain = Server::start(&model_dir(TARGET), &[]);
    let draft = model_dir("qwen3-draft");
    let drafted = Server::start(
        &model_dir(TARGET),
        &["--draft-model", draft.to_str().unwrap()],
    );
    let ngram = Server::start(
        &model_dir(TARGET),
        &["--draft-ngram", "--num-draft-tokens", "2"],
    );
    for prompt in [
        "Write a function that reads a file.",
        "Tell me about rivers.",
    ] {
        let mut body = chat(prompt, 40);
        body["stop"] = json!("\n\n");
        body["logprobs"] = json!(true);
        let want = plain.ok("/v1/chat/completions", &body);
        assert!(want["verity_stats"].get("speculation").is_none());
        for server in [&drafted, &ngram] {
            let got = server.ok("/v1/chat/completions", &body);
            assert_eq!(content(&got), content(&want), "{prompt}");
            assert_eq!(finish(&got), finish(&want));
            assert_eq!(got["usage"], want["usage"]);
            assert_eq!(
                got["choices"][0]["logprobs"],
                want["choices"][0]["logprobs"]
            );
            let spec = &got["verity_stats"]["speculation"];
            assert!(spec["rounds"].as_u64().unwrap() > 0, "{spec}");
        }
    }
}

#[test]
fn native_drafter_lanes_equal_plain() {
    let dflash = model_dir("qwen3-target-dflash");
    // A split MTP folder (`--draft-mtp DIR`) serves a conversion that carries no mtp.* weights.
    let split = model_dir("qwen3_5-trained-mtp");
    let lanes: [(&str, &[&str]); 3] = [
        ("qwen3_5", &["--draft-mtp"]),
        ("qwen3_5-4bit", &["--draft-mtp", split.to_str().unwrap()]),
        (TARGET, &["--draft-dflash", dflash.to_str().unwrap()]),
    ];
    for (target, args) in lanes {
        let plain = Server::start(&model_dir(target), &[]);
        let drafted = Server::start(&model_dir(target), args);
        let mut body = chat("Write a function that reads a file.", 40);
        body["logprobs"] = json!(true);
        let want = plain.ok("/v1/chat/completions", &body);
        // Twice: the second request starts from a cached prefix (the DFlash lane's with the
        // target's taps over it, which its drafter reads as context).
        for round in 0..2 {
            let got = drafted.ok("/v1/chat/completions", &body);
            assert_eq!(answer(&got), answer(&want), "{args:?} request {round}");
            let spec = &got["verity_stats"]["speculation"];
            assert!(spec["rounds"].as_u64().unwrap() > 0, "{args:?}: {spec}");
            let cached = cached_tokens(&got);
            assert_eq!(
                cached > 0,
                round == 1,
                "{args:?} request {round}: {cached} cached"
            );
        }
    }
}

#[test]
fn bad_requests_are_400_naming_the_field_and_the_server_goes_on() {
    let s = Server::start(&model_dir(TARGET), &[]);
    let good = chat("hi", 4);
    let with = |k: &str, v: Value| {
        let mut b = good.clone();
        b[k] = v;
        b
    };
    let long_prompt: Vec<u32> = (0..4097).map(|i| 10 + i % 500).collect();
    let cases: Vec<(&str, Value, Option<&str>, &[&str])> = vec![
        (
            "/v1/chat/completions",
            with("temperature", json!(-1)),
            Some("temperature"),
            &["temperature is -1, must be a number >= 0"],
        ),
        (
            "/v1/chat/completions",
            with("temperature", json!("hot")),
            Some("temperature"),
            &["\"hot\""],
        ),
        (
            "/v1/chat/completions",
            with("max_tokens", json!(4_294_967_295u64)),
            Some("max_tokens"),
            &[
                "max_tokens is 4294967295",
                "of the model's context of 4096 tokens",
            ],
        ),
        (
            "/v1/chat/completions",
            with("top_p", json!(1.5)),
            Some("top_p"),
            &["1.5"],
        ),
        (
            "/v1/chat/completions",
            with("min_p", json!(-0.1)),
            Some("min_p"),
            &["-0.1"],
        ),
        (
            "/v1/chat/completions",
            with("top_k", json!(2.5)),
            Some("top_k"),
            &["2.5"],
        ),
        (
            "/v1/chat/completions",
            with("top_k", json!(5000)),
            None,
            &["top_k", "5000"],
        ),
        (
            "/v1/chat/completions",
            with("max_tokens", json!(0)),
            Some("max_tokens"),
            &["0"],
        ),
        (
            "/v1/chat/completions",
            with("max_tokens", json!("10")),
            Some("max_tokens"),
            &["\"10\""],
        ),
        (
            "/v1/chat/completions",
            with("max_completion_tokens", json!(-3)),
            Some("max_completion_tokens"),
            &["-3"],
        ),
        (
            "/v1/chat/completions",
            with("seed", json!(-1)),
            Some("seed"),
            &["-1"],
        ),
        (
            "/v1/chat/completions",
            with("stream", json!("yes")),
            Some("stream"),
            &["\"yes\""],
        ),
        (
            "/v1/chat/completions",
            with("stop", json!(5)),
            Some("stop"),
            &["5"],
        ),
        (
            "/v1/chat/completions",
            with("stop", json!([""])),
            Some("stop"),
            &["empty"],
        ),
        (
            "/v1/chat/completions",
            with("n", json!(2)),
            Some("n"),
            &["2", "only 1"],
        ),
        (
            "/v1/chat/completions",
            with("logit_bias", json!({"x": 1})),
            Some("logit_bias"),
            &["\"x\""],
        ),
        (
            "/v1/chat/completions",
            with("logit_bias", json!({"5": 1000})),
            Some("logit_bias"),
            &["1000"],
        ),
        (
            "/v1/chat/completions",
            with("logit_bias", json!({"99999": 1})),
            None,
            &["99999", "vocabulary"],
        ),
        (
            "/v1/chat/completions",
            with("top_logprobs", json!(3)),
            Some("top_logprobs"),
            &["logprobs"],
        ),
        (
            "/v1/chat/completions",
            with("top_logprobs", json!(21)),
            Some("top_logprobs"),
            &["21"],
        ),
        (
            "/v1/chat/completions",
            with("repetition_penalty", json!(-2)),
            Some("repetition_penalty"),
            &["-2"],
        ),
        (
            "/v1/chat/completions",
            with("messages", json!([])),
            Some("messages"),
            &["non-empty"],
        ),
        (
            "/v1/chat/completions",
            with("messages", json!([{"content": "x"}])),
            Some("messages[0].role"),
            &["null"],
        ),
        (
            "/v1/chat/completions",
            with("messages", json!("hi")),
            Some("messages"),
            &["\"hi\""],
        ),
        (
            "/v1/chat/completions",
            json!({"max_tokens": 3}),
            Some("messages"),
            &["missing"],
        ),
        (
            "/v1/chat/completions",
            with("response_format", json!({"type": "xml"})),
            Some("response_format.type"),
            &["\"xml\""],
        ),
        (
            "/v1/chat/completions",
            with(
                "response_format",
                json!({"type": "json_schema", "json_schema": {"schema": {"type": "nonsense"}}}),
            ),
            None,
            &["nonsense"],
        ),
        (
            "/v1/chat/completions",
            with("num_draft_tokens", json!(0)),
            Some("num_draft_tokens"),
            &["0"],
        ),
        (
            "/v1/chat/completions",
            json!([1, 2]),
            Some("body"),
            &["an array"],
        ),
        (
            "/v1/completions",
            json!({"prompt": 5}),
            Some("prompt"),
            &["5"],
        ),
        (
            "/v1/completions",
            json!({"prompt": [1, -2]}),
            Some("prompt"),
            &["-2"],
        ),
        (
            "/v1/chat/completions",
            with("tools", json!({"type": "function"})),
            Some("tools"),
            &[
                "tools is {\"type\":\"function\"}",
                "must be an array of function tools",
            ],
        ),
        (
            "/v1/chat/completions",
            with(
                "tools",
                json!([{"type": "function", "function": {"description": "x"}}]),
            ),
            Some("tools[0].function.name"),
            &[
                "tools[0].function.name is null",
                "must be a non-empty string",
            ],
        ),
        (
            "/v1/chat/completions",
            with(
                "tools",
                json!([{"type": "function", "function": {"name": "f", "parameters": "city"}}]),
            ),
            Some("tools[0].function.parameters"),
            &["\"city\"", "must be a JSON schema object"],
        ),
        (
            "/v1/chat/completions",
            with(
                "tool_choice",
                json!({"type": "function", "function": {"name": "nope"}}),
            ),
            Some("tool_choice"),
            &["\"nope\"", "not in tools"],
        ),
        (
            "/v1/chat/completions",
            with("tool_choice", json!("always")),
            Some("tool_choice"),
            &["\"always\"", "must be \"none\", \"auto\", \"required\""],
        ),
        (
            "/v1/chat/completions",
            with("tool_choice", json!("required")),
            Some("tool_choice"),
            &["the request has no tools"],
        ),
        (
            "/v1/chat/completions",
            with("chat_template_kwargs", json!(["enable_thinking"])),
            Some("chat_template_kwargs"),
            &["[\"enable_thinking\"]", "must be an object"],
        ),
        (
            "/v1/chat/completions",
            with("xtc_probability", json!(1.5)),
            Some("xtc_probability"),
            &["xtc_probability is 1.5, must be a number from 0 to 1"],
        ),
        (
            "/v1/chat/completions",
            with("xtc_threshold", json!(0.7)),
            Some("xtc_threshold"),
            &["xtc_threshold is 0.7, must be a number from 0 to 0.5"],
        ),
        (
            "/v1/chat/completions",
            json!({"messages": [{"role": "user", "content": "hi"},
                                {"role": "assistant", "content": null, "tool_calls": [
                                    {"id": "c", "type": "function",
                                     "function": {"name": "f", "arguments": "{city"}}]}]}),
            Some("messages[1].tool_calls[0].function.arguments"),
            &["\"{city\"", "must be JSON"],
        ),
        (
            "/v1/chat/completions",
            with(
                "tools",
                json!([{"type": "function", "function": {"name": "f"}}]),
            )
            .as_object()
            .map(|b| {
                let mut b = Value::Object(b.clone());
                b["tool_choice"] = json!("required");
                b
            })
            .unwrap(),
            Some("tool_choice"),
            &["no tool-call format verity parses"],
        ),
        (
            "/v1/completions",
            json!({"prompt": [5000]}),
            None,
            &["5000", "vocabulary"],
        ),
        (
            "/v1/completions",
            json!({"prompt": long_prompt}),
            Some("prompt"),
            &["4097", "4096"],
        ),
        (
            "/v1/completions",
            json!({"prompt": "x", "logprobs": 30}),
            Some("logprobs"),
            &["30"],
        ),
    ];
    for (path, body, param, needles) in &cases {
        let (status, v) = s.post(path, body);
        let body: String = body.to_string().chars().take(120).collect();
        assert_eq!(status, 400, "{body}: {v}");
        let e = &v["error"];
        assert_eq!(e["type"], "invalid_request_error", "{v}");
        if let Some(p) = param {
            assert_eq!(e["param"], *p, "{body}: {v}");
        }
        let message = e["message"].as_str().unwrap();
        for n in *needles {
            assert!(message.contains(n), "{body}: {message:?} lacks {n:?}");
        }
    }
    let (status, v) = s.post_raw("/v1/chat/completions", "{not json");
    assert_eq!(status, 400);
    assert_eq!(v["error"]["param"], "body");
    // Unknown fields are ignored, and the server still serves.
    let ok = s.ok("/v1/chat/completions", &with("frobnicate", json!({"a": 1})));
    assert_eq!(completion_tokens(&ok), 4);
    let log = s.log.lock().unwrap().clone();
    assert!(!log.contains("panicked"), "{log}");
}

#[test]
fn a_disconnected_stream_is_cancelled_and_the_next_request_equals_a_cold_run() {
    let s = Server::start(&model_dir(TARGET), &[]);
    let next = chat("Tell me about rivers.", 24);
    let cold = s.ok("/v1/chat/completions", &next);

    let mut long = chat("Write a long story.", 4000);
    long["stream"] = json!(true);
    long["logit_bias"] = json!({"2": -100, "0": -100});
    let lines = s.open_stream("/v1/chat/completions", &long, 3);
    drop(lines);

    let warm = s.ok("/v1/chat/completions", &next);
    assert_eq!(content(&warm), content(&cold));
    assert_eq!(counts(&warm["usage"]), counts(&cold["usage"]));
    assert!(
        cached_tokens(&warm) > 0,
        "served from the prefix the cold run left"
    );
    // The cancelled request's own prefix was kept consistent: continuing from it equals a
    // cold run of the same prompt.
    let mut short = long.clone();
    short["stream"] = json!(false);
    short["max_tokens"] = json!(16);
    let resumed = s.ok("/v1/chat/completions", &short);
    assert!(cached_tokens(&resumed) > 0);
    let fresh = Server::start(&model_dir(TARGET), &["--prompt-cache-bytes", "0"]);
    let cold_long = fresh.ok("/v1/chat/completions", &short);
    assert_eq!(content(&resumed), content(&cold_long));
    assert_eq!(counts(&resumed["usage"]), counts(&cold_long["usage"]));
    let log = s.log_when(|l| l.contains("cancelled by the client tokens="));
    let cancelled: usize = log
        .lines()
        .find_map(|l| l.split("cancelled by the client tokens=").nth(1))
        .unwrap_or_else(|| panic!("no cancellation in the log: {log}"))
        .parse()
        .unwrap();
    assert!((3..4000).contains(&cancelled), "{cancelled}");
}

#[test]
fn a_full_queue_answers_503_with_retry_after() {
    let s = Arc::new(Server::start(
        &model_dir(TARGET),
        &["--queue-size", "1", "--max-num-seqs", "1"],
    ));
    let mut long = chat("Write a long story.", 4000);
    long["stream"] = json!(true);
    long["logit_bias"] = json!({"2": -100, "0": -100});
    // One request runs, one waits, the rest are refused at once. An accepted stream is
    // dropped as soon as its 200 arrives, which cancels it and lets the waiting one start.
    let clients: Vec<_> = (0..4)
        .map(|_| {
            let (s, body) = (s.clone(), long.clone());
            thread::spawn(move || {
                let mut r = s
                    .agent
                    .post(format!("{}/v1/chat/completions", s.base))
                    .send_json(&body)
                    .unwrap();
                let status = r.status().as_u16();
                if status == 503 {
                    assert_eq!(r.headers()["retry-after"], "1");
                    let v: Value = r.body_mut().read_json().unwrap();
                    assert_eq!(v["error"]["code"], "queue_full", "{v}");
                    assert_eq!(v["error"]["type"], "server_error");
                }
                status
            })
        })
        .collect();
    let statuses: Vec<u16> = clients.into_iter().map(|c| c.join().unwrap()).collect();
    assert!(
        statuses.iter().all(|&c| c == 200 || c == 503),
        "{statuses:?}"
    );
    assert!(statuses.contains(&503), "{statuses:?}");
    assert!(statuses.contains(&200), "{statuses:?}");
    let v = s.ok("/v1/chat/completions", &chat("hi", 3));
    assert_eq!(completion_tokens(&v), 3);
}

/// The message (content, reasoning, tool calls), the tokens (ids and logprob bits) and usage of
/// a chat answer.
fn answer(v: &Value) -> (Value, Value, Value) {
    let mut usage = v["usage"].clone();
    usage["prompt_tokens_details"] = Value::Null;
    (
        v["choices"][0]["message"].clone(),
        v["choices"][0]["logprobs"].clone(),
        usage,
    )
}

/// The value of `name=` in a line of the server's log.
fn field<'l>(line: &'l str, name: &str) -> Option<&'l str> {
    line.split(' ')
        .find_map(|w| w.strip_prefix(name)?.strip_prefix('='))
}

fn cached_tokens(v: &Value) -> u64 {
    v["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap()
}

#[test]
fn a_warm_prefix_cache_equals_a_cold_run_with_and_without_a_draft() {
    let draft = model_dir("qwen3-draft");
    let lanes: [&[&str]; 3] = [
        &[],
        &["--draft-model", draft.to_str().unwrap()],
        &["--draft-ngram"],
    ];
    for lane in lanes {
        let warm = Server::start(&model_dir(TARGET), lane);
        let cold_args: Vec<&str> = lane
            .iter()
            .copied()
            .chain(["--prompt-cache-bytes", "0"])
            .collect();
        let cold = Server::start(&model_dir(TARGET), &cold_args);
        let mut first = chat("What does the function os.path.join do?", 24);
        first["logprobs"] = json!(true);
        let a = warm.ok("/v1/chat/completions", &first);
        assert_eq!(cached_tokens(&a), 0, "{lane:?}");
        // The same request again: everything but the last prompt token comes from the cache.
        let again = warm.ok("/v1/chat/completions", &first);
        let prompt_tokens = again["usage"]["prompt_tokens"].as_u64().unwrap();
        assert_eq!(cached_tokens(&again), prompt_tokens - 1, "{lane:?}");
        assert_eq!(answer(&again), answer(&a), "{lane:?}");
        // A second turn continues the first: its prefix is cached, and the processors still
        // see the whole prompt (a repetition penalty over a long context).
        let second = json!({
            "messages": [
                {"role": "user", "content": "What does the function os.path.join do?"},
                {"role": "assistant", "content": content(&a)},
                {"role": "user", "content": "And os.path.split?"},
            ],
            "max_tokens": 32,
            "logprobs": true,
            "repetition_penalty": 1.3,
            "repetition_context_size": 64,
        });
        let w = warm.ok("/v1/chat/completions", &second);
        let c = cold.ok("/v1/chat/completions", &second);
        assert!(cached_tokens(&w) > 0, "{lane:?}: {}", w["usage"]);
        assert_eq!(cached_tokens(&c), 0);
        assert_eq!(answer(&w), answer(&c), "{lane:?}");
        assert_eq!(
            w["verity_stats"]["cached_tokens"].as_u64(),
            Some(cached_tokens(&w))
        );
    }
}

#[test]
fn each_turn_of_a_conversation_restores_the_last_answer_and_equals_a_cold_run() {
    let turns = [
        "Tell me about rivers.",
        "And the sea?",
        "Write a function that reads a file.",
        "Explain recursion briefly.",
        "Thanks.",
    ];
    // From the second turn on only the new message and the template's framing are prefilled:
    // the history up to the end of the last answer, as the template renders it, comes from the
    // cache (but the end of turn's last token), on a KV model, a hybrid and a sliding-window
    // one (trained, whose answers come back token for token, and random, whose rendered
    // answers are other tokens than those generated), quantized KV caches and speculative
    // lanes (a draft model's caches and a DFlash drafter's taps kept with the target's), one
    // request at a time as in a batch, and a thinking model whose reasoning the client does not
    // carry back (the template drops it from the history). --max-kv-size's windows past their size keep sink
    // tokens that a resumed prefill would attend and a cold one not: nothing is restored there.
    let (draft, dflash) = (model_dir("qwen3-draft"), model_dir("qwen3-target-dflash"));
    let lanes: [(&str, &[&str], bool); 12] = [
        (TARGET, &[], true),
        ("glm4_moe_lite", &[], true),
        ("glm4_moe_lite", &["--prefill-step-size", "16"], true),
        ("qwen3_5-trained", &[], true),
        ("qwen3_5", &[], true),
        ("gemma3", &[], true),
        (TARGET, &["--kv-bits", "8", "--kv-group-size", "32"], true),
        (TARGET, &["--draft-model", draft.to_str().unwrap()], true),
        (TARGET, &["--draft-dflash", dflash.to_str().unwrap()], true),
        (TARGET, &["--max-num-seqs", "1"], true),
        ("qwen3-chat", &[], true),
        (TARGET, &["--max-kv-size", "16"], false),
    ];
    for (model, args, restores) in lanes {
        let tokenizer = Tokenizer::from_dir(&model_dir(model)).unwrap();
        let history = |messages: &[Value]| {
            let text = tokenizer
                .apply_chat_template(messages, false, &Map::new())
                .unwrap();
            tokenizer.encode(&text, false).unwrap().len() as u64
        };
        let warm = Server::start(&model_dir(model), args);
        let cold_args = [args, &["--prompt-cache-bytes", "0"]].concat();
        let cold = Server::start(&model_dir(model), &cold_args);
        let mut messages: Vec<Value> = Vec::new();
        for (k, turn) in turns.iter().enumerate() {
            let held = match (k, restores) {
                (0, _) | (_, false) => 0,
                _ => history(&messages) - 2,
            };
            messages.push(json!({"role": "user", "content": turn}));
            let body = json!({"messages": messages, "max_tokens": 12, "logprobs": true});
            let w = warm.ok("/v1/chat/completions", &body);
            let c = cold.ok("/v1/chat/completions", &body);
            assert_eq!(answer(&w), answer(&c), "{model} {args:?} turn {k}");
            assert_eq!(cached_tokens(&c), 0);
            assert_eq!(cached_tokens(&w), held, "{model} {args:?} turn {k}");
            // As a client carries the answer back: its content ("" when all of it was
            // reasoning), not its reasoning.
            let said = w["choices"][0]["message"]["content"].as_str().unwrap_or("");
            messages.push(json!({"role": "assistant", "content": said}));
        }
    }
}

#[test]
fn conversations_that_share_a_system_prompt_share_its_prefill_where_caches_cannot_be_cut_back() {
    // A hybrid and a sliding-window model's caches cannot be cut back to what two prompts
    // share: the end of the system messages is a checkpoint of its own, which the next
    // conversation with the same system prompt restores (usage counts it from then on).
    let system = json!({"role": "system", "content": "You answer in one short line."});
    let user = |content: &str| json!({"role": "user", "content": content});
    for model in ["qwen3_5", "gemma3"] {
        let tokenizer = Tokenizer::from_dir(&model_dir(model)).unwrap();
        let encode = |messages: &[Value], generation: bool| {
            let text = tokenizer
                .apply_chat_template(messages, generation, &Map::new())
                .unwrap();
            tokenizer.encode(&text, false).unwrap()
        };
        let opening = encode(&[system.clone(), user("")], false);
        let warm = Server::start(&model_dir(model), &[]);
        let cold = Server::start(&model_dir(model), &["--prompt-cache-bytes", "0"]);
        for (k, ask) in ["Tell me about rivers.", "Explain recursion briefly."]
            .iter()
            .enumerate()
        {
            let messages = [system.clone(), user(ask)];
            let prompt = encode(&messages, true);
            let shared = opening
                .iter()
                .zip(&prompt)
                .take_while(|(a, b)| a == b)
                .count();
            let body = json!({"messages": messages, "max_tokens": 8, "logprobs": true});
            let w = warm.ok("/v1/chat/completions", &body);
            let c = cold.ok("/v1/chat/completions", &body);
            assert_eq!(answer(&w), answer(&c), "{model} conversation {k}");
            let held = if k == 0 { 0 } else { shared as u64 };
            assert_eq!(cached_tokens(&w), held, "{model} conversation {k}");
        }
    }
}

#[test]
fn the_prefix_cache_stays_within_its_budget_evicting_the_least_recently_used() {
    let entry_bytes = {
        let s = Server::start(&model_dir(TARGET), &[]);
        s.ok("/v1/chat/completions", &chat("Say hello.", 2));
        let log = s.log_when(|l| l.contains("prefix_cache_entries=1 "));
        let line = log
            .lines()
            .find(|l| l.contains("prefix_cache_entries=1 "))
            .unwrap();
        let bytes: usize = field(line, "prefix_cache_bytes").unwrap().parse().unwrap();
        assert!(bytes > 0);
        bytes
    };
    // Room for one entry of these short prompts (their caches have the same capacity).
    let budget = (entry_bytes + entry_bytes / 2).to_string();
    let s = Server::start(&model_dir(TARGET), &["--prompt-cache-bytes", &budget]);
    let one = chat("Say hello.", 2);
    let two = chat("Count to ten.", 2);
    s.ok("/v1/chat/completions", &one);
    let whole = cached_tokens(&s.ok("/v1/chat/completions", &one));
    assert!(whole > 0);
    s.ok("/v1/chat/completions", &two);
    assert!(cached_tokens(&s.ok("/v1/chat/completions", &two)) > 0);
    // Its own entry evicted, `one` restores at most what it shares with `two` (the template's
    // opening), cut back from two's entry.
    let after = cached_tokens(&s.ok("/v1/chat/completions", &one));
    assert!(after < whole, "evicted: {after} of {whole} tokens restored");
    let log = s.log_when(|l| l.matches(" prefix_cache_bytes=").count() == 5);
    for line in log.lines().filter(|l| l.contains(" prefix_cache_bytes=")) {
        let bytes: usize = field(line, "prefix_cache_bytes").unwrap().parse().unwrap();
        assert!(bytes <= entry_bytes + entry_bytes / 2, "{line}");
    }
}

#[test]
fn a_client_gone_during_the_prefill_stops_it_at_the_next_chunk() {
    let s = Server::start(&model_dir(TARGET), &["--prefill-step-size", "4"]);
    let prompt: Vec<u32> = (0..4000).map(|i| 10 + i % 500).collect();
    for stream in [true, false] {
        let body = json!({"prompt": prompt, "max_tokens": 8, "stream": stream});
        let agent: ureq::Agent = ureq::Agent::config_builder()
            .timeout_global(Some(std::time::Duration::from_millis(300)))
            .build()
            .into();
        // Streaming: the 200 comes once the prefill starts, and the client leaves at once.
        // Not streaming: the client gives up waiting while the prompt is prefilled.
        let r = agent
            .post(format!("{}/v1/completions", s.base))
            .send_json(&body);
        assert_eq!(r.is_ok(), stream, "{:?}", r.err());
        drop(r);
        let v = s.ok(
            "/v1/completions",
            &json!({"prompt": "def f():", "max_tokens": 4}),
        );
        assert_eq!(completion_tokens(&v), 4);
    }
    let log = s.log_when(|l| {
        l.matches("cancelled by the client during the prefill")
            .count()
            == 2
    });
    assert_eq!(
        log.matches("cancelled by the client during the prefill")
            .count(),
        2,
        "{log}"
    );
}

#[test]
fn a_draft_that_does_not_fit_is_refused_at_startup() {
    let scratch = std::env::temp_dir().join(format!("verity-server-draft-{}", std::process::id()));
    std::fs::create_dir_all(&scratch).unwrap();
    for entry in std::fs::read_dir(model_dir("qwen3-draft")).unwrap() {
        let entry = entry.unwrap();
        std::fs::copy(entry.path(), scratch.join(entry.file_name())).unwrap();
    }
    let config = scratch.join("config.json");
    let mut c: Value = serde_json::from_str(&std::fs::read_to_string(&config).unwrap()).unwrap();
    c["vocab_size"] = json!(1000);
    std::fs::write(&config, c.to_string()).unwrap();
    // Its weights would not even load with this config: the refusal comes first.
    let out = Command::new(env!("CARGO_BIN_EXE_verity"))
        .args(["--device", "cpu", "serve", "--port", "0", "--model"])
        .arg(model_dir(TARGET))
        .arg("--draft-model")
        .arg(&scratch)
        .output()
        .unwrap();
    std::fs::remove_dir_all(&scratch).unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(out.stdout.is_empty(), "it must not listen");
    let stderr = String::from_utf8(out.stderr).unwrap();
    assert_eq!(stderr.lines().count(), 1, "{stderr}");
    for needle in ["draft model's vocabulary size", "1000", "1024"] {
        assert!(stderr.contains(needle), "{stderr}");
    }
}

/// Continuous batching: concurrent requests (different prompts, lengths and max_tokens,
/// streamed or not) decode in one batch, plain or speculative with a draft model (every row
/// drafting and verifying its own rounds in the batch's forwards), and each answer (text,
/// logprob bits, usage) equals the same request served alone, and plain alone.
#[test]
fn a_rust_log_that_does_not_parse_stops_the_server_naming_it() {
    let out = Command::new(env!("CARGO_BIN_EXE_verity"))
        .args(["--device", "cpu", "serve", "--port", "0", "--model"])
        .arg(model_dir(TARGET))
        .env("RUST_LOG", "verity=loudest")
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(stderr.starts_with("error: RUST_LOG: "), "{stderr}");
    assert!(out.stdout.is_empty(), "it never listened");
}

#[test]
fn concurrent_requests_batch_and_each_equals_its_answer_alone() {
    let draft = model_dir("qwen3-draft");
    let requests: Vec<Value> = (0..6)
        .map(|i| {
            let mut r = chat(&"Tell me about the sea. ".repeat(i + 1), 32 + 4 * i);
            // No EOS, so that the rows overlap for most of their steps.
            r["logit_bias"] = json!({"2": -100, "0": -100});
            r["logprobs"] = json!(true);
            r["top_logprobs"] = json!(2);
            r
        })
        .collect();
    let plain = Server::start(&model_dir(TARGET), &["--max-num-seqs", "1"]);
    let want: Vec<_> = requests
        .iter()
        .map(|r| answer(&plain.ok("/v1/chat/completions", r)))
        .collect();
    for args in [&[][..], &["--draft-model", draft.to_str().unwrap()][..]] {
        let s = Arc::new(Server::start(&model_dir(TARGET), args));
        let together: Vec<_> = requests
            .iter()
            .map(|r| {
                let (s, r) = (s.clone(), r.clone());
                thread::spawn(move || s.ok("/v1/chat/completions", &r))
            })
            .collect();
        let together: Vec<Value> = together.into_iter().map(|t| t.join().unwrap()).collect();
        let log = s.log_when(|l| l.matches(" finished ").count() == requests.len());
        let batched = |l: &&str| field(l, "batch_rows").is_some_and(|rows| rows != "1");
        assert!(
            log.lines().any(|l| batched(&l)),
            "{args:?}: no request was batched: {log}"
        );
        if !args.is_empty() {
            assert!(
                log.lines()
                    .filter(batched)
                    .any(|l| field(l, "speculative_rounds").is_some()),
                "{args:?}: no batched request speculated: {log}"
            );
        }
        let alone = Server::start(
            &model_dir(TARGET),
            &[args, &["--max-num-seqs", "1"]].concat(),
        );
        for ((r, got), want) in requests.iter().zip(&together).zip(&want) {
            let lone = answer(&alone.ok("/v1/chat/completions", r));
            assert_eq!(answer(got), lone, "{args:?}");
            assert_eq!(&lone, want, "{args:?}: speculation changed the answer");
        }
    }
}

/// A long prompt joining a running stream is prefilled a chunk at a time with the running row
/// stepping after each full chunk (mlx_lm.server interleaves prompt and decode steps too), so
/// the stream is held up a chunk at a time, not for the whole prefill; the joined answer equals
/// its request alone, with and without a drafter.
#[test]
fn a_long_prompt_joining_is_prefilled_between_the_running_rows_steps() {
    let draft = model_dir("qwen3-draft");
    let prompt: Vec<u32> = (0..400).map(|i| 10 + i % 300).collect();
    let join = json!({"prompt": prompt, "max_tokens": 6, "logprobs": 2});
    for args in [&[][..], &["--draft-model", draft.to_str().unwrap()][..]] {
        let s = Server::start(
            &model_dir(TARGET),
            &[args, &["--prefill-step-size", "16"]].concat(),
        );
        // The running row: EOS biased away and far more tokens than the join takes; it is
        // dropped once the joined request has its answer.
        let running = json!({"prompt": "def f():", "max_tokens": 4000, "stream": true,
            "logit_bias": {"2": -100, "0": -100}});
        let lines = s.open_stream("/v1/completions", &running, 2);
        let joined = s.ok("/v1/completions", &join);
        // A prompt shorter than a chunk joins without holding the running row up a step.
        let short = json!({"prompt": [5, 6, 7], "max_tokens": 2});
        s.ok("/v1/completions", &short);
        drop(lines);
        s.log_when(|l| l.contains("cancelled by the client tokens="));
        let alone = s.ok("/v1/completions", &join);
        assert_eq!(joined["choices"], alone["choices"], "{args:?}");
        let log = s.log_when(|l| l.matches(" finished ").count() == 3);
        let finished = |tokens: &str| {
            log.lines()
                .find(|l| l.contains(" finished ") && field(l, "prompt_tokens") == Some(tokens))
                .unwrap_or_else(|| panic!("{args:?}: no request of {tokens} tokens: {log}"))
        };
        let short = finished("3");
        assert_eq!(field(short, "batch_rows"), Some("2"), "{short}");
        assert_eq!(field(short, "interleaved_steps"), Some("0"), "{short}");
        let line = finished("400");
        // All but the last prompt token, in chunks of 16: 24 full ones and one of 15, after
        // which the running row steps with the joined one.
        let chunks = (prompt.len() - 1).div_ceil(16);
        let full = (prompt.len() - 1) / 16;
        assert!(full < chunks);
        assert_eq!(field(line, "batch_rows"), Some("2"), "{line}");
        assert_eq!(
            field(line, "prefill_chunks"),
            Some(&*chunks.to_string()),
            "{line}"
        );
        assert_eq!(
            field(line, "interleaved_steps"),
            Some(&*full.to_string()),
            "{args:?}: the running row did not step after every full chunk: {line}"
        );
    }
}

#[test]
fn sigterm_ends_every_open_stream_with_done_and_exits_0_within_the_drain_timeout() {
    let mut s = Server::start(&model_dir(TARGET), &["--shutdown-timeout", "1"]);
    let mut long = chat("Write a long story.", 4000);
    long["stream"] = json!(true);
    long["logit_bias"] = json!({"2": -100, "0": -100});
    let (started, streaming) = std::sync::mpsc::channel();
    let streams: Vec<_> = (0..8)
        .map(|_| {
            let (agent, url, body) = (
                s.agent.clone(),
                format!("{}/v1/chat/completions", s.base),
                long.clone(),
            );
            let started = started.clone();
            thread::spawn(move || {
                let r = agent.post(url).send_json(&body).unwrap();
                let (mut chunks, mut done) = (Vec::<Value>::new(), false);
                for line in BufReader::new(r.into_body().into_reader()).lines() {
                    let Some(data) = line.unwrap().strip_prefix("data: ").map(String::from) else {
                        continue;
                    };
                    if data == "[DONE]" {
                        done = true;
                        break;
                    }
                    chunks.push(serde_json::from_str(&data).unwrap());
                    if chunks.len() == 2 {
                        started.send(()).unwrap();
                    }
                }
                (chunks, done)
            })
        })
        .collect();
    for _ in 0..8 {
        streaming
            .recv_timeout(std::time::Duration::from_secs(120))
            .expect("every stream has started");
    }
    let signalled = std::time::Instant::now();
    s.signal("TERM");
    let status = s.wait_exit(std::time::Duration::from_secs(30));
    assert!(status.success(), "{status:?}: {}", s.log.lock().unwrap());
    // The drain timeout (1 s) and the cut requests' last chunks, well before the 5 s after the
    // cut at which the server would give up on them.
    let took = signalled.elapsed();
    assert!(took < std::time::Duration::from_secs(6), "took {took:?}");
    for stream in streams {
        let (chunks, done) = stream.join().unwrap();
        assert!(done, "a stream ended without [DONE]: {chunks:?}");
        let last = chunks.last().unwrap();
        assert_eq!(last["choices"][0]["finish_reason"], "shutdown", "{last}");
        let text: String = chunks
            .iter()
            .filter_map(|c| c["choices"][0]["delta"]["content"].as_str())
            .collect();
        assert!(!text.is_empty(), "the cut stream's text came through");
    }
    let log = s.log_when(|l| l.contains("every response is out"));
    assert_eq!(log.matches(" finish_reason=shutdown ").count(), 8, "{log}");
}
