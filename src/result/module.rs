//! Modules and kernel launch: load PTX, find a function, launch, unload. Stateless and
//! thread-safe like the driver calls they make.

use std::ffi::{CStr, c_void};

use super::driver_call;
use crate::cuda_error::Result;
use crate::sys::{CUfunction, CUmodule, CUstream};

/// `cuModuleLoadData`: loads a NUL-terminated PTX (or cubin) image into the current context.
///
/// # Errors
/// The driver's error (`CUDA_ERROR_INVALID_PTX`, `CUDA_ERROR_UNSUPPORTED_PTX_VERSION`, ...).
#[doc(alias = "cuModuleLoadData")]
pub fn load_data(image: &CStr) -> Result<CUmodule> {
    let mut module: CUmodule = std::ptr::null_mut();
    driver_call!(cuModuleLoadData(&mut module, image.as_ptr().cast::<c_void>()))?;
    Ok(module)
}

/// `cuModuleLoadData` of a binary image (a cubin or a fatbin).
///
/// # Safety
/// `image` points at a whole, well-formed cubin or fatbin (the driver reads it without a length:
/// every size its headers state lies within the image), aligned to 8 bytes.
#[doc(alias = "cuModuleLoadData")]
pub unsafe fn load_binary(image: *const u8) -> Result<CUmodule> {
    let mut module: CUmodule = std::ptr::null_mut();
    driver_call!(cuModuleLoadData(&mut module, image.cast::<c_void>()))?;
    Ok(module)
}

/// `cuModuleUnload`.
///
/// # Safety
/// - `module` is live, owned by the caller, and none of its functions runs or is used afterwards.
#[doc(alias = "cuModuleUnload")]
pub unsafe fn unload(module: CUmodule) -> Result<()> {
    driver_call!(cuModuleUnload(module))
}

/// `cuModuleGetFunction`.
///
/// # Safety
/// - `module` is live.
#[doc(alias = "cuModuleGetFunction")]
pub unsafe fn get_function(module: CUmodule, name: &CStr) -> Result<CUfunction> {
    let mut function: CUfunction = std::ptr::null_mut();
    driver_call!(cuModuleGetFunction(&mut function, module, name.as_ptr()))?;
    Ok(function)
}

/// `cuLaunchKernel`.
///
/// # Safety
/// - `function` and `stream` are live and of the same context.
/// - `params` holds one pointer per kernel parameter, in order, each to a value of exactly that
///   parameter's type, valid for the duration of the call.
/// - Every device pointer passed stays valid until the kernel completes, and accesses no more
///   than the memory it owns.
#[doc(alias = "cuLaunchKernel")]
#[inline(always)]
pub unsafe fn launch_kernel(
    function: CUfunction,
    grid: (u32, u32, u32),
    block: (u32, u32, u32),
    shared_mem_bytes: u32,
    stream: CUstream,
    params: &mut [*mut c_void],
) -> Result<()> {
    // SAFETY: the caller's contract, unchanged.
    unsafe { launch_kernel_dims(function, &grid, &block, &shared_mem_bytes, stream, params) }
}

/// [`launch_kernel`] with the dimensions by reference: read where the call is made (a launch's
/// configuration is then read after the driver's entry point, not held across its lookup).
///
/// # Safety
/// As [`launch_kernel`].
#[inline(always)]
pub(crate) unsafe fn launch_kernel_dims(
    function: CUfunction,
    grid: &(u32, u32, u32),
    block: &(u32, u32, u32),
    shared_mem_bytes: &u32,
    stream: CUstream,
    params: &mut [*mut c_void],
) -> Result<()> {
    driver_call!(cuLaunchKernel(
        function,
        grid.0,
        grid.1,
        grid.2,
        block.0,
        block.1,
        block.2,
        *shared_mem_bytes,
        stream,
        params.as_mut_ptr(),
        std::ptr::null_mut(),
    ))
}
