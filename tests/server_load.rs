//! The load test (nextest profile `load`, run by .ci/run): 32 concurrent streaming clients on
//! loopback for a bounded time, a fifth of their requests cancelled mid-stream by dropping the
//! connection. Every finished stream must carry exactly the tokens and text of the same request
//! run alone on the cold server (no lost, duplicated or reordered token), no request may fail,
//! the answers after the run must equal the cold ones, and the server's memory must be flat.
//! Prints p50/p99 latency, time to first token and throughput.

mod server_client;
mod support;

use std::io::{BufRead, BufReader};
use std::sync::Arc;
use std::thread;
use std::time::{Duration, Instant};

use serde_json::{json, Value};
use server_client::Server;
use support::model_dir;

const CLIENTS: usize = 32;
const RUN_FOR: Duration = Duration::from_secs(20);
const PROMPTS: [&str; 6] = [
    "What does the function os.path.join do?",
    "Tell me about rivers.",
    "Write a function that reads a file.",
    "Say hello.",
    "Count to ten.",
    "Explain recursion briefly.",
];

fn request(prompt: &str, stream: bool) -> Value {
    json!({
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": 40,
        "logprobs": true,
        "stream": stream,
        "stream_options": {"include_usage": true},
    })
}

/// A request's answer: token ids, text, completion tokens.
#[derive(Clone, Debug, PartialEq)]
struct Answer {
    ids: Vec<u64>,
    text: String,
    completion_tokens: u64,
}

fn ids_of(logprobs: &Value) -> impl Iterator<Item = u64> + '_ {
    logprobs["content"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|e| e["id"].as_u64().unwrap())
}

fn cold_answer(s: &Server, prompt: &str) -> Answer {
    let v = s.ok("/v1/chat/completions", &request(prompt, false));
    let choice = &v["choices"][0];
    Answer {
        ids: ids_of(&choice["logprobs"]).collect(),
        text: choice["message"]["content"].as_str().unwrap().to_string(),
        completion_tokens: v["usage"]["completion_tokens"].as_u64().unwrap(),
    }
}

/// What one client saw.
#[derive(Default)]
struct Tally {
    done: usize,
    cancelled: usize,
    errors: Vec<String>,
    latencies: Vec<Duration>,
    first_token: Vec<Duration>,
    tokens: u64,
}

/// xorshift: each client's cancellation pattern is fixed by its seed.
fn next(state: &mut u64) -> u64 {
    *state ^= *state << 13;
    *state ^= *state >> 7;
    *state ^= *state << 17;
    *state
}

fn client(s: &Server, seed: u64, until: Instant, cold: &[Answer]) -> Tally {
    let mut t = Tally::default();
    let mut rng = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    while Instant::now() < until {
        let which = (next(&mut rng) % PROMPTS.len() as u64) as usize;
        let cancel_after = next(&mut rng)
            .is_multiple_of(5)
            .then(|| 1 + next(&mut rng) % 8);
        let start = Instant::now();
        let r = s
            .agent
            .post(format!("{}/v1/chat/completions", s.base))
            .send_json(request(PROMPTS[which], true));
        let r = match r {
            Ok(r) if r.status() == 200 => r,
            Ok(r) => {
                t.errors.push(format!("status {}", r.status()));
                continue;
            }
            Err(e) => {
                t.errors.push(e.to_string());
                continue;
            }
        };
        let mut got = Answer {
            ids: Vec::new(),
            text: String::new(),
            completion_tokens: 0,
        };
        let (mut chunks, mut finished) = (0u64, false);
        for line in BufReader::new(r.into_body().into_reader()).lines() {
            let Ok(line) = line else {
                t.errors.push("the stream broke".into());
                break;
            };
            let Some(data) = line.strip_prefix("data: ") else {
                continue;
            };
            if data == "[DONE]" {
                finished = true;
                break;
            }
            let c: Value = serde_json::from_str(data).unwrap();
            if c.get("error").is_some() {
                t.errors.push(c.to_string());
                break;
            }
            if chunks == 0 {
                t.first_token.push(start.elapsed());
            }
            chunks += 1;
            match c["choices"].get(0) {
                Some(choice) => {
                    got.ids.extend(ids_of(&choice["logprobs"]));
                    got.text
                        .push_str(choice["delta"]["content"].as_str().unwrap_or(""));
                }
                None => got.completion_tokens = c["usage"]["completion_tokens"].as_u64().unwrap(),
            }
            if cancel_after == Some(chunks) {
                break;
            }
        }
        if finished {
            t.latencies.push(start.elapsed());
            t.tokens += got.completion_tokens;
            if got != cold[which] {
                t.errors
                    .push(format!("prompt {which}: {got:?} != cold {:?}", cold[which]));
            }
            t.done += 1;
        } else if cancel_after.is_some() {
            t.cancelled += 1;
        }
    }
    t
}

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    sorted[((sorted.len() - 1) as f64 * p).round() as usize]
}

#[test]
fn thirty_two_streaming_clients_with_cancellations_lose_nothing() {
    let s = Arc::new(Server::start(
        &model_dir("qwen3-target"),
        &["--queue-size", "64"],
    ));
    let cold: Vec<Answer> = PROMPTS.iter().map(|p| cold_answer(&s, p)).collect();
    let rss_before = s.rss_bytes();

    let start = Instant::now();
    let until = start + RUN_FOR;
    let cold = Arc::new(cold);
    let clients: Vec<_> = (0..CLIENTS as u64)
        .map(|seed| {
            let (s, cold) = (s.clone(), cold.clone());
            thread::spawn(move || client(&s, seed, until, &cold))
        })
        .collect();
    let tallies: Vec<Tally> = clients.into_iter().map(|c| c.join().unwrap()).collect();
    let wall = start.elapsed();

    let errors: Vec<&String> = tallies.iter().flat_map(|t| &t.errors).collect();
    let done: usize = tallies.iter().map(|t| t.done).sum();
    let cancelled: usize = tallies.iter().map(|t| t.cancelled).sum();
    let tokens: u64 = tallies.iter().map(|t| t.tokens).sum();
    let mut latencies: Vec<Duration> = tallies.iter().flat_map(|t| t.latencies.clone()).collect();
    let mut ttft: Vec<Duration> = tallies.iter().flat_map(|t| t.first_token.clone()).collect();
    latencies.sort();
    ttft.sort();
    for p in PROMPTS {
        let again = cold_answer(&s, p);
        assert_eq!(
            again,
            cold[PROMPTS.iter().position(|q| *q == p).unwrap()],
            "after the run"
        );
    }
    let rss_after = s.rss_bytes();
    println!(
        "load: {CLIENTS} clients for {:.1}s: {done} streams finished, {cancelled} cancelled, {} errors; \
         latency p50 {:.3}s p99 {:.3}s; first token p50 {:.3}s p99 {:.3}s; {tokens} tokens, {:.1} tok/s; \
         server RSS {:.1} MB before, {:.1} MB after",
        wall.as_secs_f64(),
        errors.len(),
        percentile(&latencies, 0.5).as_secs_f64(),
        percentile(&latencies, 0.99).as_secs_f64(),
        percentile(&ttft, 0.5).as_secs_f64(),
        percentile(&ttft, 0.99).as_secs_f64(),
        tokens as f64 / wall.as_secs_f64(),
        rss_before as f64 / 1e6,
        rss_after as f64 / 1e6,
    );
    assert!(
        errors.is_empty(),
        "{} errors, first: {}",
        errors.len(),
        errors[0]
    );
    assert!(done >= CLIENTS, "only {done} streams finished");
    assert!(cancelled > 0, "no request was cancelled");
    // Flat: within 64 MB of where it started (allocator and MLX buffer-cache noise).
    assert!(
        rss_after < rss_before + (64 << 20),
        "{rss_before} -> {rss_after} bytes"
    );
}
