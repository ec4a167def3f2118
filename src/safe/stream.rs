//! Streams: the stream's own methods.
//!
//! A [`CudaStream`] owns its stream (or adopts one from another library, which it never
//! destroys) and holds its context alive; it is shared as `Arc<CudaStream>` and is `Send + Sync`:
//! work may be enqueued on it from any thread, the driver orders it by stream, not by thread.
//!
//! Here: creation and adoption, the enqueue gate (held by every call that looks at the stream's
//! capture and then enqueues), the begin and end of its capture under the gate (the registry and
//! its policy are `capture`'s, the guard `graph`'s), the event after the work enqueued so far
//! (for the ordering rule's marks), `join`, `synchronize`, `settle`. The stream's other methods
//! live with what they take: its event waits and records beside [`CudaEvent`](super::CudaEvent)
//! (`event`), copies and memsets in `copy`, `launch` in `launch`, `begin_capture` in `graph`.

use std::any::Any;
use std::cell::Cell;
use std::marker::PhantomData;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering, fence};
use std::sync::{Arc, Mutex, MutexGuard};

use super::capture::{CaptureState, refuse_in_capture};
use super::context::Context;
use super::event_pool::{PooledEvent, StreamEvent};
use crate::cuda_error::{CaptureError, CudaError, Result};
use crate::result::event as raw_event;
use crate::result::stream as raw;
use crate::sys::CUstream;

/// A CUDA stream of one context: owned (created non-blocking, destroyed on drop) or adopted
/// from another library (never destroyed by this crate). Shared as `Arc<CudaStream>`.
///
/// ```no_run
/// use ppnrt::{CudaSlice, CudaStream};
/// # fn main() -> ppnrt::Result<()> {
/// let engine = ppnrt::Engine::new(0)?;
/// let stream = CudaStream::new(engine.context())?; // another stream of the device
/// let x = engine.htod(&[1.0f32; 1024])?; // on the engine's stream
/// let mut y = CudaSlice::<f32>::alloc(&stream, 1024)?;
/// stream.memcpy_dtod(&x, &mut y)?; // waits for x's upload first, on the device
/// let mut host = vec![0.0f32; 1024];
/// stream.memcpy_dtoh(&y, &mut host)?; // returns once copied
/// assert_eq!(host[0], 1.0);
/// # Ok(()) }
/// ```
#[derive(Debug)]
pub struct CudaStream {
    ctx: Arc<Context>,
    raw: CUstream,
    owned: bool,
    /// Counts the begins and ends of captures through this crate: odd while one is active (read
    /// without the lock below). A begin counts before the driver begins, an end after it ends.
    capture_epoch: AtomicUsize,
    /// That capture.
    capture: Mutex<Option<Arc<CaptureState>>>,
    /// The enqueue gate ([`enqueue_gate`](Self::enqueue_gate)): the number of calls in progress
    /// that checked whether this stream is capturing and will enqueue on it, plus
    /// [`GATE_EXCLUSIVE`] while a capture of it begins or ends.
    gate: AtomicUsize,
    /// This wrapper's identity, never given to another: see [`id`](Self::id).
    id: u64,
    /// The context's device ordinal, kept beside the handle: every launch and copy compares it.
    ordinal: i32,
    /// What keeps an adopted stream alive ([`adopt_owned`](Self::adopt_owned)): the other
    /// library's handle of it, released only after the wrapper's last use.
    keep_alive: Option<Box<dyn Any + Send + Sync>>,
    /// Scoped lends of another library's memory whose end orders on this stream, in progress
    /// ([`lend_scope`](Self::lend_scope)): no capture of the stream may begin meanwhile.
    lends: AtomicUsize,
}

/// The next [`CudaStream::id`].
static NEXT_STREAM_ID: AtomicU64 = AtomicU64::new(1);

/// The enqueue gate's bit for a capture beginning or ending.
const GATE_EXCLUSIVE: usize = 1 << (usize::BITS - 1);

thread_local! {
    /// The stream whose launch is running a caller's kernel-argument code on this thread (null
    /// when none): that thread holds the stream's enqueue gate, so a capture of it cannot begin
    /// or end there by waiting for the gate.
    static LAUNCHING_ON: Cell<*const CudaStream> = const { Cell::new(std::ptr::null()) };

    /// The stream whose enqueue gate this thread's outermost shared hold counts (null when it
    /// holds none that way): a hold of that stream's gate taken inside it needs no count of its
    /// own (see [`CudaStream::enqueue_gate`]).
    static GATE_HELD: Cell<*const CudaStream> = const { Cell::new(std::ptr::null()) };
}

/// A stream's enqueue gate, held shared (`held` 1, see [`CudaStream::enqueue_gate`]),
/// exclusively (`held` [`GATE_EXCLUSIVE`], to begin or end a capture), or inside this thread's
/// counted shared hold of it (`held` 0: the outer hold keeps the gate; this one gives back
/// nothing).
pub(crate) struct EnqueueGate<'a> {
    stream: &'a CudaStream,
    held: usize,
    /// Whether this hold is the one [`GATE_HELD`] names, cleared when it drops.
    marked: bool,
    /// A gate is held and given back by one thread ([`GATE_HELD`] is the thread's).
    _not_send: PhantomData<*const ()>,
}

impl EnqueueGate<'_> {
    /// Whether this is `stream`'s gate.
    #[inline]
    pub(crate) fn holds(&self, stream: &CudaStream) -> bool {
        std::ptr::eq(self.stream, stream)
    }
}

impl Drop for EnqueueGate<'_> {
    #[inline]
    fn drop(&mut self) {
        if self.marked {
            // Before the count: from here on this thread's holds of the stream count again.
            let _ = GATE_HELD.try_with(|held| held.set(std::ptr::null()));
        }
        if self.held != 0 {
            self.stream.gate.fetch_sub(self.held, Ordering::Release);
        }
    }
}

/// [`refuse_in_capture`] for a call concerning `stream` (if any), whose own capture counts too
/// (read only while some capture is active): the check of [`CudaStream::refuse_in_capture`], which
/// the door (`enqueue`) calls directly on its capture path, so that the check stays one call
/// there.
#[inline]
pub(crate) fn refuse_on(stream: Option<&CudaStream>, call: &'static str) -> Result<()> {
    refuse_in_capture(move || stream.and_then(CudaStream::capture), call)
}

/// Waits a little, longer on each call: a gate is held only for the span of one call.
pub(crate) fn back_off(round: &mut u32) {
    *round += 1;
    if *round < 64 {
        std::hint::spin_loop();
    } else {
        std::thread::yield_now();
    }
}

// SAFETY: a CUstream may be used from any thread; the driver orders work per stream, not per
// thread.
unsafe impl Send for CudaStream {}
// SAFETY: as above; all methods take &self and call thread-safe driver entry points.
unsafe impl Sync for CudaStream {}

impl CudaStream {
    /// Creates a non-blocking stream (it does not synchronise with the legacy default stream).
    ///
    /// # Errors
    /// The driver's error.
    #[doc(alias = "cuStreamCreate")]
    pub fn new(ctx: &Arc<Context>) -> Result<Arc<CudaStream>> {
        let _bound = ctx.bind()?;
        let raw = raw::create_non_blocking()?;
        Ok(Arc::new(CudaStream::wrap(ctx, raw, true)))
    }

    /// Wraps a stream created elsewhere (a `cudaStream_t` from cuBLAS or PyTorch is a
    /// `CUstream`). The stream is not destroyed when the wrapper drops.
    ///
    /// # Safety
    /// - `stream` is a live stream of `ctx` (or null for the legacy default stream of `ctx`).
    /// - It stays live for as long as the returned wrapper and everything holding it live.
    pub unsafe fn adopt(ctx: &Arc<Context>, stream: CUstream) -> Arc<CudaStream> {
        Arc::new(CudaStream::wrap(ctx, stream, false))
    }

    /// Wraps a stream that another library owns, keeping it alive by ownership: `owner` (that
    /// library's handle of the stream, e.g. cudarc's `Arc<cudarc::driver::CudaStream>`) is held
    /// by the wrapper and dropped after its last use, so the stream lives as long as anything
    /// of this crate holds the wrapper (a runtime's stage stream, a slice it owns). The stream is
    /// not destroyed by the wrapper; dropping `owner` may destroy it, and runs with the wrapper's
    /// context current, the thread's current context put back afterwards (the crate's context
    /// rule holds across the other library's drop).
    ///
    /// # Safety
    /// `stream` is a live stream of `ctx` (or null for the legacy default stream of `ctx`) for as
    /// long as `owner` lives.
    pub unsafe fn adopt_owned(
        ctx: &Arc<Context>,
        stream: CUstream,
        owner: Box<dyn Any + Send + Sync>,
    ) -> Arc<CudaStream> {
        let mut wrapper = CudaStream::wrap(ctx, stream, false);
        wrapper.keep_alive = Some(owner);
        Arc::new(wrapper)
    }

    fn wrap(ctx: &Arc<Context>, raw: CUstream, owned: bool) -> CudaStream {
        CudaStream {
            ctx: Arc::clone(ctx),
            raw,
            owned,
            capture_epoch: AtomicUsize::new(0),
            capture: Mutex::new(None),
            gate: AtomicUsize::new(0),
            id: NEXT_STREAM_ID.fetch_add(1, Ordering::Relaxed),
            ordinal: ctx.ordinal(),
            keep_alive: None,
            lends: AtomicUsize::new(0),
        }
    }

    /// A number that identifies this wrapper for the life of the process: unlike the raw handle,
    /// which the driver may give to a new stream once this one is destroyed, it is never reused.
    /// (Two wrappers of one adopted stream have two identities.)
    #[inline]
    pub(crate) fn id(&self) -> u64 {
        self.id
    }

    /// Whether a capture begun with [`begin_capture`](Self::begin_capture) is active on this
    /// stream.
    #[inline]
    pub fn is_capturing(&self) -> bool {
        self.capture_epoch.load(Ordering::Acquire) & 1 == 1
    }

    /// The active capture of this stream, if any.
    #[inline]
    pub(crate) fn capture(&self) -> Option<Arc<CaptureState>> {
        if !self.is_capturing() {
            return None;
        }
        self.active_capture()
    }

    /// [`capture`](Self::capture) once the stream was seen capturing.
    #[cold]
    fn active_capture(&self) -> Option<Arc<CaptureState>> {
        self.lock_capture().clone()
    }

    fn lock_capture(&self) -> MutexGuard<'_, Option<Arc<CaptureState>>> {
        self.capture.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Holds this stream's capture state still (no capture of it begins or ends) until the
    /// returned gate drops: taken by every call that checks whether the stream is capturing and
    /// then enqueues on it, around both. Shared: calls on one stream from several threads do not
    /// wait for each other, and a call may take it again inside (a free, a nested copy). It waits
    /// only while a capture's begin or end holds it exclusively, which waits for no other lock.
    ///
    /// A gate is held across the crate's own code, and across a caller's code only inside a
    /// launch's kernel arguments ([`run_launch_arguments`](Self::run_launch_arguments)).
    ///
    /// A thread's first shared hold (of any stream, while it holds none counted this way) is
    /// named in a thread-local; a hold of the same stream taken inside it (a nested copy, an
    /// allocation inside a receive) costs no atomic operation: the outer hold, which drops after
    /// it (holds are scoped, the inner in a callee), keeps the gate. Holds of other streams count
    /// as usual.
    #[inline(always)]
    pub(crate) fn enqueue_gate(&self) -> EnqueueGate<'_> {
        let me: *const CudaStream = self;
        let outer = GATE_HELD.try_with(Cell::get).ok();
        if outer == Some(me) {
            return EnqueueGate { stream: self, held: 0, marked: false, _not_send: PhantomData };
        }
        let mut round = 0;
        loop {
            if self.gate.fetch_add(1, Ordering::Acquire) & GATE_EXCLUSIVE == 0 {
                // Named only by the thread's outermost hold: the one that clears the name is
                // the one that set it, and it drops last.
                let marked =
                    outer.is_some_and(|outer| outer.is_null()) && GATE_HELD.try_with(|held| held.set(me)).is_ok();
                return EnqueueGate { stream: self, held: 1, marked, _not_send: PhantomData };
            }
            self.gate.fetch_sub(1, Ordering::Relaxed);
            while self.gate.load(Ordering::Relaxed) & GATE_EXCLUSIVE != 0 {
                back_off(&mut round);
            }
        }
    }

    /// [`enqueue_gate`](Self::enqueue_gate), refusing `call` (a call that cannot be captured)
    /// while a capture of this stream is active.
    ///
    /// # Errors
    /// While this stream is captured, the error of [`refuse_in_capture`](Self::refuse_in_capture)
    /// for `call`.
    #[inline]
    pub(crate) fn enqueue_gate_uncaptured(&self, call: &'static str) -> Result<EnqueueGate<'_>> {
        let gate = self.enqueue_gate();
        if self.is_capturing() {
            self.refuse_in_capture(call)?;
        }
        Ok(gate)
    }

    /// Runs a caller's kernel-argument code during a launch on this stream (whose enqueue gate
    /// this thread holds): a capture of this stream cannot begin or end in there.
    pub(crate) fn run_launch_arguments<R>(&self, f: impl FnOnce() -> R) -> R {
        struct Restore(*const CudaStream);
        impl Drop for Restore {
            fn drop(&mut self) {
                let _ = LAUNCHING_ON.try_with(|on| on.set(self.0));
            }
        }
        let _restore = Restore(LAUNCHING_ON.try_with(|on| on.replace(self)).unwrap_or(std::ptr::null()));
        f()
    }

    /// Whether this thread runs a caller's kernel-argument code inside a launch on this stream.
    fn launching_here(&self) -> bool {
        LAUNCHING_ON.try_with(|on| std::ptr::eq(on.get(), self)).unwrap_or(false)
    }

    /// The gate held exclusively, to begin or end a capture, once no call holds it; `None` inside
    /// a launch's kernel-argument code on this stream (this thread holds it there).
    fn gate_exclusive(&self) -> Option<EnqueueGate<'_>> {
        if self.launching_here() {
            return None;
        }
        let mut round = 0;
        while self.gate.compare_exchange_weak(0, GATE_EXCLUSIVE, Ordering::Acquire, Ordering::Relaxed).is_err() {
            back_off(&mut round);
        }
        Some(EnqueueGate { stream: self, held: GATE_EXCLUSIVE, marked: false, _not_send: PhantomData })
    }

    /// Begins a capture of this stream: under the stream's capture lock, records an event from the
    /// pool at the end of the stream, has `begin` start the driver's capture, and keeps the
    /// capture `make` builds from that event. `Ok(None)` when a capture is active already.
    pub(crate) fn claim_capture(
        &self,
        begin: impl FnOnce() -> Result<()>,
        make: impl FnOnce(Arc<PooledEvent>) -> Arc<CaptureState>,
    ) -> Result<Option<Arc<CaptureState>>> {
        let Some(_exclusive) = self.gate_exclusive() else {
            return Err(CudaError::Capture(CaptureError::CannotBegin {
                reason: "this thread is enqueueing work on the stream (inside a launch's kernel arguments)",
            }));
        };
        let mut held = self.lock_capture();
        if held.is_some() {
            return Ok(None);
        }
        if self.lends.load(Ordering::SeqCst) != 0 {
            // The lend's end orders on this stream: captured, it would order nothing.
            return Err(CudaError::Capture(CaptureError::CannotBegin {
                reason: "a buffer is lent on the stream for a scope (EngineStream::read, write or received_view)",
            }));
        }
        let before = Arc::new(PooledEvent::take(&self.ctx)?);
        self.record_pooled(&before)?;
        // Counted before the driver begins: a record that lands in the capture is followed by a
        // look at the count that sees it (see `event_after_enqueued`). Until the capture is kept
        // below, a look at it waits for this lock.
        self.capture_epoch.fetch_add(1, Ordering::SeqCst);
        if let Err(e) = begin() {
            self.capture_epoch.fetch_add(1, Ordering::SeqCst);
            return Err(e);
        }
        let capture = make(before);
        *held = Some(Arc::clone(&capture));
        Ok(Some(capture))
    }

    /// Marks a scoped lend of another library's memory, whose end orders on this stream, as in
    /// progress until the returned scope drops (in the lending function's frame): no capture of
    /// the stream begins meanwhile (a captured end would order nothing).
    ///
    /// # Errors
    /// [`CaptureError::IllegalCall`] naming `call` while the stream is capturing.
    #[cfg(feature = "cudarc-interop")]
    pub(crate) fn lend_scope(&self, call: &'static str) -> Result<LendScope<'_>> {
        let held = self.lock_capture();
        if held.is_none() {
            // Under the capture lock: a capture's begin, which looks at the count under it, sees it.
            self.lends.fetch_add(1, Ordering::SeqCst);
            return Ok(LendScope { stream: self });
        }
        drop(held);
        self.refuse_in_capture(call)?;
        Err(CudaError::Capture(CaptureError::IllegalCall { call }))
    }

    /// Ends this stream's capture: `end` ends the driver's capture under the stream's capture
    /// lock, and the capture is cleared with it. (Inside a launch's kernel arguments on this
    /// stream, the gate is not taken: ending the capture there is outside the launch's contract.)
    pub(crate) fn release_capture<R>(&self, end: impl FnOnce() -> R) -> R {
        let _exclusive = self.gate_exclusive();
        let mut held = self.lock_capture();
        let ended = end();
        self.capture_epoch.fetch_add(1, Ordering::SeqCst);
        *held = None;
        ended
    }

    /// An event that completes once all the work enqueued on this stream so far has: `reuse` when
    /// it is this stream context's own, else one from the pool, recorded now at the end of the
    /// stream.
    ///
    /// While a capture begun through this crate is active, a record would land in the capture
    /// (and a stream waiting for it would join the capture): the event recorded when the capture
    /// began stands in, as all the stream's work outside the capture came before it.
    ///
    /// Takes this stream's enqueue gate around the record, like every call that enqueues on a
    /// stream: it is called for other streams' buffers too (a mark's event recorded when another
    /// stream first waits for it), from threads that hold no gate of this stream, and the driver
    /// does not survive a capture of the stream beginning or ending while another thread records
    /// on it. The gate is shared, so holding another stream's meanwhile cannot deadlock (a
    /// capture's begin or end waits for no other lock while it holds the gate). Inside a launch's
    /// kernel arguments a capture may still end without the gate: a record that races with it is
    /// seen afterwards and replaced.
    pub(crate) fn event_after_enqueued(&self, mut reuse: Option<StreamEvent>) -> Result<StreamEvent> {
        let _gate = self.enqueue_gate();
        loop {
            let epoch = self.capture_epoch.load(Ordering::SeqCst);
            if epoch & 1 == 0 {
                let event = self.record_event(reuse.take())?;
                // A capture is counted before the driver begins it, and the driver orders the
                // begin and this record: had the record landed in a capture (even one that has
                // ended since), the count would have moved by now.
                fence(Ordering::SeqCst);
                if self.capture_epoch.load(Ordering::SeqCst) == epoch {
                    return Ok(StreamEvent::Own(event));
                }
                // A capture began meanwhile, and the record may be in it. This event goes back
                // to the pool, whose next user records it anew before anything waits for it.
            }
            if let Some(capture) = self.lock_capture().as_ref() {
                // All the stream's work outside the capture came before this event.
                return Ok(StreamEvent::Shared(Arc::clone(capture.before())));
            }
            // The capture ended in between: record again, outside it.
        }
    }

    /// Sets `event` to an event after the work enqueued so far, as
    /// [`event_after_enqueued`](Self::event_after_enqueued) with `event` to reuse; `gate` is this
    /// stream's enqueue gate when the caller holds it. Under the gate, while the stream is not
    /// capturing, no capture of it can begin until the gate drops: the record needs no second
    /// look at the capture count, and an event of this stream's context is recorded again where
    /// it is (a wait already made on it keeps what it captured). On failure `event` is left
    /// empty.
    #[inline]
    pub(crate) fn record_after_enqueued(
        &self,
        gate: Option<&EnqueueGate<'_>>,
        event: &mut Option<StreamEvent>,
    ) -> Result<()> {
        if !gate.is_some_and(|gate| gate.holds(self)) || self.is_capturing() {
            *event = Some(self.event_after_enqueued(event.take())?);
            return Ok(());
        }
        if let Some(StreamEvent::Own(own)) = event {
            if Arc::ptr_eq(own.context(), &self.ctx) {
                if let Err(e) = self.record_pooled(own) {
                    *event = None;
                    return Err(e);
                }
                return Ok(());
            }
        }
        *event = Some(StreamEvent::Own(self.record_event(event.take())?));
        Ok(())
    }

    /// Records `reuse` at the end of this stream when it is this stream context's own event (a
    /// wait already made on it keeps what it captured), else an event from the pool.
    fn record_event(&self, reuse: Option<StreamEvent>) -> Result<PooledEvent> {
        let event = match reuse {
            Some(StreamEvent::Own(event)) if Arc::ptr_eq(event.context(), &self.ctx) => event,
            _ => PooledEvent::take(&self.ctx)?,
        };
        self.record_pooled(&event)?;
        Ok(event)
    }

    /// Refuses `call`, which cannot be captured, while it would break a capture (of this stream,
    /// of the calling thread, or a global one).
    pub(crate) fn refuse_in_capture(&self, call: &'static str) -> Result<()> {
        refuse_on(Some(self), call)
    }

    /// The stream's context.
    pub fn context(&self) -> &Arc<Context> {
        &self.ctx
    }

    /// The stream's device ordinal.
    #[inline]
    pub fn ordinal(&self) -> i32 {
        self.ordinal
    }

    /// The raw handle (valid while `self` lives).
    pub fn raw(&self) -> CUstream {
        self.raw
    }

    /// Whether this wrapper created (and will destroy) the stream.
    pub fn is_owned(&self) -> bool {
        self.owned
    }

    /// Blocks until all work enqueued so far has completed.
    ///
    /// # Errors
    /// [`CaptureError::IllegalCall`](crate::CaptureError::IllegalCall) during a capture it would
    /// break; the driver's error, including errors of earlier asynchronous work.
    #[doc(alias = "cuStreamSynchronize")]
    pub fn synchronize(&self) -> Result<()> {
        let _gate = self.enqueue_gate();
        self.refuse_in_capture("CudaStream::synchronize")?;
        let _bound = self.ctx.bind()?;
        // SAFETY: self.raw is live while self lives.
        unsafe { raw::synchronize(self.raw) }
    }

    /// Whether all work enqueued so far has completed.
    ///
    /// # Errors
    /// [`CaptureError::IllegalCall`](crate::CaptureError::IllegalCall) during a capture it would
    /// break; the driver's error.
    #[doc(alias = "cuStreamQuery")]
    pub fn is_idle(&self) -> Result<bool> {
        let _gate = self.enqueue_gate();
        self.refuse_in_capture("CudaStream::is_idle")?;
        let _bound = self.ctx.bind()?;
        // SAFETY: self.raw is live while self lives.
        unsafe { raw::query(self.raw) }
    }

    /// Makes later work on this stream wait for the last record of a pooled event (of any
    /// context).
    #[inline]
    pub(crate) fn wait_pooled(&self, event: &PooledEvent) -> Result<()> {
        let _bound = self.ctx.bind()?;
        // SAFETY: both handles are live while their wrappers (borrowed here) live.
        unsafe { raw::wait_event(self.raw, event.raw()) }
    }

    /// Records the pooled `event` (of this stream's context) at the current end of this stream.
    #[inline(always)]
    pub(crate) fn record_pooled(&self, event: &PooledEvent) -> Result<()> {
        debug_assert!(Arc::ptr_eq(event.context(), &self.ctx), "pooled events are recorded in their own context");
        // The event's context (the stream's): its handle is at hand where the event was just
        // compared with the stream's.
        let _bound = event.context().bind()?;
        // SAFETY: both handles are live and of the same context.
        unsafe { raw_event::record(event.raw(), self.raw) }
    }

    /// Orders this stream after all work enqueued so far on `other`: a no-op when `other` is this
    /// stream, else a wait on an event (from `other`'s context's pool) recorded on `other` now. No
    /// query: usable while a stream is captured into a graph. Buffers need no join (copies and
    /// launches order them, see the `safe` module docs); this is for work the crate cannot see.
    ///
    /// # Errors
    /// [`CaptureError::IllegalCall`](crate::CaptureError::IllegalCall) when either stream is
    /// capturing; the driver's error.
    pub fn join(&self, other: &CudaStream) -> Result<()> {
        if self.raw == other.raw && Arc::ptr_eq(&self.ctx, &other.ctx) {
            return Ok(());
        }
        let _gate = self.enqueue_gate();
        if self.is_capturing() || other.is_capturing() {
            self.refuse_in_capture("CudaStream::join with a capturing stream")?;
            other.refuse_in_capture("CudaStream::join with a capturing stream")?;
        }
        let event = other.event_after_enqueued(None)?;
        self.wait_pooled(&event)
    }
}

impl CudaStream {
    /// Passes `result` through; when it is an error, first waits for everything enqueued on this
    /// stream. Calls that enqueue work and then fail in a step that protects it (an event record,
    /// a join back into an owner) use it so that no work outlives their `Err` unordered: after
    /// the wait the work has completed, or the context is lost and it never runs (that error is
    /// kept for [`take_drop_errors`](crate::take_drop_errors)).
    #[inline(always)]
    pub(crate) fn settle<T>(&self, result: Result<T>) -> Result<T> {
        if result.is_err() {
            self.settle_after_failure();
        }
        result
    }

    /// The wait of [`settle`](Self::settle) after a failure (its error kept for
    /// [`take_drop_errors`](crate::take_drop_errors)).
    #[cold]
    #[inline(never)]
    fn settle_after_failure(&self) {
        if let Err(e) = self.synchronize() {
            super::record_drop_error(e);
        }
    }
}

/// A scoped lend in progress on a stream ([`CudaStream::lend_scope`]).
#[cfg(feature = "cudarc-interop")]
pub(crate) struct LendScope<'a> {
    stream: &'a CudaStream,
}

#[cfg(feature = "cudarc-interop")]
impl Drop for LendScope<'_> {
    fn drop(&mut self) {
        self.stream.lends.fetch_sub(1, Ordering::SeqCst);
    }
}

impl Drop for CudaStream {
    fn drop(&mut self) {
        if let Some(owner) = self.keep_alive.take() {
            // The other library's drop of its handle may bind its context (cudarc's does, to
            // destroy the stream): under the crate's context rule.
            self.ctx.call_foreign(|| drop(owner));
        }
        if !self.owned {
            return;
        }
        let result = self.ctx.bind().and_then(|_bound| {
            // SAFETY: the stream is owned and this is its last use; work still queued on it
            // completes, the driver releases the stream afterwards.
            unsafe { raw::destroy(self.raw) }
        });
        if let Err(e) = result {
            super::record_drop_error(e);
        }
    }
}
