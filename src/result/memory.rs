//! Device memory, memory pools, pinned host memory and copies. Stateless and thread-safe like the
//! driver calls they make; the `unsafe` ones carry the driver's own contract.

use std::os::raw::c_void;

use super::driver_call;
use crate::cuda_error::Result;
use crate::sys::{
    CUcontext, CUdevice, CUdeviceptr, CUmemPool_attribute, CUmemoryPool, CUmemorytype, CUpointer_attribute, CUstream,
};

/// `cuMemAlloc_v2`: `bytes` of device memory in the current context (not from a pool).
///
/// # Errors
/// The driver's error.
#[doc(alias = "cuMemAlloc")]
pub fn alloc(bytes: usize) -> Result<CUdeviceptr> {
    let mut ptr: CUdeviceptr = 0;
    driver_call!(cuMemAlloc_v2(&mut ptr, bytes))?;
    Ok(ptr)
}

/// `cuMemFree_v2`.
///
/// # Safety
/// - `ptr` came from [`alloc`], is freed once, and no pending or later work uses it.
#[doc(alias = "cuMemFree")]
pub unsafe fn free(ptr: CUdeviceptr) -> Result<()> {
    driver_call!(cuMemFree_v2(ptr))
}

/// `cuMemAllocAsync`: `bytes` from the device's current pool, ordered on `stream`.
///
/// # Safety
/// - `stream` is live; the memory may be used only by work ordered after this call on it.
#[doc(alias = "cuMemAllocAsync")]
#[inline]
pub unsafe fn alloc_async(bytes: usize, stream: CUstream) -> Result<CUdeviceptr> {
    let mut ptr: CUdeviceptr = 0;
    driver_call!(cuMemAllocAsync(&mut ptr, bytes, stream))?;
    Ok(ptr)
}

/// `cuMemFreeAsync`.
///
/// # Safety
/// - `ptr` came from [`alloc_async`], is freed once, `stream` is live, and all work using `ptr`
///   is ordered before this call on `stream`.
#[doc(alias = "cuMemFreeAsync")]
#[inline]
pub unsafe fn free_async(ptr: CUdeviceptr, stream: CUstream) -> Result<()> {
    driver_call!(cuMemFreeAsync(ptr, stream))
}

/// `cuDeviceGetDefaultMemPool`.
///
/// # Errors
/// The driver's error.
#[doc(alias = "cuDeviceGetDefaultMemPool")]
pub fn default_mem_pool(device: CUdevice) -> Result<CUmemoryPool> {
    let mut pool: CUmemoryPool = std::ptr::null_mut();
    driver_call!(cuDeviceGetDefaultMemPool(&mut pool, device))?;
    Ok(pool)
}

/// `cuMemPoolSetAttribute` for a 64-bit attribute (the release threshold).
///
/// # Safety
/// - `pool` is live and `attribute` takes a `cuuint64_t`.
#[doc(alias = "cuMemPoolSetAttribute")]
pub unsafe fn mem_pool_set_u64(pool: CUmemoryPool, attribute: CUmemPool_attribute, value: u64) -> Result<()> {
    let mut value = value;
    driver_call!(cuMemPoolSetAttribute(pool, attribute, (&raw mut value).cast::<c_void>()))
}

/// `cuMemGetInfo_v2`: `(free, total)` bytes of the current context's device.
///
/// # Errors
/// The driver's error.
#[doc(alias = "cuMemGetInfo")]
pub fn get_info() -> Result<(usize, usize)> {
    let (mut free, mut total) = (0usize, 0usize);
    driver_call!(cuMemGetInfo_v2(&mut free, &mut total))?;
    Ok((free, total))
}

/// `cuMemHostAlloc`: page-locked host memory.
///
/// # Errors
/// The driver's error.
#[doc(alias = "cuMemHostAlloc")]
pub fn host_alloc(bytes: usize, flags: u32) -> Result<*mut c_void> {
    let mut ptr: *mut c_void = std::ptr::null_mut();
    driver_call!(cuMemHostAlloc(&mut ptr, bytes, flags))?;
    Ok(ptr)
}

/// `cuMemFreeHost`.
///
/// # Safety
/// - `ptr` came from [`host_alloc`], is freed once, and no pending work uses it.
#[doc(alias = "cuMemFreeHost")]
pub unsafe fn free_host(ptr: *mut c_void) -> Result<()> {
    driver_call!(cuMemFreeHost(ptr))
}

/// `cuMemHostRegister_v2`: pins `bytes` of host memory at `ptr` (page-locked, mapped for every
/// device with `CU_MEMHOSTREGISTER_DEVICEMAP`, for every context with
/// `CU_MEMHOSTREGISTER_PORTABLE`).
///
/// # Safety
/// - `ptr` is mapped for `bytes` bytes until [`host_unregister`] (which must come first).
#[doc(alias = "cuMemHostRegister")]
pub unsafe fn host_register(ptr: *mut c_void, bytes: usize, flags: u32) -> Result<()> {
    driver_call!(cuMemHostRegister_v2(ptr, bytes, flags))
}

/// `cuMemHostUnregister`.
///
/// # Safety
/// - `ptr` was registered by [`host_register`], is unregistered once, and no pending work uses
///   it.
#[doc(alias = "cuMemHostUnregister")]
pub unsafe fn host_unregister(ptr: *mut c_void) -> Result<()> {
    driver_call!(cuMemHostUnregister(ptr))
}

/// `cuMemHostGetDevicePointer_v2`: the device address of registered (or pinned) host memory in
/// the current context.
///
/// # Errors
/// The driver's error (`CUDA_ERROR_INVALID_VALUE` for memory that is not registered).
#[doc(alias = "cuMemHostGetDevicePointer")]
pub fn host_device_pointer(ptr: *mut c_void) -> Result<CUdeviceptr> {
    let mut device: CUdeviceptr = 0;
    driver_call!(cuMemHostGetDevicePointer_v2(&mut device, ptr, 0))?;
    Ok(device)
}

/// `cuMemcpyAsync`: `bytes` between two unified addresses (any devices, or pinned host), on
/// `stream`.
///
/// # Safety
/// - Both ranges are valid for `bytes` until the copy completes; `stream` is live.
#[doc(alias = "cuMemcpyAsync")]
#[inline(always)]
pub unsafe fn memcpy_async(dst: CUdeviceptr, src: CUdeviceptr, bytes: usize, stream: CUstream) -> Result<()> {
    driver_call!(cuMemcpyAsync(dst, src, bytes, stream))
}

/// `cuMemcpyPeerAsync`: `bytes` from `src` in `src_ctx` to `dst` in `dst_ctx`, on `stream`.
///
/// # Safety
/// - Both ranges are valid for `bytes` until the copy completes; contexts and `stream` are live.
#[doc(alias = "cuMemcpyPeerAsync")]
#[inline]
pub unsafe fn memcpy_peer_async(
    dst: CUdeviceptr,
    dst_ctx: CUcontext,
    src: CUdeviceptr,
    src_ctx: CUcontext,
    bytes: usize,
    stream: CUstream,
) -> Result<()> {
    driver_call!(cuMemcpyPeerAsync(dst, dst_ctx, src, src_ctx, bytes, stream))
}

/// `cuMemcpyHtoDAsync_v2`.
///
/// # Safety
/// - `src` is readable for `bytes` until the copy completes (pageable memory is copied before
///   the call returns; pinned memory is read later); `dst` is valid; `stream` is live.
#[doc(alias = "cuMemcpyHtoDAsync")]
#[inline(always)]
pub unsafe fn memcpy_htod_async(dst: CUdeviceptr, src: *const c_void, bytes: usize, stream: CUstream) -> Result<()> {
    driver_call!(cuMemcpyHtoDAsync_v2(dst, src, bytes, stream))
}

/// `cuMemcpyDtoHAsync_v2`.
///
/// # Safety
/// - `dst` is writable for `bytes` until the copy completes and nothing reads it before; `src`
///   is valid; `stream` is live.
#[doc(alias = "cuMemcpyDtoHAsync")]
#[inline(always)]
pub unsafe fn memcpy_dtoh_async(dst: *mut c_void, src: CUdeviceptr, bytes: usize, stream: CUstream) -> Result<()> {
    driver_call!(cuMemcpyDtoHAsync_v2(dst, src, bytes, stream))
}

/// `cuMemsetD32Async`: `count` 32-bit words set to `value`.
///
/// # Safety
/// - `dst` is valid for `4 * count` bytes and 4-byte aligned; `stream` is live.
#[doc(alias = "cuMemsetD32Async")]
pub unsafe fn memset_d32_async(dst: CUdeviceptr, value: u32, count: usize, stream: CUstream) -> Result<()> {
    driver_call!(cuMemsetD32Async(dst, value, count, stream))
}

/// `cuMemsetD8Async`: `count` bytes set to `value`.
///
/// # Safety
/// - `dst` is valid for `count` bytes; `stream` is live.
#[doc(alias = "cuMemsetD8Async")]
pub unsafe fn memset_d8_async(dst: CUdeviceptr, value: u8, count: usize, stream: CUstream) -> Result<()> {
    driver_call!(cuMemsetD8Async(dst, value, count, stream))
}

/// `cuPointerGetAttributes(CU_POINTER_ATTRIBUTE_MEMORY_TYPE)`: the kind of memory at `ptr`, or
/// `None` for memory the driver does not know (pageable host memory). Unlike
/// `cuPointerGetAttribute`, the call succeeds for unknown addresses, so probing pageable memory
/// raises no driver error (which tools such as compute-sanitizer report).
///
/// # Errors
/// The driver's error.
#[doc(alias = "cuPointerGetAttributes")]
pub fn memory_type(ptr: CUdeviceptr) -> Result<Option<CUmemorytype>> {
    let mut kind: u32 = 0;
    let mut attribute = CUpointer_attribute::CU_POINTER_ATTRIBUTE_MEMORY_TYPE;
    let mut data = [(&raw mut kind).cast::<c_void>()];
    driver_call!(cuPointerGetAttributes(1, &mut attribute, data.as_mut_ptr(), ptr))?;
    Ok((kind != 0).then_some(CUmemorytype(kind)))
}
