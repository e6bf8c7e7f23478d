//! The verity parity harness, independent of any engine: the golden trace format, comparison of
//! an engine's run with a trace under a parity tier, and the reports `verity check` prints.
//!
//! It does not depend on the engine (the engine's CLI and tests depend on it), so it builds fast
//! and can judge traces produced by any engine.

pub mod acceptance;
pub mod atomic;
#[cfg(any(test, feature = "strategies"))]
pub mod cache_model;
pub mod compare;
pub mod forced;
pub mod html;
pub mod judge;
pub mod junit;
pub mod protocol;
pub mod registry;
pub mod report;
pub mod stats;
pub mod topk;
pub mod trace;

pub use compare::{compare, Divergence, DivergenceKind, Generation, Verdict};
pub use trace::{FinishReason, Step, Tier, Trace, TraceError};
