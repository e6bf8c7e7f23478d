//! verity-harness
