//! `verity generate`: mlx_lm.generate's flags and behaviour (chat template on by default, text
//! streamed to stdout, speed and peak memory on stderr).

use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::Instant;

use anyhow::{bail, Context};
use clap::builder::{PossibleValuesParser, TypedValueParser};
use clap::Args;
use indicatif::{ProgressBar, ProgressStyle};
use verity::bundle::ModelBundle;
use verity::cache::{load_prompt_cache, KvQuantization, LayerCache};
use verity::decode::{decode, Hooks, Request, Start};
use verity::generate::{Control, FinishReason, GenerateParams, GeneratedToken};
use verity::grammar::Grammar;
use verity::request::reproducible_seed;
use verity::sample::{KeySchedule, ProcessorParams, SamplerParams};
use verity::speculative::{Drafter, SpeculationStats};
use verity::tokenizer::{StreamingDetokenizer, UserTurn};
use verity::validate;

use super::draft_args::DraftArgs;

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
    /// How the seed keys each draw: `sequence` (mlx-lm: one global key split per draw) or
    /// `positioned` (mlx-vlm: one key per generated position; temperature, top-k and top-p only).
    #[arg(long, default_value = "sequence", value_parser = key_schedule())]
    keys: KeySchedule,
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
    /// the prompt then only adds the new user turn. Plain decoding only.
    #[arg(long, conflicts_with_all = ["draft_model", "draft_ngram", "draft_mtp", "draft_dflash"])]
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
    #[command(flatten)]
    draft: DraftArgs,
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
    /// The KV quantization the flags ask for (validated with the model, crate::validate).
    pub fn kv_quantization(&self) -> Option<KvQuantization> {
        self.kv_bits.map(|bits| KvQuantization {
            bits,
            group_size: self.kv_group_size,
            start: self.quantized_kv_start,
        })
    }

    /// Generation parameters for processing a prompt only (greedy, no processors).
    pub fn prompt_params(&self) -> GenerateParams {
        GenerateParams {
            prefill_step_size: self.prefill_step_size,
            max_kv_size: self.max_kv_size,
            kv_quantization: self.kv_quantization(),
            ..GenerateParams::greedy(1, Vec::new())
        }
    }
}

fn key_schedule() -> impl clap::builder::TypedValueParser<Value = KeySchedule> {
    PossibleValuesParser::new(["sequence", "positioned"]).map(|s| match s.as_str() {
        "positioned" => KeySchedule::Positioned,
        _ => KeySchedule::Sequence,
    })
}

fn parse_bias(s: &str) -> Result<(u32, f64), String> {
    let (id, bias) = s.split_once('=').ok_or("expected TOKEN_ID=BIAS")?;
    Ok((
        id.trim().parse().map_err(|_| "bad token id")?,
        bias.trim().parse().map_err(|_| "bad bias")?,
    ))
}

pub fn generate(a: GenerateArgs) -> anyhow::Result<ExitCode> {
    let bundle = ModelBundle::load(&a.model)?;
    let drafter = a
        .draft
        .spec()
        .map(|spec| Drafter::load(&spec, &bundle))
        .transpose()?;
    let prompt = prompt_tokens(&a, &bundle)?;
    warn_past_context(&bundle, prompt.len() + a.max_tokens);
    let params = generate_params(&a, &bundle)?;
    let constraint = a.grammar()?.map(|g| bundle.constraint(&g)).transpose()?;
    let start = match prompt_cache(&a, &bundle, &params)? {
        Some(caches) => Start::Context(caches),
        None => Start::Fresh,
    };
    let mut out = Printer::new(&bundle);
    mlx::memory::reset_peak();
    let bar = prefill_bar(prompt.len(), params.prefill_step_size);
    let mut on_chunk = |done: usize| {
        bar.set_position(done as u64);
        Control::Continue
    };
    let mut on_token = |step: &GeneratedToken| {
        if !bar.is_finished() {
            bar.finish_and_clear();
        }
        out.emit(step)
    };
    let hooks = Hooks {
        on_chunk: Some(&mut on_chunk),
        ..Hooks::tokens(&mut on_token)
    };
    let request = Request {
        prompt: &prompt,
        params: &params,
        constraint,
        num_draft_tokens: a.draft.num_draft_tokens,
    };
    let decoded = decode(bundle.model(), drafter.as_ref(), start, request, hooks)?;
    bar.finish_and_clear();
    out.finish(prompt.len(), decoded.speculation.as_ref())?;
    Ok(ExitCode::SUCCESS)
}

/// A progress bar over the prompt, for prompts of several prefill chunks (hidden otherwise, and
/// when stderr is not a terminal).
fn prefill_bar(tokens: usize, step: usize) -> ProgressBar {
    if tokens <= 2 * step {
        return ProgressBar::hidden();
    }
    let bar = ProgressBar::new(tokens as u64);
    bar.set_style(
        ProgressStyle::with_template("{spinner} prefill [{bar:30}] {pos}/{len} tokens {eta}")
            .expect("valid template")
            .progress_chars("=> "),
    );
    bar
}

/// Warns when a request runs past the context the model was trained for: it still runs (as in
/// mlx-lm), but slowly and, past that length, into positions the model never saw.
fn warn_past_context(bundle: &ModelBundle, tokens: usize) {
    if let Some(context) = bundle.context_length().filter(|&c| tokens > c) {
        eprintln!(
            "warning: prompt plus --max-tokens is {tokens} tokens, past the model's context of \
             {context} (max_position_embeddings)"
        );
    }
}

/// The prompt as mlx_lm.generate builds it: `-` reads standard input, the literal escapes \n
/// and \t become a newline and a tab, and the chat template applies unless ignored.
fn prompt_tokens(a: &GenerateArgs, bundle: &ModelBundle) -> anyhow::Result<Vec<u32>> {
    let mut text = a.prompt.replace("\\n", "\n").replace("\\t", "\t");
    if text == "-" {
        text.clear();
        std::io::stdin()
            .read_to_string(&mut text)
            .context("reading the prompt from stdin")?;
    }
    Ok(bundle.tokenizer.encode_user_turn(&UserTurn {
        text: &text,
        system: a.system_prompt.as_deref(),
        raw: a.ignore_chat_template,
        continues_cache: a.prompt_cache_file.is_some(),
    })?)
}

/// The request's parameters from the flags.
fn generate_params(a: &GenerateArgs, bundle: &ModelBundle) -> anyhow::Result<GenerateParams> {
    if a.cache.max_kv_size.is_some() && bundle.model().ignores_max_kv_size() {
        eprintln!(
            "note: this model builds its own caches; --max-kv-size is ignored (as in mlx-lm)"
        );
    }
    if a.seed.is_none() && a.temp > 0.0 {
        eprintln!("note: no --seed given; sampling with seed 0");
    }
    Ok(GenerateParams {
        max_tokens: a.max_tokens,
        sampler: SamplerParams {
            temp: a.temp,
            top_p: a.top_p,
            min_p: a.min_p,
            min_tokens_to_keep: a.min_tokens_to_keep,
            top_k: a.top_k,
            xtc_probability: a.xtc_probability,
            xtc_threshold: a.xtc_threshold,
            xtc_special_tokens: bundle.xtc_special_tokens()?,
        },
        processors: ProcessorParams {
            logit_bias: a.logit_bias.clone(),
            repetition_penalty: a.repetition_penalty,
            repetition_context_size: a.repetition_context_size,
            presence_penalty: a.presence_penalty,
            presence_context_size: a.presence_context_size,
            frequency_penalty: a.frequency_penalty,
            frequency_context_size: a.frequency_context_size,
        },
        seed: reproducible_seed(a.seed, a.temp),
        keys: a.keys,
        prefill_step_size: a.cache.prefill_step_size,
        prefill_splits: Vec::new(),
        max_kv_size: a.cache.max_kv_size,
        kv_quantization: a.cache.kv_quantization(),
        eos_token_ids: bundle.eos_token_ids.clone(),
    })
}

impl GenerateArgs {
    /// The output constraint the flags ask for, if any.
    fn grammar(&self) -> anyhow::Result<Option<Grammar>> {
        Ok(match (&self.json_schema, &self.regex, &self.grammar) {
            (Some(f), _, _) => Some(Grammar::json_schema_file(f)?),
            (_, Some(r), _) => Some(Grammar::Regex(r.clone())),
            (_, _, Some(f)) => Some(Grammar::lark_file(f)?),
            _ if !self.choice.is_empty() => Some(Grammar::Choice(self.choice.clone())),
            _ => None,
        })
    }
}

/// The caches of the prompt cache file the flags name, if any.
fn prompt_cache(
    a: &GenerateArgs,
    bundle: &ModelBundle,
    params: &GenerateParams,
) -> anyhow::Result<Option<Vec<LayerCache>>> {
    let Some(file) = &a.prompt_cache_file else {
        return Ok(None);
    };
    let (caches, metadata) = load_prompt_cache(file).context("--prompt-cache-file")?;
    // mlx-lm's generate reads this key too (and fails without it): a cache that does not say
    // which model made it cannot be told apart from one of another model of the same shape.
    let Some(written_for) = metadata.get("model") else {
        bail!(
            "--prompt-cache-file {}: the cache does not record the model it was made with \
             (metadata key \"model\", which mlx_lm.cache_prompt and verity cache-prompt write)",
            file.display()
        );
    };
    let same = |a: &Path, b: &Path| match (a.canonicalize(), b.canonicalize()) {
        (Ok(a), Ok(b)) => a == b,
        _ => a == b,
    };
    if !same(Path::new(written_for), &a.model) {
        bail!(
            "{}: the prompt cache was made with model {written_for}, not {} (mlx-lm refuses \
             this too)",
            file.display(),
            a.model.display()
        );
    }
    validate::prompt_cache(&file.display().to_string(), bundle.model(), &caches, params)?;
    Ok(Some(caches))
}

/// Streams text to stdout as mlx_lm.generate does and reports speed, acceptance and peak
/// memory on stderr.
struct Printer {
    detok: StreamingDetokenizer,
    start: Instant,
    first_token_at: Option<Instant>,
    count: usize,
    finish: Option<FinishReason>,
    printed: std::io::Result<()>,
}

impl Printer {
    fn new(bundle: &ModelBundle) -> Printer {
        Printer {
            detok: bundle.tokenizer.detokenizer(),
            start: Instant::now(),
            first_token_at: None,
            count: 0,
            finish: None,
            printed: Ok(()),
        }
    }

    /// Prints a token's text (a stopping EOS prints nothing, as in mlx-lm); stops the
    /// generation when stdout is gone.
    fn emit(&mut self, step: &GeneratedToken) -> Control {
        self.first_token_at.get_or_insert_with(Instant::now);
        self.count += 1;
        self.finish = step.finish;
        if step.finish != Some(FinishReason::Stop) {
            self.detok.add_token(step.token);
            let mut stdout = std::io::stdout().lock();
            self.printed =
                write!(stdout, "{}", self.detok.take_segment()).and_then(|_| stdout.flush());
        }
        if self.printed.is_ok() {
            Control::Continue
        } else {
            Control::Stop
        }
    }

    fn finish(mut self, prompt_len: usize, stats: Option<&SpeculationStats>) -> anyhow::Result<()> {
        std::mem::replace(&mut self.printed, Ok(()))?;
        println!("{}", self.detok.finalize());
        let first = self.first_token_at.unwrap_or_else(Instant::now);
        let prompt_secs = (first - self.start).as_secs_f64();
        let gen_secs = first.elapsed().as_secs_f64();
        eprintln!("==========");
        eprintln!(
            "Prompt: {prompt_len} tokens, {:.3} tokens-per-sec",
            prompt_len as f64 / prompt_secs.max(1e-9)
        );
        eprintln!(
            "Generation: {} tokens, {:.3} tokens-per-sec",
            self.count,
            self.count as f64 / gen_secs.max(1e-9)
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
            self.finish.map_or("none".into(), |f| f.to_string())
        );
        eprintln!("Peak memory: {:.3} GB", mlx::memory::peak() as f64 / 1e9);
        Ok(())
    }
}
