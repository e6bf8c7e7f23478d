//! Warm ≡ cold over conversations: random trees of chats (new conversations, some opening with
//! a shared system prompt, next turns that carry the last answer, earlier turns edited, answers
//! regenerated) sent to a server with a prefix cache and to one without, every answer equal
//! token for token and logprob bit for bit, on a KV, a hybrid and a sliding-window model, with
//! a draft model and a DFlash drafter, with quantized KV caches, with --max-kv-size's windows
//! (which keep sink tokens) and on a thinking model. The prefix cache then restores prompts,
//! answers, system prompts and prefixes cut back from longer entries in every order the tree
//! makes (`src/server/prefix_cache.rs`).

mod server_client;
mod support;

use proptest::prelude::*;
use proptest::test_runner::{Config, TestRunner};
use serde_json::{json, Value};
use server_client::Server;
use support::{model_dir, proptest_cases};

const MESSAGES: [&str; 6] = [
    "Tell me about rivers.",
    "And the sea?",
    "Write a function that reads a file.",
    "Explain recursion briefly.",
    "What does the function os.path.join do?",
    "Thanks.",
];

/// System prompts a new conversation may open with (conversations share them).
const SYSTEMS: [&str; 2] = [
    "You answer in one short line.",
    "You are a careful reviewer.",
];

/// One request of a conversation tree; indices wrap around what exists.
#[derive(Clone, Debug)]
enum Turn {
    /// A new conversation opening with system prompt `s` (none past the list) and message `m`.
    New { s: usize, m: usize },
    /// Conversation `c` goes on: its last answer, then message `m`.
    Next { c: usize, m: usize },
    /// Conversation `c`'s user turn `t` becomes message `m`; the turns after it are dropped.
    Edit { c: usize, t: usize, m: usize },
    /// Conversation `c` sent again as it stands.
    Regenerate { c: usize },
}

fn turn() -> impl Strategy<Value = Turn> {
    let m = 0..MESSAGES.len();
    prop_oneof![
        (0..SYSTEMS.len() + 1, m.clone()).prop_map(|(s, m)| Turn::New { s, m }),
        (0..8usize, m.clone()).prop_map(|(c, m)| Turn::Next { c, m }),
        (0..8usize, 0..8usize, m).prop_map(|(c, t, m)| Turn::Edit { c, t, m }),
        (0..8usize).prop_map(|c| Turn::Regenerate { c }),
    ]
}

fn user(m: usize) -> Value {
    json!({"role": "user", "content": MESSAGES[m]})
}

/// The parts of an answer a prefix cache must not change.
fn answer(v: &Value) -> (Value, Value, Value, Value) {
    (
        v["choices"][0]["message"].clone(),
        v["choices"][0]["logprobs"].clone(),
        v["usage"]["prompt_tokens"].clone(),
        v["usage"]["completion_tokens"].clone(),
    )
}

/// A conversation: its messages and the warm answer to them, once asked.
struct Conversation {
    messages: Vec<Value>,
    answer: Option<String>,
}

/// A tree: a first conversation, random turns, then the first conversation sent again as it
/// stands (so every case has a prompt the cache holds whole).
fn tree() -> impl Strategy<Value = Vec<Turn>> {
    (0..MESSAGES.len(), prop::collection::vec(turn(), 1..6)).prop_map(|(m, mut turns)| {
        turns.insert(
            0,
            Turn::New {
                s: SYSTEMS.len(),
                m,
            },
        );
        turns.push(Turn::Regenerate { c: 0 });
        turns
    })
}

/// Plays `turns` against both servers; Err names the first answer that differs. Returns the
/// prompt tokens the warm server restored.
fn play(warm: &Server, cold: &Server, turns: &[Turn]) -> Result<usize, TestCaseError> {
    let mut conversations: Vec<Conversation> = Vec::new();
    let mut restored = 0;
    for turn in turns {
        let n = conversations.len();
        let c = match *turn {
            Turn::New { s, m } => {
                let system = SYSTEMS
                    .get(s)
                    .map(|c| json!({"role": "system", "content": c}));
                conversations.push(Conversation {
                    messages: system.into_iter().chain([user(m)]).collect(),
                    answer: None,
                });
                n
            }
            _ if n == 0 => continue,
            Turn::Next { c, m } => {
                let conv = &mut conversations[c % n];
                if let Some(a) = conv.answer.take() {
                    conv.messages
                        .push(json!({"role": "assistant", "content": a}));
                }
                conv.messages.push(user(m));
                c % n
            }
            Turn::Edit { c, t, m } => {
                let conv = &mut conversations[c % n];
                let system = usize::from(conv.messages[0]["role"] == "system");
                let turns = (conv.messages.len() - system).div_ceil(2);
                conv.messages.truncate(system + 2 * (t % turns));
                conv.messages.push(user(m));
                conv.answer = None;
                c % n
            }
            Turn::Regenerate { c } => c % n,
        };
        let conv = &mut conversations[c];
        let body = json!({"messages": conv.messages, "max_tokens": 6, "logprobs": true});
        let (w, k) = (
            warm.ok("/v1/chat/completions", &body),
            cold.ok("/v1/chat/completions", &body),
        );
        prop_assert_eq!(answer(&w), answer(&k), "{:?} after {:?}", turn, turns);
        restored += w["usage"]["prompt_tokens_details"]["cached_tokens"]
            .as_u64()
            .unwrap() as usize;
        // As a client carries it back: the content ("" when all of it was reasoning).
        let said = w["choices"][0]["message"]["content"].as_str().unwrap_or("");
        conv.answer = Some(said.to_string());
    }
    Ok(restored)
}

#[test]
fn warm_answers_equal_cold_ones_over_random_conversation_trees() {
    let draft = model_dir("qwen3-draft");
    let dflash = model_dir("qwen3-target-dflash");
    let lanes: [(&str, &[&str]); 9] = [
        ("qwen3-target", &[]),
        // MLA: a one-token chunk takes its own path, so resumes only where cold chunks end.
        ("glm4_moe_lite", &["--prefill-step-size", "16"]),
        ("qwen3_5", &[]),
        ("gemma3", &[]),
        ("qwen3-target", &["--draft-model", draft.to_str().unwrap()]),
        (
            "qwen3-target",
            &["--draft-dflash", dflash.to_str().unwrap()],
        ),
        ("qwen3-target", &["--kv-bits", "4", "--kv-group-size", "32"]),
        ("qwen3_5-trained", &["--max-kv-size", "40"]),
        ("qwen3-chat", &[]),
    ];
    for (model, args) in lanes {
        let warm = Server::start(&model_dir(model), args);
        let cold_args: Vec<&str> = args
            .iter()
            .copied()
            .chain(["--prompt-cache-bytes", "0"])
            .collect();
        let cold = Server::start(&model_dir(model), &cold_args);
        let config = Config {
            cases: proptest_cases(3, 30),
            source_file: Some(file!()),
            ..Config::default()
        };
        TestRunner::new(config)
            .run(&tree(), |turns| {
                let restored = play(&warm, &cold, &turns)?;
                prop_assert!(restored > 0, "the cache never served");
                Ok(())
            })
            .unwrap_or_else(|e| panic!("{model} {args:?}: {e}"));
    }
}
