//! The pipeline's misuse errors ([`PpError`]) and the slot states they name ([`SlotState`]).
//!
//! These are the pipeline runtime's own errors (every one is raised in `pp`, and reached as
//! `ppnrt::pp::PpError` too), kept here, under the crate-wide [`Error`](crate::Error) that holds
//! them as `Error::Pipeline`: the pipeline's calls return that umbrella, so a home inside `pp`
//! would make `pp` and `error` each depend on the other. Nothing here names anything of `pp`'s
//! code; the slot states' one owner, the transitions between them, is the ring.

use std::fmt;
use std::time::Duration;

/// Where a slot of a boundary's ring stands (host-side state; `tx` fills a free slot, `rx`
/// receives a filled one).
///
/// ```no_run
/// use ppnrt::{Error, PpConfig, PpError, PpNRt, SlotState};
/// # fn main() -> ppnrt::Result<()> {
/// let primary = ppnrt::Engine::new(0)?;
/// let rt = PpNRt::new(PpConfig::new(2).with_slots(1), &primary)?;
/// let x = primary.htod(&[1.0f32; 16])?;
/// rt.tx(0, &x, 16)?; // fills the ring's one slot
/// match rt.tx(0, &x, 16) {
///     // Not received yet: refused, nothing overwritten.
///     Err(Error::Pipeline(PpError::SlotState { found: SlotState::Filled { n, elem }, .. })) => {
///         assert_eq!((n, elem), (16, "f32"))
///     }
///     other => panic!("{other:?}"),
/// }
/// # Ok(()) }
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum SlotState {
    /// Free: nothing was ever sent through it.
    NeverFilled,
    /// Filled by `tx` and not received yet.
    Filled {
        /// Elements sent.
        n: usize,
        /// Their type's [`DeviceRepr::NAME`](crate::DeviceRepr::NAME).
        elem: &'static str,
    },
    /// Free: its data was received.
    Received,
    /// Free: its data was given up by [`PpNRt::discard_unreceived`](crate::PpNRt::discard_unreceived).
    Discarded,
    /// Received in place ([`PpNRt::rx_in_place`](crate::PpNRt::rx_in_place)): the receiver's view
    /// of it is alive. A write that reaches it gives the slot another buffer and leaves the lent
    /// one to the view.
    Lent,
    /// Taken by [`PpNRt::capture_step`](crate::PpNRt::capture_step) while it captures the step's
    /// graphs.
    Capturing,
    /// Being filled by a receive from another rank: the boundary's receiver thread is posting it.
    Receiving,
    /// Seen from the sending rank of a boundary to another rank: the slot holds step `step`,
    /// which the receiving rank's stage has not taken yet (as far as its answers tell).
    UntakenByPeer {
        /// The step the slot holds.
        step: u64,
    },
}

impl SlotState {
    /// Whether `tx` may fill the slot.
    pub fn is_free(&self) -> bool {
        matches!(self, SlotState::NeverFilled | SlotState::Received | SlotState::Discarded)
    }
}

impl fmt::Display for SlotState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            SlotState::NeverFilled => f.write_str("free (never filled)"),
            SlotState::Filled { n, elem } => write!(f, "filled ({n} {elem} sent, not yet received)"),
            SlotState::Received => f.write_str("free (already received)"),
            SlotState::Discarded => f.write_str("free (discarded unreceived)"),
            SlotState::Lent => f.write_str("lent (received in place, its view still alive)"),
            SlotState::Capturing => f.write_str("taken by a capture of the step's graphs"),
            SlotState::Receiving => f.write_str("being received from another rank"),
            SlotState::UntakenByPeer { step } => write!(f, "holding step {step}, not yet taken by the receiving rank"),
        }
    }
}

/// Misuse of a [`PpNRt`](crate::PpNRt) call: caught before anything is enqueued, nothing was
/// overwritten, and the runtime stays usable.
///
/// ```no_run
/// use ppnrt::{Error, PpConfig, PpError, PpNRt};
/// # fn main() -> ppnrt::Result<()> {
/// let primary = ppnrt::Engine::new(0)?;
/// let rt = PpNRt::new(PpConfig::new(2), &primary)?;
/// let x = primary.htod(&[1.0f32; 16])?;
/// let slot = rt.tx(0, &x, 16)?;
/// // An rx of another type than the tx sent is refused; the slot keeps its data.
/// match rt.rx::<u32>(0, slot, 16) {
///     Err(Error::Pipeline(PpError::RxTypeMismatch { requested, sent, .. })) => assert_eq!((requested, sent), ("u32", "f32")),
///     other => panic!("{other:?}"),
/// }
/// let y = rt.rx::<f32>(0, slot, 16)?;
/// # drop(y);
/// # Ok(()) }
/// ```
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum PpError {
    /// A stage index past the pipeline's stages.
    #[error("stage {stage} is out of range: the pipeline has {n_stages} stage(s)")]
    StageOutOfRange {
        /// The stage asked for.
        stage: usize,
        /// The pipeline's stage count.
        n_stages: usize,
    },
    /// A stage that another process of the pipeline runs: this process may not enter it, nor make
    /// its side of a boundary (`tx` of a stage's boundary, `rx` into it).
    #[error("stage {stage} runs in rank {owner}; this process is rank {rank}")]
    StageNotOwned {
        /// The stage.
        stage: usize,
        /// The rank that runs it.
        owner: usize,
        /// This process's rank.
        rank: usize,
    },
    /// A boundary to another process failed: the peer exited or closed its connection, NCCL
    /// reported an asynchronous error, or a call to it failed. The boundary's communicator was
    /// aborted (no operation of it stays queued) and every later call on the boundary returns
    /// this error.
    #[error("boundary {boundary}: the peer process (rank {peer}) failed: {reason}")]
    PeerFailed {
        /// The boundary.
        boundary: usize,
        /// The peer's rank.
        peer: usize,
        /// What happened.
        reason: String,
    },
    /// A boundary index past the pipeline's boundaries.
    #[error("boundary {boundary} is out of range: the pipeline has {n_boundaries} boundary(ies)")]
    BoundaryOutOfRange {
        /// The boundary asked for.
        boundary: usize,
        /// The pipeline's boundary count (stages - 1).
        n_boundaries: usize,
    },
    /// A slot index past the boundary's ring.
    #[error("boundary {boundary}: slot {slot} is out of range, the ring has {n_slots} slot(s)")]
    SlotOutOfRange {
        /// The boundary.
        boundary: usize,
        /// The slot asked for.
        slot: usize,
        /// The ring's size.
        n_slots: usize,
    },
    /// A transfer of zero elements.
    #[error("boundary {boundary}: n must be at least 1")]
    ZeroLength {
        /// The boundary.
        boundary: usize,
    },
    /// A slot is not in the state the call needs; nothing was enqueued or overwritten.
    #[error("boundary {boundary}, slot {slot}: {call} needs a {needed} slot, but it is {found}")]
    SlotState {
        /// The boundary.
        boundary: usize,
        /// The slot.
        slot: usize,
        /// `tx` or `rx`.
        call: &'static str,
        /// The state the call needs.
        needed: &'static str,
        /// The slot's state.
        found: SlotState,
    },
    /// `rx` asked for another length than the slot's `tx` sent.
    #[error("boundary {boundary}, slot {slot}: rx of {requested} element(s), but tx sent {sent}")]
    RxLengthMismatch {
        /// The boundary.
        boundary: usize,
        /// The slot.
        slot: usize,
        /// The length passed to `rx`.
        requested: usize,
        /// The length `tx` sent.
        sent: usize,
    },
    /// `rx` asked for another element type than the slot's `tx` sent.
    #[error("boundary {boundary}, slot {slot}: rx as {requested}, but tx sent {sent}")]
    RxTypeMismatch {
        /// The boundary.
        boundary: usize,
        /// The slot.
        slot: usize,
        /// The element type passed to `rx`.
        requested: &'static str,
        /// The element type `tx` sent.
        sent: &'static str,
    },
    /// `rx` asked for as many elements of a type of that name as were sent, but they fill another
    /// number of bytes than the step carried: the sender's type of that name has another size (a
    /// peer process of another build, or a record that lies). Nothing was received; the slot
    /// keeps its data.
    #[error(
        "boundary {boundary}, slot {slot}: rx of {n} {elem} of {requested_size} byte(s) each, but the step \
         carried {sent_bytes} byte(s)"
    )]
    RxSizeMismatch {
        /// The boundary.
        boundary: usize,
        /// The slot.
        slot: usize,
        /// The element type's name.
        elem: &'static str,
        /// Elements asked for (as many as were sent).
        n: usize,
        /// The size of the receiver's element type, in bytes.
        requested_size: usize,
        /// The bytes the step carried.
        sent_bytes: usize,
    },
    /// `tx` over a boundary to another process of an element type whose name
    /// ([`DeviceRepr::NAME`](crate::DeviceRepr::NAME)) is longer than the boundary carries;
    /// nothing was sent.
    #[error(
        "boundary {boundary}: the element type name `{name}` is {} bytes; a boundary between processes carries names of at most {max}",
        name.len()
    )]
    TypeNameTooLong {
        /// The boundary.
        boundary: usize,
        /// The element type's name.
        name: &'static str,
        /// The longest name the boundary carries, in bytes.
        max: usize,
    },
    /// `tx_wait` or `rx_wait` waited `waited` and the slot never became ready (free for `tx`,
    /// filled for `rx`); nothing was enqueued.
    #[error("boundary {boundary}, slot {slot}: {call} waited {waited:?}, and the slot is still {found}")]
    Timeout {
        /// The boundary.
        boundary: usize,
        /// The slot waited for.
        slot: usize,
        /// `tx` or `rx`.
        call: &'static str,
        /// How long the call waited.
        waited: Duration,
        /// The slot's state when it gave up.
        found: SlotState,
    },
    /// Graph mode ([`PpNRt::capture_step`](crate::PpNRt::capture_step)) does not support the
    /// boundary's transport (host-staged copies go through pinned host memory, which a graph
    /// cannot hold).
    #[error("boundary {boundary}: graph mode does not support the {transport} transport")]
    GraphTransport {
        /// The boundary.
        boundary: usize,
        /// The transport.
        transport: &'static str,
    },
    /// A step larger than the slots of a boundary between two processes of one host (their
    /// memory is mapped by both processes at build, and does not grow): raise the slots with
    /// [`PpConfig::with_reserve_bytes`](crate::PpConfig::with_reserve_bytes) (`PPNRT_RESERVE_BYTES`)
    /// on the receiving rank, or carry the boundary over NCCL.
    #[error(
        "boundary {boundary}: a step of {bytes} byte(s) does not fit its slots of {capacity} byte(s) (raise reserve_bytes on the receiving rank)"
    )]
    StepTooLarge {
        /// The boundary.
        boundary: usize,
        /// The step's bytes.
        bytes: usize,
        /// The slots' capacity.
        capacity: usize,
    },
    /// The plan gave a boundary a transport this build cannot run: refused when the runtime is
    /// built. (This build runs every transport; kept for builds without one.)
    #[error("boundary {boundary}: the {transport} transport is not available in this build: {reason}")]
    TransportUnavailable {
        /// The boundary.
        boundary: usize,
        /// The transport.
        transport: &'static str,
        /// Why it was chosen, and what to do instead.
        reason: String,
    },
    /// A stage's captured step broke graph mode's rules (`tx` missing or made twice, `received`
    /// asked of stage 0, a length other than the step's).
    #[error("stage {stage}: {problem}")]
    GraphStage {
        /// The stage.
        stage: usize,
        /// What went wrong.
        problem: &'static str,
    },
    /// A graph step was launched while the boundary rings are not in step (an eager step crossed
    /// some boundaries but not all): the boundary's next slot is not the one the step would use.
    /// To get back in step, finish the eager step (its `tx` and `rx` on the boundaries it did not
    /// cross).
    #[error(
        "boundary {boundary}: a graph step would use slot {expected}, but the ring's next slot is {found} (an eager \
         step that crossed only some boundaries is finished by its `tx` and `rx` on the others)"
    )]
    GraphOutOfStep {
        /// The boundary.
        boundary: usize,
        /// The slot of the step (boundary 0's next).
        expected: usize,
        /// The boundary's next slot.
        found: usize,
    },
    /// [`PpNRt::capture_step`](crate::PpNRt::capture_step) found this rank's boundary rings at
    /// different slots: an eager step crossed some boundaries but not all (a `tx` and `rx` more
    /// on one boundary than on another). One step's graphs use one slot of every ring, so the
    /// graphs would never be in step; nothing was captured and the rings are as they were. To
    /// get back in step, finish the eager step: a `tx` and its `rx` on each ring behind (a ring
    /// moves one slot per `tx`) until every ring stands at one slot, then capture again.
    #[error(
        "the boundary rings stand at different slots ({}): finish the eager step that crossed only some \
         boundaries (a `tx` and its `rx` on each ring behind, until every ring is at one slot), then capture again",
        ring_slots(rings)
    )]
    CaptureOutOfStep {
        /// Each ring of this rank and the slot it stands at: `(boundary, slot)` (a ring's next
        /// write, or for a ring filled from another rank the slot of the step after the last one
        /// received).
        rings: Vec<(usize, usize)>,
    },
    /// A stage's graph was launched out of turn: the stage's own step count
    /// ([`StepGraphs::launch_stage`](crate::StepGraphs::launch_stage)) is not the step the whole-step
    /// [`launch`](crate::StepGraphs::launch) would make, or the reverse.
    #[error("stage {stage}: a graph step for slot {expected} was asked, but the stage is at slot {found}")]
    GraphStageOutOfStep {
        /// The stage.
        stage: usize,
        /// The slot the call would use.
        expected: usize,
        /// The slot the stage is at.
        found: usize,
    },
    /// A stage's graph would read a slot of a boundary from another rank that holds another step
    /// than the stage's next (the step after the last one received): an eager `rx` of that
    /// boundary took a step out of turn, skipping the one the slot holds.
    #[error(
        "boundary {boundary}: the stage's graph expects step {expected} from the other rank, its slot holds step {found}"
    )]
    GraphStepOrder {
        /// The boundary.
        boundary: usize,
        /// The step the stage is at.
        expected: u64,
        /// The step the slot holds.
        found: u64,
    },
    /// The step's graphs no longer match the runtime (a slot was reallocated by an eager `tx` of
    /// a larger length, or a re-capture failed): capture the step again.
    #[error("boundary {boundary}, slot {slot}: the step's graphs are stale (capture the step again)")]
    GraphStale {
        /// The boundary.
        boundary: usize,
        /// The slot.
        slot: usize,
    },
}

/// `boundary 0 at slot 1, boundary 1 at slot 0`, for [`PpError::CaptureOutOfStep`].
fn ring_slots(rings: &[(usize, usize)]) -> String {
    let at: Vec<String> = rings.iter().map(|(b, slot)| format!("boundary {b} at slot {slot}")).collect();
    at.join(", ")
}

#[cfg(test)]
mod tests {
    use super::SlotState;

    #[test]
    fn slot_states_read_well_in_errors() {
        assert_eq!(SlotState::NeverFilled.to_string(), "free (never filled)");
        assert_eq!(SlotState::Filled { n: 42, elem: "f32" }.to_string(), "filled (42 f32 sent, not yet received)");
        assert_eq!(SlotState::Received.to_string(), "free (already received)");
        assert_eq!(SlotState::Discarded.to_string(), "free (discarded unreceived)");
        assert!(!SlotState::Filled { n: 1, elem: "u8" }.is_free() && SlotState::Discarded.is_free());
        assert_eq!(SlotState::Receiving.to_string(), "being received from another rank");
        assert!(!SlotState::Receiving.is_free());
    }
}
