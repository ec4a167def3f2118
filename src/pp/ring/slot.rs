//! One slot of a ring: its state, its buffer, and the buffer's own events while only the ring
//! reaches it. The ring (the parent module) makes every change of a slot's state; this file owns
//! how a slot's buffer is ordered: by its own events, or by the rule once they are handed over.

use super::{SlotBuffer, SlotHome};
use crate::pp::error::{Result, SlotState};
use crate::safe::DeviceSlice;
use crate::safe::ordering::OwnOrder;

/// One slot of a ring. The copy into it records an event on the TX stream right after the copy
/// (the protocol's `ev_tx`), the copy out records one on the RX stream right after that copy
/// (`ev_rx`); the next copy out waits for the first (read after write), the next copy in for the
/// second (write after read). A buffer that only the ring's own `tx` and `rx` reach (in a ring
/// filled by this rank, from its growth until it is lent, captured or replaced) keeps the two
/// events itself (`order`); any other slot buffer is *eager* under the crate's ordering rule,
/// whose marks then hold them.
pub(super) struct Slot {
    pub(super) state: SlotState,
    /// The bytes the slot was last filled with (its state names the element count and type).
    pub(super) bytes: usize,
    pub(super) buffer: SlotBuffer,
    /// The buffer's own events while only the ring reaches it: handed over to the buffer's
    /// ordering state ([`Slot::rule_orders`]) before anything else may.
    pub(super) order: Option<OwnOrder>,
    /// For a boundary from another rank: the step the slot was last filled with.
    pub(super) step: u64,
}

impl Slot {
    /// Hands the buffer's own events over to the rule (see [`OwnOrder::hand_over`]): from now on
    /// the rule orders every use of it (it is about to be lent, captured, replaced or freed).
    pub(super) fn rule_orders(&mut self) {
        match (self.order.take(), &self.buffer) {
            (Some(order), SlotBuffer::Device(buffer)) => order.hand_over(buffer.access()),
            (Some(order), SlotBuffer::Host(buffer)) => order.hand_over(buffer.access()),
            _ => {}
        }
    }

    /// Replaces the buffer with one of at least `bytes` (see [`SlotHome::grow`]); in a ring
    /// filled by this rank, the buffer is then ordered by the slot's own events.
    pub(super) fn grow(&mut self, bytes: usize, home: SlotHome<'_>, inbound: bool) -> Result<()> {
        self.rule_orders();
        home.grow(&mut self.buffer, bytes)?;
        // A fresh buffer whose allocation is complete: not pool memory, allocated in a stream's
        // order (its first write would have to wait for that stream).
        let access = match &self.buffer {
            SlotBuffer::Device(buffer) if !buffer.is_pooled() => buffer.access(),
            SlotBuffer::Host(buffer) => buffer.access(),
            SlotBuffer::Device(_) | SlotBuffer::Empty => return Ok(()),
        };
        if !inbound {
            self.order = Some(OwnOrder::new(access, home.tx_stream, home.rx_stream));
        }
        Ok(())
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        // The buffer's free is ordered after the ring's copies by the rule.
        self.rule_orders();
    }
}
