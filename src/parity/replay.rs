//! Runs the engine on a golden trace: the trace's parameters become engine parameters, the
//! same prompt tokens are generated step by step, and the result becomes the harness's
//! `Generation` for comparison.

use std::path::{Path, PathBuf};
use std::rc::Rc;

use mlx::Array;
use serde::de::DeserializeOwned;
use serde_json::{Map, Value};
use verity_harness::trace::{self, Draft, Step, Trace};
use verity_harness::Generation as Run;

use super::Models;
use crate::bundle::ModelBundle;
use crate::cache::{load_prompt_cache, KvQuantization, LayerCache};
use crate::generate::{score, FinishReason, GenerateParams, GeneratedToken, Generation};
use crate::model::LanguageModel;
use crate::sample::KeySchedule;
use crate::speculative::{
    generate_speculative, Control, DflashDrafter, DraftModel, DraftSource, MtpDrafter,
};
use crate::{validate, Error, Result};

/// How many of the best entries a trace records per step.
pub const TOP_K: usize = 5;

/// Every golden set under `root`: `golden/traces` (recorded on the CPU) and each
/// `golden/traces-<backend>` (recorded on CUDA, Metal, ...), sorted.
pub fn golden_sets(root: &Path) -> std::io::Result<Vec<PathBuf>> {
    let golden = root.join("golden");
    let mut sets: Vec<PathBuf> = std::fs::read_dir(&golden)?
        .map(|e| e.map(|e| e.path()))
        .collect::<std::io::Result<_>>()?;
    sets.retain(|p| {
        p.is_dir()
            && p.file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| n == "traces" || n.starts_with("traces-"))
    });
    sets.sort();
    Ok(sets)
}

/// A trace's mlx-lm arguments (an object by name) as the engine's parameter type.
fn arguments<T: DeserializeOwned>(what: &str, args: &Map<String, Value>) -> Result<T> {
    serde_json::from_value(Value::Object(args.clone()))
        .map_err(|e| Error::Params(format!("params.{what}: {e}")))
}

/// The generation parameters a trace was recorded with, stopping on the model's EOS set
/// `eos_token_ids` (which must be the one the trace records, when it records one).
pub fn params(trace: &Trace, eos_token_ids: Vec<u32>) -> Result<GenerateParams> {
    let p = &trace.params;
    let sorted = |ids: &[u32]| {
        let mut ids = ids.to_vec();
        ids.sort_unstable();
        ids
    };
    let differs = |r: &&Vec<u32>| sorted(r) != sorted(&eos_token_ids);
    if let Some(recorded) = trace.eos_token_ids.as_ref().filter(differs) {
        return Err(Error::Params(format!(
            "eos_token_ids is {recorded:?}, but the model stops on {eos_token_ids:?} (a trace of \
             another model or tokenizer?)"
        )));
    }
    Ok(GenerateParams {
        max_tokens: p.max_tokens,
        sampler: arguments("sampler", &p.sampler)?,
        processors: arguments("processors", &p.processors)?,
        seed: p.seed,
        keys: match p.keys {
            trace::Keys::Sequence => KeySchedule::Sequence,
            trace::Keys::Positioned => KeySchedule::Positioned,
        },
        prefill_step_size: p.prefill_step_size,
        max_kv_size: p.max_kv_size,
        kv_quantization: p.kv_bits.map(|bits| KvQuantization {
            bits: bits as i32,
            group_size: p.kv_group_size as i32,
            start: p.quantized_kv_start,
        }),
        eos_token_ids,
    })
}

fn finish_reason(f: FinishReason) -> trace::FinishReason {
    match f {
        FinishReason::Stop => trace::FinishReason::Stop,
        FinishReason::Length => trace::FinishReason::Length,
    }
}

/// The caches a trace's generation starts from: the prompt cache file's, or fresh ones (the
/// speculative path builds its own, ignoring max_kv_size, as mlx-lm does).
fn starting_caches(
    trace: &Trace,
    models: &Models,
    bundle: &ModelBundle,
    params: &GenerateParams,
) -> Result<Vec<LayerCache>> {
    let model = bundle.model();
    let Some(cached) = &trace.prompt_cache else {
        let max_kv_size = match trace.draft {
            Some(_) => None,
            None => trace.params.max_kv_size,
        };
        return Ok(model.make_cache(max_kv_size));
    };
    let (caches, _) = load_prompt_cache(&models.path(&cached.file))?;
    validate::prompt_cache(&cached.file, model, &caches, params)
        .map_err(|e| e.context(&trace.id))?;
    Ok(caches)
}

/// A teacher-forced replay: the engine's view of every step with the oracle's tokens fed
/// back, and for a greedy speculative trace without processors, how many emitted tokens the
/// draft model would have supplied over the same tokens.
pub struct ForcedRun {
    /// Per step: the oracle's token, the engine's logprob of it, the engine's best entries.
    pub scored: Vec<Step>,
    /// The replayed `from_draft` count (see `verity_harness::forced::replayed_from_draft`).
    pub from_draft: Option<usize>,
}

/// Replays a trace teacher-forced (tier B across backends).
pub fn replay_forced(trace: &Trace, models: &mut Models) -> Result<(ForcedRun, Rc<ModelBundle>)> {
    let bundle = models.get(&trace.model)?;
    let params = params(trace, bundle.eos_token_ids.clone()).map_err(|e| e.context(&trace.id))?;
    let emitted = trace.tokens();
    let mut scored = Vec::with_capacity(emitted.len());
    let caches = starting_caches(trace, models, &bundle, &params)?;
    score(
        bundle.model(),
        caches,
        &trace.prompt.tokens,
        &emitted,
        &params,
        |i, lp| {
            scored.push(step_record(emitted[i], lp, false)?);
            Ok(())
        },
    )
    .map_err(|e| e.context(&trace.id))?;
    let greedy = params.sampler.temp == 0.0 && params.processors.logit_bias.is_empty();
    let plain = params.processors.repetition_penalty.is_none()
        && params.processors.presence_penalty.is_none()
        && params.processors.frequency_penalty.is_none();
    let from_draft = match &trace.draft {
        Some(Draft::Model {
            model,
            num_draft_tokens,
        }) if greedy && plain => {
            let draft = models.get(model)?;
            let draft_params = GenerateParams {
                eos_token_ids: draft.eos_token_ids.clone(),
                ..params.clone()
            };
            let mut choice = Vec::with_capacity(emitted.len());
            let caches = draft.model().make_cache(None);
            score(
                draft.model(),
                caches,
                &trace.prompt.tokens,
                &emitted,
                &draft_params,
                |_, lp| {
                    choice.push(mlx::ops::argmax(lp, -1, false)?.item::<u32>()?);
                    Ok(())
                },
            )
            .map_err(|e| e.context(format!("{} (draft)", trace.id)))?;
            Some(verity_harness::forced::replayed_from_draft(
                trace,
                &choice,
                *num_draft_tokens,
            ))
        }
        _ => None,
    };
    Ok((ForcedRun { scored, from_draft }, bundle))
}

/// Replays one trace with the engine; returns the run and the target's bundle (for reports).
pub fn replay(trace: &Trace, models: &mut Models) -> Result<(Run, Rc<ModelBundle>)> {
    let bundle = models.get(&trace.model)?;
    let params = params(trace, bundle.eos_token_ids.clone()).map_err(|e| e.context(&trace.id))?;
    let model = bundle.model();
    let mut steps = Vec::new();
    let mut finish = None;
    let mut record = |token: &GeneratedToken| -> Result<()> {
        steps.push(step_record(token.token, &token.logprobs, token.from_draft)?);
        finish = token.finish;
        Ok(())
    };
    let unsupported = |what: &str| Err(Error::Unsupported(format!("{}: {what}", trace.id)));
    match (&trace.draft, &trace.prompt_cache) {
        (
            Some(Draft::Model {
                model: draft,
                num_draft_tokens,
            }),
            None,
        ) => {
            let draft = models.get(draft)?;
            let source = &mut DraftModel::new(draft.model());
            speculate(
                model,
                source,
                trace,
                &params,
                *num_draft_tokens,
                &mut record,
            )?;
        }
        (None, _) => {
            let caches = starting_caches(trace, models, &bundle, &params)?;
            let generation = Generation::start(model, caches, &trace.prompt.tokens, &params, None)
                .map_err(|e| e.context(&trace.id))?;
            for token in generation {
                record(&token.map_err(|e| e.context(&trace.id))?)?;
            }
        }
        (Some(Draft::Model { .. }), Some(_)) => {
            return unsupported(
                "draft-model speculation from a prompt cache is not implemented yet",
            )
        }
        (Some(Draft::Mtp { block_size }), None) => {
            // mlx-vlm's block is the round's verify input: the last token and its drafts.
            validate::draft_block_size(*block_size).map_err(|e| e.context(&trace.id))?;
            let source = &mut MtpDrafter::new(model).map_err(|e| e.context(&trace.id))?;
            speculate(model, source, trace, &params, block_size - 1, &mut record)?;
        }
        (Some(Draft::Mtp { .. }), Some(_)) => {
            return unsupported("MTP speculation from a prompt cache is not implemented yet")
        }
        (
            Some(Draft::Dflash {
                model: drafter,
                block_size,
            }),
            None,
        ) => {
            validate::draft_block_size(*block_size).map_err(|e| e.context(&trace.id))?;
            let drafter = models.dflash(drafter)?;
            let source =
                &mut DflashDrafter::new(model, &drafter).map_err(|e| e.context(&trace.id))?;
            speculate(model, source, trace, &params, block_size - 1, &mut record)?;
        }
        (Some(Draft::Dflash { .. }), Some(_)) => {
            return unsupported("DFlash speculation from a prompt cache is not supported")
        }
    }
    let Some(finish) = finish else {
        return unsupported("no token was generated");
    };
    let run = Run {
        steps,
        finish_reason: finish_reason(finish),
    };
    Ok((run, bundle))
}

/// Decodes `trace`'s prompt speculatively with `source`, handing each token to `record`; the
/// first error (the engine's or `record`'s) names the trace.
fn speculate(
    model: &dyn LanguageModel,
    source: &mut dyn DraftSource,
    trace: &Trace,
    params: &GenerateParams,
    k: usize,
    record: &mut dyn FnMut(&GeneratedToken) -> Result<()>,
) -> Result<()> {
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
        source,
        &trace.prompt.tokens,
        params,
        k,
        None,
        &mut on_token,
    )
    .map_err(|e| e.context(&trace.id))?;
    match failed {
        Some(e) => Err(e.context(&trace.id)),
        None => Ok(()),
    }
}

/// The trace's view of one step: the chosen token's logprob and the TOP_K best entries by
/// logprob descending, then id ascending (the recorder's order).
pub fn step_record(token: u32, logprobs: &Array, from_draft: bool) -> Result<Step> {
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
