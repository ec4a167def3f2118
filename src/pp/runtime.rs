//! `PpNRt`: stages, boundary slot rings and the TX/RX protocol.
//!
//! Owns each stage's stream, each boundary's ring of slots (their buffers and host-side state)
//! and the readback stream; the engines of other devices are shared. Lifetime: a runtime lives as
//! long as its owner keeps it (the process-wide one from `get` forever); dropping it drains every
//! stream before its buffers go. Threading: `Send + Sync`; each boundary's ring has its own lock,
//! so threads driving different stages run concurrently, and `tx_wait`/`rx_wait` park on the
//! ring's condition variable.

use std::collections::BTreeMap;
use std::fmt;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};
use std::time::{Duration, Instant};

use super::error::{PpError, ReceiverState};
use super::plan::{BoundaryPlan, Plan, Transport};
use super::readback::{PendingReadback, ReadbackShared};
use super::remote::{self, Announced, Link, LocalStage, Phase, Receiver, Sender, SlotFiller, Watchdog};
use super::ring::{MIN_SLOT_BYTES, SlotBuffer, SlotHome, SlotRing, Slots};
use crate::engine::Engine;
use crate::error::{ConfigError, Error, Result};
#[cfg(feature = "testing")]
use crate::pp::config::ProtocolFault;
use crate::pp::config::{
    DEVICES_VAR, PEER_TIMEOUT_VAR, PpConfig, RANK_VAR, RANKS_VAR, RENDEZVOUS_VAR, SLOTS_VAR, STAGES_VAR, TRANSPORT_VAR,
};
use crate::safe::EnqueueGate;
use crate::safe::ordering::{Access, Use};
use crate::safe::{
    CudaEvent, CudaSlice, CudaStream, CudaView, CudaViewMut, Device, DeviceRepr, DeviceSlice, PinnedHostBuffer,
    StreamOverride, enable_peer_access, record_drop_error,
};

/// The pipeline-parallel N-stage transport runtime. See the [module docs](crate::pp).
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

mod step_graph;
pub use step_graph::{StageCapture, StepGraphs};

static RUNTIME: OnceLock<std::result::Result<PpNRt, Error>> = OnceLock::new();

/// Same-device boundary copies (`tx` over a [`Transport::Local`] boundary, and every `rx` from a
/// device slot) of at most this many bytes, with both addresses 16-byte aligned, run as the SM
/// copy kernel: its launch costs the host about 0.7 µs less than a same-device `cuMemcpyAsync`
/// (measured on H200 and driver 580), and at these sizes the host's issue cost, not the copy,
/// bounds a step. Larger copies go through the copy engine, which moves them at least as fast
/// and leaves the SMs to the model.
pub const SM_COPY_MAX_BYTES: usize = 4 << 20;

impl PpNRt {
    /// The process-wide runtime, built on first use against `primary` from the `PPNRT_*`
    /// variables (see [`PpConfig`]). The configuration freezes at the first build; later calls
    /// return the same runtime whatever engine they pass. A failed build is sticky: every later
    /// call returns the same [`Error::PipelineBuild`], which names the configuration and the cause.
    ///
    /// # Errors
    /// [`Error::PipelineBuild`].
    pub fn get(primary: &Engine) -> Result<&'static PpNRt> {
        let built = RUNTIME.get_or_init(|| {
            let config = PpConfig::from_env()
                .map_err(|e| Error::PipelineBuild { config: describe_env(), source: Box::new(Error::Config(e)) })?;
            PpNRt::new(config.clone(), primary)
                .map_err(|e| Error::PipelineBuild { config: config.to_string(), source: Box::new(e) })
        });
        built.as_ref().map_err(Clone::clone)
    }

    /// Builds a runtime for `config` (not the process-wide one): engines for the devices of the
    /// stages (`primary` for its own device), one stream per stage, peer access where the plan
    /// uses it, and one slot ring per boundary.
    ///
    /// When the stages span processes ([`PpConfig::ranks`]), this process builds only its own
    /// stages, and the call blocks until every rank has met at the rendezvous and each boundary
    /// between two ranks has its NCCL communicator and its connection (at most the peer timeout
    /// for the rendezvous; see the [module docs](crate::pp)).
    ///
    /// # Errors
    /// [`Error::Config`] for a configuration that cannot run on the devices present; the driver's
    /// error; across processes also [`Error::Rendezvous`], [`Error::Nccl`] and
    /// [`PpError::PeerFailed`].
    pub fn new(config: PpConfig, primary: &Engine) -> Result<PpNRt> {
        config.validate()?;
        let stage_devices = config.stage_devices(primary.ordinal());
        let stage_ranks = config.stage_ranks();
        let rank = config.own_rank();
        let owned = |s: usize| stage_ranks[s] == rank;
        let count = Device::count()?;
        if let Some(&bad) =
            stage_devices.iter().enumerate().filter(|&(s, _)| owned(s)).map(|(_, d)| d).find(|&&d| d >= count)
        {
            return Err(ConfigError {
                setting: DEVICES_VAR,
                value: stage_devices.iter().map(ToString::to_string).collect::<Vec<_>>().join(","),
                reason: format!("device ordinal {bad} is not present: {count} device(s) found"),
            }
            .into());
        }
        let mut engines: BTreeMap<i32, Engine> = BTreeMap::new();
        for (_, &ordinal) in stage_devices.iter().enumerate().filter(|&(s, _)| owned(s)) {
            if let std::collections::btree_map::Entry::Vacant(entry) = engines.entry(ordinal) {
                entry.insert(if ordinal == primary.ordinal() { primary.clone() } else { Engine::new(ordinal)? });
            }
        }
        let mut access = BTreeMap::new();
        for (&a, ea) in &engines {
            for (&b, eb) in &engines {
                access.insert((a, b), a != b && ea.device().peer_info(eb.device())?.access_supported);
            }
        }
        let plan = Plan::choose_across(&stage_devices, &stage_ranks, rank, config.transport_policy(), |a, b| {
            access.get(&(a, b)).copied().unwrap_or(false)
        })?;
        for b in plan.boundaries.iter().filter(|b| b.transport == Transport::Peer && b.tx_rank == rank) {
            enable_peer_access(engines[&b.tx_device].context(), engines[&b.rx_device].context())?;
        }
        let stages = stage_devices
            .iter()
            .enumerate()
            .map(|(s, d)| {
                if !owned(s) {
                    return Ok(None);
                }
                let engine = engines[d].clone();
                let stream = CudaStream::new(engine.context())?;
                Ok(Some(Stage { engine, stream }))
            })
            .collect::<Result<Vec<_>>>()?;
        let mut links = if plan.spans_processes() {
            let local: Vec<_> = stages
                .iter()
                .map(|stage| {
                    stage.as_ref().map(|stage| LocalStage {
                        ctx: Arc::clone(stage.engine.context()),
                        stream: Arc::clone(&stage.stream),
                    })
                })
                .collect();
            Some(remote::connect(&config, &plan, &local)?)
        } else {
            None
        };
        let mut inbound_links = Vec::new();
        let boundaries = plan
            .boundaries
            .iter()
            .map(|&bp| {
                let (tx, rx) = (&stages[bp.boundary], &stages[bp.boundary + 1]);
                let (tx_stream, rx, inbound) = match (tx, rx) {
                    (Some(tx), Some(rx)) => (Arc::clone(&tx.stream), rx, None),
                    (None, Some(rx)) => {
                        let inbound = links
                            .as_mut()
                            .and_then(|links| links.inbound.remove(&bp.boundary))
                            .expect("connect() links every boundary this rank receives");
                        let stream = Arc::clone(&inbound.recv_stream);
                        let link = Arc::clone(&inbound.link);
                        inbound_links.push((bp.boundary, inbound));
                        (stream, rx, Some(link))
                    }
                    (Some(_), None) => {
                        let sender = links
                            .as_ref()
                            .and_then(|links| links.senders.get(&bp.boundary))
                            .expect("connect() links every boundary this rank sends");
                        return Ok(BoundaryEnd::Send(Arc::clone(sender)));
                    }
                    (None, None) => return Ok(BoundaryEnd::Foreign),
                };
                let home = SlotHome { transport: bp.transport, tx_stream: &tx_stream, rx_stream: &rx.stream };
                let ring = SlotRing::new(config.n_slots(), config.reserved_bytes(), inbound.is_some(), home)?;
                let sm_copies = bp.transport != Transport::HostStaged
                    && config.sm_copies_allowed()
                    && helpers_runnable(&rx.engine)?;
                Ok(BoundaryEnd::Ring(Arc::new(Boundary {
                    plan: bp,
                    tx_stream,
                    rx_stream: Arc::clone(&rx.stream),
                    rx_engine: rx.engine.clone(),
                    sm_copies,
                    ring,
                    inbound,
                })))
            })
            .collect::<Result<Vec<_>>>()?;
        let mut receivers = Vec::with_capacity(inbound_links.len());
        let mut heartbeats = Vec::with_capacity(inbound_links.len());
        for (b, inbound) in inbound_links {
            let BoundaryEnd::Ring(ring) = &boundaries[b] else { unreachable!("an inbound boundary has a ring") };
            heartbeats.push(inbound.heartbeat()?);
            receivers.push(Receiver::start(inbound, Arc::clone(ring) as Arc<dyn SlotFiller>)?);
        }
        let senders =
            boundaries.iter().filter_map(|end| if let BoundaryEnd::Send(s) = end { Some(Arc::clone(s)) } else { None });
        let watchdog = Watchdog::start(senders.collect(), heartbeats)?;
        // The readback stream lives in the last stage's context (in this rank's last stage's
        // when another rank runs the last stage; `readback` is refused there).
        let last = stages.iter().rev().flatten().next().expect("every rank runs at least one stage");
        let readback = CudaStream::new(last.engine.context())?;
        let links = boundaries.iter().filter_map(BoundaryEnd::link).map(|link| link.failure()).collect();
        Ok(PpNRt {
            config,
            plan,
            stages,
            boundaries,
            readback,
            readbacks: Arc::new(ReadbackShared { ring: Mutex::new(Vec::new()), links }),
            watchdog,
            receivers,
        })
    }

    /// Number of stages.
    pub fn n_stages(&self) -> usize {
        self.stages.len()
    }

    /// Number of boundaries (`n_stages - 1`).
    pub fn n_boundaries(&self) -> usize {
        self.boundaries.len()
    }

    /// How many steps boundary `b` received through captured graphs so far (see
    /// [`PpConfig::nccl_recv_graphs`]): 0 unless this rank receives `b` from another rank.
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

    /// Slots per boundary ring.
    pub fn n_slots(&self) -> usize {
        self.config.n_slots()
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
    /// [`SM_COPY_MAX_BYTES`]): allowed by [`PpConfig::sm_copies`], a boundary with device slots,
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
        Error::Pipeline(PpError::StageNotOwned {
            stage: s,
            owner: self.plan.stage_ranks[s],
            rank: self.config.own_rank(),
        })
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
        self.config.own_rank()
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
        StreamOverride::new(Arc::clone(&self.stage(s)?.stream))
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
    /// [`PpError::ZeroLength`], [`Error::OutOfBounds`] (`n` larger than `x`), [`Error::WrongDevice`]
    /// (`x` not on stage `b`'s device), [`PpError::SlotState`] (the next slot's data was never
    /// received), [`CaptureError::IllegalCall`](crate::CaptureError::IllegalCall) (the stage's
    /// stream is being captured: the copy would run at the graph's launch while the slot said
    /// filled now; the capture is invalidated; [`capture_step`](Self::capture_step) captures
    /// steps). Else the driver's error. To another rank also [`PpError::TypeNameTooLong`] and
    /// [`PpError::PeerFailed`] (the link failed).
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
    /// # Errors
    /// As [`tx`](Self::tx), and [`PpError::Timeout`] when the slot stayed filled for `timeout`
    /// (nothing was enqueued).
    pub fn tx_wait<T: DeviceRepr, S: DeviceSlice<T>>(
        &self,
        b: usize,
        x: &S,
        n: usize,
        timeout: Duration,
    ) -> Result<usize> {
        self.tx_impl(b, x, n, Some(timeout))
    }

    fn tx_impl<T: DeviceRepr, S: DeviceSlice<T>>(
        &self,
        b: usize,
        x: &S,
        n: usize,
        wait: Option<Duration>,
    ) -> Result<usize> {
        let boundary = match self.end(b)? {
            BoundaryEnd::Ring(boundary) if boundary.inbound.is_none() => boundary,
            BoundaryEnd::Send(sender) => return self.tx_remote(b, sender, x, n),
            BoundaryEnd::Ring(_) | BoundaryEnd::Foreign => return Err(self.not_owned(b)),
        };
        check_tx_args(b, x, n, boundary.plan.tx_device)?;
        let bytes = n * std::mem::size_of::<T>();
        let mut ring = boundary.ring.lock();
        if let Some(timeout) = wait {
            ring = boundary.ring.wait_until(b, "tx", ring, timeout, &|| None, Slots::next)?;
        }
        let index = ring.next();
        ring.check_writable(b, index, "tx")?;
        let tx = &boundary.tx_stream;
        // No capture of the stage's stream: a captured copy would run at the graph's launch, not
        // now, and the slot would say filled with nothing in it. (`capture_step` captures steps.)
        let _gate = tx.enqueue_gate_uncaptured("PpNRt::tx")?;
        let slot = ring.writable(b, index, "tx", bytes, boundary.home())?;
        // One binding for the whole call (the copy and its event record find it current).
        let _bound = tx.context().bind_for_call()?;
        let src = x.as_view().slice(..n)?.into_bytes();
        #[cfg(feature = "testing")]
        if self.config.fault() == ProtocolFault::SkipRxWait {
            slot.access().forget_reads();
        }
        match slot {
            SlotBuffer::Device(buffer) => {
                // A writable slot is not lent (a lent one was given another buffer): the buffer
                // is not shared.
                let buffer = Arc::get_mut(buffer).expect("a writable slot's buffer is not shared");
                let dst = buffer.as_view_mut().slice_mut(..bytes)?;
                boundary.copy_into_slot(tx, src, dst)?;
            }
            SlotBuffer::Host(buffer) => buffer.copy_from_device(tx, src)?,
            SlotBuffer::Empty => unreachable!("writable() gave the slot a buffer of at least one byte"),
        }
        ring.filled(index, n, T::NAME);
        drop(ring);
        boundary.ring.wake_sleepers();
        Ok(index)
    }

    /// `tx` over a boundary to another rank: the same checks, then the NCCL send.
    fn tx_remote<T: DeviceRepr, S: DeviceSlice<T>>(&self, b: usize, sender: &Sender, x: &S, n: usize) -> Result<usize> {
        check_tx_args(b, x, n, sender.tx_device)?;
        sender.tx(x, n)
    }

    /// Boundary RX at boundary `b` (stage `b + 1`'s side): waits for the slot's TX event, copies
    /// the slot into a fresh stream-ordered buffer on stage `b + 1`'s stream, records the slot's
    /// RX event. The returned buffer is owned by the RX stage's stream and freed there.
    ///
    /// # Errors
    /// Caught before anything is enqueued: [`PpError::BoundaryOutOfRange`], [`PpError::ZeroLength`],
    /// [`PpError::SlotOutOfRange`], [`PpError::SlotState`] (never filled or already received),
    /// [`PpError::RxLengthMismatch`], [`PpError::RxTypeMismatch`],
    /// [`CaptureError::IllegalCall`](crate::CaptureError::IllegalCall) (the stage's stream is
    /// being captured: the copy would run at the graph's launch, reading whatever the slot holds
    /// then, while the slot said received now; the capture is invalidated). Else the driver's
    /// error. From another rank also [`PpError::PeerFailed`] (the link failed).
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

    fn rx_impl<T: DeviceRepr>(
        &self,
        b: usize,
        slot_index: usize,
        n: usize,
        wait: Option<Duration>,
    ) -> Result<CudaSlice<T>> {
        let (boundary, mut ring, _gate) = self.receivable::<T>(b, slot_index, n, wait, "PpNRt::rx")?;
        let bytes = n * std::mem::size_of::<T>();
        let rx = &boundary.rx_stream;
        let _bound = rx.context().bind_for_call()?;
        let mut out = CudaSlice::<T>::alloc(rx, n)?;
        let dst = out.as_view_mut().into_bytes();
        match ring.buffer(slot_index) {
            SlotBuffer::Device(buffer) => boundary.copy_within_device(rx, buffer.as_view().slice(..bytes)?, dst)?,
            SlotBuffer::Host(buffer) => buffer.copy_to_device(rx, dst)?,
            SlotBuffer::Empty => unreachable!("a filled slot has a buffer"),
        }
        ring.received(slot_index);
        drop(ring);
        boundary.ring.wake_sleepers();
        Ok(out)
    }

    /// Boundary `b` and its ring, locked, with slot `slot_index` checked to be filled with `n`
    /// elements of `T` (after waiting up to `wait` for it to be filled), and the RX stream's
    /// enqueue gate, taken after the wait and checked uncaptured for `call`: a captured receive
    /// would run at the graph's launch, reading whatever the slot holds then, while the slot says
    /// received now. (`capture_step` captures steps.)
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
        let wait = wait.or(boundary.inbound.as_ref().map(|_| self.config.peer_timeout_value()));
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
        #[cfg(feature = "testing")]
        if self.config.fault() == ProtocolFault::SkipTxWait {
            ring.buffer(slot_index).access().forget_write();
        }
        Ok((boundary, ring, gate))
    }

    /// Boundary RX without a copy: lends the slot itself to stage `b + 1` as a [`ReceivedSlot`],
    /// whose [`view`](ReceivedSlot::view) the stage's kernels read in place (ordered after the
    /// slot's `tx` by the crate's rule, and the slot's next `tx` after them). Drop the guard once
    /// the work that reads the view has been enqueued: the slot's buffer then serves the next
    /// write again. A write that reaches the slot while the guard lives (or after it was
    /// forgotten) gives the slot another buffer (a spare from an earlier guard, else a fresh
    /// allocation) and leaves the guard's buffer, and its step, to the guard; captured step graphs
    /// that used the slot's old buffer are then stale ([`PpError::GraphStale`]). A host-staged
    /// slot cannot be lent to kernels: there the guard holds a copy, as [`rx`](Self::rx) makes.
    ///
    /// # Errors
    /// As [`rx`](Self::rx).
    pub fn rx_in_place<T: DeviceRepr>(&self, b: usize, slot_index: usize, n: usize) -> Result<ReceivedSlot<'_, T>> {
        self.rx_in_place_impl(b, slot_index, n, None)
    }

    /// [`rx_in_place`](Self::rx_in_place) that parks until the slot is filled, as
    /// [`rx_wait`](Self::rx_wait) does.
    ///
    /// # Errors
    /// As [`rx_wait`](Self::rx_wait).
    pub fn rx_in_place_wait<T: DeviceRepr>(
        &self,
        b: usize,
        slot_index: usize,
        n: usize,
        timeout: Duration,
    ) -> Result<ReceivedSlot<'_, T>> {
        self.rx_in_place_impl(b, slot_index, n, Some(timeout))
    }

    fn rx_in_place_impl<T: DeviceRepr>(
        &self,
        b: usize,
        slot_index: usize,
        n: usize,
        wait: Option<Duration>,
    ) -> Result<ReceivedSlot<'_, T>> {
        let boundary = self.boundary(b)?;
        if n == 0 {
            return Err(Error::Pipeline(PpError::ZeroLength { boundary: b }));
        }
        if matches!(boundary.plan.transport, Transport::HostStaged) {
            let copy = self.rx_impl::<T>(b, slot_index, n, wait)?;
            return Ok(ReceivedSlot {
                lent: None,
                readers: Vec::new(),
                copy: Some(copy),
                boundary,
                slot: slot_index,
                n,
            });
        }
        let (_, mut ring, _gate) = self.receivable::<T>(b, slot_index, n, wait, "PpNRt::rx_in_place")?;
        let lent = ring.lend(slot_index);
        Ok(ReceivedSlot { lent: Some(lent), readers: Vec::new(), copy: None, boundary, slot: slot_index, n })
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

    /// Records a fresh completion event on the last stage's stream (call after the step's final
    /// work, e.g. the logits matmul, has been enqueued there): an event to wait on, on the host or
    /// on another stream, for everything the step enqueued on the last stage.
    ///
    /// For reading a step's results back while later steps run, use [`readback`](Self::readback)
    /// instead: it waits for the results' own last write only, copies into pinned buffers it
    /// reuses, and never makes a stage stream wait for the copy. A pinned buffer allocated per
    /// step costs far more than the step (a 33 µs decode step took 1.58 ms so); done by hand,
    /// allocate it once:
    ///
    /// ```no_run
    /// # fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// use ppnrt::{Engine, PinnedHostBuffer, PpNRt};
    /// let primary = Engine::new(0)?;
    /// let rt = PpNRt::get(&primary)?;
    /// let last = rt.n_stages() - 1;
    /// let readback = rt.readback_stream();
    /// // Once, before the decode loop:
    /// let mut host = PinnedHostBuffer::<f32>::new(readback.context(), 32_000, false)?;
    /// for _step in 0..3 {
    ///     let logits = {
    ///         let _scope = rt.enter(last)?;
    ///         rt.engine(last, &primary)?.alloc_zeroed::<f32>(32_000)? // the step's logits
    ///     };
    ///     let done = rt.record_done()?;
    ///     readback.wait(&done)?;
    ///     readback.memcpy_dtoh_pinned(&logits, &mut host)?;
    ///     let values: &[f32] = host.as_slice()?; // waits for the copy
    ///     let _ = values;
    /// }
    /// # Ok(()) }
    /// ```
    ///
    /// # Errors
    /// The driver's error.
    pub fn record_done(&self) -> Result<CudaEvent> {
        let last = self.stage(self.stages.len() - 1)?;
        let event = CudaEvent::new(last.engine.context(), false)?;
        event.record(&last.stream)?;
        Ok(event)
    }

    /// Deferred readback of `source`, a buffer on the last stage's device (the step's logits, say):
    /// the readback stream waits for `source`'s last write (the step's work, enqueued before this
    /// call) and copies it into a pinned buffer from the runtime's ring; `source`'s free is moved
    /// to the readback stream, so no stage stream ever waits for the copy, and the buffer stays
    /// alive until the copy is done. Call it after the step's last work on `source` was enqueued.
    /// A buffer that a graph holds (the last stage's output in graph mode) keeps its owner: the
    /// graph frees it last, after the copy as every free; to read such a buffer back step after
    /// step without giving it up, use [`readback_of`](Self::readback_of).
    ///
    /// ```no_run
    /// # fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// use ppnrt::{Engine, PpNRt};
    /// let primary = Engine::new(0)?;
    /// let rt = PpNRt::get(&primary)?;
    /// let last = rt.n_stages() - 1;
    /// let logits = {
    ///     let _scope = rt.enter(last)?;
    ///     rt.engine(last, &primary)?.alloc_zeroed::<f32>(32_000)? // the step's logits
    /// };
    /// let pending = rt.readback(logits)?;
    /// // ... enqueue the next steps ...
    /// let values: &[f32] = pending.wait()?;
    /// # let _ = values; Ok(()) }
    /// ```
    ///
    /// # Errors
    /// [`Error::WrongDevice`] when `source` is not on the last stage's device; the driver's
    /// error (a pinned allocation the first time a size is read back).
    pub fn readback<T: DeviceRepr>(&self, mut source: CudaSlice<T>) -> Result<PendingReadback<T>> {
        let host = self.start_readback("PpNRt::readback", &source)?;
        match source.set_stream(&self.readback) {
            // A graph holds the memory and frees it last: the slice's drop frees nothing.
            Ok(()) | Err(Error::HeldByGraph { .. }) => {}
            Err(e) => return Err(e),
        }
        Ok(PendingReadback::new(host, source.len(), Some(source), Arc::clone(&self.readbacks)))
    }

    /// Deferred readback of a buffer the caller keeps (the last stage's output buffer of captured
    /// step graphs, say): as [`readback`](Self::readback), but `source` stays the caller's. The
    /// copy is a read of `source` under the crate's ordering rule: the next write of `source`
    /// (the next step's, a graph's launch included) waits for it on the GPU, and its free does
    /// too. Prefer [`readback`](Self::readback) for a buffer of one step, which no stage stream
    /// then waits for.
    ///
    /// # Errors
    /// As [`readback`](Self::readback).
    pub fn readback_of<T: DeviceRepr, S: DeviceSlice<T>>(&self, source: &S) -> Result<PendingReadback<T>> {
        let host = self.start_readback("PpNRt::readback_of", source)?;
        Ok(PendingReadback::new(host, source.len(), None, Arc::clone(&self.readbacks)))
    }

    /// Checks `source` (`what` reads it back), takes a pinned buffer from the ring (or allocates
    /// one) and enqueues the copy on the readback stream. On error the pinned buffer is back in
    /// the ring.
    fn start_readback<T: DeviceRepr, S: DeviceSlice<T>>(
        &self,
        what: &'static str,
        source: &S,
    ) -> Result<PinnedHostBuffer<u8>> {
        let device = self.stage(self.stages.len() - 1)?.engine.ordinal();
        if source.ordinal() != device {
            return Err(Error::WrongDevice { what, expected: device, found: source.ordinal() });
        }
        let bytes = source.len() * std::mem::size_of::<T>();
        let reused = {
            let mut ring = self.readbacks.ring.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
            ring.iter().position(|host| host.len() >= bytes).map(|at| ring.swap_remove(at))
        };
        let mut host = match reused {
            Some(host) => host,
            None => {
                let capacity = bytes.checked_next_power_of_two().unwrap_or(bytes).max(MIN_SLOT_BYTES);
                PinnedHostBuffer::new_eager(self.readback.context(), capacity)?
            }
        };
        let copied = host.copy_from_device(&self.readback, source.as_view().into_bytes());
        if let Err(e) = copied {
            self.readbacks.ring.lock().unwrap_or_else(|poisoned| poisoned.into_inner()).push(host);
            return Err(e);
        }
        Ok(host)
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

    /// The dedicated readback stream (in the last stage's context).
    pub fn readback_stream(&self) -> &Arc<CudaStream> {
        &self.readback
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

impl SlotFiller for Boundary {
    fn fill(
        &self,
        step: &Announced,
        stop: &AtomicBool,
        recv: &mut dyn FnMut(usize, &mut CudaViewMut<'_, u8>) -> Result<()>,
    ) -> Result<bool> {
        let phase = |phase: Phase| {
            if let Some(link) = &self.inbound {
                link.phase.set(phase, step.step);
            }
        };
        phase(Phase::AwaitingFreeSlot);
        let mut ring = self.ring.lock();
        // The RX stage's `rx` of the slot is likely near: spin first, so that `rx` finds no
        // sleeper to wake, then sleep.
        let start = Instant::now();
        let spin_until = start + remote::SPIN;
        while !ring.next_writable(start.elapsed()) {
            if stop.load(Ordering::SeqCst) {
                return Ok(false);
            }
            ring = if Instant::now() < spin_until {
                self.ring.spin(ring, spin_until, || stop.load(Ordering::Relaxed))
            } else {
                self.ring.sleep(ring, remote::POLL)
            };
        }
        // The slot's buffer leaves the ring while its receive is posted, and the ring's lock is
        // released: growing the slot allocates, and posting the receive may wait (a graph launch
        // for its previous launch, NCCL for a connection it makes in the background). The RX
        // stage's `rx` of the other slots, and its bounded waits, go on meanwhile. This thread is
        // the ring's only writer; the slot is receiving (not free, not filled) until its receive
        // is posted, so that a capture of the step's graphs leaves it alone.
        let (index, mut buffer, was) = ring.begin_receive(step.bytes);
        drop(ring);
        phase(Phase::Posting);
        let posted = self.post_receive(&mut buffer, index, step.bytes, recv);
        let mut ring = self.ring.lock();
        let arrived = posted.is_ok().then_some((step.n, step.elem, step.step));
        ring.end_receive(index, buffer, was, arrived);
        if let Err(e) = posted {
            drop(ring);
            self.ring.wake_sleepers();
            return Err(e);
        }
        // Under the ring's lock: a receive that finds the slot filled finds the thread awaiting
        // the next record, not still posting this one.
        if let Some(link) = &self.inbound {
            link.phase.set(Phase::AwaitingRecord, step.step + 1);
        }
        drop(ring);
        self.ring.wake_sleepers();
        Ok(true)
    }

    fn wake(&self) {
        self.ring.wake_all();
    }
}

impl Boundary {
    /// Where the ring's slot buffers live, to grow them.
    fn home(&self) -> SlotHome<'_> {
        SlotHome { transport: self.plan.transport, tx_stream: &self.tx_stream, rx_stream: &self.rx_stream }
    }

    /// The error of the failed link from the TX stage's rank, if this boundary has one that
    /// failed.
    fn link_failure(&self) -> Option<Error> {
        self.inbound.as_ref().and_then(|link| link.stopped())
    }

    /// Posts `recv` of `bytes` into slot `index`'s buffer `buffer` (taken out of the ring), grown
    /// first if it is too small.
    fn post_receive(
        &self,
        buffer: &mut SlotBuffer,
        index: usize,
        bytes: usize,
        recv: &mut dyn FnMut(usize, &mut CudaViewMut<'_, u8>) -> Result<()>,
    ) -> Result<()> {
        if !buffer.holds(bytes) {
            self.home().grow(buffer, bytes)?;
        }
        let _bound = self.tx_stream.context().bind_for_call()?;
        let SlotBuffer::Device(buffer) = buffer else {
            unreachable!("a slot of a boundary from another rank is device memory")
        };
        // A writable slot is not lent (a lent one was given another buffer).
        let buffer = Arc::get_mut(buffer).expect("a writable slot's buffer is not shared");
        let mut dst = buffer.as_view_mut().slice_mut(..bytes)?;
        recv(index, &mut dst)
    }

    /// Enqueues a copy within the RX device on `stream` (a stream of that device): the SM copy
    /// kernel when the boundary may use it, up to [`SM_COPY_MAX_BYTES`], with both addresses
    /// 16-byte aligned; else the copy engine.
    fn copy_within_device(
        &self,
        stream: &Arc<CudaStream>,
        src: CudaView<'_, u8>,
        dst: CudaViewMut<'_, u8>,
    ) -> Result<()> {
        if self.sm_copies && src.len() <= SM_COPY_MAX_BYTES && src.is_aligned_to(16) && dst.is_aligned_to(16) {
            self.rx_engine.helper_kernels()?.copy_bytes(stream, src, dst)
        } else {
            stream.memcpy_dtod(&src, &mut { dst })
        }
    }
}

/// Checks `tx`'s arguments at boundary `b`: `n` at least 1 and within `x`, `x` on the TX stage's
/// device `tx_device`.
fn check_tx_args<T: DeviceRepr, S: DeviceSlice<T>>(b: usize, x: &S, n: usize, tx_device: i32) -> Result<()> {
    if n == 0 {
        return Err(Error::Pipeline(PpError::ZeroLength { boundary: b }));
    }
    if n > x.len() {
        return Err(Error::OutOfBounds { what: "PpNRt::tx: n exceeds x", start: 0, end: n, len: x.len() });
    }
    if x.ordinal() != tx_device {
        return Err(Error::WrongDevice {
            what: "PpNRt::tx: x must be on the TX stage's device",
            expected: tx_device,
            found: x.ordinal(),
        });
    }
    Ok(())
}

/// Whether the helper kernels load on `engine`'s device. `Ok(false)` when the driver cannot run
/// the embedded PTX (a driver older than the toolkit that built it): boundary copies then stay on
/// the copy engines, which need no kernel. Any other failure is the build's error.
fn helpers_runnable(engine: &Engine) -> Result<bool> {
    match engine.helper_kernels() {
        Ok(_) => Ok(true),
        Err(Error::Driver(e)) if e.is_unrunnable_code() => Ok(false),
        Err(e) => Err(e),
    }
}

/// A slot received in place ([`PpNRt::rx_in_place`]): read it through [`view`](Self::view) on
/// any stream (the crate's ordering rule orders those reads after the slot's `tx`, and the slot's
/// next `tx` after them). Dropping the guard gives the slot's buffer back for the next `tx`; drop
/// it once the work that reads the view has been enqueued. A guard that lives past its slot's
/// next write keeps its own buffer and step (see [`PpNRt::rx_in_place`]).
#[must_use = "the guard lends the slot's buffer until it drops"]
pub struct ReceivedSlot<'a, T: DeviceRepr> {
    /// The slot's own buffer (device transports).
    lent: Option<Arc<CudaSlice<u8>>>,
    /// The streams ordered by [`order_on`](ReceivedSlot::order_on), each once: their reads are
    /// recorded when the guard drops.
    readers: Vec<Arc<CudaStream>>,
    /// A copy (host-staged transport).
    copy: Option<CudaSlice<T>>,
    boundary: &'a Boundary,
    slot: usize,
    n: usize,
}

impl<T: DeviceRepr> ReceivedSlot<'_, T> {
    /// The received elements.
    ///
    /// # Errors
    /// [`Error::Misaligned`] cannot happen for the crate's element types (slot buffers are
    /// 256-byte aligned); kept for types of yours with a larger alignment.
    pub fn view(&self) -> Result<CudaView<'_, T>> {
        match (&self.lent, &self.copy) {
            (Some(buffer), _) => buffer.as_view().first_as::<T>("ReceivedSlot::view", self.n),
            (None, Some(copy)) => Ok(copy.as_view()),
            (None, None) => unreachable!("a guard holds the slot or a copy"),
        }
    }

    /// Orders `stream` after the slot's data arrived, for a consumer that reads the view's memory
    /// by other means than this crate's launches and copies (another library's kernels, say):
    /// its reads are recorded when the guard drops, so enqueue them on `stream` before dropping
    /// it. Call it for each stream that reads so; the slot's next `tx` (or, for a host-staged
    /// boundary, the free of the copy) waits for all of them. (Reads through this crate order
    /// themselves and need no call.)
    ///
    /// # Errors
    /// The driver's error.
    pub fn order_on(&mut self, stream: &Arc<CudaStream>) -> Result<()> {
        self.access().order(stream, Use::Read)?;
        if !self.readers.iter().any(|reader| Arc::ptr_eq(reader, stream)) {
            self.readers.push(Arc::clone(stream));
        }
        Ok(())
    }

    /// The ordering state of the memory the guard lends: the slot's buffer, or the copy.
    fn access(&self) -> &Access {
        match (&self.lent, &self.copy) {
            (Some(buffer), _) => buffer.access(),
            (None, Some(copy)) => copy.access(),
            (None, None) => unreachable!("a guard holds the slot or a copy"),
        }
    }

    /// Number of elements.
    pub fn len(&self) -> usize {
        self.n
    }

    /// Whether no element was received (never: `n` is at least 1).
    pub fn is_empty(&self) -> bool {
        self.n == 0
    }

    /// Whether the view is the slot itself (`false`: a copy, for a host-staged boundary).
    pub fn is_in_place(&self) -> bool {
        self.lent.is_some()
    }
}

impl<T: DeviceRepr> Drop for ReceivedSlot<'_, T> {
    fn drop(&mut self) {
        // The reads of the streams ordered by `order_on` end here (their work was enqueued
        // before): the slot's next `tx`, or the copy's free, waits for them.
        for reader in &self.readers {
            if let Err(e) = self.access().note(reader, Use::Read) {
                // The read stays recorded without its event; a later writer records one at the
                // end of the reader's stream, after the read.
                record_drop_error(e);
            }
        }
        if let Some(lent) = self.lent.take() {
            let left = self.boundary.ring.lock().give_back(self.slot, lent);
            self.boundary.ring.wake_sleepers();
            drop(left);
        }
    }
}

impl<T: DeviceRepr> fmt::Debug for ReceivedSlot<'_, T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ReceivedSlot")
            .field("slot", &self.slot)
            .field("n", &self.n)
            .field("in_place", &self.is_in_place())
            .finish()
    }
}

impl Drop for PpNRt {
    fn drop(&mut self) {
        // Slot buffers are written by TX streams of other devices: drain every stream before the
        // fields (and the buffers) go, each one even when another failed.
        // A boundary to another rank first closes cleanly (the receiving rank confirms that it
        // received every step), or is aborted: no NCCL send of it may stay queued.
        for end in &self.boundaries {
            if let BoundaryEnd::Send(sender) = end {
                sender.close(self.config.peer_timeout_value());
            }
        }
        self.watchdog = None;
        for receiver in &mut self.receivers {
            receiver.stop();
        }
        for stream in self.local_streams() {
            if let Err(e) = stream.synchronize() {
                record_drop_error(e);
            }
        }
        // A link to another rank that failed and whose failure no call returned (it failed in
        // the background after the last call, or during this teardown: the close was not
        // confirmed, the receives did not complete) may have lost steps: recorded.
        for failure in self.readbacks.links.iter().filter_map(|link| link.unreported()) {
            record_drop_error(failure);
        }
    }
}

impl fmt::Debug for PpNRt {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PpNRt").field("config", &self.config.to_string()).field("plan", &self.plan.to_string()).finish()
    }
}

fn describe_env() -> String {
    let core = [STAGES_VAR, DEVICES_VAR, SLOTS_VAR, TRANSPORT_VAR].iter().map(|name| match std::env::var_os(name) {
        Some(value) => format!("{name}={:?}", value.to_string_lossy()),
        None => format!("{name} unset"),
    });
    // The settings of a pipeline across processes, where set.
    let processes = [RANKS_VAR, RANK_VAR, RENDEZVOUS_VAR, PEER_TIMEOUT_VAR]
        .iter()
        .filter_map(|name| std::env::var_os(name).map(|value| format!("{name}={:?}", value.to_string_lossy())));
    core.chain(processes).collect::<Vec<_>>().join(" ")
}
