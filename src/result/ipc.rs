//! Memory and events shared between processes: the virtual memory management calls
//! (`cuMemCreate`, export to and import from a POSIX file descriptor, reserve, map, access,
//! unmap, release), the legacy 64-byte memory handles (`cuIpcGetMemHandle`) and the interprocess
//! events' handles. Stateless and thread-safe like the driver calls they make; the `unsafe` ones
//! carry the driver's own contract.

use std::os::raw::{c_int, c_void};

use super::driver_call;
use crate::cuda_error::Result;
use crate::sys::{
    CUdevice, CUdeviceptr, CUevent, CUipcEventHandle, CUipcMem_flags, CUipcMemHandle, CUmemAccess_flags,
    CUmemAccessDesc, CUmemAllocationGranularity_flags, CUmemAllocationHandleType, CUmemAllocationProp,
    CUmemAllocationType, CUmemGenericAllocationHandle, CUmemLocation, CUmemLocationType,
};

/// The properties of pinned device memory on `device` that may be exported as a POSIX file
/// descriptor.
pub fn exportable_prop(device: CUdevice) -> CUmemAllocationProp {
    CUmemAllocationProp {
        type_: CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED,
        requestedHandleTypes: CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
        location: CUmemLocation { type_: CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE, id: device },
        ..CUmemAllocationProp::default()
    }
}

/// `cuMemGetAllocationGranularity` (the minimum granularity) for allocations of `prop`.
///
/// # Errors
/// The driver's error.
#[doc(alias = "cuMemGetAllocationGranularity")]
pub fn granularity(prop: &CUmemAllocationProp) -> Result<usize> {
    let mut bytes = 0usize;
    driver_call!(cuMemGetAllocationGranularity(
        &mut bytes,
        prop,
        CUmemAllocationGranularity_flags::CU_MEM_ALLOC_GRANULARITY_MINIMUM
    ))?;
    Ok(bytes)
}

/// `cuMemCreate`: physical memory of `bytes` (a multiple of the granularity) with `prop`.
///
/// # Errors
/// The driver's error.
#[doc(alias = "cuMemCreate")]
pub fn create(bytes: usize, prop: &CUmemAllocationProp) -> Result<CUmemGenericAllocationHandle> {
    let mut handle: CUmemGenericAllocationHandle = 0;
    driver_call!(cuMemCreate(&mut handle, bytes, prop, 0))?;
    Ok(handle)
}

/// `cuMemRelease`: drops this reference to the allocation; the memory goes once every mapping
/// of it is unmapped and every handle (exported ones included) is released.
///
/// # Safety
/// - `handle` came from [`create`] or [`import_fd`] and is released once.
#[doc(alias = "cuMemRelease")]
pub unsafe fn release(handle: CUmemGenericAllocationHandle) -> Result<()> {
    driver_call!(cuMemRelease(handle))
}

/// `cuMemExportToShareableHandle` as a POSIX file descriptor, which the caller then owns.
///
/// # Safety
/// - `handle` is live (not released) and was created exportable as a POSIX file descriptor.
#[doc(alias = "cuMemExportToShareableHandle")]
pub unsafe fn export_fd(handle: CUmemGenericAllocationHandle) -> Result<c_int> {
    let mut fd: c_int = -1;
    driver_call!(cuMemExportToShareableHandle(
        (&raw mut fd).cast::<c_void>(),
        handle,
        CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
        0
    ))?;
    Ok(fd)
}

/// `cuMemImportFromShareableHandle` of a POSIX file descriptor (which stays the caller's).
///
/// # Errors
/// The driver's error (`CUDA_ERROR_INVALID_VALUE` or `CUDA_ERROR_INVALID_HANDLE` for a
/// descriptor that is no exported allocation).
#[doc(alias = "cuMemImportFromShareableHandle")]
pub fn import_fd(fd: c_int) -> Result<CUmemGenericAllocationHandle> {
    let mut handle: CUmemGenericAllocationHandle = 0;
    // The handle type says the "pointer" is the descriptor's value, not an address.
    let os_handle = fd as isize as *mut c_void;
    driver_call!(cuMemImportFromShareableHandle(
        &mut handle,
        os_handle,
        CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
    ))?;
    Ok(handle)
}

/// `cuMemAddressReserve`: `bytes` of virtual address space, aligned to `alignment` (0: the
/// granularity).
///
/// # Errors
/// The driver's error.
#[doc(alias = "cuMemAddressReserve")]
pub fn address_reserve(bytes: usize, alignment: usize) -> Result<CUdeviceptr> {
    let mut ptr: CUdeviceptr = 0;
    driver_call!(cuMemAddressReserve(&mut ptr, bytes, alignment, 0, 0))?;
    Ok(ptr)
}

/// `cuMemAddressFree`.
///
/// # Safety
/// - `ptr`/`bytes` is a whole reservation of [`address_reserve`], nothing is mapped in it, and
///   it is freed once.
#[doc(alias = "cuMemAddressFree")]
pub unsafe fn address_free(ptr: CUdeviceptr, bytes: usize) -> Result<()> {
    driver_call!(cuMemAddressFree(ptr, bytes))
}

/// `cuMemMap`: maps `bytes` of `handle`'s memory (from offset 0) at `ptr`.
///
/// # Safety
/// - `ptr`/`bytes` lies in a reservation of [`address_reserve`] where nothing is mapped;
///   `handle` is live.
#[doc(alias = "cuMemMap")]
pub unsafe fn map(ptr: CUdeviceptr, bytes: usize, handle: CUmemGenericAllocationHandle) -> Result<()> {
    driver_call!(cuMemMap(ptr, bytes, 0, handle, 0))
}

/// `cuMemUnmap`.
///
/// # Safety
/// - `ptr`/`bytes` is a whole mapping made by [`map`], and no pending or later work uses it.
#[doc(alias = "cuMemUnmap")]
pub unsafe fn unmap(ptr: CUdeviceptr, bytes: usize) -> Result<()> {
    driver_call!(cuMemUnmap(ptr, bytes))
}

/// `cuMemSetAccess`: read and write access to `ptr`/`bytes` for `device`.
///
/// # Safety
/// - `ptr`/`bytes` is mapped (by [`map`]).
#[doc(alias = "cuMemSetAccess")]
pub unsafe fn set_access_read_write(ptr: CUdeviceptr, bytes: usize, device: CUdevice) -> Result<()> {
    let desc = CUmemAccessDesc {
        location: CUmemLocation { type_: CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE, id: device },
        flags: CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
    };
    driver_call!(cuMemSetAccess(ptr, bytes, &desc, 1))
}

/// `cuMemGetAddressRange_v2`: the base and size of the allocation that holds `ptr`.
///
/// # Errors
/// The driver's error (`CUDA_ERROR_NOT_FOUND` for an address of no allocation).
#[doc(alias = "cuMemGetAddressRange")]
pub fn address_range(ptr: CUdeviceptr) -> Result<(CUdeviceptr, usize)> {
    let (mut base, mut bytes): (CUdeviceptr, usize) = (0, 0);
    driver_call!(cuMemGetAddressRange_v2(&mut base, &mut bytes, ptr))?;
    Ok((base, bytes))
}

/// `cuIpcGetMemHandle`: the legacy 64-byte handle of a `cuMemAlloc` allocation.
///
/// # Safety
/// - `ptr` is the base of a live allocation of `cuMemAlloc` (not pool, not `cuMemCreate`).
#[doc(alias = "cuIpcGetMemHandle")]
pub unsafe fn get_mem_handle(ptr: CUdeviceptr) -> Result<CUipcMemHandle> {
    let mut handle = CUipcMemHandle::default();
    driver_call!(cuIpcGetMemHandle(&mut handle, ptr))?;
    Ok(handle)
}

/// `cuIpcOpenMemHandle_v2` with `CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS`, in the current context.
///
/// # Errors
/// The driver's error (a handle of this process, of a freed allocation, or no handle at all).
#[doc(alias = "cuIpcOpenMemHandle")]
pub fn open_mem_handle(handle: CUipcMemHandle) -> Result<CUdeviceptr> {
    let mut ptr: CUdeviceptr = 0;
    driver_call!(cuIpcOpenMemHandle_v2(&mut ptr, handle, CUipcMem_flags::CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS.0))?;
    Ok(ptr)
}

/// `cuIpcCloseMemHandle`.
///
/// # Safety
/// - `ptr` came from [`open_mem_handle`], is closed once, and no pending or later work uses it.
#[doc(alias = "cuIpcCloseMemHandle")]
pub unsafe fn close_mem_handle(ptr: CUdeviceptr) -> Result<()> {
    driver_call!(cuIpcCloseMemHandle(ptr))
}

/// `cuEventCreate` with `CU_EVENT_INTERPROCESS | CU_EVENT_DISABLE_TIMING` in the current context.
///
/// # Errors
/// The driver's error.
#[doc(alias = "cuEventCreate")]
pub fn create_interprocess_event() -> Result<CUevent> {
    use crate::sys::CUevent_flags;
    let flags = CUevent_flags::CU_EVENT_INTERPROCESS.0 | CUevent_flags::CU_EVENT_DISABLE_TIMING.0;
    let mut event: CUevent = std::ptr::null_mut();
    driver_call!(cuEventCreate(&mut event, flags))?;
    Ok(event)
}

/// `cuIpcGetEventHandle`.
///
/// # Safety
/// - `event` is live and was created interprocess ([`create_interprocess_event`]).
#[doc(alias = "cuIpcGetEventHandle")]
pub unsafe fn get_event_handle(event: CUevent) -> Result<CUipcEventHandle> {
    let mut handle = CUipcEventHandle::default();
    driver_call!(cuIpcGetEventHandle(&mut handle, event))?;
    Ok(handle)
}

/// `cuIpcOpenEventHandle` in the current context; the event is destroyed with
/// `cuEventDestroy` like any other.
///
/// # Errors
/// The driver's error.
#[doc(alias = "cuIpcOpenEventHandle")]
pub fn open_event_handle(handle: CUipcEventHandle) -> Result<CUevent> {
    let mut event: CUevent = std::ptr::null_mut();
    driver_call!(cuIpcOpenEventHandle(&mut event, handle))?;
    Ok(event)
}
