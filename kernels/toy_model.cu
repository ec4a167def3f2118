// The toy residual model that tests and the pipeline example split over stages.
//
// One layer updates the residual stream in place: x[i] = fma(x[i], a, b), where a and b are
// drawn from a hash of (step, layer, i). A transfer that delivers the wrong step's data, a stale
// slot, or elements in the wrong place therefore changes the final output. fma is exactly
// rounded, so every GPU gives the same bits for the same inputs.

#include <stdint.h>

#include "mix.cuh"

extern "C" __global__ void ppnrt_toy_layer_f32(float* x, uint64_t n, uint32_t step, uint32_t layer) {
    uint32_t key = ppnrt_mix32(step * 0x9e3779b9u ^ ppnrt_mix32(layer + 0x7f4a7c15u));
    for (uint64_t i = blockIdx.x * (uint64_t)blockDim.x + threadIdx.x; i < n;
         i += (uint64_t)gridDim.x * blockDim.x) {
        uint32_t h = ppnrt_mix32(key ^ (uint32_t)i);
        // a in [0.5, 1.0), b in [-0.5, 0.5): the stream stays bounded over many layers.
        float a = 0.5f + (float)(h >> 8) * (0.5f / 16777216.0f);
        float b = (float)(ppnrt_mix32(h) >> 8) * (1.0f / 16777216.0f) - 0.5f;
        x[i] = fmaf(x[i], a, b);
    }
}
