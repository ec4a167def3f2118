// Hash shared by the helper kernels. Its bit-for-bit twin on the host is `kernels::mix32` in
// src/kernels.rs; keep the two in step.
#pragma once
#include <stdint.h>

// MurmurHash3's 32-bit finalizer: a bijection that spreads every input bit.
__device__ __forceinline__ uint32_t ppnrt_mix32(uint32_t h) {
    h ^= h >> 16;
    h *= 0x85ebca6bu;
    h ^= h >> 13;
    h *= 0xc2b2ae35u;
    h ^= h >> 16;
    return h;
}
