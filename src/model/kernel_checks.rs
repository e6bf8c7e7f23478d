//! Custom CUDA kernels that repeat MLX's arithmetic are trusted only once a check shows they
//! give MLX's own bits on this process's libmlx (or, where one stands in for a call of MLX's
//! that no batch can repeat, agrees with it to rounding): once per key (operand types and
//! shape), run the first time a caller asks, remembered for the process. A kernel that does not
//! build or run counts as one that does not match; either way the caller keeps MLX's own calls,
//! and a warning says so once.

use std::collections::HashMap;
use std::fmt::Debug;
use std::hash::Hash;
use std::sync::Mutex;

use mlx::Result;

/// The outcomes of one kernel's checks: per key, what the check found (None: no match).
pub struct KernelChecks<K, V> {
    /// What the kernel is, for the warnings.
    kernel: &'static str,
    /// What callers do instead where it does not match, for the warnings.
    instead: &'static str,
    found: Mutex<Option<HashMap<K, Option<V>>>>,
}

impl<K: Eq + Hash + Debug + Copy, V: Copy> KernelChecks<K, V> {
    pub const fn new(kernel: &'static str, instead: &'static str) -> Self {
        Self {
            kernel,
            instead,
            found: Mutex::new(None),
        }
    }

    /// What the check for `key` found, running `check` the first time.
    pub fn outcome(&self, key: K, check: impl FnOnce() -> Result<Option<V>>) -> Option<V> {
        let mut found = self.found.lock().unwrap_or_else(|e| e.into_inner());
        let found = found.get_or_insert_with(HashMap::new);
        if let Some(&outcome) = found.get(&key) {
            return outcome;
        }
        let outcome = check().unwrap_or_else(|e| {
            tracing::warn!("the {} failed on this libmlx: {e}", self.kernel);
            None
        });
        if outcome.is_none() {
            tracing::warn!(
                "the {} differs from MLX's own call for {key:?}: {}",
                self.kernel,
                self.instead
            );
        }
        found.insert(key, outcome);
        outcome
    }
}
