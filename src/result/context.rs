//! Primary contexts and the calling thread's current context. Stateless; the current context is
//! the driver's per-thread state.

use super::driver_call;
use crate::cuda_error::Result;
use crate::sys::{CUcontext, CUdevice};

/// `cuDevicePrimaryCtxRetain`: the device's primary context, its reference count raised.
///
/// # Errors
/// The driver's error.
#[doc(alias = "cuDevicePrimaryCtxRetain")]
pub fn primary_retain(device: CUdevice) -> Result<CUcontext> {
    let mut ctx: CUcontext = std::ptr::null_mut();
    driver_call!(cuDevicePrimaryCtxRetain(&mut ctx, device))?;
    Ok(ctx)
}

/// `cuDevicePrimaryCtxRelease_v2`: drops one reference taken by [`primary_retain`].
///
/// # Safety
/// - One reference from [`primary_retain`] on `device` is given up; nothing of this crate's may
///   use the context through that reference afterwards.
#[doc(alias = "cuDevicePrimaryCtxRelease")]
pub unsafe fn primary_release(device: CUdevice) -> Result<()> {
    driver_call!(cuDevicePrimaryCtxRelease_v2(device))
}

/// `cuCtxSetCurrent`: binds `ctx` on the calling thread.
///
/// # Safety
/// - `ctx` is a live context (or null, which unbinds).
#[doc(alias = "cuCtxSetCurrent")]
#[inline]
pub unsafe fn set_current(ctx: CUcontext) -> Result<()> {
    driver_call!(cuCtxSetCurrent(ctx))
}

/// `cuCtxGetCurrent`: the context bound on the calling thread (null when none).
///
/// # Errors
/// The driver's error.
#[doc(alias = "cuCtxGetCurrent")]
#[inline(always)]
pub fn get_current() -> Result<CUcontext> {
    let mut ctx: CUcontext = std::ptr::null_mut();
    driver_call!(cuCtxGetCurrent(&mut ctx))?;
    Ok(ctx)
}

/// `cuCtxSynchronize`: waits for all work of the current context.
///
/// # Errors
/// The driver's error.
#[doc(alias = "cuCtxSynchronize")]
pub fn synchronize() -> Result<()> {
    driver_call!(cuCtxSynchronize())
}

/// `cuCtxEnablePeerAccess`: lets the current context access `peer`'s memory.
///
/// # Safety
/// - `peer` is a live context.
#[doc(alias = "cuCtxEnablePeerAccess")]
pub unsafe fn enable_peer_access(peer: CUcontext) -> Result<()> {
    driver_call!(cuCtxEnablePeerAccess(peer, 0))
}
