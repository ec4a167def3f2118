//! The boundary listener against strangers: a flood does not crowd out the sending rank, and a
//! sending rank whose connection is closed unanswered tries again.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

use super::*;
use crate::auth::{JobAccess, JobSecret};

fn plan(boundary: usize) -> crate::pp::plan::BoundaryPlan {
    crate::pp::plan::BoundaryPlan::nccl_between_ranks_for_tests(boundary)
}

fn job() -> JobKey {
    JobAccess::Secret(JobSecret::new("a job secret for the tests").unwrap()).key()
}

/// A flood of silent strangers far past the connections the receiving rank's listener serves at
/// once (256) does not crowd out the sending rank: both boundaries connect within a second
/// (connections past the bound used to be closed as they came, failing the setup at once).
#[test]
fn a_flood_of_silent_strangers_does_not_crowd_out_the_sending_rank() {
    let cross = vec![plan(0), plan(1)];
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    let timeout = Duration::from_secs(5);
    let (stop, opened) = (AtomicBool::new(false), AtomicUsize::new(0));
    std::thread::scope(|scope| {
        let receiver = scope.spawn(|| accept_inbound(&listener, &cross, 1, timeout, &job()));
        let floods: Vec<_> = (0..2)
            .map(|_| {
                scope.spawn(|| {
                    let mut held = VecDeque::new();
                    let deadline = Instant::now() + Duration::from_secs(6);
                    while !stop.load(Ordering::Relaxed) && Instant::now() < deadline {
                        if let Ok(stream) = TcpStream::connect_timeout(&addr, Duration::from_millis(200)) {
                            held.push_back(stream);
                            if held.len() > 600 {
                                held.pop_front();
                            }
                            opened.fetch_add(1, Ordering::Relaxed);
                        }
                    }
                })
            })
            .collect();
        let deadline = Instant::now() + Duration::from_secs(5);
        while opened.load(Ordering::Relaxed) < 400 {
            assert!(Instant::now() < deadline, "the flood opened only {}", opened.load(Ordering::Relaxed));
            std::thread::sleep(Duration::from_millis(5));
        }
        let start = Instant::now();
        let connected: Vec<_> = (0..2).map(|b| connect_outbound(&plan(b), addr, timeout, &job())).collect();
        let took = start.elapsed();
        stop.store(true, Ordering::Relaxed);
        for flood in floods {
            flood.join().unwrap();
        }
        for connection in connected {
            connection.map(|_| ()).unwrap();
        }
        assert_eq!(receiver.join().unwrap().unwrap().len(), 2);
        assert!(took < Duration::from_millis(1500), "the sending rank took {took:?} in the flood");
    });
}

/// A sending rank whose connection is closed before the listener answers (as a flood's eviction
/// does) tries again with backoff, and is admitted (it used to fail at once).
#[test]
fn a_sending_rank_whose_connection_is_closed_unanswered_tries_again() {
    let cross = vec![plan(0)];
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    let timeout = Duration::from_secs(5);
    std::thread::scope(|scope| {
        let sender = scope.spawn(|| connect_outbound(&plan(0), addr, timeout, &job()));
        // The first connection is closed without a word; then the listener admits as it does.
        let (first, _) = listener.accept().unwrap();
        drop(first);
        let inbound = accept_inbound(&listener, &cross, 1, timeout, &job()).unwrap();
        assert!(inbound.contains_key(&0));
        sender.join().unwrap().map(|_| ()).unwrap();
    });
}

/// A malformed rendezvous contribution (too short for the port and the NCCL flag, or a flag
/// neither 0 nor 1) fails the setup naming the rank that sent it, at its own boundary, and the
/// bad value; three bytes, any reason bytes after the flag (not UTF-8 either) are well formed.
#[test]
fn a_malformed_contribution_fails_the_setup_naming_its_rank_and_value() {
    // Boundary 4 between ranks 1 and 2, boundary 5 between ranks 2 and 3.
    let between = |boundary, tx_rank, rx_rank| crate::pp::plan::BoundaryPlan { tx_rank, rx_rank, ..plan(boundary) };
    let cross = [between(4, 1, 2), between(5, 2, 3)];
    let fine: &[u8] = &[0x10, 0x27, 1];
    let unusable: &[u8] = &[0x10, 0x27, 0, 0xff, 0xfe, b'x'];
    let read = parse_contributions(&[fine, &[0x10, 0x27, 0], unusable, fine], &cross).unwrap();
    assert_eq!(read[0].port, 0x2710);
    assert!(read[0].without_nccl.is_none() && read[1].without_nccl.as_deref() == Some(""));
    assert!(read[2].without_nccl.as_deref().is_some_and(|reason| reason.ends_with('x')));
    let refused = |contributions: &[&[u8]]| match parse_contributions(contributions, &cross) {
        Err(Error::Pipeline(PpError::PeerFailed { boundary, peer, reason })) => (boundary, peer, reason),
        other => panic!("not PeerFailed: {other:?}"),
    };
    let (boundary, peer, reason) = refused(&[fine, fine, fine, &[0x10, 0x27, 2]]);
    assert_eq!((boundary, peer), (5, 3), "{reason}");
    assert!(reason.contains("rank 3") && reason.contains("0x02"), "{reason}");
    let (boundary, peer, reason) = refused(&[fine, fine, &[0x10, 0x27, 0xff, b'x'], fine]);
    assert_eq!((boundary, peer), (4, 2), "{reason}");
    assert!(reason.contains("0xff"), "{reason}");
    for short in [&[][..], &[0x10][..], &[0x10, 0x27][..]] {
        let (boundary, peer, reason) = refused(&[fine, short, fine, fine]);
        assert_eq!((boundary, peer), (4, 1), "{reason}");
        assert!(reason.contains(&format!("{} byte(s)", short.len())), "{reason}");
    }
}
