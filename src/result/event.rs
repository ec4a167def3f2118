//! Events: create, record, query, synchronise, elapsed time, destroy. Stateless and
//! thread-safe like the driver calls they make.

use super::driver_call;
use crate::cuda_error::Result;
use crate::sys::{CUevent, CUevent_flags, CUstream};

/// `cuEventCreate` in the current context; `timing` keeps timestamps (slower to record).
///
/// # Errors
/// The driver's error.
#[doc(alias = "cuEventCreate")]
pub fn create(timing: bool) -> Result<CUevent> {
    let flags = if timing { CUevent_flags::CU_EVENT_DEFAULT } else { CUevent_flags::CU_EVENT_DISABLE_TIMING };
    let mut event: CUevent = std::ptr::null_mut();
    driver_call!(cuEventCreate(&mut event, flags.0))?;
    Ok(event)
}

/// `cuEventDestroy_v2`.
///
/// # Safety
/// - `event` is live, owned by the caller and not used afterwards (pending records are fine).
#[doc(alias = "cuEventDestroy")]
pub unsafe fn destroy(event: CUevent) -> Result<()> {
    driver_call!(cuEventDestroy_v2(event))
}

/// `cuEventRecord`.
///
/// # Safety
/// - `event` and `stream` are live and belong to the same context.
#[doc(alias = "cuEventRecord")]
#[inline(always)]
pub unsafe fn record(event: CUevent, stream: CUstream) -> Result<()> {
    driver_call!(cuEventRecord(event, stream))
}

/// `cuEventQuery`: `Ok(true)` once the recorded work is done.
///
/// # Safety
/// - `event` is live.
#[doc(alias = "cuEventQuery")]
pub unsafe fn query(event: CUevent) -> Result<bool> {
    super::ready(driver_call!(cuEventQuery(event)))
}

/// `cuEventSynchronize`.
///
/// # Safety
/// - `event` is live.
#[doc(alias = "cuEventSynchronize")]
pub unsafe fn synchronize(event: CUevent) -> Result<()> {
    driver_call!(cuEventSynchronize(event))
}

/// `cuEventElapsedTime_v2`: milliseconds from `start` to `end`.
///
/// # Safety
/// - Both events are live, were created with timing and have completed records.
#[doc(alias = "cuEventElapsedTime")]
pub unsafe fn elapsed_ms(start: CUevent, end: CUevent) -> Result<f32> {
    let mut ms = 0f32;
    driver_call!(cuEventElapsedTime_v2(&mut ms, start, end))?;
    Ok(ms)
}
