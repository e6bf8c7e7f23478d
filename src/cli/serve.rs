//! `verity serve`: the OpenAI-compatible server (verity::server) on one address. Prints
//! `verity serve: listening on http://ADDR` on stdout once the model is loaded and the socket
//! bound, so a caller that asked for port 0 learns the port.

use std::io::Write;
use std::path::PathBuf;
use std::process::ExitCode;

use clap::Args;
use verity::server::{self, engine};

use super::generate::CacheArgs;

#[derive(Args)]
pub struct ServeArgs {
    /// Model folder (config.json, model*.safetensors, tokenizer.json).
    #[arg(long)]
    model: PathBuf,
    /// Serve speculatively with this draft model folder (same vocabulary and tokenizer).
    #[arg(long, conflicts_with_all = ["draft_ngram", "draft_mtp", "draft_dflash"])]
    draft_model: Option<PathBuf>,
    /// Serve speculatively with prompt lookup (n-gram) drafts.
    #[arg(long, conflicts_with_all = ["draft_mtp", "draft_dflash"])]
    draft_ngram: bool,
    /// Serve speculatively with the model's own multi-token-prediction head (Qwen3.5 `mtp.*`
    /// weights), as mlx-vlm's MTP loop drafts.
    #[arg(long, conflicts_with = "draft_dflash")]
    draft_mtp: bool,
    /// Serve speculatively with this DFlash block drafter folder, as mlx-vlm's DFlash loop
    /// drafts. A DFlash lane keeps no prefix cache (its drafter reads the whole prompt's
    /// hidden states, which a cached prefix does not hold).
    #[arg(long)]
    draft_dflash: Option<PathBuf>,
    #[arg(long, default_value_t = 1)]
    ngram_min: usize,
    #[arg(long, default_value_t = 3)]
    ngram_max: usize,
    /// Drafts per round, a request may set num_draft_tokens (default 3; with --draft-dflash,
    /// the drafter's block_size - 1).
    #[arg(long)]
    num_draft_tokens: Option<usize>,
    #[arg(long, default_value = "127.0.0.1")]
    host: String,
    /// Port to listen on (0: any free port, printed on stdout).
    #[arg(long, default_value_t = 8080)]
    port: u16,
    /// Requests that may wait while one runs; more are answered 503 with Retry-After.
    #[arg(long, default_value_t = 16)]
    queue_size: usize,
    /// max_tokens of a request that names none (mlx_lm.server's default).
    #[arg(long, default_value_t = 512)]
    max_tokens: usize,
    /// Byte budget of the prefix cache shared across requests (0: none); least recently used
    /// prefixes are evicted first.
    #[arg(long, default_value_t = 512 << 20)]
    prompt_cache_bytes: usize,
    #[command(flatten)]
    cache: CacheArgs,
}

pub fn serve(a: ServeArgs, device: mlx::Device) -> anyhow::Result<ExitCode> {
    anyhow::ensure!(a.queue_size >= 1, "--queue-size is 0, must be at least 1");
    anyhow::ensure!(a.max_tokens >= 1, "--max-tokens is 0, must be at least 1");
    let drafter = match (&a.draft_model, &a.draft_dflash) {
        (Some(dir), _) => Some(engine::Drafter::Model(dir.clone())),
        (None, Some(dir)) => Some(engine::Drafter::Dflash(dir.clone())),
        (None, None) if a.draft_ngram => Some(engine::Drafter::Ngram {
            min: a.ngram_min,
            max: a.ngram_max,
        }),
        (None, None) if a.draft_mtp => Some(engine::Drafter::Mtp),
        (None, None) => None,
    };
    let prompt = a.cache.prompt_params();
    let handle = engine::start(engine::EngineConfig {
        model: a.model.clone(),
        drafter,
        num_draft_tokens: a.num_draft_tokens,
        device,
        queue_size: a.queue_size,
        prefill_step_size: prompt.prefill_step_size,
        max_kv_size: prompt.max_kv_size,
        kv_quantization: prompt.kv_quantization,
        prompt_cache_bytes: a.prompt_cache_bytes,
    })?;
    let app = server::router(handle, a.max_tokens);
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    runtime.block_on(async {
        let listener = tokio::net::TcpListener::bind((a.host.as_str(), a.port)).await?;
        let addr = listener.local_addr()?;
        println!("verity serve: listening on http://{addr}");
        std::io::stdout().flush()?;
        axum::serve(listener, app)
            .with_graceful_shutdown(async {
                let _ = tokio::signal::ctrl_c().await;
            })
            .await?;
        Ok(ExitCode::SUCCESS)
    })
}
