//! The engine thread: one long-lived OS thread that does all MLX work.
//!
//! MLX binds each array to the stream of the thread that built it (evaluating it elsewhere fails
//! with "There is no Stream(cpu, 0) in current thread"), and every thread that evaluates
//! anything leaves a stream scheduler thread behind that is never reclaimed
//! (toolchain-notes.md section 1). So MLX work is never spread over short-lived or pooled
//! threads: it is sent as closures to one `EngineThread`, and only plain data (token ids,
//! `Vec<f32>`, strings) crosses back. `Array` is `!Send`, so the compiler enforces the rest.

use std::sync::mpsc;
use std::thread::{self, JoinHandle, ThreadId};

type Job = Box<dyn FnOnce() + Send>;

/// A handle to the thread that owns all MLX state. Dropping it finishes queued jobs, then joins.
pub struct EngineThread {
    jobs: Option<mpsc::Sender<Job>>,
    handle: Option<JoinHandle<()>>,
    id: ThreadId,
}

/// The engine thread stopped (a job panicked) before it could answer.
#[derive(Debug, thiserror::Error)]
#[error("the MLX engine thread has stopped")]
pub struct EngineStopped;

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
    pub fn run<T, F>(&self, job: F) -> Result<T, EngineStopped>
    where
        T: Send + 'static,
        F: FnOnce() -> T + Send + 'static,
    {
        let (tx, rx) = mpsc::sync_channel(1);
        self.submit(move || {
            let _ = tx.send(job());
        })?;
        rx.recv().map_err(|_| EngineStopped)
    }

    /// Queues `job` without waiting; it may answer through its own channel.
    pub fn submit(&self, job: impl FnOnce() + Send + 'static) -> Result<(), EngineStopped> {
        let jobs = self.jobs.as_ref().ok_or(EngineStopped)?;
        jobs.send(Box::new(job)).map_err(|_| EngineStopped)
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
