//! Pipeline configuration: the settings value and its getters, and the checks that need no GPU.
//!
//! See [`PpConfig`] for the settings and the variables that carry them. Plain data, which the
//! runtime ([`PpNRt`](crate::PpNRt)) is built from; nothing below `pp` reads it. The builder
//! calls live in `builder.rs`, the environment front end (`PPNRT_*`) in `env.rs`, the transport
//! policy with the plan ([`TransportPolicy`]). Published as `ppnrt::pp::*`.

use std::fmt;
use std::time::Duration;

use crate::auth::JobAccess;
use crate::error::ConfigError;
use crate::pp::fault::Fault;
use crate::pp::plan::{SettingNames, TransportPolicy};
use crate::pp::process_transport::ProcessTransport;

mod builder;
mod env;
#[cfg(test)]
mod tests;

pub use env::{
    DEVICES_VAR, PEER_TIMEOUT_VAR, PROCESS_TRANSPORT_VAR, RANK_VAR, RANKS_VAR, RENDEZVOUS_VAR, RESERVE_BYTES_VAR,
    SLOTS_VAR, STAGES_VAR, TRANSPORT_VAR,
};

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

/// A pipeline configuration: stage count, stage→device map, slots per boundary, transport
/// policy. Built with the builder calls ([`new`](Self::new), [`with_devices`](Self::with_devices),
/// then `with_*`), or read from the environment by [`PpConfig::from_env`]; each getter has its
/// setting's name ([`slots`](Self::slots) for [`with_slots`](Self::with_slots)):
///
/// | variable | meaning | default |
/// | --- | --- | --- |
/// | `PPNRT_STAGES` | number of stages, ≥ 1 | the length of `PPNRT_DEVICES`, else 1 |
/// | `PPNRT_DEVICES` | comma-separated device ordinal per stage (`0,0,1,1`) | every stage on the primary engine's device |
/// | `PPNRT_SLOTS` | slots in each boundary's ring, ≥ 1 | 2 |
/// | `PPNRT_TRANSPORT` | `auto`, `peer` (fail where peers cannot reach each other) or `staged` (every boundary through pinned host memory) | `auto` |
/// | `PPNRT_RANKS` | comma-separated process rank per stage (`0,0,1,1`): a pipeline that spans processes or hosts | every stage in this process |
/// | `PPNRT_RANK` | this process's rank | 0 |
/// | `PPNRT_PROCESS_TRANSPORT` | boundaries between ranks: `auto` (IPC where two ranks share a host and reach each other's devices, else NCCL), `ipc` (fail where it cannot work) or `nccl` | `auto` |
/// | `PPNRT_RESERVE_BYTES` | bytes reserved per slot at build; an IPC boundary's slots hold this much (rounded up to the allocation granularity) and do not grow | `0` |
/// | `PPNRT_RENDEZVOUS` | rank 0's address, `host:port` (rank 0 listens there) | required with two or more ranks |
/// | `PPNRT_PEER_TIMEOUT_MS` | bound on every wait for another process, and on its silence (a peer that shows no sign of life for longer fails its boundaries) | 60000 |
/// | `PPNRT_JOB_SECRET` / `PPNRT_JOB_SECRET_FILE` | the secret every rank of the job proves (see [`JobAccess`], `SECURITY.md`); required across hosts; empty is an error; the file regular, ≤ 4,096 bytes, mode 600 | none: every rank on this host |
/// | `PPNRT_ALLOW_UNAUTHENTICATED` | `1`: ranks without a secret meet across hosts, unauthenticated | `0` |
///
/// Every process of a pipeline that spans processes runs the same configuration (compared at the
/// rendezvous) except `PPNRT_RANK`; `PPNRT_DEVICES` names, for each stage, a device of the host
/// that runs the stage's rank.
///
/// Validation that needs no GPU happens in [`validate`](Self::validate) (and in the parsing of
/// the environment); device ordinals are checked against the devices present when the runtime
/// is built. A [`ConfigError`] about a value set in code names the builder call
/// (`PpConfig::with_slots`), one about a value read from the environment its variable
/// (`PPNRT_SLOTS`).
///
/// ```
/// use ppnrt::{PpConfig, TransportPolicy};
///
/// let config = PpConfig::with_devices(&[0, 1, 2, 3]).with_slots(4).with_transport(TransportPolicy::Peer);
/// assert_eq!(config.n_stages(), 4);
/// assert_eq!(config.slots(), 4);
/// assert_eq!(config.transport(), TransportPolicy::Peer);
/// config.validate()?;
/// assert!(PpConfig::new(0).validate().is_err()); // no stage
/// # Ok::<(), ppnrt::ConfigError>(())
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PpConfig {
    devices: Option<Vec<i32>>,
    n_stages: usize,
    slots: usize,
    transport: TransportPolicy,
    process_transport: ProcessTransport,
    fault: Fault,
    reserve_bytes: usize,
    sm_copies: bool,
    nccl_recv_graphs: bool,
    ranks: Option<Vec<usize>>,
    rank: usize,
    rendezvous: Option<String>,
    peer_timeout: Duration,
    access: JobAccess,
    sources: Sources,
}

/// Where each checked setting came from: the name a [`ConfigError`] about it gives (the builder
/// call for a value set in code, the `PPNRT_*` variable for one read from the environment).
#[derive(Debug, Clone, Copy)]
struct Sources {
    stages: &'static str,
    devices: &'static str,
    slots: &'static str,
    ranks: &'static str,
    transport: &'static str,
    process_transport: &'static str,
    rank: &'static str,
    rendezvous: &'static str,
    peer_timeout: &'static str,
}

/// Where a value came from is not part of the configuration: two configurations of the same
/// settings are equal however they were made.
impl PartialEq for Sources {
    fn eq(&self, _: &Sources) -> bool {
        true
    }
}

impl Eq for Sources {}

impl Default for PpConfig {
    fn default() -> PpConfig {
        PpConfig {
            devices: None,
            n_stages: 1,
            slots: 2,
            transport: TransportPolicy::Auto,
            process_transport: ProcessTransport::Auto,
            fault: Fault::default(),
            reserve_bytes: 0,
            sm_copies: true,
            nccl_recv_graphs: true,
            ranks: None,
            rank: 0,
            rendezvous: None,
            peer_timeout: DEFAULT_PEER_TIMEOUT,
            access: JobAccess::SameHost,
            sources: Sources::CODE,
        }
    }
}

impl PpConfig {
    /// Number of stages.
    pub fn n_stages(&self) -> usize {
        self.n_stages
    }

    /// Slots per boundary (see [`with_slots`](Self::with_slots)).
    pub fn slots(&self) -> usize {
        self.slots
    }

    /// The transport policy (see [`with_transport`](Self::with_transport)).
    pub fn transport(&self) -> TransportPolicy {
        self.transport
    }

    /// The transport of boundaries between ranks (see
    /// [`with_process_transport`](Self::with_process_transport)).
    pub fn process_transport(&self) -> ProcessTransport {
        self.process_transport
    }

    /// The injected fault (see [`with_fault`](Self::with_fault)).
    #[cfg(feature = "testing")]
    pub fn fault(&self) -> crate::pp::fault::ProtocolFault {
        self.fault.injected()
    }

    /// The fault seam's value, asked by the runtime at its fault points.
    #[inline(always)]
    pub(in crate::pp) fn faults(&self) -> Fault {
        self.fault
    }

    /// Bytes reserved per slot at build (see [`with_reserve_bytes`](Self::with_reserve_bytes)).
    pub fn reserve_bytes(&self) -> usize {
        self.reserve_bytes
    }

    /// Whether copies within a device may use the SM copy kernel (see
    /// [`with_sm_copies`](Self::with_sm_copies)).
    pub fn sm_copies(&self) -> bool {
        self.sm_copies
    }

    /// Whether boundaries from other ranks may receive through CUDA graphs (see
    /// [`with_nccl_recv_graphs`](Self::with_nccl_recv_graphs)).
    pub fn nccl_recv_graphs(&self) -> bool {
        self.nccl_recv_graphs
    }

    /// The stage→rank map: every stage in rank 0 unless [`with_ranks`](Self::with_ranks) set it.
    pub fn ranks(&self) -> Vec<usize> {
        self.ranks.clone().unwrap_or_else(|| vec![0; self.n_stages])
    }

    /// This process's rank (see [`with_rank`](Self::with_rank)).
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// The number of processes the pipeline spans (1 without [`with_ranks`](Self::with_ranks)).
    pub fn world(&self) -> usize {
        self.ranks.as_ref().and_then(|r| r.iter().max()).map_or(1, |max| max + 1)
    }

    /// Rank 0's rendezvous address, if set (see [`with_rendezvous`](Self::with_rendezvous)).
    pub fn rendezvous(&self) -> Option<&str> {
        self.rendezvous.as_deref()
    }

    /// The bound on every wait for another process (see
    /// [`with_peer_timeout`](Self::with_peer_timeout)).
    pub fn peer_timeout(&self) -> Duration {
        self.peer_timeout
    }

    /// How the ranks recognise each other (see [`with_job_access`](Self::with_job_access)).
    pub fn job_access(&self) -> &JobAccess {
        &self.access
    }

    /// The names the plan's errors give the settings it reads: where each value came from.
    pub(crate) fn setting_names(&self) -> SettingNames {
        SettingNames {
            devices: self.sources.devices,
            ranks: self.sources.ranks,
            transport: self.sources.transport,
            process_transport: self.sources.process_transport,
        }
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
    /// A [`ConfigError`] naming the setting (the builder call that set it, or the variable it
    /// was read from), the value and the reason.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let sources = &self.sources;
        if self.n_stages == 0 || self.n_stages > MAX_STAGES {
            return Err(ConfigError {
                setting: sources.stages,
                value: self.n_stages.to_string(),
                reason: format!("the stage count must be between 1 and {MAX_STAGES}"),
            });
        }
        if let Some(devices) = &self.devices {
            if devices.len() != self.n_stages {
                return Err(ConfigError {
                    setting: sources.devices,
                    value: join(devices),
                    reason: format!("{} device(s) listed for {} stage(s)", devices.len(), self.n_stages),
                });
            }
            if let Some(bad) = devices.iter().find(|&&d| d < 0) {
                return Err(ConfigError {
                    setting: sources.devices,
                    value: join(devices),
                    reason: format!("device ordinal {bad} is negative"),
                });
            }
        }
        if self.slots == 0 || self.slots > MAX_SLOTS {
            return Err(ConfigError {
                setting: sources.slots,
                value: self.slots.to_string(),
                reason: format!("the slot count must be between 1 and {MAX_SLOTS}"),
            });
        }
        self.validate_processes()
    }

    fn validate_processes(&self) -> Result<(), ConfigError> {
        let sources = &self.sources;
        let world = self.world();
        if let Some(ranks) = &self.ranks {
            let bad = |reason: String| ConfigError { setting: sources.ranks, value: join(ranks), reason };
            if ranks.len() != self.n_stages {
                return Err(bad(format!("{} rank(s) listed for {} stage(s)", ranks.len(), self.n_stages)));
            }
            if let Some(idle) = (0..world).find(|r| !ranks.contains(r)) {
                return Err(bad(format!("rank {idle} owns no stage (ranks must be 0..{world}, each owning a stage)")));
            }
        }
        if self.rank >= world {
            return Err(ConfigError {
                setting: sources.rank,
                value: self.rank.to_string(),
                reason: format!("the pipeline spans {world} rank(s) ({RANKS_VAR}), so the rank must be below {world}"),
            });
        }
        if world > 1 {
            match self.rendezvous.as_deref().map(str::trim) {
                None | Some("") => {
                    return Err(ConfigError {
                        setting: sources.rendezvous,
                        value: String::new(),
                        reason: format!("a pipeline of {world} ranks needs rank 0's address, host:port"),
                    });
                }
                Some(addr) => check_rendezvous_address(sources.rendezvous, addr)?,
            }
        }
        if !(MIN_PEER_TIMEOUT..=MAX_PEER_TIMEOUT).contains(&self.peer_timeout) {
            return Err(ConfigError {
                setting: sources.peer_timeout,
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
}

/// Checks a rendezvous address's form, `host:port` (a name, an IPv4 address or a bracketed IPv6
/// one, and a port from 1 to 65535), without resolving it; an error names `setting`.
fn check_rendezvous_address(setting: &'static str, addr: &str) -> Result<(), ConfigError> {
    let bad = |reason: String| ConfigError { setting, value: addr.to_string(), reason };
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
        if self.process_transport != ProcessTransport::Auto {
            write!(f, " {PROCESS_TRANSPORT_VAR}={}", self.process_transport)?;
        }
        if self.reserve_bytes != 0 {
            write!(f, " {RESERVE_BYTES_VAR}={}", self.reserve_bytes)?;
        }
        if self.peer_timeout != DEFAULT_PEER_TIMEOUT {
            write!(f, " {PEER_TIMEOUT_VAR}={}", self.peer_timeout.as_millis())?;
        }
        if let Some(fault) = self.fault.shown() {
            write!(f, " fault={fault:?}")?;
        }
        Ok(())
    }
}

fn join<T: ToString>(items: &[T]) -> String {
    items.iter().map(ToString::to_string).collect::<Vec<_>>().join(",")
}
