//! Replaying graph mode's steps: a whole step's or one stage's launch
//! ([`StepGraphs::launch`], [`StepGraphs::launch_stage`]), with the protocol's waits between
//! launches, the checks that the graphs still match the rings, and the rings advanced as
//! eager `tx`/`rx` would advance them.

use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::{Mutex, MutexGuard};

use super::{StepGraphs, slot_of};
use crate::pp::error::{Error, PpError, Result};
use crate::pp::ring::{SlotBuffer, Slots};
use crate::pp::runtime::Stage;
use crate::safe::{DeviceRepr, GraphExec};

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
    /// [`tx`](crate::PpNRt::tx) sends (the step's record, then NCCL's send on the stage's stream).
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
}
