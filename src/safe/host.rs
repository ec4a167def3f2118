//! Page-locked (pinned) host buffers.
//!
//! Copies between pinned memory and the device run truly asynchronously, so the buffer must not
//! be read, written or freed while one is in flight. The buffer follows the crate's ordering rule
//! like device memory: copies on any stream order themselves after its conflicting uses, and host
//! access waits on the host first (reading waits for device writes into it; writing and `Drop`
//! wait for every use).

use std::sync::Arc;

use super::context::Context;
use super::memory::{
    CudaView, CudaViewMut, DeviceRepr, DeviceSlice, DeviceSliceMut, Tracked, byte_size, check_same_device, ordered,
};
use super::ordering::{Access, Use};
use super::stream::CudaStream;
use crate::cuda_error::{CudaError, Result};
use crate::result::memory as raw;
use crate::sys::{CU_MEMHOSTALLOC_PORTABLE, CU_MEMHOSTALLOC_WRITECOMBINED};

/// A page-locked host array of `T`, usable by every context (`CU_MEMHOSTALLOC_PORTABLE`).
#[derive(Debug)]
pub struct PinnedHostBuffer<T: DeviceRepr> {
    ptr: *mut T,
    len: usize,
    ctx: Arc<Context>,
    access: Access,
}

// SAFETY: the buffer owns its host allocation; access from any thread goes through &/&mut self
// and waits for the device's conflicting uses first.
unsafe impl<T: DeviceRepr> Send for PinnedHostBuffer<T> {}
// SAFETY: &self methods only read the memory after every device write into it completed; no &self
// method writes it.
unsafe impl<T: DeviceRepr> Sync for PinnedHostBuffer<T> {}

impl<T: DeviceRepr> PinnedHostBuffer<T> {
    /// Allocates `len` elements, zeroed. `write_combined` makes host writes and device reads
    /// faster and host reads very slow: ask for it only for buffers the host only writes.
    ///
    /// # Errors
    /// [`CudaError::SizeOverflow`]; the driver's error.
    #[doc(alias = "cuMemHostAlloc")]
    pub fn new(ctx: &Arc<Context>, len: usize, write_combined: bool) -> Result<PinnedHostBuffer<T>> {
        let bytes = byte_size::<T>("PinnedHostBuffer::new", len)?;
        let ptr = if bytes == 0 {
            std::ptr::NonNull::<T>::dangling().as_ptr()
        } else {
            let _bound = ctx.bind()?;
            let flags = CU_MEMHOSTALLOC_PORTABLE | if write_combined { CU_MEMHOSTALLOC_WRITECOMBINED } else { 0 };
            let ptr = raw::host_alloc(bytes, flags)?.cast::<T>();
            // SAFETY: the allocation is `bytes` long, suitably aligned (page-aligned) and owned.
            unsafe { std::ptr::write_bytes(ptr.cast::<u8>(), 0, bytes) };
            ptr
        };
        Ok(PinnedHostBuffer { ptr, len, ctx: Arc::clone(ctx), access: Access::new(None, false) })
    }

    /// Like [`new`](Self::new), for buffers whose every use records its completion event at once
    /// (the pipeline's host-staged slots).
    pub(crate) fn new_eager(ctx: &Arc<Context>, len: usize) -> Result<PinnedHostBuffer<T>> {
        let mut buffer = Self::new(ctx, len, false)?;
        buffer.access = Access::new(None, true);
        Ok(buffer)
    }

    /// Number of elements.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the buffer has no elements.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The host address (for interop; the copy methods keep the ordering for you).
    pub fn as_ptr(&self) -> *const T {
        self.ptr
    }

    /// The host address, mutable (for interop; the copy methods keep the ordering for you).
    pub fn as_mut_ptr(&mut self) -> *mut T {
        self.ptr
    }

    /// The contents, after every device write into the buffer has completed.
    ///
    /// # Errors
    /// The error of the work waited for.
    pub fn as_slice(&self) -> Result<&[T]> {
        self.access.wait_on_host("PinnedHostBuffer::as_slice", Use::Read)?;
        // SAFETY: ptr is valid for len initialised elements (zeroed at allocation, T plain data)
        // and no device write is in flight.
        Ok(unsafe { std::slice::from_raw_parts(self.ptr, self.len) })
    }

    /// The contents, mutable, after every device use of the buffer has completed.
    ///
    /// # Errors
    /// The error of the work waited for.
    pub fn as_mut_slice(&mut self) -> Result<&mut [T]> {
        self.access.wait_on_host("PinnedHostBuffer::as_mut_slice", Use::Write)?;
        // SAFETY: as in as_slice, no device read is in flight either, and &mut self makes the
        // access exclusive.
        Ok(unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) })
    }

    /// The buffer's ordering state.
    #[cfg(feature = "testing")]
    pub(crate) fn access(&self) -> &Access {
        &self.access
    }

    /// Blocks until every device use of the buffer enqueued so far has completed.
    ///
    /// # Errors
    /// The error of the work waited for.
    pub fn synchronize(&self) -> Result<()> {
        self.access.wait_on_host("PinnedHostBuffer::synchronize", Use::Write)
    }
}

impl<T: DeviceRepr> PinnedHostBuffer<T> {
    /// Enqueues a copy of `src` into the buffer's first `src.len()` bytes on `stream`, ordered by
    /// the crate's rule. Callers hold the buffer exclusively (it is written).
    fn enqueue_from_device(
        &self,
        what: (&'static str, &'static str),
        stream: &Arc<CudaStream>,
        src: CudaView<'_, u8>,
    ) -> Result<()> {
        let capacity = self.len * std::mem::size_of::<T>();
        if src.len() > capacity {
            return Err(CudaError::OutOfBounds { what: what.0, start: 0, end: src.len(), len: capacity });
        }
        check_same_device(what.1, stream, src.ordinal())?;
        if src.is_empty() {
            return Ok(());
        }
        ordered(
            stream,
            [(src.tracked(), Use::Read), (Tracked::Host(&self.access), Use::Write)],
            #[inline(always)]
            || {
                // SAFETY: the buffer holds at least src.len() bytes (checked) and stays allocated and
                // untouched by the host until the copy completes (host access and Drop wait for its
                // uses); src is valid; both are ordered on `stream`.
                unsafe { raw::memcpy_dtoh_async(self.ptr.cast(), src.device_ptr(), src.len(), stream.raw()) }
            },
        )
    }

    /// Enqueues a copy of the buffer's first `dst.len()` bytes into `dst` on `stream`, ordered by
    /// the crate's rule.
    fn enqueue_to_device(
        &self,
        what: (&'static str, &'static str),
        stream: &Arc<CudaStream>,
        dst: CudaViewMut<'_, u8>,
    ) -> Result<()> {
        let capacity = self.len * std::mem::size_of::<T>();
        if dst.len() > capacity {
            return Err(CudaError::OutOfBounds { what: what.0, start: 0, end: dst.len(), len: capacity });
        }
        check_same_device(what.1, stream, dst.ordinal())?;
        if dst.is_empty() {
            return Ok(());
        }
        ordered(
            stream,
            [(Tracked::Host(&self.access), Use::Read), (dst.tracked(), Use::Write)],
            #[inline(always)]
            || {
                // SAFETY: the buffer holds at least dst.len() bytes (checked) and is not written by
                // the host until the copy completes (as_mut_slice and Drop wait for its uses); dst is
                // valid; both are ordered on `stream`.
                unsafe { raw::memcpy_htod_async(dst.device_ptr(), self.ptr.cast(), dst.len(), stream.raw()) }
            },
        )
    }
}

impl CudaStream {
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

impl PinnedHostBuffer<u8> {
    /// The first `len` elements of the buffer's bytes as `T`s, after every device write into the
    /// buffer has completed.
    ///
    /// # Errors
    /// [`CudaError::OutOfBounds`] when `len` elements of `T` do not fit; [`CudaError::Misaligned`] when
    /// the buffer is not aligned for `T` (pinned allocations are page-aligned); the error of the
    /// work waited for.
    pub fn as_slice_of<T: DeviceRepr>(&self, len: usize) -> Result<&[T]> {
        let bytes = byte_size::<T>("PinnedHostBuffer::as_slice_of", len)?;
        if bytes > self.len {
            return Err(CudaError::OutOfBounds {
                what: "PinnedHostBuffer::as_slice_of",
                start: 0,
                end: bytes,
                len: self.len,
            });
        }
        if len > 0 && (self.ptr as usize) % std::mem::align_of::<T>() != 0 {
            return Err(CudaError::Misaligned {
                what: "PinnedHostBuffer::as_slice_of",
                address: self.ptr as u64,
                align: std::mem::align_of::<T>(),
            });
        }
        self.access.wait_on_host("PinnedHostBuffer::as_slice_of", Use::Read)?;
        if len == 0 {
            return Ok(&[]);
        }
        // SAFETY: the range holds `bytes` initialised bytes of this allocation (zeroed at
        // allocation, or written by completed copies), aligned for T (checked); every bit pattern
        // is a valid T (DeviceRepr); no device write is in flight (waited above) and none can
        // start while the returned borrow of self lives (device writes need &mut self).
        Ok(unsafe { std::slice::from_raw_parts(self.ptr.cast::<T>(), len) })
    }

    /// Whether every device write into the buffer enqueued so far has completed (does not block).
    ///
    /// # Errors
    /// The driver's error.
    pub fn is_ready(&self) -> Result<bool> {
        self.access.is_complete("PinnedHostBuffer::is_ready", Use::Read)
    }

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

impl<T: DeviceRepr> Drop for PinnedHostBuffer<T> {
    fn drop(&mut self) {
        if let Some(blocked) = super::graph::free_blocked(None) {
            // Waiting on the host would break a capture: hand the buffer to it, which frees it
            // when it ends, or to a thread the capture leaves free.
            let held = PinnedHostBuffer {
                ptr: std::mem::replace(&mut self.ptr, std::ptr::null_mut()),
                len: std::mem::take(&mut self.len),
                ctx: Arc::clone(&self.ctx),
                access: std::mem::replace(&mut self.access, Access::new(None, false)),
            };
            blocked.hold(Box::new(held));
            return;
        }
        if let Err(e) = self.access.wait_on_host("PinnedHostBuffer::drop", Use::Write) {
            // The copy failed; its memory may still be in use by a dead context. Leak rather
            // than free memory the device might write.
            super::record_drop_error(e);
            return;
        }
        if self.len == 0 || std::mem::size_of::<T>() == 0 {
            return;
        }
        let result = self.ctx.bind().and_then(|_bound| {
            // SAFETY: ptr came from cuMemHostAlloc, is freed once, and no copy is in flight.
            unsafe { raw::free_host(self.ptr.cast()) }
        });
        if let Err(e) = result {
            super::record_drop_error(e);
        }
    }
}
