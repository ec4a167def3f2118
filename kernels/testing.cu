// Test fixtures embedded as PTX with the `testing` feature only: patterns and checksums that
// tests use to validate transfers, a delay kernel for hazard tests, and a trapping kernel for
// fault tests.
//
// Every kernel is extern "C" (unmangled names) and takes element counts as 64-bit values.
// The hash functions have a bit-for-bit twin in src/kernels.rs; keep the two in step.

#include <stdint.h>

#include "mix.cuh"

// The pattern word for element `i` under `seed`.
__device__ __forceinline__ uint32_t ppnrt_pattern(uint32_t seed, uint64_t i) {
    return ppnrt_mix32(seed ^ ppnrt_mix32((uint32_t)i ^ ppnrt_mix32((uint32_t)(i >> 32) + 0x9e3779b9u)));
}

// dst[i] = pattern(seed, i) for i < n.
extern "C" __global__ void ppnrt_fill_pattern_u32(uint32_t* dst, uint64_t n, uint32_t seed) {
    for (uint64_t i = blockIdx.x * (uint64_t)blockDim.x + threadIdx.x; i < n;
         i += (uint64_t)gridDim.x * blockDim.x) {
        dst[i] = ppnrt_pattern(seed, i);
    }
}

// dst[i] = value (a 32-bit word) for i < n.
extern "C" __global__ void ppnrt_fill_u32(uint32_t* dst, uint64_t n, uint32_t value) {
    for (uint64_t i = blockIdx.x * (uint64_t)blockDim.x + threadIdx.x; i < n;
         i += (uint64_t)gridDim.x * blockDim.x) {
        dst[i] = value;
    }
}

// *out += sum over i < n of mix32(src[i] + 0x9e3779b9 * i), modulo 2^64. Position-sensitive
// (a swapped pair changes it) and independent of the order threads add in.
extern "C" __global__ void ppnrt_checksum_u32(const uint32_t* src, uint64_t n, unsigned long long* out) {
    unsigned long long local = 0;
    for (uint64_t i = blockIdx.x * (uint64_t)blockDim.x + threadIdx.x; i < n;
         i += (uint64_t)gridDim.x * blockDim.x) {
        local += ppnrt_mix32(src[i] + 0x9e3779b9u * (uint32_t)i);
    }
    for (int offset = 16; offset > 0; offset >>= 1) {
        local += __shfl_down_sync(0xffffffffu, local, offset);
    }
    if ((threadIdx.x & 31) == 0 && local != 0) {
        atomicAdd(out, local);
    }
}

// One thread spins for `ns` nanoseconds of the GPU's global timer: a delay injected on a
// stream to widen race windows in hazard tests.
extern "C" __global__ void ppnrt_spin_ns(uint64_t ns) {
    uint64_t start;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
    uint64_t now = start;
    while (now - start < ns) {
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
    }
}

// Traps: the context that runs it becomes unusable. Used by the fault tests only.
extern "C" __global__ void ppnrt_trap() {
    __trap();
}
