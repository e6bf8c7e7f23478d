//! The top-k agreement rule of tier B, shared by the free-running comparison and the
//! teacher-forced check: the oracle's entries clear of its cut-off must be in the engine's list
//! within the tolerance, and entries near the cut-off may swap in or out.

/// `value <= limit`, false for NaN: a NaN logprob is a failure, never a pass.
pub(crate) fn within(value: f32, limit: f32) -> bool {
    value <= limit
}

/// The oracle's top entries above its cut-off (its last listed logprob) by more than `margin`.
fn clear_of_cutoff(oracle: &[(u32, f32)], margin: f32) -> impl Iterator<Item = &(u32, f32)> {
    let cutoff = oracle.last().map_or(f32::NEG_INFINITY, |e| e.1);
    oracle.iter().filter(move |e| e.1 > cutoff + margin)
}

/// The engine's logprob of `id`, if it lists it.
fn listed(engine: &[(u32, f32)], id: u32) -> Option<f32> {
    engine.iter().find(|e| e.0 == id).map(|e| e.1)
}

/// Every oracle entry clear of the cut-off by more than the tolerance appears in the engine's
/// list within the tolerance; entries near the cut-off may legitimately swap in or out.
pub fn top_agrees(oracle: &[(u32, f32)], engine: &[(u32, f32)], tolerance: f32) -> bool {
    clear_of_cutoff(oracle, tolerance)
        .all(|&(id, lp)| listed(engine, id).is_some_and(|e| within((e - lp).abs(), tolerance)))
}

/// The largest deviation of an oracle top entry above the cut-off that the engine also lists.
pub fn top_deviation(oracle: &[(u32, f32)], engine: &[(u32, f32)]) -> f32 {
    clear_of_cutoff(oracle, 0.0)
        .filter_map(|&(id, lp)| listed(engine, id).map(|e| (e - lp).abs()))
        .fold(0.0, f32::max)
}
