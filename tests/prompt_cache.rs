//! Prompt caches: files round-trip through mlx-lm's format for every cache kind, and a warm run
//! that reuses the cached prefix of a byte-identical prompt equals the cold run bit for bit
//! (the failure mlx-vlm #1715 reports). Files written by mlx-lm are covered by the
//! prompt-cache golden traces; files written here load in mlx-lm (oracles/test_prompt_cache.py,
//! in the `mlx-lm` profile).

mod support;

use std::collections::BTreeMap;
use std::process::Command;

use support::{bundle, golden_input, oracle_python, root};
use verity::cache::{load_prompt_cache, save_prompt_cache, KvQuantization, LayerCache};
use verity::generate::{prefill, token_array, GenerateParams, Generation};
use verity::model::LanguageModel;

/// Token ids and logprob bits of a whole generation.
fn run(g: Generation<'_>) -> Vec<(u32, Vec<u8>)> {
    g.map(|s| {
        let s = s.unwrap();
        (s.token, s.logprobs.to_bytes().unwrap())
    })
    .collect()
}

/// Caches holding all but the last prompt token, as generation leaves them before its first step.
fn prefix_caches(
    model: &dyn LanguageModel,
    prompt: &[u32],
    params: &GenerateParams,
) -> Vec<LayerCache> {
    let mut caches = model.make_cache(params.max_kv_size);
    let head = token_array(&prompt[..prompt.len() - 1]).unwrap();
    prefill(model, &mut caches, &head, params, |_| Ok(())).unwrap();
    caches
}

fn warm_equals_cold(fixture: &str, trace: &str, kv: Option<KvQuantization>) {
    support::on_cpu();
    let bundle = bundle(fixture);
    let model = bundle.model();
    let (prompt, mut params) = golden_input(trace, 12);
    params.kv_quantization = kv;
    let cold = run(Generation::new(model, &prompt, &params).unwrap());
    let cached = prefix_caches(model, &prompt, &params);
    let last = &prompt[prompt.len() - 1..];
    for attempt in 0..2 {
        let warm = run(Generation::start(model, cached.clone(), last, &params, None).unwrap());
        assert!(
            warm == cold,
            "{fixture}: warm run {attempt} differs from the cold run"
        );
    }

    // The same prefix through a prompt cache file.
    let file = std::env::temp_dir().join(format!(
        "verity-prompt-cache-{fixture}-{}.safetensors",
        std::process::id()
    ));
    save_prompt_cache(
        &file,
        &cached,
        &BTreeMap::from([("model".into(), fixture.into())]),
    )
    .unwrap();
    let (reloaded, meta) = load_prompt_cache(&file).unwrap();
    std::fs::remove_file(&file).unwrap();
    assert_eq!(meta.get("model").map(String::as_str), Some(fixture));
    let from_file = run(Generation::start(model, reloaded, last, &params, None).unwrap());
    assert!(
        from_file == cold,
        "{fixture}: continuing from a saved prompt cache differs from the cold run"
    );
}

#[test]
fn kv_cache_warm_equals_cold() {
    warm_equals_cold("qwen3-target", "qwen3-target/greedy/code", None);
}

#[test]
fn quantized_kv_cache_warm_equals_cold() {
    let kv = KvQuantization {
        bits: 4,
        group_size: 32,
        start: 0,
    };
    warm_equals_cold("qwen3-target", "qwen3-target/greedy/code", Some(kv));
}

#[test]
fn rotating_cache_past_its_window_warm_equals_cold() {
    warm_equals_cold("gemma3", "gemma3/greedy/long", None);
}

#[test]
fn recurrent_cache_warm_equals_cold() {
    warm_equals_cold("qwen3_next", "qwen3_next/greedy/chat", None);
    warm_equals_cold("qwen3_5", "qwen3_5/greedy/chat", None);
}

#[test]
fn a_file_that_is_not_a_prompt_cache_is_a_clear_error() {
    let weights = root().join("golden/models/llama/model.safetensors");
    let err = match load_prompt_cache(&weights) {
        Ok(_) => panic!("model weights loaded as a prompt cache"),
        Err(e) => e.to_string(),
    };
    assert!(
        err.contains("model.safetensors") && err.contains("not an mlx-lm prompt cache"),
        "{err}"
    );
}

/// mlx-lm itself loads the prompt cache file verity writes for every prompt-cache golden (the
/// same tensors and metadata as mlx-lm's own file) and continues from it to the golden's steps
/// (oracles/test_prompt_cache.py). Runs in the `mlx-lm` profile, which has the oracle venv.
#[test]
fn mlx_lm_continues_every_prompt_cache_verity_writes() {
    mlx::jit::isolate_per_test_slot();
    // Each prompt-cache golden has a file of its own, written by mlx-lm.
    let traces = std::fs::read_dir(root().join("golden/prompt-cache"))
        .unwrap()
        .count();
    assert!(traces > 0, "no prompt-cache golden files");
    let python = oracle_python();
    let out = Command::new(&python)
        .arg(root().join("oracles/test_prompt_cache.py"))
        .arg(env!("CARGO_BIN_EXE_verity"))
        .output()
        .unwrap_or_else(|e| panic!("{}: {e} (run oracles/venv.sh)", python.display()));
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let want = format!("{traces} of {traces} verity-written prompt caches load in mlx-lm exactly");
    assert!(stdout.contains(&want), "{stdout}");
}
