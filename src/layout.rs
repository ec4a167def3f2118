//! Compile-time checks of the types that cross the FFI boundary, and of the thread-safety
//! promises of the public types.

use std::os::raw::c_void;

use static_assertions::{
    assert_eq_align, assert_eq_size, assert_impl_all, assert_not_impl_any, assert_type_eq_all, const_assert,
};

use crate::safe::{
    Context, CudaEvent, CudaSlice, CudaStream, CudaView, Device, Function, Module, PinnedHostBuffer, StreamOverride,
};
use crate::sys;

// Result codes and enums are 32-bit newtypes (C enums are `int`-sized on every CUDA platform).
assert_eq_size!(sys::CUresult, u32);
assert_eq_align!(sys::CUresult, u32);
assert_eq_size!(sys::CUdevice_attribute, u32);
// Handles are pointers; device addresses and devices are fixed-width integers.
assert_eq_size!(sys::CUstream, *mut c_void);
assert_eq_size!(sys::CUevent, *mut c_void);
assert_eq_size!(sys::CUcontext, *mut c_void);
assert_eq_size!(sys::CUmodule, *mut c_void);
assert_eq_size!(sys::CUfunction, *mut c_void);
assert_type_eq_all!(sys::CUdeviceptr, u64);
assert_type_eq_all!(sys::CUdevice, i32);
// Runtime-API handles are the driver's: a cudaStream_t from cuBLAS or PyTorch is a CUstream.
assert_type_eq_all!(sys::cudaStream_t, sys::CUstream);
assert_type_eq_all!(sys::cudaEvent_t, sys::CUevent);
// The bindings come from a CUDA 12 or newer header.
const_assert!(sys::CUDA_VERSION >= 12000);
// Half-precision element types are two bytes, like their C counterparts.
assert_eq_size!(crate::bf16, u16);
assert_eq_size!(crate::f16, u16);
assert_eq_align!(crate::bf16, u16);

// Thread-safety promises.
assert_impl_all!(Context: Send, Sync);
assert_impl_all!(CudaStream: Send, Sync);
assert_impl_all!(CudaEvent: Send, Sync);
assert_impl_all!(CudaSlice<f32>: Send, Sync);
assert_impl_all!(CudaView<'static, f32>: Send, Sync);
assert_impl_all!(PinnedHostBuffer<f32>: Send, Sync);
assert_impl_all!(Module: Send, Sync);
assert_impl_all!(Function: Send, Sync);
assert_impl_all!(Device: Send, Sync, Copy);
assert_impl_all!(crate::Engine: Send, Sync, Clone);
assert_impl_all!(crate::error::CudaError: Send, Sync, Clone);
assert_impl_all!(crate::PpNRt: Send, Sync);
assert_impl_all!(crate::safe::event_pool::PooledEvent: Send, Sync);
assert_impl_all!(crate::PendingReadback<f32>: Send, Sync);
assert_not_impl_any!(crate::safe::BoundContext<'static>: Send);
// An ambient-stream guard belongs to the thread that made it.
assert_not_impl_any!(StreamOverride: Send, Sync);
// Capture belongs to the thread that began it (the driver ends a capture on that thread); a
// graph is moved between threads but used by one at a time; an executable graph and a step's
// graphs may be shared (launches take `&mut` or lock).
assert_not_impl_any!(crate::StreamCapture: Send, Sync);
assert_impl_all!(crate::CudaGraph: Send);
assert_not_impl_any!(crate::CudaGraph: Sync);
assert_impl_all!(crate::GraphExec: Send, Sync);
assert_impl_all!(crate::StepGraphs<'static, f32>: Send, Sync);
assert_impl_all!(crate::nccl::NcclComm: Send, Sync);
assert_impl_all!(crate::nccl::NcclUniqueId: Send, Sync, Copy);
// NCCL's handles and ids are what nccl.h says.
assert_eq_size!(sys::nccl::ncclComm_t, *mut c_void);
assert_eq_size!(sys::nccl::ncclUniqueId, [u8; 128]);
assert_eq_size!(sys::nccl::ncclResult_t, u32);
// The fields of ncclConfig_t that every NCCL since 2.14 reads at these offsets (later fields are
// read only up to the `size` the caller states).
const_assert!(std::mem::offset_of!(sys::nccl::ncclConfig_t, size) == 0);
const_assert!(std::mem::offset_of!(sys::nccl::ncclConfig_t, magic) == 8);
const_assert!(std::mem::offset_of!(sys::nccl::ncclConfig_t, version) == 12);
const_assert!(std::mem::offset_of!(sys::nccl::ncclConfig_t, blocking) == 16);
