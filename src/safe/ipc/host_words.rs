//! Flag words in host memory that two processes share (a [`ControlBlock`]: a memfd each of them
//! maps), registered with the driver in this process so that a stream writes and waits on them
//! (`cuMemHostRegister`, `cuMemHostGetDevicePointer`): a slice of the crate's memory that keeps
//! the block mapped and registered until every use of it has completed.
//!
//! What one process's stream writes there (`cuStreamWriteValue64`, after a fence), the other
//! process's host reads with an atomic load, and the other way round: neither side's stream ever
//! waits for the other process's stream, only for a word a host stores.

use std::sync::Arc;

use crate::cuda_error::Result;
use crate::local_channel::ControlBlock;
use crate::result::memory as raw_memory;
use crate::safe::memory::{CudaSlice, ReleaseMapping};
use crate::safe::stream::CudaStream;
use crate::sys::CUdeviceptr;

/// `CU_MEMHOSTREGISTER_PORTABLE | CU_MEMHOSTREGISTER_DEVICEMAP`: every context reaches the words.
const REGISTER_FLAGS: u32 = 0x1 | 0x2;

/// A registered control block: unregistered by the slice's release, after every use. Dropped
/// without its release (a slice whose uses could not be waited for is not freed), it keeps the
/// block mapped for good: the device may still write into the pages, which must stay this
/// process's and registered.
#[derive(Debug)]
struct Registration {
    block: Option<Arc<ControlBlock>>,
}

impl ReleaseMapping for Registration {
    unsafe fn release(&mut self, _ptr: CUdeviceptr) -> Result<()> {
        let Some(block) = self.block.as_ref() else { return Ok(()) };
        // SAFETY: the block's mapping was registered once by `register_control_block`, and no use
        // of it is pending (the caller's contract); the block is still mapped (held here).
        unsafe { raw_memory::host_unregister(block.as_mut_ptr()) }?;
        self.block = None;
        Ok(())
    }
}

impl Drop for Registration {
    fn drop(&mut self) {
        if let Some(block) = self.block.take() {
            // Not unregistered: never unmapped either (see the type's docs).
            std::mem::forget(block);
        }
    }
}

/// Registers `block`'s mapping in `stream`'s context and returns its words as a slice owned by
/// `stream` (the block stays mapped as long as the slice, and is unregistered once every use of
/// the slice has completed).
///
/// # Errors
/// [`CaptureError::IllegalCall`](crate::CaptureError::IllegalCall) on a capturing stream; the
/// driver's error (a block registered already in this process is
/// `CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED`).
pub(crate) fn register_control_block(stream: &Arc<CudaStream>, block: Arc<ControlBlock>) -> Result<CudaSlice<u64>> {
    stream.refuse_in_capture("registering a control block (cuMemHostRegister)")?;
    let _bound = stream.context().bind()?;
    let (ptr, bytes) = (block.as_mut_ptr(), block.byte_len());
    // SAFETY: the block's mapping is `bytes` long and stays mapped as long as `block`, which the
    // registration holds until it unregisters the range.
    unsafe { raw_memory::host_register(ptr, bytes, REGISTER_FLAGS)? };
    let device = match raw_memory::host_device_pointer(ptr) {
        Ok(device) => device,
        Err(e) => {
            // SAFETY: registered just above, never used.
            let _ = unsafe { raw_memory::host_unregister(ptr) };
            return Err(e);
        }
    };
    let release = Box::new(Registration { block: Some(block) });
    // SAFETY: `device` addresses the block's `bytes` bytes (a whole number of words) for this
    // context until the release unregisters them, which only the slice's drop calls; the range
    // was registered here once, so no other slice covers it.
    Ok(unsafe { CudaSlice::from_mapping(device, bytes / 8, stream, release, true) })
}
