//! Groups of point-to-point operations ([`P2p`], [`group`]): every operation ordered, issued
//! in one NCCL group.

use super::*;

/// One send or receive of a [`group`].
///
/// ```no_run
/// use ppnrt::Engine;
/// use ppnrt::nccl::{NcclComm, P2p, group};
///
/// fn exchange(engine: &Engine, comm: &NcclComm) -> ppnrt::Result<()> {
/// let stream = engine.stream()?;
/// let peer = 1 - comm.rank();
/// let x = engine.htod(&[1.0f32; 256])?;
/// let mut y = engine.alloc::<f32>(256)?;
/// // Both ranks send and receive at once: one group, so neither waits for the other.
/// // SAFETY: the peer sends and receives exactly 256 f32 too.
/// let ops = unsafe { [P2p::send(comm, &stream, &x, peer), P2p::recv(comm, &stream, &mut y, peer)] };
/// group(&ops)?;
/// Ok(())
/// }
/// ```
#[derive(Debug)]
pub enum P2p<'a> {
    /// Sends the bytes of `buf` to rank `peer` on `stream`.
    Send {
        /// The communicator.
        comm: &'a NcclComm,
        /// The stream of the send (of the communicator's device).
        stream: &'a Arc<CudaStream>,
        /// What is sent.
        buf: CudaView<'a, u8>,
        /// The receiving rank.
        peer: i32,
    },
    /// Receives from rank `peer` into the bytes of `buf` on `stream`.
    Recv {
        /// The communicator.
        comm: &'a NcclComm,
        /// The stream of the receive (of the communicator's device).
        stream: &'a Arc<CudaStream>,
        /// Where it lands.
        buf: CudaViewMut<'a, u8>,
        /// The sending rank.
        peer: i32,
    },
}

impl<'a> P2p<'a> {
    /// A send of `buf` to `peer` on `stream`.
    ///
    /// # Safety
    /// As [`NcclComm::send`]: `peer`'s matching receive is of exactly `buf`'s bytes.
    pub unsafe fn send<T: DeviceRepr, S: DeviceSlice<T>>(
        comm: &'a NcclComm,
        stream: &'a Arc<CudaStream>,
        buf: &'a S,
        peer: i32,
    ) -> P2p<'a> {
        P2p::Send { comm, stream, buf: buf.as_view().into_bytes(), peer }
    }

    /// A receive from `peer` into `buf` on `stream`.
    ///
    /// # Safety
    /// As [`NcclComm::recv`]: `peer`'s matching send is of exactly `buf`'s bytes.
    pub unsafe fn recv<T: DeviceRepr, D: DeviceSliceMut<T>>(
        comm: &'a NcclComm,
        stream: &'a Arc<CudaStream>,
        buf: &'a mut D,
        peer: i32,
    ) -> P2p<'a> {
        P2p::Recv { comm, stream, buf: buf.as_view_mut().into_bytes(), peer }
    }

    pub(super) fn comm(&self) -> &'a NcclComm {
        match self {
            P2p::Send { comm, .. } | P2p::Recv { comm, .. } => comm,
        }
    }

    pub(super) fn stream(&self) -> &'a Arc<CudaStream> {
        match self {
            P2p::Send { stream, .. } | P2p::Recv { stream, .. } => stream,
        }
    }

    pub(super) fn peer(&self) -> i32 {
        match self {
            P2p::Send { peer, .. } | P2p::Recv { peer, .. } => *peer,
        }
    }

    pub(super) fn ordered_use(&self) -> (Tracked<'_>, Use) {
        match self {
            P2p::Send { buf, .. } => (buf.tracked(), Use::Read),
            P2p::Recv { buf, .. } => (buf.tracked(), Use::Write),
        }
    }

    pub(super) fn device(&self) -> i32 {
        match self {
            P2p::Send { buf, .. } => buf.ordinal(),
            P2p::Recv { buf, .. } => buf.ordinal(),
        }
    }

    /// The NCCL entry point of the operation.
    pub(super) fn call_name(&self) -> &'static str {
        if matches!(self, P2p::Send { .. }) { "ncclSend" } else { "ncclRecv" }
    }

    /// Issues the operation inside the open group.
    pub(super) fn issue(&self, nccl: &Nccl) -> Result<()> {
        let result = self.raw_call(nccl)?;
        let call = if matches!(self, P2p::Send { .. }) { "ncclSend (in a group)" } else { "ncclRecv (in a group)" };
        nccl.check(call, result)
    }

    /// Calls NCCL's send or receive: its raw result.
    pub(super) fn raw_call(&self, nccl: &Nccl) -> Result<ncclResult_t> {
        let comm = self.comm();
        Ok(match self {
            // Contract: the buffer is valid for its byte length and ordered on `stream` (waits
            // enqueued by the caller, `group` or `NcclComm::alone`); the communicator and stream
            // are live and of this device (checked by the caller); the communicator's call lock
            // is held by the caller.
            P2p::Send { stream, buf, peer, .. } => nccl_result!(
                nccl,
                ncclSend(
                    buf.device_ptr() as *const c_void,
                    buf.byte_len(),
                    ncclDataType_t::ncclUint8,
                    *peer,
                    comm.raw,
                    stream.raw().cast()
                )
            )?,
            // Contract: as the send's; the buffer is exclusively borrowed.
            P2p::Recv { stream, buf, peer, .. } => nccl_result!(
                nccl,
                ncclRecv(
                    buf.device_ptr() as *mut c_void,
                    buf.byte_len(),
                    ncclDataType_t::ncclUint8,
                    *peer,
                    comm.raw,
                    stream.raw().cast()
                )
            )?,
        })
    }
}

/// The most operations one [`group`] takes.
pub const MAX_GROUP_OPS: usize = 256;

/// Issues `ops` as one NCCL group (`ncclGroupStart`, the sends and receives,
/// `ncclGroupEnd`): they are launched together, so a rank may send to and receive from a peer
/// in one step without deadlock. Each operation is ordered by the crate's rule like a copy
/// that reads (a send) or writes (a receive) its buffer: its stream waits for what the buffer's
/// use conflicts with before the group, and the use is noted once the group ended, when NCCL
/// has enqueued its work. Nothing but these operations runs inside the group (NCCL launches a
/// group's work only at its end, so other work on those buffers issued inside it would be
/// ordered before work that is not yet enqueued). With non-blocking communicators
/// ([`NcclComm::init_rank_watched`]) the group's end is waited for when NCCL completes it in
/// the background (each communicator at most its bound).
///
/// # Errors
/// [`NcclError::InvalidRank`] and [`CudaError::WrongDevice`] as [`NcclComm::send`], checked for
/// every operation before anything is issued; [`NcclError::Aborted`] for an aborted
/// communicator; [`NcclError::GroupTooLarge`] beyond [`MAX_GROUP_OPS`]; NCCL's error.
pub fn group(ops: &[P2p<'_>]) -> Result<()> {
    if ops.len() > MAX_GROUP_OPS {
        return Err(NcclError::GroupTooLarge { ops: ops.len(), max: MAX_GROUP_OPS });
    }
    for op in ops {
        let what = if matches!(op, P2p::Send { .. }) { "nccl::group (a send)" } else { "nccl::group (a receive)" };
        op.comm().check_peer(what, op.peer(), op.stream(), op.device())?;
    }
    let nccl = nccl()?;
    // Every communicator's call lock, once each, in address order, from the first call to the
    // group's end.
    let mut comms: Vec<&NcclComm> = ops.iter().map(P2p::comm).collect();
    comms.sort_by_key(|comm| std::ptr::from_ref::<NcclComm>(comm) as usize);
    comms.dedup_by_key(|comm| std::ptr::from_ref::<NcclComm>(comm) as usize);
    posting(|| {
        let mut locks = comms.iter().map(|comm| comm.one_call("nccl::group")).collect::<Result<Vec<_>>>()?;
        let posted = ordered_from(nccl, ops, 0, &comms, &mut locks);
        // Noted whatever the group returned: a failed group may have enqueued work.
        for op in ops {
            op.comm().in_flight.note(op.stream());
        }
        posted?
    })
}

/// Orders `ops[at]` and, inside that, the rest in turn; the innermost issues the group. Each
/// operation's use is noted when its `ordered_with` returns, after the group ended: once the
/// group started, whatever the group returns (the inner result; a group that failed may have
/// enqueued work, and one that did not settle aborted its communicators first, see
/// [`NcclComm::settle`]).
pub(super) fn ordered_from(
    nccl: &Nccl,
    ops: &[P2p<'_>],
    at: usize,
    comms: &[&NcclComm],
    locks: &mut [MutexGuard<'_, bool>],
) -> Result<Result<()>> {
    match ops.get(at) {
        // Unlocked between the waits and the notes: two operations may share a buffer (one
        // buffer sent to two peers).
        Some(op) => {
            ordered_as(op.stream(), [op.ordered_use()], false, || ordered_from(nccl, ops, at + 1, comms, locks))
        }
        None => issue_group(nccl, ops, comms, locks),
    }
}

/// The group itself: every operation issued, then the group ended (and waited for where NCCL
/// completes it in the background). `Err` when the group could not start (nothing enqueued);
/// else the group's result.
pub(super) fn issue_group(
    nccl: &Nccl,
    ops: &[P2p<'_>],
    comms: &[&NcclComm],
    locks: &mut [MutexGuard<'_, bool>],
) -> Result<Result<()>> {
    // Contract: no arguments; the group is ended below on this thread, whatever the calls return.
    nccl_call!(nccl, ncclGroupStart())?;
    let issued = ops.iter().try_for_each(|op| op.issue(nccl));
    // Contract: ends the group started above, on this thread.
    let ended = nccl_result!(nccl, ncclGroupEnd()).and_then(|ended| {
        if ended != ncclResult_t::ncclInProgress {
            return nccl.check("ncclGroupEnd", ended);
        }
        // Every communicator settles (or is aborted), also after another one failed: none is
        // left completing the group's work in the background.
        let mut settled = Ok(());
        for (comm, lock) in comms.iter().zip(locks.iter_mut()).filter(|(comm, _)| comm.nonblocking()) {
            let this = comm.settle(nccl, lock, "ncclGroupEnd", ended);
            settled = settled.and(this);
        }
        settled
    });
    Ok(issued.and(ended))
}
