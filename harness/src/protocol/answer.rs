//! A response made sure of and judged: [`validate`] checks that it answers its request with
//! values any log-softmax could give, [`judge_answer`] judges it against its trace.

use super::*;

/// A response made sure of: what the engine computed, in the harness's types.
#[derive(Clone, Debug, PartialEq)]
pub enum Answer {
    /// The engine cannot run the case: why.
    Unsupported(String),
    Generated(Generation),
    Scored {
        scored: Vec<Step>,
        draft_choice: Option<Vec<u32>>,
    },
    TierC {
        speculative: Generation,
        plain: Generation,
    },
}

/// Checks that `response` answers `request` with values any log-softmax could give: the
/// fields its mode needs and no others, step counts the request allows, ids below the
/// vocabulary, finite logprobs at most 0, `top_k` best entries in order. The error names the
/// field and the value.
pub fn validate(request: &Request, response: &Response) -> Result<Answer, String> {
    let r = response;
    let has = |present: bool, name: &str, wanted: bool| match (present, wanted) {
        (true, false) => Err(format!(
            "has {name}, which a {:?} request does not take",
            request.mode
        )),
        (false, true) => Err(format!(
            "lacks {name}, which a {:?} request needs",
            request.mode
        )),
        _ => Ok(()),
    };
    if let Some(why) = &r.unsupported {
        let extra = r.steps.is_some()
            || r.finish_reason.is_some()
            || r.scored.is_some()
            || r.draft_tokens.is_some()
            || r.plain.is_some();
        if extra {
            return Err("is unsupported but gives results too".to_string());
        }
        return Ok(Answer::Unsupported(why.clone()));
    }
    let (generate, score, tier_c) = (
        matches!(request.mode, Mode::Generate | Mode::TierC),
        request.mode == Mode::Score,
        request.mode == Mode::TierC,
    );
    has(r.steps.is_some(), "steps", generate)?;
    has(r.finish_reason.is_some(), "finish_reason", generate)?;
    has(r.scored.is_some(), "scored", score)?;
    has(
        r.draft_tokens.is_some(),
        "draft_tokens",
        request.draft_tokens,
    )?;
    has(r.plain.is_some(), "plain", tier_c)?;
    let generation = |what: &str, steps: &[GeneratedStep], finish: FinishReason| {
        check_generation(request, what, steps, finish)
    };
    match (&r.steps, r.finish_reason, &r.scored, &r.plain) {
        (Some(steps), Some(finish), None, None) => {
            Ok(Answer::Generated(generation("steps", steps, finish)?))
        }
        (Some(steps), Some(finish), None, Some(plain)) => Ok(Answer::TierC {
            speculative: generation("steps", steps, finish)?,
            plain: generation("plain.steps", &plain.steps, plain.finish_reason)?,
        }),
        (None, None, Some(scored), None) => {
            let tokens = request.tokens.as_deref().unwrap_or_default();
            if scored.len() != tokens.len() {
                return Err(format!(
                    "scored has {} steps, the request gives {} tokens to score",
                    scored.len(),
                    tokens.len()
                ));
            }
            let scored = scored
                .iter()
                .zip(tokens)
                .enumerate()
                .map(|(i, (s, &token))| {
                    let step = Step {
                        token,
                        logprob: s.logprob.0,
                        top: s.top.iter().map(|&(id, lp)| (id, lp.0)).collect(),
                        from_draft: false,
                    };
                    check_step(request, &format!("scored[{i}]"), &step).map(|()| step)
                })
                .collect::<Result<Vec<_>, _>>()?;
            let draft_choice = match &r.draft_tokens {
                Some(ids) if ids.len() != tokens.len() => {
                    return Err(format!(
                        "draft_tokens has {} ids, the request gives {} tokens",
                        ids.len(),
                        tokens.len()
                    ))
                }
                Some(ids) => {
                    check_ids(request, "draft_tokens", ids)?;
                    Some(ids.clone())
                }
                None => None,
            };
            Ok(Answer::Scored {
                scored,
                draft_choice,
            })
        }
        _ => Err(format!("does not answer a {:?} request", request.mode)),
    }
}

fn check_ids(request: &Request, what: &str, ids: &[u32]) -> Result<(), String> {
    match ids.iter().position(|&id| id as usize >= request.vocab_size) {
        Some(i) => Err(format!(
            "{what}[{i}] is token {}, past the vocabulary of {} ids",
            ids[i], request.vocab_size
        )),
        None => Ok(()),
    }
}

/// A step's ids are in the vocabulary, it lists `top_k` best entries, and it is what a
/// log-softmax gives ([`Step::validate`]).
fn check_step(request: &Request, what: &str, step: &Step) -> Result<(), String> {
    check_ids(request, &format!("{what}.token"), &[step.token])
        .map_err(|e| e.replace(".token[0]", ".token"))?;
    let top: Vec<u32> = step.top.iter().map(|&(id, _)| id).collect();
    check_ids(request, &format!("{what}.top"), &top)?;
    if step.top.len() != request.top_k {
        return Err(format!(
            "{what}.top has {} entries, top_k is {}",
            step.top.len(),
            request.top_k
        ));
    }
    step.validate().map_err(|e| format!("{what}: {e}"))
}

fn check_generation(
    request: &Request,
    what: &str,
    steps: &[GeneratedStep],
    finish: FinishReason,
) -> Result<Generation, String> {
    let max = request.params.max_tokens;
    let counted = match finish {
        FinishReason::Length => steps.len() == max,
        FinishReason::Stop => (1..=max).contains(&steps.len()),
    };
    if !counted {
        return Err(format!(
            "{what} has {} steps with finish_reason {finish}, max_tokens is {max} (\"length\" \
             is exactly max_tokens steps, \"stop\" 1 to max_tokens)",
            steps.len()
        ));
    }
    let steps = steps
        .iter()
        .enumerate()
        .map(|(i, s)| {
            let step = Step {
                token: s.token,
                logprob: s.logprob.0,
                top: s.top.iter().map(|&(id, lp)| (id, lp.0)).collect(),
                from_draft: s.from_draft,
            };
            if step.from_draft && request.draft.is_none() {
                return Err(format!(
                    "{what}[{i}] is from_draft, but the request has no draft"
                ));
            }
            check_step(request, &format!("{what}[{i}]"), &step).map(|()| step)
        })
        .collect::<Result<Vec<_>, _>>()?;
    Ok(Generation {
        steps,
        finish_reason: finish,
    })
}

/// Judges a validated answer to `trace`'s request on `backend` the way `plan` says, as
/// `verity check` judges verity's own run; `class` is the model's, for teacher-forced
/// tolerances. An engine that answered unsupported gets its reason back (it did not run).
pub fn judge_answer(
    trace: &Trace,
    plan: Plan,
    answer: Answer,
    backend: &str,
    registry: &Registry,
    class: ModelClass,
) -> Result<Judgement, String> {
    match (plan, answer) {
        (Plan::Skip(why), _) => Ok(Judgement::skipped(trace, backend, why)),
        (_, Answer::Unsupported(why)) => Err(format!("the engine does not run it: {why}")),
        (Plan::Generate, Answer::Generated(run)) => {
            Ok(Judgement::generated(trace, backend, registry, run))
        }
        (
            Plan::Score { lowered_by },
            Answer::Scored {
                scored,
                draft_choice,
            },
        ) => Ok(Judgement::scored(
            trace,
            backend,
            registry,
            lowered_by,
            class,
            scored,
            draft_choice.as_deref(),
            None,
        )),
        (Plan::TierC { bug }, Answer::TierC { speculative, plain }) => Ok(Judgement::tier_c(
            trace,
            backend,
            bug,
            speculative.tokens(),
            plain.tokens(),
        )),
        (plan, _) => Err(format!(
            "the answer is not of the kind its plan {plan:?} asks for"
        )),
    }
}
