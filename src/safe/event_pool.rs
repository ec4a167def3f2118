//! The event pool: events of a context (timing disabled) for the ordering rule, reused instead of
//! created per use.
//!
//! A [`PooledEvent`] is taken from its context's pool (or created when the pool is empty) and
//! goes back when it drops; taking, creating, querying, waiting on the host and giving back are
//! here (a stream records one and waits for one: `CudaStream::record_pooled`, `wait_pooled`). A
//! [`StreamEvent`] is how a stream and the ordering rule hold one: their own, or shared with a
//! capture or a host wait.
//!
//! The pool's storage, a list of idle handles, is a field of the [`Context`]: the context outlives
//! every event of its pool (each holds it by `Arc`) and destroys the idle ones when it goes, so
//! the storage lives and dies with it, and the context reads no file above its own (this one
//! binds it).
//!
//! Threading: pooled events are `Send + Sync`; the pool is behind the context's mutex, held only
//! to take or give back one handle.

use std::sync::Arc;

use super::context::Context;
use crate::cuda_error::Result;
use crate::result::event as raw_event;
use crate::sys::CUevent;

/// An event of a context's pool; returned to the pool when dropped.
#[derive(Debug)]
pub(crate) struct PooledEvent {
    ctx: Arc<Context>,
    raw: CUevent,
}

// SAFETY: a CUevent may be recorded, waited on and destroyed from any thread.
unsafe impl Send for PooledEvent {}
// SAFETY: as above; the handle is only passed to thread-safe driver calls.
unsafe impl Sync for PooledEvent {}

impl PooledEvent {
    /// An event of `ctx` (timing disabled), from its pool or new.
    pub(crate) fn take(ctx: &Arc<Context>) -> Result<PooledEvent> {
        if let Some(raw) = ctx.pooled_events().pop() {
            return Ok(PooledEvent { ctx: Arc::clone(ctx), raw });
        }
        let _bound = ctx.bind()?;
        let raw = raw_event::create(false)?;
        Ok(PooledEvent { ctx: Arc::clone(ctx), raw })
    }

    /// Whether the last record completed (does not block).
    pub(crate) fn is_complete(&self) -> Result<bool> {
        let _bound = self.ctx.bind()?;
        // SAFETY: the event is live.
        unsafe { raw_event::query(self.raw) }
    }

    /// Blocks until the last record completed.
    pub(crate) fn synchronize(&self) -> Result<()> {
        let _bound = self.ctx.bind()?;
        // SAFETY: the event is live.
        unsafe { raw_event::synchronize(self.raw) }
    }

    #[inline]
    pub(crate) fn raw(&self) -> CUevent {
        self.raw
    }

    /// The context the event belongs to.
    #[inline]
    pub(crate) fn context(&self) -> &Arc<Context> {
        &self.ctx
    }
}

impl Drop for PooledEvent {
    // Inlined into the hot path's drops of marks (the ordering rule's file), as it was when the
    // pool lived there.
    #[inline]
    fn drop(&mut self) {
        // A pending record or wait on the event is unaffected when it is recorded again later.
        self.ctx.pooled_events().push(self.raw);
    }
}

/// An event recorded after work on a stream: one of the stream context's pool, or, while the
/// stream is being captured, the event recorded when the capture began (shared with the capture;
/// see [`CudaStream::event_after_enqueued`](super::stream::CudaStream::event_after_enqueued)), or one a
/// host wait holds too ([`Access::wait_on_host`](super::ordering::Access::wait_on_host)).
#[derive(Debug)]
pub(crate) enum StreamEvent {
    /// The stream's own, recorded after the work.
    Own(PooledEvent),
    /// Shared with a capture (the capture's event, which stands for all the stream's work outside
    /// the capture) or with a host wait: never recorded again.
    Shared(Arc<PooledEvent>),
}

impl std::ops::Deref for StreamEvent {
    type Target = PooledEvent;

    fn deref(&self) -> &PooledEvent {
        match self {
            StreamEvent::Own(event) => event,
            StreamEvent::Shared(event) => event,
        }
    }
}
