//! Stream memory operations on one 64-bit word of device memory: a stream writes a value into
//! a flag word after its earlier work ([`CudaStream::write_value_u64`], `cuStreamWriteValue64`),
//! or holds its later work until the word meets a condition ([`CudaStream::wait_value_u64`],
//! `cuStreamWaitValue64`); and what a device supports of them ([`MemOpsSupport`]).
//!
//! # Ordering inside the process
//! The word is an element of the crate's device memory, taken as a slice or view and an index
//! (never a raw address), and each operation passes the one door (`enqueue`). A wait-value is a
//! read of the allocation: it waits for the last write made in this process, and later writes
//! and the memory's release wait for it. A write-value is ordered by its own stream only: it
//! waits for no other stream's use of the memory, because any such wait could be a wait for the
//! very wait-value it is there to release (the ordering rule waits for a use through an event
//! recorded at the end of that use's stream, which may sit behind the wait-value). It is noted as
//! a pending use, so later writes and the memory's release wait for it. What it may overlap is
//! another stream's use of the same word, which sees the word old or new (any bit pattern is a
//! `u64`); the words around it it does not touch. So give the flags their first values on the
//! stream that writes them, or synchronise after writing them, before any write-value.
//!
//! # Ordering between processes, and a dying peer
//! On memory an [`ImportedMemory`](crate::ImportedMemory) maps (or its
//! [`ExportedMemory`](crate::ExportedMemory)), one process's stream writes a step number after
//! its copy and the other's waits for it (GEQ), and the same the other way for "consumed". This
//! stays sound when the other process dies, unlike an interprocess event: the importer's mapping
//! keeps the physical memory (CUDA Driver API, Virtual Memory Management, `cuMemRelease`: the
//! memory is freed "when all outstanding mappings to the memory are unmapped and when all
//! outstanding references to the handle ... are also released"), so a wait on a word of it, and
//! every read after, touch live memory of this process whatever the peer did. A wait whose
//! writer died is released by this process: a write-value of the awaited (or a "failed") value
//! from another stream. The driver sees no dependency between the two streams ("Synchronization
//! ordering established through these APIs is not visible to CUDA", CUDA Driver API, Stream
//! Memory Operations): the releasing stream must not be ordered behind the waiting one by other
//! work, which is why the write-value above waits for no other stream.
//!
//! # What the flags guarantee
//! - A write-value is made with `CU_STREAM_WRITE_VALUE_DEFAULT`: the driver puts a memory fence
//!   before the write, scoped to the stream (`cuStreamWriteValue64`; the opposite flag
//!   `CU_STREAM_WRITE_VALUE_NO_MEMORY_BARRIER` "permits the write to be reordered with writes which
//!   were issued before it"), so a reader that sees the value sees the stream's earlier writes.
//! - [`WaitCondition::GEQ`] is the driver's cyclic comparison: `(int64_t)(*addr - value) >= 0`
//!   (`CU_STREAM_WAIT_VALUE_GEQ`); a step counter that never runs ahead by 2^63 compares as
//!   numbers. [`WaitCondition::EQ`] waits for equality.
//! - Writes that reach a device from elsewhere (another device's copy into this device's memory,
//!   then its write of the flag) may be reordered inside the receiving device:
//!   `CU_STREAM_WAIT_VALUE_FLUSH` makes the writes that reached the device before the wait is met
//!   visible to the work after it ([`WaitCondition::flush_remote_writes`]). It exists only where
//!   `CU_DEVICE_ATTRIBUTE_CAN_FLUSH_REMOTE_WRITES` says so; elsewhere it is refused by name.
//!
//! Neither operation is captured into a graph here (refused on a capturing stream): whether the
//! driver captures them across processes is for a GPU to say.

use std::sync::Arc;

use super::copy::check_same_device;
use super::device::Device;
use super::enqueue::ordered;
use super::memory::{CudaView, DeviceSlice, DeviceSliceMut};
use super::ordering::Use;
use super::stream::CudaStream;
use crate::cuda_error::{CudaError, IpcError, Result};
use crate::result::stream as raw;
use crate::sys::{CUdevice_attribute, CUstreamWaitValue_flags, CUstreamWriteValue_flags};

/// The attribute a 64-bit memory operation needs.
const OPS_64: &str = "CU_DEVICE_ATTRIBUTE_CAN_USE_64_BIT_STREAM_MEM_OPS";
/// The attribute a flushing wait needs.
const FLUSH: &str = "CU_DEVICE_ATTRIBUTE_CAN_FLUSH_REMOTE_WRITES";

/// What a device supports of the stream memory operations.
///
/// ```no_run
/// # fn main() -> ppnrt::Result<()> {
/// let engine = ppnrt::Engine::new(0)?;
/// let support = ppnrt::MemOpsSupport::of(engine.device())?;
/// if !support.flush_remote_writes {
///     println!("a peer device's writes need another fence before the flag");
/// }
/// # Ok(()) }
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MemOpsSupport {
    /// `CU_DEVICE_ATTRIBUTE_CAN_USE_64_BIT_STREAM_MEM_OPS`: `cuStreamWriteValue64` and
    /// `cuStreamWaitValue64`.
    pub ops_64: bool,
    /// `CU_DEVICE_ATTRIBUTE_CAN_FLUSH_REMOTE_WRITES`: `CU_STREAM_WAIT_VALUE_FLUSH`.
    pub flush_remote_writes: bool,
}

impl MemOpsSupport {
    /// Queries `device`.
    ///
    /// ```no_run
    /// # fn main() -> ppnrt::Result<()> {
    /// let engine = ppnrt::Engine::new(0)?;
    /// let support = ppnrt::MemOpsSupport::of(engine.device())?;
    /// println!("64-bit stream memory operations: {}", support.ops_64);
    /// # Ok(()) }
    /// ```
    ///
    /// # Errors
    /// The driver's error.
    #[doc(alias = "cuDeviceGetAttribute")]
    pub fn of(device: &Device) -> Result<MemOpsSupport> {
        let attr = |a| device.attribute(a).map(|v| v != 0);
        Ok(MemOpsSupport {
            ops_64: attr(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_CAN_USE_64_BIT_STREAM_MEM_OPS)?,
            flush_remote_writes: attr(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_CAN_FLUSH_REMOTE_WRITES)?,
        })
    }
}

/// The condition a [`wait_value_u64`](CudaStream::wait_value_u64) waits for.
///
/// ```
/// use ppnrt::WaitCondition;
/// // A step counter written by a peer device after its copy.
/// let filled = WaitCondition::GEQ.flush_remote_writes();
/// assert!(filled.flushes() && !WaitCondition::EQ.flushes());
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WaitCondition {
    equal: bool,
    flush: bool,
}

impl WaitCondition {
    /// The word is at least the value, compared cyclically: `(int64_t)(word - value) >= 0`
    /// (`CU_STREAM_WAIT_VALUE_GEQ`).
    pub const GEQ: WaitCondition = WaitCondition { equal: false, flush: false };
    /// The word equals the value (`CU_STREAM_WAIT_VALUE_EQ`).
    pub const EQ: WaitCondition = WaitCondition { equal: true, flush: false };

    /// The same condition, followed by a flush of the writes that reached the device from
    /// elsewhere (`CU_STREAM_WAIT_VALUE_FLUSH`): for a word another device writes after its
    /// data. Needs `CU_DEVICE_ATTRIBUTE_CAN_FLUSH_REMOTE_WRITES` ([`MemOpsSupport`]).
    #[must_use]
    pub const fn flush_remote_writes(self) -> WaitCondition {
        WaitCondition { flush: true, ..self }
    }

    /// Whether [`flush_remote_writes`](Self::flush_remote_writes) is set.
    pub const fn flushes(self) -> bool {
        self.flush
    }

    pub(super) fn flags(self) -> u32 {
        let condition = if self.equal {
            CUstreamWaitValue_flags::CU_STREAM_WAIT_VALUE_EQ
        } else {
            CUstreamWaitValue_flags::CU_STREAM_WAIT_VALUE_GEQ
        };
        let flush = if self.flush { CUstreamWaitValue_flags::CU_STREAM_WAIT_VALUE_FLUSH.0 } else { 0 };
        condition.0 | flush
    }
}

/// What `stream`'s device supports, queried once per context (a step's flagged copy would
/// otherwise ask the driver twice per word).
fn support_of(stream: &CudaStream) -> Result<MemOpsSupport> {
    let cell = stream.context().mem_ops_cell();
    if let Some(&(ops_64, flush_remote_writes)) = cell.get() {
        return Ok(MemOpsSupport { ops_64, flush_remote_writes });
    }
    let support = MemOpsSupport::of(stream.context().device())?;
    let _ = cell.set((support.ops_64, support.flush_remote_writes));
    Ok(support)
}

/// Checks what every memory operation on `flag[index]` from `stream` needs, and returns a view
/// of that one element.
pub(super) fn word<'a>(
    what: &'static str,
    stream: &CudaStream,
    flag: CudaView<'a, u64>,
    index: usize,
    flush: bool,
) -> Result<CudaView<'a, u64>> {
    if index >= flag.len() {
        return Err(CudaError::OutOfBounds { what, start: index, end: index.saturating_add(1), len: flag.len() });
    }
    let device = stream.context().device();
    let support = support_of(stream)?;
    let missing = if !support.ops_64 {
        Some(OPS_64)
    } else if flush && !support.flush_remote_writes {
        Some(FLUSH)
    } else {
        None
    };
    if let Some(missing) = missing {
        return Err(IpcError::Unsupported { what, device: device.ordinal(), missing }.into());
    }
    check_same_device(what, stream, flag.ordinal())?;
    let word = flag.slice(index..=index)?;
    if !word.is_aligned_to(8) {
        return Err(CudaError::Misaligned { what, address: word.device_ptr(), align: 8 });
    }
    Ok(word)
}

impl CudaStream {
    /// Writes `value` into `flag[index]` once this stream's earlier work is done, with a memory
    /// fence before it (`cuStreamWriteValue64`, `CU_STREAM_WRITE_VALUE_DEFAULT`): another
    /// stream or process that sees the value sees the earlier writes of this stream. Ordered by
    /// this stream only: it waits for no other stream's use of the memory (the waits it
    /// releases among them; module doc), and later writes and the memory's release wait for it.
    ///
    /// ```no_run
    /// # fn main() -> ppnrt::Result<()> {
    /// use ppnrt::{CudaStream, Engine, WaitCondition};
    /// let engine = Engine::new(0)?;
    /// let (producer, consumer) = (CudaStream::new(engine.context())?, CudaStream::new(engine.context())?);
    /// let mut flags = engine.alloc_zeroed::<u64>(2)?;
    /// consumer.wait_value_u64(&flags, 0, 1, WaitCondition::GEQ)?;
    /// producer.write_value_u64(&mut flags, 0, 1)?; // releases the consumer's later work
    /// # Ok(()) }
    /// ```
    ///
    /// # Errors
    /// [`CudaError::OutOfBounds`] for an `index` past the flags; [`IpcError::Unsupported`] on a
    /// device without 64-bit stream memory operations; [`CudaError::WrongDevice`] for flags of
    /// another device than this stream's; [`CaptureError::IllegalCall`](crate::CaptureError::IllegalCall)
    /// on a capturing stream; the driver's error.
    #[doc(alias = "cuStreamWriteValue64")]
    pub fn write_value_u64<D: DeviceSliceMut<u64>>(
        self: &Arc<Self>,
        flag: &mut D,
        index: usize,
        value: u64,
    ) -> Result<()> {
        const WHAT: &str = "CudaStream::write_value_u64";
        let view = flag.as_view_mut();
        let word = word(WHAT, self, view.as_view(), index, false)?;
        self.refuse_in_capture("CudaStream::write_value_u64 (cuStreamWriteValue64)")?;
        ordered(self, [(word.tracked(), Use::Signal)], || {
            // SAFETY: the word is one aligned element of device memory of this stream's device,
            // kept alive until the write has run by the ordering rule (the write is noted as a
            // pending use, which the memory's release waits for).
            unsafe {
                raw::write_value_64(
                    self.raw(),
                    word.device_ptr(),
                    value,
                    CUstreamWriteValue_flags::CU_STREAM_WRITE_VALUE_DEFAULT.0,
                )
            }
        })
    }

    /// Holds this stream's later work until `flag[index]` meets `condition` against `value`
    /// (`cuStreamWaitValue64`). The word is read by the device until then: the memory's release
    /// waits for the wait, so a wait whose writer may never write must be released by a
    /// [`write_value_u64`](Self::write_value_u64) of this process (module doc).
    ///
    /// # Errors
    /// [`CudaError::OutOfBounds`] for an `index` past the flags; [`IpcError::Unsupported`] on a
    /// device without 64-bit stream memory operations, or without remote-write flushes for
    /// [`WaitCondition::flush_remote_writes`]; [`CudaError::WrongDevice`] for flags of another
    /// device than this stream's; [`CaptureError::IllegalCall`](crate::CaptureError::IllegalCall)
    /// on a capturing stream; the driver's error.
    #[doc(alias = "cuStreamWaitValue64")]
    pub fn wait_value_u64<S: DeviceSlice<u64>>(
        self: &Arc<Self>,
        flag: &S,
        index: usize,
        value: u64,
        condition: WaitCondition,
    ) -> Result<()> {
        const WHAT: &str = "CudaStream::wait_value_u64";
        let word = word(WHAT, self, flag.as_view(), index, condition.flushes())?;
        self.refuse_in_capture("CudaStream::wait_value_u64 (cuStreamWaitValue64)")?;
        ordered(self, [(word.tracked(), Use::Read)], || {
            // SAFETY: the word is one aligned element of device memory of this stream's device,
            // kept alive until the wait has run by the ordering rule (the memory's release waits
            // for its reads).
            unsafe { raw::wait_value_64(self.raw(), word.device_ptr(), value, condition.flags()) }
        })
    }
}
