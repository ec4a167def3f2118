//! The stream's part of a boundary between processes whose order is carried by flag words two
//! processes share: the sender's copy, after a wait when the slot was not free yet, then a signal
//! ([`CudaStream::flagged_copy`]), and, where the copy came from another device, the receiver's
//! flush of what reached its device before the signal ([`CudaStream::flush_arrival`]); each one
//! pass through the door, so the buffers' ordering inside each process is the crate's rule and
//! the order between the processes is the flags' (see `stream_memops`: a write-value fences the
//! stream's earlier writes before the value).
//!
//! A wait that a failure releases (its word set to a value no step reaches) is met as a wait
//! met by a freed slot is: a copy-engine copy behind it then runs and writes the slot. So a copy
//! that waits, given [`Releasable`], is the helper kernels' instead: `ppnrt_gated_copy_bytes`
//! copies only while the awaited word is below the released value, and `ppnrt_gated_signal`,
//! after it, writes the signal's value, or the released value where the word says the wait was
//! released (a copy skipped, wholly or in part, never reads as done). Each block of the copy
//! fences its writes for the whole system before it ends, so the signal follows them as the
//! write-value's fence makes it follow a copy-engine copy. A copy that needs no wait stays on the
//! copy engine.

use std::ffi::c_void;
use std::sync::Arc;

use crate::cuda_error::{CudaError, Result};
use crate::result::memory as raw_memory;
use crate::result::stream as raw;
use crate::safe::enqueue::{ordered, ordered_releasing};
use crate::safe::helpers::HelperKernels;
use crate::safe::launch::LaunchConfig;
use crate::safe::memory::{CudaView, CudaViewMut, DeviceSlice};
use crate::safe::ordering::Use;
use crate::safe::stream::CudaStream;
use crate::safe::stream_memops::{WaitCondition, word};
use crate::sys::{CUdeviceptr, CUstreamWriteValue_flags};

/// Where a flagged copy waits (when it must) and what it writes: `waits[wait_at]` must reach
/// `wait_for` (cyclic `>=`) unless `wait` is `None`, then `signals[signal_at]` is set to `signal`.
#[derive(Debug, Clone, Copy)]
pub(crate) struct FlagSteps {
    pub(crate) wait_at: usize,
    pub(crate) wait_for: u64,
    pub(crate) wait: Option<WaitCondition>,
    pub(crate) signal_at: usize,
    pub(crate) signal: u64,
}

/// What makes a flagged copy's wait one a failure can cancel: the helper kernels of the stream's
/// device, and the value of the awaited word that says the wait was released rather than met
/// (every word at or above it; see the module docs).
#[derive(Debug, Clone, Copy)]
pub(crate) struct Releasable<'a> {
    pub(crate) kernels: &'a HelperKernels,
    pub(crate) released: u64,
}

/// One block of one thread: the gated signal's launch.
const ONE_THREAD: LaunchConfig = LaunchConfig { grid: (1, 1, 1), block: (1, 1, 1), shared_mem_bytes: 0 };

impl CudaStream {
    /// On this stream: waits until `waits[steps.wait_at] >= steps.wait_for` (the slot is free;
    /// no wait when `steps.wait` is `None`: the caller saw it free), copies `src` into `dst` (the
    /// receiver's slot, mapped into this process), then writes `signals[steps.signal_at] =
    /// steps.signal` (filled) after a fence. With a wait and `releasable`, the copy and the signal
    /// are its kernels (module docs): where the awaited word is at or above
    /// `releasable.released` when they run, `dst` is not written and the signal is that value.
    /// Ordered by the rule as a read of `src`, a write of `dst`, a read of `waits` (when it waits)
    /// and a signal on `signals` (ordered by this stream only: the words are read by other
    /// streams and processes, see `stream_memops`).
    ///
    /// # Errors
    /// [`CudaError::LengthMismatch`] unless the lengths agree; the word checks of
    /// [`write_value_u64`](Self::write_value_u64); [`CudaError::WrongDevice`] for kernels or
    /// buffers of another device than this stream's (a copy through the kernels); the driver's
    /// error. A call that fails after an earlier one queued its work (the wait, the copy) leaves
    /// that work queued, to run later: every buffer's use is noted all the same. Where noting
    /// them fails, the rule waits on the host for the stream; `release_waits` runs first (a
    /// queued wait, this copy's or an earlier one's on the stream, would hold that wait until the
    /// other process frees the slot), whether or not this copy waits: it must set the awaited
    /// words so that every wait on them is met, as a failure's release does.
    #[allow(clippy::too_many_arguments)] // each is one of the copy's distinct parts
    pub(crate) fn flagged_copy(
        self: &Arc<Self>,
        src: CudaView<'_, u8>,
        dst: &mut CudaViewMut<'_, u8>,
        waits: CudaView<'_, u64>,
        signals: &mut CudaViewMut<'_, u64>,
        steps: FlagSteps,
        releasable: Option<Releasable<'_>>,
        release_waits: impl FnOnce(),
    ) -> Result<()> {
        const WHAT: &str = "the boundary's flagged copy";
        if src.len() != dst.len() {
            return Err(CudaError::LengthMismatch { what: WHAT, expected: dst.len(), found: src.len() });
        }
        let waited = match steps.wait {
            Some(wait) => Some((word(WHAT, self, waits, steps.wait_at, wait.flushes())?.device_ptr(), wait)),
            None => None,
        };
        let signalled_words = signals.as_view();
        let signalled = word(WHAT, self, signalled_words, steps.signal_at, false)?.device_ptr();
        self.refuse_in_capture("a flagged copy (cuStreamWaitValue64, cuStreamWriteValue64)")?;
        let to = dst.as_view();
        let (dst_ptr, src_ptr, bytes, raw_stream) = (to.device_ptr(), src.device_ptr(), src.byte_len(), self.raw());
        let gated = match (waited, releasable) {
            (Some((gate, wait)), Some(releasable)) => {
                let device = self.ordinal();
                for found in [releasable.kernels.gated_copy.ordinal(), src.ordinal(), to.ordinal()] {
                    if found != device {
                        return Err(CudaError::WrongDevice { what: WHAT, expected: device, found });
                    }
                }
                let (dst, src, bytes, signal) = (dst_ptr, src_ptr, bytes as u64, signalled);
                Some((Gated { releasable, gate, dst, src, bytes, signal }, wait))
            }
            _ => None,
        };
        let uses = [(src.tracked(), Use::Read), (to.tracked(), Use::Write), (signalled_words.tracked(), Use::Signal)]
            .into_iter()
            .chain(waited.map(|_| (waits.tracked(), Use::Read)));
        if let Some((gated, wait)) = gated {
            return ordered_releasing(self, uses, release_waits, || {
                // SAFETY: the awaited word is an aligned element of `waits`, memory this stream's
                // device reaches (checked by `word`); `src` and `dst` are valid for `bytes` bytes
                // (lengths checked) and, with the kernels, of this stream's device (checked
                // above); every range is kept alive until this work has run by the ordering rule
                // (each use is noted as pending, after a later call's failure too): the
                // contract of `Gated::launch`, which the closure calls.
                unsafe {
                    queued_then(raw::wait_value_64(raw_stream, gated.gate, steps.wait_for, wait.flags()), || {
                        gated.launch(self, steps.signal)
                    })
                }
            })?;
        }
        let queue = || {
            // SAFETY: both words are aligned elements of their slices, memory this stream's
            // device reaches (checked by `word`); `src` and `dst` are valid for `bytes` bytes
            // (lengths checked); every range is kept alive until this work has run by the
            // ordering rule (each use is noted as pending, after a later call's failure too).
            unsafe {
                let wait = || match waited {
                    Some((waited, wait)) => raw::wait_value_64(raw_stream, waited, steps.wait_for, wait.flags()),
                    None => Ok(()),
                };
                let copy = || match bytes {
                    0 => Ok(()),
                    _ => raw_memory::memcpy_async(dst_ptr, src_ptr, bytes, raw_stream),
                };
                let signal = || {
                    let flags = CUstreamWriteValue_flags::CU_STREAM_WRITE_VALUE_DEFAULT.0;
                    raw::write_value_64(raw_stream, signalled, steps.signal, flags)
                };
                match (waited, bytes) {
                    (Some(_), _) => queued_then(wait(), || copy().and_then(|()| signal())),
                    (None, 1..) => queued_then(copy(), signal),
                    (None, 0) => queued_then(signal(), || Ok(())),
                }
            }
        };
        // A copy that queues no wait of its own may still be queued behind an earlier step's wait
        // on this stream (a slot freed out of order, a lie), which holds the rule's host wait
        // after failed notes just the same: released too.
        ordered_releasing(self, uses, release_waits, queue)?
    }

    /// On this stream, once the host saw `flags[at] >= value` (the sender's signal after its copy
    /// into `dst` from another device): a wait for it that is met at once and flushes the writes
    /// that reached this device before it (`CU_STREAM_WAIT_VALUE_FLUSH`), so the work after it
    /// sees the copy whole. Ordered by the rule as a write of `dst` (later reads of the slot wait
    /// for it) and a read of `flags`.
    ///
    /// # Errors
    /// The word checks of [`wait_value_u64`](Self::wait_value_u64) (a device without the flush
    /// is refused by name); the driver's error.
    pub(crate) fn flush_arrival(
        self: &Arc<Self>,
        dst: &mut CudaViewMut<'_, u8>,
        flags: CudaView<'_, u64>,
        at: usize,
        value: u64,
    ) -> Result<()> {
        const WHAT: &str = "the boundary's flush of an arrival";
        let wait = WaitCondition::GEQ.flush_remote_writes();
        let waited = word(WHAT, self, flags, at, true)?.device_ptr();
        self.refuse_in_capture("a flush of an arrival (cuStreamWaitValue64)")?;
        let to = dst.as_view();
        let raw_stream = self.raw();
        ordered(self, [(to.tracked(), Use::Write), (flags.tracked(), Use::Read)], || {
            // SAFETY: the word is an aligned element of `flags`, memory of this stream's device
            // (checked by `word`), kept alive until this work has run by the ordering rule.
            unsafe { raw::wait_value_64(raw_stream, waited, value, wait.flags()) }
        })
    }
}

/// The result of a flagged copy's calls for the ordering rule ([`ordered`]): `first`'s error
/// when it failed (nothing queued), else `Ok` of what the calls after it (`then`) return. A
/// call that fails after an earlier one queued its work leaves that work queued, to run later
/// (behind a wait, possibly long after): its buffers' uses must be noted all the same, or a
/// buffer it reads or writes (the source, the slot, the words) would be freed or reused under
/// it.
fn queued_then(first: Result<()>, then: impl FnOnce() -> Result<()>) -> Result<Result<()>> {
    first?;
    Ok(then())
}

/// A flagged copy through the helper kernels (see the module docs): the addresses its two launches
/// take, checked by [`CudaStream::flagged_copy`].
#[derive(Clone, Copy)]
struct Gated<'a> {
    releasable: Releasable<'a>,
    /// The awaited word's address.
    gate: CUdeviceptr,
    dst: CUdeviceptr,
    src: CUdeviceptr,
    bytes: u64,
    /// The signal word's address.
    signal: CUdeviceptr,
}

impl Gated<'_> {
    /// On `stream`, after its wait: `ppnrt_gated_copy_bytes` of the bytes (none for an empty step),
    /// then `ppnrt_gated_signal` of `value`.
    ///
    /// # Safety
    /// - `dst` and `src` are valid for `bytes` bytes, and both words (`gate`, `signal`) are aligned
    ///   `u64`s, all reachable from `stream`'s device and kept alive until the launches have run
    ///   (ordered on `stream` by the caller);
    /// - the kernels are of `stream`'s device.
    unsafe fn launch(self, stream: &Arc<CudaStream>, value: u64) -> Result<()> {
        let kernels = self.releasable.kernels;
        let (mut gate, mut released) = (self.gate, self.releasable.released);
        if self.bytes > 0 {
            // Both 16-byte aligned: a thread per 16-byte word (and one for the tail), as the SM
            // copy is launched; else a thread per byte (the kernel copies byte by byte then).
            let aligned = (self.dst | self.src) % 16 == 0;
            let elements = if aligned { self.bytes / 16 + 1 } else { self.bytes };
            let config =
                LaunchConfig::for_elements(usize::try_from(elements).unwrap_or(usize::MAX), kernels.max_blocks);
            let (mut dst, mut src, mut bytes) = (self.dst, self.src, self.bytes);
            let mut params: [*mut c_void; 5] = [
                (&raw mut dst).cast(),
                (&raw mut src).cast(),
                (&raw mut bytes).cast(),
                (&raw mut gate).cast(),
                (&raw mut released).cast(),
            ];
            // SAFETY: the parameters match ppnrt_gated_copy_bytes(uint8_t* dst, const uint8_t*
            // src, uint64_t bytes, const uint64_t* gate, uint64_t released), which reads the gate
            // and copies at most `bytes` bytes within both ranges; the caller's contract covers
            // the memory and the kernel's device.
            unsafe { stream.launch_ordered(&kernels.gated_copy, &config, &mut params)? };
        }
        let (mut signal, mut value) = (self.signal, value);
        let mut params: [*mut c_void; 4] =
            [(&raw mut signal).cast(), (&raw mut value).cast(), (&raw mut gate).cast(), (&raw mut released).cast()];
        // SAFETY: the parameters match ppnrt_gated_signal(uint64_t* signal, uint64_t value, const
        // uint64_t* gate, uint64_t released), one thread that reads the gate and writes the
        // signal word; the caller's contract covers both words and the kernel's device.
        unsafe { stream.launch_ordered(&kernels.gated_signal, &ONE_THREAD, &mut params) }
    }
}
