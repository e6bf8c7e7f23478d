//! `verity cache-prompt`: mlx_lm.cache_prompt — process a prompt once and save the caches in
//! mlx-lm's prompt cache format, for `verity generate --prompt-cache-file` or mlx-lm.

use std::collections::BTreeMap;
use std::io::Read;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Instant;

use anyhow::{bail, Context};
use clap::Args;
use verity::bundle::ModelBundle;
use verity::cache::save_prompt_cache;
use verity::generate::cache_prompt;

use super::generate::CacheArgs;

#[derive(Args)]
pub struct CachePromptArgs {
    /// Model folder.
    #[arg(long)]
    model: PathBuf,
    /// Prompt text ("-" reads standard input), encoded as raw text with special tokens.
    #[arg(long, short, conflicts_with = "tokens")]
    prompt: Option<String>,
    /// Token ids instead of text, comma separated.
    #[arg(long, value_delimiter = ',')]
    tokens: Option<Vec<u32>>,
    /// The .safetensors file to write.
    #[arg(long)]
    out: PathBuf,
    #[command(flatten)]
    cache: CacheArgs,
}

pub fn cache_prompt_cmd(a: CachePromptArgs) -> anyhow::Result<ExitCode> {
    let out = || format!("--out {}", a.out.display());
    verity_harness::atomic::check_target(&a.out).with_context(out)?;
    let bundle = ModelBundle::load(&a.model)?;
    let tokens = match (&a.tokens, &a.prompt) {
        (Some(t), _) => t.clone(),
        (None, Some(p)) => {
            let mut text = p.clone();
            if text == "-" {
                text.clear();
                std::io::stdin()
                    .read_to_string(&mut text)
                    .context("reading the prompt from stdin")?;
            }
            bundle.tokenizer.encode(&text, true)?
        }
        (None, None) => bail!("give --prompt or --tokens"),
    };
    let start = Instant::now();
    let caches = cache_prompt(bundle.model(), &tokens, &a.cache.prompt_params())?;
    let metadata = BTreeMap::from([
        ("model".to_string(), a.model.display().to_string()),
        (
            "tokenizer_config".to_string(),
            r#"{"trust_remote_code": false}"#.to_string(),
        ),
    ]);
    save_prompt_cache(&a.out, &caches, &metadata).with_context(out)?;
    let secs = start.elapsed().as_secs_f64();
    eprintln!(
        "Processed {} tokens ({:.2} tok/s)",
        tokens.len(),
        tokens.len() as f64 / secs.max(1e-9)
    );
    eprintln!("Peak memory: {:.3} GB", mlx::memory::peak() as f64 / 1e9);
    eprintln!("Saved {}", a.out.display());
    Ok(ExitCode::SUCCESS)
}
