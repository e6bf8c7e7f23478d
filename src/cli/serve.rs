//! `verity serve`: the OpenAI-compatible server (verity::server) on one address. Prints
//! `verity serve: listening on http://ADDR` on stdout once the model is loaded and the socket
//! bound, so a caller that asked for port 0 learns the port. Everything else it says goes
//! through `tracing` to stderr, at the levels RUST_LOG names (default: info).
//!
//! SIGTERM or SIGINT shuts it down: no new connections, running requests get
//! `--shutdown-timeout` seconds to end, then each is cut (its stream ends with a last chunk,
//! finish_reason "shutdown", and `[DONE]`) and not-yet-admitted ones are answered 503; exit 0
//! once every response is out. A second signal exits at once (status 1).

use std::io::Write;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use anyhow::Context;
use clap::Args;
use tokio::signal::unix::{signal, Signal, SignalKind};
use tracing::{error, info, warn};
use tracing_subscriber::filter::LevelFilter;
use tracing_subscriber::EnvFilter;
use verity::server::{self, engine};

use super::draft_args::DraftArgs;
use super::generate::CacheArgs;

#[derive(Args)]
pub struct ServeArgs {
    /// Model folder (config.json, model*.safetensors, tokenizer.json).
    #[arg(long)]
    model: PathBuf,
    #[command(flatten)]
    draft: DraftArgs,
    /// Greedy speculative rows draft only while drafting measures faster than plain batch
    /// steps (measured in turns as the server runs); their answers are the same either way.
    #[arg(long)]
    adaptive_drafts: bool,
    #[arg(long, default_value = "127.0.0.1")]
    host: String,
    /// Port to listen on (0: any free port, printed on stdout).
    #[arg(long, default_value_t = 8080)]
    port: u16,
    /// Requests that may wait while one runs; more are answered 503 with Retry-After.
    #[arg(long, default_value_t = 16)]
    queue_size: usize,
    /// Requests decoded together at most (continuous batching, speculative rows included;
    /// mlx_lm.server's --decode-concurrency); more wait in the queue.
    #[arg(long, default_value_t = 32)]
    max_num_seqs: usize,
    /// max_tokens of a request that names none (mlx_lm.server's default).
    #[arg(long, default_value_t = 512)]
    max_tokens: usize,
    /// Byte budget of the prefix cache shared across requests (0: none); least recently used
    /// prefixes are evicted first.
    #[arg(long, default_value_t = 512 << 20)]
    prompt_cache_bytes: usize,
    #[command(flatten)]
    cache: CacheArgs,
    /// A chat template file to use instead of the model's (mlx_lm.server's --chat-template,
    /// which takes the template's text); the tool-call format is read from it.
    #[arg(long)]
    chat_template: Option<PathBuf>,
    /// Seconds running requests get to end after SIGTERM or SIGINT before they are cut.
    #[arg(long, default_value_t = 5.0)]
    shutdown_timeout: f64,
}

/// How long the cut requests get to send their last chunk before the process exits anyway.
const AFTER_CUT: Duration = Duration::from_secs(5);

/// SIGTERM and SIGINT, caught from before the server says it listens (a signal before then
/// would otherwise kill it with no drain).
struct Signals {
    term: Signal,
    int: Signal,
}

impl Signals {
    fn catch() -> std::io::Result<Signals> {
        Ok(Signals {
            term: signal(SignalKind::terminate())?,
            int: signal(SignalKind::interrupt())?,
        })
    }

    /// The next SIGTERM or SIGINT.
    async fn next(&mut self) {
        tokio::select! {
            _ = self.term.recv() => {}
            _ = self.int.recv() => {}
        }
    }
}

/// Waits for the first signal, then drives the drain in the background: the cut after
/// `timeout`, a forced exit `AFTER_CUT` later or at a second signal.
async fn drain_on_signal(mut signals: Signals, handle: engine::EngineHandle, timeout: Duration) {
    signals.next().await;
    info!(
        drain_timeout_seconds = timeout.as_secs_f64(),
        "shutting down: no new connections; running requests get the drain timeout to end"
    );
    tokio::spawn(async move {
        tokio::select! {
            _ = tokio::time::sleep(timeout) => {}
            _ = signals.next() => exit_now(),
        }
        warn!("drain timeout: cutting the running requests");
        handle.cut_running();
        tokio::select! {
            _ = tokio::time::sleep(AFTER_CUT) => {
                error!(seconds_after_cut = AFTER_CUT.as_secs(), "responses still open: exiting");
                exit_at_once(1);
            }
            _ = signals.next() => exit_now(),
        }
    });
}

fn exit_now() {
    warn!("second signal: exiting now");
    exit_at_once(1);
}

/// Exits without running the process's static destructors: the engine thread may still be
/// computing, and MLX's allocator destroyed under it corrupts the heap (a crash instead of the
/// promised status).
fn exit_at_once(status: i32) -> ! {
    let _ = std::io::stdout().flush();
    // SAFETY: _exit ends the process at once; nothing after it runs.
    unsafe { libc::_exit(status) }
}

/// Logs to stderr through `tracing`, filtered by RUST_LOG (default: info); a RUST_LOG that
/// does not parse is an error rather than silently ignored.
fn init_logging() -> anyhow::Result<()> {
    let filter = EnvFilter::builder()
        .with_default_directive(LevelFilter::INFO.into())
        .from_env()
        .context("RUST_LOG")?;
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_target(false)
        .try_init()
        .map_err(|e| anyhow::anyhow!("the log: {e}"))
}

pub fn serve(a: ServeArgs, device: mlx::Device) -> anyhow::Result<ExitCode> {
    init_logging()?;
    anyhow::ensure!(a.queue_size >= 1, "--queue-size is 0, must be at least 1");
    anyhow::ensure!(a.max_tokens >= 1, "--max-tokens is 0, must be at least 1");
    anyhow::ensure!(
        a.max_num_seqs >= 1,
        "--max-num-seqs is 0, must be at least 1"
    );
    anyhow::ensure!(
        a.shutdown_timeout.is_finite() && (0.0..=3600.0).contains(&a.shutdown_timeout),
        "--shutdown-timeout is {}, must be from 0 to 3600 seconds",
        a.shutdown_timeout
    );
    anyhow::ensure!(
        !a.adaptive_drafts || (a.draft.spec().is_some() && a.max_num_seqs > 1),
        "--adaptive-drafts chooses between drafting and plain batch steps: it needs a drafter \
         (--draft-model, --draft-ngram, --draft-mtp or --draft-dflash) and --max-num-seqs above 1"
    );
    let timeout = Duration::from_secs_f64(a.shutdown_timeout);
    let prompt = a.cache.prompt_params();
    let chat_template = a
        .chat_template
        .as_ref()
        .map(|path| {
            std::fs::read_to_string(path)
                .with_context(|| format!("--chat-template {}", path.display()))
                .map(|source| (source, path.display().to_string()))
        })
        .transpose()?;
    let (handle, engine_thread) = engine::start(engine::EngineConfig {
        model: a.model.clone(),
        drafter: a.draft.spec(),
        num_draft_tokens: a.draft.num_draft_tokens,
        device,
        queue_size: a.queue_size,
        max_num_seqs: a.max_num_seqs,
        prefill_step_size: prompt.prefill_step_size,
        max_kv_size: prompt.max_kv_size,
        kv_quantization: prompt.kv_quantization,
        prompt_cache_bytes: a.prompt_cache_bytes,
        chat_template,
        adaptive_drafts: a.adaptive_drafts,
    })?;
    let app = server::router(handle.clone(), a.max_tokens);
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    let served = runtime.block_on(async {
        let signals = Signals::catch()?;
        let listener = tokio::net::TcpListener::bind((a.host.as_str(), a.port)).await?;
        let addr = listener.local_addr()?;
        println!("verity serve: listening on http://{addr}");
        std::io::stdout().flush()?;
        info!(%addr, "listening");
        axum::serve(listener, app)
            .with_graceful_shutdown(drain_on_signal(signals, handle, timeout))
            .await?;
        info!("every response is out: exiting");
        anyhow::Ok(())
    });
    // Dropping the runtime drops every task's EngineHandle, which ends the engine thread.
    drop(runtime);
    if !engine_thread.join_within(AFTER_CUT) {
        error!(
            seconds_after_the_last_response = AFTER_CUT.as_secs(),
            "the engine thread did not end: exiting"
        );
        exit_at_once(1);
    }
    served.map(|()| ExitCode::SUCCESS)
}
