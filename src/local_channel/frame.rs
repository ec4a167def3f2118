//! The frames of a local channel: a sealed record, and the file descriptors that travel with it
//! (`SCM_RIGHTS`), each named by the record (its kind, its byte size, its step or slot index).
//!
//! A frame is `length (u32) ‖ body ‖ seal`; the body of a descriptor frame is a count and, per
//! descriptor, `kind (u8) ‖ bytes (u64) ‖ index (u32)`. The descriptors ride on the frame's first
//! byte. Every descriptor the kernel hands over is owned at once ([`OwnedFd`]): whatever the
//! check decides, a descriptor the caller does not get is closed before the call returns.

use std::io::{ErrorKind, IoSlice, IoSliceMut};
use std::mem::MaybeUninit;
use std::os::fd::{BorrowedFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::time::Instant;

use rustix::net::{
    RecvAncillaryBuffer, RecvAncillaryMessage, RecvFlags, ReturnFlags, SendAncillaryBuffer, SendAncillaryMessage,
    SendFlags,
};

use super::LocalChannelError;
use crate::auth::{Opener, SEAL, Sealer};

/// The most descriptors one frame carries.
pub const MAX_FDS: usize = 16;
/// The longest body of a frame.
pub(super) const MAX_BODY: usize = 64 << 10;
/// Bytes of one descriptor's entry in a record.
const ENTRY: usize = 1 + 8 + 4;

/// What a passed file descriptor is: the receiver names the kinds it expects, in order, and any
/// other record is refused with every descriptor closed.
///
/// ```no_run
/// use ppnrt::local_channel::{FdKind, LocalChannel};
///
/// # fn receive(channel: &mut LocalChannel) -> Result<(), ppnrt::local_channel::LocalChannelError> {
/// let received = channel.recv_fds(&[FdKind::ControlBlock, FdKind::SlotMemory, FdKind::SlotMemory])?;
/// assert_eq!(received[0].entry.kind, FdKind::ControlBlock);
/// # Ok(())
/// # }
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum FdKind {
    /// A slot's device memory, exported by its owner (`cuMemExportToShareableHandle`, a POSIX
    /// file descriptor).
    SlotMemory,
    /// The shared control block ([`ControlBlock`](super::ControlBlock)).
    ControlBlock,
    /// A boundary's flag words in device memory, exported by the receiving rank.
    Flags,
}

impl FdKind {
    fn code(self) -> u8 {
        match self {
            FdKind::SlotMemory => 1,
            FdKind::ControlBlock => 2,
            FdKind::Flags => 3,
        }
    }

    fn of(code: u8) -> Option<FdKind> {
        match code {
            1 => Some(FdKind::SlotMemory),
            2 => Some(FdKind::ControlBlock),
            3 => Some(FdKind::Flags),
            _ => None,
        }
    }
}

/// One passed descriptor as the record names it.
///
/// ```no_run
/// use std::os::fd::AsFd;
/// use ppnrt::local_channel::{FdEntry, FdKind, LocalChannel};
///
/// # fn send(channel: &mut LocalChannel, slot: std::os::fd::OwnedFd) -> Result<(), ppnrt::local_channel::LocalChannelError> {
/// let entry = FdEntry { kind: FdKind::SlotMemory, bytes: 1 << 20, index: 0 };
/// channel.send_fds(&[entry], &[slot.as_fd()])?;
/// # Ok(())
/// # }
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct FdEntry {
    /// What it is.
    pub kind: FdKind,
    /// Its size in bytes (an allocation's, the block's).
    pub bytes: u64,
    /// Its slot (or step) index.
    pub index: u32,
}

/// A descriptor received with its entry; closed when dropped.
///
/// ```no_run
/// use ppnrt::local_channel::{FdKind, LocalChannel, ReceivedFd};
///
/// # fn receive(channel: &mut LocalChannel) -> Result<(), ppnrt::local_channel::LocalChannelError> {
/// let mut received: Vec<ReceivedFd> = channel.recv_fds(&[FdKind::SlotMemory])?;
/// let slot = received.remove(0);
/// println!("slot {} of {} bytes", slot.entry.index, slot.entry.bytes);
/// let _fd = slot.fd; // an `OwnedFd`, e.g. for `ImportedMemory::import`
/// # Ok(())
/// # }
/// ```
#[derive(Debug)]
pub struct ReceivedFd {
    /// What the record says it is.
    pub entry: FdEntry,
    /// The descriptor.
    pub fd: OwnedFd,
}

/// The body of a record naming `entries`.
pub(super) fn encode(entries: &[FdEntry]) -> Vec<u8> {
    let mut body = Vec::with_capacity(1 + entries.len() * ENTRY);
    body.push(entries.len() as u8);
    for entry in entries {
        body.push(entry.kind.code());
        body.extend_from_slice(&entry.bytes.to_le_bytes());
        body.extend_from_slice(&entry.index.to_le_bytes());
    }
    body
}

/// The entries a record's body names; an error for a body that is none.
pub(super) fn decode(body: &[u8]) -> Result<Vec<FdEntry>, String> {
    let Some((&count, rest)) = body.split_first() else { return Err("an empty record".into()) };
    let count = usize::from(count);
    if count > MAX_FDS || rest.len() != count * ENTRY {
        return Err(format!("a record of {} byte(s) naming {count} descriptor(s)", body.len()));
    }
    rest.chunks_exact(ENTRY)
        .map(|entry| {
            let kind = FdKind::of(entry[0]).ok_or_else(|| format!("an unknown descriptor kind {}", entry[0]))?;
            let bytes = u64::from_le_bytes(entry[1..9].try_into().expect("eight bytes"));
            let index = u32::from_le_bytes(entry[9..13].try_into().expect("four bytes"));
            Ok(FdEntry { kind, bytes, index })
        })
        .collect()
}

/// Writes one sealed frame of `body` with `fds` riding on its first byte, by `deadline`.
pub(super) fn send(
    stream: &UnixStream,
    sealer: &mut Sealer,
    body: &[u8],
    fds: &[BorrowedFd<'_>],
    deadline: Instant,
) -> Result<(), LocalChannelError> {
    let mut frame = Vec::with_capacity(4 + body.len() + SEAL);
    frame.extend_from_slice(&(body.len() as u32).to_le_bytes());
    frame.extend_from_slice(body);
    let mut sealed = body.to_vec();
    sealer.seal(&mut sealed);
    frame.extend_from_slice(&sealed[body.len()..]);
    let mut space = [MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(MAX_FDS))];
    let mut control = SendAncillaryBuffer::new(&mut space);
    if !fds.is_empty() && !control.push(SendAncillaryMessage::ScmRights(fds)) {
        return Err(LocalChannelError::Record { what: format!("{} descriptors do not fit one frame", fds.len()) });
    }
    let mut written = 0;
    while written < frame.len() {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(LocalChannelError::Timeout { what: "the peer to read a frame (it does not read)".into() });
        }
        stream.set_write_timeout(Some(left)).map_err(|e| LocalChannelError::io("setting a write deadline", e))?;
        // The descriptors go with the first bytes only.
        let sent = if written == 0 {
            rustix::net::sendmsg(stream, &[IoSlice::new(&frame)], &mut control, SendFlags::NOSIGNAL)
        } else {
            rustix::net::send(stream, &frame[written..], SendFlags::NOSIGNAL)
        };
        match sent.map_err(std::io::Error::from) {
            Ok(0) => return Err(LocalChannelError::PeerClosed { what: "writing a frame".into() }),
            Ok(n) => written += n,
            Err(e) if e.kind() == ErrorKind::Interrupted => {}
            Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => {}
            Err(e) if e.kind() == ErrorKind::BrokenPipe => {
                return Err(LocalChannelError::PeerClosed { what: "writing a frame".into() });
            }
            Err(e) => return Err(LocalChannelError::io("writing a frame", e)),
        }
    }
    Ok(())
}

/// Reads one frame by `deadline`: its body once its seal opens, and every descriptor that came
/// with it (owned: dropping them closes them). A frame longer than `max_body`, with a seal that
/// does not open, or whose descriptors the kernel had to cut short is an error, its descriptors
/// closed. `torn` is set once any byte of the frame is read (an error then leaves the stream
/// mid-frame).
pub(super) fn receive(
    stream: &UnixStream,
    opener: &mut Opener,
    max_body: usize,
    deadline: Instant,
    torn: &mut bool,
) -> Result<(Vec<u8>, Vec<OwnedFd>), LocalChannelError> {
    let mut fds = Vec::new();
    let mut read = Vec::new();
    let mut want = 4;
    let mut chunk = [0u8; 4096];
    while read.len() < want {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(LocalChannelError::Timeout { what: "a frame from the peer (it stopped)".into() });
        }
        stream.set_read_timeout(Some(left)).map_err(|e| LocalChannelError::io("setting a read deadline", e))?;
        let mut space = [MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(MAX_FDS))];
        let mut control = RecvAncillaryBuffer::new(&mut space);
        let room = (want - read.len()).min(chunk.len());
        let before = fds.len();
        let received = rustix::net::recvmsg(
            stream,
            &mut [IoSliceMut::new(&mut chunk[..room])],
            &mut control,
            RecvFlags::CMSG_CLOEXEC,
        );
        // Every descriptor that came is owned now, whatever happens next.
        for message in control.drain() {
            if let RecvAncillaryMessage::ScmRights(passed) = message {
                fds.extend(passed);
            }
        }
        let received = match received.map_err(std::io::Error::from) {
            Ok(received) => received,
            Err(e) if e.kind() == ErrorKind::Interrupted => continue,
            Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => continue,
            Err(e) => return Err(LocalChannelError::io("reading a frame", e)),
        };
        // Bytes of the frame are taken from here on: an error leaves the stream mid-frame.
        *torn |= received.bytes > 0;
        if received.flags.contains(ReturnFlags::CTRUNC) {
            return Err(LocalChannelError::Record {
                what: format!(
                    "descriptors cut short (more than {MAX_FDS} with one frame, or none left to this process)"
                ),
            });
        }
        // The descriptors ride on a frame's first bytes only: any that come later (a peer that
        // attaches them to every byte of a long frame) are refused at once, so a frame never
        // holds more than one message's worth (`MAX_FDS`) of this process's descriptors.
        if !read.is_empty() && fds.len() > before {
            return Err(LocalChannelError::Record {
                what: format!(
                    "{} descriptor(s) past the first bytes of a frame (byte {} of it)",
                    fds.len() - before,
                    read.len()
                ),
            });
        }
        if received.bytes == 0 {
            return Err(LocalChannelError::PeerClosed { what: "reading a frame".into() });
        }
        read.extend_from_slice(&chunk[..received.bytes]);
        if want == 4 && read.len() >= 4 {
            let body = u32::from_le_bytes(read[..4].try_into().expect("four bytes")) as usize;
            if body > max_body {
                return Err(LocalChannelError::Record {
                    what: format!("a frame of {body} bytes (at most {max_body})"),
                });
            }
            want = 4 + body + SEAL;
        }
    }
    let (body, seal) = read[4..].split_at(want - 4 - SEAL);
    if !opener.open(body, seal) {
        return Err(LocalChannelError::Unauthenticated {
            what: "a frame whose seal does not open (forged, altered, replayed or reordered)".into(),
        });
    }
    Ok((body.to_vec(), fds))
}

/// Checks a received record against what the caller expects, in order: the same count of
/// entries, of descriptors and of expected kinds, each entry of its expected kind. Returns the
/// pairs; on any difference every descriptor is closed (dropped) and the error names it.
pub(super) fn match_expected(
    body: &[u8],
    fds: Vec<OwnedFd>,
    expected: &[FdKind],
) -> Result<Vec<ReceivedFd>, LocalChannelError> {
    let entries = decode(body).map_err(|what| LocalChannelError::Record { what })?;
    if entries.len() != fds.len() || entries.len() != expected.len() {
        return Err(LocalChannelError::Record {
            what: format!(
                "the record names {} descriptor(s), {} came with it, {} were expected",
                entries.len(),
                fds.len(),
                expected.len()
            ),
        });
    }
    if let Some((at, (entry, kind))) = entries.iter().zip(expected).enumerate().find(|(_, (e, k))| e.kind != **k) {
        return Err(LocalChannelError::Record {
            what: format!("descriptor {at} is named {:?}, {kind:?} was expected", entry.kind),
        });
    }
    Ok(entries.into_iter().zip(fds).map(|(entry, fd)| ReceivedFd { entry, fd }).collect())
}
