//! The bad-input suite: every verb of the `verity` binary fed what a hostile user would give it
//! (out-of-range token ids, NaN and out-of-range options, broken model folders, foreign prompt
//! caches, bad traces, suites and baselines). Each case asserts the documented exit code (2, or
//! 125 for `accept`, which `git bisect run` reads as "cannot run"), an `error:` line naming the
//! problem, no signal and no panic, and no output file left behind. The binary runs with
//! MALLOC_CHECK_=3 so that heap corruption aborts loudly instead of passing. Broken fixtures are
//! made by each case from the shipped ones, in its own scratch folder.

mod support;

use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use libtest_mimic::{Failed, Trial};
use serde_json::{json, Map, Value};
use support::{model_dir, root};

/// One bad input and what must come of it.
struct Case {
    name: String,
    /// Arguments after `verity --device cpu`; `{S}` is the case's scratch folder and `{R}`
    /// the repository root.
    args: Vec<String>,
    /// Prepares the scratch folder (broken fixtures, files the arguments name).
    setup: Setup,
    code: i32,
    /// Substrings the error line must contain (the input, the value, what is allowed).
    needles: Vec<String>,
}

type Setup = Box<dyn Fn(&Path) + Send + Sync>;

/// The DFlash drafter fixture (trained for qwen3-target: taps layers 1 and 3).
const DFLASH: &str = "qwen3-target-dflash";

fn no_setup() -> Setup {
    Box::new(|_| {})
}

fn case(name: &str, args: &[&str], code: i32, needles: &[&str], setup: Setup) -> Case {
    Case {
        name: name.to_string(),
        args: args.iter().map(|a| a.to_string()).collect(),
        setup,
        code,
        needles: needles.iter().map(|n| n.to_string()).collect(),
    }
}

fn model_arg(name: &str) -> String {
    model_dir(name).to_string_lossy().into_owned()
}

/// Copies fixture `name` to `<scratch>/m` and returns that folder.
fn copy_model(scratch: &Path, name: &str) -> PathBuf {
    let to = scratch.join("m");
    fs::create_dir_all(&to).unwrap();
    for entry in fs::read_dir(model_dir(name)).unwrap() {
        let entry = entry.unwrap();
        fs::copy(entry.path(), to.join(entry.file_name())).unwrap();
    }
    to
}

fn edit_json(path: &Path, edit: impl FnOnce(&mut Map<String, Value>)) {
    let mut doc: Map<String, Value> =
        serde_json::from_str(&fs::read_to_string(path).unwrap()).unwrap();
    edit(&mut doc);
    fs::write(path, serde_json::to_string_pretty(&doc).unwrap()).unwrap();
}

/// A copy of fixture `name` at `<scratch>/m` with its config.json edited.
fn broken_config(name: &'static str, edit: fn(&mut Map<String, Value>)) -> Setup {
    Box::new(move |s| edit_json(&copy_model(s, name).join("config.json"), edit))
}

/// A copy of fixture `name` at `<scratch>/m` whose config.json sets `key` to `value`.
fn config_value(name: &'static str, key: &'static str, value: Value) -> Setup {
    Box::new(move |s| {
        edit_json(&copy_model(s, name).join("config.json"), |c| {
            c.insert(key.into(), value.clone());
        })
    })
}

/// A copy of qwen3 at `<scratch>/m` whose tokenizer maps two tokens the other way round: the
/// same vocabulary size, another tokenizer.
fn other_tokenizer() -> Setup {
    Box::new(|s| {
        edit_json(&copy_model(s, "qwen3").join("tokenizer.json"), |t| {
            let vocab = t["model"]["vocab"].as_object_mut().unwrap();
            let (a, b) = (vocab["a"].clone(), vocab["b"].clone());
            vocab.insert("a".into(), b);
            vocab.insert("b".into(), a);
        })
    })
}

/// A copy of qwen3 at `<scratch>/m` with one tensor's safetensors header entry edited.
fn broken_header(tensor: &'static str, edit: fn(&mut Map<String, Value>)) -> Setup {
    Box::new(move |s| {
        let path = copy_model(s, "qwen3").join("model.safetensors");
        let (mut header, data) = read_safetensors(&path);
        edit(header.get_mut(tensor).unwrap().as_object_mut().unwrap());
        write_safetensors(&path, &header, &data);
    })
}

/// The header and the data section of a safetensors file.
fn read_safetensors(path: &Path) -> (Map<String, Value>, Vec<u8>) {
    let bytes = fs::read(path).unwrap();
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let header = serde_json::from_slice(&bytes[8..8 + n]).unwrap();
    (header, bytes[8 + n..].to_vec())
}

fn write_safetensors(path: &Path, header: &Map<String, Value>, data: &[u8]) {
    let text = serde_json::to_vec(header).unwrap();
    let mut out = (text.len() as u64).to_le_bytes().to_vec();
    out.extend(text);
    out.extend(data);
    fs::write(path, out).unwrap();
}

/// A copy of fixture `name` at `<scratch>/m` without the tensor `tensor` (its bytes dropped
/// and the other tensors' offsets moved up, so the file stays well formed).
fn without_tensor(name: &'static str, tensor: &'static str) -> Setup {
    Box::new(move |s| {
        let path = copy_model(s, name).join("model.safetensors");
        let (mut header, data) = read_safetensors(&path);
        header.remove(tensor).unwrap();
        let span = |entry: &Value| {
            let offsets = &entry["data_offsets"];
            (
                offsets[0].as_u64().unwrap() as usize,
                offsets[1].as_u64().unwrap() as usize,
            )
        };
        let mut keys: Vec<String> = header
            .keys()
            .filter(|k| *k != "__metadata__")
            .cloned()
            .collect();
        keys.sort_by_key(|k| span(&header[k]).0);
        let mut packed = Vec::new();
        for key in keys {
            let (start, end) = span(&header[&key]);
            let at = packed.len();
            packed.extend_from_slice(&data[start..end]);
            header[&key]["data_offsets"] = json!([at, packed.len()]);
        }
        write_safetensors(&path, &header, &packed);
    })
}

/// A copy of fixture `name` at `<scratch>/m` with every float32 tensor stored as bfloat16 (each
/// value's upper 16 bits), as a bfloat16 conversion of the model would hold it.
fn as_bfloat16(name: &'static str) -> Setup {
    Box::new(move |s| {
        let path = copy_model(s, name).join("model.safetensors");
        let (mut header, data) = read_safetensors(&path);
        let keys: Vec<String> = header
            .keys()
            .filter(|k| *k != "__metadata__")
            .cloned()
            .collect();
        let mut packed = Vec::new();
        for key in keys {
            let entry = &mut header[&key];
            let offsets = &entry["data_offsets"];
            let (start, end) = (
                offsets[0].as_u64().unwrap() as usize,
                offsets[1].as_u64().unwrap() as usize,
            );
            let at = packed.len();
            if entry["dtype"] == "F32" {
                for value in data[start..end].chunks(4) {
                    packed.extend_from_slice(&value[2..]);
                }
                entry["dtype"] = json!("BF16");
            } else {
                packed.extend_from_slice(&data[start..end]);
            }
            entry["data_offsets"] = json!([at, packed.len()]);
        }
        write_safetensors(&path, &header, &packed);
    })
}

/// A copy of qwen3 at `<scratch>/m` whose (f32) tensor `tensor` starts with the value `bits`.
fn poisoned_tensor(tensor: &'static str, bits: u32) -> Setup {
    Box::new(move |s| {
        let path = copy_model(s, "qwen3").join("model.safetensors");
        let (header, mut data) = read_safetensors(&path);
        assert_eq!(header[tensor]["dtype"], "F32");
        let start = header[tensor]["data_offsets"][0].as_u64().unwrap() as usize;
        data[start..start + 4].copy_from_slice(&bits.to_le_bytes());
        write_safetensors(&path, &header, &data);
    })
}

/// A copy of qwen3 at `<scratch>/m` with a second shard that holds a copy of `tensor`.
fn repeated_in_a_shard(tensor: &'static str) -> Setup {
    Box::new(move |s| {
        let dir = copy_model(s, "qwen3");
        let (header, data) = read_safetensors(&dir.join("model.safetensors"));
        let mut entry = header[tensor].clone();
        let span: Vec<usize> = entry["data_offsets"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_u64().unwrap() as usize)
            .collect();
        entry["data_offsets"] = json!([0, span[1] - span[0]]);
        let shard = Map::from_iter([(tensor.to_string(), entry)]);
        write_safetensors(
            &dir.join("model-00002-of-00002.safetensors"),
            &shard,
            &data[span[0]..span[1]],
        );
    })
}

/// A copy of qwen3 at `<scratch>/m` with `file` replaced by `contents` (or removed).
fn replaced_file(file: &'static str, contents: Option<&'static str>) -> Setup {
    Box::new(move |s| {
        let path = copy_model(s, "qwen3").join(file);
        match contents {
            Some(c) => fs::write(path, c).unwrap(),
            None => fs::remove_file(path).unwrap(),
        }
    })
}

/// Writes `contents` to `<scratch>/<name>`.
fn file(name: &'static str, contents: String) -> Setup {
    Box::new(move |s| fs::write(s.join(name), &contents).unwrap())
}

/// Runs the binary on the CPU with heap checking on.
fn verity(args: &[String], cwd: &Path) -> Output {
    Command::new(env!("CARGO_BIN_EXE_verity"))
        .args(["--device", "cpu"])
        .args(args)
        .current_dir(cwd)
        .env("MALLOC_CHECK_", "3")
        .env("CI", "true")
        .output()
        .unwrap()
}

/// Runs a case-independent helper command inside a case's setup (e.g. writing a prompt cache
/// with another model), which must succeed.
fn verity_ok(args: &[&str], cwd: &Path) {
    let args: Vec<String> = args.iter().map(|a| a.to_string()).collect();
    let out = verity(&args, cwd);
    assert!(
        out.status.success(),
        "setup command {args:?} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

fn run(case: &Case) -> Result<(), Failed> {
    let scratch = std::env::temp_dir().join(format!(
        "verity-bad-{}-{}",
        case.name.replace('/', "-"),
        std::process::id()
    ));
    let _ = fs::remove_dir_all(&scratch);
    fs::create_dir_all(&scratch).unwrap();
    (case.setup)(&scratch);
    let before = listing(&scratch);
    let fill = |a: &String| {
        a.replace("{S}", &scratch.to_string_lossy())
            .replace("{R}", &root().to_string_lossy())
    };
    let args: Vec<String> = case.args.iter().map(fill).collect();
    let needles: Vec<String> = case.needles.iter().map(fill).collect();
    let out = verity(&args, &scratch);
    let after = listing(&scratch);
    let _ = fs::remove_dir_all(&scratch);
    let stderr = String::from_utf8_lossy(&out.stderr);
    let Some(code) = out.status.code() else {
        return Err(format!("killed by a signal ({:?}); stderr: {stderr}", out.status).into());
    };
    if code != case.code {
        return Err(format!("exit {code}, expected {}; stderr: {stderr}", case.code).into());
    }
    if stderr.contains("panicked") || stderr.contains("RUST_BACKTRACE") {
        return Err(format!("panicked: {stderr}").into());
    }
    let Some(line) = stderr.lines().find(|l| l.starts_with("error:")) else {
        return Err(format!("no `error:` line; stderr: {stderr}").into());
    };
    for needle in &needles {
        if !line.contains(needle.as_str()) {
            return Err(format!("the error line does not name {needle:?}: {line}").into());
        }
    }
    if after != before {
        return Err(format!("files left behind: before {before:?}, after {after:?}").into());
    }
    Ok(())
}

/// Every path under `dir`, sorted.
fn listing(dir: &Path) -> Vec<String> {
    let mut out = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in fs::read_dir(&d).into_iter().flatten().flatten() {
            let p = e.path();
            if p.is_dir() {
                stack.push(p.clone());
            }
            out.push(p.strip_prefix(dir).unwrap().to_string_lossy().into_owned());
        }
    }
    out.sort();
    out
}

/// `verity generate` on the qwen3 fixture with one flag set to each bad value: (flag, value,
/// what the message must name, `|`-separated).
const GENERATE_FLAGS: &[(&str, &str, &str)] = &[
    ("--max-tokens", "0", "max_tokens"),
    ("--max-tokens", "x", "--max-tokens"),
    ("--max-tokens", "-1", "-1"),
    ("--temp", "NaN", "temperature"),
    ("--temp", "inf", "temperature"),
    ("--temp", "x", "--temp"),
    ("--temp", "-1", "-1"),
    ("--top-p", "2", "top_p"),
    ("--top-p", "1.0001", "top_p"),
    ("--top-p", "NaN", "top_p"),
    ("--top-p", "inf", "top_p"),
    ("--top-p", "-0.5", "-0"),
    ("--min-p", "1.5", "min_p"),
    ("--min-p", "NaN", "min_p"),
    ("--top-k", "5000", "top_k"),
    ("--top-k", "1025", "top_k"),
    ("--top-k", "x", "--top-k"),
    ("--min-tokens-to-keep", "0", "min_tokens_to_keep"),
    ("--min-tokens-to-keep", "2000", "min_tokens_to_keep"),
    ("--xtc-probability", "1.5", "xtc_probability"),
    ("--xtc-probability", "NaN", "xtc_probability"),
    ("--xtc-threshold", "0.9", "xtc_threshold"),
    ("--xtc-threshold", "NaN", "xtc_threshold"),
    ("--seed", "x", "--seed"),
    ("--seed", "18446744073709551616", "--seed"),
    ("--keys", "random", "--keys"),
    (
        "--logit-bias",
        "1024=10",
        "logit_bias token id|1024|vocabulary size 1024",
    ),
    ("--logit-bias", "5000=1", "logit_bias token id|5000"),
    (
        "--logit-bias",
        "4294967295=1",
        "logit_bias token id|4294967295",
    ),
    ("--logit-bias", "4294967296=1", "bad token id|4294967296=1"),
    ("--logit-bias", "5=NaN", "logit_bias[5]|NaN|finite"),
    ("--logit-bias", "5=inf", "logit_bias[5]|inf|finite"),
    ("--logit-bias", "5=-inf", "logit_bias[5]|-inf|finite"),
    ("--logit-bias", "5", "TOKEN_ID=BIAS"),
    ("--logit-bias", "=5", "bad token id"),
    ("--logit-bias", "abc=1", "bad token id"),
    ("--logit-bias", "5=abc", "bad bias"),
    ("--repetition-penalty", "NaN", "repetition_penalty"),
    ("--repetition-penalty", "inf", "repetition_penalty"),
    ("--repetition-context-size", "0", "repetition_context_size"),
    ("--presence-penalty", "NaN", "presence_penalty"),
    ("--presence-penalty", "inf", "presence_penalty"),
    ("--presence-context-size", "0", "presence_context_size"),
    ("--frequency-penalty", "NaN", "frequency_penalty"),
    ("--frequency-context-size", "0", "frequency_context_size"),
    ("--max-kv-size", "0", "max_kv_size"),
    ("--max-kv-size", "1", "max_kv_size"),
    ("--max-kv-size", "4", "max_kv_size"),
    ("--max-kv-size", "x", "--max-kv-size"),
    ("--kv-bits", "0", "kv_bits"),
    ("--kv-bits", "1", "kv_bits"),
    ("--kv-bits", "7", "kv_bits"),
    ("--kv-bits", "16", "kv_bits"),
    ("--kv-bits", "x", "--kv-bits"),
    ("--prefill-step-size", "0", "prefill_step_size"),
    ("--num-draft-tokens", "x", "--num-draft-tokens"),
    ("--device", "tpu", "--device"),
];

/// With `--kv-bits 4`: group sizes mlx cannot use, or that do not divide the fixture's head
/// dimension (32).
const GROUP_SIZES: &[(&str, &str)] = &[
    ("0", "must be one of"),
    ("48", "must be one of"),
    ("256", "must be one of"),
    ("64", "must divide the model's attention head dimension 32"),
    ("128", "must divide the model's attention head dimension 32"),
    ("x", "--kv-group-size"),
];

fn generate_cases() -> Vec<Case> {
    let q = model_arg("qwen3");
    let mut cases = Vec::new();
    for (flag, value, names) in GENERATE_FLAGS {
        let mut needles: Vec<&str> = names.split('|').collect();
        if !value.contains('=') && !value.starts_with('-') {
            needles.push(value);
        }
        let mut args = vec!["generate", "--model", &q, flag, value];
        if *flag != "--max-tokens" {
            args.extend(["-m", "4"]);
        }
        cases.push(case(
            &format!("generate/{}={value}", flag.trim_start_matches('-')),
            &args,
            2,
            &needles,
            no_setup(),
        ));
    }
    for (size, names) in GROUP_SIZES {
        cases.push(case(
            &format!("generate/kv-group-size={size}"),
            &[
                "generate",
                "--model",
                &q,
                "-m",
                "4",
                "--kv-bits",
                "4",
                "--kv-group-size",
                size,
            ],
            2,
            &[names, size],
            no_setup(),
        ));
    }
    // glm4_moe_lite's latent attention scores its RoPE part against the cached values, which a
    // quantized cache holds packed (mlx-lm fails there): refused before anything runs.
    let lite = model_arg("glm4_moe_lite");
    cases.push(case(
        "generate/kv-bits-on-latent-attention",
        &["generate", "--model", &lite, "-m", "4", "--kv-bits", "8"],
        2,
        &["kv_bits", "8", "glm4_moe_lite", "plain KV caches only"],
        no_setup(),
    ));
    cases.push(case(
        "generate/positioned-keys-with-xtc",
        &[
            "generate",
            "--model",
            &q,
            "-m",
            "4",
            "--keys",
            "positioned",
            "--temp",
            "0.8",
            "--xtc-probability",
            "0.5",
        ],
        2,
        &["xtc_probability", "0.5", "positioned keys"],
        no_setup(),
    ));
    let ngram = |name: &str, extra: &[&str], needles: &[&str]| {
        let mut args = vec!["generate", "--model", &q, "-m", "4", "--draft-ngram"];
        args.extend(extra);
        case(name, &args, 2, needles, no_setup())
    };
    cases.extend([
        ngram(
            "generate/ngram-k0",
            &["--num-draft-tokens", "0"],
            &["num_draft_tokens", "0"],
        ),
        ngram(
            "generate/ngram-k1000",
            &["--num-draft-tokens", "1000"],
            &["num_draft_tokens", "1000"],
        ),
        ngram(
            "generate/ngram-min0",
            &["--ngram-min", "0"],
            &["ngram_min", "0"],
        ),
        ngram(
            "generate/ngram-max100",
            &["--ngram-max", "100"],
            &["ngram_max", "100"],
        ),
        ngram(
            "generate/ngram-min-above-max",
            &["--ngram-min", "5", "--ngram-max", "2"],
            &["ngram_max", "2", "[5, 64]"],
        ),
        ngram(
            "generate/ngram-from-prompt-cache",
            &["--prompt-cache-file", "{S}/c.safetensors"],
            &["--prompt-cache-file", "--draft-ngram"],
        ),
    ]);
    let gen = |name: &str, extra: &[&str], needles: &[&str], setup: Setup| {
        let mut args = vec!["generate", "--model", &q, "-m", "4"];
        args.extend(extra);
        case(name, &args, 2, needles, setup)
    };
    cases.extend([
        gen(
            "generate/empty-raw-prompt",
            &["--ignore-chat-template", "--prompt", ""],
            &["prompt", "empty"],
            no_setup(),
        ),
        gen(
            "generate/draft-missing",
            &["--draft-model", "{S}/nope"],
            &["{S}/nope", "no such model folder"],
            no_setup(),
        ),
        gen(
            "generate/draft-other-tokenizer",
            &["--draft-model", "{S}/m"],
            &["another tokenizer"],
            other_tokenizer(),
        ),
        gen(
            "generate/draft-and-ngram",
            &["--draft-model", &q, "--draft-ngram"],
            &["--draft-ngram"],
            no_setup(),
        ),
        gen(
            "generate/draft-mtp-without-head",
            &["--draft-mtp"],
            &["mtp.* weights", "MTP head"],
            no_setup(),
        ),
        case(
            "serve/draft-mtp-without-head",
            &["serve", "--port", "0", "--model", &q, "--draft-mtp"],
            2,
            &["mtp.* weights", "MTP head"],
            no_setup(),
        ),
        case(
            "serve/chat-template-missing",
            &[
                "serve",
                "--port",
                "0",
                "--model",
                &q,
                "--chat-template",
                "{S}/no-such-template.jinja",
            ],
            2,
            &["--chat-template", "no-such-template.jinja"],
            no_setup(),
        ),
        case(
            "serve/dflash-taps-past-the-target",
            &[
                "serve",
                "--port",
                "0",
                "--model",
                &q,
                "--draft-dflash",
                &model_arg(DFLASH),
            ],
            2,
            &["target_layer_ids", "[1, 3]", "which has 2"],
            no_setup(),
        ),
        gen(
            "generate/draft-mtp-and-ngram",
            &["--draft-mtp", "--draft-ngram"],
            &["--draft-mtp", "--draft-ngram"],
            no_setup(),
        ),
        gen(
            "generate/dflash-missing",
            &["--draft-dflash", "{S}/nope"],
            &["{S}/nope", "no such model folder"],
            no_setup(),
        ),
        gen(
            "generate/dflash-not-a-drafter",
            &["--draft-dflash", &q],
            &["model_type", "qwen3", "not a DFlash drafter"],
            no_setup(),
        ),
        gen(
            "generate/dflash-taps-past-the-target",
            &["--draft-dflash", &model_arg(DFLASH)],
            &["target_layer_ids", "[1, 3]", "which has 2"],
            no_setup(),
        ),
        gen(
            "generate/dflash-block-one",
            &["--draft-dflash", "{S}/m"],
            &["block_size", "1", "at least 2"],
            config_value(DFLASH, "block_size", json!(1)),
        ),
        gen(
            "generate/dflash-taps-unordered",
            &["--draft-dflash", "{S}/m"],
            &["target_layer_ids", "[3, 1]", "strictly increasing"],
            broken_config(DFLASH, |c| {
                c["dflash_config"]["target_layer_ids"] = json!([3, 1]);
            }),
        ),
        gen(
            "generate/dflash-mask-past-vocab",
            &["--draft-dflash", "{S}/m"],
            &[
                "mask_token_id",
                "5000",
                "below the target's vocabulary size, 1024",
            ],
            broken_config(DFLASH, |c| {
                c["dflash_config"]["mask_token_id"] = json!(5000);
            }),
        ),
        gen(
            "generate/dflash-sliding-layers",
            &["--draft-dflash", "{S}/m"],
            &["layer_types", "sliding"],
            config_value(DFLASH, "layer_types", json!(["sliding_attention"])),
        ),
        gen(
            "generate/dflash-and-mtp",
            &["--draft-dflash", "{S}/nope", "--draft-mtp"],
            &["--draft-dflash", "--draft-mtp"],
            no_setup(),
        ),
        gen(
            "generate/json-schema-missing",
            &["--json-schema", "{S}/nope.json"],
            &["nope.json"],
            no_setup(),
        ),
        gen(
            "generate/json-schema-not-json",
            &["--json-schema", "{S}/s.json"],
            &["s.json"],
            file("s.json", "{not json".into()),
        ),
        gen(
            "generate/json-schema-bad-type",
            &["--json-schema", "{S}/s.json"],
            &["schema"],
            file("s.json", r#"{"type": 5}"#.into()),
        ),
        gen(
            "generate/regex-unbalanced",
            &["--regex", "(ab"],
            &["regex"],
            no_setup(),
        ),
        gen(
            "generate/regex-matching-nothing",
            &["--regex", "[^\\s\\S]"],
            &["regex", "matches no text"],
            no_setup(),
        ),
        gen(
            "generate/grammar-without-a-base-case",
            &["--grammar", "{S}/g.lark"],
            &["grammar"],
            file("g.lark", "start: \"a\" start\n".into()),
        ),
        gen(
            "generate/grammar-missing",
            &["--grammar", "{S}/g.lark"],
            &["g.lark"],
            no_setup(),
        ),
        gen(
            "generate/grammar-bad-lark",
            &["--grammar", "{S}/g.lark"],
            &["grammar"],
            file("g.lark", "start: ???\n".into()),
        ),
        gen(
            "generate/two-constraints",
            &["--regex", "a", "--choice", "b"],
            &["--choice"],
            no_setup(),
        ),
        gen(
            "generate/prompt-cache-missing",
            &["--prompt-cache-file", "{S}/c.safetensors"],
            &["c.safetensors"],
            no_setup(),
        ),
        gen(
            "generate/prompt-cache-not-safetensors",
            &["--prompt-cache-file", "{S}/c.safetensors"],
            &["c.safetensors"],
            file("c.safetensors", "hello".into()),
        ),
        gen(
            "generate/prompt-cache-of-another-model",
            &["--prompt-cache-file", "{S}/c.safetensors"],
            &["c.safetensors", "made with model", "llama"],
            Box::new(|s| {
                verity_ok(
                    &[
                        "cache-prompt",
                        "--model",
                        &model_arg("llama"),
                        "--tokens",
                        "1,2,3",
                        "--out",
                        "c.safetensors",
                    ],
                    s,
                )
            }),
        ),
        gen(
            "generate/prompt-cache-with-other-kv-settings",
            &["--prompt-cache-file", "{S}/c.safetensors"],
            &["c.safetensors", "layer 0", "rotating"],
            Box::new(move |s| {
                verity_ok(
                    &[
                        "cache-prompt",
                        "--model",
                        &model_arg("qwen3"),
                        "--tokens",
                        "1,2,3",
                        "--max-kv-size",
                        "64",
                        "--out",
                        "c.safetensors",
                    ],
                    s,
                )
            }),
        ),
        gen(
            "generate/prompt-cache-quantized-other-bits",
            &[
                "--prompt-cache-file",
                "{S}/c.safetensors",
                "--kv-bits",
                "4",
                "--kv-group-size",
                "32",
            ],
            &["c.safetensors", "8-bit", "4 bits"],
            Box::new(move |s| {
                verity_ok(
                    &[
                        "cache-prompt",
                        "--model",
                        &model_arg("qwen3"),
                        "--tokens",
                        "1,2,3",
                        "--kv-bits",
                        "8",
                        "--kv-group-size",
                        "32",
                        "--quantized-kv-start",
                        "0",
                        "--out",
                        "c.safetensors",
                    ],
                    s,
                )
            }),
        ),
    ]);
    // A cache of another model (same architecture and shapes) whose metadata was stripped.
    cases.push(case(
        "generate/prompt-cache-without-its-model",
        &[
            "generate",
            "--model",
            &q,
            "-m",
            "4",
            "--prompt-cache-file",
            "{S}/c.safetensors",
        ],
        2,
        &[
            "--prompt-cache-file",
            "c.safetensors",
            "metadata key \"model\"",
        ],
        Box::new(|s| {
            verity_ok(
                &[
                    "cache-prompt",
                    "--model",
                    &model_arg("qwen3-4bit"),
                    "--tokens",
                    "1,2,3",
                    "--out",
                    "c.safetensors",
                ],
                s,
            );
            let path = s.join("c.safetensors");
            let (mut header, data) = read_safetensors(&path);
            let meta = header["__metadata__"].as_object_mut().unwrap();
            assert!(meta.remove("0.model").is_some());
            write_safetensors(&path, &header, &data);
        }),
    ));
    // A cache written for the model folder at {S}/m, whose contents were then swapped for
    // another architecture: the metadata matches, the tensors do not.
    cases.push(case(
        "generate/prompt-cache-structure-mismatch",
        &[
            "generate",
            "--model",
            "{S}/m",
            "-m",
            "4",
            "--prompt-cache-file",
            "{S}/c.safetensors",
        ],
        2,
        &["c.safetensors", "layer"],
        Box::new(|s| {
            let m = copy_model(s, "qwen3_next");
            verity_ok(
                &[
                    "cache-prompt",
                    "--model",
                    &m.to_string_lossy(),
                    "--tokens",
                    "1,2,3",
                    "--out",
                    "c.safetensors",
                ],
                s,
            );
            fs::remove_dir_all(&m).unwrap();
            copy_model(s, "qwen3");
        }),
    ));
    cases
}

/// A model folder broken in one way, and what the error must name.
fn model_folder_cases() -> Vec<Case> {
    let folder = |name: &str, needles: &[&str], setup: Setup| {
        case(
            &format!("model/{name}"),
            &["generate", "--model", "{S}/m", "-m", "2"],
            2,
            needles,
            setup,
        )
    };
    vec![
        folder("missing", &["{S}/m", "no such model folder"], no_setup()),
        folder(
            "a-file",
            &["{S}/m"],
            Box::new(|s| fs::write(s.join("m"), "x").unwrap()),
        ),
        folder(
            "empty",
            &["config.json", "missing"],
            Box::new(|s| fs::create_dir(s.join("m")).unwrap()),
        ),
        folder(
            "config-not-json",
            &["config.json"],
            replaced_file("config.json", Some("{")),
        ),
        folder(
            "config-an-array",
            &["config.json", "object"],
            replaced_file("config.json", Some("[1, 2]")),
        ),
        folder(
            "unknown-model-type",
            &["unknown model_type", "gpt9"],
            config_value("qwen3", "model_type", json!("gpt9")),
        ),
        folder(
            "no-model-type",
            &["model_type"],
            broken_config("qwen3", |c| {
                c.remove("model_type");
            }),
        ),
        folder(
            "hidden-size-a-string",
            &["config.json", "hidden_size", "\"big\"", "expected i32"],
            config_value("qwen3", "hidden_size", json!("big")),
        ),
        folder(
            "rope-theta-a-list",
            &["config.json", "rope_theta", "expected f64"],
            config_value("llama", "rope_theta", json!([1])),
        ),
        folder(
            "text-config-layers-negative",
            &["config.json", "text_config.num_hidden_layers", "-2"],
            broken_config("qwen3_5", |c| {
                c["text_config"]["num_hidden_layers"] = json!(-2);
            }),
        ),
        folder(
            "vocab-size-changed",
            &["embed_tokens", "shape"],
            config_value("qwen3", "vocab_size", json!(2048)),
        ),
        folder(
            "hidden-size-changed",
            &["shape"],
            config_value("qwen3", "hidden_size", json!(64)),
        ),
        folder(
            "head-dim-zero",
            &["config.json", "head_dim is 0", "at least 1"],
            config_value("qwen3", "head_dim", json!(0)),
        ),
        folder(
            "attention-heads-zero",
            &["config.json", "num_attention_heads is 0", "at least 1"],
            config_value("qwen3", "num_attention_heads", json!(0)),
        ),
        folder(
            "kv-heads-not-dividing",
            &[
                "num_key_value_heads is 3",
                "must divide num_attention_heads (4)",
            ],
            config_value("qwen3", "num_key_value_heads", json!(3)),
        ),
        folder(
            "rms-norm-eps-negative",
            &["rms_norm_eps is -1", "finite number > 0"],
            config_value("llama", "rms_norm_eps", json!(-1.0)),
        ),
        folder(
            "rope-theta-negative",
            &["rope_theta", "-1", "finite number > 0"],
            config_value("llama", "rope_theta", json!(-1.0)),
        ),
        folder(
            "text-config-hidden-size-zero",
            &["text_config.hidden_size", "hidden_size is 0"],
            broken_config("qwen3_5", |c| {
                c["text_config"]["hidden_size"] = json!(0);
            }),
        ),
        folder(
            "more-layers",
            &["missing tensor", "layers.2"],
            config_value("qwen3", "num_hidden_layers", json!(3)),
        ),
        folder(
            "fewer-layers",
            &["unexpected tensors", "layers.1"],
            config_value("qwen3", "num_hidden_layers", json!(1)),
        ),
        folder(
            "eos-past-vocab",
            &["eos token id 5000", "1024"],
            config_value("qwen3", "eos_token_id", json!(5000)),
        ),
        folder(
            "eos-negative",
            &["eos_token_id"],
            config_value("qwen3", "eos_token_id", json!(-1)),
        ),
        folder(
            "sliding-window-zero",
            &["sliding_window must be at least 1"],
            config_value("gemma3", "sliding_window", json!(0)),
        ),
        folder(
            "sliding-window-pattern-zero",
            &["sliding_window_pattern"],
            config_value("gemma3", "sliding_window_pattern", json!(0)),
        ),
        folder(
            "full-attention-interval-zero",
            &["full_attention_interval"],
            config_value("qwen3_next", "full_attention_interval", json!(0)),
        ),
        folder(
            "moe-more-experts-per-token-than-experts",
            &[
                "config.json",
                "num_experts_per_tok is 9",
                "between 1 and num_experts (8)",
            ],
            config_value("qwen3_moe", "num_experts_per_tok", json!(9)),
        ),
        folder(
            "moe-no-experts",
            &["config.json", "num_experts is 0", "at least 1"],
            config_value("qwen3_moe", "num_experts", json!(0)),
        ),
        folder(
            "moe-sparse-step-zero",
            &["config.json", "decoder_sparse_step is 0", "at least 1"],
            config_value("qwen3_moe", "decoder_sparse_step", json!(0)),
        ),
        folder(
            "moe-dense-layer-past-the-layers",
            &["mlp_only_layers lists layer 3", "layers 0 to 2"],
            config_value("qwen3_moe", "mlp_only_layers", json!([1, 3])),
        ),
        folder(
            "moe-bfloat16-experts-on-the-cpu",
            &[
                "model.layers.0.mlp.switch_mlp.gate_proj.weight",
                "Bfloat16",
                "float32 on the CPU",
            ],
            as_bfloat16("qwen3_moe"),
        ),
        folder(
            "moe-missing-expert-tensor",
            &[
                "missing tensor",
                "model.layers.2.mlp.experts.5.down_proj.weight",
            ],
            without_tensor("qwen3_moe", "model.layers.2.mlp.experts.5.down_proj.weight"),
        ),
        folder(
            "moe-missing-quantized-expert-scales",
            &[
                "model.layers.2.mlp.switch_mlp.up_proj.weight",
                "Uint32",
                ".scales beside it, which is missing",
            ],
            without_tensor(
                "qwen3_moe-4bit",
                "model.layers.2.mlp.switch_mlp.up_proj.scales",
            ),
        ),
        folder(
            "hybrid-moe-more-experts-per-token-than-experts",
            &[
                "config.json",
                "num_experts_per_tok is 5",
                "between 1 and num_experts (4)",
            ],
            broken_config("qwen3_5_moe", |c| {
                c["text_config"]["num_experts_per_tok"] = json!(5);
            }),
        ),
        folder(
            "hybrid-moe-no-experts-per-token",
            &["config.json", "num_experts_per_tok is 0", "between 1"],
            broken_config("qwen3_5_moe", |c| {
                c["text_config"]
                    .as_object_mut()
                    .unwrap()
                    .remove("num_experts_per_tok");
            }),
        ),
        folder(
            "hybrid-moe-shared-expert-width-zero",
            &[
                "config.json",
                "shared_expert_intermediate_size is 0",
                "at least 1",
            ],
            broken_config("qwen3_5_moe", |c| {
                c["text_config"]["shared_expert_intermediate_size"] = json!(0);
            }),
        ),
        folder(
            "hybrid-moe-missing-fused-expert-tensor",
            &["missing tensor", "layers.1.mlp.experts.down_proj"],
            without_tensor(
                "qwen3_5_moe",
                "model.language_model.layers.1.mlp.experts.down_proj",
            ),
        ),
        folder(
            "hybrid-moe-missing-shared-expert-gate",
            &["missing tensor", "layers.0.mlp.shared_expert_gate.weight"],
            without_tensor(
                "qwen3_5_moe",
                "model.language_model.layers.0.mlp.shared_expert_gate.weight",
            ),
        ),
        folder(
            "glm-moe-more-experts-per-token-than-experts",
            &[
                "config.json",
                "num_experts_per_tok is 9",
                "between 1 and n_routed_experts (8)",
            ],
            config_value("glm4_moe", "num_experts_per_tok", json!(9)),
        ),
        folder(
            "glm-moe-topk-group-past-n-group",
            &[
                "config.json",
                "topk_group is 5",
                "between 1 and n_group (4)",
            ],
            config_value("glm4_moe", "topk_group", json!(5)),
        ),
        folder(
            "glm-moe-experts-not-divisible-into-groups",
            &["config.json", "n_group is 3", "divide n_routed_experts (8)"],
            config_value("glm4_moe", "n_group", json!(3)),
        ),
        folder(
            "glm-moe-groups-of-one-expert",
            &["config.json", "n_group is 8", "at least 2 experts"],
            config_value("glm4_moe", "n_group", json!(8)),
        ),
        folder(
            "glm-moe-unknown-topk-method",
            &["config.json", "topk_method is \"greedy\"", "noaux_tc"],
            config_value("glm4_moe", "topk_method", json!("greedy")),
        ),
        folder(
            "glm-moe-missing-expert-tensor",
            &[
                "missing tensor",
                "model.layers.1.mlp.experts.7.up_proj.weight",
            ],
            without_tensor("glm4_moe", "model.layers.1.mlp.experts.7.up_proj.weight"),
        ),
        folder(
            "glm-moe-missing-correction-bias",
            &[
                "missing tensor",
                "model.layers.1.mlp.gate.e_score_correction_bias",
            ],
            without_tensor(
                "glm4_moe",
                "model.layers.1.mlp.gate.e_score_correction_bias",
            ),
        ),
        folder(
            "glm-lite-more-experts-per-token-than-experts",
            &[
                "config.json",
                "num_experts_per_tok is 9",
                "between 1 and n_routed_experts (8)",
            ],
            config_value("glm4_moe_lite", "num_experts_per_tok", json!(9)),
        ),
        folder(
            "glm-lite-missing-expert-tensor",
            &[
                "missing tensor",
                "model.layers.1.mlp.experts.7.gate_proj.weight",
            ],
            without_tensor(
                "glm4_moe_lite",
                "model.layers.1.mlp.experts.7.gate_proj.weight",
            ),
        ),
        folder(
            "glm-lite-kv-lora-rank-not-the-weights",
            &[
                "config.json",
                "model.layers.0.self_attn.kv_b_proj",
                "[192, 64]",
                "kv_lora_rank is [192, 48]",
            ],
            config_value("glm4_moe_lite", "kv_lora_rank", json!(48)),
        ),
        folder(
            "glm-lite-rope-head-dim-not-the-weights",
            &[
                "model.layers.0.self_attn.q_b_proj.weight",
                "[160, 64]",
                "the config implies [144, 64]",
            ],
            config_value("glm4_moe_lite", "qk_rope_head_dim", json!(8)),
        ),
        folder(
            "glm-lite-q-lora-rank-null-over-low-rank-weights",
            &["missing tensor", "model.layers.0.self_attn.q_proj.weight"],
            config_value("glm4_moe_lite", "q_lora_rank", Value::Null),
        ),
        folder(
            "glm-lite-moe-layer-freq-zero",
            &["config.json", "moe_layer_freq is 0", "at least 1"],
            config_value("glm4_moe_lite", "moe_layer_freq", json!(0)),
        ),
        folder(
            "glm-lite-zero-kv-lora-rank",
            &["config.json", "kv_lora_rank is 0", "at least 1"],
            config_value("glm4_moe_lite", "kv_lora_rank", json!(0)),
        ),
        folder(
            "gemma4-kv-sharing-past-the-layers",
            &[
                "config.json",
                "num_kv_shared_layers is 7",
                "below num_hidden_layers (5)",
            ],
            config_value("gemma4", "num_kv_shared_layers", json!(7)),
        ),
        folder(
            "gemma4-every-layer-kv-shared",
            &[
                "config.json",
                "num_kv_shared_layers is 5",
                "below num_hidden_layers (5)",
            ],
            config_value("gemma4", "num_kv_shared_layers", json!(5)),
        ),
        folder(
            "gemma4-kv-shared-layer-without-an-owner",
            &[
                "config.json",
                "layer 1 is KV-shared (num_kv_shared_layers is 4)",
                "no earlier layer is a full_attention",
            ],
            config_value("gemma4", "num_kv_shared_layers", json!(4)),
        ),
        folder(
            "gemma4-moe-block-without-experts",
            &[
                "config.json",
                "num_experts is missing",
                "enable_moe_block is true",
            ],
            config_value("gemma4", "enable_moe_block", json!(true)),
        ),
        folder(
            "gemma4-moe-top-k-past-the-experts",
            &[
                "config.json",
                "top_k_experts is 5",
                "between 1 and num_experts (4)",
            ],
            config_value("gemma4_moe", "top_k_experts", json!(5)),
        ),
        folder(
            "gemma4-moe-missing-router-scale",
            &["missing tensor", "model.layers.1.router.per_expert_scale"],
            without_tensor("gemma4_moe", "model.layers.1.router.per_expert_scale"),
        ),
        folder(
            "gemma4-layer-types-short",
            &[
                "config.json",
                "layer_types has 1 entries",
                "one per layer (5)",
            ],
            config_value("gemma4", "layer_types", json!(["full_attention"])),
        ),
        folder(
            "gemma4-per-layer-vocab-too-small",
            &[
                "config.json",
                "vocab_size_per_layer_input is 512",
                "at least vocab_size (1024)",
            ],
            config_value("gemma4", "vocab_size_per_layer_input", json!(512)),
        ),
        folder(
            "gemma4-missing-per-layer-tensor",
            &[
                "missing tensor",
                "model.layers.2.per_layer_input_gate.weight",
            ],
            without_tensor("gemma4", "model.layers.2.per_layer_input_gate.weight"),
        ),
        folder(
            "quantization-group-zero",
            &["quantization.group_size is 0"],
            broken_config("qwen3-4bit", |c| {
                c["quantization"]["group_size"] = json!(0);
            }),
        ),
        folder(
            "quantization-bits-zero",
            &["quantization.bits is 0"],
            broken_config("qwen3-4bit", |c| {
                c["quantization"]["bits"] = json!(0);
            }),
        ),
        folder(
            "quantization-bits-disagree-with-the-weights",
            &["quantization.bits is 8", "stored with bits 4"],
            broken_config("qwen3-4bit", |c| {
                c["quantization"]["bits"] = json!(8);
            }),
        ),
        folder(
            "quantization-not-an-object",
            &["quantization"],
            config_value("qwen3-4bit", "quantization", json!(4)),
        ),
        folder(
            "no-weights",
            &["no model*.safetensors"],
            replaced_file("model.safetensors", None),
        ),
        folder(
            "weights-truncated",
            &["model.safetensors"],
            Box::new(|s| {
                let path = copy_model(s, "qwen3").join("model.safetensors");
                let bytes = fs::read(&path).unwrap();
                fs::write(&path, &bytes[..bytes.len() / 2]).unwrap();
            }),
        ),
        folder(
            "weights-garbage",
            &["model.safetensors"],
            replaced_file("model.safetensors", Some("not a safetensors file at all")),
        ),
        folder(
            "weights-dtype-relabelled",
            &["embed_tokens", "Int32", "float"],
            broken_header("model.embed_tokens.weight", |t| {
                t.insert("dtype".into(), json!("I32"));
            }),
        ),
        folder(
            "weights-dtype-size-mismatch",
            &["embed_tokens", "bytes"],
            broken_header("model.embed_tokens.weight", |t| {
                t.insert("dtype".into(), json!("F16"));
            }),
        ),
        folder(
            "weights-unknown-dtype",
            &["embed_tokens", "dtype"],
            broken_header("model.embed_tokens.weight", |t| {
                t.insert("dtype".into(), json!("F8_E4M3"));
            }),
        ),
        folder(
            "weights-shape-lies",
            &["embed_tokens"],
            broken_header("model.embed_tokens.weight", |t| {
                t.insert("shape".into(), json!([2048, 128]));
            }),
        ),
        folder(
            "weights-offsets-past-end",
            &["embed_tokens"],
            broken_header("model.embed_tokens.weight", |t| {
                t.insert("data_offsets".into(), json!([1116416, 99999999]));
            }),
        ),
        folder(
            "weights-overlapping-offsets",
            &["model.layers.0.input_layernorm.weight", "overlap"],
            broken_header("model.layers.0.post_attention_layernorm.weight", |t| {
                t.insert("data_offsets".into(), json!([984832, 985344]));
            }),
        ),
        folder(
            "weights-nan",
            &["model.layers.0.mlp.up_proj.weight", "NaN or infinite"],
            poisoned_tensor("model.layers.0.mlp.up_proj.weight", f32::NAN.to_bits()),
        ),
        folder(
            "weights-infinity",
            &["model.embed_tokens.weight", "NaN or infinite"],
            poisoned_tensor("model.embed_tokens.weight", f32::NEG_INFINITY.to_bits()),
        ),
        folder(
            "weights-tensor-in-two-shards",
            &["model.norm.weight", "is also in", "model.safetensors"],
            repeated_in_a_shard("model.norm.weight"),
        ),
        case(
            "model/quantized-override-not-the-stored-bits",
            &["generate", "--model", "{S}/m", "-m", "2"],
            2,
            &[
                "quantization.model.layers.0.mlp.up_proj",
                "bits 8",
                "stored as bits 4",
            ],
            Box::new(|s| {
                let dir = s.join("m");
                fs::create_dir_all(&dir).unwrap();
                for entry in fs::read_dir(model_dir("qwen3-4bit")).unwrap() {
                    let entry = entry.unwrap();
                    fs::copy(entry.path(), dir.join(entry.file_name())).unwrap();
                }
                edit_json(&dir.join("config.json"), |c| {
                    c["quantization"]["model.layers.0.mlp.up_proj"] =
                        json!({"group_size": 64, "bits": 8});
                });
            }),
        ),
        folder(
            "no-tokenizer",
            &["tokenizer.json"],
            replaced_file("tokenizer.json", None),
        ),
        folder(
            "tokenizer-not-json",
            &["tokenizer.json", "JSON"],
            replaced_file("tokenizer.json", Some("{")),
        ),
        folder(
            "tokenizer-larger-than-embedding",
            &["tokenizer has 1025 tokens", "1024 rows"],
            Box::new(|s| {
                edit_json(&copy_model(s, "qwen3").join("tokenizer.json"), |t| {
                    t["added_tokens"].as_array_mut().unwrap().push(json!({
                        "id": 1024, "content": "<|extra|>", "single_word": false,
                        "lstrip": false, "rstrip": false, "normalized": false,
                        "special": true
                    }));
                })
            }),
        ),
    ]
}

fn cache_prompt_cases() -> Vec<Case> {
    let q = model_arg("qwen3");
    let cp = |name: &str, extra: &[&str], needles: &[&str], setup: Setup| {
        let mut args = vec!["cache-prompt", "--model", &q];
        args.extend(extra);
        case(&format!("cache-prompt/{name}"), &args, 2, needles, setup)
    };
    let out = ["--out", "{S}/c.safetensors"];
    let with_out = |extra: &[&'static str]| -> Vec<&str> {
        let mut v: Vec<&str> = extra.to_vec();
        v.extend(out);
        v
    };
    vec![
        cp(
            "token-past-vocab",
            &with_out(&["--tokens", "1,2,5000"]),
            &["prompt token 2", "5000", "1024"],
            no_setup(),
        ),
        cp(
            "token-u32-max",
            &with_out(&["--tokens", "1,2,4294967295"]),
            &["4294967295", "1024"],
            no_setup(),
        ),
        cp(
            "token-past-u32",
            &with_out(&["--tokens", "1,4294967296"]),
            &["4294967296"],
            no_setup(),
        ),
        cp(
            "token-negative",
            &with_out(&["--tokens", "1,-2"]),
            &["-2"],
            no_setup(),
        ),
        cp(
            "token-not-a-number",
            &with_out(&["--tokens", "1,x"]),
            &["--tokens"],
            no_setup(),
        ),
        cp("no-prompt", &out, &["--prompt or --tokens"], no_setup()),
        cp(
            "out-is-a-directory",
            &["--tokens", "1,2", "--out", "{S}/d"],
            &["{S}/d", "is a directory"],
            Box::new(|s| fs::create_dir(s.join("d")).unwrap()),
        ),
        cp(
            "out-in-a-missing-folder",
            &["--tokens", "1,2", "--out", "{S}/nope/c.safetensors"],
            &["--out {S}/nope/c.safetensors", "{S}/nope does not exist"],
            no_setup(),
        ),
        cp(
            "out-a-fifo",
            &["--tokens", "1,2", "--out", "{S}/fifo"],
            &["--out {S}/fifo", "is a FIFO", "regular file"],
            Box::new(|s| {
                let made = Command::new("mkfifo").arg(s.join("fifo")).status().unwrap();
                assert!(made.success());
            }),
        ),
        cp(
            "out-a-character-device",
            &["--tokens", "1,2", "--out", "/dev/null"],
            &["--out /dev/null", "is a character device"],
            no_setup(),
        ),
        cp(
            "out-a-symbolic-link",
            &["--tokens", "1,2", "--out", "{S}/link.safetensors"],
            &["--out {S}/link.safetensors", "is a symbolic link"],
            Box::new(|s| {
                fs::write(s.join("real.safetensors"), "kept").unwrap();
                std::os::unix::fs::symlink(s.join("real.safetensors"), s.join("link.safetensors"))
                    .unwrap();
            }),
        ),
        cp(
            "kv-group-zero",
            &with_out(&["--tokens", "1,2", "--kv-bits", "4", "--kv-group-size", "0"]),
            &["kv_group_size", "0"],
            no_setup(),
        ),
        cp(
            "kv-bits-five-hundred",
            &with_out(&["--tokens", "1,2", "--kv-bits", "500"]),
            &["kv_bits", "500"],
            no_setup(),
        ),
        cp(
            "max-kv-size-two",
            &with_out(&["--tokens", "1,2", "--max-kv-size", "2"]),
            &["max_kv_size", "2"],
            no_setup(),
        ),
        cp(
            "prefill-step-zero",
            &with_out(&["--tokens", "1,2", "--prefill-step-size", "0"]),
            &["prefill_step_size", "0"],
            no_setup(),
        ),
        cp(
            "existing-out-kept-on-failure",
            &with_out(&["--tokens", "1,5000"]),
            &["5000"],
            file("c.safetensors", "the previous cache".into()),
        ),
    ]
}

/// A golden trace, edited.
fn trace_with(edit: fn(&mut Value)) -> String {
    let path = root().join("golden/traces/qwen3-target/greedy/code.json");
    let mut trace: Value = serde_json::from_str(&fs::read_to_string(path).unwrap()).unwrap();
    edit(&mut trace);
    serde_json::to_string(&trace).unwrap()
}

/// Bad traces, each through `replay` and through `check --traces`.
fn trace_cases() -> Vec<Case> {
    let bad: Vec<(&str, String, &[&str])> = vec![
        ("not-json", "{".into(), &["t.json"]),
        ("an-array", "[]".into(), &["t.json"]),
        (
            "unknown-format",
            trace_with(|t| t["format"] = json!("verity-trace/99")),
            &["unknown trace format"],
        ),
        (
            "prompt-token-past-vocab",
            trace_with(|t| t["prompt"]["tokens"][3] = json!(5000)),
            &["prompt token 3", "5000"],
        ),
        (
            "empty-prompt",
            trace_with(|t| t["prompt"]["tokens"] = json!([])),
            &["prompt", "empty"],
        ),
        (
            "logit-bias-past-vocab",
            trace_with(|t| t["params"]["processors"]["logit_bias"] = json!({"5000": 1.0})),
            &["logit_bias token id", "5000"],
        ),
        (
            "logit-bias-key-not-an-id",
            trace_with(|t| t["params"]["processors"]["logit_bias"] = json!({"x": 1.0})),
            &["logit_bias"],
        ),
        (
            "top-p-two",
            trace_with(|t| t["params"]["sampler"]["top_p"] = json!(2.0)),
            &["top_p", "2"],
        ),
        (
            "keys-unknown",
            trace_with(|t| t["params"]["keys"] = json!("random")),
            &["keys", "random"],
        ),
        (
            "positioned-keys-with-min-p",
            trace_with(|t| {
                t["params"]["keys"] = json!("positioned");
                t["params"]["seed"] = json!(3);
                t["params"]["sampler"]["temp"] = json!(0.8);
                t["params"]["sampler"]["min_p"] = json!(0.1);
            }),
            &["min_p", "0.1", "positioned keys"],
        ),
        (
            "temp-negative",
            trace_with(|t| t["params"]["sampler"]["temp"] = json!(-1.0)),
            &["temperature", "-1"],
        ),
        (
            "max-tokens-zero",
            trace_with(|t| t["params"]["max_tokens"] = json!(0)),
            &["of 0 tokens"],
        ),
        (
            "kv-group-zero",
            trace_with(|t| {
                t["params"]["kv_bits"] = json!(4);
                t["params"]["kv_group_size"] = json!(0);
            }),
            &["kv_group_size", "0"],
        ),
        (
            "model-missing",
            trace_with(|t| t["model"] = json!("golden/models/nope")),
            &["nope", "no such model folder"],
        ),
        (
            "draft-missing",
            trace_with(|t| {
                t["draft"] =
                    json!({"kind": "model", "model": "golden/models/nope", "num_draft_tokens": 3})
            }),
            &["nope"],
        ),
        (
            "draft-k-zero",
            trace_with(
                |t| t["draft"] = json!({"kind": "model", "model": "golden/models/qwen3-draft", "num_draft_tokens": 0}),
            ),
            &["num_draft_tokens", "0"],
        ),
        (
            "mtp-block-one",
            trace_with(|t| t["draft"] = json!({"kind": "mtp", "block_size": 1})),
            &["draft.block_size", "1", "[2, 257]"],
        ),
        (
            "mtp-on-a-target-without-head",
            trace_with(|t| t["draft"] = json!({"kind": "mtp", "block_size": 3})),
            &["mtp.* weights"],
        ),
        (
            "dflash-drafter-missing",
            trace_with(|t| {
                t["draft"] =
                    json!({"kind": "dflash", "model": "golden/models/nope", "block_size": 4})
            }),
            &["nope", "no such model folder"],
        ),
        (
            "dflash-block-one",
            trace_with(
                |t| t["draft"] = json!({"kind": "dflash", "model": "golden/models/qwen3-target-dflash", "block_size": 1}),
            ),
            &["draft.block_size", "1", "[2, 257]"],
        ),
        (
            "prompt-cache-missing",
            trace_with(|t| {
                t["prompt_cache"] = json!({"file": "golden/nope.safetensors", "tokens": [1]})
            }),
            &["nope.safetensors"],
        ),
        (
            "recorded-token-past-vocab",
            trace_with(|t| t["steps"][2]["token"] = json!(5000)),
            &["recorded token 2 is 5000", "vocabulary size"],
        ),
        (
            "top-token-past-vocab",
            trace_with(|t| t["steps"][1]["top"][0][0] = json!(5000)),
            &["steps[1].top token 0 is 5000"],
        ),
        (
            "logprob-positive",
            trace_with(|t| t["steps"][0]["logprob"] = json!(0.5)),
            &["steps[0]", "logprob is 0.5", "at most 0"],
        ),
        (
            "logprob-overflows-f32",
            trace_with(|t| t["steps"][0]["logprob"] = json!(-1e39)),
            &["steps[0]", "logprob is -inf", "finite"],
        ),
        (
            "top-out-of-order",
            trace_with(|t| {
                let top = t["steps"][0]["top"].as_array_mut().unwrap();
                top.swap(0, 1);
            }),
            &["steps[0]", "not in order"],
        ),
        (
            "top-disagrees-with-the-chosen-logprob",
            trace_with(|t| t["steps"][0]["logprob"] = json!(-50.0)),
            &["steps[0]", "chosen token", "-50"],
        ),
        (
            "from-draft-without-a-draft",
            trace_with(|t| t["steps"][0]["from_draft"] = json!(true)),
            &["steps[0]", "from_draft", "no draft"],
        ),
        (
            "eos-past-vocab",
            trace_with(|t| t["eos_token_ids"] = json!([5000])),
            &["eos_token_ids is [5000]", "the model stops on"],
        ),
    ];
    let mut cases = Vec::new();
    for (name, text, needles) in bad {
        cases.push(case(
            &format!("replay/{name}"),
            &["replay", "--root", "{R}", "{S}/t.json"],
            2,
            needles,
            file("t.json", text.clone()),
        ));
        cases.push(case(
            &format!("check/{name}"),
            &["check", "--root", "{R}", "--traces", "{S}/set"],
            2,
            needles,
            Box::new(move |s| {
                fs::create_dir(s.join("set")).unwrap();
                fs::write(s.join("set/t.json"), &text).unwrap();
            }),
        ));
    }
    let check = |name: &str, args: &[&str], needles: &[&str], setup: Setup| {
        case(&format!("check/{name}"), args, 2, needles, setup)
    };
    cases.extend([
        case(
            "replay/missing-file",
            &["replay", "--root", "{R}", "{S}/nope.json"],
            2,
            &["nope.json"],
            no_setup(),
        ),
        case(
            "replay/a-directory",
            &["replay", "--root", "{R}", "{S}"],
            2,
            &["{S}"],
            no_setup(),
        ),
        case(
            "replay/outside-a-repository",
            &[
                "replay",
                &root()
                    .join("golden/traces/qwen3/greedy/code.json")
                    .to_string_lossy(),
            ],
            2,
            &["not a verity repository root"],
            no_setup(),
        ),
        check(
            "missing-folder",
            &["check", "--root", "{R}", "--traces", "{S}/nope"],
            &["{S}/nope"],
            no_setup(),
        ),
        check(
            "empty-folder",
            &["check", "--root", "{R}", "--traces", "{S}"],
            &["no trace files"],
            no_setup(),
        ),
        check(
            "only-matches-nothing",
            &["check", "--root", "{R}", "--only", "zzz-no-such-suite"],
            &["zzz-no-such-suite"],
            no_setup(),
        ),
        check(
            "root-without-goldens",
            &["check", "--root", "{S}"],
            &["no golden traces"],
            no_setup(),
        ),
        check(
            "html-into-a-folder",
            &["check", "--root", "{R}", "--html", "{S}"],
            &["--html {S}"],
            no_setup(),
        ),
        check(
            "accept-without-html",
            &["check", "--root", "{R}", "--accept", "{S}/a.json"],
            &["required arguments were not provided"],
            no_setup(),
        ),
        check(
            "accept-not-an-accept-document",
            &[
                "check",
                "--root",
                "{R}",
                "--html",
                "{S}/r.html",
                "--accept",
                "{S}/a.json",
            ],
            &[
                "--accept {S}/a.json",
                "not a `verity accept --json` document",
            ],
            file("a.json", r#"{"rows": []}"#.into()),
        ),
        check(
            "bench-not-json",
            &[
                "check",
                "--root",
                "{R}",
                "--html",
                "{S}/r.html",
                "--bench",
                "{S}/b.json",
            ],
            &["--bench {S}/b.json"],
            file("b.json", "{".into()),
        ),
        check(
            "duplicate-trace-ids",
            &["check", "--root", "{R}", "--traces", "{S}/set"],
            &["appears twice"],
            Box::new(|s| {
                fs::create_dir(s.join("set")).unwrap();
                let text = trace_with(|_| {});
                fs::write(s.join("set/a.json"), &text).unwrap();
                fs::write(s.join("set/b.json"), &text).unwrap();
            }),
        ),
    ]);
    cases
}

/// An acceptance suite file, edited.
fn suite_with(edit: fn(&mut toml::Table)) -> String {
    let text = fs::read_to_string(root().join("golden/accept/noisy-draft.toml")).unwrap();
    let mut suite: toml::Table = toml::from_str(&text).unwrap();
    edit(&mut suite);
    toml::to_string(&suite).unwrap()
}

/// The noisy-draft suite's committed baseline, edited.
fn baseline_with(edit: fn(&mut Value)) -> String {
    let path = root().join("golden/accept/noisy-draft.baseline.json");
    let mut b: Value = serde_json::from_str(&fs::read_to_string(path).unwrap()).unwrap();
    edit(&mut b);
    serde_json::to_string(&b).unwrap()
}

/// `verity accept` exits 125 on anything it cannot run, so `git bisect run` skips the commit.
fn accept_cases() -> Vec<Case> {
    let suite = |name: &str, text: String, needles: &[&str]| {
        case(
            &format!("accept/suite-{name}"),
            &["accept", "--root", "{R}", "--suite", "{S}/noisy-draft.toml"],
            125,
            needles,
            Box::new(move |s| {
                fs::write(s.join("noisy-draft.toml"), &text).unwrap();
                fs::copy(
                    root().join("golden/accept/noisy-draft.baseline.json"),
                    s.join("noisy-draft.baseline.json"),
                )
                .unwrap();
            }),
        )
    };
    let baseline = |name: &str, text: String, needles: &[&str]| {
        case(
            &format!("accept/baseline-{name}"),
            &[
                "accept",
                "--root",
                "{R}",
                "--suite",
                "{R}/golden/accept/noisy-draft.toml",
                "--baseline",
                "{S}/b.json",
            ],
            125,
            needles,
            file("b.json", text),
        )
    };
    vec![
        case(
            "accept/suite-missing",
            &["accept", "--root", "{R}", "--suite", "{S}/nope.toml"],
            125,
            &["nope.toml"],
            no_setup(),
        ),
        suite("not-toml", "[[[".into(), &["noisy-draft.toml"]),
        suite(
            "wrong-format",
            suite_with(|s| {
                s.insert("format".into(), "verity-accept/9".into());
            }),
            &["format"],
        ),
        suite(
            "no-prompts",
            suite_with(|s| {
                s.insert("prompts".into(), toml::Value::Array(vec![]));
            }),
            &["prompts"],
        ),
        suite(
            "k-zero",
            suite_with(|s| {
                s.insert(
                    "num_draft_tokens".into(),
                    toml::Value::Array(vec![0.into()]),
                );
            }),
            &["num_draft_tokens"],
        ),
        suite(
            "k-repeated",
            suite_with(|s| {
                s.insert(
                    "num_draft_tokens".into(),
                    toml::Value::Array(vec![3.into(), 3.into()]),
                );
            }),
            &["distinct"],
        ),
        suite(
            "prompt-token-past-vocab",
            suite_with(|s| {
                s["prompts"].as_array_mut().unwrap()[0]
                    .as_array_mut()
                    .unwrap()[0] = 5000.into();
            }),
            &["5000"],
        ),
        suite(
            "oracle-accepts-more-than-it-drafts",
            suite_with(|s| {
                let oracle: toml::Table = toml::from_str(
                    "from_draft = { \"3\" = 0.5 }\n\
                     drafted_by_pos = { \"3\" = [10, 8, 6] }\n\
                     accepted_by_pos = { \"3\" = [4, 9, 1] }",
                )
                .unwrap();
                s.insert("oracle".into(), toml::Value::Table(oracle));
            }),
            &["oracle k=3", "[4, 9, 1]", "[10, 8, 6]"],
        ),
        suite(
            "target-missing",
            suite_with(|s| {
                s.insert("target".into(), "golden/models/nope".into());
            }),
            &["nope"],
        ),
        baseline("empty-file", String::new(), &["b.json"]),
        case(
            "accept/baseline-missing",
            &[
                "accept",
                "--root",
                "{R}",
                "--suite",
                "{R}/golden/accept/noisy-draft.toml",
                "--baseline",
                "{S}/nope.json",
            ],
            125,
            &["nope.json"],
            no_setup(),
        ),
        baseline("not-json", "{".into(), &["b.json"]),
        baseline(
            "wrong-format",
            baseline_with(|b| b["format"] = json!("verity-accept-baseline/1")),
            &["format"],
        ),
        baseline(
            "empty",
            baseline_with(|b| b["acceptance"] = json!({})),
            &["has rows for num_draft_tokens []"],
        ),
        baseline(
            "of-another-suite",
            baseline_with(|b| b["suite"] = json!("trained-pair")),
            &["trained-pair", "noisy-draft"],
        ),
        baseline(
            "accepting-more-than-drafted",
            baseline_with(|b| {
                let d = b["acceptance"]["3"]["drafted_by_pos"][0].clone();
                b["acceptance"]["3"]["accepted_by_pos"][0] = json!(d.as_u64().unwrap() + 1);
            }),
            &["acceptance k=3", "position 0 accepts"],
        ),
        baseline(
            "acceptance-rising-with-the-position",
            baseline_with(|b| {
                let a = &mut b["acceptance"]["3"]["accepted_by_pos"];
                a[2] = a[0].clone();
                a[1] = json!(0);
            }),
            &["acceptance k=3", "accepted_by_pos rises"],
        ),
        baseline(
            "a-count-missing",
            baseline_with(|b| {
                b["acceptance"]["3"]["drafted_by_pos"]
                    .as_array_mut()
                    .unwrap()
                    .pop();
            }),
            &["acceptance k=3", "drafted_by_pos has 2"],
        ),
        baseline(
            "more-from-draft-than-generated",
            baseline_with(|b| b["acceptance"]["3"]["from_draft"] = json!(1_000_000)),
            &["acceptance k=3", "from_draft 1000000"],
        ),
        case(
            "accept/write-baseline-to-a-fifo",
            &[
                "accept",
                "--root",
                "{R}",
                "--suite",
                "{R}/golden/accept/noisy-draft.toml",
                "--baseline",
                "{S}/fifo",
                "--write-baseline",
            ],
            125,
            &["baseline {S}/fifo", "is a FIFO"],
            Box::new(|s| {
                let made = Command::new("mkfifo").arg(s.join("fifo")).status().unwrap();
                assert!(made.success());
            }),
        ),
        baseline(
            "extra-row",
            baseline_with(|b| {
                let row = b["acceptance"]["3"].clone();
                b["acceptance"]["4"] = row;
            }),
            &["[3, 4]"],
        ),
        case(
            "accept/baseline-covering-one-k-of-six",
            &[
                "accept",
                "--root",
                "{R}",
                "--suite",
                "{R}/golden/accept/trained-pair.toml",
                "--baseline",
                "{S}/b.json",
            ],
            125,
            &["has rows for num_draft_tokens [3]", "[1, 2, 3, 4, 5, 6]"],
            Box::new(|s| {
                let path = root().join("golden/accept/trained-pair.baseline.json");
                let mut b: Value =
                    serde_json::from_str(&fs::read_to_string(path).unwrap()).unwrap();
                let row = b["acceptance"]["3"].clone();
                b["acceptance"] = json!({ "3": row });
                fs::write(s.join("b.json"), b.to_string()).unwrap();
            }),
        ),
        case(
            "accept/json-into-a-folder",
            &[
                "accept",
                "--root",
                "{R}",
                "--suite",
                "{R}/golden/accept/noisy-draft.toml",
                "--json",
                "{S}",
            ],
            125,
            &["--json {S}"],
            no_setup(),
        ),
        case(
            "accept/baseline-with-two-suites",
            &[
                "accept",
                "--root",
                "{R}",
                "--suite",
                "{R}/golden/accept/noisy-draft.toml",
                "--suite",
                "{R}/golden/accept/trained-pair.toml",
                "--baseline",
                "{R}/golden/accept/noisy-draft.baseline.json",
            ],
            125,
            &["--baseline needs exactly one --suite"],
            no_setup(),
        ),
    ]
}

/// `bisect`, `grammar-corpus` and `bench grammar`: bad arguments fail before any work.
fn other_cases() -> Vec<Case> {
    let r = "{R}";
    let q = model_arg("qwen3");
    // Both benches load the drafter the shared draft flags name before measuring anything.
    let mtp_without_a_head = ["speed", "serve"].map(|verb| {
        case(
            &format!("bench-{verb}/mtp-without-a-head"),
            &["bench", verb, "--model", &q, "--draft-mtp", "--no-mlx-lm"],
            2,
            &["mtp.* weights", "MTP head"],
            no_setup(),
        )
    });
    let mut cases = vec![
        case(
            "bisect/unknown-good",
            &[
                "bisect",
                "--repo",
                r,
                "--good",
                "no-such-ref",
                "--bad",
                "HEAD",
            ],
            2,
            &["no-such-ref"],
            no_setup(),
        ),
        case(
            "bisect/suite-missing",
            &[
                "bisect",
                "--repo",
                r,
                "--good",
                "HEAD",
                "--bad",
                "HEAD",
                "--suite",
                "nope.toml",
            ],
            2,
            &["--suite", "nope.toml"],
            no_setup(),
        ),
        case(
            "bisect/baseline-missing",
            &[
                "bisect",
                "--repo",
                r,
                "--good",
                "HEAD",
                "--bad",
                "HEAD",
                "--baseline",
                "{S}/nope.json",
            ],
            2,
            &["--baseline", "nope.json"],
            no_setup(),
        ),
        case(
            "bisect/repo-missing",
            &["bisect", "--repo", "{S}/nope", "--good", "a", "--bad", "b"],
            2,
            &["--repo", "nope"],
            no_setup(),
        ),
        case(
            "grammar-corpus/missing-folder",
            &[
                "grammar-corpus",
                "{S}/nope",
                "--model",
                &model_arg("qwen3-target"),
                "--expected",
                "{S}/e.json",
            ],
            2,
            &["nope", "not a corpus folder"],
            file("e.json", "[]".into()),
        ),
        case(
            "grammar-corpus/empty-folder",
            &[
                "grammar-corpus",
                "{S}/corpus",
                "--model",
                &model_arg("qwen3-target"),
                "--expected",
                "{S}/e.json",
            ],
            2,
            &["no .json schema files"],
            Box::new(|s| {
                fs::create_dir(s.join("corpus")).unwrap();
                fs::write(s.join("e.json"), "[]").unwrap();
            }),
        ),
        case(
            "grammar-corpus/a-file-not-json",
            &[
                "grammar-corpus",
                "{S}/corpus",
                "--model",
                &model_arg("qwen3-target"),
                "--expected",
                "{S}/e.json",
            ],
            2,
            &["corpus file", "bad.json", "not JSON"],
            Box::new(|s| {
                fs::create_dir(s.join("corpus")).unwrap();
                fs::write(s.join("corpus/bad.json"), "{").unwrap();
                fs::write(s.join("e.json"), "[]").unwrap();
            }),
        ),
        case(
            "grammar-corpus/a-test-without-valid",
            &[
                "grammar-corpus",
                "{S}/corpus",
                "--model",
                &model_arg("qwen3-target"),
                "--expected",
                "{S}/e.json",
            ],
            2,
            &["corpus file", "t.json", "tests[1]", "valid"],
            Box::new(|s| {
                fs::create_dir(s.join("corpus")).unwrap();
                let doc = json!({"schema": {"type": "integer"},
                    "tests": [{"valid": true, "data": 1}, {"data": "x"}]});
                fs::write(s.join("corpus/t.json"), doc.to_string()).unwrap();
                fs::write(s.join("e.json"), "[]").unwrap();
            }),
        ),
        case(
            "grammar-corpus/write-expected-to-a-directory",
            &[
                "grammar-corpus",
                "{R}/golden/schemas",
                "--model",
                &model_arg("qwen3-target"),
                "--expected",
                "{S}/d",
                "--write-expected",
            ],
            2,
            &["--expected {S}/d", "is a directory"],
            Box::new(|s| fs::create_dir(s.join("d")).unwrap()),
        ),
        case(
            "grammar-corpus/expected-missing",
            &[
                "grammar-corpus",
                "{R}/golden/schemas",
                "--model",
                &model_arg("qwen3-target"),
                "--expected",
                "{S}/nope.json",
            ],
            2,
            &["--expected", "nope.json"],
            no_setup(),
        ),
        case(
            "grammar-corpus/model-missing",
            &[
                "grammar-corpus",
                "{R}/golden/schemas",
                "--model",
                "{S}/nope",
                "--expected",
                "{S}/e.json",
            ],
            2,
            &["nope"],
            file("e.json", "[]".into()),
        ),
        case(
            "bench-grammar/corpus-missing",
            &["bench", "grammar", "--corpus", "{S}/nope"],
            2,
            &["nope"],
            no_setup(),
        ),
        case(
            "bench-grammar/max-tokens-zero",
            &[
                "bench",
                "grammar",
                "--corpus",
                "{R}/golden/schemas",
                "--model",
                &model_arg("qwen3-target"),
                "--max-tokens",
                "0",
            ],
            2,
            &["max_tokens", "0"],
            no_setup(),
        ),
        case(
            "bench-speed/runs-zero",
            &[
                "bench",
                "speed",
                "--model",
                &model_arg("qwen3"),
                "--runs",
                "0",
            ],
            2,
            &["--runs", "0"],
            no_setup(),
        ),
        case(
            "bench-speed/one-decode-token",
            &[
                "bench",
                "speed",
                "--model",
                &model_arg("qwen3"),
                "--decode-tokens",
                "1",
            ],
            2,
            &["--decode-tokens", "1"],
            no_setup(),
        ),
        case(
            "bench-speed/dflash-taps-past-the-target",
            &[
                "bench",
                "speed",
                "--model",
                &model_arg("qwen3"),
                "--draft-dflash",
                &model_arg(DFLASH),
                "--no-mlx-lm",
            ],
            2,
            &["target_layer_ids", "[1, 3]", "which has 2"],
            no_setup(),
        ),
        case(
            "bench-speed/two-drafters",
            &[
                "bench",
                "speed",
                "--model",
                &model_arg("qwen3"),
                "--draft-mtp",
                "--draft-dflash",
                &model_arg(DFLASH),
                "--no-mlx-lm",
            ],
            2,
            &["--draft-mtp", "--draft-dflash"],
            no_setup(),
        ),
        case(
            "bench-speed/ngram-max-below-min",
            &[
                "bench",
                "speed",
                "--model",
                &model_arg("qwen3"),
                "--ngram-min",
                "3",
                "--ngram-max",
                "2",
                "--no-mlx-lm",
            ],
            2,
            &["ngram_max", "2"],
            no_setup(),
        ),
        case(
            "bench-serve/clients-zero",
            &[
                "bench",
                "serve",
                "--model",
                &model_arg("qwen3"),
                "--clients",
                "4,0",
                "--no-mlx-lm",
            ],
            2,
            &["--clients", "[4, 0]", "at least 1"],
            no_setup(),
        ),
        case(
            "bench-serve/adaptive-drafts-without-drafter",
            &[
                "bench",
                "serve",
                "--model",
                &model_arg("qwen3"),
                "--adaptive-drafts",
                "--no-mlx-lm",
            ],
            2,
            &["--adaptive-drafts", "needs a drafter"],
            no_setup(),
        ),
        case(
            "bench-serve/model-missing",
            &[
                "bench",
                "serve",
                "--model",
                "{S}/nope",
                "--no-mlx-lm",
                "--python",
                "python3",
            ],
            2,
            &["nope", "no such model folder"],
            no_setup(),
        ),
        case(
            "generate/temperature-underflows",
            &[
                "generate",
                "--model",
                &model_arg("qwen3"),
                "-m",
                "2",
                "--temp",
                "1e-45",
                "--seed",
                "1",
            ],
            2,
            &["temperature is 1e-45", "fit in a float32"],
            no_setup(),
        ),
        case(
            "serve/attention-heads-zero",
            &["serve", "--port", "0", "--model", "{S}/m"],
            2,
            &["num_attention_heads is 0", "at least 1"],
            config_value("qwen3", "num_attention_heads", json!(0)),
        ),
        case(
            "serve/max-num-seqs-zero",
            &[
                "serve",
                "--port",
                "0",
                "--model",
                &model_arg("qwen3"),
                "--max-num-seqs",
                "0",
            ],
            2,
            &["--max-num-seqs", "at least 1"],
            no_setup(),
        ),
        case(
            "serve/adaptive-drafts-without-drafter",
            &[
                "serve",
                "--port",
                "0",
                "--model",
                &model_arg("qwen3"),
                "--adaptive-drafts",
            ],
            2,
            &["--adaptive-drafts", "needs a drafter"],
            no_setup(),
        ),
        case(
            "serve/adaptive-drafts-one-request-at-a-time",
            &[
                "serve",
                "--port",
                "0",
                "--model",
                &model_arg("qwen3"),
                "--draft-ngram",
                "--adaptive-drafts",
                "--max-num-seqs",
                "1",
            ],
            2,
            &["--adaptive-drafts", "--max-num-seqs above 1"],
            no_setup(),
        ),
        // The server's own flags are checked before it listens, as a request's would be.
        case(
            "serve/max-kv-size-zero",
            &[
                "serve",
                "--port",
                "0",
                "--model",
                &model_arg("qwen3"),
                "--max-kv-size",
                "0",
            ],
            2,
            &["cache flags", "max_kv_size", "0"],
            no_setup(),
        ),
        case(
            "serve/kv-bits-with-a-group-size-past-the-head-dim",
            &[
                "serve",
                "--port",
                "0",
                "--model",
                &model_arg("qwen3"),
                "--kv-bits",
                "4",
            ],
            2,
            &[
                "cache flags",
                "must divide the model's attention head dimension 32",
            ],
            no_setup(),
        ),
        case(
            "serve/prefill-step-size-zero",
            &[
                "serve",
                "--port",
                "0",
                "--model",
                &model_arg("qwen3"),
                "--prefill-step-size",
                "0",
            ],
            2,
            &["cache flags", "prefill_step_size"],
            no_setup(),
        ),
        case(
            "serve/shutdown-timeout-negative",
            &[
                "serve",
                "--port",
                "0",
                "--model",
                &model_arg("qwen3"),
                "--shutdown-timeout=-1",
            ],
            2,
            &["--shutdown-timeout", "-1", "from 0 to 3600"],
            no_setup(),
        ),
        case(
            "serve/shutdown-timeout-nan",
            &[
                "serve",
                "--port",
                "0",
                "--model",
                &model_arg("qwen3"),
                "--shutdown-timeout",
                "NaN",
            ],
            2,
            &["--shutdown-timeout", "NaN"],
            no_setup(),
        ),
        case(
            "bench-speed/model-missing",
            &["bench", "speed", "--model", "{S}/nope", "--no-mlx-lm"],
            2,
            &["nope", "no such model folder"],
            no_setup(),
        ),
        case(
            "bench-speed/no-oracle-venv",
            &[
                "bench",
                "speed",
                "--model",
                &model_arg("qwen3"),
                "--python",
                "{S}/python",
            ],
            2,
            &["oracle venv", "--no-mlx-lm"],
            no_setup(),
        ),
        case(
            "bench-speed/draft-of-another-vocabulary",
            &[
                "bench",
                "speed",
                "--model",
                &model_arg("qwen3"),
                "--draft-model",
                "{S}/m",
                "--no-mlx-lm",
            ],
            2,
            &["another tokenizer"],
            other_tokenizer(),
        ),
        case(
            "cli/unknown-verb",
            &["frobnicate"],
            2,
            &["frobnicate"],
            no_setup(),
        ),
    ];
    cases.extend(mtp_without_a_head);
    cases
}

/// A git repository at `<scratch>/repo` holding the acceptance suites, in two commits (the
/// second empty), then `extra` run on the scratch folder. `bisect` must refuse before it adds a
/// worktree or a target folder to it, which the check for files left behind would see.
fn bisect_repo(extra: impl Fn(&Path) + Send + Sync + 'static) -> Setup {
    Box::new(move |s| {
        let repo = s.join("repo");
        let suites = repo.join("golden/accept");
        fs::create_dir_all(&suites).unwrap();
        for suite in ["trained-pair", "noisy-draft"] {
            for file in [format!("{suite}.toml"), format!("{suite}.baseline.json")] {
                fs::copy(root().join("golden/accept").join(&file), suites.join(&file)).unwrap();
            }
        }
        let git = |args: &[&str]| {
            let out = Command::new("git")
                .arg("-C")
                .arg(&repo)
                .args([
                    "-c",
                    "user.name=bad input",
                    "-c",
                    "user.email=bad@verity.invalid",
                ])
                .args(["-c", "commit.gpgsign=false"])
                .args(args)
                .output()
                .unwrap();
            assert!(
                out.status.success(),
                "git {args:?}: {}",
                String::from_utf8_lossy(&out.stderr)
            );
        };
        git(&["init", "-q"]);
        git(&["add", "."]);
        git(&["commit", "-qm", "suites"]);
        git(&["commit", "-q", "--allow-empty", "-m", "later"]);
        extra(s);
    })
}

/// `bisect` refuses a bad revision, range, suite or baseline at once, exit 2, before it builds
/// anything: found after the first build, each would cost minutes.
fn bisect_cases() -> Vec<Case> {
    let bisect = |name: &str, extra: &[&str], needles: &[&str], setup: Setup| {
        let mut args = vec!["bisect", "--repo", "{S}/repo"];
        args.extend(extra);
        case(&format!("bisect/{name}"), &args, 2, needles, setup)
    };
    let baseline = |name: &str, text: String, needles: &[&str]| {
        bisect(
            &format!("baseline-{name}"),
            &[
                "--good",
                "HEAD~1",
                "--bad",
                "HEAD",
                "--suite",
                "golden/accept/noisy-draft.toml",
                "--baseline",
                "{S}/b.json",
            ],
            needles,
            bisect_repo(move |s| fs::write(s.join("b.json"), &text).unwrap()),
        )
    };
    let suite = |name: &str, text: String, needles: &[&str]| {
        bisect(
            &format!("suite-{name}"),
            &[
                "--good",
                "HEAD~1",
                "--bad",
                "HEAD",
                "--suite",
                "golden/accept/broken.toml",
            ],
            needles,
            bisect_repo(move |s| {
                fs::write(s.join("repo/golden/accept/broken.toml"), &text).unwrap()
            }),
        )
    };
    vec![
        bisect(
            "good-typo",
            &["--good", "zzz", "--bad", "HEAD"],
            &["--good zzz: no such commit in"],
            bisect_repo(|_| {}),
        ),
        bisect(
            "bad-typo",
            &["--good", "HEAD~1", "--bad", "zzz"],
            &["--bad zzz: no such commit in"],
            bisect_repo(|_| {}),
        ),
        bisect(
            "good-past-the-first-commit",
            &["--good", "HEAD~20", "--bad", "HEAD"],
            &["--good HEAD~20: no such commit in"],
            bisect_repo(|_| {}),
        ),
        bisect(
            "good-is-bad",
            &["--good", "HEAD", "--bad", "HEAD"],
            &["--good HEAD and --bad HEAD are the same commit"],
            bisect_repo(|_| {}),
        ),
        bisect(
            "good-after-bad",
            &["--good", "HEAD", "--bad", "HEAD~1"],
            &["--good HEAD is not an ancestor of --bad HEAD~1"],
            bisect_repo(|_| {}),
        ),
        case(
            "bisect/repo-not-git",
            &[
                "bisect", "--repo", "{S}", "--good", "HEAD~1", "--bad", "HEAD",
            ],
            2,
            &["--repo", "not a git repository"],
            no_setup(),
        ),
        bisect(
            "target-dir-of-the-repo",
            &[
                "--good",
                "HEAD~1",
                "--bad",
                "HEAD",
                "--target-dir",
                "{S}/repo/target",
            ],
            &["--target-dir", "the repository's own target folder"],
            bisect_repo(|s| fs::create_dir(s.join("repo/target")).unwrap()),
        ),
        baseline(
            "not-json",
            "not json".into(),
            &["--baseline", "b.json", "expected"],
        ),
        baseline(
            "of-another-suite",
            fs::read_to_string(root().join("golden/accept/trained-pair.baseline.json")).unwrap(),
            &[
                "--baseline",
                "b.json",
                "is the baseline of suite \"trained-pair\", not \"noisy-draft\"",
            ],
        ),
        baseline(
            "wrong-k",
            baseline_with(|b| {
                let row = b["acceptance"]["3"].clone();
                b["acceptance"]["5"] = row;
            }),
            &["--baseline", "has rows for num_draft_tokens [3, 5]"],
        ),
        baseline(
            "old-format",
            baseline_with(|b| b["format"] = json!("verity-accept-baseline/2")),
            &["--baseline", "verity-accept-baseline/2"],
        ),
        suite(
            "not-toml",
            "not toml".into(),
            &["--suite golden/accept/broken.toml"],
        ),
        suite(
            "no-prompts",
            suite_with(|s| {
                s.insert("prompts".into(), toml::Value::Array(Vec::new()));
            }),
            &[
                "--suite golden/accept/broken.toml",
                "prompts must be non-empty",
            ],
        ),
    ]
}

fn all_cases() -> Vec<Case> {
    let mut cases = generate_cases();
    cases.extend(model_folder_cases());
    cases.extend(cache_prompt_cases());
    cases.extend(trace_cases());
    cases.extend(accept_cases());
    cases.extend(other_cases());
    cases.extend(bisect_cases());
    cases.extend(split_mtp_cases());
    cases
}

/// The split MTP drafter fixture (qwen3_5-trained's head, oracles/split_mtp.py).
const SPLIT_MTP: &str = "qwen3_5-trained-mtp";

/// A copy of the split MTP folder at `<scratch>/m` whose tokenizer maps two tokens the other
/// way round.
fn split_mtp_other_tokenizer() -> Setup {
    Box::new(|s| {
        edit_json(&copy_model(s, SPLIT_MTP).join("tokenizer.json"), |t| {
            let vocab = t["model"]["vocab"].as_object_mut().unwrap();
            let (a, b) = (vocab["a"].clone(), vocab["b"].clone());
            vocab.insert("a".into(), b);
            vocab.insert("b".into(), a);
        })
    })
}

/// `--draft-mtp DIR` with a folder that does not pair with the target: refused at startup by
/// generate, serve and bench speed, naming the folder, the value and what is allowed.
fn split_mtp_cases() -> Vec<Case> {
    let trained = model_arg("qwen3_5-trained");
    let split = model_arg(SPLIT_MTP);
    let gen = |name: &str, dir: &str, needles: &[&str], setup: Setup| {
        let args = [
            "generate",
            "--model",
            &trained,
            "-m",
            "4",
            "--draft-mtp",
            dir,
        ];
        case(name, &args, 2, needles, setup)
    };
    // The head of another model: qwen3-draft is 64 wide, the head 128.
    let narrow = model_arg("qwen3-draft");
    let other_model = [
        "text_config.hidden_size",
        SPLIT_MTP,
        "128",
        "hidden size, 64",
    ];
    vec![
        gen(
            "generate/draft-mtp-dir-missing",
            "{S}/nope",
            &["{S}/nope", "no such model folder"],
            no_setup(),
        ),
        gen(
            "generate/draft-mtp-dir-not-a-split-folder",
            &model_arg(DFLASH),
            &[DFLASH, "model_type \"qwen3\"", "qwen3_5_mtp"],
            no_setup(),
        ),
        case(
            "generate/draft-mtp-dir-of-another-model",
            &[
                "generate",
                "--model",
                &narrow,
                "-m",
                "4",
                "--draft-mtp",
                &split,
            ],
            2,
            &other_model,
            no_setup(),
        ),
        gen(
            "generate/draft-mtp-dir-hidden-size",
            "{S}/m",
            &[
                "{S}/m",
                "text_config.hidden_size",
                "is 96",
                "hidden size, 128",
            ],
            broken_config(SPLIT_MTP, |c| c["text_config"]["hidden_size"] = json!(96)),
        ),
        gen(
            "generate/draft-mtp-dir-vocab-size",
            "{S}/m",
            &["{S}/m", "text_config.vocab_size", "is 1000", "1024"],
            broken_config(SPLIT_MTP, |c| c["text_config"]["vocab_size"] = json!(1000)),
        ),
        gen(
            "generate/draft-mtp-dir-missing-tensor",
            "{S}/m",
            &[
                "{S}/m",
                "missing tensor",
                "layers.0.self_attn.q_proj.weight",
            ],
            without_tensor(SPLIT_MTP, "layers.0.self_attn.q_proj.weight"),
        ),
        gen(
            "generate/draft-mtp-dir-other-tokenizer",
            "{S}/m",
            &["the MTP drafter {S}/m", "another tokenizer"],
            split_mtp_other_tokenizer(),
        ),
        gen(
            "generate/draft-mtp-dir-experts",
            "{S}/m",
            &["{S}/m", "num_experts is 4", "must be 0"],
            broken_config(SPLIT_MTP, |c| c["text_config"]["num_experts"] = json!(4)),
        ),
        case(
            "serve/draft-mtp-dir-of-another-model",
            &[
                "serve",
                "--port",
                "0",
                "--model",
                &narrow,
                "--draft-mtp",
                &split,
            ],
            2,
            &other_model,
            no_setup(),
        ),
        case(
            "bench-speed/draft-mtp-dir-of-another-model",
            &[
                "bench",
                "speed",
                "--model",
                &narrow,
                "--draft-mtp",
                &split,
                "--no-mlx-lm",
            ],
            2,
            &other_model,
            no_setup(),
        ),
    ]
}

fn main() {
    let args = libtest_mimic::Arguments::from_args();
    let cases = all_cases();
    let mut names: Vec<&str> = cases.iter().map(|c| c.name.as_str()).collect();
    names.sort_unstable();
    let count = names.len();
    names.dedup();
    assert_eq!(names.len(), count, "case names must be distinct");
    let trials = cases
        .into_iter()
        .map(|c| {
            let name = c.name.clone();
            Trial::test(name, move || run(&c))
        })
        .collect();
    libtest_mimic::run(&args, trials).exit();
}
