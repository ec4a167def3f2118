//! Device memory that is a mapping of shared memory (an `ipc` export or import): how a slice is
//! made over one, and how the mapping is given back in place of a free (`DeviceMemory`'s drop).

use std::sync::Arc;

use super::{CudaSlice, DeviceRepr};
use crate::cuda_error::Result;
use crate::safe::stream::CudaStream;
use crate::sys::CUdeviceptr;

/// How a mapping of shared memory (`ipc`: an export or an import) is given back, instead of a
/// free: its drop waits on the host for every use, then calls `release` once.
pub(crate) trait ReleaseMapping: Send + Sync + std::fmt::Debug {
    /// Unmaps the memory at `ptr` and releases what backs it.
    /// # Safety
    /// - Called once, after every use of the memory has completed, with its context bound.
    unsafe fn release(&mut self, ptr: CUdeviceptr) -> Result<()>;
}

impl<T: DeviceRepr> CudaSlice<T> {
    /// A slice of the mapping at `ptr`, owned by `stream`; released by `mapping` after every
    /// use. Kernels of other devices do not reach it (as pool memory).
    /// # Safety
    /// - `ptr` is mapped readable and writable for `stream`'s device for `len` elements of `T`
    ///   until `mapping` releases it (nothing else does); no other slice covers it.
    pub(crate) unsafe fn from_mapping(
        ptr: CUdeviceptr,
        len: usize,
        stream: &Arc<CudaStream>,
        mapping: Box<dyn ReleaseMapping>,
        eager: bool,
    ) -> CudaSlice<T> {
        let mut slice = Self::of_memory(ptr, len, stream, true, false, eager);
        Arc::get_mut(&mut slice.mem).expect("a new slice's memory is its own").mapping = Some(mapping);
        slice
    }
}
