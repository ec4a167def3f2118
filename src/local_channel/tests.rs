//! The channel's guards through its seams: a peer of another user (its credentials stood in: no
//! test can be another user), a record that lies about its descriptors, the control block's
//! refusals.

use std::io::Read;
use std::os::fd::{AsFd, OwnedFd};
use std::time::Duration;

use super::*;
use crate::auth::{JobAccess, JobSecret};

fn access() -> JobAccess {
    JobAccess::Secret(JobSecret::new("the job's secret, 32 bytes long.").unwrap())
}

fn another_user(stream: &UnixStream) -> std::io::Result<PeerCredentials> {
    let real = peer_credentials(stream)?;
    Ok(PeerCredentials { uid: real.uid.wrapping_add(1), ..real })
}

/// A connected pair: (listening end, connecting end).
fn pair(purpose: u64) -> (LocalChannel, LocalChannel) {
    let listener = LocalListener::bind(&access(), purpose).unwrap();
    let path = listener.path().to_path_buf();
    let host = std::thread::spawn(move || listener.accept(Duration::from_secs(5)).unwrap());
    let guest = LocalChannel::connect(&path, &access(), purpose, Duration::from_secs(5)).unwrap();
    (host.join().unwrap(), guest)
}

/// A socket pair whose second end is passed: once every copy of it is closed, reading the first
/// end gives end of file at once.
fn pipe() -> (UnixStream, OwnedFd) {
    let (read, write) = UnixStream::pair().unwrap();
    (read, OwnedFd::from(write))
}

/// Whether every copy of the passed end is closed (the kept end sees end of file).
fn closed_everywhere(read: &mut UnixStream) -> bool {
    read.set_nonblocking(true).unwrap();
    matches!(read.read(&mut [0u8; 1]), Ok(0))
}

#[test]
fn check_peer_refuses_another_user_and_names_both() {
    let me = PeerCredentials { pid: 42, uid: 1000, gid: 1000 };
    assert_eq!(check_peer(me, 1000), Ok(me));
    let err = check_peer(me, 1001).unwrap_err();
    assert_eq!(err, LocalChannelError::WrongUser { expected: 1001, found: 1000, pid: 42 });
    assert!(err.to_string().contains("pid 42") && err.to_string().contains("uid 1000"), "{err}");
}

#[test]
fn a_listener_of_another_user_gets_nothing_past_the_handshake() {
    let listener = LocalListener::bind(&access(), 5).unwrap();
    let path = listener.path().to_path_buf();
    let host = std::thread::spawn(move || listener.accept(Duration::from_millis(800)));
    let err = LocalChannel::connect_with(&path, &access(), 5, Duration::from_secs(2), another_user).unwrap_err();
    assert!(matches!(err, LocalChannelError::WrongUser { .. }), "{err}");
    // The listener never got the purpose: it waited out its time.
    let err = host.join().unwrap().unwrap_err();
    assert!(matches!(err, LocalChannelError::Timeout { .. }), "{err}");
}

#[test]
fn a_guest_of_another_user_is_closed_unanswered_and_the_listener_waits_on() {
    let listener = LocalListener::bind(&access(), 6).unwrap();
    let path = listener.path().to_path_buf();
    let host = std::thread::spawn(move || listener.accept_with(Duration::from_millis(1500), another_user));
    let err = LocalChannel::connect(&path, &access(), 6, Duration::from_millis(700)).unwrap_err();
    assert!(matches!(err, LocalChannelError::Unauthenticated { .. } | LocalChannelError::Timeout { .. }), "{err}");
    let err = host.join().unwrap().unwrap_err();
    assert!(matches!(err, LocalChannelError::Timeout { ref what } if what.contains("other users")), "{err}");
}

#[test]
fn a_record_naming_fewer_descriptors_than_came_is_refused_and_every_one_closed() {
    let (mut host, mut guest) = pair(7);
    let (mut read_a, write_a) = pipe();
    let (mut read_b, write_b) = pipe();
    // One entry, two descriptors: a lying sender (the public call refuses to send this).
    let entries = [FdEntry { kind: FdKind::SlotMemory, bytes: 4096, index: 0 }];
    guest.send_raw(&frame::encode(&entries), &[write_a.as_fd(), write_b.as_fd()]).unwrap();
    drop((write_a, write_b));
    let err = host.recv_fds(&[FdKind::SlotMemory]).unwrap_err();
    assert!(matches!(err, LocalChannelError::Record { ref what } if what.contains("2 came")), "{err}");
    assert!(closed_everywhere(&mut read_a) && closed_everywhere(&mut read_b), "the received copies were closed");
}

#[test]
fn the_public_send_refuses_entries_that_do_not_match_its_descriptors() {
    let (_host, mut guest) = pair(8);
    let (_read, write) = pipe();
    let err = guest.send_fds(&[], &[write.as_fd()]).unwrap_err();
    assert!(matches!(err, LocalChannelError::Record { .. }), "{err}");
}

#[test]
fn a_forged_frame_is_refused_with_its_descriptors_closed() {
    let (mut host, mut guest) = pair(9);
    let (mut read, write) = pipe();
    // Sealed at the wrong position: the sealer of another channel's first frame.
    guest.sealer = Sealer::new(access().key().derive(&[b"another channel"]));
    let entries = [FdEntry { kind: FdKind::SlotMemory, bytes: 1, index: 0 }];
    guest.send_fds(&entries, &[write.as_fd()]).unwrap();
    drop(write);
    let err = host.recv_fds(&[FdKind::SlotMemory]).unwrap_err();
    assert!(matches!(err, LocalChannelError::Unauthenticated { .. }), "{err}");
    assert!(closed_everywhere(&mut read));
}

#[test]
fn a_block_without_its_size_sealed_is_refused() {
    let fd = rustix::fs::memfd_create("unsealed", rustix::fs::MemfdFlags::CLOEXEC).unwrap();
    rustix::fs::ftruncate(&fd, ControlBlock::byte_size(2) as u64).unwrap();
    let err = ControlBlock::open(fd, 2).unwrap_err();
    assert!(matches!(err, LocalChannelError::Block { ref what } if what.contains("not sealed")), "{err}");
}

/// A sealed memfd of `bytes` bytes holding `words` from its start.
fn sealed(bytes: usize, words: &[u64]) -> OwnedFd {
    let fd = rustix::fs::memfd_create("block", rustix::fs::MemfdFlags::CLOEXEC | rustix::fs::MemfdFlags::ALLOW_SEALING)
        .unwrap();
    let data: Vec<u8> = words.iter().flat_map(|w| w.to_le_bytes()).collect();
    rustix::io::write(&fd, &data).unwrap();
    rustix::fs::ftruncate(&fd, bytes as u64).unwrap();
    rustix::fs::fcntl_add_seals(&fd, rustix::fs::SealFlags::SHRINK | rustix::fs::SealFlags::GROW).unwrap();
    fd
}

#[test]
fn a_block_of_the_wrong_size_magic_version_or_slot_count_is_refused() {
    let shape = |version: u64, slots: u64| version | (slots << 32);
    let good = [ControlBlock::MAGIC, shape(u64::from(ControlBlock::VERSION), 2)];
    let block = ControlBlock::open(sealed(ControlBlock::byte_size(2), &good), 2).unwrap();
    assert_eq!((block.slots(), block.byte_len()), (2, 192 + 64 * ControlBlock::ANNOUNCEMENTS));
    let refused = |fd: OwnedFd, slots: usize, says: &str| {
        let err = ControlBlock::open(fd, slots).unwrap_err();
        assert!(matches!(err, LocalChannelError::Block { ref what } if what.contains(says)), "{err} lacks {says}");
    };
    refused(sealed(ControlBlock::byte_size(2) - 64, &good), 2, "2176 bytes, 2240 expected");
    refused(sealed(ControlBlock::byte_size(2), &[0x1234, shape(2, 2)]), 2, "magic");
    // Blocks of the earlier layouts (no announcement lines; a sleep word woken over the
    // connection), sized as this one.
    refused(sealed(ControlBlock::byte_size(2), &[ControlBlock::MAGIC, shape(1, 2)]), 2, "version 1, 3 expected");
    refused(sealed(ControlBlock::byte_size(2), &[ControlBlock::MAGIC, shape(2, 2)]), 2, "version 2, 3 expected");
    refused(sealed(ControlBlock::byte_size(3), &[ControlBlock::MAGIC, shape(3, 2)]), 3, "2 slot(s), 3 expected");
    assert!(ControlBlock::create(0).is_err() && ControlBlock::create(ControlBlock::MAX_SLOTS + 1).is_err());
}

#[test]
fn the_block_layout_is_as_documented() {
    assert_eq!(ControlBlock::byte_size(1), 128 + 64 * 32);
    let block = ControlBlock::create(3).unwrap();
    block.publish_filled(2, 11);
    block.publish_consumed(2, 10);
    block.beat(Side::Receiver);
    block.beat(Side::Sender);
    block.beat(Side::Sender);
    block.announce(33, 700);
    block.take_announcements(30);
    block.set_receiver_asleep(true);
    let mut bytes = vec![0u8; block.byte_len()];
    rustix::io::pread(block.fd(), &mut bytes, 0).unwrap();
    let word = |at: usize| u64::from_le_bytes(bytes[at..at + 8].try_into().unwrap());
    assert_eq!(word(0), ControlBlock::MAGIC);
    assert_eq!(word(8), 3 | (3 << 32));
    assert_eq!((word(16), word(24)), (1, 2));
    assert_eq!((word(32), word(40)), (31, 1));
    assert_eq!((word(64 + 128), word(72 + 128)), (11, 10));
    // Step 33 in announcement line 1 (after the header line and three slot lines).
    assert_eq!((word(64 * (1 + 3 + 1)), word(64 * (1 + 3 + 1) + 8)), (34, 700));
    assert_eq!((block.filled(0), block.consumed(1)), (0, 0));
    assert_eq!((block.announced(33), block.announced(1), block.announcements_taken()), (Some(700), None, 31));
    assert!(block.receiver_asleep());
}

/// The receiver's sleep on the block's sleep word, through two mappings of one block (as the two
/// ranks have): a wake from the other mapping ends it long before its timeout, a wake that came
/// before the sleep began ends it at once, a sender finds no one to wake when the receiver is
/// awake, and with no wake the sleep lasts its timeout.
#[test]
fn a_receiver_asleep_on_the_block_is_woken_through_the_other_mapping() {
    use std::time::{Duration, Instant};
    let receiver = ControlBlock::create(2).unwrap();
    let sender = ControlBlock::open(receiver.fd().try_clone_to_owned().unwrap(), 2).unwrap();
    assert!(!sender.wake_receiver(), "a wake with the receiver awake");
    std::thread::scope(|scope| {
        receiver.set_receiver_asleep(true);
        let sleeping = scope.spawn(|| {
            let start = Instant::now();
            receiver.sleep_while_asleep(Duration::from_secs(20));
            start.elapsed()
        });
        std::thread::sleep(Duration::from_millis(50));
        assert!(sender.receiver_asleep());
        assert!(sender.wake_receiver());
        let slept = sleeping.join().unwrap();
        assert!(slept < Duration::from_secs(5), "the woken sleep lasted {slept:?}");
    });
    // Woken before it slept: the sleep ends at once.
    receiver.set_receiver_asleep(true);
    assert!(sender.wake_receiver());
    let start = Instant::now();
    receiver.sleep_while_asleep(Duration::from_secs(20));
    assert!(start.elapsed() < Duration::from_secs(5), "a wake before the sleep was lost");
    // No wake: the timeout.
    receiver.set_receiver_asleep(true);
    let start = Instant::now();
    receiver.sleep_while_asleep(Duration::from_millis(30));
    assert!(start.elapsed() >= Duration::from_millis(25), "the sleep ended early: {:?}", start.elapsed());
    receiver.set_receiver_asleep(false);
    assert!(!sender.receiver_asleep());
}

/// A stranger (any process of the user may map the block) waiting on the sleep word before the
/// receiver does cannot absorb the sender's wake: every waiter is woken, the receiver with it,
/// long before its timeout (a wake of one waiter went to the first queued, the stranger).
#[test]
fn a_strangers_wait_on_the_sleep_word_does_not_absorb_the_receivers_wake() {
    use std::time::Instant;
    let receiver = ControlBlock::create(2).unwrap();
    let other = || ControlBlock::open(receiver.fd().try_clone_to_owned().unwrap(), 2).unwrap();
    let (sender, stranger) = (other(), other());
    receiver.set_receiver_asleep(true);
    std::thread::scope(|scope| {
        let stranger = scope.spawn(|| stranger.sleep_while_asleep(Duration::from_secs(4)));
        std::thread::sleep(Duration::from_millis(100));
        let sleeping = scope.spawn(|| {
            let start = Instant::now();
            receiver.sleep_while_asleep(Duration::from_secs(4));
            start.elapsed()
        });
        std::thread::sleep(Duration::from_millis(100));
        assert!(sender.wake_receiver());
        let slept = sleeping.join().unwrap();
        assert!(slept < Duration::from_secs(2), "the receiver slept {slept:?}: its wake went to the stranger");
        stranger.join().unwrap();
    });
}

/// Writes `bytes` with `fds` attached, as a lying peer would (no frame, no seal).
fn send_with_fds(stream: &UnixStream, bytes: &[u8], fds: &[std::os::fd::BorrowedFd<'_>]) {
    use rustix::net::{SendAncillaryBuffer, SendAncillaryMessage, SendFlags};
    let mut space = [std::mem::MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(2 * MAX_FDS))];
    let mut control = SendAncillaryBuffer::new(&mut space);
    assert!(fds.is_empty() || control.push(SendAncillaryMessage::ScmRights(fds)));
    let sent = rustix::net::sendmsg(stream, &[std::io::IoSlice::new(bytes)], &mut control, SendFlags::NOSIGNAL);
    assert_eq!(sent.unwrap(), bytes.len());
}

#[test]
fn descriptors_past_a_frames_first_bytes_are_refused_at_once_and_closed() {
    let (mut host, guest) = pair(10);
    host.timeout = Duration::from_secs(3);
    let (mut read_a, write_a) = pipe();
    let (mut read_b, write_b) = pipe();
    // A frame of 100 bytes announced with one descriptor, then one byte of it with another,
    // then nothing: a peer that would attach descriptors to every byte of a long frame.
    send_with_fds(&guest.stream, &100u32.to_le_bytes(), &[write_a.as_fd()]);
    send_with_fds(&guest.stream, &[1], &[write_b.as_fd()]);
    drop((write_a, write_b));
    let start = std::time::Instant::now();
    let err = host.recv_fds(&[FdKind::SlotMemory]).unwrap_err();
    assert!(matches!(err, LocalChannelError::Record { ref what } if what.contains("past the first bytes")), "{err}");
    assert!(start.elapsed() < Duration::from_secs(2), "refused as they came, not when the frame ended");
    assert!(closed_everywhere(&mut read_a) && closed_everywhere(&mut read_b), "the received copies were closed");
    drop(guest);
}

#[test]
fn a_listener_whose_queue_is_full_costs_the_connecting_rank_only_its_timeout() {
    use rustix::net::{AddressFamily, SocketAddrUnix, SocketFlags, SocketType};
    // A peer that listens and never accepts, its queue full (it stopped, or is flooded).
    let dir = std::env::temp_dir().join(format!("ppnrt-full-queue-{}", std::process::id()));
    std::fs::create_dir(&dir).unwrap();
    let path = dir.join("channel");
    let addr = SocketAddrUnix::new(&path).unwrap();
    let socket = |flags| rustix::net::socket_with(AddressFamily::UNIX, SocketType::STREAM, flags, None).unwrap();
    let listener = socket(SocketFlags::CLOEXEC);
    rustix::net::bind(&listener, &addr).unwrap();
    rustix::net::listen(&listener, 0).unwrap();
    let mut queued = Vec::new();
    loop {
        let stream = socket(SocketFlags::CLOEXEC | SocketFlags::NONBLOCK);
        match rustix::net::connect(&stream, &addr) {
            Ok(()) => queued.push(stream),
            Err(rustix::io::Errno::AGAIN) => break,
            Err(e) => panic!("{e}"),
        }
        assert!(queued.len() < 64, "the queue never filled");
    }
    let (tx, rx) = std::sync::mpsc::channel();
    let connecting = path.clone();
    std::thread::spawn(move || {
        let _ = tx.send(LocalChannel::connect(&connecting, &access(), 11, Duration::from_millis(300)));
    });
    let result = rx.recv_timeout(Duration::from_secs(5)).expect("the connection gave up within its timeout");
    assert!(matches!(result, Err(LocalChannelError::Timeout { .. })), "{result:?}");
    drop((queued, listener));
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn a_block_that_is_no_memfd_is_refused_by_name() {
    let refused = |fd: OwnedFd, says: &str| {
        let raw = std::os::fd::AsRawFd::as_raw_fd(&fd);
        let err = ControlBlock::open(fd, 1).unwrap_err();
        let named = format!("descriptor {raw} is not a memfd ({says})");
        assert!(matches!(err, LocalChannelError::Block { ref what } if what == &named), "{err}");
    };
    let (socket, _other) = UnixStream::pair().unwrap();
    refused(socket.into(), "a socket");
    let mut ends = [0; 2];
    // SAFETY: `pipe2` writes two new descriptors into `ends`, each owned once just below.
    assert_eq!(unsafe { libc::pipe2(ends.as_mut_ptr(), libc::O_CLOEXEC) }, 0);
    // SAFETY: both are fresh descriptors of this process that nothing else owns.
    let (pipe, _writer) = unsafe {
        use std::os::fd::FromRawFd;
        (OwnedFd::from_raw_fd(ends[0]), OwnedFd::from_raw_fd(ends[1]))
    };
    refused(pipe, "a pipe");
    refused(std::fs::File::open(std::env::temp_dir()).unwrap().into(), "a directory");
    refused(std::fs::File::open("/dev/null").unwrap().into(), "a character device");
}

#[test]
fn a_timeout_without_end_waits_rather_than_overflows() {
    let listener = LocalListener::bind(&access(), 12).unwrap();
    let path = listener.path().to_path_buf();
    let host = std::thread::spawn(move || listener.accept(Duration::MAX));
    let mut guest = LocalChannel::connect(&path, &access(), 12, Duration::MAX).unwrap();
    let mut host = host.join().unwrap().unwrap();
    guest.send_bytes(b"no end").unwrap();
    assert_eq!(host.recv_bytes(16).unwrap(), b"no end");
    let (_read, write) = pipe();
    host.send_fds(&[FdEntry { kind: FdKind::ControlBlock, bytes: 64, index: 0 }], &[write.as_fd()]).unwrap();
    assert_eq!(guest.recv_fds(&[FdKind::ControlBlock]).unwrap().len(), 1);
}

#[test]
fn more_descriptors_than_a_frame_holds_are_cut_short_refused_and_closed() {
    let (mut host, guest) = pair(13);
    let (mut read, write) = pipe();
    let copies: Vec<OwnedFd> = (0..MAX_FDS + 4).map(|_| write.try_clone().unwrap()).collect();
    let borrowed: Vec<_> = copies.iter().map(|fd| fd.as_fd()).collect();
    send_with_fds(&guest.stream, &100u32.to_le_bytes(), &borrowed);
    drop((write, copies));
    let err = host.recv_fds(&[FdKind::SlotMemory]).unwrap_err();
    assert!(matches!(err, LocalChannelError::Record { ref what } if what.contains("cut short")), "{err}");
    assert!(closed_everywhere(&mut read), "the descriptors that came were closed, the kernel closed the rest");
    drop(guest);
}

#[test]
fn a_length_past_the_bound_is_refused_before_any_of_it_is_read() {
    let (mut host, guest) = pair(14);
    host.timeout = Duration::from_secs(3);
    let huge = u32::MAX.to_le_bytes();
    send_with_fds(&guest.stream, &huge, &[]);
    let start = std::time::Instant::now();
    let err = host.recv_bytes(usize::MAX).unwrap_err();
    let named = format!("a frame of {} bytes (at most {})", u32::MAX, frame::MAX_BODY);
    assert!(matches!(err, LocalChannelError::Record { ref what } if what == &named), "{err}");
    assert!(start.elapsed() < Duration::from_secs(2), "refused at its length, not after waiting for the body");
    drop(guest);
}

#[test]
fn a_channel_left_mid_frame_takes_no_further_frame_and_a_clean_timeout_leaves_it_whole() {
    let (mut host, mut guest) = pair(15);
    host.timeout = Duration::from_millis(200);
    // Nothing came: the channel stays whole.
    assert!(matches!(host.recv_bytes(16), Err(LocalChannelError::Timeout { .. })));
    guest.send_bytes(b"late").unwrap();
    assert_eq!(host.recv_bytes(16).unwrap(), b"late");
    // A frame cut off after its length: the receive times out mid-frame, and whatever comes
    // next is not read as a frame (it would be misread as a forgery).
    send_with_fds(&guest.stream, &10u32.to_le_bytes(), &[]);
    let err = host.recv_bytes(16).unwrap_err();
    assert!(matches!(err, LocalChannelError::Timeout { .. }), "{err}");
    send_with_fds(&guest.stream, &[0; 10 + crate::auth::SEAL], &[]);
    guest.send_bytes(b"next").unwrap();
    let err = host.recv_bytes(16).unwrap_err();
    assert!(
        matches!(err, LocalChannelError::Broken { ref earlier } if earlier.contains("within the timeout")),
        "{err}"
    );
}

#[test]
fn a_send_that_failed_spends_its_seal_and_the_channel_takes_no_further_frame() {
    let (_host, mut guest) = pair(16);
    guest.timeout = Duration::from_millis(200);
    // The host never reads: the socket's buffers fill, and a send times out.
    let err = loop {
        if let Err(e) = guest.send_bytes(&[7; 60 << 10]) {
            break e;
        }
    };
    assert!(matches!(err, LocalChannelError::Timeout { .. }), "{err}");
    let err = guest.send_bytes(b"x").unwrap_err();
    assert!(
        matches!(err, LocalChannelError::Broken { ref earlier } if earlier.contains("within the timeout")),
        "{err}"
    );
}
