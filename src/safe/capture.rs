//! The capture registry and its policy: which captures are active ([`CaptureState`], one per
//! capture, held by its stream, its guard and the registries here), which calls are refused while
//! which stream captures ([`refuse_in_capture`], [`queries_allowed`]), and which frees must wait
//! or go elsewhere ([`free_blocked`]).
//!
//! Calls that cannot be part of a graph — synchronising, querying, waiting on the host, copying
//! to or from host memory, `cuMemAlloc`, a peer copy the driver stages, a plain event record or
//! wait that would fork the capture into another stream — are refused with
//! [`CaptureError::IllegalCall`] naming the call, before the driver sees them, when made on the
//! capturing stream or (for captures not in [`CaptureMode::Relaxed`]) on the capturing thread,
//! or (for [`CaptureMode::Global`]) on any thread. The capture is then invalidated: ending it
//! gives [`CaptureError::Invalidated`]. Frees that would land in a capture or break it (device
//! memory, pinned host buffers) are held back and done when the capture ends, or handed to
//! another thread when only this thread's captures forbid them (`reaper`).
//!
//! The checks take the capture of the stream a call concerns as a closure
//! (`CudaStream::capture`), read only while some capture is active anywhere: the common case
//! (none) costs one atomic load. The stream, the events, the ordering rule and the frees read
//! this file; it reads none of them but the event pool (a capture's event) and, for one tie,
//! memory.
//!
//! The one tie upward: a capture's *footprint* (the allocations its work touches, each with its
//! [`Use`]) holds the device memory alive ([`DeviceMemory`], with the ordering rule's `Use`), so
//! that the graph made from it can run on that memory after its slices are dropped. It is
//! recorded here because the capture is the one object every enqueue on the capturing stream
//! reaches (`CudaStream::capture`); the graph (`graph`) takes it when the capture ends.
//! Allocations dropped during the capture are held the other way, type-erased
//! (`deferred_frees`).
//!
//! Threading: the global registry is behind a mutex, the thread registry is the thread's, and a
//! capture's record is behind its own mutex, held only to add to it.

use std::cell::RefCell;
use std::fmt;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use super::event_pool::PooledEvent;
use super::memory::DeviceMemory;
use super::ordering::Use;
use crate::cuda_error::{CaptureError, CudaError, Result};
use crate::sys::CUstreamCaptureMode;

/// How a capture restricts calls made outside the captured stream (`CUstreamCaptureMode`).
///
/// ```no_run
/// use ppnrt::CaptureMode;
/// # fn main() -> ppnrt::Result<()> {
/// let engine = ppnrt::Engine::new(0)?;
/// let stream = ppnrt::CudaStream::new(engine.context())?;
/// // Other threads go on with their own work while this one captures.
/// let capture = stream.begin_capture(CaptureMode::ThreadLocal)?;
/// // ... the work to capture, on `stream` ...
/// let graph = capture.end()?;
/// # drop(graph);
/// # Ok(()) }
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CaptureMode {
    /// Calls that cannot be captured are refused on every thread while the capture lasts.
    Global,
    /// Calls that cannot be captured are refused on the capturing thread (the usual choice: other
    /// threads go on with their own work).
    ThreadLocal,
    /// Only calls on the captured stream itself are restricted.
    Relaxed,
}

impl CaptureMode {
    /// The driver's value.
    pub(crate) fn raw(self) -> CUstreamCaptureMode {
        match self {
            CaptureMode::Global => CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_GLOBAL,
            CaptureMode::ThreadLocal => CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL,
            CaptureMode::Relaxed => CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED,
        }
    }
}

/// What one capture has recorded so far.
#[derive(Default)]
pub(crate) struct Recorded {
    /// The allocations captured work touches, each with its strongest use.
    pub(crate) footprint: Vec<(Arc<DeviceMemory>, Use)>,
    /// The first call that invalidated the capture.
    pub(crate) invalidated_by: Option<&'static str>,
    /// Allocations (device memory, pinned host buffers) dropped while the capture was active:
    /// freed when it ends.
    pub(crate) deferred_frees: Vec<Box<dyn Send>>,
}

impl fmt::Debug for Recorded {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Recorded")
            .field("footprint", &self.footprint.len())
            .field("invalidated_by", &self.invalidated_by)
            .field("deferred_frees", &self.deferred_frees.len())
            .finish()
    }
}

/// One active capture, shared by its guard, its stream and the registries below.
#[derive(Debug)]
pub(crate) struct CaptureState {
    mode: CaptureMode,
    recorded: Mutex<Recorded>,
    /// Recorded on the stream just before the capture began: it completes after all the
    /// stream's work outside the capture (see
    /// [`CudaStream::event_after_enqueued`](super::stream::CudaStream::event_after_enqueued)).
    before: Arc<PooledEvent>,
}

impl CaptureState {
    /// A capture in `mode` whose stream recorded `before` just before it began; active once
    /// [`register`]ed.
    pub(crate) fn new(mode: CaptureMode, before: Arc<PooledEvent>) -> CaptureState {
        CaptureState { mode, recorded: Mutex::new(Recorded::default()), before }
    }

    /// The capture's mode.
    pub(crate) fn mode(&self) -> CaptureMode {
        self.mode
    }

    /// The event recorded on the stream just before the capture began.
    pub(crate) fn before(&self) -> &Arc<PooledEvent> {
        &self.before
    }

    fn lock(&self) -> MutexGuard<'_, Recorded> {
        self.recorded.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    fn invalidate(&self, call: &'static str) {
        self.lock().invalidated_by.get_or_insert(call);
    }

    /// Adds `memory` with `use_` to the footprint (a write supersedes a read).
    pub(crate) fn add(&self, memory: &Arc<DeviceMemory>, use_: Use) {
        // A graph's launch orders its footprint as a whole: any write is a write there.
        let use_ = if use_ == Use::Read { Use::Read } else { Use::Write };
        let mut recorded = self.lock();
        match recorded.footprint.iter_mut().find(|(held, _)| Arc::ptr_eq(held, memory)) {
            Some((_, held_use)) => {
                if use_ == Use::Write {
                    *held_use = Use::Write;
                }
            }
            None => recorded.footprint.push((Arc::clone(memory), use_)),
        }
    }

    /// Holds back the free of `allocation` (dropped when the capture ends).
    pub(crate) fn defer_free(&self, allocation: Box<dyn Send>) {
        self.lock().deferred_frees.push(allocation);
    }

    /// What the capture recorded, taken (once it has ended and is unregistered).
    pub(crate) fn take_recorded(&self) -> Recorded {
        std::mem::take(&mut *self.lock())
    }
}

/// Captures active anywhere in the process: the common case (none) costs one atomic load.
static ACTIVE: AtomicUsize = AtomicUsize::new(0);
/// Active captures in [`CaptureMode::Global`].
static GLOBAL: Mutex<Vec<Arc<CaptureState>>> = Mutex::new(Vec::new());

thread_local! {
    /// Active captures begun on this thread in a mode other than [`CaptureMode::Relaxed`].
    static THREAD: RefCell<Vec<Arc<CaptureState>>> = const { RefCell::new(Vec::new()) };
}

fn global() -> MutexGuard<'static, Vec<Arc<CaptureState>>> {
    GLOBAL.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// Registers `state`, a capture that has just begun on this thread: from now on the calls and
/// frees it forbids are refused or held back.
pub(crate) fn register(state: &Arc<CaptureState>) {
    ACTIVE.fetch_add(1, Ordering::AcqRel);
    match state.mode {
        CaptureMode::Global => global().push(Arc::clone(state)),
        CaptureMode::ThreadLocal => {
            let _ = THREAD.try_with(|captures| captures.borrow_mut().push(Arc::clone(state)));
        }
        CaptureMode::Relaxed => {}
    }
}

/// Unregisters `state`, a capture that has ended (on the thread that began it, for a capture
/// not in [`CaptureMode::Relaxed`]).
pub(crate) fn unregister(state: &Arc<CaptureState>) {
    match state.mode {
        CaptureMode::Global => global().retain(|held| !Arc::ptr_eq(held, state)),
        CaptureMode::ThreadLocal => {
            let _ = THREAD.try_with(|captures| captures.borrow_mut().retain(|held| !Arc::ptr_eq(held, state)));
        }
        CaptureMode::Relaxed => {}
    }
    ACTIVE.fetch_sub(1, Ordering::AcqRel);
}

/// The captures that a call which cannot be captured, made now on a stream whose capture `own`
/// gives (`|| None` for a call that concerns no stream), would break: the stream's own, this
/// thread's non-relaxed ones, and every global one.
#[inline]
fn affected(own: impl FnOnce() -> Option<Arc<CaptureState>>) -> Vec<Arc<CaptureState>> {
    if ACTIVE.load(Ordering::Acquire) == 0 {
        return Vec::new();
    }
    active_captures(own)
}

/// [`affected`] while some capture is active.
#[inline(never)]
fn active_captures(own: impl FnOnce() -> Option<Arc<CaptureState>>) -> Vec<Arc<CaptureState>> {
    let mut found: Vec<Arc<CaptureState>> = own().into_iter().collect();
    let _ = THREAD.try_with(|captures| found.extend(captures.borrow().iter().cloned()));
    found.extend(global().iter().cloned());
    found
}

/// Whether a call that cannot be captured, concerning no stream (an event query, say), may be
/// made on this thread now (no capture of this thread, and no global one, is active).
#[inline]
pub(crate) fn queries_allowed() -> bool {
    affected(|| None).is_empty()
}

/// Refuses `call` (a call that cannot be captured) while it would break a capture: see the
/// [module docs](self). `own` gives the capture of the stream the call concerns
/// (`CudaStream::capture`; `|| None` for none). Invalidates each capture it would break.
#[inline]
pub(crate) fn refuse_in_capture(own: impl FnOnce() -> Option<Arc<CaptureState>>, call: &'static str) -> Result<()> {
    let affected = affected(own);
    if affected.is_empty() {
        return Ok(());
    }
    for capture in &affected {
        capture.invalidate(call);
    }
    Err(CudaError::Capture(CaptureError::IllegalCall { call }))
}

/// Why a free of memory owned by a stream (or of host memory) cannot be made here and now
/// ([`free_blocked`]).
pub(crate) enum FreeBlocked {
    /// It would land in this capture (the owning stream's own) or break it for every thread (a global
    /// one): the capture holds the allocation and frees it when it ends.
    Capture(Arc<CaptureState>),
    /// Only captures begun on this thread (not relaxed) forbid it, and only on this thread:
    /// another thread frees it ([`free_elsewhere`](super::reaper::free_elsewhere)). A capture
    /// this thread forgot (`mem::forget`) then holds back no free of another stream's memory.
    /// The capture named holds the allocation when that thread cannot take it.
    ThisThread(Arc<CaptureState>),
}

impl FreeBlocked {
    /// Takes `allocation`, whose free this thread may not make now: into the capture, or to the
    /// freeing thread.
    pub(crate) fn hold(self, allocation: Box<dyn Send>) {
        match self {
            FreeBlocked::Capture(capture) => capture.defer_free(allocation),
            FreeBlocked::ThisThread(capture) => {
                if let Err(allocation) = super::reaper::free_elsewhere(allocation) {
                    capture.defer_free(allocation);
                }
            }
        }
    }
}

/// Whether a free of memory owned by a stream whose capture `own` gives (`CudaStream::capture`;
/// `|| None` for host memory) would land in or break a capture, and which way it must go
/// instead.
#[inline]
pub(crate) fn free_blocked(own: impl FnOnce() -> Option<Arc<CaptureState>>) -> Option<FreeBlocked> {
    if ACTIVE.load(Ordering::Acquire) == 0 {
        return None;
    }
    if let Some(own) = own() {
        return Some(FreeBlocked::Capture(own));
    }
    if let Some(everywhere) = global().first() {
        return Some(FreeBlocked::Capture(Arc::clone(everywhere)));
    }
    THREAD.try_with(|captures| captures.borrow().first().cloned()).ok().flatten().map(FreeBlocked::ThisThread)
}
