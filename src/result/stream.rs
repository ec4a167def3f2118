//! Streams: create, destroy, synchronise, query, wait on an event. Stateless and thread-safe
//! like the driver calls they make.

use super::driver_call;
use crate::cuda_error::Result;
use crate::sys::{CUdeviceptr, CUevent, CUstream, CUstream_flags};

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
#[inline(always)]
pub unsafe fn wait_event(stream: CUstream, event: CUevent) -> Result<()> {
    driver_call!(cuStreamWaitEvent(stream, event, 0))
}

/// `cuStreamWriteValue64_v2`: writes `value` to the 8 bytes at `addr` once the stream's earlier
/// work is done.
///
/// # Safety
/// - `stream` is live; `addr` is 8-byte aligned device memory the stream's device may write,
///   live until the write has run.
#[doc(alias = "cuStreamWriteValue64")]
pub unsafe fn write_value_64(stream: CUstream, addr: CUdeviceptr, value: u64, flags: u32) -> Result<()> {
    driver_call!(cuStreamWriteValue64_v2(stream, addr, value, flags))
}

/// `cuStreamWaitValue64_v2`: later work on `stream` waits until the 8 bytes at `addr` meet the
/// condition `flags` names against `value`.
///
/// # Safety
/// - `stream` is live; `addr` is 8-byte aligned device memory the stream's device may read, live
///   until the wait has run.
#[doc(alias = "cuStreamWaitValue64")]
pub unsafe fn wait_value_64(stream: CUstream, addr: CUdeviceptr, value: u64, flags: u32) -> Result<()> {
    driver_call!(cuStreamWaitValue64_v2(stream, addr, value, flags))
}
