//! Receiving in place: [`PpNRt::rx_in_place`] lends the slot itself to the receiving stage as a
//! [`ReceivedSlot`], whose drop gives the slot's buffer back to the ring.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use super::{Boundary, PpNRt};
use crate::pp::error::PpError;
use crate::pp::error::{Error, Result};
use crate::pp::plan::Transport;
use crate::safe::ordering::{Access, Use};
use crate::safe::{CudaSlice, CudaStream, CudaView, DeviceRepr, record_drop_error};

impl PpNRt {
    /// Boundary RX without a copy: lends the slot itself to stage `b + 1` as a [`ReceivedSlot`],
    /// whose [`view`](ReceivedSlot::view) the stage's kernels read in place (ordered after the
    /// slot's `tx` by the crate's rule, and the slot's next `tx` after them). Drop the guard once
    /// the work that reads the view has been enqueued: the slot's buffer then serves the next
    /// write again. A write that reaches the slot while the guard lives (or after it was
    /// forgotten) gives the slot another buffer (a spare from an earlier guard, else a fresh
    /// allocation) and leaves the guard's buffer, and its step, to the guard; captured step graphs
    /// that used the slot's old buffer are then stale ([`PpError::GraphStale`]). A host-staged
    /// slot cannot be lent to kernels: there the guard holds a copy, as [`rx`](Self::rx) makes.
    ///
    /// # Errors
    /// As [`rx`](Self::rx).
    pub fn rx_in_place<T: DeviceRepr>(&self, b: usize, slot_index: usize, n: usize) -> Result<ReceivedSlot<'_, T>> {
        self.rx_in_place_impl(b, slot_index, n, None)
    }

    /// [`rx_in_place`](Self::rx_in_place) that parks until the slot is filled, as
    /// [`rx_wait`](Self::rx_wait) does.
    ///
    /// # Errors
    /// As [`rx_wait`](Self::rx_wait).
    pub fn rx_in_place_wait<T: DeviceRepr>(
        &self,
        b: usize,
        slot_index: usize,
        n: usize,
        timeout: Duration,
    ) -> Result<ReceivedSlot<'_, T>> {
        self.rx_in_place_impl(b, slot_index, n, Some(timeout))
    }

    fn rx_in_place_impl<T: DeviceRepr>(
        &self,
        b: usize,
        slot_index: usize,
        n: usize,
        wait: Option<Duration>,
    ) -> Result<ReceivedSlot<'_, T>> {
        let boundary = self.boundary(b)?;
        if n == 0 {
            return Err(Error::Pipeline(PpError::ZeroLength { boundary: b }));
        }
        if matches!(boundary.plan.transport, Transport::HostStaged) {
            let copy = self.rx_impl::<T>(b, slot_index, n, wait)?;
            return Ok(ReceivedSlot {
                lent: None,
                readers: Vec::new(),
                copy: Some(copy),
                boundary,
                slot: slot_index,
                n,
            });
        }
        let (_, mut ring, _gate) = self.receivable::<T>(b, slot_index, n, wait, "PpNRt::rx_in_place")?;
        let lent = ring.lend(slot_index);
        Ok(ReceivedSlot { lent: Some(lent), readers: Vec::new(), copy: None, boundary, slot: slot_index, n })
    }
}

/// A slot received in place ([`PpNRt::rx_in_place`]): read it through [`view`](Self::view) on
/// any stream (the crate's ordering rule orders those reads after the slot's `tx`, and the slot's
/// next `tx` after them). Dropping the guard gives the slot's buffer back for the next `tx`; drop
/// it once the work that reads the view has been enqueued. A guard that lives past its slot's
/// next write keeps its own buffer and step (see [`PpNRt::rx_in_place`]).
///
/// ```no_run
/// # fn main() -> ppnrt::Result<()> {
/// # let primary = ppnrt::Engine::new(0)?;
/// # let rt = ppnrt::PpNRt::new(ppnrt::PpConfig::new(2), &primary)?;
/// # let x = primary.htod(&[1.0f32; 256])?;
/// let slot = rt.tx(0, &x, 256)?;
/// let _stage1 = rt.enter(1)?;
/// let received = rt.rx_in_place::<f32>(0, slot, 256)?;
/// let input = received.view()?; // the slot itself: no copy
/// let copy = rt.engine(1, &primary)?.dtoh(&input)?; // any read enqueued while the guard lives
/// assert_eq!(copy.len(), received.len());
/// drop(received); // the slot may take the next step
/// # Ok(()) }
/// ```
#[must_use = "the guard lends the slot's buffer until it drops"]
pub struct ReceivedSlot<'a, T: DeviceRepr> {
    /// The slot's own buffer (device transports).
    lent: Option<Arc<CudaSlice<u8>>>,
    /// The streams ordered by [`order_on`](ReceivedSlot::order_on), each once: their reads are
    /// recorded when the guard drops.
    readers: Vec<Arc<CudaStream>>,
    /// A copy (host-staged transport).
    copy: Option<CudaSlice<T>>,
    boundary: &'a Boundary,
    slot: usize,
    n: usize,
}

impl<T: DeviceRepr> ReceivedSlot<'_, T> {
    /// The received elements.
    ///
    /// # Errors
    /// [`CudaError::Misaligned`](crate::CudaError::Misaligned) cannot happen for the crate's element types (slot buffers are
    /// 256-byte aligned); kept for types of yours with a larger alignment.
    pub fn view(&self) -> Result<CudaView<'_, T>> {
        match (&self.lent, &self.copy) {
            (Some(buffer), _) => Ok(buffer.as_view().first_as::<T>("ReceivedSlot::view", self.n)?),
            (None, Some(copy)) => Ok(copy.as_view()),
            (None, None) => unreachable!("a guard holds the slot or a copy"),
        }
    }

    /// Orders `stream` after the slot's data arrived, for a consumer that reads the view's memory
    /// by other means than this crate's launches and copies (another library's kernels, say):
    /// its reads are recorded when the guard drops, so enqueue them on `stream` before dropping
    /// it. Call it for each stream that reads so; the slot's next `tx` (or, for a host-staged
    /// boundary, the free of the copy) waits for all of them. (Reads through this crate order
    /// themselves and need no call.)
    ///
    /// # Errors
    /// The driver's error.
    pub fn order_on(&mut self, stream: &Arc<CudaStream>) -> Result<()> {
        self.access().order(stream, Use::Read)?;
        if !self.readers.iter().any(|reader| Arc::ptr_eq(reader, stream)) {
            self.readers.push(Arc::clone(stream));
        }
        Ok(())
    }

    /// The ordering state of the memory the guard lends: the slot's buffer, or the copy.
    fn access(&self) -> &Access {
        match (&self.lent, &self.copy) {
            (Some(buffer), _) => buffer.access(),
            (None, Some(copy)) => copy.access(),
            (None, None) => unreachable!("a guard holds the slot or a copy"),
        }
    }

    /// Number of elements.
    pub fn len(&self) -> usize {
        self.n
    }

    /// Whether no element was received (never: `n` is at least 1).
    pub fn is_empty(&self) -> bool {
        self.n == 0
    }

    /// Whether the view is the slot itself (`false`: a copy, for a host-staged boundary).
    pub fn is_in_place(&self) -> bool {
        self.lent.is_some()
    }
}

impl<T: DeviceRepr> Drop for ReceivedSlot<'_, T> {
    fn drop(&mut self) {
        // The reads of the streams ordered by `order_on` end here (their work was enqueued
        // before): the slot's next `tx`, or the copy's free, waits for them.
        for reader in &self.readers {
            if let Err(e) = self.access().note(reader, Use::Read) {
                // The read stays recorded without its event; a later writer records one at the
                // end of the reader's stream, after the read.
                record_drop_error(e);
            }
        }
        if let Some(lent) = self.lent.take() {
            let left = self.boundary.ring.lock().give_back(self.slot, lent);
            self.boundary.ring.wake_sleepers();
            drop(left);
        }
    }
}

impl<T: DeviceRepr> fmt::Debug for ReceivedSlot<'_, T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ReceivedSlot")
            .field("slot", &self.slot)
            .field("n", &self.n)
            .field("in_place", &self.is_in_place())
            .finish()
    }
}
