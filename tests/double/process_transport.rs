//! The transport between two ranks of one host, chosen at the rendezvous (two ranks as threads
//! of this process, through the doubles, whose devices are peers): `auto` keeps NCCL until the
//! IPC transport is built and the plan says why; a forced `ipc` is refused by both ranks with a
//! typed error naming the boundary; a forced `nccl` says so.

use super::*;
use ppnrt::{PpError, ProcessTransport, Transport};

#[test]
fn auto_keeps_a_same_host_boundary_on_nccl_and_says_why() {
    with_double("auto_keeps_a_same_host_boundary_on_nccl_and_says_why", |_| {
        let ranks = two_ranks(std::time::Duration::from_secs(10));
        for rank in [&ranks.0, &ranks.1] {
            let boundary = rank.plan().boundaries[0];
            assert_eq!(boundary.transport, Transport::Nccl);
            let line = rank.plan().to_string();
            assert!(line.ends_with("nccl (same host, peer access; ipc not built yet)"), "{line}");
        }
        // Rank 0 (the sender) first: its close is confirmed by rank 1, and nothing is recorded.
        drop(ranks);
        let errors = ppnrt::take_drop_errors();
        assert!(errors.is_empty(), "a drop failed: {errors:?}");
    });
}

#[test]
fn a_forced_ipc_boundary_is_refused_by_both_ranks_and_a_forced_nccl_says_so() {
    with_double("a_forced_ipc_boundary_is_refused_by_both_ranks_and_a_forced_nccl_says_so", |_| {
        let primary = Engine::new(0).unwrap();
        let timeout = std::time::Duration::from_secs(10);
        let (zero, one) = ranks::try_two_ranks_configured(&primary, timeout, |_, config| {
            config.with_process_transport(ProcessTransport::Ipc)
        });
        for built in [zero, one] {
            let Err(err) = built else { panic!("an IPC boundary is refused until its transport is built") };
            assert!(
                matches!(err, Error::Pipeline(PpError::TransportUnavailable { boundary: 0, transport: "ipc", .. })),
                "{err}"
            );
        }
        let forced =
            ranks::two_ranks_configured(timeout, |_, config| config.with_process_transport(ProcessTransport::Nccl));
        assert!(forced.0.plan().to_string().ends_with("nccl (forced)"), "{}", forced.0.plan());
        drop(forced);
        let errors = ppnrt::take_drop_errors();
        assert!(errors.is_empty(), "a drop failed: {errors:?}");
    });
}
