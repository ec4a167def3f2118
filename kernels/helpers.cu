// The kernels every ppnrt build embeds as PTX: the SM copy kernel that the pipeline runtime uses
// for small copies within a device.
//
// Every kernel is extern "C" (unmangled names) and takes counts as 64-bit values.

#include <stdint.h>

// Copies `n16` 16-byte words then `tail` trailing bytes with the SMs (dst and src may live on
// different devices when peer access is on). Pointers must be 16-byte aligned.
extern "C" __global__ void ppnrt_copy_bytes(uint4* dst, const uint4* src, uint64_t n16, uint64_t tail) {
    uint64_t stride = (uint64_t)gridDim.x * blockDim.x;
    uint64_t first = blockIdx.x * (uint64_t)blockDim.x + threadIdx.x;
    for (uint64_t i = first; i < n16; i += stride) {
        dst[i] = src[i];
    }
    if (first < tail) {
        ((uint8_t*)(dst + n16))[first] = ((const uint8_t*)(src + n16))[first];
    }
}
