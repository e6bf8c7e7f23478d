//! Runs an acceptance suite: greedy speculative generation of every prompt at every
//! num_draft_tokens, with the statistics summed per num_draft_tokens.

use std::collections::BTreeMap;

use verity_harness::accept::{Source, Suite};
use verity_harness::stats::SpecStats;

use crate::generate::GenerateParams;
use crate::replay::{Models, ReplayError};
use crate::spec::{generate_speculative, Control, DraftModel, DraftSource, NgramLookup};

/// The suite's statistics per num_draft_tokens.
pub fn run_suite(
    suite: &Suite,
    models: &mut Models,
) -> Result<BTreeMap<usize, SpecStats>, ReplayError> {
    let target = models.get(&suite.target)?;
    let draft = match &suite.source {
        Source::Model { model } => Some(models.get(model)?),
        Source::Ngram { .. } => None,
    };
    let params = GenerateParams::greedy(suite.max_tokens, target.eos_token_ids.clone());
    let mut out = BTreeMap::new();
    for &k in &suite.num_draft_tokens {
        let mut total = SpecStats::default();
        for prompt in &suite.prompts {
            let mut source: Box<dyn DraftSource> = match (&suite.source, &draft) {
                (Source::Ngram { min, max }, _) => Box::new(NgramLookup::new(*min, *max)),
                (_, Some(d)) => Box::new(DraftModel::new(d.model.model.as_ref())),
                (Source::Model { .. }, None) => unreachable!("loaded above"),
            };
            let mut ignore = |_: &crate::generate::GeneratedToken| Control::Continue;
            let stats = generate_speculative(
                target.model.model.as_ref(),
                source.as_mut(),
                prompt,
                &params,
                k,
                &mut ignore,
            )
            .map_err(|e| ReplayError::Generate(format!("{} k={k}", suite.target), e))?;
            total.add(&stats);
        }
        out.insert(k, total);
    }
    Ok(out)
}
