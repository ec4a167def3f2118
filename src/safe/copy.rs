//! Copies and memsets: between device buffers (of one device or two), between the host and the
//! device (pageable slices, and pinned buffers, asynchronously), and the raw byte copy outside
//! the ordering rule. Every one but the raw copy passes the one door (`enqueue::ordered`), which
//! orders the buffers it touches by the crate's rule or records it into the stream's capture.
//!
//! This is the home of the copies of [`CudaStream`] (an `impl CudaStream` block: `memcpy_*`,
//! `memset_*`, `copy_bytes_async`) and of [`PinnedHostBuffer`]'s copies to and from the device;
//! the stream's own methods are `stream`'s, the buffers' are `memory`'s and `host`'s.
//!
//! Threading: as for every enqueue, a copy may be made on any stream from any thread; a copy that
//! writes a buffer holds it by `&mut`.

use std::sync::Arc;

use super::element::DeviceRepr;
use super::enqueue::{Tracked, ordered, ordered_owned, ordered_retired_owned};
use super::host::PinnedHostBuffer;
use super::memory::{CudaView, CudaViewMut, DeviceSlice, DeviceSliceMut, Retired};
use super::ordering::{OwnOrder, Owned, Use};
use super::stream::{CudaStream, EnqueueGate};
use crate::cuda_error::{CudaError, Result};
use crate::result::memory as raw;
use crate::sys::CUdeviceptr;

/// Host-device copies run on a stream of the device memory's own device (the driver refuses
/// others).
pub(crate) fn check_same_device(what: &'static str, stream: &CudaStream, memory_device: i32) -> Result<()> {
    if stream.ordinal() == memory_device {
        Ok(())
    } else {
        Err(CudaError::WrongDevice { what, expected: stream.ordinal(), found: memory_device })
    }
}

fn check_len(what: &'static str, expected: usize, found: usize) -> Result<()> {
    if expected == found { Ok(()) } else { Err(CudaError::LengthMismatch { what, expected, found }) }
}

impl CudaStream {
    /// Copies host `src` into `dst` on this stream. `src` may be dropped or overwritten as soon
    /// as this returns: pageable memory is staged by the driver during the call, and memory the
    /// driver reads later (pinned, registered or managed host memory, such as a
    /// [`PinnedHostBuffer`](crate::PinnedHostBuffer)'s contents) is waited for before returning.
    /// For an asynchronous copy from pinned memory use
    /// [`memcpy_htod_pinned`](Self::memcpy_htod_pinned).
    ///
    /// # Errors
    /// [`CudaError::LengthMismatch`] unless the lengths agree; [`CudaError::WrongDevice`] when `dst` is on
    /// another device than this stream; the driver's error.
    #[doc(alias = "cuMemcpyHtoDAsync")]
    pub fn memcpy_htod<T: DeviceRepr, D: DeviceSliceMut<T>>(self: &Arc<Self>, src: &[T], dst: &mut D) -> Result<()> {
        check_len("CudaStream::memcpy_htod", dst.len(), src.len())?;
        self.refuse_in_capture("CudaStream::memcpy_htod")?;
        check_same_device("CudaStream::memcpy_htod: dst must be on the stream's device", self, dst.ordinal())?;
        if src.is_empty() {
            return Ok(());
        }
        let read_later = raw::memory_type(src.as_ptr() as CUdeviceptr)?.is_some();
        let view = dst.as_view();
        ordered(self, [(view.tracked(), Use::Write)], || {
            // SAFETY: dst is valid for byte_len bytes and ordered on this stream; src is pageable
            // (staged before the call returns) or memory the driver reads later, which is waited
            // for below before the borrow of src ends.
            unsafe { raw::memcpy_htod_async(view.device_ptr(), src.as_ptr().cast(), view.byte_len(), self.raw()) }
        })?;
        if read_later {
            // On failure the context is lost and the copy will not run.
            self.synchronize()?;
        }
        Ok(())
    }

    /// Copies device `src` into host `dst` on this stream and returns once `dst` holds the data.
    ///
    /// # Errors
    /// [`CudaError::LengthMismatch`] unless the lengths agree; [`CudaError::WrongDevice`] when `src` is on
    /// another device than this stream; the driver's error.
    #[doc(alias = "cuMemcpyDtoHAsync")]
    pub fn memcpy_dtoh<T: DeviceRepr, S: DeviceSlice<T>>(self: &Arc<Self>, src: &S, dst: &mut [T]) -> Result<()> {
        check_len("CudaStream::memcpy_dtoh", dst.len(), src.len())?;
        self.refuse_in_capture("CudaStream::memcpy_dtoh")?;
        check_same_device("CudaStream::memcpy_dtoh: src must be on the stream's device", self, src.ordinal())?;
        if dst.is_empty() {
            return Ok(());
        }
        let view = src.as_view();
        ordered(self, [(view.tracked(), Use::Read)], || {
            // SAFETY: src is valid and ordered on this stream; dst is writable for byte_len bytes
            // and exclusively borrowed; it is read only after the synchronisation below.
            unsafe { raw::memcpy_dtoh_async(dst.as_mut_ptr().cast(), view.device_ptr(), view.byte_len(), self.raw()) }
        })?;
        // A failed wait means the context is lost: the copy will not run after dst is gone.
        self.synchronize()
    }

    /// Copies `src` into `dst` on this stream; the two may be on different devices. A
    /// unified-address `cuMemcpyAsync` (with peer access the copy engines move it over NVLink or
    /// PCIe; it can be captured into a CUDA graph) unless a side is pool memory of another device
    /// than the stream's, which the stream's copy engine cannot reach: then `cuMemcpyPeerAsync`,
    /// which the driver stages.
    ///
    /// # Errors
    /// [`CudaError::LengthMismatch`] unless the lengths agree; the driver's error.
    #[doc(alias = "cuMemcpyAsync")]
    #[doc(alias = "cuMemcpyPeerAsync")]
    pub fn memcpy_dtod<T: DeviceRepr, S: DeviceSlice<T>, D: DeviceSliceMut<T>>(
        self: &Arc<Self>,
        src: &S,
        dst: &mut D,
    ) -> Result<()> {
        check_len("CudaStream::memcpy_dtod", dst.len(), src.len())?;
        if src.is_empty() {
            return Ok(());
        }
        let (from, to) = (src.as_view(), dst.as_view());
        // The stream's copy engine reaches pool memory of its own device only: pool memory of
        // another device goes through cuMemcpyPeerAsync, which the driver stages.
        let foreign_pool = |view: &CudaView<'_, T>| view.is_pooled() && view.ordinal() != self.ordinal();
        if foreign_pool(&from) || foreign_pool(&to) {
            return self.memcpy_peer_dtod(from.into_bytes(), to.into_bytes());
        }
        let (dst_ptr, src_ptr, bytes, raw_stream) = (to.device_ptr(), from.device_ptr(), from.byte_len(), self.raw());
        ordered(
            self,
            [(from.tracked(), Use::Read), (to.tracked(), Use::Write)],
            #[inline(always)]
            move || {
                // SAFETY: both ranges are valid for byte_len bytes (lengths checked) and ordered
                // on this stream.
                unsafe { raw::memcpy_async(dst_ptr, src_ptr, bytes, raw_stream) }
            },
        )
    }

    /// [`memcpy_dtod`](Self::memcpy_dtod) of bytes, of which one side is a buffer its owner
    /// orders (`owned`, see [`OwnOrder`](super::ordering::OwnOrder)), the other side ordered by
    /// the rule; `gate` is this stream's enqueue gate, held by the caller, which saw the stream
    /// not capturing. Pool memory of another device goes through `cuMemcpyPeerAsync`.
    ///
    /// # Errors
    /// As [`memcpy_dtod`](Self::memcpy_dtod).
    pub(crate) fn memcpy_dtod_owned(
        self: &Arc<Self>,
        gate: &EnqueueGate<'_>,
        from: CudaView<'_, u8>,
        to: CudaViewMut<'_, u8>,
        owned: Owned<'_>,
    ) -> Result<()> {
        check_len("CudaStream::memcpy_dtod", to.len(), from.len())?;
        if from.is_empty() {
            return Ok(());
        }
        let foreign_pool = |pooled: bool, ordinal: i32| pooled && ordinal != self.ordinal();
        let peer = foreign_pool(from.is_pooled(), from.ordinal()) || foreign_pool(to.is_pooled(), to.ordinal());
        let (dst_ptr, src_ptr, bytes, raw_stream) = (to.device_ptr(), from.device_ptr(), from.byte_len(), self.raw());
        let contexts = (to.memory().owner().context().raw(), from.owner().context().raw());
        ordered_owned(
            self,
            gate,
            from.tracked(),
            to.tracked(),
            owned,
            #[inline(always)]
            move || {
                if peer {
                    // SAFETY: both ranges are valid for byte_len bytes (lengths checked) and
                    // ordered on this stream; the contexts are the ranges' live primary contexts.
                    unsafe { raw::memcpy_peer_async(dst_ptr, contexts.0, src_ptr, contexts.1, bytes, raw_stream) }
                } else {
                    // SAFETY: both ranges are valid for byte_len bytes (lengths checked) and
                    // ordered on this stream.
                    unsafe { raw::memcpy_async(dst_ptr, src_ptr, bytes, raw_stream) }
                }
            },
        )
    }

    /// [`memcpy_dtod`](Self::memcpy_dtod) of `from` into `to` (equal, non-zero lengths), one of
    /// them pool memory of another device than this stream's: through `cuMemcpyPeerAsync`, which
    /// the driver stages (refused in a capture).
    #[cold]
    #[inline(never)]
    fn memcpy_peer_dtod(self: &Arc<Self>, from: CudaView<'_, u8>, to: CudaView<'_, u8>) -> Result<()> {
        if self.is_capturing() {
            self.refuse_in_capture("CudaStream::memcpy_dtod of another device's pool memory (cuMemcpyPeerAsync)")?;
        }
        ordered(self, [(from.tracked(), Use::Read), (to.tracked(), Use::Write)], || {
            // SAFETY: both ranges are valid for byte_len bytes (lengths checked by the caller)
            // and ordered on this stream; the contexts are the ranges' live primary contexts.
            unsafe {
                raw::memcpy_peer_async(
                    to.device_ptr(),
                    to.owner().context().raw(),
                    from.device_ptr(),
                    from.owner().context().raw(),
                    from.byte_len(),
                    self.raw(),
                )
            }
        })
    }

    /// Sets every 32-bit word of `dst` to `value` on this stream.
    ///
    /// # Errors
    /// [`CudaError::LengthMismatch`] unless `T` is 4 bytes wide; [`CudaError::Misaligned`] unless `dst`
    /// starts on a 4-byte boundary (a view of a 4-byte type whose alignment is smaller can start
    /// anywhere); the driver's error.
    #[doc(alias = "cuMemsetD32Async")]
    pub fn memset_u32<T: DeviceRepr, D: DeviceSliceMut<T>>(self: &Arc<Self>, dst: &mut D, value: u32) -> Result<()> {
        check_len("CudaStream::memset_u32: element size", 4, std::mem::size_of::<T>())?;
        if dst.is_empty() {
            return Ok(());
        }
        let view = dst.as_view();
        if view.device_ptr() % 4 != 0 {
            return Err(CudaError::Misaligned { what: "CudaStream::memset_u32", address: view.device_ptr(), align: 4 });
        }
        ordered(self, [(view.tracked(), Use::Write)], || {
            // SAFETY: dst is valid for len 4-byte words, starts on a 4-byte boundary (checked
            // above) and is ordered on this stream.
            unsafe { raw::memset_d32_async(view.device_ptr(), value, view.len(), self.raw()) }
        })
    }

    /// Sets every byte of `dst` to `value` on this stream.
    ///
    /// # Errors
    /// The driver's error.
    #[doc(alias = "cuMemsetD8Async")]
    pub fn memset_bytes<T: DeviceRepr, D: DeviceSliceMut<T>>(self: &Arc<Self>, dst: &mut D, value: u8) -> Result<()> {
        if dst.is_empty() {
            return Ok(());
        }
        let view = dst.as_view();
        ordered(self, [(view.tracked(), Use::Write)], || {
            // SAFETY: dst is valid for byte_len bytes and ordered on this stream.
            unsafe { raw::memset_d8_async(view.device_ptr(), value, view.byte_len(), self.raw()) }
        })
    }

    /// Copies pinned `src` into `dst`, asynchronously on this stream.
    ///
    /// # Errors
    /// [`CudaError::LengthMismatch`] unless the lengths agree; [`CudaError::WrongDevice`] when `dst` is on
    /// another device than this stream; the driver's error.
    #[doc(alias = "cuMemcpyHtoDAsync")]
    pub fn memcpy_htod_pinned<T: DeviceRepr, D: DeviceSliceMut<T>>(
        self: &Arc<Self>,
        src: &PinnedHostBuffer<T>,
        dst: &mut D,
    ) -> Result<()> {
        if src.len() != dst.len() {
            return Err(CudaError::LengthMismatch {
                what: "CudaStream::memcpy_htod_pinned",
                expected: dst.len(),
                found: src.len(),
            });
        }
        src.enqueue_to_device(
            ("CudaStream::memcpy_htod_pinned", "CudaStream::memcpy_htod_pinned: dst must be on the stream's device"),
            self,
            dst.as_view_mut().into_bytes(),
        )
    }

    /// Copies `src` into pinned `dst`, asynchronously on this stream; `dst`'s contents are
    /// readable once the copy completes (its accessors wait).
    ///
    /// # Errors
    /// [`CudaError::LengthMismatch`] unless the lengths agree; [`CudaError::WrongDevice`] when `src` is on
    /// another device than this stream; the driver's error.
    #[doc(alias = "cuMemcpyDtoHAsync")]
    pub fn memcpy_dtoh_pinned<T: DeviceRepr, S: DeviceSlice<T>>(
        self: &Arc<Self>,
        src: &S,
        dst: &mut PinnedHostBuffer<T>,
    ) -> Result<()> {
        if src.len() != dst.len() {
            return Err(CudaError::LengthMismatch {
                what: "CudaStream::memcpy_dtoh_pinned",
                expected: dst.len(),
                found: src.len(),
            });
        }
        dst.enqueue_from_device(
            ("CudaStream::memcpy_dtoh_pinned", "CudaStream::memcpy_dtoh_pinned: src must be on the stream's device"),
            self,
            src.as_view().into_bytes(),
        )
    }
}

impl<T: DeviceRepr> PinnedHostBuffer<T> {
    /// Enqueues a copy of `src` into the buffer's first `src.len()` bytes on `stream`, ordered by
    /// the crate's rule. Callers hold the buffer exclusively (it is written).
    pub(crate) fn enqueue_from_device(
        &self,
        what: (&'static str, &'static str),
        stream: &Arc<CudaStream>,
        src: CudaView<'_, u8>,
    ) -> Result<()> {
        let capacity = self.len() * std::mem::size_of::<T>();
        if src.len() > capacity {
            return Err(CudaError::OutOfBounds { what: what.0, start: 0, end: src.len(), len: capacity });
        }
        check_same_device(what.1, stream, src.ordinal())?;
        if src.is_empty() {
            return Ok(());
        }
        ordered(
            stream,
            [(src.tracked(), Use::Read), (Tracked::Host(self.access()), Use::Write)],
            #[inline(always)]
            || {
                // SAFETY: the buffer holds at least src.len() bytes (checked) and stays allocated and
                // untouched by the host until the copy completes (host access and Drop wait for its
                // uses); src is valid; both are ordered on `stream`.
                unsafe { raw::memcpy_dtoh_async(self.host_ptr().cast(), src.device_ptr(), src.len(), stream.raw()) }
            },
        )
    }

    /// Enqueues a copy of the buffer's first `dst.len()` bytes into `dst` on `stream`, ordered by
    /// the crate's rule.
    pub(crate) fn enqueue_to_device(
        &self,
        what: (&'static str, &'static str),
        stream: &Arc<CudaStream>,
        dst: CudaViewMut<'_, u8>,
    ) -> Result<()> {
        let capacity = self.len() * std::mem::size_of::<T>();
        if dst.len() > capacity {
            return Err(CudaError::OutOfBounds { what: what.0, start: 0, end: dst.len(), len: capacity });
        }
        check_same_device(what.1, stream, dst.ordinal())?;
        if dst.is_empty() {
            return Ok(());
        }
        ordered(
            stream,
            [(Tracked::Host(self.access()), Use::Read), (dst.tracked(), Use::Write)],
            #[inline(always)]
            || {
                // SAFETY: the buffer holds at least dst.len() bytes (checked) and is not written by
                // the host until the copy completes (as_mut_slice and Drop wait for its uses); dst is
                // valid; both are ordered on `stream`.
                unsafe { raw::memcpy_htod_async(dst.device_ptr(), self.host_ptr().cast(), dst.len(), stream.raw()) }
            },
        )
    }
}

impl PinnedHostBuffer<u8> {
    /// [`copy_from_device`](Self::copy_from_device) into this buffer, ordered by its owner
    /// (`order`, see [`OwnOrder`](super::ordering::OwnOrder)), from `src`, ordered by the rule;
    /// `gate` is `stream`'s enqueue gate, held by the caller, which saw the stream not capturing.
    ///
    /// # Errors
    /// As [`copy_from_device`](Self::copy_from_device).
    pub(crate) fn copy_from_device_owned(
        &mut self,
        stream: &Arc<CudaStream>,
        gate: &EnqueueGate<'_>,
        src: CudaView<'_, u8>,
        order: &mut OwnOrder,
    ) -> Result<()> {
        let what = "PinnedHostBuffer::copy_from_device";
        if src.len() > self.len() {
            return Err(CudaError::OutOfBounds { what, start: 0, end: src.len(), len: self.len() });
        }
        check_same_device(
            "PinnedHostBuffer::copy_from_device: src must be on the stream's device",
            stream,
            src.ordinal(),
        )?;
        if src.is_empty() {
            return Ok(());
        }
        let (host, device, bytes, raw_stream) = (self.host_ptr().cast(), src.device_ptr(), src.len(), stream.raw());
        ordered_owned(stream, gate, src.tracked(), Tracked::Host(self.access()), Owned::Dst(order), move || {
            // SAFETY: the buffer holds at least `bytes` bytes (checked) and stays allocated and
            // untouched by the host until the copy completes (its owner's events, handed over to
            // its state before it goes); src is valid; both are ordered on `stream`.
            unsafe { raw::memcpy_dtoh_async(host, device, bytes, raw_stream) }
        })
    }

    /// [`copy_from_device_owned`](Self::copy_from_device_owned) of the whole of `src`, a slice
    /// given up for its last read on `stream`, which frees it after (see
    /// [`Retired`](super::memory::Retired)): the slice's state is handed to `stream`, which
    /// waits for its uses and stands for the copy's read (see
    /// [`OwnOrder::write_from_handed`]).
    ///
    /// # Errors
    /// As [`copy_from_device`](Self::copy_from_device).
    #[inline]
    pub(crate) fn copy_from_retired_owned<T: DeviceRepr>(
        &mut self,
        stream: &Arc<CudaStream>,
        gate: &EnqueueGate<'_>,
        src: &mut Retired<T>,
        order: &mut OwnOrder,
    ) -> Result<()> {
        assert!(Arc::ptr_eq(stream, src.stream()), "a retired slice is read on the stream that frees it");
        let (device, bytes, access) = src.read_parts();
        if bytes > self.len() {
            let what = "PinnedHostBuffer::copy_from_device";
            return Err(CudaError::OutOfBounds { what, start: 0, end: bytes, len: self.len() });
        }
        if bytes == 0 {
            return Ok(());
        }
        let (host, raw_stream) = (self.host_ptr().cast(), stream.raw());
        ordered_retired_owned(stream, gate, access, Tracked::Host(self.access()), order, move || {
            // SAFETY: the buffer holds at least `bytes` bytes (checked) and stays allocated and
            // untouched by the host until the copy completes (its owner's events, handed over to
            // its state before it goes); src is valid for `bytes` bytes, of the stream's device,
            // and freed on `stream` after the copy; both are ordered on `stream`.
            unsafe { raw::memcpy_dtoh_async(host, device, bytes, raw_stream) }
        })
    }

    /// [`copy_to_device`](Self::copy_to_device) out of this buffer, ordered by its owner
    /// (`order`), into `dst`, ordered by the rule; `gate` as for
    /// [`copy_from_device_owned`](Self::copy_from_device_owned).
    ///
    /// # Errors
    /// As [`copy_to_device`](Self::copy_to_device).
    pub(crate) fn copy_to_device_owned(
        &self,
        stream: &Arc<CudaStream>,
        gate: &EnqueueGate<'_>,
        dst: CudaViewMut<'_, u8>,
        order: &mut OwnOrder,
    ) -> Result<()> {
        let what = "PinnedHostBuffer::copy_to_device";
        if dst.len() > self.len() {
            return Err(CudaError::OutOfBounds { what, start: 0, end: dst.len(), len: self.len() });
        }
        check_same_device(
            "PinnedHostBuffer::copy_to_device: dst must be on the stream's device",
            stream,
            dst.ordinal(),
        )?;
        if dst.is_empty() {
            return Ok(());
        }
        let (device, host, bytes, raw_stream) = (dst.device_ptr(), self.host_ptr().cast(), dst.len(), stream.raw());
        ordered_owned(stream, gate, Tracked::Host(self.access()), dst.tracked(), Owned::Src(order), move || {
            // SAFETY: the buffer holds at least `bytes` bytes (checked) and is not written by the
            // host until the copy completes; dst is valid; both are ordered on `stream`.
            unsafe { raw::memcpy_htod_async(device, host, bytes, raw_stream) }
        })
    }
}

impl PinnedHostBuffer<u8> {
    /// Copies `src` into the first `src.len()` bytes of this buffer, on `stream`, ordered by the
    /// crate's rule.
    ///
    /// # Errors
    /// [`CudaError::OutOfBounds`] when `src` is longer than the buffer; [`CudaError::WrongDevice`] when
    /// `src` is on another device than `stream`; the driver's error.
    pub fn copy_from_device(&mut self, stream: &Arc<CudaStream>, src: CudaView<'_, u8>) -> Result<()> {
        self.enqueue_from_device(
            (
                "PinnedHostBuffer::copy_from_device",
                "PinnedHostBuffer::copy_from_device: src must be on the stream's device",
            ),
            stream,
            src,
        )
    }

    /// Copies the first `dst.len()` bytes of this buffer into `dst`, on `stream`, ordered by the
    /// crate's rule.
    ///
    /// # Errors
    /// [`CudaError::OutOfBounds`] when `dst` is longer than the buffer; [`CudaError::WrongDevice`] when
    /// `dst` is on another device than `stream`; the driver's error.
    pub fn copy_to_device(&self, stream: &Arc<CudaStream>, dst: CudaViewMut<'_, u8>) -> Result<()> {
        self.enqueue_to_device(
            (
                "PinnedHostBuffer::copy_to_device",
                "PinnedHostBuffer::copy_to_device: dst must be on the stream's device",
            ),
            stream,
            dst,
        )
    }
}

/// A raw byte copy outside the crate's ordering rule, for code that keeps its own ordering (the
/// topology example times bare copies with it).
impl CudaStream {
    /// Enqueues a copy of `bytes` from `src` to `dst` (unified addresses: device memory of any
    /// device, or pinned host memory) on this stream.
    ///
    /// # Errors
    /// The driver's error.
    ///
    /// # Safety
    /// - Both ranges are valid for `bytes` bytes from the moment the copy runs until it completes.
    /// - Nothing else writes `dst` or frees either range while the copy can run: the caller orders
    ///   all other users with events or stream order.
    /// - A device range of another device than this stream's is reachable from it (peer access
    ///   enabled and not pool memory), or is pinned host memory.
    #[doc(alias = "cuMemcpyAsync")]
    #[inline]
    pub unsafe fn copy_bytes_async(
        &self,
        dst: crate::sys::CUdeviceptr,
        src: crate::sys::CUdeviceptr,
        bytes: usize,
    ) -> Result<()> {
        let _bound = self.context().bind()?;
        // SAFETY: the caller meets memcpy_async's contract; self.raw() is live.
        unsafe { crate::result::memory::memcpy_async(dst, src, bytes, self.raw()) }
    }
}
