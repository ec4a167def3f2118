//! A link between two ranks: its NCCL communicator, its failure record, the receiver's phase,
//! and the receive graphs captured for its slots.

use std::io::{ErrorKind, Read};
use std::net::TcpStream;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use super::ipc::IpcFlags;
use super::sender::{heartbeat_interval, silence};
use super::wire::BackWriter;
use crate::nccl::NcclComm;
use crate::pp::error::{Error, PpError, ReceiverState, Result};
use crate::pp::fault::{Fault, FaultPoint};
use crate::safe::{GraphExec, KeptMemory};

/// Why a link stopped, set once, and whether it was aborted (not closed cleanly). Shared with the
/// runtime's readbacks: a readback holds this record, not the link (whose connection and
/// communicator end with the runtime), and can tell whether the link failed after the runtime is
/// gone.
pub(in crate::pp) struct LinkFailure {
    pub(super) boundary: usize,
    pub(super) peer: usize,
    pub(super) reason: Mutex<Option<(String, bool)>>,
    /// Whether a call returned the link's error to its caller.
    pub(super) reported: AtomicBool,
}

impl LinkFailure {
    pub(super) fn new(boundary: usize, peer: usize) -> LinkFailure {
        LinkFailure { boundary, peer, reason: Mutex::new(None), reported: AtomicBool::new(false) }
    }

    pub(super) fn reason(&self) -> MutexGuard<'_, Option<(String, bool)>> {
        self.reason.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Whether the link failed and its communicator was aborted (its receives may be cut short).
    pub(in crate::pp) fn aborted(&self) -> bool {
        self.reason().as_ref().is_some_and(|(_, aborted)| *aborted)
    }

    /// The typed error of the stopped link, if it stopped (not counted as reported).
    pub(super) fn error(&self) -> Option<Error> {
        let (reason, _) = self.reason().clone()?;
        Some(Error::Pipeline(PpError::PeerFailed { boundary: self.boundary, peer: self.peer, reason }))
    }

    /// The error of a link that failed (was aborted) without any call returning it to a caller.
    pub(in crate::pp) fn unreported(&self) -> Option<Error> {
        (self.aborted() && !self.reported.load(Ordering::Relaxed)).then(|| self.error()).flatten()
    }

    /// [`error`](Self::error) for a caller: the failure counts as reported.
    pub(in crate::pp) fn reported_error(&self) -> Option<Error> {
        let error = self.error()?;
        self.reported.store(true, Ordering::Relaxed);
        Some(error)
    }
}

/// One boundary between two ranks, as seen by either of them.
pub(in crate::pp) struct Link {
    pub(in crate::pp) boundary: usize,
    /// The other rank.
    pub(in crate::pp) peer: usize,
    /// Whether this rank sends on the link (its TX end); else it receives.
    pub(super) sends: bool,
    /// On the RX rank: the receives captured in CUDA graphs (see [`receive_step`]); `None` once
    /// the link failed. Declared before `comm`, so dropped first: NCCL's destroy and abort wait
    /// until every graph holding an operation of the communicator is destroyed.
    pub(super) recv_graphs: Mutex<Option<Vec<RecvGraph>>>,
    /// How many steps were received through captured graphs.
    pub(super) graph_receives: AtomicU64,
    /// On how many steps a capture found the process's NCCL work still running within its wait
    /// (see [`capture_receive`]).
    pub(super) captures_missed: AtomicU32,
    /// What moves the steps: the link's NCCL communicator, or the flag words of an IPC boundary.
    pub(in crate::pp) carrier: Carrier,
    pub(super) failure: Arc<LinkFailure>,
    /// Every link of this rank: a link that fails fails the others first (see [`Link::fail`]).
    pub(super) rank_links: Arc<RankLinks>,
    /// A handle of the link's control connection, shut down when the link fails so that the
    /// peer learns it at once (its end reads the connection's end).
    pub(super) connection: TcpStream,
    /// The peer timeout: a peer silent for longer fails the link; signs of life go out ten times
    /// as often.
    pub(super) timeout: Duration,
    /// Whether silence fails the link (see [`silence_fails`]).
    pub(super) silence_fails: bool,
    /// On the RX rank: what its receiver thread is doing.
    pub(in crate::pp) phase: PhaseCell,
    /// On the RX rank: the TX rank's waits for a free slot ([`Credit`]).
    pub(super) credit: Option<Credit>,
    /// The protocol broken on purpose (tests only): the failure of this link is not passed on to
    /// the rank's other links ([`FaultPoint::ContainedFailure`]), or it waits before it is
    /// recorded ([`Fault::fail_delay`]).
    pub(super) fault: Fault,
}

/// What moves a link's steps.
pub(in crate::pp) enum Carrier {
    /// A two-rank NCCL communicator (the TX rank is its rank 0).
    Nccl(NcclComm),
    /// The RX rank's exported slots and flag words (see [`super::ipc`]).
    Ipc(IpcFlags),
}

/// What a receiver thread is doing, since when: two atomics (the phase with its step, and the
/// time it began), read apart (a diagnosis, not a synchronisation).
pub(in crate::pp) struct PhaseCell {
    /// The step shifted left by 2, or'd with the phase.
    pub(super) word: AtomicU64,
    /// When the phase began, in ns since `epoch`.
    pub(super) began_ns: AtomicU64,
    pub(super) epoch: Instant,
}

/// A receiver thread's phase (see [`ReceiverState`]).
#[derive(Clone, Copy)]
pub(in crate::pp) enum Phase {
    AwaitingRecord = 0,
    AwaitingFreeSlot = 1,
    Posting = 2,
    Stopped = 3,
}

impl PhaseCell {
    pub(super) fn new() -> PhaseCell {
        PhaseCell {
            word: AtomicU64::new(Phase::AwaitingRecord as u64),
            began_ns: AtomicU64::new(0),
            epoch: Instant::now(),
        }
    }

    /// Records that the thread entered `phase` for step `step`, now.
    pub(in crate::pp) fn set(&self, phase: Phase, step: u64) {
        let now = u64::try_from(self.epoch.elapsed().as_nanos()).unwrap_or(u64::MAX);
        self.began_ns.store(now, Ordering::Relaxed);
        self.word.store((step << 2) | phase as u64, Ordering::Release);
    }

    pub(in crate::pp) fn get(&self) -> ReceiverState {
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
pub(super) struct RecvGraph {
    pub(super) slot: usize,
    pub(super) bytes: usize,
    pub(super) exec: GraphExec,
}

/// How many byte counts each slot keeps a captured receive for (the oldest is dropped).
pub(super) const RECV_GRAPHS_PER_SLOT: usize = 2;

/// How long a receiver thread about to capture a receive waits for the process's NCCL work to
/// complete (see [`capture_receive`]).
pub(super) const CAPTURE_SETTLE_WAIT: Duration = Duration::from_millis(1);

/// On how many steps a link waits so; later it captures only when it finds the work complete
/// at once.
pub(super) const CAPTURE_WAITS: u32 = 32;

/// On the RX rank of a link: whether the TX rank waits for a free slot (its `tx_wait` sent a
/// [`WAITING`] record), and the sealed answers this rank writes back. The receiver thread answers
/// each [`WAITING`] at once with the steps this rank's stage has taken, and the stage's next take
/// answers again ([`Link::answer_credit`]), so the TX rank's wait ends as soon as a slot is free,
/// and nothing is written back while nobody waits.
pub(in crate::pp) struct Credit {
    pub(super) wanted: AtomicBool,
    pub(super) back: Arc<Mutex<BackWriter>>,
}

/// How long the aborts of the links a rank sends on are given to end before the aborts of the
/// links it receives on begin (see [`RankLinks`]): each sets its communicator's abort flag at
/// once; an abort still running after this waits on the device, and the receiving links' aborts
/// must begin.
const SENDS_ABORT_HEAD_START: Duration = Duration::from_millis(100);

/// The links of one rank. A rank's boundaries form one pipeline: when one link fails, what this
/// rank sends on from then on may come from a receive the abort cut short, so every other link
/// of the rank fails too, before any of its receives is cut short (before any cut-short data
/// exists). The ranks downstream then fail their links and refuse the readbacks of what may be
/// affected, instead of delivering it; the ranks upstream learn it at once.
///
/// A rank fails its links one failure at a time (`failing`), and a failure ends every link it
/// stops together: first each one's captured receives are destroyed, then their communicators
/// are aborted, those this rank sends on first, whichever link failed, given
/// [`SENDS_ABORT_HEAD_START`] to end before the aborts of those it receives on begin
/// ([`NcclComm::abort_first_then`]): a receiving link's abort cuts its receive short, and the
/// rank's stream then runs on into the sends queued behind it, which must find their
/// communicators aborted already (else the next rank could receive a cut-short step as whole
/// before it learns of the failure). Only a head start, not one abort after the other: an abort's
/// cleanup (which may wait for the whole device) would wait for a receive kernel of a link not yet
/// aborted, and hold the driver while the next link's graphs are destroyed: the rank would hang.
/// Before any of this releases the rank's stream, the next ranks over IPC know
/// ([`await_ipc_downstream`]); the IPC links' own waits are released last ([`release_ipc`]).
#[derive(Default)]
pub(in crate::pp) struct RankLinks {
    links: Mutex<Vec<std::sync::Weak<Link>>>,
    failing: Mutex<()>,
}

impl RankLinks {
    pub(super) fn add(&self, link: &Arc<Link>) {
        self.links.lock().unwrap_or_else(|poisoned| poisoned.into_inner()).push(Arc::downgrade(link));
    }

    /// Stops every link of the rank but `failed` that had not stopped, naming it; returns them.
    fn stop_others(&self, failed: &Link, reason: &str) -> Vec<Arc<Link>> {
        let others: Vec<Arc<Link>> = self
            .links
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .iter()
            .filter_map(std::sync::Weak::upgrade)
            .filter(|link| !std::ptr::eq(Arc::as_ptr(link), failed))
            .collect();
        others
            .into_iter()
            .filter(|link| {
                link.stop_failed(format!(
                    "boundary {} of this rank (with rank {}) failed first: {reason}",
                    failed.boundary, failed.peer
                ))
            })
            .collect()
    }
}

/// Waits until the next ranks know of a failure that stopped `stopped` (each recorded as
/// failed; see [`RankLinks`]), before anything lets this rank's stream run on. A flag word cannot
/// be taken back once a stream is released towards it: once this rank's receive of a step that
/// never came is released (its own wait on a flag word, or its NCCL communicator's abort), its
/// stream runs on into its sends to the next ranks with whatever the slot held, and over IPC
/// those arrive there whole. So the next ranks must know first, and so must theirs: each IPC link
/// this rank sends on was shut down for writing when it stopped; this rank now waits (at most the
/// link's peer timeout) until its peer closes the connection, which the peer does only once it
/// recorded the failure and its own next ranks did the same.
fn await_ipc_downstream(stopped: &[&Link]) {
    for link in stopped.iter().filter(|link| link.sends && link.ipc().is_some()) {
        wait_for_peer_close(&link.connection, link.timeout);
    }
}

/// Ends the IPC links a failure stopped (`stopped`), once the next ranks know
/// ([`await_ipc_downstream`]) and the communicators are aborted: closes this rank's links from
/// the ranks before it (telling them in turn) and releases its waits, the sends' waits for a
/// free slot first, then the receives' waits.
fn release_ipc(stopped: &[&Link]) {
    let senders = stopped.iter().filter(|link| link.sends);
    for link in stopped.iter().filter(|link| !link.sends) {
        let _ = link.connection.shutdown(std::net::Shutdown::Both);
    }
    let receivers = stopped.iter().filter(|link| !link.sends);
    for link in senders.chain(receivers) {
        if let Some(Err(e)) = link.ipc().map(IpcFlags::release) {
            crate::safe::record_drop_error(e);
        }
    }
}

/// Reads `connection` (discarding what comes) until the peer closes it, fails, or `timeout`
/// passes.
fn wait_for_peer_close(connection: &TcpStream, timeout: Duration) {
    let start = Instant::now();
    let mut bytes = [0u8; 256];
    let mut reader = connection;
    while start.elapsed() < timeout {
        if reader.set_read_timeout(Some(Duration::from_millis(10))).is_err() {
            return;
        }
        match reader.read(&mut bytes) {
            Ok(0) => return,
            Ok(_) => {}
            Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut | ErrorKind::Interrupted) => {}
            Err(_) => return,
        }
    }
}

impl Link {
    /// Fails the link (once): records `reason`, shuts the control connection down (the peer's
    /// link fails too, within milliseconds, whatever this side's reason), fails every other link
    /// of the rank (see [`RankLinks`]) and aborts the communicators, so no NCCL kernel of them
    /// stays queued.
    pub(in crate::pp) fn fail(&self, reason: String) {
        if self.is_stopped() {
            return; // whoever stopped it ends it
        }
        let fail_delay = self.fault.fail_delay();
        if !fail_delay.is_zero() {
            std::thread::sleep(fail_delay);
        }
        let _failing = self.rank_links.failing.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        if !self.stop_failed(reason.clone()) {
            return;
        }
        let contained = self.fault.at(FaultPoint::ContainedFailure);
        let others = if contained { Vec::new() } else { self.rank_links.stop_others(self, &reason) };
        let stopped: Vec<&Link> = std::iter::once(self).chain(others.iter().map(|link| &**link)).collect();
        // NCCL's abort waits until every graph holding an operation of the communicator is
        // destroyed: destroy the captured receives first, keeping their slots' memory alive
        // until the aborts have stopped their runs.
        let kept: Vec<KeptMemory> = stopped
            .iter()
            .flat_map(|link| link.recv_graphs.lock().unwrap_or_else(|poisoned| poisoned.into_inner()).take())
            .flatten()
            .map(|graph| graph.exec.destroy_keeping_memory())
            .collect();
        // The next ranks over IPC know before this link's receive is released (see
        // `await_ipc_downstream`): an IPC send behind it would deliver the cut-short step whole.
        await_ipc_downstream(&stopped);
        // The communicators this rank sends on first, whichever link failed: their aborts set
        // their flags before a receive is cut short and the rank's stream runs on into the sends
        // queued behind it (see `RankLinks`).
        let comms = |sends: bool| -> Vec<&NcclComm> {
            stopped.iter().filter(|link| link.sends == sends).filter_map(|link| link.nccl()).collect()
        };
        for result in NcclComm::abort_first_then(&comms(true), &comms(false), SENDS_ABORT_HEAD_START) {
            if let Err(e) = result {
                crate::safe::record_drop_error(e);
            }
        }
        drop(kept);
        let ipc: Vec<&Link> = stopped.iter().copied().filter(|link| link.ipc().is_some()).collect();
        if !ipc.is_empty() {
            release_ipc(&ipc);
        }
    }

    /// Records `reason` as the link's failure and shuts its control connection down; false if
    /// it had stopped before.
    fn stop_failed(&self, reason: String) -> bool {
        let stopped = self.stop(reason, true);
        if stopped {
            // An IPC link's peer is told in the order `release_ipc` keeps.
            let how = match self.ipc() {
                None => Some(std::net::Shutdown::Both),
                Some(_) if self.sends => Some(std::net::Shutdown::Write),
                Some(_) => None,
            };
            if let Some(how) = how {
                let _ = self.connection.shutdown(how);
            }
        }
        stopped
    }

    /// On the RX rank: tells the TX rank that this rank's stage has taken `taken` steps, when it
    /// waits for a free slot (or `now`, the receiver thread's answer to its [`WAITING`]). Called
    /// with the ring's lock held: never waits; a connection that is full or failed loses nothing
    /// (the answer stays queued for the next write; a failed connection fails the link through its
    /// reads).
    pub(in crate::pp) fn answer_credit(&self, taken: u64, now: bool) {
        let Some(credit) = &self.credit else { return };
        let wanted = || credit.wanted.load(Ordering::Relaxed) && credit.wanted.swap(false, Ordering::AcqRel);
        if !now && !wanted() {
            return;
        }
        let mut back = credit.back.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        let _ = back.send_credit(&self.connection, taken);
    }

    /// The link's NCCL communicator, when NCCL carries it.
    pub(in crate::pp) fn nccl(&self) -> Option<&NcclComm> {
        match &self.carrier {
            Carrier::Nccl(comm) => Some(comm),
            Carrier::Ipc(_) => None,
        }
    }

    /// The link's flag words, when it is an IPC boundary.
    pub(in crate::pp) fn ipc(&self) -> Option<&IpcFlags> {
        match &self.carrier {
            Carrier::Ipc(flags) => Some(flags),
            Carrier::Nccl(_) => None,
        }
    }

    /// Records why the link stopped without aborting (a clean close).
    pub(super) fn stop_with(&self, reason: String) {
        self.stop(reason, false);
    }

    /// Records why the link stopped; false if it had stopped before.
    pub(super) fn stop(&self, reason: String, aborted: bool) -> bool {
        let mut slot = self.failure.reason();
        if slot.is_some() {
            return false;
        }
        *slot = Some((reason, aborted));
        true
    }

    /// How many steps were received through captured graphs.
    #[cfg(feature = "testing")]
    pub(in crate::pp) fn graph_receives(&self) -> u64 {
        self.graph_receives.load(Ordering::Relaxed)
    }

    /// On the RX side of an IPC boundary: the steps announced in the control block (0 over NCCL).
    #[cfg(feature = "testing")]
    pub(in crate::pp) fn block_announcements(&self) -> u64 {
        self.ipc().map_or(0, super::ipc::IpcFlags::block_announcements)
    }

    /// The typed error of a stopped link, if it stopped, for a caller: the failure counts as
    /// reported.
    pub(in crate::pp) fn stopped(&self) -> Option<Error> {
        self.failure.reported_error()
    }

    /// Whether the link stopped (failed, or closed cleanly).
    pub(in crate::pp) fn is_stopped(&self) -> bool {
        self.failure.reason().is_some()
    }

    pub(super) fn error(&self) -> Option<Error> {
        self.failure.error()
    }

    /// The link's failure record, for the runtime's readbacks.
    pub(in crate::pp) fn failure(&self) -> Arc<LinkFailure> {
        Arc::clone(&self.failure)
    }

    /// Whether the link failed and its communicator was aborted (its receives may be cut short).
    pub(in crate::pp) fn aborted(&self) -> bool {
        self.failure.aborted()
    }

    /// The typed error of the stopped link, or [`PpError::PeerFailed`] with `reason` if it has no
    /// recorded one, for a caller (see [`stopped`](Self::stopped)).
    pub(super) fn stopped_or(&self, reason: &str) -> Error {
        self.failure.reported.store(true, Ordering::Relaxed);
        self.error_or(reason)
    }

    /// [`stopped_or`](Self::stopped_or) for this crate's own threads: the failure does not count
    /// as reported.
    pub(super) fn error_or(&self, reason: &str) -> Error {
        self.error().unwrap_or_else(|| {
            Error::Pipeline(PpError::PeerFailed { boundary: self.boundary, peer: self.peer, reason: reason.into() })
        })
    }

    pub(super) fn check(&self) -> Result<()> {
        self.stopped().map_or(Ok(()), Err)
    }

    /// Why the link fails when the peer, last heard from at `heard`, has been silent for longer
    /// than the peer timeout; `None` while it has not (or silence does not fail links).
    pub(super) fn silent_too_long(&self, heard: Instant) -> Option<String> {
        let silent = heard.elapsed();
        (self.silence_fails && silent > self.timeout).then(|| silence(silent))
    }

    /// How often this rank shows the peer it is alive.
    pub(super) fn heartbeat_interval(&self) -> Duration {
        heartbeat_interval(self.timeout)
    }
}
