//! Batch ≡ single: every row of a batch emits, token for token and logprob bit for bit, what
//! the same request emits alone, on the CPU (and, under the nextest `gpu` profile, on the GPU
//! through the lone-row kernels). A property over random schedules (prompts of
//! different lengths, greedy and seeded rows, grammar-constrained rows, rows starting from a
//! prefix-cache hit, rows with a logit bias, rows joining between steps, finishing at different
//! times and being cancelled), for every fixture architecture and cache kind: KV,
//! rotating (a sliding window, and --max-kv-size), quantized KV, recurrent, 4-bit weights;
//! and with speculative rows beside plain ones, each with its own drafter kind (draft model,
//! n-gram, MTP, DFlash) and drafts per round, whose greedy rows also equal plain decoding alone,
//! in batches that draft every step and in batches that adapt their drafts (windows of plain
//! steps in turn).

mod support;

use std::collections::BTreeMap;

use proptest::prelude::*;
use proptest::test_runner::{Config, TestRunner};
use support::{bundle, proptest_cases};
use verity::batch::{Batch, DraftPolicy};
use verity::bundle::ModelBundle;
use verity::cache::{KvQuantization, LayerCache};
use verity::decode::{decode, Hooks, Request, Start};
use verity::generate::{
    prefill, token_array, Control, FinishReason, GenerateParams, GeneratedToken,
};
use verity::grammar::Grammar;
use verity::model::{lone_rows, LanguageModel};
use verity::speculative::{DraftPrefix, Drafter, DrafterSpec, SpeculationStats};

/// (token, logprob bits, finish) of each emitted token.
type Steps = Vec<(u32, Vec<u8>, Option<FinishReason>)>;

fn record(steps: &mut Steps, t: &GeneratedToken) {
    steps.push((t.token, t.logprobs.to_bytes().unwrap(), t.finish));
}

/// One step of `batch`, each row's tokens recorded under its id in `got`.
fn step_into(batch: &mut Batch, got: &mut [Steps]) {
    batch
        .step(&mut |i, t| {
            record(&mut got[i], t);
            Control::Continue
        })
        .unwrap();
}

/// One request of a schedule.
#[derive(Clone, Debug)]
struct Row {
    prompt: Vec<u32>,
    max_tokens: usize,
    /// Sampled at temperature 0.8 with this seed; greedy when None.
    seed: Option<u64>,
    /// The step before which it joins the batch.
    joins: usize,
    /// The step before which it is taken out, if it is still running then.
    cancelled: Option<usize>,
    /// Speculative with the fixture's drafter of this index, and these drafts per round (None:
    /// the drafter's default); plain when None.
    drafter: Option<(usize, Option<usize>)>,
    /// Constrained to [`GRAMMAR`].
    grammar: bool,
    /// A prefix-cache hit: it starts from caches that hold this many of its prompt tokens.
    prefix: Option<usize>,
    /// A logit bias (token id, bias), its ids not always distinct.
    bias: Vec<(u32, f64)>,
}

/// The grammar of a schedule's constrained rows: short, so that rows finish it and their mask
/// then leaves only EOS.
const GRAMMAR: &str = "(yes|no), [a-z]{1,6}\\.";

impl Row {
    /// The row's request with `params`: its prompt, a fresh matcher of its grammar if it has
    /// one, and its drafts per round.
    fn request<'a>(&'a self, b: &ModelBundle, params: &'a GenerateParams) -> Request<'a> {
        Request {
            prompt: &self.prompt,
            params,
            constraint: self
                .grammar
                .then(|| b.constraint(&Grammar::Regex(GRAMMAR.into())).unwrap()),
            num_draft_tokens: self.drafter.and_then(|(_, k)| k),
        }
    }

    /// Where the row starts with `drafter` and `params`: fresh, or from its prefix as a prefix
    /// cache keeps it (the caches and draft side of a request for the prefix and one more
    /// token, once prefilled), where those resume exactly (the server's rule).
    fn start(&self, b: &ModelBundle, drafter: Option<&Drafter>, params: &GenerateParams) -> Start {
        let Some(cached) = self.prefix else {
            return Start::Fresh;
        };
        let mut kept = None;
        let mut keep = |target: &[LayerCache], draft: Option<&DraftPrefix>| {
            kept = Some((target.to_vec(), draft.cloned()));
        };
        let mut on_token = |_: &GeneratedToken| Control::Stop;
        let hooks = Hooks {
            on_token: &mut on_token,
            on_chunk: None,
            on_prefilled: Some(&mut keep),
        };
        let request = Request {
            prompt: &self.prompt[..=cached],
            ..self.request(b, params)
        };
        decode(b.model(), drafter, Start::Fresh, request, hooks).unwrap();
        let (caches, draft) = kept.expect("a decode calls on_prefilled");
        let draft_caches = match &draft {
            Some(DraftPrefix::Caches(caches)) => &caches[..],
            _ => &[],
        };
        if !caches
            .iter()
            .chain(draft_caches)
            .all(LayerCache::resumes_exactly)
        {
            return Start::Fresh;
        }
        Start::Prefix {
            caches,
            draft,
            cached,
        }
    }
}

/// Schedules over a vocabulary of `vocab` tokens with `drafters` drafter kinds to pick from.
fn rows(vocab: u32, drafters: usize) -> impl Strategy<Value = Vec<Row>> {
    let drafter = prop::option::of((0..drafters.max(1), prop::option::of(1usize..=4)))
        .prop_map(move |d| d.filter(|_| drafters > 0));
    let row = (
        prop::collection::vec(3..vocab, 1..=24),
        1usize..=10,
        prop::option::of(0u64..1000),
        0usize..=6,
        prop::option::of(1usize..=8),
        drafter,
        prop::bool::weighted(0.3),
        prop::option::weighted(0.3, any::<prop::sample::Index>()),
        prop::option::weighted(
            0.4,
            prop::collection::vec((3..vocab.min(40), -3.0..6.0f64), 1..=3),
        ),
    )
        .prop_map(
            |(prompt, max_tokens, seed, joins, cancel, drafter, grammar, prefix, bias)| Row {
                prefix: prefix
                    .map(|at| at.index(prompt.len()))
                    .filter(|&cached| cached > 0),
                prompt,
                max_tokens,
                seed,
                joins,
                cancelled: cancel.map(|c| joins + c),
                drafter,
                grammar,
                bias: bias.unwrap_or_default(),
            },
        );
    // Every schedule of several rows has a constrained row (the first), beside the others'.
    prop::collection::vec(row, 1..=4).prop_map(|mut rows| {
        if rows.len() > 1 {
            rows[0].grammar = true;
        }
        rows
    })
}

/// How the fixture's requests set their caches.
#[derive(Clone, Copy)]
enum Caches {
    Plain,
    Rotating(usize),
    QuantizedKv,
}

fn params(model: &ModelBundle, row: &Row, caches: Caches) -> GenerateParams {
    let mut p = GenerateParams::greedy(row.max_tokens, model.eos_token_ids.clone());
    p.processors.logit_bias = row.bias.clone();
    if let Some(seed) = row.seed {
        p.sampler.temp = 0.8;
        p.seed = Some(seed);
    }
    match caches {
        Caches::Plain => {}
        Caches::Rotating(size) => p.max_kv_size = Some(size),
        Caches::QuantizedKv => {
            p.kv_quantization = Some(KvQuantization {
                bits: 4,
                group_size: 32,
                start: 0,
            })
        }
    }
    p
}

/// The request decoded alone through the one decode entry point, speculatively with `drafter`
/// at `k` drafts per round.
fn alone(
    model: &dyn LanguageModel,
    drafter: Option<&Drafter>,
    k: Option<usize>,
    prompt: &[u32],
    params: &GenerateParams,
) -> Steps {
    let request = Request {
        prompt,
        params,
        constraint: None,
        num_draft_tokens: k,
    };
    alone_with_stats(model, drafter, Start::Fresh, request).0
}

/// [`alone`] for any request (a grammar's included), with the speculation counters.
fn alone_with_stats(
    model: &dyn LanguageModel,
    drafter: Option<&Drafter>,
    start: Start,
    request: Request<'_>,
) -> (Steps, Option<SpeculationStats>) {
    let mut steps = Steps::new();
    let mut on_token = |t: &GeneratedToken| {
        record(&mut steps, t);
        Control::Continue
    };
    let decoded = decode(model, drafter, start, request, Hooks::tokens(&mut on_token)).unwrap();
    (steps, decoded.speculation)
}

/// A schedule run as one batch: every row's emitted tokens by row index, the speculation
/// counters of the speculative rows that finished, the most rows that decoded in one step, and
/// the steps whose rows shared one KV cache per attention layer.
struct Batched {
    steps: BTreeMap<usize, Steps>,
    speculation: BTreeMap<usize, SpeculationStats>,
    widest: usize,
    shared_steps: usize,
    shared_draft_steps: usize,
    /// The steps that fed a draft group its next drafts before reading its verdicts.
    drafted_ahead_steps: usize,
    /// Whether each step's greedy speculative rows decoded plain ([`Batch::adapt_drafts`]).
    undrafted: Vec<bool>,
}

/// `rows` as one batch, its greedy speculative rows drafting as `policy` chooses, if given.
fn batched<'m>(
    b: &'m ModelBundle,
    drafters: &'m [Drafter],
    rows: &[Row],
    params: &[GenerateParams],
    policy: Option<DraftPolicy>,
) -> Batched {
    let mut batch = Batch::new(b.model());
    batch.adapt_drafts(policy);
    let mut undrafted = Vec::new();
    let mut out: BTreeMap<usize, Steps> = BTreeMap::new();
    let mut speculation = BTreeMap::new();
    let mut widest = 0;
    let mut step = 0;
    while step <= rows.iter().map(|r| r.joins).max().unwrap() || !batch.is_empty() {
        for (i, row) in rows.iter().enumerate().filter(|(_, r)| r.joins == step) {
            let drafter = row.drafter.map(|(d, _)| &drafters[d]);
            batch
                .add(
                    i,
                    drafter,
                    row.start(b, drafter, &params[i]),
                    row.request(b, &params[i]),
                    None,
                    None,
                )
                .unwrap();
            out.insert(i, Steps::new());
        }
        for (i, _) in rows
            .iter()
            .enumerate()
            .filter(|(_, r)| r.cancelled == Some(step))
        {
            batch.remove(i).unwrap();
        }
        widest = widest.max(batch.ids().len());
        let before = batch.split().undrafted;
        let left = batch
            .step(&mut |i, t| {
                record(out.get_mut(&i).unwrap(), t);
                Control::Continue
            })
            .unwrap();
        speculation.extend(
            left.into_iter()
                .filter_map(|l| Some((l.id, l.speculation?))),
        );
        undrafted.push(batch.split().undrafted > before);
        step += 1;
    }
    Batched {
        steps: out,
        speculation,
        widest,
        shared_steps: batch.split().shared,
        shared_draft_steps: batch.split().shared_drafts,
        drafted_ahead_steps: batch.split().drafted_ahead,
        undrafted,
    }
}

fn check_fixture(fixture: &str, caches: Caches) {
    check_speculative_fixture(fixture, caches, &[]);
}

/// The property on `fixture`, its rows speculative or plain at random, each speculative one
/// with one of `drafters`.
fn check_speculative_fixture(fixture: &str, caches: Caches, drafters: &[DrafterSpec]) {
    support::on_invariant_device();
    let b = bundle(fixture);
    let model = b.model();
    let drafters: Vec<Drafter> = drafters
        .iter()
        .map(|spec| Drafter::load(spec, &b).unwrap())
        .collect();
    let config = Config {
        cases: proptest_cases(6, 300),
        source_file: Some(file!()),
        ..Config::default()
    };
    let vocab = model.vocab_size() as u32;
    let shared = std::cell::Cell::new(0usize);
    let shared_steps = std::cell::Cell::new(0usize);
    // Half the schedules adapt their drafts, alternating windows of 1-3 measured steps.
    let schedules = (rows(vocab, drafters.len()), prop::option::of(1usize..=3));
    TestRunner::new(config)
        .run(&schedules, |(rows, window)| {
            let params: Vec<GenerateParams> = rows.iter().map(|r| params(&b, r, caches)).collect();
            let policy = window.map(|w| DraftPolicy::new(w, 0));
            let Batched {
                steps: got,
                speculation,
                widest,
                shared_steps: cache_shared,
                ..
            } = batched(&b, &drafters, &rows, &params, policy);
            shared_steps.set(shared_steps.get() + cache_shared);
            for (i, row) in rows.iter().enumerate() {
                let drafter = row.drafter.map(|(d, _)| &drafters[d]);
                let start = row.start(&b, drafter, &params[i]);
                let (want, want_stats) =
                    alone_with_stats(model, drafter, start, row.request(&b, &params[i]));
                if drafter.is_some() && row.seed.is_none() {
                    let start = row.start(&b, None, &params[i]);
                    let (plain, _) =
                        alone_with_stats(model, None, start, row.request(&b, &params[i]));
                    prop_assert_eq!(
                        &want,
                        &plain,
                        "row {}: speculation changed greedy output",
                        i
                    );
                }
                let got = &got[&i];
                // A row emits a token a step, the first a step late when it joined a batch
                // stepping ahead (its prompt's last token rides the next step enqueued).
                let whole = row.cancelled.is_none_or(|c| c - row.joins > want.len());
                prop_assert!(
                    got.len() <= want.len() && got[..] == want[..got.len()],
                    "row {i} of {rows:?}: the batch emitted {:?}, alone {:?}",
                    got.iter().map(|s| s.0).collect::<Vec<_>>(),
                    want.iter().map(|s| s.0).collect::<Vec<_>>()
                );
                prop_assert!(!whole || got.len() == want.len(), "row {i} stopped early");
                // Rows that drafted together drafted what each drafts alone (but the greedy rows
                // of an adaptive batch, which drafted fewer rounds).
                let drafted_as_alone = window.is_none() || row.seed.is_some();
                if let Some(stats) = speculation.get(&i).filter(|_| drafted_as_alone) {
                    prop_assert_eq!(Some(stats), want_stats.as_ref(), "row {}: other drafts", i);
                }
            }
            if widest > 1 && (drafters.is_empty() || rows.iter().any(|r| r.drafter.is_some())) {
                shared.set(shared.get() + 1);
            }
            Ok(())
        })
        .unwrap();
    assert!(
        shared.get() > 0,
        "{fixture}: no step decoded two rows (with a speculative one when drafters are given)"
    );
    // Rows of plain KV caches, plain or speculative, share one per layer whenever two decode
    // together.
    if model.attends_batch_caches() && matches!(caches, Caches::Plain) {
        assert!(
            shared_steps.get() > 0,
            "{fixture}: no step's rows shared their KV caches"
        );
    }
}

#[test]
fn llama_batch_rows_equal_their_lone_requests() {
    check_fixture("llama", Caches::Plain);
}

#[test]
fn qwen3_batch_rows_equal_their_lone_requests() {
    check_fixture("qwen3", Caches::Plain);
}

#[test]
fn qwen3_rotating_batch_rows_equal_their_lone_requests() {
    check_fixture("qwen3", Caches::Rotating(12));
}

#[test]
fn gemma3_batch_rows_equal_their_lone_requests() {
    check_fixture("gemma3", Caches::Plain);
}

#[test]
fn qwen3_next_batch_rows_equal_their_lone_requests() {
    check_fixture("qwen3_next", Caches::Plain);
}

#[test]
fn qwen3_5_batch_rows_equal_their_lone_requests() {
    check_fixture("qwen3_5", Caches::Plain);
}

/// Mixture of experts: a packed prefill of several rows can reach SwitchGLU's 64 (token, expert)
/// pairs, where it sorts them by expert, while each row alone (at most 24 tokens, 48 pairs) does
/// not.
#[test]
fn qwen3_moe_batch_rows_equal_their_lone_requests() {
    check_fixture("qwen3_moe", Caches::Plain);
}

#[test]
fn qwen3_moe_4bit_batch_rows_equal_their_lone_requests() {
    check_fixture("qwen3_moe-4bit", Caches::Plain);
}

/// The hybrid with experts: each row's recurrent state advanced on its own, its tokens' experts
/// (and the shared expert) computed over the packed rows, sorted by expert past 64 pairs.
#[test]
fn qwen3_5_moe_batch_rows_equal_their_lone_requests() {
    check_fixture("qwen3_5_moe", Caches::Plain);
}

#[test]
fn qwen3_5_moe_4bit_batch_rows_equal_their_lone_requests() {
    check_fixture("qwen3_5_moe-4bit", Caches::Plain);
}

/// GLM's grouped router: each row's tokens pick their experts from the groups that row's own
/// scores keep, through the compiled group_expert_select over the packed rows.
#[test]
fn glm4_moe_batch_rows_equal_their_lone_requests() {
    check_fixture("glm4_moe", Caches::Plain);
}

#[test]
fn glm4_moe_4bit_batch_rows_equal_their_lone_requests() {
    check_fixture("glm4_moe-4bit", Caches::Plain);
}

/// MLA: each row takes the path its own length picks (absorbed for a decode step's one token,
/// latent-expanding for a prefill chunk), over its own latent cache.
#[test]
fn glm4_moe_lite_batch_rows_equal_their_lone_requests() {
    check_fixture("glm4_moe_lite", Caches::Plain);
}

#[test]
fn glm4_moe_lite_4bit_batch_rows_equal_their_lone_requests() {
    check_fixture("glm4_moe_lite-4bit", Caches::Plain);
}

/// KV-shared layers: each row's shared layers attend over what that row's owner fetched from
/// its own caches, at its own offset.
#[test]
fn gemma4_batch_rows_equal_their_lone_requests() {
    check_fixture("gemma4", Caches::Plain);
}

#[test]
fn gemma4_4bit_batch_rows_equal_their_lone_requests() {
    check_fixture("gemma4-4bit", Caches::Plain);
}

/// Gemma 4's MoE block: each row's tokens routed by their own scores, the packed prefill past
/// SwitchGLU's 64 pairs where a row alone may not be.
#[test]
fn gemma4_moe_batch_rows_equal_their_lone_requests() {
    check_fixture("gemma4_moe", Caches::Plain);
}

#[test]
fn gemma4_moe_4bit_batch_rows_equal_their_lone_requests() {
    check_fixture("gemma4_moe-4bit", Caches::Plain);
}

#[test]
fn qwen3_4bit_quantized_kv_batch_rows_equal_their_lone_requests() {
    check_fixture("qwen3-4bit", Caches::QuantizedKv);
}

/// The trained pair: a draft model whose drafts the target accepts, and prompt lookup.
#[test]
fn qwen3_target_speculative_batch_rows_equal_their_lone_requests() {
    check_speculative_fixture(
        "qwen3-target",
        Caches::Plain,
        &[
            DrafterSpec::Model(support::model_dir("qwen3-draft")),
            DrafterSpec::Ngram { min: 1, max: 3 },
        ],
    );
}

/// Prompts of rows decoding with the trained pair.
const PAIR_PROMPTS: [&str; 5] = [
    "def fib(n):",
    "The capital of France is",
    "1, 2, 3,",
    "Once upon a time, in a land far",
    "import numpy as",
];

/// The trained pair: its target and its draft model as the one drafter.
fn trained_pair() -> (ModelBundle, [Drafter; 1]) {
    let b = bundle("qwen3-target");
    let drafter = Drafter::load(&DrafterSpec::Model(support::model_dir("qwen3-draft")), &b);
    (b, [drafter.unwrap()])
}

/// The first `n` of [`PAIR_PROMPTS`] as rows speculating with drafter 0, row i as `shape` has it
/// (its prompt and drafter set; a logit bias on `biased` only).
fn pair_rows(
    b: &ModelBundle,
    n: usize,
    biased: usize,
    shape: impl Fn(usize, Row) -> Row,
) -> Vec<Row> {
    (PAIR_PROMPTS.iter().take(n).enumerate())
        .map(|(i, p)| {
            let row = Row {
                prompt: b.tokenizer.encode(p, true).unwrap(),
                max_tokens: 24,
                seed: None,
                joins: 0,
                cancelled: None,
                drafter: Some((0, None)),
                grammar: false,
                prefix: None,
                // A bias alone reads no history: the row drafts together with the unbiased.
                bias: if i == biased {
                    vec![(5, 2.5), (11, -1.5)]
                } else {
                    Vec::new()
                },
            };
            shape(i, row)
        })
        .collect()
}

/// Asserts that each row of `got` emitted what it emits alone with `drafter` (a cancelled row
/// a prefix of it), drafted what it drafts alone (its acceptance counters), and, greedy,
/// emitted what plain decoding emits; returns each finished row's lone counters.
fn assert_rows_as_alone(
    b: &ModelBundle,
    drafter: &Drafter,
    rows: &[Row],
    params: &[GenerateParams],
    got: &Batched,
) -> BTreeMap<usize, SpeculationStats> {
    let mut counters = BTreeMap::new();
    for (i, row) in rows.iter().enumerate() {
        let request = row.request(b, &params[i]);
        let (want, stats) = alone_with_stats(b.model(), Some(drafter), Start::Fresh, request);
        if row.cancelled.is_some() {
            assert!(want.starts_with(&got.steps[&i]), "row {i}");
            continue;
        }
        assert_eq!(got.steps[&i], want, "row {i}");
        let stats = stats.unwrap();
        assert_eq!(
            got.speculation.get(&i),
            Some(&stats),
            "row {i}: other drafts"
        );
        if row.seed.is_none() {
            let plain = alone(b.model(), None, None, &row.prompt, &params[i]);
            assert_eq!(want, plain, "row {i}");
        }
        counters.insert(i, stats);
    }
    counters
}

/// Rows that draft with one draft model draft together (one packed forward per draft step):
/// with different prompt lengths, drafts per round, greedy and seeded, joining at different
/// steps, with and without logits processors, each row emits what it emits alone and drafts what
/// it drafts alone (its acceptance counters), and greedy rows emit what plain decoding emits.
#[test]
fn rows_sharing_a_draft_model_draft_together_as_each_alone() {
    support::on_invariant_device();
    let (b, drafters) = trained_pair();
    let rows = pair_rows(&b, 4, 0, |i, row| Row {
        seed: (i == 2).then_some(7),
        joins: i / 2,
        drafter: Some((0, Some(1 + i))),
        ..row
    });
    let mut params: Vec<GenerateParams> =
        rows.iter().map(|r| params(&b, r, Caches::Plain)).collect();
    // Processors that read the drafts, on a greedy row and on the seeded one.
    for i in [1, 2] {
        params[i].processors.repetition_penalty = Some(1.3);
        params[i].processors.repetition_context_size = 20;
    }
    let got = batched(&b, &drafters, &rows, &params, None);
    assert_eq!(got.widest, 4);
    assert!(
        got.shared_steps > 0,
        "the rows never shared their KV caches"
    );
    assert!(
        got.shared_draft_steps > 0,
        "the rows never shared their draft model's KV caches"
    );
    for (i, stats) in assert_rows_as_alone(&b, &drafters[0], &rows, &params, &got) {
        assert!(stats.accepted > 0, "row {i}: the pair accepts drafts");
    }
}

/// Greedy rows of one draft a round that share a draft model draft their next round before
/// their verdicts are read (batch::draft_ahead): with prompts of different lengths, a logit
/// bias, rows joining late and one cancelled, each row emits what it emits alone, drafts what
/// it drafts alone (its acceptance counters, rejected drafts included), and emits what plain
/// decoding emits.
#[test]
fn greedy_rows_of_one_draft_draft_ahead_as_each_alone() {
    support::on_invariant_device();
    let (b, drafters) = trained_pair();
    let rows = pair_rows(&b, 5, 1, |i, row| Row {
        max_tokens: 12 + 5 * i,
        joins: [0, 0, 1, 4, 9][i],
        cancelled: (i == 4).then_some(14),
        drafter: Some((0, Some(1))),
        ..row
    });
    let params: Vec<GenerateParams> = rows.iter().map(|r| params(&b, r, Caches::Plain)).collect();
    let got = batched(&b, &drafters, &rows, &params, None);
    assert!(
        got.drafted_ahead_steps > 0,
        "no step fed its rows' next drafts ahead"
    );
    let counters = assert_rows_as_alone(&b, &drafters[0], &rows, &params, &got);
    assert_eq!(counters.len(), 4);
    for (i, stats) in counters {
        assert!(
            stats.accepted > 0 && stats.accepted < stats.drafted,
            "row {i}: drafts both accepted and rejected"
        );
    }
}

/// With adaptive drafts the greedy speculative rows of each drafter kind decode windows of plain
/// steps and resume drafting, their sources catching up (a policy that measures the other
/// choice after every window alternates whatever the timings say): every row still emits what
/// it emits alone, greedy rows what plain decoding emits, and a seeded row, which drafts
/// throughout, its lone speculative tokens.
fn check_adaptive_drafts(fixture: &str, drafters: &[DrafterSpec]) {
    support::on_invariant_device();
    let b = bundle(fixture);
    let model = b.model();
    let drafters: Vec<Drafter> = drafters
        .iter()
        .map(|spec| Drafter::load(spec, &b).unwrap())
        .collect();
    let prompts = ["def fib(n):", "The capital of France is", "1, 2, 3,"];
    let mut rows: Vec<Row> = Vec::new();
    for d in 0..drafters.len() {
        for (i, p) in prompts.iter().enumerate() {
            rows.push(Row {
                prompt: b.tokenizer.encode(p, true).unwrap(),
                max_tokens: 40,
                seed: (i == 2).then_some(5),
                joins: i,
                cancelled: None,
                drafter: Some((d, Some(2 + i % 2))),
                grammar: false,
                prefix: None,
                bias: Vec::new(),
            });
        }
    }
    let params: Vec<GenerateParams> = rows.iter().map(|r| params(&b, r, Caches::Plain)).collect();
    // The steps after a row joins (the first three) are not measured; then five
    // steps of each choice in turn (one unmeasured, four measured).
    let got = batched(&b, &drafters, &rows, &params, Some(DraftPolicy::new(4, 0)));
    let joined = prompts.len();
    let turns: Vec<bool> = got.undrafted[joined..].chunks(5).map(|c| c[0]).collect();
    assert!(
        got.undrafted[..joined].iter().all(|u| !u) && turns.starts_with(&[false, true, false]),
        "{fixture}: steps undrafted {:?}, not {joined} unmeasured, then windows of 5 in turn",
        got.undrafted
    );
    for (i, row) in rows.iter().enumerate() {
        let drafter = row.drafter.map(|(d, _)| &drafters[d]);
        let (want, _) = alone_with_stats(model, drafter, Start::Fresh, row.request(&b, &params[i]));
        assert_eq!(got.steps[&i], want, "{fixture} row {i}");
        if row.seed.is_none() {
            assert_eq!(
                want,
                alone(model, None, None, &row.prompt, &params[i]),
                "{fixture} row {i}"
            );
        }
    }
}

/// A batch that stops adapting mid-way, during a window of plain steps, drafts again: no row
/// keeps the plain steps' cap of 0 drafts.
#[test]
fn rows_draft_again_once_the_batch_stops_adapting() {
    support::on_invariant_device();
    let b = bundle("qwen3-target");
    let drafter =
        Drafter::load(&DrafterSpec::Model(support::model_dir("qwen3-draft")), &b).unwrap();
    let params = GenerateParams::greedy(40, Vec::new());
    let prompts = ["def fib(n):", "The capital of France is"];
    let mut batch = Batch::new(b.model());
    // The step after the rows join (not measured), then five drafting steps, then five
    // plain ones, in turn.
    batch.adapt_drafts(Some(DraftPolicy::new(4, 0)));
    let prompts: Vec<Vec<u32>> = prompts
        .iter()
        .map(|p| b.tokenizer.encode(p, true).unwrap())
        .collect();
    for (i, prompt) in prompts.iter().enumerate() {
        let request = Request {
            prompt,
            params: &params,
            constraint: None,
            num_draft_tokens: Some(3),
        };
        batch
            .add(i, Some(&drafter), Start::Fresh, request, None, None)
            .unwrap();
    }
    let mut got = vec![Steps::new(); prompts.len()];
    let mut left = Vec::new();
    for step in 0.. {
        if step == 8 {
            assert_eq!(batch.split().undrafted, 2, "step 8 is in the plain window");
            batch.adapt_drafts(None);
        }
        if batch.is_empty() {
            break;
        }
        left.extend(
            batch
                .step(&mut |i, t| {
                    record(&mut got[i], t);
                    Control::Continue
                })
                .unwrap(),
        );
    }
    assert_eq!(batch.split().undrafted, 2);
    for l in left {
        // Five rounds of 3 drafts emit at most 20 of the 40 tokens: more rounds drafted.
        let drafted = l.speculation.unwrap().drafted;
        assert!(drafted > 15, "row {}: {drafted} drafts", l.id);
        let want = alone(b.model(), None, None, &prompts[l.id], &params);
        assert_eq!(got[l.id], want, "row {}", l.id);
    }
}

#[test]
fn adaptive_drafts_keep_every_rows_tokens_with_a_draft_model_and_prompt_lookup() {
    check_adaptive_drafts(
        "qwen3-target",
        &[
            DrafterSpec::Model(support::model_dir("qwen3-draft")),
            DrafterSpec::Ngram { min: 1, max: 3 },
        ],
    );
}

#[test]
fn adaptive_drafts_keep_every_rows_tokens_with_mtp_and_dflash_on_the_hybrid() {
    check_adaptive_drafts(
        "qwen3_5",
        &[
            DrafterSpec::Mtp { dir: None },
            DrafterSpec::Dflash {
                dir: support::model_dir("qwen3_5-dflash"),
                chain: false,
            },
        ],
    );
}

/// Every drafter kind on the hybrid: recurrent state rolled back per row, and rows tapping
/// different target layers (MTP, DFlash) in one forward.
#[test]
fn qwen3_5_speculative_batch_rows_equal_their_lone_requests() {
    check_speculative_fixture(
        "qwen3_5",
        Caches::Plain,
        &[
            DrafterSpec::Model(support::model_dir("qwen3_5")),
            DrafterSpec::Ngram { min: 1, max: 3 },
            DrafterSpec::Mtp { dir: None },
            DrafterSpec::Dflash {
                dir: support::model_dir("qwen3_5-dflash"),
                chain: false,
            },
        ],
    );
}

/// Sliding-window caches under speculation: prompts of up to 24 tokens pass the window of 16,
/// where a row's verify writes its rotating caches a token at a time and a rejected tail is
/// restored.
#[test]
fn gemma3_speculative_batch_rows_equal_their_lone_requests() {
    check_speculative_fixture(
        "gemma3",
        Caches::Plain,
        &[DrafterSpec::Ngram { min: 1, max: 2 }],
    );
}

/// MLA under speculation: a row's verify forward takes each token as its one-token step (the
/// absorbed path); rejected drafts trimmed from the latent caches.
#[test]
fn glm4_moe_lite_speculative_batch_rows_equal_their_lone_requests() {
    check_speculative_fixture(
        "glm4_moe_lite",
        Caches::Plain,
        &[
            DrafterSpec::Model(support::model_dir("glm4_moe_lite-4bit")),
            DrafterSpec::Ngram { min: 1, max: 2 },
        ],
    );
}

/// KV-shared layers under speculation: a rejected draft is trimmed from the owners' caches only.
#[test]
fn gemma4_speculative_batch_rows_equal_their_lone_requests() {
    check_speculative_fixture(
        "gemma4",
        Caches::Plain,
        &[DrafterSpec::Ngram { min: 1, max: 2 }],
    );
}

/// Gemma 4's assistant drafter reads each row's own target caches.
#[test]
fn gemma4_assistant_batch_rows_equal_their_lone_requests() {
    check_speculative_fixture(
        "gemma4-vlm",
        Caches::Plain,
        &[DrafterSpec::Mtp {
            dir: Some(support::model_dir("gemma4-assistant")),
        }],
    );
}

/// A grammar-constrained row, a plain row and a grammar-constrained speculative row decode
/// together, each as alone: the grammar's mask is the row's own, and greedy grammar +
/// speculation is grammar-only.
#[test]
fn a_grammar_row_beside_a_plain_row_equals_both_alone() {
    support::on_invariant_device();
    let b = bundle("qwen3-target");
    let model = b.model();
    let prompt = b.tokenizer.encode("The answer is", true).unwrap();
    let grammar = Grammar::Regex("(yes|no), because [a-z ]{1,40}\\.".into());
    let params = GenerateParams::greedy(24, b.eos_token_ids.clone());
    let request = Request {
        prompt: &prompt,
        params: &params,
        constraint: Some(b.constraint(&grammar).unwrap()),
        num_draft_tokens: None,
    };
    let (want_grammar, _) = alone_with_stats(model, None, Start::Fresh, request);
    let want_plain = alone(model, None, None, &prompt[1..], &params);

    let drafter = Drafter::load(&DrafterSpec::Ngram { min: 1, max: 3 }, &b).unwrap();
    let mut batch = Batch::new(model);
    let constrained = Request {
        prompt: &prompt,
        params: &params,
        constraint: Some(b.constraint(&grammar).unwrap()),
        num_draft_tokens: None,
    };
    batch
        .add(0, None, Start::Fresh, constrained, None, None)
        .unwrap();
    let plain = Request {
        prompt: &prompt[1..],
        params: &params,
        constraint: None,
        num_draft_tokens: None,
    };
    batch.add(1, None, Start::Fresh, plain, None, None).unwrap();
    let speculative = Request {
        prompt: &prompt,
        params: &params,
        constraint: Some(b.constraint(&grammar).unwrap()),
        num_draft_tokens: Some(3),
    };
    batch
        .add(2, Some(&drafter), Start::Fresh, speculative, None, None)
        .unwrap();
    let mut got = [Steps::new(), Steps::new(), Steps::new()];
    while !batch.is_empty() {
        step_into(&mut batch, &mut got);
    }
    assert_eq!(got[0], want_grammar);
    assert_eq!(got[1], want_plain);
    assert_eq!(got[2], want_grammar, "grammar + speculation in the batch");
    assert_ne!(
        want_grammar.iter().map(|s| s.0).collect::<Vec<_>>(),
        want_plain.iter().map(|s| s.0).collect::<Vec<_>>(),
        "the grammar changed nothing: the test would not see a shared mask"
    );
}

/// A long prompt joining in chunks while a plain and a speculative row decode: the running rows
/// step once after each of its chunks (so they are not stalled by its prefill), and every row,
/// the joiner included, still emits what its request emits alone.
#[test]
fn running_rows_step_between_a_joining_prompts_chunks_and_every_row_equals_alone() {
    support::on_invariant_device();
    let b = bundle("qwen3-target");
    let model = b.model();
    let short = b.tokenizer.encode("Once upon a time", true).unwrap();
    let long: Vec<u32> = b
        .tokenizer
        .encode(
            &"the quick brown fox jumps over the lazy dog ".repeat(4),
            true,
        )
        .unwrap();
    let mut params = GenerateParams::greedy(16, b.eos_token_ids.clone());
    params.prefill_step_size = 8;
    let chunks = (long.len() - 1).div_ceil(params.prefill_step_size);
    assert!(chunks >= 4, "a prompt of {} tokens", long.len());
    let drafter = Drafter::load(&DrafterSpec::Ngram { min: 1, max: 3 }, &b).unwrap();
    let request = |prompt| Request {
        prompt,
        params: &params,
        constraint: None,
        num_draft_tokens: None,
    };
    let mut batch = Batch::new(model);
    batch
        .add(0, None, Start::Fresh, request(&short), None, None)
        .unwrap();
    batch
        .add(
            1,
            Some(&drafter),
            Start::Fresh,
            request(&short[1..]),
            None,
            None,
        )
        .unwrap();
    let mut got = [Steps::new(), Steps::new(), Steps::new()];
    let (mut calls, mut prefilled) = (0, Vec::new());
    let mut between = |batch: &mut Batch, done: usize| {
        calls += 1;
        prefilled.push(done);
        step_into(batch, &mut got);
        Control::Continue
    };
    batch
        .add(
            2,
            None,
            Start::Fresh,
            request(&long),
            Some(&mut between),
            None,
        )
        .unwrap();
    assert_eq!(calls, chunks);
    assert_eq!(prefilled.last(), Some(&(long.len() - 1)));
    assert_eq!(got[0].len(), chunks, "the plain row steps once per chunk");
    assert!(
        got[1].len() >= chunks,
        "the speculative row steps once per chunk"
    );
    assert!(got[2].is_empty());
    while !batch.is_empty() {
        step_into(&mut batch, &mut got);
    }
    assert_eq!(got[0], alone(model, None, None, &short, &params));
    assert_eq!(
        got[1],
        alone(model, Some(&drafter), None, &short[1..], &params)
    );
    assert_eq!(got[2], alone(model, None, None, &long, &params));
}

/// A plain row leaves with caches that hold its prompt and every token it emitted but the last,
/// as the request decoded alone holds them (what the server's prefix cache keeps for a
/// conversation's next turn), though the batch stepping ahead fed its last token before reading it: in one
/// buffer per layer shared with another row, in KV caches of its own, and in a hybrid model's
/// recurrent layers, its own or beside another row's; a sliding window's rotating caches, which
/// the step ahead overwrote, are not handed out.
#[test]
fn plain_rows_leave_with_the_caches_of_their_tokens_but_the_last() {
    let cases = [
        ("qwen3", true),
        ("qwen3", false),
        ("qwen3_5", true),
        ("qwen3_5", false),
        ("gemma3", false),
    ];
    for (fixture, share) in cases {
        let b = bundle(fixture);
        let model = b.model();
        let prompts: [&[u32]; 3] = [&[5, 17, 300, 42], &[9, 8, 7, 6, 5, 4, 3], &[11, 12]];
        let params: Vec<GenerateParams> = [3, 6, 4]
            .map(|max_tokens| GenerateParams::greedy(max_tokens, Vec::new()))
            .into();
        let mut batch = Batch::new(model);
        batch.share_caches(share);
        let mut emitted: Vec<Vec<u32>> = vec![Vec::new(); prompts.len()];
        let mut left = Vec::new();
        for (i, prompt) in prompts.iter().enumerate() {
            let request = Request {
                prompt,
                params: &params[i],
                constraint: None,
                num_draft_tokens: None,
            };
            batch
                .add(i, None, Start::Fresh, request, None, None)
                .unwrap();
            // The last row joins a batch already stepping ahead.
            if i == 1 {
                left.extend(step_tokens(&mut batch, &mut emitted));
            }
        }
        while !batch.is_empty() {
            left.extend(step_tokens(&mut batch, &mut emitted));
        }
        assert_eq!(left.len(), prompts.len());
        for row in left {
            let i = row.id;
            assert_eq!(emitted[i].len(), params[i].max_tokens, "row {i}");
            if fixture == "gemma3" {
                assert!(
                    row.caches.is_none(),
                    "gemma3 row {i}: a window's caches handed out"
                );
                continue;
            }
            let caches = row.caches.expect("a plain row's caches");
            let held = [prompts[i], &emitted[i][..emitted[i].len() - 1]].concat();
            let want = decoded_alone(model, &held, prompts[i].len(), &params[i]);
            for (layer, (got, want)) in caches.iter().zip(&want).enumerate() {
                let at = format!("{fixture}, share {share}, row {i}, layer {layer}");
                assert_eq!(got.offset(), held.len(), "{at}");
                assert_eq!(held_bits(got), held_bits(want), "{at}");
            }
        }
    }
}

/// The caches of a request alone after it fed `tokens`, the first `prompt` of them its prompt:
/// the prompt but its last prefilled, then one decode step a token.
fn decoded_alone(
    model: &dyn LanguageModel,
    tokens: &[u32],
    prompt: usize,
    params: &GenerateParams,
) -> Vec<LayerCache> {
    let mut caches = model.make_cache(None);
    let ids = token_array(&tokens[..prompt - 1]).unwrap();
    prefill(model, &mut caches, &ids, params, |_| Ok(())).unwrap();
    for &token in &tokens[prompt - 1..] {
        let ids = token_array(&[token]).unwrap().expand_dims(&[0]).unwrap();
        lone_rows::decode_rows(|| model.forward(&ids, &mut caches, &[])).unwrap();
    }
    caches
}

/// The bits a cache holds of its tokens: a KV cache's visible keys and values, a recurrent
/// layer's state.
fn held_bits(cache: &LayerCache) -> Vec<Vec<u8>> {
    let arrays = match cache {
        LayerCache::Recurrent(_) => cache.state().into_iter().cloned().collect(),
        _ => {
            let (keys, values) = cache.visible().unwrap().expect("a filled cache");
            vec![keys, values]
        }
    };
    assert!(!arrays.is_empty(), "a cache holds its tokens");
    arrays.iter().map(|a| a.to_bytes().unwrap()).collect()
}

/// One step of `batch`, each row's tokens appended under its id in `emitted`; the rows that left.
fn step_tokens(batch: &mut Batch, emitted: &mut [Vec<u32>]) -> Vec<verity::batch::Left> {
    batch
        .step(&mut |i, t| {
            emitted[i].push(t.token);
            Control::Continue
        })
        .unwrap()
}
