//! `verity bench speed`: verity against mlx-lm on one model, in one run. mlx-lm runs in a child
//! process (oracles/bench_mlx_lm.py, the oracle venv's Python) that loads the model once;
//! every measurement alternates a verity run in this process with an mlx-lm run on the same
//! prompt, after a warm-up run of each, and reports the median with min and max. Decode rows
//! also show the floor: weight bytes per token over the measured memory bandwidth.

use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, ChildStdout, Command, ExitCode, Stdio};
use std::time::Instant;

use anyhow::{bail, Context};
use clap::Args;
use indicatif::{ProgressBar, ProgressStyle};
use serde_json::{json, Value};
use verity::bench::{memory_bandwidth, time_decode, Timing};
use verity::bundle::ModelBundle;
use verity::generate::StepSplit;
use verity::grammar::Grammar;
use verity::request::GenerateParams;
use verity::speculative::drafter::DEFAULT_NUM_DRAFT_TOKENS;
use verity::speculative::{Drafter, DrafterSpec};

use super::draft_args::DraftArgs;

#[derive(Args)]
pub struct SpeedArgs {
    /// Model folder.
    #[arg(long)]
    model: PathBuf,
    /// A drafter adds a speculative row (both engines for a draft model, verity alone for the
    /// others); the n-gram row runs in any case.
    #[command(flatten)]
    draft: DraftArgs,
    /// Prompt lengths of the prefill rows.
    #[arg(long, value_delimiter = ',', default_value = "128,1024,4096")]
    prompt_lens: Vec<usize>,
    /// Tokens decoded per run.
    #[arg(long, default_value_t = 128)]
    decode_tokens: usize,
    /// Measured runs per row and engine (after one warm-up run each).
    #[arg(long, default_value_t = 5)]
    runs: usize,
    /// Python of the oracle venv.
    #[arg(long, default_value = "oracles/.venv/bin/python")]
    python: PathBuf,
    /// Measure verity alone.
    #[arg(long)]
    no_mlx_lm: bool,
    /// Print JSON instead of the table.
    #[arg(long)]
    json: bool,
}

/// A text prompt for the speculative rows: drafting needs text with structure to accept
/// anything, which random ids lack.
const TEXT_PROMPT: &str = "import os\n\n\ndef read_config(path):\n    \"\"\"Return the parsed \
    configuration of the file at path.\"\"\"\n    with open(path) as f:\n";

/// The mlx-lm child process.
struct MlxLm {
    child: Child,
    stdin: ChildStdin,
    stdout: BufReader<ChildStdout>,
}

impl MlxLm {
    fn start(a: &SpeedArgs, device: mlx::Device) -> anyhow::Result<MlxLm> {
        let script = Path::new("oracles/bench_mlx_lm.py");
        // A bare name (python3) is looked up on PATH by the spawn; a path must exist.
        let python_missing = a.python.components().count() > 1 && !a.python.is_file();
        if !script.is_file() || python_missing {
            bail!(
                "mlx-lm needs {} and the oracle venv's {} (run from the repository root after \
                 `bash oracles/venv.sh`, or pass --no-mlx-lm)",
                script.display(),
                a.python.display()
            );
        }
        let mut cmd = Command::new(&a.python);
        cmd.arg(script).arg("--model").arg(&a.model);
        if let Some(d) = &a.draft.draft_model {
            cmd.arg("--draft-model").arg(d);
        }
        cmd.args([
            "--device",
            if device == mlx::Device::Cpu {
                "cpu"
            } else {
                "gpu"
            },
        ]);
        let mut child = cmd
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .with_context(|| format!("starting {}", a.python.display()))?;
        let stdin = child.stdin.take().context("mlx-lm stdin")?;
        let stdout = BufReader::new(child.stdout.take().context("mlx-lm stdout")?);
        let mut m = MlxLm {
            child,
            stdin,
            stdout,
        };
        m.answer()?;
        Ok(m)
    }

    fn answer(&mut self) -> anyhow::Result<Value> {
        let mut line = String::new();
        self.stdout.read_line(&mut line)?;
        if line.is_empty() {
            bail!("the mlx-lm driver exited (see its error above)");
        }
        let v: Value = serde_json::from_str(&line).context("the mlx-lm driver's answer")?;
        if let Some(e) = v.get("error") {
            bail!("mlx-lm: {e}");
        }
        Ok(v)
    }

    fn run(
        &mut self,
        prompt: &[u32],
        p: &GenerateParams,
        k: Option<usize>,
    ) -> anyhow::Result<Timing> {
        let request = json!({
            "prompt": prompt,
            "max_tokens": p.max_tokens,
            "prefill_step_size": p.prefill_step_size,
            "num_draft_tokens": k,
        });
        writeln!(self.stdin, "{request}")?;
        self.stdin.flush()?;
        let v = self.answer()?;
        let num = |k: &str| {
            v[k].as_f64()
                .with_context(|| format!("mlx-lm answer lacks {k}"))
        };
        let split = match v.get("split") {
            Some(s) if !s.is_null() => {
                let part = |k: &str| {
                    s[k].as_f64()
                        .with_context(|| format!("mlx-lm answer's split lacks {k}"))
                };
                Some(StepSplit {
                    build_s: part("build_s")?,
                    enqueue_s: part("enqueue_s")?,
                    wait_s: part("wait_s")?,
                    steps: part("steps")? as usize,
                })
            }
            _ => None,
        };
        Ok(Timing {
            ttft_s: num("ttft_s")?,
            decode_s: num("decode_s")?,
            generated: num("generated")? as usize,
            prefill_peak_bytes: num("prefill_peak_bytes")? as usize,
            peak_bytes: num("peak_bytes")? as usize,
            split,
        })
    }
}

impl Drop for MlxLm {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// How a workload decodes.
#[derive(Clone, Copy, PartialEq)]
enum Kind {
    Plain,
    /// With the drafter the flags name.
    Drafter,
    Ngram,
    Grammar,
}

/// What one measurement runs, for both engines (mlx-lm has no n-gram or grammar decoding).
struct Workload {
    kind: Kind,
    prompt: Vec<u32>,
    /// A prefill row's random prompt (four rows), or the text prompt (one end-to-end row).
    prefill_row: bool,
}

impl Workload {
    /// The name of a text-prompt row, `spec` being the drafter the flags name.
    fn text_row(&self, k: usize, spec: Option<&DrafterSpec>) -> String {
        match (self.kind, spec) {
            (Kind::Plain, _) => "text prompt, plain".into(),
            (Kind::Drafter, Some(DrafterSpec::Model(_))) => {
                format!("text prompt, draft model k={k}")
            }
            (Kind::Drafter, Some(DrafterSpec::Mtp { .. })) => {
                format!("text prompt, MTP head k={k}")
            }
            (Kind::Drafter, _) => "text prompt, DFlash drafter".into(),
            (Kind::Ngram, _) => format!("text prompt, n-gram k={k}"),
            (Kind::Grammar, _) => "text prompt, regex grammar".into(),
        }
    }
}

/// Median, min and max of one engine's samples.
#[derive(Clone, Copy)]
struct Spread {
    median: f64,
    min: f64,
    max: f64,
}

impl Spread {
    fn of(mut v: Vec<f64>) -> Option<Spread> {
        if v.is_empty() {
            return None;
        }
        v.sort_by(f64::total_cmp);
        Some(Spread {
            median: v[v.len() / 2],
            min: v[0],
            max: v[v.len() - 1],
        })
    }
}

/// One printed row.
struct Row {
    name: String,
    unit: &'static str,
    /// Whether a larger value is better (tok/s) or worse (ms, bytes).
    higher_is_better: bool,
    verity: Option<Spread>,
    mlx_lm: Option<Spread>,
    /// Decode rows: the floor in tok/s.
    floor: Option<f64>,
}

impl Row {
    /// verity relative to mlx-lm, > 1 when verity is better.
    fn ratio(&self) -> Option<f64> {
        let (v, m) = (self.verity?.median, self.mlx_lm?.median);
        Some(if self.higher_is_better { v / m } else { m / v })
    }

    fn to_json(&self) -> Value {
        let spread =
            |s: Option<Spread>| s.map(|s| json!({"median": s.median, "min": s.min, "max": s.max}));
        json!({
            "row": self.name, "unit": self.unit,
            "verity": spread(self.verity), "mlx_lm": spread(self.mlx_lm),
            "ratio": self.ratio(), "floor": self.floor,
        })
    }
}

/// Deterministic prompt ids below `vocab`, avoiding the first few (special tokens).
pub(super) fn random_prompt(len: usize, vocab: usize, seed: u64) -> Vec<u32> {
    let mut state = seed
        .wrapping_mul(6364136223846793005)
        .wrapping_add(1442695040888963407);
    (0..len)
        .map(|_| {
            state = state
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            3 + ((state >> 33) % (vocab as u64 - 3)) as u32
        })
        .collect()
}

pub fn speed(a: SpeedArgs, device: mlx::Device) -> anyhow::Result<ExitCode> {
    anyhow::ensure!(a.runs >= 1, "--runs is 0, must be at least 1");
    anyhow::ensure!(
        a.decode_tokens >= 2,
        "--decode-tokens is {}, must be at least 2",
        a.decode_tokens
    );
    let bundle = ModelBundle::load(&a.model)?;
    // The n-gram row runs whatever the flags name; the drafter row is another source's.
    let spec = a.draft.spec();
    let ngram = DrafterSpec::Ngram {
        min: a.draft.ngram_min,
        max: a.draft.ngram_max,
    };
    let ngram = Drafter::load(&ngram, &bundle)?;
    let spec = spec.filter(|s| !matches!(s, DrafterSpec::Ngram { .. }));
    let mut drafter = spec
        .as_ref()
        .map(|s| Drafter::load(s, &bundle))
        .transpose()?;
    // Checked now; a drafter that mlx-lm's side does not hold is loaded again when its row
    // runs, so its weights do not count in the other rows' peak memory.
    if drafter.as_ref().is_some_and(|d| d.draft_model().is_none()) {
        drafter = None;
    }
    let mut mlx_lm = if a.no_mlx_lm {
        None
    } else {
        Some(MlxLm::start(&a, device)?)
    };
    let vocab = bundle
        .tokenizer
        .vocab_size()
        .min(bundle.model().vocab_size());
    let params = |max_tokens| GenerateParams {
        max_tokens,
        eos_token_ids: Vec::new(),
        ..GenerateParams::greedy(max_tokens, Vec::new())
    };
    let text = bundle.tokenizer.encode(TEXT_PROMPT, true)?;
    let mut workloads: Vec<Workload> = a
        .prompt_lens
        .iter()
        .map(|&l| Workload {
            kind: Kind::Plain,
            prompt: random_prompt(l, vocab, l as u64),
            prefill_row: true,
        })
        .collect();
    let text_kinds = [Kind::Plain, Kind::Drafter, Kind::Ngram, Kind::Grammar];
    workloads.extend(
        text_kinds
            .into_iter()
            .filter(|&kind| kind != Kind::Drafter || spec.is_some())
            .map(|kind| Workload {
                kind,
                prompt: text.clone(),
                prefill_row: false,
            }),
    );

    let weight_bytes = weight_bytes(&a.model, &bundle.config.json)?;
    let bandwidth = memory_bandwidth()?;
    let floor = bandwidth / weight_bytes as f64;
    if !a.json {
        println!(
            "verity bench speed: {} on {} (MLX {}), {} decode tokens, median of {} runs [min-max]",
            a.model.display(),
            device.name(),
            mlx::version(),
            a.decode_tokens,
            a.runs
        );
        println!(
            "weights {:.1} MB, memory bandwidth {:.1} GB/s: floor {floor:.1} tok/s\n",
            weight_bytes as f64 / 1e6,
            bandwidth / 1e9
        );
        print!("{}", table_header());
    }
    let bar = ProgressBar::new((workloads.len() * (a.runs + 1)) as u64);
    bar.set_style(
        ProgressStyle::with_template("{spinner} bench [{bar:30}] {pos}/{len} {wide_msg}")
            .expect("valid template")
            .progress_chars("=> "),
    );
    let p = params(a.decode_tokens);
    let k = a.draft.num_draft_tokens.unwrap_or(DEFAULT_NUM_DRAFT_TOKENS);
    let grammar = Grammar::Regex("(?s:.*)".into());
    let mut rows = Vec::new();
    let mut plain_text = None;
    for w in &workloads {
        let (mut ours, mut theirs) = (Vec::new(), Vec::new());
        for run in 0..=a.runs {
            bar.set_message(format!("{} tokens, run {run}", w.prompt.len()));
            let (model, prompt) = (bundle.model(), &w.prompt);
            let t = match w.kind {
                Kind::Plain => time_decode(model, None, prompt, &p, None, None)?,
                Kind::Grammar => {
                    let constraint = Some(bundle.constraint(&grammar)?);
                    time_decode(model, None, prompt, &p, None, constraint)?
                }
                Kind::Drafter => {
                    if drafter.is_none() {
                        let spec = spec.as_ref().context("a drafter")?;
                        drafter = Some(Drafter::load(spec, &bundle)?);
                    }
                    let k = a.draft.num_draft_tokens;
                    time_decode(model, drafter.as_ref(), prompt, &p, k, None)?
                }
                Kind::Ngram => time_decode(model, Some(&ngram), prompt, &p, Some(k), None)?,
            };
            let oracle = match (w.kind, mlx_lm.as_mut()) {
                (Kind::Plain, Some(m)) => Some(m.run(prompt, &p, None)?),
                (Kind::Drafter, Some(m)) if a.draft.draft_model.is_some() => {
                    Some(m.run(prompt, &p, Some(k))?)
                }
                _ => None,
            };
            if run > 0 {
                ours.push(t);
                theirs.extend(oracle);
            }
            bar.inc(1);
        }
        if !w.prefill_row && w.kind == Kind::Plain {
            plain_text = Spread::of(ours.iter().map(Timing::end_to_end_tps).collect());
        }
        // Rows are printed as their workload completes, so a run cut short keeps them.
        let new = workload_rows(w, &ours, &theirs, floor, w.text_row(k, spec.as_ref()));
        if !a.json {
            bar.suspend(|| new.iter().for_each(|r| print!("{}", table_row(r))));
        }
        rows.extend(new);
    }
    bar.finish_and_clear();
    let cold = cold_start(&a, device, mlx_lm.is_some())?;
    drop(mlx_lm);

    if a.json {
        rows.push(cold);
        let doc = json!({
            "model": a.model, "device": device.name(), "mlx_version": mlx::version(),
            "weight_bytes": weight_bytes, "bandwidth_bytes_per_s": bandwidth, "floor_tok_s": floor,
            "decode_tokens": a.decode_tokens, "runs": a.runs,
            "rows": rows.iter().map(Row::to_json).collect::<Vec<_>>(),
        });
        println!("{}", serde_json::to_string_pretty(&doc)?);
        return Ok(ExitCode::SUCCESS);
    }
    print!("{}", table_row(&cold));
    let ratios: Vec<String> = [
        ("text prompt, draft", "draft model"),
        ("text prompt, DFlash", "DFlash drafter"),
    ]
    .into_iter()
    .filter_map(|(row, what)| {
        let spec = rows.iter().find(|r| r.name.starts_with(row))?.verity?;
        let plain = plain_text.as_ref()?;
        Some(format!(
            "speculative ({what}) / plain on the text prompt, end to end, verity: {:.2}x",
            spec.median / plain.median
        ))
    })
    .collect();
    if !ratios.is_empty() {
        println!("\n{}", ratios.join("\n"));
    }
    Ok(ExitCode::SUCCESS)
}

/// The rows of one workload: end to end for a text-prompt run (named `text_row`); prefill,
/// time to first token, decode (with the floor `floor` and the step split) and peak memory for
/// a prefill run.
fn workload_rows(
    w: &Workload,
    ours: &[Timing],
    theirs: &[Timing],
    floor: f64,
    text_row: String,
) -> Vec<Row> {
    let spread = |ts: &[Timing], f: &dyn Fn(&Timing) -> f64| Spread::of(ts.iter().map(f).collect());
    let row = |name: String, unit, higher, f: &dyn Fn(&Timing) -> f64, floor| Row {
        name,
        unit,
        higher_is_better: higher,
        verity: spread(ours, f),
        mlx_lm: spread(theirs, f),
        floor,
    };
    if !w.prefill_row {
        return vec![row(text_row, "tok/s", true, &Timing::end_to_end_tps, None)];
    }
    let n = w.prompt.len();
    let mut rows = vec![
        row(
            format!("prefill {n}"),
            "tok/s",
            true,
            &|t| t.prefill_tps(n),
            None,
        ),
        row(format!("ttft {n}"), "ms", false, &|t| t.ttft_s * 1e3, None),
        row(
            format!("decode after {n}"),
            "tok/s",
            true,
            &Timing::decode_tps,
            Some(floor),
        ),
    ];
    for (i, part) in StepSplit::PARTS.iter().enumerate() {
        let per_token = |ts: &[Timing]| {
            Spread::of(
                ts.iter()
                    .filter_map(|t| Some(t.split?.per_step_us()?[i]))
                    .collect(),
            )
        };
        rows.push(Row {
            name: format!("  {part} per token after {n}"),
            unit: "us",
            higher_is_better: false,
            verity: per_token(ours),
            mlx_lm: per_token(theirs),
            floor: None,
        });
    }
    rows.push(row(
        format!("peak memory {n}, prefill"),
        "MB",
        false,
        &|t| t.prefill_peak_bytes as f64 / 1e6,
        None,
    ));
    rows.push(row(
        format!("peak memory {n}"),
        "MB",
        false,
        &|t| t.peak_bytes as f64 / 1e6,
        None,
    ));
    rows
}

/// The printed table's header line; [`table_row`] prints its rows in fixed-width columns.
fn table_header() -> String {
    format!(
        "{:<32} {:>6}  {:>26}  {:>26}  {:>7}  {:>15}\n",
        "row", "unit", "verity", "mlx-lm", "ratio", "floor v / m"
    )
}

fn table_row(r: &Row) -> String {
    let cell = |s: Option<Spread>| {
        s.map_or("-".into(), |s| {
            format!("{:.1} [{:.1}-{:.1}]", s.median, s.min, s.max)
        })
    };
    let floor = r.floor.map_or("-".into(), |f| {
        let pct =
            |s: Option<Spread>| s.map_or("-".into(), |s| format!("{:.0}%", 100.0 * s.median / f));
        format!("{} / {}", pct(r.verity), pct(r.mlx_lm))
    });
    format!(
        "{:<32} {:>6}  {:>26}  {:>26}  {:>7}  {:>15}\n",
        r.name,
        r.unit,
        cell(r.verity),
        cell(r.mlx_lm),
        r.ratio().map_or("-".into(), |x| format!("{x:.2}x")),
        floor
    )
}

/// The bytes a decode step reads: the weight files' tensors, but of a mixture of experts'
/// stacked expert tensors (first axis the experts) only the share of the experts a token uses.
fn weight_bytes(dir: &Path, config: &serde_json::Map<String, Value>) -> anyhow::Result<u64> {
    let text = config
        .get("text_config")
        .and_then(Value::as_object)
        .unwrap_or(config);
    let count = |keys: &[&str]| keys.iter().find_map(|k| text.get(*k)?.as_u64());
    let routed = count(&["num_experts_per_tok", "top_k_experts"])
        .zip(count(&["num_experts", "n_routed_experts"]))
        .filter(|&(k, e)| k > 0 && k < e);
    let mut total = 0.0;
    for e in std::fs::read_dir(dir)? {
        let path = e?.path();
        let name = path.file_name().and_then(|n| n.to_str()).unwrap_or("");
        if !(name.starts_with("model") && name.ends_with(".safetensors")) {
            continue;
        }
        let header = safetensors_header(&path)
            .with_context(|| format!("reading the tensor header of {}", path.display()))?;
        for (tensor, info) in header.iter().filter(|(t, _)| *t != "__metadata__") {
            let offsets = info["data_offsets"].as_array();
            let (Some(start), Some(end)) = (
                offsets.and_then(|o| o.first()?.as_u64()),
                offsets.and_then(|o| o.get(1)?.as_u64()),
            ) else {
                bail!("{}: tensor {tensor} has no data_offsets", path.display());
            };
            let experts_first = info["shape"].as_array().and_then(|s| s.first()?.as_u64());
            // One expert's tensor (`experts.3.`, as Hugging Face stores them) or all the
            // experts' stacked along the first axis.
            let one_expert = tensor.split("experts.").nth(1).is_some_and(|rest| {
                rest.split('.')
                    .next()
                    .is_some_and(|i| i.parse::<u64>().is_ok())
            });
            let share = match routed {
                Some((k, e))
                    if one_expert
                        || experts_first == Some(e)
                            && (tensor.contains("experts") || tensor.contains("switch_mlp")) =>
                {
                    k as f64 / e as f64
                }
                _ => 1.0,
            };
            total += (end - start) as f64 * share;
        }
    }
    Ok(total as u64)
}

/// A safetensors file's JSON header (its first 8 bytes give the header's length).
fn safetensors_header(path: &Path) -> anyhow::Result<serde_json::Map<String, Value>> {
    use std::io::Read;
    let mut file = std::fs::File::open(path)?;
    let mut len = [0u8; 8];
    file.read_exact(&mut len)?;
    let len = u64::from_le_bytes(len);
    if len > file.metadata()?.len() {
        bail!("header length {len} is past the end of the file");
    }
    let mut header = vec![0u8; len as usize];
    file.read_exact(&mut header)?;
    Ok(serde_json::from_slice(&header)?)
}

/// Load plus first token in a fresh process, for verity (`verity generate`) and mlx-lm
/// (`python -m mlx_lm generate`), each the median of three.
fn cold_start(a: &SpeedArgs, device: mlx::Device, with_mlx_lm: bool) -> anyhow::Result<Row> {
    let model = a.model.to_string_lossy().into_owned();
    let dev = if device == mlx::Device::Cpu {
        "cpu"
    } else {
        "gpu"
    };
    let time = |cmd: &mut Command| -> anyhow::Result<f64> {
        let start = Instant::now();
        let out = cmd.output()?;
        if !out.status.success() {
            bail!(
                "cold start: {}",
                String::from_utf8_lossy(&out.stderr).trim()
            );
        }
        Ok(start.elapsed().as_secs_f64() * 1e3)
    };
    let args = [
        "--prompt",
        "hello",
        "--ignore-chat-template",
        "--max-tokens",
        "1",
    ];
    let exe = std::env::current_exe()?;
    let mut ours = Vec::new();
    let mut theirs = Vec::new();
    for _ in 0..3 {
        ours.push(time(
            Command::new(&exe)
                .args(["--device", dev, "generate", "--model", &model])
                .args(args),
        )?);
        // mlx_lm.generate runs on MLX's default device, so it is timed only on that one.
        if with_mlx_lm && device == mlx::Device::best_available() {
            theirs.push(time(
                Command::new(&a.python)
                    .args(["-m", "mlx_lm", "generate", "--model", &model])
                    .args(args)
                    .env("HF_HUB_OFFLINE", "1"),
            )?);
        }
    }
    Ok(Row {
        name: "cold start (load + 1 token)".into(),
        unit: "ms",
        higher_is_better: false,
        verity: Spread::of(ours),
        mlx_lm: Spread::of(theirs),
        floor: None,
    })
}
