//! Pipeline configuration: stage count, stage→device map, slots per boundary, transport policy.
//!
//! See [`PpConfig`] for the settings and the variables that carry them. Plain data and parsing,
//! which the runtime ([`PpNRt`](crate::PpNRt)) is built from; nothing below `pp` reads it.
//! Published as `ppnrt::pp::*`.

use std::fmt;
use std::time::Duration;

use crate::auth::JobAccess;
use crate::error::ConfigError;

/// Variable holding the stage count.
pub const STAGES_VAR: &str = "PPNRT_STAGES";
/// Variable holding the stage→device map.
pub const DEVICES_VAR: &str = "PPNRT_DEVICES";
/// Variable holding the slot count.
pub const SLOTS_VAR: &str = "PPNRT_SLOTS";
/// Variable holding the transport policy.
pub const TRANSPORT_VAR: &str = "PPNRT_TRANSPORT";
/// Variable holding the stage→process map of a pipeline that spans processes (`0,0,1,1`).
pub const RANKS_VAR: &str = "PPNRT_RANKS";
/// Variable holding this process's rank.
pub const RANK_VAR: &str = "PPNRT_RANK";
pub use crate::rendezvous::RENDEZVOUS_VAR;
/// Variable holding the bound, in milliseconds, on waits for another process (the rendezvous, a
/// receive from a peer that has not sent yet, a clean shutdown's handshake).
pub const PEER_TIMEOUT_VAR: &str = "PPNRT_PEER_TIMEOUT_MS";

/// The default of [`PEER_TIMEOUT_VAR`].
pub const DEFAULT_PEER_TIMEOUT: Duration = Duration::from_secs(60);

/// The shortest peer timeout: every rank shows its peers a sign of life ten times per timeout,
/// and at most every 10 ms, so a shorter timeout would fail healthy peers.
pub const MIN_PEER_TIMEOUT: Duration = Duration::from_millis(100);

/// The longest peer timeout (a day): every deadline the runtime computes from it stays far
/// from the clock's range, and a peer that is gone is still noticed.
pub const MAX_PEER_TIMEOUT: Duration = Duration::from_secs(24 * 60 * 60);

/// The most stages a pipeline may have (a sanity bound against typos such as `PPNRT_STAGES=1000`).
pub const MAX_STAGES: usize = 256;
// Every stage may have a rank of its own: the rendezvous gathers that many.
static_assertions::const_assert!(MAX_STAGES <= crate::rendezvous::MAX_WORLD);
/// The most slots a ring may have.
pub const MAX_SLOTS: usize = 64;

/// How boundaries between devices move data.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum TransportPolicy {
    /// `Local` on one device; `Peer` between devices with peer access both ways; else `HostStaged`.
    #[default]
    Auto,
    /// Like `Auto`, but a cross-device boundary without peer access is a build error.
    Peer,
    /// Every boundary, local ones too, through pinned host memory (tests the fallback anywhere).
    Staged,
}

impl TransportPolicy {
    fn parse(text: &str) -> Result<TransportPolicy, ConfigError> {
        match text.trim().to_ascii_lowercase().as_str() {
            "auto" | "" => Ok(TransportPolicy::Auto),
            "peer" => Ok(TransportPolicy::Peer),
            "staged" | "host" | "host_staged" | "hoststaged" => Ok(TransportPolicy::Staged),
            _ => Err(ConfigError {
                setting: TRANSPORT_VAR,
                value: text.to_string(),
                reason: "unknown transport: expected auto, peer or staged".into(),
            }),
        }
    }
}

impl fmt::Display for TransportPolicy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            TransportPolicy::Auto => "auto",
            TransportPolicy::Peer => "peer",
            TransportPolicy::Staged => "staged",
        })
    }
}

/// A deliberate protocol break, for tests that must show the hazard checks catch real races
/// (`testing` feature).
#[cfg(feature = "testing")]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum ProtocolFault {
    /// The protocol as specified.
    #[default]
    None,
    /// `tx` does not wait for the slot's previous `rx` (write-after-read hazard).
    SkipRxWait,
    /// `rx` does not wait for the slot's `tx` (read-before-write hazard).
    SkipTxWait,
    /// A boundary to another process is not failed when its peer stays silent for longer than
    /// the peer timeout (the liveness check off).
    IgnoreSilence,
    /// This rank exits (status 86) after the rendezvous, right before it joins its first NCCL
    /// communicator: a peer that dies during the others' setup.
    ExitBeforeCommJoin,
    /// The setup joins NCCL communicators blocking and waits for each link's first message with
    /// no bound (a peer that dies meanwhile hangs it): the bounded setup off.
    UnwatchedSetup,
    /// A `tx` to another rank writes its step's record but never sends the step's data: a peer
    /// that announces a step and dies before its send ran.
    AnnounceWithoutSend,
    /// A link that fails does not fail this rank's other links: what this rank forwards after a
    /// receive the failure cut short goes on downstream as if it were whole.
    ContainedFailure,
    /// A `tx` to another rank alters its record of this step after sealing it (a record forged
    /// or corrupted in flight).
    ForgeRecordAt(u64),
    /// A `tx` to another rank writes its record of this step twice (a record replayed).
    ReplayRecordAt(u64),
    /// A `tx` to another rank writes half of its record of this step and then ends the
    /// connection (a record cut short by a dying peer).
    TruncateRecordAt(u64),
    /// This rank's links take this many milliseconds to fail once a failure is seen (a busy
    /// machine's threads that read a shut connection or a silent peer late): meanwhile its calls
    /// and readbacks find the links up.
    SlowToFail(u64),
}

/// A pipeline configuration: stage count, stage→device map, slots per boundary, transport
/// policy. Built with the builder methods, or read from the environment by
/// [`PpConfig::from_env`]:
///
/// | variable | meaning | default |
/// | --- | --- | --- |
/// | `PPNRT_STAGES` | number of stages, ≥ 1 | the length of `PPNRT_DEVICES`, else 1 |
/// | `PPNRT_DEVICES` | comma-separated device ordinal per stage (`0,0,1,1`) | every stage on the primary engine's device |
/// | `PPNRT_SLOTS` | slots in each boundary's ring, ≥ 1 | 2 |
/// | `PPNRT_TRANSPORT` | `auto`, `peer` (fail where peers cannot reach each other) or `staged` (every boundary through pinned host memory) | `auto` |
/// | `PPNRT_RANKS` | comma-separated process rank per stage (`0,0,1,1`): a pipeline that spans processes or hosts | every stage in this process |
/// | `PPNRT_RANK` | this process's rank | 0 |
/// | `PPNRT_RENDEZVOUS` | rank 0's address, `host:port` (rank 0 listens there) | required with two or more ranks |
/// | `PPNRT_PEER_TIMEOUT_MS` | bound on every wait for another process, and on its silence (a peer that shows no sign of life for longer fails its boundaries) | 60000 |
/// | `PPNRT_JOB_SECRET` / `PPNRT_JOB_SECRET_FILE` | the secret every rank of the job proves (see [`JobAccess`], `SECURITY.md`); required across hosts; empty is an error; the file regular, ≤ 4,096 bytes, mode 600 | none: every rank on this host |
/// | `PPNRT_ALLOW_UNAUTHENTICATED` | `1`: ranks without a secret meet across hosts, unauthenticated | `0` |
///
/// Every process of a pipeline that spans processes runs the same configuration (compared at the
/// rendezvous) except `PPNRT_RANK`; `PPNRT_DEVICES` names, for each stage, a device of the host
/// that runs the stage's rank.
///
/// Validation that needs no GPU happens in the builder methods and in
/// [`validate`](Self::validate); device ordinals are checked against the devices present when the
/// runtime is built.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PpConfig {
    devices: Option<Vec<i32>>,
    n_stages: usize,
    slots: usize,
    transport: TransportPolicy,
    #[cfg(feature = "testing")]
    fault: ProtocolFault,
    reserve_bytes: usize,
    sm_copies: bool,
    nccl_recv_graphs: bool,
    ranks: Option<Vec<usize>>,
    rank: usize,
    rendezvous: Option<String>,
    peer_timeout: Duration,
    access: JobAccess,
}

impl Default for PpConfig {
    fn default() -> PpConfig {
        PpConfig {
            devices: None,
            n_stages: 1,
            slots: 2,
            transport: TransportPolicy::Auto,
            #[cfg(feature = "testing")]
            fault: ProtocolFault::None,
            reserve_bytes: 0,
            sm_copies: true,
            nccl_recv_graphs: true,
            ranks: None,
            rank: 0,
            rendezvous: None,
            peer_timeout: DEFAULT_PEER_TIMEOUT,
            access: JobAccess::SameHost,
        }
    }
}

impl PpConfig {
    /// `n_stages` stages, all on the primary engine's device, 2 slots, `auto` transport.
    pub fn new(n_stages: usize) -> PpConfig {
        PpConfig { n_stages, ..PpConfig::default() }
    }

    /// One stage per entry of `devices`, on that device.
    pub fn with_devices(devices: &[i32]) -> PpConfig {
        PpConfig { n_stages: devices.len(), devices: Some(devices.to_vec()), ..PpConfig::default() }
    }

    /// Sets the slots per boundary.
    pub fn slots(mut self, slots: usize) -> PpConfig {
        self.slots = slots;
        self
    }

    /// Sets the transport policy.
    pub fn transport(mut self, transport: TransportPolicy) -> PpConfig {
        self.transport = transport;
        self
    }

    /// Pre-allocates every slot for `bytes` at build, so the first steps do not allocate.
    pub fn reserve_bytes(mut self, bytes: usize) -> PpConfig {
        self.reserve_bytes = bytes;
        self
    }

    /// Whether copies within a device (the `tx` of a `Local` boundary, every `rx` from a device
    /// slot) may run as the SM copy kernel up to [`SM_COPY_MAX_BYTES`](crate::SM_COPY_MAX_BYTES)
    /// (default: yes; it costs the host less than the copy engine). `false` keeps every boundary
    /// copy on the copy engines, leaving the SMs to the model alone.
    pub fn sm_copies(mut self, allowed: bool) -> PpConfig {
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
    pub fn nccl_recv_graphs(mut self, allowed: bool) -> PpConfig {
        self.nccl_recv_graphs = allowed;
        self
    }

    /// Spreads the stages over processes: `ranks[s]` is the rank of the process that runs stage
    /// `s` (see [`PpConfig`]'s `PPNRT_RANKS`). Ranks are `0..world`, each owning a stage.
    pub fn ranks(mut self, ranks: &[usize]) -> PpConfig {
        self.ranks = Some(ranks.to_vec());
        self
    }

    /// Sets this process's rank (`PPNRT_RANK`).
    pub fn rank(mut self, rank: usize) -> PpConfig {
        self.rank = rank;
        self
    }

    /// Sets rank 0's rendezvous address, `host:port` (`PPNRT_RENDEZVOUS`).
    pub fn rendezvous(mut self, addr: &str) -> PpConfig {
        self.rendezvous = Some(addr.to_string());
        self
    }

    /// Sets the bound on every wait for another process, and on its silence
    /// (`PPNRT_PEER_TIMEOUT_MS`).
    pub fn peer_timeout(mut self, timeout: Duration) -> PpConfig {
        self.peer_timeout = timeout;
        self
    }

    /// Sets how the ranks recognise each other (`PPNRT_JOB_SECRET`, `PPNRT_JOB_SECRET_FILE`,
    /// `PPNRT_ALLOW_UNAUTHENTICATED`; see [`JobAccess`] and `SECURITY.md`). Default:
    /// [`JobAccess::SameHost`], every rank on this host.
    pub fn job_access(mut self, access: JobAccess) -> PpConfig {
        self.access = access;
        self
    }

    /// Breaks the protocol on purpose (hazard tests only; `testing` feature).
    #[cfg(feature = "testing")]
    pub fn inject_fault(mut self, fault: ProtocolFault) -> PpConfig {
        self.fault = fault;
        self
    }

    /// Number of stages.
    pub fn n_stages(&self) -> usize {
        self.n_stages
    }

    /// Slots per boundary.
    pub fn n_slots(&self) -> usize {
        self.slots
    }

    /// The transport policy.
    pub fn transport_policy(&self) -> TransportPolicy {
        self.transport
    }

    /// The injected fault, if any.
    #[cfg(feature = "testing")]
    pub fn fault(&self) -> ProtocolFault {
        self.fault
    }

    /// Bytes reserved per slot at build.
    pub fn reserved_bytes(&self) -> usize {
        self.reserve_bytes
    }

    /// Whether copies within a device may use the SM copy kernel (see [`sm_copies`](Self::sm_copies)).
    pub fn sm_copies_allowed(&self) -> bool {
        self.sm_copies
    }

    /// Whether boundaries from other ranks may receive through CUDA graphs (see
    /// [`nccl_recv_graphs`](Self::nccl_recv_graphs)).
    pub fn nccl_recv_graphs_allowed(&self) -> bool {
        self.nccl_recv_graphs
    }

    /// The stage→rank map: every stage in rank 0 unless [`ranks`](Self::ranks) was set.
    pub fn stage_ranks(&self) -> Vec<usize> {
        self.ranks.clone().unwrap_or_else(|| vec![0; self.n_stages])
    }

    /// This process's rank.
    pub fn own_rank(&self) -> usize {
        self.rank
    }

    /// The number of processes the pipeline spans (1 without [`ranks`](Self::ranks)).
    pub fn world(&self) -> usize {
        self.ranks.as_ref().and_then(|r| r.iter().max()).map_or(1, |max| max + 1)
    }

    /// Rank 0's rendezvous address, if set.
    pub fn rendezvous_addr(&self) -> Option<&str> {
        self.rendezvous.as_deref()
    }

    /// The bound on every wait for another process.
    pub fn peer_timeout_value(&self) -> Duration {
        self.peer_timeout
    }

    /// How the ranks recognise each other (see [`job_access`](Self::job_access)).
    pub fn job_access_value(&self) -> &JobAccess {
        &self.access
    }

    /// The configuration without this process's rank: every process of one pipeline has the same
    /// fingerprint (the rendezvous compares them). A fault of one rank's setup (`testing`) is
    /// that rank's alone and left out.
    pub fn fingerprint(&self) -> String {
        #[cfg(feature = "testing")]
        let fault = match self.fault {
            // Faults of one rank's own behaviour, which the others need not share.
            ProtocolFault::ExitBeforeCommJoin
            | ProtocolFault::UnwatchedSetup
            | ProtocolFault::AnnounceWithoutSend
            | ProtocolFault::ContainedFailure
            | ProtocolFault::ForgeRecordAt(_)
            | ProtocolFault::ReplayRecordAt(_)
            | ProtocolFault::TruncateRecordAt(_)
            | ProtocolFault::SlowToFail(_) => ProtocolFault::None,
            other => other,
        };
        PpConfig {
            rank: 0,
            #[cfg(feature = "testing")]
            fault,
            ..self.clone()
        }
        .to_string()
    }

    /// The stage→device map, with `primary` for stages not mapped explicitly.
    pub fn stage_devices(&self, primary: i32) -> Vec<i32> {
        match &self.devices {
            Some(devices) => devices.clone(),
            None => vec![primary; self.n_stages],
        }
    }

    /// Checks what can be checked without a GPU.
    ///
    /// # Errors
    /// A [`ConfigError`] naming the setting, the value and the reason.
    pub fn validate(&self) -> Result<(), ConfigError> {
        if self.n_stages == 0 || self.n_stages > MAX_STAGES {
            return Err(ConfigError {
                setting: STAGES_VAR,
                value: self.n_stages.to_string(),
                reason: format!("the stage count must be between 1 and {MAX_STAGES}"),
            });
        }
        if let Some(devices) = &self.devices {
            if devices.len() != self.n_stages {
                return Err(ConfigError {
                    setting: DEVICES_VAR,
                    value: join(devices),
                    reason: format!("{} device(s) listed for {} stage(s)", devices.len(), self.n_stages),
                });
            }
            if let Some(bad) = devices.iter().find(|&&d| d < 0) {
                return Err(ConfigError {
                    setting: DEVICES_VAR,
                    value: join(devices),
                    reason: format!("device ordinal {bad} is negative"),
                });
            }
        }
        if self.slots == 0 || self.slots > MAX_SLOTS {
            return Err(ConfigError {
                setting: SLOTS_VAR,
                value: self.slots.to_string(),
                reason: format!("the slot count must be between 1 and {MAX_SLOTS}"),
            });
        }
        self.validate_processes()
    }

    fn validate_processes(&self) -> Result<(), ConfigError> {
        let world = self.world();
        if let Some(ranks) = &self.ranks {
            let bad = |reason: String| ConfigError { setting: RANKS_VAR, value: join(ranks), reason };
            if ranks.len() != self.n_stages {
                return Err(bad(format!("{} rank(s) listed for {} stage(s)", ranks.len(), self.n_stages)));
            }
            if let Some(idle) = (0..world).find(|r| !ranks.contains(r)) {
                return Err(bad(format!("rank {idle} owns no stage (ranks must be 0..{world}, each owning a stage)")));
            }
        }
        if self.rank >= world {
            return Err(ConfigError {
                setting: RANK_VAR,
                value: self.rank.to_string(),
                reason: format!("the pipeline spans {world} rank(s) ({RANKS_VAR}), so the rank must be below {world}"),
            });
        }
        if world > 1 {
            match self.rendezvous.as_deref().map(str::trim) {
                None | Some("") => {
                    return Err(ConfigError {
                        setting: RENDEZVOUS_VAR,
                        value: String::new(),
                        reason: format!("a pipeline of {world} ranks needs rank 0's address, host:port"),
                    });
                }
                Some(addr) => check_rendezvous_address(addr)?,
            }
        }
        if !(MIN_PEER_TIMEOUT..=MAX_PEER_TIMEOUT).contains(&self.peer_timeout) {
            return Err(ConfigError {
                setting: PEER_TIMEOUT_VAR,
                value: format!("{} ms", self.peer_timeout.as_millis()),
                reason: format!(
                    "the peer timeout must be between {} ms and {} ms (signs of life go out ten times per \
                     timeout, at most every 10 ms)",
                    MIN_PEER_TIMEOUT.as_millis(),
                    MAX_PEER_TIMEOUT.as_millis()
                ),
            });
        }
        Ok(())
    }

    /// Reads the `PPNRT_*` variables (see [`PpConfig`]).
    ///
    /// # Errors
    /// A [`ConfigError`] for a malformed or inconsistent value.
    pub fn from_env() -> Result<PpConfig, ConfigError> {
        let read = |name: &'static str| -> Result<Option<String>, ConfigError> {
            match std::env::var(name) {
                Ok(value) => Ok(Some(value)),
                Err(std::env::VarError::NotPresent) => Ok(None),
                Err(std::env::VarError::NotUnicode(raw)) => Err(ConfigError {
                    setting: name,
                    value: raw.to_string_lossy().into_owned(),
                    reason: "not valid UTF-8".into(),
                }),
            }
        };
        PpConfig::parse(
            read(STAGES_VAR)?.as_deref(),
            read(DEVICES_VAR)?.as_deref(),
            read(SLOTS_VAR)?.as_deref(),
            read(TRANSPORT_VAR)?.as_deref(),
        )?
        .parse_processes(
            read(RANKS_VAR)?.as_deref(),
            read(RANK_VAR)?.as_deref(),
            read(RENDEZVOUS_VAR)?.as_deref(),
            read(PEER_TIMEOUT_VAR)?.as_deref(),
        )
        .and_then(|config| Ok(config.job_access(JobAccess::from_env()?)))
    }

    /// Adds the settings of a pipeline that spans processes, as [`from_env`](Self::from_env) reads
    /// them (`None` = unset): `PPNRT_RANKS`, `PPNRT_RANK`, `PPNRT_RENDEZVOUS`,
    /// `PPNRT_PEER_TIMEOUT_MS`.
    ///
    /// # Errors
    /// A [`ConfigError`] for a malformed or inconsistent value.
    pub fn parse_processes(
        mut self,
        ranks: Option<&str>,
        rank: Option<&str>,
        rendezvous: Option<&str>,
        peer_timeout_ms: Option<&str>,
    ) -> Result<PpConfig, ConfigError> {
        if let Some(text) = ranks {
            let bad = |reason: String| ConfigError { setting: RANKS_VAR, value: text.to_string(), reason };
            let parsed = text
                .split(',')
                .map(|item| {
                    item.trim().parse::<usize>().map_err(|e| bad(format!("`{}` is not a rank: {e}", item.trim())))
                })
                .collect::<Result<Vec<_>, _>>()?;
            if parsed.iter().any(|&r| r >= MAX_STAGES) {
                return Err(bad(format!("ranks must be below {MAX_STAGES}")));
            }
            self.ranks = Some(parsed);
        }
        if let Some(text) = rank {
            self.rank = parse_count(RANK_VAR, text)?;
        }
        if let Some(text) = rendezvous {
            self.rendezvous = Some(text.trim().to_string());
        }
        if let Some(text) = peer_timeout_ms {
            let ms = parse_count(PEER_TIMEOUT_VAR, text)?;
            self.peer_timeout = Duration::from_millis(ms as u64);
        }
        self.validate()?;
        Ok(self)
    }

    /// Parses the four settings as [`from_env`](Self::from_env) reads them (`None` = unset).
    ///
    /// # Errors
    /// A [`ConfigError`] for a malformed or inconsistent value.
    pub fn parse(
        stages: Option<&str>,
        devices: Option<&str>,
        slots: Option<&str>,
        transport: Option<&str>,
    ) -> Result<PpConfig, ConfigError> {
        let devices = devices.map(parse_devices).transpose()?;
        let n_stages = match stages {
            Some(text) => parse_count(STAGES_VAR, text)?,
            None => devices.as_ref().map_or(1, Vec::len),
        };
        let config = PpConfig {
            devices,
            n_stages,
            slots: slots.map(|t| parse_count(SLOTS_VAR, t)).transpose()?.unwrap_or(2),
            transport: transport.map(TransportPolicy::parse).transpose()?.unwrap_or_default(),
            #[cfg(feature = "testing")]
            fault: ProtocolFault::None,
            reserve_bytes: 0,
            sm_copies: true,
            nccl_recv_graphs: true,
            ranks: None,
            rank: 0,
            rendezvous: None,
            peer_timeout: DEFAULT_PEER_TIMEOUT,
            access: JobAccess::SameHost,
        };
        config.validate()?;
        Ok(config)
    }
}

/// Checks a rendezvous address's form, `host:port` (a name, an IPv4 address or a bracketed IPv6
/// one, and a port from 1 to 65535), without resolving it.
fn check_rendezvous_address(addr: &str) -> Result<(), ConfigError> {
    let bad = |reason: String| ConfigError { setting: RENDEZVOUS_VAR, value: addr.to_string(), reason };
    let Some((host, port)) = addr.rsplit_once(':') else {
        return Err(bad("not host:port (no port)".into()));
    };
    if host.is_empty() || host.chars().any(char::is_whitespace) {
        return Err(bad(format!("`{host}` is not a host name or address")));
    }
    if host.contains(':') && !(host.starts_with('[') && host.ends_with(']')) {
        return Err(bad("an IPv6 address is written in brackets, [addr]:port".into()));
    }
    match port.parse::<u16>() {
        Ok(0) => Err(bad("port 0 is no port to meet at".into())),
        Ok(_) => Ok(()),
        Err(e) => Err(bad(format!("`{port}` is not a port (1 to 65535): {e}"))),
    }
}

impl fmt::Display for PpConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{STAGES_VAR}={} ", self.n_stages)?;
        match &self.devices {
            Some(devices) => write!(f, "{DEVICES_VAR}={} ", join(devices))?,
            None => write!(f, "{DEVICES_VAR}=(primary) ")?,
        }
        write!(f, "{SLOTS_VAR}={} {TRANSPORT_VAR}={}", self.slots, self.transport)?;
        if !self.sm_copies {
            f.write_str(" sm_copies=off")?;
        }
        if !self.nccl_recv_graphs {
            f.write_str(" nccl_recv_graphs=off")?;
        }
        if let Some(ranks) = &self.ranks {
            write!(f, " {RANKS_VAR}={} {RANK_VAR}={}", join(ranks), self.rank)?;
            if let Some(addr) = &self.rendezvous {
                write!(f, " {RENDEZVOUS_VAR}={addr}")?;
            }
        }
        if self.peer_timeout != DEFAULT_PEER_TIMEOUT {
            write!(f, " {PEER_TIMEOUT_VAR}={}", self.peer_timeout.as_millis())?;
        }
        #[cfg(feature = "testing")]
        if self.fault != ProtocolFault::None {
            write!(f, " fault={:?}", self.fault)?;
        }
        Ok(())
    }
}

fn join<T: ToString>(items: &[T]) -> String {
    items.iter().map(ToString::to_string).collect::<Vec<_>>().join(",")
}

fn parse_count(setting: &'static str, text: &str) -> Result<usize, ConfigError> {
    text.trim().parse::<usize>().map_err(|e| ConfigError {
        setting,
        value: text.to_string(),
        reason: format!("not a whole number: {e}"),
    })
}

fn parse_devices(text: &str) -> Result<Vec<i32>, ConfigError> {
    let bad = |reason: String| ConfigError { setting: DEVICES_VAR, value: text.to_string(), reason };
    if text.trim().is_empty() {
        return Err(bad("empty device list".into()));
    }
    text.split(',')
        .map(|item| {
            let item = item.trim();
            item.parse::<i32>().map_err(|e| bad(format!("`{item}` is not a device ordinal: {e}")))
        })
        .collect::<Result<Vec<_>, _>>()
        .and_then(|devices| match devices.iter().find(|&&d| d < 0) {
            Some(d) => Err(bad(format!("device ordinal {d} is negative"))),
            None => Ok(devices),
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_are_one_stage_two_slots_auto() {
        let config = PpConfig::parse(None, None, None, None).unwrap();
        assert_eq!(config.n_stages(), 1);
        assert_eq!(config.n_slots(), 2);
        assert_eq!(config.transport_policy(), TransportPolicy::Auto);
        assert_eq!(config.stage_devices(3), vec![3]);
    }

    #[test]
    fn devices_imply_the_stage_count() {
        let config = PpConfig::parse(None, Some("0, 0,1,1"), Some("3"), Some("PEER")).unwrap();
        assert_eq!(config.n_stages(), 4);
        assert_eq!(config.stage_devices(7), vec![0, 0, 1, 1]);
        assert_eq!(config.n_slots(), 3);
        assert_eq!(config.transport_policy(), TransportPolicy::Peer);
        assert_eq!(config.to_string(), "PPNRT_STAGES=4 PPNRT_DEVICES=0,0,1,1 PPNRT_SLOTS=3 PPNRT_TRANSPORT=peer");
    }

    #[test]
    fn malformed_values_name_setting_value_and_reason() {
        type Case<'a> = (Option<&'a str>, Option<&'a str>, Option<&'a str>, Option<&'a str>, &'a str, &'a str);
        let cases: &[Case<'_>] = &[
            (Some("0"), None, None, None, STAGES_VAR, "0"),
            (Some("abc"), None, None, None, STAGES_VAR, "abc"),
            (Some("-1"), None, None, None, STAGES_VAR, "-1"),
            (Some("1000"), None, None, None, STAGES_VAR, "1000"),
            (Some("3"), Some("0,1"), None, None, DEVICES_VAR, "0,1"),
            (None, Some("0,x"), None, None, DEVICES_VAR, "0,x"),
            (None, Some("0,-2"), None, None, DEVICES_VAR, "0,-2"),
            (None, Some(""), None, None, DEVICES_VAR, ""),
            (None, None, Some("0"), None, SLOTS_VAR, "0"),
            (None, None, Some("two"), None, SLOTS_VAR, "two"),
            (None, None, None, Some("carrier-pigeon"), TRANSPORT_VAR, "carrier-pigeon"),
        ];
        for &(stages, devices, slots, transport, setting, value) in cases {
            let err = PpConfig::parse(stages, devices, slots, transport).unwrap_err();
            assert_eq!(err.setting, setting, "{err}");
            assert_eq!(err.value, value, "{err}");
            assert!(err.to_string().contains(setting), "{err}");
        }
    }

    #[test]
    fn process_settings_parse_and_validate() {
        let base = PpConfig::parse(None, Some("0,0,1,1"), None, None).unwrap();
        let config =
            base.clone().parse_processes(Some("0,0,1,1"), Some("1"), Some("10.0.0.1:29500"), Some("5000")).unwrap();
        assert_eq!(config.stage_ranks(), vec![0, 0, 1, 1]);
        assert_eq!((config.own_rank(), config.world()), (1, 2));
        assert_eq!(config.rendezvous_addr(), Some("10.0.0.1:29500"));
        assert_eq!(config.peer_timeout_value(), Duration::from_millis(5000));
        let rank0 = config.clone().rank(0);
        assert_eq!(rank0.fingerprint(), config.fingerprint(), "the fingerprint leaves the rank out");
        assert_ne!(rank0.to_string(), config.to_string());
        type Case<'a> = (Option<&'a str>, Option<&'a str>, Option<&'a str>, Option<&'a str>, &'a str);
        let cases: &[Case<'_>] = &[
            (Some("0,1"), None, Some("h:1"), None, RANKS_VAR),
            (Some("0,0,2,2"), None, Some("h:1"), None, RANKS_VAR),
            (Some("0,x,1,1"), None, Some("h:1"), None, RANKS_VAR),
            (Some("0,0,1,1"), Some("2"), Some("h:1"), None, RANK_VAR),
            (Some("0,0,1,1"), Some("-1"), Some("h:1"), None, RANK_VAR),
            (Some("0,0,1,1"), Some("1"), None, None, RENDEZVOUS_VAR),
            (Some("0,0,1,1"), Some("1"), Some(" "), None, RENDEZVOUS_VAR),
            (Some("0,0,1,1"), Some("1"), Some("h:1"), Some("0"), PEER_TIMEOUT_VAR),
            (Some("0,0,1,1"), Some("1"), Some("h:1"), Some("soon"), PEER_TIMEOUT_VAR),
            (None, Some("1"), None, None, RANK_VAR),
        ];
        for &(ranks, rank, addr, timeout, setting) in cases {
            let err = base.clone().parse_processes(ranks, rank, addr, timeout).unwrap_err();
            assert_eq!(err.setting, setting, "{err}");
        }
        // One rank needs no rendezvous.
        assert_eq!(base.parse_processes(Some("0,0,0,0"), None, None, None).unwrap().world(), 1);
    }

    /// Every rendezvous address and peer timeout is checked before a runtime is built: no
    /// malformed address reaches the rendezvous, and no timeout overflows a deadline (a
    /// `Duration::MAX` timeout used to panic in `PpNRt::new`) or fails healthy peers (signs of
    /// life go out at most every 10 ms).
    #[test]
    fn rendezvous_addresses_and_peer_timeouts_are_checked() {
        let two = PpConfig::with_devices(&[0, 0]).ranks(&[0, 1]).rank(1);
        for addr in ["garbage", "localhost:99999", "localhost:0", ":29500", "::1:29500", "host name:1", "h:", "h:-1"] {
            let err = two.clone().rendezvous(addr).validate().unwrap_err();
            assert_eq!((err.setting, err.value.as_str()), (RENDEZVOUS_VAR, addr), "{err}");
        }
        for addr in ["localhost:29500", "10.0.0.1:1", "[::1]:65535", "node-7.cluster:29500"] {
            assert!(two.clone().rendezvous(addr).validate().is_ok(), "{addr}");
        }
        let with = |timeout: Duration| two.clone().rendezvous("h:1").peer_timeout(timeout).validate();
        for timeout in [Duration::ZERO, Duration::from_millis(1), Duration::from_millis(99), Duration::MAX] {
            let err = with(timeout).unwrap_err();
            assert_eq!(err.setting, PEER_TIMEOUT_VAR, "{timeout:?}: {err}");
        }
        for timeout in [MIN_PEER_TIMEOUT, DEFAULT_PEER_TIMEOUT, MAX_PEER_TIMEOUT] {
            assert!(with(timeout).is_ok(), "{timeout:?}");
        }
        let base = PpConfig::parse(None, Some("0,0"), None, None).unwrap();
        for text in ["1", "99", "99999999999999"] {
            let err = base.clone().parse_processes(Some("0,1"), Some("1"), Some("h:1"), Some(text)).unwrap_err();
            assert_eq!(err.setting, PEER_TIMEOUT_VAR, "{text}: {err}");
        }
    }

    #[test]
    fn builder_validation_matches_parsing() {
        assert!(PpConfig::new(0).validate().is_err());
        assert!(PpConfig::new(4).slots(0).validate().is_err());
        assert!(PpConfig::with_devices(&[0, 1, 0, 1]).slots(4).validate().is_ok());
        assert!(PpConfig::with_devices(&[]).validate().is_err());
    }

    /// Property test: on any input (random bytes, near-valid lists, huge numbers, odd
    /// whitespace and signs) the parser returns a value or a `ConfigError` naming one of the four
    /// settings, never panics, and every configuration it accepts passes `validate`.
    #[test]
    fn the_parser_never_panics_and_accepts_only_valid_configs() {
        let mut state = 0x2545_f491_4f6c_dd1du64;
        let mut next = move || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state
        };
        let atoms = [
            "",
            " ",
            "0",
            "1",
            "2",
            "8",
            "-1",
            "+3",
            "256",
            "257",
            "65",
            "4294967296",
            "99999999999999999999",
            ",",
            ",,",
            "0,0",
            "0,1,0,1",
            " 1 , 0 ",
            "x",
            "auto",
            "PEER",
            "staged",
            "host",
            "\u{0}",
            "é",
            "0x10",
            "1e3",
            "NaN",
        ];
        let field = |next: &mut dyn FnMut() -> u64| -> Option<String> {
            match next() % 5 {
                0 => None,
                1 => Some(atoms[(next() % atoms.len() as u64) as usize].to_string()),
                2 => Some(
                    (0..next() % 6)
                        .map(|_| atoms[(next() % atoms.len() as u64) as usize])
                        .collect::<Vec<_>>()
                        .join(","),
                ),
                3 => Some((0..next() % 12).map(|_| char::from_u32((next() % 0x250) as u32).unwrap_or('?')).collect()),
                _ => Some(format!("{}", next() as i64 % 300)),
            }
        };
        let mut accepted = 0;
        for _ in 0..20_000 {
            let (a, b, c, d) = (field(&mut next), field(&mut next), field(&mut next), field(&mut next));
            match PpConfig::parse(a.as_deref(), b.as_deref(), c.as_deref(), d.as_deref()) {
                Ok(config) => {
                    accepted += 1;
                    assert!(config.validate().is_ok(), "{config}");
                    assert_eq!(config.stage_devices(0).len(), config.n_stages());
                    assert!((1..=MAX_SLOTS).contains(&config.n_slots()));
                }
                Err(e) => {
                    assert!([STAGES_VAR, DEVICES_VAR, SLOTS_VAR, TRANSPORT_VAR].contains(&e.setting), "{e}");
                    assert!(!e.reason.is_empty());
                }
            }
        }
        assert!(accepted > 100, "the generator should reach valid configurations too ({accepted})");
    }
}
