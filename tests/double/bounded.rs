//! Nothing a caller forgets or reads keeps memory or streams without bound, through the CUDA
//! driver double (`tests/driver_double/cuda_double.c`): a thread-local capture that is forgotten
//! holds back no free of another stream's memory, and a buffer read on stream after stream keeps
//! none of those streams alive, while the reads stay ordered before the buffer's next write.

use crate::double;

use std::sync::Arc;
use std::time::{Duration, Instant};

use double::with_double;
use ppnrt::{CaptureMode, CudaSlice, CudaStream, Engine, PinnedHostBuffer};

/// Waits (flushing the double's queues) until the live allocations are `expected`, for at most
/// five seconds; returns what they were last.
fn allocations_settle_to(double: &double::Double, expected: (u64, u64)) -> (u64, u64) {
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        double.flush();
        let live = double.live_allocations();
        if live == expected || Instant::now() > deadline {
            return live;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// A thread that begins a thread-local capture and forgets it (`mem::forget`) then drops buffers
/// of other streams: stream-ordered and `cuMemAlloc` device memory and pinned host memory. The
/// driver forbids that thread their frees while the capture lasts (for ever), but not another
/// thread: every allocation is freed, none is held by the forgotten capture.
#[test]
fn a_forgotten_thread_local_capture_holds_back_no_other_streams_frees() {
    with_double("a_forgotten_thread_local_capture_holds_back_no_other_streams_frees", |double| {
        let engine = Engine::new(0).unwrap();
        let captured = CudaStream::new(engine.context()).unwrap();
        let other = CudaStream::new(engine.context()).unwrap();
        double.flush();
        let before = double.live_allocations();
        std::thread::scope(|scope| {
            scope
                .spawn(|| {
                    let mut pooled = Vec::new();
                    let mut plain = Vec::new();
                    let mut pinned = Vec::new();
                    for _ in 0..96 {
                        pooled.push(CudaSlice::<u32>::alloc(&other, 1024).unwrap());
                        plain.push(CudaSlice::<u32>::alloc_persistent(&other, 1024).unwrap());
                        pinned.push(PinnedHostBuffer::<u32>::new(other.context(), 1024, false).unwrap());
                    }
                    for buffer in pooled.iter_mut().chain(plain.iter_mut()) {
                        other.memset_u32(buffer, 5).unwrap();
                    }
                    // Forgotten: its thread may never free anything again itself.
                    std::mem::forget(captured.begin_capture(CaptureMode::ThreadLocal).unwrap());
                    drop((pooled, plain, pinned));
                })
                .join()
                .unwrap();
        });
        let after = allocations_settle_to(double, before);
        assert_eq!(after, before, "allocations (device, pinned) still held by the forgotten capture");
        assert!(ppnrt::take_drop_errors().is_empty(), "the frees made elsewhere failed");
    });
}

/// A buffer (say, weights) read by a copy on each of 200 fresh streams, each stream dropped by
/// the caller at once: the buffer's read marks keep at most a few of them alive, and a write to
/// the buffer afterwards still waits for every read (the double runs unordered work as late as
/// possible: a read not waited for would see the new values).
#[test]
fn a_buffer_read_on_stream_after_stream_keeps_none_of_them() {
    with_double("a_buffer_read_on_stream_after_stream_keeps_none_of_them", |_| {
        let engine = Engine::new(0).unwrap();
        let home = CudaStream::new(engine.context()).unwrap();
        let n = 1024;
        let mut weights = CudaSlice::<u32>::alloc(&home, n).unwrap();
        home.memset_u32(&mut weights, 7).unwrap();
        let mut first = CudaSlice::<u32>::alloc(&home, n).unwrap();
        let mut middle = CudaSlice::<u32>::alloc(&home, n).unwrap();
        let mut last = CudaSlice::<u32>::alloc(&home, n).unwrap();
        let readers = 200;
        let mut gone = Vec::with_capacity(readers);
        for i in 0..readers {
            let stream = CudaStream::new(engine.context()).unwrap();
            let dst = match i {
                0 => &mut first,
                i if i + 1 == readers => &mut last,
                _ => &mut middle,
            };
            stream.memcpy_dtod(&weights, dst).unwrap();
            gone.push(Arc::downgrade(&stream));
        }
        // The three destinations' last writes hold their streams (one each, until their next use).
        let alive = gone.iter().filter(|stream| stream.strong_count() > 0).count();
        assert!(alive <= 8, "{alive} of {readers} dropped streams are kept alive by the buffer's read marks");
        home.memset_u32(&mut weights, 9).unwrap();
        for (name, dst) in [("first", &first), ("middle", &middle), ("last", &last)] {
            let mut host = vec![0u32; dst.len()];
            home.memcpy_dtoh(dst, &mut host).unwrap();
            assert!(host.iter().all(|&v| v == 7), "the {name} read was not ordered before the write");
        }
    });
}
