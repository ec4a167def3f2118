//! Streams: create, destroy, synchronise, query, wait on an event. Stateless and thread-safe
//! like the driver calls they make.

use super::driver_call;
use crate::cuda_error::Result;
use crate::sys::{CUevent, CUstream, CUstream_flags};

/// `cuStreamCreate` with `CU_STREAM_NON_BLOCKING` in the current context.
///
/// # Errors
/// The driver's error.
#[doc(alias = "cuStreamCreate")]
pub fn create_non_blocking() -> Result<CUstream> {
    let mut stream: CUstream = std::ptr::null_mut();
    driver_call!(cuStreamCreate(&mut stream, CUstream_flags::CU_STREAM_NON_BLOCKING.0))?;
    Ok(stream)
}

/// `cuStreamDestroy_v2`.
///
/// # Safety
/// - `stream` is a live stream owned by the caller and is not used afterwards.
#[doc(alias = "cuStreamDestroy")]
pub unsafe fn destroy(stream: CUstream) -> Result<()> {
    driver_call!(cuStreamDestroy_v2(stream))
}

/// `cuStreamSynchronize`.
///
/// # Safety
/// - `stream` is a live stream.
#[doc(alias = "cuStreamSynchronize")]
pub unsafe fn synchronize(stream: CUstream) -> Result<()> {
    driver_call!(cuStreamSynchronize(stream))
}

/// `cuStreamQuery`: `Ok(true)` when all work is done, `Ok(false)` while some is pending.
///
/// # Safety
/// - `stream` is a live stream.
#[doc(alias = "cuStreamQuery")]
pub unsafe fn query(stream: CUstream) -> Result<bool> {
    super::ready(driver_call!(cuStreamQuery(stream)))
}

/// `cuStreamWaitEvent`: later work on `stream` waits for `event`'s last record.
///
/// # Safety
/// - `stream` and `event` are live.
#[doc(alias = "cuStreamWaitEvent")]
#[inline]
pub unsafe fn wait_event(stream: CUstream, event: CUevent) -> Result<()> {
    driver_call!(cuStreamWaitEvent(stream, event, 0))
}
