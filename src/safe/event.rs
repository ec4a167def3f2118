//! Events, and a stream's record of and wait for one.
//!
//! A [`CudaEvent`] owns its event and holds its context alive; dropping it destroys the event
//! (a pending record completes first, in the driver). `Send + Sync`: it may be recorded, waited on
//! and queried from any thread. The stream's side ([`CudaStream::wait`], [`CudaStream::record`])
//! is here too, beside the event it takes. (The crate's own events, for the ordering rule, are
//! the pool's: `event_pool`.)

use std::sync::Arc;

use super::capture::refuse_in_capture;
use super::context::Context;
use super::stream::CudaStream;
use crate::cuda_error::{CudaError, Result};
use crate::result::event as raw;
use crate::result::stream as raw_stream;
use crate::sys::CUevent;

/// A CUDA event of one context. It can be recorded only on streams of its own device and waited
/// on from any device.
///
/// ```no_run
/// use ppnrt::CudaEvent;
/// # fn main() -> ppnrt::Result<()> {
/// let engine = ppnrt::Engine::new(0)?;
/// let stream = engine.stream()?;
/// let start = CudaEvent::new(engine.context(), true)?; // with timing
/// let end = CudaEvent::new(engine.context(), true)?;
/// start.record(&stream)?;
/// let x = engine.alloc_zeroed::<f32>(1 << 20)?;
/// end.record(&stream)?;
/// end.synchronize()?;
/// println!("zeroing took {:.3} ms", end.elapsed_ms(&start)?);
/// # drop(x);
/// # Ok(()) }
/// ```
#[derive(Debug)]
pub struct CudaEvent {
    ctx: Arc<Context>,
    raw: CUevent,
    timing: bool,
}

// SAFETY: a CUevent may be recorded, queried and waited on from any thread.
unsafe impl Send for CudaEvent {}
// SAFETY: as above; all methods take &self and call thread-safe driver entry points.
unsafe impl Sync for CudaEvent {}

impl CudaEvent {
    /// Creates an event; `timing` keeps timestamps for [`elapsed_ms`](Self::elapsed_ms) (recording
    /// is cheaper without).
    ///
    /// # Errors
    /// The driver's error.
    #[doc(alias = "cuEventCreate")]
    pub fn new(ctx: &Arc<Context>, timing: bool) -> Result<CudaEvent> {
        let _bound = ctx.bind()?;
        let raw = raw::create(timing)?;
        Ok(CudaEvent { ctx: Arc::clone(ctx), raw, timing })
    }

    /// An event this crate made some other way (an interprocess event, created or opened),
    /// destroyed with `cuEventDestroy` when the wrapper drops.
    ///
    /// # Safety
    /// - `raw` is a live event of `ctx`, owned by the caller, and destroyed by nothing else.
    pub(crate) unsafe fn adopt(ctx: &Arc<Context>, raw: CUevent, timing: bool) -> CudaEvent {
        CudaEvent { ctx: Arc::clone(ctx), raw, timing }
    }

    /// Records the event at the current end of `stream`.
    ///
    /// # Errors
    /// [`CudaError::WrongDevice`] when `stream` belongs to another device (checked before the driver
    /// is called); [`CaptureError::IllegalCall`](crate::CaptureError::IllegalCall) on a capturing
    /// stream (a plain record there would fork the capture; use
    /// [`StreamCapture::record_external`](crate::StreamCapture::record_external)); else the
    /// driver's error.
    #[doc(alias = "cuEventRecord")]
    #[inline]
    pub fn record(&self, stream: &CudaStream) -> Result<()> {
        if stream.ordinal() != self.ctx.ordinal() {
            return Err(CudaError::WrongDevice {
                what: "CudaEvent::record: the stream must be on the event's device",
                expected: self.ctx.ordinal(),
                found: stream.ordinal(),
            });
        }
        let _gate = stream.enqueue_gate_uncaptured("CudaEvent::record on a capturing stream")?;
        let _bound = self.ctx.bind()?;
        // SAFETY: both handles are live and of the same device's primary context.
        unsafe { raw::record(self.raw, stream.raw()) }
    }

    /// Whether the last record has completed (true for an event never recorded).
    ///
    /// # Errors
    /// [`CaptureError::IllegalCall`](crate::CaptureError::IllegalCall) on a thread that is
    /// capturing; the driver's error.
    #[doc(alias = "cuEventQuery")]
    pub fn is_complete(&self) -> Result<bool> {
        refuse_in_capture(|| None, "CudaEvent::is_complete")?;
        let _bound = self.ctx.bind()?;
        // SAFETY: self.raw is live.
        unsafe { raw::query(self.raw) }
    }

    /// Blocks until the last record has completed.
    ///
    /// # Errors
    /// [`CaptureError::IllegalCall`](crate::CaptureError::IllegalCall) on a thread that is
    /// capturing; the driver's error, including errors of the work it waited for.
    #[doc(alias = "cuEventSynchronize")]
    pub fn synchronize(&self) -> Result<()> {
        refuse_in_capture(|| None, "CudaEvent::synchronize")?;
        let _bound = self.ctx.bind()?;
        // SAFETY: self.raw is live.
        unsafe { raw::synchronize(self.raw) }
    }

    /// Milliseconds from `start`'s record to this event's record. Both must have been created with
    /// timing and have completed.
    ///
    /// # Errors
    /// [`CudaError::EventWithoutTiming`] when either event was created without timing and
    /// [`CudaError::WrongDevice`] for events of different devices (both checked before the driver is
    /// called); the driver's error otherwise (`CUDA_ERROR_NOT_READY` before completion).
    #[doc(alias = "cuEventElapsedTime")]
    pub fn elapsed_ms(&self, start: &CudaEvent) -> Result<f32> {
        if !self.timing || !start.timing {
            return Err(CudaError::EventWithoutTiming);
        }
        if start.ctx.ordinal() != self.ctx.ordinal() {
            return Err(CudaError::WrongDevice {
                what: "CudaEvent::elapsed_ms: both events must be on one device",
                expected: self.ctx.ordinal(),
                found: start.ctx.ordinal(),
            });
        }
        let _bound = self.ctx.bind()?;
        // SAFETY: both events are live; the driver checks timing and completion.
        unsafe { raw::elapsed_ms(start.raw, self.raw) }
    }

    /// Whether the event keeps timestamps.
    pub fn has_timing(&self) -> bool {
        self.timing
    }

    /// The event's context.
    pub fn context(&self) -> &Arc<Context> {
        &self.ctx
    }

    /// The event's device ordinal.
    pub fn ordinal(&self) -> i32 {
        self.ctx.ordinal()
    }

    /// The raw handle (valid while `self` lives).
    pub fn raw(&self) -> CUevent {
        self.raw
    }
}

impl Drop for CudaEvent {
    fn drop(&mut self) {
        let result = self.ctx.bind().and_then(|_bound| {
            // SAFETY: the event is owned and this is its last use; a pending record is released
            // by the driver once it completes.
            unsafe { raw::destroy(self.raw) }
        });
        if let Err(e) = result {
            super::record_drop_error(e);
        }
    }
}

/// The stream's record of and wait for an event.
impl CudaStream {
    /// Makes later work on this stream wait for `event`'s last record (which may be on any
    /// device).
    ///
    /// # Errors
    /// [`CaptureError::IllegalCall`](crate::CaptureError::IllegalCall) on a capturing stream (a
    /// wait there joins the event's stream into the capture; use
    /// [`StreamCapture::wait_external`](crate::StreamCapture::wait_external)); the driver's error.
    #[doc(alias = "cuStreamWaitEvent")]
    #[inline]
    pub fn wait(&self, event: &CudaEvent) -> Result<()> {
        let _gate = self.enqueue_gate_uncaptured("CudaStream::wait on a capturing stream")?;
        let _bound = self.context().bind()?;
        // SAFETY: both handles are live while their wrappers live.
        unsafe { raw_stream::wait_event(self.raw(), event.raw()) }
    }

    /// Records `event` here; see [`CudaEvent::record`].
    ///
    /// # Errors
    /// As [`CudaEvent::record`].
    pub fn record(&self, event: &CudaEvent) -> Result<()> {
        event.record(self)
    }
}
