//! How a boundary between two ranks is carried: the setting ([`ProcessTransport`]: `auto`, `ipc`
//! or `nccl`), what the rendezvous tells of the two ranks' reach ([`Reach`]), and the rule that
//! turns both into a choice with its reason ([`TransportReason`]).
//!
//! The rule reads only the rendezvous's member table, which every rank receives whole and the
//! same, so the two ranks of a boundary always make the same choice:
//! 1. the two ranks must run on one host ([`HostIdentity::same_host`]: the same boot id and host
//!    name), else [`Reach::OtherHost`];
//! 2. as one user (the local channel admits only its own user), else [`Reach::OtherUser`];
//! 3. both devices must be reported, by UUID (ordinals differ between processes), else
//!    [`Reach::UnknownDevice`];
//! 4. one device (the same UUID: two processes on one GPU) is [`Reach::SameDevice`]; two devices
//!    of which either rank reports peer access both ways (both visible to that process) are
//!    [`Reach::PeerAccess`]; else [`Reach::NoPeerAccess`].
//!
//! IPC is possible for `SameDevice` and `PeerAccess`. `ipc` then takes it, and is a
//! [`ConfigError`] naming the boundary and the reach otherwise; `nccl` always takes NCCL; `auto`
//! takes IPC where possible once the IPC transport is built ([`IPC_TRANSPORT_BUILT`]).

use std::fmt;

use crate::error::ConfigError;
use crate::rendezvous::{HostIdentity, RankIdentity};

/// Whether the IPC boundary transport is built. Until it is, `auto` keeps every boundary between
/// ranks on NCCL (its reason says IPC would apply), so nothing that runs today changes, and a
/// forced `ipc` is refused when the runtime is built
/// ([`PpError::TransportUnavailable`](crate::PpError::TransportUnavailable)).
pub(crate) const IPC_TRANSPORT_BUILT: bool = true;

/// How boundaries between two ranks move data.
///
/// ```
/// use ppnrt::{PpConfig, ProcessTransport};
///
/// let config = PpConfig::new(2).with_process_transport(ProcessTransport::Nccl);
/// assert_eq!(config.process_transport(), ProcessTransport::Nccl);
/// assert_eq!(ProcessTransport::default(), ProcessTransport::Auto);
/// assert_eq!(ProcessTransport::Ipc.to_string(), "ipc");
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum ProcessTransport {
    /// IPC where the two ranks share a host and reach each other's devices, else NCCL.
    #[default]
    Auto,
    /// IPC on every boundary between ranks; one where it cannot work is a configuration error.
    Ipc,
    /// NCCL on every boundary between ranks.
    Nccl,
}

impl fmt::Display for ProcessTransport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            ProcessTransport::Auto => "auto",
            ProcessTransport::Ipc => "ipc",
            ProcessTransport::Nccl => "nccl",
        })
    }
}

/// What the rendezvous tells of whether two ranks' devices can reach each other (the rule in
/// the module docs).
///
/// ```
/// use ppnrt::pp::Reach;
/// use ppnrt::rendezvous::{DeviceIdentity, RankIdentity};
///
/// let gpu = DeviceIdentity { ordinal: 0, uuid: [7; 16], peer_access: Vec::new() };
/// let a = RankIdentity::of_this_process(vec![gpu.clone()]);
/// let b = RankIdentity::of_this_process(vec![gpu]);
/// let reach = Reach::between(&a, 0, &b, 0);
/// // Two ranks of one host and user on one device can share its memory (where the boot id is known).
/// assert!(reach == Reach::SameDevice || a.host.boot_id.is_empty());
/// assert_eq!(reach.ipc_possible(), reach == Reach::SameDevice);
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Reach {
    /// One host, one user, one device (the same UUID).
    SameDevice,
    /// One host, one user, two devices with peer access both ways.
    PeerAccess,
    /// Two hosts.
    OtherHost,
    /// One host, two users.
    OtherUser,
    /// One host, a device neither rank reported.
    UnknownDevice,
    /// One host, two devices without peer access.
    NoPeerAccess,
}

impl Reach {
    /// The reach between `tx_device` of rank `tx` and `rx_device` of rank `rx` (each an ordinal
    /// in its own rank), by the rule of the module docs.
    pub fn between(tx: &RankIdentity, tx_device: i32, rx: &RankIdentity, rx_device: i32) -> Reach {
        if !HostIdentity::same_host(&tx.host, &rx.host) {
            return Reach::OtherHost;
        }
        if tx.uid != rx.uid {
            return Reach::OtherUser;
        }
        let (Some(a), Some(b)) = (tx.device(tx_device), rx.device(rx_device)) else {
            return Reach::UnknownDevice;
        };
        if a.uuid == b.uuid {
            return Reach::SameDevice;
        }
        let peers = |r: &RankIdentity| r.peer_access(&a.uuid, &b.uuid) && r.peer_access(&b.uuid, &a.uuid);
        if peers(tx) || peers(rx) { Reach::PeerAccess } else { Reach::NoPeerAccess }
    }

    /// Whether IPC can carry a boundary of this reach.
    pub fn ipc_possible(self) -> bool {
        matches!(self, Reach::SameDevice | Reach::PeerAccess)
    }
}

impl fmt::Display for Reach {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Reach::SameDevice => "same host, same device",
            Reach::PeerAccess => "same host, peer access",
            Reach::OtherHost => "other host",
            Reach::OtherUser => "same host, other user",
            Reach::UnknownDevice => "same host, a device not reported",
            Reach::NoPeerAccess => "same host, no peer access",
        })
    }
}

/// Why a boundary got its transport (shown in the plan's line for a boundary between ranks).
///
/// ```
/// use ppnrt::pp::{Reach, TransportReason};
///
/// assert_eq!(TransportReason::Forced.to_string(), "forced");
/// let why = TransportReason::IpcNotBuilt(Reach::SameDevice);
/// assert!(why.to_string().ends_with("ipc not built yet"), "{why}");
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum TransportReason {
    /// Within one process: chosen from the devices and the transport policy.
    InProcess,
    /// Between ranks, before the rendezvous told where they run.
    NotMet,
    /// Chosen by `auto` or `ipc` from the two ranks' reach.
    Reach(Reach),
    /// `nccl` was set.
    Forced,
    /// `auto` would take IPC for this reach, but the IPC transport is not built yet.
    IpcNotBuilt(Reach),
}

impl fmt::Display for TransportReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            TransportReason::InProcess => f.write_str("one process"),
            TransportReason::NotMet => f.write_str("ranks not met yet"),
            TransportReason::Reach(reach) => write!(f, "{reach}"),
            TransportReason::Forced => f.write_str("forced"),
            TransportReason::IpcNotBuilt(reach) => write!(f, "{reach}; ipc not built yet"),
        }
    }
}

/// The choice for boundary `boundary` of reach `reach` under `setting`: whether it takes IPC,
/// and why. `ipc_built` is [`IPC_TRANSPORT_BUILT`] (a parameter, so both states are tested).
///
/// # Errors
/// A [`ConfigError`] on `setting_name` for `ipc` where IPC cannot work, naming the boundary and
/// the reach.
pub(crate) fn choose(
    boundary: usize,
    reach: Reach,
    setting: ProcessTransport,
    setting_name: &'static str,
    ipc_built: bool,
) -> Result<(bool, TransportReason), ConfigError> {
    match setting {
        ProcessTransport::Nccl => Ok((false, TransportReason::Forced)),
        ProcessTransport::Ipc if reach.ipc_possible() => Ok((true, TransportReason::Reach(reach))),
        ProcessTransport::Ipc => Err(ConfigError {
            setting: setting_name,
            value: "ipc".into(),
            reason: format!("boundary {boundary} cannot use ipc: {reach}"),
        }),
        ProcessTransport::Auto if reach.ipc_possible() && ipc_built => Ok((true, TransportReason::Reach(reach))),
        ProcessTransport::Auto if reach.ipc_possible() => Ok((false, TransportReason::IpcNotBuilt(reach))),
        ProcessTransport::Auto => Ok((false, TransportReason::Reach(reach))),
    }
}

#[cfg(test)]
mod tests;
