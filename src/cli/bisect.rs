//! `verity bisect --good REV --bad REV`: finds the commit that lowered speculative acceptance.
//! In a scratch worktree it measures the acceptance suite at the good commit (the baseline),
//! then lets `git bisect run` build and run `verity accept` against that baseline at each
//! probed commit (exit 0 good, 1 regressed, 125 skip: a commit that cannot build or run).

use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode};

use anyhow::{bail, Context};
use clap::Args;

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

fn git(dir: &Path, args: &[&str]) -> anyhow::Result<String> {
    let out = Command::new("git")
        .arg("-C")
        .arg(dir)
        .args(args)
        .output()
        .context("running git")?;
    if !out.status.success() {
        bail!(
            "git {}: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
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

pub fn bisect(a: BisectArgs) -> anyhow::Result<ExitCode> {
    let repo = super::root_or_cwd(a.repo)?;
    let repo = repo
        .canonicalize()
        .with_context(|| format!("--repo {}", repo.display()))?;
    if !repo.join(&a.suite).is_file() {
        bail!(
            "--suite {}: no such file in {}",
            a.suite.display(),
            repo.display()
        );
    }
    let good = git(
        &repo,
        &["rev-parse", "--verify", &format!("{}^{{commit}}", a.good)],
    )?
    .trim()
    .to_string();
    let bad = git(
        &repo,
        &["rev-parse", "--verify", &format!("{}^{{commit}}", a.bad)],
    )?
    .trim()
    .to_string();
    let target_dir = a.target_dir.unwrap_or_else(|| repo.join("target/bisect"));
    std::fs::create_dir_all(&target_dir)?;
    let target_dir = target_dir.canonicalize()?;
    let baseline = a
        .baseline
        .as_ref()
        .map(|b| {
            b.canonicalize()
                .with_context(|| format!("--baseline {}", b.display()))
        })
        .transpose()?;
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
