//! The draft flags, defined once and flattened into `generate`, `serve`, `bench speed` and
//! `bench serve`: at most one drafter, named as the drafter registry names it
//! (verity::speculative::DrafterSpec).

use std::ffi::OsString;
use std::path::PathBuf;

use clap::Args;
use verity::speculative::DrafterSpec;

#[derive(Args, Clone, Debug)]
pub struct DraftArgs {
    /// Speculate with this draft model folder (same vocabulary and tokenizer as the model).
    #[arg(long, conflicts_with_all = ["draft_ngram", "draft_mtp", "draft_dflash"])]
    pub draft_model: Option<PathBuf>,
    /// Speculate with prompt lookup (n-gram) drafts.
    #[arg(long, conflicts_with_all = ["draft_mtp", "draft_dflash"])]
    pub draft_ngram: bool,
    /// Speculate with a multi-token-prediction head, as mlx-vlm's MTP loop does
    /// (--num-draft-tokens is its block size minus one). Bare, the model's own head (Qwen3.5
    /// `mtp.*` weights); with DIR, the head in a split drafter folder (mlx-vlm's `qwen3_5_mtp`
    /// layout, e.g. from `python -m mlx_vlm.split_mtp`) for a model whose conversion stripped
    /// its `mtp.*` weights, or a Gemma 4 assistant drafter (model_type gemma4_assistant, which
    /// attends over the Gemma 4 model's keys and values; default drafts: its block_size - 1).
    #[arg(long, value_name = "DIR", num_args = 0..=1, conflicts_with = "draft_dflash")]
    pub draft_mtp: Option<Option<PathBuf>>,
    /// Speculate with this DFlash block drafter folder (model_type qwen3_dflash), as mlx-vlm's
    /// DFlash loop does: one drafter pass per round drafts a whole block, whose size adapts to
    /// acceptance up to the drafter's block_size (or --num-draft-tokens + 1). The server's
    /// prefix cache keeps the target's taps over a prefix with its caches: the drafter reads
    /// the whole prompt's hidden states.
    #[arg(long)]
    pub draft_dflash: Option<PathBuf>,
    /// Drafts per round (default 3; with --draft-dflash, the drafter's block_size - 1); a
    /// server request may name its own.
    #[arg(long)]
    pub num_draft_tokens: Option<usize>,
    /// Shortest and longest n-gram prompt lookup matches.
    #[arg(long, default_value_t = 1)]
    pub ngram_min: usize,
    #[arg(long, default_value_t = 3)]
    pub ngram_max: usize,
}

impl DraftArgs {
    /// These flags as another `verity` command takes them (`bench serve` passes them to the
    /// `verity serve` it starts).
    pub fn to_args(&self) -> Vec<OsString> {
        let mut args: Vec<OsString> = Vec::new();
        let mut flag = |name: &str, value: Option<OsString>| {
            args.push(name.into());
            args.extend(value);
        };
        if let Some(dir) = &self.draft_model {
            flag("--draft-model", Some(dir.into()));
        }
        if self.draft_ngram {
            flag("--draft-ngram", None);
        }
        if let Some(dir) = &self.draft_mtp {
            flag("--draft-mtp", dir.as_ref().map(Into::into));
        }
        if let Some(dir) = &self.draft_dflash {
            flag("--draft-dflash", Some(dir.into()));
        }
        if let Some(k) = self.num_draft_tokens {
            flag("--num-draft-tokens", Some(k.to_string().into()));
        }
        flag("--ngram-min", Some(self.ngram_min.to_string().into()));
        flag("--ngram-max", Some(self.ngram_max.to_string().into()));
        args
    }

    /// The drafter the flags name, if any.
    pub fn spec(&self) -> Option<DrafterSpec> {
        match (&self.draft_model, &self.draft_dflash) {
            (Some(dir), _) => Some(DrafterSpec::Model(dir.clone())),
            (None, Some(dir)) => Some(DrafterSpec::Dflash {
                dir: dir.clone(),
                chain: false,
            }),
            (None, None) => match (self.draft_ngram, &self.draft_mtp) {
                (true, _) => Some(DrafterSpec::Ngram {
                    min: self.ngram_min,
                    max: self.ngram_max,
                }),
                (false, Some(dir)) => Some(DrafterSpec::Mtp { dir: dir.clone() }),
                (false, None) => None,
            },
        }
    }
}
