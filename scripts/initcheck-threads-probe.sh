#!/usr/bin/env bash
# Reproduces the open initcheck finding of docs/RELIABILITY.md ("Open: initcheck reports in the
# thread-per-stage loop"): runs `pipeline :: one_thread_per_stage_matches_one_thread` (300 steps)
# under compute-sanitizer initcheck in N processes at once, R rounds, from gpu-bundle/ (made by
# scripts/build-gpu-bundle.sh), and prints each run's error summary and test result.
#
#   bash scripts/initcheck-threads-probe.sh [processes (default 4)] [rounds (default 2)] [test]
#
# `test` is a test of tests/pipeline.rs (default one_thread_per_stage_matches_one_thread; the
# variants one_thread_per_stage_with_reserved_slots_matches_one_thread,
# one_thread_per_stage_in_lockstep_matches_one_thread and
# one_thread_per_stage_from_device_inputs_matches_one_thread change one thing each;
# raw_driver_thread_per_stage_matches_one_thread runs the same protocol on the raw driver, without
# the crate).
#
# Logs go to $OUT (or initcheck-probe/). PROBE_TOOL=memcheck (or another compute-sanitizer tool,
# with PROBE_TOOL_ARGS) runs the same under that tool instead. PROBE_BINARY names another test
# executable (default pipeline): e.g. PROBE_BINARY=soundness PROBE_TOOL=synccheck with
# work_racing_a_capture_lands_inside_it_or_outside_it, and then raw_driver_capture_race_runs (the
# same driver calls without the crate), reruns the capture race under synccheck.
set -u
cd "$(dirname "$0")/.."
processes=${1:-4}
rounds=${2:-2}
test=${3:-one_thread_per_stage_matches_one_thread}
tool=${PROBE_TOOL:-initcheck}
binary=${PROBE_BINARY:-pipeline}
logs=${OUT:-initcheck-probe}
mkdir -p "$logs"
for round in $(seq "$rounds"); do
  for p in $(seq "$processes"); do
    PPNRT_SANITIZER=1 PPNRT_HAZARD_STEPS=300 timeout 300 compute-sanitizer --tool "$tool" ${PROBE_TOOL_ARGS:-} --print-limit 2 \
      gpu-bundle/tests/"$binary" --test-threads=1 --exact "$test" \
      >"$logs/$tool-probe-$test-$round-$p.log" 2>&1 &
  done
  wait
done
for log in "$logs/$tool-probe-$test"-*.log; do
  summary=$(grep -hE 'ERROR SUMMARY: [0-9]+ errors?$' "$log" | head -1)
  result=$(grep -hE '^test result' "$log" | sed 's/; finished in.*//')
  echo "$(basename "$log"): ${summary:-no summary} | ${result:-no test result}"
  grep -hE -m1 '^=========     at ' "$log" | sed 's/^=========  */    first report: /'
  # The first frame of the test's own code that launched it.
  grep -hE -m1 'Host Frame: .*(raw_threads|threads|pipeline|soundness)::' "$log" | sed -E 's/^=========  *Host Frame: */    launched from: /; s/::h[0-9a-f]{16}//'
  # A failed run: why (the panic and the driver's error).
  grep -hE -A2 "panicked at" "$log" | grep -v '^note:' | head -4 | sed 's/^/    /'
done
