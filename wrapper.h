/* The C surface that build.rs hands to bindgen: the CUDA driver API, and the few runtime-API
 * types an engine meets when it shares streams and events with cuBLAS, PyTorch or other
 * runtime-API libraries (a cudaStream_t is a CUstream, a cudaEvent_t a CUevent). */
#include <cuda.h>
#include <driver_types.h>
