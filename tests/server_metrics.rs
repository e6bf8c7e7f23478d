//! `verity serve`'s `/metrics` and request log over real HTTP on 127.0.0.1: after some
//! requests, every counter holds what their answers imply (tokens equal to the sums of their
//! usage, acceptance per draft position equal to their `verity_stats`), the queue and the
//! running rows show a waiting request, and each finished request logs one line in its span.

mod server_client;
mod support;

use std::collections::HashMap;
use std::sync::Arc;
use std::thread;
use std::time::{Duration, Instant};

use serde_json::{json, Value};
use server_client::Server;
use support::model_dir;

const TARGET: &str = "qwen3-target";

fn chat(content: &str, max_tokens: usize) -> Value {
    json!({"messages": [{"role": "user", "content": content}], "max_tokens": max_tokens})
}

/// The samples of a scrape, by name and labels as written (`verity_requests_total{...}`).
struct Scrape(HashMap<String, f64>);

impl Scrape {
    fn of(s: &Server) -> Scrape {
        let mut r = s.agent.get(format!("{}/metrics", s.base)).call().unwrap();
        assert_eq!(r.status().as_u16(), 200);
        let content_type = r.headers()["content-type"].to_str().unwrap().to_string();
        assert!(
            content_type.starts_with("application/openmetrics-text"),
            "{content_type}"
        );
        let text = r.body_mut().read_to_string().unwrap();
        assert!(text.ends_with("# EOF\n"), "{text}");
        let samples = text
            .lines()
            .filter(|l| !l.starts_with('#'))
            .map(|l| {
                let (key, value) = l.rsplit_once(' ').unwrap();
                (key.to_string(), value.parse().unwrap())
            })
            .collect();
        Scrape(samples)
    }

    /// A sample's value; 0 for a labelled sample not written yet (a family without it).
    fn get(&self, key: &str) -> f64 {
        match self.0.get(key) {
            Some(&v) => v,
            None if key.contains('{') => 0.0,
            None => panic!("no sample {key} in {:?}", self.0),
        }
    }
}

fn usage(v: &Value, key: &str) -> f64 {
    v["usage"][key].as_f64().unwrap()
}

fn cached(v: &Value) -> f64 {
    v["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_f64()
        .unwrap()
}

/// The value of `name=` in a log line.
fn field<'l>(line: &'l str, name: &str) -> Option<&'l str> {
    line.split(' ')
        .find_map(|w| w.strip_prefix(name)?.strip_prefix('='))
}

#[test]
fn counters_hold_what_the_answers_imply_and_each_request_logs_one_line() {
    let s = Server::start(&model_dir(TARGET), &[]);
    let before = Scrape::of(&s);
    for key in [
        "verity_queue_depth",
        "verity_running_requests",
        "verity_completion_tokens_total",
        "verity_prefix_cache_hits_total",
    ] {
        assert_eq!(before.get(key), 0.0, "{key}");
    }

    let mut answers = Vec::new();
    let hello = chat("Say hello.", 8);
    answers.push(s.ok("/v1/chat/completions", &hello));
    answers.push(s.ok("/v1/chat/completions", &hello));
    answers.push(s.ok("/v1/chat/completions", &chat("Tell me about rivers.", 12)));
    answers.push(s.ok(
        "/v1/completions",
        &json!({"prompt": "def main():", "max_tokens": 6}),
    ));
    let streamed = json!({"prompt": "import os", "max_tokens": 5, "stream": true,
        "stream_options": {"include_usage": true}});
    let chunks = s.stream("/v1/completions", &streamed);
    answers.push(chunks.last().unwrap().clone());
    let (status, _) = s.post(
        "/v1/chat/completions",
        &json!({"messages": [{"role": "user", "content": "hi"}], "temperature": -1}),
    );
    assert_eq!(status, 400);
    let (status, _) = s.post_raw("/v1/completions", "{not json");
    assert_eq!(status, 400);

    let m = Scrape::of(&s);
    let sum = |f: &dyn Fn(&Value) -> f64| answers.iter().map(f).sum::<f64>();
    assert_eq!(
        m.get("verity_completion_tokens_total"),
        sum(&|v| usage(v, "completion_tokens"))
    );
    assert_eq!(
        m.get("verity_prompt_tokens_total"),
        sum(&|v| usage(v, "prompt_tokens"))
    );
    let cached_sum = sum(&cached);
    assert!(cached_sum > 0.0, "the repeated prompt was served warm");
    // The engine thread's time outside the steps: joining the requests, keeping the first
    // answers' histories for the prefix cache, finishing rows and waiting for requests; and the
    // requests' time in the queue.
    for phase in ["join", "keep", "finish", "idle"] {
        let key = format!("verity_engine_seconds_total{{phase=\"{phase}\"}}");
        assert!(m.get(&key) > 0.0, "{key}");
    }
    assert!(m.get("verity_queue_seconds_total") > 0.0);
    assert_eq!(m.get("verity_cached_prompt_tokens_total"), cached_sum);
    let warm = answers.iter().filter(|v| cached(v) > 0.0).count() as f64;
    assert_eq!(m.get("verity_prefix_cache_hits_total"), warm);
    assert_eq!(
        m.get("verity_prefix_cache_misses_total"),
        answers.len() as f64 - warm
    );
    assert!(m.get("verity_prefix_cache_entries") >= 1.0);
    assert!(m.get("verity_prefix_cache_bytes") > 0.0);
    assert_eq!(m.get("verity_queue_depth"), 0.0);
    assert_eq!(m.get("verity_running_requests"), 0.0);
    // One request at a time: a step of one row per completion token, and one more per
    // request, the step ahead enqueued before its last token was read.
    let steps = sum(&|v| usage(v, "completion_tokens")) + answers.len() as f64;
    assert_eq!(m.get("verity_batch_steps_total"), steps);
    assert_eq!(m.get("verity_batch_step_rows_total"), steps);
    assert_eq!(
        m.get("verity_batch_shared_cache_steps_total"),
        0.0,
        "a lone row shares nothing"
    );
    let phase = |p: &str| m.get(&format!("verity_batch_step_seconds_total{{phase=\"{p}\"}}"));
    for p in ["build", "eval", "settle"] {
        assert!(phase(p) > 0.0, "{p}");
    }
    assert_eq!(phase("draft"), 0.0, "no row drafts");

    let mut finishes: HashMap<String, f64> = HashMap::new();
    for (i, v) in answers[..4].iter().enumerate() {
        let endpoint = if i < 3 { "chat" } else { "completion" };
        let finish = v["choices"][0]["finish_reason"].as_str().unwrap();
        *finishes
            .entry(format!("{endpoint}\",outcome=\"{finish}"))
            .or_default() += 1.0;
    }
    let streamed_finish = chunks
        .iter()
        .find_map(|c| c["choices"].get(0)?["finish_reason"].as_str())
        .unwrap();
    *finishes
        .entry(format!("completion\",outcome=\"{streamed_finish}"))
        .or_default() += 1.0;
    *finishes
        .entry("chat\",outcome=\"invalid".into())
        .or_default() += 1.0;
    *finishes
        .entry("completion\",outcome=\"invalid".into())
        .or_default() += 1.0;
    let requests: f64 =
        m.0.iter()
            .filter(|(k, _)| k.starts_with("verity_requests_total{"))
            .map(|(_, v)| v)
            .sum();
    assert_eq!(requests, 7.0, "{:?}", m.0);
    for (labels, n) in finishes {
        let key = format!("verity_requests_total{{endpoint=\"{labels}\"}}");
        assert_eq!(m.get(&key), n, "{key}");
    }

    // One line per finished request, each in its own span, with the tokens its usage reports.
    let log =
        s.log_when(|l| l.matches(" finished ").count() == 5 && l.matches(" refused ").count() == 2);
    let finished: Vec<&str> = log.lines().filter(|l| l.contains(" finished ")).collect();
    let mut ids: Vec<&str> = finished
        .iter()
        .map(|l| {
            l.split("request{id=")
                .nth(1)
                .unwrap()
                .split(' ')
                .next()
                .unwrap()
        })
        .collect();
    ids.sort_unstable();
    ids.dedup();
    assert_eq!(ids.len(), 5, "{log}");
    for (line, v) in finished.iter().zip(&answers) {
        let tokens: f64 = field(line, "completion_tokens").unwrap().parse().unwrap();
        assert_eq!(tokens, usage(v, "completion_tokens"), "{line}");
        assert!(field(line, "finish_reason").is_some(), "{line}");
        assert!(field(line, "duration").unwrap().ends_with('s'), "{line}");
    }
    let refused = log.lines().filter(|l| l.contains(" refused "));
    for line in refused {
        assert!(
            line.contains("request{id=") && line.contains(" status=400 "),
            "{line}"
        );
    }
}

#[test]
fn speculative_requests_move_the_acceptance_counters_of_their_lane() {
    let draft = model_dir("qwen3-draft");
    let lanes: [(&str, &[&str]); 2] = [
        ("draft_model", &["--draft-model", draft.to_str().unwrap()]),
        ("ngram", &["--draft-ngram", "--num-draft-tokens", "2"]),
    ];
    for (lane, args) in lanes {
        let s = Server::start(&model_dir(TARGET), args);
        let (mut drafted, mut accepted, mut rounds) = (Vec::new(), Vec::new(), 0.0);
        for prompt in ["Write a function that reads a file.", "Count to ten."] {
            let v = s.ok("/v1/chat/completions", &chat(prompt, 24));
            let spec = &v["verity_stats"]["speculation"];
            rounds += spec["rounds"].as_f64().unwrap();
            for (sum, key) in [
                (&mut drafted, "drafted_by_position"),
                (&mut accepted, "accepted_by_position"),
            ] {
                for (i, n) in spec[key].as_array().unwrap().iter().enumerate() {
                    if sum.len() <= i {
                        sum.push(0.0);
                    }
                    sum[i] += n.as_f64().unwrap();
                }
            }
        }
        assert!(rounds > 0.0 && !drafted.is_empty(), "{lane}");
        let m = Scrape::of(&s);
        assert_eq!(
            m.get(&format!(
                "verity_speculative_rounds_total{{lane=\"{lane}\"}}"
            )),
            rounds
        );
        for (name, sums) in [("drafted", &drafted), ("accepted", &accepted)] {
            for (position, &n) in sums.iter().enumerate() {
                let key = format!(
                    "verity_speculative_{name}_total{{lane=\"{lane}\",position=\"{position}\"}}"
                );
                assert_eq!(m.get(&key), n, "{key}");
            }
            let past = format!(
                "verity_speculative_{name}_total{{lane=\"{lane}\",position=\"{}\"}}",
                sums.len()
            );
            assert!(!m.0.contains_key(&past), "{past}");
        }
        let log = s.log_when(|l| l.matches(" finished ").count() == 2);
        assert!(
            log.lines()
                .filter(|l| l.contains(" finished "))
                .all(|l| field(l, "accepted_by_position").is_some()),
            "{log}"
        );
    }
}

/// With --adaptive-drafts a greedy request decodes some steps plain (the policy measures plain
/// steps after its first window of drafting) and answers, logprobs included, as plain serving
/// does; /metrics counts those steps.
#[test]
fn adaptive_drafts_answer_as_plain_and_count_their_undrafted_steps() {
    let draft = model_dir("qwen3-draft");
    let plain = Server::start(&model_dir(TARGET), &[]);
    let adaptive = Server::start(
        &model_dir(TARGET),
        &[
            "--draft-model",
            draft.to_str().unwrap(),
            "--adaptive-drafts",
        ],
    );
    let mut body = chat("Write a long story.", 48);
    body["logit_bias"] = json!({"2": -100, "0": -100});
    body["logprobs"] = json!(true);
    let want = plain.ok("/v1/chat/completions", &body);
    let got = adaptive.ok("/v1/chat/completions", &body);
    assert_eq!(got["choices"], want["choices"]);
    assert_eq!(usage(&got, "completion_tokens"), 48.0);
    let m = Scrape::of(&adaptive);
    let undrafted = m.get("verity_batch_undrafted_steps_total");
    assert!(undrafted >= 5.0, "{undrafted} undrafted steps");
    // A plain step is not a round: the request's counters hold the steps apart.
    let spec = &got["verity_stats"]["speculation"];
    assert_eq!(spec["undrafted_steps"].as_f64(), Some(undrafted));
    let rounds = spec["rounds"].as_f64().unwrap();
    assert_eq!(
        m.get("verity_speculative_rounds_total{lane=\"draft_model\"}"),
        rounds
    );
    assert_eq!(
        spec["target_calls"].as_f64(),
        Some(rounds + undrafted),
        "{spec}"
    );
    assert!(m.get("verity_batch_steps_total") > undrafted);
    assert_eq!(
        Scrape::of(&plain).get("verity_batch_undrafted_steps_total"),
        0.0
    );
}

/// Polls the metrics until `ready` holds for them; panics after 30 s.
fn scrape_when(s: &Server, ready: impl Fn(&Scrape) -> bool) -> Scrape {
    let start = Instant::now();
    loop {
        let m = Scrape::of(s);
        if ready(&m) {
            return m;
        }
        assert!(
            start.elapsed() < Duration::from_secs(30),
            "the metrics never got there: {:?}",
            m.0
        );
        thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn the_queue_depth_and_running_rows_show_a_waiting_request_and_a_cancel_is_counted() {
    let s = Arc::new(Server::start(&model_dir(TARGET), &["--max-num-seqs", "1"]));
    let mut long = chat("Write a long story.", 4000);
    long["stream"] = json!(true);
    long["logit_bias"] = json!({"2": -100, "0": -100});
    let lines = s.open_stream("/v1/chat/completions", &long, 2);
    // The long stream runs alone (--max-num-seqs 1), so the next request waits in the queue.
    let waiting = {
        let s = s.clone();
        thread::spawn(move || s.ok("/v1/chat/completions", &chat("hi", 3)))
    };
    let m = scrape_when(&s, |m| m.get("verity_queue_depth") == 1.0);
    assert_eq!(m.get("verity_running_requests"), 1.0);
    drop(lines);
    let v = waiting.join().unwrap();
    let finish = v["choices"][0]["finish_reason"]
        .as_str()
        .unwrap()
        .to_string();

    let m = Scrape::of(&s);
    assert_eq!(m.get("verity_queue_depth"), 0.0);
    assert_eq!(m.get("verity_running_requests"), 0.0);
    assert_eq!(
        m.get("verity_requests_total{endpoint=\"chat\",outcome=\"cancelled\"}"),
        1.0
    );
    assert_eq!(
        m.get(&format!(
            "verity_requests_total{{endpoint=\"chat\",outcome=\"{finish}\"}}"
        )),
        1.0
    );
    // The cancelled request's tokens reached no usage, so they are not counted.
    assert_eq!(
        m.get("verity_completion_tokens_total"),
        usage(&v, "completion_tokens")
    );
}

#[test]
fn plain_requests_decoding_together_share_their_kv_caches() {
    let s = Server::start(&model_dir(TARGET), &[]);
    let mut long = chat("Write a long story.", 4000);
    long["stream"] = json!(true);
    long["logit_bias"] = json!({"2": -100, "0": -100});
    let lines = s.open_stream("/v1/chat/completions", &long, 2);
    scrape_when(&s, |m| m.get("verity_running_requests") == 1.0);
    let before = Scrape::of(&s).get("verity_batch_shared_cache_steps_total");
    let v = s.ok("/v1/chat/completions", &chat("hi", 8));
    let after = Scrape::of(&s);
    drop(lines);
    // Every step of the short request but its joining one ran beside the stream.
    let steps = usage(&v, "completion_tokens");
    assert!(
        after.get("verity_batch_shared_cache_steps_total") - before >= steps - 1.0,
        "{steps} tokens beside a stream, {} steps on shared caches",
        after.get("verity_batch_shared_cache_steps_total") - before
    );
    assert!(
        after.get("verity_batch_shared_cache_steps_total") <= after.get("verity_batch_steps_total")
    );
}

/// `request`'s answer while a long stream decodes beside it, with the metrics scraped before
/// and after it.
fn beside_a_stream(s: &Server, request: &Value) -> (Scrape, Value, Scrape) {
    let mut long = chat("Write a long story.", 4000);
    long["stream"] = json!(true);
    long["logit_bias"] = json!({"2": -100, "0": -100});
    let lines = s.open_stream("/v1/chat/completions", &long, 2);
    scrape_when(s, |m| m.get("verity_running_requests") == 1.0);
    let before = Scrape::of(s);
    let v = s.ok("/v1/chat/completions", request);
    let after = Scrape::of(s);
    drop(lines);
    (before, v, after)
}

/// Greedy requests of one draft a round decoding together draft their next rounds before
/// reading their verdicts (batch::draft_ahead): a request beside a stream does so in all but
/// its first and last steps, and answers what it answers alone.
#[test]
fn greedy_requests_of_one_draft_draft_their_next_rounds_ahead() {
    let draft = model_dir("qwen3-draft");
    let s = Server::start(
        &model_dir(TARGET),
        &[
            "--draft-model",
            draft.to_str().unwrap(),
            "--num-draft-tokens",
            "1",
        ],
    );
    let request = chat("Count to ten.", 24);
    let alone = s.ok("/v1/chat/completions", &request);
    assert_eq!(
        Scrape::of(&s).get("verity_batch_drafted_ahead_steps_total"),
        0.0,
        "a lone request has no group to draft ahead with"
    );
    let (before, v, after) = beside_a_stream(&s, &request);
    assert_eq!(v["choices"], alone["choices"]);
    let rounds = v["verity_stats"]["speculation"]["rounds"].as_f64().unwrap();
    let ahead = after.get("verity_batch_drafted_ahead_steps_total")
        - before.get("verity_batch_drafted_ahead_steps_total");
    assert!(
        rounds > 4.0 && ahead >= rounds - 2.0,
        "{rounds} rounds beside a stream, {ahead} steps drafted ahead"
    );
}

/// Speculative requests decoding together share the target's KV caches and their draft
/// model's: a draft-model request beside a speculative stream runs its steps on both.
#[test]
fn speculative_requests_decoding_together_share_target_and_draft_caches() {
    let draft = model_dir("qwen3-draft");
    let s = Server::start(
        &model_dir(TARGET),
        &["--draft-model", draft.to_str().unwrap()],
    );
    let (before, v, after) = beside_a_stream(&s, &chat("Count to ten.", 24));
    let rounds = v["verity_stats"]["speculation"]["rounds"].as_f64().unwrap();
    assert!(rounds > 1.0, "{rounds} rounds");
    for counter in [
        "verity_batch_shared_cache_steps_total",
        "verity_batch_shared_draft_cache_steps_total",
    ] {
        // Every round of the short request but its joining one ran beside the stream.
        let shared = after.get(counter) - before.get(counter);
        assert!(
            shared >= rounds - 1.0,
            "{counter}: {rounds} rounds beside a stream, {shared} steps on shared caches"
        );
    }
}
