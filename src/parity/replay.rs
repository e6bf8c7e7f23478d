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
use crate::cache::{load_prompt_cache, KvQuantization};
use crate::generate::{FinishReason, GenerateParams, GeneratedToken, Generation};
use crate::speculative::{generate_speculative, Control, DraftModel};
use crate::{Error, Result};

/// How many of the best entries a trace records per step.
pub const TOP_K: usize = 5;

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

/// A trace's mlx-lm arguments (an object by name) as the engine's parameter type.
fn arguments<T: DeserializeOwned>(what: &str, args: &Map<String, Value>) -> Result<T> {
    serde_json::from_value(Value::Object(args.clone()))
        .map_err(|e| Error::Params(format!("params.{what}: {e}")))
}

/// The generation parameters a trace was recorded with.
pub fn params(trace: &Trace, eos_token_ids: Vec<u32>) -> Result<GenerateParams> {
    let p = &trace.params;
    Ok(GenerateParams {
        max_tokens: p.max_tokens,
        sampler: arguments("sampler", &p.sampler)?,
        processors: arguments("processors", &p.processors)?,
        seed: p.seed,
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
            let mut source = DraftModel::new(draft.model());
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
                None,
                &mut on_token,
            )
            .map_err(|e| e.context(&trace.id))?;
            if let Some(e) = failed {
                return Err(e.context(&trace.id));
            }
        }
        (None, cached) => {
            let caches = match cached {
                Some(cached) => {
                    let (caches, _) = load_prompt_cache(&models.path(&cached.file))?;
                    if caches.len() != model.num_layers() {
                        return unsupported(&format!(
                            "{} holds {} layers, the model has {}",
                            cached.file,
                            caches.len(),
                            model.num_layers()
                        ));
                    }
                    caches
                }
                None => model.make_cache(params.max_kv_size),
            };
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
        (Some(Draft::Mtp { .. }), _) => {
            return unsupported("MTP speculative decoding is not implemented yet")
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
