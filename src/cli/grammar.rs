//! `verity grammar-corpus` (a MaskBench-format corpus through the grammar engine, diffed
//! against the committed expected outcome) and `verity bench grammar` (compile and mask times).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::ExitCode;

use anyhow::Context;
use clap::Args;
use indicatif::{ProgressBar, ProgressStyle};
use verity::parity::corpus::{run_schema, CorpusFile, CorpusModel, SchemaOutcome, Timings};

#[derive(Args)]
pub struct CorpusArgs {
    /// Folder of MaskBench files ({schema, tests}) or bare schema files.
    dir: PathBuf,
    /// Model whose tokenizer and greedy output are used.
    #[arg(long, default_value = "golden/models/qwen3-target")]
    model: PathBuf,
    /// Expected outcome to diff against.
    #[arg(long, default_value = "golden/maskbench-expected.json")]
    expected: PathBuf,
    /// Write the expected outcome instead of diffing.
    #[arg(long)]
    write_expected: bool,
    #[arg(long, default_value_t = verity::parity::corpus::MAX_TOKENS)]
    max_tokens: usize,
}

#[derive(Args)]
pub struct BenchGrammarArgs {
    /// Folder of schemas (bare or MaskBench files).
    #[arg(long, default_value = "golden/schemas")]
    corpus: PathBuf,
    #[arg(long, default_value = "golden/models/qwen3-target")]
    model: PathBuf,
    #[arg(long, default_value_t = 96)]
    max_tokens: usize,
}

/// Runs every `*.json` in `dir` with a progress bar.
fn run_corpus(
    dir: &Path,
    model: &Path,
    max_tokens: usize,
) -> anyhow::Result<(Vec<SchemaOutcome>, Timings, f64)> {
    let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
        .with_context(|| format!("{}: not a corpus folder", dir.display()))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "json"))
        .collect();
    files.sort();
    anyhow::ensure!(
        !files.is_empty(),
        "{}: no .json schema files",
        dir.display()
    );
    let files = files
        .iter()
        .map(|f| CorpusFile::read(f))
        .collect::<verity::Result<Vec<_>>>()?;
    let m = CorpusModel::load(model, max_tokens)?;
    let bar = ProgressBar::new(files.len() as u64);
    bar.set_style(
        ProgressStyle::with_template("{spinner} schemas [{bar:30}] {pos}/{len} {wide_msg}")
            .expect("valid template")
            .progress_chars("=> "),
    );
    let mut timings = Timings::default();
    let mut outcomes = Vec::with_capacity(files.len());
    for f in &files {
        bar.set_message(f.name.clone());
        outcomes.push(run_schema(f, &m, &mut timings));
        bar.inc(1);
    }
    bar.finish_and_clear();
    Ok((outcomes, timings, m.env_ms))
}

pub fn corpus(a: CorpusArgs) -> anyhow::Result<ExitCode> {
    // The expected outcome is read before the run, so a wrong path fails at once.
    let expected = if a.write_expected {
        verity_harness::atomic::check_target(&a.expected)
            .with_context(|| format!("--expected {}", a.expected.display()))?;
        String::new()
    } else {
        std::fs::read_to_string(&a.expected)
            .with_context(|| format!("--expected {}", a.expected.display()))?
    };
    let (outcomes, _, _) = run_corpus(&a.dir, &a.model, a.max_tokens)?;
    let compiled: Vec<&SchemaOutcome> = outcomes.iter().filter(|o| o.compile == "ok").collect();
    let mut reasons: BTreeMap<String, usize> = BTreeMap::new();
    for o in outcomes.iter().filter(|o| o.compile != "ok") {
        *reasons.entry(short_reason(&o.compile)).or_default() += 1;
    }
    let sum = |f: fn(&SchemaOutcome) -> usize| outcomes.iter().map(f).sum::<usize>();
    let invalid_accepted = sum(|o| o.invalid_total - o.invalid_rejected);
    println!(
        "grammar corpus {}: {} schemas",
        a.dir.display(),
        outcomes.len()
    );
    println!(
        "  compiled: {}; compile failures: {}",
        compiled.len(),
        outcomes.len() - compiled.len()
    );
    for (reason, n) in &reasons {
        println!("    {n:>4}  {reason}");
    }
    let valid_gen = compiled
        .iter()
        .filter(|o| o.generation.starts_with("valid"))
        .count();
    println!("  greedy output valid: {valid_gen} of {}", compiled.len());
    println!(
        "  valid instances accepted: {} of {}",
        sum(|o| o.valid_accepted),
        sum(|o| o.valid_total)
    );
    println!(
        "  invalid instances rejected: {} of {}",
        sum(|o| o.invalid_rejected),
        sum(|o| o.invalid_total)
    );
    let doc = serde_json::to_string_pretty(&outcomes)? + "\n";
    if a.write_expected {
        verity_harness::atomic::write(&a.expected, doc.as_bytes())
            .with_context(|| format!("writing {}", a.expected.display()))?;
        println!("wrote {}", a.expected.display());
        return Ok(ExitCode::SUCCESS);
    }
    let changed = expected != doc;
    if changed {
        let diff = similar::TextDiff::from_lines(&expected, &doc);
        println!("\noutcome differs from {}:", a.expected.display());
        print!(
            "{}",
            diff.unified_diff()
                .context_radius(2)
                .header("expected", "now")
        );
    } else {
        println!("  matches {}", a.expected.display());
    }
    if invalid_accepted > 0 {
        println!("FAIL: {invalid_accepted} invalid instances were accepted");
    }
    Ok(if changed || invalid_accepted > 0 {
        ExitCode::from(1)
    } else {
        ExitCode::SUCCESS
    })
}

/// The first line of a compile error, without schema-specific detail after a colon pair.
fn short_reason(e: &str) -> String {
    let e = e
        .strip_prefix("cannot compile the JSON schema: ")
        .unwrap_or(e);
    let line = e.lines().next().unwrap_or(e);
    line.chars().take(90).collect()
}

fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    sorted[((sorted.len() - 1) as f64 * p).round() as usize]
}

pub fn bench(a: BenchGrammarArgs) -> anyhow::Result<ExitCode> {
    let (outcomes, t, env_ms) = run_corpus(&a.corpus, &a.model, a.max_tokens)?;
    println!(
        "grammar bench: {} ({} schemas, {} compiled), tokenizer {}",
        a.corpus.display(),
        outcomes.len(),
        t.compile_ms.len(),
        a.model.display()
    );
    println!("  token environment: {env_ms:.1} ms");
    println!(
        "  {:<12} {:>8} {:>10} {:>10} {:>10}",
        "", "count", "mean", "p50", "p99"
    );
    timing_row("compile", t.compile_ms, "ms", 3);
    timing_row("mask/token", t.mask_us, "us", 1);
    Ok(ExitCode::SUCCESS)
}

/// One row of the bench table: count, mean, p50 and p99 of `samples`.
fn timing_row(name: &str, mut samples: Vec<f64>, unit: &str, decimals: usize) {
    samples.sort_by(f64::total_cmp);
    let mean = samples.iter().sum::<f64>() / samples.len().max(1) as f64;
    let cell = |x: f64| format!("{x:>8.decimals$}{unit}");
    println!(
        "  {:<12} {:>8} {:>10} {:>10} {:>10}",
        name,
        samples.len(),
        cell(mean),
        cell(percentile(&samples, 0.5)),
        cell(percentile(&samples, 0.99))
    );
}
