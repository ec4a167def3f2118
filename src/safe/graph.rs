//! Stream capture and CUDA graphs: [`StreamCapture`] (the guard of one capture, and
//! `CudaStream::begin_capture`, which makes it), [`CudaGraph`], [`GraphExec`]. Which captures are
//! active, and what they refuse or hold back, is the capture registry's (`capture`).
//!
//! Under capture, a copy, memset or launch on the capturing stream is recorded into the graph
//! instead of running, and the crate's ordering rule applies to the graph as a whole: the buffers
//! the captured work touches (its *footprint*, with how each is used) are ordered when the graph
//! is launched, as one operation on the launch stream — the launch waits for their last writes
//! (and, for buffers it writes, the reads since), and afterwards they are marked as used by the
//! launch stream. The graph holds each footprint allocation alive, so freeing a slice cannot free
//! memory a graph may still run on; the free waits for every launch.
//!
//! Calls that cannot be part of a graph are refused while a capture they would break is active
//! (on the capturing stream, or on the capturing thread, or on any thread, by the capture's
//! [`CaptureMode`]), and the capture is then invalidated: ending it gives
//! [`CaptureError::Invalidated`]. Frees that would land in a capture or break it are held back
//! and done when the capture ends (see `capture`).
//!
//! Threading: a [`StreamCapture`] stays on the thread that began it (the driver requires the end
//! on that thread for non-relaxed captures); graphs and executable graphs are `Send` and used
//! through `&mut` where the driver does not synchronise them. Work another thread enqueues on a
//! stream while it is captured lands in the capture (and its buffers in the graph's footprint);
//! a capture's begin and end wait for calls on the stream in progress, so each call lands wholly
//! inside or wholly outside (see `CudaStream::enqueue_gate`). Work on other streams that needs a
//! buffer last used on the capturing stream before the capture waits for that use, never for the
//! captured work.

use std::fmt;
use std::marker::PhantomData;
use std::sync::Arc;

use super::capture::{self, CaptureMode, CaptureState, Recorded};
use super::context::Context;
use super::element::DeviceRepr;
use super::event::CudaEvent;
use super::memory::{CudaViewMut, DeviceMemory};
use super::ordering::{Access, Use};
use super::stream::CudaStream;
use crate::cuda_error::{CaptureError, CudaError, Result};
use crate::result::graph as raw;
use crate::sys::{CUgraph, CUgraphExec, CUgraphExecUpdateResult, CUresult};

/// An active capture of one stream; [`end`](Self::end) it to get the graph. Dropping it without
/// ending discards what was captured. Stays on the thread that began it.
///
/// ```no_run
/// use ppnrt::{CaptureMode, CudaSlice, CudaStream};
/// # fn main() -> ppnrt::Result<()> {
/// let engine = ppnrt::Engine::new(0)?;
/// let stream = CudaStream::new(engine.context())?;
/// // Memory a graph uses is allocated before the capture (an allocation cannot be captured).
/// let x = engine.htod(&[1.0f32; 256])?;
/// let mut y = CudaSlice::<f32>::alloc_persistent(&stream, 256)?;
/// let capture = stream.begin_capture(CaptureMode::ThreadLocal)?;
/// stream.memcpy_dtod(&x, &mut y)?; // recorded, not run
/// let graph = capture.end()?;
/// let mut step = graph.instantiate()?;
/// step.launch(&stream)?; // runs the copy
/// # Ok(()) }
/// ```
#[must_use = "a capture records work until it is ended"]
pub struct StreamCapture {
    stream: Arc<CudaStream>,
    state: Arc<CaptureState>,
    ended: bool,
    _same_thread: PhantomData<*const ()>,
}

impl CudaStream {
    /// Begins capturing this stream into a graph: until the capture ends, copies, memsets and
    /// launches enqueued on this stream (from any thread) are recorded instead of run. Engine
    /// operations under an ambient-stream override of this stream land in the capture too.
    ///
    /// # Errors
    /// [`CaptureError::CannotBegin`] when the stream is capturing already, is the legacy default
    /// stream, or has another library's buffer lent on it for a scope (the cudarc interop's
    /// `EngineStream` lends); the driver's error.
    #[doc(alias = "cuStreamBeginCapture")]
    pub fn begin_capture(self: &Arc<Self>, mode: CaptureMode) -> Result<StreamCapture> {
        if self.raw().is_null() {
            return Err(CudaError::Capture(CaptureError::CannotBegin { reason: "the legacy default stream" }));
        }
        let _bound = self.context().bind()?;
        let claimed = self.claim_capture(
            || {
                // SAFETY: the stream is live, not the legacy stream, and not capturing (checked
                // under its capture lock, which is held).
                unsafe { raw::begin_capture(self.raw(), mode.raw()) }
            },
            |before| Arc::new(CaptureState::new(mode, before)),
        )?;
        let Some(state) = claimed else {
            return Err(CudaError::Capture(CaptureError::CannotBegin { reason: "the stream is capturing already" }));
        };
        capture::register(&state);
        Ok(StreamCapture { stream: Arc::clone(self), state, ended: false, _same_thread: PhantomData })
    }
}

impl StreamCapture {
    /// The captured stream.
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    /// Adds an event record node: each run of the graph records `event` at this point (an event
    /// of the stream's device; other streams and graphs may wait on it).
    ///
    /// # Errors
    /// [`CudaError::WrongDevice`] for an event of another device; the driver's error.
    #[doc(alias = "cuEventRecordWithFlags")]
    pub fn record_external(&self, event: &CudaEvent) -> Result<()> {
        if event.ordinal() != self.stream.ordinal() {
            return Err(CudaError::WrongDevice {
                what: "StreamCapture::record_external: the event must be on the stream's device",
                expected: self.stream.ordinal(),
                found: event.ordinal(),
            });
        }
        let _bound = self.stream.context().bind()?;
        // SAFETY: both handles are live and of one context; the stream is capturing.
        unsafe { raw::record_external(event.raw(), self.stream.raw()) }
    }

    /// Adds an event wait node: each run of the graph waits here for `event`'s last record
    /// before it was launched. The event must be of the stream's device (the driver refuses a
    /// wait node on another device's event inside a capture; order a launch after another
    /// device's work on the launch stream instead, as [`GraphExec::launch`] does for buffers).
    ///
    /// # Errors
    /// [`CudaError::WrongDevice`] for an event of another device; the driver's error.
    #[doc(alias = "cuStreamWaitEvent")]
    pub fn wait_external(&self, event: &CudaEvent) -> Result<()> {
        if event.ordinal() != self.stream.ordinal() {
            return Err(CudaError::WrongDevice {
                what: "StreamCapture::wait_external: the event must be on the stream's device",
                expected: self.stream.ordinal(),
                found: event.ordinal(),
            });
        }
        let _bound = self.stream.context().bind()?;
        // SAFETY: both handles are live; the stream is capturing.
        unsafe { raw::wait_external(self.stream.raw(), event.raw()) }
    }

    /// Ends the capture and returns its graph.
    ///
    /// # Errors
    /// [`CaptureError::Invalidated`] when a call during the capture could not be captured (no
    /// graph; the stream is usable again); the driver's error.
    #[doc(alias = "cuStreamEndCapture")]
    pub fn end(mut self) -> Result<CudaGraph> {
        let (graph, recorded) = self.finish();
        let raw_graph = graph?;
        let mut graph = CudaGraph {
            raw: raw_graph,
            ctx: Arc::clone(self.stream.context()),
            footprint: recorded.footprint,
            nodes: 0,
            _not_sync: PhantomData,
        };
        graph.nodes = {
            let _bound = graph.ctx.bind()?;
            // SAFETY: the graph was just made by the driver and is owned here.
            unsafe { raw::node_count(graph.raw)? }
        };
        match recorded.invalidated_by {
            // The driver may have kept going after a refused call that never reached it: the
            // graph is still dropped, as the capture misses that call's work.
            Some(call) => Err(CudaError::Capture(CaptureError::Invalidated { call: call.to_string() })),
            None => Ok(graph),
        }
    }

    /// Ends the driver's capture and unregisters it (once); returns the raw graph and the record.
    /// Deferred frees run here, after the stream stopped capturing.
    fn finish(&mut self) -> (Result<CUgraph>, Recorded) {
        self.ended = true;
        let ended = self.stream.release_capture(|| end_driver_capture(&self.stream));
        capture::unregister(&self.state);
        let mut recorded = self.state.take_recorded();
        let graph = match ended {
            Ok(graph) => Ok(graph),
            Err(CudaError::Driver(e)) if e.code == CUresult::CUDA_ERROR_STREAM_CAPTURE_INVALIDATED => {
                Err(CudaError::Capture(CaptureError::Invalidated {
                    call: recorded.invalidated_by.map_or_else(|| e.to_string(), str::to_string),
                }))
            }
            Err(e) => Err(e),
        };
        // Frees held back during the capture happen now, in their streams' order.
        recorded.deferred_frees.clear();
        (graph, recorded)
    }
}

/// Ends the driver's capture of `stream` (capturing in a capture this thread began), however
/// the calls around it fail: a stream left capturing would refuse all its later work. The end is
/// made even when the stream's context cannot be bound (the stream names its context), and made
/// once more when it failed and the stream is still capturing; the first error stands when the
/// second end fails too. A failure the end gets over (the bind, or a first end the second makes
/// good) is recorded for [`take_drop_errors`](crate::take_drop_errors).
fn end_driver_capture(stream: &CudaStream) -> Result<CUgraph> {
    let bound = stream.context().bind();
    // SAFETY: the stream is live and capturing in this capture, begun on this thread
    // (StreamCapture is not Send) or relaxed.
    let ended = match unsafe { raw::end_capture(stream.raw()) } {
        Err(CudaError::Driver(first)) if first.code != CUresult::CUDA_ERROR_STREAM_CAPTURE_INVALIDATED => {
            // SAFETY: the stream is live and not the legacy stream (captures refuse it).
            let still_capturing = !matches!(unsafe { raw::is_capturing(stream.raw()) }, Ok(false));
            if still_capturing {
                // SAFETY: as the first end: the stream was capturing in this capture and, by the
                // query (or its failure), may still be; the driver refuses with an error the end
                // of a stream that no longer captures.
                match unsafe { raw::end_capture(stream.raw()) } {
                    Ok(graph) => {
                        super::record_drop_error(CudaError::Driver(first));
                        Ok(graph)
                    }
                    Err(_) => Err(CudaError::Driver(first)),
                }
            } else {
                Err(CudaError::Driver(first))
            }
        }
        other => other,
    };
    match bound {
        Ok(guard) => drop(guard),
        Err(e) => super::record_drop_error(e),
    }
    ended
}

impl Drop for StreamCapture {
    fn drop(&mut self) {
        if self.ended {
            return;
        }
        if let (Ok(graph), _) = self.finish() {
            // SAFETY: the graph was just made by the driver and is owned here.
            if let Err(e) = unsafe { raw::destroy(graph) } {
                super::record_drop_error(e);
            }
        }
    }
}

impl fmt::Debug for StreamCapture {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("StreamCapture").field("stream", &self.stream.raw()).field("mode", &self.state.mode()).finish()
    }
}

/// A captured graph: instantiate it to run it.
///
/// ```no_run
/// use ppnrt::{CaptureMode, CudaSlice, CudaStream};
/// # fn main() -> ppnrt::Result<()> {
/// # let engine = ppnrt::Engine::new(0)?;
/// let stream = CudaStream::new(engine.context())?;
/// let mut y = CudaSlice::<u32>::alloc_persistent(&stream, 256)?;
/// let capture = stream.begin_capture(CaptureMode::ThreadLocal)?;
/// stream.memset_u32(&mut y, 7)?;
/// let graph = capture.end()?;
/// println!("{} node(s), holding {} buffer(s) alive", graph.node_count(), graph.footprint_len());
/// let exec = graph.instantiate()?; // as many as needed, from one graph
/// # drop(exec);
/// # Ok(()) }
/// ```
pub struct CudaGraph {
    raw: CUgraph,
    ctx: Arc<Context>,
    footprint: Vec<(Arc<DeviceMemory>, Use)>,
    /// How many nodes the graph has.
    nodes: usize,
    _not_sync: PhantomData<std::cell::Cell<()>>,
}

// SAFETY: a CUgraph may be used from any thread as long as it is not used from two at once;
// CudaGraph is not Sync and every method that touches it takes `&self` of an unshared value.
unsafe impl Send for CudaGraph {}

impl CudaGraph {
    /// Instantiates the graph into an executable graph.
    ///
    /// # Errors
    /// The driver's error.
    #[doc(alias = "cuGraphInstantiate")]
    pub fn instantiate(&self) -> Result<GraphExec> {
        let _bound = self.ctx.bind()?;
        // SAFETY: the graph is live.
        let raw = unsafe { raw::instantiate(self.raw)? };
        Ok(GraphExec { raw, ctx: Arc::clone(&self.ctx), footprint: self.footprint.clone(), nodes: self.nodes })
    }

    /// How many nodes the graph has (each captured copy, memset and launch is one).
    pub fn node_count(&self) -> usize {
        self.nodes
    }

    /// How many allocations the captured work touches.
    pub fn footprint_len(&self) -> usize {
        self.footprint.len()
    }
}

impl Drop for CudaGraph {
    fn drop(&mut self) {
        let result = self.ctx.bind().and_then(|_bound| {
            // SAFETY: the graph is owned here and not used afterwards.
            unsafe { raw::destroy(self.raw) }
        });
        if let Err(e) = result {
            super::record_drop_error(e);
        }
    }
}

impl fmt::Debug for CudaGraph {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CudaGraph")
            .field("device", &self.ctx.ordinal())
            .field("footprint", &self.footprint.len())
            .finish()
    }
}

/// An executable graph: launch it on a stream of its device. It holds the memory its work touches
/// alive; every launch is ordered with the rest of the program's use of that memory by the
/// crate's ordering rule.
///
/// ```no_run
/// use ppnrt::{CaptureMode, CudaSlice, CudaStream};
/// # fn main() -> ppnrt::Result<()> {
/// # let engine = ppnrt::Engine::new(0)?;
/// let stream = CudaStream::new(engine.context())?;
/// let mut y = CudaSlice::<u32>::alloc_persistent(&stream, 256)?;
/// let capture = stream.begin_capture(CaptureMode::ThreadLocal)?;
/// stream.memset_u32(&mut y, 7)?;
/// let mut exec = capture.end()?.instantiate()?;
/// exec.upload(&stream)?; // optional: makes the first launch as cheap as the others
/// for _ in 0..100 {
///     exec.launch(&stream)?; // ordered against other uses of `y`, like any call
/// }
/// // A capture of the same shape with other values replaces the parameters in place.
/// let capture = stream.begin_capture(CaptureMode::ThreadLocal)?;
/// stream.memset_u32(&mut y, 8)?;
/// exec.update(&capture.end()?)?;
/// exec.launch(&stream)?;
/// assert!(engine.dtoh(&y)?.iter().all(|&v| v == 8));
/// # Ok(()) }
/// ```
pub struct GraphExec {
    raw: CUgraphExec,
    ctx: Arc<Context>,
    footprint: Vec<(Arc<DeviceMemory>, Use)>,
    /// How many nodes the graph it runs has.
    nodes: usize,
}

// SAFETY: a CUgraphExec may be used from any thread as long as it is not used from two at once;
// every method that touches it takes `&mut self` (or `&self` of methods that only read Rust
// state).
unsafe impl Send for GraphExec {}
// SAFETY: `&GraphExec` gives no access to the handle.
unsafe impl Sync for GraphExec {}

impl GraphExec {
    fn check_stream(&self, what: &'static str, stream: &CudaStream) -> Result<()> {
        if stream.ordinal() != self.ctx.ordinal() {
            return Err(CudaError::WrongDevice { what, expected: self.ctx.ordinal(), found: stream.ordinal() });
        }
        Ok(())
    }

    /// Uploads the graph's device resources on `stream` ahead of the first launch (optional; the
    /// first launch does it otherwise).
    ///
    /// # Errors
    /// [`CudaError::WrongDevice`] for a stream of another device; the driver's error.
    #[doc(alias = "cuGraphUpload")]
    pub fn upload(&mut self, stream: &Arc<CudaStream>) -> Result<()> {
        self.check_stream("GraphExec::upload: the stream must be on the graph's device", stream)?;
        let _gate = stream.enqueue_gate();
        stream.refuse_in_capture("GraphExec::upload")?;
        let _bound = self.ctx.bind()?;
        // SAFETY: both handles are live and of one context (checked above).
        unsafe { raw::upload(self.raw, stream.raw()) }
    }

    /// Enqueues one run of the graph on `stream`, ordered by the crate's rule: after the last
    /// writes (and, for memory the graph writes, the reads since) of everything it touches, and
    /// before their next conflicting use. A launch cannot be captured (the driver refuses it and
    /// invalidates the capture): on a capturing stream it is refused before anything is enqueued.
    /// Graphs that share memory may be launched from several threads at once: each launch is
    /// ordered after the ones whose bookkeeping came first, as if they were issued in turn.
    ///
    /// # Errors
    /// [`CudaError::WrongDevice`] for a stream of another device;
    /// [`CaptureError::IllegalCall`](crate::CaptureError::IllegalCall) on a capturing stream (the
    /// capture is invalidated, as the driver would); the driver's error.
    #[doc(alias = "cuGraphLaunch")]
    pub fn launch(&mut self, stream: &Arc<CudaStream>) -> Result<()> {
        self.check_stream("GraphExec::launch: the stream must be on the graph's device", stream)?;
        let raw_exec = self.raw;
        // SAFETY: both handles are live and of one context (checked above); the memory the graph
        // uses is held alive by self.footprint, and the closure runs only after the waits that
        // order that memory on this stream (both paths below).
        let launch = || unsafe { raw::launch(raw_exec, stream.raw()) };
        let gate = stream.enqueue_gate_uncaptured("GraphExec::launch")?;
        // Another graph holding the same memory may be launched from another thread at the same
        // time (no borrow keeps it away): the footprint stays locked from the waits to the notes,
        // so one launch is ordered after the other.
        let _bound = stream.context().bind_for_call()?;
        let mut held = Access::lock_all(self.footprint.iter().map(|(memory, use_)| (memory.access(), *use_)));
        held.order(stream)?;
        launch()?;
        stream.settle(held.note(stream, &gate))
    }

    /// Gives this executable graph the work of `graph` (a re-capture of the same sequence with
    /// other buffers, sizes or kernel arguments) without instantiating it anew. Runs already
    /// enqueued are unaffected.
    ///
    /// # Errors
    /// [`CaptureError::UpdateRefused`] when the driver cannot update (another topology or node
    /// kind): this graph is unchanged; [`CudaError::WrongDevice`] for a graph of another device.
    #[doc(alias = "cuGraphExecUpdate")]
    pub fn update(&mut self, graph: &CudaGraph) -> Result<()> {
        if graph.ctx.ordinal() != self.ctx.ordinal() {
            return Err(CudaError::WrongDevice {
                what: "GraphExec::update: the graph must be on the executable graph's device",
                expected: self.ctx.ordinal(),
                found: graph.ctx.ordinal(),
            });
        }
        if graph.nodes != self.nodes {
            // Another topology for certain: refused without asking the driver.
            return Err(CudaError::Capture(CaptureError::UpdateRefused {
                reason: format!("the topology changed ({} nodes, the new graph has {})", self.nodes, graph.nodes),
            }));
        }
        let _bound = self.ctx.bind()?;
        // SAFETY: both handles are live; `&mut self` excludes a concurrent launch.
        match unsafe { raw::exec_update(self.raw, graph.raw) } {
            Ok(()) => {
                // Memory only the old graph used is freed once its launches completed (their
                // marks are on the buffers).
                self.footprint = graph.footprint.clone();
                Ok(())
            }
            Err((error, info)) => {
                // Whatever the driver kept, the union of both footprints stays alive.
                for (memory, use_) in &graph.footprint {
                    if !self.footprint.iter().any(|(held, _)| Arc::ptr_eq(held, memory)) {
                        self.footprint.push((Arc::clone(memory), *use_));
                    }
                }
                match error {
                    CudaError::Driver(e) if e.code == CUresult::CUDA_ERROR_GRAPH_EXEC_UPDATE_FAILURE => {
                        Err(CudaError::Capture(CaptureError::UpdateRefused { reason: update_reason(info.result) }))
                    }
                    other => Err(other),
                }
            }
        }
    }

    /// How many allocations the graph's work touches.
    pub fn footprint_len(&self) -> usize {
        self.footprint.len()
    }

    /// Whether the graph's work writes the allocation `view` is part of.
    pub(crate) fn writes<T: DeviceRepr>(&self, view: &CudaViewMut<'_, T>) -> bool {
        self.footprint.iter().any(|(held, use_)| *use_ == Use::Write && Arc::ptr_eq(held, view.memory()))
    }

    /// Destroys the executable graph but keeps the memory its runs use alive in the returned
    /// footprint: for a caller that must destroy the graph before its runs can complete (NCCL's
    /// abort waits until every graph holding an operation of the communicator is destroyed) and
    /// frees the memory only after that.
    pub(crate) fn destroy_keeping_memory(mut self) -> KeptMemory {
        KeptMemory(std::mem::take(&mut self.footprint))
    }
}

/// The memory of a destroyed executable graph, kept alive until this is dropped (see
/// [`GraphExec::destroy_keeping_memory`]).
pub(crate) struct KeptMemory(#[allow(dead_code)] Vec<(Arc<DeviceMemory>, Use)>);

fn update_reason(result: CUgraphExecUpdateResult) -> String {
    let name = match result {
        CUgraphExecUpdateResult::CU_GRAPH_EXEC_UPDATE_ERROR_TOPOLOGY_CHANGED => "the topology changed",
        CUgraphExecUpdateResult::CU_GRAPH_EXEC_UPDATE_ERROR_NODE_TYPE_CHANGED => "a node's type changed",
        CUgraphExecUpdateResult::CU_GRAPH_EXEC_UPDATE_ERROR_FUNCTION_CHANGED => "a kernel node's function changed",
        CUgraphExecUpdateResult::CU_GRAPH_EXEC_UPDATE_ERROR_PARAMETERS_CHANGED => {
            "a node's parameters changed in a way that cannot be updated"
        }
        CUgraphExecUpdateResult::CU_GRAPH_EXEC_UPDATE_ERROR_NOT_SUPPORTED => "the update is not supported",
        CUgraphExecUpdateResult::CU_GRAPH_EXEC_UPDATE_ERROR_UNSUPPORTED_FUNCTION_CHANGE => {
            "a kernel node's function changed unsupportedly"
        }
        CUgraphExecUpdateResult::CU_GRAPH_EXEC_UPDATE_ERROR_ATTRIBUTES_CHANGED => "a node's attributes changed",
        _ => "the update failed",
    };
    format!("{name} (CUgraphExecUpdateResult {})", result.0)
}

impl Drop for GraphExec {
    fn drop(&mut self) {
        let result = self.ctx.bind().and_then(|_bound| {
            // SAFETY: the executable graph is owned here and not used afterwards; runs already
            // enqueued complete normally (and the footprint's frees wait for them).
            unsafe { raw::exec_destroy(self.raw) }
        });
        if let Err(e) = result {
            super::record_drop_error(e);
        }
    }
}

impl fmt::Debug for GraphExec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("GraphExec")
            .field("device", &self.ctx.ordinal())
            .field("footprint", &self.footprint.len())
            .finish()
    }
}
