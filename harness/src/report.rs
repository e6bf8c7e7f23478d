//! Human-readable results: the divergence report for one trace and the per-suite table.

use std::collections::BTreeMap;
use std::fmt::Write;

use similar::{ChangeTag, TextDiff};

use crate::compare::{Generation, Verdict};
use crate::trace::Trace;

/// Explains the first difference between a trace and a run: where, what, how close the oracle's
/// own choice was there (near-tie or real divergence), and a word diff of the decoded texts.
/// `decode` turns token ids into text with the model's tokenizer.
pub fn divergence_report(
    trace: &Trace,
    run: &Generation,
    verdict: &Verdict,
    device: &str,
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
        crate::compare::parity_on(trace, device).tier
    );
    let _ = writeln!(out, "  {}", d.kind);
    let describe = |side: &str, step: Option<&crate::trace::Step>| match step {
        Some(s) => format!(
            "  {side:<6} token {:>6} {:<16} logprob {:?}",
            s.token,
            format!("{:?}", decode(&[s.token])),
            s.logprob
        ),
        None => format!("  {side:<6} (no step)"),
    };
    let _ = writeln!(out, "{}", describe("oracle", trace.steps.get(d.step)));
    let _ = writeln!(out, "{}", describe("engine", run.steps.get(d.step)));
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

/// Pass / near-tie / fail counts per suite.
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct Counts {
    pub pass: usize,
    pub near_tie: usize,
    pub fail: usize,
}

impl Counts {
    pub fn add(&mut self, verdict: &Verdict) {
        match verdict {
            Verdict::Pass => self.pass += 1,
            Verdict::NearTie(_) => self.near_tie += 1,
            Verdict::Fail(_) => self.fail += 1,
        }
    }

    pub fn total(&self) -> usize {
        self.pass + self.near_tie + self.fail
    }
}

/// Renders the per-suite table `verity check` prints, with a total row.
pub fn suite_table(suites: &BTreeMap<String, Counts>) -> String {
    let width = suites.keys().map(String::len).max().unwrap_or(5).max(5);
    let mut out = String::new();
    let _ = writeln!(
        out,
        "{:<width$}  {:>6}  {:>6}  {:>8}  {:>6}",
        "suite", "traces", "pass", "near-tie", "fail"
    );
    let mut total = Counts::default();
    for (name, c) in suites {
        let _ = writeln!(
            out,
            "{name:<width$}  {:>6}  {:>6}  {:>8}  {:>6}",
            c.total(),
            c.pass,
            c.near_tie,
            c.fail
        );
        total.pass += c.pass;
        total.near_tie += c.near_tie;
        total.fail += c.fail;
    }
    let _ = writeln!(
        out,
        "{:<width$}  {:>6}  {:>6}  {:>8}  {:>6}",
        "total",
        total.total(),
        total.pass,
        total.near_tie,
        total.fail
    );
    out
}
