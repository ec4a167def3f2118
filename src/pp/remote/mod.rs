//! Boundaries between processes: the links of a pipeline whose stages run in several ranks.
//!
//! Owns, per boundary whose two stages run in different ranks, the link: a two-rank NCCL
//! communicator (the TX rank is its rank 0, the RX rank its rank 1) and a TCP control connection
//! from the TX rank to the RX rank. `tx` sends the payload with NCCL on the TX stage's stream and
//! writes a record `(step, n, element type)` to the connection; on the RX rank a receiver thread
//! reads each record, waits for the ring's next slot to be free (as an in-process `tx` does),
//! posts the NCCL receive of exactly the bytes sent into the slot on the boundary's receive
//! stream, and marks the slot filled with the sender's `n` and type. The RX stage's `rx` is then
//! the in-process one: it checks `n` and the type against the sender's (a mismatch is a typed
//! error, the slot keeps its data) and orders itself after the receive by the crate's rule.
//!
//! Captured receives: NCCL's receive call costs several µs of host time, on the hop's critical
//! path. Once a byte count repeats, the receiver thread captures the receive into each slot for
//! that count in a CUDA graph (on a stream nothing else uses) and from then on launches the
//! graph, ordered like the call. A receive is captured only while no other NCCL call of the
//! process is in progress and none of the process's NCCL work is still running on its GPU
//! (`nccl::PostingAlone`; waited for at most a millisecond); else it is received by NCCL's call
//! and the capture waits for a later step of its count. A link that missed 32 such chances
//! no longer waits (it captures only where it finds the work complete at once).
//! The graphs live in the link; each slot keeps two counts. A graph
//! of a slot's old memory (the slot grew) is dropped. NCCL's abort and destroy wait until every
//! graph holding an operation of the communicator is destroyed, so a failing link destroys its
//! graphs first (keeping the slots' memory alive until the abort has ended their runs), and a
//! link drops them before its communicator.
//!
//! Failure: a connection that ends without the close record (the peer exited), a failed write,
//! an NCCL asynchronous error, or a peer silent for the peer timeout (its process hung or
//! stopped) fails the link: its communicator is aborted at once (so no NCCL kernel stays queued
//! and every stream drains, a stream synchronisation waiting for a send or receive included),
//! waiting `rx` calls wake up, and every later call on the boundary returns
//! [`PpError::PeerFailed`], as does the wait of every readback of the rank (its values may come
//! from a receive the abort cut short). A failure no call returned is recorded by the runtime's
//! drop. Liveness: a watchdog thread per runtime sends a sign of life on every
//! link of this rank a few times per timeout (an `ALIVE` record to the RX rank, an `ALIVE` byte
//! back to the TX rank), reads the TX side's, and polls NCCL; the receiver threads read the RX
//! side's with the records. The signs of life go on while a call waits on the link (a `tx_wait`
//! waiting for a free slot holds the link's control lock, not its writer), and whichever thread
//! reads the peer's answers records that it heard them, so a wait as long as the caller asks
//! never looks like a hung rank to either side. Clean shutdown: the TX rank sends a close record and waits (bounded)
//! until the RX rank's receives of every step are complete and, over NCCL, its own last send
//! too (an event recorded right after each send): a confirmation while a send waits for its
//! receive is a lie, and fails the link.
//!
//! Trust: every control connection is admitted as [`crate::auth`] describes (the TX rank and the
//! RX rank each prove the job's key before the boundary is named; the RX rank's listener binds
//! the interface that reaches rank 0), and every record in either direction carries a seal over
//! its position and bytes; a record whose seal is wrong fails the link before any of it is used.
//! A link that fails fails the rank's other links first ([`RankLinks`]), so what this rank
//! forwards after a receive the abort cut short never reaches the next rank as whole.
//!
//! Setup ([`connect`]): a rendezvous at rank 0 gathers every rank's listening port and whether
//! it can load NCCL, and every rank chooses each boundary's transport from that same table; TX
//! ranks connect to RX ranks (while a thread of the rank admits the connections of its inbound
//! boundaries); on each NCCL boundary the RX rank makes the NCCL unique id and hands it to the TX
//! rank on the admitted connection, sealed (`setup/nccl_id.rs`); the communicators
//! are initialised in boundary order (every rank in the same order, so none waits on another
//! cycle); and each link moves one small message to prove it before the runtime is returned.
//! Every wait of the setup for another rank is bounded by the peer timeout, and the waits for
//! NCCL (the join, which NCCL does in the background, and the first message, which connects
//! NCCL's transport) also end as soon as the peer closes its end of the boundary's connection
//! (it died): a rank that dies or stops during another's setup is a [`PpError::PeerFailed`]
//! there, not a hang.

use std::time::Duration;

mod gates;
mod inbox;
mod ipc;
mod link;
mod receiver;
mod sender;
mod setup;
mod watchdog;
mod wire;

pub(super) use link::{Link, LinkFailure, Phase};
pub(super) use receiver::{Announced, Inbound, Receiver, SlotFiller};
pub(super) use sender::Sender;
pub(super) use setup::{Links, LocalStage, connect};
pub(super) use watchdog::Watchdog;

/// The read timeout of a TX rank's control connection, which bounds the watchdog's peek at it
/// (the connection's other readers, `tx_wait` and the close, set theirs and give this one back).
pub(super) const WATCH_PEEK: Duration = Duration::from_millis(1);

/// The greeting of a control connection; the digit is the wire protocol's version.
const HELLO_MAGIC: &[u8; 8] = b"PPNRTBD4";
const DATA: u8 = 1;
const CLOSE: u8 = 2;
/// The RX rank's one-byte answer to a close: every step was received.
const DONE: u8 = 3;
/// A sign of life: a record with no payload from the TX rank, one byte from the RX rank.
const ALIVE: u8 = 4;
/// The TX rank's record: a `tx_wait` waits for a free slot for this step (see [`Credit`]).
const WAITING: u8 = 5;
/// The RX rank's answer to [`WAITING`]: how many steps its stage has taken (a `u64` follows),
/// sent at once and again when its stage next takes one.
const CREDIT: u8 = 6;
/// A record: kind, three reserved bytes, the name's length (u32), step (u64), n (u64), the
/// element's size in bytes (u64), the element type's name, then the record's seal.
const RECORD_HEAD: usize = 32;
const MAX_TYPE_NAME: usize = 64;

#[cfg(test)]
mod tests {
    use std::io::{Read, Write};
    use std::net::{TcpListener, TcpStream};
    use std::time::{Duration, Instant};

    use super::link::*;
    use super::sender::*;
    use super::setup::*;
    use super::wire::*;
    use super::*;
    use crate::auth::{JobAccess, JobSecret, Opener, Sealer};
    use crate::pp::config::PpConfig;
    use crate::pp::error::{Error, PpError, ReceiverState};
    use crate::pp::timing::POLL;

    /// A connected pair on loopback; the reader's reads time out after 20 ms.
    fn pair() -> (TcpStream, TcpStream) {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let writer = TcpStream::connect(listener.local_addr().unwrap()).unwrap();
        let (reader, _) = listener.accept().unwrap();
        reader.set_read_timeout(Some(Duration::from_millis(20))).unwrap();
        writer.set_nodelay(true).unwrap();
        (writer, reader)
    }

    /// The two ends' record keys of one link.
    fn seals() -> (Sealer, Opener) {
        let key = JobAccess::Secret(JobSecret::new("a job secret for the tests").unwrap()).key().derive(&[b"link"]);
        (Sealer::new(key.clone()), Opener::new(key))
    }

    fn read_until_record(
        reader: &mut TcpStream,
        pending: &mut Vec<u8>,
        opener: &mut Opener,
    ) -> std::result::Result<Record, String> {
        let deadline = Instant::now() + Duration::from_secs(5);
        loop {
            if let Some(record) = read_record(reader, pending, opener)? {
                return Ok(record);
            }
            assert!(Instant::now() < deadline, "no record within 5 s");
        }
    }

    #[test]
    fn receives_use_graphs_unless_configured_off_or_nccl_mixing_is_off() {
        assert!(!mixing_support_off(None));
        assert!(!mixing_support_off(Some("1")));
        assert!(!mixing_support_off(Some("")));
        assert!(mixing_support_off(Some("0")));
        assert!(mixing_support_off(Some(" 0 ")));
        let config = PpConfig::default();
        assert!(config.nccl_recv_graphs());
        assert!(!config.clone().with_nccl_recv_graphs(false).nccl_recv_graphs());
        assert!(config.with_nccl_recv_graphs(false).to_string().ends_with(" nccl_recv_graphs=off"));
    }

    #[test]
    fn a_record_written_byte_by_byte_is_read_whole_and_two_in_one_write_both() {
        let (mut writer, mut reader) = pair();
        let (mut sealer, mut opener) = seals();
        let mut pending = Vec::new();
        let record = encode_record(&mut sealer, DATA, 7, 1000, 4, "f32");
        for byte in &record {
            assert!(
                read_record(&mut reader, &mut pending, &mut opener).unwrap().is_none(),
                "a partial record is not a record"
            );
            writer.write_all(std::slice::from_ref(byte)).unwrap();
        }
        match read_until_record(&mut reader, &mut pending, &mut opener).unwrap() {
            Record::Data(step) => {
                assert_eq!((step.step, step.n, step.elem, step.bytes), (7, 1000, "f32", 4000));
            }
            Record::Close { .. } | Record::Alive | Record::Waiting { .. } => panic!("expected data"),
        }
        let mut three = encode_record(&mut sealer, DATA, 8, 3, 2, "bf16");
        three.extend(encode_record(&mut sealer, ALIVE, 0, 0, 0, ""));
        three.extend(encode_record(&mut sealer, CLOSE, 9, 0, 0, ""));
        writer.write_all(&three).unwrap();
        assert!(matches!(
            read_until_record(&mut reader, &mut pending, &mut opener).unwrap(),
            Record::Data(s) if s.elem == "bf16" && s.bytes == 6
        ));
        assert!(matches!(read_until_record(&mut reader, &mut pending, &mut opener).unwrap(), Record::Alive));
        assert!(matches!(
            read_until_record(&mut reader, &mut pending, &mut opener).unwrap(),
            Record::Close { steps: 9 }
        ));
        assert!(pending.is_empty());
    }

    #[test]
    fn signs_of_life_come_ten_times_per_timeout_within_bounds() {
        assert_eq!(heartbeat_interval(Duration::from_secs(60)), Duration::from_secs(1));
        assert_eq!(heartbeat_interval(Duration::from_secs(2)), Duration::from_millis(200));
        assert_eq!(heartbeat_interval(Duration::from_millis(20)), POLL);
        assert!(silence(Duration::from_secs(3)).contains("no sign of life from the peer for 3s"));
    }

    #[test]
    fn malformed_records_and_a_closed_connection_are_reasons_to_fail() {
        let record = |kind, step, n, size, name: &str| encode_record(&mut seals().0, kind, step, n, size, name);
        let cases: Vec<(Vec<u8>, &str)> = vec![
            (record(9, 0, 1, 4, "f32"), "unknown kind"),
            (record(DATA, 0, 0, 4, "f32"), "element(s)"),
            (record(DATA, 0, u64::MAX, 8, "f64"), "element(s)"),
            (record(DATA, 0, 1, 4, &"x".repeat(MAX_TYPE_NAME + 1)), "type name of"),
            (
                {
                    // A type name that is not UTF-8, sealed as it is (a sender of another build).
                    let mut r = record(DATA, 0, 1, 1, "ab");
                    r.truncate(r.len() - crate::auth::SEAL);
                    let at = r.len() - 2;
                    r[at] = 0xff;
                    let mut sealer = seals().0;
                    sealer.seal(&mut r);
                    r
                },
                "not UTF-8",
            ),
        ];
        for (bytes, expected) in cases {
            let (mut writer, mut reader) = pair();
            writer.write_all(&bytes).unwrap();
            let err = read_until_record(&mut reader, &mut Vec::new(), &mut seals().1).err().unwrap_or_default();
            assert!(err.contains(expected), "{expected:?} not in {err:?}");
        }
        let (writer, mut reader) = pair();
        drop(writer);
        let err = read_until_record(&mut reader, &mut Vec::new(), &mut seals().1).err().unwrap_or_default();
        assert!(err.contains("closed"), "{err}");
    }

    #[test]
    fn forged_altered_replayed_reordered_and_foreign_records_fail_the_link_before_they_are_believed() {
        let (mut sealer, _) = seals();
        let first = encode_record(&mut sealer, DATA, 0, 256, 4, "f32");
        let second = encode_record(&mut sealer, DATA, 1, 256, 4, "f32");
        let mut altered = first.clone();
        altered[16] = 0; // n = 256 becomes 0 ... or any other value: the seal no longer fits.
        altered[17] ^= 4;
        let mut wrong_size = first.clone();
        wrong_size[24] = 1; // the element size the receiver checks against its own type
        let stranger = {
            let key = JobAccess::Secret(JobSecret::new("another job's secret, as long").unwrap()).key();
            encode_record(&mut Sealer::new(key.derive(&[b"link"])), DATA, 0, 256, 4, "f32")
        };
        let unsealed = first[..first.len() - crate::auth::SEAL].to_vec();
        let cases: Vec<(&str, Vec<Vec<u8>>)> = vec![
            ("altered", vec![altered]),
            ("element size changed", vec![wrong_size]),
            ("replayed", vec![first.clone(), first.clone()]),
            ("reordered", vec![second.clone(), first.clone()]),
            ("from another job", vec![stranger]),
            ("unsealed, then another", vec![unsealed, second.clone()]),
        ];
        for (what, records) in cases {
            let (mut writer, mut reader) = pair();
            let mut opener = seals().1;
            let mut pending = Vec::new();
            for record in &records {
                writer.write_all(record).unwrap();
            }
            let mut believed = 0;
            let outcome = loop {
                match read_until_record(&mut reader, &mut pending, &mut opener) {
                    Ok(_) => believed += 1,
                    Err(reason) => break reason,
                }
            };
            assert!(outcome.contains("seal is wrong"), "{what}: {outcome}");
            assert!(believed < records.len(), "{what}: every record was believed");
        }
        // A truncated record is no record: nothing is believed while its seal is missing.
        let (mut writer, mut reader) = pair();
        let mut opener = seals().1;
        writer.write_all(&first[..first.len() - 1]).unwrap();
        let mut pending = Vec::new();
        for _ in 0..5 {
            assert!(read_record(&mut reader, &mut pending, &mut opener).unwrap().is_none());
        }
    }

    #[test]
    fn the_receivers_answers_are_sealed_and_never_cut_or_interleaved() {
        let key = JobAccess::Secret(JobSecret::new("a job secret for the tests").unwrap()).key().derive(&[b"back"]);
        let (writer_socket, reader_socket) = pair();
        let mut writer = BackWriter { sealer: Sealer::new(key.clone()), unsent: Vec::new() };
        for kind in [ALIVE, ALIVE, DONE] {
            writer.send(&writer_socket, kind).unwrap();
        }
        let mut reader = BackReader { opener: Opener::new(key.clone()), pending: Vec::new() };
        let mut bytes = vec![0u8; 3 * (1 + crate::auth::SEAL)];
        (&reader_socket).read_exact(&mut bytes).unwrap();
        // Delivered in two pieces, cut inside a frame.
        let mut credit = 0;
        let mut kinds = reader.take(&bytes[..20], &mut credit).unwrap();
        kinds.extend(reader.take(&bytes[20..], &mut credit).unwrap());
        assert_eq!(kinds, [ALIVE, ALIVE, DONE]);
        // A credit's count comes with it; an older one never lowers it.
        writer.send_credit(&writer_socket, 7).unwrap();
        writer.send_credit(&writer_socket, 5).unwrap();
        let mut bytes = vec![0u8; 2 * (9 + crate::auth::SEAL)];
        (&reader_socket).read_exact(&mut bytes).unwrap();
        assert_eq!(reader.take(&bytes, &mut credit).unwrap(), [CREDIT, CREDIT]);
        assert_eq!(credit, 7);
        // A forged DONE (a byte without its seal, or another key's) fails.
        let mut forger =
            BackWriter { sealer: Sealer::new(seals_key_of("another job's secret, as long")), unsent: Vec::new() };
        forger.send(&writer_socket, DONE).unwrap();
        let mut frame = vec![0u8; 1 + crate::auth::SEAL];
        (&reader_socket).read_exact(&mut frame).unwrap();
        assert!(reader.take(&frame, &mut credit).unwrap_err().contains("seal is wrong"));
    }

    /// A receiving rank's listener admits only the sending rank of the job: a silent connection, a
    /// process without the job's key that names the boundary, and a second claim of a boundary
    /// already taken are closed, the real sender is admitted, and both ends derive the same
    /// record keys (the listener used to take the first connection that sent the public magic).
    #[test]
    fn a_boundary_listener_admits_only_the_jobs_sender() {
        let job = JobAccess::Secret(JobSecret::new("a job secret for the tests").unwrap()).key();
        let intruder = JobAccess::Secret(JobSecret::new("an intruder's guess at one").unwrap()).key();
        let plan = crate::pp::plan::BoundaryPlan::nccl_between_ranks_for_tests;
        let cross = vec![plan(0), plan(1)];
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let timeout = Duration::from_secs(10);
        std::thread::scope(|scope| {
            let receiver = {
                let (cross, job) = (cross.clone(), job.clone());
                scope.spawn(move || accept_inbound(&listener, &cross, 1, timeout, &job))
            };
            let _silent = TcpStream::connect(addr).unwrap();
            let refused = connect_outbound(&plan(0), addr, timeout, &intruder).map(|_| ()).unwrap_err();
            assert!(refused.to_string().contains("another job secret"), "{refused}");
            let start = Instant::now();
            let (mut socket, forward, _) = connect_outbound(&plan(0), addr, timeout, &job).unwrap();
            assert!(start.elapsed() < Duration::from_secs(1), "the sender waited {:?}", start.elapsed());
            let twice = connect_outbound(&plan(0), addr, timeout, &job).map(|_| ()).unwrap_err();
            assert!(twice.to_string().contains("does not take this boundary"), "{twice}");
            let (_socket1, _, _) = connect_outbound(&plan(1), addr, timeout, &job).unwrap();
            let mut inbound = receiver.join().unwrap().unwrap();
            let (mut reader, rx_forward, _) = inbound.remove(&0).unwrap();
            reader.set_read_timeout(Some(Duration::from_millis(20))).unwrap();
            socket.write_all(&encode_record(&mut Sealer::new(forward), DATA, 0, 8, 4, "f32")).unwrap();
            let record = read_until_record(&mut reader, &mut Vec::new(), &mut Opener::new(rx_forward)).unwrap();
            assert!(matches!(record, Record::Data(step) if step.n == 8));
        });
    }

    fn seals_key_of(secret: &str) -> crate::auth::JobKey {
        JobAccess::Secret(JobSecret::new(secret).unwrap()).key().derive(&[b"back"])
    }

    #[test]
    fn a_type_name_longer_than_a_record_carries_is_refused_before_sending() {
        let longest: &'static str = Box::leak("t".repeat(MAX_TYPE_NAME).into_boxed_str());
        check_type_name(3, longest).unwrap();
        let long: &'static str = Box::leak("t".repeat(MAX_TYPE_NAME + 1).into_boxed_str());
        let err = check_type_name(3, long).unwrap_err();
        assert!(
            matches!(err, Error::Pipeline(PpError::TypeNameTooLong { boundary: 3, name, max: MAX_TYPE_NAME }) if name == long),
            "{err}"
        );
        assert!(err.to_string().contains(&format!("{} bytes", MAX_TYPE_NAME + 1)), "{err}");
    }

    #[test]
    fn a_receiver_phase_reads_back_as_set() {
        let cell = PhaseCell::new();
        assert!(matches!(cell.get(), ReceiverState::AwaitingRecord { step: 0, .. }));
        for (phase, step) in
            [(Phase::AwaitingFreeSlot, 7), (Phase::Posting, (1u64 << 62) - 1), (Phase::AwaitingRecord, 8)]
        {
            cell.set(phase, step);
            let state = cell.get();
            let (got_phase, got_step) = match state {
                ReceiverState::AwaitingRecord { step, waited } => (Phase::AwaitingRecord as u8, (step, waited)),
                ReceiverState::AwaitingFreeSlot { step, waited } => (Phase::AwaitingFreeSlot as u8, (step, waited)),
                ReceiverState::Posting { step, waited } => (Phase::Posting as u8, (step, waited)),
                other => panic!("{other}"),
            };
            assert_eq!((got_phase, got_step.0), (phase as u8, step));
            assert!(got_step.1 < Duration::from_secs(5));
        }
        cell.set(Phase::Stopped, 9);
        assert_eq!(cell.get(), ReceiverState::Stopped);
    }

    #[test]
    fn type_names_from_the_wire_are_kept_once() {
        let a = intern("my_type_from_the_wire").unwrap();
        let b = intern(&String::from("my_type_from_the_wire")).unwrap();
        assert!(std::ptr::eq(a, b));
        assert_eq!(a, "my_type_from_the_wire");
    }
}
