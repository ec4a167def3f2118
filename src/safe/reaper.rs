//! Frees that the calling thread may not make: handed to one process-wide thread that drops them.
//!
//! A capture in [`CaptureMode::ThreadLocal`](super::CaptureMode::ThreadLocal) or
//! [`CaptureMode::Global`](super::CaptureMode::Global) forbids its thread calls that cannot be
//! captured, `cuMemFree` and `cuMemFreeHost` among them, and the driver lets every other thread
//! make them. A free of memory that the capture does not touch (owned by another stream, or
//! pinned host memory) is therefore made by this thread instead of being held back until the
//! capture ends: a capture that is held long, or forgotten, keeps no memory it does not use.
//!
//! Lifetime: the thread starts with the first free handed to it and lives as long as the
//! process. The allocations' own drops order and free them there, as on any thread, and record
//! their errors for [`take_drop_errors`](super::take_drop_errors).

use std::sync::OnceLock;
use std::sync::mpsc::{Sender, channel};

/// An allocation whose drop frees it.
type Allocation = Box<dyn Send>;

/// The channel to the freeing thread; `None` when the thread could not be started.
static REAPER: OnceLock<Option<Sender<Allocation>>> = OnceLock::new();

/// Hands `allocation` to the freeing thread, which drops it. Gives it back when that thread
/// cannot be started (or has gone): the caller then keeps it some other way.
pub(crate) fn free_elsewhere(allocation: Allocation) -> Result<(), Allocation> {
    let reaper = REAPER.get_or_init(|| {
        let (send, receive) = channel::<Allocation>();
        let started = std::thread::Builder::new().name("ppnrt-free".into()).spawn(move || {
            for allocation in receive {
                drop(allocation);
            }
        });
        started.ok().map(|_| send)
    });
    match reaper {
        Some(send) => send.send(allocation).map_err(|refused| refused.0),
        None => Err(allocation),
    }
}
