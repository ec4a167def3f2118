//! A slice given up for its last read ([`Retired`]): the memory's only handle (no graph holds
//! it), its free moved to the stream of that read. Its ordering state is then held exclusively,
//! so the read can hand the state to that stream ([`Access::hand_to`]) instead of noting the read
//! apart (the deferred readback's source, `copy`'s `copy_from_retired_owned`).

use std::sync::Arc;

use super::{CudaSlice, DeviceRepr};
use crate::safe::ordering::Access;
use crate::safe::stream::CudaStream;
use crate::sys::CUdeviceptr;

/// A slice given up for a last read on one stream, which then frees it (see the
/// [module docs](self)): it can only be read on that stream, and dropped.
#[derive(Debug)]
pub(crate) struct Retired<T: DeviceRepr> {
    slice: CudaSlice<T>,
    /// The stream of the last read until the read, then the one the memory had (the read swaps
    /// the two: the memory is freed on the read's stream).
    stream: Arc<CudaStream>,
}

impl<T: DeviceRepr> CudaSlice<T> {
    /// Gives the slice up for a last read on `stream` (of its device), which then frees it
    /// (as [`set_stream`](Self::set_stream)): [`Retired`] when this slice is its memory's only
    /// handle, else the slice back unchanged (a graph holds the memory, and frees it last).
    pub(crate) fn retire(self, stream: &Arc<CudaStream>) -> Result<Retired<T>, CudaSlice<T>> {
        // A look at the counts (no other handle can appear: this one is owned here); the memory
        // is taken exclusively at the read.
        if Arc::strong_count(&self.mem) != 1 || Arc::weak_count(&self.mem) != 0 {
            return Err(self);
        }
        if stream.ordinal() != self.mem.stream.ordinal() {
            return Err(self);
        }
        Ok(Retired { slice: self, stream: Arc::clone(stream) })
    }
}

impl<T: DeviceRepr> Retired<T> {
    /// The stream of the last read, which frees the memory after it.
    #[inline]
    pub(crate) fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    /// The slice's address and size in bytes, to read, and its memory's ordering state,
    /// exclusively (no other handle of the memory exists): for the read to hand it to its stream.
    /// From here on the memory is freed on that stream.
    #[inline]
    pub(crate) fn read_parts(&mut self) -> (CUdeviceptr, usize, &mut Access) {
        let (ptr, bytes) = (self.slice.ptr, self.slice.len * std::mem::size_of::<T>());
        let mem = Arc::get_mut(&mut self.slice.mem).expect("a retired slice is its memory's only handle");
        std::mem::swap(&mut mem.stream, &mut self.stream);
        (ptr, bytes, &mut mem.access)
    }
}
