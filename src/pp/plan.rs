//! The boundary plan: which transport each stage boundary uses, and the policy it follows.
//!
//! Owns the transport policy ([`TransportPolicy`], a setting of [`PpConfig`](crate::PpConfig))
//! and the decision (a value computed once when a runtime is built, from the stage→device map,
//! the transport policy and the peer-access matrix); immutable, `Send + Sync`.

use std::fmt;

use crate::error::ConfigError;
use crate::pp::process_transport::{self, IPC_TRANSPORT_BUILT, ProcessTransport, Reach, TransportReason};
use crate::rendezvous::RankIdentity;

/// How boundaries between devices move data.
///
/// ```
/// use ppnrt::{PpConfig, TransportPolicy};
///
/// let config = PpConfig::new(2).with_transport(TransportPolicy::Staged);
/// assert_eq!(config.transport(), TransportPolicy::Staged);
/// assert_eq!(TransportPolicy::default(), TransportPolicy::Auto);
/// assert_eq!(TransportPolicy::Peer.to_string(), "peer");
/// ```
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

impl fmt::Display for TransportPolicy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            TransportPolicy::Auto => "auto",
            TransportPolicy::Peer => "peer",
            TransportPolicy::Staged => "staged",
        })
    }
}

/// How one boundary moves data from its TX stage to its RX stage.
///
/// ```
/// use ppnrt::{Transport, TransportPolicy, pp::Plan};
///
/// // Devices 0 and 1 without peer access: that boundary goes through host memory.
/// let plan = Plan::choose(&[0, 0, 1], TransportPolicy::Auto, |_, _| false)?;
/// let transports: Vec<Transport> = plan.boundaries.iter().map(|b| b.transport).collect();
/// assert_eq!(transports, [Transport::Local, Transport::HostStaged]);
/// assert_eq!(Transport::HostStaged.to_string(), "host-staged");
/// # Ok::<(), ppnrt::ConfigError>(())
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Transport {
    /// Both stages on one device: a device-to-device copy.
    Local,
    /// Two devices with peer access both ways: a copy-engine copy over NVLink or PCIe straight
    /// into the RX device's slot buffer.
    Peer,
    /// Through a pinned host slot: device-to-host on TX, host-to-device on RX.
    HostStaged,
    /// The stages run in different processes (ranks): an NCCL send on the TX stage's stream, an
    /// NCCL receive into the RX rank's slot.
    Nccl,
    /// The stages run in different processes (ranks) of one host whose devices reach each
    /// other: the RX rank's slots and events exported to the TX rank (CUDA IPC), the steps
    /// announced in shared memory. Chosen by [`ProcessTransport`]; the transport itself is not
    /// built yet, and a runtime refuses a plan that has one
    /// ([`PpError::TransportUnavailable`](crate::PpError::TransportUnavailable)).
    Ipc,
}

impl fmt::Display for Transport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Transport::Local => "local",
            Transport::Peer => "peer",
            Transport::HostStaged => "host-staged",
            Transport::Nccl => "nccl",
            Transport::Ipc => "ipc",
        })
    }
}

/// One boundary of the plan: boundary `b` joins stage `b` (TX) and stage `b + 1` (RX).
///
/// ```
/// use ppnrt::{Transport, TransportPolicy, pp::Plan};
///
/// let plan = Plan::choose(&[0, 1], TransportPolicy::Auto, |_, _| true)?;
/// let b = &plan.boundaries[0];
/// assert_eq!((b.boundary, b.tx_device, b.rx_device), (0, 0, 1));
/// assert_eq!((b.tx_rank, b.rx_rank), (0, 0)); // one process
/// assert_eq!(b.transport, Transport::Peer);
/// # Ok::<(), ppnrt::ConfigError>(())
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct BoundaryPlan {
    /// The boundary index.
    pub boundary: usize,
    /// The TX stage's device.
    pub tx_device: i32,
    /// The RX stage's device.
    pub rx_device: i32,
    /// The rank of the process that runs the TX stage.
    pub tx_rank: usize,
    /// The rank of the process that runs the RX stage.
    pub rx_rank: usize,
    /// The transport.
    pub transport: Transport,
    /// Why the boundary got its transport.
    pub reason: TransportReason,
}

#[cfg(test)]
impl BoundaryPlan {
    /// Boundary `boundary` between rank 0 (TX) and rank 1 (RX), both on device 0, over NCCL: the
    /// setup's unit tests' boundary.
    pub(crate) fn nccl_between_ranks_for_tests(boundary: usize) -> BoundaryPlan {
        BoundaryPlan {
            boundary,
            tx_device: 0,
            rx_device: 0,
            tx_rank: 0,
            rx_rank: 1,
            transport: Transport::Nccl,
            reason: crate::pp::process_transport::TransportReason::NotMet,
        }
    }
}

/// The transports of every boundary, printable for logs.
///
/// ```
/// use ppnrt::{TransportPolicy, pp::Plan};
///
/// let plan = Plan::choose(&[0, 1], TransportPolicy::Auto, |_, _| true)?;
/// assert_eq!(plan.boundaries.len(), 1);
/// assert!(plan.cross_device() && !plan.spans_processes());
/// println!("{plan}");
/// // The `peer` policy refuses two devices without peer access.
/// assert!(Plan::choose(&[0, 1], TransportPolicy::Peer, |_, _| false).is_err());
/// # Ok::<(), ppnrt::ConfigError>(())
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Plan {
    /// Device of each stage (on the host of the stage's rank).
    pub stage_devices: Vec<i32>,
    /// Rank of each stage's process.
    pub stage_ranks: Vec<usize>,
    /// One entry per boundary, in order.
    pub boundaries: Vec<BoundaryPlan>,
}

/// The names a plan's errors give the settings they are about: the caller's (a builder call or a
/// `PPNRT_*` variable, from [`PpConfig`](crate::PpConfig)), or the parameters of
/// [`Plan::choose_across`] when it is called directly.
#[derive(Debug, Clone, Copy)]
pub(crate) struct SettingNames {
    /// The stage→device map.
    pub(crate) devices: &'static str,
    /// The stage→rank map.
    pub(crate) ranks: &'static str,
    /// The transport policy.
    pub(crate) transport: &'static str,
    /// The transport between ranks.
    pub(crate) process_transport: &'static str,
}

impl SettingNames {
    /// The parameters of [`Plan::choose_across`].
    const PARAMETERS: SettingNames = SettingNames {
        devices: "stage_devices",
        ranks: "stage_ranks",
        transport: "policy",
        process_transport: "setting",
    };
}

impl Plan {
    /// Chooses each boundary's transport. `peer_access(a, b)` says whether device `a` can access
    /// device `b`'s memory.
    ///
    /// # Errors
    /// A [`ConfigError`] when the `peer` policy meets two devices without peer access.
    pub fn choose(
        stage_devices: &[i32],
        policy: TransportPolicy,
        peer_access: impl FnMut(i32, i32) -> bool,
    ) -> Result<Plan, ConfigError> {
        Plan::choose_across(stage_devices, &vec![0; stage_devices.len()], 0, policy, peer_access)
    }

    /// [`choose`](Self::choose) for a pipeline whose stages run in the processes `stage_ranks`,
    /// as seen by rank `rank`: a boundary between two ranks is [`Transport::Nccl`]; a boundary
    /// within one rank is chosen as `choose` does, and `peer_access` is asked only about the
    /// devices of `rank`'s own boundaries (another rank's transports are recorded as if its
    /// devices were peers; this rank never uses them).
    ///
    /// # Errors
    /// As [`choose`](Self::choose).
    pub fn choose_across(
        stage_devices: &[i32],
        stage_ranks: &[usize],
        rank: usize,
        policy: TransportPolicy,
        peer_access: impl FnMut(i32, i32) -> bool,
    ) -> Result<Plan, ConfigError> {
        Plan::choose_named(stage_devices, stage_ranks, rank, policy, peer_access, SettingNames::PARAMETERS)
    }

    /// [`choose_across`](Self::choose_across), its errors naming each setting as `names` says
    /// (where the caller's values came from: a builder call or a variable).
    pub(crate) fn choose_named(
        stage_devices: &[i32],
        stage_ranks: &[usize],
        rank: usize,
        policy: TransportPolicy,
        mut peer_access: impl FnMut(i32, i32) -> bool,
        names: SettingNames,
    ) -> Result<Plan, ConfigError> {
        if stage_ranks.len() != stage_devices.len() {
            return Err(ConfigError {
                setting: names.ranks,
                value: stage_ranks.iter().map(ToString::to_string).collect::<Vec<_>>().join(","),
                reason: format!("{} rank(s) listed for {} stage(s)", stage_ranks.len(), stage_devices.len()),
            });
        }
        let mut boundaries = Vec::with_capacity(stage_devices.len().saturating_sub(1));
        for (boundary, pair) in stage_devices.windows(2).enumerate() {
            let (tx_device, rx_device) = (pair[0], pair[1]);
            let (tx_rank, rx_rank) = (stage_ranks[boundary], stage_ranks[boundary + 1]);
            let transport = match policy {
                _ if tx_rank != rx_rank => Transport::Nccl,
                TransportPolicy::Staged => Transport::HostStaged,
                _ if tx_device == rx_device => Transport::Local,
                _ if tx_rank != rank => Transport::Peer,
                _ if peer_access(tx_device, rx_device) && peer_access(rx_device, tx_device) => Transport::Peer,
                TransportPolicy::Peer => {
                    return Err(ConfigError {
                        setting: names.transport,
                        value: "peer".into(),
                        reason: format!(
                            "boundary {boundary} joins devices {tx_device} and {rx_device}, which have no peer access \
                             ({}={})",
                            names.devices,
                            stage_devices.iter().map(ToString::to_string).collect::<Vec<_>>().join(",")
                        ),
                    });
                }
                TransportPolicy::Auto => Transport::HostStaged,
            };
            let reason = if tx_rank == rx_rank { TransportReason::InProcess } else { TransportReason::NotMet };
            boundaries.push(BoundaryPlan { boundary, tx_device, rx_device, tx_rank, rx_rank, transport, reason });
        }
        Ok(Plan { stage_devices: stage_devices.to_vec(), stage_ranks: stage_ranks.to_vec(), boundaries })
    }

    /// Chooses the transport of every boundary between two ranks from what each rank told the
    /// rendezvous (`identities[r]`: rank `r`'s host, user and devices) under `setting`, by the
    /// rule of [`Reach::between`]: both ranks of a boundary compute the same choice from the same
    /// table. Until the IPC transport is built, `auto` keeps NCCL (the reason says IPC would
    /// apply).
    ///
    /// # Errors
    /// A [`ConfigError`] on `setting` for [`ProcessTransport::Ipc`] where a boundary's ranks
    /// cannot use it (naming the boundary and why), or for fewer identities than ranks.
    pub fn choose_processes(
        &mut self,
        identities: &[RankIdentity],
        setting: ProcessTransport,
    ) -> Result<(), ConfigError> {
        self.choose_processes_named(identities, setting, SettingNames::PARAMETERS, IPC_TRANSPORT_BUILT)
    }

    /// [`choose_processes`](Self::choose_processes), its errors naming the setting as `names`
    /// says; `ipc_built` as [`IPC_TRANSPORT_BUILT`].
    pub(crate) fn choose_processes_named(
        &mut self,
        identities: &[RankIdentity],
        setting: ProcessTransport,
        names: SettingNames,
        ipc_built: bool,
    ) -> Result<(), ConfigError> {
        for b in self.boundaries.iter_mut().filter(|b| b.tx_rank != b.rx_rank) {
            let (Some(tx), Some(rx)) = (identities.get(b.tx_rank), identities.get(b.rx_rank)) else {
                return Err(ConfigError {
                    setting: names.process_transport,
                    value: setting.to_string(),
                    reason: format!(
                        "boundary {} joins ranks {} and {}, {} identities known",
                        b.boundary,
                        b.tx_rank,
                        b.rx_rank,
                        identities.len()
                    ),
                });
            };
            let reach = Reach::between(tx, b.tx_device, rx, b.rx_device);
            let (ipc, reason) =
                process_transport::choose(b.boundary, reach, setting, names.process_transport, ipc_built)?;
            b.transport = if ipc { Transport::Ipc } else { Transport::Nccl };
            b.reason = reason;
        }
        Ok(())
    }

    /// Refuses a plan that gives a boundary a transport this build cannot run (IPC, until its
    /// transport is built): the first such boundary's [`PpError::TransportUnavailable`].
    pub(crate) fn refuse_unbuilt(&self) -> Result<(), crate::error::PpError> {
        match self.boundaries.iter().find(|b| b.transport == Transport::Ipc) {
            Some(b) if !IPC_TRANSPORT_BUILT => Err(crate::error::PpError::TransportUnavailable {
                boundary: b.boundary,
                transport: "ipc",
                reason: format!(
                    "chosen for ranks {} and {} ({}); set the transport between ranks to auto or nccl",
                    b.tx_rank, b.rx_rank, b.reason
                ),
            }),
            _ => Ok(()),
        }
    }

    /// Whether any boundary crosses devices (or processes).
    pub fn cross_device(&self) -> bool {
        self.boundaries.iter().any(|b| b.tx_device != b.rx_device || b.tx_rank != b.rx_rank)
    }

    /// Whether the pipeline spans more than one process.
    pub fn spans_processes(&self) -> bool {
        self.stage_ranks.iter().any(|&r| r != self.stage_ranks[0])
    }
}

impl fmt::Display for Plan {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} stage(s) on devices [", self.stage_devices.len())?;
        for (i, d) in self.stage_devices.iter().enumerate() {
            write!(f, "{}{d}", if i == 0 { "" } else { "," })?;
        }
        write!(f, "]")?;
        if self.spans_processes() {
            write!(f, " in ranks [")?;
            for (i, r) in self.stage_ranks.iter().enumerate() {
                write!(f, "{}{r}", if i == 0 { "" } else { "," })?;
            }
            write!(f, "]")?;
        }
        for b in &self.boundaries {
            let side = |rank: usize, device: i32| {
                if self.spans_processes() { format!("rank {rank} dev {device}") } else { format!("dev {device}") }
            };
            write!(
                f,
                "; boundary {}: stage {} ({}) -> stage {} ({}) {}",
                b.boundary,
                b.boundary,
                side(b.tx_rank, b.tx_device),
                b.boundary + 1,
                side(b.rx_rank, b.rx_device),
                b.transport
            )?;
            if b.tx_rank != b.rx_rank {
                write!(f, " ({})", b.reason)?;
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn auto_picks_local_peer_and_staged() {
        // Devices 0 and 1 are peers; device 2 reaches nobody.
        let peers = |a: i32, b: i32| a != 2 && b != 2 && a != b;
        let plan = Plan::choose(&[0, 0, 1, 2], TransportPolicy::Auto, peers).unwrap();
        let transports: Vec<_> = plan.boundaries.iter().map(|b| b.transport).collect();
        assert_eq!(transports, vec![Transport::Local, Transport::Peer, Transport::HostStaged]);
        assert!(plan.cross_device());
        assert_eq!(
            plan.to_string(),
            "4 stage(s) on devices [0,0,1,2]; boundary 0: stage 0 (dev 0) -> stage 1 (dev 0) local; \
             boundary 1: stage 1 (dev 0) -> stage 2 (dev 1) peer; boundary 2: stage 2 (dev 1) -> stage 3 (dev 2) host-staged"
        );
    }

    #[test]
    fn peer_access_must_hold_both_ways() {
        let one_way = |a: i32, b: i32| a == 0 && b == 1;
        let plan = Plan::choose(&[0, 1], TransportPolicy::Auto, one_way).unwrap();
        assert_eq!(plan.boundaries[0].transport, Transport::HostStaged);
    }

    #[test]
    fn staged_forces_every_boundary_and_peer_refuses_unreachable_devices() {
        let plan = Plan::choose(&[0, 0, 1], TransportPolicy::Staged, |_, _| true).unwrap();
        assert!(plan.boundaries.iter().all(|b| b.transport == Transport::HostStaged));
        let err = Plan::choose(&[0, 1], TransportPolicy::Peer, |_, _| false).unwrap_err();
        assert_eq!(err.setting, "policy");
        assert!(err.reason.contains("devices 0 and 1") && err.reason.contains("(stage_devices=0,1)"), "{err}");
    }

    #[test]
    fn boundaries_between_ranks_are_nccl_and_other_ranks_devices_are_never_asked_about() {
        let asked = std::cell::RefCell::new(Vec::new());
        let access = |a: i32, b: i32| {
            asked.borrow_mut().push((a, b));
            true
        };
        let plan = Plan::choose_across(&[0, 1, 0, 0, 1], &[0, 0, 1, 1, 1], 0, TransportPolicy::Auto, access).unwrap();
        let transports: Vec<_> = plan.boundaries.iter().map(|b| b.transport).collect();
        assert_eq!(transports, vec![Transport::Peer, Transport::Nccl, Transport::Local, Transport::Peer]);
        assert_eq!(*asked.borrow(), vec![(0, 1), (1, 0)], "only rank 0's own boundary is looked up");
        assert!(plan.spans_processes() && plan.cross_device());
        assert!(
            plan.to_string().contains("boundary 1: stage 1 (rank 0 dev 1) -> stage 2 (rank 1 dev 0) nccl"),
            "{plan}"
        );
        let staged = Plan::choose_across(&[0, 0], &[0, 1], 1, TransportPolicy::Staged, |_, _| false).unwrap();
        assert_eq!(staged.boundaries[0].transport, Transport::Nccl);
    }

    /// Fewer (or more) stage ranks than stages is a typed error, not an index out of bounds.
    #[test]
    fn a_rank_list_of_another_length_is_a_typed_error() {
        for ranks in [&[0usize][..], &[0, 1, 1][..]] {
            let err = Plan::choose_across(&[0, 1], ranks, 0, TransportPolicy::Auto, |_, _| true).unwrap_err();
            assert_eq!(err.setting, "stage_ranks", "{err}");
        }
    }

    /// Rank 0 runs stages 0–1 on devices 0 and 1 (peers); rank 1 stage 2 on the same GPU as
    /// rank 0's device 1 (its device 0); rank 2, on another host, stage 3.
    fn three_ranks() -> (Plan, Vec<RankIdentity>) {
        use crate::rendezvous::{DeviceIdentity, HostIdentity};
        let host = |boot: &str| HostIdentity { boot_id: boot.into(), hostname: "node".into() };
        let device = |ordinal, uuid: u8, peers: &[i32]| DeviceIdentity {
            ordinal,
            uuid: [uuid; 16],
            peer_access: peers.to_vec(),
        };
        let identities = vec![
            RankIdentity { host: host("boot-1"), uid: 7, devices: vec![device(0, 1, &[1]), device(1, 2, &[0])] },
            RankIdentity { host: host("boot-1"), uid: 7, devices: vec![device(0, 2, &[])] },
            RankIdentity { host: host("boot-2"), uid: 7, devices: vec![device(0, 3, &[])] },
        ];
        let plan = Plan::choose_across(&[0, 1, 0, 0], &[0, 0, 1, 2], 0, TransportPolicy::Auto, |_, _| true).unwrap();
        (plan, identities)
    }

    #[test]
    fn boundaries_between_ranks_get_their_transport_and_reason_from_the_identities() {
        let (mut plan, identities) = three_ranks();
        assert!(plan.to_string().contains("nccl (ranks not met yet)"), "{plan}");
        let names = SettingNames::PARAMETERS;
        // With the IPC transport built: auto takes IPC on one host, NCCL to the other host.
        let mut built = plan.clone();
        built.choose_processes_named(&identities, ProcessTransport::Auto, names, true).unwrap();
        let line = built.to_string();
        assert!(line.contains("boundary 0: stage 0 (rank 0 dev 0) -> stage 1 (rank 0 dev 1) peer;"), "{line}");
        assert!(
            line.contains("boundary 1: stage 1 (rank 0 dev 1) -> stage 2 (rank 1 dev 0) ipc (same host, same device)"),
            "{line}"
        );
        assert!(
            line.ends_with("boundary 2: stage 2 (rank 1 dev 0) -> stage 3 (rank 2 dev 0) nccl (other host)"),
            "{line}"
        );
        // Without the IPC transport: auto keeps NCCL and says why.
        let mut unbuilt = plan.clone();
        unbuilt.choose_processes_named(&identities, ProcessTransport::Auto, names, false).unwrap();
        assert_eq!(unbuilt.boundaries[1].transport, Transport::Nccl);
        assert!(unbuilt.to_string().contains("nccl (same host, same device; ipc not built yet)"), "{unbuilt}");
        // This build: as built.
        plan.choose_processes(&identities, ProcessTransport::Auto).unwrap();
        assert_eq!(plan.boundaries[1].transport, Transport::Ipc);
        assert!(plan.refuse_unbuilt().is_ok());
        // Forced NCCL; forced IPC where the ranks are on two hosts is an error naming the boundary.
        plan.choose_processes(&identities, ProcessTransport::Nccl).unwrap();
        assert!(!plan.to_string().contains("ipc") && plan.to_string().contains("nccl (forced)"), "{plan}");
        let err = plan.clone().choose_processes(&identities, ProcessTransport::Ipc).unwrap_err();
        assert_eq!(err.setting, "setting");
        assert!(err.reason.contains("boundary 2 cannot use ipc: other host"), "{err}");
        // Forced IPC where it works is chosen, and this build runs it.
        let (mut two, identities) = three_ranks();
        two.boundaries.truncate(2);
        two.choose_processes(&identities, ProcessTransport::Ipc).unwrap();
        assert_eq!(two.boundaries[1].transport, Transport::Ipc);
        assert_eq!(two.refuse_unbuilt(), Ok(()));
        // Fewer identities than ranks: a typed error, not an index out of bounds.
        assert!(plan.choose_processes(&identities[..1], ProcessTransport::Auto).is_err());
    }

    #[test]
    fn one_stage_has_no_boundary() {
        let plan = Plan::choose(&[0], TransportPolicy::Auto, |_, _| false).unwrap();
        assert!(plan.boundaries.is_empty());
        assert!(!plan.cross_device());
    }
}
