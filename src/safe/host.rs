//! Page-locked (pinned) host buffers.
//!
//! Copies between pinned memory and the device run truly asynchronously, so the buffer must not
//! be read, written or freed while one is in flight. The buffer follows the crate's ordering rule
//! like device memory: copies on any stream order themselves after its conflicting uses, and host
//! access waits on the host first (reading waits for device writes into it; writing and `Drop`
//! wait for every use). The copies between the buffer and the device are `copy`'s; a free that
//! a capture forbids now is held back (`capture`).

use std::sync::Arc;

use super::capture::free_blocked;
use super::context::Context;
use super::element::DeviceRepr;
use super::memory::byte_size;
use super::ordering::{Access, Use};
use crate::cuda_error::{CudaError, Result};
use crate::result::memory as raw;
use crate::sys::{CU_MEMHOSTALLOC_PORTABLE, CU_MEMHOSTALLOC_WRITECOMBINED};

/// A page-locked host array of `T`, usable by every context (`CU_MEMHOSTALLOC_PORTABLE`).
///
/// ```no_run
/// use ppnrt::PinnedHostBuffer;
/// # fn main() -> ppnrt::Result<()> {
/// let engine = ppnrt::Engine::new(0)?;
/// let stream = engine.stream()?;
/// let x = engine.htod(&[1.0f32; 4096])?;
/// let mut host = PinnedHostBuffer::<f32>::new(engine.context(), 4096, false)?;
/// stream.memcpy_dtoh_pinned(&x, &mut host)?; // returns at once
/// // ... the next step's work is enqueued here ...
/// let values: &[f32] = host.as_slice()?; // waits for the copy
/// assert_eq!(values[0], 1.0);
/// # Ok(()) }
/// ```
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
    #[inline]
    pub(crate) fn access(&self) -> &Access {
        &self.access
    }

    /// The host address, for the copies (`copy`), which order their use of it.
    #[inline]
    pub(crate) fn host_ptr(&self) -> *mut T {
        self.ptr
    }

    /// Blocks until every device use of the buffer enqueued so far has completed.
    ///
    /// # Errors
    /// The error of the work waited for.
    pub fn synchronize(&self) -> Result<()> {
        self.access.wait_on_host("PinnedHostBuffer::synchronize", Use::Write)
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
}

impl<T: DeviceRepr> Drop for PinnedHostBuffer<T> {
    fn drop(&mut self) {
        if let Some(blocked) = free_blocked(|| None) {
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
