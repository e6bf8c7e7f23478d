//! Runs an acceptance suite: greedy speculative generation of every prompt at every
//! num_draft_tokens, with the statistics summed per num_draft_tokens in the harness's format.

use std::collections::BTreeMap;

use verity_harness::acceptance::{Source, Suite};
use verity_harness::stats::SpecStats;

use super::Models;
use crate::generate::{GenerateParams, GeneratedToken};
use crate::speculative::{
    generate_speculative, Control, DraftModel, DraftSource, NgramLookup, SpeculationStats,
};
use crate::Result;

/// The engine's counters in the harness's statistics format.
pub fn to_harness(s: &SpeculationStats) -> SpecStats {
    SpecStats {
        rounds: s.rounds,
        drafted: s.drafted,
        accepted: s.accepted,
        drafted_by_pos: s.drafted_by_pos.clone(),
        accepted_by_pos: s.accepted_by_pos.clone(),
        target_calls: s.target_calls,
        generated: s.generated,
        from_draft: s.from_draft,
        refused_rounds: s.refused_rounds,
        partial_rollbacks: s.partial_rollbacks,
    }
}

/// The suite's statistics per num_draft_tokens.
pub fn run_suite(suite: &Suite, models: &mut Models) -> Result<BTreeMap<usize, SpecStats>> {
    let target = models.get(&suite.target)?;
    let draft_model = match &suite.source {
        Source::Model { model } => Some(models.get(model)?),
        Source::Ngram { .. } => None,
    };
    let params = GenerateParams::greedy(suite.max_tokens, target.eos_token_ids.clone());
    let mut out = BTreeMap::new();
    for &k in &suite.num_draft_tokens {
        let mut total = SpecStats::default();
        for prompt in &suite.prompts {
            let mut source: Box<dyn DraftSource> = match (&draft_model, &suite.source) {
                (Some(d), _) => Box::new(DraftModel::new(d.model())),
                (None, Source::Ngram { min, max }) => Box::new(NgramLookup::new(*min, *max)),
                (None, Source::Model { .. }) => unreachable!("a model source is loaded above"),
            };
            let mut ignore = |_: &GeneratedToken| Control::Continue;
            let (stats, _) = generate_speculative(
                target.model(),
                source.as_mut(),
                prompt,
                &params,
                k,
                None,
                &mut ignore,
            )
            .map_err(|e| e.context(format!("{} k={k}", suite.target)))?;
            total.add(&to_harness(&stats));
        }
        out.insert(k, total);
    }
    Ok(out)
}
