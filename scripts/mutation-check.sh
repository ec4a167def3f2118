#!/usr/bin/env bash
# Shows that the driver-double tests catch what they guard: each mutation undoes one soundness
# fix in a scratch worktree of HEAD, and `cargo test --test double` (or the test binary the
# mutation names: `processes` runs its ranks through the driver and NCCL doubles) must then
# report a failure.
# Prints, per mutation, the failing tests; "CAUGHT" or "MISSED" ("STALE" when the code it
# mutates has changed and the mutation no longer applies).
#
#   bash scripts/mutation-check.sh [NAME...]     (only the mutations named; default every one)
#
# Each mutation rebuilds and runs its whole test binary: `double` takes about two minutes since
# its fault sweeps across ranks, so all of them take over an hour; name the ones a change concerns.
set -u
only=" $* "
repo=$(cd "$(dirname "$0")/.." && pwd)
scratch=$(mktemp -d)
git -C "$repo" worktree add -q "$scratch/tree" HEAD
trap 'git -C "$repo" worktree remove --force "$scratch/tree"; rm -rf "$scratch"' EXIT
cd "$scratch/tree"
export CARGO_TARGET_DIR=$repo/target/mutation
run() {
  name=$1; test=${5:-double}; shift
  if [ "$only" != "  " ] && [[ "$only" != *" $name "* ]]; then return; fi
  git checkout -q -- .
  if ! python3 - "$1" "$2" "$3" <<'PY'
import sys
path, old, new = sys.argv[1], sys.argv[2], sys.argv[3]
s = open(path).read()
if old not in s:
    sys.exit(f"{path}: the mutation's anchor is gone: {old!r}")
open(path, 'w').write(s.replace(old, new, 1))
PY
  then
    echo "STALE $name (update its anchor)"; return
  fi
  out=$(cargo test --test "$test" 2>&1 | grep -E "^test .*FAILED$")
  if [ -n "$out" ]; then echo "CAUGHT $name:"; echo "$out" | sed 's/^/    /'; else echo "MISSED $name"; fi
}
run pinned-htod src/safe/memory.rs "        if read_later {" "        if false && read_later {"
run copy-with-sms src/safe/module.rs "            if used.pooled {" "            if false && used.pooled {"
run guards src/safe/ambient.rs "                stack.remove(at);" "                stack.truncate(at);"
run context src/safe/context.rs "        Ok(BoundContext { restore: Some(previous), scope: None, _ctx: PhantomData })" "        Ok(BoundContext { restore: None, scope: None, _ctx: PhantomData })"
run settle src/safe/stream.rs "        if result.is_err() {" "        if false && result.is_err() {"
run readback-free-on-readback-stream src/pp/runtime.rs "        source.set_stream(&self.readback)?;" ""
run older-entry-names src/loader.rs "    if api.cuEventElapsedTime_v2.is_ok() {" "    if true {"
run pool-fallback src/safe/memory.rs "        if !stream.context().memory_pools_supported() {" "        if false {"
# Not listed: growing a slot waits for its last copies twice over (an explicit wait that reports
# errors, and the old buffer's drop), so undoing either alone changes nothing a test can see.
# Graphs: the launch orders the captured footprint; the footprint keeps its memory alive; frees
# during a capture are held back; illegal calls invalidate the capture.
run graph-launch-order src/safe/graph.rs "let mut held = Access::lock_all(self.footprint.iter().map(" "let mut held = Access::lock_all(self.footprint.iter().take(0).map("
run graph-keep-alive src/safe/graph.rs "None => recorded.footprint.push((Arc::clone(memory), use_))," "None => {}"
run graph-deferred-free src/safe/memory.rs "        if let Some(capture) = super::graph::capture_for_free(Some(&self.stream)) {" "        if let Some(capture) = None::<std::sync::Arc<super::graph::CaptureState>> {"
run graph-deferred-pinned-free src/safe/host.rs "        if let Some(capture) = super::graph::capture_for_free(None) {" "        if let Some(capture) = None::<std::sync::Arc<super::graph::CaptureState>> {"
run graph-invalidate src/safe/graph.rs "        capture.invalidate(call);" ""
run graph-stale-slot src/pp/runtime/step_graph.rs "(SlotBuffer::Device(buffer), Some(captured)) if Arc::ptr_eq(buffer.memory(), captured) => Ok(())," "(SlotBuffer::Device(_), _) => Ok(()),"
run lazy-record-gate src/safe/stream.rs "        let _gate = self.enqueue_gate();
        loop {" "        loop {"
# Boundaries between processes (their ranks through the driver and NCCL doubles): a silent peer
# fails the link.
run liveness src/pp/remote.rs "    let _ = config;
    true
}" "    let _ = config;
    false
}" processes
# ... and a peer that dies during another rank's setup ends that rank's wait for NCCL.
run setup-peer-closed src/pp/remote.rs "        Ok(read) => Ok(read == 0)," "        Ok(read) => Ok(read == 0 && false)," processes
# A receiver thread posts a step's receive without the ring's lock (the RX stage's other slots
# and its bounded waits go on while the posting is held up).
run post-unlocked src/pp/runtime.rs "        drop(ring);
        phase(Phase::Posting);
        let posted = self.post_receive(&mut buffer, index, step.bytes, recv);
        let mut ring = PpNRt::lock(self);" "        phase(Phase::Posting);
        let posted = self.post_receive(&mut buffer, index, step.bytes, recv);" processes
# No receive is captured while another NCCL call of the process posts (the NCCL double refuses
# such a pair).
run posting-apart src/nccl.rs "    let _shared = POSTING.read().unwrap_or_else(|poisoned| poisoned.into_inner());
    post()" "    post()" processes
# A slot of a boundary from another rank is the receive stream's memory (its growth leaves a
# capture of the RX stage's stream alone).
run slot-owner src/pp/runtime.rs "    let owner = if transport == Transport::Nccl { tx_stream } else { rx_stream };" "    let owner = rx_stream;" processes
# A call a non-blocking communicator completes in the background is waited for (and bounded).
run nccl-settle src/nccl.rs "        let Some(bound) = self.background_bound.filter(|_| result == ncclResult_t::ncclInProgress) else {" "        let Some(bound) = None::<Duration> else {" nccl
# NCCL's abort is waited for at most its bound (the caller is not kept by an abort that hangs).
run abort-unbounded src/nccl.rs "    match result.recv_timeout(bound) {" "    match result.recv() {" nccl
# Graph mode across processes: a launch reads only the step its stage is at from another rank.
run graph-step-order src/pp/runtime/step_graph.rs "if ring.slots[k].step != expected {" "if false {" processes
# Eager and graph steps interleave across processes: an eager receive is counted, so the next
# launch reads the step after it; a first stage sending to another rank uses its step's slot.
run eager-rx-untracked src/pp/runtime.rs "        ring.took(slot_index, boundary.inbound.is_some());
" "" processes
run graph-send-slot src/pp/runtime/step_graph.rs "            (None, Some(sender)) if s == 0 => slot_of(sender.steps_sent(), n_slots),
" "" processes
# A receive is captured only while none of the process's NCCL work is still running: the check,
# and the note a launch of a captured receive leaves (the NCCL double refuses such a capture).
run capture-in-flight src/nccl.rs "        if !all_settled()? {" "        if false && !all_settled()? {" processes
run graph-launch-unnoted src/nccl.rs "            self.in_flight.note(stream);
            Ok(())" "            Ok(())" processes
# A communicator lets go of the streams only it holds (a caller posting on a new stream each
# time keeps none alive).
run in-flight-streams-kept src/nccl.rs "const IN_FLIGHT_STREAMS: usize = 8;" "const IN_FLIGHT_STREAMS: usize = 1000;" nccl
# A step's slot state changes only once its copy is enqueued: a failed tx leaves the slot free,
# a failed rx leaves it filled (to be received again). The fault sweep fails every call in turn.
run tx-state-early src/pp/runtime.rs "        match &mut slot.buffer {
            SlotBuffer::Device(buffer) => {" "        slot.state = SlotState::Filled { n, elem: T::NAME };
        match &mut slot.buffer {
            SlotBuffer::Device(buffer) => {"
run rx-state-early src/pp/runtime.rs "        let dst = out.as_view_mut().into_bytes();
        match &slot.buffer {" "        let dst = out.as_view_mut().into_bytes();
        slot.state = SlotState::Received;
        match &slot.buffer {"
# A stage's count moves only once its graph was launched: a failed launch leaves the stage where
# it was, for `launch_stage` to finish the step (the graph fault sweep).
run graph-launch-advance-early src/pp/runtime/step_graph.rs "            self.exec(k, s).lock().unwrap_or_else(|poisoned| poisoned.into_inner()).launch(&stage.stream)?;
            next[s] = (k + 1) % n_slots;" "            next[s] = (k + 1) % n_slots;
            self.exec(k, s).lock().unwrap_or_else(|poisoned| poisoned.into_inner()).launch(&stage.stream)?;"
# A capture is ended however the calls around its end fail: without the context bound, and once
# more while the stream is still capturing (the capture fault sweep).
run capture-end-bound src/safe/graph.rs "    let bound = stream.context().bind();
    // SAFETY: the stream is live and capturing" "    let bound = stream.context().bind()?;
    // SAFETY: the stream is live and capturing"
run capture-end-once src/safe/graph.rs "            if still_capturing {" "            if false && still_capturing {"
# A buffer whose free could not be ordered after its uses (a failed wait) is left allocated, not
# freed under them (the drop fault sweep).
run pooled-free-unordered src/safe/memory.rs "            self.access.order_exclusive(&self.stream, Use::Write).and_then(|()| {" "            { let _ = self.access.order_exclusive(&self.stream, Use::Write); Ok(()) }.and_then(|()| {"
run plain-free-unwaited src/safe/memory.rs '            self.access.wait_on_host("CudaSlice::drop", Use::Write).and_then(|()| {' '            { let _ = self.access.wait_on_host("CudaSlice::drop", Use::Write); Ok(()) }.and_then(|()| {'
# `launch` names the first stage behind (a launch that failed part-way) before any ring out of
# step, so that `launch_stage` can finish the step (the graph sweep, four stages).
run graph-stage-check-late src/pp/runtime/step_graph.rs "        if let Some((stage, found)) = next.iter().enumerate().find(|(_, at)| **at != next[0]) {
            return Err(Error::Pipeline(PpError::GraphStageOutOfStep { stage, expected: next[0], found: *found }));
        }
        for (b, ring) in rings.iter().enumerate() {" "        for (b, ring) in rings.iter().enumerate() {
            if ring.next != k {
                return Err(Error::Pipeline(PpError::GraphOutOfStep { boundary: b, expected: k, found: ring.next }));
            }
        }
        if let Some((stage, found)) = next.iter().enumerate().find(|(_, at)| **at != next[0]) {
            return Err(Error::Pipeline(PpError::GraphStageOutOfStep { stage, expected: next[0], found: *found }));
        }
        for (b, ring) in rings.iter().enumerate() {"
# Across ranks (the fault sweep across ranks, through the driver and NCCL doubles): a drop that
# does not record a boundary failure no call returned; a failed send that leaves its link up (the
# receiver waits for a step that never comes); a receiver thread whose failed receive leaves the
# link up.
run drop-unreported-link src/pp/runtime.rs "        for failure in self.readbacks.links.iter().filter_map(|link| link.unreported()) {" "        for failure in self.readbacks.links.iter().filter_map(|link| link.unreported()).filter(|_| false) {"
run send-failure-keeps-link src/pp/remote.rs '            self.link.fail(format!("the NCCL send of step {step} failed: {e}"));
            return Err(self.link.stopped().unwrap_or(e));' '            return Err(e);'
run receive-failure-keeps-link src/pp/remote.rs '                    Err(e) => break Err(format!("receiving step {}: {e}", step.step)),' '                    Err(_) => break Ok(()),'
# A readback given although a boundary of its rank failed (its receive may have been cut short).
run readback-after-failure src/pp/readback.rs "        match self.shared.links.iter().find(|link| link.aborted()) {" "        match self.shared.links.iter().find(|link| link.aborted() && false) {"
