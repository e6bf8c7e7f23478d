//! `verity generate`: mlx_lm.generate's flags and behaviour (chat template on by default, text
//! streamed to stdout, speed and peak memory on stderr).

use std::collections::BTreeMap;
use std::io::{Read, Write};
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Instant;

use anyhow::{bail, Context};
use clap::Args;
use serde_json::json;
use verity::cache::{load_prompt_cache, KvQuantization};
use verity::generate::{GenerateParams, GeneratedToken, Generation};
use verity::grammar::{GrammarSpec, TokenEnv};
use verity::replay::Loaded;
use verity::spec::{
    generate_speculative_constrained, Control, DraftModel, DraftSource, NgramLookup,
};
use verity_harness::trace::{FinishReason, ProcessorParams, SamplerParams};

#[derive(Args)]
pub struct GenerateArgs {
    /// Model folder (config.json, model*.safetensors, tokenizer.json).
    #[arg(long)]
    model: PathBuf,
    /// Prompt text; "-" reads standard input.
    #[arg(long, short, default_value = "hello")]
    prompt: String,
    #[arg(long, short = 'm', default_value_t = 100)]
    max_tokens: usize,
    /// Sampling temperature (0: greedy).
    #[arg(long, default_value_t = 0.0)]
    temp: f64,
    #[arg(long, default_value_t = 1.0)]
    top_p: f64,
    #[arg(long, default_value_t = 0.0)]
    min_p: f64,
    #[arg(long, default_value_t = 0)]
    top_k: usize,
    #[arg(long, default_value_t = 1)]
    min_tokens_to_keep: usize,
    #[arg(long, default_value_t = 0.0)]
    xtc_probability: f64,
    #[arg(long, default_value_t = 0.1)]
    xtc_threshold: f64,
    /// Random seed; sampling without one uses seed 0, so every run is reproducible.
    #[arg(long)]
    seed: Option<u64>,
    /// Feed the prompt as raw text, without the model's chat template.
    #[arg(long)]
    ignore_chat_template: bool,
    #[arg(long)]
    system_prompt: Option<String>,
    /// Additive logit bias, TOKEN_ID=BIAS (repeatable).
    #[arg(long, value_parser = parse_bias)]
    logit_bias: Vec<(u32, f64)>,
    #[arg(long)]
    repetition_penalty: Option<f64>,
    #[arg(long, default_value_t = 20)]
    repetition_context_size: usize,
    #[arg(long)]
    presence_penalty: Option<f64>,
    #[arg(long, default_value_t = 20)]
    presence_context_size: usize,
    #[arg(long)]
    frequency_penalty: Option<f64>,
    #[arg(long, default_value_t = 20)]
    frequency_context_size: usize,
    #[command(flatten)]
    cache: CacheArgs,
    /// Continue from a prompt cache file (mlx-lm's format, e.g. from `verity cache-prompt`):
    /// the prompt then only adds the new user turn.
    #[arg(long)]
    prompt_cache_file: Option<PathBuf>,
    /// Constrain the output to this JSON schema (compact JSON).
    #[arg(long, group = "output_constraint")]
    json_schema: Option<PathBuf>,
    /// Constrain the output to this regular expression.
    #[arg(long, group = "output_constraint")]
    regex: Option<String>,
    /// Constrain the output to this Lark grammar file.
    #[arg(long, group = "output_constraint")]
    grammar: Option<PathBuf>,
    /// Constrain the output to one of these strings (repeatable).
    #[arg(long, group = "output_constraint")]
    choice: Vec<String>,
    /// Speculate with this draft model folder (same tokenizer as the model).
    #[arg(long, conflicts_with = "draft_ngram")]
    draft_model: Option<PathBuf>,
    /// Speculate with prompt lookup (n-gram) drafts.
    #[arg(long)]
    draft_ngram: bool,
    /// Drafts per round.
    #[arg(long, default_value_t = 3)]
    num_draft_tokens: usize,
    /// Shortest and longest n-gram prompt lookup matches.
    #[arg(long, default_value_t = 1)]
    ngram_min: usize,
    #[arg(long, default_value_t = 3)]
    ngram_max: usize,
}

/// How the prompt is processed into the KV cache (shared by generate and cache-prompt).
#[derive(Args)]
pub struct CacheArgs {
    /// Rotating KV cache of this many tokens (models without their own cache layout).
    #[arg(long)]
    max_kv_size: Option<usize>,
    /// Quantize the KV cache to this many bits (4 or 8).
    #[arg(long)]
    kv_bits: Option<i32>,
    #[arg(long, default_value_t = 64)]
    kv_group_size: i32,
    #[arg(long, default_value_t = 5000)]
    quantized_kv_start: usize,
    #[arg(long, default_value_t = 2048)]
    prefill_step_size: usize,
}

impl CacheArgs {
    pub fn kv_quantization(&self) -> anyhow::Result<Option<KvQuantization>> {
        match self.kv_bits {
            None => Ok(None),
            Some(bits @ (4 | 8)) => Ok(Some(KvQuantization {
                bits,
                group_size: self.kv_group_size,
                start: self.quantized_kv_start,
            })),
            Some(_) => bail!("--kv-bits must be 4 or 8"),
        }
    }

    /// Generation parameters for processing a prompt only (greedy, no processors).
    pub fn prompt_params(&self) -> anyhow::Result<GenerateParams> {
        Ok(GenerateParams {
            prefill_step_size: self.prefill_step_size,
            max_kv_size: self.max_kv_size,
            kv_quantization: self.kv_quantization()?,
            ..GenerateParams::greedy(1, Vec::new())
        })
    }
}

fn parse_bias(s: &str) -> Result<(u32, f64), String> {
    let (id, bias) = s.split_once('=').ok_or("expected TOKEN_ID=BIAS")?;
    Ok((
        id.trim().parse().map_err(|_| "bad token id")?,
        bias.trim().parse().map_err(|_| "bad bias")?,
    ))
}

pub fn generate(a: GenerateArgs) -> anyhow::Result<ExitCode> {
    let loaded = Loaded::load(&a.model)?;
    let mut text = a.prompt.clone();
    if text == "-" {
        text.clear();
        std::io::stdin()
            .read_to_string(&mut text)
            .context("reading the prompt from stdin")?;
    }
    let tok = &loaded.tokenizer;
    let use_chat = !a.ignore_chat_template && tok.has_chat_template();
    let using_cache = a.prompt_cache_file.is_some();
    let prompt = if use_chat {
        let mut messages = Vec::new();
        if let Some(system) = a.system_prompt.as_ref().filter(|_| !using_cache) {
            messages.push(json!({"role": "system", "content": system}));
        }
        messages.push(json!({"role": "user", "content": text}));
        let no_extra = serde_json::Map::new();
        let mut rendered = tok.apply_chat_template(&messages, true, &no_extra)?;
        if using_cache {
            // As mlx_lm.generate: the cached prefix holds the conversation so far, so keep only
            // what the template adds from this user turn on.
            messages.last_mut().expect("a user message")["content"] = json!("<query>");
            let marker = tok.apply_chat_template(&messages, true, &no_extra)?;
            let start = marker
                .find("<query>")
                .expect("the template renders the message");
            rendered = rendered[start..].to_string();
        }
        tok.encode(&rendered, false)?
    } else {
        tok.encode(&text, true)?
    };
    if a.cache.max_kv_size.is_some() && loaded.model.model.ignores_max_kv_size() {
        eprintln!(
            "note: this model builds its own caches; --max-kv-size is ignored (as in mlx-lm)"
        );
    }
    let seed = match (a.seed, a.temp > 0.0) {
        (Some(s), _) => Some(s),
        (None, true) => {
            eprintln!("note: no --seed given; sampling with seed 0");
            Some(0)
        }
        (None, false) => None,
    };
    let mut xtc_special_tokens = tok.encode("\n", false)?;
    xtc_special_tokens.extend(&loaded.eos_token_ids);
    let params = GenerateParams {
        max_tokens: a.max_tokens,
        sampler: SamplerParams {
            temp: a.temp,
            top_p: a.top_p,
            min_p: a.min_p,
            min_tokens_to_keep: a.min_tokens_to_keep,
            top_k: a.top_k,
            xtc_probability: a.xtc_probability,
            xtc_threshold: a.xtc_threshold,
            xtc_special_tokens,
        },
        processors: ProcessorParams {
            logit_bias: (!a.logit_bias.is_empty()).then(|| {
                a.logit_bias
                    .iter()
                    .map(|(id, b)| (id.to_string(), *b))
                    .collect::<BTreeMap<_, _>>()
            }),
            repetition_penalty: a.repetition_penalty,
            repetition_context_size: a.repetition_context_size,
            presence_penalty: a.presence_penalty,
            presence_context_size: a.presence_context_size,
            frequency_penalty: a.frequency_penalty,
            frequency_context_size: a.frequency_context_size,
        },
        seed,
        prefill_step_size: a.cache.prefill_step_size,
        max_kv_size: a.cache.max_kv_size,
        kv_quantization: a.cache.kv_quantization()?,
        eos_token_ids: loaded.eos_token_ids.clone(),
    };

    mlx::memory::reset_peak();
    let start = Instant::now();
    let model = loaded.model.model.as_ref();
    let mut detok = tok.detokenizer();
    let mut stdout = std::io::stdout().lock();
    let (mut first_token_at, mut count, mut finish) = (None, 0usize, None);
    let mut printed: std::io::Result<()> = Ok(());
    let mut emit = |step: &GeneratedToken| {
        first_token_at.get_or_insert_with(Instant::now);
        count += 1;
        finish = step.finish;
        if step.finish != Some(FinishReason::Stop) {
            detok.add_token(step.token);
            printed = write!(stdout, "{}", detok.take_segment()).and_then(|_| stdout.flush());
        }
        if printed.is_ok() {
            Control::Continue
        } else {
            Control::Stop
        }
    };
    let spec = match (&a.json_schema, &a.regex, &a.grammar) {
        (Some(f), _, _) => Some(GrammarSpec::json_schema_file(f)?),
        (_, Some(r), _) => Some(GrammarSpec::Regex(r.clone())),
        (_, _, Some(f)) => Some(GrammarSpec::lark_file(f)?),
        _ if !a.choice.is_empty() => Some(GrammarSpec::Choice(a.choice.clone())),
        _ => None,
    };
    let constraint = match &spec {
        Some(spec) => {
            let eos = tok
                .eos_token_id()
                .or_else(|| loaded.eos_token_ids.first().copied())
                .unwrap_or(0);
            let env = TokenEnv::from_dir(&a.model, eos, model.vocab_size())?;
            Some(env.constraint(spec, &loaded.eos_token_ids)?)
        }
        None => None,
    };
    let draft = a.draft_model.as_deref().map(Loaded::load).transpose()?;
    let stats = if draft.is_some() || a.draft_ngram {
        anyhow::ensure!(
            a.prompt_cache_file.is_none(),
            "speculative decoding from a prompt cache file is not supported"
        );
        let mut source: Box<dyn DraftSource> = match &draft {
            Some(d) => Box::new(DraftModel::new(d.model.model.as_ref())),
            None => Box::new(NgramLookup::new(a.ngram_min, a.ngram_max)),
        };
        Some(
            generate_speculative_constrained(
                model,
                source.as_mut(),
                &prompt,
                &params,
                a.num_draft_tokens,
                constraint,
                &mut emit,
            )?
            .0,
        )
    } else {
        let generation = match &a.prompt_cache_file {
            Some(file) => {
                let (caches, _) = load_prompt_cache(file)?;
                if caches.len() != model.num_layers() {
                    bail!(
                        "{}: {} cache layers, the model has {}",
                        file.display(),
                        caches.len(),
                        model.num_layers()
                    );
                }
                Generation::start(model, caches, &prompt, &params, constraint)?
            }
            None => {
                let caches = model.make_cache(params.max_kv_size);
                Generation::start(model, caches, &prompt, &params, constraint)?
            }
        };
        for step in generation {
            if emit(&step?) == Control::Stop {
                break;
            }
        }
        None
    };
    printed?;
    writeln!(stdout, "{}", detok.finalize())?;
    let first = first_token_at.unwrap_or_else(Instant::now);
    let prompt_secs = (first - start).as_secs_f64();
    let gen_secs = first.elapsed().as_secs_f64();
    eprintln!("==========");
    eprintln!(
        "Prompt: {} tokens, {:.3} tokens-per-sec",
        prompt.len(),
        prompt.len() as f64 / prompt_secs.max(1e-9)
    );
    eprintln!(
        "Generation: {count} tokens, {:.3} tokens-per-sec",
        count as f64 / gen_secs.max(1e-9)
    );
    if let Some(s) = stats {
        eprintln!(
            "Speculation: {} rounds, {}/{} drafts accepted ({:.3}), {:.3} tokens per target forward, {} refused rounds",
            s.rounds,
            s.accepted,
            s.drafted,
            s.acceptance_rate(),
            s.tokens_per_forward(),
            s.refused_rounds
        );
    }
    eprintln!(
        "Finish: {}",
        finish.map_or("none".into(), |f| f.to_string())
    );
    eprintln!("Peak memory: {:.3} GB", mlx::memory::peak() as f64 / 1e9);
    Ok(ExitCode::SUCCESS)
}
