//! The verity parity harness, independent of any engine: the golden trace format, comparison of
//! an engine's run with a trace under a parity tier, and the reports `verity check` prints.
//!
//! It does not depend on the engine (the engine's CLI and tests depend on it), so it builds fast
//! and can judge traces produced by any engine.

pub mod accept;
pub mod cache_model;
pub mod compare;
pub mod report;
pub mod stats;
pub mod trace;

pub use compare::{compare, Divergence, DivergenceKind, Generation, Verdict};
pub use trace::{FinishReason, Step, Tier, Trace, TraceError};

/// Proptest cases for a property: `PROPTEST_CASES` if set, `fuzz` under the nextest `fuzz`
/// profile, else `default` (sized so the default profile stays fast on 2 cores).
pub fn proptest_cases(default: u32, fuzz: u32) -> u32 {
    if let Some(n) = std::env::var("PROPTEST_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
    {
        return n;
    }
    match std::env::var("NEXTEST_PROFILE").as_deref() {
        Ok("fuzz") => fuzz,
        _ => default,
    }
}
