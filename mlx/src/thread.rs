//! The engine thread: one long-lived OS thread that does all MLX work.
//!
//! MLX binds each array to the stream of the thread that built it (evaluating it elsewhere fails
//! with "There is no Stream(cpu, 0) in current thread"), and every thread that evaluates
//! anything leaves a stream scheduler thread behind that is never reclaimed
//! (docs/DESIGN.md, section 3). So MLX work is never spread over short-lived or pooled
//! threads: it is sent as closures to one `EngineThread`, and only plain data (token ids,
//! `Vec<f32>`, strings) crosses back. `Array` is `!Send`, so the compiler enforces the rest.

use std::panic::{self, AssertUnwindSafe};
use std::sync::mpsc;
use std::thread::{self, JoinHandle, ThreadId};

type Job = Box<dyn FnOnce() + Send>;

/// A handle to the thread that owns all MLX state. Dropping it finishes queued jobs, then joins.
pub struct EngineThread {
    jobs: Option<mpsc::Sender<Job>>,
    handle: Option<JoinHandle<()>>,
    id: ThreadId,
}

/// Why a job sent to the engine thread gave no result.
#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    #[error("the MLX engine thread has stopped")]
    Stopped,
    /// The job panicked; the engine thread caught it and keeps serving other jobs.
    #[error("an MLX engine job panicked: {0}")]
    Panicked(String),
}

impl EngineThread {
    /// Starts the thread. `name` shows in debuggers and panic messages.
    pub fn spawn(name: &str) -> std::io::Result<EngineThread> {
        let (jobs, queue) = mpsc::channel::<Job>();
        let handle = thread::Builder::new()
            .name(name.to_string())
            .spawn(move || {
                for job in queue {
                    job();
                }
            })?;
        let id = handle.thread().id();
        Ok(EngineThread {
            jobs: Some(jobs),
            handle: Some(handle),
            id,
        })
    }

    /// The engine thread's id, for checking where work ran.
    pub fn id(&self) -> ThreadId {
        self.id
    }

    /// Runs `job` on the engine thread and waits for its result. Callable from any thread.
    pub fn run<T, F>(&self, job: F) -> Result<T, EngineError>
    where
        T: Send + 'static,
        F: FnOnce() -> T + Send + 'static,
    {
        let (tx, rx) = mpsc::sync_channel(1);
        self.submit(move || {
            let result = panic::catch_unwind(AssertUnwindSafe(job)).map_err(|p| {
                let text = p
                    .downcast_ref::<&str>()
                    .map(|s| s.to_string())
                    .or_else(|| p.downcast_ref::<String>().cloned())
                    .unwrap_or_else(|| "unknown panic".into());
                EngineError::Panicked(text)
            });
            let _ = tx.send(result);
        })?;
        rx.recv().map_err(|_| EngineError::Stopped)?
    }

    /// Queues `job` without waiting; it may answer through its own channel.
    pub fn submit(&self, job: impl FnOnce() + Send + 'static) -> Result<(), EngineError> {
        let jobs = self.jobs.as_ref().ok_or(EngineError::Stopped)?;
        jobs.send(Box::new(job)).map_err(|_| EngineError::Stopped)
    }
}

impl Drop for EngineThread {
    fn drop(&mut self) {
        drop(self.jobs.take());
        if let Some(handle) = self.handle.take() {
            let _ = handle.join();
        }
    }
}
