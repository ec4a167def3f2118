#!/usr/bin/env bash
# Shows that the driver-double tests catch what they guard: each mutation undoes one soundness
# fix in a scratch worktree of HEAD, and `cargo test --test double` (or the test binary the
# mutation names: `processes` runs its ranks through the driver and NCCL doubles) must then
# report a failure.
# Prints, per mutation, the failing tests; "CAUGHT" or "MISSED" ("STALE" when the code it
# mutates has changed and the mutation no longer applies; "BROKEN" when the mutated code does
# not build, which shows nothing about the tests: rewrite the mutation so that it builds;
# "UNMATCHED" when none of the tests listed for it exists any more).
#
#   bash scripts/mutation-check.sh [NAME...]     (only the mutations named; default every one)
#
# Each mutation rebuilds its test binary and runs the tests listed for it below (those that
# caught it in the last whole run, at most four): all forty took 484 s on two cores on
# 2026-12-02. MUTATION_FILTERS=0 runs each mutation's whole test binary instead (`double` alone
# takes about two minutes: 2,738 s for the forty). A mutation with no tests listed runs its whole
# binary.
set -u
only=" $* "
repo=$(cd "$(dirname "$0")/.." && pwd)
scratch=$(mktemp -d)
git -C "$repo" worktree add -q "$scratch/tree" HEAD
trap 'git -C "$repo" worktree remove --force "$scratch/tree"; rm -rf "$scratch"' EXIT
cd "$scratch/tree"
export CARGO_TARGET_DIR=$repo/target/mutation
# The tests that caught each mutation when every mutation ran its whole test binary
# (2026-12-02): name filters, as `cargo test` takes them.
declare -A catchers=(
  [pinned-htod]="pinned_sources_are_read_before_htod_returns"
  [copy-with-sms]="copy_with_sms_refuses_memory_its_sms_cannot_reach failed_joins_back_into_the_owner_leave_no_work_in_flight"
  [guards]="stream_overrides_drop_in_any_order"
  [context]="a_boundary_step_makes_the_protocols_driver_calls_and_no_more a_failed_record_in_a_warm_ring_leaves_it_ordered a_failed_rx_can_be_retried a_failed_tx_leaves_no_copy_in_flight"
  [settle]="a_failed_record_in_a_warm_ring_leaves_it_ordered a_failed_tx_leaves_no_copy_in_flight"
  [readback-free-on-readback-stream]="a_readback_waits_for_its_step_once_copy_and_free_together readbacks_arrive_and_never_hold_up_the_stage_stream"
  [older-entry-names]="a_cuda_12_4_driver_gets_every_feature_it_has"
  [pool-fallback]="devices_without_memory_pools_fall_back_to_plain_allocations"
  [graph-launch-order]="a_graph_step_makes_one_launch_per_stage_and_the_protocols_calls_only a_readback_fed_by_a_failed_boundary_is_refused capture_misuse_is_a_typed_error_through_the_double every_failing_call_across_ranks_is_an_error_in_bounded_time_that_loses_nothing"
  [graph-keep-alive]="a_graph_step_makes_one_launch_per_stage_and_the_protocols_calls_only a_readback_fed_by_a_failed_boundary_is_refused capture_misuse_is_a_typed_error_through_the_double every_failing_call_across_ranks_is_an_error_in_bounded_time_that_loses_nothing"
  [graph-deferred-free]="graphs_keep_their_memory_alive_and_ordered_through_the_double slot_events_are_reused_within_their_context_only"
  [graph-deferred-pinned-free]="graphs_keep_their_memory_alive_and_ordered_through_the_double slot_events_are_reused_within_their_context_only"
  [graph-invalidate]="capture_misuse_is_a_typed_error_through_the_double graph_misuse_leaves_everything_sound_through_the_double graphs_keep_their_memory_alive_and_ordered_through_the_double"
  [graph-stale-slot]="mismatched_graph_steps_are_refused_through_the_double"
  [lazy-record-gate]="work_racing_a_capture_lands_inside_it_or_outside_it"
  [liveness]="a_stopped_rank_is_a_typed_error_in_the_survivor"
  [setup-peer-closed]="a_rank_that_dies_during_setup_is_a_typed_error_in_the_other"
  [post-unlocked]="a_receive_held_up_while_posted_holds_up_no_other_slot"
  [posting-apart]="no_receive_is_captured_while_another_nccl_call_posts two_processes_match_one_engine_bitwise two_processes_over_sockets_match_one_engine_bitwise graph_mode_across_processes_matches_one_engine_bitwise"
  [slot-owner]="a_slot_growing_leaves_a_capture_of_the_rx_stage_alone"
  [nccl-settle]="a_background_call_that_never_completes_times_out_and_aborts an_abort_that_never_returns_keeps_no_caller two_ranks_exchange_buffers_bitwise"
  [abort-unbounded]="an_abort_that_never_returns_keeps_no_caller"
  [graph-step-order]="graph_mode_across_processes_matches_one_engine_bitwise"
  [eager-rx-untracked]="graph_mode_across_processes_matches_one_engine_bitwise"
  [graph-send-slot]="graph_mode_across_processes_matches_one_engine_bitwise"
  [capture-in-flight]="a_broken_protocol_across_processes_is_caught graph_mode_across_processes_matches_one_engine_bitwise no_receive_is_captured_while_another_nccl_call_posts the_contract_holds_across_processes"
  [graph-launch-unnoted]="a_broken_protocol_across_processes_is_caught graph_mode_across_processes_matches_one_engine_bitwise no_receive_is_captured_while_another_nccl_call_posts the_contract_holds_across_processes"
  [in-flight-streams-kept]="two_ranks_exchange_buffers_bitwise"
  [tx-state-early]="a_failed_record_in_a_warm_ring_leaves_it_ordered a_failed_tx_leaves_no_copy_in_flight every_failing_driver_call_of_a_step_is_an_error_that_loses_nothing"
  [rx-state-early]="a_failed_record_in_a_warm_ring_leaves_it_ordered a_failed_rx_can_be_retried every_failing_call_across_ranks_is_an_error_in_bounded_time_that_loses_nothing every_failing_driver_call_of_a_step_is_an_error_that_loses_nothing"
  [graph-launch-advance-early]="every_failing_driver_call_of_a_graph_step_is_an_error_that_loses_nothing"
  [capture-end-once]="every_failing_driver_call_of_a_capture_is_an_error_that_loses_nothing failed_joins_back_into_the_owner_leave_no_work_in_flight"
  [pooled-free-unordered]="every_failing_call_across_ranks_is_an_error_in_bounded_time_that_loses_nothing every_failing_driver_call_of_a_drop_with_work_queued_frees_nothing_in_use failed_joins_back_into_the_owner_leave_no_work_in_flight"
  [plain-free-unwaited]="every_failing_call_of_a_setup_across_ranks_is_a_typed_error_in_bounded_time every_failing_driver_call_of_a_drop_with_work_queued_frees_nothing_in_use"
  [graph-stage-check-late]="every_failing_driver_call_of_a_graph_step_is_an_error_that_loses_nothing"
  [drop-unreported-link]="every_failing_call_across_ranks_is_an_error_in_bounded_time_that_loses_nothing"
  [send-failure-keeps-link]="every_failing_call_across_ranks_is_an_error_in_bounded_time_that_loses_nothing"
  [receive-failure-keeps-link]="every_failing_call_across_ranks_is_an_error_in_bounded_time_that_loses_nothing"
  [readback-after-failure]="a_readback_fed_by_a_failed_boundary_is_refused every_failing_call_across_ranks_is_an_error_in_bounded_time_that_loses_nothing"
  [capture-end-bound]="every_failing_driver_call_of_a_capture_is_an_error_that_loses_nothing"
  [tx-in-capture]="an_eager_tx_on_a_capturing_stage_stream_is_refused_and_changes_nothing"
  [rx-in-capture]="an_eager_receive_on_a_capturing_stage_stream_is_refused_and_changes_nothing"
  [lent-blocks-ring]="a_forgotten_in_place_guard_does_not_stop_the_boundary a_guard_held_across_the_next_write_reads_its_own_step"
  [spares-dropped]="a_guard_held_across_the_next_write_reads_its_own_step"
  [readback-held-by-graph]="a_graph_steps_output_is_read_back_every_step"
  [forgotten-capture-holds-frees]="a_forgotten_thread_local_capture_holds_back_no_other_streams_frees"
  [read-marks-hold-streams]="a_buffer_read_on_stream_after_stream_keeps_none_of_them"
  [detached-reads-dropped]="a_buffer_read_on_stream_after_stream_keeps_none_of_them"
  [rx-size-unchecked]="a_step_of_another_element_size_is_refused_and_kept"
  [hellos-one-at-a-time]="silent_trickling_and_foreign_connections_cost_the_ranks_nothing"
  [close-drain-unbounded]="a_step_announced_and_never_sent_fails_the_boundary_in_bounded_time"
  [unable-rank-silent]="a_rank_without_nccl_fails_the_others_setup_at_once"
)
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
  filters=()
  [ "${MUTATION_FILTERS:-1}" = 1 ] && read -r -a filters <<< "${catchers[$name]:-}"
  log=$(cargo test --test "$test" -- "${filters[@]}" 2>&1)
  out=$(echo "$log" | grep -E "^test .*FAILED$")
  if [ -n "$out" ]; then
    echo "CAUGHT $name:"; echo "$out" | sed 's/^/    /'
  elif echo "$log" | grep -q -E "^error(\[E[0-9]+\])?: "; then
    echo "BROKEN $name (the mutated code does not build):"; echo "$log" | grep -E -m 2 -A 4 "^error" | sed 's/^/    /'
  elif [ ${#filters[@]} -gt 0 ] && ! echo "$log" | grep -q -E "^running [1-9][0-9]* tests?$"; then
    echo "UNMATCHED $name (no test matches its catchers: a test was renamed? update the table)"
  else
    echo "MISSED $name"
  fi
}
run pinned-htod src/safe/memory.rs "        if read_later {" "        if false && read_later {"
run copy-with-sms src/safe/module.rs "            if used.pooled {" "            if false && used.pooled {"
run guards src/safe/ambient.rs "                stack.remove(at);" "                stack.truncate(at);"
run context src/safe/context.rs "        Ok(BoundContext { restore: Some(previous), scope: None, _ctx: PhantomData })" "        Ok(BoundContext { restore: None, scope: None, _ctx: PhantomData })"
run settle src/safe/stream.rs "        if result.is_err() {" "        if false && result.is_err() {"
run readback-free-on-readback-stream src/pp/runtime/readback.rs "        match source.set_stream(&self.readback) {" "        match Ok::<(), Error>(()) {"
run older-entry-names src/loader.rs "    if api.cuEventElapsedTime_v2.is_ok() {" "    if true {"
run pool-fallback src/safe/memory.rs "        if !stream.context().memory_pools_supported() {" "        if false {"
# Not listed: growing a slot waits for its last copies twice over (an explicit wait that reports
# errors, and the old buffer's drop), so undoing either alone changes nothing a test can see.
# Graphs: the launch orders the captured footprint; the footprint keeps its memory alive; frees
# during a capture are held back; illegal calls invalidate the capture.
run graph-launch-order src/safe/graph.rs "let mut held = Access::lock_all(self.footprint.iter().map(" "let mut held = Access::lock_all(self.footprint.iter().take(0).map("
run graph-keep-alive src/safe/graph.rs "None => recorded.footprint.push((Arc::clone(memory), use_))," "None => {}"
run graph-deferred-free src/safe/memory.rs "        if let Some(blocked) = super::graph::free_blocked(Some(&self.stream)) {" "        if let Some(blocked) = None::<super::graph::FreeBlocked> {"
run graph-deferred-pinned-free src/safe/host.rs "        if let Some(blocked) = super::graph::free_blocked(None) {" "        if let Some(blocked) = None::<super::graph::FreeBlocked> {"
run graph-invalidate src/safe/graph.rs "        capture.invalidate(call);" ""
run graph-stale-slot src/pp/runtime/step_graph.rs "(SlotBuffer::Device(buffer), Some(captured)) if Arc::ptr_eq(buffer.memory(), captured) => Ok(())," "(SlotBuffer::Device(_), _) => Ok(()),"
run lazy-record-gate src/safe/stream.rs "        let _gate = self.enqueue_gate();
        loop {" "        loop {"
# Boundaries between processes (their ranks through the driver and NCCL doubles): a silent peer
# fails the link.
run liveness src/pp/remote/sender.rs "    let _ = config;
    true
}" "    let _ = config;
    false
}" processes
# ... and a peer that dies during another rank's setup ends that rank's wait for NCCL.
run setup-peer-closed src/pp/remote/setup.rs "        Ok(read) => Ok(read == 0)," "        Ok(read) => Ok(read == 0 && false)," processes
# A receiver thread posts a step's receive without the ring's lock (the RX stage's other slots
# and its bounded waits go on while the posting is held up).
run post-unlocked src/pp/runtime/inbound.rs "        drop(ring);
        phase(Phase::Posting);
        let posted = self.post_receive(&mut buffer, index, step.bytes, recv);
        let mut ring = self.ring.lock();" "        phase(Phase::Posting);
        let posted = self.post_receive(&mut buffer, index, step.bytes, recv);" processes
# No receive is captured while another NCCL call of the process posts (the NCCL double refuses
# such a pair).
run posting-apart src/nccl/posting.rs "    let _shared = POSTING.read().unwrap_or_else(|poisoned| poisoned.into_inner());
    post()" "    post()" processes
# A slot of a boundary from another rank is the receive stream's memory (its growth leaves a
# capture of the RX stage's stream alone).
run slot-owner src/pp/ring.rs "        let owner = if self.transport == Transport::Nccl { self.tx_stream } else { self.rx_stream };" "        let owner = self.rx_stream;" processes
# A call a non-blocking communicator completes in the background is waited for (and bounded).
run nccl-settle src/nccl/comm.rs "        let Some(bound) = self.background_bound.filter(|_| result == ncclResult_t::ncclInProgress) else {" "        let Some(bound) = None::<Duration> else {" nccl
# NCCL's abort is waited for at most its bound (the caller is not kept by an abort that hangs).
run abort-unbounded src/nccl/settle.rs "    match result.recv_timeout(bound) {" "    match result.recv() {" nccl
# Graph mode across processes: a launch reads only the step its stage is at from another rank.
run graph-step-order src/pp/runtime/step_graph.rs "if ring.step(k) != expected {" "if false {" processes
# Eager and graph steps interleave across processes: an eager receive is counted, so the next
# launch reads the step after it; a first stage sending to another rank uses its step's slot.
run eager-rx-untracked src/pp/ring.rs "        self.slots[k].state = SlotState::Received;
        self.took(k);" "        self.slots[k].state = SlotState::Received;" processes
run graph-send-slot src/pp/runtime/step_graph.rs "            (None, Some(sender)) if s == 0 => slot_of(sender.steps_sent(), n_slots),
" "" processes
# A receive is captured only while none of the process's NCCL work is still running: the check,
# and the note a launch of a captured receive leaves (the NCCL double refuses such a capture).
run capture-in-flight src/nccl/posting.rs "        if !all_settled()? {" "        if false && !all_settled()? {" processes
run graph-launch-unnoted src/nccl/comm.rs "            self.in_flight.note(stream);
            Ok(())" "            Ok(())" processes
# A communicator lets go of the streams only it holds (a caller posting on a new stream each
# time keeps none alive).
run in-flight-streams-kept src/nccl/posting.rs "const IN_FLIGHT_STREAMS: usize = 8;" "const IN_FLIGHT_STREAMS: usize = 1000;" nccl
# A step's slot state changes only once its copy is enqueued: a failed tx leaves the slot free,
# a failed rx leaves it filled (to be received again). The fault sweep fails every call in turn.
run tx-state-early src/pp/runtime.rs "                boundary.copy_into_slot(tx, src, dst)?;" "                let _ = boundary.copy_into_slot(tx, src, dst);"
run rx-state-early src/pp/runtime.rs "            SlotBuffer::Device(buffer) => boundary.copy_within_device(rx, buffer.as_view().slice(..bytes)?, dst)?," "            SlotBuffer::Device(buffer) => {
                let _ = boundary.copy_within_device(rx, buffer.as_view().slice(..bytes)?, dst);
            }"
# The ring (src/pp/ring.rs): an eager boundary call on a capturing stage stream is refused; a
# lent slot is given another buffer rather than stopping the ring; a guard's buffer is kept as a
# spare; a graph's output is read back while the graph holds it (tests/ring.rs).
run tx-in-capture src/pp/runtime.rs '        let _gate = tx.enqueue_gate_uncaptured("PpNRt::tx")?;' '        let _gate = tx.enqueue_gate();' ring
run rx-in-capture src/pp/runtime.rs "        let gate = boundary.rx_stream.enqueue_gate_uncaptured(call)?;" "        let gate = { let _ = call; boundary.rx_stream.enqueue_gate() };" ring
run lent-blocks-ring src/pp/ring.rs "    state.is_free() || state == SlotState::Lent
}" "    state.is_free()
}" ring
run spares-dropped src/pp/ring.rs "        if Arc::strong_count(&lent) == 1 && self.spares.len() < self.slots.len() {" "        if false {" ring
run readback-held-by-graph src/pp/runtime/readback.rs "            Ok(()) | Err(Error::HeldByGraph { .. }) => {}" "            Ok(()) => {}" ring
# A stage's count moves only once its graph was launched: a failed launch leaves the stage where
# it was, for `launch_stage` to finish the step (the graph fault sweep).
run graph-launch-advance-early src/pp/runtime/step_graph.rs "            self.launch_on(stage, s, k, input, output)?;
            next[s] = (k + 1) % n_slots;" "            next[s] = (k + 1) % n_slots;
            self.launch_on(stage, s, k, input, output)?;"
# A capture is ended however the calls around its end fail: without the context bound, and once
# more while the stream is still capturing (the capture fault sweep).
run capture-end-bound src/safe/graph.rs "    let bound = stream.context().bind();
    // SAFETY: the stream is live and capturing" "    let bound = Ok::<_, Error>(stream.context().bind()?);
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
        // Every stage's output slot" "        for (b, ring) in rings.iter().enumerate() {
            if ring.next() != k {
                return Err(Error::Pipeline(PpError::GraphOutOfStep { boundary: b, expected: k, found: ring.next() }));
            }
        }
        if let Some((stage, found)) = next.iter().enumerate().find(|(_, at)| **at != next[0]) {
            return Err(Error::Pipeline(PpError::GraphStageOutOfStep { stage, expected: next[0], found: *found }));
        }
        // Every stage's output slot"
# Across ranks (the fault sweep across ranks, through the driver and NCCL doubles): a drop that
# does not record a boundary failure no call returned; a failed send that leaves its link up (the
# receiver waits for a step that never comes); a receiver thread whose failed receive leaves the
# link up.
run drop-unreported-link src/pp/runtime/build.rs "        for failure in self.readbacks.links.iter().filter_map(|link| link.unreported()) {" "        for failure in self.readbacks.links.iter().filter_map(|link| link.unreported()).filter(|_| false) {"
run send-failure-keeps-link src/pp/remote/sender.rs '            self.link.fail(format!("the NCCL send of step {step} failed: {e}"));
            return Err(self.link.stopped().unwrap_or(e));' '            return Err(e);'
run receive-failure-keeps-link src/pp/remote/receiver.rs '                    Err(e) => break Err(format!("receiving step {}: {e}", step.step)),' '                    Err(_) => break Ok(()),'
# A readback given although a boundary of its rank failed (its receive may have been cut short).
run readback-after-failure src/pp/readback.rs "        match self.shared.links.iter().find(|link| link.aborted()) {" "        match self.shared.links.iter().find(|link| link.aborted() && false) {"
# Nothing a caller forgets or reads keeps memory or streams without bound (tests/bounded.rs): a
# forgotten thread-local capture holds back no other stream's free; read marks let their streams
# go; a detached read is dropped only once it completed.
run forgotten-capture-holds-frees src/safe/graph.rs "    THREAD.try_with(|captures| captures.borrow().first().cloned()).ok().flatten().map(FreeBlocked::ThisThread)" "    THREAD.try_with(|captures| captures.borrow().first().cloned()).ok().flatten().map(FreeBlocked::Capture)" bounded
run read-marks-hold-streams src/safe/ordering.rs "                    if reads.len() >= ATTACHED_READS {" "                    if false {" bounded
run detached-reads-dropped src/safe/ordering.rs "            (None, Some(event)) => event.is_complete()?," "            (None, Some(_event)) => true," bounded
# A step whose bytes are not the receiver's n elements is refused (a peer whose type of that
# name has another size): tests/ring.rs.
run rx-size-unchecked src/pp/ring.rs "            SlotState::Filled { .. } if n.checked_mul(size_of::<T>()) != Some(self.slots[k].bytes) => {" "            SlotState::Filled { .. } if false => {" ring
# Rank 0 reads every connection's hello at once, each within its own budget (tests/rendezvous.rs).
run hellos-one-at-a-time src/rendezvous.rs "    while at < pending.len() {" "    while at < pending.len().min(1) {" rendezvous
# The receiver drains its receives at a close within the peer timeout: a step announced and
# never sent fails the boundary instead of keeping the thread and the drop for ever.
run close-drain-unbounded src/pp/remote/receiver.rs "                let drained = drain_within(&inbound.recv_stream, link.timeout, stop);" "                let drained = inbound.recv_stream.synchronize().map_err(|e| e.to_string());" ring
# A rank that cannot load NCCL tells the others at the rendezvous (tests/processes).
run unable-rank-silent src/pp/remote/setup.rs "        (m.bytes.first() == Some(&UNABLE)).then(|| (r, String::from_utf8_lossy(&m.bytes[1..]).into_owned()))" "        (m.bytes.first() == Some(&UNABLE) && false).then(|| (r, String::from_utf8_lossy(&m.bytes[1..]).into_owned()))" processes
