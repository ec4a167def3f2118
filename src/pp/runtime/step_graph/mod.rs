//! Graph mode: each stage's step — its receive, the engine's kernels, its send — captured as one
//! single-device graph per stage per slot, and whole steps replayed from them.
//!
//! The boundary protocol is the eager one, applied by the crate's ordering rule to each stage's
//! graph as a whole: launching stage `s`'s graph waits for the slot it reads to have been written
//! (read after write, on `ev_tx`) and for the slot it writes to have been read by the previous
//! step through it (write after read, on `ev_rx`); the slot buffers record their events right
//! after each launch. These waits are made on the launch streams, between graph launches, so no
//! graph holds a node that waits on another device's event. One instance per slot of the ring
//! keeps each slot's copies in their own graph, and the ring's host-side state advances at every
//! launch exactly as `tx`/`rx` advance it, so eager and graph steps interleave freely. A graph
//! reads each ring's slots in turn: a launch whose read would overtake an eager `tx` not received
//! yet is refused, as is a capture of rings that stand at different slots.
//!
//! In a pipeline that spans processes each rank captures and replays its own stages. A boundary
//! from another rank is read in place from its ring, which the boundary's receiver thread fills:
//! a launch waits for the slot's step to arrive, and checks that it is the step the stage is at
//! ([`PpError::GraphStepOrder`] otherwise). A boundary to another rank cannot be captured (its
//! record goes out on the host): the stage's graph copies the step into a buffer of the graphs,
//! and the launch then sends that buffer as an eager `tx` would, on the stage's stream. Eager
//! and graph steps interleave there too: a launch reads the step after the last one received
//! from the ring, by an eager `rx` or a graph alike (steps fill the slots in turn), and each
//! rank may choose eager or graph steps on its own.
//!
//! Lifetime: a [`StepGraphs`] borrows its runtime and holds every allocation its graphs touch
//! (slot buffers included) until it drops. Threading: it is `Send + Sync`; the whole-step
//! [`launch`](StepGraphs::launch) takes `&mut`, [`launch_stage`](StepGraphs::launch_stage) takes
//! `&self` so that each stage's thread launches its own graph, and locks the rings (in boundary
//! order) like `tx`/`rx` do.
//!
//! The steps' capture lives in `capture.rs` ([`StageCapture`], [`PpNRt::capture_step`],
//! [`StepGraphs::recapture`]), their replay in `launch.rs`.

use std::marker::PhantomData;
use std::sync::Arc;

use parking_lot::Mutex;

use super::PpNRt;
use crate::safe::memory::DeviceMemory;
use crate::safe::{CudaSlice, DeviceRepr, GraphExec};

mod capture;
mod launch;

pub use capture::StageCapture;

/// A whole step of the pipeline as graphs ([`PpNRt::capture_step`]): one executable graph per
/// stage per ring slot. [`launch`](Self::launch) replays one step with no host synchronisation.
///
/// ```no_run
/// # fn main() -> ppnrt::Result<()> {
/// # let primary = ppnrt::Engine::new(0)?;
/// let rt = ppnrt::PpNRt::new(ppnrt::PpConfig::new(2), &primary)?;
/// let n = 1024;
/// let mut input = primary.alloc_zeroed::<f32>(n)?; // stage 1's input, allocated before the capture
/// let output = primary.alloc_zeroed::<f32>(n)?; // stage 0's output
/// let mut step = rt.capture_step::<f32>(n, |stage| match stage.stage() {
///     0 => stage.tx(&output),
///     _ => stage.rx_into(&mut input),
/// })?;
/// println!("{} graphs for {} elements", step.n_graphs(), step.n());
/// for _ in 0..10 {
///     step.launch()?; // one step: every stage's graph, in order
/// }
/// # Ok(()) }
/// ```
pub struct StepGraphs<'rt, T: DeviceRepr> {
    rt: &'rt PpNRt,
    n: usize,
    /// `[slot][stage]`, for this rank's stages; locked per launch (a stage's thread launches its
    /// own).
    execs: Vec<Vec<Option<Mutex<GraphExec>>>>,
    /// Each stage's next slot (advanced by every launch of its graph).
    next: Mutex<Vec<usize>>,
    /// `[slot][boundary]`: the slot allocations of this rank's rings the graphs were captured
    /// with.
    slots: Vec<Vec<Option<Arc<DeviceMemory>>>>,
    /// `[slot][boundary]`: for a boundary to another rank, the buffer its TX stage's graph
    /// copies the step into, sent after each launch.
    staging: Vec<Vec<Option<CudaSlice<u8>>>>,
    /// Set when a re-capture failed half-way: the graphs disagree with each other.
    stale: bool,
    _elem: PhantomData<T>,
}

/// The slot of a ring filled from another rank that holds `step` (steps fill its slots in turn).
fn slot_of(step: u64, n_slots: usize) -> usize {
    (step % n_slots as u64) as usize
}

impl<T: DeviceRepr> StepGraphs<'_, T> {
    /// The step's element count at every boundary.
    pub fn n(&self) -> usize {
        self.n
    }

    /// How many graphs the step holds (stages × slots).
    pub fn n_graphs(&self) -> usize {
        self.execs.iter().flatten().filter(|exec| exec.is_some()).count()
    }
}

impl<T: DeviceRepr> std::fmt::Debug for StepGraphs<'_, T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StepGraphs")
            .field("n", &self.n)
            .field("graphs", &self.n_graphs())
            .field("stale", &self.stale)
            .finish()
    }
}
