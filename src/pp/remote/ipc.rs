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
//! The flag words live in host memory both ranks map: the RX rank's control block (a sealed
//! memfd, see [`crate::local_channel::ControlBlock`]), passed with the slots and registered with
//! the driver by each rank, so that a stream writes a word and the other rank's host reads it.
//! Neither rank's stream waits for the other rank's stream: on one GPU shared by two processes,
//! a stream that waits on a word only the other process's stream will write holds the GPU for
//! its time slice, one slice per step.
//!
//! One step `k` in slot `s = k mod n` (words `filled[s]` and `consumed[s]`; `consumed[s] >= k`
//! says the slot is free for step `k`):
//! - `tx` (TX rank) announces the step: a step of the previous step's element type in the
//!   block's announcement line `k mod ANNOUNCEMENTS` (its element count, then `k + 1`), once the
//!   RX rank took the step that line held; the first step, each change of type, and a step that
//!   finds its line not yet taken go on the control connection as a sealed record, as over NCCL.
//!   An announcement in the block costs no system call; when the RX rank's receiver thread
//!   sleeps (it says so in the block's sleep word, then looks once more at the block and the
//!   connection, then waits on the word as a futex), the TX rank wakes it (one futex wake, no
//!   record), as after every record it writes on the connection. Then `tx` enqueues on the TX
//!   stage's stream: the copy into the slot and
//!   `filled[s] = k + 1` (after a fence: whoever sees the value sees the copy). Only when its
//!   host finds `consumed[s] < k` (the RX rank has not freed the slot yet) does the stream first
//!   wait, and then on a gate word of the TX rank's own, which its forwarding thread raises once
//!   the RX rank's host stored `consumed[s] >= k` (see `gates`): no other process can hold the
//!   TX rank's stream. The copy and the signal after such a wait are the helper kernels'
//!   (`ppnrt_gated_copy_bytes`, `ppnrt_gated_signal`: a copy a failure cancels, see "Failure:");
//!   a step whose slot was free at `tx` stays on the copy engine.
//! - the RX rank's receiver thread takes the step's announcement (the block's first, then the
//!   connection's, in the TX rank's order: see `inbox`; a step taken from either frees the block's
//!   lines up to it for the TX rank), waits until the ring's slot is free (the RX
//!   stage took step `k - n`) and every read of it in this process has completed (on the host),
//!   stores `consumed[s] = k`, and waits on the host until `filled[s] >= k + 1`; then the slot is
//!   filled in the ring. Where the copy came from another device, the receive stream first
//!   flushes what reached this device (a wait met at once, `CU_STREAM_WAIT_VALUE_FLUSH`) and
//!   `rx` orders itself after it. While it waits the thread watches the link: a stop, the peer's
//!   end of the connection closed, or its heartbeat in the block still for longer than the peer
//!   timeout, fail the step.
//!
//! So the sender's copy never overwrites a slot the RX stage still reads, and the RX stage never
//! reads a slot before the copy is in it. No interprocess event is used: an opened event is
//! undefined behaviour once its exporter destroyed it (which its exit does), while a flag word
//! lives in memory every mapping keeps alive.
//!
//! Failure: a link that fails (the peer died, hung, lied, or closed its end) releases the TX
//! rank's stream waits, after the rank's other links have stopped and the next ranks know (see
//! `link`): the TX rank sets its gates to [`RELEASED`] (whatever the peer writes into its block,
//! the stream drains) and writes [`RELEASED`] into every `filled` word on the stream that wrote
//! them, behind its writes still queued there; the RX rank sets every `consumed` word where every
//! wait for a step is met (the TX rank's forwarder then opens its gates before it learns of the
//! failure) and every `filled` word, for its own host waits. A receiver
//! thread waiting on the host stops with the link and fills nothing. The slots of a failed link
//! are then never trusted ([`PpError::PeerFailed`] on every later call and readback, as for an
//! aborted NCCL link), and every stream drains. A copy the sending rank queued behind a wait does
//! not run once the wait is released: its kernel reads the gate and copies only below
//! [`RELEASED`], that is where the RX rank freed the slot for it (a `consumed` word at
//! [`RELEASED`], the RX rank's release or a lie, frees no slot: the forwarder sets the gate to
//! [`RELEASED`] too). So no slot the RX rank may still read, a slot lent in place included, is
//! written after a failure. The signal after it writes [`RELEASED`] into `filled` where the gate
//! is [`RELEASED`] once the copy ran (a copy skipped, or cut short by a release that came while it
//! ran, a case in which the RX rank had freed the slot), never the step: a receiver takes it as
//! the link's failure. By then the RX rank has failed the link already (the TX rank releases
//! only once its peer closed the connection, which it does once it recorded the failure, or after
//! the peer timeout), and a receiver that has not learned of it yet (a peer stopped that long)
//! still never takes a skipped copy as filled. A driver that cannot run the helper kernels (older
//! than the toolkit that built their PTX) keeps these copies on the copy engine: they run once
//! released and may then write a slot the RX rank still reads, a lent one included.
//!
//! Ownership: the RX rank owns the slots and the control block; the TX rank's mappings keep the
//! memory alive after the RX rank dropped it or exited (CUDA's virtual memory management frees
//! the physical memory only when its last mapping goes; a memfd lives while a mapping does), so a
//! copy or wait already queued by the survivor touches live memory whatever its peer did.

use std::io::Write;
use std::net::TcpStream;
use std::os::unix::ffi::OsStrExt;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant};

use crate::Engine;
use crate::local_channel::{ControlBlock, FdEntry, FdKind, LocalChannel, LocalChannelError, LocalListener, Side};
use crate::pp::config::PpConfig;
use crate::pp::error::{Error, PpError, Result};
use crate::pp::plan::BoundaryPlan;
use crate::pp::process_transport::{Reach, TransportReason};
use crate::pp::timing::{POLL, SPIN};
use crate::safe::memory::DeviceMemory;
use crate::safe::ordering::Use;
use crate::safe::{CudaSlice, CudaStream, CudaView, CudaViewMut, ExportedMemory, ImportedMemory, WaitCondition};
use crate::safe::{FlagSteps, MemOpsSupport, PrivateWords, Releasable, register_control_block, register_private_words};

use super::gates::{Gates, RELEASED};
use super::wire::read_exact_by;

// A ring of the configuration's slots fits a control block (more are refused by the configuration).
static_assertions::const_assert!(crate::pp::config::MAX_SLOTS <= ControlBlock::MAX_SLOTS);

/// The longest socket path the RX rank may name: a Unix socket's path is at most 108 bytes on
/// Linux (`sun_path`); a longer one is refused before it is read.
const MAX_PATH: usize = 108;

/// The TX rank's request for the local channel's path.
const ASK: u8 = 0x1c;

/// A receiver thread's sleep between two looks at a `filled` word, once it has spun for [`SPIN`].
const NAP: Duration = Duration::from_micros(20);

/// Which end of the boundary a link's flags serve.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum End {
    Sender,
    Receiver,
}

/// A link's flag words: the control block both ranks map, and this process's registration of it.
pub(in crate::pp) struct IpcFlags {
    block: Arc<ControlBlock>,
    /// The block's words as this process's streams reach them (registered host memory).
    words: Mutex<CudaSlice<u64>>,
    n_slots: usize,
    end: End,
    /// On the RX side, where the copy comes from another device and this device can: the receive
    /// stream flushes what reached the device before the stage reads the slot.
    flush_arrivals: bool,
    /// On the RX side: each slot's allocation (not kept alive here), so a receive goes only into
    /// the exported memory the TX rank writes.
    slot_memory: Vec<Weak<DeviceMemory>>,
    /// On the TX side, the stream this side writes `filled` on, once a step was queued: a release
    /// writes them last there (see `release`).
    queued_on: Mutex<Option<Arc<CudaStream>>>,
    /// On the RX side: the steps taken from announcements in the block.
    block_announcements: AtomicU64,
    /// On the TX side: the words its stream waits on for a free slot, which only this rank writes
    /// (see `gates`).
    gates: Option<Gates>,
    /// On the TX side: the engine whose helper kernels make a copy that waits for its slot one a
    /// release cancels (see the module docs), where the driver runs them.
    releasable_by: Option<Engine>,
}

/// How a receiver thread's wait for a step's copy watches its link: `Err` with the reason ends
/// the wait (the link stopped, the peer's end closed, the runtime stopping).
pub(super) type Watch<'a> = &'a mut dyn FnMut() -> std::result::Result<(), String>;

impl IpcFlags {
    fn new(block: Arc<ControlBlock>, words: CudaSlice<u64>, end: End) -> IpcFlags {
        IpcFlags {
            n_slots: block.slots(),
            block,
            words: Mutex::new(words),
            end,
            flush_arrivals: false,
            slot_memory: Vec::new(),
            queued_on: Mutex::new(None),
            block_announcements: AtomicU64::new(0),
            gates: None,
            releasable_by: None,
        }
    }

    /// Whether these are the TX rank's flags (its stream may wait on `consumed`).
    pub(super) fn is_sender(&self) -> bool {
        self.end == End::Sender
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, CudaSlice<u64>> {
        self.words.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// A sign of life of the TX rank, which the RX rank's receiver thread watches while it waits
    /// for a copy (called with each sign of life on the connection).
    pub(super) fn beat(&self) {
        if self.is_sender() {
            self.block.beat(Side::Sender);
        }
    }

    /// The TX side of step `step`: on `stream`, copies `src` into `dst` (the slot's mapping,
    /// exactly the step's bytes), after a wait until the RX rank freed the slot unless it has
    /// already, and marks the slot filled.
    pub(super) fn send(
        &self,
        stream: &Arc<CudaStream>,
        step: u64,
        src: CudaView<'_, u8>,
        dst: &mut CudaViewMut<'_, u8>,
    ) -> Result<()> {
        let s = (step % self.n_slots as u64) as usize;
        let Some(gates) = self.gates.as_ref() else {
            unreachable!("only the sending side's flags send, and they have gates (see `take`)")
        };
        let freed = gates.free_or_wanted(s, step);
        let steps = FlagSteps {
            wait_at: s,
            wait_for: step,
            wait: (!freed).then_some(WaitCondition::GEQ),
            signal_at: self.block.filled_word(s),
            signal: step + 1,
        };
        // Only a copy that waits is one a release may cancel (see the module docs).
        let releasable = match (&self.releasable_by, freed) {
            (Some(engine), false) => Some(Releasable { kernels: engine.helper_kernels()?, released: RELEASED }),
            _ => None,
        };
        let mut words = self.lock();
        self.note_queued_on(stream);
        let gate_words = gates.words();
        // Where the copy's notes fail, the host waits for the stream, which a queued wait for the
        // slot would hold until the RX rank frees it (or for ever): the gates are released first
        // (for good; the failed send fails the link, whose release follows). Only where the copies
        // behind the waits are the kernels a release cancels: a copy-engine copy (a driver that
        // cannot run them) would run once released, into a slot the RX rank may still read (lent
        // in place), before that rank knows of any failure; the call then waits as it did, until
        // the slot is freed or the link fails.
        let cancellable = self.releasable_by.is_some();
        let release_waits = || {
            if cancellable {
                gates.release();
            }
        };
        Ok(stream.flagged_copy(
            src,
            dst,
            gate_words.as_view(),
            &mut words.as_view_mut(),
            steps,
            releasable,
            release_waits,
        )?)
    }

    /// The TX side: whether its stream may still wait for a free slot (a gate below the step it
    /// waits for). After the RX side confirmed that it received every step, none may: a wait
    /// still pending is one that peer would never end.
    pub(super) fn waits_pending(&self) -> bool {
        self.gates.as_ref().is_some_and(Gates::waits_pending)
    }

    /// Notes `stream` as the one this side writes `filled` on (a release writes them last there).
    fn note_queued_on(&self, stream: &Arc<CudaStream>) {
        let mut queued_on = self.queued_on.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        if !queued_on.as_ref().is_some_and(|queued| Arc::ptr_eq(queued, stream)) {
            *queued_on = Some(Arc::clone(stream));
        }
    }

    /// The TX side's announcement of step `step` of `n` elements in the control block, made when
    /// its line is free (the RX rank took the step it held); returns whether it was.
    pub(super) fn announce(&self, step: u64, n: u64) -> bool {
        let free = step < self.block.announcements_taken().saturating_add(ControlBlock::ANNOUNCEMENTS as u64);
        if free {
            self.block.announce(step, n);
        }
        free
    }

    /// The TX side, after an announcement in the block (or a record on the connection): wakes the
    /// RX rank's receiver thread if it sleeps (see [`ControlBlock::wake_receiver`]).
    pub(super) fn wake_receiver(&self) {
        self.block.wake_receiver();
    }

    /// The control block, for the TX side's writer of records (which wakes the receiver after
    /// each).
    pub(super) fn block(&self) -> Arc<ControlBlock> {
        Arc::clone(&self.block)
    }

    /// The RX side: the element count of step `step`'s announcement in the control block, taken
    /// (its line free for the TX side again), when the block holds it.
    pub(super) fn take_announcement(&self, step: u64) -> Option<u64> {
        let n = self.block.announced(step)?;
        self.block.take_announcements(step);
        self.block_announcements.fetch_add(1, Ordering::Relaxed);
        Some(n)
    }

    /// The RX side: records that step `step` was taken, in order, from either source (a step of
    /// the connection too: the block's lines of the steps up to it hold nothing the RX side will
    /// look at again, and the TX side may write them; counting only the block's steps would keep
    /// the TX side on the connection for good once the block's lines' worth of steps went there).
    pub(super) fn took(&self, step: u64) {
        self.block.take_announcements(step);
    }

    /// The RX side: how many steps were taken from announcements in the block.
    #[cfg(feature = "testing")]
    pub(super) fn block_announcements(&self) -> u64 {
        self.block_announcements.load(Ordering::Relaxed)
    }

    /// The RX side: marks the receiver thread asleep, or awake (see
    /// [`ControlBlock::set_receiver_asleep`]); a look at the block and the connection follows
    /// the first, then, when it found nothing, [`sleep`](Self::sleep).
    pub(super) fn mark_asleep(&self, asleep: bool) {
        self.block.set_receiver_asleep(asleep);
    }

    /// The RX side, marked asleep, having found nothing: sleeps until the TX side wakes it or for
    /// `timeout` (see [`ControlBlock::sleep_while_asleep`]).
    pub(super) fn sleep(&self, timeout: Duration) {
        self.block.sleep_while_asleep(timeout);
    }

    /// The RX side of step `step` into slot `slot`'s bytes `dst`: once every read of the slot in
    /// this process has completed (on the host), frees it for the TX rank's copy and waits on the host until
    /// the copy is in, watching the link with `watch` (and the TX rank's heartbeat, by the link's
    /// silence rule: `silent_too_long(last_beat)` says why the wait fails). Where the copy came
    /// from another device, `stream` flushes it before the slot is read.
    pub(super) fn receive(
        &self,
        stream: &Arc<CudaStream>,
        step: u64,
        slot: usize,
        dst: &mut CudaViewMut<'_, u8>,
        silent_too_long: &dyn Fn(Instant) -> Option<String>,
        watch: Watch<'_>,
    ) -> std::result::Result<(), String> {
        if let Err(why) = self.check_slot(step, slot, dst.memory()) {
            return Err(why.to_string());
        }
        let access = dst.memory().access();
        self.await_host(silent_too_long, watch, || {
            access.is_complete("the IPC boundary's receive", Use::Write).map_err(|e| e.to_string())
        })?;
        self.block.raise_consumed(slot, step);
        self.await_host(silent_too_long, watch, || {
            let filled = self.block.filled(slot);
            if filled >= RELEASED {
                return Err("the sending rank released the slot: its end of the boundary failed".into());
            }
            Ok(filled > step)
        })?;
        if self.flush_arrivals {
            let words = self.lock();
            stream
                .flush_arrival(dst, words.as_view(), self.block.filled_word(slot), step + 1)
                .map_err(|e| e.to_string())?;
        }
        Ok(())
    }

    /// Frees slot `slot`, whose buffer is `buffer`, for step `step` ahead of the step's record,
    /// when the slot is the step's and every read of it in this process has completed (a look
    /// that never blocks): the TX rank's copy of the step then finds it free. Returns whether it
    /// did (a slot it could not free now is freed by [`receive`](Self::receive) at the latest).
    ///
    /// # Errors
    /// The driver's error from the look at the slot's reads.
    pub(super) fn free_ahead(&self, step: u64, slot: usize, buffer: &CudaSlice<u8>) -> crate::cuda_error::Result<bool> {
        if self.check_slot(step, slot, buffer.memory()).is_err() {
            return Ok(false);
        }
        let read = buffer.memory().access().is_complete("the IPC boundary's receive", Use::Write);
        if read.as_ref().is_ok_and(|&read| read) {
            self.block.raise_consumed(slot, step);
        }
        read
    }

    /// Whether slot `slot` is step `step`'s, and `memory` the exported allocation the TX rank
    /// writes into it (the receive's and the look ahead's one check); `Err` says which is not.
    fn check_slot(&self, step: u64, slot: usize, memory: &Arc<DeviceMemory>) -> std::result::Result<(), SlotMismatch> {
        if slot != (step % self.n_slots as u64) as usize {
            return Err(SlotMismatch::NotTheSteps { step, slot, n_slots: self.n_slots });
        }
        let exported = self.slot_memory.get(slot).is_some_and(|held| Weak::ptr_eq(held, &Arc::downgrade(memory)));
        if !exported {
            return Err(SlotMismatch::NotExported { slot });
        }
        Ok(())
    }

    /// Waits on the host until `done` says so: spinning first (what it waits for is likely
    /// near), then in short sleeps; every [`POLL`] it asks `watch` and checks the TX rank's
    /// heartbeat (`silent_too_long(last_beat)`: the link's silence rule says the peer is silent,
    /// the wait fails).
    fn await_host(
        &self,
        silent_too_long: &dyn Fn(Instant) -> Option<String>,
        watch: Watch<'_>,
        mut done: impl FnMut() -> std::result::Result<bool, String>,
    ) -> std::result::Result<(), String> {
        let start = Instant::now();
        let mut checked = start;
        let (mut beat, mut beat_seen) = (self.block.heartbeat(Side::Sender), start);
        while !done()? {
            let now = Instant::now();
            if now.duration_since(checked) >= POLL {
                checked = now;
                watch()?;
                let heartbeat = self.block.heartbeat(Side::Sender);
                if heartbeat != beat {
                    (beat, beat_seen) = (heartbeat, now);
                } else if let Some(reason) = silent_too_long(beat_seen) {
                    return Err(reason);
                }
            }
            if now.duration_since(start) < SPIN {
                std::hint::spin_loop();
            } else {
                std::thread::sleep(NAP);
            }
        }
        Ok(())
    }

    /// Releases the TX rank's stream waits (see the module docs). On the TX side: every gate set
    /// at [`RELEASED`] (words only this rank writes, so the stream's waits end whatever the peer
    /// writes), and [`RELEASED`] written into every `filled` word on the stream that wrote them,
    /// behind this side's writes still queued there (so none of those lowers it). On the RX side:
    /// every `consumed` word released at [`RELEASED`] on the host (the TX rank's forwarder then
    /// opens its gates), and every `filled` word (this side's own waits, which also end with the
    /// link).
    pub(super) fn release(&self) -> Result<()> {
        match self.end {
            End::Receiver => {
                for s in 0..self.n_slots {
                    self.block.release_consumed(s, RELEASED);
                    self.block.release_filled(s, RELEASED);
                }
            }
            End::Sender => {
                if let Some(gates) = &self.gates {
                    gates.release();
                }
                let queued_on = self.queued_on.lock().unwrap_or_else(|poisoned| poisoned.into_inner()).clone();
                if let Some(stream) = queued_on {
                    let mut words = self.lock();
                    for s in 0..self.n_slots {
                        stream.write_value_u64(&mut *words, self.block.filled_word(s), RELEASED)?;
                    }
                }
            }
        }
        Ok(())
    }
}

/// Why a slot handed to the RX side is not the one the TX rank writes for a step.
#[derive(Debug)]
enum SlotMismatch {
    NotTheSteps { step: u64, slot: usize, n_slots: usize },
    NotExported { slot: usize },
}

impl std::fmt::Display for SlotMismatch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            SlotMismatch::NotTheSteps { step, slot, n_slots } => {
                write!(f, "step {step} was given slot {slot} of {n_slots}")
            }
            SlotMismatch::NotExported { slot } => {
                write!(f, "slot {slot}'s buffer is not the memory the sending rank maps")
            }
        }
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
    let block = ControlBlock::create(n_slots).map_err(channel_failed(b, peer, "the control block"))?;
    // Every slot is free for its first step (`consumed[s] = s`).
    for s in 0..n_slots {
        block.raise_consumed(s, s as u64);
    }
    let capacity = ExportedMemory::<u8>::rounded_len(stream, config.reserve_bytes().max(1))?;
    let slots = (0..n_slots)
        .map(|_| ExportedMemory::<u8>::alloc_with(stream, capacity, true))
        .collect::<crate::cuda_error::Result<Vec<_>>>()?;
    let mut fds = vec![block.fd().try_clone_to_owned().map_err(|e| failed(b, peer, "passing the control block", &e))?];
    let mut entries = vec![FdEntry { kind: FdKind::ControlBlock, bytes: block.byte_len() as u64, index: 0 }];
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
    // The slots' first uses are the receiver's, which look on the host for every earlier use:
    // none is left from their allocation (an unsettled one would stand for the whole stage
    // stream, and a slot's first receive would wait for whatever the stage runs meanwhile).
    for slot in &slots {
        slot.memory().access().wait_on_host("the IPC boundary's setup", Use::Write)?;
    }
    let block = Arc::new(block);
    let words = register_control_block(stream, Arc::clone(&block))?;
    let same_device = matches!(b.reason, TransportReason::Reach(Reach::SameDevice));
    let support = MemOpsSupport::of(stream.context().device())?;
    let mut flags = IpcFlags::new(block, words, End::Receiver);
    flags.flush_arrivals = !same_device && support.flush_remote_writes;
    flags.slot_memory = slots.iter().map(|slot| Arc::downgrade(slot.memory())).collect();
    Ok(Offered { flags, slots, _channel: channel })
}

/// The TX rank's side of boundary `b`'s IPC setup over `socket`, on the TX stage's `stream` of
/// `engine`.
pub(super) fn take(
    config: &PpConfig,
    b: &BoundaryPlan,
    socket: &mut TcpStream,
    stream: &Arc<CudaStream>,
    engine: &Engine,
) -> Result<Taken> {
    let peer = b.rx_rank;
    let timeout = config.peer_timeout();
    let deadline = Instant::now().checked_add(timeout);
    socket.write_all(&[ASK]).map_err(|e| failed(b, peer, "asking for the local channel", &e))?;
    let path = read_path(socket, deadline).map_err(|e| failed(b, peer, "reading the local channel's path", &e))?;
    let mut channel = LocalChannel::connect(&path, config.job_access(), b.boundary as u64, timeout)
        .map_err(channel_failed(b, peer, "connecting the local channel"))?;
    let n_slots = config.slots();
    let mut expected = vec![FdKind::ControlBlock];
    expected.extend(std::iter::repeat_n(FdKind::SlotMemory, n_slots));
    let mut received = Vec::with_capacity(expected.len());
    for kinds in expected.chunks(crate::local_channel::MAX_FDS) {
        received.extend(channel.recv_fds(kinds).map_err(channel_failed(b, peer, "receiving the slots"))?);
    }
    let mut received = received.into_iter();
    let block_fd = received.next().expect("the kinds were matched");
    // The block is checked whole (its seals, size, magic, version and slot count) before it is
    // mapped for use.
    let block = Arc::new(ControlBlock::open(block_fd.fd, n_slots).map_err(channel_failed(
        b,
        peer,
        "the receiving rank's control block",
    ))?);
    let mut slots = Vec::with_capacity(n_slots);
    for (s, slot) in received.enumerate() {
        let bytes = usize::try_from(slot.entry.bytes).unwrap_or(usize::MAX);
        if slot.entry.index as usize != s || bytes == 0 {
            let why = format!("slot {} of {bytes} byte(s) where slot {s} was due", slot.entry.index);
            return Err(failed(b, peer, "the receiving rank's slots", &why));
        }
        slots.push(ImportedMemory::<u8>::import_with(stream, slot.fd, bytes, true)?.into_slice());
    }
    let words = register_control_block(stream, Arc::clone(&block))?;
    let gate_words =
        Arc::new(PrivateWords::new(n_slots).map_err(|e| failed(b, peer, "mapping the sending rank's gate words", &e))?);
    let registered = register_private_words(stream, Arc::clone(&gate_words))?;
    let gates = Gates::new(b.boundary, gate_words, registered, Arc::clone(&block), n_slots)
        .map_err(|e| failed(b, peer, "starting the gates' thread", &e))?;
    let mut flags = IpcFlags::new(block, words, End::Sender);
    flags.gates = Some(gates);
    // A driver older than the toolkit that built the helper kernels cannot run them: its copies
    // that wait stay on the copy engine (module docs, "Failure:").
    flags.releasable_by = engine.helper_kernels_if_runnable()?.map(|_| engine.clone());
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
