// A kernel with twelve parameters of as many kinds as engines pass: device pointers, a struct by
// value, bf16, f16, bool, and 8- to 64-bit integers and floats. Built into
// tests/data/test_params.fatbin and tests/data/test_params.cubin by scripts/build-test-kernels.sh
// (not by build.rs: the tests load the images as an engine loads its own). The bf16 and f16
// parameters are taken as their 16-bit patterns (the same size and alignment as __nv_bfloat16 and
// __half) and converted here, so the kernel needs no header beyond nvcc's own.

struct Shape {
    unsigned int rows;
    unsigned int cols;
    float scale;
};

extern "C" __global__ void ppnrt_test_params12(const float* x, float* y, unsigned long long n, Shape shape,
                                               unsigned short bias_bf16, bool negate, int offset, unsigned char small,
                                               double wide, unsigned short half_f16, long long big, unsigned int last) {
    float bias = __uint_as_float((unsigned int)bias_bf16 << 16);
    float half_term;
    asm("cvt.f32.f16 %0, %1;" : "=f"(half_term) : "h"(half_f16));
    for (unsigned long long i = blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (unsigned long long)gridDim.x * blockDim.x) {
        float v = x[i] * shape.scale + bias + (float)offset + (float)small + (float)wide + half_term + (float)big +
                  (float)last + (float)(shape.rows * shape.cols);
        y[i] = negate ? -v : v;
    }
}
