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
//! side's with the records. Clean shutdown: the TX rank sends a close record and waits (bounded)
//! until the RX rank's receives of every step are complete.
//!
//! Setup ([`connect`]): a rendezvous at rank 0 gathers every rank's listening port and hands out
//! one NCCL unique id per cross-rank boundary; TX ranks connect to RX ranks; the communicators
//! are initialised in boundary order (every rank in the same order, so none waits on another
//! cycle); and each link moves one small message to prove it before the runtime is returned.
//! Every wait of the setup for another rank is bounded by the peer timeout, and the waits for
//! NCCL (the join, which NCCL does in the background, and the first message, which connects
//! NCCL's transport) also end as soon as the peer closes its end of the boundary's connection
//! (it died): a rank that dies or stops during another's setup is a [`PpError::PeerFailed`]
//! there, not a hang.

use std::collections::BTreeMap;
use std::io::{ErrorKind, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, TryLockError};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use super::error::{PpError, ReceiverState};
use super::plan::{Plan, Transport};
use crate::error::{Error, Result};
use crate::nccl::{GRAPH_MIXING_VERSION, NcclComm, NcclUniqueId, PostingAlone, nccl, poll_pause};
use crate::pp::config::PpConfig;
use crate::rendezvous::{Rendezvous, RendezvousError};
use crate::safe::{
    CaptureMode, Context, CudaEvent, CudaSlice, CudaStream, CudaViewMut, DeviceRepr, DeviceSlice, GraphExec, KeptMemory,
};

/// How often the receiver threads and the watchdog look at a link that is quiet.
pub(super) const POLL: Duration = Duration::from_millis(10);

/// How long a thread that expects the next step soon (a receiver thread after a record or
/// waiting for a free slot, an `rx_wait` on a boundary from another rank) spins before it
/// sleeps: waking a sleeping thread costs tens of µs on a busy host, more than a step's host
/// work, and a decode step's next boundary crossing comes within this window. Spinning costs one
/// core for at most this long per wait.
pub(super) const SPIN: Duration = Duration::from_micros(250);

/// The greeting of a control connection; the digit is the wire protocol's version.
const HELLO_MAGIC: &[u8; 8] = b"PPNRTBD2";
const DATA: u8 = 1;
const CLOSE: u8 = 2;
/// The RX rank's one-byte answer to a close: every step was received.
const DONE: u8 = 3;
/// A sign of life: a record with no payload from the TX rank, one byte from the RX rank.
const ALIVE: u8 = 4;
/// A record: kind, three reserved bytes, the name's length (u32), step (u64), n (u64), the
/// element's size in bytes (u64), then the element type's name.
const RECORD_HEAD: usize = 32;
const MAX_TYPE_NAME: usize = 64;

/// Why a link stopped, set once, and whether it was aborted (not closed cleanly). Shared with the
/// runtime's readbacks: a readback holds this record, not the link (whose connection and
/// communicator end with the runtime), and can tell whether the link failed after the runtime is
/// gone.
pub(super) struct LinkFailure {
    boundary: usize,
    peer: usize,
    reason: Mutex<Option<(String, bool)>>,
    /// Whether a call returned the link's error to its caller.
    reported: AtomicBool,
}

impl LinkFailure {
    fn new(boundary: usize, peer: usize) -> LinkFailure {
        LinkFailure { boundary, peer, reason: Mutex::new(None), reported: AtomicBool::new(false) }
    }

    fn reason(&self) -> MutexGuard<'_, Option<(String, bool)>> {
        self.reason.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Whether the link failed and its communicator was aborted (its receives may be cut short).
    pub(super) fn aborted(&self) -> bool {
        self.reason().as_ref().is_some_and(|(_, aborted)| *aborted)
    }

    /// The typed error of the stopped link, if it stopped (not counted as reported).
    fn error(&self) -> Option<Error> {
        let (reason, _) = self.reason().clone()?;
        Some(Error::Pipeline(PpError::PeerFailed { boundary: self.boundary, peer: self.peer, reason }))
    }

    /// The error of a link that failed (was aborted) without any call returning it to a caller.
    pub(super) fn unreported(&self) -> Option<Error> {
        (self.aborted() && !self.reported.load(Ordering::Relaxed)).then(|| self.error()).flatten()
    }

    /// [`error`](Self::error) for a caller: the failure counts as reported.
    pub(super) fn reported_error(&self) -> Option<Error> {
        let error = self.error()?;
        self.reported.store(true, Ordering::Relaxed);
        Some(error)
    }
}

/// One boundary between two ranks, as seen by either of them.
pub(super) struct Link {
    pub(super) boundary: usize,
    /// The other rank.
    pub(super) peer: usize,
    /// On the RX rank: the receives captured in CUDA graphs (see [`receive_step`]); `None` once
    /// the link failed. Declared before `comm`, so dropped first: NCCL's destroy and abort wait
    /// until every graph holding an operation of the communicator is destroyed.
    recv_graphs: Mutex<Option<Vec<RecvGraph>>>,
    /// How many steps were received through captured graphs.
    graph_receives: AtomicU64,
    /// On how many steps a capture found the process's NCCL work still running within its wait
    /// (see [`capture_receive`]).
    captures_missed: AtomicU32,
    pub(super) comm: NcclComm,
    failure: Arc<LinkFailure>,
    /// A handle of the link's control connection, shut down when the link fails so that the
    /// peer learns it at once (its end reads the connection's end).
    connection: TcpStream,
    /// The peer timeout: a peer silent for longer fails the link; signs of life go out ten times
    /// as often.
    timeout: Duration,
    /// Whether silence fails the link (see [`silence_fails`]).
    silence_fails: bool,
    /// On the RX rank: what its receiver thread is doing.
    pub(super) phase: PhaseCell,
}

/// What a receiver thread is doing, since when: two atomics (the phase with its step, and the
/// time it began), read apart (a diagnosis, not a synchronisation).
pub(super) struct PhaseCell {
    /// The step shifted left by 2, or'd with the phase.
    word: AtomicU64,
    /// When the phase began, in ns since `epoch`.
    began_ns: AtomicU64,
    epoch: Instant,
}

/// A receiver thread's phase (see [`ReceiverState`]).
#[derive(Clone, Copy)]
pub(super) enum Phase {
    AwaitingRecord = 0,
    AwaitingFreeSlot = 1,
    Posting = 2,
    Stopped = 3,
}

impl PhaseCell {
    fn new() -> PhaseCell {
        PhaseCell {
            word: AtomicU64::new(Phase::AwaitingRecord as u64),
            began_ns: AtomicU64::new(0),
            epoch: Instant::now(),
        }
    }

    /// Records that the thread entered `phase` for step `step`, now.
    pub(super) fn set(&self, phase: Phase, step: u64) {
        let now = u64::try_from(self.epoch.elapsed().as_nanos()).unwrap_or(u64::MAX);
        self.began_ns.store(now, Ordering::Relaxed);
        self.word.store((step << 2) | phase as u64, Ordering::Release);
    }

    pub(super) fn get(&self) -> ReceiverState {
        let word = self.word.load(Ordering::Acquire);
        let began = Duration::from_nanos(self.began_ns.load(Ordering::Relaxed));
        let waited = self.epoch.elapsed().saturating_sub(began);
        let step = word >> 2;
        match word & 3 {
            0 => ReceiverState::AwaitingRecord { step, waited },
            1 => ReceiverState::AwaitingFreeSlot { step, waited },
            2 => ReceiverState::Posting { step, waited },
            _ => ReceiverState::Stopped,
        }
    }
}

/// The receive of `bytes` bytes into slot `slot`, captured once and launched for each step of
/// that size into that slot.
struct RecvGraph {
    slot: usize,
    bytes: usize,
    exec: GraphExec,
}

/// How many byte counts each slot keeps a captured receive for (the oldest is dropped).
const RECV_GRAPHS_PER_SLOT: usize = 2;

/// How long a receiver thread about to capture a receive waits for the process's NCCL work to
/// complete (see [`capture_receive`]).
const CAPTURE_SETTLE_WAIT: Duration = Duration::from_millis(1);

/// On how many steps a link waits so; later it captures only when it finds the work complete
/// at once.
const CAPTURE_WAITS: u32 = 32;

impl Link {
    /// Fails the link (once): records `reason`, shuts the control connection down (the peer's
    /// link fails too, within milliseconds, whatever this side's reason) and aborts the
    /// communicator, so no NCCL kernel of it stays queued.
    pub(super) fn fail(&self, reason: String) {
        if self.stop(reason, true) {
            let _ = self.connection.shutdown(std::net::Shutdown::Both);
            // NCCL's abort waits until every graph holding an operation of the communicator is
            // destroyed: destroy the captured receives first, keeping their slots' memory alive
            // until the abort has stopped their runs.
            let graphs = self.recv_graphs.lock().unwrap_or_else(|poisoned| poisoned.into_inner()).take();
            let kept: Vec<KeptMemory> =
                graphs.into_iter().flatten().map(|graph| graph.exec.destroy_keeping_memory()).collect();
            if let Err(e) = self.comm.abort_now() {
                crate::safe::record_drop_error(e);
            }
            drop(kept);
        }
    }

    /// Records why the link stopped without aborting (a clean close).
    fn stop_with(&self, reason: String) {
        self.stop(reason, false);
    }

    /// Records why the link stopped; false if it had stopped before.
    fn stop(&self, reason: String, aborted: bool) -> bool {
        let mut slot = self.failure.reason();
        if slot.is_some() {
            return false;
        }
        *slot = Some((reason, aborted));
        true
    }

    /// How many steps were received through captured graphs.
    #[cfg(feature = "testing")]
    pub(super) fn graph_receives(&self) -> u64 {
        self.graph_receives.load(Ordering::Relaxed)
    }

    /// The typed error of a stopped link, if it stopped, for a caller: the failure counts as
    /// reported.
    pub(super) fn stopped(&self) -> Option<Error> {
        self.failure.reported_error()
    }

    /// Whether the link stopped (failed, or closed cleanly).
    pub(super) fn is_stopped(&self) -> bool {
        self.failure.reason().is_some()
    }

    fn error(&self) -> Option<Error> {
        self.failure.error()
    }

    /// The link's failure record, for the runtime's readbacks.
    pub(super) fn failure(&self) -> Arc<LinkFailure> {
        Arc::clone(&self.failure)
    }

    /// Whether the link failed and its communicator was aborted (its receives may be cut short).
    pub(super) fn aborted(&self) -> bool {
        self.failure.aborted()
    }

    /// The typed error of the stopped link, or [`PpError::PeerFailed`] with `reason` if it has no
    /// recorded one, for a caller (see [`stopped`](Self::stopped)).
    fn stopped_or(&self, reason: &str) -> Error {
        self.failure.reported.store(true, Ordering::Relaxed);
        self.error_or(reason)
    }

    /// [`stopped_or`](Self::stopped_or) for this crate's own threads: the failure does not count
    /// as reported.
    fn error_or(&self, reason: &str) -> Error {
        self.error().unwrap_or_else(|| {
            Error::Pipeline(PpError::PeerFailed { boundary: self.boundary, peer: self.peer, reason: reason.into() })
        })
    }

    fn check(&self) -> Result<()> {
        self.stopped().map_or(Ok(()), Err)
    }

    /// Why the link fails when the peer, last heard from at `heard`, has been silent for longer
    /// than the peer timeout; `None` while it has not (or silence does not fail links).
    fn silent_too_long(&self, heard: Instant) -> Option<String> {
        let silent = heard.elapsed();
        (self.silence_fails && silent > self.timeout).then(|| silence(silent))
    }

    /// How often this rank shows the peer it is alive.
    fn heartbeat_interval(&self) -> Duration {
        heartbeat_interval(self.timeout)
    }
}

/// The TX rank's end of a link.
pub(super) struct Sender {
    pub(super) link: Arc<Link>,
    pub(super) tx_stream: Arc<CudaStream>,
    pub(super) tx_device: i32,
    n_slots: usize,
    control: Mutex<SendControl>,
    /// A second handle of the control connection: the watchdog reads the peer's signs of life
    /// (and sees its end) through it.
    watch: TcpStream,
}

struct SendControl {
    socket: TcpStream,
    step: u64,
    closed: bool,
    /// When this rank last wrote to the connection (a record or a sign of life).
    written: Instant,
}

/// How often a rank shows a peer it is alive, for a peer `timeout`: ten times per timeout,
/// at most once per poll interval and at least once a second.
fn heartbeat_interval(timeout: Duration) -> Duration {
    (timeout / 10).clamp(POLL, Duration::from_secs(1))
}

/// Whether a peer silent for longer than the peer timeout fails its link: always, except with
/// the liveness check broken on purpose ([`ProtocolFault::IgnoreSilence`], tests only).
fn silence_fails(config: &PpConfig) -> bool {
    #[cfg(feature = "testing")]
    if config.fault() == crate::pp::config::ProtocolFault::IgnoreSilence {
        return false;
    }
    #[cfg(not(feature = "testing"))]
    let _ = config;
    true
}

/// Why a link whose peer was silent for `silent` (more than the peer timeout) fails.
fn silence(silent: Duration) -> String {
    format!("no sign of life from the peer for {silent:?}, more than the peer timeout (its process hung or stopped?)")
}

/// Why a link fails when its connection ends without the close record.
const PEER_CLOSED: &str =
    "the peer closed the boundary's connection (its process exited, or its end of the boundary failed)";

impl Sender {
    /// Sends `x[..n]` (checked by the caller) as the boundary's next step: the step's record
    /// first (so the RX rank posts its receive while this rank issues the send), then the NCCL
    /// send on the TX stage's stream, ordered like a copy that reads `x`. Returns the step's slot
    /// index. If the send fails after its record went out, the link fails and the connection is
    /// shut down, so the RX rank aborts its receive instead of waiting for it.
    ///
    /// Refused on a capturing TX stream like every call that cannot be captured
    /// ([`CaptureError::IllegalCall`](crate::CaptureError::IllegalCall), the capture invalidated):
    /// the record would go out once while the captured send ran at every launch of the graph
    /// (never, or more than once), and the receiver would wait for data that does not come, or the
    /// sender for a receive.
    pub(super) fn tx<T: DeviceRepr, S: DeviceSlice<T>>(&self, x: &S, n: usize) -> Result<usize> {
        check_type_name(self.link.boundary, T::NAME)?;
        self.link.check()?;
        // No capture of the TX stream begins between this check and the send.
        let _gate = self.tx_stream.enqueue_gate_uncaptured("PpNRt::tx to another rank")?;
        let mut control = self.lock();
        if control.closed {
            return Err(self.link.stopped_or("the boundary was closed"));
        }
        let view = x.as_view().slice(..n)?;
        let step = control.step;
        let record = encode_record(DATA, step, n as u64, std::mem::size_of::<T>() as u64, T::NAME);
        if let Err(e) = control.socket.write_all(&record) {
            self.link.fail(format!("writing step {step}'s record failed: {e}"));
            return Err(self.link.stopped().expect("failed above"));
        }
        control.written = Instant::now();
        if let Err(e) = self.link.comm.send(&self.tx_stream, &view, 1) {
            // The send may or may not be queued, and its record is out: the link cannot be
            // trusted with another step, and the RX rank must not wait for this one.
            // A send that failed because the link failed meanwhile (its communicator aborted by
            // the watchdog or a receiver thread) reports that failure, as every later call does.
            self.link.fail(format!("the NCCL send of step {step} failed: {e}"));
            return Err(self.link.stopped().unwrap_or(e));
        }
        control.step += 1;
        Ok((step % self.n_slots as u64) as usize)
    }

    fn lock(&self) -> MutexGuard<'_, SendControl> {
        self.control.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// How many steps this end has sent.
    pub(super) fn steps_sent(&self) -> u64 {
        self.lock().step
    }

    /// Clean close: sends the close record and waits, at most `timeout`, until the RX rank has
    /// received every step (its receives are complete). A link that cannot close is failed
    /// (aborted), so no send of it stays queued.
    pub(super) fn close(&self, timeout: Duration) {
        let mut control = self.lock();
        if control.closed || self.link.is_stopped() {
            return;
        }
        control.closed = true;
        let step = control.step;
        let deadline = Instant::now() + timeout;
        let answer = control.socket.write_all(&encode_record(CLOSE, step, 0, 0, "")).and_then(|()| {
            // The answer, past the signs of life the peer sent meanwhile.
            let mut byte = [0u8; 1];
            loop {
                let left = deadline.saturating_duration_since(Instant::now()).max(Duration::from_millis(1));
                control.socket.set_read_timeout(Some(left))?;
                control.socket.read_exact(&mut byte)?;
                if byte[0] != ALIVE {
                    return Ok(byte[0]);
                }
            }
        });
        match answer {
            Ok(DONE) => {
                self.link.stop_with(format!("the boundary was closed after {step} step(s)"));
            }
            Ok(other) => self.link.fail(format!("the peer answered the close with {other}")),
            Err(e) => self.link.fail(format!("the peer did not confirm the close within {timeout:?}: {e}")),
        }
    }

    /// The watchdog's look at the link: the peer's end of the connection and its signs of life
    /// (`heard` is when the last came); silence longer than the timeout; a sign of life to the
    /// peer when this rank wrote nothing for a heartbeat interval; NCCL's asynchronous error.
    /// The connection is looked at without the link's lock (a peek waits up to a millisecond
    /// when nothing came), and read or written under it only when that cannot block a `tx` for
    /// long: skipped while a `tx` or the close holds it (the close reads the peer's answer, and a
    /// `tx` blocked on a full connection fails by its own write timeout).
    fn watch(&self, heard: &mut Instant) {
        if self.link.is_stopped() {
            return;
        }
        match self.look(heard) {
            Ok(()) => watch_comm(&self.link),
            Err(reason) => self.link.fail(reason),
        }
    }

    /// [`watch`](Self::watch) of the connection; the reason the link fails, if it does.
    fn look(&self, heard: &mut Instant) -> std::result::Result<(), String> {
        let quiet = |e: &std::io::Error| {
            matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut | ErrorKind::Interrupted)
        };
        let failed = |e: std::io::Error| format!("the boundary's connection failed: {e}");
        let mut byte = [0u8; 1];
        let waiting = match self.watch.peek(&mut byte) {
            Ok(0) => return Err(PEER_CLOSED.into()),
            Ok(_) => true,
            Err(e) if quiet(&e) => false,
            Err(e) => return Err(failed(e)),
        };
        let mut control = match self.control.try_lock() {
            Ok(control) => control,
            Err(TryLockError::Poisoned(poisoned)) => poisoned.into_inner(),
            Err(TryLockError::WouldBlock) => return Ok(()),
        };
        if control.closed {
            return Ok(());
        }
        if waiting {
            // Bytes are there (only this thread and the close, which holds the lock, read them):
            // the read returns at once.
            let mut bytes = [0u8; 64];
            match (&self.watch).read(&mut bytes) {
                Ok(0) => return Err(PEER_CLOSED.into()),
                Ok(read) => {
                    if let Some(other) = bytes[..read].iter().find(|&&byte| byte != ALIVE) {
                        return Err(format!("the peer sent {other} before the close"));
                    }
                    *heard = Instant::now();
                }
                Err(e) if quiet(&e) => {}
                Err(e) => return Err(failed(e)),
            }
        }
        if let Some(reason) = self.link.silent_too_long(*heard) {
            return Err(reason);
        }
        let now = Instant::now();
        if now.duration_since(control.written) >= self.link.heartbeat_interval() {
            control
                .socket
                .write_all(&encode_record(ALIVE, 0, 0, 0, ""))
                .map_err(|e| format!("writing a sign of life failed: {e}"))?;
            control.written = now;
        }
        Ok(())
    }
}

/// The watchdog's look at NCCL: an asynchronous error fails the link. Skipped while another
/// thread's call holds the communicator (the watchdog never waits on the calls it watches).
fn watch_comm(link: &Link) {
    if let Err(e) = link.comm.async_error_if_idle() {
        if !link.is_stopped() {
            link.fail(format!("NCCL reported: {e}"));
        }
    }
}

/// The RX rank's end of a link, before its receiver thread starts.
pub(super) struct Inbound {
    pub(super) link: Arc<Link>,
    pub(super) socket: TcpStream,
    /// The boundary's receive stream (on the RX stage's device): the NCCL receives run there.
    pub(super) recv_stream: Arc<CudaStream>,
    /// A stream of the same device used only to capture receives into graphs, when allowed
    /// ([`PpConfig::nccl_recv_graphs`]).
    pub(super) capture_stream: Option<Arc<CudaStream>>,
}

impl Inbound {
    /// The watchdog's end of this link: a second handle of the connection, for this rank's
    /// signs of life.
    pub(super) fn heartbeat(&self) -> Result<Heartbeat> {
        let socket = self.socket.try_clone().map_err(|e| io_error(&self.link, "cloning the connection", &e))?;
        Ok(Heartbeat { link: Arc::clone(&self.link), socket })
    }
}

/// Signs of life from the RX rank to the TX rank of one link, sent by the watchdog.
pub(super) struct Heartbeat {
    link: Arc<Link>,
    socket: TcpStream,
}

impl Heartbeat {
    /// Sends a sign of life when `sent` (the last one's time) is an interval ago. The connection
    /// may be non-blocking at the time (the receiver thread switches it): a full buffer skips
    /// this one.
    fn beat(&self, sent: &mut Instant) {
        if self.link.is_stopped() || sent.elapsed() < self.link.heartbeat_interval() {
            return;
        }
        match (&self.socket).write(&[ALIVE]) {
            Ok(_) => *sent = Instant::now(),
            Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut | ErrorKind::Interrupted) => {}
            Err(e) => self.link.fail(format!("writing a sign of life failed: {e}")),
        }
    }
}

/// A step announced by the TX rank.
pub(super) struct Announced {
    pub(super) step: u64,
    pub(super) n: usize,
    pub(super) elem: &'static str,
    pub(super) bytes: usize,
}

/// What the receiver thread does with each announced step: fill the ring's next slot through
/// `recv` (which posts the NCCL receive into the slot's bytes, given the slot's index), waiting
/// while the slot is taken and `stop` is not set, and keep the link's phase (the next record's,
/// once the slot is filled). Returns `Ok(false)` when stopped first.
pub(super) trait SlotFiller: Send + Sync + 'static {
    fn fill(
        &self,
        step: &Announced,
        stop: &AtomicBool,
        recv: &mut dyn FnMut(usize, &mut CudaViewMut<'_, u8>) -> Result<()>,
    ) -> Result<bool>;
    /// Wakes every thread waiting on the ring (the link stopped).
    fn wake(&self);
}

/// The receiver thread of one inbound link.
pub(super) struct Receiver {
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl Receiver {
    pub(super) fn start(inbound: Inbound, filler: Arc<dyn SlotFiller>) -> Result<Receiver> {
        let stop = Arc::new(AtomicBool::new(false));
        let link = Arc::clone(&inbound.link);
        inbound.socket.set_read_timeout(Some(POLL)).map_err(|e| io_error(&link, "the connection's timeout", &e))?;
        let thread = std::thread::Builder::new()
            .name(format!("ppnrt-rx-b{}", link.boundary))
            .spawn({
                let stop = Arc::clone(&stop);
                move || receive_loop(inbound, &*filler, &stop)
            })
            .map_err(|e| io_error(&link, "starting the receiver thread", &e))?;
        Ok(Receiver { stop, thread: Some(thread) })
    }

    /// Stops the thread and waits for it (within one poll interval once it is not posting).
    pub(super) fn stop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

impl Drop for Receiver {
    fn drop(&mut self) {
        self.stop();
    }
}

fn io_error(link: &Link, what: &str, e: &std::io::Error) -> Error {
    Error::Pipeline(PpError::PeerFailed { boundary: link.boundary, peer: link.peer, reason: format!("{what}: {e}") })
}

fn receive_loop(mut inbound: Inbound, filler: &dyn SlotFiller, stop: &AtomicBool) {
    let link = Arc::clone(&inbound.link);
    let mut pending = Vec::with_capacity(RECORD_HEAD + MAX_TYPE_NAME);
    let mut expected = 0u64;
    // The previous step's byte count: a count seen twice in a row is worth a captured receive.
    let mut last_bytes: Option<usize> = None;
    let mut last_poll = Instant::now();
    // After each record the connection is read without blocking for SPIN (the next record is
    // likely near), then with a blocking read bounded by POLL.
    let mut spin_until: Option<Instant> = None;
    let mut nonblocking = false;
    // When the TX rank was last heard from (or this thread last came back from waiting for a
    // slot, when it read nothing).
    let mut heard = Instant::now();
    let outcome: std::result::Result<(), String> = loop {
        if stop.load(Ordering::SeqCst) || link.is_stopped() {
            break Ok(());
        }
        if last_poll.elapsed() >= POLL {
            watch_comm(&link);
            last_poll = Instant::now();
        }
        let spinning = spin_until.is_some_and(|until| Instant::now() < until);
        if spinning != nonblocking {
            if let Err(e) = inbound.socket.set_nonblocking(spinning) {
                break Err(format!("switching the connection's blocking mode failed: {e}"));
            }
            nonblocking = spinning;
        }
        let record = match read_record(&mut inbound.socket, &mut pending) {
            Ok(Some(record)) => record,
            Ok(None) => {
                if spinning {
                    // Between two reads, a microsecond of pause instructions rather than a tight
                    // loop of system calls: the thread may share a core with a stage's thread.
                    let until = Instant::now() + Duration::from_micros(1);
                    while Instant::now() < until {
                        std::hint::spin_loop();
                    }
                } else {
                    spin_until = None;
                }
                if let Some(reason) = link.silent_too_long(heard) {
                    break Err(reason);
                }
                continue;
            }
            Err(reason) => break Err(reason),
        };
        heard = Instant::now();
        if matches!(record, Record::Alive) {
            continue;
        }
        spin_until = Some(Instant::now() + SPIN);
        match record {
            Record::Close { steps } if steps == expected => {
                let drained = inbound.recv_stream.synchronize();
                let _ = inbound.socket.set_nonblocking(false);
                let answered = inbound.socket.write_all(&[DONE]);
                match (drained, answered) {
                    (Ok(()), Ok(())) => {
                        link.stop_with(format!("the peer closed the boundary after {steps} step(s)"));
                        break Ok(());
                    }
                    (Err(e), _) => break Err(format!("the receives did not complete: {e}")),
                    (_, Err(e)) => break Err(format!("answering the close failed: {e}")),
                }
            }
            Record::Close { steps } => {
                break Err(format!("the close names {steps} step(s), {expected} were announced"));
            }
            Record::Alive => unreachable!("handled above"),
            Record::Data(step) if step.step != expected => {
                break Err(format!("step {} announced where step {expected} was due", step.step));
            }
            Record::Data(step) => {
                let repeated = last_bytes == Some(step.bytes);
                let (recv_stream, capture_stream) = (&inbound.recv_stream, inbound.capture_stream.as_ref());
                let mut recv = |slot: usize, dst: &mut CudaViewMut<'_, u8>| {
                    receive_step(&link, recv_stream, capture_stream, slot, dst, repeated)
                };
                let filled = filler.fill(&step, stop, &mut recv);
                // The wait for a free slot is this rank's, not the peer's silence.
                heard = Instant::now();
                match filled {
                    Ok(true) => {
                        // The filler moved the phase to the next record with the slot filled.
                        expected += 1;
                        last_bytes = Some(step.bytes);
                    }
                    Ok(false) => break Ok(()),
                    Err(e) => break Err(format!("receiving step {}: {e}", step.step)),
                }
            }
        }
    };
    link.phase.set(Phase::Stopped, expected);
    if let Err(reason) = outcome {
        link.fail(reason);
    }
    filler.wake();
}

/// Posts the receive of one step into slot `slot`'s bytes `dst` on `recv_stream`, ordered like
/// a copy that writes them: a launch of the receive captured for this slot and byte count when
/// there is one; else, with `capture_stream` (graphs allowed) and a byte count that `repeated`
/// the previous step's, the receive is captured now (on `capture_stream`, which nothing else
/// uses; only while no other NCCL call of the process is in progress, see [`capture_receive`]) and
/// launched; else NCCL's receive call. A capture whose graph writes other memory than
/// the slot's (the slot grew since) is dropped. A failed capture fails the step (the link then
/// fails): NCCL's state after a half-made capture is not trusted.
fn receive_step(
    link: &Link,
    recv_stream: &Arc<CudaStream>,
    capture_stream: Option<&Arc<CudaStream>>,
    slot: usize,
    dst: &mut CudaViewMut<'_, u8>,
    repeated: bool,
) -> Result<()> {
    let Some(capture_stream) = capture_stream else {
        return link.comm.recv(recv_stream, dst, 0);
    };
    let mut held = link.recv_graphs.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
    let Some(graphs) = held.as_mut() else {
        return Err(link.error_or("the boundary failed"));
    };
    let bytes = dst.len();
    if let Some(at) = graphs.iter().position(|graph| graph.slot == slot && graph.bytes == bytes) {
        if graphs[at].exec.writes(dst) {
            let exec = &mut graphs[at].exec;
            link.comm.posting_launch(recv_stream, || exec.launch(recv_stream))?;
            link.graph_receives.fetch_add(1, Ordering::Relaxed);
            return Ok(());
        }
        graphs.remove(at);
    }
    let exec = if repeated { capture_receive(link, capture_stream, dst)? } else { None };
    let Some(exec) = exec else {
        return link.comm.recv(recv_stream, dst, 0);
    };
    if graphs.iter().filter(|graph| graph.slot == slot).count() >= RECV_GRAPHS_PER_SLOT {
        let oldest = graphs.iter().position(|graph| graph.slot == slot).expect("counted above");
        graphs.remove(oldest);
    }
    graphs.push(RecvGraph { slot, bytes, exec });
    let exec = &mut graphs.last_mut().expect("pushed above").exec;
    link.comm.posting_launch(recv_stream, || exec.launch(recv_stream))?;
    link.graph_receives.fetch_add(1, Ordering::Relaxed);
    Ok(())
}

/// Captures NCCL's receive into `dst` on `capture_stream` (relaxed mode: other threads' calls
/// are unaffected) and instantiates it; `None`, with nothing done, while another NCCL call of the
/// process is in progress or NCCL work of the process has not completed on its GPU (NCCL's
/// launch into a capture beside another launch, and beside an NCCL kernel of the process waiting
/// for the peer, was seen to stall inside the driver, see [`PostingAlone`]).
///
/// The process's NCCL work is waited for (polled) at most [`CAPTURE_SETTLE_WAIT`], on at most
/// [`CAPTURE_WAITS`] steps of the link that found it still running: a link whose receives
/// rarely find the process's NCCL work complete (the ranks' stages keep NCCL busy) costs its
/// steps at most that long in all, and then captures only where it finds the work complete
/// at once.
fn capture_receive(
    link: &Link,
    capture_stream: &Arc<CudaStream>,
    dst: &mut CudaViewMut<'_, u8>,
) -> Result<Option<GraphExec>> {
    let wait =
        if link.captures_missed.load(Ordering::Relaxed) < CAPTURE_WAITS { CAPTURE_SETTLE_WAIT } else { Duration::ZERO };
    let deadline = Instant::now() + wait;
    let mut polls = 0;
    let _alone = loop {
        if let Some(alone) = PostingAlone::try_settled()? {
            break alone;
        }
        if Instant::now() >= deadline {
            link.captures_missed.fetch_add(1, Ordering::Relaxed);
            return Ok(None);
        }
        poll_pause(&mut polls);
    };
    let capture = capture_stream.begin_capture(CaptureMode::Relaxed)?;
    let captured = link.comm.recv(capture_stream, dst, 0);
    let graph = capture.end();
    captured?;
    graph?.instantiate().map(Some)
}

enum Record {
    Data(Announced),
    Close { steps: u64 },
    Alive,
}

fn encode_record(kind: u8, step: u64, n: u64, elem_size: u64, elem: &str) -> Vec<u8> {
    let mut record = Vec::with_capacity(RECORD_HEAD + elem.len());
    record.extend_from_slice(&[kind, 0, 0, 0]);
    record.extend_from_slice(&(elem.len() as u32).to_le_bytes());
    record.extend_from_slice(&step.to_le_bytes());
    record.extend_from_slice(&n.to_le_bytes());
    record.extend_from_slice(&elem_size.to_le_bytes());
    record.extend_from_slice(elem.as_bytes());
    record
}

/// Reads what the connection has into `pending` and returns the first whole record, if any
/// (`Ok(None)` after a quiet poll interval). A closed connection or a malformed record is the
/// reason the link fails.
fn read_record(socket: &mut TcpStream, pending: &mut Vec<u8>) -> std::result::Result<Option<Record>, String> {
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
            if pending.len() >= RECORD_HEAD + name_len {
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
                    other => return Err(format!("a record of unknown kind {other}")),
                };
                pending.drain(..RECORD_HEAD + name_len);
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

/// Refuses, at boundary `boundary`, an element type whose name is longer than a record carries
/// (the receiver would fail the link on it).
fn check_type_name(boundary: usize, name: &'static str) -> Result<()> {
    if name.len() > MAX_TYPE_NAME {
        return Err(Error::Pipeline(PpError::TypeNameTooLong { boundary, name, max: MAX_TYPE_NAME }));
    }
    Ok(())
}

/// Element type names met on the wire, each kept once (`SlotState` names a type by a
/// `&'static str`).
static TYPE_NAMES: Mutex<Vec<&'static str>> = Mutex::new(Vec::new());

/// The most distinct element type names kept (each at most [`MAX_TYPE_NAME`] bytes).
const MAX_TYPE_NAMES: usize = 1024;

/// The name kept once for the process, or `None` when [`MAX_TYPE_NAMES`] are kept already.
fn intern(name: &str) -> Option<&'static str> {
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

/// The watchdog of a runtime's outbound links (inbound links are watched by their receiver
/// threads).
pub(super) struct Watchdog {
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl Watchdog {
    /// Starts the thread that watches this rank's outgoing links (`senders`) and sends the
    /// signs of life of its incoming ones (`heartbeats`); none when there are neither.
    pub(super) fn start(senders: Vec<Arc<Sender>>, heartbeats: Vec<Heartbeat>) -> Result<Option<Watchdog>> {
        let Some(first) = senders.first().map(|s| &s.link).or(heartbeats.first().map(|h| &h.link)) else {
            return Ok(None);
        };
        // A failure to start names the first link it would have watched.
        let first = Arc::clone(first);
        for sender in &senders {
            sender
                .watch
                .set_read_timeout(Some(Duration::from_millis(1)))
                .map_err(|e| io_error(&sender.link, "the connection's timeout", &e))?;
        }
        let stop = Arc::new(AtomicBool::new(false));
        let thread = std::thread::Builder::new()
            .name("ppnrt-watchdog".into())
            .spawn({
                let stop = Arc::clone(&stop);
                move || {
                    let start = Instant::now();
                    let mut heard = vec![start; senders.len()];
                    let mut sent = vec![start; heartbeats.len()];
                    while !stop.load(Ordering::SeqCst) {
                        for (sender, heard) in senders.iter().zip(&mut heard) {
                            sender.watch(heard);
                        }
                        for (heartbeat, sent) in heartbeats.iter().zip(&mut sent) {
                            heartbeat.beat(sent);
                        }
                        std::thread::sleep(POLL);
                    }
                }
            })
            .map_err(|e| io_error(&first, "starting the watchdog thread", &e))?;
        Ok(Some(Watchdog { stop, thread: Some(thread) }))
    }
}

impl Drop for Watchdog {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

/// The local side of every cross-rank boundary, keyed by boundary.
pub(super) struct Links {
    pub(super) senders: BTreeMap<usize, Arc<Sender>>,
    pub(super) inbound: BTreeMap<usize, Inbound>,
}

/// What [`connect`] needs of a local stage: its context and stream.
pub(super) struct LocalStage {
    pub(super) ctx: Arc<Context>,
    pub(super) stream: Arc<CudaStream>,
}

/// Joins the other ranks of `config` (see the module docs) and returns this rank's links.
///
/// # Errors
/// [`Error::Rendezvous`] for a failed rendezvous or a listener that cannot be bound;
/// [`PpError::PeerFailed`] for a connection that
/// fails; NCCL's error.
pub(super) fn connect(config: &PpConfig, plan: &Plan, stages: &[Option<LocalStage>]) -> Result<Links> {
    let rank = config.own_rank();
    let timeout = config.peer_timeout_value();
    let cross: Vec<_> = plan.boundaries.iter().filter(|b| b.transport == Transport::Nccl).copied().collect();
    // The listener of this rank's incoming boundaries, on an ephemeral port of every interface.
    let unbindable = |e: std::io::Error| RendezvousError::Address { addr: "0.0.0.0:0".into(), reason: e.to_string() };
    let listener = TcpListener::bind("0.0.0.0:0").map_err(unbindable)?;
    let port = listener.local_addr().map_err(unbindable)?.port();
    let mut contribution = port.to_le_bytes().to_vec();
    if rank == 0 {
        for _ in &cross {
            contribution.extend_from_slice(&NcclUniqueId::new()?.to_bytes());
        }
    }
    let rendezvous = Rendezvous {
        addr: config.rendezvous_addr().unwrap_or_default().to_string(),
        rank,
        world: config.world(),
        fingerprint: config.fingerprint(),
        timeout,
    };
    let members = rendezvous.exchange(&contribution)?;
    let malformed = |reason: String| {
        Error::Pipeline(PpError::PeerFailed { boundary: cross.first().map_or(0, |b| b.boundary), peer: 0, reason })
    };
    if let Some(short) = members.iter().position(|m| m.bytes.len() < 2) {
        return Err(malformed(format!("rank {short} contributed no listening port")));
    }
    let ids = &members[0].bytes[2..];
    if ids.len() != cross.len() * NcclUniqueId::BYTES {
        return Err(malformed(format!("rank 0 handed out {} id bytes for {} boundaries", ids.len(), cross.len())));
    }
    let address_of =
        |r: usize| SocketAddr::new(members[r].addr, u16::from_le_bytes([members[r].bytes[0], members[r].bytes[1]]));

    // Control connections: every outbound one first (a connect completes in the listener's
    // backlog, so no rank waits on another here), then accept the inbound ones in any order.
    let mut outbound = BTreeMap::new();
    for b in cross.iter().filter(|b| b.tx_rank == rank) {
        let mut socket = connect_with_retry(address_of(b.rx_rank), timeout)
            .map_err(|e| setup_error(b.boundary, b.rx_rank, "connecting the boundary", &e))?;
        let mut hello = HELLO_MAGIC.to_vec();
        hello.extend_from_slice(&(b.boundary as u32).to_le_bytes());
        socket.write_all(&hello).map_err(|e| setup_error(b.boundary, b.rx_rank, "greeting the receiver", &e))?;
        socket.set_nodelay(true).map_err(|e| setup_error(b.boundary, b.rx_rank, "TCP_NODELAY", &e))?;
        socket.set_write_timeout(Some(timeout)).map_err(|e| setup_error(b.boundary, b.rx_rank, "write timeout", &e))?;
        outbound.insert(b.boundary, socket);
    }
    let mut inbound_sockets = accept_inbound(&listener, &cross, rank, timeout)?;

    // Communicators, in boundary order on every rank.
    let mut links = Links { senders: BTreeMap::new(), inbound: BTreeMap::new() };
    for (i, b) in cross.iter().enumerate() {
        let sending = b.tx_rank == rank;
        if !sending && b.rx_rank != rank {
            continue;
        }
        let id: &[u8; NcclUniqueId::BYTES] =
            ids[i * NcclUniqueId::BYTES..(i + 1) * NcclUniqueId::BYTES].try_into().expect("sliced to the id's size");
        let stage = if sending { b.boundary } else { b.boundary + 1 };
        let local = stages[stage].as_ref().expect("this rank runs its boundary's stage");
        let peer = if sending { b.rx_rank } else { b.tx_rank };
        let socket = if sending {
            outbound.remove(&b.boundary).expect("connected above")
        } else {
            inbound_sockets.remove(&b.boundary).expect("accepted above")
        };
        let watched = setup_watched(config);
        let id = NcclUniqueId::from_bytes(id);
        let nccl_rank = i32::from(!sending);
        let comm = if watched {
            let mut joining = setup_watch(&socket, "joining the NCCL communicator", timeout);
            NcclComm::init_rank_watched(&local.ctx, 2, &id, nccl_rank, timeout, || {
                joining().map_err(|reason| Error::Pipeline(PpError::PeerFailed { boundary: b.boundary, peer, reason }))
            })?
        } else {
            NcclComm::init_rank(&local.ctx, 2, &id, nccl_rank)?
        };
        let clone = |socket: &TcpStream| {
            socket.try_clone().map_err(|e| setup_error(b.boundary, peer, "cloning the connection", &e))
        };
        let recv_graphs = Mutex::new(Some(Vec::new()));
        let link = Arc::new(Link {
            boundary: b.boundary,
            peer,
            recv_graphs,
            graph_receives: AtomicU64::new(0),
            captures_missed: AtomicU32::new(0),
            comm,
            failure: Arc::new(LinkFailure::new(b.boundary, peer)),
            connection: clone(&socket)?,
            timeout,
            silence_fails: silence_fails(config),
            phase: PhaseCell::new(),
        });
        let probe = CudaSlice::<u32>::alloc_persistent_eager(&local.stream, 4)?;
        if sending {
            let watch = clone(&socket)?;
            // The probe proves the link (and makes NCCL connect now, not in the first step).
            link.comm.send(&local.stream, &probe, 1)?;
            wait_for_probe(&link, &local.stream, &socket, watched)?;
            let control = Mutex::new(SendControl { socket, step: 0, closed: false, written: Instant::now() });
            let sender = Sender {
                link,
                tx_stream: Arc::clone(&local.stream),
                tx_device: b.tx_device,
                n_slots: config.n_slots(),
                control,
                watch,
            };
            links.senders.insert(b.boundary, Arc::new(sender));
        } else {
            let recv_stream = CudaStream::new(&local.ctx)?;
            let mut probe = probe;
            link.comm.recv(&recv_stream, &mut probe, 0)?;
            wait_for_probe(&link, &recv_stream, &socket, watched)?;
            let capture_stream = if recv_graphs_allowed(config)? { Some(CudaStream::new(&local.ctx)?) } else { None };
            links.inbound.insert(b.boundary, Inbound { link, socket, recv_stream, capture_stream });
        }
    }
    Ok(links)
}

/// Whether inbound links may receive through captured graphs: allowed by the configuration, an
/// NCCL of at least [`GRAPH_MIXING_VERSION`], and NCCL's support for mixing graph launches with
/// ordinary calls on one communicator not turned off (`NCCL_GRAPH_MIXING_SUPPORT=0`): without
/// it NCCL does not guarantee an ordinary call made while a graph launch is outstanding, and a
/// step of a new size is such a call.
fn recv_graphs_allowed(config: &PpConfig) -> Result<bool> {
    Ok(config.nccl_recv_graphs_allowed()
        && nccl()?.version() >= GRAPH_MIXING_VERSION
        && !mixing_support_off(std::env::var("NCCL_GRAPH_MIXING_SUPPORT").ok().as_deref()))
}

/// Whether the value of `NCCL_GRAPH_MIXING_SUPPORT` turns the support off (NCCL reads it as an
/// integer; 0 is off).
fn mixing_support_off(value: Option<&str>) -> bool {
    value.is_some_and(|text| text.trim().parse::<i64>() == Ok(0))
}

/// Whether the setup's waits for NCCL are bounded and watch the peer (always, except with the
/// setup broken on purpose: [`ProtocolFault::UnwatchedSetup`](crate::pp::ProtocolFault), tests
/// only). With [`ProtocolFault::ExitBeforeCommJoin`](crate::pp::ProtocolFault) this rank exits
/// here, before it joins its first communicator (tests only).
fn setup_watched(config: &PpConfig) -> bool {
    #[cfg(feature = "testing")]
    match config.fault() {
        crate::pp::config::ProtocolFault::ExitBeforeCommJoin => std::process::exit(EXIT_BEFORE_COMM_JOIN),
        crate::pp::config::ProtocolFault::UnwatchedSetup => return false,
        _ => {}
    }
    #[cfg(not(feature = "testing"))]
    let _ = config;
    true
}

/// The exit status of a rank that exits before it joins a communicator on purpose
/// ([`ProtocolFault::ExitBeforeCommJoin`](crate::pp::ProtocolFault)).
#[cfg(feature = "testing")]
const EXIT_BEFORE_COMM_JOIN: i32 = 86;

/// A check for a wait of the setup for NCCL (`what`): why the wait ends, when the peer closed
/// its end of the boundary's connection `socket` (it died) or `timeout` passed since this was
/// made.
fn setup_watch<'a>(
    socket: &'a TcpStream,
    what: &'static str,
    timeout: Duration,
) -> impl FnMut() -> std::result::Result<(), String> + 'a {
    let deadline = Instant::now() + timeout;
    move || {
        if Instant::now() >= deadline {
            return Err(format!("{what} did not finish within {timeout:?}"));
        }
        match peer_closed(socket) {
            Ok(false) => Ok(()),
            Ok(true) => Err(format!("{PEER_CLOSED} while {what}")),
            Err(e) => Err(format!("the boundary's connection failed while {what}: {e}")),
        }
    }
}

/// Whether the peer closed its end of `socket`: a peek that does not block (the socket is
/// blocking again afterwards; the setup is its only user).
fn peer_closed(socket: &TcpStream) -> std::io::Result<bool> {
    socket.set_nonblocking(true)?;
    let mut byte = [0u8; 1];
    let peeked = socket.peek(&mut byte);
    socket.set_nonblocking(false)?;
    match peeked {
        Ok(read) => Ok(read == 0),
        Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::Interrupted) => Ok(false),
        Err(e) => Err(e),
    }
}

/// Waits until the probe's send or receive on `stream` completed. When `watched`, the wait is
/// bounded by the link's timeout and ends when the peer closes `socket`: the link then fails
/// (its communicator aborted, so the stream drains) and its error is returned.
fn wait_for_probe(link: &Link, stream: &Arc<CudaStream>, socket: &TcpStream, watched: bool) -> Result<()> {
    if !watched {
        return stream.synchronize();
    }
    let done = CudaEvent::new(stream.context(), false)?;
    done.record(stream)?;
    let mut keep_waiting = setup_watch(socket, "moving the first message", link.timeout);
    let mut polls = 0u32;
    while !done.is_complete()? {
        if let Err(reason) = keep_waiting() {
            link.fail(reason.clone());
            stream.synchronize()?;
            return Err(link.stopped_or(&reason));
        }
        poll_pause(&mut polls);
    }
    Ok(())
}

fn setup_error(boundary: usize, peer: usize, what: &str, e: &std::io::Error) -> Error {
    Error::Pipeline(PpError::PeerFailed { boundary, peer, reason: format!("{what}: {e}") })
}

fn connect_with_retry(addr: SocketAddr, timeout: Duration) -> std::io::Result<TcpStream> {
    let start = Instant::now();
    loop {
        match TcpStream::connect_timeout(&addr, Duration::from_millis(500)) {
            Ok(socket) => return Ok(socket),
            Err(e) if start.elapsed() >= timeout => return Err(e),
            Err(_) => std::thread::sleep(Duration::from_millis(20)),
        }
    }
}

/// Accepts one connection per boundary this rank receives, each greeting with its boundary.
fn accept_inbound(
    listener: &TcpListener,
    cross: &[super::plan::BoundaryPlan],
    rank: usize,
    timeout: Duration,
) -> Result<BTreeMap<usize, TcpStream>> {
    let wanted: Vec<_> = cross.iter().filter(|b| b.rx_rank == rank).map(|b| (b.boundary, b.tx_rank)).collect();
    let mut sockets = BTreeMap::new();
    listener
        .set_nonblocking(true)
        .map_err(|e| RendezvousError::Address { addr: "0.0.0.0:0".into(), reason: e.to_string() })?;
    let start = Instant::now();
    while sockets.len() < wanted.len() {
        let missing = || wanted.iter().find(|(b, _)| !sockets.contains_key(b)).copied().unwrap_or((0, 0));
        let (mut socket, _) = match listener.accept() {
            Ok(accepted) => accepted,
            Err(e) if e.kind() == ErrorKind::WouldBlock => {
                if start.elapsed() >= timeout {
                    let (b, peer) = missing();
                    return Err(Error::Pipeline(PpError::PeerFailed {
                        boundary: b,
                        peer,
                        reason: format!("the sending rank never connected within {timeout:?}"),
                    }));
                }
                std::thread::sleep(Duration::from_millis(2));
                continue;
            }
            Err(e) => {
                let (b, peer) = missing();
                return Err(setup_error(b, peer, "accepting a connection", &e));
            }
        };
        let mut hello = [0u8; 12];
        let greeted = socket
            .set_nonblocking(false)
            .and_then(|()| socket.set_read_timeout(Some(timeout.saturating_sub(start.elapsed()).max(POLL))))
            .and_then(|()| socket.read_exact(&mut hello));
        if greeted.is_err() || &hello[..8] != HELLO_MAGIC {
            continue; // not one of ours
        }
        let b = u32::from_le_bytes(hello[8..12].try_into().expect("four bytes")) as usize;
        if wanted.iter().any(|&(w, _)| w == b) && !sockets.contains_key(&b) {
            let peer = wanted.iter().find(|&&(w, _)| w == b).map_or(0, |&(_, p)| p);
            socket.set_nodelay(true).map_err(|e| setup_error(b, peer, "TCP_NODELAY", &e))?;
            socket.set_write_timeout(Some(timeout)).map_err(|e| setup_error(b, peer, "write timeout", &e))?;
            sockets.insert(b, socket);
        }
    }
    Ok(sockets)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A connected pair on loopback; the reader's reads time out after 20 ms.
    fn pair() -> (TcpStream, TcpStream) {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let writer = TcpStream::connect(listener.local_addr().unwrap()).unwrap();
        let (reader, _) = listener.accept().unwrap();
        reader.set_read_timeout(Some(Duration::from_millis(20))).unwrap();
        writer.set_nodelay(true).unwrap();
        (writer, reader)
    }

    fn read_until_record(reader: &mut TcpStream, pending: &mut Vec<u8>) -> std::result::Result<Record, String> {
        let deadline = Instant::now() + Duration::from_secs(5);
        loop {
            if let Some(record) = read_record(reader, pending)? {
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
        assert!(config.nccl_recv_graphs_allowed());
        assert!(!config.clone().nccl_recv_graphs(false).nccl_recv_graphs_allowed());
        assert!(config.nccl_recv_graphs(false).to_string().ends_with(" nccl_recv_graphs=off"));
    }

    #[test]
    fn a_record_written_byte_by_byte_is_read_whole_and_two_in_one_write_both() {
        let (mut writer, mut reader) = pair();
        let mut pending = Vec::new();
        let record = encode_record(DATA, 7, 1000, 4, "f32");
        for byte in &record {
            assert!(read_record(&mut reader, &mut pending).unwrap().is_none(), "a partial record is not a record");
            writer.write_all(std::slice::from_ref(byte)).unwrap();
        }
        match read_until_record(&mut reader, &mut pending).unwrap() {
            Record::Data(step) => {
                assert_eq!((step.step, step.n, step.elem, step.bytes), (7, 1000, "f32", 4000));
            }
            Record::Close { .. } | Record::Alive => panic!("expected data"),
        }
        let mut three = encode_record(DATA, 8, 3, 2, "bf16");
        three.extend(encode_record(ALIVE, 0, 0, 0, ""));
        three.extend(encode_record(CLOSE, 9, 0, 0, ""));
        writer.write_all(&three).unwrap();
        assert!(
            matches!(read_until_record(&mut reader, &mut pending).unwrap(), Record::Data(s) if s.elem == "bf16" && s.bytes == 6)
        );
        assert!(matches!(read_until_record(&mut reader, &mut pending).unwrap(), Record::Alive));
        assert!(matches!(read_until_record(&mut reader, &mut pending).unwrap(), Record::Close { steps: 9 }));
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
        let cases: Vec<(Vec<u8>, &str)> = vec![
            (encode_record(9, 0, 1, 4, "f32"), "unknown kind"),
            (encode_record(DATA, 0, 0, 4, "f32"), "element(s)"),
            (encode_record(DATA, 0, u64::MAX, 8, "f64"), "element(s)"),
            (encode_record(DATA, 0, 1, 4, &"x".repeat(MAX_TYPE_NAME + 1)), "type name of"),
            (
                {
                    let mut r = encode_record(DATA, 0, 1, 1, "ab");
                    let at = r.len() - 2;
                    r[at] = 0xff;
                    r
                },
                "not UTF-8",
            ),
        ];
        for (bytes, expected) in cases {
            let (mut writer, mut reader) = pair();
            writer.write_all(&bytes).unwrap();
            let err = read_until_record(&mut reader, &mut Vec::new()).err().unwrap_or_default();
            assert!(err.contains(expected), "{expected:?} not in {err:?}");
        }
        let (writer, mut reader) = pair();
        drop(writer);
        let err = read_until_record(&mut reader, &mut Vec::new()).err().unwrap_or_default();
        assert!(err.contains("closed"), "{err}");
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
