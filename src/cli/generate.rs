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
use verity::generate::{FinishReason, GenerateParams, GeneratedToken, Generation};
use verity::grammar::{Constraint, Grammar};
use verity::model::dflash::DflashModel;
use verity::sample::{KeySchedule, ProcessorParams, SamplerParams};
use verity::speculative::{
    generate_speculative, Control, DflashDrafter, DraftModel, DraftSource, MtpDrafter, NgramLookup,
    SpeculationStats,
};
use verity::tokenizer::{StreamingDetokenizer, UserTurn};
use verity::validate;

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
    /// `positioned` (mlx-vlm: one key per generated position, temperature and top-k only).
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
    #[arg(long, conflicts_with_all = ["draft_ngram", "draft_mtp", "draft_dflash"])]
    draft_model: Option<PathBuf>,
    /// Speculate with prompt lookup (n-gram) drafts.
    #[arg(long, conflicts_with_all = ["draft_mtp", "draft_dflash"])]
    draft_ngram: bool,
    /// Speculate with the model's own multi-token-prediction head (Qwen3.5 `mtp.*` weights),
    /// as mlx-vlm's MTP loop does (--num-draft-tokens is its block size minus one).
    #[arg(long, conflicts_with = "draft_dflash")]
    draft_mtp: bool,
    /// Speculate with this DFlash block drafter folder (model_type qwen3_dflash), as mlx-vlm's
    /// DFlash loop does: one drafter pass per round drafts a whole block, whose size adapts to
    /// acceptance up to the drafter's block_size (or --num-draft-tokens + 1).
    #[arg(long)]
    draft_dflash: Option<PathBuf>,
    /// Drafts per round (default 3; with --draft-dflash, the drafter's block_size - 1).
    #[arg(long)]
    num_draft_tokens: Option<usize>,
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
    let prompt = prompt_tokens(&a, &bundle)?;
    warn_past_context(&bundle, prompt.len() + a.max_tokens);
    let params = generate_params(&a, &bundle)?;
    let constraint = a.grammar()?.map(|g| bundle.constraint(&g)).transpose()?;
    let mut out = Printer::new(&bundle);
    mlx::memory::reset_peak();
    let stats =
        if a.draft_model.is_some() || a.draft_ngram || a.draft_mtp || a.draft_dflash.is_some() {
            speculate(&a, &bundle, &prompt, &params, constraint, &mut out)?
        } else {
            let caches = starting_caches(&a, &bundle, &params)?;
            let bar = prefill_bar(prompt.len(), params.prefill_step_size);
            let generation = Generation::start_reporting(
                bundle.model(),
                caches,
                &prompt,
                &params,
                constraint,
                &mut |done| bar.set_position(done as u64),
            )?;
            bar.finish_and_clear();
            for step in generation {
                if out.emit(&step?) == Control::Stop {
                    break;
                }
            }
            None
        };
    out.finish(prompt.len(), stats.as_ref())?;
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
    let json = &bundle.config.json;
    let context = json
        .get("max_position_embeddings")
        .or_else(|| json.get("text_config")?.get("max_position_embeddings"))
        .and_then(serde_json::Value::as_u64);
    if let Some(context) = context.filter(|&c| tokens as u64 > c) {
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
    let seed = match (a.seed, a.temp > 0.0) {
        (Some(s), _) => Some(s),
        (None, true) => {
            eprintln!("note: no --seed given; sampling with seed 0");
            Some(0)
        }
        (None, false) => None,
    };
    // mlx_lm.generate never lets XTC exclude a newline or an EOS token.
    let mut xtc_special_tokens = bundle.tokenizer.encode("\n", false)?;
    xtc_special_tokens.extend(&bundle.eos_token_ids);
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
            xtc_special_tokens,
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
        seed,
        keys: a.keys,
        prefill_step_size: a.cache.prefill_step_size,
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

/// The caches generation starts from: a prompt cache file's, or fresh ones.
fn starting_caches(
    a: &GenerateArgs,
    bundle: &ModelBundle,
    params: &GenerateParams,
) -> anyhow::Result<Vec<LayerCache>> {
    let model = bundle.model();
    let Some(file) = &a.prompt_cache_file else {
        return Ok(model.make_cache(params.max_kv_size));
    };
    let (caches, metadata) = load_prompt_cache(file)?;
    if let Some(written_for) = metadata.get("model") {
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
    }
    validate::prompt_cache(&file.display().to_string(), model, &caches, params)?;
    Ok(caches)
}

/// Speculative decoding with the draft model or n-gram lookup the flags name.
fn speculate(
    a: &GenerateArgs,
    bundle: &ModelBundle,
    prompt: &[u32],
    params: &GenerateParams,
    constraint: Option<Constraint>,
    out: &mut Printer,
) -> anyhow::Result<Option<SpeculationStats>> {
    anyhow::ensure!(
        a.prompt_cache_file.is_none(),
        "speculative decoding from a prompt cache file is not supported"
    );
    let draft = a
        .draft_model
        .as_deref()
        .map(|d| bundle.load_draft(d))
        .transpose()?;
    let dflash = a
        .draft_dflash
        .as_deref()
        .map(DflashModel::load)
        .transpose()?;
    let mut source: Box<dyn DraftSource> = match (&draft, &dflash) {
        (Some(d), _) => Box::new(DraftModel::new(d.model())),
        (None, Some(m)) => Box::new(DflashDrafter::new(bundle.model(), m)?),
        (None, None) if a.draft_mtp => Box::new(MtpDrafter::new(bundle.model())?),
        (None, None) => Box::new(NgramLookup::new(a.ngram_min, a.ngram_max)?),
    };
    let num_draft_tokens = match (a.num_draft_tokens, &dflash) {
        (Some(k), _) => k,
        (None, Some(m)) => m.block_size - 1,
        (None, None) => 3,
    };
    let mut emit = |step: &GeneratedToken| out.emit(step);
    let (stats, _) = generate_speculative(
        bundle.model(),
        source.as_mut(),
        prompt,
        params,
        num_draft_tokens,
        constraint,
        &mut emit,
    )?;
    Ok(Some(stats))
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
