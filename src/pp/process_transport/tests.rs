//! The rule between ranks: the reach table from the rendezvous's identities, and the choice
//! each setting makes of it (with the IPC transport built and not).

use super::*;
use crate::rendezvous::DeviceIdentity;

const A: [u8; 16] = [0xa; 16];
const B: [u8; 16] = [0xb; 16];

fn rank(boot: &str, host: &str, uid: u32, devices: &[(i32, [u8; 16], &[i32])]) -> RankIdentity {
    RankIdentity {
        host: HostIdentity { boot_id: boot.into(), hostname: host.into() },
        uid,
        devices: devices
            .iter()
            .map(|&(ordinal, uuid, peers)| DeviceIdentity { ordinal, uuid, peer_access: peers.to_vec() })
            .collect(),
    }
}

#[test]
fn the_reach_table() {
    let here = |devices: &[(i32, [u8; 16], &[i32])]| rank("boot-1", "node", 1000, devices);
    // Two processes on one GPU, seen under different ordinals (CUDA_VISIBLE_DEVICES).
    assert_eq!(Reach::between(&here(&[(0, A, &[])]), 0, &here(&[(3, A, &[])]), 3), Reach::SameDevice);
    // Two GPUs, each rank seeing both, peer access both ways (reported by either rank).
    let both = here(&[(0, A, &[1]), (1, B, &[0])]);
    let only_b = here(&[(0, B, &[])]);
    assert_eq!(Reach::between(&both, 0, &only_b, 0), Reach::PeerAccess);
    assert_eq!(Reach::between(&only_b, 0, &both, 0), Reach::PeerAccess, "the rule is symmetric");
    // Peer access one way only, or not reported by a rank that sees both: none.
    let one_way = here(&[(0, A, &[1]), (1, B, &[])]);
    assert_eq!(Reach::between(&one_way, 0, &only_b, 0), Reach::NoPeerAccess);
    assert_eq!(Reach::between(&here(&[(0, A, &[])]), 0, &only_b, 0), Reach::NoPeerAccess);
    // A device nobody reported.
    assert_eq!(Reach::between(&here(&[(0, A, &[])]), 1, &only_b, 0), Reach::UnknownDevice);
    // Another host: another boot id, or the same boot id under another name (a cloned machine,
    // a container of its own), or no boot id at all.
    let same_device = |r: RankIdentity| Reach::between(&here(&[(0, A, &[])]), 0, &r, 0);
    assert_eq!(same_device(rank("boot-2", "node", 1000, &[(0, A, &[])])), Reach::OtherHost);
    assert_eq!(same_device(rank("boot-1", "other", 1000, &[(0, A, &[])])), Reach::OtherHost);
    assert_eq!(
        Reach::between(&rank("", "node", 1000, &[(0, A, &[])]), 0, &rank("", "node", 1000, &[(0, A, &[])]), 0),
        Reach::OtherHost
    );
    // Another user on the same host.
    assert_eq!(same_device(rank("boot-1", "node", 1001, &[(0, A, &[])])), Reach::OtherUser);
}

#[test]
fn each_setting_chooses_as_documented() {
    let possible = [Reach::SameDevice, Reach::PeerAccess];
    let impossible = [Reach::OtherHost, Reach::OtherUser, Reach::UnknownDevice, Reach::NoPeerAccess];
    for built in [false, true] {
        for reach in possible {
            assert_eq!(choose(1, reach, ProcessTransport::Nccl, "s", built), Ok((false, TransportReason::Forced)));
            assert_eq!(choose(1, reach, ProcessTransport::Ipc, "s", built), Ok((true, TransportReason::Reach(reach))));
            let auto = if built {
                (true, TransportReason::Reach(reach))
            } else {
                (false, TransportReason::IpcNotBuilt(reach))
            };
            assert_eq!(choose(1, reach, ProcessTransport::Auto, "s", built), Ok(auto));
        }
        for reach in impossible {
            assert_eq!(
                choose(1, reach, ProcessTransport::Auto, "s", built),
                Ok((false, TransportReason::Reach(reach)))
            );
            assert_eq!(choose(1, reach, ProcessTransport::Nccl, "s", built), Ok((false, TransportReason::Forced)));
            let err = choose(4, reach, ProcessTransport::Ipc, "PPNRT_PROCESS_TRANSPORT", built).unwrap_err();
            assert_eq!((err.setting, err.value.as_str()), ("PPNRT_PROCESS_TRANSPORT", "ipc"));
            assert!(err.reason.contains("boundary 4") && err.reason.contains(&reach.to_string()), "{err}");
        }
    }
    // This build has the IPC transport: auto takes it where the reach allows.
    let auto = choose(1, Reach::SameDevice, ProcessTransport::Auto, "s", IPC_TRANSPORT_BUILT);
    assert_eq!(auto, Ok((true, TransportReason::Reach(Reach::SameDevice))));
}

#[test]
fn reasons_read_as_the_plan_shows_them() {
    assert_eq!(TransportReason::Reach(Reach::SameDevice).to_string(), "same host, same device");
    assert_eq!(TransportReason::Reach(Reach::OtherHost).to_string(), "other host");
    assert_eq!(TransportReason::Forced.to_string(), "forced");
    assert_eq!(
        TransportReason::IpcNotBuilt(Reach::PeerAccess).to_string(),
        "same host, peer access; ipc not built yet"
    );
}
