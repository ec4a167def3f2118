//! A deferred readback's handle, [`PendingReadback`], and the ring of pinned buffers it returns
//! to. Deferred readback: the last stage's results (say, a step's logits) copied to the host on the
//! runtime's readback stream while the stage streams go on with the next steps.
//!
//! [`PpNRt::readback`](crate::PpNRt::readback) takes the device buffer, makes the readback stream
//! wait for that buffer's last write alone (the step's work, not later steps), copies it into a
//! pinned buffer from the runtime's ring, and hands the buffer's free to the readback stream, so
//! no stage stream ever waits for the copy. A [`PendingReadback`] gives the values with
//! [`wait`](PendingReadback::wait) (blocking) or [`try_get`](PendingReadback::try_get) (not
//! blocking); dropping it returns its pinned buffer to the ring without waiting. In a pipeline
//! across processes, the values are given only while every boundary of this rank to another rank
//! is up: a boundary that failed aborted its communicator, which may cut short a receive the values
//! were computed from (see [`PendingReadback::wait`]).
//!
//! Threading: a `PendingReadback` is `Send + Sync`; the ring is shared behind a mutex.

use std::marker::PhantomData;
use std::sync::Arc;

use parking_lot::Mutex;

use super::remote::LinkFailure;
use crate::pp::error::Result;
use crate::safe::memory::Retired;
use crate::safe::ordering::OwnOrder;
use crate::safe::{CudaSlice, CudaStream, DeviceRepr, EnqueueGate, PinnedHostBuffer};

/// Pinned buffers kept for reuse; more than this many idle ones are freed.
pub(super) const MAX_IDLE_READBACK_BUFFERS: usize = 16;

/// A pinned buffer of the readback ring, ordered by its own event while only the ring's protocol
/// reaches it (see [`OwnOrder`]): written only by the runtime's readback stream, one copy per
/// readback, and read only by the host, through its readback's [`wait`](PendingReadback::wait) or
/// [`try_get`](PendingReadback::try_get), which wait for the last copy's event. A copy into it
/// waits for nothing else: the host's reads of the last readback end before the buffer is back in
/// the ring (they borrow that readback), and the copies before it ran on the same stream. The
/// event goes over to the buffer's own ordering state before the buffer is freed.
pub(super) struct ReadbackBuffer {
    host: PinnedHostBuffer<u8>,
    /// Always `Some` but in `Drop`, which hands it over.
    order: Option<OwnOrder>,
}

impl ReadbackBuffer {
    /// A buffer of `bytes` bytes, written by `stream`.
    pub(super) fn new(stream: &Arc<CudaStream>, bytes: usize) -> Result<Box<ReadbackBuffer>> {
        let mut buffer =
            Box::new(ReadbackBuffer { host: PinnedHostBuffer::new_eager(stream.context(), bytes)?, order: None });
        // Boxed first: the order names the buffer's ordering state by its address.
        buffer.order = Some(OwnOrder::new(buffer.host.access(), stream, stream));
        Ok(buffer)
    }

    /// The capacity in bytes.
    pub(super) fn len(&self) -> usize {
        self.host.len()
    }

    /// Copies `src` into the buffer on `stream`, the ring's (`gate`: its enqueue gate, seen
    /// uncaptured), ordered by the buffer's own event; `src` is ordered by the rule.
    pub(super) fn copy_from(
        &mut self,
        stream: &Arc<CudaStream>,
        gate: &EnqueueGate<'_>,
        src: crate::safe::CudaView<'_, u8>,
    ) -> crate::error::CudaResult<()> {
        let order = self.order.as_mut().expect("a ring buffer keeps its order until dropped");
        self.host.copy_from_device_owned(stream, gate, src, order)
    }

    /// Copies the whole of `src`, given up for its last read on `stream` (see [`Retired`]), into
    /// the buffer, as [`copy_from`](Self::copy_from).
    pub(super) fn copy_from_retired<T: DeviceRepr>(
        &mut self,
        stream: &Arc<CudaStream>,
        gate: &EnqueueGate<'_>,
        src: &mut Retired<T>,
    ) -> crate::error::CudaResult<()> {
        let order = self.order.as_mut().expect("a ring buffer keeps its order until dropped");
        self.host.copy_from_retired_owned(stream, gate, src, order)
    }

    /// The first `len` `T`s, once the last copy into the buffer has completed (blocks until then).
    fn values<T: DeviceRepr>(&self, len: usize) -> Result<&[T]> {
        let order = self.order.as_ref().expect("a ring buffer keeps its order until dropped");
        order.wait_written_on_host("PendingReadback::wait")?;
        Ok(self.host.as_slice_of::<T>(len)?)
    }

    /// Whether the last copy into the buffer has completed (does not block).
    fn is_ready(&self) -> Result<bool> {
        let order = self.order.as_ref().expect("a ring buffer keeps its order until dropped");
        Ok(order.is_written_complete("PendingReadback::try_get")?)
    }
}

impl Drop for ReadbackBuffer {
    fn drop(&mut self) {
        // The buffer's free waits for the last copy into it, through its own state.
        if let Some(order) = self.order.take() {
            order.hand_over(self.host.access());
        }
    }
}

impl std::fmt::Debug for ReadbackBuffer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ReadbackBuffer").field("len", &self.host.len()).finish_non_exhaustive()
    }
}

/// The device buffer a readback holds until its copy is done (freed on the readback stream).
#[derive(Debug)]
pub(super) enum ReadbackSource<T: DeviceRepr> {
    /// The caller's, kept by the caller ([`readback_of`](crate::PpNRt::readback_of)).
    Kept,
    /// Given, read under the rule (a graph holds it, or it is not pool memory).
    Given(#[allow(dead_code, reason = "held for its drop only")] CudaSlice<T>),
    /// Given up for its last read (see [`Retired`]).
    Retired(#[allow(dead_code, reason = "held for its drop only")] Retired<T>),
}

/// What the runtime's readbacks share: its ring of idle pinned buffers, and the failure records of
/// this rank's links to other ranks, whose failure a readback's values must not outlive.
pub(super) struct ReadbackShared {
    /// Boxed: a buffer moves in and out of the ring, and with a readback, as one pointer (not
    /// some 180 bytes with its ordering state).
    #[allow(clippy::vec_box)]
    pub(super) ring: Mutex<Vec<Box<ReadbackBuffer>>>,
    pub(super) links: Vec<Arc<LinkFailure>>,
}

impl ReadbackShared {
    /// Puts an idle pinned buffer back in the ring, unless the ring holds
    /// [`MAX_IDLE_READBACK_BUFFERS`] already (then it is freed).
    pub(super) fn give_back(&self, host: Box<ReadbackBuffer>) {
        let mut ring = self.ring.lock();
        if ring.len() < MAX_IDLE_READBACK_BUFFERS {
            ring.push(host);
        }
    }
}

impl std::fmt::Debug for ReadbackShared {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ReadbackShared").field("links", &self.links.len()).finish_non_exhaustive()
    }
}

/// A readback in flight, made by [`PpNRt::readback`](crate::PpNRt::readback): the values with
/// [`wait`](Self::wait) or [`try_get`](Self::try_get); dropping it returns its pinned buffer to the
/// runtime's ring without waiting.
///
/// ```no_run
/// # fn main() -> ppnrt::Result<()> {
/// # let primary = ppnrt::Engine::new(0)?;
/// # let rt = ppnrt::PpNRt::new(ppnrt::PpConfig::new(1), &primary)?;
/// let logits = primary.htod(&[0.25f32; 32])?;
/// let pending = rt.readback(logits)?;
/// let values: &[f32] = loop {
///     if let Some(values) = pending.try_get()? {
///         break values; // the copy finished
///     }
///     // ... other host work while the copy runs ...
/// };
/// assert_eq!(values.len(), pending.len());
/// # Ok(()) }
/// ```
#[derive(Debug)]
pub struct PendingReadback<T: DeviceRepr> {
    host: Option<Box<ReadbackBuffer>>,
    len: usize,
    /// The device buffer given by [`readback`](crate::PpNRt::readback), alive until the copy is
    /// done; its free is ordered on the readback stream.
    _source: ReadbackSource<T>,
    shared: Arc<ReadbackShared>,
    _marker: PhantomData<T>,
}

impl<T: DeviceRepr> PendingReadback<T> {
    pub(super) fn new(
        host: Box<ReadbackBuffer>,
        len: usize,
        source: ReadbackSource<T>,
        shared: Arc<ReadbackShared>,
    ) -> Self {
        PendingReadback { host: Some(host), len, _source: source, shared, _marker: PhantomData }
    }

    fn host(&self) -> &ReadbackBuffer {
        self.host.as_ref().expect("the buffer is taken only by Drop")
    }

    /// Number of elements read back.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether nothing was read back.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The values, once the copy completed (blocks until then).
    ///
    /// # Errors
    /// The error of the work waited for. In a pipeline across processes,
    /// [`PpError::PeerFailed`](crate::PpError::PeerFailed) once a boundary of this rank to another
    /// rank has failed (now or at any time before): its communicator was aborted, which may cut
    /// short a receive in flight, so values computed from its steps are not given (the steps in
    /// flight at a failure are lost). A link fails before its abort begins, so values whose copy
    /// completed before that are given.
    pub fn wait(&self) -> Result<&[T]> {
        let values = self.host().values::<T>(self.len)?;
        self.links_up()?;
        Ok(values)
    }

    /// The values if the copy has completed, else `None` (does not block).
    ///
    /// # Errors
    /// The driver's error; [`PpError::PeerFailed`](crate::PpError::PeerFailed) as
    /// [`wait`](Self::wait).
    pub fn try_get(&self) -> Result<Option<&[T]>> {
        if self.host().is_ready()? { self.wait().map(Some) } else { Ok(None) }
    }

    /// The error of the first of this rank's links to other ranks that failed, if one did.
    fn links_up(&self) -> Result<()> {
        match self.shared.links.iter().find(|link| link.aborted()) {
            Some(link) => Err(link.reported_error().expect("an aborted link has stopped")),
            None => Ok(()),
        }
    }
}

impl<T: DeviceRepr> Drop for PendingReadback<T> {
    fn drop(&mut self) {
        // Back to the ring without waiting: the next copy into it is ordered after this one.
        if let Some(host) = self.host.take() {
            self.shared.give_back(host);
        }
    }
}
