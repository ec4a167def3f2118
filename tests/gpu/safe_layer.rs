//! The safe layer and `Engine` on a GPU: copies, peers, events, the ambient stream, drops while
//! busy, and sharing across threads. Each test skips (visibly) without the GPUs it needs.

use crate::{common, raw_driver};

use std::sync::Arc;

use common::needs::{Needs, requires};
use common::{POISON, Rng, on_driver_double, say, spin_on, under_sanitizer};
use ppnrt::{
    CudaError, CudaEvent, CudaSlice, CudaStream, DeviceSlice, Engine, PinnedHostBuffer, StreamOverride,
    enable_peer_access, kernels, take_drop_errors,
};

const SIZES: [usize; 6] = [1, 3, 1000, 4097, 65_536, 3_000_001];

#[test]
fn every_copy_kind_round_trips_random_data_into_poisoned_outputs() {
    let Some(gpu) = requires("every_copy_kind_round_trips_random_data_into_poisoned_outputs", Needs::gpus(1)) else {
        return;
    };
    let engine = gpu.engine(0);
    let stream = engine.default_stream().clone();
    let mut rng = Rng::new(2);
    for n in SIZES {
        let data = rng.vec_u32(n);
        // Host to device (pageable), device to host (pageable).
        let mut dev = engine.htod(&vec![POISON; n]).unwrap();
        stream.memcpy_htod(&data, &mut dev).unwrap();
        let mut back = vec![POISON; n];
        stream.memcpy_dtoh(&dev, &mut back).unwrap();
        assert!(back == data, "htod/dtoh n={n}");
        // Device to device, same device.
        let mut copy = engine.htod(&vec![POISON; n]).unwrap();
        stream.memcpy_dtod(&dev, &mut copy).unwrap();
        assert!(engine.dtoh(&copy).unwrap() == data, "dtod n={n}");
        // Pinned, asynchronous both ways.
        let mut pinned = PinnedHostBuffer::<u32>::new(engine.context(), n, false).unwrap();
        pinned.as_mut_slice().unwrap().copy_from_slice(&data);
        let mut dev2 = engine.htod(&vec![POISON; n]).unwrap();
        stream.memcpy_htod_pinned(&pinned, &mut dev2).unwrap();
        let mut pinned_back = PinnedHostBuffer::<u32>::new(engine.context(), n, false).unwrap();
        pinned_back.as_mut_slice().unwrap().fill(POISON);
        stream.memcpy_dtoh_pinned(&dev2, &mut pinned_back).unwrap();
        assert!(pinned_back.as_slice().unwrap() == &data[..], "pinned n={n}");
        // Sub-slice views: copy the middle third into the front of a poisoned buffer.
        let (lo, hi) = (n / 3, 2 * n / 3);
        let mut target = engine.htod(&vec![POISON; n]).unwrap();
        {
            let src = dev.slice(lo..hi).unwrap();
            let mut dst = target.slice_mut(0..hi - lo).unwrap();
            stream.memcpy_dtod(&src, &mut dst).unwrap();
        }
        let got = engine.dtoh(&target).unwrap();
        assert!(got[..hi - lo] == data[lo..hi], "view copy n={n}");
        assert!(got[hi - lo..].iter().all(|&w| w == POISON), "view copy wrote past its range, n={n}");
    }
    assert!(take_drop_errors().is_empty());
}

#[test]
fn copies_check_lengths_and_ranges_and_write_nothing_on_error() {
    let Some(gpu) = requires("copies_check_lengths_and_ranges_and_write_nothing_on_error", Needs::gpus(1)) else {
        return;
    };
    let engine = gpu.engine(0);
    let stream = engine.default_stream().clone();
    let mut dev = engine.htod(&[POISON; 8]).unwrap();
    let err = stream.memcpy_htod(&[1u32; 7], &mut dev).unwrap_err();
    assert_eq!(err, CudaError::LengthMismatch { what: "CudaStream::memcpy_htod", expected: 8, found: 7 });
    let mut short = vec![0u32; 9];
    assert!(matches!(
        stream.memcpy_dtoh(&dev, &mut short),
        Err(CudaError::LengthMismatch { expected: 9, found: 8, .. })
    ));
    let mut other = engine.htod(&[1u32; 4]).unwrap();
    assert!(matches!(stream.memcpy_dtod(&dev, &mut other), Err(CudaError::LengthMismatch { .. })));
    assert_eq!(
        dev.slice(2..9).unwrap_err(),
        CudaError::OutOfBounds { what: "CudaView::slice", start: 2, end: 9, len: 8 }
    );
    assert!(engine.dtoh(&dev).unwrap().iter().all(|&w| w == POISON));
    assert!(engine.dtoh(&other).unwrap().iter().all(|&w| w == 1));
    // Reinterpreting bytes checks sizes.
    let bytes = engine.htod(&[0u8; 6]).unwrap();
    assert!(bytes.as_view().reinterpret::<u32>().is_err());
    assert_eq!(dev.as_view().reinterpret::<u8>().unwrap().len(), 32);
    // A zero-sized target is a typed error, not a division by zero.
    #[derive(Clone, Copy)]
    struct NoBytes;
    // SAFETY: a zero-sized type has one (empty) bit pattern, no padding, pointers or drop glue;
    // its name is its own.
    unsafe impl ppnrt::DeviceRepr for NoBytes {
        const NAME: &'static str = "NoBytes";
    }
    assert!(matches!(
        dev.as_view().reinterpret::<NoBytes>(),
        Err(CudaError::LengthMismatch { expected: 1, found: 0, .. })
    ));
}

#[test]
fn peer_copies_both_ways_with_the_source_freed_right_after_the_call() {
    let test = "peer_copies_both_ways_with_the_source_freed_right_after_the_call";
    let Some(_gpus) = requires(test, Needs::gpus(2)) else { return };
    let engines = [Engine::new(0).unwrap(), Engine::new(1).unwrap()];
    let info = engines[0].device().peer_info(engines[1].device()).unwrap();
    say(&format!("{test}: peer info 0->1 {info:?}"));
    if info.access_supported {
        enable_peer_access(engines[0].context(), engines[1].context()).unwrap();
        // Idempotent, and the current context is left alone.
        let _bound = engines[1].context().bind().unwrap();
        enable_peer_access(engines[1].context(), engines[0].context()).unwrap();
        assert_eq!(ppnrt::result::context::get_current().unwrap(), engines[1].context().raw());
    }
    let mut rng = Rng::new(3);
    for (a, b) in [(0usize, 1usize), (1, 0)] {
        for n in [1usize, 4097, 16 << 20] {
            let data = rng.vec_u32(n);
            let mut dst = engines[b].htod(&vec![POISON; n]).unwrap();
            engines[b].synchronize().unwrap();
            let src = engines[a].htod(&data).unwrap();
            // Delay the copy's stream so the copy is still queued when the source is dropped.
            engines[a].spin(2_000_000).unwrap();
            engines[a].default_stream().memcpy_dtod(&src, &mut dst).unwrap();
            drop(src);
            // Overwrite whatever the pool hands out next on the source's device.
            let mut scribble = engines[a].alloc::<u32>(n).unwrap();
            engines[a].fill_u32(&mut scribble, POISON).unwrap();
            let got = engines[b].dtoh(&dst).unwrap();
            let bad = got.iter().zip(&data).filter(|(g, d)| g != d).count();
            assert_eq!(bad, 0, "{a}->{b} n={n}: {bad} mismatches");
        }
        // The SM copy kernel reaches peer memory (persistent allocations).
        if info.access_supported {
            let n = 1 << 20;
            let data = rng.vec_u32(n);
            let src = engines[a].htod(&data).unwrap();
            let mut dst = CudaSlice::<u32>::alloc_persistent(engines[b].default_stream(), n).unwrap();
            engines[b].fill_u32(&mut dst, POISON).unwrap();
            engines[b].synchronize().unwrap();
            engines[a].copy_with_sms(&src, &mut dst).unwrap();
            assert!(engines[b].dtoh(&dst).unwrap() == data, "SM copy {a}->{b}");
        }
    }
    assert!(take_drop_errors().is_empty());
}

#[test]
fn events_time_a_known_amount_of_work() {
    let Some(gpu) = requires("events_time_a_known_amount_of_work", Needs::gpus(1)) else { return };
    let engine = gpu.engine(0);
    let stream = engine.default_stream();
    let (start, end) =
        (CudaEvent::new(engine.context(), true).unwrap(), CudaEvent::new(engine.context(), true).unwrap());
    for ms in [1u64, 5, 20] {
        start.record(stream).unwrap();
        engine.spin(ms * 1_000_000).unwrap();
        end.record(stream).unwrap();
        end.synchronize().unwrap();
        assert!(end.is_complete().unwrap());
        let elapsed = end.elapsed_ms(&start).unwrap();
        assert!(elapsed >= ms as f32 * 0.95, "spin {ms} ms timed {elapsed} ms");
        // Instrumentation (compute-sanitizer) stretches kernels: the upper bound holds only without it.
        if !under_sanitizer() {
            assert!(elapsed < ms as f32 * 1.5 + 1.0, "spin {ms} ms timed {elapsed} ms");
        }
    }
    let untimed = CudaEvent::new(engine.context(), false).unwrap();
    untimed.record(stream).unwrap();
    untimed.synchronize().unwrap();
    assert_eq!(untimed.elapsed_ms(&start).unwrap_err(), CudaError::EventWithoutTiming);
    assert_eq!(start.elapsed_ms(&untimed).unwrap_err(), CudaError::EventWithoutTiming);
}

#[test]
fn an_event_recorded_on_another_devices_stream_is_refused_before_the_driver() {
    let test = "an_event_recorded_on_another_devices_stream_is_refused_before_the_driver";
    let Some(_gpus) = requires(test, Needs::gpus(2)) else { return };
    let (e0, e1) = (Engine::new(0).unwrap(), Engine::new(1).unwrap());
    let event = CudaEvent::new(e0.context(), false).unwrap();
    let err = event.record(e1.default_stream()).unwrap_err();
    assert!(matches!(err, CudaError::WrongDevice { expected: 0, found: 1, .. }), "{err}");
    // Waiting on it from the other device is fine.
    event.record(e0.default_stream()).unwrap();
    e1.default_stream().wait(&event).unwrap();
    e1.synchronize().unwrap();
}

#[test]
fn stream_overrides_nest_and_stay_on_their_thread() {
    let Some(gpu) = requires("stream_overrides_nest_and_stay_on_their_thread", Needs::gpus(1)) else { return };
    let engine = gpu.engine(0);
    let default = engine.default_stream().clone();
    let (s1, s2) = (CudaStream::new(engine.context()).unwrap(), CudaStream::new(engine.context()).unwrap());
    assert!(Arc::ptr_eq(&engine.stream().unwrap(), &default));
    {
        let _outer = StreamOverride::new(s1.clone()).unwrap();
        assert!(Arc::ptr_eq(&engine.stream().unwrap(), &s1));
        let slice = engine.alloc::<u32>(16).unwrap();
        assert!(Arc::ptr_eq(slice.stream(), &s1), "allocation on the ambient stream");
        {
            let _inner = StreamOverride::new(s2.clone()).unwrap();
            assert!(Arc::ptr_eq(&engine.stream().unwrap(), &s2));
        }
        assert!(Arc::ptr_eq(&engine.stream().unwrap(), &s1));
    }
    assert!(Arc::ptr_eq(&engine.stream().unwrap(), &default));

    // Threads: each sets its own ambient stream and sees only its own.
    let threads: Vec<_> = (0..4u32)
        .map(|t| {
            let engine = engine.clone();
            std::thread::spawn(move || {
                let mine = CudaStream::new(engine.context()).unwrap();
                let _guard = StreamOverride::new(mine.clone()).unwrap();
                for round in 0..50u32 {
                    assert!(Arc::ptr_eq(&engine.stream().unwrap(), &mine));
                    let seed = t * 1000 + round;
                    let mut buffer = engine.alloc::<u32>(10_000).unwrap();
                    engine.fill_pattern(&mut buffer, seed).unwrap();
                    let host = engine.dtoh(&buffer).unwrap();
                    assert!(host.iter().enumerate().all(|(i, &w)| w == kernels::pattern(seed, i as u64)));
                    assert!(Arc::ptr_eq(buffer.stream(), &mine));
                }
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
    assert!(Arc::ptr_eq(&engine.stream().unwrap(), &default), "other threads' guards do not leak here");
}

/// The memory traffic of `stream_overrides_nest_and_stay_on_their_thread` on the raw driver, with
/// no crate code in the loop: four threads, each on its own stream, allocate 10,000 words from the
/// device's pool, fill them with the pattern kernel, read them back, check them and free them, 50
/// rounds each. Beside the crate's test under initcheck, it tells the tool's reports from the
/// crate's (docs/RELIABILITY.md).
#[test]
#[allow(unsafe_code)]
fn raw_driver_threads_fill_and_read_back_pool_memory() {
    use ppnrt::sys::{CUdeviceptr, CUfunction, CUmodule, CUstream};
    use raw_driver::raw;
    let Some(gpu) = requires("raw_driver_threads_fill_and_read_back_pool_memory", Needs::gpus(1)) else { return };
    let engine = gpu.engine(0);
    let ctx = engine.context().raw();
    raw!(cuCtxSetCurrent(ctx));
    let mut module: CUmodule = std::ptr::null_mut();
    raw!(cuModuleLoadData(&raw mut module, kernels::TESTING_PTX.as_ptr().cast()));
    let mut fill: CUfunction = std::ptr::null_mut();
    raw!(cuModuleGetFunction(&raw mut fill, module, c"ppnrt_fill_pattern_u32".as_ptr()));
    let handles = raw_driver::AnyThread((ctx, fill));
    let n = 10_000usize;
    std::thread::scope(|scope| {
        for t in 0..4u32 {
            let handles = &handles;
            scope.spawn(move || {
                let (ctx, fill) = handles.get();
                raw!(cuCtxSetCurrent(ctx));
                let mut stream: CUstream = std::ptr::null_mut();
                raw!(cuStreamCreate(&raw mut stream, 1));
                let mut host = vec![0u32; n];
                for round in 0..50u32 {
                    let seed = t * 1000 + round;
                    let mut buffer: CUdeviceptr = 0;
                    raw!(cuMemAllocAsync(&raw mut buffer, n * 4, stream));
                    let (mut dst, mut len, mut seed_arg) = (buffer, n as u64, seed);
                    let mut params: [*mut std::ffi::c_void; 3] =
                        [(&raw mut dst).cast(), (&raw mut len).cast(), (&raw mut seed_arg).cast()];
                    let blocks = n.div_ceil(256) as u32;
                    raw!(cuLaunchKernel(
                        fill,
                        blocks,
                        1,
                        1,
                        256,
                        1,
                        1,
                        0,
                        stream,
                        params.as_mut_ptr(),
                        std::ptr::null_mut()
                    ));
                    raw!(cuMemcpyDtoHAsync_v2(host.as_mut_ptr().cast(), buffer, n * 4, stream));
                    raw!(cuStreamSynchronize(stream));
                    assert!(host.iter().enumerate().all(|(i, &w)| w == kernels::pattern(seed, i as u64)));
                    raw!(cuMemFreeAsync(buffer, stream));
                }
                raw!(cuStreamSynchronize(stream));
                raw!(cuStreamDestroy_v2(stream));
            });
        }
    });
    raw!(cuModuleUnload(module));
}

#[test]
fn an_ambient_stream_of_another_device_is_an_error() {
    let Some(_gpus) = requires("an_ambient_stream_of_another_device_is_an_error", Needs::gpus(2)) else { return };
    let (e0, e1) = (Engine::new(0).unwrap(), Engine::new(1).unwrap());
    let _guard = StreamOverride::new(e1.default_stream().clone()).unwrap();
    assert!(matches!(e0.alloc::<f32>(4), Err(CudaError::WrongDevice { expected: 0, found: 1, .. })));
    assert!(e1.alloc::<f32>(4).is_ok());
}

#[test]
fn buffers_dropped_while_their_stream_is_busy_are_freed_in_order() {
    let Some(gpu) = requires("buffers_dropped_while_their_stream_is_busy_are_freed_in_order", Needs::gpus(1)) else {
        return;
    };
    let engine = gpu.engine(0);
    let n = 1 << 20;
    for persistent in [false, true] {
        let mut first = if persistent { engine.alloc_persistent::<u32>(n) } else { engine.alloc::<u32>(n) }.unwrap();
        engine.spin(20_000_000).unwrap();
        engine.fill_pattern(&mut first, 11).unwrap();
        let mut copy = engine.alloc::<u32>(n).unwrap();
        engine.dtod(&first, &mut copy).unwrap();
        drop(first); // the stream is still spinning; the free is ordered after the copy
        let mut reuse = engine.alloc::<u32>(n).unwrap();
        engine.fill_u32(&mut reuse, POISON).unwrap();
        let host = engine.dtoh(&copy).unwrap();
        assert!(host.iter().enumerate().all(|(i, &w)| w == kernels::pattern(11, i as u64)), "persistent={persistent}");
    }
    assert!(take_drop_errors().is_empty());
}

/// A thread blocked in a host wait for a buffer (`CudaSlice::synchronize`, waiting for a 200 ms
/// kernel) does not hold up another thread's copy from that buffer: the copy is enqueued at once,
/// ordered after the write on the device, and delivers the written values. (Were the buffer's
/// ordering state locked for the whole host wait, as it once was, the copy's call would return
/// only after the kernel.)
#[test]
fn a_host_wait_on_a_buffer_does_not_hold_up_other_threads_using_it() {
    let test = "a_host_wait_on_a_buffer_does_not_hold_up_other_threads_using_it";
    let Some(gpu) = requires(test, Needs::gpus(1)) else { return };
    let engine = gpu.engine(0);
    let n = 1 << 16;
    let (writer, reader) = (CudaStream::new(engine.context()).unwrap(), CudaStream::new(engine.context()).unwrap());
    let mut source = engine.alloc::<u32>(n).unwrap();
    {
        let _writer = StreamOverride::new(writer.clone()).unwrap();
        engine.spin(200_000_000).unwrap();
        engine.fill_pattern(&mut source, 21).unwrap();
    }
    let written = CudaEvent::new(engine.context(), false).unwrap();
    written.record(&writer).unwrap();
    let mut copy = engine.alloc::<u32>(n).unwrap();
    engine.fill_u32(&mut copy, POISON).unwrap();
    engine.synchronize().unwrap();
    // Under compute-sanitizer kernels run to completion at their launch, and the driver double
    // runs queued work when it is waited for, taking no time: then there is no wait to overlap,
    // and only the values are checked.
    let timed = !written.is_complete().unwrap() && !on_driver_double(&engine);
    let started = std::time::Instant::now();
    let copy_call = std::thread::scope(|scope| {
        let waiter = scope.spawn(|| source.synchronize().unwrap());
        // Give the waiter time to enter its wait.
        std::thread::sleep(std::time::Duration::from_millis(20));
        let before = std::time::Instant::now();
        reader.memcpy_dtod(&source, &mut copy).unwrap();
        let copy_call = before.elapsed();
        waiter.join().unwrap();
        copy_call
    });
    let waited = started.elapsed();
    say(&format!(
        "{test}: the copy's call took {copy_call:?} while the other thread waited {waited:?}{}",
        if timed { "" } else { " (the write had completed before the wait: times not checked)" }
    ));
    if timed {
        assert!(waited >= std::time::Duration::from_millis(100), "the wait ended before the kernel: {waited:?}");
        assert!(copy_call < std::time::Duration::from_millis(50), "the copy waited for the host wait: {copy_call:?}");
    }
    reader.synchronize().unwrap();
    let host = engine.dtoh(&copy).unwrap();
    assert!(
        host.iter().enumerate().all(|(i, &w)| w == kernels::pattern(21, i as u64)),
        "the copy ran before the write"
    );
}

#[test]
fn one_engine_serves_many_threads() {
    let Some(gpu) = requires("one_engine_serves_many_threads", Needs::gpus(1)) else { return };
    let engine = gpu.engine(0);
    let threads: Vec<_> = (0..8u64)
        .map(|t| {
            let engine = engine.clone();
            std::thread::spawn(move || {
                let stream = CudaStream::new(engine.context()).unwrap();
                let _guard = StreamOverride::new(stream).unwrap();
                let mut rng = Rng::new(100 + t);
                for _ in 0..25 {
                    let n = 1 + rng.below(50_000) as usize;
                    let data = rng.vec_u32(n);
                    let dev = engine.htod(&data).unwrap();
                    assert_eq!(engine.checksum(&dev).unwrap(), kernels::checksum(&data));
                    assert!(engine.dtoh(&dev).unwrap() == data);
                }
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
}

#[test]
fn adopted_streams_are_not_destroyed() {
    let Some(gpu) = requires("adopted_streams_are_not_destroyed", Needs::gpus(1)) else { return };
    let engine = gpu.engine(0);
    let _bound = engine.context().bind().unwrap();
    let raw = ppnrt::result::stream::create_non_blocking().unwrap();
    // SAFETY: raw is a live stream of the engine's context, destroyed below after the wrapper.
    let adopted = unsafe { CudaStream::adopt(engine.context(), raw) };
    assert!(!adopted.is_owned());
    let dev = CudaSlice::<u32>::alloc(&adopted, 100).unwrap();
    drop(dev);
    drop(adopted);
    // SAFETY: raw is still live (the wrapper did not destroy it) and no longer used after this.
    unsafe {
        ppnrt::result::stream::synchronize(raw).unwrap();
        ppnrt::result::stream::destroy(raw).unwrap();
    }
}

#[test]
fn the_peer_matrix_is_square_and_has_no_self_links() {
    let Some(gpus) = requires("the_peer_matrix_is_square_and_has_no_self_links", Needs::gpus(1)) else { return };
    let count = gpus.count();
    let matrix = ppnrt::Device::peer_matrix().unwrap();
    assert_eq!(matrix.len() as i32, count);
    for (i, row) in matrix.iter().enumerate() {
        assert_eq!(row.len() as i32, count);
        assert!(!row[i].access_supported);
    }
}

/// An engine's own device memory and stream in the raw form (`CudaSlice::from_foreign`, on a
/// stream the crate did not order for it), through a two-stage pipeline on the GPU, zero copy:
/// the engine writes its buffer on its own stream behind a 200 µs device delay and stage 0 sends
/// it (the send must wait for that write); stage 1 receives the step into a second engine buffer
/// behind a delay of its own, and the engine reads that buffer on its stream once the slice is
/// dropped (the read must wait for the receive). The broken rounds send from a slice made on an
/// unrelated stream (no mark of the engine's pending write) and read the second buffer before the
/// slice is dropped: stale values, caught.
#[test]
fn an_engines_raw_buffers_and_stream_go_through_the_pipeline_ordered_on_the_gpu() {
    use ppnrt::{PpConfig, PpNRt, sys};
    use raw_driver::raw;
    const N: usize = 1 << 20;
    let name = "an_engines_raw_buffers_and_stream_go_through_the_pipeline_ordered_on_the_gpu";
    let Some(gpu) = requires(name, Needs::gpus(1)) else { return };
    let engine = gpu.engine(0);
    let rt = PpNRt::new(PpConfig::new(2), &engine).unwrap();
    let own = CudaStream::new(engine.context()).unwrap(); // the engine's stream
    let other = CudaStream::new(engine.context()).unwrap();
    let alloc = || {
        let _bound = engine.context().bind().unwrap();
        let mut ptr: sys::CUdeviceptr = 0;
        raw!(cuMemAlloc_v2(&mut ptr, N * 4));
        raw!(cuMemsetD32_v2(ptr, 0, N));
        ptr
    };
    let (source, target) = (alloc(), alloc());
    let sanitized = under_sanitizer();
    let (mut caught, rounds) = ((0, 0), 20u32);
    for round in 1..=rounds {
        let broken = round % 2 == 0;
        // The engine's write of `source`, behind a device delay on its own stream.
        spin_on(&engine, &own, 200_000);
        {
            let _bound = engine.context().bind().unwrap();
            raw!(cuMemsetD32Async(source, round, N, own.raw()));
        }
        let slot = {
            // SAFETY: `source` holds N u32 until the end of the test, after a full
            // synchronisation; the engine writes it on `own` only; no other slice covers it.
            let sent = unsafe { CudaSlice::<u32>::from_foreign(source, N, if broken { &other } else { &own }) };
            let _stage = rt.enter(0).unwrap();
            rt.tx(0, &sent, N).unwrap()
        };
        let seen = {
            let _stage = rt.enter(1).unwrap();
            spin_on(&engine, rt.stage_stream(1).unwrap(), 200_000);
            // SAFETY: as above, for `target`, which the engine reads on `own` only.
            let mut received = unsafe { CudaSlice::<u32>::from_foreign(target, N, &own) };
            rt.rx_into(0, slot, &mut received).unwrap();
            let mut host = vec![0u32; N];
            let read = |host: &mut Vec<u32>| {
                let _bound = engine.context().bind().unwrap();
                raw!(cuMemcpyDtoHAsync_v2(host.as_mut_ptr().cast(), target, N * 4, own.raw()));
                raw!(cuStreamSynchronize(own.raw()));
            };
            if broken {
                read(&mut host); // before the drop: nothing orders `own` after the receive
                drop(received);
            } else {
                drop(received);
                read(&mut host);
            }
            host
        };
        engine.context().synchronize().unwrap();
        if broken {
            caught.0 += usize::from(seen.iter().any(|&v| v != round));
            // What stage 0 sent: `target` now holds it, the receive having completed.
            let mut landed = vec![0u32; N];
            {
                let _bound = engine.context().bind().unwrap();
                raw!(cuMemcpyDtoH_v2(landed.as_mut_ptr().cast(), target, N * 4));
            }
            caught.1 += usize::from(landed.iter().any(|&v| v != round));
        } else {
            assert!(seen.iter().all(|&v| v == round), "round {round}: the engine saw another round's values");
        }
    }
    {
        let _bound = engine.context().bind().unwrap();
        raw!(cuMemFree_v2(source));
        raw!(cuMemFree_v2(target));
    }
    if sanitized {
        say(&format!(
            "{name}: 10 ordered rounds exact; the broken rounds ran unchecked (serialised under compute-sanitizer)"
        ));
    } else {
        assert!(
            caught.0 > 0 && caught.1 > 0,
            "broken rounds caught {caught:?} (read early, sent early): the test cannot fail"
        );
        say(&format!(
            "{name}: 10 ordered rounds exact; of 10 broken rounds {} read stale values, {} sent the engine's earlier values",
            caught.0, caught.1
        ));
    }
}
