// The kernels every ppnrt build embeds as PTX: the SM copy kernel that the pipeline runtime uses
// for small copies within a device, and the copy a failure can cancel that the sending rank of an
// IPC boundary queues behind its wait for a free slot (with the signal that follows it).
//
// Every kernel is extern "C" (unmangled names) and takes counts as 64-bit values.

#include <stdint.h>

// The grid-stride copy of `n16` 16-byte words then `tail` trailing bytes (both pointers 16-byte
// aligned), each thread a word at a time.
static __device__ __forceinline__ void copy_words(uint4* dst, const uint4* src, uint64_t n16, uint64_t tail) {
    uint64_t stride = (uint64_t)gridDim.x * blockDim.x;
    uint64_t first = blockIdx.x * (uint64_t)blockDim.x + threadIdx.x;
    for (uint64_t i = first; i < n16; i += stride) {
        dst[i] = src[i];
    }
    if (first < tail) {
        ((uint8_t*)(dst + n16))[first] = ((const uint8_t*)(src + n16))[first];
    }
}

// Copies `n16` 16-byte words then `tail` trailing bytes with the SMs (dst and src may live on
// different devices when peer access is on). Pointers must be 16-byte aligned.
extern "C" __global__ void ppnrt_copy_bytes(uint4* dst, const uint4* src, uint64_t n16, uint64_t tail) {
    copy_words(dst, src, n16, tail);
}

// Copies `bytes` bytes from `src` to `dst` with the SMs, as ppnrt_copy_bytes does (16-byte words
// where both pointers are 16-byte aligned, else byte by byte), unless the word `*gate` is at least
// `released` when the block starts: then the block writes nothing. The copy is queued behind a
// stream wait for `*gate` to reach a step; a failure meets that wait by setting the gate to
// `released` (far above every step), and the copy then must not run. The gate only rises, so a
// block that reads it below `released` read it after the wait was met by the step (the slot freed
// for this copy); the blocks of one launch may decide apart only when the release comes while
// they run, and ppnrt_gated_signal, which reads the gate after every block, then says so.
// Each block that copies makes its writes visible to the whole system before it ends
// (__threadfence_system), so the signal written after the launch follows them.
extern "C" __global__ void ppnrt_gated_copy_bytes(uint8_t* dst, const uint8_t* src, uint64_t bytes,
                                                  const volatile uint64_t* gate, uint64_t released) {
    __shared__ int open;
    if (threadIdx.x == 0) {
        open = *gate < released;
    }
    __syncthreads();
    if (!open) {
        return;
    }
    if ((((uintptr_t)dst | (uintptr_t)src) & 15) == 0) {
        copy_words((uint4*)dst, (const uint4*)src, bytes / 16, bytes % 16);
    } else {
        uint64_t stride = (uint64_t)gridDim.x * blockDim.x;
        for (uint64_t i = blockIdx.x * (uint64_t)blockDim.x + threadIdx.x; i < bytes; i += stride) {
            dst[i] = src[i];
        }
    }
    __threadfence_system();
}

// One thread: writes `value` into `*signal` after the ppnrt_gated_copy_bytes launch before it, or
// `released` when `*gate` is at least `released` now (a copy that a release skipped, wholly or in
// part, never reads as filled). Launched with one block of one thread.
extern "C" __global__ void ppnrt_gated_signal(volatile uint64_t* signal, uint64_t value, const volatile uint64_t* gate,
                                              uint64_t released) {
    if (blockIdx.x == 0 && threadIdx.x == 0) {
        uint64_t word = *gate < released ? value : released;
        __threadfence_system();
        *signal = word;
    }
}
