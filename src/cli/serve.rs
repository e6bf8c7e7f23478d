//! `verity serve`: the OpenAI-compatible server (verity::server) on one address. Prints
//! `verity serve: listening on http://ADDR` on stdout once the model is loaded and the socket
//! bound, so a caller that asked for port 0 learns the port.

use std::io::Write;
use std::path::PathBuf;
use std::process::ExitCode;

use clap::Args;
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
}

pub fn serve(a: ServeArgs, device: mlx::Device) -> anyhow::Result<ExitCode> {
    anyhow::ensure!(a.queue_size >= 1, "--queue-size is 0, must be at least 1");
    anyhow::ensure!(a.max_tokens >= 1, "--max-tokens is 0, must be at least 1");
    anyhow::ensure!(
        a.max_num_seqs >= 1,
        "--max-num-seqs is 0, must be at least 1"
    );
    let prompt = a.cache.prompt_params();
    let handle = engine::start(engine::EngineConfig {
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
