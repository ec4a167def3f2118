#!/usr/bin/env bash
# Reproduces the open initcheck finding of docs/RELIABILITY.md ("Open: initcheck reports in the
# thread-per-stage loop"): runs `pipeline :: one_thread_per_stage_matches_one_thread` (300 steps)
# under compute-sanitizer initcheck in N processes at once, R rounds, from gpu-bundle/ (made by
# scripts/build-gpu-bundle.sh), and prints each run's error summary and test result.
#
#   bash scripts/initcheck-threads-probe.sh [processes (default 4)] [rounds (default 2)]
#
# Logs go to $OUT (or initcheck-probe/).
set -u
cd "$(dirname "$0")/.."
processes=${1:-4}
rounds=${2:-2}
logs=${OUT:-initcheck-probe}
mkdir -p "$logs"
for round in $(seq "$rounds"); do
  for p in $(seq "$processes"); do
    PPNRT_SANITIZER=1 PPNRT_HAZARD_STEPS=300 timeout 300 compute-sanitizer --tool initcheck --print-limit 2 \
      gpu-bundle/tests/pipeline --test-threads=1 --exact one_thread_per_stage_matches_one_thread \
      >"$logs/initcheck-probe-$round-$p.log" 2>&1 &
  done
  wait
done
for log in "$logs"/initcheck-probe-*.log; do
  summary=$(grep -hE 'ERROR SUMMARY: [0-9]+ errors?$' "$log" | head -1)
  result=$(grep -hE '^test result' "$log" | sed 's/; finished in.*//')
  echo "$(basename "$log"): ${summary:-no summary} | ${result:-no test result}"
done
