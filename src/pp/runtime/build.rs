//! Building a runtime: the process-wide one from the environment ([`PpNRt::get`]) or one of a
//! configuration ([`PpNRt::new`]): engines, stage streams, peer access, the boundaries' ends
//! (slot rings, senders to other ranks) and the links to other ranks; and its teardown.

use std::collections::BTreeMap;
use std::sync::{Arc, OnceLock};

use parking_lot::Mutex;

use super::{Boundary, BoundaryEnd, PpNRt, Stage};
use crate::engine::Engine;
use crate::error::ConfigError;
use crate::error::CudaError;
use crate::pp::config::{
    DEVICES_VAR, PEER_TIMEOUT_VAR, PROCESS_TRANSPORT_VAR, PpConfig, RANK_VAR, RANKS_VAR, RENDEZVOUS_VAR,
    RESERVE_BYTES_VAR, SLOTS_VAR, STAGES_VAR, TRANSPORT_VAR,
};
use crate::pp::error::{Error, Result};
use crate::pp::pending_readback::ReadbackShared;
use crate::pp::plan::{BoundaryPlan, Plan, SettingNames, Transport};
use crate::pp::remote::{self, Inbound, Links, LocalStage, Receiver, SlotFiller, Watchdog};
use crate::pp::ring::{SlotHome, SlotRing};
use crate::rendezvous::{DeviceIdentity, RankIdentity};
use crate::safe::{CudaStream, Device, enable_peer_access, record_drop_error};

static RUNTIME: OnceLock<std::result::Result<PpNRt, Error>> = OnceLock::new();

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
    /// When the stages span processes ([`PpConfig::with_ranks`]), this process builds only its own
    /// stages, and the call blocks until every rank has met at the rendezvous and each boundary
    /// between two ranks has its NCCL communicator and its connection (at most the peer timeout
    /// for the rendezvous; see the [module docs](crate::pp)).
    ///
    /// # Errors
    /// [`Error::Config`] for a configuration that cannot run on the devices present; the driver's
    /// error; across processes also [`Error::Rendezvous`], [`Error::Nccl`] and
    /// [`PpError::PeerFailed`](crate::PpError::PeerFailed).
    pub fn new(config: PpConfig, primary: &Engine) -> Result<PpNRt> {
        PpNRt::with_stage_streams(config, primary, &[])
    }

    /// [`new`](Self::new) with the engine's own streams for some stages: `streams[s]`, when
    /// given, is stage `s`'s stream (an engine's stream adopted with
    /// [`CudaStream::adopt`](crate::CudaStream::adopt), or a cudarc stream through
    /// `ppnrt::interop::EngineStream` with the `cudarc` feature), so the stage's work and the
    /// engine's own run in one stream's order with no join; the others get streams of their own.
    /// `streams` is empty or has one entry per stage.
    ///
    /// # Errors
    /// As [`new`](Self::new); [`Error::Config`] for a `streams` of another length than the stage
    /// count; [`PpError::StageNotOwned`](crate::PpError::StageNotOwned) for a stream given for
    /// another rank's stage; [`CudaError::WrongDevice`](crate::CudaError::WrongDevice) for a stream of another device than its
    /// stage's.
    pub fn with_stage_streams(
        config: PpConfig,
        primary: &Engine,
        streams: &[Option<Arc<CudaStream>>],
    ) -> Result<PpNRt> {
        config.validate()?;
        if !streams.is_empty() && streams.len() != config.n_stages() {
            return Err(Error::Config(crate::error::ConfigError {
                setting: "PpNRt::with_stage_streams",
                value: format!("{} stream(s)", streams.len()),
                reason: format!("give no stream or one entry per stage ({})", config.n_stages()),
            }));
        }
        let placement = Placement::of(&config, primary.ordinal());
        let engines = placement.open_engines(primary)?;
        let mut plan = placement.plan(&config, &engines)?;
        let stages = placement.stages(&engines, streams)?;
        let mut links = if plan.spans_processes() {
            let identity = placement.identity()?;
            let local: Vec<_> = stages
                .iter()
                .map(|stage| {
                    let stage = stage.as_ref()?;
                    Some(LocalStage { engine: stage.engine.clone(), stream: Arc::clone(&stage.stream) })
                })
                .collect();
            Some(remote::connect(&config, &mut plan, &local, &identity)?)
        } else {
            None
        };
        let mut inbound_links = Vec::new();
        let boundaries = plan
            .boundaries
            .iter()
            .map(|&bp| boundary_end(&config, bp, &stages, links.as_mut(), &mut inbound_links))
            .collect::<Result<Vec<_>>>()?;
        let (receivers, watchdog) = start_link_threads(&boundaries, inbound_links)?;
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
}

/// Where a configuration puts each stage: its device and its rank, and this process's rank.
struct Placement {
    devices: Vec<i32>,
    ranks: Vec<usize>,
    rank: usize,
    /// The names the settings' errors give them (the builder call or the variable).
    names: SettingNames,
}

impl Placement {
    fn of(config: &PpConfig, primary: i32) -> Placement {
        Placement {
            devices: config.stage_devices(primary),
            ranks: config.ranks(),
            rank: config.rank(),
            names: config.setting_names(),
        }
    }

    /// The devices of this rank's stages, each with its stage.
    fn owned_devices(&self) -> impl Iterator<Item = (usize, i32)> + '_ {
        self.devices.iter().enumerate().filter(|&(s, _)| self.ranks[s] == self.rank).map(|(s, &d)| (s, d))
    }

    /// One engine per device of this rank's stages (`primary` for its own device), once every
    /// such device was found present ([`ConfigError`] naming the first that is not).
    fn open_engines(&self, primary: &Engine) -> Result<BTreeMap<i32, Engine>> {
        let count = Device::count()?;
        if let Some((_, bad)) = self.owned_devices().find(|&(_, d)| d >= count) {
            return Err(ConfigError {
                setting: self.names.devices,
                value: self.devices.iter().map(ToString::to_string).collect::<Vec<_>>().join(","),
                reason: format!("device ordinal {bad} is not present: {count} device(s) found"),
            }
            .into());
        }
        let mut engines = BTreeMap::new();
        for (_, ordinal) in self.owned_devices() {
            if let std::collections::btree_map::Entry::Vacant(entry) = engines.entry(ordinal) {
                entry.insert(if ordinal == primary.ordinal() { primary.clone() } else { Engine::new(ordinal)? });
            }
        }
        Ok(engines)
    }

    /// The boundary plan from the peer-access matrix of this rank's devices; peer access is
    /// enabled where the plan uses it.
    fn plan(&self, config: &PpConfig, engines: &BTreeMap<i32, Engine>) -> Result<Plan> {
        let mut access = BTreeMap::new();
        for (&a, ea) in engines {
            for (&b, eb) in engines {
                access.insert((a, b), a != b && ea.device().peer_info(eb.device())?.access_supported);
            }
        }
        let plan = Plan::choose_named(
            &self.devices,
            &self.ranks,
            self.rank,
            config.transport(),
            |a, b| access.get(&(a, b)).copied().unwrap_or(false),
            self.names,
        )?;
        for b in plan.boundaries.iter().filter(|b| b.transport == Transport::Peer && b.tx_rank == self.rank) {
            enable_peer_access(engines[&b.tx_device].context(), engines[&b.rx_device].context())?;
        }
        Ok(plan)
    }

    /// What this rank tells the others at the rendezvous: its host, its user, and every device
    /// this process sees (not only its stages': another rank's device may be one of them, or
    /// reachable from one of them), each with its UUID and the devices it has peer access to.
    fn identity(&self) -> Result<RankIdentity> {
        let all = Device::all()?;
        let mut devices = Vec::with_capacity(all.len());
        for device in &all {
            let mut peer_access = Vec::new();
            for other in all.iter().filter(|other| other.ordinal() != device.ordinal()) {
                if device.peer_info(other)?.access_supported {
                    peer_access.push(other.ordinal());
                }
            }
            devices.push(DeviceIdentity { ordinal: device.ordinal(), uuid: device.uuid()?, peer_access });
        }
        Ok(RankIdentity::of_this_process(devices))
    }

    /// Every stage: its engine and its stream (`given[s]`, else one of its own) for this rank's,
    /// `None` for another rank's.
    fn stages(&self, engines: &BTreeMap<i32, Engine>, given: &[Option<Arc<CudaStream>>]) -> Result<Vec<Option<Stage>>> {
        (0..self.devices.len())
            .map(|s| {
                let given = given.get(s).cloned().flatten();
                if self.ranks[s] != self.rank {
                    if given.is_some() {
                        return Err(Error::Pipeline(crate::pp::PpError::StageNotOwned {
                            stage: s,
                            owner: self.ranks[s],
                            rank: self.rank,
                        }));
                    }
                    return Ok(None);
                }
                let engine = engines[&self.devices[s]].clone();
                let stream = match given {
                    Some(stream) if stream.ordinal() != engine.ordinal() => {
                        return Err(CudaError::WrongDevice {
                            what: "PpNRt::with_stage_streams: a stage's stream must be on the stage's device",
                            expected: engine.ordinal(),
                            found: stream.ordinal(),
                        }
                        .into());
                    }
                    Some(stream) if stream.context().raw() != engine.context().raw() => {
                        return Err(CudaError::WrongContext {
                            what: "PpNRt::with_stage_streams: a stage's stream must be of the stage engine's context",
                            device: engine.ordinal(),
                        }
                        .into());
                    }
                    Some(stream) => stream,
                    None => CudaStream::new(engine.context())?,
                };
                Ok(Some(Stage { engine, stream }))
            })
            .collect()
    }
}

/// This rank's end of boundary `bp`: a slot ring when its RX stage runs here (filled by a
/// receiver thread, whose link goes into `inbound_links`, when its TX stage runs in another
/// rank), the sender when only its TX stage does, else nothing.
fn boundary_end(
    config: &PpConfig,
    bp: BoundaryPlan,
    stages: &[Option<Stage>],
    links: Option<&mut Links>,
    inbound_links: &mut Vec<(usize, Inbound)>,
) -> Result<BoundaryEnd> {
    let (tx, rx) = (&stages[bp.boundary], &stages[bp.boundary + 1]);
    let mut exported_slots = None;
    let (tx_stream, rx, inbound) = match (tx, rx) {
        (Some(tx), Some(rx)) => (Arc::clone(&tx.stream), rx, None),
        (None, Some(rx)) => {
            let mut inbound = links
                .and_then(|links| links.inbound.remove(&bp.boundary))
                .expect("connect() links every boundary this rank receives");
            let stream = Arc::clone(&inbound.recv_stream);
            let link = Arc::clone(&inbound.link);
            exported_slots = inbound.exported_slots.take();
            inbound_links.push((bp.boundary, inbound));
            (stream, rx, Some(link))
        }
        (Some(_), None) => {
            let sender = links
                .and_then(|links| links.senders.get(&bp.boundary))
                .expect("connect() links every boundary this rank sends");
            return Ok(BoundaryEnd::Send(Arc::clone(sender)));
        }
        (None, None) => return Ok(BoundaryEnd::Foreign),
    };
    let home = SlotHome { transport: bp.transport, tx_stream: &tx_stream, rx_stream: &rx.stream };
    let ring = match exported_slots {
        // The slots the sending rank maps: fixed for the ring's life.
        Some(slots) => SlotRing::with_fixed_buffers(slots),
        None => SlotRing::new(config.slots(), config.reserve_bytes(), inbound.is_some(), home)?,
    };
    if let Some(link) = &inbound {
        // A sending rank that waits for a free slot (`tx_wait`) learns when this stage takes one.
        // (The link holds nothing of the ring: a strong reference makes no cycle, and a take
        // costs one flag's load while nobody waits.)
        let link = Arc::clone(link);
        ring.on_taken(Arc::new(move |taken| link.answer_credit(taken, false)));
    }
    let sm_copies = bp.transport != Transport::HostStaged
        && config.sm_copies()
        && rx.engine.helper_kernels_if_runnable()?.is_some();
    Ok(BoundaryEnd::Ring(Arc::new(Boundary {
        plan: bp,
        tx_stream,
        rx_stream: Arc::clone(&rx.stream),
        rx_engine: rx.engine.clone(),
        sm_copies,
        ring,
        inbound,
    })))
}

/// Starts the receiver thread of each boundary from another rank (filling its ring) and the
/// watchdog of this rank's links (signs of life both ways).
fn start_link_threads(
    boundaries: &[BoundaryEnd],
    inbound_links: Vec<(usize, Inbound)>,
) -> Result<(Vec<Receiver>, Option<Watchdog>)> {
    let mut receivers = Vec::with_capacity(inbound_links.len());
    let mut heartbeats = Vec::with_capacity(inbound_links.len());
    for (b, inbound) in inbound_links {
        let BoundaryEnd::Ring(ring) = &boundaries[b] else { unreachable!("an inbound boundary has a ring") };
        heartbeats.push(inbound.heartbeat()?);
        receivers.push(Receiver::start(inbound, Arc::clone(ring) as Arc<dyn SlotFiller>)?);
    }
    let senders =
        boundaries.iter().filter_map(|end| if let BoundaryEnd::Send(s) = end { Some(Arc::clone(s)) } else { None });
    Ok((receivers, Watchdog::start(senders.collect(), heartbeats)?))
}

impl Drop for PpNRt {
    fn drop(&mut self) {
        // Slot buffers are written by TX streams of other devices: drain every stream before the
        // fields (and the buffers) go, each one even when another failed.
        // A boundary to another rank first closes cleanly (the receiving rank confirms that it
        // received every step), or is aborted: no NCCL send of it may stay queued.
        for end in &self.boundaries {
            if let BoundaryEnd::Send(sender) = end {
                sender.close(self.config.peer_timeout());
            }
        }
        // The receivers stop before the watchdog: a receiver stopping with a receive pending
        // drains it (at most the peer timeout), and meanwhile the watchdog goes on showing the
        // peers signs of life; a rank that drained in silence would look hung to a peer that is
        // merely slow, which would fail the boundary and abort the very send the drain waits for.
        // Each is asked first, so that their drains run at once: the drop waits one peer timeout
        // at most, not one per inbound boundary.
        for receiver in &self.receivers {
            receiver.ask_to_stop();
        }
        for receiver in &mut self.receivers {
            receiver.stop();
        }
        self.watchdog = None;
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

fn describe_env() -> String {
    let core = [STAGES_VAR, DEVICES_VAR, SLOTS_VAR, TRANSPORT_VAR].iter().map(|name| match std::env::var_os(name) {
        Some(value) => format!("{name}={:?}", value.to_string_lossy()),
        None => format!("{name} unset"),
    });
    // The settings of a pipeline across processes, where set.
    let processes = [RANKS_VAR, RANK_VAR, RENDEZVOUS_VAR, PEER_TIMEOUT_VAR, PROCESS_TRANSPORT_VAR, RESERVE_BYTES_VAR]
        .iter()
        .filter_map(|name| std::env::var_os(name).map(|value| format!("{name}={:?}", value.to_string_lossy())));
    core.chain(processes).collect::<Vec<_>>().join(" ")
}
