#!/usr/bin/env python3
"""Probe: do stream-ordered driver calls need the stream's context to be current?

With device 1's primary context current (and then with no context current), makes on a stream of
device 0: cuMemAllocAsync, cuMemcpyAsync (checked by value), cuEventRecord, cuStreamWaitEvent,
cuLaunchKernel (a kernel of a device-0 module), cuMemFreeAsync; prints each call's result, whether the copy and the kernel did their work, and
the device the stream-ordered allocation landed on. Needs
two GPUs and libcuda.so.1. Run:  python3 scripts/probe-current-context.py
"""
import ctypes
import sys

cuda = ctypes.CDLL("libcuda.so.1")
u64 = ctypes.c_uint64


def check(name, code):
    if code != 0:
        text = ctypes.c_char_p()
        cuda.cuGetErrorName(code, ctypes.byref(text))
        raise SystemExit(f"{name} failed: {code} {text.value.decode()}")


check("cuInit", cuda.cuInit(0))
count = ctypes.c_int()
check("cuDeviceGetCount", cuda.cuDeviceGetCount(ctypes.byref(count)))
if count.value < 2:
    sys.exit("needs two GPUs")
ctx = []
for d in range(2):
    dev = ctypes.c_int()
    check("cuDeviceGet", cuda.cuDeviceGet(ctypes.byref(dev), d))
    c = ctypes.c_void_p()
    check("cuDevicePrimaryCtxRetain", cuda.cuDevicePrimaryCtxRetain(ctypes.byref(c), dev))
    ctx.append(c)

check("cuCtxSetCurrent", cuda.cuCtxSetCurrent(ctx[0]))
stream0 = ctypes.c_void_p()
check("cuStreamCreate", cuda.cuStreamCreate(ctypes.byref(stream0), 1))
ev0 = ctypes.c_void_p()
check("cuEventCreate", cuda.cuEventCreate(ctypes.byref(ev0), 2))
n = 1 << 16
a, b = u64(), u64()
check("cuMemAlloc_v2", cuda.cuMemAlloc_v2(ctypes.byref(a), n))
check("cuMemAlloc_v2", cuda.cuMemAlloc_v2(ctypes.byref(b), n))
ptx = b""".version 8.0
.target sm_90
.address_size 64
.visible .entry probe_store(.param .u64 p) {
  .reg .b64 %rd<3>;
  .reg .b32 %r<2>;
  ld.param.u64 %rd1, [p];
  cvta.to.global.u64 %rd2, %rd1;
  mov.u32 %r1, 42;
  st.global.u32 [%rd2], %r1;
  ret;
}
"""
module = ctypes.c_void_p()
check("cuModuleLoadData", cuda.cuModuleLoadData(ctypes.byref(module), ctypes.c_char_p(ptx)))
func = ctypes.c_void_p()
check("cuModuleGetFunction", cuda.cuModuleGetFunction(ctypes.byref(func), module, b"probe_store"))
flag = u64()
check("cuMemAlloc_v2", cuda.cuMemAlloc_v2(ctypes.byref(flag), 4))
check("cuCtxSetCurrent", cuda.cuCtxSetCurrent(ctx[1]))
ev1 = ctypes.c_void_p()
check("cuEventCreate", cuda.cuEventCreate(ctypes.byref(ev1), 2))
stream1 = ctypes.c_void_p()
check("cuStreamCreate", cuda.cuStreamCreate(ctypes.byref(stream1), 1))
check("cuEventRecord", cuda.cuEventRecord(ev1, stream1))

for label, current in [("device 1's context current", ctx[1]), ("no context current", None)]:
    check("cuCtxSetCurrent", cuda.cuCtxSetCurrent(current))
    results = {}
    pool = u64()
    results["cuMemAllocAsync on a device-0 stream"] = cuda.cuMemAllocAsync(ctypes.byref(pool), n, stream0)
    host = (ctypes.c_uint8 * n)(*([7] * 16))
    # Fill a through the current-independent path first (with device 0 current), then copy a -> b.
    check("cuCtxSetCurrent", cuda.cuCtxSetCurrent(ctx[0]))
    check("cuMemsetD8_v2", cuda.cuMemsetD8_v2(a, 7, n))
    check("cuMemsetD8_v2", cuda.cuMemsetD8_v2(b, 0, n))
    check("cuMemsetD32_v2", cuda.cuMemsetD32_v2(flag, 0, 1))
    check("cuCtxSynchronize", cuda.cuCtxSynchronize())
    check("cuCtxSetCurrent", cuda.cuCtxSetCurrent(current))
    results["cuMemcpyAsync on a device-0 stream"] = cuda.cuMemcpyAsync(b, a, ctypes.c_size_t(n), stream0)
    results["cuEventRecord of a device-0 event"] = cuda.cuEventRecord(ev0, stream0)
    results["cuStreamWaitEvent, device-0 stream on a device-1 event"] = cuda.cuStreamWaitEvent(stream0, ev1, 0)
    arg = u64(flag.value)
    params = (ctypes.c_void_p * 1)(ctypes.cast(ctypes.byref(arg), ctypes.c_void_p))
    results["cuLaunchKernel of a device-0 function"] = cuda.cuLaunchKernel(
        func, 1, 1, 1, 1, 1, 1, 0, stream0, params, None
    )
    ordinal = ctypes.c_int(-1)
    if results["cuMemAllocAsync on a device-0 stream"] == 0:
        check("cuPointerGetAttribute", cuda.cuPointerGetAttribute(ctypes.byref(ordinal), 9, pool))
    if results["cuMemAllocAsync on a device-0 stream"] == 0:
        results["cuMemFreeAsync on a device-0 stream"] = cuda.cuMemFreeAsync(pool, stream0)
    results["cuStreamSynchronize of the device-0 stream"] = cuda.cuStreamSynchronize(stream0)
    check("cuCtxSetCurrent", cuda.cuCtxSetCurrent(ctx[0]))
    check("cuCtxSynchronize", cuda.cuCtxSynchronize())
    check("cuMemcpyDtoH_v2", cuda.cuMemcpyDtoH_v2(host, b, ctypes.c_size_t(n)))
    copied = all(v == 7 for v in host)
    stored = ctypes.c_uint32()
    check("cuMemcpyDtoH_v2", cuda.cuMemcpyDtoH_v2(ctypes.byref(stored), flag, ctypes.c_size_t(4)))
    print(f"== {label}")
    for name, code in results.items():
        text = ctypes.c_char_p()
        cuda.cuGetErrorName(code, ctypes.byref(text))
        print(f"  {name}: {code} {text.value.decode() if text.value else ''}")
    print(f"  copy delivered every byte: {copied}")
    print(f"  kernel ran on device 0 (wrote 42): {stored.value == 42}")
    print(f"  stream-ordered allocation's device: {ordinal.value}")
