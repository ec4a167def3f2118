//! Boundaries between two ranks of one host over CUDA IPC (the `ipc` transport): the receiving
//! rank's slots and flag words, exported to the sending rank, and the two halves of each step.
//!
//! Setup, in boundary order once the link's control connection is admitted: the RX rank binds a
//! local channel (a private Unix socket, see [`crate::local_channel`]) and writes its path on the
//! control connection; the TX rank connects to it (the job's handshake again, and the kernel's
//! word that the peer runs as this user); the RX rank allocates its ring's slots and the flag
//! words with `cuMemCreate`, zeroes the flags, and passes a descriptor of each; the TX rank maps
//! them. The slots' capacity is fixed then (the configuration's `reserve_bytes`, rounded up to
//! the allocation granularity): a larger step is [`PpError::StepTooLarge`].
//!
//! One step `k` in slot `s = k mod n` (flag words `filled[s]` and `consumed[s]`):
//! - `tx` (TX rank) writes the step's record on the control connection (as over NCCL), then
//!   enqueues on the TX stage's stream: wait until `consumed[s] >= k`, copy into the slot, write
//!   `filled[s] = k + 1` (after a fence: whoever sees the value sees the copy);
//! - the RX rank's receiver thread reads the record, waits until the ring's slot is free (the RX
//!   stage took step `k - n`), and enqueues on the receive stream, ordered by the crate's rule as a
//!   write of the slot (after the slot's earlier reads in this process): write `consumed[s] = k`,
//!   then wait until `filled[s] >= k + 1`. The slot is filled in the ring, and `rx` orders itself
//!   after the receive stream, as for NCCL.
//!
//! So the sender's copy never overwrites a slot the RX stage still reads, and the RX stage never
//! reads a slot before the copy is in it. No interprocess event is used: an opened event is
//! undefined behaviour once its exporter destroyed it (which its exit does), while a flag word
//! lives in memory every mapping keeps alive.
//!
//! Failure: a link that fails (the peer died, hung, lied, or closed its end) releases this
//! side's waits from a stream of its own, writing [`RELEASED`] into every word this side waits on
//! (the sender's `consumed`, the receiver's `filled`), after the rank's other links have stopped
//! and the next ranks know (see `link`); then it writes [`RELEASED`] into every word the peer
//! waits on, on the stream that wrote them, so that none of its writes still queued there lowers
//! a word the peer released. The slots of a failed link are then never trusted
//! ([`PpError::PeerFailed`] on every later call and readback, as for an aborted NCCL link), and
//! every stream drains. The sending rank's copies queued behind its waits run once released:
//! they may write a slot the receiving rank still reads, a slot lent in place included, whose
//! contents are then those of a later step.
//!
//! Ownership: the RX rank owns the slots and the flags; the TX rank's mappings keep the memory
//! alive after the RX rank dropped it or exited (CUDA's virtual memory management frees the
//! physical memory only when its last mapping goes), so a copy or wait already queued by the
//! survivor touches live memory whatever its peer did.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::os::unix::ffi::OsStrExt;
use std::path::PathBuf;
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant};

use crate::local_channel::{FdEntry, FdKind, LocalChannel, LocalChannelError, LocalListener};
use crate::pp::config::PpConfig;
use crate::pp::error::{Error, PpError, Result};
use crate::pp::plan::BoundaryPlan;
use crate::pp::process_transport::{Reach, TransportReason};
use crate::safe::memory::DeviceMemory;
use crate::safe::{CudaSlice, CudaStream, CudaView, CudaViewMut, ExportedMemory, ImportedMemory, WaitCondition};
use crate::safe::{FlagSteps, MemOpsSupport};

/// What a side writes into the words it waits on when its link fails: every wait for a step
/// number (cyclic `>=`, steps far below 2^62) is met.
pub(in crate::pp) const RELEASED: u64 = 1 << 62;

/// The longest socket path the RX rank may name: a Unix socket's path is at most 108 bytes on
/// Linux (`sun_path`); a longer one is refused before it is read.
const MAX_PATH: usize = 108;

/// The TX rank's request for the local channel's path.
const ASK: u8 = 0x1c;

/// Which end of the boundary a link's flags serve.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum End {
    Sender,
    Receiver,
}

/// A link's flag words (`filled[s]` at `s`, `consumed[s]` at `n + s`), and the stream that
/// releases this side's waits on them when the link fails.
pub(in crate::pp) struct IpcFlags {
    /// The words, mapped into this process (the RX rank's export or the TX rank's import).
    flags: Mutex<CudaSlice<u64>>,
    n_slots: usize,
    end: End,
    /// A stream of this side's device that nothing else uses: the release is ordered behind no
    /// wait of the link.
    release: Arc<CudaStream>,
    /// The condition of the RX side's wait for `filled` (flushing the peer device's writes where
    /// the copy comes from another device and this device can).
    filled_wait: WaitCondition,
    /// On the RX side: each slot's allocation (not kept alive here), so a receive goes only into
    /// the exported memory the TX rank writes.
    slot_memory: Vec<Weak<DeviceMemory>>,
    /// The stream this side writes the peer's words on (the TX stage's stream, or the receive
    /// stream), once a step was queued: a release writes them last there (see `release`).
    queued_on: Mutex<Option<Arc<CudaStream>>>,
}

impl IpcFlags {
    fn filled(s: usize) -> usize {
        s
    }

    fn consumed(&self, s: usize) -> usize {
        self.n_slots + s
    }

    /// Whether these are the TX rank's flags (it waits on `consumed`).
    pub(super) fn is_sender(&self) -> bool {
        self.end == End::Sender
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, CudaSlice<u64>> {
        self.flags.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Notes that this side queues its writes of the peer's words on `stream`.
    fn queue_on(&self, stream: &Arc<CudaStream>) {
        let mut queued_on = self.queued_on.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        if !queued_on.as_ref().is_some_and(|queued| Arc::ptr_eq(queued, stream)) {
            *queued_on = Some(Arc::clone(stream));
        }
    }

    /// The TX side of step `step`: on `stream`, waits until the RX rank freed the slot, copies
    /// `src` into `dst` (the slot's mapping, exactly the step's bytes), marks the slot filled.
    pub(super) fn send(
        &self,
        stream: &Arc<CudaStream>,
        step: u64,
        src: CudaView<'_, u8>,
        dst: &mut CudaViewMut<'_, u8>,
    ) -> Result<()> {
        let s = (step % self.n_slots as u64) as usize;
        let steps = FlagSteps {
            wait_at: self.consumed(s),
            wait_for: step,
            wait: WaitCondition::GEQ,
            signal_at: Self::filled(s),
            signal: step + 1,
        };
        let mut flags = self.lock();
        self.queue_on(stream);
        Ok(stream.flagged_copy(src, dst, &mut flags.as_view_mut(), steps)?)
    }

    /// The RX side of step `step` into slot `slot`'s bytes `dst`: on `stream`, frees the slot for
    /// the TX rank's copy and holds the stream until it is in.
    pub(super) fn receive(
        &self,
        stream: &Arc<CudaStream>,
        step: u64,
        slot: usize,
        dst: &mut CudaViewMut<'_, u8>,
    ) -> std::result::Result<(), String> {
        if slot != (step % self.n_slots as u64) as usize {
            return Err(format!("step {step} was given slot {slot} of {}", self.n_slots));
        }
        let exported =
            self.slot_memory.get(slot).is_some_and(|memory| Weak::ptr_eq(memory, &Arc::downgrade(dst.memory())));
        if !exported {
            return Err(format!("slot {slot}'s buffer is not the memory the sending rank maps"));
        }
        let steps = FlagSteps {
            wait_at: Self::filled(slot),
            wait_for: step + 1,
            wait: self.filled_wait,
            signal_at: self.consumed(slot),
            signal: step,
        };
        let mut flags = self.lock();
        self.queue_on(stream);
        stream.flagged_receive(dst, &mut flags.as_view_mut(), steps).map_err(|e| e.to_string())
    }

    /// Releases every wait of this side (see the module docs), from the release stream; then
    /// writes [`RELEASED`] into every word the peer waits on, on the stream this side wrote them
    /// on: behind this side's writes still queued there, so none of those can lower a word the
    /// peer released again (a write of `consumed[s] = k` queued behind this side's stage, run after
    /// the peer's release, would hold the peer's copy of step `k + n` for ever).
    pub(super) fn release(&self) -> Result<()> {
        let mut flags = self.lock();
        // (the word this side waits on, the word the peer waits on) of slot `s`
        let words = |s: usize| match self.end {
            End::Sender => (self.consumed(s), Self::filled(s)),
            End::Receiver => (Self::filled(s), self.consumed(s)),
        };
        for s in 0..self.n_slots {
            self.release.write_value_u64(&mut *flags, words(s).0, RELEASED)?;
        }
        let queued_on = self.queued_on.lock().unwrap_or_else(|poisoned| poisoned.into_inner()).clone();
        if let Some(stream) = queued_on {
            for s in 0..self.n_slots {
                stream.write_value_u64(&mut *flags, words(s).1, RELEASED)?;
            }
        }
        Ok(())
    }
}

/// The RX rank's end of an IPC boundary after its setup: the flags, and the ring's slots.
pub(super) struct Offered {
    pub(super) flags: IpcFlags,
    pub(super) slots: Vec<Arc<CudaSlice<u8>>>,
    /// The channel stays open for the link's life (a closed one tells the peer nothing the
    /// control connection does not).
    pub(super) _channel: LocalChannel,
}

/// The TX rank's end of an IPC boundary after its setup: the flags, and its mappings of the
/// RX rank's slots.
pub(super) struct Taken {
    pub(super) flags: IpcFlags,
    pub(super) slots: Vec<CudaSlice<u8>>,
    pub(super) _channel: LocalChannel,
}

/// The error of boundary `b`'s IPC setup with rank `peer`.
fn failed(b: &BoundaryPlan, peer: usize, what: &str, e: &dyn std::fmt::Display) -> Error {
    Error::Pipeline(PpError::PeerFailed { boundary: b.boundary, peer, reason: format!("{what}: {e}") })
}

fn channel_failed(b: &BoundaryPlan, peer: usize, what: &str) -> impl Fn(LocalChannelError) -> Error {
    let (b, what) = (*b, what.to_string());
    move |e| failed(&b, peer, &what, &e)
}

/// The RX rank's side of boundary `b`'s IPC setup over `socket` (its admitted control
/// connection), on the RX stage's `stream` (see the module docs).
pub(super) fn offer(
    config: &PpConfig,
    b: &BoundaryPlan,
    socket: &mut TcpStream,
    stream: &Arc<CudaStream>,
) -> Result<Offered> {
    let peer = b.tx_rank;
    let timeout = config.peer_timeout();
    let listener = LocalListener::bind(config.job_access(), b.boundary as u64).map_err(channel_failed(
        b,
        peer,
        "binding the local channel",
    ))?;
    let path = listener.path().as_os_str().as_bytes().to_vec();
    let mut named = (path.len() as u16).to_le_bytes().to_vec();
    named.extend_from_slice(&path);
    // The TX rank asks once it has read its admission's answer (a byte sent earlier would
    // arrive inside that answer).
    let mut asked = [0u8; 1];
    read_exact_by(socket, &mut asked, Instant::now().checked_add(timeout))
        .map_err(|e| failed(b, peer, "waiting for the sending rank", &e))?;
    if asked != [ASK] {
        return Err(failed(b, peer, "the sending rank's request", &format!("{:#04x}", asked[0])));
    }
    socket.write_all(&named).map_err(|e| failed(b, peer, "naming the local channel", &e))?;
    let mut channel = listener.accept(timeout).map_err(channel_failed(b, peer, "the local channel"))?;

    let n_slots = config.slots();
    let mut flags = ExportedMemory::<u64>::alloc_with(stream, 2 * n_slots, true)?;
    stream.memset_bytes(&mut flags.as_view_mut(), 0)?;
    stream.synchronize()?;
    let capacity = ExportedMemory::<u8>::rounded_len(stream, config.reserve_bytes().max(1))?;
    let slots = (0..n_slots)
        .map(|_| ExportedMemory::<u8>::alloc_with(stream, capacity, true))
        .collect::<crate::cuda_error::Result<Vec<_>>>()?;
    let mut fds = vec![flags.export_fd()?];
    let mut entries = vec![FdEntry { kind: FdKind::Flags, bytes: (2 * n_slots * 8) as u64, index: 0 }];
    for (s, slot) in slots.iter().enumerate() {
        fds.push(slot.export_fd()?);
        entries.push(FdEntry { kind: FdKind::SlotMemory, bytes: capacity as u64, index: s as u32 });
    }
    // In frames of at most MAX_FDS descriptors, in order.
    for (entries, fds) in entries.chunks(crate::local_channel::MAX_FDS).zip(fds.chunks(crate::local_channel::MAX_FDS)) {
        let borrowed: Vec<_> = fds.iter().map(std::os::fd::AsFd::as_fd).collect();
        channel.send_fds(entries, &borrowed).map_err(channel_failed(b, peer, "passing the slots"))?;
    }
    drop(fds);
    let slots: Vec<Arc<CudaSlice<u8>>> = slots.into_iter().map(|slot| Arc::new(slot.into_slice())).collect();
    let slot_memory = slots.iter().map(|slot| Arc::downgrade(slot.memory())).collect();
    let same_device = matches!(b.reason, TransportReason::Reach(Reach::SameDevice));
    let support = MemOpsSupport::of(stream.context().device())?;
    let filled_wait = if !same_device && support.flush_remote_writes {
        WaitCondition::GEQ.flush_remote_writes()
    } else {
        WaitCondition::GEQ
    };
    let flags = IpcFlags {
        flags: Mutex::new(flags.into_slice()),
        n_slots,
        end: End::Receiver,
        release: CudaStream::new(stream.context())?,
        filled_wait,
        slot_memory,
        queued_on: Mutex::new(None),
    };
    Ok(Offered { flags, slots, _channel: channel })
}

/// The TX rank's side of boundary `b`'s IPC setup over `socket`, on the TX stage's `stream`.
pub(super) fn take(
    config: &PpConfig,
    b: &BoundaryPlan,
    socket: &mut TcpStream,
    stream: &Arc<CudaStream>,
) -> Result<Taken> {
    let peer = b.rx_rank;
    let timeout = config.peer_timeout();
    let deadline = Instant::now().checked_add(timeout);
    socket.write_all(&[ASK]).map_err(|e| failed(b, peer, "asking for the local channel", &e))?;
    let path = read_path(socket, deadline).map_err(|e| failed(b, peer, "reading the local channel's path", &e))?;
    let mut channel = LocalChannel::connect(&path, config.job_access(), b.boundary as u64, timeout)
        .map_err(channel_failed(b, peer, "connecting the local channel"))?;
    let n_slots = config.slots();
    let mut expected = vec![FdKind::Flags];
    expected.extend(std::iter::repeat_n(FdKind::SlotMemory, n_slots));
    let mut received = Vec::with_capacity(expected.len());
    for kinds in expected.chunks(crate::local_channel::MAX_FDS) {
        received.extend(channel.recv_fds(kinds).map_err(channel_failed(b, peer, "receiving the slots"))?);
    }
    let mut received = received.into_iter();
    let flag_fd = received.next().expect("the kinds were matched");
    if flag_fd.entry.bytes != (2 * n_slots * 8) as u64 {
        let why = format!("{} byte(s) of flags for {n_slots} slot(s)", flag_fd.entry.bytes);
        return Err(failed(b, peer, "the receiving rank's flags", &why));
    }
    let flags = ImportedMemory::<u64>::import_with(stream, flag_fd.fd, 2 * n_slots, true)?.into_slice();
    let mut slots = Vec::with_capacity(n_slots);
    for (s, slot) in received.enumerate() {
        let bytes = usize::try_from(slot.entry.bytes).unwrap_or(usize::MAX);
        if slot.entry.index as usize != s || bytes == 0 {
            let why = format!("slot {} of {bytes} byte(s) where slot {s} was due", slot.entry.index);
            return Err(failed(b, peer, "the receiving rank's slots", &why));
        }
        slots.push(ImportedMemory::<u8>::import_with(stream, slot.fd, bytes, true)?.into_slice());
    }
    let flags = IpcFlags {
        flags: Mutex::new(flags),
        n_slots,
        end: End::Sender,
        release: CudaStream::new(stream.context())?,
        filled_wait: WaitCondition::GEQ,
        slot_memory: Vec::new(),
        queued_on: Mutex::new(None),
    };
    Ok(Taken { flags, slots, _channel: channel })
}

/// Reads the RX rank's channel path (a little-endian `u16` length, then the bytes) from
/// `socket`, by `deadline`.
fn read_path(socket: &mut TcpStream, deadline: Option<Instant>) -> std::io::Result<PathBuf> {
    let mut len = [0u8; 2];
    read_exact_by(socket, &mut len, deadline)?;
    let len = usize::from(u16::from_le_bytes(len));
    if len == 0 || len > MAX_PATH {
        return Err(std::io::Error::new(std::io::ErrorKind::InvalidData, format!("a path of {len} byte(s)")));
    }
    let mut path = vec![0u8; len];
    read_exact_by(socket, &mut path, deadline)?;
    Ok(PathBuf::from(<std::ffi::OsString as std::os::unix::ffi::OsStringExt>::from_vec(path)))
}

/// Fills `bytes` from `socket` by `deadline` (`None`: no bound); the socket's read timeout is
/// none again afterwards, whatever happened.
fn read_exact_by(socket: &mut TcpStream, bytes: &mut [u8], deadline: Option<Instant>) -> std::io::Result<()> {
    let left =
        deadline.map_or(Duration::from_secs(3600), |deadline| deadline.saturating_duration_since(Instant::now()));
    let read =
        socket.set_read_timeout(Some(left.max(Duration::from_millis(1)))).and_then(|()| socket.read_exact(bytes));
    socket.set_read_timeout(None)?;
    read
}

#[cfg(test)]
mod tests {
    use std::io::{ErrorKind, Write};
    use std::net::{TcpListener, TcpStream};
    use std::time::{Duration, Instant};

    use super::{MAX_PATH, read_path};

    /// A connected pair on loopback: what the RX rank writes, what the TX rank reads.
    fn pair() -> (TcpStream, TcpStream) {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let rx = TcpStream::connect(listener.local_addr().unwrap()).unwrap();
        let (tx, _) = listener.accept().unwrap();
        (rx, tx)
    }

    fn named(len: u16, path: &[u8]) -> Vec<u8> {
        let mut bytes = len.to_le_bytes().to_vec();
        bytes.extend_from_slice(path);
        bytes
    }

    /// The RX rank's path message as a lying or silent peer writes it: a path is read whole; an
    /// empty one or one longer than a socket's path is refused at once, naming its length, without
    /// waiting for its bytes; a peer that sends nothing, or fewer bytes than it announced, is given
    /// up at the deadline.
    #[test]
    fn the_path_message_is_bounded_and_checked_before_it_is_read() {
        let deadline = || Some(Instant::now() + Duration::from_millis(300));
        let (mut rx, mut tx) = pair();
        rx.write_all(&named(14, b"/tmp/x/channel")).unwrap();
        assert_eq!(read_path(&mut tx, deadline()).unwrap(), std::path::PathBuf::from("/tmp/x/channel"));
        for len in [0, MAX_PATH as u16 + 1, u16::MAX] {
            let (mut rx, mut tx) = pair();
            rx.write_all(&named(len, b"")).unwrap();
            let start = Instant::now();
            let err = read_path(&mut tx, Some(Instant::now() + Duration::from_secs(3))).unwrap_err();
            assert_eq!(err.kind(), ErrorKind::InvalidData, "{len}: {err}");
            assert!(err.to_string().contains(&format!("a path of {len} byte(s)")), "{err}");
            assert!(start.elapsed() < Duration::from_secs(2), "{len}: refused after {:?}", start.elapsed());
        }
        for sent in [Vec::new(), named(20, b"/tmp")] {
            let (mut rx, mut tx) = pair();
            rx.write_all(&sent).unwrap();
            let start = Instant::now();
            let err = read_path(&mut tx, deadline()).unwrap_err();
            assert!(matches!(err.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut), "{err}");
            assert!(start.elapsed() < Duration::from_secs(5), "given up after {:?}", start.elapsed());
            drop(rx);
        }
    }
}
