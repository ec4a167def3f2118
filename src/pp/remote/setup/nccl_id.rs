//! The NCCL id of a boundary the plan gives NCCL: made by its RX rank once the transport is
//! chosen, and handed to the TX rank over the boundary's admitted control connection, sealed
//! with the connection's keys (a boundary over IPC makes none, so an IPC-only job needs no NCCL
//! and leaves no NCCL bootstrap listening).

use std::io::Write;
use std::net::TcpStream;
use std::time::{Duration, Instant};

use crate::auth::{Opener, SEAL, Sealer};
use crate::nccl::NcclUniqueId;
use crate::pp::error::{Error, PpError, Result};
use crate::pp::plan::BoundaryPlan;

use super::super::wire::read_exact_by;

/// The TX rank's request for the id (the RX rank writes nothing before it: bytes sent earlier
/// could arrive inside the admission's answer).
const ASK_ID: u8 = 0x1d;

fn failed(b: &BoundaryPlan, peer: usize, what: &str, e: &dyn std::fmt::Display) -> Error {
    Error::Pipeline(PpError::PeerFailed { boundary: b.boundary, peer, reason: format!("{what}: {e}") })
}

/// The RX rank's side: waits (within `timeout`) for the TX rank's request on `socket`, makes
/// the id and writes it sealed by `sealer` (the RX rank's answers' keys).
pub(super) fn offer(
    b: &BoundaryPlan,
    socket: &mut TcpStream,
    sealer: &mut Sealer,
    timeout: Duration,
) -> Result<NcclUniqueId> {
    let peer = b.tx_rank;
    let mut asked = [0u8; 1];
    read_exact_by(socket, &mut asked, Instant::now().checked_add(timeout))
        .map_err(|e| failed(b, peer, "waiting for the sending rank's request for the NCCL id", &e))?;
    if asked != [ASK_ID] {
        return Err(failed(b, peer, "the sending rank's request for the NCCL id", &format!("{:#04x}", asked[0])));
    }
    let id = NcclUniqueId::new()?;
    let mut message = id.to_bytes().to_vec();
    sealer.seal(&mut message);
    socket.write_all(&message).map_err(|e| failed(b, peer, "handing out the NCCL id", &e))?;
    Ok(id)
}

/// The TX rank's side: asks on `socket` and reads the id (within `timeout`), believed only once
/// `opener` (the RX rank's answers' keys) found its seal right.
pub(super) fn take(
    b: &BoundaryPlan,
    socket: &mut TcpStream,
    opener: &mut Opener,
    timeout: Duration,
) -> Result<NcclUniqueId> {
    let peer = b.rx_rank;
    socket.write_all(&[ASK_ID]).map_err(|e| failed(b, peer, "asking for the NCCL id", &e))?;
    let mut message = [0u8; NcclUniqueId::BYTES + SEAL];
    read_exact_by(socket, &mut message, Instant::now().checked_add(timeout))
        .map_err(|e| failed(b, peer, "reading the NCCL id", &e))?;
    let (bytes, seal) = message.split_at(NcclUniqueId::BYTES);
    if !opener.open(bytes, seal) {
        return Err(failed(
            b,
            peer,
            "the receiving rank's NCCL id",
            &"its seal is wrong (forged, altered or from another job)",
        ));
    }
    Ok(NcclUniqueId::from_bytes(bytes.try_into().expect("split at the id's size")))
}

#[cfg(test)]
mod tests {
    use std::io::{Read, Write};
    use std::net::{TcpListener, TcpStream};
    use std::time::{Duration, Instant};

    use super::{ASK_ID, offer, take};
    use crate::auth::{JobAccess, JobKey, JobSecret, Opener, Sealer};
    use crate::nccl::NcclUniqueId;
    use crate::pp::error::{Error, PpError};
    use crate::pp::plan::BoundaryPlan;

    fn plan() -> BoundaryPlan {
        BoundaryPlan::nccl_between_ranks_for_tests(3)
    }

    fn key(secret: &str) -> JobKey {
        JobAccess::Secret(JobSecret::new(secret).unwrap()).key().derive(&[b"back"])
    }

    /// A connected pair on loopback: the TX rank's end, the RX rank's end.
    fn pair() -> (TcpStream, TcpStream) {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let tx = TcpStream::connect(listener.local_addr().unwrap()).unwrap();
        let (rx, _) = listener.accept().unwrap();
        (tx, rx)
    }

    /// The TX rank's `take` against an RX end that answers the request with `message`, written in
    /// pieces of `piece` bytes `pause` apart; returns what `take` returned and how long it took.
    fn take_against(
        message: Vec<u8>,
        piece: usize,
        pause: Duration,
        timeout: Duration,
    ) -> (crate::pp::error::Result<NcclUniqueId>, Duration) {
        let (mut tx, mut rx) = pair();
        let answering = std::thread::spawn(move || {
            let mut asked = [0u8; 1];
            rx.read_exact(&mut asked).unwrap();
            assert_eq!(asked, [ASK_ID]);
            for chunk in message.chunks(piece) {
                if rx.write_all(chunk).is_err() {
                    return;
                }
                std::thread::sleep(pause);
            }
            // Held open a moment: the reader's bound, not a close, ends a short message.
            std::thread::sleep(Duration::from_millis(400));
        });
        let start = Instant::now();
        let taken = take(&plan(), &mut tx, &mut Opener::new(key("a job secret for the tests")), timeout);
        let took = start.elapsed();
        answering.join().unwrap();
        (taken, took)
    }

    fn sealed(id: &[u8; NcclUniqueId::BYTES], secret: &str) -> Vec<u8> {
        let mut message = id.to_vec();
        Sealer::new(key(secret)).seal(&mut message);
        message
    }

    fn peer_failed(result: crate::pp::error::Result<NcclUniqueId>) -> String {
        match result {
            Err(Error::Pipeline(PpError::PeerFailed { boundary: 3, peer: 1, reason })) => reason,
            other => panic!("not PeerFailed at boundary 3 from rank 1: {other:?}"),
        }
    }

    /// A sealed id is taken as sent; an id altered in one bit, or sealed with another job's key,
    /// is refused, naming the seal.
    #[test]
    fn nccl_id_is_believed_only_with_its_seal_right() {
        let id: [u8; NcclUniqueId::BYTES] = std::array::from_fn(|i| (i * 7 + 1) as u8);
        let timeout = Duration::from_secs(5);
        let (taken, _) = take_against(sealed(&id, "a job secret for the tests"), usize::MAX, Duration::ZERO, timeout);
        assert_eq!(taken.unwrap().to_bytes(), id);
        let mut altered = sealed(&id, "a job secret for the tests");
        altered[17] ^= 1;
        let reason = peer_failed(take_against(altered, usize::MAX, Duration::ZERO, timeout).0);
        assert!(reason.contains("seal is wrong"), "{reason}");
        let other_job = sealed(&id, "another job's secret, as long");
        let reason = peer_failed(take_against(other_job, usize::MAX, Duration::ZERO, timeout).0);
        assert!(reason.contains("seal is wrong"), "{reason}");
    }

    /// The wait for the id is bounded as a whole: a receiving rank that trickles its answer a byte
    /// at a time, or sends half of it, fails the setup at the timeout (each read waiting for the
    /// whole timeout again would stretch it by the bytes' count).
    #[test]
    fn nccl_id_wait_is_bounded_whatever_the_peer_trickles() {
        let id = [9u8; NcclUniqueId::BYTES];
        let timeout = Duration::from_millis(300);
        let (taken, took) =
            take_against(sealed(&id, "a job secret for the tests"), 1, Duration::from_millis(100), timeout);
        let reason = peer_failed(taken);
        assert!(reason.contains("reading the NCCL id"), "{reason}");
        assert!(took < Duration::from_millis(900), "a trickling peer held the wait {took:?} (timeout {timeout:?})");
        let half = sealed(&id, "a job secret for the tests")[..64].to_vec();
        let (taken, took) = take_against(half, usize::MAX, Duration::ZERO, timeout);
        peer_failed(taken);
        assert!(took < Duration::from_millis(900), "half an id held the wait {took:?}");
    }

    /// The RX rank answers only the request it expects: another byte fails its setup before it
    /// makes an id.
    #[test]
    fn nccl_id_is_offered_only_on_request() {
        let (mut tx, mut rx) = pair();
        tx.write_all(&[0x1c]).unwrap();
        let result =
            offer(&plan(), &mut rx, &mut Sealer::new(key("a job secret for the tests")), Duration::from_secs(5));
        match result {
            Err(Error::Pipeline(PpError::PeerFailed { boundary: 3, peer: 0, reason })) => {
                assert!(reason.contains("0x1c"), "{reason}");
            }
            other => panic!("not PeerFailed at boundary 3 from rank 0: {other:?}"),
        }
    }
}
