//! The pipeline runtime's error vocabulary, where `pp`'s code finds it: the crate-wide
//! [`Error`] and its [`Result`], the misuse errors ([`PpError`]) and the slot states they name
//! ([`SlotState`]), all defined in `crate::error` (the umbrella sits above the layers it wraps,
//! and the pipeline's calls return it); and [`ReceiverState`], the pipeline's own snapshot of a
//! receiver thread, defined here.

use std::fmt;
use std::time::Duration;

pub use crate::error::{Error, PpError, Result, SlotState};

/// What the receiver thread of a boundary from another rank is doing, and for how long it has
/// been doing it ([`PpNRt::receiver_state`](crate::PpNRt::receiver_state)): when a receive from
/// another rank waits too long, whether the step never came, found no free slot, or is being
/// posted. A snapshot for a diagnosis (the step and the time are read apart, without a lock).
///
/// ```no_run
/// # fn main() -> ppnrt::Result<()> {
/// # let primary = ppnrt::Engine::new(0)?;
/// # let rt = ppnrt::PpNRt::new(ppnrt::PpConfig::new(2), &primary)?;
/// // `None` for a boundary inside this process; across processes, what its receiver waits for.
/// match rt.receiver_state(0)? {
///     Some(state) => eprintln!("boundary 0's receiver: {state:?}"),
///     None => eprintln!("boundary 0 is local"),
/// }
/// # Ok(()) }
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum ReceiverState {
    /// Waiting for the TX rank's record of step `step`.
    AwaitingRecord {
        /// The step (counted from 0 on this boundary).
        step: u64,
        /// How long it has waited.
        waited: Duration,
    },
    /// Step `step`'s record came; waiting until the ring's next slot is free (received by the
    /// RX stage).
    AwaitingFreeSlot {
        /// The step.
        step: u64,
        /// How long it has waited.
        waited: Duration,
    },
    /// Posting step `step`'s receive into its slot (growing the slot first if needed).
    Posting {
        /// The step.
        step: u64,
        /// How long it has been at it.
        waited: Duration,
    },
    /// The thread has ended: the boundary was closed, or its link failed.
    Stopped,
}

impl fmt::Display for ReceiverState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ReceiverState::AwaitingRecord { step, waited } => {
                write!(f, "waiting {waited:?} for the record of step {step} from the TX rank")
            }
            ReceiverState::AwaitingFreeSlot { step, waited } => {
                write!(f, "step {step} announced; waiting {waited:?} for a free slot")
            }
            ReceiverState::Posting { step, waited } => write!(f, "posting the receive of step {step} for {waited:?}"),
            ReceiverState::Stopped => f.write_str("stopped (the boundary closed or its link failed)"),
        }
    }
}
