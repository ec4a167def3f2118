#!/usr/bin/env bash
# Starts the ranks of a pipeline that spans processes, all on this host, and waits for them.
#
#   scripts/launch-local.sh RANKS [--one-gpu-per-rank | --share-one-gpu] [--port P] -- PROGRAM [ARGS...]
#
# RANKS is the stage-to-rank map (PPNRT_RANKS), e.g. 0,0,1,1. Every rank gets the same
# environment plus PPNRT_RANKS, PPNRT_RANK and PPNRT_RENDEZVOUS=127.0.0.1:P (a free port unless
# --port is given), and a job secret made for this job (PPNRT_JOB_SECRET, 32 random bytes in hex,
# unless PPNRT_JOB_SECRET or PPNRT_JOB_SECRET_FILE is set already), so only these ranks can join
# and their records are sealed. With --one-gpu-per-rank, rank r sees GPU r only (CUDA_VISIBLE_DEVICES=r) and,
# unless PPNRT_DEVICES is set, every stage is on its rank's device 0. With --share-one-gpu every
# rank sees GPU 0 only and gets a host id of its own (NCCL_HOSTID), so NCCL treats the ranks as
# hosts and moves data over sockets on loopback (a test setup for a one-GPU machine). Each rank's
# output is prefixed with its rank. Exits with the first failing rank's status (the others are
# stopped). On several hosts, start one process per host by hand with the same variables and
# PPNRT_RENDEZVOUS naming rank 0's reachable address.
set -euo pipefail

usage() { sed -n '2,16p' "$0" | sed 's/^# \{0,1\}//'; exit 2; }
[ $# -ge 3 ] || usage
ranks=$1; shift
one_gpu=0
port=
while [ $# -gt 0 ] && [ "$1" != -- ]; do
  case $1 in
    --one-gpu-per-rank) one_gpu=1 ;;
    --share-one-gpu) one_gpu=shared ;;
    --port) port=$2; shift ;;
    *) usage ;;
  esac
  shift
done
[ "${1:-}" = -- ] || usage
shift
[ $# -ge 1 ] || usage
if ! [[ $ranks =~ ^[0-9]+(,[0-9]+)*$ ]]; then
  echo "launch-local: RANKS must be a comma-separated list of ranks, got '$ranks'" >&2
  exit 2
fi
world=$(tr ',' '\n' <<<"$ranks" | sort -n | tail -1)
world=$((world + 1))
stages=$(tr ',' '\n' <<<"$ranks" | wc -l)
if [ -z "$port" ]; then
  port=$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
fi
export PPNRT_RANKS=$ranks PPNRT_RENDEZVOUS=127.0.0.1:$port
if [ -z "${PPNRT_JOB_SECRET:-}" ] && [ -z "${PPNRT_JOB_SECRET_FILE:-}" ]; then
  PPNRT_JOB_SECRET=$(od -An -N32 -tx1 /dev/urandom | tr -d ' \n')
  export PPNRT_JOB_SECRET
fi
if [ $one_gpu != 0 ] && [ -z "${PPNRT_DEVICES:-}" ]; then
  export PPNRT_DEVICES=$(yes 0 | head -n "$stages" | paste -sd,)
fi

pids=()
for ((rank = 0; rank < world; rank++)); do
  (
    export PPNRT_RANK=$rank
    [ $one_gpu = 1 ] && export CUDA_VISIBLE_DEVICES=$rank
    if [ $one_gpu = shared ]; then
      export CUDA_VISIBLE_DEVICES=0 NCCL_HOSTID=ppnrt-local-rank-$rank NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1
      export NCCL_SOCKET_IFNAME=${NCCL_SOCKET_IFNAME:-lo}
    fi
    exec "$@" > >(sed -u "s/^/[rank $rank] /") 2> >(sed -u "s/^/[rank $rank] /" >&2)
  ) &
  pids+=($!)
done

# Waits for every rank: the first rank to fail (in time: each is looked at every 0.1 s) gives the
# script its exit status, and the others are stopped. `wait PID` returns a rank's status once it
# ended (`wait -n` loses the status of a job the shell already reported, e.g. one killed by a
# signal).
status=0
running=("${pids[@]}")
while [ ${#running[@]} -gt 0 ]; do
  left=()
  for pid in "${running[@]}"; do
    if kill -0 "$pid" 2>/dev/null; then
      left+=("$pid")
      continue
    fi
    rc=0
    wait "$pid" || rc=$?
    if [ "$rc" != 0 ] && [ "$status" = 0 ]; then
      status=$rc
      kill "${pids[@]}" 2>/dev/null || true
    fi
  done
  running=("${left[@]}")
  [ ${#running[@]} -eq 0 ] || sleep 0.1
done
exit "$status"
