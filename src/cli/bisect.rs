//! `verity bisect --good REV --bad REV`: finds the commit that lowered speculative acceptance.
//! Everything it is given is checked first (the revisions, that --good is an ancestor of --bad,
//! the suite, a --baseline against the suite as `verity accept` checks it): a mistake found after
//! the first build would cost minutes. In a scratch worktree it then measures the acceptance
//! suite at the good commit (the baseline), then lets `git bisect run` build and run `verity
//! accept` against that baseline at each probed commit (exit 0 good, 1 regressed, 125 skip: a
//! commit that cannot build or run).

use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode, Stdio};

use anyhow::{bail, Context};
use clap::Args;
use verity_harness::acceptance::{AcceptError, Baseline, Suite};

#[derive(Args)]
pub struct BisectArgs {
    /// A commit with good acceptance.
    #[arg(long)]
    good: String,
    /// A later commit with lower acceptance.
    #[arg(long)]
    bad: String,
    /// The repository [default: current directory].
    #[arg(long)]
    repo: Option<PathBuf>,
    /// Acceptance suite, repository-relative.
    #[arg(long, default_value = "golden/accept/trained-pair.toml")]
    suite: PathBuf,
    /// Cargo target directory for the builds [default: <repo>/target/bisect]; reusing one
    /// keeps rebuilds incremental.
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
    /// --baseline, read and checked against the suite.
    baseline: Option<(PathBuf, Baseline)>,
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
        baseline,
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

pub fn bisect(a: BisectArgs) -> anyhow::Result<ExitCode> {
    let plan = plan(&a)?;
    let (repo, good, bad) = (plan.repo, plan.good, plan.bad);
    let target_dir = a.target_dir.unwrap_or_else(|| repo.join("target/bisect"));
    std::fs::create_dir_all(&target_dir)?;
    let target_dir = target_dir.canonicalize()?;
    let baseline = plan.baseline.map(|(path, _)| path);
    let scratch =
        Scratch(std::env::temp_dir().join(format!("verity-bisect-{}", std::process::id())));
    let _ = std::fs::remove_dir_all(&scratch.0);
    std::fs::create_dir_all(&scratch.0)?;
    let scratch = &scratch.0;
    let baseline = baseline.unwrap_or_else(|| scratch.join("baseline.json"));
    let worktree = Worktree {
        repo: repo.clone(),
        dir: scratch.join("worktree"),
    };
    git(
        &repo,
        &[
            "worktree",
            "add",
            "--detach",
            &worktree.dir.to_string_lossy(),
            &good,
        ],
    )?;

    let step = scratch.join("step.sh");
    let script = format!(
        "#!/usr/bin/env bash\n\
         # One bisect probe: build verity, run the acceptance suite against the good baseline.\n\
         cd {wt:?} || exit 125\n\
         cargo build -q --bin verity --target-dir {td:?} >&2 || exit 125\n\
         exec {td:?}/debug/verity --device cpu accept --root {wt:?} --suite {suite:?} --baseline {base:?} \"$@\"\n",
        wt = worktree.dir,
        td = target_dir,
        suite = a.suite,
        base = baseline,
    );
    std::fs::write(&step, script)?;
    let run_step = |extra: &[&str]| Command::new("bash").arg(&step).args(extra).status();

    if a.baseline.is_none() {
        eprintln!("measuring the baseline at {}", &good[..12]);
        let status = run_step(&["--write-baseline"]).context("running the baseline probe")?;
        if !status.success() {
            bail!("the good commit {good} cannot build or run the acceptance suite ({status})");
        }
    }
    git(&worktree.dir, &["bisect", "start", &bad, &good])?;
    eprintln!("bisecting {}..{}", &good[..12], &bad[..12]);
    let out = Command::new("git")
        .arg("-C")
        .arg(&worktree.dir)
        .args(["bisect", "run", "bash"])
        .arg(&step)
        .output()
        .context("running git bisect")?;
    let log = String::from_utf8_lossy(&out.stdout);
    let first_bad = log
        .lines()
        .find_map(|l| l.strip_suffix(" is the first bad commit"))
        .map(str::to_string);
    match first_bad {
        Some(sha) => {
            let subject = git(&repo, &["log", "-1", "--format=%s", &sha])?;
            println!("first bad commit: {sha} {}", subject.trim());
            Ok(ExitCode::SUCCESS)
        }
        None => {
            eprintln!("{log}{}", String::from_utf8_lossy(&out.stderr));
            bail!("git bisect did not name a first bad commit")
        }
    }
}
