//! The parity tooling, above the engine: replaying golden traces, running acceptance suites,
//! and running schema corpora through the grammar engine. This is the only place where the
//! harness's trace-format types become engine types and back.

pub mod acceptance;
pub mod bound;
pub mod corpus;
pub mod derived;
pub mod judge;
mod models;
pub mod replay;

pub use models::Models;
