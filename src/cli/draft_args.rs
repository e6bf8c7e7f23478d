//! The draft flags, defined once and flattened into `generate`, `serve` and `bench speed`: at
//! most one drafter, named as the drafter registry names it (verity::speculative::DrafterSpec).

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
    /// Speculate with the model's own multi-token-prediction head (Qwen3.5 `mtp.*` weights),
    /// as mlx-vlm's MTP loop does (--num-draft-tokens is its block size minus one).
    #[arg(long, conflicts_with = "draft_dflash")]
    pub draft_mtp: bool,
    /// Speculate with this DFlash block drafter folder (model_type qwen3_dflash), as mlx-vlm's
    /// DFlash loop does: one drafter pass per round drafts a whole block, whose size adapts to
    /// acceptance up to the drafter's block_size (or --num-draft-tokens + 1). A DFlash lane of
    /// the server keeps no prefix cache (its drafter reads the whole prompt's hidden states).
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
    /// The drafter the flags name, if any.
    pub fn spec(&self) -> Option<DrafterSpec> {
        match (&self.draft_model, &self.draft_dflash) {
            (Some(dir), _) => Some(DrafterSpec::Model(dir.clone())),
            (None, Some(dir)) => Some(DrafterSpec::Dflash {
                dir: dir.clone(),
                chain: false,
            }),
            (None, None) if self.draft_ngram => Some(DrafterSpec::Ngram {
                min: self.ngram_min,
                max: self.ngram_max,
            }),
            (None, None) if self.draft_mtp => Some(DrafterSpec::Mtp),
            (None, None) => None,
        }
    }
}
