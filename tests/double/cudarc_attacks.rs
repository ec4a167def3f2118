//! Attacks on the cudarc interop's lends through its public API alone, with no `unsafe` in the
//! attacking code, through the CUDA driver double (see `tests/double/cudarc_double.rs`): each holds.
#![cfg(feature = "cudarc")]

use crate::double;

use double::with_double;
use ppnrt::interop::EngineStream;
use ppnrt::{CaptureMode, DeviceSlice, Engine, PpConfig, PpNRt};

const N: usize = 4096;

fn values(seed: u32) -> Vec<u32> {
    (0..N as u32).map(|i| i.wrapping_mul(2_654_435_761) ^ seed).collect()
}

/// A capture left active past a read lend's end, on another stream of this thread (thread-local
/// or global) or on the engine's stream: the lend's end still orders cudarc's next writer of the
/// buffer after the crate's send from it.
#[test]
fn a_capture_active_at_the_lends_end_does_not_unorder_it() {
    with_double("a_capture_active_at_the_lends_end_does_not_unorder_it", |_| {
        let engine = Engine::new(0).unwrap();
        let ctx = cudarc::driver::CudaContext::new(0).unwrap();
        let (theirs, other) = (ctx.new_stream().unwrap(), ctx.new_stream().unwrap());
        let engine_stream = EngineStream::new(&engine, &theirs).unwrap();
        let rt = PpNRt::new(PpConfig::new(2), &engine).unwrap();
        let unrelated = engine.stream().unwrap();
        for (round, mode) in [(1u32, CaptureMode::Global), (2, CaptureMode::ThreadLocal)] {
            let sent = values(round);
            let mut x = theirs.clone_htod(&sent).unwrap();
            let (slot, capture) = engine_stream
                .read(&x, |view| {
                    let slot = rt.enter(0).and_then(|_stage| rt.tx(0, &view, N)).unwrap();
                    (slot, unrelated.begin_capture(mode).unwrap())
                })
                .unwrap();
            drop(capture.end());
            // cudarc's next writer of `x`, on another stream, run at once.
            other.memcpy_htod(&values(0xdead), &mut x).unwrap();
            other.synchronize().unwrap();
            let received = {
                let _stage = rt.enter(1).unwrap();
                let y = rt.rx::<u32>(0, slot, N).unwrap();
                engine.dtoh(&y).unwrap()
            };
            assert!(received == sent, "{mode:?}: cudarc overwrote the buffer before the crate's send read it");
        }
    });
}

/// A capture of the engine's stream cannot begin inside a lend (its end would be captured, not
/// enqueued), and a lend on a capturing engine stream is refused before the closure runs.
#[test]
fn the_engine_stream_cannot_be_captured_around_a_lend() {
    with_double("the_engine_stream_cannot_be_captured_around_a_lend", |_| {
        let engine = Engine::new(0).unwrap();
        let ctx = cudarc::driver::CudaContext::new(0).unwrap();
        let theirs = ctx.new_stream().unwrap();
        let engine_stream = EngineStream::new(&engine, &theirs).unwrap();
        let mut x = theirs.clone_htod(&values(5)).unwrap();
        let began =
            engine_stream.read(&x, |_| engine_stream.stream().begin_capture(CaptureMode::Relaxed).map(drop)).unwrap();
        assert!(
            matches!(began, Err(ppnrt::CudaError::Capture(ppnrt::CaptureError::CannotBegin { .. }))),
            "a capture of the engine's stream began inside a read lend: {began:?}"
        );
        let began = engine_stream
            .write(&mut x, |_| engine_stream.stream().begin_capture(CaptureMode::Relaxed).map(drop))
            .unwrap();
        assert!(
            matches!(began, Err(ppnrt::CudaError::Capture(ppnrt::CaptureError::CannotBegin { .. }))),
            "a capture of the engine's stream began inside a write lend: {began:?}"
        );
        // Once the lend ended, the capture may begin; a lend inside it is refused.
        let capture = engine_stream.stream().begin_capture(CaptureMode::Relaxed).unwrap();
        let lent = engine_stream.read(&x, |_| unreachable!("lent on a capturing stream"));
        assert!(matches!(lent, Err(ppnrt::CudaError::Capture(ppnrt::CaptureError::IllegalCall { .. }))), "{lent:?}");
        assert!(capture.end().is_err(), "the refused lend invalidates the capture");
        assert_eq!(engine_stream.read(&x, |view| view.len()).unwrap(), N);
    });
}

/// A capture of the engine's stream begun through cudarc itself, which this crate cannot see
/// or stop: begun inside a lend, the lend's end still orders cudarc's next writer after the
/// crate's send (waited for on the host, since nothing enqueued on the stream would run); begun
/// before a lend, the lend is refused.
#[test]
fn a_capture_begun_through_cudarc_does_not_unorder_a_lend() {
    with_double("a_capture_begun_through_cudarc_does_not_unorder_a_lend", |_| {
        use cudarc::driver::sys::{CUgraphInstantiate_flags, CUstreamCaptureMode};
        let engine = Engine::new(0).unwrap();
        let ctx = cudarc::driver::CudaContext::new(0).unwrap();
        let (theirs, other) = (ctx.new_stream().unwrap(), ctx.new_stream().unwrap());
        let engine_stream = EngineStream::new(&engine, &theirs).unwrap();
        let rt = PpNRt::new(PpConfig::new(2), &engine).unwrap();
        let sent = values(9);
        let mut x = theirs.clone_htod(&sent).unwrap();
        let slot = engine_stream
            .read(&x, |view| {
                let slot = rt.enter(0).and_then(|_stage| rt.tx(0, &view, N)).unwrap();
                theirs.begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED).unwrap();
                slot
            })
            .unwrap();
        drop(theirs.end_capture(CUgraphInstantiate_flags::CUDA_GRAPH_INSTANTIATE_FLAG_AUTO_FREE_ON_LAUNCH));
        other.memcpy_htod(&values(0xdead), &mut x).unwrap();
        other.synchronize().unwrap();
        let received = {
            let _stage = rt.enter(1).unwrap();
            let y = rt.rx::<u32>(0, slot, N).unwrap();
            engine.dtoh(&y).unwrap()
        };
        assert!(received == sent, "cudarc overwrote the buffer before the crate's send read it");

        theirs.begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED).unwrap();
        let lent = engine_stream.read(&x, |view| view.len());
        drop(theirs.end_capture(CUgraphInstantiate_flags::CUDA_GRAPH_INSTANTIATE_FLAG_AUTO_FREE_ON_LAUNCH));
        assert!(matches!(lent, Err(ppnrt::CudaError::Capture(ppnrt::CaptureError::IllegalCall { .. }))), "{lent:?}");
    });
}
