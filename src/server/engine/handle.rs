//! What the HTTP side holds of the engine thread: the queue it submits jobs to, the events each
//! job answers with, and the thread to join at exit.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread;
use std::time::{Duration, Instant};

use tokio::sync::mpsc;
use tracing::Span;

use super::{Summary, TokenInfo};
use crate::server::api::GenRequest;
use crate::server::channels::Channels;
use crate::server::error::ApiError;
use crate::server::metrics::Metrics;

/// What the engine tells the HTTP side about one request, in this order: `Started` or
/// `Failed`; then `Delta`s; then `Done` or `Failed`.
#[derive(Debug)]
pub enum Event {
    /// The request passed validation and the prompt is being processed.
    Started {
        prompt_tokens: usize,
        /// How a chat answer's text splits into content, reasoning and tool calls.
        channels: Box<Channels>,
    },
    /// Text released by the stop matcher (possibly empty) and the tokens just generated.
    Delta {
        text: String,
        tokens: Vec<TokenInfo>,
    },
    Done(Summary),
    Failed(ApiError),
}

/// A request, where its events go, its log span, and when it was queued.
pub struct Job {
    pub request: GenRequest,
    pub events: mpsc::UnboundedSender<Event>,
    pub span: Span,
    pub queued: Instant,
}

/// The HTTP side's handle: the bounded queue into the engine thread, and what it serves.
#[derive(Clone)]
pub struct EngineHandle {
    pub(super) jobs: mpsc::Sender<Job>,
    pub model_id: String,
    pub queue_size: usize,
    pub(super) shutdown: Arc<AtomicBool>,
    pub metrics: Arc<Metrics>,
}

impl EngineHandle {
    /// The shutdown's cut: every running request ends at its next token with finish_reason
    /// "shutdown" (its held-back text released), and every request not yet admitted is
    /// answered 503.
    pub fn cut_running(&self) {
        self.shutdown.store(true, Ordering::Relaxed);
    }

    /// Queues a request, logged under `span`; refuses at once when the queue is full (never
    /// waits).
    pub fn submit(
        &self,
        request: GenRequest,
        span: Span,
    ) -> Result<mpsc::UnboundedReceiver<Event>, ApiError> {
        let (events, rx) = mpsc::unbounded_channel();
        self.jobs
            .try_send(Job {
                request,
                events,
                span,
                queued: Instant::now(),
            })
            .map_err(|e| match e {
                mpsc::error::TrySendError::Full(_) => ApiError::busy(self.queue_size),
                mpsc::error::TrySendError::Closed(_) => {
                    ApiError::internal("the engine thread has stopped")
                }
            })?;
        Ok(rx)
    }

    /// Requests waiting in the queue.
    pub fn queued(&self) -> usize {
        self.jobs.max_capacity() - self.jobs.capacity()
    }
}

/// The engine thread itself. It ends once every [`EngineHandle`] is dropped, freeing the model
/// as it goes; the process joins it before exiting, since an MLX array freed while the
/// process's static destructors (MLX's allocator among them) run corrupts the heap.
pub struct EngineThread(pub(super) thread::JoinHandle<()>);

impl EngineThread {
    /// Waits up to `limit` for the engine thread to end; false if it is still running.
    pub fn join_within(self, limit: Duration) -> bool {
        let deadline = Instant::now() + limit;
        while !self.0.is_finished() {
            if Instant::now() >= deadline {
                return false;
            }
            thread::sleep(Duration::from_millis(10));
        }
        self.0.join().is_ok()
    }
}
