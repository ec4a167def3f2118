//! A boundary's slot ring: its slots, their buffers and host-side states, the lock, the waits and
//! the wake-ups.
//!
//! This file is the only code that changes a slot's state. Every way of crossing a boundary —
//! eager `tx`/`rx`/`rx_in_place`, a captured step's launch, the receiver thread of a boundary from
//! another rank — asks for a named transition ([`Slots::filled`], [`Slots::received`],
//! [`Slots::lend`], [`Slots::give_back`], [`Slots::discard_unreceived`], [`Slots::writable`],
//! [`Slots::begin_receive`] / [`Slots::end_receive`], [`Slots::take_for_capture`] /
//! [`Slots::restore_after_capture`]) and reads states through accessors.
//!
//! The states (see [`SlotState`]): a slot is *free* (never filled, received or discarded), then
//! *filled* by a write, then received (copied out), *lent* (read in place by a
//! [`ReceivedSlot`](super::ReceivedSlot)) or discarded. A lent slot does not stop the ring: a
//! write that reaches it gives the slot another buffer (a spare given back by an earlier guard,
//! else a fresh one) and the guard keeps the old one alive, so a guard that is held long, or
//! forgotten with `mem::forget`, costs at most one buffer and never stops the boundary. A write
//! that may wait (`tx_wait`, the receiver of a boundary from another rank) first waits up to
//! [`LENT_GRACE`] for the guard to drop, which keeps the slot's buffer (and the step graphs
//! captured with it) in use; `tx` does not wait. A graph's launch never writes a lent slot (its
//! graph writes the captured buffer, which the guard still reads): it waits, or is refused.
//!
//! Threading: the ring's lock guards its [`Slots`]; [`SlotRing::wait_while`] parks on the ring's
//! condition variable, and every transition is followed by [`SlotRing::wake_sleepers`], which
//! signals only when a thread is asleep (a signal is a system call that a step's `tx` and `rx`
//! would otherwise pay each time).

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex, MutexGuard};

use super::error::{PpError, SlotState};

use super::timing::SPIN;
use crate::pp::error::{Error, Result};
use crate::safe::ordering::OwnOrder;
use crate::safe::{CudaSlice, DeviceRepr, PinnedHostBuffer};

mod home;
mod slot;
pub(super) use home::SlotHome;
use slot::Slot;

/// The smallest slot allocation, in bytes; slots grow in powers of two from here.
pub(super) const MIN_SLOT_BYTES: usize = 4096;

/// A boundary's ring of slots behind its lock, with the waits and wake-ups on it.
pub(super) struct SlotRing {
    slots: Mutex<Slots>,
    /// Signalled whenever a slot of the ring changes state (for the waiting `tx_wait`/`rx_wait`).
    changed: Condvar,
    /// Threads asleep on `changed`: a state change signals it only when some are.
    sleepers: AtomicUsize,
    /// Counts the ring's state changes (bumped by [`wake_sleepers`](SlotRing::wake_sleepers)
    /// after each, in a ring filled from another rank): a thread waiting for a slot of such a
    /// ring spins on it briefly before it sleeps on `changed`, so the thread that makes the
    /// change pays no wake-up system call. No thread spins on any other ring.
    changes: AtomicU64,
    /// Whether the ring is filled from another rank (as [`Slots::inbound`], read without the
    /// lock).
    inbound: bool,
}

/// The slots of a ring and where the ring stands (under the ring's lock).
pub(super) struct Slots {
    next: usize,
    slots: Vec<Slot>,
    /// For a boundary from another rank: the step after the last one its RX stage took (copied
    /// out, lent, or read by a graph), which a graph launch of that stage reads next. Steps fill
    /// the slots in turn, so that step is in slot `received % slots`.
    received: u64,
    /// Whether the ring is filled from another rank (its steps are counted).
    inbound: bool,
    /// Whether the slots' buffers were given at build and are never replaced (a boundary from
    /// another rank of this host: the sender writes them through its own mapping of them, so a
    /// lent slot is written again only once its guard gave it back, and a slot never grows).
    fixed: bool,
    /// Buffers given back by in-place guards whose slot had been given another buffer meanwhile:
    /// the next write that meets a lent slot takes one instead of allocating (at most one per
    /// slot is kept).
    spares: Vec<Arc<CudaSlice<u8>>>,
    /// For a boundary from another rank: told the steps taken each time the RX stage takes one
    /// (with the ring's lock held), so a sending rank that waits for a free slot learns of it.
    on_taken: Option<TakenHook>,
}

/// What a ring filled from another rank tells each time its RX stage takes a step: the steps
/// taken so far. Called with the ring's lock held: it must not take the lock or wait.
pub(super) type TakenHook = Arc<dyn Fn(u64) + Send + Sync>;

/// A slot's memory.
pub(super) enum SlotBuffer {
    /// No buffer yet (or taken out while a receive from another rank is posted into it).
    Empty,
    /// Memory on the RX device, shared with a [`ReceivedSlot`](super::ReceivedSlot) while the
    /// slot is lent: `cuMemAlloc` memory owned by the RX stream, or, for a boundary from another
    /// rank, pool memory owned by its receive stream (see [`SlotHome::grow`]).
    Device(Arc<CudaSlice<u8>>),
    /// Pinned host memory (boxed: its ordering state is larger than a device buffer's `Arc`).
    Host(Box<PinnedHostBuffer<u8>>),
}

impl SlotBuffer {
    /// The buffer's ordering state (the protocol's events live there once the slot's own are
    /// handed over, see [`Slot`]).
    #[cfg(feature = "testing")]
    pub(super) fn access(&self) -> &crate::safe::ordering::Access {
        match self {
            SlotBuffer::Empty => unreachable!("only a slot with a buffer is copied to or from"),
            SlotBuffer::Device(buffer) => buffer.access(),
            SlotBuffer::Host(buffer) => buffer.access(),
        }
    }

    pub(super) fn capacity(&self) -> usize {
        match self {
            SlotBuffer::Empty => 0,
            SlotBuffer::Device(buffer) => buffer.len(),
            SlotBuffer::Host(buffer) => buffer.len(),
        }
    }

    /// Whether the slot has a buffer of at least `bytes` (a step of zero-sized elements, 0 bytes,
    /// still needs a buffer to be ordered through).
    pub(super) fn holds(&self, bytes: usize) -> bool {
        !matches!(self, SlotBuffer::Empty) && self.capacity() >= bytes
    }
}

/// How long a write that may wait waits for a lent slot's guard to drop before it gives the slot
/// another buffer. A guard lives while its stage enqueues the work that reads it (micro- to
/// milliseconds); one held longer, or forgotten, costs each write that meets it this once.
pub(super) const LENT_GRACE: Duration = Duration::from_secs(1);

/// The longest a waiting thread sleeps between two looks at the ring (a lent slot becomes
/// writable by time, which signals no one).
const LONGEST_SLEEP: Duration = Duration::from_millis(100);

/// Whether a write may take a slot in `state`: free, or lent (the write gives the slot another
/// buffer, see the [module docs](self)).
fn writable(state: SlotState) -> bool {
    state.is_free() || state == SlotState::Lent
}

/// Whether a write that has waited `waited` (of at most `timeout`) may take a slot in `state`:
/// free, or lent for the writer's whole grace ([`LENT_GRACE`], or `timeout` when shorter).
fn writable_after(state: SlotState, waited: Duration, timeout: Duration) -> bool {
    state.is_free() || (state == SlotState::Lent && waited >= LENT_GRACE.min(timeout))
}

impl SlotRing {
    /// A ring of `n_slots` slots without buffers, each grown to `reserved` bytes when that is not
    /// zero; `inbound` for a boundary from another rank.
    pub(super) fn new(n_slots: usize, reserved: usize, inbound: bool, home: SlotHome<'_>) -> Result<SlotRing> {
        let slots = (0..n_slots)
            .map(|_| {
                let mut slot =
                    Slot { state: SlotState::NeverFilled, bytes: 0, buffer: SlotBuffer::Empty, order: None, step: 0 };
                if reserved > 0 {
                    slot.grow(reserved, home, inbound)?;
                }
                Ok(slot)
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(SlotRing::of(slots, inbound, false))
    }

    /// A ring filled from another rank whose slots are `buffers`, one per slot, fixed for the
    /// ring's life (see [`Slots::fixed`]).
    pub(super) fn with_fixed_buffers(buffers: Vec<Arc<CudaSlice<u8>>>) -> SlotRing {
        let slots = buffers
            .into_iter()
            // Filled from another rank: ordered by the rule alone (no events of their own).
            .map(|buffer| Slot {
                state: SlotState::NeverFilled,
                bytes: 0,
                buffer: SlotBuffer::Device(buffer),
                order: None,
                step: 0,
            })
            .collect();
        SlotRing::of(slots, true, true)
    }

    fn of(slots: Vec<Slot>, inbound: bool, fixed: bool) -> SlotRing {
        SlotRing {
            slots: Mutex::new(Slots {
                next: 0,
                slots,
                received: 0,
                inbound,
                fixed,
                spares: Vec::new(),
                on_taken: None,
            }),
            changed: Condvar::new(),
            sleepers: AtomicUsize::new(0),
            changes: AtomicU64::new(0),
            inbound,
        }
    }

    /// Calls `hook` each time the RX stage takes a step (see [`TakenHook`]).
    pub(super) fn on_taken(&self, hook: TakenHook) {
        self.lock().on_taken = Some(hook);
    }

    /// Locks the ring. A panic while the lock was held cannot leave a slot half-updated (each
    /// transition changes the state last), so the ring is consistent whenever the lock is free
    /// (the lock does not poison).
    #[inline]
    pub(super) fn lock(&self) -> MutexGuard<'_, Slots> {
        self.slots.lock()
    }

    /// Parks until slot `which(ring)` is ready for `call` (`tx`: free, or lent for the writer's
    /// grace, see [`LENT_GRACE`]; anything else: filled), for at most `timeout`; returns the
    /// ring's lock held. See [`wait_while`](Self::wait_while) for `failed`.
    pub(super) fn wait_until<'a>(
        &'a self,
        b: usize,
        call: &'static str,
        ring: MutexGuard<'a, Slots>,
        timeout: Duration,
        failed: &dyn Fn() -> Option<Error>,
        which: impl Fn(&Slots) -> usize,
    ) -> Result<MutexGuard<'a, Slots>> {
        let start = Instant::now();
        let not_ready = |ring: &Slots| {
            let slot = which(ring);
            let state = ring.slots[slot].state;
            let ready = if call == "tx" {
                writable_after(state, start.elapsed(), timeout)
            } else {
                matches!(state, SlotState::Filled { .. })
            };
            (!ready).then_some(slot)
        };
        self.wait_while(b, call, ring, timeout, failed, not_ready)
    }

    /// Parks while `blocking(ring)` names a slot that `call` waits for, for at most `timeout`
    /// ([`PpError::Timeout`] naming that slot); `failed()` (a failed link from another rank)
    /// ends the wait with its error. A ring filled from another rank is spun on briefly first
    /// (its step is likely near). Returns the ring's lock held.
    pub(super) fn wait_while<'a>(
        &'a self,
        b: usize,
        call: &'static str,
        mut ring: MutexGuard<'a, Slots>,
        timeout: Duration,
        failed: &dyn Fn() -> Option<Error>,
        blocking: impl Fn(&Slots) -> Option<usize>,
    ) -> Result<MutexGuard<'a, Slots>> {
        let start = Instant::now();
        let spin_until = start + SPIN;
        while let Some(slot) = blocking(&ring) {
            if let Some(failed) = failed() {
                return Err(failed);
            }
            let waited = start.elapsed();
            if waited >= timeout {
                return Err(Error::Pipeline(PpError::Timeout {
                    boundary: b,
                    slot,
                    call,
                    waited,
                    found: ring.slots[slot].state,
                }));
            }
            if ring.inbound && Instant::now() < spin_until {
                // Read under the lock, the change count misses no change.
                ring = self.spin(ring, spin_until, || false);
                continue;
            }
            ring = self.sleep(ring, (timeout - waited).min(LONGEST_SLEEP));
        }
        Ok(ring)
    }

    /// Sleeps on the ring's condition variable for at most `timeout` (counted as a sleeper, so
    /// state changes signal it); returns the lock held again.
    pub(super) fn sleep<'a>(&'a self, mut ring: MutexGuard<'a, Slots>, timeout: Duration) -> MutexGuard<'a, Slots> {
        // Counted under the lock: a thread that changes a slot's state afterwards (it needs the
        // lock) sees the count and signals.
        self.sleepers.fetch_add(1, Ordering::SeqCst);
        self.changed.wait_for(&mut ring, timeout);
        self.sleepers.fetch_sub(1, Ordering::SeqCst);
        ring
    }

    /// Releases the ring's lock and spins until its state changes (the change count moves),
    /// `until` passes or `give_up` says so; returns the lock held again. The count is read under
    /// the lock, so a change made after it is never missed.
    pub(super) fn spin<'a>(
        &'a self,
        ring: MutexGuard<'a, Slots>,
        until: Instant,
        give_up: impl Fn() -> bool,
    ) -> MutexGuard<'a, Slots> {
        debug_assert!(self.inbound, "only a ring filled from another rank counts its changes");
        let seen = self.changes.load(Ordering::Acquire);
        drop(ring);
        while self.changes.load(Ordering::Acquire) == seen && Instant::now() < until && !give_up() {
            std::hint::spin_loop();
        }
        self.lock()
    }

    /// Counts a change of the ring (one filled from another rank, whose waiters spin on the
    /// count) and signals the threads asleep on it, if any. Call after a transition, with the
    /// lock held or just released.
    #[inline]
    pub(super) fn wake_sleepers(&self) {
        if self.inbound {
            self.changes.fetch_add(1, Ordering::Release);
        }
        if self.sleepers.load(Ordering::SeqCst) != 0 {
            self.changed.notify_all();
        }
    }

    /// Wakes every thread waiting on the ring, whatever changed (a link's failure is no slot
    /// state a sleeper could have checked).
    pub(super) fn wake_all(&self) {
        let ring = self.lock();
        self.changes.fetch_add(1, Ordering::Release);
        drop(ring);
        self.changed.notify_all();
    }
}

impl Slots {
    /// The slot the next write fills.
    pub(super) fn next(&self) -> usize {
        self.next
    }

    /// The ring's slot count.
    pub(super) fn n_slots(&self) -> usize {
        self.slots.len()
    }

    /// Slot `k`'s buffer.
    pub(super) fn buffer(&self, k: usize) -> &SlotBuffer {
        &self.slots[k].buffer
    }

    /// The step slot `k` was last filled with (a boundary from another rank).
    pub(super) fn step(&self, k: usize) -> u64 {
        self.slots[k].step
    }

    /// The step after the last one the RX stage took (a boundary from another rank).
    pub(super) fn received_steps(&self) -> u64 {
        self.received
    }

    /// The first slot being received into from another rank, if any.
    pub(super) fn receiving(&self) -> Option<usize> {
        self.slots.iter().position(|slot| slot.state == SlotState::Receiving)
    }

    /// Checks that slot `k` of boundary `b` may be written by `call` into its own buffer, as a
    /// graph's launch writes it (free): [`PpError::SlotState`] when it is not.
    pub(super) fn check_free(&self, b: usize, k: usize, call: &'static str) -> Result<()> {
        let found = self.slots[k].state;
        if found.is_free() { Ok(()) } else { Err(not_free(b, k, call, found)) }
    }

    /// Checks that a read of slot `k` of boundary `b` by `call` (a graph's launch, which reads
    /// the ring's slots in turn) overtakes no step: no other slot holds a step written before the
    /// one the read takes — slot `k`'s step when it is filled, else the next write, into `k` —
    /// and not received yet. [`PpError::SlotState`] names the first such slot (the oldest).
    pub(super) fn check_read_in_turn(&self, b: usize, k: usize, call: &'static str) -> Result<()> {
        let n = self.slots.len();
        let filled = |j: usize| matches!(self.slots[j].state, SlotState::Filled { .. });
        // Slots are written in turn from `next`: those written before slot `k`'s step run from
        // the oldest write (`next`) up to `k`; before a write into `k`, every other slot.
        let oldest = if filled(k) { self.next } else { (k + 1) % n };
        let earlier = (k + n - oldest) % n;
        match (0..earlier).map(|i| (oldest + i) % n).find(|&j| filled(j)) {
            None => Ok(()),
            Some(j) => Err(Error::Pipeline(PpError::SlotState {
                boundary: b,
                slot: j,
                call,
                needed: "free (received before the step the graph reads)",
                found: self.slots[j].state,
            })),
        }
    }

    /// Checks that slot `k` of boundary `b` may be written by `call` (free, or lent):
    /// [`PpError::SlotState`] when it is not.
    #[inline]
    pub(super) fn check_writable(&self, b: usize, k: usize, call: &'static str) -> Result<()> {
        let found = self.slots[k].state;
        if writable(found) && !(self.fixed && found == SlotState::Lent) {
            Ok(())
        } else {
            Err(not_free(b, k, call, found))
        }
    }

    /// Checks that slot `k` of boundary `b` holds `n` elements of `T`, for `call` to receive it:
    /// [`PpError::RxTypeMismatch`], [`PpError::RxLengthMismatch`], [`PpError::RxSizeMismatch`]
    /// (the bytes filled are not `n` of `T`'s), or [`PpError::SlotState`] when it is not filled at
    /// all.
    pub(super) fn check_filled<T: DeviceRepr>(&self, b: usize, k: usize, call: &'static str, n: usize) -> Result<()> {
        match self.slots[k].state {
            SlotState::Filled { elem, .. } if elem != T::NAME => {
                Err(Error::Pipeline(PpError::RxTypeMismatch { boundary: b, slot: k, requested: T::NAME, sent: elem }))
            }
            SlotState::Filled { n: sent, .. } if sent != n => {
                Err(Error::Pipeline(PpError::RxLengthMismatch { boundary: b, slot: k, requested: n, sent }))
            }
            SlotState::Filled { .. } if n.checked_mul(size_of::<T>()) != Some(self.slots[k].bytes) => {
                Err(Error::Pipeline(PpError::RxSizeMismatch {
                    boundary: b,
                    slot: k,
                    elem: T::NAME,
                    n,
                    requested_size: size_of::<T>(),
                    sent_bytes: self.slots[k].bytes,
                }))
            }
            SlotState::Filled { .. } => Ok(()),
            found => Err(Error::Pipeline(PpError::SlotState { boundary: b, slot: k, call, needed: "filled", found })),
        }
    }

    /// Makes slot `k` ready for a write of `bytes` by `call` and returns its buffer: checks that it
    /// is writable; a lent slot gets another buffer (a spare that holds `bytes`, else none: the
    /// guard keeps the old one) and is free from then on; the buffer is grown to `bytes` when it
    /// is smaller. The state says *filled* only after [`filled`](Self::filled): a failed write
    /// leaves the slot free.
    #[inline(always)]
    pub(super) fn writable(
        &mut self,
        b: usize,
        k: usize,
        call: &'static str,
        bytes: usize,
        home: SlotHome<'_>,
    ) -> Result<&mut SlotBuffer> {
        self.check_writable(b, k, call)?;
        self.rehome_if_lent(k, bytes);
        let fixed = self.fixed;
        let slot = &mut self.slots[k];
        if !slot.buffer.holds(bytes) {
            if fixed {
                return Err(too_large(b, bytes, slot.buffer.capacity()));
            }
            slot.grow(bytes, home, self.inbound)?;
        }
        Ok(&mut slot.buffer)
    }

    /// Slot `k`'s buffer, with its own events while only the ring reaches it (see [`Slot`]): for
    /// the ring's `tx` and `rx`, which order the buffer by them when they are there.
    pub(super) fn ordered_buffer(&mut self, k: usize) -> (&mut SlotBuffer, Option<&mut OwnOrder>) {
        let slot = &mut self.slots[k];
        (&mut slot.buffer, slot.order.as_mut())
    }

    /// Drops the record of slot `k`'s read since its last write, so that the next write does not
    /// wait for it. Only for deliberately broken protocols in hazard tests.
    #[cfg(feature = "testing")]
    pub(super) fn forget_read(&mut self, k: usize) {
        match &mut self.slots[k].order {
            Some(order) => order.forget_read(),
            None => self.slots[k].buffer.access().forget_reads(),
        }
    }

    /// Drops the record of slot `k`'s last write, so that the next read does not wait for it.
    /// Only for deliberately broken protocols in hazard tests.
    #[cfg(feature = "testing")]
    pub(super) fn forget_write(&mut self, k: usize) {
        match &mut self.slots[k].order {
            Some(order) => order.forget_write(),
            None => self.slots[k].buffer.access().forget_write(),
        }
    }

    /// Gives slot `k`, when it is lent, a buffer of its own again (the guard keeps the one it was
    /// lent): a spare that holds `bytes` when there is one, else none (the caller grows it).
    /// Lent → free.
    #[inline]
    fn rehome_if_lent(&mut self, k: usize, bytes: usize) {
        if self.slots[k].state == SlotState::Lent && !self.fixed {
            self.rehome(k, bytes);
        }
    }

    /// [`rehome_if_lent`](Self::rehome_if_lent) for a lent slot.
    #[cold]
    fn rehome(&mut self, k: usize, bytes: usize) {
        let spare = self.spares.iter().position(|spare| spare.len() >= bytes).map(|at| self.spares.swap_remove(at));
        self.slots[k].buffer = spare.map_or(SlotBuffer::Empty, SlotBuffer::Device);
        self.slots[k].state = SlotState::Received;
    }

    /// Slot `k` was written with `n` elements of the type named `elem`, `bytes` in all: filled,
    /// and the ring moves on to the next slot.
    #[inline(always)]
    pub(super) fn filled(&mut self, k: usize, n: usize, elem: &'static str, bytes: usize) {
        self.slots[k].bytes = bytes;
        self.slots[k].state = SlotState::Filled { n, elem };
        self.next = (k + 1) % self.slots.len();
    }

    /// Slot `k` was copied out (by `rx` or a graph's launch): free again.
    #[inline]
    pub(super) fn received(&mut self, k: usize) {
        self.slots[k].state = SlotState::Received;
        self.took(k);
    }

    /// Lends filled slot `k`'s buffer to an in-place guard: lent until
    /// [`give_back`](Self::give_back).
    pub(super) fn lend(&mut self, k: usize) -> Arc<CudaSlice<u8>> {
        // The guard's reads, and whatever follows them, are ordered by the rule.
        self.slots[k].rule_orders();
        let SlotBuffer::Device(buffer) = &self.slots[k].buffer else {
            unreachable!("a filled device-transport slot has a device buffer")
        };
        let lent = Arc::clone(buffer);
        self.slots[k].state = SlotState::Lent;
        self.took(k);
        lent
    }

    /// An in-place guard gives back `lent`, the buffer it was lent from slot `k`: the slot is free
    /// when it still holds that buffer; else (a write gave the slot another buffer meanwhile)
    /// `lent` is kept as a spare when it is the last share of its memory and fewer spares than
    /// slots are kept. Returns what is left to drop after the lock is released.
    pub(super) fn give_back(&mut self, k: usize, lent: Arc<CudaSlice<u8>>) -> Option<Arc<CudaSlice<u8>>> {
        let slot = &mut self.slots[k];
        let still_lent = matches!(&slot.buffer, SlotBuffer::Device(buffer) if Arc::ptr_eq(buffer, &lent));
        if still_lent {
            // The share goes first: a write woken by the change finds the buffer unshared.
            drop(lent);
            if slot.state == SlotState::Lent {
                slot.state = SlotState::Received;
            }
            return None;
        }
        if Arc::strong_count(&lent) == 1 && self.spares.len() < self.slots.len() {
            self.spares.push(lent);
            return None;
        }
        Some(lent)
    }

    /// Gives up the data of every filled slot: discarded (free), counted as taken. Returns how
    /// many.
    pub(super) fn discard_unreceived(&mut self) -> usize {
        let mut discarded = 0;
        for k in 0..self.slots.len() {
            if matches!(self.slots[k].state, SlotState::Filled { .. }) {
                self.slots[k].state = SlotState::Discarded;
                // A step from another rank given up counts as taken: the graphs read the next.
                self.took(k);
                discarded += 1;
            }
        }
        discarded
    }

    /// The receiver of a boundary from another rank starts receiving into the ring's next slot,
    /// which must be writable (see [`next_writable`](Self::next_writable)): its buffer leaves the ring while the receive is posted (a lent
    /// slot's stays with its guard) and the slot is *receiving* (neither free nor filled, so a
    /// capture leaves it alone). Returns the slot, its buffer and the state to restore on failure.
    pub(super) fn begin_receive(&mut self, bytes: usize) -> (usize, SlotBuffer, SlotState) {
        let k = self.next;
        debug_assert!(writable(self.slots[k].state), "the receiver waits for a writable slot");
        self.rehome_if_lent(k, bytes);
        self.slots[k].rule_orders();
        let buffer = std::mem::replace(&mut self.slots[k].buffer, SlotBuffer::Empty);
        let was = std::mem::replace(&mut self.slots[k].state, SlotState::Receiving);
        (k, buffer, was)
    }

    /// The receive into slot `k` begun by [`begin_receive`](Self::begin_receive) ended: the
    /// buffer comes back; on success (`Some((n, elem, bytes, step))`) the slot holds step `step`'s
    /// `n` elements of `elem`, `bytes` in all, and the ring moves on, else it is back in the state
    /// `was`.
    pub(super) fn end_receive(
        &mut self,
        k: usize,
        buffer: SlotBuffer,
        was: SlotState,
        arrived: Option<(usize, &'static str, usize, u64)>,
    ) {
        self.slots[k].buffer = buffer;
        match arrived {
            Some((n, elem, bytes, step)) => {
                self.slots[k].step = step;
                self.filled(k, n, elem, bytes);
            }
            None => self.slots[k].state = was,
        }
    }

    /// Whether the next write's slot is writable by a writer that has waited `waited` for it (the
    /// receiver of a boundary from another rank waits for it; see [`LENT_GRACE`]).
    pub(super) fn next_writable(&self, waited: Duration) -> bool {
        let state = self.slots[self.next].state;
        if self.fixed { state.is_free() } else { writable_after(state, waited, LENT_GRACE) }
    }

    /// In a ring of fixed buffers, the next write's slot and its buffer when the slot is free now
    /// (the receiver of a boundary from another rank frees it for the sender ahead of the step).
    pub(super) fn next_free_fixed(&self) -> Option<(usize, &CudaSlice<u8>)> {
        let slot = &self.slots[self.next];
        match &slot.buffer {
            SlotBuffer::Device(buffer) if self.fixed && slot.state.is_free() => Some((self.next, buffer)),
            _ => None,
        }
    }

    /// Whether the slots' buffers are fixed (see [`Slots::fixed`]).
    pub(super) fn fixed(&self) -> bool {
        self.fixed
    }

    /// Takes slot `k`'s buffer (grown to `bytes` first) out for a capture of the step's graphs:
    /// the slot must be writable, or, in a ring filled from another rank, filled with a step that
    /// fits (kept, read first). The slot is *capturing* until
    /// [`restore_after_capture`](Self::restore_after_capture). Returns the buffer, unshared, and
    /// the state to restore.
    pub(super) fn take_for_capture(
        &mut self,
        b: usize,
        k: usize,
        bytes: usize,
        home: SlotHome<'_>,
    ) -> Result<(CudaSlice<u8>, SlotState)> {
        self.check_capturable(b, k, bytes)?;
        if !matches!(self.slots[k].state, SlotState::Filled { .. }) {
            self.writable(b, k, "capture_step", bytes, home)?;
        }
        let slot = &mut self.slots[k];
        // The graphs' uses of the buffer are ordered by the rule.
        slot.rule_orders();
        let SlotBuffer::Device(buffer) = std::mem::replace(&mut slot.buffer, SlotBuffer::Empty) else {
            unreachable!("a device-transport slot grown above has a device buffer")
        };
        // A slot that is not lent has its buffer unshared.
        let buffer = Arc::into_inner(buffer).expect("a slot that is not lent has its buffer unshared");
        Ok((buffer, std::mem::replace(&mut slot.state, SlotState::Capturing)))
    }

    /// Checks that slot `k` of boundary `b` may be taken for a capture of the step's graphs of
    /// `bytes` (see [`take_for_capture`](Self::take_for_capture)): [`PpError::SlotState`] when not.
    pub(super) fn check_capturable(&self, b: usize, k: usize, bytes: usize) -> Result<()> {
        match self.slots[k].state {
            SlotState::Filled { .. } if self.inbound && self.slots[k].buffer.holds(bytes) => Ok(()),
            _ => self.check_writable(b, k, "capture_step"),
        }
    }

    /// Puts back slot `k`'s buffer taken by [`take_for_capture`](Self::take_for_capture), with
    /// the state it had.
    pub(super) fn restore_after_capture(&mut self, k: usize, buffer: CudaSlice<u8>, state: SlotState) {
        self.slots[k].buffer = SlotBuffer::Device(Arc::new(buffer));
        self.slots[k].state = state;
    }

    /// Notes that the RX stage took slot `k` (a ring of a boundary from another rank: the steps
    /// it holds are counted).
    fn took(&mut self, k: usize) {
        if self.inbound {
            self.received = self.received.max(self.slots[k].step + 1);
            if let Some(hook) = &self.on_taken {
                hook(self.received);
            }
        }
    }
}

/// The error of a step of `bytes` bytes for a fixed slot of `capacity` bytes (see [`Slots::fixed`]).
pub(super) fn too_large(b: usize, bytes: usize, capacity: usize) -> Error {
    Error::Pipeline(PpError::StepTooLarge { boundary: b, bytes, capacity })
}

/// The error of `call` finding slot `slot` of boundary `b` not free for a write (`found`).
fn not_free(b: usize, slot: usize, call: &'static str, found: SlotState) -> Error {
    Error::Pipeline(PpError::SlotState { boundary: b, slot, call, needed: "free (received)", found })
}
