#!/usr/bin/env python3
"""Probe: the host cost of an NCCL send or receive issued eagerly against the same operation
captured once in a CUDA graph and launched, between two processes (one GPU each).

A design question of the cross-process boundary: `ncclSend` / `ncclRecv` cost several µs of host
time per call, about as much as a whole in-process `tx` + `rx`. A graph launch of a captured send
costs one `cudaGraphLaunch`, but the graph fixes the buffer's address and the byte count. This
probe measures both on the machine at hand, calling NCCL and the CUDA runtime through ctypes in
both cases (so the binding overhead is the same), and checks that every launched step delivers
its own data.

    python3 scripts/probe-nccl-graph-send.py [bytes] [steps]

Needs PyTorch (streams and buffers) and the nvidia-nccl wheel; uses GPUs 0 and 1 (or GPU 0 for
both ranks when only one is visible). Prints a table from rank 0's and rank 1's point of view.
"""

import ctypes
import glob
import os
import statistics
import sys
import time

import torch
import torch.multiprocessing as mp

NCCL_UINT8 = 1


def load_nccl():
    import nvidia.nccl

    roots = list(getattr(nvidia.nccl, "__path__", [])) or [os.path.dirname(nvidia.nccl.__file__)]
    for root in roots:
        found = sorted(glob.glob(os.path.join(root, "lib", "libnccl.so*")))
        if found:
            return ctypes.CDLL(found[0])
    raise RuntimeError("libnccl.so not found in the nvidia-nccl wheel")


def load_cudart():
    candidates = []
    for base in [os.path.dirname(torch.__file__)] + list(sys.path):
        candidates += glob.glob(os.path.join(base, "lib", "libcudart.so*"))
        candidates += glob.glob(os.path.join(base, "nvidia", "cuda_runtime", "lib", "libcudart.so*"))
        candidates += glob.glob(os.path.join(base, "nvidia", "cu13", "lib", "libcudart.so*"))
    for name in candidates + ["libcudart.so.13", "libcudart.so"]:
        try:
            return ctypes.CDLL(name)
        except OSError:
            continue
    raise RuntimeError("libcudart not found")


class UniqueId(ctypes.Structure):
    _fields_ = [("internal", ctypes.c_byte * 128)]


def check(what, code):
    if code != 0:
        raise RuntimeError(f"{what} returned {code}")


def worker(rank, uid_bytes, nbytes, steps, results):
    device = rank if torch.cuda.device_count() > 1 else 0
    torch.cuda.set_device(device)
    nccl, cudart = load_nccl(), load_cudart()
    nccl.ncclCommInitRank.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_int, UniqueId, ctypes.c_int]
    op_args = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p]
    nccl.ncclSend.argtypes = op_args
    nccl.ncclRecv.argtypes = op_args
    cudart.cudaStreamBeginCapture.argtypes = [ctypes.c_void_p, ctypes.c_int]
    cudart.cudaStreamEndCapture.argtypes = [ctypes.c_void_p, ctypes.POINTER(ctypes.c_void_p)]
    cudart.cudaGraphInstantiate.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_void_p, ctypes.c_ulonglong]
    cudart.cudaGraphLaunch.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
    cudart.cudaStreamSynchronize.argtypes = [ctypes.c_void_p]

    uid = UniqueId()
    ctypes.memmove(ctypes.byref(uid), uid_bytes, 128)
    comm = ctypes.c_void_p()
    check("ncclCommInitRank", nccl.ncclCommInitRank(ctypes.byref(comm), 2, uid, rank))

    stream = torch.cuda.Stream()
    handle = ctypes.c_void_p(stream.cuda_stream)
    buf = torch.zeros(nbytes, dtype=torch.uint8, device="cuda")
    peer = 1 - rank

    def eager():
        if rank == 0:
            return nccl.ncclSend(ctypes.c_void_p(buf.data_ptr()), nbytes, NCCL_UINT8, peer, comm, handle)
        return nccl.ncclRecv(ctypes.c_void_p(buf.data_ptr()), nbytes, NCCL_UINT8, peer, comm, handle)

    def fill(step):
        # The step's data: a value that changes with the step (never zeros).
        with torch.cuda.stream(stream):
            buf.fill_((step * 7 + 3) % 251 + 1 if rank == 0 else 0)

    def verify(step):
        want = (step * 7 + 3) % 251 + 1
        got = buf.to("cpu", non_blocking=False)
        return bool((got == want).all())

    def timed(call, label):
        times, bad = [], 0
        for step in range(steps):
            fill(step)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            check(label, call())
            t1 = time.perf_counter()
            check("cudaStreamSynchronize", cudart.cudaStreamSynchronize(handle))
            if rank == 1 and not verify(step):
                bad += 1
            if step >= steps // 10:
                times.append(t1 - t0)
        return statistics.median(times) * 1e6, bad

    for _ in range(20):
        check("warm-up", eager())
        check("cudaStreamSynchronize", cudart.cudaStreamSynchronize(handle))

    eager_us, eager_bad = timed(eager, "eager op")

    graph, exe = ctypes.c_void_p(), ctypes.c_void_p()
    torch.cuda.synchronize()
    check("cudaStreamBeginCapture", cudart.cudaStreamBeginCapture(handle, 2))  # relaxed
    check("captured op", eager())
    check("cudaStreamEndCapture", cudart.cudaStreamEndCapture(handle, ctypes.byref(graph)))
    check("cudaGraphInstantiate", cudart.cudaGraphInstantiate(ctypes.byref(exe), graph, 0))

    def launch():
        return cudart.cudaGraphLaunch(exe, handle)

    for _ in range(5):
        check("graph warm-up", launch())
        check("cudaStreamSynchronize", cudart.cudaStreamSynchronize(handle))
    graph_us, graph_bad = timed(launch, "graph launch")

    # Eager again after graph launches on the same communicator (mixing).
    mixed_us, mixed_bad = timed(eager, "eager op after graphs")
    results.put((rank, eager_us, eager_bad, graph_us, graph_bad, mixed_us, mixed_bad))
    torch.cuda.synchronize()


def main():
    nbytes = int(sys.argv[1]) if len(sys.argv) > 1 else 32 * 1024
    steps = int(sys.argv[2]) if len(sys.argv) > 2 else 2000
    nccl = load_nccl()
    uid = UniqueId()
    check("ncclGetUniqueId", nccl.ncclGetUniqueId(ctypes.byref(uid)))
    version = ctypes.c_int()
    check("ncclGetVersion", nccl.ncclGetVersion(ctypes.byref(version)))
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=worker, args=(r, bytes(uid.internal), nbytes, steps, results)) for r in range(2)]
    for p in procs:
        p.start()
    rows = sorted(results.get(timeout=600) for _ in procs)
    for p in procs:
        p.join()
        if p.exitcode != 0:
            raise SystemExit(f"a rank failed with exit code {p.exitcode}")
    mixing = os.environ.get("NCCL_GRAPH_MIXING_SUPPORT", "default")
    print(f"NCCL {version.value}, {nbytes} bytes, {steps} steps, NCCL_GRAPH_MIXING_SUPPORT={mixing}")
    print("| rank (op) | eager call (µs) | graph launch (µs) | eager after graphs (µs) | wrong steps (eager / graph / after) |")
    print("| --- | ---: | ---: | ---: | --- |")
    for rank, e, eb, g, gb, m, mb in rows:
        op = "send" if rank == 0 else "recv"
        print(f"| {rank} ({op}) | {e:.2f} | {g:.2f} | {m:.2f} | {eb} / {gb} / {mb} |")
    if any(row[2] or row[4] or row[6] for row in rows):
        raise SystemExit("some steps delivered wrong data")


if __name__ == "__main__":
    main()
