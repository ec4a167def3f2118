//! Page-locked (pinned) host buffers.
//!
//! Copies between pinned memory and the device run truly asynchronously, so the buffer must not
//! be read, written or freed while one is in flight. Every asynchronous copy records an event in
//! the buffer; host access and `Drop` wait for it first.

use std::sync::{Arc, Mutex};

use super::context::Context;
use super::event::CudaEvent;
use super::memory::{DeviceRepr, DeviceSlice, DeviceSliceMut, byte_size, check_host_copy_device};
use super::stream::CudaStream;
use crate::error::{Error, Result};
use crate::result::memory as raw;
use crate::sys::{CU_MEMHOSTALLOC_PORTABLE, CU_MEMHOSTALLOC_WRITECOMBINED};

/// A page-locked host array of `T`, usable by every context (`CU_MEMHOSTALLOC_PORTABLE`).
#[derive(Debug)]
pub struct PinnedHostBuffer<T: DeviceRepr> {
    ptr: *mut T,
    len: usize,
    ctx: Arc<Context>,
    pending: Mutex<Option<CudaEvent>>,
}

// SAFETY: the buffer owns its host allocation; access from any thread goes through &/&mut self
// and waits for the pending copy first.
unsafe impl<T: DeviceRepr> Send for PinnedHostBuffer<T> {}
// SAFETY: &self methods only read the memory after the pending copy completed (guarded by the
// mutex); no &self method writes it.
unsafe impl<T: DeviceRepr> Sync for PinnedHostBuffer<T> {}

impl<T: DeviceRepr> PinnedHostBuffer<T> {
    /// Allocates `len` elements, zeroed. `write_combined` makes host writes and device reads
    /// faster and host reads very slow: ask for it only for buffers the host only writes.
    ///
    /// # Errors
    /// [`Error::SizeOverflow`]; the driver's error.
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
        Ok(PinnedHostBuffer { ptr, len, ctx: Arc::clone(ctx), pending: Mutex::new(None) })
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

    fn wait_pending(&self) -> Result<()> {
        let mut pending = self.pending.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(event) = pending.as_ref() {
            event.synchronize()?;
        }
        *pending = None;
        Ok(())
    }

    /// The contents, after any copy in flight has completed.
    ///
    /// # Errors
    /// The error of the copy waited for.
    pub fn as_slice(&self) -> Result<&[T]> {
        self.wait_pending()?;
        // SAFETY: ptr is valid for len initialised elements (zeroed at allocation, T plain data)
        // and no copy is in flight.
        Ok(unsafe { std::slice::from_raw_parts(self.ptr, self.len) })
    }

    /// The contents, mutable, after any copy in flight has completed.
    ///
    /// # Errors
    /// The error of the copy waited for.
    pub fn as_mut_slice(&mut self) -> Result<&mut [T]> {
        self.wait_pending()?;
        // SAFETY: as in as_slice, and &mut self makes the access exclusive.
        Ok(unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) })
    }

    /// Records `event` (created before the copy was enqueued, so that a failure to create one
    /// enqueues nothing) on `stream` as the buffer's pending copy. The caller waited for the
    /// previous one before enqueuing.
    fn set_pending(&self, stream: &CudaStream, event: CudaEvent) -> Result<()> {
        event.record(stream)?;
        let mut pending = self.pending.lock().unwrap_or_else(|p| p.into_inner());
        *pending = Some(event);
        Ok(())
    }
}

impl CudaStream {
    /// Copies pinned `src` into `dst`, asynchronously on this stream.
    ///
    /// # Errors
    /// [`Error::LengthMismatch`] unless the lengths agree; [`Error::WrongDevice`] when `dst` is on
    /// another device than this stream; the driver's error.
    #[doc(alias = "cuMemcpyHtoDAsync")]
    pub fn memcpy_htod_pinned<T: DeviceRepr, D: DeviceSliceMut<T>>(
        &self,
        src: &PinnedHostBuffer<T>,
        dst: &mut D,
    ) -> Result<()> {
        if src.len() != dst.len() {
            return Err(Error::LengthMismatch {
                what: "CudaStream::memcpy_htod_pinned",
                expected: dst.len(),
                found: src.len(),
            });
        }
        check_host_copy_device(
            "CudaStream::memcpy_htod_pinned: dst must be on the stream's device",
            self,
            dst.ordinal(),
        )?;
        if src.is_empty() {
            return Ok(());
        }
        src.wait_pending()?;
        let pending = CudaEvent::new(self.context(), false)?;
        self.join(dst.stream())?;
        let _bound = self.context().bind()?;
        // SAFETY: src stays allocated and unwritten until the pending event recorded below
        // completes (Drop and host access wait for it; if recording fails, settle waits for the
        // copy before returning); dst is valid and ordered after its owner.
        unsafe { raw::memcpy_htod_async(dst.device_ptr(), src.ptr.cast(), dst.byte_len(), self.raw())? };
        self.settle(src.set_pending(self, pending).and_then(|()| dst.stream().join(self)))
    }

    /// Copies `src` into pinned `dst`, asynchronously on this stream; `dst`'s contents are
    /// readable once the copy completes (its accessors wait).
    ///
    /// # Errors
    /// [`Error::LengthMismatch`] unless the lengths agree; [`Error::WrongDevice`] when `src` is on
    /// another device than this stream; the driver's error.
    #[doc(alias = "cuMemcpyDtoHAsync")]
    pub fn memcpy_dtoh_pinned<T: DeviceRepr, S: DeviceSlice<T>>(
        &self,
        src: &S,
        dst: &mut PinnedHostBuffer<T>,
    ) -> Result<()> {
        if src.len() != dst.len() {
            return Err(Error::LengthMismatch {
                what: "CudaStream::memcpy_dtoh_pinned",
                expected: dst.len(),
                found: src.len(),
            });
        }
        check_host_copy_device(
            "CudaStream::memcpy_dtoh_pinned: src must be on the stream's device",
            self,
            src.ordinal(),
        )?;
        if src.is_empty() {
            return Ok(());
        }
        dst.wait_pending()?;
        let pending = CudaEvent::new(self.context(), false)?;
        self.join(src.stream())?;
        let _bound = self.context().bind()?;
        // SAFETY: dst is exclusively borrowed, stays allocated and unread until the pending event
        // completes (or, if recording it fails, settle waits for the copy); src is valid and
        // ordered after its owner.
        unsafe { raw::memcpy_dtoh_async(dst.ptr.cast(), src.device_ptr(), src.byte_len(), self.raw())? };
        self.settle(dst.set_pending(self, pending).and_then(|()| src.stream().join(self)))
    }
}

impl<T: DeviceRepr> Drop for PinnedHostBuffer<T> {
    fn drop(&mut self) {
        if let Err(e) = self.wait_pending() {
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
