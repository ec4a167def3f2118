//! The control connection's records: encoding and sealing, reading and checking (whole, however
//! the bytes arrive), the RX rank's sealed answers on the way back, and the element type names
//! the records carry.

use std::io::{ErrorKind, Read, Write};
use std::net::TcpStream;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use super::receiver::Announced;
use super::sender::PEER_CLOSED;
use super::{ALIVE, CLOSE, CREDIT, DATA, DONE, MAX_TYPE_NAME, RECORD_HEAD, WAITING};
use crate::auth::{Opener, SEAL, Sealer};
use crate::pp::error::{Error, PpError, Result};

pub(super) enum Record {
    Data(Announced),
    Close {
        steps: u64,
    },
    Alive,
    /// A `tx_wait` of the TX rank waits for a free slot for step `step`.
    Waiting {
        step: u64,
    },
}

/// A record, sealed at the sender's next position (see [`crate::auth`]).
pub(super) fn encode_record(sealer: &mut Sealer, kind: u8, step: u64, n: u64, elem_size: u64, elem: &str) -> Vec<u8> {
    let mut record = Vec::with_capacity(RECORD_HEAD + elem.len() + SEAL);
    record.extend_from_slice(&[kind, 0, 0, 0]);
    record.extend_from_slice(&(elem.len() as u32).to_le_bytes());
    record.extend_from_slice(&step.to_le_bytes());
    record.extend_from_slice(&n.to_le_bytes());
    record.extend_from_slice(&elem_size.to_le_bytes());
    record.extend_from_slice(elem.as_bytes());
    sealer.seal(&mut record);
    record
}

/// Why a link fails on a record whose seal is wrong.
pub(super) const BROKEN_SEAL: &str =
    "a record whose seal is wrong (forged, altered, replayed, reordered or from another job)";

/// Reads what the connection has into `pending` and returns the first whole record, if any
/// (`Ok(None)` after a quiet poll interval), once `opener` found its seal right. A closed
/// connection, a malformed record or a wrong seal is the reason the link fails; nothing of a
/// record is believed before its seal is checked.
pub(super) fn read_record(
    socket: &mut TcpStream,
    pending: &mut Vec<u8>,
    opener: &mut Opener,
) -> std::result::Result<Option<Record>, String> {
    loop {
        if pending.len() >= RECORD_HEAD {
            let word = |at: usize, len: usize| {
                let mut bytes = [0u8; 8];
                bytes[..len].copy_from_slice(&pending[at..at + len]);
                u64::from_le_bytes(bytes)
            };
            let name_len = word(4, 4) as usize;
            if name_len > MAX_TYPE_NAME {
                return Err(format!("a record with a type name of {name_len} bytes"));
            }
            let sealed = RECORD_HEAD + name_len;
            if pending.len() >= sealed + SEAL {
                if !opener.open(&pending[..sealed], &pending[sealed..sealed + SEAL]) {
                    return Err(BROKEN_SEAL.into());
                }
                let (kind, step, n, elem_size) = (pending[0], word(8, 8), word(16, 8), word(24, 8));
                let name = std::str::from_utf8(&pending[RECORD_HEAD..RECORD_HEAD + name_len])
                    .map_err(|_| "a record whose type name is not UTF-8".to_string())?;
                let record = match kind {
                    DATA => {
                        let elem = intern(name)
                            .ok_or_else(|| format!("more than {MAX_TYPE_NAMES} element type names crossed the wire"))?;
                        let bytes = n
                            .checked_mul(elem_size)
                            .and_then(|bytes| usize::try_from(bytes).ok())
                            .filter(|&bytes| bytes > 0)
                            .ok_or_else(|| format!("step {step}: {n} element(s) of {elem_size} byte(s) ({name})"))?;
                        Record::Data(Announced { step, n: n as usize, elem, bytes })
                    }
                    CLOSE => Record::Close { steps: step },
                    ALIVE => Record::Alive,
                    WAITING => Record::Waiting { step },
                    other => return Err(format!("a record of unknown kind {other}")),
                };
                pending.drain(..sealed + SEAL);
                return Ok(Some(record));
            }
        }
        let mut chunk = [0u8; 512];
        match socket.read(&mut chunk) {
            Ok(0) => return Err(PEER_CLOSED.into()),
            Ok(read) => pending.extend_from_slice(&chunk[..read]),
            Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => return Ok(None),
            Err(e) if e.kind() == ErrorKind::Interrupted => {}
            Err(e) => return Err(format!("reading the boundary's connection failed: {e}")),
        }
    }
}

/// The RX rank's answers to the TX rank ([`ALIVE`], [`DONE`]), each a kind byte and its seal,
/// written by the watchdog and the receiver thread in turn: what a full connection did not take
/// yet goes out first next time, so frames are never interleaved or cut.
pub(super) struct BackWriter {
    pub(super) sealer: Sealer,
    pub(super) unsent: Vec<u8>,
}

impl BackWriter {
    /// Queues `kind` and writes what the connection takes now (all of it, when it blocks).
    pub(super) fn send(&mut self, socket: &TcpStream, kind: u8) -> std::io::Result<()> {
        self.send_frame(socket, vec![kind])
    }

    /// Queues a [`CREDIT`] of `taken` steps and writes what the connection takes now.
    pub(super) fn send_credit(&mut self, socket: &TcpStream, taken: u64) -> std::io::Result<()> {
        let mut frame = vec![CREDIT];
        frame.extend_from_slice(&taken.to_le_bytes());
        self.send_frame(socket, frame)
    }

    fn send_frame(&mut self, socket: &TcpStream, mut frame: Vec<u8>) -> std::io::Result<()> {
        self.sealer.seal(&mut frame);
        self.unsent.extend_from_slice(&frame);
        self.flush(socket)
    }

    /// Writes what is queued; a non-blocking connection that is full keeps the rest queued.
    pub(super) fn flush(&mut self, mut socket: &TcpStream) -> std::io::Result<()> {
        while !self.unsent.is_empty() {
            match socket.write(&self.unsent) {
                Ok(0) => return Err(ErrorKind::WriteZero.into()),
                Ok(written) => {
                    self.unsent.drain(..written);
                }
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                Err(e) => return Err(e),
            }
        }
        Ok(())
    }
}

/// The TX rank's reading of the RX rank's answers: bytes as they come, frames once whole and
/// their seals right.
pub(super) struct BackReader {
    pub(super) opener: Opener,
    pub(super) pending: Vec<u8>,
}

impl BackReader {
    /// Takes `bytes` and returns the kinds of the frames now whole; a [`CREDIT`] updates
    /// `credit` (the steps the RX stage has taken) as it comes. A wrong seal or an unknown kind is
    /// the reason the link fails.
    pub(super) fn take(&mut self, bytes: &[u8], credit: &mut u64) -> std::result::Result<Vec<u8>, String> {
        self.pending.extend_from_slice(bytes);
        let mut kinds = Vec::new();
        while let Some(&kind) = self.pending.first() {
            let body = match kind {
                ALIVE | DONE => 1,
                CREDIT => 9,
                other => return Err(format!("an answer of unknown kind {other} from the receiving rank")),
            };
            if self.pending.len() < body + SEAL {
                break;
            }
            if !self.opener.open(&self.pending[..body], &self.pending[body..body + SEAL]) {
                return Err(format!("an answer from the receiving rank whose seal is wrong: {BROKEN_SEAL}"));
            }
            if kind == CREDIT {
                let taken = u64::from_le_bytes(self.pending[1..9].try_into().expect("eight bytes"));
                *credit = (*credit).max(taken);
            }
            kinds.push(kind);
            self.pending.drain(..body + SEAL);
        }
        Ok(kinds)
    }
}

/// Refuses, at boundary `boundary`, an element type whose name is longer than a record carries
/// (the receiver would fail the link on it).
pub(super) fn check_type_name(boundary: usize, name: &'static str) -> Result<()> {
    if name.len() > MAX_TYPE_NAME {
        return Err(Error::Pipeline(PpError::TypeNameTooLong { boundary, name, max: MAX_TYPE_NAME }));
    }
    Ok(())
}

/// Element type names met on the wire, each kept once (`SlotState` names a type by a
/// `&'static str`).
pub(super) static TYPE_NAMES: Mutex<Vec<&'static str>> = Mutex::new(Vec::new());

/// The most distinct element type names kept (each at most [`MAX_TYPE_NAME`] bytes).
pub(super) const MAX_TYPE_NAMES: usize = 1024;

/// The name kept once for the process, or `None` when [`MAX_TYPE_NAMES`] are kept already.
pub(super) fn intern(name: &str) -> Option<&'static str> {
    let mut known = TYPE_NAMES.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
    if let Some(&found) = known.iter().find(|&&known| known == name) {
        return Some(found);
    }
    if known.len() >= MAX_TYPE_NAMES {
        return None;
    }
    let leaked: &'static str = Box::leak(name.to_string().into_boxed_str());
    known.push(leaked);
    Some(leaked)
}

/// Fills `bytes` from `socket` by `deadline` (`None`: no bound), the whole read bounded (a peer
/// that trickles its bytes does not stretch it: each read waits only for what is left); the
/// socket's read timeout is none again afterwards, whatever happened. A non-blocking socket is
/// waited on (`poll`) between its reads, not read in a loop.
pub(super) fn read_exact_by(
    socket: &mut TcpStream,
    bytes: &mut [u8],
    deadline: Option<Instant>,
) -> std::io::Result<()> {
    let mut filled = 0;
    let read = loop {
        if filled == bytes.len() {
            break Ok(());
        }
        let left = deadline.map_or(Duration::from_secs(3600), |d| d.saturating_duration_since(Instant::now()));
        if left.is_zero() {
            break Err(std::io::Error::new(
                ErrorKind::TimedOut,
                format!("{filled} of {} byte(s) by the deadline", bytes.len()),
            ));
        }
        if let Err(e) = socket.set_read_timeout(Some(left.max(Duration::from_millis(1)))) {
            break Err(e);
        }
        match socket.read(&mut bytes[filled..]) {
            Ok(0) => break Err(ErrorKind::UnexpectedEof.into()),
            Ok(read) => filled += read,
            // A non-blocking socket with nothing to read: waited on until it has some, or what is
            // left of the deadline passed (then looked at again).
            Err(e) if e.kind() == ErrorKind::WouldBlock && is_nonblocking(socket) => {
                if let Err(e) = wait_readable(socket, left) {
                    break Err(e);
                }
            }
            // A read that timed out: the deadline is looked at again.
            Err(e) if matches!(e.kind(), ErrorKind::Interrupted | ErrorKind::WouldBlock | ErrorKind::TimedOut) => {}
            Err(e) => break Err(e),
        }
    };
    socket.set_read_timeout(None)?;
    read
}

/// Whether `socket` is in non-blocking mode (its read returns `WouldBlock` at once).
fn is_nonblocking(socket: &TcpStream) -> bool {
    rustix::fs::fcntl_getfl(socket).is_ok_and(|flags| flags.contains(rustix::fs::OFlags::NONBLOCK))
}

/// Waits until `socket` has bytes to read, its peer closed it, or `left` passed.
fn wait_readable(socket: &TcpStream, left: Duration) -> std::io::Result<()> {
    use rustix::event::{PollFd, PollFlags, Timespec};
    let mut look = [PollFd::new(socket, PollFlags::IN)];
    let left =
        Timespec { tv_sec: i64::try_from(left.as_secs()).unwrap_or(i64::MAX), tv_nsec: i64::from(left.subsec_nanos()) };
    match rustix::event::poll(&mut look, Some(&left)) {
        Ok(_) | Err(rustix::io::Errno::INTR) => Ok(()),
        Err(e) => Err(e.into()),
    }
}

#[cfg(test)]
mod tests {
    use std::io::Write;
    use std::net::{TcpListener, TcpStream};
    use std::time::{Duration, Instant};

    use super::read_exact_by;

    /// This thread's CPU time (the first field of `/proc/thread-self/schedstat`, in ns).
    fn thread_cpu_time() -> Duration {
        let stat = std::fs::read_to_string("/proc/thread-self/schedstat").expect("/proc/thread-self/schedstat");
        let ns = stat.split_whitespace().next().and_then(|ns| ns.parse().ok()).expect("a count of ns");
        Duration::from_nanos(ns)
    }

    /// A read of a non-blocking socket whose peer sends late waits for the bytes without
    /// spinning (it used to read in a loop until they came), gets them whole, and a peer that
    /// never sends ends the read at its deadline, also without spinning.
    #[test]
    fn a_read_of_a_non_blocking_socket_waits_for_its_bytes_without_spinning() {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let peer = std::thread::spawn(move || {
            let (mut socket, _) = listener.accept().unwrap();
            std::thread::sleep(Duration::from_millis(150));
            socket.write_all(b"late").unwrap();
            std::thread::sleep(Duration::from_millis(400));
        });
        let mut socket = TcpStream::connect(addr).unwrap();
        socket.set_nonblocking(true).unwrap();
        let (cpu, start) = (thread_cpu_time(), Instant::now());
        let mut bytes = [0u8; 4];
        read_exact_by(&mut socket, &mut bytes, Some(Instant::now() + Duration::from_secs(5))).unwrap();
        assert_eq!(&bytes, b"late");
        let mut more = [0u8; 1];
        let missed = read_exact_by(&mut socket, &mut more, Some(Instant::now() + Duration::from_millis(150)));
        assert!(missed.is_err_and(|e| e.kind() == std::io::ErrorKind::TimedOut));
        let (busy, waited) = (thread_cpu_time() - cpu, start.elapsed());
        assert!(waited >= Duration::from_millis(250), "waited {waited:?}");
        assert!(busy < waited / 5, "{busy:?} of CPU time in {waited:?} of waiting");
        peer.join().unwrap();
    }
}
