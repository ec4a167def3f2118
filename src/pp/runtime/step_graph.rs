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

use std::marker::PhantomData;
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::{Mutex, MutexGuard};

use super::{Boundary, PpNRt, Stage};
use crate::error::CaptureError;
use crate::error::CudaError;
use crate::pp::error::{Error, Result};
use crate::pp::error::{PpError, SlotState};
use crate::pp::plan::Transport;
use crate::pp::ring::{SlotBuffer, Slots};
use crate::safe::memory::{DeviceMemory, byte_size};
use crate::safe::{
    CaptureMode, CudaGraph, CudaSlice, CudaStream, CudaView, CudaViewMut, DeviceRepr, DeviceSlice, DeviceSliceMut,
    GraphExec,
};

/// One stage's step being captured ([`PpNRt::capture_step`]): the stage is entered (engine
/// operations land in the capture), and the boundary calls here record the protocol's copies.
pub struct StageCapture<'a, T: DeviceRepr> {
    stage: usize,
    slot: usize,
    n: usize,
    stream: &'a Arc<CudaStream>,
    /// Boundary `stage - 1` and the slot this stage receives from.
    input: Option<(&'a Boundary, &'a CudaSlice<u8>)>,
    /// Where this stage sends: a slot of boundary `stage`, or the buffer sent to another rank.
    output: Option<Output<'a>>,
    sent: bool,
    _elem: PhantomData<T>,
}

/// The slot of a ring filled from another rank that holds `step` (steps fill its slots in turn).
fn slot_of(step: u64, n_slots: usize) -> usize {
    (step % n_slots as u64) as usize
}

/// Where a captured stage's `tx` goes.
enum Output<'a> {
    /// A slot of a ring of this rank.
    Slot(&'a Boundary, &'a mut CudaSlice<u8>),
    /// The buffer that, after each launch of the stage's graph, is sent to the rank of the next
    /// stage (a boundary to another rank: its send cannot be captured).
    Remote(&'a mut CudaSlice<u8>),
}

impl<T: DeviceRepr> StageCapture<'_, T> {
    /// The stage being captured.
    pub fn stage(&self) -> usize {
        self.stage
    }

    /// The ring slot this instance of the stage's graph uses (graphs are captured once per slot).
    pub fn slot(&self) -> usize {
        self.slot
    }

    /// The step's element count at every boundary.
    pub fn n(&self) -> usize {
        self.n
    }

    /// The stage's stream, which is capturing.
    pub fn stream(&self) -> &Arc<CudaStream> {
        self.stream
    }

    /// The activations this stage receives, in place: the slot itself, which the stage's kernels
    /// read in its graph (no copy).
    ///
    /// # Errors
    /// [`PpError::GraphStage`] for stage 0, which receives nothing.
    pub fn received(&self) -> Result<CudaView<'_, T>> {
        let (_, slot) = self.input.as_ref().ok_or(Error::Pipeline(PpError::GraphStage {
            stage: self.stage,
            problem: "stage 0 receives nothing (received() is for later stages)",
        }))?;
        Ok(slot.slice(..self.n * std::mem::size_of::<T>())?.reinterpret::<T>()?)
    }

    /// Copies the received activations into `dst` (a buffer of this stage's device allocated
    /// before the capture), as `rx` would.
    ///
    /// # Errors
    /// [`PpError::GraphStage`] for stage 0; [`CudaError::LengthMismatch`](crate::CudaError::LengthMismatch) unless `dst` holds `n`
    /// elements; [`CudaError::WrongDevice`](crate::CudaError::WrongDevice) for a `dst` of another device; a capture error.
    pub fn rx_into<D: DeviceSliceMut<T>>(&self, dst: &mut D) -> Result<()> {
        let src = self.received()?.into_bytes();
        let (boundary, _) = self.input.as_ref().expect("received() checked the input");
        if dst.len() != self.n {
            return Err(CudaError::LengthMismatch {
                what: "StageCapture::rx_into: dst must hold the step's n elements",
                expected: self.n,
                found: dst.len(),
            }
            .into());
        }
        if dst.ordinal() != self.stream.ordinal() {
            return Err(CudaError::WrongDevice {
                what: "StageCapture::rx_into: dst must be on the stage's device",
                expected: self.stream.ordinal(),
                found: dst.ordinal(),
            }
            .into());
        }
        Ok(boundary.copy_within_device(self.stream, src, dst.as_view_mut().into_bytes())?)
    }

    /// Sends `x[..n]` into this stage's boundary slot (the copy `tx` makes), once per stage. For a
    /// boundary to another rank, `x[..n]` is copied into a buffer of the step's graphs, which
    /// [`StepGraphs::launch_stage`] sends after each launch.
    ///
    /// # Errors
    /// [`PpError::GraphStage`] for the last stage or a second `tx`; [`CudaError::OutOfBounds`](crate::CudaError::OutOfBounds) when
    /// `x` is shorter than `n`; [`CudaError::WrongDevice`](crate::CudaError::WrongDevice) for an `x` of another device; a capture
    /// error.
    pub fn tx<S: DeviceSlice<T>>(&mut self, x: &S) -> Result<()> {
        let stage = self.stage;
        let n = self.n;
        let Some(output) = self.output.as_mut() else {
            return Err(Error::Pipeline(PpError::GraphStage {
                stage,
                problem: "the last stage has no boundary to tx into",
            }));
        };
        if self.sent {
            return Err(Error::Pipeline(PpError::GraphStage { stage, problem: "tx was captured twice in one step" }));
        }
        if n > x.len() {
            return Err(CudaError::OutOfBounds {
                what: "StageCapture::tx: n exceeds x",
                start: 0,
                end: n,
                len: x.len(),
            }
            .into());
        }
        if x.ordinal() != self.stream.ordinal() {
            return Err(CudaError::WrongDevice {
                what: "StageCapture::tx: x must be on the stage's device",
                expected: self.stream.ordinal(),
                found: x.ordinal(),
            }
            .into());
        }
        let src = x.as_view().slice(..n)?.into_bytes();
        let bytes = n * std::mem::size_of::<T>();
        match output {
            Output::Slot(boundary, slot) => boundary.copy_into_slot(self.stream, src, slot.slice_mut(..bytes)?)?,
            Output::Remote(staging) => self.stream.memcpy_dtod(&src, &mut staging.slice_mut(..bytes)?)?,
        }
        self.sent = true;
        Ok(())
    }
}

impl<T: DeviceRepr> std::fmt::Debug for StageCapture<'_, T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StageCapture")
            .field("stage", &self.stage)
            .field("slot", &self.slot)
            .field("n", &self.n)
            .finish()
    }
}

/// A whole step of the pipeline as graphs ([`PpNRt::capture_step`]): one executable graph per
/// stage per ring slot. [`launch`](Self::launch) replays one step with no host synchronisation.
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

/// The slot buffers taken out of every ring while a step is captured; put back (with their
/// states) when dropped, on every path.
struct TakenSlots<'rt> {
    rt: &'rt PpNRt,
    /// `[boundary]`: for this rank's rings, each slot's buffer and the state it had.
    taken: Vec<Option<TakenRing>>,
}

/// A ring's slot buffers taken out for a capture, with the states they had.
type TakenRing = Vec<(CudaSlice<u8>, SlotState)>;

/// What a capture makes: `[slot][stage]` graphs of this rank's stages, the slot allocations
/// (`[slot][boundary]`) and the buffers sent to other ranks (`[slot][boundary]`).
type Captured = (Vec<Vec<Option<CudaGraph>>>, Vec<Vec<Option<Arc<DeviceMemory>>>>, Vec<Vec<Option<CudaSlice<u8>>>>);

impl Drop for TakenSlots<'_> {
    fn drop(&mut self) {
        for (b, taken) in self.taken.drain(..).enumerate() {
            let (Some(taken), Some(boundary)) = (taken, self.rt.ring(b)) else { continue };
            let mut ring = boundary.ring.lock();
            for (k, (buffer, state)) in taken.into_iter().enumerate() {
                ring.restore_after_capture(k, buffer, state);
            }
            drop(ring);
            boundary.ring.wake_sleepers();
        }
    }
}

impl PpNRt {
    /// Captures one step of the pipeline as CUDA graphs: `body` runs once per stage per ring slot,
    /// with the stage entered and its stream capturing, and records the stage's step — its
    /// receive ([`StageCapture::received`] in place, or [`StageCapture::rx_into`]), the engine's
    /// kernels, and its send ([`StageCapture::tx`], required for every stage but the last). Every
    /// boundary carries `n` elements of `T`.
    ///
    /// Capture between steps: every slot must be free (received or discarded), except the slots
    /// of a boundary from another rank, which may already hold later steps (kept, and read
    /// first); and every ring of this rank must stand at one slot, the one the next step uses
    /// (a ring's next write; for a ring filled from another rank, the slot of the step after the
    /// last one received). The graphs do not follow rings that stand apart: after an eager step
    /// that crossed only some boundaries, the capture is refused
    /// ([`PpError::CaptureOutOfStep`] names each ring's slot) until that step is finished (its
    /// `tx` and `rx` on the boundaries it did not cross). In a pipeline that spans processes each
    /// rank captures its own stages; a stage sending to another rank sends after each launch of
    /// its graph (see [`StepGraphs::launch_stage`]). Buffers the body uses must be allocated
    /// before (an allocation during the capture is refused), and live as long as the graphs need
    /// them: the graphs hold them alive. Slots are grown to `n` elements first and stay
    /// allocated.
    ///
    /// ```no_run
    /// # fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// use ppnrt::{Engine, PpNRt};
    /// let primary = Engine::new(0)?;
    /// let rt = PpNRt::get(&primary)?;
    /// let n = 8192;
    /// // Persistent per-stage activations, allocated before the capture.
    /// let mut acts = Vec::new();
    /// for s in 0..rt.n_stages() {
    ///     acts.push(rt.engine(s, &primary)?.alloc_persistent::<f32>(n)?);
    /// }
    /// let mut step = rt.capture_step::<f32>(n, |stage| {
    ///     let x = &mut acts[stage.stage()];
    ///     if stage.stage() > 0 {
    ///         stage.rx_into(x)?;
    ///     }
    ///     // ... the stage's kernels on x, under the ambient stream ...
    ///     if stage.stage() + 1 < rt.n_stages() {
    ///         stage.tx(x)?;
    ///     }
    ///     Ok(())
    /// })?;
    /// for _ in 0..100 {
    ///     step.launch()?;
    /// }
    /// rt.synchronize()?;
    /// # Ok(()) }
    /// ```
    ///
    /// # Errors
    /// [`PpError::ZeroLength`]; [`PpError::GraphTransport`] for a host-staged boundary;
    /// [`PpError::SlotState`] when a slot is not free; [`PpError::CaptureOutOfStep`] when the
    /// rings stand at different slots; [`PpError::Timeout`] when a slot of a
    /// boundary from another rank stays in its receive for the peer timeout;
    /// [`PpError::GraphStage`] when a stage broke the step's rules; [`CaptureError`] when the body
    /// made a call that cannot be captured (the runtime stays usable); the body's own error; the
    /// driver's error.
    pub fn capture_step<T: DeviceRepr>(
        &self,
        n: usize,
        body: impl FnMut(&mut StageCapture<'_, T>) -> Result<()>,
    ) -> Result<StepGraphs<'_, T>> {
        let (graphs, slots, staging) = self.capture_graphs(n, body)?;
        let mut execs = Vec::with_capacity(graphs.len());
        for per_slot in graphs {
            let mut row = Vec::with_capacity(per_slot.len());
            for (s, graph) in per_slot.into_iter().enumerate() {
                row.push(match graph {
                    Some(graph) => {
                        let mut exec = graph.instantiate()?;
                        exec.upload(&self.stage(s)?.stream)?;
                        Some(Mutex::new(exec))
                    }
                    None => None,
                });
            }
            execs.push(row);
        }
        // Every stage of this rank is at the same step: the capture needed the rings of this rank
        // free and at one slot (a step crosses every boundary once). That step's
        // slot is a ring's `next` when both its stages run here; for a ring filled from another
        // rank (which may have filled later steps already) it is the step after the last one
        // received, and for a boundary to another rank the first step not yet sent.
        let n_slots = self.n_slots();
        let first = if let Some((_, ring)) = self.rings().find(|(_, ring)| ring.inbound.is_none()) {
            ring.ring.lock().next()
        } else if let Some((_, ring)) = self.rings().next() {
            slot_of(ring.ring.lock().received_steps(), n_slots)
        } else if let Some(sender) = (0..self.boundaries.len()).find_map(|b| self.sender(b)) {
            slot_of(sender.steps_sent(), n_slots)
        } else {
            0
        };
        let next = Mutex::new(vec![first; self.n_stages()]);
        Ok(StepGraphs { rt: self, n, execs, next, slots, staging, stale: false, _elem: PhantomData })
    }

    /// Captures `[slot][stage]` graphs of one step of this rank's stages (see
    /// [`capture_step`](Self::capture_step)) and returns them with the slot allocations they use
    /// and the buffers they send to other ranks.
    fn capture_graphs<T: DeviceRepr>(
        &self,
        n: usize,
        mut body: impl FnMut(&mut StageCapture<'_, T>) -> Result<()>,
    ) -> Result<Captured> {
        if n == 0 {
            return Err(Error::Pipeline(PpError::ZeroLength { boundary: 0 }));
        }
        let bytes = byte_size::<T>("PpNRt::capture_step", n)?;
        for (b, boundary) in self.rings() {
            if boundary.plan.transport == Transport::HostStaged {
                return Err(Error::Pipeline(PpError::GraphTransport { boundary: b, transport: "host-staged" }));
            }
            if boundary.sm_copies {
                // Loaded now: a module load cannot be captured.
                boundary.rx_engine.helper_kernels()?;
            }
        }
        let n_slots = if self.boundaries.is_empty() { 1 } else { self.n_slots() };
        // The buffers sent to other ranks, allocated before any capture begins.
        let mut staging: Vec<Vec<Option<CudaSlice<u8>>>> = Vec::with_capacity(n_slots);
        for _ in 0..n_slots {
            let mut row = Vec::with_capacity(self.boundaries.len());
            for b in 0..self.boundaries.len() {
                row.push(match self.sender(b) {
                    Some(_) => Some(CudaSlice::<u8>::alloc(&self.stage(b)?.stream, bytes)?),
                    None => None,
                });
            }
            staging.push(row);
        }
        let mut taken = self.take_slots(bytes)?;
        // The rings cannot move while their slots are taken.
        self.check_rings_in_step()?;
        let slots: Vec<Vec<Option<Arc<DeviceMemory>>>> = (0..n_slots)
            .map(|k| {
                let ring_slot = |ring: &TakenRing| Arc::clone(ring[k].0.memory());
                taken.taken.iter().map(|ring| ring.as_ref().map(ring_slot)).collect()
            })
            .collect();
        let mut graphs = Vec::with_capacity(n_slots);
        for (k, staging_of_slot) in staging.iter_mut().enumerate() {
            let mut row: Vec<Option<CudaGraph>> = (0..self.n_stages()).map(|_| None).collect();
            for (s, stage) in self.local_stages() {
                let capture = stage.stream.begin_capture(CaptureMode::ThreadLocal)?;
                let (before, after) = taken.taken.split_at_mut(s);
                let input = s.checked_sub(1).map(|b| {
                    let ring = before[b].as_ref().expect("the ring a stage reads is in its rank");
                    (self.ring(b).expect("the ring a stage reads is in its rank"), &ring[k].0)
                });
                let output = match (after.first_mut().and_then(Option::as_mut), staging_of_slot.get_mut(s)) {
                    (Some(ring), _) => {
                        Some(Output::Slot(self.ring(s).expect("stage s feeds boundary s"), &mut ring[k].0))
                    }
                    (None, Some(Some(remote))) => Some(Output::Remote(remote)),
                    (None, _) => None,
                };
                let has_output = output.is_some();
                let mut capture_of_stage = StageCapture {
                    stage: s,
                    slot: k,
                    n,
                    stream: &stage.stream,
                    input,
                    output,
                    sent: false,
                    _elem: PhantomData,
                };
                {
                    let _scope = self.enter(s)?;
                    body(&mut capture_of_stage)?;
                }
                if has_output && !capture_of_stage.sent {
                    return Err(Error::Pipeline(PpError::GraphStage {
                        stage: s,
                        problem: "the step did not tx into the stage's boundary",
                    }));
                }
                row[s] = Some(capture.end()?);
            }
            graphs.push(row);
        }
        drop(taken);
        Ok((graphs, slots, staging))
    }

    /// Checks that this rank's rings stand at one slot, the slot the next step's graphs use
    /// (stage `s`'s graph for slot `k` reads slot `k` of ring `s - 1` and writes slot `k` of ring
    /// `s`): a ring's next write, or for a ring filled from another rank the slot of the step
    /// after the last one received. [`PpError::CaptureOutOfStep`] names each ring's slot.
    fn check_rings_in_step(&self) -> Result<()> {
        let n_slots = self.n_slots();
        let at: Vec<(usize, usize)> = self
            .rings()
            .map(|(b, boundary)| {
                let ring = boundary.ring.lock();
                let slot =
                    if boundary.inbound.is_some() { slot_of(ring.received_steps(), n_slots) } else { ring.next() };
                (b, slot)
            })
            .collect();
        if at.iter().any(|&(_, slot)| slot != at[0].1) {
            return Err(Error::Pipeline(PpError::CaptureOutOfStep { rings: at }));
        }
        Ok(())
    }

    /// Takes every slot buffer out of this rank's rings (grown to `bytes` first), leaving the
    /// slots [`SlotState::Capturing`]; they come back, with their states, when the returned
    /// value drops. A ring's slots must be free, except that a ring filled from another rank may
    /// hold steps not read yet (the other rank may be steps ahead): those keep their data. A
    /// slot being received into is waited for (at most the peer timeout).
    fn take_slots(&self, bytes: usize) -> Result<TakenSlots<'_>> {
        let mut taken = TakenSlots { rt: self, taken: (0..self.boundaries.len()).map(|_| None).collect() };
        for (b, boundary) in self.rings() {
            let mut ring = boundary.ring.lock();
            if boundary.inbound.is_some() {
                let timeout = self.config.peer_timeout();
                let failed = || boundary.link_failure();
                ring = boundary.ring.wait_while(b, "capture_step", ring, timeout, &failed, Slots::receiving)?;
            }
            // Every slot is checked before any is taken: a refusal leaves the ring as it was.
            for k in 0..ring.n_slots() {
                ring.check_capturable(b, k, bytes)?;
            }
            let home = boundary.home();
            let mut row = Vec::with_capacity(ring.n_slots());
            for k in 0..ring.n_slots() {
                match ring.take_for_capture(b, k, bytes, home) {
                    Ok(taken) => row.push(taken),
                    Err(e) => {
                        for (k, (buffer, state)) in row.into_iter().enumerate() {
                            ring.restore_after_capture(k, buffer, state);
                        }
                        return Err(e);
                    }
                }
            }
            taken.taken[b] = Some(row);
        }
        Ok(taken)
    }
}

impl<T: DeviceRepr> StepGraphs<'_, T> {
    /// Replays one step: launches every stage's graph for the rings' next slot, in stage order,
    /// each on its stage's stream after the protocol's waits; no host synchronisation. Returns the
    /// slot used. The rings advance as one eager step's `tx`/`rx` would advance them.
    ///
    /// In a pipeline that spans processes: this rank's stages in stage order, each as
    /// [`launch_stage`](Self::launch_stage) with the peer timeout (a stage fed by another rank
    /// waits for its step to arrive); returns the slot of this rank's first stage.
    ///
    /// # Errors
    /// Caught before anything is enqueued: [`PpError::GraphStale`], [`PpError::GraphStageOutOfStep`]
    /// (a stage ran ahead with [`launch_stage`](Self::launch_stage), or a failed launch left it
    /// behind), [`PpError::GraphOutOfStep`] (an eager step crossed some boundaries but not all:
    /// finish it, with its `tx` and `rx` on the others), [`PpError::SlotState`] (a slot of a ring
    /// the step uses still holds an unreceived eager `tx`, which the graph step would overtake:
    /// receive it, or discard it, first). Else the driver's
    /// error; stages launched before it keep their effect on the rings. Across processes, as
    /// [`launch_stage`](Self::launch_stage).
    ///
    /// A driver error names the call that failed. The stage whose launch failed did not move: its
    /// graph did not run, or (a failure after the launch, in the protocol's record) it ran to
    /// completion before the error returned. To finish the step, call `launch` again (write the
    /// step's input again first when the first stage's graph changes it in place): when no stage
    /// had moved, that is the whole step again; else it refuses with
    /// [`PpError::GraphStageOutOfStep`] naming the first stage behind, and
    /// [`launch_stage`](Self::launch_stage) of that stage, then of each later one, finishes it.
    pub fn launch(&mut self) -> Result<usize> {
        let rt = self.rt;
        if rt.spans_processes() {
            // This rank's stages in turn, each waiting for its input from another rank.
            let timeout = rt.config.peer_timeout();
            let mut first = None;
            for (s, _) in rt.local_stages() {
                let k = self.launch_stage(s, timeout)?;
                first.get_or_insert(k);
            }
            return Ok(first.unwrap_or(0));
        }
        let mut rings: Vec<MutexGuard<'_, Slots>> = rt.rings().map(|(_, boundary)| boundary.ring.lock()).collect();
        let k = rings.first().map_or(0, |ring| ring.next());
        if self.stale {
            return Err(Error::Pipeline(PpError::GraphStale { boundary: 0, slot: k }));
        }
        let mut next = self.next.lock();
        // Between steps every stage is at the same slot (eager steps may have moved the rings:
        // the stages follow them); a stage that ran ahead with `launch_stage`, or one left behind
        // by a failed launch, is refused first (its rings are out of step too), naming the stage.
        if let Some((stage, found)) = next.iter().enumerate().find(|(_, at)| **at != next[0]) {
            return Err(Error::Pipeline(PpError::GraphStageOutOfStep { stage, expected: next[0], found: *found }));
        }
        // Every stage is checked before any graph is launched; each input slot is filled by the
        // launch of the stage before it.
        for (s, _) in rt.local_stages() {
            let input = s.checked_sub(1).map(|b| &*rings[b]);
            self.check_stage(s, k, input, rings.get(s).map(|ring| &**ring), "StepGraphs::launch")?;
        }
        let n_slots = rings.first().map_or(1, |ring| ring.n_slots());
        next.iter_mut().for_each(|at| *at = k);
        for (s, stage) in rt.local_stages() {
            let (before, after) = rings.split_at_mut(s);
            let (input, output) =
                (before.last_mut().map(|ring| &mut **ring), after.first_mut().map(|ring| &mut **ring));
            self.launch_on(stage, s, k, input, output)?;
            next[s] = (k + 1) % n_slots;
        }
        drop(rings);
        for (_, boundary) in rt.rings() {
            boundary.ring.wake_sleepers();
        }
        Ok(k)
    }

    /// Stage `s`'s graph for slot `k` (a stage of this rank).
    fn exec(&self, k: usize, s: usize) -> &Mutex<GraphExec> {
        self.execs[k][s].as_ref().expect("graphs are captured for every stage of this rank")
    }

    /// Replays stage `s`'s part of its next step, for an engine that drives each stage from its
    /// own thread: waits (parked, for at most `timeout`) until the slot the stage reads has been
    /// filled by stage `s - 1` and the slot it writes has been received by stage `s + 1`, then
    /// launches the stage's graph on its stream, ordered by the same protocol as
    /// [`launch`](Self::launch), and advances its slot. Returns the slot used. Every stage's
    /// thread calls it once per step; threads never wait for each other's GPU work on the host.
    ///
    /// A stage fed by another rank waits for its step to arrive (the boundary's receiver thread
    /// fills the slot) and reads it in place. A stage sending to another rank has its graph copy
    /// the step into a buffer of the graphs, and after the launch sends that buffer as an eager
    /// [`tx`](PpNRt::tx) sends (the step's record, then NCCL's send on the stage's stream).
    ///
    /// # Errors
    /// Caught before anything is enqueued: [`PpError::StageOutOfRange`], [`PpError::GraphStale`],
    /// [`PpError::Timeout`] (nothing to receive yet, or the slot to send into still taken),
    /// [`PpError::GraphOutOfStep`] (an eager step moved the ring, or another thread launched this
    /// stage's slot first), [`PpError::SlotState`] (an eager call took the slot meanwhile, or
    /// another slot of the input ring still holds an earlier step, an eager `tx` not received
    /// yet, which the graph would overtake),
    /// [`PpError::RxLengthMismatch`] and [`PpError::RxTypeMismatch`] (an eager `tx` of another
    /// length or type filled the slot), [`PpError::GraphStepOrder`] (an eager `rx` from another
    /// rank took a step out of turn). Else the driver's error; a send to another rank that fails
    /// after the launch fails its boundary ([`PpError::PeerFailed`]).
    pub fn launch_stage(&self, s: usize, timeout: Duration) -> Result<usize> {
        let rt = self.rt;
        let stage = rt.stage(s)?;
        let n_slots = self.execs.len();
        // Between steps (every stage of this rank at the same slot) the stages follow the rings,
        // which eager steps may have moved; within a step each stage keeps its own count. The
        // first ring of this rank whose two stages both run here stays locked while the counts
        // are compared: its TX stage moves that ring's `next` and its own count under that lock,
        // so the two agree unless an eager step moved the ring. (Read before the counts' lock,
        // the ring could be a step old by then and send a stage that is behind to a slot it has
        // not reached.) A ring filled from another rank is not followed: its receiver thread
        // runs ahead of the stage that reads it, which reads the step after the last one it
        // received instead (below).
        let k = {
            let followed = rt.rings().find(|(_, boundary)| boundary.inbound.is_none()).map(|(_, b)| b.ring.lock());
            let mut next = self.next.lock();
            let between_steps = rt.local_stages().all(|(t, _)| next[t] == next[s]);
            if between_steps && (followed.is_some() || !rt.spans_processes()) {
                let rings_at = followed.as_deref().map_or(0, Slots::next);
                rt.local_stages().for_each(|(t, _)| next[t] = rings_at);
            }
            next[s]
        };
        // A stage fed by another rank reads the step after the last one received from its ring,
        // by a graph or an eager `rx` alike: that step's slot. A first stage sending to another
        // rank is at the step after the last one sent. Only the stage itself moves either count,
        // so another stage's thread running ahead or behind does not change it.
        let remote_step = s
            .checked_sub(1)
            .and_then(|b| rt.ring(b))
            .filter(|boundary| boundary.inbound.is_some())
            .map(|boundary| boundary.ring.lock().received_steps());
        let k = match (remote_step, rt.sender(s)) {
            (Some(step), _) => slot_of(step, n_slots),
            (None, Some(sender)) if s == 0 => slot_of(sender.steps_sent(), n_slots),
            _ => k,
        };
        let start = Instant::now();
        let left = || timeout.saturating_sub(start.elapsed());
        // Parks until the input slot is filled by stage s - 1 (or by the receiver thread of a
        // boundary from another rank), then until the output slot is free; each wait holds one
        // ring's lock at a time. A boundary to another rank has no ring here: its sends are
        // ordered after the graph's copy into the buffer they send, on the stage's stream.
        if s > 0 {
            let boundary = rt.ring(s - 1).expect("the ring a stage of this rank reads is in this rank");
            let failed = || boundary.link_failure();
            let ring = boundary.ring.wait_until(s - 1, "rx", boundary.ring.lock(), left(), &failed, |_| k)?;
            // An input of another length or type is refused now, not after waiting for the output.
            ring.check_filled::<T>(s - 1, k, "StepGraphs::launch_stage", self.n)?;
        }
        if let Some(boundary) = rt.ring(s) {
            drop(boundary.ring.wait_until(s, "tx", boundary.ring.lock(), left(), &|| None, |_| k)?);
        }
        // Both rings, in boundary order (as every caller locks them), checked and updated around
        // the launch under their locks: a call from another thread between the waits and here
        // (an eager `rx` or `tx` on these slots) is caught, not raced.
        let input_ring = s.checked_sub(1).and_then(|b| rt.ring(b));
        let mut input = input_ring.map(|boundary| boundary.ring.lock());
        let mut output = rt.ring(s).map(|boundary| boundary.ring.lock());
        if self.stale {
            return Err(Error::Pipeline(PpError::GraphStale { boundary: s.saturating_sub(1), slot: k }));
        }
        if let Some(ring) = input.as_deref() {
            ring.check_filled::<T>(s - 1, k, "StepGraphs::launch_stage", self.n)?;
            self.check_captured(ring, s - 1, k)?;
            // From another rank: the slot holds the step the stage is at (each slot holds the
            // step it was filled with), and no eager `rx` took a step since it was read above.
            if let Some(expected) = remote_step {
                if ring.received_steps() != expected {
                    let found = slot_of(ring.received_steps(), n_slots);
                    return Err(Error::Pipeline(PpError::GraphOutOfStep { boundary: s - 1, expected: k, found }));
                }
                if ring.step(k) != expected {
                    return Err(Error::Pipeline(PpError::GraphStepOrder {
                        boundary: s - 1,
                        expected,
                        found: ring.step(k),
                    }));
                }
            }
        }
        self.check_stage(s, k, input.as_deref(), output.as_deref(), "StepGraphs::launch_stage")?;
        self.launch_on(stage, s, k, input.as_deref_mut(), output.as_deref_mut())?;
        self.next.lock()[s] = (k + 1) % n_slots;
        drop((input, output));
        for b in [s.wrapping_sub(1), s] {
            if let Some(boundary) = rt.ring(b) {
                boundary.ring.wake_sleepers();
            }
        }
        // A boundary to another rank: the step's record and NCCL's send of the buffer the graph
        // just filled, on the stage's stream (so after the graph), as an eager `tx` sends.
        if let (Some(sender), Some(Some(staging))) = (rt.sender(s), self.staging[k].get(s)) {
            let sent = staging.as_view().first_as::<T>("StepGraphs::launch_stage", self.n)?;
            sender.tx(&sent, self.n, None)?;
        }
        Ok(k)
    }

    /// The checks of stage `s`'s launch on slot `k` that both launches make, under the locks of
    /// its rings (`call` names the launch), before it is launched (the whole-step launch checks
    /// every stage before it launches any): its output slot may take the step
    /// ([`check_output`](Self::check_output)), and its read of the input ring overtakes no step
    /// (an eager `tx` not received yet, in another slot, comes first). Slot `k` of the input
    /// ring is filled, or, in a whole-step launch, the next write (the stage before fills it).
    fn check_stage(
        &self,
        s: usize,
        k: usize,
        input: Option<&Slots>,
        output: Option<&Slots>,
        call: &'static str,
    ) -> Result<()> {
        if let Some(ring) = output {
            self.check_output(ring, s, k, call)?;
        }
        if let Some(ring) = input {
            ring.check_read_in_turn(s - 1, k, call)?;
        }
        Ok(())
    }

    /// Checks, under its ring's lock, that boundary `b`'s slot `k` may take its TX stage's output
    /// from this step's graphs (`call` names the launch): the ring is at that slot, and the slot
    /// is free and still the allocation the graphs were captured with.
    fn check_output(&self, ring: &Slots, b: usize, k: usize, call: &'static str) -> Result<()> {
        if ring.next() != k {
            return Err(Error::Pipeline(PpError::GraphOutOfStep { boundary: b, expected: k, found: ring.next() }));
        }
        ring.check_free(b, k, call)?;
        self.check_captured(ring, b, k)
    }

    /// The one per-stage step of both launches: launches stage `s`'s graph for slot `k` on the
    /// stage's stream (its rings `input` and `output` checked and locked by the caller), then
    /// moves them as the stage's `rx` and `tx` would. A failed launch moves nothing.
    fn launch_on(
        &self,
        stage: &Stage,
        s: usize,
        k: usize,
        input: Option<&mut Slots>,
        output: Option<&mut Slots>,
    ) -> Result<()> {
        self.rt.config.faults().before_launch(input.as_deref(), output.as_deref(), k);
        self.exec(k, s).lock().launch(&stage.stream)?;
        self.advance(input, output, k);
        Ok(())
    }

    /// Checks that boundary `b`'s slot `k` still has the allocation the graphs were captured with.
    fn check_captured(&self, ring: &Slots, b: usize, k: usize) -> Result<()> {
        match (ring.buffer(k), &self.slots[k][b]) {
            (SlotBuffer::Device(buffer), Some(captured)) if Arc::ptr_eq(buffer.memory(), captured) => Ok(()),
            _ => Err(Error::Pipeline(PpError::GraphStale { boundary: b, slot: k })),
        }
    }

    /// Moves the rings as a stage's launch on slot `k` does, as its `rx` and `tx` would: the
    /// input slot received, the output slot filled and its ring at the next slot.
    fn advance(&self, input: Option<&mut Slots>, output: Option<&mut Slots>, k: usize) {
        if let Some(ring) = input {
            ring.received(k);
        }
        if let Some(ring) = output {
            ring.filled(k, self.n, T::NAME, self.n * std::mem::size_of::<T>());
        }
    }

    /// Captures the step again (a new `n`, other buffers or kernels) and gives the graphs its
    /// work: each executable graph is updated in place where the driver can
    /// ([`GraphExec::update`]), else replaced by a new instance.
    ///
    /// # Errors
    /// As [`PpNRt::capture_step`]. When the capture itself fails, the old graphs stay as they
    /// were; when updating fails half-way, the graphs are stale ([`PpError::GraphStale`] on
    /// launch) until a re-capture succeeds.
    pub fn recapture(&mut self, n: usize, body: impl FnMut(&mut StageCapture<'_, T>) -> Result<()>) -> Result<()> {
        let (graphs, slots, staging) = self.rt.capture_graphs(n, body)?;
        self.stale = true;
        for (per_slot, execs) in graphs.iter().zip(self.execs.iter_mut()) {
            for (s, stage) in self.rt.local_stages() {
                let (Some(graph), Some(exec)) = (&per_slot[s], execs[s].as_mut()) else {
                    unreachable!("graphs are captured for every stage of this rank")
                };
                let exec = exec.get_mut();
                match exec.update(graph) {
                    Ok(()) => {}
                    Err(CudaError::Capture(CaptureError::UpdateRefused { .. })) => {
                        let mut fresh = graph.instantiate()?;
                        fresh.upload(&stage.stream)?;
                        *exec = fresh;
                    }
                    Err(e) => return Err(e.into()),
                }
            }
        }
        self.n = n;
        self.slots = slots;
        self.staging = staging;
        self.stale = false;
        Ok(())
    }

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

impl Boundary {
    /// Enqueues the copy of `tx` into a slot of this (device-transport) boundary on `stream`, the
    /// TX stage's stream: within the device for a local boundary, across devices for a peer one.
    pub(super) fn copy_into_slot(
        &self,
        stream: &Arc<CudaStream>,
        src: CudaView<'_, u8>,
        dst: CudaViewMut<'_, u8>,
    ) -> crate::error::Result<()> {
        if self.plan.transport == Transport::Local {
            self.copy_within_device(stream, src, dst)
        } else {
            stream.memcpy_dtod(&src, &mut { dst })
        }
    }
}
