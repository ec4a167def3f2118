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
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, OnceLock};
use std::time::{Duration, Instant};

use super::error::{PpError, ReceiverState, SlotState};
use super::plan::{BoundaryPlan, Plan, Transport};
use super::readback::{PendingReadback, ReadbackShared};
use super::remote::{self, Announced, Link, LocalStage, Phase, Receiver, Sender, SlotFiller, Watchdog};
#[cfg(feature = "testing")]
use crate::config::ProtocolFault;
use crate::config::{
    DEVICES_VAR, PEER_TIMEOUT_VAR, PpConfig, RANK_VAR, RANKS_VAR, RENDEZVOUS_VAR, SLOTS_VAR, STAGES_VAR, TRANSPORT_VAR,
};
use crate::engine::Engine;
use crate::error::{ConfigError, Error, Result};
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
    ring: Mutex<Ring>,
    /// Signalled whenever a slot of the ring changes state (for the waiting `tx_wait`/`rx_wait`).
    changed: Condvar,
    /// Threads asleep on `changed`: a state change signals it only when some are (a signal
    /// costs a system call, which a step's `tx` and `rx` would otherwise pay each time).
    sleepers: AtomicUsize,
    /// The link to the TX stage's rank, when that stage runs in another process.
    inbound: Option<Arc<Link>>,
    /// Counts the ring's state changes (bumped by [`wake_sleepers`](Boundary::wake_sleepers) after
    /// each): a thread waiting for a slot of a boundary from another rank (an `rx_wait`, or the
    /// receiver thread waiting for a free slot) spins on it briefly before it sleeps on `changed`,
    /// so the thread that makes the change pays no wake-up system call.
    changes: AtomicU64,
}

struct Ring {
    next: usize,
    slots: Vec<Slot>,
    /// For a boundary from another rank: the step after the last one its RX stage took (copied
    /// out, lent, or read by a graph), which a graph launch of that stage reads next. Steps fill
    /// the slots in turn, so that step is in slot `received % slots`.
    received: u64,
}

impl Ring {
    /// Notes that the RX stage took slot `k` (a ring of a boundary from another rank: the steps
    /// it holds are counted).
    fn took(&mut self, k: usize, inbound: bool) {
        if inbound {
            self.received = self.received.max(self.slots[k].step + 1);
        }
    }
}

/// One slot of a ring. Its buffer is *eager* under the crate's ordering rule: the copy into it
/// records its event on the TX stream right after the copy (the protocol's `ev_tx`), the copy out
/// records its event on the RX stream right after that copy (`ev_rx`); the next copy out waits for
/// the first (read after write), the next copy in for the second (write after read).
struct Slot {
    state: SlotState,
    buffer: SlotBuffer,
    /// For a boundary from another rank: the step the slot was last filled with.
    step: u64,
}

enum SlotBuffer {
    Empty,
    /// Memory on the RX device, shared with a [`ReceivedSlot`] while the slot is lent:
    /// `cuMemAlloc` memory owned by the RX stream, or, for a boundary from another rank, pool
    /// memory owned by its receive stream (see [`grow`]).
    Device(Arc<CudaSlice<u8>>),
    /// Pinned host memory.
    Host(PinnedHostBuffer<u8>),
}

impl SlotBuffer {
    /// The buffer's ordering state (the protocol's events live there).
    #[cfg(feature = "testing")]
    fn access(&self) -> &Access {
        match self {
            SlotBuffer::Empty => unreachable!("only a slot with a buffer is copied to or from"),
            SlotBuffer::Device(buffer) => buffer.access(),
            SlotBuffer::Host(buffer) => buffer.access(),
        }
    }

    fn capacity(&self) -> usize {
        match self {
            SlotBuffer::Empty => 0,
            SlotBuffer::Device(buffer) => buffer.len(),
            SlotBuffer::Host(buffer) => buffer.len(),
        }
    }

    /// Whether the slot has a buffer of at least `bytes` (a step of zero-sized elements, 0 bytes,
    /// still needs a buffer to be ordered through).
    fn holds(&self, bytes: usize) -> bool {
        !matches!(self, SlotBuffer::Empty) && self.capacity() >= bytes
    }
}

mod step_graph;
pub use step_graph::{StageCapture, StepGraphs};

static RUNTIME: OnceLock<std::result::Result<PpNRt, Error>> = OnceLock::new();

/// The smallest slot allocation, in bytes; slots grow in powers of two from here.
const MIN_SLOT_BYTES: usize = 4096;

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
                let slots = (0..config.n_slots())
                    .map(|_| {
                        let mut slot = Slot { state: SlotState::NeverFilled, buffer: SlotBuffer::Empty, step: 0 };
                        if config.reserved_bytes() > 0 {
                            grow(&mut slot.buffer, bp.transport, &tx_stream, &rx.stream, config.reserved_bytes())?;
                        }
                        Ok(slot)
                    })
                    .collect::<Result<Vec<_>>>()?;
                let sm_copies = bp.transport != Transport::HostStaged
                    && config.sm_copies_allowed()
                    && helpers_runnable(&rx.engine)?;
                Ok(BoundaryEnd::Ring(Arc::new(Boundary {
                    plan: bp,
                    tx_stream,
                    rx_stream: Arc::clone(&rx.stream),
                    rx_engine: rx.engine.clone(),
                    sm_copies,
                    ring: Mutex::new(Ring { next: 0, slots, received: 0 }),
                    changed: Condvar::new(),
                    sleepers: AtomicUsize::new(0),
                    inbound,
                    changes: AtomicU64::new(0),
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

    fn lock(boundary: &Boundary) -> MutexGuard<'_, Ring> {
        // A panic while the lock was held cannot leave a slot half-updated (state changes last),
        // so a poisoned ring is still consistent.
        boundary.ring.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Parks until the slot `which(ring)` is ready for `call` (`tx`: free; `rx`: filled), for
    /// at most `timeout`; returns the ring's lock held.
    fn wait_until<'a>(
        b: usize,
        call: &'static str,
        boundary: &'a Boundary,
        ring: MutexGuard<'a, Ring>,
        timeout: Duration,
        which: impl Fn(&Ring) -> usize,
    ) -> Result<MutexGuard<'a, Ring>> {
        let not_ready = |ring: &Ring| {
            let slot = which(ring);
            let state = ring.slots[slot].state;
            let ready = if call == "tx" { state.is_free() } else { matches!(state, SlotState::Filled { .. }) };
            (!ready).then_some(slot)
        };
        Self::wait_while(b, call, boundary, ring, timeout, not_ready)
    }

    /// Parks while `blocking(ring)` names a slot that `call` waits for, for at most `timeout`
    /// ([`PpError::Timeout`] naming that slot); a failed link from another rank ends the wait
    /// with its error. Returns the ring's lock held.
    fn wait_while<'a>(
        b: usize,
        call: &'static str,
        boundary: &'a Boundary,
        mut ring: MutexGuard<'a, Ring>,
        timeout: Duration,
        blocking: impl Fn(&Ring) -> Option<usize>,
    ) -> Result<MutexGuard<'a, Ring>> {
        let start = Instant::now();
        let spin_until = start + remote::SPIN;
        while let Some(slot) = blocking(&ring) {
            if let Some(failed) = boundary.inbound.as_ref().and_then(|link| link.stopped()) {
                return Err(failed);
            }
            let waited = start.elapsed();
            if waited >= timeout {
                return Err(Error::Pipeline(PpError::Timeout {
                    boundary: b,
                    slot,
                    call,
                    waited,
                    found: ring.slots[slot].state,
                }));
            }
            if boundary.inbound.is_some() && Instant::now() < spin_until {
                // A step from another rank is likely near: spin on the ring's change count
                // (read under the lock, so no change is missed), then look again.
                ring = boundary.spin(ring, spin_until, || false);
                continue;
            }
            ring = boundary.sleep(ring, timeout - waited);
        }
        Ok(ring)
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
    /// received). Else the driver's error. To another rank also [`PpError::TypeNameTooLong`],
    /// [`PpError::PeerFailed`] (the link failed) and [`CaptureError::IllegalCall`](crate::CaptureError::IllegalCall) (the stage's
    /// stream is being captured: a step to another process is announced once and cannot be
    /// replayed; the capture is invalidated).
    pub fn tx<T: DeviceRepr, S: DeviceSlice<T>>(&self, b: usize, x: &S, n: usize) -> Result<usize> {
        self.tx_impl(b, x, n, None)
    }

    /// [`tx`](Self::tx) for a thread that drives its own stage: when the ring's next slot still
    /// holds data not yet received, parks the thread until the receiving stage's `rx` of it has
    /// been issued (or the slot was discarded), for at most `timeout`. No busy-waiting.
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
        let mut ring = Self::lock(boundary);
        if let Some(timeout) = wait {
            ring = Self::wait_until(b, "tx", boundary, ring, timeout, |ring| ring.next)?;
        }
        let index = ring.next;
        let slot = &mut ring.slots[index];
        check_free(b, index, "tx", slot.state)?;
        if !slot.buffer.holds(bytes) {
            grow(&mut slot.buffer, boundary.plan.transport, &boundary.tx_stream, &boundary.rx_stream, bytes)?;
        }
        let tx = &boundary.tx_stream;
        // One binding for the whole call (the copy and its event record find it current).
        let _bound = tx.context().bind_for_call()?;
        let src = x.as_view().slice(..n)?.into_bytes();
        #[cfg(feature = "testing")]
        if self.config.fault() == ProtocolFault::SkipRxWait {
            slot.buffer.access().forget_reads();
        }
        match &mut slot.buffer {
            SlotBuffer::Device(buffer) => {
                // A lent slot is not free, and its view gives its share back before the slot is
                // marked received: the buffer is not shared here.
                let buffer = Arc::get_mut(buffer).ok_or_else(|| not_free(b, index, "tx", SlotState::Lent))?;
                let dst = buffer.as_view_mut().slice_mut(..bytes)?;
                boundary.copy_into_slot(tx, src, dst)?;
            }
            SlotBuffer::Host(buffer) => buffer.copy_from_device(tx, src)?,
            SlotBuffer::Empty => unreachable!("grow() gave the slot a buffer of at least one byte"),
        }
        slot.state = SlotState::Filled { n, elem: T::NAME };
        ring.next = (index + 1) % ring.slots.len();
        drop(ring);
        boundary.wake_sleepers();
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
    /// [`PpError::RxLengthMismatch`], [`PpError::RxTypeMismatch`]. Else the driver's error. From
    /// another rank also [`PpError::PeerFailed`] (the link failed) and [`CaptureError::IllegalCall`](crate::CaptureError::IllegalCall)
    /// (the stage's stream is being captured: the step fills its slot once; the capture is
    /// invalidated).
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
        let (boundary, mut ring) = self.receivable::<T>(b, slot_index, n, wait)?;
        let slot = &mut ring.slots[slot_index];
        let bytes = n * std::mem::size_of::<T>();
        let rx = &boundary.rx_stream;
        let _bound = rx.context().bind_for_call()?;
        let mut out = CudaSlice::<T>::alloc(rx, n)?;
        let dst = out.as_view_mut().into_bytes();
        match &slot.buffer {
            SlotBuffer::Device(buffer) => boundary.copy_within_device(rx, buffer.as_view().slice(..bytes)?, dst)?,
            SlotBuffer::Host(buffer) => buffer.copy_to_device(rx, dst)?,
            SlotBuffer::Empty => unreachable!("a filled slot has a buffer"),
        }
        slot.state = SlotState::Received;
        ring.took(slot_index, boundary.inbound.is_some());
        drop(ring);
        boundary.wake_sleepers();
        Ok(out)
    }

    /// Boundary `b` and its ring, locked, with slot `slot_index` checked to be filled with `n`
    /// elements of `T` (after waiting up to `wait` for it to be filled).
    fn receivable<T: DeviceRepr>(
        &self,
        b: usize,
        slot_index: usize,
        n: usize,
        wait: Option<Duration>,
    ) -> Result<(&Boundary, MutexGuard<'_, Ring>)> {
        let boundary = self.boundary(b)?;
        if n == 0 {
            return Err(Error::Pipeline(PpError::ZeroLength { boundary: b }));
        }
        if let Some(failed) = boundary.inbound.as_ref().filter(|link| link.aborted()).and_then(|link| link.stopped()) {
            // Receives of a failed link may have been cut short: no slot of it is trusted.
            return Err(failed);
        }
        // From another rank: no capture of the RX stream begins between this check and the copy.
        let _gate = boundary.inbound.as_ref().map(|_| boundary.rx_stream.enqueue_gate());
        if boundary.inbound.is_some() && boundary.rx_stream.is_capturing() {
            // A step from another rank fills its slot once: a captured receive replayed later
            // would read whatever the slot holds then.
            boundary.rx_stream.refuse_in_capture("PpNRt::rx from another rank")?;
        }
        // A step from another rank may still be on its way: wait for it, bounded.
        let wait = wait.or(boundary.inbound.as_ref().map(|_| self.config.peer_timeout_value()));
        let mut ring = Self::lock(boundary);
        let n_slots = ring.slots.len();
        if slot_index >= n_slots {
            return Err(Error::Pipeline(PpError::SlotOutOfRange { boundary: b, slot: slot_index, n_slots }));
        }
        if let Some(timeout) = wait {
            ring = Self::wait_until(b, "rx", boundary, ring, timeout, |_| slot_index)?;
        }
        let slot = &ring.slots[slot_index];
        check_filled::<T>(b, slot_index, "rx", slot.state, n)?;
        #[cfg(feature = "testing")]
        if self.config.fault() == ProtocolFault::SkipTxWait {
            slot.buffer.access().forget_write();
        }
        Ok((boundary, ring))
    }

    /// Boundary RX without a copy: lends the slot itself to stage `b + 1` as a [`ReceivedSlot`],
    /// whose [`view`](ReceivedSlot::view) the stage's kernels read in place (ordered after the
    /// slot's `tx` by the crate's rule, and the slot's next `tx` after them). The slot stays
    /// taken until the guard drops (a `tx` onto it is refused, `tx_wait` waits); drop it once the
    /// work that reads the view has been enqueued. A host-staged slot cannot be lent to kernels:
    /// there the guard holds a copy, as [`rx`](Self::rx) makes.
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
        let (_, mut ring) = self.receivable::<T>(b, slot_index, n, wait)?;
        let slot = &mut ring.slots[slot_index];
        let SlotBuffer::Device(buffer) = &slot.buffer else {
            unreachable!("a filled device-transport slot has a device buffer")
        };
        let lent = Arc::clone(buffer);
        slot.state = SlotState::Lent;
        ring.took(slot_index, boundary.inbound.is_some());
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
        let mut ring = Self::lock(boundary);
        let mut discarded = 0;
        for k in 0..ring.slots.len() {
            if matches!(ring.slots[k].state, SlotState::Filled { .. }) {
                ring.slots[k].state = SlotState::Discarded;
                // A step from another rank given up counts as taken: the graphs read the next.
                ring.took(k, boundary.inbound.is_some());
                discarded += 1;
            }
        }
        drop(ring);
        boundary.wake_sleepers();
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
        let device = self.stage(self.stages.len() - 1)?.engine.ordinal();
        if source.ordinal() != device {
            return Err(Error::WrongDevice {
                what: "PpNRt::readback: the buffer must be on the last stage's device",
                expected: device,
                found: source.ordinal(),
            });
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
        source.set_stream(&self.readback)?;
        Ok(PendingReadback::new(host, source.len(), source, Arc::clone(&self.readbacks)))
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
        let mut ring = PpNRt::lock(self);
        // The RX stage's `rx` of the slot is likely near: spin first, so that `rx` finds no
        // sleeper to wake, then sleep.
        let spin_until = Instant::now() + remote::SPIN;
        while !ring.slots[ring.next].state.is_free() {
            if stop.load(Ordering::SeqCst) {
                return Ok(false);
            }
            ring = if Instant::now() < spin_until {
                self.spin(ring, spin_until, || stop.load(Ordering::Relaxed))
            } else {
                self.sleep(ring, remote::POLL)
            };
        }
        let index = ring.next;
        // The slot's buffer leaves the ring while its receive is posted, and the ring's lock is
        // released: growing the slot allocates, and posting the receive may wait (a graph launch
        // for its previous launch, NCCL for a connection it makes in the background). The RX
        // stage's `rx` of the other slots, and its bounded waits, go on meanwhile. This thread is
        // the ring's only writer; the slot is `Receiving` (not free, not filled) until its
        // receive is posted, so that a capture of the step's graphs leaves it alone.
        let mut buffer = std::mem::replace(&mut ring.slots[index].buffer, SlotBuffer::Empty);
        let was = std::mem::replace(&mut ring.slots[index].state, SlotState::Receiving);
        drop(ring);
        phase(Phase::Posting);
        let posted = self.post_receive(&mut buffer, index, step.bytes, recv);
        let mut ring = PpNRt::lock(self);
        ring.slots[index].buffer = buffer;
        if let Err(e) = posted {
            ring.slots[index].state = was;
            drop(ring);
            self.wake_sleepers();
            return Err(e);
        }
        ring.slots[index].state = SlotState::Filled { n: step.n, elem: step.elem };
        ring.slots[index].step = step.step;
        ring.next = (index + 1) % ring.slots.len();
        // Under the ring's lock: a receive that finds the slot filled finds the thread awaiting
        // the next record, not still posting this one.
        if let Some(link) = &self.inbound {
            link.phase.set(Phase::AwaitingRecord, step.step + 1);
        }
        drop(ring);
        self.wake_sleepers();
        Ok(true)
    }

    fn wake(&self) {
        let ring = PpNRt::lock(self);
        self.changes.fetch_add(1, Ordering::Release);
        drop(ring);
        // Unconditionally: the link's failure is no slot state a sleeper could have checked.
        self.changed.notify_all();
    }
}

impl Boundary {
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
            grow(buffer, self.plan.transport, &self.tx_stream, &self.rx_stream, bytes)?;
        }
        let _bound = self.tx_stream.context().bind_for_call()?;
        let SlotBuffer::Device(buffer) = buffer else {
            unreachable!("a slot of a boundary from another rank is device memory")
        };
        // A free slot is not lent: its view gave its share back before the slot was freed.
        let buffer = Arc::get_mut(buffer).expect("a free slot's buffer is not shared");
        let mut dst = buffer.as_view_mut().slice_mut(..bytes)?;
        recv(index, &mut dst)
    }

    /// Sleeps on the ring's condition variable for at most `timeout` (counted as a sleeper, so
    /// state changes signal it); returns the lock held again.
    fn sleep<'a>(&'a self, ring: MutexGuard<'a, Ring>, timeout: Duration) -> MutexGuard<'a, Ring> {
        // Counted under the lock: a thread that changes a slot's state afterwards (it needs the
        // lock) sees the count and signals.
        self.sleepers.fetch_add(1, Ordering::SeqCst);
        let ring = match self.changed.wait_timeout(ring, timeout) {
            Ok((ring, _)) => ring,
            Err(poisoned) => poisoned.into_inner().0,
        };
        self.sleepers.fetch_sub(1, Ordering::SeqCst);
        ring
    }

    /// Releases the ring's lock and spins until its state changes (the change count moves), `until`
    /// passes or `give_up` says so; returns the lock held again. The count is read under the
    /// lock, so a change made after it is never missed.
    fn spin<'a>(
        &'a self,
        ring: MutexGuard<'a, Ring>,
        until: Instant,
        give_up: impl Fn() -> bool,
    ) -> MutexGuard<'a, Ring> {
        let seen = self.changes.load(Ordering::Acquire);
        drop(ring);
        while self.changes.load(Ordering::Acquire) == seen && Instant::now() < until && !give_up() {
            std::hint::spin_loop();
        }
        PpNRt::lock(self)
    }

    /// Counts a change of the ring and signals the threads asleep on it, if any. Call after a
    /// slot's state changed under the ring's lock (with the lock held or just released).
    fn wake_sleepers(&self) {
        self.changes.fetch_add(1, Ordering::Release);
        if self.sleepers.load(Ordering::SeqCst) != 0 {
            self.changed.notify_all();
        }
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

/// The error of `call` finding slot `slot` of boundary `b` not free for a write (`found`).
fn not_free(b: usize, slot: usize, call: &'static str, found: SlotState) -> Error {
    Error::Pipeline(PpError::SlotState { boundary: b, slot, call, needed: "free (received)", found })
}

/// Checks that a slot of boundary `b` in `state` may be written by `call`: [`PpError::SlotState`]
/// when it is not free.
fn check_free(b: usize, slot: usize, call: &'static str, state: SlotState) -> Result<()> {
    if state.is_free() { Ok(()) } else { Err(not_free(b, slot, call, state)) }
}

/// Checks that a slot of boundary `b` in `state` holds `n` elements of `T`, for `call` to receive
/// it: [`PpError::RxTypeMismatch`], [`PpError::RxLengthMismatch`], or [`PpError::SlotState`] when it
/// is not filled at all.
fn check_filled<T: DeviceRepr>(b: usize, slot: usize, call: &'static str, state: SlotState, n: usize) -> Result<()> {
    match state {
        SlotState::Filled { elem, .. } if elem != T::NAME => {
            Err(Error::Pipeline(PpError::RxTypeMismatch { boundary: b, slot, requested: T::NAME, sent: elem }))
        }
        SlotState::Filled { n: sent, .. } if sent != n => {
            Err(Error::Pipeline(PpError::RxLengthMismatch { boundary: b, slot, requested: n, sent }))
        }
        SlotState::Filled { .. } => Ok(()),
        found => Err(Error::Pipeline(PpError::SlotState { boundary: b, slot, call, needed: "filled", found })),
    }
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

/// Replaces the slot's buffer with one of at least `bytes` (a power of two, ≥ 4 KiB) of a boundary
/// of `transport` whose slots `tx_stream` writes and `rx_stream` reads, owned by `rx_stream`, or,
/// for a boundary from another rank, by its receive stream (that boundary's `tx_stream`). The slot is
/// free, and no copy in flight ever sees a freed buffer: a pooled buffer's free is ordered after
/// its last writer and reader; any other's last writer and reader are waited for first.
///
/// A boundary from another rank takes pooled memory: its slots grow while NCCL's kernels are in
/// flight, each waiting for its peer, and `cuMemAlloc`/`cuMemFree` may wait for the whole device
/// (NCCL warns that such a call can deadlock communicators used at once), where the stream-ordered
/// allocation and free do not. Its receive stream is never captured (a capture of the RX stage's
/// stream, which another thread may be making, is left alone). Slots reached by peers' copies
/// stay `cuMemAlloc` memory.
fn grow(
    slot: &mut SlotBuffer,
    transport: Transport,
    tx_stream: &Arc<CudaStream>,
    rx_stream: &Arc<CudaStream>,
    bytes: usize,
) -> Result<()> {
    let owner = if transport == Transport::Nccl { tx_stream } else { rx_stream };
    // Every copy into and out of an old buffer that is not pooled has completed before it goes
    // (its drop would wait too, but could not report an error).
    match slot {
        SlotBuffer::Device(buffer) if buffer.is_pooled() => {}
        SlotBuffer::Empty => {}
        SlotBuffer::Device(buffer) => buffer.synchronize()?,
        SlotBuffer::Host(buffer) => buffer.synchronize()?,
    }
    let capacity = bytes.checked_next_power_of_two().unwrap_or(bytes).max(MIN_SLOT_BYTES);
    *slot = SlotBuffer::Empty;
    *slot = match transport {
        Transport::Local | Transport::Peer => {
            SlotBuffer::Device(Arc::new(CudaSlice::alloc_persistent_eager(owner, capacity)?))
        }
        Transport::Nccl => SlotBuffer::Device(Arc::new(CudaSlice::alloc_eager(owner, capacity)?)),
        Transport::HostStaged => SlotBuffer::Host(PinnedHostBuffer::new_eager(owner.context(), capacity)?),
    };
    Ok(())
}

/// A slot received in place ([`PpNRt::rx_in_place`]): read it through [`view`](Self::view) on
/// any stream (the crate's ordering rule orders those reads after the slot's `tx`, and the slot's
/// next `tx` after them). Dropping the guard frees the slot for the next `tx`; drop it once the
/// work that reads the view has been enqueued.
#[must_use = "the slot stays taken until the guard drops"]
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
        // Give the buffer's share back first: a `tx` woken by the state change finds it unshared.
        if self.lent.take().is_some() {
            let mut ring = PpNRt::lock(self.boundary);
            if ring.slots[self.slot].state == SlotState::Lent {
                ring.slots[self.slot].state = SlotState::Received;
            }
            drop(ring);
            self.boundary.wake_sleepers();
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
