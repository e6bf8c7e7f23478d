//! Runs an acceptance suite: greedy speculative generation of every prompt at every
//! num_draft_tokens, with the statistics summed per num_draft_tokens, and their acceptance in
//! the harness's baseline format.

use std::collections::BTreeMap;

use verity_harness::acceptance::{Source, Suite};
use verity_harness::stats::Acceptance;

use super::Models;
use crate::generate::{GenerateParams, GeneratedToken};
use crate::speculative::{
    generate_speculative, Control, DflashDrafter, DraftModel, DraftSource, MtpDrafter, NgramLookup,
    SpeculationStats,
};
use crate::Result;

/// What a baseline keeps of the engine's counters.
pub fn acceptance(s: &SpeculationStats) -> Acceptance {
    Acceptance {
        drafted_by_pos: s.drafted_by_pos.clone(),
        accepted_by_pos: s.accepted_by_pos.clone(),
        generated: s.generated,
        from_draft: s.from_draft,
    }
}

/// The suite's statistics per num_draft_tokens, summed over its prompts.
pub fn run_suite(suite: &Suite, models: &mut Models) -> Result<BTreeMap<usize, SpeculationStats>> {
    let target = models.get(&suite.target)?;
    let draft_model = match &suite.source {
        Source::Model { model } => Some(models.get(model)?),
        Source::Ngram { .. } | Source::Mtp | Source::Dflash { .. } => None,
    };
    let dflash = match &suite.source {
        Source::Dflash { model, .. } => Some(models.dflash(model)?),
        _ => None,
    };
    let params = GenerateParams::greedy(suite.max_tokens, target.eos_token_ids.clone());
    let mut out = BTreeMap::new();
    for &k in &suite.num_draft_tokens {
        let mut total = SpeculationStats::default();
        for prompt in &suite.prompts {
            let mut source: Box<dyn DraftSource> = match (&draft_model, &suite.source) {
                (Some(d), _) => Box::new(DraftModel::new(d.model())),
                (None, Source::Ngram { min, max }) => Box::new(NgramLookup::new(*min, *max)?),
                (None, Source::Mtp) => Box::new(MtpDrafter::new(target.model())?),
                (None, Source::Dflash { chain, .. }) => {
                    let drafter = dflash.as_deref().expect("a DFlash source is loaded above");
                    Box::new(if *chain {
                        DflashDrafter::chained(target.model(), drafter)?
                    } else {
                        DflashDrafter::new(target.model(), drafter)?
                    })
                }
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
            total.add(&stats);
        }
        out.insert(k, total);
    }
    Ok(out)
}
