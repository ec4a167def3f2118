//! The sending rank's gate words of an IPC boundary: its stream waits for a slot to be free on a
//! word only this rank's host writes (anonymous private memory, registered with the driver, in
//! no file another process could open), and a forwarding thread raises that word once the
//! receiving rank has freed the slot in its control block. So no other process can hold the
//! stream's wait: a failure releases the gates, and the stream drains, whatever the peer writes
//! into its block meanwhile.
//!
//! Protocol, for step `k` in slot `s`: `tx` looks at the block's `consumed[s]`; freed already, the
//! copy is queued with no wait. Otherwise it records that slot `s` waits for step `k` (`wanted`),
//! queues a wait for `gate[s] >= k` before the copy, and wakes the forwarder when it sleeps (the
//! sleep word, then one more look, as the receiver's: no lost wake-up). The forwarder raises
//! `gate[s]` to `consumed[s]`, never past the last step waited for in the slot (the stream's
//! waits there, for `k`, `k - n`, ..., are met in order) and never lower (an atomic maximum);
//! a `consumed[s]` at or above [`RELEASED`] (the receiving rank's release, or a lie) frees no
//! slot: `tx` queues a wait, and the forwarder sets the gate to [`RELEASED`], so the copy behind
//! the wait is the release's to cancel (see `ipc`, "Failure:"), never a copy into a slot the
//! receiving rank may still read;
//! with waits pending it spins while gates keep rising (each raise starts the spin again: a
//! pipelined boundary always has a wait pending, and a forwarder that only napped after its first
//! [`SPIN`] added a nap to every step), naps once none rose for [`SPIN`], and with none pending
//! sleeps until woken (at most [`POLL`]). A
//! release sets every gate to [`RELEASED`] and stops the forwarder. A close that the receiving
//! rank confirms while a wait is still pending ([`Gates::waits_pending`]: an honest peer confirms
//! only once every copy ran) is a lie, and fails the link, which releases the gates.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::local_channel::ControlBlock;
use crate::pp::timing::{POLL, SPIN};
use crate::safe::{CudaSlice, PrivateWords};

/// What a side writes into the words it waits on when its link fails (the sending side's gates,
/// the receiving side's words in its block): every wait for a step number (cyclic `>=`, steps far
/// below 2^62) is met.
pub(super) const RELEASED: u64 = 1 << 62;

/// The forwarder's sleep between two looks at the block, once it has spun for [`SPIN`].
const NAP: Duration = Duration::from_micros(20);

/// What the sending side and its forwarding thread share.
struct Shared {
    /// `gate[s]` is word `s`.
    gates: Arc<PrivateWords>,
    /// Per slot, one past the step the stream waits for there (0: none yet).
    wanted: Vec<AtomicU64>,
    /// The receiving rank's block, whose `consumed` words say which slots it freed.
    block: Arc<ControlBlock>,
    sleeping: AtomicBool,
    lock: Mutex<()>,
    wake: Condvar,
    stop: AtomicBool,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, ()> {
        self.lock.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Raises each gate to what the block shows freed, up to the last step waited for in its
    /// slot (the stream's waits there are for that step and the earlier ones, in order).
    fn forward(&self) -> Forwarded {
        let mut forwarded = Forwarded { pending: false, raised: false };
        for (slot, wanted) in self.wanted.iter().enumerate() {
            let Some(last) = wanted.load(Ordering::Acquire).checked_sub(1) else { continue };
            let gate = self.gates.word(slot);
            if gate.load(Ordering::Acquire) >= last {
                continue;
            }
            let consumed = self.block.consumed(slot);
            let freed = if consumed >= RELEASED { RELEASED } else { consumed.min(last) };
            let before = gate.fetch_max(freed, Ordering::AcqRel);
            forwarded.raised |= freed > before;
            forwarded.pending |= before.max(freed) < last;
        }
        forwarded
    }

    /// The forwarding thread's loop (see the module docs).
    fn run(&self) {
        crate::pp::timing::sleep_finely();
        // Since when the forwarder spins: the first look that found a wait pending, or the last
        // that raised a gate.
        let mut spinning_since: Option<Instant> = None;
        while !self.stop.load(Ordering::Acquire) {
            let forwarded = self.forward();
            if forwarded.pending {
                match next_move(forwarded, &mut spinning_since, Instant::now()) {
                    Move::Spin => std::hint::spin_loop(),
                    Move::Nap => std::thread::sleep(NAP),
                }
                continue;
            }
            spinning_since = None;
            // Asleep under the lock, which a waker takes to notify: a want recorded after the
            // look below finds the sleep word set and wakes this thread.
            let guard = self.lock();
            self.sleeping.store(true, Ordering::SeqCst);
            std::sync::atomic::fence(Ordering::SeqCst);
            if !self.forward().pending && !self.stop.load(Ordering::Acquire) {
                let _ = self.wake.wait_timeout(guard, POLL);
            }
            self.sleeping.store(false, Ordering::SeqCst);
        }
    }
}

/// What one look of the forwarder at the block did.
#[derive(Debug, Clone, Copy)]
struct Forwarded {
    /// A stream wait is still unmet.
    pending: bool,
    /// A gate rose.
    raised: bool,
}

/// The forwarder's move while a wait is pending.
#[derive(Debug, PartialEq, Eq)]
enum Move {
    Spin,
    Nap,
}

/// With a wait pending after `forwarded`: spin while the last raise (or the first pending look),
/// kept in `spinning_since`, is less than [`SPIN`] before `now`, else nap.
fn next_move(forwarded: Forwarded, spinning_since: &mut Option<Instant>, now: Instant) -> Move {
    if forwarded.raised || spinning_since.is_none() {
        *spinning_since = Some(now);
    }
    let since = spinning_since.expect("set above");
    if now.saturating_duration_since(since) < SPIN { Move::Spin } else { Move::Nap }
}

/// A sending rank's gates for one IPC boundary, with their forwarding thread.
pub(super) struct Gates {
    shared: Arc<Shared>,
    /// The gates as the sending stream reaches them (registered).
    words: Mutex<CudaSlice<u64>>,
    thread: Option<JoinHandle<()>>,
}

impl Gates {
    /// Gates for boundary `boundary`, one per slot: `gates` (zeroed) as this process's host
    /// reaches them and `words`, their registration in the sending stream's context; fed from
    /// `block`. Starts the forwarding thread.
    ///
    /// # Errors
    /// Why the thread could not be started.
    pub(super) fn new(
        boundary: usize,
        gates: Arc<PrivateWords>,
        words: CudaSlice<u64>,
        block: Arc<ControlBlock>,
        slots: usize,
    ) -> std::io::Result<Gates> {
        let shared = Arc::new(Shared {
            gates,
            wanted: (0..slots).map(|_| AtomicU64::new(0)).collect(),
            block,
            sleeping: AtomicBool::new(false),
            lock: Mutex::new(()),
            wake: Condvar::new(),
            stop: AtomicBool::new(false),
        });
        let thread = std::thread::Builder::new().name(format!("ppnrt-gates-b{boundary}")).spawn({
            let shared = Arc::clone(&shared);
            move || shared.run()
        })?;
        Ok(Gates { shared, words: Mutex::new(words), thread: Some(thread) })
    }

    /// Whether slot `slot` is free for step `step` now (the block says so: the copy needs no
    /// wait); otherwise records the wait, which the forwarder ends by raising the slot's gate. A
    /// released `consumed` word (at or above [`RELEASED`]) is no free slot.
    pub(super) fn free_or_wanted(&self, slot: usize, step: u64) -> bool {
        let shared = &*self.shared;
        let consumed = shared.block.consumed(slot);
        if consumed >= step && consumed < RELEASED {
            return true;
        }
        shared.wanted[slot].store(step + 1, Ordering::Release);
        std::sync::atomic::fence(Ordering::SeqCst);
        if shared.sleeping.load(Ordering::SeqCst) {
            let _guard = shared.lock();
            shared.wake.notify_one();
        }
        false
    }

    /// Whether a stream wait recorded by [`free_or_wanted`](Self::free_or_wanted) may still be
    /// unmet: a slot's gate below the last step waited for there. Once every copy queued has run
    /// (the receiving rank saw each one), none is.
    pub(super) fn waits_pending(&self) -> bool {
        let shared = &*self.shared;
        shared.wanted.iter().enumerate().any(|(slot, wanted)| {
            wanted
                .load(Ordering::Acquire)
                .checked_sub(1)
                .is_some_and(|last| shared.gates.word(slot).load(Ordering::Acquire) < last)
        })
    }

    /// The gates as the sending stream reaches them (`gate[s]` is element `s`), locked.
    pub(super) fn words(&self) -> MutexGuard<'_, CudaSlice<u64>> {
        self.words.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Sets every gate to [`RELEASED`] (every stream wait on them is met, for good) and stops the
    /// forwarder.
    pub(super) fn release(&self) {
        for slot in 0..self.shared.wanted.len() {
            self.shared.gates.word(slot).fetch_max(RELEASED, Ordering::AcqRel);
        }
        self.stop();
    }

    fn stop(&self) {
        self.shared.stop.store(true, Ordering::Release);
        let _guard = self.shared.lock();
        self.shared.wake.notify_one();
    }
}

impl Drop for Gates {
    fn drop(&mut self) {
        // The boundary is over: a wait still queued on a gate (none is, after a clean close or
        // a failure's release) is met, so that the stream drains and the words' release, which
        // waits for every use of them, returns.
        self.release();
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::{Duration, Instant};

    use super::{Forwarded, Move, SPIN, next_move};

    /// The forwarder spins while gates keep rising, however long waits have been pending (a
    /// pipelined boundary always has one), and naps only once none rose for the spin's length.
    #[test]
    fn the_forwarder_spins_again_after_each_raise() {
        let start = Instant::now();
        let pending = Forwarded { pending: true, raised: false };
        let raised = Forwarded { pending: true, raised: true };
        let mut since = None;
        assert_eq!(next_move(pending, &mut since, start), Move::Spin);
        assert_eq!(next_move(pending, &mut since, start + SPIN / 2), Move::Spin);
        assert_eq!(next_move(pending, &mut since, start + SPIN + Duration::from_micros(1)), Move::Nap);
        // A gate rose: spinning again, for a whole spin from the raise, and again after the next.
        let raise = start + 3 * SPIN;
        assert_eq!(next_move(raised, &mut since, raise), Move::Spin);
        assert_eq!(next_move(pending, &mut since, raise + SPIN - Duration::from_micros(1)), Move::Spin);
        assert_eq!(next_move(pending, &mut since, raise + SPIN + Duration::from_micros(1)), Move::Nap);
        for k in 1..100u32 {
            let at = raise + SPIN * 2 * k;
            assert_eq!(next_move(raised, &mut since, at), Move::Spin);
            assert_eq!(next_move(pending, &mut since, at + SPIN * 9 / 10), Move::Spin, "raise {k}");
        }
    }
}
