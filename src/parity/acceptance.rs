//! Runs an acceptance suite: greedy speculative generation of every prompt at every
//! num_draft_tokens, with the statistics summed per num_draft_tokens, and their acceptance in
//! the harness's baseline format.

use std::collections::BTreeMap;

use verity_harness::acceptance::Suite;
use verity_harness::stats::Acceptance;

use super::Models;
use crate::decode::{decode, Hooks, Request, Start};
use crate::generate::{Control, GenerateParams, GeneratedToken};
use crate::speculative::SpeculationStats;
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
    let spec = models.suite_drafter(&suite.source)?;
    let drafter = models.drafter(&suite.target, &spec)?;
    let params = GenerateParams::greedy(suite.max_tokens, target.eos_token_ids.clone());
    let mut out = BTreeMap::new();
    for &k in &suite.num_draft_tokens {
        let mut total = SpeculationStats::default();
        for prompt in &suite.prompts {
            let mut ignore = |_: &GeneratedToken| Control::Continue;
            let request = Request {
                prompt,
                params: &params,
                constraint: None,
                num_draft_tokens: Some(k),
            };
            let decoded = decode(
                target.model(),
                Some(&drafter),
                Start::Fresh,
                request,
                Hooks::tokens(&mut ignore),
            )
            .map_err(|e| e.context(format!("{} k={k}", suite.target)))?;
            total.add(&decoded.speculation.unwrap_or_default());
        }
        out.insert(k, total);
    }
    Ok(out)
}
