//! Judging a golden trace with verity's engine on the backend this process runs on. Which way a
//! trace is judged, and the judgement of the run, are the harness's
//! ([`verity_harness::judge`]), shared with `verity judge score`, which judges another engine's
//! answers the same way; this module runs the engine for the answer the plan asks for.

use std::ops::Deref;
use std::rc::Rc;

use verity_harness::judge::{plan, scores_drafts, Plan};
pub use verity_harness::judge::{Cut, Judgement as Judged, Outcome};
use verity_harness::registry::{ModelClass, Registry};
use verity_harness::report::Status;
use verity_harness::trace::Trace;

use super::replay::{replay, replay_forced};
use super::Models;
use crate::bundle::ModelBundle;
use crate::Result;

/// The harness's judgement of a trace and the trace's model, which decodes token ids in its
/// report.
pub struct Judgement {
    judged: Judged,
    bundle: Option<Rc<ModelBundle>>,
}

impl Deref for Judgement {
    type Target = Judged;

    fn deref(&self) -> &Judged {
        &self.judged
    }
}

/// The class of a model folder for cross-backend tolerances.
pub fn model_class(bundle: &ModelBundle) -> ModelClass {
    let model_type = bundle.config.model_type().unwrap_or_default();
    if matches!(model_type, "qwen3_next" | "qwen3_5" | "qwen3_5_moe") {
        ModelClass::Hybrid
    } else if bundle.config.json.contains_key("quantization") {
        ModelClass::Quantized
    } else {
        ModelClass::Dense
    }
}

/// Where a teacher-forced judgement stops: the first step whose forwards had an expert router
/// within `least` of another choice (see [`crate::model::router_margin`]).
pub fn router_cut(margins: &[Option<f32>], least: f32) -> Option<Cut> {
    let (step, margin) = margins
        .iter()
        .enumerate()
        .find_map(|(i, m)| m.filter(|&m| m < least).map(|m| (i, m)))?;
    let at = if step == 0 {
        "the prompt or step 0".to_string()
    } else {
        format!("step {step}")
    };
    Some(Cut {
        step,
        why: format!(
            "an expert router's margin at {at} is {margin:.2e}, below the {least:.1e} within \
             which the oracle's rounding (another backend's, or another path's) may pick \
             another expert"
        ),
    })
}

/// Replays `trace` on `backend` and judges it.
pub fn judge(
    trace: &Trace,
    models: &mut Models,
    backend: &str,
    registry: &Registry,
) -> Result<Judgement> {
    let (judged, bundle) = match plan(trace, backend, registry) {
        Plan::Skip(why) => (Judged::skipped(trace, backend, why), None),
        Plan::TierC { bug } => {
            let (speculative, bundle) = replay(trace, models)?;
            let plain_trace = Trace {
                draft: None,
                ..trace.clone()
            };
            let (plain, _) = replay(&plain_trace, models)?;
            let (speculative, plain) = (speculative.tokens(), plain.tokens());
            let judged = Judged::tier_c(trace, backend, bug, speculative, plain);
            (judged, Some(bundle))
        }
        Plan::Generate => {
            let (run, bundle) = replay(trace, models)?;
            (
                Judged::generated(trace, backend, registry, run),
                Some(bundle),
            )
        }
        Plan::Score { lowered_by } => {
            let (run, bundle) = replay_forced(trace, models, scores_drafts(trace))?;
            let class = model_class(&bundle);
            // Scored answers come from another backend's rounding or another path's (a gap's):
            // either may pick another expert where a router's margin is within it.
            let cut = registry
                .router_margin(&trace.oracle.device, backend)
                .and_then(|least| router_cut(&run.router_margins, least));
            let judged = Judged::scored(
                trace,
                backend,
                registry,
                lowered_by,
                class,
                run.scored,
                run.draft_choice.as_deref(),
                cut,
            );
            (judged, Some(bundle))
        }
    };
    Ok(Judgement::new(judged, bundle))
}

impl Judgement {
    /// A judgement and the model that decodes its report (`None`: ids are printed as they are).
    pub fn new(judged: Judged, bundle: Option<Rc<ModelBundle>>) -> Judgement {
        Judgement { judged, bundle }
    }

    pub fn status(&self) -> Status {
        self.judged.status()
    }

    /// Token ids to text with the trace's model, for reports.
    pub fn decode(&self, ids: &[u32]) -> String {
        self.bundle
            .as_ref()
            .map_or_else(|| format!("{ids:?}"), |b| b.decode(ids))
    }

    /// The report of anything but a clean pass.
    pub fn report(&self, trace: &Trace) -> Option<String> {
        self.judged.report(trace, &|ids| self.decode(ids))
    }
}
