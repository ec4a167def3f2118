//! Where a ring's slot buffers live and who owns them: what a slot needs to grow.

use std::sync::Arc;

use super::{MIN_SLOT_BYTES, SlotBuffer};
use crate::pp::error::Result;
use crate::pp::plan::Transport;
use crate::safe::{CudaSlice, CudaStream, DeviceSlice, PinnedHostBuffer};

/// Where a ring's slot buffers live and who owns them: what a slot needs to grow.
#[derive(Clone, Copy)]
pub(in crate::pp) struct SlotHome<'a> {
    /// The boundary's transport.
    pub(in crate::pp) transport: Transport,
    /// The stream that writes the slots.
    pub(in crate::pp) tx_stream: &'a Arc<CudaStream>,
    /// The stream that reads them.
    pub(in crate::pp) rx_stream: &'a Arc<CudaStream>,
}

impl SlotHome<'_> {
    /// Replaces `slot`'s buffer with one of at least `bytes` (a power of two, ≥ 4 KiB), owned by
    /// the RX stream, or, for a boundary from another rank, by its receive stream (that
    /// boundary's TX stream). The slot is free, and no copy in flight ever sees a freed buffer: a
    /// pooled buffer's free is ordered after its last writer and reader; any other's last writer
    /// and reader are waited for first.
    ///
    /// A boundary from another rank takes pooled memory: its slots grow while NCCL's kernels are
    /// in flight, each waiting for its peer, and `cuMemAlloc`/`cuMemFree` may wait for the whole
    /// device (NCCL warns that such a call can deadlock communicators used at once), where the
    /// stream-ordered allocation and free do not. Its receive stream is never captured. Slots
    /// reached by peers' copies stay `cuMemAlloc` memory.
    pub(in crate::pp) fn grow(&self, slot: &mut SlotBuffer, bytes: usize) -> Result<()> {
        let owner = if self.transport == Transport::Nccl { self.tx_stream } else { self.rx_stream };
        // Every copy into and out of an old buffer that is not pooled has completed before it
        // goes (its drop would wait too, but could not report an error).
        match slot {
            SlotBuffer::Device(buffer) if buffer.is_pooled() => {}
            SlotBuffer::Empty => {}
            SlotBuffer::Device(buffer) => buffer.synchronize()?,
            SlotBuffer::Host(buffer) => buffer.synchronize()?,
        }
        let capacity = bytes.checked_next_power_of_two().unwrap_or(bytes).max(MIN_SLOT_BYTES);
        *slot = SlotBuffer::Empty;
        *slot = match self.transport {
            Transport::Local | Transport::Peer | Transport::Ipc => {
                SlotBuffer::Device(Arc::new(CudaSlice::alloc_persistent_eager(owner, capacity)?))
            }
            Transport::Nccl => SlotBuffer::Device(Arc::new(CudaSlice::alloc_eager(owner, capacity)?)),
            Transport::HostStaged => {
                SlotBuffer::Host(Box::new(PinnedHostBuffer::new_eager(owner.context(), capacity)?))
            }
        };
        Ok(())
    }
}
