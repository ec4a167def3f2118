//! Capturing graph mode's steps: a stage's boundary calls while its step is captured
//! ([`StageCapture`]), the capture of a whole step per ring slot ([`PpNRt::capture_step`]) with
//! the slot buffers taken out of the rings meanwhile, and a re-capture into existing graphs.

use std::marker::PhantomData;
use std::sync::Arc;

use parking_lot::Mutex;

use super::{StepGraphs, slot_of};
use crate::error::{CaptureError, CudaError};
use crate::pp::error::{Error, PpError, Result, SlotState};
use crate::pp::plan::Transport;
use crate::pp::ring::Slots;
use crate::pp::runtime::{Boundary, PpNRt};
use crate::safe::memory::{DeviceMemory, byte_size};
use crate::safe::{CaptureMode, CudaGraph, CudaSlice, CudaStream, CudaView, DeviceRepr, DeviceSlice, DeviceSliceMut};

/// One stage's step being captured ([`PpNRt::capture_step`]): the stage is entered (engine
/// operations land in the capture), and the boundary calls here record the protocol's copies.
///
/// ```no_run
/// # fn main() -> ppnrt::Result<()> {
/// # let primary = ppnrt::Engine::new(0)?;
/// # let rt = ppnrt::PpNRt::new(ppnrt::PpConfig::new(2), &primary)?;
/// let n = 1024;
/// let x = primary.alloc_zeroed::<f32>(n)?;
/// let mut step = rt.capture_step::<f32>(n, |stage| {
///     println!("capturing stage {} for slot {}", stage.stage(), stage.slot());
///     if stage.stage() == 0 {
///         stage.tx(&x)
///     } else {
///         let _input = stage.received()?; // the slot, read in place by the captured kernels
///         Ok(())
///     }
/// })?;
/// step.launch()?;
/// # Ok(()) }
/// ```
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
    /// Captures the step again (a new `n`, other buffers or kernels) and gives the graphs its
    /// work: each executable graph is updated in place where the driver can
    /// ([`GraphExec::update`](crate::GraphExec::update)), else replaced by a new instance.
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
}
