//! The drafter registry: the one place that knows every kind of draft source. A user, a trace
//! or a suite names a drafter ([`DrafterSpec`]); it is loaded and checked against its target
//! once ([`Drafter::load`]); each request then gets a fresh [`DraftSource`] from it
//! ([`Drafter::source`]). Callers never name a source type, so adding a kind of drafter touches
//! its own file and this one.

use std::path::PathBuf;

use super::{
    AssistantDrafter, DflashDrafter, DraftModel, DraftPrefix, DraftSource, MtpDrafter, NgramLookup,
};
use crate::bundle::ModelBundle;
use crate::load::load_config;
use crate::model::dflash::DflashModel;
use crate::model::gemma4_assistant::Gemma4Assistant;
use crate::model::mtp::{load_folder, MtpHead};
use crate::model::LanguageModel;
use crate::{validate, Result};

/// Drafts per round of a drafter that has no block size of its own (mlx-lm's
/// `--num-draft-tokens` default).
pub const DEFAULT_NUM_DRAFT_TOKENS: usize = 3;

/// A drafter as it is named, before anything is loaded.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum DrafterSpec {
    /// A draft model folder (same vocabulary and tokenizer as the target).
    Model(PathBuf),
    /// Prompt lookup with n-grams of `min..=max` tokens.
    Ngram { min: usize, max: usize },
    /// A multi-token-prediction head: the target's own (`dir: None`, its `mtp.*` tensors) or
    /// the one in a drafter folder, by its model_type as mlx-vlm's `--draft-kind mtp` takes it:
    /// a split head (`qwen3_5_mtp`) or a Gemma 4 assistant (`gemma4_assistant`).
    Mtp { dir: Option<PathBuf> },
    /// A DFlash block drafter folder; `chain` runs it one pass per draft (the block-vs-chain
    /// probe) instead of one pass per block.
    Dflash { dir: PathBuf, chain: bool },
}

/// A drafter loaded and paired with its target: every pairing check has passed. (The weights
/// are boxed: a drafter is loaded once and moved around whole.)
pub enum Drafter {
    Model(Box<ModelBundle>),
    Ngram {
        min: usize,
        max: usize,
    },
    /// The split folder's head, or `None` for the target's own.
    Mtp(Option<Box<dyn MtpHead>>),
    Dflash {
        model: Box<DflashModel>,
        chain: bool,
    },
    /// A Gemma 4 assistant drafter (read through `--draft-mtp DIR`, as mlx-vlm's MTP loop runs it).
    Assistant(Box<Gemma4Assistant>),
}

impl Drafter {
    /// Loads what `spec` names and checks it against `target` (vocabulary and tokenizer for a
    /// draft model, the n-gram lengths, the target's MTP head or a split head's width,
    /// vocabulary and tokenizer, a DFlash drafter's widths, taps and mask token).
    pub fn load(spec: &DrafterSpec, target: &ModelBundle) -> Result<Drafter> {
        Ok(match spec {
            DrafterSpec::Model(dir) => Drafter::Model(Box::new(target.load_draft(dir)?)),
            &DrafterSpec::Ngram { min, max } => {
                validate::ngram(min, max)?;
                Drafter::Ngram { min, max }
            }
            DrafterSpec::Mtp { dir: None } => {
                validate::mtp(target.model())?;
                Drafter::Mtp(None)
            }
            DrafterSpec::Mtp { dir: Some(dir) }
                if load_config(dir)?.model_type()? == "gemma4_assistant" =>
            {
                let model = Box::new(Gemma4Assistant::load(dir)?);
                validate::gemma4_assistant(target.model(), &model)?;
                target.check_drafter_tokenizer(dir)?;
                Drafter::Assistant(model)
            }
            DrafterSpec::Mtp { dir: Some(dir) } => {
                let head = load_folder(dir, |p| validate::mtp_folder(dir, target.model(), p))?;
                target.check_drafter_tokenizer(dir)?;
                Drafter::Mtp(Some(head))
            }
            DrafterSpec::Dflash { dir, chain } => {
                let model = Box::new(DflashModel::load(dir)?);
                validate::dflash(target.model(), &model)?;
                Drafter::Dflash {
                    model,
                    chain: *chain,
                }
            }
        })
    }

    /// Drafts per round when the request names none: a block drafter and a Gemma 4 assistant
    /// fill their block (its block size minus the verified token), the others draft
    /// [`DEFAULT_NUM_DRAFT_TOKENS`].
    pub fn default_num_draft_tokens(&self) -> usize {
        match self {
            Drafter::Dflash { model, .. } => model.block_size - 1,
            Drafter::Assistant(model) => model.block_size - 1,
            _ => DEFAULT_NUM_DRAFT_TOKENS,
        }
    }

    /// The draft model, for a drafter that is one.
    pub fn draft_model(&self) -> Option<&ModelBundle> {
        match self {
            Drafter::Model(bundle) => Some(bundle),
            _ => None,
        }
    }

    /// A fresh source for one request on `target` (the model this drafter was loaded for).
    /// `resume` is a prefix cache's copy of the source's state ([`DraftSource::prefix`]) and
    /// the prompt tokens it holds; the kinds that keep no state across requests ignore it.
    pub fn source<'a>(
        &'a self,
        target: &'a dyn LanguageModel,
        resume: Option<(DraftPrefix, usize)>,
    ) -> Result<Box<dyn DraftSource + 'a>> {
        Ok(match self {
            Drafter::Model(bundle) => {
                let model = bundle.model();
                Box::new(match resume {
                    Some((DraftPrefix::Caches(caches), cached)) => {
                        DraftModel::resume(model, caches, cached)
                    }
                    _ => DraftModel::new(model),
                })
            }
            &Drafter::Ngram { min, max } => Box::new(NgramLookup::new(min, max)?),
            Drafter::Mtp(None) => Box::new(MtpDrafter::new(target)?),
            Drafter::Mtp(Some(head)) => Box::new(MtpDrafter::with_head(target, head.as_ref())),
            Drafter::Assistant(model) => Box::new(AssistantDrafter::new(target, model)?),
            &Drafter::Dflash { ref model, chain } => {
                let drafter = if chain {
                    DflashDrafter::chained(target, model)?
                } else {
                    DflashDrafter::new(target, model)?
                };
                Box::new(match resume {
                    Some((DraftPrefix::Taps(taps), _)) => drafter.resumed(taps),
                    _ => drafter,
                })
            }
        })
    }
}
