//! Whether a call on a stream needs the stream's context current: decided once per process.
//!
//! The driver documents stream-ordered calls on a created stream as working in the stream's own
//! context (`cuMemAllocAsync` allocates from "the memory pool current to the stream's device" and
//! fails for want of a current context only on the default stream; a `CUkernel` launch takes its
//! context "from the specified stream"), and driver 580 does so with another context current or
//! none for event records and waits, stream-ordered allocations and frees, memsets and kernel
//! launches. Making those calls unbound saves each a `cuCtxGetCurrent`, and a call on another
//! device than the caller's current one two `cuCtxSetCurrent`.
//!
//! Copies always bind: the driver checks a copy's addresses in the current context (on driver
//! 580 a peer `cuMemcpyAsync` on device 0's stream, with device 1's context current, fails with
//! `CUDA_ERROR_INVALID_VALUE`), and it could take pinned memory of another context for pageable
//! memory. NCCL calls and graph launches bind too.
//!
//! Nothing is assumed: the first [`Context::primary`](super::Context::primary) of the process
//! makes each kind of unbound call once with no context current — an event record and a wait, a
//! stream-ordered allocation, a memset and a free — and reads the memset's bytes back. Only when
//! every call succeeded and every byte arrived are those calls made unbound
//! ([`StreamCalls::Unbound`]); otherwise, or with `PPNRT_BIND_STREAM_CALLS=1`, every call binds
//! its context first ([`StreamCalls::Bound`]). A kernel launch that the driver refuses unbound
//! (`CUDA_ERROR_INVALID_CONTEXT`) is made again bound, and from then on every call binds.
//!
//! Threading: the decision is one atomic, written once (or once more, to
//! [`StreamCalls::Bound`]), read with relaxed loads.

use std::sync::atomic::{AtomicU8, Ordering};

use super::context::{BoundContext, Context};
use crate::error::Result;
use crate::result::{context as raw_context, event as raw_event, memory, stream as raw_stream};
use crate::sys::{CUdeviceptr, CUevent, CUstream};

/// How this process makes stream-ordered calls other than copies (memsets, kernel launches,
/// event records and waits, stream-ordered allocations and frees): with the stream's context
/// bound first, or unbound where the driver makes them in the stream's context anyway. Copies
/// always bind (the driver checks their addresses in the current context). Decided when the
/// process retains its first context, by making each kind of call once with no context current
/// and checking the result; `PPNRT_BIND_STREAM_CALLS=1` ([`BIND_STREAM_CALLS_VAR`]) forces
/// binding.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StreamCalls {
    /// No context has been retained yet: nothing is decided.
    Undecided,
    /// The driver does stream-ordered calls in the stream's context whatever is current: they
    /// are made without binding.
    Unbound,
    /// Every call binds its context first (the driver refused an unbound call, or
    /// `PPNRT_BIND_STREAM_CALLS=1`).
    Bound,
}

const UNDECIDED: u8 = 0;
const UNBOUND: u8 = 1;
const BOUND: u8 = 2;

static STREAM_CALLS: AtomicU8 = AtomicU8::new(UNDECIDED);

/// The environment variable that makes every call bind its context (`1`).
pub const BIND_STREAM_CALLS_VAR: &str = "PPNRT_BIND_STREAM_CALLS";

/// How this process makes calls on a stream: decided when the first context is retained.
pub fn stream_calls() -> StreamCalls {
    match STREAM_CALLS.load(Ordering::Relaxed) {
        UNBOUND => StreamCalls::Unbound,
        BOUND => StreamCalls::Bound,
        _ => StreamCalls::Undecided,
    }
}

#[inline]
fn unbound() -> bool {
    STREAM_CALLS.load(Ordering::Relaxed) == UNBOUND
}

/// From now on every call binds its context (the driver refused a call made unbound).
pub(crate) fn bind_from_now_on() {
    STREAM_CALLS.store(BOUND, Ordering::Relaxed);
}

/// Decides, once per process, how calls on a stream are made, probing with `ctx` (just retained).
pub(crate) fn decide(ctx: &Context) {
    if STREAM_CALLS.load(Ordering::Acquire) != UNDECIDED {
        return;
    }
    let forced = std::env::var(BIND_STREAM_CALLS_VAR).is_ok_and(|value| value == "1");
    // A probe that fails for any reason (out of memory, say) decides for binding.
    let decision = if !forced && probe(ctx).unwrap_or(false) { UNBOUND } else { BOUND };
    let _ = STREAM_CALLS.compare_exchange(UNDECIDED, decision, Ordering::AcqRel, Ordering::Acquire);
}

impl Context {
    /// Binds this context for stream-ordered calls on one of its streams, unless the driver makes
    /// those in the stream's context anyway (then nothing is called). Only for scopes that make
    /// nothing but such calls; others use [`bind`](Self::bind).
    #[inline]
    pub(crate) fn bind_stream(&self) -> Result<BoundContext<'_>> {
        if unbound() { Ok(BoundContext::unchanged()) } else { self.bind() }
    }

    /// [`bind_stream`](Self::bind_stream) for the whole of one of this crate's calls (see
    /// [`bind_for_call`](Self::bind_for_call)).
    #[inline]
    pub(crate) fn bind_stream_for_call(&self) -> Result<BoundContext<'_>> {
        if unbound() { Ok(BoundContext::unchanged()) } else { self.bind_for_call() }
    }
}

/// Whether the driver makes every kind of stream-ordered call this crate uses in the stream's
/// context with no context current, and does the work: `Ok(false)` when it refuses one (or does
/// it wrong).
fn probe(ctx: &Context) -> Result<bool> {
    let _bound = ctx.bind()?;
    let stream = raw_stream::create_non_blocking()?;
    let result = raw_event::create(false).and_then(|event| {
        let result = probe_with(ctx, stream, event);
        // SAFETY: the event was created above and is not used after this; a pending record is
        // released by the driver.
        let destroyed = unsafe { raw_event::destroy(event) };
        result.and_then(|works| destroyed.map(|()| works))
    });
    // SAFETY: the stream was created above, drained in probe_with (or its work is abandoned
    // with the context's error), and is not used after this.
    let destroyed = unsafe { raw_stream::destroy(stream) };
    result.and_then(|works| destroyed.map(|()| works))
}

/// The bytes the probe writes and reads back.
const PROBE_BYTES: usize = 256;
const PROBE_PATTERN: u8 = 0x5a;

fn probe_with(ctx: &Context, stream: CUstream, event: CUevent) -> Result<bool> {
    // Plain memory when there are no pools (the stream-ordered allocation is then not probed).
    let plain = if ctx.memory_pools_supported() { None } else { Some(memory::alloc(PROBE_BYTES)?) };
    // SAFETY: null unbinds the calling thread's context; `ctx` is bound again right after.
    let unbound = unsafe { raw_context::set_current(std::ptr::null_mut()) }.map_err(|_| None).and_then(|()| {
        // SAFETY: the stream and event are live and of `ctx`; the memory is PROBE_BYTES long
        // (allocated on this stream, or the plain block) and used only on this stream.
        unsafe { unbound_calls(stream, event, plain) }
    });
    // SAFETY: `ctx` is retained for as long as it lives.
    let rebound = unsafe { raw_context::set_current(ctx.raw()) };
    rebound.clone()?;
    let mut host = [0u8; PROBE_BYTES];
    let block = match unbound {
        Ok(block) => Some(block),
        Err(block) => block,
    };
    let checked = match (unbound.is_ok(), block) {
        (true, Some(block)) => {
            // SAFETY: the block is PROBE_BYTES long and written only on this stream; `host` is
            // writable for its length (pageable: the copy has completed when the call returns).
            unsafe { memory::memcpy_dtoh_async(host.as_mut_ptr().cast(), block, PROBE_BYTES, stream) }
        }
        _ => Ok(()),
    };
    let mut freed_unbound = false;
    if let (Some(block), None) = (block, plain) {
        if unbound.is_ok() {
            // SAFETY: null unbinds; `ctx` is bound again right after.
            freed_unbound = unsafe { raw_context::set_current(std::ptr::null_mut()) }.is_ok()
                // SAFETY: the block came from the probe's stream-ordered allocation, is freed
                // once, and its uses are on this stream.
                && unsafe { memory::free_async(block, stream) }.is_ok();
            // SAFETY: `ctx` is retained for as long as it lives.
            unsafe { raw_context::set_current(ctx.raw())? };
        }
        if !freed_unbound {
            // SAFETY: as above; the unbound free was refused (or not tried), so not made.
            unsafe { memory::free_async(block, stream)? };
        }
    }
    // SAFETY: the stream is live; this waits for everything the probe enqueued.
    let drained = unsafe { raw_stream::synchronize(stream) };
    if let (Some(block), Ok(())) = (plain, &drained) {
        // SAFETY: from cuMemAlloc above; its uses have completed.
        unsafe { memory::free(block)? };
    }
    drained?;
    checked?;
    Ok(unbound.is_ok() && (freed_unbound || plain.is_some()) && host.iter().all(|&byte| byte == PROBE_PATTERN))
}

/// The probe's calls with no context current: an event record and a wait, an allocation (unless
/// `plain` is given) and a memset of it. Returns the block; on the first refusal, the block if
/// one was allocated.
///
/// # Safety
/// As stated at the call in [`probe_with`].
unsafe fn unbound_calls(
    stream: CUstream,
    event: CUevent,
    plain: Option<CUdeviceptr>,
) -> std::result::Result<CUdeviceptr, Option<CUdeviceptr>> {
    // SAFETY: as the caller promises.
    unsafe {
        raw_event::record(event, stream).map_err(|_| None)?;
        raw_stream::wait_event(stream, event).map_err(|_| None)?;
        let block = match plain {
            Some(block) => block,
            None => memory::alloc_async(PROBE_BYTES, stream).map_err(|_| None)?,
        };
        memory::memset_d8_async(block, PROBE_PATTERN, PROBE_BYTES, stream).map_err(|_| Some(block))?;
        Ok(block)
    }
}
