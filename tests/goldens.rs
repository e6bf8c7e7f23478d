//! One test per golden trace: the engine replays it and must match the oracle under the
//! trace's parity tier. A failure prints the divergence report.

mod support;

use std::path::Path;

use libtest_mimic::{Failed, Trial};
use support::root;
use verity::parity::{replay, Models};
use verity_harness::compare;
use verity_harness::report::divergence_report;
use verity_harness::trace::{find_traces, Trace};

fn check(path: &Path, device: mlx::Device) -> Result<(), Failed> {
    mlx::jit::isolate_per_test_slot();
    mlx::set_default_device(device)?;
    let trace = Trace::load(path)?;
    let mut models = Models::new(root());
    let (run, bundle) = replay::replay(&trace, &mut models)?;
    let verdict = compare(&trace, &run, device.name());
    if verdict.is_failure() {
        let decode = |ids: &[u32]| bundle.decode(ids);
        return Err(divergence_report(&trace, &run, &verdict, device.name(), &decode).into());
    }
    Ok(())
}

fn main() {
    let args = support::main_thread_args();
    // The set recorded on this backend if there is one, else the CPU set (token-exact).
    let device = mlx::Device::best_available();
    let dir = replay::golden_traces(root(), device);
    let paths = find_traces(&dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display()));
    assert!(
        !paths.is_empty(),
        "no golden traces under {}",
        dir.display()
    );
    let trials = paths
        .into_iter()
        .map(|path| {
            let name = path
                .strip_prefix(&dir)
                .unwrap()
                .with_extension("")
                .to_string_lossy()
                .into_owned();
            Trial::test(name, move || check(&path, device))
        })
        .collect();
    libtest_mimic::run(&args, trials).exit();
}
