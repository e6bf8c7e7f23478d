//! One test per golden trace of every set: a trace recorded on this backend is replayed under
//! its own tier, one recorded on another backend teacher-forced under cross-backend tier B
//! (verity::parity::judge). A failure prints the report; an explained one (a case this backend
//! cannot run, a known backend bug) passes and says why.

mod support;

use std::path::Path;

use libtest_mimic::{Failed, Trial};
use support::root;
use verity::parity::judge::judge;
use verity::parity::replay::golden_sets;
use verity::parity::Models;
use verity_harness::registry::Registry;
use verity_harness::report::Status;
use verity_harness::trace::{find_traces, Trace};

fn check(path: &Path, device: mlx::Device) -> Result<(), Failed> {
    mlx::jit::isolate_per_test_slot();
    mlx::set_default_device(device)?;
    let registry = Registry::load(&root().join("golden"))?;
    let trace = Trace::load(path)?;
    let mut models = Models::new(root());
    let judgement = judge(&trace, &mut models, device.name(), &registry)?;
    match judgement.status() {
        Status::Fail => Err(judgement.report(&trace).unwrap_or_default().into()),
        _ => Ok(()),
    }
}

fn main() {
    let args = support::main_thread_args();
    let device = mlx::Device::best_available();
    let mut trials = Vec::new();
    for set in golden_sets(root()).expect("golden/ lists its trace sets") {
        let paths = find_traces(&set).unwrap_or_else(|e| panic!("{}: {e}", set.display()));
        assert!(
            !paths.is_empty(),
            "no golden traces under {}",
            set.display()
        );
        let prefix = set.file_name().unwrap().to_string_lossy().into_owned();
        for path in paths {
            let name = path.strip_prefix(&set).unwrap().with_extension("");
            let name = format!("{prefix}/{}", name.to_string_lossy());
            trials.push(Trial::test(name, move || check(&path, device)));
        }
    }
    libtest_mimic::run(&args, trials).exit();
}
