//! The TX rank's end of a link: the step's record and NCCL's send, signs of life, the clean
//! close.

use std::io::{ErrorKind, Read, Write};
use std::net::TcpStream;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, TryLockError};
use std::time::{Duration, Instant};

use super::link::{Carrier, Link};
use super::wire::{BackReader, check_type_name, encode_record};
use super::{ALIVE, CLOSE, CREDIT, DATA, DONE, WAITING, WATCH_PEEK};
use crate::auth::Sealer;
use crate::local_channel::ControlBlock;
use crate::pp::config::PpConfig;
use crate::pp::error::{Error, PpError, Result};
use crate::pp::fault::{Fault, FaultPoint, Tamper};
use crate::pp::timing::{POLL, poll_until};
use crate::safe::event_pool::StreamEvent;
use crate::safe::{CudaSlice, CudaStream, DeviceRepr, DeviceSlice};

/// The TX rank's end of a link.
pub(in crate::pp) struct Sender {
    pub(in crate::pp) link: Arc<Link>,
    pub(in crate::pp) tx_stream: Arc<CudaStream>,
    pub(in crate::pp) tx_device: i32,
    pub(super) n_slots: usize,
    /// The sending calls' state and the reading end of the connection: held by a `tx` for its
    /// whole call (a `tx_wait`'s wait for a free slot included) and by the close.
    pub(super) control: Mutex<SendControl>,
    /// The writing end of the connection, held only while a record is written: the watchdog's
    /// signs of life go out through it while a call holds `control` (a wait longer than the
    /// peer timeout must not look like a hung rank to the peer).
    pub(super) writer: Mutex<ControlWriter>,
    /// When the peer was last heard from, by whichever reader read it (the watchdog, a waiting
    /// `tx_wait`, the close).
    pub(super) heard: Heard,
    /// A second handle of the control connection: the watchdog reads the peer's signs of life
    /// (and sees its end) through it.
    pub(super) watch: TcpStream,
    /// The protocol broken on purpose (tests only): steps announced and never sent, records
    /// forged, replayed or cut short.
    pub(super) fault: Fault,
}

pub(super) struct SendControl {
    /// The connection, read for the RX rank's answers by a waiting `tx_wait` and the close.
    pub(super) socket: TcpStream,
    /// The RX rank's answers, checked as they come.
    pub(super) back: BackReader,
    /// The steps the RX rank's stage has taken, as far as its answers told ([`CREDIT`]).
    pub(super) credit: u64,
    pub(super) step: u64,
    /// On an IPC boundary: this rank's mappings of the RX rank's slots (see [`super::ipc`]);
    /// empty over NCCL.
    pub(super) ipc_slots: Vec<CudaSlice<u8>>,
    /// Whether the close began (no `tx` after it).
    pub(super) closed: bool,
    /// The element type (name, byte size) of the last step announced over the connection: a
    /// step of the same type may be announced in the control block of an IPC boundary.
    pub(super) last_elem: Option<(&'static str, usize)>,
    /// Over NCCL: an event recorded on the TX stream right after the last step's send (none
    /// before the first), the close's witness that every send of the link completed (see
    /// [`Sender::await_sends`]).
    pub(super) sent: Option<StreamEvent>,
}

/// The writing end of a TX rank's control connection (see [`Sender::writer`]).
pub(super) struct ControlWriter {
    pub(super) socket: TcpStream,
    /// Seals the records this end writes, in the order they are written.
    pub(super) sealer: Sealer,
    /// When this rank last wrote to the connection (a record or a sign of life).
    pub(super) written: Instant,
    /// Whether the close record went out (nothing follows it, no sign of life either; the
    /// watchdog reads this without `control`).
    pub(super) closed: bool,
    /// Over IPC, the RX rank's control block: its receiver thread, when it sleeps, is woken after
    /// each record (it sleeps on the block's sleep word, not on the connection).
    pub(super) wakes: Option<Arc<ControlBlock>>,
}

impl ControlWriter {
    /// Seals and writes one record of `kind` (see [`encode_record`]).
    pub(super) fn write(&mut self, kind: u8, step: u64, n: u64, elem_size: u64, elem: &str) -> std::io::Result<()> {
        let record = encode_record(&mut self.sealer, kind, step, n, elem_size, elem);
        self.write_sealed(&record)
    }

    /// Writes a record sealed by this writer's sealer.
    pub(super) fn write_sealed(&mut self, record: &[u8]) -> std::io::Result<()> {
        self.socket.write_all(record)?;
        self.written = Instant::now();
        if let Some(block) = &self.wakes {
            block.wake_receiver();
        }
        Ok(())
    }
}

/// When a peer was last heard from: an instant shared by the threads that read its connection.
pub(super) struct Heard {
    epoch: Instant,
    /// Nanoseconds after `epoch`.
    ns: AtomicU64,
}

impl Heard {
    /// Heard now.
    pub(super) fn new() -> Heard {
        Heard { epoch: Instant::now(), ns: AtomicU64::new(0) }
    }

    /// Records that the peer was heard from now.
    pub(super) fn mark(&self) {
        let ns = u64::try_from(self.epoch.elapsed().as_nanos()).unwrap_or(u64::MAX);
        self.ns.fetch_max(ns, Ordering::Relaxed);
    }

    /// When the peer was last heard from.
    pub(super) fn get(&self) -> Instant {
        self.epoch + Duration::from_nanos(self.ns.load(Ordering::Relaxed))
    }
}

/// How often a rank shows a peer it is alive, for a peer `timeout`: ten times per timeout,
/// at most once per poll interval and at least once a second.
pub(super) fn heartbeat_interval(timeout: Duration) -> Duration {
    (timeout / 10).clamp(POLL, Duration::from_secs(1))
}

/// Whether a peer silent for longer than the peer timeout fails its link: always, except with
/// the liveness check broken on purpose ([`ProtocolFault::IgnoreSilence`], tests only).
pub(super) fn silence_fails(config: &PpConfig) -> bool {
    !config.faults().at(FaultPoint::IgnoreSilence)
}

/// Why a link whose peer was silent for `silent` (more than the peer timeout) fails.
pub(super) fn silence(silent: Duration) -> String {
    format!("no sign of life from the peer for {silent:?}, more than the peer timeout (its process hung or stopped?)")
}

/// Why a link fails when its connection ends without the close record.
pub(super) const PEER_CLOSED: &str =
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
    ///
    /// With `wait` (`tx_wait`), first waits, at most that long, until the RX rank's stage has
    /// taken the step the slot last held ([`PpError::Timeout`] with nothing sent otherwise): the
    /// TX rank asks with a [`WAITING`] record and reads the RX rank's [`CREDIT`] answers.
    /// Without it the send is queued at once and waits on the device.
    pub(in crate::pp) fn tx<T: DeviceRepr, S: DeviceSlice<T>>(
        &self,
        x: &S,
        n: usize,
        wait: Option<Duration>,
    ) -> Result<usize> {
        check_type_name(self.link.boundary, T::NAME)?;
        self.link.check()?;
        // No capture of the TX stream begins between this check and the send (and its witness).
        let gate = self.tx_stream.enqueue_gate_uncaptured("PpNRt::tx to another rank")?;
        let mut control = self.lock();
        if control.closed {
            return Err(self.link.stopped_or("the boundary was closed"));
        }
        if let Some(timeout) = wait {
            self.wait_for_credit(&mut control, timeout)?;
        }
        let view = x.as_view().slice(..n)?;
        let step = control.step;
        let slot = (step % self.n_slots as u64) as usize;
        if let Some(capacity) = control.ipc_slots.get(slot).map(|mapped| mapped.len()) {
            if view.byte_len() > capacity {
                return Err(crate::pp::ring::too_large(self.link.boundary, view.byte_len(), capacity));
            }
        }
        let elem = (T::NAME, std::mem::size_of::<T>());
        if let Err(e) = self.announce(&mut control, step, n as u64, elem) {
            self.link.fail(format!("writing step {step}'s record failed: {e}"));
            return Err(self.link.stopped().expect("failed above"));
        }
        if self.fault.at(FaultPoint::AnnounceWithoutSend) {
            control.step += 1;
            return Ok((step % self.n_slots as u64) as usize);
        }
        let sent: Result<()> = match &self.link.carrier {
            Carrier::Ipc(flags) => {
                let mapped = &mut control.ipc_slots[slot];
                match mapped.as_view_mut().slice_mut(..view.byte_len()) {
                    Ok(mut dst) => flags.send(&self.tx_stream, step, view.into_bytes(), &mut dst),
                    Err(e) => Err(e.into()),
                }
            }
            // SAFETY: the RX rank receives exactly the bytes of the record written above (n
            // elements of `size_of::<T>()` bytes, sealed), which are `view`'s bytes.
            Carrier::Nccl(comm) => unsafe { comm.send(&self.tx_stream, &view, 1) }.map_err(Into::into),
        };
        if let Err(e) = sent {
            // The send may or may not be queued, and its record is out: the link cannot be
            // trusted with another step, and the RX rank must not wait for this one.
            // A send that failed because the link failed meanwhile (its communicator aborted by
            // the watchdog or a receiver thread) reports that failure, as every later call does.
            self.link.fail(format!("the send of step {step} failed: {e}"));
            return Err(self.link.stopped().unwrap_or(e));
        }
        // Over NCCL, the close's witness that this send completed: an event right after it (one
        // record per step, of the same event; a record at the close would also wait for the
        // caller's work queued after the last send, which may wait on another boundary).
        if self.link.nccl().is_some() {
            if let Err(e) = self.tx_stream.record_after_enqueued(Some(&gate), &mut control.sent) {
                // The close could not tell whether this send completed: the link cannot be
                // trusted with another step (the send and its record are out).
                self.link.fail(format!("recording the end of step {step}'s send failed: {e}"));
                return Err(self.link.stopped().unwrap_or_else(|| e.into()));
            }
        }
        control.step += 1;
        Ok(slot)
    }

    /// Announces step `step` of `n` elements of `elem` (name, byte size) to the RX rank. Over IPC,
    /// a step of the previous step's element type goes into the control block's announcement
    /// line when the RX rank took the one it held (no system call, no seal: the block is shared
    /// with the peer alone), and the RX rank's receiver thread is woken if it sleeps (a futex
    /// wake, no record). Otherwise (over NCCL, the first step and each change
    /// of type, a full block, a record tampered with on purpose) the sealed record goes over the
    /// connection. (A wait for a free slot asked on the connection may then be read after its
    /// step: the RX rank takes it as stale, see `inbox`.)
    fn announce(
        &self,
        control: &mut SendControl,
        step: u64,
        n: u64,
        elem: (&'static str, usize),
    ) -> std::io::Result<()> {
        let tamper = self.fault.tamper(step);
        if let Carrier::Ipc(flags) = &self.link.carrier {
            if tamper.is_none() && control.last_elem == Some(elem) && flags.announce(step, n) {
                flags.wake_receiver();
                return Ok(());
            }
        }
        let mut writer = self.writer();
        let record = encode_record(&mut writer.sealer, DATA, step, n, elem.1 as u64, elem.0);
        let record = match tamper {
            None => record,
            Some(tamper) => match self.tampered(&mut writer, tamper, step, record) {
                Some(record) => record,
                // The link failed already, with the reason every call reports.
                None => return Err(std::io::Error::other("the record was cut short on purpose")),
            },
        };
        writer.write_sealed(&record)?;
        control.last_elem = Some(elem);
        Ok(())
    }

    /// The record of `step` as the fault this link was built with makes it ([`Tamper`]): altered
    /// after its seal, written twice, or cut short (then the connection is ended and the link
    /// failed: `None`). Tests only: without the `testing` feature no tampering is asked for.
    #[cold]
    fn tampered(&self, writer: &mut ControlWriter, tamper: Tamper, step: u64, mut record: Vec<u8>) -> Option<Vec<u8>> {
        match tamper {
            Tamper::Forge => {
                record[16] ^= 1; // the element count, after the seal
                Some(record)
            }
            Tamper::Replay => {
                let twice = [record.as_slice(), record.as_slice()].concat();
                Some(twice)
            }
            Tamper::Truncate => {
                let _ = writer.socket.write_all(&record[..record.len() / 2]);
                self.link.fail(format!("step {step}'s record cut short on purpose"));
                None
            }
        }
    }

    /// Waits, at most `timeout`, until the RX rank's stage has taken enough steps for this one
    /// to find a free slot there; reads the connection for the answers meanwhile (the
    /// watchdog leaves the reading to it while the lock is held, and goes on sending this rank's
    /// signs of life and checking the peer's, which these reads record).
    fn wait_for_credit(&self, control: &mut SendControl, timeout: Duration) -> Result<()> {
        let waited = self.wait_for_credit_reading(control, timeout);
        // The reads above set the connection's read timeout, which the watchdog's peeks share:
        // theirs again.
        if let Err(e) = control.socket.set_read_timeout(Some(WATCH_PEEK)) {
            self.link.fail(format!("the boundary's connection failed: {e}"));
        }
        waited
    }

    fn wait_for_credit_reading(&self, control: &mut SendControl, timeout: Duration) -> Result<()> {
        let n_slots = self.n_slots as u64;
        let start = Instant::now();
        // Answers to the last WAITING: the first comes at once, the next at the stage's next take,
        // which frees the slot; should that still leave none free, it is asked again.
        let mut asked = false;
        let mut answers = 0u32;
        while control.step >= control.credit + n_slots {
            let waited = start.elapsed();
            if waited >= timeout {
                let held = control.step - n_slots;
                return Err(Error::Pipeline(PpError::Timeout {
                    boundary: self.link.boundary,
                    slot: (control.step % n_slots) as usize,
                    call: "tx",
                    waited,
                    found: crate::pp::SlotState::UntakenByPeer { step: held },
                }));
            }
            if !asked {
                let written = self.writer().write(WAITING, control.step, 0, 0, "");
                if let Err(e) = written {
                    self.link.fail(format!("writing a wait for a free slot failed: {e}"));
                    return Err(self.link.stopped().expect("failed above"));
                }
                asked = true;
                answers = 0;
            }
            let left = (timeout - waited).min(POLL).max(Duration::from_micros(100));
            let mut bytes = [0u8; 256];
            let read = control.socket.set_read_timeout(Some(left)).and_then(|()| control.socket.read(&mut bytes));
            let kinds = match read {
                Ok(0) => Err(PEER_CLOSED.to_string()),
                Ok(read) => {
                    self.heard.mark();
                    control.back.take(&bytes[..read], &mut control.credit)
                }
                Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut | ErrorKind::Interrupted) => {
                    Ok(Vec::new())
                }
                Err(e) => Err(format!("the boundary's connection failed: {e}")),
            };
            match kinds {
                Ok(kinds) if kinds.iter().all(|&kind| kind == ALIVE || kind == CREDIT) => {
                    answers += kinds.iter().filter(|&&kind| kind == CREDIT).count() as u32;
                    if answers >= 2 {
                        asked = false;
                    }
                }
                Ok(kinds) => {
                    self.link.fail(format!("the peer sent {kinds:?} before the close"));
                    return Err(self.link.stopped().expect("failed above"));
                }
                Err(reason) => {
                    self.link.fail(reason);
                    return Err(self.link.stopped().expect("failed above"));
                }
            }
            self.link.check()?;
        }
        Ok(())
    }

    pub(super) fn lock(&self) -> MutexGuard<'_, SendControl> {
        self.control.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// The writing end; taken after `control` by a call that holds both.
    pub(super) fn writer(&self) -> MutexGuard<'_, ControlWriter> {
        self.writer.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// How many steps this end has sent.
    pub(in crate::pp) fn steps_sent(&self) -> u64 {
        self.lock().step
    }

    /// Clean close: sends the close record and waits, at most `timeout`, until the RX rank has
    /// received every step (its receives are complete) and, over NCCL, until this rank's sends
    /// completed too ([`await_sends`](Self::await_sends)). A link that cannot close is failed
    /// (aborted), so no send of it stays queued.
    pub(in crate::pp) fn close(&self, timeout: Duration) {
        let mut control = self.lock();
        if control.closed || self.link.is_stopped() {
            return;
        }
        control.closed = true;
        let step = control.step;
        let deadline = Instant::now() + timeout;
        let control = &mut *control;
        let written = {
            let mut writer = self.writer();
            writer.closed = true;
            writer.write(CLOSE, step, 0, 0, "")
        };
        let answer = written.map_err(|e| e.to_string()).and_then(|()| {
            // The answer, past the signs of life the peer sent meanwhile.
            let mut bytes = [0u8; 64];
            loop {
                let left = deadline.saturating_duration_since(Instant::now()).max(Duration::from_millis(1));
                let read = control
                    .socket
                    .set_read_timeout(Some(left))
                    .and_then(|()| control.socket.read(&mut bytes))
                    .map_err(|e| e.to_string())?;
                if read == 0 {
                    return Err(PEER_CLOSED.to_string());
                }
                self.heard.mark();
                let kinds = control.back.take(&bytes[..read], &mut control.credit)?;
                if let Some(&kind) = kinds.iter().find(|&&kind| kind != ALIVE && kind != CREDIT) {
                    return Ok(kind);
                }
            }
        });
        match answer {
            // A peer that confirms the close while this rank's stream still waits for one of its
            // slots lied (every copy ran before an honest peer's confirmation): failed, so that
            // the gates are released and the stream drains.
            Ok(DONE) if matches!(&self.link.carrier, Carrier::Ipc(flags) if flags.waits_pending()) => self.link.fail(
                format!("the peer confirmed the close after {step} step(s) while a copy still waited for its slot"),
            ),
            Ok(DONE) => match self.await_sends(control, step, deadline, timeout) {
                Ok(()) => {
                    self.link.stop_with(format!("the boundary was closed after {step} step(s)"));
                }
                Err(reason) => self.link.fail(reason),
            },
            Ok(other) => self.link.fail(format!("the peer answered the close with {other}")),
            Err(e) => self.link.fail(format!("the peer did not confirm the close within {timeout:?}: {e}")),
        }
    }

    /// Over NCCL, once the peer confirmed the close after `steps` steps: waits, until `deadline`
    /// (the close's, `timeout` after it began; one look at least), until the send of the last
    /// step completed, as seen by the event recorded right after it (`sent`, which the caller's
    /// later work on the TX stream does not delay). An honest peer confirms only once it received
    /// every step, and then every send completes; a peer that confirms without having received
    /// lied, and a send of the link waits for its receive for ever (NCCL's sends larger than its
    /// buffers do), which the runtime's drop would wait for too: the reason the link fails then
    /// (aborted, its abort ends the send).
    fn await_sends(
        &self,
        control: &SendControl,
        steps: u64,
        deadline: Instant,
        timeout: Duration,
    ) -> std::result::Result<(), String> {
        // Recorded over NCCL only (see `tx`).
        let Some(sent) = control.sent.as_ref() else {
            return Ok(());
        };
        let last = steps.saturating_sub(1);
        let completed = poll_until(deadline, || {
            sent.is_complete().map_err(|e| format!("looking at the send of step {last} after the close failed: {e}"))
        })?;
        match completed {
            true => Ok(()),
            false => Err(format!(
                "the peer confirmed the close after {steps} step(s) while the send of step {last} had not completed \
                 within {timeout:?}"
            )),
        }
    }

    /// The watchdog's look at the link: the peer's end of the connection and its signs of life;
    /// silence longer than the timeout (since any reader last heard the peer, see [`Heard`]); a
    /// sign of life to the peer when this rank wrote nothing for a heartbeat interval; NCCL's
    /// asynchronous error. The connection is looked at without the link's locks (a peek waits up
    /// to a millisecond when nothing came). It is read only while no call holds `control` (a
    /// waiting `tx_wait` and the close read it themselves), and written through `writer` whether
    /// or not a call holds `control`, so the peer hears from this rank while a call waits
    /// (skipped only while a record is being written, which is bounded by the write timeout).
    pub(super) fn watch(&self) {
        if self.link.is_stopped() {
            return;
        }
        // Over IPC, the RX rank's receiver thread watches this beat while it waits for a copy.
        if let Some(flags) = self.link.ipc() {
            flags.beat();
        }
        match self.look() {
            Ok(()) => watch_comm(&self.link),
            Err(reason) => self.link.fail(reason),
        }
    }

    /// Whether this end's close began (its `CLOSE` record is written, or being written: no
    /// answer of the peer can precede it). Never waits: a writer busy with a record is not the
    /// close's (`tx` refuses once the close began, and the watchdog writes no sign of life then).
    fn close_began(&self) -> bool {
        match self.writer.try_lock() {
            Ok(writer) => writer.closed,
            Err(TryLockError::Poisoned(poisoned)) => poisoned.into_inner().closed,
            Err(TryLockError::WouldBlock) => false,
        }
    }

    /// [`watch`](Self::watch) of the connection; the reason the link fails, if it does.
    pub(super) fn look(&self) -> std::result::Result<(), String> {
        let quiet = |e: &std::io::Error| {
            matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut | ErrorKind::Interrupted)
        };
        let failed = |e: std::io::Error| format!("the boundary's connection failed: {e}");
        let mut byte = [0u8; 1];
        let waiting = match self.watch.peek(&mut byte) {
            // After a close began, the peer ends the connection once it answered: the close
            // decides (it reads the answer, then waits for this rank's last send).
            Ok(0) if self.close_began() => return Ok(()),
            Ok(0) => return Err(PEER_CLOSED.into()),
            Ok(_) => true,
            Err(e) if quiet(&e) => false,
            Err(e) => return Err(failed(e)),
        };
        if waiting {
            let control = match self.control.try_lock() {
                Ok(control) => Some(control),
                Err(TryLockError::Poisoned(poisoned)) => Some(poisoned.into_inner()),
                // A call reads the connection meanwhile, and records what it hears.
                Err(TryLockError::WouldBlock) => None,
            };
            if let Some(mut control) = control {
                // Bytes are there (only this thread and the calls that hold the lock read them):
                // the read returns at once.
                let mut bytes = [0u8; 64];
                match (&self.watch).read(&mut bytes) {
                    Ok(0) if self.close_began() => return Ok(()),
                    Ok(0) => return Err(PEER_CLOSED.into()),
                    Ok(read) => {
                        let control = &mut *control;
                        let kinds = control.back.take(&bytes[..read], &mut control.credit)?;
                        if let Some(other) = kinds.into_iter().find(|&kind| kind != ALIVE && kind != CREDIT) {
                            return Err(format!("the peer sent {other} before the close"));
                        }
                        self.heard.mark();
                    }
                    Err(e) if quiet(&e) => {}
                    Err(e) => return Err(failed(e)),
                }
            }
        }
        let writer = match self.writer.try_lock() {
            Ok(writer) => Some(writer),
            Err(TryLockError::Poisoned(poisoned)) => Some(poisoned.into_inner()),
            // A record is being written: it shows the peer this rank is alive.
            Err(TryLockError::WouldBlock) => None,
        };
        if writer.as_ref().is_some_and(|writer| writer.closed) {
            // The close waits for the peer's answer within its own bound.
            return Ok(());
        }
        if let Some(reason) = self.link.silent_too_long(self.heard.get()) {
            return Err(reason);
        }
        if let Some(mut writer) = writer {
            if writer.written.elapsed() >= self.link.heartbeat_interval() {
                writer.write(ALIVE, 0, 0, 0, "").map_err(|e| format!("writing a sign of life failed: {e}"))?;
            }
        }
        Ok(())
    }
}

/// The watchdog's look at NCCL: an asynchronous error fails the link. Skipped while another
/// thread's call holds the communicator (the watchdog never waits on the calls it watches).
pub(super) fn watch_comm(link: &Link) {
    let Some(comm) = link.nccl() else { return };
    if let Err(e) = comm.async_error_if_idle() {
        if !link.is_stopped() {
            link.fail(format!("NCCL reported: {e}"));
        }
    }
}
