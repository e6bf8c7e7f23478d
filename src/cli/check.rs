//! `verity check` and `verity replay`: run the engine on golden traces and judge the runs.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::ExitCode;

use anyhow::{bail, Context};
use clap::Args;
use indicatif::{ProgressBar, ProgressStyle};
use serde_json::json;
use verity::parity::replay;
use verity::parity::Models;
use verity_harness::compare::parity_on;
use verity_harness::report::{divergence_report, suite_table, Counts};
use verity_harness::trace::{find_traces, Trace};
use verity_harness::{compare, Verdict};

#[derive(Args)]
pub struct CheckArgs {
    /// Repository root that trace model paths are relative to [default: current directory].
    #[arg(long)]
    root: Option<PathBuf>,
    /// Trace folder [default: <root>/golden/traces-<device> if present, else <root>/golden/traces].
    #[arg(long)]
    traces: Option<PathBuf>,
    /// Only traces whose id contains this.
    #[arg(long)]
    only: Option<String>,
    /// Print machine-readable JSON instead of tables.
    #[arg(long)]
    json: bool,
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

/// The outcome of one trace: a verdict, or an error that kept it from running.
struct Outcome {
    trace: Trace,
    verdict: Result<Verdict, String>,
    report: Option<String>,
}

impl Outcome {
    fn failed(&self) -> bool {
        self.verdict.as_ref().map_or(true, Verdict::is_failure)
    }

    fn to_json(&self, device: mlx::Device) -> serde_json::Value {
        let (status, divergence) = match &self.verdict {
            Ok(Verdict::Pass) => ("pass", None),
            Ok(Verdict::NearTie(d)) => ("near-tie", Some(d)),
            Ok(Verdict::Fail(d)) => ("fail", Some(d)),
            Err(_) => ("error", None),
        };
        json!({
            "id": self.trace.id,
            "suite": self.trace.suite(),
            "tier": format!("{:?}", parity_on(&self.trace, device.name()).tier),
            "status": status,
            "error": self.verdict.as_ref().err(),
            "divergence": divergence.map(|d| json!({
                "step": d.step,
                "what": d.kind.to_string(),
                "oracle_margin": d.oracle_margin,
                "near_tie": d.near_tie,
            })),
            "report": self.report,
        })
    }
}

fn run_traces(
    paths: &[PathBuf],
    root: &Path,
    device: mlx::Device,
    show_progress: bool,
) -> anyhow::Result<Vec<Outcome>> {
    let traces = paths
        .iter()
        .map(|p| Trace::load(p).map_err(anyhow::Error::from))
        .collect::<anyhow::Result<Vec<_>>>()?;
    let bar = if show_progress {
        ProgressBar::new(traces.len() as u64)
    } else {
        ProgressBar::hidden()
    };
    bar.set_style(
        ProgressStyle::with_template("{spinner} replaying [{bar:30}] {pos}/{len} {wide_msg}")
            .expect("valid template")
            .progress_chars("=> "),
    );
    let mut models = Models::new(root);
    let mut outcomes = Vec::with_capacity(traces.len());
    for trace in traces {
        bar.set_message(trace.id.clone());
        let outcome = match replay::replay(&trace, &mut models) {
            Ok((run, bundle)) => {
                let verdict = compare(&trace, &run, device.name());
                let report = verdict.divergence().map(|_| {
                    let decode = |ids: &[u32]| bundle.decode(ids);
                    divergence_report(&trace, &run, &verdict, device.name(), &decode)
                });
                Outcome {
                    trace,
                    verdict: Ok(verdict),
                    report,
                }
            }
            Err(e) => Outcome {
                trace,
                verdict: Err(e.to_string()),
                report: None,
            },
        };
        outcomes.push(outcome);
        bar.inc(1);
    }
    bar.finish_and_clear();
    Ok(outcomes)
}

fn print_failures(outcomes: &[Outcome]) {
    for o in outcomes {
        match (&o.verdict, &o.report) {
            (Err(e), _) => println!("ERROR {}: {e}\n", o.trace.id),
            (Ok(_), Some(report)) => println!("{report}"),
            _ => {}
        }
    }
}

pub fn check(args: CheckArgs, device: mlx::Device) -> anyhow::Result<ExitCode> {
    let root = super::root_or_cwd(args.root)?;
    let dir = args
        .traces
        .unwrap_or_else(|| replay::golden_traces(&root, device));
    let mut paths = find_traces(&dir).with_context(|| {
        format!(
            "no golden traces at {} (run from the repository root or pass --root)",
            dir.display()
        )
    })?;
    if let Some(only) = &args.only {
        paths.retain(|p| p.to_string_lossy().contains(only.as_str()));
    }
    if paths.is_empty() {
        bail!("no trace files under {}", dir.display());
    }
    let outcomes = run_traces(&paths, &root, device, !args.json)?;
    let mut suites: BTreeMap<String, Counts> = BTreeMap::new();
    let mut tiers: BTreeMap<String, usize> = BTreeMap::new();
    for o in &outcomes {
        let counts = suites.entry(o.trace.suite().to_string()).or_default();
        match &o.verdict {
            Ok(v) => counts.add(v),
            Err(_) => counts.fail += 1,
        }
        *tiers
            .entry(format!("{:?}", o.trace.parity.tier))
            .or_default() += 1;
    }
    let failed = outcomes.iter().filter(|o| o.failed()).count();
    if args.json {
        let doc = json!({
            "mlx_version": mlx::version(),
            "traces": outcomes.iter().map(|o| o.to_json(device)).collect::<Vec<_>>(),
            "suites": suites,
            "failed": failed,
        });
        println!("{}", serde_json::to_string_pretty(&doc)?);
    } else {
        print_failures(&outcomes);
        println!(
            "verity check: {} traces from {} (MLX {}, {})\n",
            outcomes.len(),
            dir.strip_prefix(&root).unwrap_or(&dir).display(),
            mlx::version(),
            device.name()
        );
        print!("{}", suite_table(&suites));
        let tier_list: Vec<String> = tiers
            .iter()
            .map(|(t, n)| format!("tier {t}: {n}"))
            .collect();
        println!(
            "\n{} ({})",
            if failed == 0 {
                "all traces pass"
            } else {
                "FAILED"
            },
            tier_list.join(", ")
        );
        if failed > 0 {
            println!(
                "{failed} of {} traces diverged or could not run",
                outcomes.len()
            );
        }
    }
    Ok(if failed == 0 {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(1)
    })
}

pub fn replay(args: ReplayArgs, device: mlx::Device) -> anyhow::Result<ExitCode> {
    let root = super::root_or_cwd(args.root)?;
    let outcomes = run_traces(&args.paths, &root, device, false)?;
    let failed = outcomes.iter().filter(|o| o.failed()).count();
    if args.json {
        let doc: Vec<_> = outcomes.iter().map(|o| o.to_json(device)).collect();
        println!("{}", serde_json::to_string_pretty(&doc)?);
    } else {
        for o in &outcomes {
            match (&o.verdict, &o.report) {
                (Ok(Verdict::Pass), _) => {
                    println!("pass {} ({} steps)", o.trace.id, o.trace.steps.len())
                }
                (Err(e), _) => println!("ERROR {}: {e}", o.trace.id),
                (Ok(_), Some(r)) => print!("{r}"),
                (Ok(_), None) => {}
            }
        }
    }
    Ok(if failed == 0 {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(1)
    })
}
