//! The ring of a boundary from another rank, filled by the boundary's receiver thread (see
//! [`remote`](crate::pp::remote)): it waits for the ring's next slot to be writable, and posts
//! the NCCL receive into it with the ring's lock released.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Instant;

use super::Boundary;
use crate::pp::error::Result;
use crate::pp::remote::{Announced, Phase, SlotFiller};
use crate::pp::ring::SlotBuffer;
use crate::pp::timing;
use crate::safe::{CudaSlice, CudaViewMut};

impl SlotFiller for Boundary {
    fn fill(
        &self,
        step: &Announced,
        stop: &AtomicBool,
        watch: &mut dyn FnMut() -> Result<()>,
        recv: &mut dyn FnMut(usize, &mut CudaViewMut<'_, u8>) -> Result<()>,
    ) -> Result<bool> {
        let phase = |phase: Phase| {
            if let Some(link) = &self.inbound {
                link.phase.set(phase, step.step);
            }
        };
        phase(Phase::AwaitingFreeSlot);
        let mut ring = self.ring.lock();
        // The RX stage's `rx` of the slot is likely near: spin first, so that `rx` finds no
        // sleeper to wake, then sleep.
        let start = Instant::now();
        let spin_until = start + timing::SPIN;
        while !ring.next_writable(start.elapsed()) {
            if stop.load(Ordering::SeqCst) {
                return Ok(false);
            }
            ring = if Instant::now() < spin_until {
                self.ring.spin(ring, spin_until, || stop.load(Ordering::Relaxed))
            } else {
                watch()?;
                self.ring.sleep(ring, timing::POLL)
            };
        }
        // The slot's buffer leaves the ring while its receive is posted, and the ring's lock is
        // released: growing the slot allocates, and posting the receive may wait (a graph launch
        // for its previous launch, NCCL for a connection it makes in the background). The RX
        // stage's `rx` of the other slots, and its bounded waits, go on meanwhile. This thread is
        // the ring's only writer; the slot is receiving (not free, not filled) until its receive
        // is posted, so that a capture of the step's graphs leaves it alone.
        let fixed = ring.fixed();
        let (index, mut buffer, was) = ring.begin_receive(step.bytes);
        drop(ring);
        phase(Phase::Posting);
        let posted = self.post_receive(&mut buffer, index, step.bytes, fixed, recv);
        let mut ring = self.ring.lock();
        let arrived = posted.is_ok().then_some((step.n, step.elem, step.bytes, step.step));
        ring.end_receive(index, buffer, was, arrived);
        if let Err(e) = posted {
            drop(ring);
            self.ring.wake_sleepers();
            return Err(e);
        }
        // Under the ring's lock: a receive that finds the slot filled finds the thread awaiting
        // the next record, not still posting this one.
        if let Some(link) = &self.inbound {
            link.phase.set(Phase::AwaitingRecord, step.step + 1);
        }
        drop(ring);
        self.ring.wake_sleepers();
        Ok(true)
    }

    fn free_ahead(&self, free: &mut dyn FnMut(usize, &CudaSlice<u8>)) {
        let ring = self.ring.lock();
        if let Some((index, buffer)) = ring.next_free_fixed() {
            free(index, buffer);
        }
    }

    fn wake(&self) {
        self.ring.wake_all();
    }

    fn taken(&self) -> u64 {
        self.ring.lock().received_steps()
    }
}

impl Boundary {
    /// Posts `recv` of `bytes` into slot `index`'s buffer `buffer` (taken out of the ring), grown
    /// first if it is too small (refused for a ring whose buffers are `fixed`).
    fn post_receive(
        &self,
        buffer: &mut SlotBuffer,
        index: usize,
        bytes: usize,
        fixed: bool,
        recv: &mut dyn FnMut(usize, &mut CudaViewMut<'_, u8>) -> Result<()>,
    ) -> Result<()> {
        if !buffer.holds(bytes) {
            if fixed {
                return Err(crate::pp::ring::too_large(self.plan.boundary, bytes, buffer.capacity()));
            }
            self.home().grow(buffer, bytes)?;
        }
        let _bound = self.tx_stream.context().bind_for_call()?;
        let SlotBuffer::Device(buffer) = buffer else {
            unreachable!("a slot of a boundary from another rank is device memory")
        };
        // A writable slot is not lent (a lent one was given another buffer).
        let buffer = Arc::get_mut(buffer).expect("a writable slot's buffer is not shared");
        let mut dst = buffer.as_view_mut().slice_mut(..bytes)?;
        recv(index, &mut dst)
    }
}
