//! The order in which an RX rank's receiver thread takes the TX rank's records: over IPC most
//! steps are announced in the control block (see [`super::ipc`]), the rest and every other
//! record on the connection, and one rule puts the two in the TX rank's order.
//!
//! The TX rank announces step `k` in the block before it writes any later record on the
//! connection, so the receiver looks in the block for the step it expects before it reads the
//! connection, and again after: a record of the connection read meanwhile (written after the
//! step's announcement, which the first look missed) waits until the block's steps before it were
//! taken. A step in the block has the element type of the last step announced on the connection
//! (the TX rank puts only such steps there).
//!
//! Two consequences of looking at the block first: a receiver that keeps finding its steps there
//! never needs the connection, so it also reads it every poll interval without waiting
//! ([`Inbox::drain`]: the TX rank's signs of life would otherwise fill it); and a `WAITING` record
//! the TX rank wrote before it announced the step in the block (a `tx_wait` that timed out) may be
//! read after that step was taken: stale, dropped ([`Inbox::next`]).

use super::receiver::Announced;
use super::wire::Record;

/// The receiver thread's record source: the block's announcements and the connection's records,
/// in order (see the module docs).
#[derive(Default)]
pub(super) struct Inbox {
    /// The element type (name, byte size) of the last step announced on the connection.
    last_elem: Option<(&'static str, u64)>,
    /// A record of the connection read while earlier steps' announcements in the block were
    /// still to be taken.
    deferred: Option<Record>,
    /// One past the last step taken from the block (0: none yet).
    from_block: u64,
}

impl Inbox {
    /// The next record while step `expected` is due: the record held back once the steps before
    /// the one it names were taken; else step `expected`'s announcement in the block when `block`
    /// takes one (`block(step)`: the element count of `step`'s announcement, taken, or `None`);
    /// else one `read` from the connection (`Ok(None)`: none yet), held back when it names a later
    /// step and `block` now has step `expected` (announced before it). A wait for a step the block
    /// gave already is stale and dropped (`Ok(None)`): the TX rank wrote it before it announced
    /// the step there (a `tx_wait` that timed out, or a second ask its answers crossed), and the
    /// block was looked at first. `Err` with the reason the link fails: a step of the block before
    /// any type crossed the connection, or of no byte.
    pub(super) fn next(
        &mut self,
        expected: u64,
        block: &mut dyn FnMut(u64) -> Option<u64>,
        read: &mut dyn FnMut() -> std::result::Result<Option<Record>, String>,
    ) -> std::result::Result<Option<Record>, String> {
        let record = match self.deferred.take() {
            Some(record) => record,
            None => {
                if let Some(n) = block(expected) {
                    return self.step_in_block(expected, n).map(Some);
                }
                match read()? {
                    Some(record) => record,
                    None => return Ok(None),
                }
            }
        };
        if matches!(record, Record::Waiting { step } if step < self.from_block) {
            return Ok(None);
        }
        // A record naming a later step came after the announcements of the steps before it.
        if names_step(&record).is_some_and(|named| named > expected) {
            if let Some(n) = block(expected) {
                self.deferred = Some(record);
                return self.step_in_block(expected, n).map(Some);
            }
        }
        if let Record::Data(step) = &record {
            self.last_elem = Some((step.elem, (step.bytes / step.n.max(1)) as u64));
        }
        Ok(Some(record))
    }

    /// Takes what `read` finds on the connection now (`Ok(None)`: nothing whole there), while no
    /// record is held back: signs of life and wakes are dropped, the first record naming a step
    /// is held back for [`next`](Self::next), which gives it in its place in the order. Returns
    /// whether anything came. A receiver that keeps finding its steps in the block reads the
    /// connection only so: left unread, the TX rank's signs of life would fill it.
    pub(super) fn drain(
        &mut self,
        read: &mut dyn FnMut() -> std::result::Result<Option<Record>, String>,
    ) -> std::result::Result<bool, String> {
        let mut heard = false;
        while self.deferred.is_none() {
            match read()? {
                None => break,
                Some(Record::Alive) => heard = true,
                Some(record) => {
                    self.deferred = Some(record);
                    heard = true;
                }
            }
        }
        Ok(heard)
    }

    /// Step `step` of `n` elements, announced in the block.
    fn step_in_block(&mut self, step: u64, n: u64) -> std::result::Result<Record, String> {
        let Some((elem, elem_size)) = self.last_elem else {
            return Err(format!(
                "step {step} announced in the control block before any step's type crossed the connection"
            ));
        };
        let bytes = n
            .checked_mul(elem_size)
            .and_then(|bytes| usize::try_from(bytes).ok())
            .filter(|&bytes| bytes > 0)
            .ok_or_else(|| {
            format!("step {step}: {n} element(s) of {elem_size} byte(s) ({elem}) in the control block")
        })?;
        self.from_block = step + 1;
        Ok(Record::Data(Announced { step, n: bytes / elem_size as usize, elem, bytes }))
    }
}

/// The step a record names, for its place among the block's steps: a step's announcement, the
/// wait for its slot, or the close after the steps before it. Signs of life name none.
fn names_step(record: &Record) -> Option<u64> {
    match record {
        Record::Data(step) => Some(step.step),
        Record::Waiting { step } => Some(*step),
        Record::Close { steps } => Some(*steps),
        Record::Alive => None,
    }
}

#[cfg(test)]
mod tests {
    use std::cell::RefCell;
    use std::collections::HashMap;

    use super::*;

    /// A block of announcements (step → count) taken as the receiver takes them.
    #[derive(Default)]
    struct Block(RefCell<HashMap<u64, u64>>);

    impl Block {
        fn announce(&self, step: u64, n: u64) {
            self.0.borrow_mut().insert(step, n);
        }
        fn take(&self, step: u64) -> Option<u64> {
            self.0.borrow_mut().remove(&step)
        }
    }

    fn data(step: u64, n: usize, elem: &'static str, elem_size: usize) -> Record {
        Record::Data(Announced { step, n, elem, bytes: n * elem_size })
    }

    /// What `record` is, in short.
    fn seen(record: Option<Record>) -> String {
        match record {
            Some(Record::Data(step)) => format!("data {} {}x{} {}", step.step, step.n, step.bytes / step.n, step.elem),
            Some(Record::Waiting { step }) => format!("waiting {step}"),
            Some(Record::Close { steps }) => format!("close {steps}"),
            Some(Record::Alive) => "alive".into(),
            None => "none".into(),
        }
    }

    /// The TX rank's order, whatever the receiver's looks missed: a record of the connection
    /// read while the step it expects was announced in the block after its first look (the TX
    /// rank announced it, then wrote the record) waits for that step, and comes before the steps
    /// announced in the block after it; steps in the block take the element type of the last
    /// step announced on the connection, until the next such step changes it. With the second
    /// look taken out (mutation `ipc-connection-before-block`), the wait record comes first; with
    /// the held record waiting for the block's later steps too (`ipc-held-after-later-steps`),
    /// it comes last.
    #[test]
    fn records_of_the_connection_wait_for_the_steps_announced_before_them_in_the_block() {
        let block = Block::default();
        let mut connection = vec![data(0, 256, "u32", 4), Record::Waiting { step: 2 }, data(3, 10, "f16", 2)];
        connection.reverse();
        let mut inbox = Inbox::default();
        let mut order = Vec::new();
        for expected in 0..4u64 {
            loop {
                let record = inbox
                    .next(expected, &mut |step| block.take(step), &mut || {
                        let record = connection.pop();
                        // The TX rank announced step 1 in the block, then asked for a slot for
                        // step 2 on the connection: the receiver's first look was before both.
                        if matches!(record, Some(Record::Waiting { .. })) {
                            block.announce(1, 512);
                        }
                        Ok(record)
                    })
                    .unwrap();
                let record = seen(record);
                let done = record.starts_with("data");
                order.push(record);
                if done {
                    break;
                }
            }
            if expected == 1 {
                block.announce(2, 128);
            }
        }
        assert_eq!(order, ["data 0 256x4 u32", "data 1 512x4 u32", "waiting 2", "data 2 128x4 u32", "data 3 10x2 f16"]);
        // Step 4 in the block after a step of another type: that type's.
        block.announce(4, 3);
        assert_eq!(seen(inbox.next(4, &mut |step| block.take(step), &mut || Ok(None)).unwrap()), "data 4 3x2 f16");
        assert_eq!(seen(inbox.next(5, &mut |step| block.take(step), &mut || Ok(None)).unwrap()), "none");
    }

    /// A step of a new type on the connection, read while the block's step before it was still
    /// to be taken (the receiver's first look came before its announcement): the block's step
    /// keeps the type of the steps before it, and only the steps from the new one on take the
    /// new type. With the type taken from a record as soon as it is read (mutation
    /// `ipc-type-from-held-record`), the block's step would take the later step's type.
    #[test]
    fn a_held_step_of_a_new_type_leaves_the_type_of_the_blocks_steps_before_it() {
        let block = Block::default();
        let mut connection = vec![data(0, 256, "u32", 4), data(2, 100, "f16", 2)];
        connection.reverse();
        let mut inbox = Inbox::default();
        let mut order = Vec::new();
        for expected in 0..4u64 {
            let record = inbox
                .next(expected, &mut |step| block.take(step), &mut || {
                    let record = connection.pop();
                    // The TX rank announced step 1 in the block, then step 2 (of a new type) on
                    // the connection: the receiver's first look was before both.
                    if matches!(&record, Some(Record::Data(step)) if step.step == 2) {
                        block.announce(1, 512);
                    }
                    Ok(record)
                })
                .unwrap();
            order.push(seen(record));
            if expected == 2 {
                block.announce(3, 30);
            }
        }
        assert_eq!(order, ["data 0 256x4 u32", "data 1 512x4 u32", "data 2 100x2 f16", "data 3 30x2 f16"]);
    }

    /// A wait the TX rank wrote on the connection for step 3 before it announced step 3 in the
    /// block (its `tx_wait` timed out, then a `tx` sent the step), read only after the block gave
    /// step 3 (the receiver looks there first): dropped as stale, and the next record comes in
    /// order; where the block gave no step, a wait read late is still passed on. With stale waits passed on
    /// (mutation `ipc-stale-wait-fails`), the receiver would fail the link on a wait for step 3
    /// while step 4 is due.
    #[test]
    fn a_wait_read_after_the_block_gave_its_step_is_stale() {
        let block = Block::default();
        let mut connection = vec![data(0, 8, "u32", 4), Record::Waiting { step: 3 }, Record::Close { steps: 5 }];
        connection.reverse();
        let mut inbox = Inbox::default();
        let mut read = || Ok(connection.pop());
        assert_eq!(seen(inbox.next(0, &mut |step| block.take(step), &mut read).unwrap()), "data 0 8x4 u32");
        for step in 1..=4 {
            block.announce(step, 8);
        }
        let mut order = Vec::new();
        for expected in 1..=5u64 {
            loop {
                let record = seen(inbox.next(expected, &mut |step| block.take(step), &mut read).unwrap());
                let done = record != "none";
                if done {
                    order.push(record);
                    break;
                }
            }
        }
        assert_eq!(order, ["data 1 8x4 u32", "data 2 8x4 u32", "data 3 8x4 u32", "data 4 8x4 u32", "close 5"]);
        // Where the block gave no step, a wait read late is passed on (the receiver refuses it).
        let mut inbox = Inbox::default();
        let mut connection = vec![Record::Waiting { step: 0 }, data(0, 8, "u32", 4)];
        assert_eq!(seen(inbox.next(0, &mut |_| None, &mut || Ok(connection.pop())).unwrap()), "data 0 8x4 u32");
        assert_eq!(seen(inbox.next(1, &mut |_| None, &mut || Ok(connection.pop())).unwrap()), "waiting 0");
    }

    /// What a lying or broken TX rank writes into the block: a step before any type crossed the
    /// connection, a step of no element, a count whose bytes overflow. Each is the reason the
    /// link fails, naming the step and what is wrong.
    #[test]
    fn a_step_in_the_block_without_a_type_or_of_no_byte_fails_the_link() {
        let err = Inbox::default().next(0, &mut |_| Some(4), &mut || Ok(None)).err().expect("refused");
        assert!(err.contains("step 0 announced in the control block before any step's type"), "{err}");
        for n in [0, u64::MAX] {
            let mut inbox = Inbox::default();
            let mut first = Some(data(0, 4, "u64", 8));
            assert!(inbox.next(0, &mut |_| None, &mut || Ok(first.take())).unwrap().is_some());
            let err = inbox.next(1, &mut |_| Some(n), &mut || Ok(None)).err().expect("refused");
            assert!(err.contains(&format!("step 1: {n} element(s) of 8 byte(s) (u64)")), "{err}");
        }
    }
}
