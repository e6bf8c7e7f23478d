//! Speculative decoding: ONE verify/accept executor ([`executor`]) fed by draft sources through
//! the [`DraftSource`] seam ([`source`]), each kind of source named, loaded and handed out by
//! the drafter registry ([`drafter`]). The executor never names a model family or a cache
//! type; it asks the rollback contract (crate::cache::Rollback) before every round.

pub mod dflash;
pub mod draft_model;
pub mod drafter;
pub mod executor;
pub mod gemma4_assistant;
pub mod mtp;
pub mod ngram;
pub mod prefix;
pub mod source;
pub mod stats;

pub use dflash::DflashDrafter;
pub use draft_model::DraftModel;
pub use drafter::{Drafter, DrafterSpec};
pub use executor::{generate_speculative, resume_speculative, Speculation, Speculator};
pub use gemma4_assistant::AssistantDrafter;
pub use mtp::MtpDrafter;
pub use ngram::NgramLookup;
pub use prefix::DraftPrefix;
pub use source::{DraftContext, DraftSource, PrefillMode, Verified};
pub use stats::SpeculationStats;
