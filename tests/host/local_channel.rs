//! The channel between two ranks of one host (`ppnrt::local_channel`), two threads standing in
//! for the ranks: descriptors and the control block pass and both ends see the same memory; a
//! stranger without the job's secret gets nothing and does not keep the rank out, nor does a
//! flood of silent connections; a record of other kinds than expected is refused with every
//! descriptor that came closed; a peer that stops or goes is a typed error in bounded time.

use std::io::{Read, Write};
use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::time::{Duration, Instant};

use ppnrt::local_channel::{
    ControlBlock, FdEntry, FdKind, LocalChannel, LocalChannelError, LocalListener, Side, own_uid,
};
use ppnrt::{JobAccess, JobSecret};

fn access(secret: &str) -> JobAccess {
    JobAccess::Secret(JobSecret::new(secret).unwrap())
}

const SECRET: &str = "the job's secret, 32 bytes long.";

/// A connected pair (listening end, connecting end), within five seconds.
fn pair(purpose: u64) -> (LocalChannel, LocalChannel) {
    let listener = LocalListener::bind(&access(SECRET), purpose).unwrap();
    let path = listener.path().to_path_buf();
    let host = std::thread::spawn(move || listener.accept(Duration::from_secs(5)).unwrap());
    let guest = LocalChannel::connect(&path, &access(SECRET), purpose, Duration::from_secs(5)).unwrap();
    (host.join().unwrap(), guest)
}

#[test]
fn the_socket_lives_in_a_private_directory_removed_with_the_listener() {
    use std::os::unix::fs::MetadataExt;
    let listener = LocalListener::bind(&access(SECRET), 1).unwrap();
    let dir = listener.path().parent().unwrap().to_path_buf();
    let meta = std::fs::metadata(&dir).unwrap();
    assert_eq!(meta.mode() & 0o777, 0o700, "{}", dir.display());
    assert_eq!(meta.uid(), own_uid());
    drop(listener);
    assert!(!dir.exists(), "{} removed", dir.display());
}

#[test]
fn descriptors_and_the_control_block_pass_and_both_ends_share_the_block() {
    let (mut host, mut guest) = pair(2);
    assert_eq!(host.peer().pid, std::process::id() as i32, "the peer's process is recorded");
    assert_eq!(guest.peer().uid, own_uid());
    // The receiving rank creates the block and passes it with a slot's memory (a memfd here).
    let block = ControlBlock::create(2).unwrap();
    let memory = rustix::fs::memfd_create("slot", rustix::fs::MemfdFlags::CLOEXEC).unwrap();
    rustix::io::write(&memory, b"slot bytes").unwrap();
    let entries = [
        FdEntry { kind: FdKind::ControlBlock, bytes: block.byte_len() as u64, index: 0 },
        FdEntry { kind: FdKind::SlotMemory, bytes: 10, index: 1 },
    ];
    host.send_fds(&entries, &[block.fd(), memory.as_fd()]).unwrap();
    let mut received = guest.recv_fds(&[FdKind::ControlBlock, FdKind::SlotMemory]).unwrap();
    assert_eq!(received.iter().map(|r| r.entry).collect::<Vec<_>>(), entries);
    let slot = received.pop().unwrap();
    let mut bytes = [0u8; 10];
    rustix::io::pread(&slot.fd, &mut bytes, 0).unwrap();
    assert_eq!(&bytes, b"slot bytes");
    let theirs = ControlBlock::open(received.pop().unwrap().fd, 2).unwrap();
    theirs.publish_filled(1, 5);
    theirs.beat(Side::Sender);
    assert_eq!((block.filled(1), block.heartbeat(Side::Sender)), (5, 1), "one memory, two mappings");
    // Bytes travel sealed too.
    guest.send_bytes(b"event handles").unwrap();
    assert_eq!(host.recv_bytes(64).unwrap(), b"event handles");
}

/// A socket pair whose second end is passed: once every copy of it is closed, the first end
/// reads end of file at once.
fn probe() -> (UnixStream, OwnedFd) {
    let (kept, passed) = UnixStream::pair().unwrap();
    kept.set_nonblocking(true).unwrap();
    (kept, OwnedFd::from(passed))
}

fn closed_everywhere(kept: &mut UnixStream) -> bool {
    matches!(kept.read(&mut [0u8; 1]), Ok(0))
}

#[test]
fn a_record_of_other_kinds_or_count_is_refused_and_its_descriptors_closed() {
    let (mut host, mut guest) = pair(3);
    let (mut kept, passed) = probe();
    let entries = [FdEntry { kind: FdKind::SlotMemory, bytes: 1, index: 0 }];
    guest.send_fds(&entries, &[passed.as_fd()]).unwrap();
    drop(passed);
    let err = host.recv_fds(&[FdKind::ControlBlock]).unwrap_err();
    assert!(
        matches!(err, LocalChannelError::Record { ref what } if what.contains("ControlBlock was expected")),
        "{err}"
    );
    assert!(closed_everywhere(&mut kept), "the refused descriptor was closed");
    // Two expected, one came.
    let (mut kept, passed) = probe();
    guest.send_fds(&entries, &[passed.as_fd()]).unwrap();
    drop(passed);
    let err = host.recv_fds(&[FdKind::SlotMemory, FdKind::SlotMemory]).unwrap_err();
    assert!(matches!(err, LocalChannelError::Record { .. }), "{err}");
    assert!(closed_everywhere(&mut kept));
    // Bytes expected, a descriptor came.
    let (mut kept, passed) = probe();
    guest.send_fds(&entries, &[passed.as_fd()]).unwrap();
    drop(passed);
    assert!(matches!(host.recv_bytes(64), Err(LocalChannelError::Record { .. })));
    assert!(closed_everywhere(&mut kept));
}

#[test]
fn a_stranger_without_the_secret_gets_nothing_and_the_rank_still_connects() {
    let listener = LocalListener::bind(&access(SECRET), 4).unwrap();
    let path = listener.path().to_path_buf();
    let host = std::thread::spawn(move || listener.accept(Duration::from_secs(5)));
    // A stranger of another job: refused at its knock, told nothing.
    let err = LocalChannel::connect(&path, &access("another job's secret, also long"), 4, Duration::from_secs(2))
        .unwrap_err();
    assert!(matches!(err, LocalChannelError::Unauthenticated { .. }), "{err}");
    // A stranger that answers the challenge with a made-up knock learns nothing more: the
    // listener closes the connection without a word (no welcome).
    let mut guesser = UnixStream::connect(&path).unwrap();
    guesser.set_read_timeout(Some(Duration::from_secs(3))).unwrap();
    let mut challenge = [0u8; 40];
    guesser.read_exact(&mut challenge).unwrap();
    assert_eq!(&challenge[..8], b"PPNRTLC1");
    guesser.write_all(&[7u8; 64]).unwrap();
    let mut after = Vec::new();
    let _ = guesser.read_to_end(&mut after);
    assert!(after.is_empty(), "a stranger's made-up knock got {} byte(s) back", after.len());
    // Silent connections and one that streams garbage.
    let silent: Vec<_> = (0..40).map(|_| UnixStream::connect(&path).unwrap()).collect();
    let mut garbage = UnixStream::connect(&path).unwrap();
    let _ = garbage.write_all(&[0x55; 4096]);
    let start = Instant::now();
    let mut guest = LocalChannel::connect(&path, &access(SECRET), 4, Duration::from_secs(4)).unwrap();
    assert!(start.elapsed() < Duration::from_secs(4));
    let mut host = host.join().unwrap().unwrap();
    guest.send_bytes(b"hello").unwrap();
    assert_eq!(host.recv_bytes(8).unwrap(), b"hello");
    drop(silent);
}

#[test]
fn a_guest_for_another_purpose_is_refused() {
    let listener = LocalListener::bind(&access(SECRET), 5).unwrap();
    let path = listener.path().to_path_buf();
    let host = std::thread::spawn(move || listener.accept(Duration::from_millis(800)));
    let err = LocalChannel::connect(&path, &access(SECRET), 6, Duration::from_secs(2)).unwrap_err();
    assert!(matches!(err, LocalChannelError::Unauthenticated { ref what } if what.contains("purpose 6")), "{err}");
    assert!(matches!(host.join().unwrap(), Err(LocalChannelError::Timeout { .. })));
}

#[test]
fn a_peer_that_stops_or_goes_is_a_typed_error_in_bounded_time() {
    let listener = LocalListener::bind(&access(SECRET), 7).unwrap();
    let path = listener.path().to_path_buf();
    let host = std::thread::spawn(move || listener.accept(Duration::from_millis(400)).unwrap());
    let guest = LocalChannel::connect(&path, &access(SECRET), 7, Duration::from_millis(400)).unwrap();
    let mut host = host.join().unwrap();
    // The peer is alive but sends nothing: a timeout, on time.
    let start = Instant::now();
    let err = host.recv_fds(&[FdKind::SlotMemory]).unwrap_err();
    assert!(matches!(err, LocalChannelError::Timeout { .. }), "{err}");
    assert!(start.elapsed() < Duration::from_secs(2), "{:?}", start.elapsed());
    // The peer is gone.
    drop(guest);
    let err = host.recv_bytes(8).unwrap_err();
    assert!(matches!(err, LocalChannelError::PeerClosed { .. }), "{err}");
    // Nobody listening: the connecting rank's wait is bounded too.
    let start = Instant::now();
    let nowhere = std::env::temp_dir().join("ppnrt-nowhere/channel");
    let err = LocalChannel::connect(&nowhere, &access(SECRET), 7, Duration::from_millis(300)).unwrap_err();
    assert!(matches!(err, LocalChannelError::Timeout { .. }), "{err}");
    assert!(start.elapsed() < Duration::from_secs(2));
}

/// The listener may send the moment `accept` returns: the guest has read the answer whole by
/// then (its first frame, which `accept` waits for, says so), so a frame sent at once never
/// reaches the guest inside the answer and fails its connect. Many connections, each answered
/// and followed by a frame back to back.
#[test]
fn the_listener_may_send_as_soon_as_accept_returns() {
    for purpose in 0..200u64 {
        let listener = LocalListener::bind(&access(SECRET), purpose).unwrap();
        let path = listener.path().to_path_buf();
        let host = std::thread::spawn(move || {
            let mut channel = listener.accept(Duration::from_secs(5)).unwrap();
            channel.send_bytes(b"at once").unwrap();
        });
        let mut guest = LocalChannel::connect(&path, &access(SECRET), purpose, Duration::from_secs(5))
            .unwrap_or_else(|e| panic!("connection {purpose}: {e}"));
        assert_eq!(guest.recv_bytes(64).unwrap(), b"at once", "connection {purpose}");
        host.join().unwrap();
    }
}
