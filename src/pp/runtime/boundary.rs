//! A boundary's own helpers: where its slot buffers live, its link's failure, and the copies
//! into and out of its slots (the SM copy kernel within one device, else the copy engine; a
//! slot ordered by its own events, or by the rule).

use std::sync::Arc;

use super::{Boundary, SM_COPY_MAX_BYTES};
use crate::pp::error::Error;
use crate::pp::plan::Transport;
use crate::pp::ring::SlotHome;
use crate::safe::ordering::Owned;
use crate::safe::{CudaStream, CudaView, CudaViewMut, DeviceSlice, EnqueueGate};

impl Boundary {
    /// Where the ring's slot buffers live, to grow them.
    pub(super) fn home(&self) -> SlotHome<'_> {
        SlotHome { transport: self.plan.transport, tx_stream: &self.tx_stream, rx_stream: &self.rx_stream }
    }

    /// The error of the failed link from the TX stage's rank, if this boundary has one that
    /// failed.
    pub(super) fn link_failure(&self) -> Option<Error> {
        self.inbound.as_ref().and_then(|link| link.stopped())
    }

    /// Enqueues a copy within the RX device on `stream` (a stream of that device): the SM copy
    /// kernel when the boundary may use it, up to [`SM_COPY_MAX_BYTES`], with both addresses
    /// 16-byte aligned; else the copy engine.
    pub(super) fn copy_within_device(
        &self,
        stream: &Arc<CudaStream>,
        src: CudaView<'_, u8>,
        dst: CudaViewMut<'_, u8>,
    ) -> crate::error::CudaResult<()> {
        if self.sm_copies && src.len() <= SM_COPY_MAX_BYTES && src.is_aligned_to(16) && dst.is_aligned_to(16) {
            self.rx_engine.helper_kernels()?.copy_bytes(stream, src, dst)
        } else {
            stream.memcpy_dtod(&src, &mut { dst })
        }
    }

    /// Enqueues a copy of which one side is a slot buffer ordered by its own events (`owned`),
    /// the other ordered by the rule, on `stream` (the TX stream into the slot, the RX stream out
    /// of it; `gate`: its enqueue gate, seen uncaptured): as
    /// [`copy_within_device`](Self::copy_within_device) within the RX device (the SM copy checks
    /// the devices and the alignment itself, and leaves any other copy to the copy engine), else
    /// the copy engine.
    #[inline(always)]
    pub(super) fn copy_owned(
        &self,
        stream: &Arc<CudaStream>,
        gate: &EnqueueGate<'_>,
        src: CudaView<'_, u8>,
        dst: CudaViewMut<'_, u8>,
        owned: Owned<'_>,
    ) -> crate::error::CudaResult<()> {
        if self.sm_copies && src.len() <= SM_COPY_MAX_BYTES {
            self.rx_engine.helper_kernels()?.copy_bytes_owned(stream, gate, src, dst, owned)
        } else {
            stream.memcpy_dtod_owned(gate, src, dst, owned)
        }
    }

    /// Enqueues the copy of `tx` into a slot of this (device-transport) boundary on `stream`, the
    /// TX stage's stream: within the device for a local boundary, across devices for a peer one.
    pub(super) fn copy_into_slot(
        &self,
        stream: &Arc<CudaStream>,
        src: CudaView<'_, u8>,
        dst: CudaViewMut<'_, u8>,
    ) -> crate::error::CudaResult<()> {
        if self.plan.transport == Transport::Local {
            self.copy_within_device(stream, src, dst)
        } else {
            stream.memcpy_dtod(&src, &mut { dst })
        }
    }
}
