//! Runs the engine on a golden trace: the same prompt tokens and parameters, step by step, and
//! turns the result into the harness's `Generation` for comparison.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::rc::Rc;

use mlx::Array;
use verity_harness::trace::{Draft, Step, Trace};
use verity_harness::Generation as Run;

use crate::cache::{load_prompt_cache, KvQuantization, PromptFileError};
use crate::generate::{GenerateError, GenerateParams, GeneratedToken, Generation};
use crate::load::LoadError;
use crate::model::{self, LoadedModel};
use crate::spec::{generate_speculative, Control, DraftModel};
use crate::tokenizer::{Tokenizer, TokenizerError};

/// How many of the best entries a trace records per step.
pub const TOP_K: usize = 5;

#[derive(Debug, thiserror::Error)]
pub enum ReplayError {
    #[error(transparent)]
    Load(#[from] LoadError),
    #[error(transparent)]
    Tokenizer(#[from] TokenizerError),
    #[error(transparent)]
    PromptCache(#[from] PromptFileError),
    #[error("{0}: {1}")]
    Generate(String, GenerateError),
    #[error("{0}: {1}")]
    Unsupported(String, String),
}

/// A model folder loaded once and shared by every trace that names it.
pub struct Loaded {
    pub model: LoadedModel,
    pub tokenizer: Tokenizer,
    /// mlx-lm's TokenizerWrapper eos set: config eos ids plus the tokenizer's eos token.
    pub eos_token_ids: Vec<u32>,
}

impl Loaded {
    pub fn load(dir: &Path) -> Result<Loaded, ReplayError> {
        let model = model::load(dir)?;
        let tokenizer = Tokenizer::from_dir(dir)?;
        let mut eos = model.config_eos.clone();
        if let Some(id) = tokenizer.eos_token_id() {
            if !eos.contains(&id) {
                eos.push(id);
            }
        }
        Ok(Loaded {
            model,
            tokenizer,
            eos_token_ids: eos,
        })
    }

    /// Token ids to text, for reports.
    pub fn decode(&self, ids: &[u32]) -> String {
        self.tokenizer
            .decode(ids)
            .unwrap_or_else(|e| format!("<undecodable: {e}>"))
    }
}

/// Model folders by path, loaded on first use.
pub struct Models {
    root: PathBuf,
    loaded: HashMap<PathBuf, Rc<Loaded>>,
}

impl Models {
    /// `root` is the repository root that trace model paths are relative to.
    pub fn new(root: &Path) -> Models {
        Models {
            root: root.to_path_buf(),
            loaded: HashMap::new(),
        }
    }

    pub fn get(&mut self, relative: &str) -> Result<Rc<Loaded>, ReplayError> {
        let dir = self.root.join(relative);
        if let Some(m) = self.loaded.get(&dir) {
            return Ok(Rc::clone(m));
        }
        let m = Rc::new(Loaded::load(&dir)?);
        self.loaded.insert(dir, Rc::clone(&m));
        Ok(m)
    }
}

/// The golden traces for a device: `golden/traces-<device>` when a set was recorded on that
/// backend (an M-series runner records `traces-gpu`), else the committed CPU set
/// `golden/traces`, which other devices replay token-exact (tier B).
pub fn golden_traces(root: &Path, device: mlx::Device) -> PathBuf {
    let own = root.join(format!("golden/traces-{}", device.name()));
    if device != mlx::Device::Cpu && own.is_dir() {
        own
    } else {
        root.join("golden/traces")
    }
}

/// The generation parameters a trace was recorded with.
pub fn params(trace: &Trace, eos_token_ids: Vec<u32>) -> GenerateParams {
    let p = &trace.params;
    GenerateParams {
        max_tokens: p.max_tokens,
        sampler: p.sampler.clone(),
        processors: p.processors.clone(),
        seed: p.seed,
        prefill_step_size: p.prefill_step_size,
        max_kv_size: p.max_kv_size,
        kv_quantization: p.kv_bits.map(|bits| KvQuantization {
            bits: bits as i32,
            group_size: p.kv_group_size as i32,
            start: p.quantized_kv_start,
        }),
        eos_token_ids,
    }
}

/// Replays one trace with the engine.
pub fn replay(trace: &Trace, models: &mut Models) -> Result<(Run, Rc<Loaded>), ReplayError> {
    let loaded = models.get(&trace.model)?;
    let params = params(trace, loaded.eos_token_ids.clone());
    let fail = |e: GenerateError| ReplayError::Generate(trace.id.clone(), e);
    let model = loaded.model.model.as_ref();
    let mut steps = Vec::new();
    let mut finish = None;
    let mut record = |token: &GeneratedToken| -> Result<(), GenerateError> {
        steps.push(step_record(token.token, &token.logprobs, token.from_draft)?);
        finish = token.finish;
        Ok(())
    };
    match (&trace.draft, &trace.prompt_cache) {
        (
            Some(Draft::Model {
                model: draft,
                num_draft_tokens,
            }),
            None,
        ) => {
            let draft = models.get(draft)?;
            let mut source = DraftModel::new(draft.model.model.as_ref());
            let mut failed = None;
            let mut on_token = |t: &GeneratedToken| match record(t) {
                Ok(()) => Control::Continue,
                Err(e) => {
                    failed = Some(e);
                    Control::Stop
                }
            };
            generate_speculative(
                model,
                &mut source,
                &trace.prompt.tokens,
                &params,
                *num_draft_tokens,
                &mut on_token,
            )
            .map_err(fail)?;
            if let Some(e) = failed {
                return Err(fail(e));
            }
        }
        (None, cached) => {
            let generation = match cached {
                Some(cached) => {
                    let (caches, _) = load_prompt_cache(&models.root.join(&cached.file))?;
                    if caches.len() != model.num_layers() {
                        let message = format!(
                            "{} holds {} layers, the model has {}",
                            cached.file,
                            caches.len(),
                            model.num_layers()
                        );
                        return Err(ReplayError::Unsupported(trace.id.clone(), message));
                    }
                    Generation::with_caches(model, caches, &trace.prompt.tokens, &params)
                }
                None => Generation::new(model, &trace.prompt.tokens, &params),
            }
            .map_err(fail)?;
            for token in generation {
                record(&token.map_err(fail)?).map_err(fail)?;
            }
        }
        (Some(draft), _) => {
            let what = match draft {
                Draft::Model { .. } => "draft-model speculation from a prompt cache",
                Draft::Mtp { .. } => "MTP speculative decoding",
            };
            return Err(ReplayError::Unsupported(
                trace.id.clone(),
                format!("{what} is not implemented yet"),
            ));
        }
    }
    let finish_reason = finish.ok_or_else(|| {
        ReplayError::Unsupported(trace.id.clone(), "no token was generated".into())
    })?;
    Ok((
        Run {
            steps,
            finish_reason,
        },
        loaded,
    ))
}

/// The trace's view of one step: the chosen token's logprob and the TOP_K best entries by
/// logprob descending, then id ascending (the recorder's order).
pub fn step_record(token: u32, logprobs: &Array, from_draft: bool) -> mlx::Result<Step> {
    let lp = logprobs.to_vec::<f32>()?;
    let mut order: Vec<u32> = (0..lp.len() as u32).collect();
    order.sort_by(|&a, &b| lp[b as usize].total_cmp(&lp[a as usize]).then(a.cmp(&b)));
    let top = order
        .iter()
        .take(TOP_K)
        .map(|&i| (i, lp[i as usize]))
        .collect();
    Ok(Step {
        token,
        logprob: lp[token as usize],
        top,
        from_draft,
    })
}
