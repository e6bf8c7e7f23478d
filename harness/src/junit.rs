//! The parity report for CI dashboards: JUnit XML with one test case per trace (classname the
//! suite), drawn from the JSON document `verity check --json` prints. A failing trace carries
//! its divergence report; an explained one is a skip with its reason.

use std::fmt::Write;

use serde_json::Value;

/// The JUnit document for `check`'s JSON document.
pub fn render(doc: &Value) -> String {
    let traces = doc["traces"].as_array().map(Vec::as_slice).unwrap_or(&[]);
    let count = |status: &str| traces.iter().filter(|t| t["status"] == status).count();
    let mut out = String::from("<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n");
    let _ = writeln!(
        out,
        "<testsuites name=\"verity check\" tests=\"{}\" failures=\"{}\" skipped=\"{}\">",
        traces.len(),
        count("fail"),
        count("explained")
    );
    let _ = writeln!(
        out,
        "<testsuite name=\"goldens on {}\" tests=\"{}\" failures=\"{}\" skipped=\"{}\">",
        esc(doc["backend"].as_str().unwrap_or("?")),
        traces.len(),
        count("fail"),
        count("explained")
    );
    for t in traces {
        let text = |k: &str| esc(t[k].as_str().unwrap_or(""));
        let _ = write!(
            out,
            "<testcase classname=\"{}\" name=\"{}\"",
            text("suite"),
            text("id")
        );
        let detail = match (t["error"].as_str(), t["report"].as_str()) {
            (Some(e), _) => esc(e),
            (None, Some(r)) => esc(r),
            (None, None) => String::new(),
        };
        match t["status"].as_str() {
            Some("fail") => {
                let first = detail.lines().next().unwrap_or("diverged").to_string();
                let _ = writeln!(
                    out,
                    "><failure message=\"{first}\">{detail}</failure></testcase>"
                );
            }
            Some("explained") => {
                let first = detail.lines().next().unwrap_or("explained").to_string();
                let _ = writeln!(out, "><skipped message=\"{first}\"/></testcase>");
            }
            _ => out.push_str("/>\n"),
        }
    }
    out.push_str("</testsuite>\n</testsuites>\n");
    out
}

/// XML text and attribute escaping; characters XML 1.0 cannot hold become U+FFFD.
fn esc(s: &str) -> String {
    s.chars()
        .map(|c| match c {
            '&' => "&amp;".into(),
            '<' => "&lt;".into(),
            '>' => "&gt;".into(),
            '"' => "&quot;".into(),
            '\t' | '\n' | '\r' => c.to_string(),
            c if (c as u32) < 0x20 => "\u{fffd}".into(),
            c => c.to_string(),
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn one_case_per_trace_with_failures_and_skips_counted() {
        let doc = json!({"backend": "cpu", "traces": [
            {"id": "a/1", "suite": "a", "status": "pass"},
            {"id": "a/2", "suite": "a", "status": "fail", "report": "FAIL a/2: first difference at step 3\n  token: \"<x>\""},
            {"id": "b/1", "suite": "b", "status": "explained", "report": "UNSUPPORTED b/1 on cpu: \u{1}why"},
        ]});
        let xml = render(&doc);
        assert_eq!(xml.matches("<testcase ").count(), 3);
        assert!(xml.contains("tests=\"3\" failures=\"1\" skipped=\"1\""));
        assert!(xml.contains("<failure message=\"FAIL a/2: first difference at step 3\">"));
        assert!(xml.contains("&lt;x&gt;") && !xml.contains("<x>"));
        assert!(xml.contains("<skipped message=\"UNSUPPORTED b/1 on cpu: \u{fffd}why\"/>"));
    }
}
