//! `verity check` and `verity replay`: run the engine on golden traces and judge the runs. A
//! trace recorded on this backend is replayed under its own tier; one recorded on another
//! backend is replayed teacher-forced under tier B (verity::parity::judge).

use std::collections::BTreeMap;
use std::io::IsTerminal;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use clap::Args;
use indicatif::{ProgressBar, ProgressStyle};
use serde_json::json;
use verity::parity::judge::{judge, Judgement, Outcome};
use verity::parity::replay::golden_sets;
use verity::parity::Models;
use verity_harness::registry::{Limits, Registry};
use verity_harness::report::{suite_table, Counts, Status};
use verity_harness::trace::{find_traces, Trace};

#[derive(Args)]
pub struct CheckArgs {
    #[command(flatten)]
    traces: TraceArgs,
    /// Print machine-readable JSON instead of tables.
    #[arg(long)]
    json: bool,
    #[command(flatten)]
    report: ReportArgs,
}

/// Which traces a verb takes (`check`, `judge export`).
#[derive(Args)]
pub struct TraceArgs {
    /// Repository root that trace model paths are relative to [default: current directory].
    #[arg(long)]
    root: Option<PathBuf>,
    /// Trace folders [default: every golden set, <root>/golden/traces and traces-<backend>].
    #[arg(long = "traces")]
    sets: Vec<PathBuf>,
    /// Only traces whose path contains this.
    #[arg(long)]
    only: Option<String>,
}

/// The traces [`TraceArgs`] select: the root, and each trace folder with its trace files.
pub(super) struct Selected {
    pub root: PathBuf,
    pub sets: Vec<(PathBuf, Vec<PathBuf>)>,
}

impl TraceArgs {
    /// Finds the trace files (`--only` applied; folders left without any dropped), refusing a
    /// selection of none.
    pub(super) fn select(self) -> anyhow::Result<Selected> {
        let root = super::root_or_cwd(self.root)?;
        let dirs = if self.sets.is_empty() {
            golden_sets(&root).with_context(|| {
                format!(
                    "no golden traces under {} (run from the repository root or pass --root)",
                    root.join("golden").display()
                )
            })?
        } else {
            self.sets
        };
        let mut sets = Vec::new();
        for dir in &dirs {
            let mut paths = find_traces(dir).with_context(|| format!("{}", dir.display()))?;
            if let Some(only) = &self.only {
                paths.retain(|p| p.to_string_lossy().contains(only.as_str()));
            }
            if !paths.is_empty() {
                sets.push((dir.clone(), paths));
            }
        }
        if sets.is_empty() {
            let list = dirs
                .iter()
                .map(|d| d.display().to_string())
                .collect::<Vec<_>>()
                .join(", ");
            match &self.only {
                Some(only) => bail!("no trace path contains {only:?} in {list}"),
                None => bail!("no trace files in {list}"),
            }
        }
        Ok(Selected { root, sets })
    }
}

/// The report files `check` and `judge score` can write besides their output.
#[derive(Args)]
pub struct ReportArgs {
    /// Also write the report as one self-contained HTML page.
    #[arg(long, value_name = "FILE")]
    html: Option<PathBuf>,
    /// Also write the report as JUnit XML (one test case per trace), for CI dashboards.
    #[arg(long, value_name = "FILE")]
    junit: Option<PathBuf>,
    /// A `verity bench --json` document to draw in the HTML report.
    #[arg(long, value_name = "FILE", requires = "html")]
    bench: Option<PathBuf>,
    /// A `verity accept --json` document to draw in the HTML report (acceptance per draft
    /// position against the baseline).
    #[arg(long, value_name = "FILE", requires = "html")]
    accept: Option<PathBuf>,
}

#[derive(Args)]
pub struct ReplayArgs {
    /// Trace files to replay.
    #[arg(required = true)]
    paths: Vec<PathBuf>,
    /// Repository root that trace model paths are relative to [default: current directory].
    #[arg(long)]
    root: Option<PathBuf>,
    /// Print machine-readable JSON.
    #[arg(long)]
    json: bool,
}

/// One trace's result: a judgement, or an error that kept it from running (`verity judge
/// score` builds them from another engine's answers).
pub(super) struct Checked {
    pub(super) trace: Trace,
    pub(super) judgement: Result<Judgement, String>,
}

impl Checked {
    fn status(&self) -> Status {
        self.judgement
            .as_ref()
            .map_or(Status::Fail, Judgement::status)
    }

    fn report(&self) -> Option<String> {
        match &self.judgement {
            Ok(j) => j.report(&self.trace),
            Err(e) => Some(format!("ERROR {}: {e}\n", self.trace.id)),
        }
    }

    fn to_json(&self) -> serde_json::Value {
        let mut doc = json!({
            "id": self.trace.id,
            "suite": self.trace.suite(),
            "status": self.status(),
            "error": self.judgement.as_ref().err(),
            "report": self.report(),
        });
        if let Ok(j) = &self.judgement {
            doc["view"] = self.view(j);
            doc["recorded"] = json!(j.recorded);
            doc["replayed"] = json!(j.replayed);
            doc["explained_by"] = json!(j.explained_by);
            doc["lowered_by"] = json!(j.lowered_by);
            if let Outcome::TierC { bug, .. } = &j.outcome {
                doc["tier_c"] = json!({ "bug": bug });
            }
            if let Outcome::Forced {
                check,
                tolerance,
                class,
                acceptance,
                cut,
                ..
            } = &j.outcome
            {
                let (max, at) = check.max_deviation();
                doc["forced"] = json!({
                    "class": class.name(),
                    "tolerance_step": tolerance.limits.step,
                    "tolerance_mean": tolerance.limits.mean,
                    "tolerance_measured": tolerance.measured,
                    "steps": check.deviations.len(),
                    "max_deviation": max,
                    "max_deviation_step": at,
                    "mean_deviation": check.mean_deviation(),
                    "deviations": check.deviations,
                    "top_deviations": check.top_deviations,
                    "near_ties": check.near_ties,
                    "accepted_drafts": acceptance.map(|(o, r)| json!({"oracle": o, "replayed": r})),
                    "cut": cut.as_ref().map(|c| json!({"step": c.step, "why": c.why})),
                });
            }
        }
        doc
    }
}

impl Checked {
    /// What the HTML report draws of a trace: the oracle's and the engine's text token by
    /// token, the first step they differ at, and the oracle's top-1/top-2 margin per step.
    fn view(&self, j: &Judgement) -> serde_json::Value {
        // Each token's piece is what it adds to the decoded prefix; a token that completes a
        // multi-byte character replaces the placeholder the prefix ended in.
        let pieces = |ids: &[u32]| -> Vec<String> {
            let mut prev = String::new();
            (1..=ids.len())
                .map(|n| {
                    let text = j.decode(&ids[..n]);
                    let mut common = prev
                        .bytes()
                        .zip(text.bytes())
                        .take_while(|(a, b)| a == b)
                        .count();
                    while !text.is_char_boundary(common) {
                        common -= 1;
                    }
                    let piece = text[common..].to_string();
                    prev = text;
                    piece
                })
                .collect()
        };
        let margins: Vec<Option<f32>> = self
            .trace
            .steps
            .iter()
            .map(|s| match s.top.as_slice() {
                [a, b, ..] => Some(a.1 - b.1),
                _ => None,
            })
            .collect();
        let (engine, first_difference) = match &j.outcome {
            Outcome::Replayed { run, verdict } => (
                Some(pieces(&run.tokens())),
                verdict.divergence().map(|d| d.step),
            ),
            Outcome::Forced { check, .. } => (None, check.failure.as_ref().map(|d| d.step)),
            Outcome::TierC { .. } | Outcome::Unsupported(_) => (None, None),
        };
        json!({
            "oracle": pieces(&self.trace.tokens()),
            "engine": engine,
            "first_difference": first_difference,
            "margins": margins,
        })
    }
}

/// How often a run whose stderr is not a terminal (a CI log, a remote job), where the progress
/// bar is not drawn, says how far it got.
const PROGRESS_LINE_EVERY: Duration = Duration::from_secs(30);

/// Judges every trace in `paths`, with a progress bar unless `quiet` (on a stderr that is not a
/// terminal, a line every [`PROGRESS_LINE_EVERY`] instead).
fn run_traces(
    paths: &[PathBuf],
    root: &Path,
    backend: &str,
    quiet: bool,
) -> anyhow::Result<Vec<Checked>> {
    let traces = paths
        .iter()
        .map(|p| Trace::load(p).map_err(anyhow::Error::from))
        .collect::<anyhow::Result<Vec<_>>>()?;
    let registry = Registry::load(&root.join("golden")).with_context(|| {
        format!(
            "{} is not a verity repository root (pass --root)",
            root.display()
        )
    })?;
    // Ten copies of one trace are one trace, not ten passes.
    let mut seen: BTreeMap<&str, &Path> = BTreeMap::new();
    for (trace, path) in traces.iter().zip(paths) {
        if let Some(first) = seen.insert(&trace.id, path) {
            bail!(
                "trace id {:?} appears twice: {} and {}",
                trace.id,
                first.display(),
                path.display()
            );
        }
    }
    let bar = if quiet {
        ProgressBar::hidden()
    } else {
        ProgressBar::new(traces.len() as u64)
    };
    bar.set_style(
        ProgressStyle::with_template("{spinner} replaying [{bar:30}] {pos}/{len} {wide_msg}")
            .expect("valid template")
            .progress_chars("=> "),
    );
    let mut models = Models::new(root);
    let mut checked = Vec::with_capacity(traces.len());
    let total = traces.len();
    let lines = !quiet && !std::io::stderr().is_terminal();
    let mut said = Instant::now();
    for trace in traces {
        if lines && said.elapsed() >= PROGRESS_LINE_EVERY {
            eprintln!(
                "replaying: {} of {total} traces, now {}",
                checked.len(),
                trace.id
            );
            said = Instant::now();
        }
        bar.set_message(trace.id.clone());
        let judgement = match judge(&trace, &mut models, backend, &registry) {
            Err(e) if e.is_bad_input() => {
                bar.finish_and_clear();
                let e = e.to_string();
                match e.contains(&trace.id) {
                    true => bail!("trace {e}"),
                    false => bail!("trace {}: {e}", trace.id),
                }
            }
            j => j.map_err(|e| e.to_string()),
        };
        checked.push(Checked { trace, judgement });
        bar.inc(1);
    }
    bar.finish_and_clear();
    Ok(checked)
}

/// The teacher-forced deviations of one (recorded backend, model class) group.
struct DeviationGroup {
    /// Mean |Δ logprob| of each trace.
    trace_means: Vec<f32>,
    /// |Δ logprob| of every step.
    steps: Vec<f32>,
    /// The largest |Δ logprob| of the other top entries.
    top_max: f32,
    limits: Limits,
}

/// The largest and the 99th-percentile deviation of teacher-forced replays per (recorded
/// backend, model class): the measurements the cross-backend tolerances are derived from.
fn deviation_table(checked: &[Checked]) -> String {
    let mut groups: BTreeMap<(String, &str), DeviationGroup> = BTreeMap::new();
    for c in checked {
        let Ok(j) = &c.judgement else { continue };
        if let Outcome::Forced {
            check,
            class,
            tolerance,
            ..
        } = &j.outcome
        {
            let g = groups
                .entry((j.recorded.clone(), class.name()))
                .or_insert(DeviationGroup {
                    trace_means: Vec::new(),
                    steps: Vec::new(),
                    top_max: 0.0,
                    limits: tolerance.limits,
                });
            g.trace_means.push(check.mean_deviation());
            g.steps.extend(&check.deviations);
            g.top_max = check
                .top_deviations
                .iter()
                .copied()
                .fold(g.top_max, f32::max);
        }
    }
    if groups.is_empty() {
        return String::new();
    }
    let mut out = String::from(
        "\nteacher-forced |Δ logprob| of the oracle's token (per step: max, p99; per trace: largest mean) \
         and of its other top entries (max):\n\
         recorded  class      traces   steps        max        p99   max-mean    top-max  tolerance (step, mean)\n",
    );
    for ((recorded, class), mut g) in groups {
        g.steps.sort_by(f32::total_cmp);
        let devs = &g.steps;
        let at = |q: f64| devs[((devs.len() - 1) as f64 * q).round() as usize];
        let (max, p99) = if devs.is_empty() {
            (0.0, 0.0)
        } else {
            (at(1.0), at(0.99))
        };
        let max_mean = g.trace_means.iter().copied().fold(0.0, f32::max);
        let (traces, steps) = (g.trace_means.len(), devs.len());
        let (top_max, step, mean) = (g.top_max, g.limits.step, g.limits.mean);
        out.push_str(&format!(
            "{recorded:<9} {class:<9} {traces:>7} {steps:>7} {max:>10.3e} {p99:>10.3e} {max_mean:>10.3e} {top_max:>10.3e}  {step:.3e}, {mean:.3e}\n"
        ));
    }
    out
}

fn print_reports(checked: &[Checked]) {
    for report in checked.iter().filter_map(Checked::report) {
        println!("{report}");
    }
}

fn exit_code(checked: &[Checked]) -> ExitCode {
    if checked.iter().any(|c| c.status() == Status::Fail) {
        ExitCode::from(1)
    } else {
        ExitCode::SUCCESS
    }
}

/// The report files `--html` and `--junit` ask for, checked before any trace runs, and the
/// `--bench` and `--accept` documents read then too.
pub(super) struct ReportFiles {
    html: Option<PathBuf>,
    junit: Option<PathBuf>,
    bench: Option<serde_json::Value>,
    accept: Option<serde_json::Value>,
}

/// The JSON document `path` names (for `flag`), refused unless it has the array `key`, which
/// every document of `verb` has.
fn read_document(
    flag: &str,
    path: &Path,
    key: &str,
    verb: &str,
) -> anyhow::Result<serde_json::Value> {
    let what = || format!("{flag} {}", path.display());
    let doc: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(path).with_context(what)?)
            .with_context(what)?;
    if !doc[key].is_array() {
        bail!("{}: not a `{verb} --json` document (no {key})", what());
    }
    Ok(doc)
}

impl ReportFiles {
    pub(super) fn new(args: &ReportArgs) -> anyhow::Result<ReportFiles> {
        for (flag, path) in [("--html", &args.html), ("--junit", &args.junit)] {
            if let Some(p) = path {
                verity_harness::atomic::check_target(p)
                    .with_context(|| format!("{flag} {}", p.display()))?;
            }
        }
        let bench = args
            .bench
            .as_deref()
            .map(|p| read_document("--bench", p, "rows", "verity bench"))
            .transpose()?;
        let accept = args
            .accept
            .as_deref()
            .map(|p| read_document("--accept", p, "suites", "verity accept"))
            .transpose()?;
        Ok(ReportFiles {
            html: args.html.clone(),
            junit: args.junit.clone(),
            bench,
            accept,
        })
    }

    fn write(&self, doc: &serde_json::Value) -> anyhow::Result<()> {
        let pages = [
            (
                "--html",
                &self.html,
                verity_harness::html::render(doc, self.bench.as_ref(), self.accept.as_ref()),
            ),
            ("--junit", &self.junit, verity_harness::junit::render(doc)),
        ];
        for (flag, path, text) in pages {
            if let Some(p) = path {
                verity_harness::atomic::write(p, text.as_bytes())
                    .with_context(|| format!("{flag} {}", p.display()))?;
            }
        }
        Ok(())
    }
}

pub fn check(args: CheckArgs, device: mlx::Device) -> anyhow::Result<ExitCode> {
    let reports = ReportFiles::new(&args.report)?;
    let backend = device.name();
    let Selected { root, sets } = args.traces.select()?;
    let mut report = Vec::new();
    let mut all = Vec::new();
    for (dir, paths) in &sets {
        let checked = run_traces(paths, &root, backend, args.json)?;
        let name = dir.strip_prefix(&root).unwrap_or(dir).display().to_string();
        report.push(set_report(name, &checked));
        all.extend(checked);
    }
    print_results("verity check", &report, &all, args.json, backend, &reports)
}

/// One trace folder's name, trace count and counts per suite.
pub(super) type SetReport = (String, usize, BTreeMap<String, Counts>);

/// The report of the set `name` whose traces came out as `checked`.
pub(super) fn set_report(name: String, checked: &[Checked]) -> SetReport {
    let mut suites: BTreeMap<String, Counts> = BTreeMap::new();
    for c in checked {
        suites
            .entry(c.trace.suite().to_string())
            .or_default()
            .add(c.status());
    }
    (name, checked.len(), suites)
}

/// Prints the results of every set (the reports, the suite tables, the deviation table and
/// the summary, or with `json` one document) and gives the exit code; `verb` heads each table.
pub(super) fn print_results(
    verb: &str,
    report: &[SetReport],
    all: &[Checked],
    json: bool,
    backend: &str,
    reports: &ReportFiles,
) -> anyhow::Result<ExitCode> {
    let failed = all.iter().filter(|c| c.status() == Status::Fail).count();
    let doc = json!({
        "mlx_version": mlx::version(),
        "backend": backend,
        "sets": report.iter().map(|(n, t, s)| json!({"dir": n, "traces": t, "suites": s})).collect::<Vec<_>>(),
        "traces": all.iter().map(Checked::to_json).collect::<Vec<_>>(),
        "failed": failed,
    });
    reports.write(&doc)?;
    if json {
        println!("{}", serde_json::to_string_pretty(&doc)?);
        return Ok(exit_code(all));
    }
    print_reports(all);
    for (name, traces, suites) in report {
        println!(
            "{verb}: {traces} traces from {name} (MLX {}, {backend})\n",
            mlx::version()
        );
        println!("{}", suite_table(suites));
    }
    print!("{}", deviation_table(all));
    let count = |s: Status| all.iter().filter(|c| c.status() == s).count();
    let (explained, tier_c) = (count(Status::Explained), count(Status::TierC));
    if failed == 0 {
        println!("\nall traces pass ({tier_c} at tier C under a known oracle bug, {explained} explained)");
    } else {
        println!(
            "\nFAILED: {failed} of {} traces diverged or could not run",
            all.len()
        );
    }
    Ok(exit_code(all))
}

pub fn replay(args: ReplayArgs, device: mlx::Device) -> anyhow::Result<ExitCode> {
    let root = super::root_or_cwd(args.root)?;
    let checked = run_traces(&args.paths, &root, device.name(), true)?;
    if args.json {
        let doc: Vec<_> = checked.iter().map(Checked::to_json).collect();
        println!("{}", serde_json::to_string_pretty(&doc)?);
    } else {
        for c in &checked {
            match c.report() {
                Some(r) => print!("{r}"),
                None if c.status() == Status::TierC => println!(
                    "pass at tier C {} (verity speculative == verity plain; the oracle's tokens are wrong: {})",
                    c.trace.id,
                    c.judgement.as_ref().map_or(String::new(), |j| j.oracle_bug().unwrap_or_default())
                ),
                None => println!("pass {} ({} steps)", c.trace.id, c.trace.steps.len()),
            }
        }
    }
    Ok(exit_code(&checked))
}
