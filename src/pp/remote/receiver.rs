//! The RX rank's end of a link: the receiver thread that reads each record and fills the ring's
//! next slot through NCCL's receive (or a captured one).

use std::io::ErrorKind;
use std::net::TcpStream;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use super::inbox::Inbox;
use super::link::{CAPTURE_SETTLE_WAIT, CAPTURE_WAITS, Link, Phase, RECV_GRAPHS_PER_SLOT, RecvGraph};
use super::sender::{PEER_CLOSED, watch_comm};
use super::wire::{BackWriter, Record, read_record};
use super::{ALIVE, DONE, MAX_TYPE_NAME, RECORD_HEAD};
use crate::auth::Opener;
use crate::nccl::{PostingAlone, poll_pause};
use crate::pp::error::{Error, PpError, Result};
use crate::pp::fault::FaultPoint;
use crate::pp::timing::{POLL, SPIN, poll_until};
use crate::safe::{CaptureMode, CudaSlice, CudaStream, CudaViewMut, DeviceSlice, GraphExec};

/// The RX rank's end of a link, before its receiver thread starts.
pub(in crate::pp) struct Inbound {
    pub(in crate::pp) link: Arc<Link>,
    pub(in crate::pp) socket: TcpStream,
    /// Checks the seals of the TX rank's records.
    pub(super) opener: Opener,
    /// This end's sealed answers to the TX rank (the receiver thread's and the watchdog's).
    pub(super) back: Arc<Mutex<BackWriter>>,
    /// The boundary's receive stream (on the RX stage's device): the NCCL receives run there.
    pub(in crate::pp) recv_stream: Arc<CudaStream>,
    /// A stream of the same device used only to capture receives into graphs, when allowed
    /// ([`PpConfig::with_nccl_recv_graphs`]).
    pub(in crate::pp) capture_stream: Option<Arc<CudaStream>>,
    /// On an IPC boundary: the ring's slots, exported to the TX rank, which writes them through
    /// its mappings (the ring keeps them for its life, see [`super::ipc`]).
    pub(in crate::pp) exported_slots: Option<Vec<Arc<crate::safe::CudaSlice<u8>>>>,
}

impl Inbound {
    /// The watchdog's end of this link: a second handle of the connection, for this rank's
    /// signs of life.
    pub(in crate::pp) fn heartbeat(&self) -> Result<Heartbeat> {
        let socket = self.socket.try_clone().map_err(|e| io_error(&self.link, "cloning the connection", &e))?;
        Ok(Heartbeat { link: Arc::clone(&self.link), socket, back: Arc::clone(&self.back) })
    }
}

/// Signs of life from the RX rank to the TX rank of one link, sent by the watchdog.
pub(in crate::pp) struct Heartbeat {
    pub(super) link: Arc<Link>,
    pub(super) socket: TcpStream,
    pub(super) back: Arc<Mutex<BackWriter>>,
}

impl Heartbeat {
    /// Sends a sign of life when `sent` (the last one's time) is an interval ago. The connection
    /// may be non-blocking at the time (the receiver thread switches it): a full buffer skips
    /// this one.
    pub(super) fn beat(&self, sent: &mut Instant) {
        if self.link.is_stopped() || sent.elapsed() < self.link.heartbeat_interval() {
            return;
        }
        let mut back = self.back.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        // One queued sign of life is enough: a full connection does not grow the queue.
        let sent_now = if back.unsent.is_empty() { back.send(&self.socket, ALIVE) } else { back.flush(&self.socket) };
        match sent_now {
            Ok(()) => *sent = Instant::now(),
            Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut | ErrorKind::Interrupted) => {}
            Err(e) => self.link.fail(format!("writing a sign of life failed: {e}")),
        }
    }
}

/// A step announced by the TX rank.
pub(in crate::pp) struct Announced {
    pub(in crate::pp) step: u64,
    pub(in crate::pp) n: usize,
    pub(in crate::pp) elem: &'static str,
    pub(in crate::pp) bytes: usize,
}

/// What the receiver thread does with each announced step: fill the ring's next slot through
/// `recv` (which posts the NCCL receive into the slot's first `step.bytes` bytes, exactly those,
/// given the slot's index), waiting while the slot is taken and `stop` is not set, and keep the
/// link's phase (the next record's, once the slot is filled). Returns `Ok(false)` when stopped
/// first. While it sleeps for the slot it calls `watch` (at most once a poll interval): an
/// error (the link stopped, the peer's end closed) ends the wait with it, so that the thread
/// learns of the peer's failure while its stage holds every slot.
pub(in crate::pp) trait SlotFiller: Send + Sync + 'static {
    fn fill(
        &self,
        step: &Announced,
        stop: &AtomicBool,
        watch: &mut dyn FnMut() -> Result<()>,
        recv: &mut dyn FnMut(usize, &mut CudaViewMut<'_, u8>) -> Result<()>,
    ) -> Result<bool>;
    /// Calls `free` with the next step's slot and its buffer, under the ring's lock, when the
    /// ring's buffers are fixed and that slot is free already (an IPC receiver frees it for the
    /// sender before the step's record comes).
    fn free_ahead(&self, free: &mut dyn FnMut(usize, &CudaSlice<u8>));
    /// Wakes every thread waiting on the ring (the link stopped).
    fn wake(&self);
    /// The steps the RX stage has taken so far.
    fn taken(&self) -> u64;
}

/// How often, at most, a receiver thread over IPC looks whether the next step's slot can be freed
/// for the sender ahead of its announcement (each look locks the ring and queries the slot's
/// reads).
const FREE_LOOK: Duration = Duration::from_micros(10);

/// The receiver thread of one inbound link.
pub(in crate::pp) struct Receiver {
    pub(super) stop: Arc<AtomicBool>,
    pub(super) thread: Option<JoinHandle<()>>,
}

impl Receiver {
    pub(in crate::pp) fn start(inbound: Inbound, filler: Arc<dyn SlotFiller>) -> Result<Receiver> {
        let stop = Arc::new(AtomicBool::new(false));
        let link = Arc::clone(&inbound.link);
        inbound.socket.set_read_timeout(Some(POLL)).map_err(|e| io_error(&link, "the connection's timeout", &e))?;
        let thread = std::thread::Builder::new()
            .name(format!("ppnrt-rx-b{}", link.boundary))
            .spawn({
                let stop = Arc::clone(&stop);
                move || {
                    crate::pp::timing::sleep_finely();
                    receive_loop(inbound, &*filler, &stop)
                }
            })
            .map_err(|e| io_error(&link, "starting the receiver thread", &e))?;
        Ok(Receiver { stop, thread: Some(thread) })
    }

    /// Asks the thread to stop, without waiting for it: a runtime stopping several receivers
    /// asks each first, so that their drains (each at most the peer timeout) run at once.
    pub(in crate::pp) fn ask_to_stop(&self) {
        self.stop.store(true, Ordering::SeqCst);
    }

    /// Stops the thread and waits for it (within one poll interval once it is not posting, or
    /// draining its receives: at most the peer timeout).
    pub(in crate::pp) fn stop(&mut self) {
        self.ask_to_stop();
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

pub(super) fn io_error(link: &Link, what: &str, e: &std::io::Error) -> Error {
    Error::Pipeline(PpError::PeerFailed { boundary: link.boundary, peer: link.peer, reason: format!("{what}: {e}") })
}

/// Waits, polling, until every receive queued on `stream` has completed, for at most `timeout`
/// (the peer timeout) or until `stop` is set: a step whose record came and whose data never
/// will (its sender died between the two, and NCCL's receive waits on until this side aborts)
/// fails the link then, instead of keeping this thread, and the runtime's drop, for ever.
pub(super) fn drain_within(
    stream: &CudaStream,
    timeout: Duration,
    stop: &AtomicBool,
) -> std::result::Result<(), String> {
    let start = Instant::now();
    let drained = poll_until(start + timeout, || {
        let idle = stream.is_idle().map_err(|e| e.to_string())?;
        if !idle && stop.load(Ordering::SeqCst) {
            return Err("the runtime stopped before they completed".to_string());
        }
        Ok(idle)
    })?;
    match drained {
        true => Ok(()),
        false => Err(format!(
            "still running after {:?}, more than the peer timeout (a step announced and never sent?)",
            start.elapsed()
        )),
    }
}

/// Whether the peer's end of `socket` is closed (shut down for writing, or its process gone),
/// whatever unread bytes it sent before: a look that never blocks.
fn peer_hung_up(socket: &TcpStream) -> bool {
    use rustix::event::{PollFd, PollFlags, Timespec};
    let mut look = [PollFd::new(socket, PollFlags::RDHUP)];
    let now = Timespec { tv_sec: 0, tv_nsec: 0 };
    let ready = rustix::event::poll(&mut look, Some(&now)).unwrap_or(0);
    ready > 0 && look[0].revents().intersects(PollFlags::RDHUP | PollFlags::HUP | PollFlags::ERR)
}

pub(super) fn receive_loop(mut inbound: Inbound, filler: &dyn SlotFiller, stop: &AtomicBool) {
    let link = Arc::clone(&inbound.link);
    let mut pending = Vec::with_capacity(RECORD_HEAD + MAX_TYPE_NAME + crate::auth::SEAL);
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
    // Over IPC: the step whose slot this thread freed for the sender ahead of its record, and when
    // it last looked (a ring lock and an event query, at most every FREE_LOOK while spinning).
    let mut freed_ahead: Option<u64> = None;
    let mut free_looked: Option<Instant> = None;
    // Over IPC: the steps announced in the control block, and the connection's records, in order.
    let mut inbox = Inbox::default();
    let outcome: std::result::Result<(), String> = loop {
        if stop.load(Ordering::SeqCst) || link.is_stopped() {
            break Ok(());
        }
        if last_poll.elapsed() >= POLL {
            watch_comm(&link);
            last_poll = Instant::now();
            // Over IPC a thread that keeps finding its steps in the block reads the connection
            // here, without waiting: the TX rank's signs of life (and wakes) never pile up there
            // (a full connection would make its writes time out and fail the link).
            if link.ipc().is_some() {
                let mode = |socket: &TcpStream, nonblocking: bool| {
                    socket
                        .set_nonblocking(nonblocking)
                        .map_err(|e| format!("switching the connection's blocking mode failed: {e}"))
                };
                let drained = if nonblocking { Ok(()) } else { mode(&inbound.socket, true) }.and_then(|()| {
                    inbox.drain(&mut || read_record(&mut inbound.socket, &mut pending, &mut inbound.opener))
                });
                let restored = if nonblocking { Ok(()) } else { mode(&inbound.socket, false) };
                match (drained, restored) {
                    (Ok(heard_now), Ok(())) => {
                        if heard_now {
                            heard = Instant::now();
                        }
                    }
                    (Err(reason), _) | (_, Err(reason)) => break Err(reason),
                }
            }
        }
        if let Some(flags) = link.ipc() {
            // The next step's slot is freed for the sender as soon as the RX stage took it and
            // read it, not when the step's record comes: the sender's copy then need not wait.
            if freed_ahead != Some(expected) && free_looked.is_none_or(|at| at.elapsed() >= FREE_LOOK) {
                free_looked = Some(Instant::now());
                let mut freed: crate::cuda_error::Result<bool> = Ok(false);
                filler.free_ahead(&mut |slot, buffer| freed = flags.free_ahead(expected, slot, buffer));
                match freed {
                    Ok(true) => freed_ahead = Some(expected),
                    Ok(false) => {}
                    // Not the step's failure: its receive frees the slot again (and fails with
                    // the driver's error if it fails there too). Recorded, as no call reports it.
                    Err(e) => crate::safe::record_drop_error(e),
                }
            }
        }
        let spinning = spin_until.is_some_and(|until| Instant::now() < until);
        let flags = link.ipc();
        // Over IPC the connection is never waited on: the thread sleeps on the block's sleep word.
        if (spinning || flags.is_some()) != nonblocking {
            if let Err(e) = inbound.socket.set_nonblocking(!nonblocking) {
                break Err(format!("switching the connection's blocking mode failed: {e}"));
            }
            nonblocking = !nonblocking;
        }
        // Over IPC the TX rank announces most steps in the control block: the next step's
        // announcement there comes before any record of the connection (which the TX rank wrote
        // after it). A thread about to sleep says so in the block first, then looks at both: the
        // TX rank, after an announcement or a record, then wakes it (see `ipc`).
        let asleep = !spinning && flags.is_some();
        if let (true, Some(flags)) = (asleep, flags) {
            flags.mark_asleep(true);
        }
        let read = inbox.next(expected, &mut |step| flags.and_then(|flags| flags.take_announcement(step)), &mut || {
            read_record(&mut inbound.socket, &mut pending, &mut inbound.opener)
        });
        if let (true, Some(flags)) = (asleep, flags) {
            if matches!(read, Ok(None)) {
                flags.sleep(POLL);
            }
            flags.mark_asleep(false);
        }
        let record = match read {
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
        if let Record::Waiting { step } = record {
            if step != expected {
                break Err(format!("a wait for a free slot for step {step} where step {expected} was due"));
            }
            // The TX rank's `tx_wait` waits for a free slot: answered now, and again at the
            // stage's next take.
            if let Some(credit) = &link.credit {
                credit.wanted.store(true, Ordering::Release);
            }
            link.answer_credit(filler.taken(), true);
            continue;
        }
        spin_until = Some(Instant::now() + SPIN);
        match record {
            Record::Close { steps } if steps == expected => {
                // `DONE` says that every step was received: answered only then (the TX rank
                // then ends the boundary cleanly, with no send of it queued).
                if let Err(e) = drain_within(&inbound.recv_stream, link.timeout, stop) {
                    break Err(format!("the receives did not complete after the close: {e}"));
                }
                let _ = inbound.socket.set_nonblocking(false);
                let answered =
                    inbound.back.lock().unwrap_or_else(|poisoned| poisoned.into_inner()).send(&inbound.socket, DONE);
                match answered {
                    Ok(()) => {
                        link.stop_with(format!("the peer closed the boundary after {steps} step(s)"));
                        break Ok(());
                    }
                    Err(e) => break Err(format!("answering the close failed: {e}")),
                }
            }
            Record::Close { steps } => {
                break Err(format!("the close names {steps} step(s), {expected} were announced"));
            }
            Record::Alive | Record::Waiting { .. } => unreachable!("handled above"),
            Record::Data(step) if step.step != expected => {
                break Err(format!("step {} announced where step {expected} was due", step.step));
            }
            Record::Data(step) => {
                if let Some(flags) = link.ipc() {
                    flags.took(step.step);
                }
                let repeated = last_bytes == Some(step.bytes);
                let (recv_stream, capture_stream) = (&inbound.recv_stream, inbound.capture_stream.as_ref());
                let socket = &inbound.socket;
                let number = step.step;
                // What ends a wait of this thread for the peer's part (a copy, a free slot): the
                // link stopped, or the peer's end of the connection closed.
                let link_or_peer_ended = || match (link.is_stopped(), peer_hung_up(socket)) {
                    (true, _) => Some("the boundary stopped"),
                    (false, true) => Some(PEER_CLOSED),
                    (false, false) => None,
                };
                let mut recv = |slot: usize, dst: &mut CudaViewMut<'_, u8>| {
                    if link.ipc().is_some() && link.fault.at(FaultPoint::ReceiveWithoutFreeing) {
                        return Ok(());
                    }
                    if link.nccl().is_some() && link.fault.at(FaultPoint::ConfirmWithoutReceiving) {
                        return Ok(());
                    }
                    if let Some(flags) = link.ipc() {
                        // While the copy is awaited: the runtime's stop, the link's, and the peer's
                        // end of the connection closed end the wait (its silence, the flags').
                        let mut watch = || {
                            if stop.load(Ordering::SeqCst) {
                                return Err("the runtime stopped".to_string());
                            }
                            link_or_peer_ended().map_or(Ok(()), |reason| Err(reason.to_string()))
                        };
                        return flags
                            .receive(recv_stream, number, slot, dst, &|beat| link.silent_too_long(beat), &mut watch)
                            .map_err(|reason| link.error_or(&reason));
                    }
                    // SAFETY: the filler hands `recv` the slot's first `step.bytes` bytes (see
                    // `SlotFiller::fill`), the count of the sealed record the TX rank sends.
                    unsafe { receive_step(&link, recv_stream, capture_stream, slot, dst, repeated) }
                };
                // While the slot is awaited: the link's stop and the peer's end of the connection
                // closed end the wait (the stage may hold every slot for long; the peer's failure
                // must reach this rank meanwhile: its next ranks wait for it to, see `Link::fail`).
                let mut watch_slot = || link_or_peer_ended().map_or(Ok(()), |reason| Err(link.error_or(reason)));
                let filled = filler.fill(&step, stop, &mut watch_slot, &mut recv);
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
    // A runtime that stops (its drop) synchronises its streams next: the receives this thread
    // posted for steps the TX rank announced must complete within the peer timeout (an honest TX
    // rank sends every step it announced), else the link fails, and its abort cuts them short,
    // instead of the drop waiting for ever on a peer that never sends. (The watchdog goes on
    // showing the peer signs of life meanwhile: it stops after the receivers.) A stream that
    // drained is no proof that the receives got their data: a peer that ended its side (failed,
    // aborted) may end a receive waiting for it without the data, which NCCL reports as the
    // communicator's asynchronous error; the link fails then too.
    let outcome = outcome.and_then(|()| {
        let Some(comm) = link.nccl() else { return Ok(()) };
        if link.is_stopped() || !stop.load(Ordering::SeqCst) {
            return Ok(());
        }
        drain_within(&inbound.recv_stream, link.timeout, &AtomicBool::new(false))
            .and_then(|()| comm.async_error().map_err(|e| format!("the peer's end failed meanwhile: {e}")))
            .map_err(|e| format!("the runtime stopped with a receive pending: {e}"))
    });
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
///
/// # Safety
/// `dst` is exactly the bytes the TX rank announced for this step (its send moves that many).
pub(super) unsafe fn receive_step(
    link: &Link,
    recv_stream: &Arc<CudaStream>,
    capture_stream: Option<&Arc<CudaStream>>,
    slot: usize,
    dst: &mut CudaViewMut<'_, u8>,
    repeated: bool,
) -> Result<()> {
    let Some(comm) = link.nccl() else {
        return Err(link.error_or("an NCCL receive on a boundary NCCL does not carry"));
    };
    let Some(capture_stream) = capture_stream else {
        // SAFETY: `dst` is exactly the bytes the TX rank's sealed record announced, which its
        // send moves (the caller's contract, `receive_step`'s).
        return unsafe { Ok(comm.recv(recv_stream, dst, 0)?) };
    };
    let mut held = link.recv_graphs.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
    let Some(graphs) = held.as_mut() else {
        return Err(link.error_or("the boundary failed"));
    };
    let bytes = dst.len();
    if let Some(at) = graphs.iter().position(|graph| graph.slot == slot && graph.bytes == bytes) {
        if graphs[at].exec.writes(dst) {
            let exec = &mut graphs[at].exec;
            comm.posting_launch(recv_stream, || exec.launch(recv_stream))?;
            link.graph_receives.fetch_add(1, Ordering::Relaxed);
            return Ok(());
        }
        graphs.remove(at);
    }
    // SAFETY: `dst` is the step's announced bytes (this function's contract), and the capture is
    // launched only for steps of that many bytes into this slot (matched above).
    let exec = if repeated { unsafe { capture_receive(link, capture_stream, dst) }? } else { None };
    let Some(exec) = exec else {
        // SAFETY: as above.
        return unsafe { Ok(comm.recv(recv_stream, dst, 0)?) };
    };
    if graphs.iter().filter(|graph| graph.slot == slot).count() >= RECV_GRAPHS_PER_SLOT {
        let oldest = graphs.iter().position(|graph| graph.slot == slot).expect("counted above");
        graphs.remove(oldest);
    }
    graphs.push(RecvGraph { slot, bytes, exec });
    let exec = &mut graphs.last_mut().expect("pushed above").exec;
    comm.posting_launch(recv_stream, || exec.launch(recv_stream))?;
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
///
/// # Safety
/// The graph is launched only for steps whose TX rank sends exactly `dst`'s bytes.
pub(super) unsafe fn capture_receive(
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
    let Some(comm) = link.nccl() else { return Ok(None) };
    let capture = capture_stream.begin_capture(CaptureMode::Relaxed)?;
    // SAFETY: the capture is launched only for steps of exactly `dst`'s bytes (this function's
    // contract), which the TX rank's send moves.
    let captured = unsafe { comm.recv(capture_stream, dst, 0) };
    let graph = capture.end();
    captured?;
    Ok(graph?.instantiate().map(Some)?)
}
