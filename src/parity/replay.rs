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
use crate::batch::Batch;
use crate::bundle::ModelBundle;
use crate::cache::{load_prompt_cache, KvQuantization};
use crate::decode::{decode, fresh_caches, Hooks, Request, Start};
use crate::generate::{score, Control, FinishReason, GenerateParams, GeneratedToken};
use crate::model::{lone_rows, router_margin};
use crate::sample::KeySchedule;
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
        prefill_splits: Vec::new(),
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

/// The oracle's own tokens, chosen and top-k, are ids of the trace's model: a corrupt trace is
/// refused as bad input instead of being judged as a divergence.
fn recorded_tokens(trace: &Trace, vocab: usize) -> Result<()> {
    validate::token_ids("recorded", &trace.tokens(), vocab)?;
    for (i, step) in trace.steps.iter().enumerate() {
        let top: Vec<u32> = step.top.iter().map(|&(id, _)| id).collect();
        validate::token_ids(&format!("steps[{i}].top"), &top, vocab)?;
    }
    Ok(())
}

/// Where a trace's generation starts: the prompt cache file's caches, or fresh ones.
fn start(
    trace: &Trace,
    models: &Models,
    bundle: &ModelBundle,
    params: &GenerateParams,
) -> Result<Start> {
    let Some(cached) = &trace.prompt_cache else {
        return Ok(Start::Fresh);
    };
    let (caches, _) = load_prompt_cache(&models.path(&cached.file))?;
    validate::prompt_cache(&cached.file, bundle.model(), &caches, params)
        .map_err(|e| e.context(&trace.id))?;
    Ok(Start::Context(caches))
}

/// A teacher-forced replay: the engine's view of every step with the oracle's tokens fed
/// back, and where asked, the draft model's greedy choice at every emitted position over the
/// same tokens (for `verity_harness::forced::replayed_from_draft`).
pub struct ForcedRun {
    /// Per step: the oracle's token, the engine's logprob of it, the engine's best entries.
    pub scored: Vec<Step>,
    pub draft_choice: Option<Vec<u32>>,
    /// Per step, the smallest margin of the expert routers in the forwards that gave its
    /// logprobs (the prompt's prefill counts for step 0); None for a model without routers.
    pub router_margins: Vec<Option<f32>>,
}

/// Replays a trace teacher-forced (tier B across backends); with `drafts` (see
/// `verity_harness::judge::scores_drafts`), its draft model scores the same tokens too.
pub fn replay_forced(
    trace: &Trace,
    models: &mut Models,
    drafts: bool,
) -> Result<(ForcedRun, Rc<ModelBundle>)> {
    let bundle = models.get(&trace.model)?;
    recorded_tokens(trace, bundle.model().vocab_size()).map_err(|e| e.context(&trace.id))?;
    let params = params(trace, bundle.eos_token_ids.clone()).map_err(|e| e.context(&trace.id))?;
    let emitted = trace.tokens();
    let mut scored = Vec::with_capacity(emitted.len());
    let caches = match start(trace, models, &bundle, &params)? {
        Start::Context(caches) => caches,
        _ => fresh_caches(bundle.model(), trace.draft.is_some(), &params),
    };
    let mut router_margins = Vec::with_capacity(emitted.len());
    router_margin::watch(|| {
        score(
            bundle.model(),
            caches,
            &trace.prompt.tokens,
            &emitted,
            &params,
            |i, lp| {
                scored.push(step_record(emitted[i], lp, false)?);
                router_margins.push(router_margin::take()?);
                Ok(())
            },
        )
    })
    .map_err(|e| e.context(&trace.id))?;
    let draft_choice = match &trace.draft {
        Some(Draft::Model { model, .. }) if drafts => {
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
            Some(choice)
        }
        _ => None,
    };
    Ok((
        ForcedRun {
            scored,
            draft_choice,
            router_margins,
        },
        bundle,
    ))
}

/// Replays one trace with the engine; returns the run and the target's bundle (for reports).
/// Decode forwards use the oracle's kernels ([`lone_rows::oracle_kernels`]): on a GPU mlx-lm's
/// verify and batch rows are not its one-token steps, and the trace recorded them as they are.
pub fn replay(trace: &Trace, models: &mut Models) -> Result<(Run, Rc<ModelBundle>)> {
    lone_rows::oracle_kernels(|| replay_as_recorded(trace, models))
}

fn replay_as_recorded(trace: &Trace, models: &mut Models) -> Result<(Run, Rc<ModelBundle>)> {
    let bundle = models.get(&trace.model)?;
    recorded_tokens(trace, bundle.model().vocab_size()).map_err(|e| e.context(&trace.id))?;
    let params = params(trace, bundle.eos_token_ids.clone()).map_err(|e| e.context(&trace.id))?;
    let drafter = match &trace.draft {
        Some(draft) => {
            let (spec, k) = models
                .trace_drafter(draft)
                .map_err(|e| e.context(&trace.id))?;
            Some((models.drafter(&trace.model, &spec)?, k))
        }
        None => None,
    };
    if let Some(batch) = &trace.batch {
        let (steps, finish) = replay_batch(trace, &bundle, &params, batch)?;
        let run = Run {
            steps,
            finish_reason: finish_reason(finish),
        };
        return Ok((run, bundle));
    }
    let start = start(trace, models, &bundle, &params)?;
    let mut steps = Vec::new();
    let (mut finish, mut failed) = (None, None);
    let mut on_token = |token: &GeneratedToken| {
        match step_record(token.token, &token.logprobs, token.from_draft) {
            Ok(step) => steps.push(step),
            Err(e) => {
                failed = Some(e);
                return Control::Stop;
            }
        }
        finish = token.finish;
        Control::Continue
    };
    let request = Request {
        prompt: &trace.prompt.tokens,
        params: &params,
        constraint: None,
        num_draft_tokens: drafter.as_ref().map(|d| d.1),
    };
    let drafter = drafter.as_ref().map(|d| d.0.as_ref());
    decode(
        bundle.model(),
        drafter,
        start,
        request,
        Hooks::tokens(&mut on_token),
    )
    .map_err(|e| e.context(&trace.id))?;
    if let Some(e) = failed {
        return Err(e.context(&trace.id));
    }
    let Some(finish) = finish else {
        return Err(Error::Unsupported(format!(
            "{}: no token was generated",
            trace.id
        )));
    };
    let run = Run {
        steps,
        finish_reason: finish_reason(finish),
    };
    Ok((run, bundle))
}

/// Decodes every row of a batch trace together (verity's own batch, crate::batch), each row
/// with the trace's params and its own max_tokens; returns the trace's row's steps and finish.
fn replay_batch(
    trace: &Trace,
    bundle: &ModelBundle,
    params: &GenerateParams,
    batch: &trace::Batch,
) -> Result<(Vec<Step>, FinishReason)> {
    let in_trace = |e: Error| e.context(&trace.id);
    let model = bundle.model();
    let row_params: Vec<GenerateParams> = batch
        .rows
        .iter()
        .map(|r| GenerateParams {
            max_tokens: r.max_tokens,
            ..params.clone()
        })
        .collect();
    let mut rows = Batch::new(model);
    for (i, (row, params)) in batch.rows.iter().zip(&row_params).enumerate() {
        let request = Request {
            prompt: &row.tokens,
            params,
            constraint: None,
            num_draft_tokens: None,
        };
        rows.add(i, None, Start::Fresh, request, None, None)
            .map_err(|e| in_trace(e.context(format!("batch row {i}"))))?;
    }
    let (mut steps, mut finish, mut failed) = (Vec::new(), None, None);
    while !rows.is_empty() {
        rows.step(&mut |i, token| {
            if i != batch.row {
                return Control::Continue;
            }
            match step_record(token.token, &token.logprobs, token.from_draft) {
                Ok(step) => steps.push(step),
                Err(e) => failed = Some(e),
            }
            finish = token.finish;
            Control::Continue
        })
        .map_err(in_trace)?;
    }
    if let Some(e) = failed {
        return Err(in_trace(e));
    }
    let finish = finish
        .ok_or_else(|| Error::Unsupported(format!("{}: no token was generated", trace.id)))?;
    Ok((steps, finish))
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
