//! `PpNRt`: stages, boundary slot rings and the TX/RX protocol.
//!
//! Owns each stage's stream, each boundary's ring of slots (their buffers and host-side state)
//! and the readback stream; the engines of other devices are shared. Lifetime: a runtime lives as
//! long as its owner keeps it (the process-wide one from `get` forever); dropping it drains every
//! stream before its buffers go. Threading: `Send + Sync`; each boundary's ring has its own lock,
//! so threads driving different stages run concurrently, and `tx_wait`/`rx_wait` park on the
//! ring's condition variable.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use parking_lot::MutexGuard;

use super::error::{PpError, ReceiverState};
use super::pending_readback::ReadbackShared;
use super::plan::{BoundaryPlan, Plan};
use super::remote::{Link, Receiver, Sender, Watchdog};
use super::ring::{SlotBuffer, SlotRing, Slots};
use crate::engine::Engine;
use crate::error::CudaError;
use crate::pp::config::PpConfig;
use crate::pp::error::{Error, Result};
use crate::safe::EnqueueGate;
use crate::safe::ordering::Owned;
use crate::safe::{CudaSlice, CudaStream, CudaViewMut, DeviceRepr, DeviceSlice, DeviceSliceMut, StreamOverride};

/// The pipeline-parallel N-stage transport runtime. See the [module docs](crate::pp).
///
/// ```no_run
/// use ppnrt::{Engine, PpConfig, PpNRt};
/// # fn main() -> ppnrt::Result<()> {
/// let primary = Engine::new(0)?;
/// let rt = PpNRt::new(PpConfig::with_devices(&[0, 0]), &primary)?;
/// let n = 1024;
/// let x = {
///     let _stage0 = rt.enter(0)?;
///     rt.engine(0, &primary)?.htod(&vec![7u32; n])?
/// };
/// let slot = rt.tx(0, &x, n)?;
/// let _stage1 = rt.enter(1)?;
/// let y = rt.rx::<u32>(0, slot, n)?;
/// assert_eq!(rt.engine(1, &primary)?.dtoh(&y)?, vec![7u32; n]);
/// # Ok(()) }
/// ```
pub struct PpNRt {
    config: PpConfig,
    plan: Plan,
    /// Every stage; `None` for a stage another rank runs.
    stages: Vec<Option<Stage>>,
    boundaries: Vec<BoundaryEnd>,
    readback: Arc<CudaStream>,
    /// The readbacks' pinned buffers, and this rank's links' failure records.
    readbacks: Arc<ReadbackShared>,
    /// The watchdog of this rank's outbound links to other ranks.
    watchdog: Option<Watchdog>,
    /// The receiver threads of this rank's inbound links.
    receivers: Vec<Receiver>,
}

/// This process's side of one boundary.
enum BoundaryEnd {
    /// A slot ring in this process: both stages run here, or the TX stage runs in another rank
    /// and a receiver thread fills the ring from it.
    Ring(Arc<Boundary>),
    /// The TX stage runs here and the RX stage in another rank.
    Send(Arc<Sender>),
    /// Both stages run in other ranks.
    Foreign,
}

impl BoundaryEnd {
    /// This rank's link of the boundary to another rank, if it has one.
    fn link(&self) -> Option<&Arc<Link>> {
        match self {
            BoundaryEnd::Send(sender) => Some(&sender.link),
            BoundaryEnd::Ring(boundary) => boundary.inbound.as_ref(),
            BoundaryEnd::Foreign => None,
        }
    }
}

struct Stage {
    engine: Engine,
    stream: Arc<CudaStream>,
}

struct Boundary {
    plan: BoundaryPlan,
    /// The stream that writes the slots: the TX stage's (the boundary's receive stream when the
    /// TX stage runs in another rank).
    tx_stream: Arc<CudaStream>,
    rx_stream: Arc<CudaStream>,
    /// The RX stage's engine: its SM copy kernel makes the boundary's same-device copies.
    rx_engine: Engine,
    /// Whether same-device copies may use that kernel (allowed by the config, the boundary has
    /// device slots, and the driver runs the embedded PTX).
    sm_copies: bool,
    /// The slot ring: its slots, their states, and the waits on them.
    ring: SlotRing,
    /// The link to the TX stage's rank, when that stage runs in another process.
    inbound: Option<Arc<Link>>,
}

mod boundary;
mod build;
mod inbound;
mod readback;
mod received;
mod step_graph;
pub use received::ReceivedSlot;
pub use step_graph::{StageCapture, StepGraphs};

/// Same-device boundary copies (`tx` over a [`Transport::Local`](crate::Transport::Local) boundary, and every `rx` from a
/// device slot) of at most this many bytes, with both addresses 16-byte aligned, run as the SM
/// copy kernel: its launch costs the host about 0.7 µs less than a same-device `cuMemcpyAsync`
/// (measured on H200 and driver 580), and at these sizes the host's issue cost, not the copy,
/// bounds a step. Larger copies go through the copy engine, which moves them at least as fast
/// and leaves the SMs to the model.
pub const SM_COPY_MAX_BYTES: usize = 4 << 20;

impl PpNRt {
    /// Number of stages.
    pub fn n_stages(&self) -> usize {
        self.stages.len()
    }

    /// Number of boundaries (`n_stages - 1`).
    pub fn n_boundaries(&self) -> usize {
        self.boundaries.len()
    }

    /// How many steps boundary `b` received through captured graphs so far (see
    /// [`PpConfig::with_nccl_recv_graphs`]): 0 unless this rank receives `b` from another rank.
    ///
    /// # Errors
    /// [`PpError::BoundaryOutOfRange`].
    #[cfg(feature = "testing")]
    pub fn graph_receives(&self, b: usize) -> Result<u64> {
        Ok(match self.end(b)? {
            BoundaryEnd::Ring(ring) => ring.inbound.as_ref().map_or(0, |link| link.graph_receives()),
            BoundaryEnd::Send(_) | BoundaryEnd::Foreign => 0,
        })
    }

    /// How many steps boundary `b` received announced in the IPC control block rather than on
    /// the control connection: 0 unless this rank receives `b` from another rank over IPC.
    ///
    /// # Errors
    /// [`PpError::BoundaryOutOfRange`].
    #[cfg(feature = "testing")]
    pub fn block_announcements(&self, b: usize) -> Result<u64> {
        Ok(match self.end(b)? {
            BoundaryEnd::Ring(ring) => ring.inbound.as_ref().map_or(0, |link| link.block_announcements()),
            BoundaryEnd::Send(_) | BoundaryEnd::Foreign => 0,
        })
    }

    /// Slots per boundary ring.
    pub fn n_slots(&self) -> usize {
        self.config.slots()
    }

    /// True iff any boundary crosses devices.
    pub fn cross_device(&self) -> bool {
        self.plan.cross_device()
    }

    /// The boundary plan (printable for logs).
    pub fn plan(&self) -> &Plan {
        &self.plan
    }

    /// Whether boundary `b`'s copies within a device run as the SM copy kernel (up to
    /// [`SM_COPY_MAX_BYTES`]): allowed by [`PpConfig::with_sm_copies`], a boundary with device slots,
    /// and a driver that runs the embedded PTX (an older driver than the toolkit that built it
    /// cannot; the boundary then keeps every copy on the copy engines).
    ///
    /// # Errors
    /// [`PpError::BoundaryOutOfRange`].
    pub fn sm_copies(&self, b: usize) -> Result<bool> {
        Ok(match self.end(b)? {
            BoundaryEnd::Ring(boundary) => boundary.sm_copies,
            BoundaryEnd::Send(_) | BoundaryEnd::Foreign => false,
        })
    }

    /// The configuration the runtime was built from.
    pub fn config(&self) -> &PpConfig {
        &self.config
    }

    fn stage(&self, s: usize) -> Result<&Stage> {
        match self.stages.get(s) {
            None => Err(Error::Pipeline(PpError::StageOutOfRange { stage: s, n_stages: self.stages.len() })),
            Some(None) => Err(self.not_owned(s)),
            Some(Some(stage)) => Ok(stage),
        }
    }

    fn not_owned(&self, s: usize) -> Error {
        Error::Pipeline(PpError::StageNotOwned { stage: s, owner: self.plan.stage_ranks[s], rank: self.config.rank() })
    }

    fn end(&self, b: usize) -> Result<&BoundaryEnd> {
        // A match, not `ok_or`: the error is built only when it is returned (every tx and rx).
        match self.boundaries.get(b) {
            Some(end) => Ok(end),
            None => {
                Err(Error::Pipeline(PpError::BoundaryOutOfRange { boundary: b, n_boundaries: self.boundaries.len() }))
            }
        }
    }

    /// Boundary `b`'s ring, for the RX stage's calls (`rx`, `discard_unreceived`): refused when
    /// another rank runs the RX stage.
    fn boundary(&self, b: usize) -> Result<&Arc<Boundary>> {
        match self.end(b)? {
            BoundaryEnd::Ring(boundary) => Ok(boundary),
            BoundaryEnd::Send(_) | BoundaryEnd::Foreign => Err(self.not_owned(b + 1)),
        }
    }

    /// This rank's stages with their indices, for graph mode.
    fn local_stages(&self) -> impl Iterator<Item = (usize, &Stage)> {
        self.stages.iter().enumerate().filter_map(|(s, stage)| Some((s, stage.as_ref()?)))
    }

    /// Every ring of this rank (both stages here, or the RX stage here and a receiver thread
    /// filling it from another rank) with its boundary, for graph mode.
    fn rings(&self) -> impl Iterator<Item = (usize, &Boundary)> {
        self.boundaries.iter().enumerate().filter_map(|(b, end)| match end {
            BoundaryEnd::Ring(boundary) => Some((b, &**boundary)),
            BoundaryEnd::Send(_) | BoundaryEnd::Foreign => None,
        })
    }

    /// Boundary `b`'s ring in this rank, for graph mode (see [`rings`](Self::rings)).
    fn ring(&self, b: usize) -> Option<&Boundary> {
        match self.boundaries.get(b) {
            Some(BoundaryEnd::Ring(boundary)) => Some(boundary),
            _ => None,
        }
    }

    /// Boundary `b`'s sending end, when this rank runs its TX stage and another its RX stage.
    fn sender(&self, b: usize) -> Option<&Sender> {
        match self.boundaries.get(b) {
            Some(BoundaryEnd::Send(sender)) => Some(sender),
            _ => None,
        }
    }

    /// Whether other ranks run some of the stages.
    fn spans_processes(&self) -> bool {
        self.stages.iter().any(Option::is_none)
    }

    /// The rank of this process (0 in a pipeline of one process).
    pub fn rank(&self) -> usize {
        self.config.rank()
    }

    /// Whether this process runs stage `s` (every stage, in a pipeline of one process).
    pub fn owns_stage(&self, s: usize) -> bool {
        matches!(self.stages.get(s), Some(Some(_)))
    }

    /// The device of stage `s`.
    ///
    /// # Errors
    /// [`PpError::StageOutOfRange`].
    pub fn stage_device(&self, s: usize) -> Result<i32> {
        Ok(self.stage(s)?.engine.ordinal())
    }

    /// The stream of stage `s`: everything of the stage runs there.
    ///
    /// # Errors
    /// [`PpError::StageOutOfRange`].
    pub fn stage_stream(&self, s: usize) -> Result<&Arc<CudaStream>> {
        Ok(&self.stage(s)?.stream)
    }

    /// The engine stage `s`'s subgraph must run through: `primary` when the stage lives on the
    /// primary's device, else the stage's own engine.
    ///
    /// # Errors
    /// [`PpError::StageOutOfRange`].
    pub fn engine<'a>(&'a self, s: usize, primary: &'a Engine) -> Result<&'a Engine> {
        let stage = self.stage(s)?;
        Ok(if stage.engine.ordinal() == primary.ordinal() { primary } else { &stage.engine })
    }

    /// Enters stage `s`: until the guard drops, every engine operation on this thread runs on the
    /// stage's stream.
    ///
    /// # Errors
    /// [`PpError::StageOutOfRange`].
    pub fn enter(&self, s: usize) -> Result<StreamOverride> {
        Ok(StreamOverride::new(Arc::clone(&self.stage(s)?.stream))?)
    }

    /// Boundary TX at boundary `b` (stage `b`'s side): waits for the slot's previous RX
    /// (write-after-read guard; from the slot's second use on), copies `x[..n]` into the slot
    /// through the boundary's transport on stage `b`'s stream, records the slot's TX event.
    /// Returns the slot index for the paired [`rx`](Self::rx). Runs on the stage's stream
    /// whatever the ambient stream is.
    ///
    /// `x` should be owned by the stage's stream (the usual case inside [`enter`](Self::enter));
    /// if it is owned by another stream, the two are joined both ways so `x` cannot be freed or
    /// overwritten while the copy is in flight.
    ///
    /// # Errors
    /// Caught before anything is enqueued, nothing overwritten: [`PpError::BoundaryOutOfRange`],
    /// [`PpError::ZeroLength`], [`CudaError::OutOfBounds`](crate::CudaError::OutOfBounds) (`n` larger than `x`), [`CudaError::WrongDevice`](crate::CudaError::WrongDevice)
    /// (`x` not on stage `b`'s device), [`PpError::SlotState`] (the next slot's data was never
    /// received), [`CaptureError::IllegalCall`](crate::CaptureError::IllegalCall) (the stage's
    /// stream is being captured: the copy would run at the graph's launch while the slot said
    /// filled now; the capture is invalidated; [`capture_step`](Self::capture_step) captures
    /// steps). Else the driver's error. To another rank also [`PpError::TypeNameTooLong`] and
    /// [`PpError::PeerFailed`] (the link failed).
    ///
    /// To another rank, `tx` does not wait on the host: it writes the step's record and queues
    /// NCCL's send, which waits on the device until the receiving rank has a free slot for it
    /// ([`tx_wait`](Self::tx_wait) waits on the host instead, bounded).
    pub fn tx<T: DeviceRepr, S: DeviceSlice<T>>(&self, b: usize, x: &S, n: usize) -> Result<usize> {
        self.tx_impl(b, x, n, None)
    }

    /// [`tx`](Self::tx) for a thread that drives its own stage: when the ring's next slot still
    /// holds data not yet received, parks the thread until the receiving stage's `rx` of it has
    /// been issued (or the slot was discarded), for at most `timeout`. No busy-waiting. A slot
    /// lent to an in-place guard ([`rx_in_place`](Self::rx_in_place)) is waited for until the
    /// guard drops, for at most one second (or `timeout`, when shorter); then the slot gets
    /// another buffer and the guard keeps its own, as [`tx`](Self::tx) does at once.
    ///
    /// To another rank, waits until the receiving rank's stage has taken the step its slot holds:
    /// the receiving rank answers at once and again at its stage's next take (so the wait ends
    /// within a round trip of the take), for at most `timeout`.
    ///
    /// # Errors
    /// As [`tx`](Self::tx), and [`PpError::Timeout`] when the slot stayed filled for `timeout`
    /// (nothing was enqueued or sent; to another rank its state is
    /// [`SlotState::UntakenByPeer`](crate::SlotState::UntakenByPeer)).
    pub fn tx_wait<T: DeviceRepr, S: DeviceSlice<T>>(
        &self,
        b: usize,
        x: &S,
        n: usize,
        timeout: Duration,
    ) -> Result<usize> {
        self.tx_impl(b, x, n, Some(timeout))
    }

    #[inline]
    fn tx_impl<T: DeviceRepr, S: DeviceSlice<T>>(
        &self,
        b: usize,
        x: &S,
        n: usize,
        wait: Option<Duration>,
    ) -> Result<usize> {
        let boundary = match self.end(b)? {
            BoundaryEnd::Ring(boundary) if boundary.inbound.is_none() => boundary,
            BoundaryEnd::Send(sender) => return self.tx_remote(b, sender, x, n, wait),
            BoundaryEnd::Ring(_) | BoundaryEnd::Foreign => return Err(self.not_owned(b)),
        };
        check_tx_args(b, x, n, boundary.plan.tx_device)?;
        let bytes = n * std::mem::size_of::<T>();
        let mut ring = boundary.ring.lock();
        if let Some(timeout) = wait {
            ring = boundary.ring.wait_until(b, "tx", ring, timeout, &|| None, Slots::next)?;
        }
        let index = ring.next();
        let tx = &boundary.tx_stream;
        // No capture of the stage's stream: a captured copy would run at the graph's launch, not
        // now, and the slot would say filled with nothing in it. (`capture_step` captures steps.)
        let gate = tx.enqueue_gate_uncaptured("PpNRt::tx")?;
        ring.writable(b, index, "tx", bytes, boundary.home())?;
        // One binding for the whole call (the copy and its event record find it current).
        let _bound = tx.context().bind_for_call()?;
        let src = x.as_view().slice(..n)?.into_bytes();
        self.config.faults().before_tx(&mut ring, index);
        match ring.ordered_buffer(index) {
            (SlotBuffer::Device(buffer), order) => {
                // A writable slot is not lent (a lent one was given another buffer): the buffer
                // is not shared.
                let buffer = Arc::get_mut(buffer).expect("a writable slot's buffer is not shared");
                let dst = buffer.as_view_mut().slice_mut(..bytes)?;
                match order {
                    Some(order) => boundary.copy_owned(tx, &gate, src, dst, Owned::Dst(order))?,
                    None => boundary.copy_into_slot(tx, src, dst)?,
                }
            }
            (SlotBuffer::Host(buffer), Some(order)) => buffer.copy_from_device_owned(tx, &gate, src, order)?,
            (SlotBuffer::Host(buffer), None) => buffer.copy_from_device(tx, src)?,
            (SlotBuffer::Empty, _) => unreachable!("writable() gave the slot a buffer of at least one byte"),
        }
        ring.filled(index, n, T::NAME, bytes);
        drop(ring);
        boundary.ring.wake_sleepers();
        Ok(index)
    }

    /// `tx` over a boundary to another rank: the same checks, then the NCCL send (after a wait
    /// for the RX rank's free slot, with `wait`).
    fn tx_remote<T: DeviceRepr, S: DeviceSlice<T>>(
        &self,
        b: usize,
        sender: &Sender,
        x: &S,
        n: usize,
        wait: Option<Duration>,
    ) -> Result<usize> {
        check_tx_args(b, x, n, sender.tx_device)?;
        sender.tx(x, n, wait)
    }

    /// Boundary RX at boundary `b` (stage `b + 1`'s side): waits for the slot's TX event, copies
    /// the slot into a fresh stream-ordered buffer on stage `b + 1`'s stream, records the slot's
    /// RX event. The returned buffer is owned by the RX stage's stream and freed there.
    ///
    /// # Errors
    /// Caught before anything is enqueued: [`PpError::BoundaryOutOfRange`], [`PpError::ZeroLength`],
    /// [`PpError::SlotOutOfRange`], [`PpError::SlotState`] (never filled or already received),
    /// [`PpError::RxLengthMismatch`], [`PpError::RxTypeMismatch`], [`PpError::RxSizeMismatch`] (from another
    /// rank: the bytes sent are not `n` of `T`'s),
    /// [`CaptureError::IllegalCall`](crate::CaptureError::IllegalCall) (the stage's stream is
    /// being captured: the copy would run at the graph's launch, reading whatever the slot holds
    /// then, while the slot said received now; the capture is invalidated). Else the driver's
    /// error. From another rank also [`PpError::PeerFailed`] (the link failed).
    ///
    /// From another rank, a step may still be on its way when `rx` is called: `rx` then waits for
    /// the receiving thread to post it, for at most the peer timeout
    /// ([`PpConfig::with_peer_timeout`]; [`PpError::Timeout`] after it); [`rx_wait`](Self::rx_wait)
    /// bounds that wait by its own timeout.
    pub fn rx<T: DeviceRepr>(&self, b: usize, slot_index: usize, n: usize) -> Result<CudaSlice<T>> {
        self.rx_impl(b, slot_index, n, None)
    }

    /// [`rx`](Self::rx) for a thread that drives its own stage: when the slot is not filled yet
    /// (or still holds an earlier step that was received), parks the thread until the sending
    /// stage's `tx` filled it, for at most `timeout`. No busy-waiting.
    ///
    /// # Errors
    /// As [`rx`](Self::rx), and [`PpError::Timeout`] when the slot stayed unfilled for `timeout`
    /// (nothing was enqueued).
    pub fn rx_wait<T: DeviceRepr>(
        &self,
        b: usize,
        slot_index: usize,
        n: usize,
        timeout: Duration,
    ) -> Result<CudaSlice<T>> {
        self.rx_impl(b, slot_index, n, Some(timeout))
    }

    #[inline]
    fn rx_impl<T: DeviceRepr>(
        &self,
        b: usize,
        slot_index: usize,
        n: usize,
        wait: Option<Duration>,
    ) -> Result<CudaSlice<T>> {
        let (boundary, mut ring, gate) = self.receivable::<T>(b, slot_index, n, wait, "PpNRt::rx")?;
        let rx = &boundary.rx_stream;
        let _bound = rx.context().bind_for_call()?;
        // Under the copy's gate: the stream was seen uncaptured there.
        let mut out = CudaSlice::<T>::alloc_under(rx, &gate, n)?;
        Self::receive_into(boundary, &mut ring, &gate, slot_index, out.as_view_mut().into_bytes())?;
        drop(ring);
        boundary.ring.wake_sleepers();
        Ok(out)
    }

    /// Copies the filled slot `slot_index` of `boundary` (locked, checked) into `dst` on the RX
    /// stream (`gate`: its enqueue gate, seen uncaptured), and marks it received.
    #[inline]
    fn receive_into(
        boundary: &Boundary,
        ring: &mut MutexGuard<'_, Slots>,
        gate: &EnqueueGate<'_>,
        slot_index: usize,
        dst: CudaViewMut<'_, u8>,
    ) -> Result<()> {
        let rx = &boundary.rx_stream;
        let bytes = dst.len();
        match ring.ordered_buffer(slot_index) {
            (SlotBuffer::Device(buffer), Some(order)) => {
                boundary.copy_owned(rx, gate, buffer.as_view().slice(..bytes)?, dst, Owned::Src(order))?;
            }
            (SlotBuffer::Device(buffer), None) => {
                boundary.copy_within_device(rx, buffer.as_view().slice(..bytes)?, dst)?;
            }
            (SlotBuffer::Host(buffer), Some(order)) => buffer.copy_to_device_owned(rx, gate, dst, order)?,
            (SlotBuffer::Host(buffer), None) => buffer.copy_to_device(rx, dst)?,
            (SlotBuffer::Empty, _) => unreachable!("a filled slot has a buffer"),
        }
        ring.received(slot_index);
        Ok(())
    }

    /// [`rx`](Self::rx) into the caller's buffer `dst` (of the RX stage's device, `dst.len()`
    /// elements): an engine's own activation buffer (a foreign slice, a cudarc slice lent through
    /// `ppnrt::interop` with the `cudarc` feature) receives the step with the boundary's one copy, ordered by the
    /// crate's rule (the copy waits for `dst`'s earlier uses; later uses wait for it).
    ///
    /// # Errors
    /// As [`rx`](Self::rx) (with `n` = `dst.len()`), and [`CudaError::WrongDevice`](crate::CudaError::WrongDevice) for a `dst` of
    /// another device than the RX stage's (nothing enqueued, the slot still filled).
    pub fn rx_into<T: DeviceRepr, D: DeviceSliceMut<T>>(&self, b: usize, slot_index: usize, dst: &mut D) -> Result<()> {
        self.rx_into_impl(b, slot_index, dst, None)
    }

    /// [`rx_into`](Self::rx_into) that waits, as [`rx_wait`](Self::rx_wait) does, at most
    /// `timeout` for the slot to be filled.
    ///
    /// # Errors
    /// As [`rx_into`](Self::rx_into), and [`PpError::Timeout`].
    pub fn rx_into_wait<T: DeviceRepr, D: DeviceSliceMut<T>>(
        &self,
        b: usize,
        slot_index: usize,
        dst: &mut D,
        timeout: Duration,
    ) -> Result<()> {
        self.rx_into_impl(b, slot_index, dst, Some(timeout))
    }

    fn rx_into_impl<T: DeviceRepr, D: DeviceSliceMut<T>>(
        &self,
        b: usize,
        slot_index: usize,
        dst: &mut D,
        wait: Option<Duration>,
    ) -> Result<()> {
        let rx_device = self.boundary(b)?.plan.rx_device;
        if dst.ordinal() != rx_device {
            return Err(CudaError::WrongDevice {
                what: "PpNRt::rx_into: the buffer must be on the RX stage's device",
                expected: rx_device,
                found: dst.ordinal(),
            }
            .into());
        }
        let n = dst.len();
        let (boundary, mut ring, gate) = self.receivable::<T>(b, slot_index, n, wait, "PpNRt::rx_into")?;
        let _bound = boundary.rx_stream.context().bind_for_call()?;
        Self::receive_into(boundary, &mut ring, &gate, slot_index, dst.as_view_mut().into_bytes())?;
        drop(ring);
        boundary.ring.wake_sleepers();
        Ok(())
    }

    /// Boundary `b` and its ring, locked, with slot `slot_index` checked to be filled with `n`
    /// elements of `T` (after waiting up to `wait` for it to be filled), and the RX stream's
    /// enqueue gate, taken after the wait and checked uncaptured for `call`: a captured receive
    /// would run at the graph's launch, reading whatever the slot holds then, while the slot says
    /// received now. (`capture_step` captures steps.)
    #[inline]
    fn receivable<T: DeviceRepr>(
        &self,
        b: usize,
        slot_index: usize,
        n: usize,
        wait: Option<Duration>,
        call: &'static str,
    ) -> Result<(&Boundary, MutexGuard<'_, Slots>, EnqueueGate<'_>)> {
        let boundary = self.boundary(b)?;
        if n == 0 {
            return Err(Error::Pipeline(PpError::ZeroLength { boundary: b }));
        }
        if let Some(failed) = boundary.inbound.as_ref().filter(|link| link.aborted()).and_then(|link| link.stopped()) {
            // Receives of a failed link may have been cut short: no slot of it is trusted.
            return Err(failed);
        }
        // A step from another rank may still be on its way: wait for it, bounded.
        let wait = wait.or(boundary.inbound.as_ref().map(|_| self.config.peer_timeout()));
        let mut ring = boundary.ring.lock();
        let n_slots = ring.n_slots();
        if slot_index >= n_slots {
            return Err(Error::Pipeline(PpError::SlotOutOfRange { boundary: b, slot: slot_index, n_slots }));
        }
        if let Some(timeout) = wait {
            ring = boundary.ring.wait_until(b, "rx", ring, timeout, &|| boundary.link_failure(), |_| slot_index)?;
        }
        ring.check_filled::<T>(b, slot_index, "rx", n)?;
        // Taken after the wait (a capture of the stream may begin and end meanwhile) and held
        // until the copy is enqueued.
        let gate = boundary.rx_stream.enqueue_gate_uncaptured(call)?;
        self.config.faults().before_rx(&mut ring, slot_index);
        Ok((boundary, ring, gate))
    }

    /// Gives up the data of boundary `b`'s filled slots that will never be received (say, the
    /// receiving stage abandoned a step): they become free for `tx` again, and an `rx` of one is
    /// a [`PpError::SlotState`] error. Returns how many slots were discarded. Enqueues nothing: a
    /// copy into a discarded slot that is still in flight stays ordered before the slot's next
    /// `tx` (same stream) and before any reallocation of its buffer.
    ///
    /// # Errors
    /// [`PpError::BoundaryOutOfRange`].
    pub fn discard_unreceived(&self, b: usize) -> Result<usize> {
        let boundary = self.boundary(b)?;
        let discarded = boundary.ring.lock().discard_unreceived();
        boundary.ring.wake_sleepers();
        Ok(discarded)
    }

    /// What the receiver thread of boundary `b` is doing, for a boundary from another rank into
    /// this one (`None` for any other boundary): to tell, when an `rx` of it waits too long,
    /// whether the step never came, found no free slot, or is being posted.
    ///
    /// # Errors
    /// [`PpError::BoundaryOutOfRange`].
    pub fn receiver_state(&self, b: usize) -> Result<Option<ReceiverState>> {
        Ok(match self.end(b)? {
            BoundaryEnd::Ring(boundary) => boundary.inbound.as_ref().map(|link| link.phase.get()),
            BoundaryEnd::Send(_) | BoundaryEnd::Foreign => None,
        })
    }

    /// This rank's streams: its stages', its boundaries' receive streams and the readback stream.
    fn local_streams(&self) -> impl Iterator<Item = &Arc<CudaStream>> {
        let receives = self.boundaries.iter().filter_map(|end| match end {
            BoundaryEnd::Ring(boundary) if boundary.inbound.is_some() => Some(&boundary.tx_stream),
            _ => None,
        });
        self.stages.iter().flatten().map(|stage| &stage.stream).chain(receives).chain([&self.readback])
    }

    /// Blocks until every stream of this process's stages, its receives from other ranks, and the
    /// readback stream are idle.
    ///
    /// # Errors
    /// The first driver error met.
    pub fn synchronize(&self) -> Result<()> {
        for stream in self.local_streams() {
            stream.synchronize()?;
        }
        Ok(())
    }
}

/// Checks `tx`'s arguments at boundary `b`: `n` at least 1 and within `x`, `x` on the TX stage's
/// device `tx_device`.
fn check_tx_args<T: DeviceRepr, S: DeviceSlice<T>>(b: usize, x: &S, n: usize, tx_device: i32) -> Result<()> {
    if n == 0 {
        return Err(Error::Pipeline(PpError::ZeroLength { boundary: b }));
    }
    if n > x.len() {
        return Err(CudaError::OutOfBounds { what: "PpNRt::tx: n exceeds x", start: 0, end: n, len: x.len() }.into());
    }
    if x.ordinal() != tx_device {
        return Err(CudaError::WrongDevice {
            what: "PpNRt::tx: x must be on the TX stage's device",
            expected: tx_device,
            found: x.ordinal(),
        }
        .into());
    }
    Ok(())
}

impl fmt::Debug for PpNRt {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PpNRt").field("config", &self.config.to_string()).field("plan", &self.plan.to_string()).finish()
    }
}
