//! The builder calls of [`PpConfig`]: the constructors and the `with_*` setters, each taking and
//! returning the configuration; and the getters' former names, kept one release as deprecated
//! aliases.
//!
//! A value set here is the code's: an error about it names the call (`PpConfig::with_slots`),
//! not a variable.

use std::time::Duration;

use super::{PpConfig, Sources};
use crate::auth::JobAccess;
use crate::pp::fault::Fault;
use crate::pp::plan::TransportPolicy;
use crate::pp::process_transport::ProcessTransport;

impl Sources {
    /// Every setting set in code: errors name the builder calls.
    pub(super) const CODE: Sources = Sources {
        stages: "PpConfig::new",
        devices: "PpConfig::with_devices",
        slots: "PpConfig::with_slots",
        ranks: "PpConfig::with_ranks",
        transport: "PpConfig::with_transport",
        process_transport: "PpConfig::with_process_transport",
        rank: "PpConfig::with_rank",
        rendezvous: "PpConfig::with_rendezvous",
        peer_timeout: "PpConfig::with_peer_timeout",
    };
}

impl PpConfig {
    /// `n_stages` stages, all on the primary engine's device, 2 slots, `auto` transport.
    pub fn new(n_stages: usize) -> PpConfig {
        PpConfig { n_stages, ..PpConfig::default() }
    }

    /// One stage per entry of `devices`, on that device.
    pub fn with_devices(devices: &[i32]) -> PpConfig {
        let sources = Sources { stages: Sources::CODE.devices, ..Sources::CODE };
        PpConfig { n_stages: devices.len(), devices: Some(devices.to_vec()), sources, ..PpConfig::default() }
    }

    /// Sets the slots per boundary (`PPNRT_SLOTS`).
    pub fn with_slots(mut self, slots: usize) -> PpConfig {
        self.slots = slots;
        self.sources.slots = Sources::CODE.slots;
        self
    }

    /// Sets the transport policy (`PPNRT_TRANSPORT`).
    pub fn with_transport(mut self, transport: TransportPolicy) -> PpConfig {
        self.transport = transport;
        self.sources.transport = Sources::CODE.transport;
        self
    }

    /// Sets the transport of boundaries between ranks (`PPNRT_PROCESS_TRANSPORT`): `Auto` (IPC
    /// where the two ranks share a host and reach each other's devices, else NCCL), `Ipc` (a
    /// configuration error, naming the boundary, where it cannot work) or `Nccl`. An IPC boundary's
    /// slots do not grow: size them with [`with_reserve_bytes`](Self::with_reserve_bytes). Every rank must set the same (the rendezvous compares it).
    pub fn with_process_transport(mut self, transport: ProcessTransport) -> PpConfig {
        self.process_transport = transport;
        self.sources.process_transport = Sources::CODE.process_transport;
        self
    }

    /// Pre-allocates every slot for `bytes` at build, so the first steps do not allocate.
    pub fn with_reserve_bytes(mut self, bytes: usize) -> PpConfig {
        self.reserve_bytes = bytes;
        self
    }

    /// Whether copies within a device (the `tx` of a `Local` boundary, every `rx` from a device
    /// slot) may run as the SM copy kernel up to [`SM_COPY_MAX_BYTES`](crate::SM_COPY_MAX_BYTES)
    /// (default: yes; it costs the host less than the copy engine). `false` keeps every boundary
    /// copy on the copy engines, leaving the SMs to the model alone, but one: over IPC, the sending
    /// rank's copy of a step that waits on the device for its slot runs on the SMs whatever this
    /// says (the copy a failure cancels, see [`ProcessTransport::Ipc`]).
    pub fn with_sm_copies(mut self, allowed: bool) -> PpConfig {
        self.sm_copies = allowed;
        self
    }

    /// Whether a boundary from another rank may receive through CUDA graphs (default: yes). Once
    /// a boundary has received the same byte count twice in a row, the receiver thread captures
    /// NCCL's receive into each slot for that count once and from then on launches the capture
    /// (one `cuGraphLaunch`, a few µs of host time less per step than NCCL's receive call, on the
    /// hop's critical path). Each slot keeps captures for at most two counts; other counts use
    /// NCCL's call. Off whatever this says with an NCCL older than
    /// [`GRAPH_MIXING_VERSION`](crate::nccl::GRAPH_MIXING_VERSION) or with
    /// `NCCL_GRAPH_MIXING_SUPPORT=0` in the environment (NCCL then does not guarantee a call made
    /// while a graph launch is outstanding). `false` always uses NCCL's call.
    pub fn with_nccl_recv_graphs(mut self, allowed: bool) -> PpConfig {
        self.nccl_recv_graphs = allowed;
        self
    }

    /// Spreads the stages over processes: `ranks[s]` is the rank of the process that runs stage
    /// `s` (see [`PpConfig`]'s `PPNRT_RANKS`). Ranks are `0..world`, each owning a stage.
    pub fn with_ranks(mut self, ranks: &[usize]) -> PpConfig {
        self.ranks = Some(ranks.to_vec());
        self.sources.ranks = Sources::CODE.ranks;
        self
    }

    /// Sets this process's rank (`PPNRT_RANK`).
    pub fn with_rank(mut self, rank: usize) -> PpConfig {
        self.rank = rank;
        self.sources.rank = Sources::CODE.rank;
        self
    }

    /// Sets rank 0's rendezvous address, `host:port` (`PPNRT_RENDEZVOUS`).
    pub fn with_rendezvous(mut self, addr: &str) -> PpConfig {
        self.rendezvous = Some(addr.to_string());
        self.sources.rendezvous = Sources::CODE.rendezvous;
        self
    }

    /// Sets the bound on every wait for another process, and on its silence
    /// (`PPNRT_PEER_TIMEOUT_MS`).
    pub fn with_peer_timeout(mut self, timeout: Duration) -> PpConfig {
        self.peer_timeout = timeout;
        self.sources.peer_timeout = Sources::CODE.peer_timeout;
        self
    }

    /// Sets how the ranks recognise each other (`PPNRT_JOB_SECRET`, `PPNRT_JOB_SECRET_FILE`,
    /// `PPNRT_ALLOW_UNAUTHENTICATED`; see [`JobAccess`] and `SECURITY.md`). Default:
    /// [`JobAccess::SameHost`], every rank on this host.
    pub fn with_job_access(mut self, access: JobAccess) -> PpConfig {
        self.access = access;
        self
    }

    /// Breaks the protocol on purpose (hazard tests only; `testing` feature).
    #[cfg(feature = "testing")]
    pub fn with_fault(mut self, fault: crate::pp::fault::ProtocolFault) -> PpConfig {
        self.fault = Fault::new(fault);
        self
    }

    /// Sets the fault seam's value (the part of a fault every rank shares, for the fingerprint).
    pub(in crate::pp) fn with_faults(mut self, fault: Fault) -> PpConfig {
        self.fault = fault;
        self
    }

    /// Renamed to [`with_fault`](Self::with_fault).
    #[cfg(feature = "testing")]
    #[deprecated(note = "renamed to `with_fault`")]
    pub fn inject_fault(self, fault: crate::pp::fault::ProtocolFault) -> PpConfig {
        self.with_fault(fault)
    }

    /// Renamed to [`slots`](Self::slots).
    #[deprecated(note = "renamed to `slots`")]
    pub fn n_slots(&self) -> usize {
        self.slots()
    }

    /// Renamed to [`transport`](Self::transport).
    #[deprecated(note = "renamed to `transport`")]
    pub fn transport_policy(&self) -> TransportPolicy {
        self.transport()
    }

    /// Renamed to [`reserve_bytes`](Self::reserve_bytes).
    #[deprecated(note = "renamed to `reserve_bytes`")]
    pub fn reserved_bytes(&self) -> usize {
        self.reserve_bytes()
    }

    /// Renamed to [`sm_copies`](Self::sm_copies).
    #[deprecated(note = "renamed to `sm_copies`")]
    pub fn sm_copies_allowed(&self) -> bool {
        self.sm_copies()
    }

    /// Renamed to [`nccl_recv_graphs`](Self::nccl_recv_graphs).
    #[deprecated(note = "renamed to `nccl_recv_graphs`")]
    pub fn nccl_recv_graphs_allowed(&self) -> bool {
        self.nccl_recv_graphs()
    }

    /// Renamed to [`ranks`](Self::ranks).
    #[deprecated(note = "renamed to `ranks`")]
    pub fn stage_ranks(&self) -> Vec<usize> {
        self.ranks()
    }

    /// Renamed to [`rank`](Self::rank).
    #[deprecated(note = "renamed to `rank`")]
    pub fn own_rank(&self) -> usize {
        self.rank()
    }

    /// Renamed to [`rendezvous`](Self::rendezvous).
    #[deprecated(note = "renamed to `rendezvous`")]
    pub fn rendezvous_addr(&self) -> Option<&str> {
        self.rendezvous()
    }

    /// Renamed to [`peer_timeout`](Self::peer_timeout).
    #[deprecated(note = "renamed to `peer_timeout`")]
    pub fn peer_timeout_value(&self) -> std::time::Duration {
        self.peer_timeout()
    }

    /// Renamed to [`job_access`](Self::job_access).
    #[deprecated(note = "renamed to `job_access`")]
    pub fn job_access_value(&self) -> &JobAccess {
        self.job_access()
    }
}
