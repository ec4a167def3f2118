//! The rendezvous of a multi-process pipeline, on this host's loopback (no GPU needed): a world
//! of ranks meets and gets rank 0's payload; a duplicate rank, another world size, another
//! configuration and a rank out of range are typed errors on rank 0 and on the ranks; a rank
//! nobody answers, and a rank 0 missing ranks, time out with a typed error in bounded time. With a
//! job secret, a process without it learns nothing and disturbs no one, on either side.

use std::net::TcpListener;
use std::time::{Duration, Instant};

use ppnrt::rendezvous::{PAYLOAD_BYTES, Rendezvous, RendezvousError};
use ppnrt::{JobAccess, JobSecret};

fn free_address() -> String {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    format!("127.0.0.1:{}", listener.local_addr().unwrap().port())
}

fn member(addr: &str, rank: usize, world: usize, fingerprint: &str, timeout_ms: u64) -> Rendezvous {
    Rendezvous {
        addr: addr.to_string(),
        rank,
        world,
        fingerprint: fingerprint.to_string(),
        timeout: Duration::from_millis(timeout_ms),
        access: JobAccess::SameHost,
    }
}

fn payload() -> [u8; PAYLOAD_BYTES] {
    std::array::from_fn(|i| (i * 7 + 3) as u8)
}

type Outcome = Result<[u8; PAYLOAD_BYTES], RendezvousError>;

/// Runs rank 0 and the given other ranks (rank, world, fingerprint) at once.
fn meet(world: usize, others: &[(usize, usize, &str)], timeout_ms: u64) -> (Outcome, Vec<Outcome>) {
    let addr = free_address();
    std::thread::scope(|scope| {
        let server = {
            let addr = addr.clone();
            scope.spawn(move || member(&addr, 0, world, "stages=4 slots=2", timeout_ms).serve(&payload()))
        };
        let clients: Vec<_> = others
            .iter()
            .map(|&(rank, world, fingerprint)| {
                let addr = addr.clone();
                scope.spawn(move || member(&addr, rank, world, fingerprint, timeout_ms).join())
            })
            .collect();
        (server.join().unwrap(), clients.into_iter().map(|c| c.join().unwrap()).collect())
    })
}

#[test]
fn a_world_meets_and_shares_rank_0s_payload() {
    let fp = "stages=4 slots=2";
    let (server, clients) = meet(4, &[(3, 4, fp), (1, 4, fp), (2, 4, fp)], 10_000);
    assert_eq!(server.unwrap(), payload());
    for client in clients {
        assert_eq!(client.unwrap(), payload());
    }
}

#[test]
fn ranks_that_start_before_rank_0_wait_for_it() {
    let addr = free_address();
    let fp = "stages=4 slots=2";
    let early = {
        let addr = addr.clone();
        std::thread::spawn(move || member(&addr, 1, 2, fp, 10_000).join())
    };
    std::thread::sleep(Duration::from_millis(300));
    assert_eq!(member(&addr, 0, 2, fp, 10_000).serve(&payload()).unwrap(), payload());
    assert_eq!(early.join().unwrap().unwrap(), payload());
}

#[test]
fn a_duplicate_rank_is_refused_everywhere() {
    let fp = "stages=4 slots=2";
    let (server, clients) = meet(3, &[(1, 3, fp), (1, 3, fp)], 10_000);
    assert_eq!(server.unwrap_err(), RendezvousError::DuplicateRank { rank: 1 });
    for client in clients {
        match client {
            Err(RendezvousError::Refused { reason }) => assert!(reason.contains("rank 1 joined twice"), "{reason}"),
            other => panic!("expected a refusal, got {other:?}"),
        }
    }
}

#[test]
fn another_world_size_or_configuration_is_refused() {
    let (server, clients) = meet(2, &[(1, 3, "stages=4 slots=2")], 10_000);
    assert_eq!(server.unwrap_err(), RendezvousError::WorldSizeMismatch { rank: 1, expected: 2, found: 3 });
    assert!(matches!(&clients[0], Err(RendezvousError::Refused { reason }) if reason.contains("world of 3")));
    let (server, clients) = meet(2, &[(1, 2, "stages=8 slots=2")], 10_000);
    assert!(matches!(server, Err(RendezvousError::ConfigMismatch { rank: 1, .. })), "{server:?}");
    // The refused connection learns what it sent, never rank 0's configuration.
    match &clients[0] {
        Err(RendezvousError::Refused { reason }) => {
            assert!(reason.contains("stages=8 slots=2") && !reason.contains("stages=4"), "{reason}");
        }
        other => panic!("expected a refusal, got {other:?}"),
    }
}

#[test]
fn ranks_out_of_range_are_typed_errors() {
    let addr = free_address();
    assert_eq!(member(&addr, 2, 2, "", 100).join().unwrap_err(), RendezvousError::RankOutOfRange { rank: 2, world: 2 });
    assert_eq!(
        member(&addr, 0, 1, "", 100).serve(&payload()).unwrap_err(),
        RendezvousError::RankOutOfRange { rank: 0, world: 1 }
    );
    assert!(matches!(member("no such host:1", 1, 2, "", 100).join(), Err(RendezvousError::Address { .. })));
    // A world larger than a rendezvous gathers is refused before anything is allocated for it
    // (`usize::MAX` used to panic, `1 << 40` to abort the process).
    for world in [ppnrt::rendezvous::MAX_WORLD + 1, 1 << 40, usize::MAX] {
        let max = ppnrt::rendezvous::MAX_WORLD;
        assert_eq!(
            member(&addr, 0, world, "", 100).serve(&payload()).unwrap_err(),
            RendezvousError::WorldOutOfRange { world, max }
        );
        assert_eq!(
            member(&addr, 1, world, "", 100).join().unwrap_err(),
            RendezvousError::WorldOutOfRange { world, max }
        );
    }
}

#[test]
fn nobody_answering_is_a_timeout_in_bounded_time() {
    let addr = free_address();
    let start = Instant::now();
    match member(&addr, 1, 2, "", 500).join() {
        Err(RendezvousError::Timeout { waiting_for, .. }) => assert!(waiting_for.contains("rank 0"), "{waiting_for}"),
        other => panic!("expected a timeout, got {other:?}"),
    }
    assert!(start.elapsed() < Duration::from_secs(5), "took {:?}", start.elapsed());
    // Rank 0 missing a rank: it times out naming it, and the rank that came is told.
    let fp = "stages=4 slots=2";
    let start = Instant::now();
    let (server, clients) = meet(3, &[(2, 3, fp)], 700);
    match server {
        Err(RendezvousError::Timeout { waiting_for, .. }) => assert!(waiting_for.contains("[1]"), "{waiting_for}"),
        other => panic!("expected a timeout, got {other:?}"),
    }
    assert!(matches!(&clients[0], Err(RendezvousError::Refused { .. }) | Err(RendezvousError::Timeout { .. })));
    assert!(start.elapsed() < Duration::from_secs(5), "took {:?}", start.elapsed());
}

#[test]
fn exchange_gathers_every_ranks_contribution_with_its_address() {
    let addr = free_address();
    let world = 3;
    let tables: Vec<_> = std::thread::scope(|scope| {
        let ranks: Vec<_> = (0..world)
            .map(|rank| {
                let addr = addr.clone();
                scope.spawn(move || {
                    let contribution = vec![rank as u8; 10 + rank * 100];
                    member(&addr, rank, world, "fp", 10_000).exchange(&contribution)
                })
            })
            .collect();
        ranks.into_iter().map(|r| r.join().unwrap().unwrap()).collect()
    });
    for table in &tables {
        assert_eq!(table, &tables[0], "every rank gets the same table");
        for (rank, member) in table.iter().enumerate() {
            assert_eq!(member.bytes, vec![rank as u8; 10 + rank * 100]);
            assert!(member.addr.is_loopback(), "{member:?}");
        }
    }
    let too_big = vec![0u8; ppnrt::rendezvous::MAX_CONTRIBUTION + 1];
    assert!(matches!(member(&addr, 1, 2, "fp", 100).exchange(&too_big), Err(RendezvousError::Protocol { .. })));
}

/// Connects to `addr`, retrying until rank 0 listens (at most two seconds).
fn connect_when_listening(addr: &str) -> std::net::TcpStream {
    let deadline = Instant::now() + Duration::from_secs(2);
    loop {
        match std::net::TcpStream::connect(addr) {
            Ok(stream) => return stream,
            Err(e) if Instant::now() < deadline => {
                let _ = e;
                std::thread::sleep(Duration::from_millis(5));
            }
            Err(e) => panic!("rank 0 never listened at {addr}: {e}"),
        }
    }
}

/// Connections that are not ranks cost the real ranks nothing: one that says nothing, one that
/// trickles a well-formed hello a byte every 100 ms (it would take seconds), and one that speaks
/// another protocol, all made before rank 1 arrives. Rank 0 reads every connection at once, each
/// within its own budget: rank 1 is met at once and both ranks get the payload (a silent
/// connection used to hold rank 0 until its whole timeout, failing the rendezvous).
#[test]
fn silent_trickling_and_foreign_connections_cost_the_ranks_nothing() {
    let addr = free_address();
    std::thread::scope(|scope| {
        let server = {
            let addr = addr.clone();
            scope.spawn(move || member(&addr, 0, 2, "cfg", 5000).serve(&payload()))
        };
        let _silent = connect_when_listening(&addr);
        let mut foreign = connect_when_listening(&addr);
        std::io::Write::write_all(&mut foreign, b"GET / HTTP/1.1\r\n\r\n").unwrap();
        let trickler = {
            let addr = addr.clone();
            scope.spawn(move || {
                let mut stream = connect_when_listening(&addr);
                let mut hello = b"PPNRTRV3".to_vec();
                for word in [1u32, 2, 3] {
                    hello.extend_from_slice(&word.to_le_bytes());
                }
                hello.extend_from_slice(b"cfg");
                hello.extend_from_slice(&0u32.to_le_bytes());
                for byte in hello.iter().take(20) {
                    if std::io::Write::write_all(&mut stream, &[*byte]).is_err() {
                        return; // dropped by rank 0
                    }
                    std::thread::sleep(Duration::from_millis(100));
                }
            })
        };
        std::thread::sleep(Duration::from_millis(100));
        let start = Instant::now();
        let joined = member(&addr, 1, 2, "cfg", 5000).join();
        let took = start.elapsed();
        assert_eq!(joined.unwrap(), payload(), "rank 1");
        assert!(took < Duration::from_secs(1), "rank 1 waited {took:?} behind the connections that are not ranks");
        assert_eq!(server.join().unwrap().unwrap(), payload(), "rank 0");
        trickler.join().unwrap();
    });
}

fn with_secret(mut member: Rendezvous, secret: &str) -> Rendezvous {
    member.access = JobAccess::Secret(JobSecret::new(secret).unwrap());
    member
}

const SECRET: &str = "the job's secret, made once per job";

/// A process without the job secret that connects to rank 0 (as a rank that states a disagreeing
/// configuration would: that used to abort every rank's rendezvous and hand it rank 0's
/// configuration) is closed after its first proof: it gets a typed error and nothing of the job,
/// and the real ranks meet as if it had not come.
#[test]
fn a_process_without_the_secret_is_dropped_and_the_rendezvous_goes_on() {
    let addr = free_address();
    std::thread::scope(|scope| {
        let server = {
            let addr = addr.clone();
            scope.spawn(move || with_secret(member(&addr, 0, 3, "cfg", 5000), SECRET).serve(&payload()))
        };
        // Strangers: no secret, another secret, another configuration and a duplicate rank.
        let strangers: Vec<_> =
            [(1, "cfg", None), (2, "other cfg", Some("another job's secret entirely")), (1, "x", None)]
                .into_iter()
                .map(|(rank, fp, secret)| {
                    let addr = addr.clone();
                    scope.spawn(move || {
                        let stranger = member(&addr, rank, 3, fp, 3000);
                        match secret {
                            Some(secret) => with_secret(stranger, secret).join(),
                            None => stranger.join(),
                        }
                    })
                })
                .collect();
        for stranger in strangers {
            match stranger.join().unwrap() {
                Err(RendezvousError::Unauthenticated { what, .. }) => {
                    assert!(what.contains("another job secret"), "{what}");
                }
                other => panic!("a stranger got {other:?}"),
            }
        }
        let start = Instant::now();
        let ranks: Vec<_> = [1, 2]
            .into_iter()
            .map(|rank| {
                let addr = addr.clone();
                scope.spawn(move || with_secret(member(&addr, rank, 3, "cfg", 5000), SECRET).join())
            })
            .collect();
        for rank in ranks {
            assert_eq!(rank.join().unwrap().unwrap(), payload());
        }
        assert_eq!(server.join().unwrap().unwrap(), payload());
        assert!(start.elapsed() < Duration::from_secs(2), "the ranks took {:?}", start.elapsed());
    });
}

/// A process that holds rank 0's address first (without the secret) is found out by every rank
/// at once: it never proves the key, so a rank sends it nothing but a nonce and fails with a typed
/// error instead of taking its member table and NCCL ids; the squatter's own wait names what it
/// saw.
#[test]
fn a_squatter_on_rank_0s_address_is_found_out_and_learns_nothing() {
    let addr = free_address();
    std::thread::scope(|scope| {
        let squatter = {
            let addr = addr.clone();
            scope.spawn(move || {
                with_secret(member(&addr, 0, 2, "cfg", 1500), "a squatter's guess at the secret").serve(&payload())
            })
        };
        std::thread::sleep(Duration::from_millis(100));
        let start = Instant::now();
        match with_secret(member(&addr, 1, 2, "cfg", 5000), SECRET).join() {
            Err(RendezvousError::Unauthenticated { what, .. }) => {
                assert!(what.contains("another job secret"), "{what}")
            }
            other => panic!("rank 1 got {other:?}"),
        }
        assert!(start.elapsed() < Duration::from_secs(1), "rank 1 took {:?}", start.elapsed());
        match squatter.join().unwrap() {
            Err(RendezvousError::Timeout { waiting_for, .. }) => {
                assert!(waiting_for.contains("1 connection(s) did not prove the job secret"), "{waiting_for}");
            }
            other => panic!("the squatter got {other:?}"),
        }
    });
}

/// Without a secret, ranks meet only on loopback: an address other hosts reach is refused on
/// every rank with a message that says how to set a secret, unless the job opted out.
#[test]
fn without_a_secret_only_loopback_unless_opted_out() {
    for (rank, addr) in [(1, "10.11.12.13:29500"), (0, "0.0.0.0:29500")] {
        let without = member(addr, rank, 2, "cfg", 200);
        let err = if rank == 0 { without.serve(&payload()).unwrap_err() } else { without.join().unwrap_err() };
        assert!(matches!(err, RendezvousError::NoSecret { .. }), "{err:?}");
        assert!(err.to_string().contains("PPNRT_JOB_SECRET") && err.to_string().contains("SECURITY.md"), "{err}");
    }
    let mut open = member("10.11.12.13:29500", 1, 2, "cfg", 200);
    open.access = JobAccess::Unauthenticated;
    assert!(matches!(open.join(), Err(RendezvousError::Timeout { .. })));
    assert!(with_secret(member("10.11.12.13:29500", 1, 2, "cfg", 200), SECRET).local_interface().is_ok());
}
