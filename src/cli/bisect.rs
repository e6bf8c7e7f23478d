//! `verity bisect --good REV --bad REV`: finds the commit that lowered speculative acceptance.
//!
//! Everything it is given is checked first (the revisions, that --good is an ancestor of --bad,
//! the suite, a --baseline against the suite as `verity accept` checks it): a mistake found after
//! the first build would cost minutes. In a scratch worktree it then measures the suite at --good
//! (the baseline) unless --baseline is given, and drives `git bisect` one commit at a time:
//! build verity there (release profile), let that commit's own `verity accept --write-baseline`
//! measure the suite on the CPU into a scratch file, and compare the measurement with the
//! baseline here, with `verity accept`'s tolerance. A commit that cannot build or measure is
//! skipped.
//!
//! The loop is driven here rather than by `git bisect run` so that each probe is reported as it
//! ends. The comparison is made here rather than by the probed commit's `accept` so that one
//! judgement holds for every probe and the verdict can give its figures: an older commit's
//! `accept` has only an exit code and free text to say how a run compares.

use std::collections::HashMap;
use std::fmt;
use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use clap::Args;
use indicatif::{ProgressBar, ProgressStyle};
use verity_harness::acceptance::{AcceptError, Baseline, Suite};
use verity_harness::stats::{regressions, Acceptance, Regression, Tolerance};

#[derive(Args)]
pub struct BisectArgs {
    /// A commit with good acceptance; it must be an ancestor of --bad.
    #[arg(long)]
    good: String,
    /// A later commit with lower acceptance.
    #[arg(long)]
    bad: String,
    /// The repository [default: the one the current directory is in].
    #[arg(long)]
    repo: Option<PathBuf>,
    /// Acceptance suite, repository-relative (each probe runs the suite at its own commit).
    #[arg(long, default_value = "golden/accept/trained-pair.toml")]
    suite: PathBuf,
    /// Cargo target directory for the probes' release builds [default: <repo>/target/bisect];
    /// reusing one keeps them incremental. Not the repository's own target folder.
    #[arg(long)]
    target_dir: Option<PathBuf>,
    /// Compare with this baseline instead of measuring one at --good (e.g. the suite's
    /// committed baseline, when --good is the commit that wrote it).
    #[arg(long)]
    baseline: Option<PathBuf>,
}

/// Runs git in `dir` and returns its stdout, trimmed.
fn git(dir: &Path, args: &[&str]) -> anyhow::Result<String> {
    let out = git_command(dir, args).output().context("running git")?;
    if !out.status.success() {
        bail!(
            "git {}: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(String::from_utf8_lossy(&out.stdout).trim().to_string())
}

/// A git command in `dir`, in the C locale (its output is parsed), reading nothing from stdin.
fn git_command(dir: &Path, args: &[&str]) -> Command {
    let mut cmd = Command::new("git");
    cmd.arg("-C")
        .arg(dir)
        .args(args)
        .env("LC_ALL", "C")
        .stdin(Stdio::null());
    cmd
}

/// The commit that `rev` (the value of `flag`) names. A typo is refused naming the flag, where
/// git alone would only say "Needed a single revision".
fn commit(repo: &Path, flag: &str, rev: &str) -> anyhow::Result<String> {
    let spec = format!("{rev}^{{commit}}");
    let out = git_command(
        repo,
        &[
            "rev-parse",
            "--verify",
            "--quiet",
            "--end-of-options",
            &spec,
        ],
    )
    .output()
    .context("running git")?;
    if !out.status.success() {
        bail!("{flag} {rev}: no such commit in {}", repo.display());
    }
    Ok(String::from_utf8_lossy(&out.stdout).trim().to_string())
}

/// A commit's short sha and subject, as the progress lines and the verdict name it.
fn describe(repo: &Path, sha: &str) -> anyhow::Result<String> {
    git(repo, &["show", "-s", "--format=%h %s", sha])
}

/// `--flag VALUE: why`, naming the value as it was given (the error names the path resolved).
fn refused(flag: &str, value: &Path, e: AcceptError) -> anyhow::Error {
    let AcceptError::Invalid { message, .. } = e;
    anyhow::anyhow!("{flag} {}: {message}", value.display())
}

/// The arguments, checked: everything a bisect needs before it makes a worktree or builds.
struct Plan {
    repo: PathBuf,
    good: String,
    bad: String,
    /// The suite in the repository's work tree, which the baseline and every measurement must
    /// fit.
    suite_path: PathBuf,
    suite: Suite,
    /// --baseline, read and checked against the suite.
    baseline: Option<(PathBuf, Baseline)>,
    /// Where the probes build (not created yet).
    target_dir: PathBuf,
}

fn plan(a: &BisectArgs) -> anyhow::Result<Plan> {
    let given = super::root_or_cwd(a.repo.clone())?;
    let dir = given
        .canonicalize()
        .with_context(|| format!("--repo {}", given.display()))?;
    let out = git_command(&dir, &["rev-parse", "--show-toplevel"])
        .output()
        .context("running git")?;
    if !out.status.success() {
        let why = why(&out.stderr);
        bail!(
            "--repo {}: {}",
            given.display(),
            why.trim_start_matches("fatal: ")
        );
    }
    let repo = PathBuf::from(String::from_utf8_lossy(&out.stdout).trim());
    let suite_path = repo.join(&a.suite);
    if !suite_path.is_file() {
        bail!(
            "--suite {}: no such file in {}",
            a.suite.display(),
            repo.display()
        );
    }
    let suite = Suite::load(&suite_path).map_err(|e| refused("--suite", &a.suite, e))?;
    let baseline = match &a.baseline {
        Some(given) => {
            let path = given
                .canonicalize()
                .with_context(|| format!("--baseline {}", given.display()))?;
            let baseline = Baseline::load_for(&path, &suite_path, &suite)
                .map_err(|e| refused("--baseline", given, e))?;
            Some((path, baseline))
        }
        None => None,
    };
    let target_dir = a
        .target_dir
        .clone()
        .unwrap_or_else(|| repo.join("target/bisect"));
    // Cargo names a path crate's artifacts by its path within the workspace, so in the
    // repository's own target folder a probe's build of another commit would replace the
    // repository's own build and be taken for it.
    if let (Ok(dir), Ok(own)) = (
        target_dir.canonicalize(),
        repo.join("target").canonicalize(),
    ) {
        if dir == own {
            bail!(
                "--target-dir {}: the repository's own target folder, where a probe's build of \
                 another commit would pass for the repository's own (the default is \
                 <repo>/target/bisect)",
                target_dir.display()
            );
        }
    }
    let good = commit(&repo, "--good", &a.good)?;
    let bad = commit(&repo, "--bad", &a.bad)?;
    if good == bad {
        bail!(
            "--good {} and --bad {} are the same commit {}: there is nothing to bisect",
            a.good,
            a.bad,
            &good[..12]
        );
    }
    let out = git_command(&repo, &["merge-base", "--is-ancestor", &good, &bad])
        .output()
        .context("running git")?;
    match out.status.code() {
        Some(0) => {}
        Some(1) => bail!(
            "--good {} is not an ancestor of --bad {}: the good commit must come before the bad \
             one",
            a.good,
            a.bad
        ),
        _ => bail!(
            "git merge-base --is-ancestor: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        ),
    }
    Ok(Plan {
        repo,
        good,
        bad,
        suite_path,
        suite,
        baseline,
        target_dir,
    })
}

/// The scratch folder of one bisect, removed whatever way the bisect ends.
struct Scratch(PathBuf);

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// A worktree removed (with its bisect state) when dropped.
struct Worktree {
    repo: PathBuf,
    dir: PathBuf,
}

impl Drop for Worktree {
    fn drop(&mut self) {
        let _ = git(&self.dir, &["bisect", "reset"]);
        let _ = git(
            &self.repo,
            &["worktree", "remove", "--force", &self.dir.to_string_lossy()],
        );
    }
}

/// Runs `work` with a spinner naming it and the time it has taken (on a terminal only:
/// indicatif hides it elsewhere, where the progress lines alone must say what is running).
fn timed<T>(what: &'static str, work: impl FnOnce() -> T) -> (T, Duration) {
    let spinner = ProgressBar::new_spinner()
        .with_style(ProgressStyle::with_template("  {spinner} {msg} {elapsed}").expect("valid"))
        .with_message(what);
    spinner.enable_steady_tick(Duration::from_millis(200));
    let start = Instant::now();
    let out = work();
    spinner.finish_and_clear();
    (out, start.elapsed())
}

fn secs(d: Duration) -> String {
    format!("{:.0} s", d.as_secs_f64())
}

/// Why a command failed, in one line: its first `error` line, else its last line.
fn why(stderr: &[u8]) -> String {
    let text = String::from_utf8_lossy(stderr);
    let lines: Vec<&str> = text
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty())
        .collect();
    lines
        .iter()
        .find(|l| l.starts_with("error"))
        .or(lines.last())
        .map_or_else(|| "no message".to_string(), |l| l.to_string())
}

/// The per-position rates of one row, as `verity accept`'s table prints them.
fn by_position(a: &Acceptance) -> String {
    let rates: Vec<String> = (0..a.drafted_by_pos.len())
        .map(|i| format!("{:.2}", a.rate_at(i)))
        .collect();
    rates.join(" ")
}

/// The baseline and a probe's measurement at one num_draft_tokens.
struct Row {
    k: usize,
    base: Acceptance,
    now: Acceptance,
    regressions: Vec<Regression>,
}

/// `k=3: acceptance 0.4792 -> 0.3344 (position 1: 0.29 -> 0.12)`: the overall rate, and each
/// position that fell past the tolerance.
impl fmt::Display for Row {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "k={}: acceptance {:.4} -> {:.4}",
            self.k,
            self.base.rate(),
            self.now.rate()
        )?;
        let positions: Vec<String> = self
            .regressions
            .iter()
            .filter_map(|r| match r {
                Regression::Position {
                    pos, baseline, run, ..
                } => Some(format!("position {pos}: {baseline:.2} -> {run:.2}")),
                Regression::Overall { .. } => None,
            })
            .collect();
        if !positions.is_empty() {
            write!(f, " ({})", positions.join(", "))?;
        }
        Ok(())
    }
}

/// How a regressed commit fell: its rows past the tolerance, and where its own `accept` found
/// its per-position counts differing from the oracle's.
struct Finding {
    rows: Vec<Row>,
    oracle: Vec<String>,
}

/// What one probe found.
enum Outcome {
    Good(Vec<Row>),
    Regressed(Finding),
    /// It could not build or measure the suite (why).
    Skip(String),
}

/// A measurement of the suite at the worktree's checked-out commit.
enum Measurement {
    /// The suite's acceptance per k, and what that commit's `accept` said of the oracle.
    Done {
        acceptance: Baseline,
        oracle: Vec<String>,
    },
    Skip(String),
}

/// Builds and measures the worktree's checked-out commit.
struct Probe<'a> {
    worktree: &'a Path,
    target_dir: &'a Path,
    /// --suite as given: each commit runs its own copy.
    suite_arg: &'a Path,
    suite_path: &'a Path,
    suite: &'a Suite,
    /// Where the commit's `accept` writes its measurement.
    out: PathBuf,
}

impl Probe<'_> {
    fn measure(&self) -> anyhow::Result<Measurement> {
        eprintln!("  building (cargo build --release)");
        let (out, took) = timed("building", || {
            Command::new("cargo")
                .current_dir(self.worktree)
                .args(["build", "--release", "--quiet", "--bin", "verity"])
                .arg("--target-dir")
                .arg(self.target_dir)
                // A probed commit differs little from the last one: incremental builds of the
                // repository's own crates (dependencies never are) save most of each rebuild.
                .env("CARGO_INCREMENTAL", "1")
                .stdin(Stdio::null())
                .output()
        });
        let out = out.context("running cargo")?;
        if !out.status.success() {
            return Ok(Measurement::Skip(format!(
                "does not build: {}",
                why(&out.stderr)
            )));
        }
        eprintln!("  built in {}; measuring the suite on the CPU", secs(took));
        // A stale measurement must not stand in for one this commit failed to write.
        let _ = std::fs::remove_file(&self.out);
        let (out, took) = timed("measuring", || {
            Command::new(self.target_dir.join("release/verity"))
                .current_dir(self.worktree)
                .args(["--device", "cpu", "accept", "--root"])
                .arg(self.worktree)
                .arg("--suite")
                .arg(self.suite_arg)
                .arg("--write-baseline")
                .arg("--baseline")
                .arg(&self.out)
                .stdin(Stdio::null())
                .output()
        });
        let out = out.context("running verity accept")?;
        let code = out.status.code();
        if !matches!(code, Some(0 | 1)) {
            return Ok(Measurement::Skip(format!(
                "cannot measure the suite ({}): {}",
                out.status,
                why(&out.stderr)
            )));
        }
        let acceptance = match Baseline::load_for(&self.out, self.suite_path, self.suite) {
            Ok(b) => b,
            Err(AcceptError::Invalid { message, .. }) => {
                return Ok(Measurement::Skip(format!(
                    "its measurement does not fit the suite: {message}"
                )))
            }
        };
        eprintln!("  measured in {}", secs(took));
        // In writing a measurement, `accept` exits 1 only where the suite records the oracle's
        // per-position counts and the commit's differ: the lines under its DIFFERS heading.
        let oracle = if code == Some(1) {
            let stdout = String::from_utf8_lossy(&out.stdout);
            let lines: Vec<String> = stdout
                .lines()
                .skip_while(|l| !l.starts_with("DIFFERS from the oracle"))
                .skip(1)
                .take_while(|l| l.starts_with("  "))
                .map(|l| l.trim().to_string())
                .collect();
            if lines.is_empty() {
                vec!["its verity accept exits 1 on its own measurement".to_string()]
            } else {
                lines
            }
        } else {
            Vec::new()
        };
        Ok(Measurement::Done { acceptance, oracle })
    }

    /// Measures the checked-out commit and compares it with `baseline`, printing the outcome.
    fn judge(&self, baseline: &Baseline) -> anyhow::Result<Outcome> {
        let (measured, oracle) = match self.measure()? {
            Measurement::Done { acceptance, oracle } => (acceptance, oracle),
            Measurement::Skip(why) => {
                eprintln!("  skip: {why}");
                return Ok(Outcome::Skip(why));
            }
        };
        // Both fit the suite, so they have the same k, in the same order.
        let rows: Vec<Row> = baseline
            .acceptance
            .iter()
            .zip(measured.acceptance)
            .map(|((&k, base), (_, now))| Row {
                k,
                regressions: regressions(base, &now, &Tolerance::default()),
                base: base.clone(),
                now,
            })
            .collect();
        let join = |rows: &[Row]| {
            rows.iter()
                .map(Row::to_string)
                .chain(oracle.iter().cloned())
                .collect::<Vec<_>>()
                .join("; ")
        };
        if oracle.is_empty() && rows.iter().all(|r| r.regressions.is_empty()) {
            eprintln!("  good: {}", join(&rows));
            return Ok(Outcome::Good(rows));
        }
        let rows: Vec<Row> = rows
            .into_iter()
            .filter(|r| !r.regressions.is_empty())
            .collect();
        eprintln!("  regressed: {}", join(&rows));
        Ok(Outcome::Regressed(Finding { rows, oracle }))
    }
}

/// Where git bisect stands after a start, good, bad or skip.
enum Step {
    /// It checked out the next commit to probe, with roughly this many probes after it.
    Next(Option<usize>),
    /// It named the first bad commit.
    Found(String),
    /// Only skipped commits are left, one of which is the first bad commit.
    OnlySkipped(Vec<String>),
}

fn bisect_step(worktree: &Path, args: &[&str]) -> anyhow::Result<Step> {
    // A build may have touched tracked files (a stale Cargo.lock): git bisect must be free to
    // check out the next commit.
    git(worktree, &["reset", "--quiet", "--hard"])?;
    let mut all = vec!["bisect"];
    all.extend(args);
    let out = git_command(worktree, &all)
        .output()
        .context("running git bisect")?;
    let stdout = String::from_utf8_lossy(&out.stdout);
    if let Some(sha) = stdout
        .lines()
        .find_map(|l| l.strip_suffix(" is the first bad commit"))
    {
        return Ok(Step::Found(sha.to_string()));
    }
    if stdout.contains("There are only 'skip'ped commits left to test") {
        let shas = stdout
            .lines()
            .skip_while(|l| !l.starts_with("The first bad commit could be any of"))
            .skip(1)
            .take_while(|l| l.len() == 40 && l.bytes().all(|b| b.is_ascii_hexdigit()))
            .map(str::to_string)
            .collect();
        return Ok(Step::OnlySkipped(shas));
    }
    if !out.status.success() {
        bail!(
            "git {}: {}",
            all.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    let left = stdout
        .lines()
        .find_map(|l| l.split("(roughly ").nth(1)?.split(' ').next()?.parse().ok());
    Ok(Step::Next(left))
}

pub fn bisect(a: BisectArgs) -> anyhow::Result<ExitCode> {
    let plan = plan(&a)?;
    let start = Instant::now();
    let repo = &plan.repo;
    let target_dir = plan.target_dir;
    std::fs::create_dir_all(&target_dir)
        .with_context(|| format!("--target-dir {}", target_dir.display()))?;
    let target_dir = target_dir.canonicalize()?;
    let scratch =
        Scratch(std::env::temp_dir().join(format!("verity-bisect-{}", std::process::id())));
    let _ = std::fs::remove_dir_all(&scratch.0);
    std::fs::create_dir_all(&scratch.0)?;
    let worktree = Worktree {
        repo: repo.clone(),
        dir: scratch.0.join("worktree"),
    };
    git(
        repo,
        &[
            "worktree",
            "add",
            "--detach",
            &worktree.dir.to_string_lossy(),
            &plan.good,
        ],
    )?;
    let probe = Probe {
        worktree: &worktree.dir,
        target_dir: &target_dir,
        suite_arg: &a.suite,
        suite_path: &plan.suite_path,
        suite: &plan.suite,
        out: scratch.0.join("measured.json"),
    };
    let suite_name = Suite::name(&plan.suite_path);
    let count = git(
        repo,
        &[
            "rev-list",
            "--count",
            &format!("{}..{}", plan.good, plan.bad),
        ],
    )?;
    eprintln!(
        "bisecting the {count} commits after {} up to {} on suite {suite_name}; each probe \
         builds verity (release) into {} and measures the suite on the CPU",
        &plan.good[..12],
        &plan.bad[..12],
        target_dir.display()
    );

    let baseline = match plan.baseline {
        Some((path, baseline)) => {
            eprintln!("baseline: {}", path.display());
            baseline
        }
        None => {
            eprintln!(
                "baseline: measured at --good {} ({})",
                a.good,
                describe(repo, &plan.good)?
            );
            match probe.measure()? {
                Measurement::Done { acceptance, oracle } if oracle.is_empty() => acceptance,
                Measurement::Done { oracle, .. } => bail!(
                    "--good {}: its per-position counts differ from the oracle's: {}",
                    a.good,
                    oracle.join("; ")
                ),
                Measurement::Skip(why) => bail!("--good {} gives no baseline: {why}", a.good),
            }
        }
    };
    for (k, acceptance) in &baseline.acceptance {
        eprintln!(
            "  k={k}: acceptance {:.4} (by position {})",
            acceptance.rate(),
            by_position(acceptance)
        );
    }

    let mut regressed: HashMap<String, Finding> = HashMap::new();
    let mut probes = 0;
    let mut step = bisect_step(&worktree.dir, &["start", &plan.bad, &plan.good])?;
    let first_bad = loop {
        let left = match step {
            Step::Found(sha) => break sha,
            Step::OnlySkipped(shas) => {
                eprintln!("the first bad commit is one of these, which could not be measured:");
                for sha in &shas {
                    eprintln!("  {}", describe(repo, sha)?);
                }
                bail!(
                    "git bisect cannot name the first bad commit: {} commits could not be measured",
                    shas.len()
                );
            }
            Step::Next(left) => left,
        };
        probes += 1;
        let sha = git(&worktree.dir, &["rev-parse", "HEAD"])?;
        let more = match left {
            Some(0) => " (roughly the last)".to_string(),
            Some(n) => format!(" (roughly {n} more after it)"),
            None => String::new(),
        };
        eprintln!("probe {probes}{more}: {}", describe(repo, &sha)?);
        let term = match probe.judge(&baseline)? {
            Outcome::Good(_) => "good",
            Outcome::Regressed(finding) => {
                regressed.insert(sha, finding);
                "bad"
            }
            Outcome::Skip(_) => "skip",
        };
        step = bisect_step(&worktree.dir, &[term])?;
    };
    let finding = match regressed.remove(&first_bad) {
        Some(finding) => finding,
        // git bisect names --bad without probing it when every commit before it is good: it
        // takes the caller's word, which is measured here before it is repeated.
        None => {
            probes += 1;
            eprintln!("probe {probes}: --bad {}", describe(repo, &first_bad)?);
            git(
                &worktree.dir,
                &["checkout", "--quiet", "--detach", &first_bad],
            )?;
            match probe.judge(&baseline)? {
                Outcome::Regressed(finding) => finding,
                Outcome::Good(rows) => bail!(
                    "--bad {} is within tolerance of the baseline ({}): no commit lowered \
                     acceptance",
                    a.bad,
                    rows.iter()
                        .map(Row::to_string)
                        .collect::<Vec<_>>()
                        .join("; ")
                ),
                Outcome::Skip(why) => bail!(
                    "every commit before --bad {} is within tolerance, and --bad cannot be \
                     measured: {why}",
                    a.bad
                ),
            }
        }
    };
    eprintln!("{probes} probes in {}", secs(start.elapsed()));
    let subject = git(repo, &["show", "-s", "--format=%s", &first_bad])?;
    println!("first bad commit: {first_bad} {subject}");
    for row in &finding.rows {
        println!("suite {suite_name}, {row}");
    }
    for line in &finding.oracle {
        println!("suite {suite_name}, {line}");
    }
    Ok(ExitCode::SUCCESS)
}
