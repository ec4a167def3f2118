/* The C surface that build.rs hands to bindgen for NCCL: nccl.h (which brings in the runtime-API
 * types it names, such as cudaStream_t). Loaded at run time, never linked.
 *
 * The half-precision headers nccl.h includes are skipped (their include guards are set): nothing
 * bound here uses their types, and they need the CUDA C++ core library's headers. */
#define __CUDA_FP16_H__
#define __CUDA_BF16_H__
#include <nccl.h>
