//! `verity accept`: run the acceptance suites, print a per-position table, compare with the
//! committed baselines. Exit 0 good, 1 regressed, 125 cannot run — `git bisect run`'s codes.

use std::collections::BTreeMap;
use std::fmt::Write;
use std::path::{Path, PathBuf};
use std::process::ExitCode;

use anyhow::Context;
use clap::Args;
use serde_json::json;
use verity::parity::acceptance::{acceptance, run_suite};
use verity::parity::Models;
use verity::speculative::SpeculationStats;
use verity_harness::acceptance::{Baseline, Suite};
use verity_harness::stats::{regressions, Acceptance, Tolerance};

#[derive(Args)]
pub struct AcceptArgs {
    /// Suite files [default: <root>/golden/accept/*.toml].
    #[arg(long = "suite")]
    suites: Vec<PathBuf>,
    /// Baseline to compare with [default: each suite's <name>.baseline.json]; one suite only.
    #[arg(long)]
    baseline: Option<PathBuf>,
    /// Write the baselines (at --baseline, or next to each suite) instead of comparing.
    #[arg(long)]
    write_baseline: bool,
    /// Repository root that suite paths are relative to [default: current directory].
    #[arg(long)]
    root: Option<PathBuf>,
    /// Also write the results (per suite and k, measured and baseline counts per draft
    /// position) as JSON, for `check --html --accept`.
    #[arg(long, value_name = "FILE")]
    json: Option<PathBuf>,
    /// Also write the acceptance per draft position against the baseline as an HTML page.
    #[arg(long, value_name = "FILE")]
    html: Option<PathBuf>,
}

/// The exit code git bisect reads as "skip this commit".
const CANNOT_RUN: u8 = 125;

pub fn accept(a: AcceptArgs) -> anyhow::Result<ExitCode> {
    match run(a) {
        Ok(regressed) => Ok(ExitCode::from(u8::from(regressed))),
        Err(e) => {
            eprintln!("error: {}", super::one_line(&e));
            Ok(ExitCode::from(CANNOT_RUN))
        }
    }
}

fn run(a: AcceptArgs) -> anyhow::Result<bool> {
    let reports = AcceptReports::new(&a)?;
    let root = super::root_or_cwd(a.root)?;
    let mut suites = a.suites;
    if suites.is_empty() {
        let dir = root.join("golden/accept");
        let entries =
            std::fs::read_dir(&dir).map_err(|e| anyhow::anyhow!("{}: {e}", dir.display()))?;
        suites = entries
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| p.extension().is_some_and(|x| x == "toml"))
            .collect();
        suites.sort();
    }
    anyhow::ensure!(!suites.is_empty(), "no acceptance suites");
    anyhow::ensure!(
        a.baseline.is_none() || suites.len() == 1,
        "--baseline needs exactly one --suite"
    );
    // Every suite and baseline is read and checked before anything runs.
    let mut jobs = Vec::new();
    for path in suites {
        let suite = Suite::load(&path)?;
        let baseline_path = a
            .baseline
            .clone()
            .unwrap_or_else(|| Suite::baseline_path(&path));
        let baseline = if a.write_baseline {
            verity_harness::atomic::check_target(&baseline_path)
                .with_context(|| format!("baseline {}", baseline_path.display()))?;
            None
        } else {
            Some(Baseline::load_for(&baseline_path, &path, &suite)?)
        };
        jobs.push((path, suite, baseline_path, baseline));
    }
    let mut models = Models::new(&root);
    let mut regressed = false;
    let mut doc = Vec::new();
    for (path, suite, baseline_path, baseline) in jobs {
        let stats = run_suite(&suite, &mut models)?;
        print!("{}", table(&path, &suite, &stats));
        let measured: BTreeMap<usize, Acceptance> =
            stats.iter().map(|(k, s)| (*k, acceptance(s))).collect();
        // Where the oracle reports per-position counts, they must be verity's exactly.
        let mut parity = Vec::new();
        for (k, a) in &measured {
            let mismatches = suite
                .oracle
                .as_ref()
                .and_then(|o| o.by_position_mismatches(*k, a));
            match mismatches {
                Some(m) if m.is_empty() => println!("k={k}: by position equal to the oracle's"),
                Some(m) => parity.extend(m.into_iter().map(|m| format!("k={k}: {m}"))),
                None => {}
            }
        }
        if !parity.is_empty() {
            regressed = true;
            println!("DIFFERS from the oracle:\n  {}\n", parity.join("\n  "));
        }
        let mut problems = Vec::new();
        match &baseline {
            None => {
                Baseline::new(Suite::name(&path), measured.clone()).save(&baseline_path)?;
                println!("wrote {}\n", baseline_path.display());
            }
            Some(baseline) => {
                for (k, base) in &baseline.acceptance {
                    match measured.get(k) {
                        Some(now) => problems.extend(
                            regressions(base, now, &Tolerance::default())
                                .into_iter()
                                .map(|m| format!("k={k}: {m}")),
                        ),
                        None => problems.push(format!("k={k}: in the baseline but not measured")),
                    }
                }
                if problems.is_empty() {
                    println!(
                        "{} rows within tolerance of {}\n",
                        baseline.acceptance.len(),
                        baseline_path.display()
                    );
                } else {
                    regressed = true;
                    println!(
                        "REGRESSED against {}:\n  {}\n",
                        baseline_path.display(),
                        problems.join("\n  ")
                    );
                }
            }
        }
        doc.push(json!({
            "name": Suite::name(&path),
            "target": suite.target,
            "source": suite.source.to_string(),
            "max_tokens": suite.max_tokens,
            "prompts": suite.prompts.len(),
            "baseline": baseline.as_ref().map(|_| baseline_path.display().to_string()),
            "rows": measured.iter().map(|(k, m)| json!({
                "k": k,
                "measured": m,
                "baseline": baseline.as_ref().and_then(|b| b.acceptance.get(k)),
            })).collect::<Vec<_>>(),
            "problems": parity.iter().chain(&problems).collect::<Vec<_>>(),
        }));
    }
    reports.write(&json!({
        "mlx_version": mlx::version(),
        "tolerance": Tolerance::default(),
        "suites": doc,
        "regressed": regressed,
    }))?;
    Ok(regressed)
}

/// The files `--json` and `--html` ask for, checked before any suite runs.
struct AcceptReports {
    json: Option<PathBuf>,
    html: Option<PathBuf>,
}

impl AcceptReports {
    fn new(a: &AcceptArgs) -> anyhow::Result<AcceptReports> {
        for (flag, path) in [("--json", &a.json), ("--html", &a.html)] {
            if let Some(p) = path {
                verity_harness::atomic::check_target(p)
                    .with_context(|| format!("{flag} {}", p.display()))?;
            }
        }
        Ok(AcceptReports {
            json: a.json.clone(),
            html: a.html.clone(),
        })
    }

    fn write(&self, doc: &serde_json::Value) -> anyhow::Result<()> {
        if let Some(p) = &self.json {
            let text = serde_json::to_string_pretty(doc)? + "\n";
            verity_harness::atomic::write(p, text.as_bytes())
                .with_context(|| format!("--json {}", p.display()))?;
        }
        if let Some(p) = &self.html {
            let page = verity_harness::html::render_acceptance(doc);
            verity_harness::atomic::write(p, page.as_bytes())
                .with_context(|| format!("--html {}", p.display()))?;
        }
        Ok(())
    }
}

/// The per-k table, with per-position acceptance and mlx-lm's from_draft fraction.
fn table(path: &Path, suite: &Suite, stats: &BTreeMap<usize, SpeculationStats>) -> String {
    let mut out = String::new();
    let name = Suite::name(path);
    let (target, source, max) = (&suite.target, &suite.source, suite.max_tokens);
    let prompts = suite.prompts.len();
    let _ = writeln!(
        out,
        "suite {name}: {target} with {source}, {prompts} prompts x {max} tokens, greedy"
    );
    let _ = writeln!(out, "  k  rounds  drafted  accepted  accept  mean-len  tok/fwd  from_draft  oracle  by position");
    for (k, s) in stats {
        let a = acceptance(s);
        let from_draft = a.from_draft_fraction();
        let oracle = suite
            .oracle
            .as_ref()
            .and_then(|o| o.from_draft.get(&k.to_string()))
            .map_or("-".to_string(), |v| format!("{v:.4}"));
        let by_pos: Vec<String> = (0..s.drafted_by_pos.len())
            .map(|i| format!("{:.2}", a.rate_at(i)))
            .collect();
        let _ = writeln!(
            out,
            "{k:>3}  {:>6}  {:>7}  {:>8}  {:>6.4}  {:>8.3}  {:>7.3}  {from_draft:>10.4}  {oracle:>6}  {}",
            s.rounds,
            s.drafted,
            s.accepted,
            s.acceptance_rate(),
            s.mean_accepted_len(),
            s.tokens_per_forward(),
            by_pos.join(" ")
        );
    }
    out
}
