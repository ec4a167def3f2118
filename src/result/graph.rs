//! Stream capture and graphs: begin and end a capture, instantiate, upload, launch and update an
//! executable graph, destroy both, and the external event record and wait of a capture. Stateless
//! and thread-safe like the driver calls they make.

use super::driver_call;
use crate::cuda_error::Result;
use crate::sys::{
    CUevent, CUevent_record_flags, CUevent_wait_flags, CUgraph, CUgraphExec, CUgraphExecUpdateResultInfo, CUstream,
    CUstreamCaptureMode, CUstreamCaptureStatus,
};

/// `cuStreamBeginCapture_v2`: work enqueued on `stream` from now on is recorded, not run.
///
/// # Safety
/// - `stream` is a live stream that is not the legacy default stream and is not capturing.
#[doc(alias = "cuStreamBeginCapture")]
pub unsafe fn begin_capture(stream: CUstream, mode: CUstreamCaptureMode) -> Result<()> {
    driver_call!(cuStreamBeginCapture_v2(stream, mode))
}

/// `cuStreamEndCapture`: ends the capture and returns its graph (an invalidated capture ends with
/// an error and no graph).
///
/// # Safety
/// - `stream` is a live stream capturing in a capture this thread began (or any thread, for a
///   relaxed capture).
#[doc(alias = "cuStreamEndCapture")]
pub unsafe fn end_capture(stream: CUstream) -> Result<CUgraph> {
    let mut graph: CUgraph = std::ptr::null_mut();
    driver_call!(cuStreamEndCapture(stream, &mut graph))?;
    Ok(graph)
}

/// `cuStreamIsCapturing`: whether `stream` is capturing (a capture active or invalidated and not
/// yet ended).
///
/// # Safety
/// - `stream` is a live stream that is not the legacy default stream.
#[doc(alias = "cuStreamIsCapturing")]
pub unsafe fn is_capturing(stream: CUstream) -> Result<bool> {
    let mut status = CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE;
    driver_call!(cuStreamIsCapturing(stream, &mut status))?;
    Ok(status != CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE)
}

/// `cuGraphInstantiateWithFlags` with no flags.
///
/// # Safety
/// - `graph` is a live graph.
#[doc(alias = "cuGraphInstantiate")]
pub unsafe fn instantiate(graph: CUgraph) -> Result<CUgraphExec> {
    let mut exec: CUgraphExec = std::ptr::null_mut();
    driver_call!(cuGraphInstantiateWithFlags(&mut exec, graph, 0))?;
    Ok(exec)
}

/// `cuGraphUpload`: prepares `exec`'s device resources on `stream` ahead of its first launch.
///
/// # Safety
/// - `exec` and `stream` are live and of the same context.
#[doc(alias = "cuGraphUpload")]
pub unsafe fn upload(exec: CUgraphExec, stream: CUstream) -> Result<()> {
    driver_call!(cuGraphUpload(exec, stream))
}

/// `cuGraphLaunch`: enqueues one run of `exec` on `stream`.
///
/// # Safety
/// - `exec` and `stream` are live and of the same context.
/// - Every memory the graph's nodes use is valid, and ordered, for the time the run can take.
#[doc(alias = "cuGraphLaunch")]
#[inline]
pub unsafe fn launch(exec: CUgraphExec, stream: CUstream) -> Result<()> {
    driver_call!(cuGraphLaunch(exec, stream))
}

/// `cuGraphExecUpdate_v2`: gives `exec` the node parameters of `graph` (of the same topology).
/// On failure the driver's explanation is returned beside the error.
///
/// # Safety
/// - `exec` and `graph` are live; no run of `exec` is being enqueued concurrently.
#[doc(alias = "cuGraphExecUpdate")]
pub unsafe fn exec_update(
    exec: CUgraphExec,
    graph: CUgraph,
) -> std::result::Result<(), (crate::cuda_error::CudaError, CUgraphExecUpdateResultInfo)> {
    let mut info = CUgraphExecUpdateResultInfo::default();
    let result = (|| driver_call!(cuGraphExecUpdate_v2(exec, graph, &mut info)))();
    result.map_err(|e| (e, info))
}

/// `cuGraphGetNodes` asking for the count only: how many nodes `graph` has.
///
/// # Safety
/// - `graph` is a live graph.
#[doc(alias = "cuGraphGetNodes")]
pub unsafe fn node_count(graph: CUgraph) -> Result<usize> {
    let mut count = 0usize;
    driver_call!(cuGraphGetNodes(graph, std::ptr::null_mut(), &mut count))?;
    Ok(count)
}

/// `cuGraphDestroy`.
///
/// # Safety
/// - `graph` is live, owned by the caller and not used afterwards (its instantiations are
///   independent of it).
#[doc(alias = "cuGraphDestroy")]
pub unsafe fn destroy(graph: CUgraph) -> Result<()> {
    driver_call!(cuGraphDestroy(graph))
}

/// `cuGraphExecDestroy`.
///
/// # Safety
/// - `exec` is live, owned by the caller and not used afterwards (runs already enqueued
///   complete normally).
#[doc(alias = "cuGraphExecDestroy")]
pub unsafe fn exec_destroy(exec: CUgraphExec) -> Result<()> {
    driver_call!(cuGraphExecDestroy(exec))
}

/// `cuEventRecordWithFlags(.., CU_EVENT_RECORD_EXTERNAL)`: inside a capture, an event record
/// node that records `event` each time the graph runs.
///
/// # Safety
/// - `event` and `stream` are live and of the same context; `stream` is capturing.
#[doc(alias = "cuEventRecordWithFlags")]
pub unsafe fn record_external(event: CUevent, stream: CUstream) -> Result<()> {
    driver_call!(cuEventRecordWithFlags(event, stream, CUevent_record_flags::CU_EVENT_RECORD_EXTERNAL.0))
}

/// `cuStreamWaitEvent(.., CU_EVENT_WAIT_EXTERNAL)`: inside a capture, an event wait node that
/// waits for `event`'s last record each time the graph runs.
///
/// # Safety
/// - `event` and `stream` are live; `stream` is capturing.
#[doc(alias = "cuStreamWaitEvent")]
pub unsafe fn wait_external(stream: CUstream, event: CUevent) -> Result<()> {
    driver_call!(cuStreamWaitEvent(stream, event, CUevent_wait_flags::CU_EVENT_WAIT_EXTERNAL.0))
}
