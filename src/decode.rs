//! The one decode entry point, as mlx-lm's `stream_generate(draft_model=None)` is: plain
//! decoding ([`Generation`]) or, given a drafter, speculative decoding through the one
//! verify/accept executor. The CLI, the parity replay, the acceptance suites, the bench and the
//! server all decode through [`decode`], so none of them chooses a loop or a draft source.

use crate::cache::LayerCache;
use crate::generate::{GeneratedToken, Generation, OnPrefilled, Resume, StepSplit};
use crate::grammar::Constraint;
use crate::model::LanguageModel;
use crate::request::{Control, GenerateParams};
use crate::speculative::{resume_speculative, DraftPrefix, Drafter, Speculation, SpeculationStats};
use crate::{Error, Result};

/// What one request decodes.
pub struct Request<'a> {
    pub prompt: &'a [u32],
    pub params: &'a GenerateParams,
    /// The grammar the output must follow, from the first generated token on.
    pub constraint: Option<Constraint>,
    /// Drafts per round; None takes the drafter's default. Unused without a drafter.
    pub num_draft_tokens: Option<usize>,
}

impl<'a> Request<'a> {
    /// The request as `drafter` speculates it (its default drafts per round unless named).
    pub(crate) fn speculation(self, drafter: &Drafter) -> Speculation<'a> {
        Speculation {
            prompt: self.prompt,
            params: self.params,
            num_draft_tokens: self
                .num_draft_tokens
                .unwrap_or_else(|| drafter.default_num_draft_tokens()),
            constraint: self.constraint,
        }
    }
}

/// The caches decoding starts from.
pub enum Start {
    /// Fresh caches ([`fresh_caches`]).
    Fresh,
    /// Caches holding context before the prompt (a prompt cache file's): the prompt continues
    /// them, and the processors' history starts with the prompt, as in mlx-lm. Plain decoding
    /// only.
    Context(Vec<LayerCache>),
    /// A prefix cache's copy: `caches` hold the first `cached` prompt tokens, and `draft`
    /// (for a drafter that keeps any) the draft side's state over the same tokens.
    Prefix {
        caches: Vec<LayerCache>,
        draft: Option<DraftPrefix>,
        cached: usize,
    },
}

impl Start {
    /// The target's caches, a draft model's, and how many prompt tokens they hold.
    pub(crate) fn into_caches(
        self,
        target: &dyn LanguageModel,
        speculative: bool,
        params: &GenerateParams,
    ) -> Result<StartingCaches> {
        Ok(match self {
            Start::Fresh => (fresh_caches(target, speculative, params), None, 0),
            Start::Context(_) if speculative => {
                return Err(Error::Unsupported(
                    "speculative decoding from a prompt cache file is not supported".into(),
                ))
            }
            Start::Context(caches) => (caches, None, 0),
            Start::Prefix {
                caches,
                draft,
                cached,
            } => (caches, draft, cached),
        })
    }
}

/// The target's caches, the draft side's state, and the prompt tokens they hold.
pub(crate) type StartingCaches = (Vec<LayerCache>, Option<DraftPrefix>, usize);

/// What the caller sees while a request decodes.
pub struct Hooks<'a> {
    /// Every emitted token in order; the last one carries the finish reason.
    pub on_token: &'a mut dyn FnMut(&GeneratedToken) -> Control,
    /// After each prefill chunk, the prompt tokens the caches hold so far; `Stop` ends the
    /// prefill with [`Error::Cancelled`].
    pub on_chunk: Option<&'a mut dyn FnMut(usize) -> Control>,
    /// The target's caches (and the draft side's state) once they hold all of the prompt but
    /// its last token: what a prefix cache keeps.
    pub on_prefilled: Option<OnPrefilled<'a>>,
}

impl<'a> Hooks<'a> {
    /// Hooks that only see the tokens.
    pub fn tokens(on_token: &'a mut dyn FnMut(&GeneratedToken) -> Control) -> Hooks<'a> {
        Hooks {
            on_token,
            on_chunk: None,
            on_prefilled: None,
        }
    }
}

/// What a decode reports besides its tokens.
pub struct Decoded {
    /// The speculation counters, when a drafter was given.
    pub speculation: Option<SpeculationStats>,
    /// Where the host spent the plain loop's decode steps (None when speculating).
    pub step_split: Option<StepSplit>,
}

/// mlx-lm's `make_prompt_cache` for a request: the plain loop honours `max_kv_size`, the
/// speculative path builds the model's own caches and ignores it (as mlx-lm's does).
pub fn fresh_caches(
    target: &dyn LanguageModel,
    speculative: bool,
    params: &GenerateParams,
) -> Vec<LayerCache> {
    target.make_cache(params.max_kv_size.filter(|_| !speculative))
}

/// Decodes `request` on `target` from `start`, speculatively when `drafter` is given (loaded
/// for this target, [`Drafter::load`]).
pub fn decode(
    target: &dyn LanguageModel,
    drafter: Option<&Drafter>,
    start: Start,
    request: Request<'_>,
    hooks: Hooks<'_>,
) -> Result<Decoded> {
    let Hooks {
        on_token,
        on_chunk,
        on_prefilled,
    } = hooks;
    let (caches, draft, cached) = start.into_caches(target, drafter.is_some(), request.params)?;
    let (mut keep_nothing, mut go_on) = (
        |_: &[LayerCache], _: Option<&DraftPrefix>| {},
        |_| Control::Continue,
    );
    let resume = Resume {
        caches,
        cached,
        on_prefilled: on_prefilled.unwrap_or(&mut keep_nothing),
        on_chunk: on_chunk.unwrap_or(&mut go_on),
    };
    let Some(drafter) = drafter else {
        let mut generation = Generation::resume(
            target,
            resume,
            request.prompt,
            request.params,
            request.constraint,
        )?;
        for step in generation.by_ref() {
            if on_token(&step?) == Control::Stop {
                break;
            }
        }
        return Ok(Decoded {
            speculation: None,
            step_split: Some(generation.step_split()),
        });
    };
    let mut source = drafter.source(target, draft.map(|d| (d, cached)))?;
    let speculation = request.speculation(drafter);
    let (stats, _) = resume_speculative(target, source.as_mut(), resume, speculation, on_token)?;
    Ok(Decoded {
        speculation: Some(stats),
        step_split: None,
    })
}
