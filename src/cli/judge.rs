//! `verity judge`: hold any engine to the golden traces through files (docs/judge.md). `export`
//! writes what each golden case asks of an engine, `respond` answers it with verity's own
//! engine, and `score` judges an engine's answers exactly as `verity check` judges verity's
//! runs, printing the same tables and JSON. The protocol and the judging are the harness's
//! (verity_harness::protocol); this verb reads and writes the files and loads the models whose
//! vocabulary, tolerance class and tokenizer they need.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::ExitCode;

use anyhow::{anyhow, bail, Context};
use clap::{Args, Subcommand};
use indicatif::{ProgressBar, ProgressStyle};
use verity::parity::judge::{model_class, Judged, Judgement};
use verity::parity::replay::{replay, replay_forced};
use verity::parity::Models;
use verity_harness::atomic;
use verity_harness::judge::{plan, Plan};
use verity_harness::protocol::{
    judge_answer, pair_responses, parse_requests, validate, Mode, Request, Response,
};
use verity_harness::registry::Registry;
use verity_harness::trace::Trace;

use super::check::{
    print_results, set_report, Checked, ReportArgs, ReportFiles, Selected, TraceArgs,
};

#[derive(Subcommand)]
pub enum Judge {
    /// Write what every golden case asks of an engine (verity-judge/1 requests, JSON Lines).
    Export(ExportArgs),
    /// Answer a requests file with verity's own engine.
    Respond(RespondArgs),
    /// Judge an engine's responses against the goldens, like `verity check` (exit 0 / 1 / 2).
    Score(ScoreArgs),
}

#[derive(Args)]
pub struct ExportArgs {
    #[command(flatten)]
    traces: TraceArgs,
    /// The backend the engine runs on: cpu, cuda or metal [default: this run's device]. It
    /// decides which cases are generated and which teacher-forced, as for `verity check`.
    #[arg(long)]
    backend: Option<String>,
    /// The requests file to write.
    #[arg(long)]
    out: PathBuf,
}

#[derive(Args)]
pub struct RespondArgs {
    /// A requests file of `verity judge export`.
    requests: PathBuf,
    /// Repository root that model paths are relative to [default: current directory].
    #[arg(long)]
    root: Option<PathBuf>,
    /// The responses file to write.
    #[arg(long)]
    out: PathBuf,
}

#[derive(Args)]
pub struct ScoreArgs {
    /// A requests file of `verity judge export`.
    requests: PathBuf,
    /// The engine's responses to it.
    responses: PathBuf,
    /// Repository root that trace paths are relative to [default: current directory].
    #[arg(long)]
    root: Option<PathBuf>,
    /// Print machine-readable JSON (the document of `verity check --json`) instead of tables.
    #[arg(long)]
    json: bool,
    #[command(flatten)]
    report: ReportArgs,
}

/// The backends traces are recorded on (golden/traces, golden/traces-<backend>).
const BACKENDS: [&str; 3] = ["cpu", "cuda", "metal"];

pub fn run(command: Judge, device: mlx::Device) -> anyhow::Result<ExitCode> {
    match command {
        Judge::Export(a) => export(a, device),
        Judge::Respond(a) => respond(a, device),
        Judge::Score(a) => score(a),
    }
}

fn registry(root: &Path) -> anyhow::Result<Registry> {
    Registry::load(&root.join("golden")).with_context(|| {
        format!(
            "{} is not a verity repository root (pass --root)",
            root.display()
        )
    })
}

/// `path` as the requests name it: relative to the root when under it.
fn relative(path: &Path, root: &Path) -> anyhow::Result<String> {
    let path = std::fs::canonicalize(path).with_context(|| format!("{}", path.display()))?;
    Ok(path
        .strip_prefix(root)
        .unwrap_or(&path)
        .display()
        .to_string())
}

fn read(path: &Path, what: &str) -> anyhow::Result<String> {
    std::fs::read_to_string(path).with_context(|| format!("{what} {}", path.display()))
}

fn export(args: ExportArgs, device: mlx::Device) -> anyhow::Result<ExitCode> {
    atomic::check_target(&args.out).with_context(|| format!("--out {}", args.out.display()))?;
    let backend = args.backend.unwrap_or_else(|| device.name().to_string());
    if !BACKENDS.contains(&backend.as_str()) {
        bail!(
            "--backend {backend:?}: the backends are {}",
            BACKENDS.join(", ")
        );
    }
    let Selected { root, sets } = args.traces.select()?;
    let root = std::fs::canonicalize(&root).with_context(|| format!("{}", root.display()))?;
    let registry = registry(&root)?;
    let mut models = Models::new(&root);
    let (mut lines, mut modes, mut cases) = (String::new(), Vec::new(), BTreeSet::new());
    for (dir, paths) in sets {
        let set = relative(&dir, &root)?;
        for path in paths {
            let trace = Trace::load(&path)?;
            let bundle = models
                .get(&trace.model)
                .map_err(|e| anyhow!("trace {}: {e}", trace.id))?;
            let plan = plan(&trace, &backend, &registry);
            let request = Request::new(
                &trace,
                set.clone(),
                relative(&path, &root)?,
                &backend,
                &plan,
                bundle.model().vocab_size(),
                bundle.eos_token_ids.clone(),
            );
            if !cases.insert(request.id.clone()) {
                bail!("case {:?} appears twice ({})", request.id, path.display());
            }
            modes.push(request.mode);
            lines.push_str(&serde_json::to_string(&request)?);
            lines.push('\n');
        }
    }
    atomic::write(&args.out, lines.as_bytes())
        .with_context(|| format!("--out {}", args.out.display()))?;
    let count = |m: Mode| modes.iter().filter(|&&x| x == m).count();
    eprintln!(
        "wrote {} requests to {} for {backend}: {} to generate, {} to score, {} tier C, {} skipped",
        modes.len(),
        args.out.display(),
        count(Mode::Generate),
        count(Mode::Score),
        count(Mode::TierC),
        count(Mode::Skip)
    );
    Ok(ExitCode::SUCCESS)
}

/// Verity's answer to one request, as `verity check` computes it; `None` for a skipped case.
fn answer(request: &Request, models: &mut Models) -> verity::Result<Option<Response>> {
    let trace = request.replay_trace();
    let id = &request.id;
    Ok(Some(match request.mode {
        Mode::Skip => return Ok(None),
        Mode::Generate => Response::generated(id, &replay(&trace, models)?.0),
        Mode::Score => {
            let (run, _) = replay_forced(&trace, models, request.draft_tokens)?;
            Response::scored(id, &run.scored, run.draft_choice)
        }
        Mode::TierC => {
            let (speculative, _) = replay(&trace, models)?;
            let plain = Trace {
                draft: None,
                ..trace
            };
            Response::tier_c(id, &speculative, &replay(&plain, models)?.0)
        }
    }))
}

fn respond(args: RespondArgs, device: mlx::Device) -> anyhow::Result<ExitCode> {
    atomic::check_target(&args.out).with_context(|| format!("--out {}", args.out.display()))?;
    let root = super::root_or_cwd(args.root)?;
    let requests = parse_requests(&read(&args.requests, "requests")?, &args.requests)?;
    let backend = device.name();
    if let Some(r) = requests
        .iter()
        .find(|r| r.backend != backend && r.mode != Mode::Skip)
    {
        bail!(
            "{}: case {:?} was exported for {}, but this run is on {backend} (pass --device, or \
             export with --backend {backend})",
            args.requests.display(),
            r.id,
            r.backend
        );
    }
    let bar = ProgressBar::new(requests.len() as u64);
    bar.set_style(
        ProgressStyle::with_template("{spinner} answering [{bar:30}] {pos}/{len} {wide_msg}")
            .expect("valid template")
            .progress_chars("=> "),
    );
    let mut models = Models::new(&root);
    let mut lines = String::new();
    for request in &requests {
        bar.set_message(request.id.clone());
        let response = match answer(request, &mut models) {
            Err(e) if e.is_bad_input() => {
                bar.finish_and_clear();
                bail!("case {}: {e}", request.id);
            }
            Err(e) => Some(Response::unsupported(&request.id, e.to_string())),
            Ok(r) => r,
        };
        if let Some(r) = response {
            lines.push_str(&serde_json::to_string(&r)?);
            lines.push('\n');
        }
        bar.inc(1);
    }
    bar.finish_and_clear();
    atomic::write(&args.out, lines.as_bytes())
        .with_context(|| format!("--out {}", args.out.display()))?;
    Ok(ExitCode::SUCCESS)
}

fn score(args: ScoreArgs) -> anyhow::Result<ExitCode> {
    let reports = ReportFiles::new(&args.report)?;
    let root = super::root_or_cwd(args.root)?;
    let requests = parse_requests(&read(&args.requests, "requests")?, &args.requests)?;
    let responses = read(&args.responses, "responses")?;
    let paired = pair_responses(&responses, &args.responses, &requests)?;
    let backend = requests[0].backend.clone();
    if let Some(r) = requests.iter().find(|r| r.backend != backend) {
        bail!(
            "{}: case {:?} is for {}, the first case for {backend}: one file judges one backend",
            args.requests.display(),
            r.id,
            r.backend
        );
    }
    let registry = registry(&root)?;
    let mut models = Models::new(&root);
    let mut sets: Vec<(String, Vec<Checked>)> = Vec::new();
    for (request, response) in requests.iter().zip(paired) {
        let in_case = |e: String| anyhow!("case {}: {e}", request.id);
        let trace = Trace::load(&root.join(&request.trace))
            .map_err(|e| in_case(format!("its trace: {e}")))?;
        let bundle = models
            .get(&trace.model)
            .map_err(|e| in_case(e.to_string()))?;
        let plan = plan(&trace, &backend, &registry);
        let expected = Request::new(
            &trace,
            request.set.clone(),
            request.trace.clone(),
            &backend,
            &plan,
            bundle.model().vocab_size(),
            bundle.eos_token_ids.clone(),
        );
        request
            .matches(&expected)
            .map_err(|e| anyhow!("{}: case {}: {e}", args.requests.display(), request.id))?;
        let judged = match (plan, response) {
            (Plan::Skip(why), _) => Ok(Judged::skipped(&trace, &backend, why)),
            (_, None) => bail!(
                "{}: case {} has no response",
                args.responses.display(),
                request.id
            ),
            (plan, Some(response)) => {
                let answer = validate(request, &response).map_err(|e| {
                    anyhow!("{}: case {}: {e}", args.responses.display(), request.id)
                })?;
                let class = model_class(&bundle);
                judge_answer(&trace, plan, answer, &backend, &registry, class)
            }
        };
        let judgement = judged.map(|j| Judgement::new(j, Some(bundle)));
        let checked = Checked { trace, judgement };
        match sets.iter_mut().find(|(name, _)| *name == request.set) {
            Some((_, all)) => all.push(checked),
            None => sets.push((request.set.clone(), vec![checked])),
        }
    }
    let report: Vec<_> = sets.iter().map(|(n, c)| set_report(n.clone(), c)).collect();
    let all: Vec<Checked> = sets.into_iter().flat_map(|(_, c)| c).collect();
    print_results("verity judge", &report, &all, args.json, &backend, &reports)
}
