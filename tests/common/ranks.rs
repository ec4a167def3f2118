//! Two ranks of one pipeline as threads of one test process (through the driver and NCCL
//! doubles, or on a GPU machine), each rank's runtime built on a thread of its own.
#![allow(dead_code, unreachable_pub)]

use ppnrt::{Engine, Error, PpConfig, PpNRt};

/// Two ranks of one pipeline in this process, one stage each (rank 0's on device 0, rank 1's on
/// device 1), each built on a thread of its own (a rank's setup waits for the other's). The
/// rendezvous port was free when picked ([`crate::common::rendezvous_port`]); another socket
/// that binds it meanwhile makes rank 0 fail with the typed `Address` error, and
/// both are built again on another port (at most three times).
pub fn two_ranks(peer_timeout: std::time::Duration) -> (PpNRt, PpNRt) {
    let (zero, one) = try_two_ranks(&Engine::new(0).unwrap(), peer_timeout);
    (zero.expect("rank 0's setup"), one.expect("rank 1's setup"))
}

/// [`two_ranks`] with each rank's configuration passed through `configure(rank, config)` first
/// (a fault injected into one rank, say).
pub fn two_ranks_configured(
    peer_timeout: std::time::Duration,
    configure: impl Fn(usize, PpConfig) -> PpConfig + Sync,
) -> (PpNRt, PpNRt) {
    let (zero, one) = try_two_ranks_configured(&Engine::new(0).unwrap(), peer_timeout, configure);
    (zero.expect("rank 0's setup"), one.expect("rank 1's setup"))
}

/// [`two_ranks`] with the caller's primary engine, each rank's setup as it ended.
pub fn try_two_ranks(
    primary: &Engine,
    peer_timeout: std::time::Duration,
) -> (ppnrt::Result<PpNRt>, ppnrt::Result<PpNRt>) {
    try_two_ranks_configured(primary, peer_timeout, |_, config| config)
}

/// [`try_two_ranks`] with each rank's configuration passed through `configure(rank, config)`.
pub fn try_two_ranks_configured(
    primary: &Engine,
    peer_timeout: std::time::Duration,
    configure: impl Fn(usize, PpConfig) -> PpConfig + Sync,
) -> (ppnrt::Result<PpNRt>, ppnrt::Result<PpNRt>) {
    for attempt in 1.. {
        let (zero, one) = try_two_ranks_once(primary, peer_timeout, &configure);
        if !(attempt < 3 && zero.as_ref().is_err_and(port_taken)) {
            return (zero, one);
        }
    }
    unreachable!("the loop returns")
}

/// One try of [`try_two_ranks_configured`], on a port that was free when picked
/// ([`crate::common::rendezvous_port`]): when another socket bound it meanwhile, rank 0's setup is the typed `Address`
/// error ([`port_taken`]) and rank 1's whatever its wait for the rendezvous ended with. A caller
/// that counts what the setups did (a fault sweep) makes such a run again.
pub fn try_two_ranks_once(
    primary: &Engine,
    peer_timeout: std::time::Duration,
    configure: &(impl Fn(usize, PpConfig) -> PpConfig + Sync),
) -> (ppnrt::Result<PpNRt>, ppnrt::Result<PpNRt>) {
    let port = crate::common::rendezvous_port();
    let addr = format!("127.0.0.1:{port}");
    let build = |rank: usize| {
        let config = PpConfig::with_devices(&[0, 1])
            .with_ranks(&[0, 1])
            .with_rank(rank)
            .with_rendezvous(&addr)
            .with_peer_timeout(peer_timeout);
        PpNRt::new(configure(rank, config), primary)
    };
    std::thread::scope(|scope| {
        let one = scope.spawn(|| build(1));
        let zero = build(0);
        (zero, one.join().unwrap())
    })
}

/// Whether `error` is rank 0's failure to host the rendezvous on its port (taken by another
/// socket between [`try_two_ranks_once`]'s probe and its bind).
pub fn port_taken(error: &Error) -> bool {
    matches!(error, Error::Rendezvous(ppnrt::rendezvous::RendezvousError::Address { .. }))
}

/// One rank per stage of a pipeline of `devices.len()` stages (stage `s` on `devices[s]`, in rank
/// `s`), every rank built on a thread of its own, each configuration passed through
/// `configure(rank, config)` first. Retries on another port as [`two_ranks`] does.
pub fn chain_of_ranks(
    devices: &[i32],
    peer_timeout: std::time::Duration,
    configure: impl Fn(usize, PpConfig) -> PpConfig + Sync,
) -> Vec<PpNRt> {
    let stage_ranks: Vec<usize> = (0..devices.len()).collect();
    ranks_of(devices, &stage_ranks, peer_timeout, configure)
}

/// The ranks of a pipeline whose stage `s` runs on `devices[s]` in rank `stage_ranks[s]` (every
/// rank from 0 to the largest named), every rank built on a thread of its own, each
/// configuration passed through `configure(rank, config)` first; in rank order. Retries on
/// another port as [`two_ranks`] does.
pub fn ranks_of(
    devices: &[i32],
    stage_ranks: &[usize],
    peer_timeout: std::time::Duration,
    configure: impl Fn(usize, PpConfig) -> PpConfig + Sync,
) -> Vec<PpNRt> {
    let primary = Engine::new(0).unwrap();
    let world = stage_ranks.iter().max().map_or(0, |last| last + 1);
    for attempt in 1.. {
        let port = crate::common::rendezvous_port();
        let addr = format!("127.0.0.1:{port}");
        let build = |rank: usize| {
            let config = PpConfig::with_devices(devices)
                .with_ranks(stage_ranks)
                .with_rank(rank)
                .with_rendezvous(&addr)
                .with_peer_timeout(peer_timeout);
            PpNRt::new(configure(rank, config), &primary)
        };
        let built: Vec<ppnrt::Result<PpNRt>> = std::thread::scope(|scope| {
            let others: Vec<_> = (1..world).map(|rank| scope.spawn(move || build(rank))).collect();
            let mut all = vec![build(0)];
            all.extend(others.into_iter().map(|other| other.join().unwrap()));
            all
        });
        if attempt < 3 && built[0].as_ref().is_err_and(port_taken) {
            continue;
        }
        return built
            .into_iter()
            .enumerate()
            .map(|(rank, r)| r.unwrap_or_else(|e| panic!("rank {rank}'s setup: {e}")))
            .collect();
    }
    unreachable!("the loop returns")
}
