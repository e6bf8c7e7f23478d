//! What the integration tests share: the CPU pin of bit-exact tests, the repository root, golden traces and fixture models,
//! the trial arguments of the libtest-mimic suites, and proptest case counts per profile.
//! Each test binary uses its own part of it.
#![allow(dead_code)]

use std::path::{Path, PathBuf};

use libtest_mimic::Arguments;
use verity::bundle::ModelBundle;
use verity::generate::GenerateParams;
use verity::generate::{Control, Generation};
use verity::model::LanguageModel;
use verity::parity::{derived, replay};
use verity::speculative::{
    generate_speculative, DraftContext, DraftSource, PrefillMode, SpeculationStats, Verified,
};
use verity_harness::trace::Trace;

/// Runs this test's MLX work on the CPU backend, first isolating its JIT cache. Its assertions
/// are bit-exact (the engine's own invariants, or replays of the CPU golden set), and only the
/// CPU's kernels give the same bits for a different number of tokens per call; on a GPU the
/// backend-facing tests (goldens, model_rollback) judge with their own tolerances.
pub fn on_cpu() {
    mlx::jit::isolate_per_test_slot();
    mlx::set_default_device(mlx::Device::Cpu).unwrap();
}

/// Pins the device of the batch and lone-row invariants: the GPU under the nextest `gpu` profile
/// (there they must hold through the lone-row kernels, which a GPU decode forward takes), else
/// the CPU, whose kernels give every row its lone bits.
pub fn on_invariant_device() {
    mlx::jit::isolate_per_test_slot();
    let device = match std::env::var("NEXTEST_PROFILE").as_deref() {
        Ok("gpu") => mlx::Device::Gpu,
        _ => mlx::Device::Cpu,
    };
    mlx::set_default_device(device).unwrap();
}

/// Runs the `verity` binary on the CPU, where the CPU golden set is bit-exact.
pub fn verity_cpu(args: &[&str]) -> std::process::Output {
    mlx::jit::isolate_per_test_slot();
    std::process::Command::new(env!("CARGO_BIN_EXE_verity"))
        .args(["--device", "cpu"])
        .args(args)
        .output()
        .unwrap()
}

/// The oracle virtualenv's Python (oracles/venv.sh installs it), or VERITY_ORACLE_PYTHON.
pub fn oracle_python() -> PathBuf {
    std::env::var_os("VERITY_ORACLE_PYTHON")
        .map(PathBuf::from)
        .unwrap_or_else(|| root().join("oracles/.venv/bin/python"))
}

/// The repository root (fixtures ship with the repo; a missing one is a failure).
pub fn root() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

/// A fixture model folder under golden/models, as it loads: a folder whose weights are derived
/// is materialised under target/derived-models and verified against SHA256SUMS first.
pub fn model_dir(name: &str) -> PathBuf {
    let dir = root().join("golden/models").join(name);
    derived::resolve(&dir, &root().join(derived::CACHE)).unwrap_or_else(|e| panic!("{e}"))
}

/// A fixture model, tokenizer included.
pub fn bundle(name: &str) -> ModelBundle {
    ModelBundle::load(&model_dir(name)).unwrap_or_else(|e| panic!("{name}: {e}"))
}

/// The committed CPU golden trace `id` (e.g. "qwen3-target/greedy/code").
pub fn golden(id: &str) -> Trace {
    Trace::load(&root().join(format!("golden/traces/{id}.json"))).unwrap()
}

/// The prompt and parameters of a golden trace (a realistic input), cut to `max_tokens`.
pub fn golden_input(id: &str, max_tokens: usize) -> (Vec<u32>, GenerateParams) {
    let trace = golden(id);
    let eos = trace.eos_token_ids.clone().unwrap_or_default();
    let mut params = replay::params(&trace, eos).unwrap();
    params.max_tokens = max_tokens;
    (trace.prompt.tokens, params)
}

/// The command-line arguments, with the trials run one at a time on the main thread whatever
/// `--test-threads` says. MLX work stays on one thread (the one-engine-thread rule), and that
/// thread must be gone before `exit` runs MLX's static destructors: a pool worker is not, since
/// `thread::scope` returns before a worker's thread-local destructors (MLX compile caches and
/// their arrays) have finished, and the two racing corrupted the heap after every trial passed
/// ("malloc_consolidate(): unaligned fastbin chunk detected", about one run in twenty).
pub fn main_thread_args() -> Arguments {
    let mut args = Arguments::from_args();
    args.test_threads = Some(1);
    args
}

/// Proptest cases for a property: `PROPTEST_CASES` if set, `fuzz` under the nextest `fuzz`
/// profile, 16 under the `gpu` profile (a short run on an accelerator), else `default` (sized so
/// the default profile stays fast on 2 cores).
pub fn proptest_cases(default: u32, fuzz: u32) -> u32 {
    if let Some(n) = std::env::var("PROPTEST_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
    {
        return n;
    }
    match std::env::var("NEXTEST_PROFILE").as_deref() {
        Ok("fuzz") => fuzz,
        Ok("gpu") => 16,
        _ => default,
    }
}

/// A draft source recording each round's drafts and how many of them were accepted (to
/// compare with an oracle's, round by round).
pub struct Spy<S> {
    pub inner: S,
    pub drafts: Vec<Vec<u32>>,
    pub accepted: Vec<usize>,
}

impl<S> Spy<S> {
    pub fn new(inner: S) -> Spy<S> {
        Spy {
            inner,
            drafts: Vec::new(),
            accepted: Vec::new(),
        }
    }
}

impl<S: DraftSource> DraftSource for Spy<S> {
    fn taps(&self) -> Vec<usize> {
        self.inner.taps()
    }

    fn prefill_mode(&self) -> PrefillMode {
        self.inner.prefill_mode()
    }

    fn reads_target_caches(&self) -> bool {
        self.inner.reads_target_caches()
    }

    fn prefill(&mut self, prompt: &[u32], ctx: &mut DraftContext<'_>) -> verity::Result<()> {
        self.inner.prefill(prompt, ctx)
    }

    fn draft(&mut self, n: usize, ctx: &mut DraftContext<'_>) -> verity::Result<Vec<u32>> {
        let drafts = self.inner.draft(n, ctx)?;
        self.drafts.push(drafts.clone());
        Ok(drafts)
    }

    fn commit(&mut self, round: &Verified<'_>) -> verity::Result<()> {
        if round.drafted > 0 {
            self.accepted.push(round.accepted);
        }
        self.inner.commit(round)
    }
}

/// Replays the greedy mlx-vlm speculative trace `id` with `source` (verify input `block` tokens)
/// and asserts that every round drafted what mlx-vlm's drafter did, as the recorder kept it
/// under `field`. Returns each round's drafts.
pub fn drafts_equal_mlx_vlm<S: DraftSource>(
    target: &ModelBundle,
    id: &str,
    field: &str,
    source: S,
    block: usize,
) -> Vec<Vec<u32>> {
    let path = root().join(format!("golden/traces/{id}.json"));
    let json: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    let want: Vec<Vec<u32>> = serde_json::from_value(json[field].clone()).unwrap();
    let trace = golden(id);
    let params = replay::params(&trace, target.eos_token_ids.clone()).unwrap();
    let mut spy = Spy::new(source);
    verity::speculative::generate_speculative(
        target.model(),
        &mut spy,
        &trace.prompt.tokens,
        &params,
        block - 1,
        None,
        &mut |_| verity::generate::Control::Continue,
    )
    .unwrap();
    assert_eq!(spy.drafts, want, "{id}: drafts differ from mlx-vlm's");
    let oracle = accepted_per_round(&trace);
    assert!(
        spy.accepted.len() >= oracle.len(),
        "{id}: fewer rounds than mlx-vlm's"
    );
    assert_eq!(
        spy.accepted[..oracle.len()],
        oracle[..],
        "{id}: accepted drafts per round differ from mlx-vlm's"
    );
    want
}

/// The drafts accepted in each round of an mlx-vlm speculative trace, read from its from_draft
/// flags (the recorder writes them from the drafter's per-round accept_lens: the first token from
/// the prefill, then each round's accepted drafts and the target's own token). A last round the
/// budget or an EOS cut before the target's token is left out: its count is not in the flags.
pub fn accepted_per_round(trace: &Trace) -> Vec<usize> {
    let mut rounds = Vec::new();
    let mut run = 0;
    for step in trace.steps.iter().skip(1) {
        if step.from_draft {
            run += 1;
        } else {
            rounds.push(run);
            run = 0;
        }
    }
    rounds
}

/// The bytes of `a`: a logprob row's bits.
pub fn bits(a: &mlx::Array) -> Vec<u8> {
    a.to_bytes().unwrap()
}

/// Each token of plain decoding with its logprob row's bits.
pub fn plain_steps(
    model: &dyn LanguageModel,
    prompt: &[u32],
    params: &GenerateParams,
) -> Vec<(u32, Vec<u8>)> {
    Generation::new(model, prompt, params)
        .unwrap()
        .map(|s| {
            let s = s.unwrap();
            (s.token, bits(&s.logprobs))
        })
        .collect()
}

/// Each token of speculative decoding through `source` (`k` drafts a round) with its logprob
/// row's bits, and the decode's statistics.
pub fn speculative_steps(
    model: &dyn LanguageModel,
    source: &mut dyn DraftSource,
    prompt: &[u32],
    params: &GenerateParams,
    k: usize,
) -> (Vec<(u32, Vec<u8>)>, SpeculationStats) {
    let mut steps = Vec::new();
    let (stats, _) = generate_speculative(model, source, prompt, params, k, None, &mut |t| {
        steps.push((t.token, bits(&t.logprobs)));
        Control::Continue
    })
    .unwrap();
    (steps, stats)
}
