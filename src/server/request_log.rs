//! The server's log lines about requests, through `tracing`. Every request runs in a span,
//! `request{id=N endpoint=...}`, which the engine thread enters too, so each line about a
//! request carries its id; a finished request logs one line with its stats.

use std::sync::atomic::{AtomicU64, Ordering};

use axum::http::StatusCode;
use tracing::{info, info_span, warn, Span};

use super::api::Endpoint;
use super::error::ApiError;
use super::lane::Summary;

static NEXT_ID: AtomicU64 = AtomicU64::new(1);

/// A new request's span, under the next request id.
pub fn span(endpoint: Endpoint) -> Span {
    info_span!(
        "request",
        id = NEXT_ID.fetch_add(1, Ordering::Relaxed),
        endpoint = %endpoint.name()
    )
}

/// The line of a finished request: its tokens, times and finish reason, how full the prefix
/// cache is now, the widest batch it decoded in, the chunks of its prefill and the running rows'
/// steps between them, and its drafts' acceptance when speculative.
pub fn finished(s: &Summary, prefix_entries: usize, prefix_bytes: usize) {
    let st = &s.stats;
    let sp = st.speculation.as_ref();
    info!(
        finish_reason = %s.finish_reason,
        prompt_tokens = st.prompt_tokens,
        cached_tokens = st.cached_tokens,
        completion_tokens = st.completion_tokens,
        duration = %format_args!("{:.3}s", st.prompt_seconds + st.decode_seconds),
        prompt_tokens_per_second = %format_args!("{:.1}", st.prompt_tokens_per_second),
        decode_tokens_per_second = %format_args!("{:.1}", st.decode_tokens_per_second),
        batch_rows = s.batch_rows,
        prefill_chunks = s.prefill_chunks,
        interleaved_steps = s.interleaved_steps,
        prefix_cache_entries = prefix_entries,
        prefix_cache_bytes = prefix_bytes,
        speculative_rounds = sp.map(|sp| sp.rounds),
        drafted = sp.map(|sp| sp.drafted),
        accepted = sp.map(|sp| sp.accepted),
        drafted_by_position = sp.map(|sp| display(by_position(&sp.drafted_by_position))),
        accepted_by_position = sp.map(|sp| display(by_position(&sp.accepted_by_position))),
        target_calls = sp.map(|sp| sp.target_calls),
        "finished"
    );
}

/// Counts by draft position as one word, `[3,2,1]`.
fn by_position(counts: &[usize]) -> String {
    let counts: Vec<String> = counts.iter().map(usize::to_string).collect();
    format!("[{}]", counts.join(","))
}

/// The line of a refused or failed request: a warning when the engine failed it.
pub fn refused(e: &ApiError) {
    let status = e.status.as_u16();
    if e.status == StatusCode::INTERNAL_SERVER_ERROR {
        warn!(status, error = %e.message, "failed");
    } else {
        info!(status, error = %e.message, "refused");
    }
}
