//! The one-engine-thread rule: MLX work sent from many threads runs on one OS thread, and the
//! process does not gain a stream scheduler thread per caller. (That `Array` cannot leave the
//! engine thread at all is checked at compile time in array.rs.)

use std::sync::Arc;
use std::thread;

use mlx::thread::EngineThread;
use mlx::Array;

fn sum_of_squares(n: i32) -> f32 {
    let a = Array::arange(0.0, n as f64, 1.0, mlx::Dtype::Float32).unwrap();
    a.square()
        .unwrap()
        .sum(&[], false)
        .unwrap()
        .item::<f32>()
        .unwrap()
}

#[cfg(target_os = "linux")]
fn os_threads() -> usize {
    let status = std::fs::read_to_string("/proc/self/status").unwrap();
    let line = status.lines().find(|l| l.starts_with("Threads:")).unwrap();
    line.split_whitespace().nth(1).unwrap().parse().unwrap()
}

#[test]
fn work_from_many_threads_runs_on_the_engine_thread() {
    let engine = Arc::new(EngineThread::spawn("mlx-engine").unwrap());
    let clients: Vec<_> = (0..4)
        .map(|c| {
            let engine = Arc::clone(&engine);
            thread::spawn(move || {
                (0..25)
                    .map(|j| {
                        let n = 10 + c * 25 + j;
                        engine
                            .run(move || (thread::current().id(), n, sum_of_squares(n)))
                            .unwrap()
                    })
                    .collect::<Vec<_>>()
            })
        })
        .collect();
    for client in clients {
        for (ran_on, n, got) in client.join().unwrap() {
            assert_eq!(
                ran_on,
                engine.id(),
                "job for n={n} ran off the engine thread"
            );
            let want: f32 = (0..n).map(|i| (i * i) as f32).sum();
            assert_eq!(got, want, "n={n}");
        }
    }
}

#[cfg(target_os = "linux")]
#[test]
fn evaluating_many_jobs_adds_no_os_threads() {
    let engine = EngineThread::spawn("mlx-engine").unwrap();
    engine.run(|| sum_of_squares(8)).unwrap();
    let before = os_threads();
    for n in 0..200 {
        engine.run(move || sum_of_squares(n + 1)).unwrap();
    }
    assert_eq!(os_threads(), before, "MLX work leaked OS threads");
}

#[test]
fn a_panicking_job_is_reported_and_the_engine_keeps_serving() {
    let engine = EngineThread::spawn("mlx-engine").unwrap();
    let err = engine.run(|| -> i32 { panic!("job failed") }).unwrap_err();
    assert!(err.to_string().contains("job failed"), "{err}");
    assert_eq!(engine.run(|| sum_of_squares(3)).unwrap(), 5.0);
}
