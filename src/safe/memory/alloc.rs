//! Where a [`CudaSlice`]'s memory comes from: the device's stream-ordered pool
//! (`cuMemAllocAsync`, on the owning stream, refused inside a capture) or `cuMemAlloc` (peers
//! reach it; devices without pools fall back to it), eager or not.

use std::sync::Arc;

use super::{CudaSlice, byte_size};
use crate::cuda_error::Result;
use crate::result::memory as raw;
use crate::safe::element::DeviceRepr;
use crate::safe::stream::{CudaStream, EnqueueGate};

impl<T: DeviceRepr> CudaSlice<T> {
    /// Allocates `len` elements from the device's memory pool, ordered on `stream`, which owns the
    /// slice. The contents are unspecified (any bit pattern, valid for `T`). On a device without
    /// memory pools ([`Context::memory_pools_supported`](crate::Context::memory_pools_supported))
    /// this is [`alloc_persistent`](Self::alloc_persistent).
    ///
    /// # Errors
    /// [`CudaError::SizeOverflow`](crate::CudaError::SizeOverflow); the driver's error (`CUDA_ERROR_OUT_OF_MEMORY`).
    #[doc(alias = "cuMemAllocAsync")]
    #[inline]
    pub fn alloc(stream: &Arc<CudaStream>, len: usize) -> Result<CudaSlice<T>> {
        Self::alloc_pooled(stream, len, false)
    }

    /// Like [`alloc`](Self::alloc), for buffers whose every use should record its completion
    /// event at once (see [`alloc_persistent_eager`](Self::alloc_persistent_eager)): the slot
    /// buffers of boundaries from other ranks. Neither this allocation nor the buffer's free
    /// waits for the device (as `cuMemAlloc` and `cuMemFree` may), which NCCL's kernels in
    /// flight, each waiting for its peer, could turn into a deadlock.
    pub(crate) fn alloc_eager(stream: &Arc<CudaStream>, len: usize) -> Result<CudaSlice<T>> {
        Self::alloc_pooled(stream, len, true)
    }

    /// [`alloc`](Self::alloc) under `gate`, `stream`'s enqueue gate, held by the caller, which saw
    /// the stream not capturing under it (a receive's output buffer, allocated under the gate of
    /// the copy that fills it): no second look at the capture.
    #[inline(always)]
    pub(crate) fn alloc_under(stream: &Arc<CudaStream>, gate: &EnqueueGate<'_>, len: usize) -> Result<CudaSlice<T>> {
        assert!(gate.holds(stream) && !stream.is_capturing(), "an allocation under a gate outside a capture");
        let pools = stream.context().memory_pools_supported();
        if !pools {
            return Self::alloc_plain(stream, len, false);
        }
        let bytes = byte_size::<T>("CudaSlice::alloc", len)?;
        Self::alloc_async_bytes(stream, bytes, len, false)
    }

    #[inline(always)]
    fn alloc_pooled(stream: &Arc<CudaStream>, len: usize, eager: bool) -> Result<CudaSlice<T>> {
        if !stream.context().memory_pools_supported() {
            return Self::alloc_plain(stream, len, eager);
        }
        let bytes = byte_size::<T>("CudaSlice::alloc", len)?;
        let _gate = stream.enqueue_gate();
        if stream.is_capturing() {
            // A graph allocation would be made at every run and outlive none: graphs use memory
            // allocated before the capture.
            stream.refuse_in_capture("CudaSlice::alloc on a capturing stream")?;
        }
        Self::alloc_async_bytes(stream, bytes, len, eager)
    }

    /// The stream-ordered allocation of `bytes` (`len` elements) on `stream`, whose enqueue gate
    /// the caller holds, seen uncaptured.
    #[inline(always)]
    fn alloc_async_bytes(stream: &Arc<CudaStream>, bytes: usize, len: usize, eager: bool) -> Result<CudaSlice<T>> {
        let ptr = if bytes == 0 {
            0
        } else {
            let _bound = stream.context().bind()?;
            // SAFETY: the stream is live; the memory is used only by work ordered after this on
            // `stream` or joined to it (see the module doc).
            unsafe { raw::alloc_async(bytes, stream.raw())? }
        };
        Ok(CudaSlice::new(ptr, len, stream, true, eager))
    }

    /// Allocates `len` elements with `cuMemAlloc` (not from a pool: peers with peer access can
    /// reach it), owned by `stream`. The contents are unspecified (any bit pattern, valid for `T`).
    ///
    /// # Errors
    /// [`CudaError::SizeOverflow`](crate::CudaError::SizeOverflow); the driver's error.
    #[doc(alias = "cuMemAlloc")]
    pub fn alloc_persistent(stream: &Arc<CudaStream>, len: usize) -> Result<CudaSlice<T>> {
        Self::alloc_plain(stream, len, false)
    }

    fn alloc_plain(stream: &Arc<CudaStream>, len: usize, eager: bool) -> Result<CudaSlice<T>> {
        let bytes = byte_size::<T>("CudaSlice::alloc_persistent", len)?;
        stream.refuse_in_capture("CudaSlice::alloc_persistent (cuMemAlloc)")?;
        let ptr = if bytes == 0 {
            0
        } else {
            let _bound = stream.context().bind()?;
            raw::alloc(bytes)?
        };
        Ok(CudaSlice::new(ptr, len, stream, false, eager))
    }

    /// Like [`alloc_persistent`](Self::alloc_persistent), for buffers whose every use should
    /// record its completion event at once (rather than when another stream first waits for it):
    /// the pipeline's slot buffers, whose readers and writers on other devices then wait for
    /// exactly the copy, not for the later work of its stream.
    pub(crate) fn alloc_persistent_eager(stream: &Arc<CudaStream>, len: usize) -> Result<CudaSlice<T>> {
        Self::alloc_plain(stream, len, true)
    }
}
