//! The admission's own rules, on loopback: who is admitted past strangers, whom a newcomer
//! evicts, and which errors of `accept` are transient.

use std::io::Write;
use std::net::{TcpListener, TcpStream};
use std::time::{Duration, Instant};

use super::*;
use crate::auth::{JobAccess, JobSecret};

const MAGIC: &[u8; 8] = b"PPNRTT01";

fn access(secret: &str) -> JobAccess {
    JobAccess::Secret(JobSecret::new(secret).unwrap())
}

fn fixed(read: &[u8]) -> Result<Option<usize>, String> {
    Ok((read.len() >= 4).then_some(4))
}

/// A host admitting on a fresh listener for at most three seconds; returns the admitted message,
/// and the admission's refusals.
fn host_once(
    listener: TcpListener,
    key: JobKey,
    answer: &'static [u8],
) -> std::thread::JoinHandle<(Option<Vec<u8>>, String)> {
    std::thread::spawn(move || {
        let mut admission = Admission::new(&listener, key.clone(), MAGIC, Duration::from_millis(300), 8, 4).unwrap();
        let deadline = Instant::now() + Duration::from_secs(3);
        while Instant::now() < deadline {
            if let Some(mut admitted) = admission.poll(&fixed).unwrap() {
                write_by(&mut admitted.stream, &admitted.handshake.answer(&key, answer), deadline).unwrap();
                return (Some(admitted.message), admission.refusals());
            }
            std::thread::sleep(Duration::from_millis(1));
        }
        (None, admission.refusals())
    })
}

#[test]
fn a_guest_with_the_secret_is_admitted_past_strangers_and_both_sides_get_the_same_keys() {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    let key = access("the job's secret, 32 bytes long.").key();
    let host = host_once(listener, key.clone(), b"ok");
    // A stranger that stays silent, one that speaks another protocol, and one with another key.
    let _silent = TcpStream::connect(addr).unwrap();
    let mut other = TcpStream::connect(addr).unwrap();
    other.write_all(b"GET / HTTP/1.0\r\n\r\n").unwrap();
    let mut wrong = TcpStream::connect(addr).unwrap();
    let deadline = Instant::now() + Duration::from_secs(2);
    let err = knock(&mut wrong, &access("another job's secret, also long").key(), MAGIC, deadline).err().unwrap();
    assert!(matches!(err, KnockError::Closed { after_knock: true }), "{err}");
    // The member.
    let (mut guest, handshake) = connect_and_knock(addr, &key, MAGIC, deadline).unwrap();
    handshake.send_message(&mut guest, &key, b"rank", deadline).unwrap();
    let answer =
        handshake.read_answer(&mut guest, &key, deadline, |read: &[u8]| Ok((read.len() >= 2).then_some(2))).unwrap();
    assert_eq!(answer, b"ok");
    let (message, refusals) = host.join().unwrap();
    assert_eq!(message.as_deref(), Some(&b"rank"[..]));
    assert!(refusals.contains("1 connection(s) did not prove the job secret"), "{refusals}");
}

/// Polls `admission` until `done` holds of it (at most two seconds).
fn poll_until(admission: &mut Admission<'_>, done: impl Fn(&Admission<'_>) -> bool) -> Option<Admitted> {
    let deadline = Instant::now() + Duration::from_secs(2);
    while !done(admission) {
        assert!(Instant::now() < deadline, "the admission never got there");
        if let Some(admitted) = admission.poll(&fixed).unwrap() {
            return Some(admitted);
        }
        std::thread::sleep(Duration::from_millis(1));
    }
    None
}

fn holds(admission: &Admission<'_>, stream: &TcpStream) -> bool {
    let local = stream.local_addr().unwrap();
    admission.pending.iter().any(|p| p.peer == local)
}

/// With the bound reached, a newcomer evicts the oldest connection that has not proved the key,
/// never a member that has (it is admitted afterwards): the strangers that waited longest go
/// first, as OpenSSH's `MaxStartups` drops unauthenticated connections, never members.
#[test]
fn a_newcomer_evicts_the_oldest_unproven_connection_never_a_member() {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    let key = access("the job's secret, 32 bytes long.").key();
    let mut admission = Admission::new(&listener, key.clone(), MAGIC, Duration::from_secs(5), 4, 4).unwrap();
    admission.per_source = usize::MAX;
    let mut member = TcpStream::connect(addr).unwrap();
    poll_until(&mut admission, |a| a.pending.len() == 1);
    let deadline = Instant::now() + Duration::from_secs(2);
    let handshake = std::thread::scope(|scope| {
        let knocking = scope.spawn(|| knock(&mut member, &key, MAGIC, deadline));
        poll_until(&mut admission, |a| a.pending[0].knocked);
        knocking.join().unwrap().unwrap()
    });
    let strangers: Vec<_> = (0..3)
        .map(|n| {
            let stranger = TcpStream::connect(addr).unwrap();
            poll_until(&mut admission, |a| a.pending.len() == 2 + n);
            stranger
        })
        .collect();
    let newcomer = TcpStream::connect(addr).unwrap();
    poll_until(&mut admission, |a| holds(a, &newcomer));
    assert!(!holds(&admission, &strangers[0]), "the oldest stranger is evicted");
    assert!(holds(&admission, &strangers[1]) && holds(&admission, &strangers[2]), "the younger ones stay");
    assert!(holds(&admission, &member), "the member stays");
    assert_eq!(admission.evicted, 1);
    handshake.send_message(&mut member, &key, b"rank", deadline).unwrap();
    let admitted = poll_until(&mut admission, |_| false).expect("the member is admitted");
    assert_eq!(admitted.message, b"rank");
}

/// A source that holds its share of unproven connections evicts its own oldest first, not an
/// older connection of another source: a flood from one address cannot evict the members
/// connecting from others.
#[test]
fn a_source_over_its_share_evicts_its_own_oldest_first() {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    let key = access("the job's secret, 32 bytes long.").key();
    let mut admission = Admission::new(&listener, key, MAGIC, Duration::from_secs(5), 8, 4).unwrap();
    assert_eq!(admission.per_source, 2);
    let elsewhere = TcpStream::connect(addr).unwrap();
    poll_until(&mut admission, |a| a.pending.len() == 1);
    // The first connection stands for one from another host.
    admission.pending[0].peer = "192.0.2.7:4000".parse().unwrap();
    let local: Vec<_> = (0..2)
        .map(|n| {
            let stranger = TcpStream::connect(addr).unwrap();
            poll_until(&mut admission, |a| a.pending.len() == 2 + n);
            stranger
        })
        .collect();
    let newcomer = TcpStream::connect(addr).unwrap();
    poll_until(&mut admission, |a| holds(a, &newcomer));
    assert!(!holds(&admission, &local[0]), "the source's oldest is evicted");
    assert!(holds(&admission, &local[1]));
    assert!(admission.pending.iter().any(|p| p.peer.ip().to_string() == "192.0.2.7"), "the other source's stays");
    drop(elsewhere);
}

/// Running out of descriptors or buffers while accepting, and a connection that failed before
/// it was accepted, are transient; only an error of the listener itself ends the admission.
#[test]
fn only_an_error_of_the_listener_itself_ends_the_admission() {
    let raw = std::io::Error::from_raw_os_error;
    for (error, expected) in [
        (raw(24), AcceptFailure::Descriptors),  // EMFILE
        (raw(23), AcceptFailure::Descriptors),  // ENFILE
        (raw(105), AcceptFailure::Descriptors), // ENOBUFS
        (raw(12), AcceptFailure::Descriptors),  // ENOMEM
        (raw(103), AcceptFailure::Connection),  // ECONNABORTED
        (raw(71), AcceptFailure::Connection),   // EPROTO
        (raw(4), AcceptFailure::Connection),    // EINTR
        (raw(11), AcceptFailure::Drained),      // EAGAIN
        (raw(9), AcceptFailure::Listener),      // EBADF
        (raw(22), AcceptFailure::Listener),     // EINVAL
    ] {
        assert_eq!(accept_failure(&error), expected, "{error}");
    }
}

/// A reader that stalls gets a typed timeout at the deadline, and the other streams their bytes
/// whole in the meantime.
#[test]
fn a_stalled_reader_holds_no_other_write_past_the_deadline() {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    let stalled = TcpStream::connect(addr).unwrap();
    let (stalled_end, _) = listener.accept().unwrap();
    let reading = TcpStream::connect(addr).unwrap();
    let (reading_end, _) = listener.accept().unwrap();
    let big = vec![7u8; 64 << 20];
    let reader = std::thread::spawn(move || {
        let mut all = Vec::new();
        std::io::Read::read_to_end(&mut &reading, &mut all).map(|_| all.len())
    });
    let start = Instant::now();
    let (head, tail) = big.split_at(1000);
    let outcomes = write_each_by(
        &[(&stalled_end, &[head, tail]), (&reading_end, &[head, tail])],
        start + Duration::from_millis(1500),
    );
    let took = start.elapsed();
    assert!(matches!(&outcomes[0], Err(e) if e.kind() == ErrorKind::TimedOut), "{:?}", outcomes[0]);
    assert!(outcomes[1].is_ok(), "{:?}", outcomes[1]);
    assert!(took < Duration::from_millis(2500), "took {took:?}");
    drop(reading_end);
    assert_eq!(reader.join().unwrap().unwrap(), 64 << 20);
    drop(stalled);
}

/// Before a connection proves the key, the host reads no more than the knock: a stranger that
/// sends a knock's worth of garbage and more is closed with the rest unread (the close resets
/// the connection), where reading everything first would have ended it with a clean close.
#[test]
fn a_stranger_is_read_no_further_than_its_knock() {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    let key = access("the job's secret, 32 bytes long.").key();
    let mut admission = Admission::new(&listener, key, MAGIC, Duration::from_millis(300), 8, 4).unwrap();
    let mut stranger = TcpStream::connect(addr).unwrap();
    stranger.write_all(&[0x5a; NONCE + PROOF + 1000]).unwrap();
    std::thread::sleep(Duration::from_millis(20));
    poll_until(&mut admission, |a| a.unproven + a.dropped == 1);
    assert_eq!(admission.unproven, 1, "the knock was read and refused");
    stranger.set_read_timeout(Some(Duration::from_secs(2))).unwrap();
    let mut all = Vec::new();
    let ended = std::io::Read::read_to_end(&mut stranger, &mut all);
    assert!(
        matches!(&ended, Err(e) if e.kind() == ErrorKind::ConnectionReset),
        "{ended:?} after {} byte(s): the host read past the knock",
        all.len()
    );
}
