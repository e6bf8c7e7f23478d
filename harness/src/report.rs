//! Human-readable results: the divergence report of a free-running replay, the report of a
//! teacher-forced one, and the per-suite table.

use std::collections::BTreeMap;
use std::fmt::Write;

use similar::{ChangeTag, TextDiff};

use crate::compare::{Generation, Verdict};
use crate::forced::ForcedCheck;
use crate::registry::Limits;
use crate::trace::{Step, Trace};

/// Explains the first difference between a trace and a run: where, what, how close the oracle's
/// own choice was there (near-tie or real divergence), and a word diff of the decoded texts.
/// `decode` turns token ids into text with the model's tokenizer.
pub fn divergence_report(
    trace: &Trace,
    run: &Generation,
    verdict: &Verdict,
    decode: &dyn Fn(&[u32]) -> String,
) -> String {
    let Some(d) = verdict.divergence() else {
        return format!("{}: pass ({} steps)\n", trace.id, trace.steps.len());
    };
    let label = match verdict {
        Verdict::NearTie(_) => "NEAR-TIE",
        _ => "FAIL",
    };
    let mut out = String::new();
    let _ = writeln!(
        out,
        "{label} {}: first difference at step {} of {} (tier {:?})",
        trace.id,
        d.step,
        trace.steps.len(),
        trace.parity.tier
    );
    let _ = writeln!(out, "  {}", d.kind);
    describe_step(&mut out, "oracle", trace.steps.get(d.step), decode);
    describe_step(&mut out, "engine", run.steps.get(d.step), decode);
    match d.oracle_margin {
        Some(m) => {
            let kind = if d.near_tie {
                "a near-tie"
            } else {
                "a real divergence"
            };
            let _ = writeln!(
                out,
                "  oracle top-1/top-2 margin at step {}: {m:e} ({kind})",
                d.step
            );
        }
        None => {
            let _ = writeln!(out, "  oracle top-1/top-2 margin: n/a");
        }
    }
    let oracle_text = decode(&trace.tokens());
    let engine_text = decode(&run.tokens());
    let _ = writeln!(out, "  text diff (- oracle, + engine):");
    let diff = TextDiff::from_words(&oracle_text, &engine_text);
    let mut line = String::from("    ");
    for change in diff.iter_all_changes() {
        let v = change.value();
        match change.tag() {
            ChangeTag::Equal => line.push_str(v),
            ChangeTag::Delete => {
                let _ = write!(line, "[-{v}-]");
            }
            ChangeTag::Insert => {
                let _ = write!(line, "{{+{v}+}}");
            }
        }
    }
    for l in line.lines() {
        let _ = writeln!(out, "    {l}");
    }
    out
}

fn describe_step(
    out: &mut String,
    side: &str,
    step: Option<&Step>,
    decode: &dyn Fn(&[u32]) -> String,
) {
    let _ = match step {
        Some(s) => writeln!(
            out,
            "  {side:<6} token {:>6} {:<16} logprob {:?}",
            s.token,
            format!("{:?}", decode(&[s.token])),
            s.logprob
        ),
        None => writeln!(out, "  {side:<6} (no step)"),
    };
}

/// Explains a teacher-forced replay on another backend: the steps compared, the largest
/// deviation, the near-ties, and the first step out of tolerance with the oracle's and the
/// engine's view of it.
pub fn forced_report(
    trace: &Trace,
    scored: &[Step],
    check: &ForcedCheck,
    limits: Limits,
    decode: &dyn Fn(&[u32]) -> String,
) -> String {
    let mut out = String::new();
    let (max, at) = check.max_deviation();
    let label = if check.failure.is_some() {
        "FAIL"
    } else {
        "pass"
    };
    let _ = writeln!(
        out,
        "{label} {}: teacher-forced, {} steps, |Δ logprob| largest {max:e} at step {at}, mean \
         {:e}, {} near-ties {:?} (tier B, tolerance {:e} per step, {:e} mean)",
        trace.id,
        check.deviations.len(),
        check.mean_deviation(),
        check.near_ties.len(),
        check.near_ties,
        limits.step,
        limits.mean
    );
    if let Some(d) = &check.failure {
        let _ = writeln!(
            out,
            "  first step out of tolerance: {} — {}",
            d.step, d.kind
        );
        describe_step(&mut out, "oracle", trace.steps.get(d.step), decode);
        describe_step(&mut out, "engine", scored.get(d.step), decode);
        if let Some(m) = d.oracle_margin {
            let _ = writeln!(out, "  oracle top-1/top-2 margin at step {}: {m:e}", d.step);
        }
    }
    out
}

/// How one trace came out.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Status {
    Pass,
    /// Passed, with the top choice flipped at an oracle near-tie somewhere.
    NearTie,
    /// A trace under a known oracle bug, judged at tier C (verity speculative ≡ verity plain)
    /// instead of against the oracle's wrong tokens, and passing there.
    TierC,
    /// Did not pass or could not run, for a registered reason (a case the backend cannot
    /// run, a known backend bug).
    Explained,
    Fail,
}

/// Pass / near-tie / explained / fail counts per suite.
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct Counts {
    pub pass: usize,
    pub near_tie: usize,
    pub tier_c: usize,
    pub explained: usize,
    pub fail: usize,
}

impl Counts {
    pub fn add(&mut self, status: Status) {
        match status {
            Status::Pass => self.pass += 1,
            Status::NearTie => self.near_tie += 1,
            Status::TierC => self.tier_c += 1,
            Status::Explained => self.explained += 1,
            Status::Fail => self.fail += 1,
        }
    }

    fn add_counts(&mut self, other: &Counts) {
        self.pass += other.pass;
        self.near_tie += other.near_tie;
        self.tier_c += other.tier_c;
        self.explained += other.explained;
        self.fail += other.fail;
    }

    pub fn total(&self) -> usize {
        self.pass + self.near_tie + self.tier_c + self.explained + self.fail
    }
}

/// Renders the per-suite table `verity check` prints, with a total row.
pub fn suite_table(suites: &BTreeMap<String, Counts>) -> String {
    let width = suites.keys().map(String::len).max().unwrap_or(5).max(5);
    let mut out = String::new();
    let row = |out: &mut String, name: &str, c: &Counts| {
        let (t, p, n, e, f) = (c.total(), c.pass, c.near_tie, c.explained, c.fail);
        let tc = c.tier_c;
        let _ = writeln!(
            out,
            "{name:<width$}  {t:>6}  {p:>6}  {n:>8}  {tc:>6}  {e:>9}  {f:>6}"
        );
    };
    let _ = writeln!(
        out,
        "{:<width$}  {:>6}  {:>6}  {:>8}  {:>6}  {:>9}  {:>6}",
        "suite", "traces", "pass", "near-tie", "tier C", "explained", "fail"
    );
    let mut total = Counts::default();
    for (name, c) in suites {
        row(&mut out, name, c);
        total.add_counts(c);
    }
    row(&mut out, "total", &total);
    out
}
