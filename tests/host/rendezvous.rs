//! The rendezvous of a multi-process pipeline, on this host's loopback (no GPU needed): a world
//! of ranks meets and gets rank 0's payload; a duplicate rank, another world size, another
//! configuration and a rank out of range are typed errors on rank 0 and on the ranks; a rank
//! nobody answers, and a rank 0 missing ranks, time out with a typed error in bounded time. With a
//! job secret, a process without it learns nothing and disturbs no one, on either side. Strangers
//! on rank 0's port cost the ranks nothing: one that streams without a knock is read no further
//! than a knock, a flood of them does not crowd out the ranks, and rank 0 running out of file
//! descriptors while accepting is transient.

use std::collections::VecDeque;
use std::io::{BufRead, BufReader, Write};
use std::net::{TcpListener, TcpStream};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use ppnrt::rendezvous::{PAYLOAD_BYTES, Rendezvous, RendezvousError};
use ppnrt::{JobAccess, JobSecret};

fn free_address() -> String {
    format!("127.0.0.1:{}", crate::common::rendezvous_port())
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

/// Every rank's identity reaches every rank, sealed with the member table: its host (boot id
/// and name), its user and its devices with their UUIDs and peer access, as the rank reported
/// them; the plain `exchange` reports this host and user with no device. An identity past the
/// bounds is refused before anything is sent.
#[test]
fn every_rank_learns_every_ranks_host_user_and_devices() {
    use ppnrt::rendezvous::{DeviceIdentity, HostIdentity, MAX_DEVICES, RankIdentity};
    let addr = free_address();
    let world = 3;
    let reported = |rank: usize| {
        let devices = (0..rank as i32)
            .map(|d| DeviceIdentity { ordinal: d, uuid: [rank as u8 * 16 + d as u8; 16], peer_access: vec![1 - d] })
            .collect();
        RankIdentity::of_this_process(devices)
    };
    let tables: Vec<_> = std::thread::scope(|scope| {
        let ranks: Vec<_> = (0..world)
            .map(|rank| {
                let addr = addr.clone();
                scope.spawn(move || {
                    let me = member(&addr, rank, world, "fp", 10_000);
                    if rank == 1 { me.exchange(b"plain") } else { me.exchange_as(&reported(rank), b"with devices") }
                })
            })
            .collect();
        ranks.into_iter().map(|r| r.join().unwrap().unwrap()).collect()
    });
    let this_host = HostIdentity::of_this_host();
    for table in &tables {
        assert_eq!(table, &tables[0], "every rank gets the same table");
        assert_eq!(table[0].identity, reported(0));
        assert_eq!(table[1].identity, RankIdentity::of_this_process(Vec::new()));
        assert_eq!(table[2].identity, reported(2));
        assert_eq!(table[2].identity.devices[1].uuid, [33; 16]);
        for member in table {
            assert_eq!(member.identity.host, this_host);
            assert_eq!(member.identity.uid, table[0].identity.uid);
        }
    }
    let too_many = RankIdentity::of_this_process(vec![DeviceIdentity::default(); MAX_DEVICES + 1]);
    let err = member(&addr, 1, 2, "fp", 100).exchange_as(&too_many, b"").unwrap_err();
    assert!(matches!(err, RendezvousError::Protocol { .. }), "{err}");
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
                // Rank 1 tried three times: a close right after its knock may be a flood's eviction.
                assert!(waiting_for.contains("3 connection(s) did not prove the job secret"), "{waiting_for}");
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

/// This process's resident memory, in bytes (Linux's `/proc/self/statm`, in 4 KiB pages).
fn resident_bytes() -> usize {
    let statm = std::fs::read_to_string("/proc/self/statm").unwrap();
    statm.split_whitespace().nth(1).unwrap().parse::<usize>().unwrap() * 4096
}

/// A stranger that streams bytes without a knock is read no further than a knock's size and
/// closed: what it manages to write is what the sockets' buffers take, rank 0's memory stays
/// bounded, and rank 1 is met at once (rank 0 used to read all of it before looking at it,
/// growing by as much as the stranger sent, and was held while it streamed).
#[test]
fn a_stranger_streaming_without_a_knock_is_read_no_further_than_a_knock() {
    const STREAM_LIMIT: usize = 256 << 20;
    let addr = free_address();
    let resident_before = resident_bytes();
    std::thread::scope(|scope| {
        let server = {
            let addr = addr.clone();
            scope.spawn(move || with_secret(member(&addr, 0, 2, "cfg", 5000), SECRET).serve(&payload()))
        };
        let streamer = scope.spawn(|| {
            let mut stream = connect_when_listening(&addr);
            stream.set_write_timeout(Some(Duration::from_secs(3))).unwrap();
            let chunk = vec![0x5au8; 1 << 20];
            let mut sent = 0;
            while sent < STREAM_LIMIT {
                match stream.write(&chunk) {
                    Ok(n) => sent += n,
                    Err(_) => break,
                }
            }
            sent
        });
        std::thread::sleep(Duration::from_millis(50));
        let start = Instant::now();
        let joined = with_secret(member(&addr, 1, 2, "cfg", 5000), SECRET).join();
        let took = start.elapsed();
        assert_eq!(joined.unwrap(), payload(), "rank 1");
        assert!(took < Duration::from_secs(1), "rank 1 waited {took:?} behind the stranger");
        assert_eq!(server.join().unwrap().unwrap(), payload(), "rank 0");
        let sent = streamer.join().unwrap();
        assert!(sent < 64 << 20, "rank 0 took {sent} bytes from a stranger that never knocked");
        let grown = resident_bytes().saturating_sub(resident_before);
        assert!(grown < 64 << 20, "the process grew by {grown} bytes");
    });
}

/// Opens connections to `addr` that say nothing, as fast as it can, holding the latest 1,500,
/// until `stop` (or eight seconds); counts them in `opened`.
fn flood(addr: std::net::SocketAddr, stop: &AtomicBool, opened: &AtomicUsize) {
    let mut held = VecDeque::new();
    let deadline = Instant::now() + Duration::from_secs(8);
    while !stop.load(Ordering::Relaxed) && Instant::now() < deadline {
        match TcpStream::connect_timeout(&addr, Duration::from_millis(200)) {
            Ok(stream) => {
                held.push_back(stream);
                if held.len() > 1500 {
                    held.pop_front();
                }
                opened.fetch_add(1, Ordering::Relaxed);
            }
            Err(_) => std::thread::sleep(Duration::from_millis(1)),
        }
    }
}

/// Waits (at most five seconds) until `opened` reaches `count`.
fn wait_for(opened: &AtomicUsize, count: usize) {
    let deadline = Instant::now() + Duration::from_secs(5);
    while opened.load(Ordering::Relaxed) < count {
        assert!(Instant::now() < deadline, "the flood opened only {} connections", opened.load(Ordering::Relaxed));
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// A flood of strangers that connect and say nothing, far past the connections rank 0 serves at
/// once (1,024), does not crowd out the ranks: a newcomer evicts the oldest connection that has
/// not proved the key, never a rank's, and the world meets within a second (connections past the
/// bound used to be closed as they came, and the rank did not try again).
#[test]
fn a_flood_of_silent_strangers_does_not_crowd_out_the_ranks() {
    let addr = free_address();
    let target: std::net::SocketAddr = addr.parse().unwrap();
    let (stop, opened) = (AtomicBool::new(false), AtomicUsize::new(0));
    std::thread::scope(|scope| {
        let server = {
            let addr = addr.clone();
            scope.spawn(move || with_secret(member(&addr, 0, 4, "cfg", 8000), SECRET).serve(&payload()))
        };
        let floods: Vec<_> = (0..2).map(|_| scope.spawn(|| flood(target, &stop, &opened))).collect();
        wait_for(&opened, 1100);
        let start = Instant::now();
        let ranks: Vec<_> = (1..4)
            .map(|rank| {
                let addr = addr.clone();
                scope.spawn(move || with_secret(member(&addr, rank, 4, "cfg", 5000), SECRET).join())
            })
            .collect();
        let joined: Vec<_> = ranks.into_iter().map(|rank| rank.join().unwrap()).collect();
        let took = start.elapsed();
        stop.store(true, Ordering::Relaxed);
        for flood in floods {
            flood.join().unwrap();
        }
        for (rank, joined) in joined.into_iter().enumerate() {
            assert_eq!(joined.unwrap(), payload(), "rank {}", rank + 1);
        }
        assert_eq!(server.join().unwrap().unwrap(), payload(), "rank 0");
        assert!(took < Duration::from_millis(1500), "the ranks took {took:?} in the flood");
    });
}

/// A rank whose connection rank 0 closes before answering (as a flood's eviction does) tries
/// again with backoff within its timeout, and is met (it used to fail at once, refused).
#[test]
fn a_rank_whose_connection_is_closed_unanswered_tries_again() {
    let addr = free_address();
    let listener = TcpListener::bind(&addr).unwrap();
    listener.set_nonblocking(true).unwrap();
    std::thread::scope(|scope| {
        let rank_1 = {
            let addr = addr.clone();
            scope.spawn(move || with_secret(member(&addr, 1, 2, "cfg", 5000), SECRET).join())
        };
        // The first connection is closed without a word, and the listener goes away.
        let deadline = Instant::now() + Duration::from_secs(2);
        let first = loop {
            match listener.accept() {
                Ok((stream, _)) => break stream,
                Err(_) if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(1)),
                Err(e) => panic!("rank 1 never connected: {e}"),
            }
        };
        drop(first);
        drop(listener);
        std::thread::sleep(Duration::from_millis(50));
        let served = with_secret(member(&addr, 0, 2, "cfg", 5000), SECRET).serve(&payload());
        assert_eq!(rank_1.join().unwrap().unwrap(), payload(), "rank 1");
        assert_eq!(served.unwrap(), payload(), "rank 0");
    });
}

/// Set (to rank 0's address) in the child process that runs rank 0 with few descriptors.
const FEW_DESCRIPTORS_VAR: &str = "PPNRT_TEST_RANK_0_FEW_DESCRIPTORS";
/// The child's word that it holds every descriptor it may open.
const EXHAUSTED: &str = "rank 0: every descriptor taken";

/// Rank 0 runs out of file descriptors while rank 1 connects (a child process of this test
/// under `ulimit -n 64` opens `/dev/null` until `EMFILE`, for half a second): every `accept`
/// fails with `EMFILE` meanwhile, which is transient, and the world meets once descriptors are
/// free again (the first such `accept` used to fail the whole rendezvous).
#[test]
fn running_out_of_descriptors_while_accepting_does_not_fail_the_rendezvous() {
    if let Ok(addr) = std::env::var(FEW_DESCRIPTORS_VAR) {
        return rank_0_with_few_descriptors(&addr);
    }
    let addr = free_address();
    // This test's path in the host binary.
    let name = "rendezvous::running_out_of_descriptors_while_accepting_does_not_fail_the_rendezvous";
    let mut child = Command::new("sh")
        .arg("-c")
        .arg("ulimit -n 64 && exec \"$0\" \"$@\"")
        .arg(std::env::current_exe().unwrap())
        .args(["--exact", name, "--nocapture", "--test-threads=1"])
        .env(FEW_DESCRIPTORS_VAR, &addr)
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    // The child ends by itself (its rendezvous times out after five seconds at the latest).
    let exhausted = lines.by_ref().map_while(Result::ok).any(|line| line.contains(EXHAUSTED));
    let joined = exhausted.then(|| with_secret(member(&addr, 1, 2, "cfg", 5000), SECRET).join());
    let rest: Vec<String> = lines.map_while(Result::ok).collect();
    let status = child.wait().unwrap();
    assert!(exhausted, "the child never ran out of descriptors: {rest:?}");
    assert!(status.success(), "rank 0 failed while out of descriptors: {rest:?}");
    assert_eq!(joined.unwrap().unwrap(), payload(), "rank 1");
}

fn rank_0_with_few_descriptors(addr: &str) {
    let server = {
        let addr = addr.to_string();
        std::thread::spawn(move || with_secret(member(&addr, 0, 2, "cfg", 5000), SECRET).serve(&payload()))
    };
    std::thread::sleep(Duration::from_millis(200));
    let mut held = Vec::new();
    let exhausted = loop {
        match std::fs::File::open("/dev/null") {
            Ok(file) if held.len() < 4096 => held.push(file),
            Ok(_) => break None,
            Err(e) => break Some(e),
        }
    };
    assert_eq!(exhausted.as_ref().and_then(std::io::Error::raw_os_error), Some(24), "{exhausted:?} (EMFILE)");
    println!("{EXHAUSTED}");
    std::io::stdout().flush().unwrap();
    // Rank 1 connects meanwhile: each of rank 0's accepts fails with EMFILE.
    std::thread::sleep(Duration::from_millis(500));
    drop(held);
    assert_eq!(server.join().unwrap().unwrap(), payload(), "rank 0");
}
