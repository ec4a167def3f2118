//! The stream's part of a boundary between processes whose order is carried by flag words two
//! processes share: the sender's copy, after a wait when the slot was not free yet, then a signal
//! ([`CudaStream::flagged_copy`]), and, where the copy came from another device, the receiver's
//! flush of what reached its device before the signal ([`CudaStream::flush_arrival`]); each one
//! pass through the door, so the buffers' ordering inside each process is the crate's rule and
//! the order between the processes is the flags' (see `stream_memops`: a write-value fences the
//! stream's earlier writes before the value).

use std::sync::Arc;

use crate::cuda_error::{CudaError, Result};
use crate::result::memory as raw_memory;
use crate::result::stream as raw;
use crate::safe::enqueue::ordered;
use crate::safe::memory::{CudaView, CudaViewMut, DeviceSlice};
use crate::safe::ordering::Use;
use crate::safe::stream::CudaStream;
use crate::safe::stream_memops::{WaitCondition, word};
use crate::sys::CUstreamWriteValue_flags;

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

impl CudaStream {
    /// On this stream: waits until `waits[steps.wait_at] >= steps.wait_for` (the slot is free;
    /// no wait when `steps.wait` is `None`: the caller saw it free), copies `src` into `dst` (the
    /// receiver's slot, mapped into this process), then writes `signals[steps.signal_at] =
    /// steps.signal` (filled) after a fence. Ordered by the rule as a read of `src`, a write of
    /// `dst`, a read of `waits` (when it waits) and a signal on `signals` (ordered by this stream
    /// only: the words are read by other streams and processes, see `stream_memops`).
    ///
    /// # Errors
    /// [`CudaError::LengthMismatch`] unless the lengths agree; the word checks of
    /// [`write_value_u64`](Self::write_value_u64); the driver's error.
    pub(crate) fn flagged_copy(
        self: &Arc<Self>,
        src: CudaView<'_, u8>,
        dst: &mut CudaViewMut<'_, u8>,
        waits: CudaView<'_, u64>,
        signals: &mut CudaViewMut<'_, u64>,
        steps: FlagSteps,
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
        let uses = [(src.tracked(), Use::Read), (to.tracked(), Use::Write), (signalled_words.tracked(), Use::Signal)]
            .into_iter()
            .chain(waited.map(|_| (waits.tracked(), Use::Read)));
        ordered(self, uses, || {
            // SAFETY: both words are aligned elements of their slices, memory this stream's
            // device reaches (checked by `word`); `src` and `dst` are valid for `bytes` bytes
            // (lengths checked); every range is kept alive until this work has run by the
            // ordering rule (each use is noted as pending).
            unsafe {
                if let Some((waited, wait)) = waited {
                    raw::wait_value_64(raw_stream, waited, steps.wait_for, wait.flags())?;
                }
                if bytes > 0 {
                    raw_memory::memcpy_async(dst_ptr, src_ptr, bytes, raw_stream)?;
                }
                raw::write_value_64(
                    raw_stream,
                    signalled,
                    steps.signal,
                    CUstreamWriteValue_flags::CU_STREAM_WRITE_VALUE_DEFAULT.0,
                )
            }
        })
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
