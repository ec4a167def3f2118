//! Rank 0's side against members the crate's own ranks would never be: one that proves the key
//! and then stops reading.

use std::net::TcpStream;
use std::time::{Duration, Instant};

use super::*;
use crate::auth::{JobSecret, connect_and_knock};

/// Joins the rendezvous at `addr` as `rank` of `world` without reading the answer: the hello is
/// sent, and the connection is returned unread.
fn join_and_stop_reading(addr: SocketAddr, key: &JobKey, rank: usize, world: usize, contribution: &[u8]) -> TcpStream {
    let deadline = Instant::now() + Duration::from_secs(5);
    let (mut stream, handshake) = connect_and_knock(addr, key, MAGIC, deadline).unwrap();
    let mut hello = Vec::new();
    for word in [rank as u32, world as u32, 2] {
        hello.extend_from_slice(&word.to_le_bytes());
    }
    hello.extend_from_slice(b"fp");
    hello.extend_from_slice(&(contribution.len() as u32).to_le_bytes());
    hello.extend_from_slice(contribution);
    let identity = RankIdentity::of_this_process(Vec::new()).encode().unwrap();
    hello.extend_from_slice(&(identity.len() as u32).to_le_bytes());
    hello.extend_from_slice(&identity);
    handshake.send_message(&mut stream, key, &hello, deadline).unwrap();
    stream
}

/// A member that proves the key and then never reads a large member table holds rank 0 no
/// longer than its timeout: rank 0 returns a typed timeout naming it, and the other members get
/// the table meanwhile (rank 0's writes used to block until the member read or went away).
#[test]
fn a_member_that_stops_reading_holds_rank_0_no_longer_than_its_timeout() {
    // A table of 6 MiB: more than a loopback connection's buffers take in.
    let world = 96;
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let addr: SocketAddr = format!("127.0.0.1:{port}").parse().unwrap();
    let access = JobAccess::Secret(JobSecret::new("the job's secret, 32 bytes long.").unwrap());
    let key = access.key();
    let timeout = Duration::from_secs(3);
    let rank_0 = Rendezvous { addr: addr.to_string(), rank: 0, world, fingerprint: "fp".into(), timeout, access };
    let (done, outcome) = std::sync::mpsc::channel();
    let start = Instant::now();
    let serving = std::thread::spawn(move || {
        let result = rank_0.exchange(&[1u8; MAX_CONTRIBUTION]);
        let _ = done.send((result.map(|members| members.len()), start.elapsed()));
    });
    let contribution = vec![2u8; MAX_CONTRIBUTION];
    let stalled = join_and_stop_reading(addr, &key, 1, world, &contribution);
    // The others read whatever comes, to its end (bounded by a read timeout).
    let readers: Vec<_> = (2..world)
        .map(|rank| {
            let mut stream = join_and_stop_reading(addr, &key, rank, world, &contribution);
            std::thread::spawn(move || {
                stream.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
                std::io::copy(&mut stream, &mut std::io::sink()).unwrap_or(0)
            })
        })
        .collect();
    let joined = start.elapsed();
    // Bounded: the stalled member goes away two seconds past the timeout at the latest, which
    // ends the writes whatever rank 0 does.
    let received = outcome.recv_timeout(timeout + Duration::from_secs(2));
    drop(stalled);
    serving.join().unwrap();
    for reader in readers {
        assert!(reader.join().unwrap() > 5 << 20, "a reading member got the table");
    }
    let (result, took) = received.expect("rank 0 was still writing two seconds past its timeout");
    assert!(took < timeout + Duration::from_millis(500), "rank 0 took {took:?} (the ranks joined after {joined:?})");
    match result {
        Err(RendezvousError::Timeout { waiting_for, .. }) => {
            assert!(waiting_for.contains("rank(s) [1] did not take the member table"), "{waiting_for}");
        }
        other => panic!("expected a timeout, got {other:?}"),
    }
}
