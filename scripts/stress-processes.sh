#!/usr/bin/env bash
# Runs tests of the multi-process pipeline (`processes`, from gpu-bundle/) over and over, several
# copies at once, for a while: a rare stall or mismatch then shows, with its evidence. Each copy
# is a loop of whole test-process runs; every run is bounded by STRESS_RUN_TIMEOUT. Prints one
# line per run and a count per test; keeps the logs of the runs that failed (with the stall dump
# of `PPNRT_TEST_STALL_DUMP_S`, every rank's threads and stacks) and packs them into
# <logs>/stress-failures.tgz.
#
#   bash scripts/stress-processes.sh [seconds] [copies] [test...]
#
# Defaults: 300 seconds, 4 copies, the tests `two_processes_over_sockets_match_one_engine_bitwise`,
# `two_processes_match_one_engine_bitwise` and `graph_mode_across_processes_matches_one_engine_bitwise`
# (copies alternate between the tests given).
# A run started before the time is up runs to its end. Environment: STRESS_OUT (logs; default
# $OUT or stress-logs/), STRESS_RUN_TIMEOUT (default 300 s, past the test's own 240 s limit on a launch, so that a stalled launch is reported by the test, with every rank's output), and what the gate sets
# (PPNRT_REQUIRE_GPUS, PPNRT_TEST_STALL_DUMP_S, PPNRT_TEST_QUICK: set here to 1 so that the
# 10,000-step run of the NVLink test is 500 steps and a run stays short). With
# NCCL_GRAPH_MIXING_SUPPORT=0 the ranks receive by NCCL's call only, no captured receive (the
# tests then check that none went through a graph).
set -u
cd "$(dirname "$0")/.."
seconds=${1:-300}
copies=${2:-4}
shift $(($# > 2 ? 2 : $#))
tests=("$@")
[ ${#tests[@]} -gt 0 ] || tests=(two_processes_over_sockets_match_one_engine_bitwise two_processes_match_one_engine_bitwise
  graph_mode_across_processes_matches_one_engine_bitwise)
bin=gpu-bundle/tests/processes
[ -x "$bin" ] || { echo "stress-processes: $bin missing (bash scripts/build-gpu-bundle.sh)"; exit 2; }
logs=${STRESS_OUT:-${OUT:-stress-logs}}
mkdir -p "$logs/runs"
export PPNRT_REQUIRE_GPUS=${PPNRT_REQUIRE_GPUS:-$(nvidia-smi -L 2>/dev/null | grep -c '^GPU')}
export NCCL_NVLS_ENABLE=0 PPNRT_REQUIRE_NCCL=${PPNRT_REQUIRE_NCCL:-1}
export PPNRT_TEST_STALL_DUMP_S=${PPNRT_TEST_STALL_DUMP_S:-20} PPNRT_TEST_QUICK=${PPNRT_TEST_QUICK:-1}
run_timeout=${STRESS_RUN_TIMEOUT:-300}
deadline=$(($(date +%s) + seconds))

# copy test: runs the test until the deadline; one line per run.
loop() {
  local copy=$1 test=$2 run=0 log rc start
  while [ "$(date +%s)" -lt "$deadline" ]; do
    run=$((run + 1))
    log="$logs/runs/$test.$copy.$run.log"
    start=$(date +%s)
    timeout -k 10 "$run_timeout" "$bin" --test-threads=1 --exact "$test" >"$log" 2>&1
    rc=$?
    if [ $rc -eq 0 ] && grep -q '^test result: ok. 1 passed' "$log"; then
      echo "run $test copy $copy #$run PASS $(($(date +%s) - start)) s"
      rm -f "$log"
    else
      echo "run $test copy $copy #$run FAIL rc=$rc $(($(date +%s) - start)) s"
    fi
  done
}

echo "stress on $(hostname): ${copies} copies for ${seconds} s of ${tests[*]}; PPNRT_REQUIRE_GPUS=$PPNRT_REQUIRE_GPUS; NCCL_GRAPH_MIXING_SUPPORT=${NCCL_GRAPH_MIXING_SUPPORT:-unset}"
for ((copy = 1; copy <= copies; copy++)); do
  loop "$copy" "${tests[$(((copy - 1) % ${#tests[@]}))]}" &
done | tee "$logs/stress-runs.txt"
wait
echo "==== stress summary ($(date -u +%Y-%m-%dT%H:%MZ)) ===="
failed=0
for test in "${tests[@]}"; do
  pass=$(grep -c "^run $test .* PASS" "$logs/stress-runs.txt")
  fail=$(grep -c "^run $test .* FAIL" "$logs/stress-runs.txt")
  echo "$test: $pass passed, $fail failed"
  [ "$fail" -eq 0 ] || failed=1
done
if [ -n "$(ls -A "$logs/runs")" ]; then
  tar czf "$logs/stress-failures.tgz" -C "$logs" runs
fi
rm -rf "$logs/runs"
[ $failed -eq 0 ] && echo "STRESS PASS" || echo "STRESS FAIL"
exit $failed
