//! `verity bench serve`: `verity serve` against `mlx_lm.server` on one model, in one run. Both
//! servers run as child processes on loopback ports; at each level of concurrent clients the
//! client driver (oracles/bench_serve.py, the oracle venv's Python) sends the same requests to
//! one server, then to the other, each after two warm-up rounds, and reports throughput
//! (completion tokens per second of wall time) and p50/p99 request latency; and, from verity's
//! /metrics, where its engine spent each level: its batch steps by phase, and what a
//! speculative round gave.

use std::collections::VecDeque;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStderr, Command, ExitCode, Stdio};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use clap::Args;
use indicatif::{ProgressBar, ProgressStyle};
use serde_json::{json, Value};
use verity::bundle::ModelBundle;
use verity::speculative::Drafter;

use super::draft_args::DraftArgs;

#[derive(Args)]
pub struct ServeBenchArgs {
    /// Model folder.
    #[arg(long)]
    model: PathBuf,
    /// Concurrent clients of each level.
    #[arg(long, value_delimiter = ',', default_value = "1,4,8,32")]
    clients: Vec<usize>,
    /// Requests per level and server (after two warm-up rounds of one request per client).
    #[arg(long, default_value_t = 32)]
    requests: usize,
    /// Completion tokens per request (EOS is biased away, so every request generates them all).
    #[arg(long, default_value_t = 64)]
    max_tokens: usize,
    /// verity speculates with the drafter these name. mlx_lm.server takes a draft model alone
    /// (and then decodes one request at a time; verity keeps batching), with its own default
    /// drafts unless --num-draft-tokens is given; with another drafter it decodes plain.
    #[command(flatten)]
    draft: DraftArgs,
    /// verity's greedy speculative rows draft only while drafting measures faster than plain
    /// steps (`verity serve --adaptive-drafts`).
    #[arg(long)]
    adaptive_drafts: bool,
    /// Python of the oracle venv (mlx_lm.server and the client driver).
    #[arg(long, default_value = "oracles/.venv/bin/python")]
    python: PathBuf,
    /// Measure verity alone.
    #[arg(long)]
    no_mlx_lm: bool,
    /// Print JSON instead of the table.
    #[arg(long)]
    json: bool,
}

const DRIVER: &str = "oracles/bench_serve.py";

/// A server child process, killed when dropped.
struct Server {
    name: &'static str,
    child: Child,
    url: String,
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// mlx_lm.server's draft flags: a draft model and its drafts, the only drafter it has.
fn mlx_lm_draft_flags(draft: &DraftArgs, command: &mut Command) {
    if let Some(dir) = &draft.draft_model {
        command.arg("--draft-model").arg(dir);
        if let Some(k) = draft.num_draft_tokens {
            command.args(["--num-draft-tokens", &k.to_string()]);
        }
    }
}

/// Starts `verity serve` (this binary) on a free loopback port and waits for its
/// "listening" line.
fn start_verity(a: &ServeBenchArgs, device: mlx::Device, queue: usize) -> anyhow::Result<Server> {
    let exe = std::env::current_exe().context("the path of this verity binary")?;
    let mut command = Command::new(exe);
    command.args(["--device", device_arg(device)]);
    if !verity::model::lone_rows::enabled() {
        command.arg("--batched-kernels");
    }
    command.args(["serve", "--model"]).arg(&a.model);
    if a.draft.spec().is_some() {
        command.args(a.draft.to_args());
    }
    if a.adaptive_drafts {
        command.arg("--adaptive-drafts");
    }
    // The server's warnings (a kernel check that failed, and so a slower path) reach the
    // bench's stderr; its request log does not, unless RUST_LOG asks for it.
    if std::env::var_os("RUST_LOG").is_none() {
        command.env("RUST_LOG", "warn");
    }
    let mut child = command
        .args(["--port", "0", "--queue-size", &queue.to_string()])
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .context("starting verity serve")?;
    let stdout = child.stdout.take().context("verity serve's stdout")?;
    let mut server = Server {
        name: "verity serve",
        child,
        url: String::new(),
    };
    for line in BufReader::new(stdout).lines() {
        if let Some(url) = line?.strip_prefix("verity serve: listening on ") {
            server.url = url.to_string();
            return Ok(server);
        }
    }
    bail!("verity serve exited before listening (its error is on the lines above)")
}

/// Starts mlx_lm.server from the oracle venv on a free loopback port and waits until it
/// accepts connections.
fn start_mlx_lm(a: &ServeBenchArgs) -> anyhow::Result<Server> {
    let port = TcpListener::bind("127.0.0.1:0")?.local_addr()?.port();
    let mut command = Command::new(&a.python);
    command
        .args(["-m", "mlx_lm.server", "--model"])
        .arg(&a.model);
    mlx_lm_draft_flags(&a.draft, &mut command);
    let mut child = command
        .args(["--host", "127.0.0.1", "--port", &port.to_string()])
        .env("HF_HUB_OFFLINE", "1")
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .with_context(|| format!("starting mlx_lm.server with {}", a.python.display()))?;
    let stderr = StderrTail::drain(child.stderr.take().context("mlx_lm.server's stderr")?);
    let mut server = Server {
        name: "mlx_lm.server",
        child,
        url: format!("http://127.0.0.1:{port}"),
    };
    let since = Instant::now();
    while TcpStream::connect(("127.0.0.1", port)).is_err() {
        if let Some(status) = server.child.try_wait()? {
            bail!(
                "mlx_lm.server ({} -m mlx_lm.server) exited ({status}) before listening: {}",
                a.python.display(),
                stderr.last_lines()
            );
        }
        if since.elapsed() > Duration::from_secs(120) {
            bail!("mlx_lm.server did not listen within 120 s");
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    Ok(server)
}

/// The last lines a child wrote to stderr: read all along (a child blocks on a full pipe), kept
/// so that a server which exits before listening says why.
struct StderrTail {
    lines: Arc<Mutex<VecDeque<String>>>,
    reader: JoinHandle<()>,
}

impl StderrTail {
    const KEPT: usize = 8;

    fn drain(stderr: ChildStderr) -> StderrTail {
        let lines = Arc::new(Mutex::new(VecDeque::new()));
        let kept = Arc::clone(&lines);
        let reader = std::thread::spawn(move || {
            for line in BufReader::new(stderr).lines().map_while(Result::ok) {
                let mut kept = kept.lock().unwrap_or_else(|e| e.into_inner());
                if kept.len() == Self::KEPT {
                    kept.pop_front();
                }
                kept.push_back(line);
            }
        });
        StderrTail { lines, reader }
    }

    /// The kept lines, joined, once the child's stderr is closed (it has exited).
    fn last_lines(self) -> String {
        let _ = self.reader.join();
        let lines = self.lines.lock().unwrap_or_else(|e| e.into_inner());
        let text = lines
            .iter()
            .map(|l| l.trim())
            .collect::<Vec<_>>()
            .join(" | ");
        if text.is_empty() {
            "it wrote nothing to stderr".into()
        } else {
            text
        }
    }
}

fn device_arg(device: mlx::Device) -> &'static str {
    if device == mlx::Device::Cpu {
        "cpu"
    } else {
        "gpu"
    }
}

/// The counters of verity's /metrics that say where its engine's time went.
#[derive(Clone, Copy, Default)]
struct EngineCounters {
    steps: f64,
    rows: f64,
    /// Seconds in the steps' phases: draft, build, eval, settle.
    phases: [f64; 4],
    rounds: f64,
    drafted: f64,
    accepted: f64,
    /// Steps whose greedy speculative rows decoded plain (--adaptive-drafts).
    undrafted: f64,
    /// Steps that fed a draft group's next drafts before reading its verdicts.
    drafted_ahead: f64,
    /// Seconds of the engine thread outside the steps: joining requests, keeping answers,
    /// finishing rows. (Its idle counter also holds the wait before a level's first request,
    /// so a level's idle time is the wall time left over instead.)
    outside: [f64; 3],
    /// Seconds requests waited in the queue, summed.
    queued: f64,
}

const PHASES: [&str; 4] = ["draft", "build", "eval", "settle"];
const OUTSIDE: [&str; 3] = ["join", "keep", "finish"];

/// `a - b`, element by element.
fn minus<const N: usize>(a: [f64; N], b: [f64; N]) -> [f64; N] {
    std::array::from_fn(|i| a[i] - b[i])
}

/// The index of the phase label in `sample`'s labels among `phases`.
fn phase_of(sample: &str, phases: &[&str]) -> Option<usize> {
    phases
        .iter()
        .position(|p| sample.contains(&format!("phase=\"{p}\"")))
}

impl EngineCounters {
    /// The counters in verity serve's /metrics text (OpenMetrics, one sample per line).
    fn parse(text: &str) -> EngineCounters {
        let mut c = EngineCounters::default();
        for line in text.lines().filter(|l| !l.starts_with('#')) {
            let Some((name, value)) = line.rsplit_once(' ') else {
                continue;
            };
            let Ok(value) = value.parse::<f64>() else {
                continue;
            };
            let base = name.split('{').next().unwrap_or(name);
            match base {
                "verity_batch_steps_total" => c.steps += value,
                "verity_batch_step_rows_total" => c.rows += value,
                "verity_batch_undrafted_steps_total" => c.undrafted += value,
                "verity_batch_drafted_ahead_steps_total" => c.drafted_ahead += value,
                "verity_speculative_rounds_total" => c.rounds += value,
                "verity_speculative_drafted_total" => c.drafted += value,
                "verity_speculative_accepted_total" => c.accepted += value,
                "verity_batch_step_seconds_total" => {
                    if let Some(i) = phase_of(name, &PHASES) {
                        c.phases[i] += value;
                    }
                }
                "verity_queue_seconds_total" => c.queued += value,
                "verity_engine_seconds_total" => {
                    if let Some(i) = phase_of(name, &OUTSIDE) {
                        c.outside[i] += value;
                    }
                }
                _ => {}
            }
        }
        c
    }

    /// What moved between `earlier` and these counters.
    fn since(&self, earlier: &EngineCounters) -> EngineCounters {
        EngineCounters {
            steps: self.steps - earlier.steps,
            rows: self.rows - earlier.rows,
            phases: minus(self.phases, earlier.phases),
            rounds: self.rounds - earlier.rounds,
            drafted: self.drafted - earlier.drafted,
            accepted: self.accepted - earlier.accepted,
            undrafted: self.undrafted - earlier.undrafted,
            drafted_ahead: self.drafted_ahead - earlier.drafted_ahead,
            outside: minus(self.outside, earlier.outside),
            queued: self.queued - earlier.queued,
        }
    }

    fn json(&self, wall_s: f64) -> Value {
        let per_step = |s: f64| s * 1e3 / self.steps.max(1.0);
        let in_steps = self.phases.iter().sum::<f64>();
        json!({
            "steps": self.steps,
            "rows_per_step": self.rows / self.steps.max(1.0),
            "ms_per_step": PHASES.iter().zip(self.phases)
                .map(|(p, s)| (p.to_string(), json!(per_step(s))))
                .collect::<serde_json::Map<_, _>>(),
            "seconds_in_steps": in_steps,
            "seconds_outside_steps": OUTSIDE.iter().zip(self.outside)
                .map(|(p, s)| (p.to_string(), json!(s)))
                .collect::<serde_json::Map<_, _>>(),
            // Negative where a phase counted in the level began before it (a keep of the
            // warm-up's last answer).
            "seconds_idle": wall_s - in_steps - self.outside.iter().sum::<f64>(),
            "queue_seconds": self.queued,
            "wall_s": wall_s,
            "rounds": self.rounds,
            "accepted_per_round": (self.rounds > 0.0).then(|| self.accepted / self.rounds),
            "drafted_per_round": (self.rounds > 0.0).then(|| self.drafted / self.rounds),
            "undrafted_steps": self.undrafted,
            "drafted_ahead_steps": self.drafted_ahead,
        })
    }
}

/// verity serve's counters now, read from its /metrics over loopback.
fn scrape(server: &Server) -> anyhow::Result<EngineCounters> {
    let addr = server
        .url
        .strip_prefix("http://")
        .context("verity serve's URL")?;
    let mut stream = TcpStream::connect(addr).context("connecting to verity serve's /metrics")?;
    stream.set_read_timeout(Some(Duration::from_secs(30)))?;
    write!(
        stream,
        "GET /metrics HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n"
    )?;
    let mut response = String::new();
    stream.read_to_string(&mut response)?;
    let (head, body) = response
        .split_once("\r\n\r\n")
        .context("verity serve's /metrics response has no body")?;
    if !head.starts_with("HTTP/1.1 200") {
        bail!(
            "verity serve's /metrics answered {}",
            head.lines().next().unwrap_or("")
        );
    }
    Ok(EngineCounters::parse(body))
}

/// One level on one server: the driver's report. Failed requests (mlx_lm.server resets
/// connections past its listen backlog) are counted in it and warned about, not fatal.
fn drive(
    a: &ServeBenchArgs,
    server: &Server,
    clients: usize,
    requests: usize,
    eos: &[u32],
) -> anyhow::Result<Value> {
    let mut cmd = Command::new(&a.python);
    cmd.arg(DRIVER)
        .args(["--url", &server.url])
        .args(["--clients", &clients.to_string()])
        .args(["--requests", &requests.to_string()])
        .args(["--max-tokens", &a.max_tokens.to_string()]);
    for id in eos {
        cmd.args(["--eos", &id.to_string()]);
    }
    let out = cmd.stderr(Stdio::inherit()).output()?;
    if !out.status.success() {
        bail!(
            "the client driver failed against {} ({})",
            server.name,
            out.status
        );
    }
    let report: Value = serde_json::from_slice(&out.stdout).context("the driver's report")?;
    if let Some(e) = report["errors"].as_array().and_then(|e| e.first()) {
        eprintln!(
            "warning: {} failed {} of {requests} requests at {clients} clients (first: {e})",
            server.name,
            report["errors"].as_array().map_or(0, Vec::len)
        );
    }
    Ok(report)
}

pub fn serve(a: ServeBenchArgs, device: mlx::Device) -> anyhow::Result<ExitCode> {
    anyhow::ensure!(
        !a.clients.is_empty() && !a.clients.contains(&0),
        "--clients is {:?}, each level must be at least 1",
        a.clients
    );
    anyhow::ensure!(a.requests >= 1, "--requests is 0, must be at least 1");
    anyhow::ensure!(a.max_tokens >= 1, "--max-tokens is 0, must be at least 1");
    anyhow::ensure!(
        a.draft.num_draft_tokens != Some(0),
        "--num-draft-tokens is 0, must be at least 1"
    );
    let spec = a.draft.spec();
    anyhow::ensure!(
        !a.adaptive_drafts || spec.is_some(),
        "--adaptive-drafts chooses between drafting and plain batch steps: it needs a drafter \
         (--draft-model, --draft-ngram, --draft-mtp or --draft-dflash)"
    );
    // The model and its drafter are loaded here only to check them (before a server starts)
    // and to read the model's EOS set.
    let bundle = ModelBundle::load(&a.model)?;
    if let Some(spec) = &spec {
        Drafter::load(spec, &bundle)?;
    }
    let eos = bundle.eos_token_ids;
    // mlx_lm.server's one drafter is a draft model; with another drafter it decodes plain.
    let mlx_lm_speculates = a.draft.draft_model.is_some();
    // A bare name (python3) is looked up on PATH by the spawn; a path must exist.
    let python_missing = a.python.components().count() > 1 && !a.python.is_file();
    if !Path::new(DRIVER).is_file() || python_missing {
        bail!(
            "bench serve needs {DRIVER} and the oracle venv's {} (run from the repository root \
             after `bash oracles/venv.sh`)",
            a.python.display()
        );
    }
    let queue = a.clients.iter().copied().max().unwrap_or(1);
    let mut servers = vec![start_verity(&a, device, queue)?];
    if !a.no_mlx_lm {
        servers.push(start_mlx_lm(&a)?);
    }
    let bar = ProgressBar::new((a.clients.len() * servers.len()) as u64);
    bar.set_style(
        ProgressStyle::with_template("{spinner} bench serve [{bar:30}] {pos}/{len} {wide_msg}")
            .expect("valid template")
            .progress_chars("=> "),
    );
    let mut levels = Vec::new();
    for &clients in &a.clients {
        let mut reports = Vec::new();
        for (i, server) in servers.iter().enumerate() {
            bar.set_message(format!("{} at {clients} clients", server.name));
            // Two warm-up rounds: a finished chat's answer is kept for the prefix cache after
            // its response (on a GPU the first keep compiles kernels for a second or more), and
            // the second round waits for the first's, so the timed level does not.
            drive(&a, server, clients, 2 * clients, &eos)?;
            // servers[0] is verity: its engine's counters over the timed requests.
            let before = (i == 0).then(|| scrape(server)).transpose()?;
            let mut report = drive(&a, server, clients, a.requests, &eos)?;
            if let Some(before) = before {
                let wall = report["wall_s"].as_f64().unwrap_or(0.0);
                report["engine"] = scrape(server)?.since(&before).json(wall);
            }
            reports.push(report);
            bar.inc(1);
        }
        levels.push((clients, reports));
    }
    bar.finish_and_clear();
    let ratio = |r: &[Value]| {
        let tps = |v: &Value| v["tok_s"].as_f64();
        Some(tps(&r[0])? / tps(r.get(1)?)?)
    };
    if a.json {
        let rows: Vec<Value> = levels
            .iter()
            .map(|(clients, r)| {
                json!({"clients": clients, "verity": r[0], "mlx_lm": r.get(1), "ratio": ratio(r)})
            })
            .collect();
        let doc = json!({
            "model": a.model.display().to_string(),
            "device": device.name(),
            "requests": a.requests,
            "max_tokens": a.max_tokens,
            "mlx_lm_speculates": mlx_lm_speculates,
            "levels": rows,
        });
        println!("{}", serde_json::to_string_pretty(&doc)?);
        return Ok(ExitCode::SUCCESS);
    }
    println!(
        "verity bench serve: {} on {}, {} requests x {} tokens per level and server",
        a.model.display(),
        device.name(),
        a.requests,
        a.max_tokens
    );
    if spec.is_some() && !mlx_lm_speculates && !a.no_mlx_lm {
        println!("mlx_lm.server decodes plain: it has no drafter but a draft model");
    }
    println!(
        "\n{:>7}  {:>11}  {:>13}  {:>6}  {:>17}  {:>17}  {:>13}",
        "clients",
        "verity tok/s",
        "mlx_lm tok/s",
        "ratio",
        "verity p50/p99 s",
        "mlx_lm p50/p99 s",
        "failed v / m"
    );
    let num = |v: Option<&Value>, k: &str| v.and_then(|v| v[k].as_f64());
    let cell = |x: Option<f64>| x.map_or("-".into(), |x| format!("{x:.1}"));
    let pair = |v: Option<&Value>| match (num(v, "p50_s"), num(v, "p99_s")) {
        (Some(p50), Some(p99)) => format!("{p50:.2} / {p99:.2}"),
        _ => "-".into(),
    };
    let failed = |v: Option<&Value>| {
        v.and_then(|v| v["errors"].as_array())
            .map_or("-".into(), |e| e.len().to_string())
    };
    for (clients, r) in &levels {
        println!(
            "{clients:>7}  {:>11}  {:>13}  {:>6}  {:>17}  {:>17}  {:>13}",
            cell(num(r.first(), "tok_s")),
            cell(num(r.get(1), "tok_s")),
            ratio(r).map_or("-".into(), |x| format!("{x:.2}x")),
            pair(r.first()),
            pair(r.get(1)),
            format!("{} / {}", failed(r.first()), failed(r.get(1))),
        );
    }
    println!(
        "\nverity's engine over each level (/metrics): batch steps, their mean rows, ms per step \
         drafting / building / evaluating / settling, the steps' share of the wall time, the \
         shares outside them joining requests / keeping answers for the prefix cache / \
         finishing rows / the rest (the engine idle), a request's mean wait in the queue, and \
         drafts accepted of drafted per round (rounds that drafted nothing included; in brackets \
         the steps where --adaptive-drafts chose plain, and those that drafted ahead)"
    );
    for (clients, r) in &levels {
        let e = &r[0]["engine"];
        let ms = |p: &str| e["ms_per_step"][p].as_f64().unwrap_or(0.0);
        let wall = e["wall_s"].as_f64().unwrap_or(0.0).max(1e-9);
        let share = e["seconds_in_steps"].as_f64().unwrap_or(0.0) / wall;
        let outside =
            |p: &str| 100.0 * e["seconds_outside_steps"][p].as_f64().unwrap_or(0.0) / wall;
        let mut rounds = match (
            e["accepted_per_round"].as_f64(),
            e["drafted_per_round"].as_f64(),
        ) {
            (Some(acc), Some(drafted)) => format!("{acc:.2} of {drafted:.2}"),
            _ => "-".into(),
        };
        let undrafted = e["undrafted_steps"].as_f64().unwrap_or(0.0);
        if undrafted > 0.0 {
            rounds += &format!(" ({undrafted} steps undrafted)");
        }
        let ahead = e["drafted_ahead_steps"].as_f64().unwrap_or(0.0);
        if ahead > 0.0 {
            rounds += &format!(" ({ahead} steps drafted ahead)");
        }
        println!(
            "{clients:>7}  {:>6} steps  {:>5.2} rows  {:.2} / {:.2} / {:.2} / {:.2} ms  {:>5.1}% of \
             wall  {:.1}% / {:.1}% / {:.1}% / {:.1}%  {:.1} ms queued  {rounds}",
            e["steps"].as_f64().unwrap_or(0.0),
            e["rows_per_step"].as_f64().unwrap_or(0.0),
            ms("draft"),
            ms("build"),
            ms("eval"),
            ms("settle"),
            100.0 * share,
            outside("join"),
            outside("keep"),
            outside("finish"),
            100.0 * e["seconds_idle"].as_f64().unwrap_or(0.0) / wall,
            1e3 * e["queue_seconds"].as_f64().unwrap_or(0.0) / a.requests.max(1) as f64,
        );
    }
    Ok(ExitCode::SUCCESS)
}
