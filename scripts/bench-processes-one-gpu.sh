#!/usr/bin/env bash
# The processes table on a machine with one GPU, twice: as the GPU comes (two processes on it
# time-slice between their contexts), and under MPS (the contexts' work runs side by side), so the
# share of the time-slicing in the gap to the in-process boundary is measured, not guessed.
# Runs the bench executable of gpu-bundle/ (scripts/build-gpu-bundle.sh); writes
# $OUT/bench-processes{,-mps}.md (or ./bench-logs/); BENCH_MPS=0 skips the MPS run. The MPS daemon is started with pipe and log
# folders of its own and stopped again, whatever happened.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-bench-logs}
mkdir -p "$out"
bench=gpu-bundle/benches/transport
[ -x "$bench" ] || { echo "no $bench: run scripts/build-gpu-bundle.sh first"; exit 2; }
run() { # name, then the environment's additions
  local name=$1; shift
  env "$@" PPNRT_BENCH_TABLES=processes PPNRT_BENCH_REPORT="$out/bench-$name.md" \
    timeout 280 "$bench" --bench no-criterion-group > "$out/bench-$name.log" 2>&1
  echo "bench $name: rc=$?"; grep -E "^\| (round|NCCL)|^TARGET" "$out/bench-$name.log"
}
run processes
if [ "${BENCH_MPS:-1}" = 0 ]; then
  echo "SKIPPED the MPS run: BENCH_MPS=0"; exit 0
fi
if ! command -v nvidia-cuda-mps-control > /dev/null; then
  echo "SKIPPED the MPS run: nvidia-cuda-mps-control is not installed"; exit 0
fi
mps=$(mktemp -d)
export CUDA_MPS_PIPE_DIRECTORY=$mps/pipe CUDA_MPS_LOG_DIRECTORY=$mps/log
mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
trap 'echo quit | nvidia-cuda-mps-control; sleep 1' EXIT
nvidia-cuda-mps-control -d || { echo "SKIPPED the MPS run: the daemon did not start"; exit 0; }
run processes-mps CUDA_MPS_PIPE_DIRECTORY="$CUDA_MPS_PIPE_DIRECTORY"
