//! Command-line verbs. Errors reach `main` as anyhow errors and exit with code 2; `check`,
//! `replay` and `judge score` exit 1 when a trace diverges.

mod accept;
mod bench;
mod bench_rows;
mod bench_serve;
mod bisect;
mod cache_prompt;
mod check;
mod draft_args;
mod generate;
mod grammar;
mod judge;
mod serve;

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand, ValueEnum};

#[derive(Parser)]
#[command(
    name = "verity",
    version,
    about = "An MLX inference engine that proves parity with mlx-lm"
)]
pub struct Cli {
    /// Device to run MLX on [default: the GPU when this build has Metal, else the CPU].
    #[arg(long, global = true, value_enum)]
    device: Option<DeviceArg>,
    /// On a GPU, let MLX choose the kernels of verify and batch forwards by their shape:
    /// faster, but a verified or batched row may then differ from its request alone (`verity
    /// bench rows` measures both).
    #[arg(long, global = true)]
    batched_kernels: bool,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Bench {
    /// Prefill, time to first token, decode, peak memory, cold start, speculative and grammar
    /// rows, against mlx-lm in the same run (ratios and the memory-bandwidth floor).
    Speed(bench::SpeedArgs),
    /// Grammar compile time and mask time per token (p50, p99).
    Grammar(grammar::BenchGrammarArgs),
    /// Server throughput and p50/p99 latency at several levels of concurrent clients, against
    /// mlx_lm.server in the same run.
    Serve(bench_serve::ServeBenchArgs),
    /// Whether a verified or batched row equals the one-token step on this device (tokens and
    /// logprob bits), with the lone-row kernels and with MLX's batched ones, and their cost.
    Rows(bench_rows::RowsArgs),
}

#[derive(Clone, Copy, ValueEnum)]
enum DeviceArg {
    Cpu,
    Gpu,
}

#[derive(Subcommand)]
enum Command {
    /// Replay every golden trace and print a parity table per suite (the main job).
    Check(check::CheckArgs),
    /// Replay the given trace files and explain each divergence.
    Replay(check::ReplayArgs),
    /// Hold any engine to the goldens through files: export requests, score responses.
    #[command(subcommand)]
    Judge(judge::Judge),
    /// Generate text from a model folder, like mlx_lm.generate.
    Generate(Box<generate::GenerateArgs>),
    /// Process a prompt once and save its caches (mlx-lm's prompt cache format).
    CachePrompt(cache_prompt::CachePromptArgs),
    /// Run the acceptance suites and compare with their baselines (exit 0 / 1 / 125).
    Accept(accept::AcceptArgs),
    /// Find the commit that lowered acceptance: git bisect, each probed commit built and measured.
    Bisect(bisect::BisectArgs),
    /// Run a MaskBench-format schema corpus and diff with the expected outcome.
    GrammarCorpus(grammar::CorpusArgs),
    /// Serve the model over an OpenAI-compatible HTTP API.
    Serve(Box<serve::ServeArgs>),
    /// Benchmarks.
    #[command(subcommand)]
    Bench(Bench),
}

pub fn run(cli: Cli) -> anyhow::Result<ExitCode> {
    let device = match cli.device {
        Some(DeviceArg::Cpu) => mlx::Device::Cpu,
        Some(DeviceArg::Gpu) => mlx::Device::Gpu,
        None => mlx::Device::best_available(),
    };
    mlx::set_default_device(device)?;
    verity::model::lone_rows::set_enabled(!cli.batched_kernels);
    match cli.command {
        Command::Check(a) => check::check(a, device),
        Command::Replay(a) => check::replay(a, device),
        Command::Judge(a) => judge::run(a, device),
        Command::Generate(a) => generate::generate(*a),
        Command::CachePrompt(a) => cache_prompt::cache_prompt_cmd(a),
        Command::Accept(a) => accept::accept(a),
        Command::Bisect(a) => bisect::bisect(a),
        Command::GrammarCorpus(a) => grammar::corpus(a),
        Command::Serve(a) => serve::serve(*a, device),
        Command::Bench(Bench::Speed(a)) => bench::speed(a, device),
        Command::Bench(Bench::Grammar(a)) => grammar::bench(a),
        Command::Bench(Bench::Serve(a)) => bench_serve::serve(a, device),
        Command::Bench(Bench::Rows(a)) => bench_rows::rows(a, device),
    }
}

/// An error and its causes on one line, each cause once: most of the library's errors already
/// quote their source in their own message, which `{:#}` would print a second time.
pub fn one_line(e: &anyhow::Error) -> String {
    let mut out = e.to_string();
    for cause in e.chain().skip(1) {
        let cause = cause.to_string();
        if !out.contains(&cause) {
            out.push_str(": ");
            out.push_str(&cause);
        }
    }
    out
}

/// The repository root: `--root`, else the current directory.
fn root_or_cwd(root: Option<PathBuf>) -> anyhow::Result<PathBuf> {
    Ok(match root {
        Some(r) => r,
        None => std::env::current_dir()?,
    })
}
