//! The parity report as people read it: one self-contained HTML page (inline CSS and SVG, no
//! script, nothing fetched) drawn from the JSON document `verity check --json` prints, so any
//! producer of that document (`check`, `judge score`) gets the same page.
//!
//! Per trace it shows the oracle's and the engine's text token by token with the first
//! difference marked, the oracle's top-1/top-2 margin per step as a strip (near-ties in red),
//! and for teacher-forced traces the |Δ logprob| per step against the tolerance line. A
//! `bench --json` document adds its rows as bars against mlx-lm (1.0x), and a `verity accept
//! --json` document the acceptance per draft position against its baseline.

use std::fmt::Write;

use serde_json::Value;

/// Margins at or below this are drawn as near-ties (harness::compare::NEAR_TIE_MARGIN's scale).
const NEAR_TIE: f64 = 1e-5;

const STYLE: &str = "body{font:14px system-ui,sans-serif;margin:24px;color:#222}\
h1{font-size:20px}h2{font-size:16px;margin-top:28px}\
table{border-collapse:collapse;margin:8px 0}td,th{padding:3px 10px;border-bottom:1px solid #ddd;text-align:right}\
td:first-child,th:first-child{text-align:left}tr.fail td{background:#fde2e2}tr.ok td{background:#e6f4ea}\
.b{display:inline-block;padding:1px 6px;border-radius:3px;color:#fff;font-size:12px}\
.pass{background:#2e7d32}.near-tie{background:#689f38}.tier-c{background:#00838f}.explained{background:#9e9e9e}.fail{background:#c62828}\
details{margin:4px 0;border:1px solid #eee;padding:4px 8px}summary{cursor:pointer}\
.cols{display:flex;gap:16px}.cols>div{flex:1;min-width:0}\
.t{font:12px ui-monospace,monospace;white-space:pre-wrap;word-break:break-all;background:#fafafa;padding:6px;border:1px solid #eee}\
.t span{border-right:1px solid #e3e3e3}.t .d{background:#ffcdd2;outline:1px solid #c62828}.t .a{color:#999}\
pre{font-size:12px;background:#f6f6f6;padding:6px;overflow:auto}svg{display:block;margin:4px 0}";

/// The page for `check`'s JSON document, with `bench` (a `bench --json` document) and
/// `accept` (a `verity accept --json` document) as charts.
pub fn render(doc: &Value, bench: Option<&Value>, accept: Option<&Value>) -> String {
    let traces = doc["traces"].as_array().map(Vec::as_slice).unwrap_or(&[]);
    let failed = doc["failed"].as_u64().unwrap_or(0);
    let mut out = String::new();
    let _ = write!(
        out,
        "<!DOCTYPE html><html><head><meta charset=\"utf-8\"><title>verity check: {failed} \
         failed</title><style>{STYLE}</style></head><body><h1>verity check: {} traces, \
         {failed} failed</h1><p>backend {}, MLX {}</p>",
        traces.len(),
        esc(doc["backend"].as_str().unwrap_or("?")),
        esc(doc["mlx_version"].as_str().unwrap_or("?")),
    );
    for set in doc["sets"].as_array().into_iter().flatten() {
        suite_table(&mut out, set);
    }
    if let Some(bench) = bench {
        bench_chart(&mut out, bench);
    }
    if let Some(accept) = accept {
        acceptance_charts(&mut out, accept);
    }
    out.push_str("<h2>Traces</h2>");
    // Failures first, open; the rest folded, in the document's order.
    let failing = |t: &&Value| t["status"] == "fail";
    for t in traces.iter().filter(failing) {
        trace(&mut out, t, true);
    }
    for t in traces.iter().filter(|t| !failing(t)) {
        trace(&mut out, t, false);
    }
    out.push_str("</body></html>\n");
    out
}

/// The page for `verity accept --json`'s document alone.
pub fn render_acceptance(doc: &Value) -> String {
    let verdict = if doc["regressed"] == true {
        "regressed"
    } else {
        "within tolerance"
    };
    let mut out = format!(
        "<!DOCTYPE html><html><head><meta charset=\"utf-8\"><title>verity accept: {verdict}\
         </title><style>{STYLE}</style></head><body><h1>verity accept: {verdict}</h1><p>MLX {}</p>",
        esc(doc["mlx_version"].as_str().unwrap_or("?"))
    );
    acceptance_charts(&mut out, doc);
    out.push_str("</body></html>\n");
    out
}

fn esc(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
        .replace('"', "&quot;")
}

const COUNTS: [(&str, &str); 5] = [
    ("pass", "pass"),
    ("near_tie", "near-tie"),
    ("tier_c", "tier C"),
    ("explained", "explained"),
    ("fail", "fail"),
];

fn suite_table(out: &mut String, set: &Value) {
    let _ = write!(
        out,
        "<h2>{} ({} traces)</h2><table class=\"suites\"><tr><th>suite</th><th>traces</th>",
        esc(set["dir"].as_str().unwrap_or("?")),
        set["traces"]
    );
    for (_, label) in COUNTS {
        let _ = write!(out, "<th>{label}</th>");
    }
    out.push_str("</tr>");
    for (name, c) in set["suites"].as_object().into_iter().flatten() {
        let n = |k: &str| c[k].as_u64().unwrap_or(0);
        let total: u64 = COUNTS.iter().map(|(k, _)| n(k)).sum();
        let class = if n("fail") > 0 { "fail" } else { "ok" };
        let _ = write!(
            out,
            "<tr class=\"suite {class}\"><td>{}</td><td>{total}</td>",
            esc(name)
        );
        for (k, _) in COUNTS {
            let _ = write!(out, "<td>{}</td>", n(k));
        }
        out.push_str("</tr>");
    }
    out.push_str("</table>");
}

fn trace(out: &mut String, t: &Value, open: bool) {
    let status = t["status"].as_str().unwrap_or("fail");
    let _ = write!(
        out,
        "<details class=\"trace\"{}><summary><span class=\"b {status}\">{status}</span> {}</summary>",
        if open { " open" } else { "" },
        esc(t["id"].as_str().unwrap_or("?"))
    );
    if let Some(e) = t["error"].as_str() {
        let _ = write!(out, "<pre>{}</pre>", esc(e));
    }
    let view = &t["view"];
    if view.is_object() {
        let first = view["first_difference"].as_u64().map(|s| s as usize);
        let engine = view["engine"].as_array();
        let differs = engine.is_some() && first.is_some();
        out.push_str("<div class=\"cols\">");
        text_column(out, "oracle", &view["oracle"], first);
        if differs {
            text_column(out, "engine", &view["engine"], first);
        }
        out.push_str("</div>");
        margin_strip(out, &view["margins"], first);
    }
    if let Some(forced) = t.get("forced") {
        deviation_chart(out, forced);
    }
    if let Some(r) = t["report"].as_str() {
        let _ = write!(out, "<pre>{}</pre>", esc(r));
    }
    out.push_str("</details>");
}

/// One side's text, a span per token: the first difference marked, the tokens after it grey.
fn text_column(out: &mut String, label: &str, pieces: &Value, first: Option<usize>) {
    let _ = write!(out, "<div><b>{label}</b><div class=\"t\">");
    for (i, p) in pieces.as_array().into_iter().flatten().enumerate() {
        let class = match first {
            Some(f) if i == f => " class=\"d\"",
            Some(f) if i > f => " class=\"a\"",
            _ => "",
        };
        let _ = write!(out, "<span{class}>{}</span>", esc(p.as_str().unwrap_or("")));
    }
    out.push_str("</div></div>");
}

/// The oracle's top-1/top-2 margin per step on a log scale (1e-6 at the bottom, 10 at the
/// top), near-ties in red, the first difference as a line.
fn margin_strip(out: &mut String, margins: &Value, first: Option<usize>) {
    let m: Vec<Option<f64>> = margins
        .as_array()
        .into_iter()
        .flatten()
        .map(Value::as_f64)
        .collect();
    if m.is_empty() {
        return;
    }
    // Wide bars for short traces, at least 3 px for long ones.
    let (w, h) = ((600.0 / m.len() as f64).clamp(3.0, 16.0), 30.0);
    let height = |v: f64| ((v.max(1e-6).log10() + 6.0) / 7.0).clamp(0.05, 1.0) * h;
    let (mut tall, mut ties) = (String::new(), String::new());
    for (i, v) in m.iter().enumerate() {
        let Some(v) = *v else { continue };
        let path = if v <= NEAR_TIE { &mut ties } else { &mut tall };
        let _ = write!(path, "M{:.1} {h}v-{:.1}", i as f64 * w + w / 2.0, height(v));
    }
    let width = m.len() as f64 * w;
    let _ = write!(
        out,
        "<svg class=\"chart margins\" width=\"{width}\" height=\"{h}\" viewBox=\"0 0 {width} {h}\">\
         <title>oracle top-1/top-2 margin per step (log scale)</title>\
         <path d=\"{tall}\" stroke=\"#5c6bc0\" stroke-width=\"{bar:.1}\"/>\
         <path d=\"{ties}\" stroke=\"#c62828\" stroke-width=\"{bar:.1}\"/>",
        bar = (w - 1.0).max(1.0)
    );
    if let Some(f) = first {
        let x = f as f64 * w + w / 2.0;
        let _ = write!(
            out,
            "<line x1=\"{x}\" x2=\"{x}\" y1=\"0\" y2=\"{h}\" stroke=\"#000\" stroke-dasharray=\"2\"/>"
        );
    }
    out.push_str("</svg>");
}

/// A teacher-forced trace's |Δ logprob| per step (log scale) against its step tolerance.
fn deviation_chart(out: &mut String, forced: &Value) {
    let devs: Vec<f64> = forced["deviations"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(Value::as_f64)
        .collect();
    let Some(tolerance) = forced["tolerance_step"].as_f64() else {
        return;
    };
    if devs.is_empty() {
        return;
    }
    let (w, h) = ((600.0 / devs.len() as f64).clamp(3.0, 16.0), 60.0);
    // Eight decades ending one above the tolerance.
    let top = tolerance.max(1e-30).log10().ceil() + 1.0;
    let y = |v: f64| ((top - v.max(1e-30).log10()) / 8.0).clamp(0.0, 1.0) * h;
    let points: Vec<String> = devs
        .iter()
        .enumerate()
        .map(|(i, &d)| format!("{:.1},{:.1}", i as f64 * w + w / 2.0, y(d)))
        .collect();
    let width = devs.len() as f64 * w;
    let _ = write!(
        out,
        "<svg class=\"chart deviations\" width=\"{width}\" height=\"{h}\" viewBox=\"0 0 {width} {h}\">\
         <title>teacher-forced |Δ logprob| per step against the tolerance {tolerance:e}</title>\
         <line x1=\"0\" x2=\"{width}\" y1=\"{ty:.1}\" y2=\"{ty:.1}\" stroke=\"#c62828\" stroke-dasharray=\"4\"/>\
         <polyline points=\"{}\" fill=\"none\" stroke=\"#00838f\"/></svg>",
        points.join(" "),
        ty = y(tolerance)
    );
}

/// `bench --json` rows as bars of verity's ratio to mlx-lm, with the 1.0x line.
fn bench_chart(out: &mut String, bench: &Value) {
    let rows: Vec<(&str, f64)> = bench["rows"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|r| Some((r["row"].as_str()?, r["ratio"].as_f64()?)))
        .collect();
    if rows.is_empty() {
        return;
    }
    let _ = write!(
        out,
        "<h2>bench: {} on {}</h2>",
        esc(&bench["model"].to_string()),
        esc(bench["device"].as_str().unwrap_or("?"))
    );
    let max = rows.iter().map(|r| r.1).fold(1.0, f64::max) * 1.1;
    let (label, bar, line) = (260.0, 400.0, 18.0);
    let height = rows.len() as f64 * line + 4.0;
    let one = label + bar / max;
    let _ = write!(
        out,
        "<svg class=\"chart bench\" width=\"{}\" height=\"{height}\">",
        label + bar + 60.0
    );
    for (i, (name, ratio)) in rows.iter().enumerate() {
        let y = i as f64 * line;
        let colour = if *ratio >= 1.0 { "#2e7d32" } else { "#c62828" };
        let _ = write!(
            out,
            "<text x=\"0\" y=\"{:.1}\" font-size=\"12\">{}</text>\
             <rect x=\"{label}\" y=\"{:.1}\" width=\"{:.1}\" height=\"{:.1}\" fill=\"{colour}\"/>\
             <text x=\"{:.1}\" y=\"{:.1}\" font-size=\"12\">{ratio:.2}x</text>",
            y + 13.0,
            esc(name),
            y + 2.0,
            bar * ratio / max,
            line - 4.0,
            label + bar * ratio / max + 4.0,
            y + 13.0
        );
    }
    let _ = write!(
        out,
        "<line x1=\"{one:.1}\" x2=\"{one:.1}\" y1=\"0\" y2=\"{height}\" stroke=\"#000\" stroke-dasharray=\"3\"/></svg>"
    );
}

/// Per suite and num_draft_tokens, the acceptance rate at each draft position as a bar (red
/// where it fell below the baseline by more than the per-position floor), the baseline as a
/// black tick and the tolerated band below it in grey; then what regressed, if anything.
fn acceptance_charts(out: &mut String, doc: &Value) {
    let floor = doc["tolerance"]["per_position_floor"]
        .as_f64()
        .unwrap_or(0.0);
    for suite in doc["suites"].as_array().into_iter().flatten() {
        let _ = write!(
            out,
            "<h2>acceptance: {} ({} with {}, {} prompts x {} tokens)</h2><p>baseline {}. Bars: \
             acceptance per draft position; black: the baseline's; grey: the {floor:.2} it may \
             fall; red: fell further.</p>",
            esc(suite["name"].as_str().unwrap_or("?")),
            esc(suite["target"].as_str().unwrap_or("?")),
            esc(suite["source"].as_str().unwrap_or("?")),
            suite["prompts"],
            suite["max_tokens"],
            esc(suite["baseline"]
                .as_str()
                .unwrap_or("none (written by this run)")),
        );
        for row in suite["rows"].as_array().into_iter().flatten() {
            position_chart(out, row, floor);
        }
        let problems: Vec<&str> = suite["problems"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(Value::as_str)
            .collect();
        if !problems.is_empty() {
            let _ = write!(
                out,
                "<pre class=\"regressed\">{}</pre>",
                esc(&problems.join("\n"))
            );
        }
    }
}

/// accepted_by_pos[i] / drafted_by_pos[i] of one `Acceptance` document.
fn rates(counts: &Value) -> Vec<f64> {
    let get = |key: &str| -> Vec<f64> {
        counts[key]
            .as_array()
            .into_iter()
            .flatten()
            .map(|v| v.as_f64().unwrap_or(0.0))
            .collect()
    };
    let (drafted, accepted) = (get("drafted_by_pos"), get("accepted_by_pos"));
    drafted
        .iter()
        .zip(&accepted)
        .map(|(d, a)| if *d > 0.0 { a / d } else { 0.0 })
        .collect()
}

fn position_chart(out: &mut String, row: &Value, floor: f64) {
    let measured = rates(&row["measured"]);
    let baseline = rates(&row["baseline"]);
    let (slot, h, top) = (56.0, 100.0, 16.0);
    let y = |rate: f64| top + (1.0 - rate.clamp(0.0, 1.0)) * h;
    let width = measured.len() as f64 * slot + 8.0;
    let _ = write!(
        out,
        "<svg class=\"chart acceptance\" width=\"{width}\" height=\"{}\"><title>k={}: \
         acceptance per draft position against the baseline</title><text x=\"0\" y=\"11\" \
         font-size=\"11\">k={}</text>",
        top + h + 18.0,
        row["k"],
        row["k"]
    );
    for (i, rate) in measured.iter().enumerate() {
        let x = i as f64 * slot + 8.0;
        let base = baseline.get(i).copied();
        if let Some(b) = base {
            let _ = write!(
                out,
                "<rect x=\"{x}\" y=\"{:.1}\" width=\"{:.1}\" height=\"{:.1}\" fill=\"#e0e0e0\"/>",
                y(b),
                slot - 8.0,
                y(b - floor) - y(b)
            );
        }
        let colour = match base {
            Some(b) if *rate < b - floor => "#c62828",
            Some(_) => "#2e7d32",
            None => "#5c6bc0",
        };
        let _ = write!(
            out,
            "<rect class=\"rate\" x=\"{:.1}\" y=\"{:.1}\" width=\"{:.1}\" height=\"{:.1}\" fill=\"{colour}\"/>\
             <text x=\"{:.1}\" y=\"{:.1}\" font-size=\"11\">{rate:.2}</text>\
             <text x=\"{:.1}\" y=\"{:.1}\" font-size=\"11\">pos {i}</text>",
            x + 8.0,
            y(*rate),
            slot - 24.0,
            top + h - y(*rate),
            x + 6.0,
            y(*rate) - 3.0,
            x + 6.0,
            top + h + 14.0
        );
        if let Some(b) = base {
            let _ = write!(
                out,
                "<line x1=\"{x}\" x2=\"{:.1}\" y1=\"{yb:.1}\" y2=\"{yb:.1}\" stroke=\"#000\" stroke-width=\"2\"/>",
                x + slot - 8.0,
                yb = y(b)
            );
        }
    }
    out.push_str("</svg>");
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn doc() -> Value {
        json!({
            "backend": "cpu", "mlx_version": "0.0", "failed": 1,
            "sets": [{"dir": "golden/traces", "traces": 2,
                      "suites": {"a": {"pass": 1, "near_tie": 0, "tier_c": 0, "explained": 0, "fail": 0},
                                 "b": {"pass": 0, "near_tie": 0, "tier_c": 0, "explained": 0, "fail": 1}}}],
            "traces": [
                {"id": "a/x", "status": "pass", "view": {"oracle": ["he", "llo"], "engine": ["he", "llo"],
                 "first_difference": null, "margins": [1.0, 2.0]}},
                {"id": "b/<y>", "status": "fail", "report": "FAIL b/<y>",
                 "view": {"oracle": ["a", "b", "c"], "engine": ["a", "x", "c"],
                          "first_difference": 1, "margins": [0.5, 1e-7, null]}},
            ],
        })
    }

    #[test]
    fn a_failing_trace_comes_first_open_with_its_difference_marked() {
        let page = render(&doc(), None, None);
        let fail = page.find("b/&lt;y&gt;").unwrap();
        assert!(fail < page.find("a/x").unwrap());
        assert_eq!(page.matches("<details class=\"trace\" open>").count(), 1);
        assert_eq!(page.matches("class=\"d\"").count(), 2, "one per column");
        assert_eq!(page.matches("<tr class=\"suite fail\">").count(), 1);
        assert_eq!(page.matches("<tr class=\"suite ok\">").count(), 1);
        assert_eq!(page.matches("class=\"chart margins\"").count(), 2);
        assert!(!page.contains("<y>"), "text is escaped");
        assert!(!page.contains("<script") && !page.contains("http"));
    }

    #[test]
    fn bench_rows_become_bars_and_forced_traces_a_deviation_chart() {
        let mut d = doc();
        d["traces"][0]["forced"] = json!({"deviations": [1e-7, 2e-6], "tolerance_step": 1e-5});
        let bench = json!({"model": "m", "device": "cpu", "rows": [
            {"row": "decode", "ratio": 1.2}, {"row": "prefill", "ratio": 0.8}, {"row": "x", "ratio": null}]});
        let page = render(&d, Some(&bench), None);
        assert_eq!(page.matches("<rect ").count(), 2);
        assert_eq!(page.matches("class=\"chart deviations\"").count(), 1);
    }

    #[test]
    fn a_position_below_its_baselines_band_is_drawn_red() {
        let counts = |d: [u32; 2], a: [u32; 2]| json!({"drafted_by_pos": d, "accepted_by_pos": a, "generated": 10, "from_draft": 1});
        let accept = json!({"mlx_version": "0.0", "regressed": true,
            "tolerance": {"overall_rtol": 0.05, "per_position_floor": 0.1},
            "suites": [{"name": "s", "target": "t", "source": "m", "prompts": 1, "max_tokens": 8,
                "baseline": "s.baseline.json", "problems": ["k=2: position 1 fell"],
                "rows": [{"k": 2, "measured": counts([10, 5], [9, 1]),
                          "baseline": counts([10, 8], [9, 6])}]}]});
        for page in [
            render(&doc(), None, Some(&accept)),
            render_acceptance(&accept),
        ] {
            assert_eq!(page.matches("class=\"chart acceptance\"").count(), 1);
            assert_eq!(page.matches("class=\"rate\"").count(), 2);
            assert_eq!(
                page.matches("fill=\"#c62828\"").count(),
                1,
                "position 1 only"
            );
            assert_eq!(page.matches("<pre class=\"regressed\">").count(), 1);
        }
    }
}
