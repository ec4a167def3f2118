//! The host-cost tables: each driver call a step makes, every boundary at once against each
//! alone, safe copies back to back beside raw ones, and the engine's paths (local steps, in-place
//! receives, readbacks, one thread per stage) beside raw loops.

use super::*;

/// Host cost of each driver call a peer boundary step makes, one call type at a time, issued into
/// an idle queue: where the time of `tx` and `rx` goes.
pub(crate) fn call_costs(gpus: &Gpus, report: &mut String) {
    if !gpus.peers {
        return;
    }
    let (e0, e1) = (&gpus.engines[0], &gpus.engines[1]);
    let (s0, s1) = (e0.default_stream().clone(), e1.default_stream().clone());
    let bytes = 32 * KIB;
    let src = filled(e0, bytes, 7);
    let mut dst = filled(e1, bytes, 8);
    let ev0 = CudaEvent::new(e0.context(), false).unwrap();
    let ev1 = CudaEvent::new(e1.context(), false).unwrap();
    ev1.record(&s1).unwrap();
    let (c0, c1) = (e0.context().raw(), e1.context().raw());
    let (src_ptr, dst_ptr) = (src.device_ptr(), dst.device_ptr());
    let iters = 3000;
    let _ =
        writeln!(report, "\n| driver call (peer boundary, 32 KiB) | host median | host p99 |\n| --- | ---: | ---: |");
    let mut measure = |name: &str, call: &mut dyn FnMut()| {
        let mut times = Vec::with_capacity(iters);
        for i in 0..iters {
            if i % 64 == 0 {
                s0.synchronize().unwrap();
                s1.synchronize().unwrap();
            }
            let t = Instant::now();
            call();
            times.push(t.elapsed().as_secs_f64() * 1e6);
        }
        s0.synchronize().unwrap();
        s1.synchronize().unwrap();
        let line = format!("| {name} | {:.2} µs | {:.2} µs |", median(&mut times), percentile(&mut times, 0.99));
        println!("{line}");
        let _ = writeln!(report, "{line}");
    };
    measure("cuCtxSetCurrent (context already current)", &mut || raw!(cuCtxSetCurrent(c0)));
    measure("cuCtxSetCurrent x2 (switch device and back)", &mut || {
        raw!(cuCtxSetCurrent(c1));
        raw!(cuCtxSetCurrent(c0));
    });
    measure("cuStreamWaitEvent (event of the other device)", &mut || raw!(cuStreamWaitEvent(s0.raw(), ev1.raw(), 0)));
    measure("cuMemcpyAsync 32 KiB to the peer", &mut || raw!(cuMemcpyAsync(dst_ptr, src_ptr, bytes, s0.raw())));
    // The safe copy's cost beside the raw call, and the one driver call it adds (with the
    // stream's context current, as here, it makes no other).
    measure("cuCtxGetCurrent + cuMemcpyAsync 32 KiB to the peer", &mut || {
        let mut current: ppnrt::sys::CUcontext = std::ptr::null_mut();
        raw!(cuCtxGetCurrent(&mut current));
        raw!(cuMemcpyAsync(dst_ptr, src_ptr, bytes, s0.raw()));
    });
    measure("safe memcpy_dtod 32 KiB to the peer (its context current)", &mut || {
        s0.memcpy_dtod(&src, &mut dst).unwrap()
    });
    measure("cuEventRecord", &mut || raw!(cuEventRecord(ev0.raw(), s0.raw())));
    // Each raw call runs with its stream's context current, set outside the timed calls.
    raw!(cuCtxSetCurrent(c1));
    measure("cuMemAllocAsync + cuMemFreeAsync 32 KiB", &mut || {
        let mut p: CUdeviceptr = 0;
        raw!(cuMemAllocAsync(&mut p, bytes, s1.raw()));
        raw!(cuMemFreeAsync(p, s1.raw()));
    });
    measure("cuMemcpyAsync 16 KiB within a device", &mut || {
        raw!(cuMemcpyAsync(dst_ptr, dst_ptr + (bytes / 2) as u64, bytes / 2, s1.raw()))
    });
    // Alternatives for the same-device copy that every `rx` makes, and for the waits.
    let half = (bytes / 2) as u64;
    measure("cuMemcpyDtoDAsync 16 KiB within a device", &mut || {
        raw!(cuMemcpyDtoDAsync_v2(dst_ptr, dst_ptr + half, bytes / 2, s1.raw()))
    });
    let module = Module::load_ptx(e1.context(), "helpers", ppnrt::kernels::HELPERS_PTX).unwrap();
    let copy = module.function("ppnrt_copy_bytes").unwrap();
    let sm_blocks = e1.max_blocks();
    measure("cuLaunchKernel SM copy 16 KiB within a device", &mut || {
        launch_or_copy(&copy, sm_blocks, dst_ptr, dst_ptr + half, bytes / 2, s1.raw())
    });
    measure("cuEventQuery (completed, this device)", &mut || {
        let _ = ev0.is_complete().unwrap();
    });
    measure("cuEventQuery (completed, other device)", &mut || {
        let _ = ev1.is_complete().unwrap();
    });
    raw!(cuCtxSetCurrent(c0));
    measure("cuStreamWaitEvent (event of this device)", &mut || raw!(cuStreamWaitEvent(s0.raw(), ev0.raw(), 0)));
    measure("cuStreamWriteValue32 into peer memory", &mut || raw!(cuStreamWriteValue32_v2(s0.raw(), dst_ptr, 1, 0)));
    raw!(cuCtxSetCurrent(c1));
    measure("cuStreamWaitValue32 (already satisfied)", &mut || {
        raw!(cuStreamWaitValue32_v2(s1.raw(), dst_ptr, 0, CUstreamWaitValue_flags::CU_STREAM_WAIT_VALUE_GEQ.0))
    });
    // Device time of a same-device copy, copy engine against SM kernel, by size.
    let big = 64 * MIB;
    let scratch = filled(e1, 2 * big, 9);
    let (from, to) = (scratch.device_ptr(), scratch.device_ptr() + big as u64);
    let events = (CudaEvent::new(e1.context(), true).unwrap(), CudaEvent::new(e1.context(), true).unwrap());
    let _ = writeln!(
        report,
        "\n| copy within a device, device time per copy back to back | copy engine | SM kernel |\n| --- | ---: | ---: |"
    );
    for size in [16 * KIB, 256 * KIB, MIB, 4 * MIB, 16 * MIB, 64 * MIB] {
        let reps = (256 * MIB / size).clamp(20, 1000) as u64;
        let config = LaunchConfig::for_elements(size / 16 + 1, sm_blocks);
        let per_copy = |use_kernel: bool| {
            let time = device_time(&s1, &events, reps, || {
                if use_kernel {
                    // SAFETY (bench): ppnrt_copy_bytes(dst, src, n16, tail) between two disjoint
                    // 64 MiB halves of one live buffer on s1's device; size ≤ 64 MiB.
                    unsafe { s1.launch(&copy, config, (to, from, (size / 16) as u64, 0u64)).unwrap() }
                } else {
                    raw!(cuMemcpyAsync(to, from, size, s1.raw()))
                }
            });
            time.as_secs_f64() * 1e6 / reps as f64
        };
        let (engine, kernel) = (per_copy(false), per_copy(true));
        let line = format!("| {} | {engine:.2} µs | {kernel:.2} µs |", label(size));
        println!("{line}");
        let _ = writeln!(report, "{line}");
    }
    drop(scratch);
    drop((src, dst));
}

/// Every boundary of a pipeline with one stage per GPU moving 64 MiB at once, against the sum of
/// the same boundaries measured one at a time (NVLink and copy-engine contention show as a ratio
/// below 1). With two GPUs this is the one boundary 0 -> 1 and the ratio is 1 by construction.
pub(crate) fn aggregate(gpus: &Gpus, report: &mut String) {
    let n = gpus.engines.len();
    if n < 2 {
        return;
    }
    let bytes = 64 * MIB;
    let words = bytes / 4;
    let devices: Vec<i32> = (0..n as i32).collect();
    let primary = &gpus.engines[0];
    let rt = PpNRt::new(PpConfig::with_devices(&devices).with_reserve_bytes(bytes), primary).unwrap();
    let xs: Vec<CudaSlice<u32>> = (0..n - 1)
        .map(|b| {
            let engine = rt.engine(b, primary).unwrap();
            let _scope = rt.enter(b).unwrap();
            let mut x = engine.alloc::<u32>(words).unwrap();
            engine.fill_pattern(&mut x, b as u32).unwrap();
            x
        })
        .collect();
    let steps = 30;
    let run = |boundaries: &[usize]| -> f64 {
        for _ in 0..3 {
            for &b in boundaries {
                let slot = rt.tx(b, &xs[b], words).unwrap();
                drop(rt.rx::<u32>(b, slot, words).unwrap());
            }
        }
        rt.synchronize().unwrap();
        let t0 = Instant::now();
        for _ in 0..steps {
            for &b in boundaries {
                let slot = rt.tx(b, &xs[b], words).unwrap();
                drop(rt.rx::<u32>(b, slot, words).unwrap());
            }
        }
        rt.synchronize().unwrap();
        (boundaries.len() * steps * bytes) as f64 / t0.elapsed().as_secs_f64() / 1e9
    };
    let alone: Vec<f64> = (0..n - 1).map(|b| run(&[b])).collect();
    let all: Vec<usize> = (0..n - 1).collect();
    let together = run(&all);
    let sum: f64 = alone.iter().sum();
    let _ =
        writeln!(report, "\n| every boundary at once, 64 MiB, stages on devices {devices:?} | GB/s |\n| --- | ---: |");
    for (b, gbs) in alone.iter().enumerate() {
        let _ = writeln!(report, "| boundary {b} ({} -> {}) alone | {gbs:.1} |", b, b + 1);
    }
    let line = format!(
        "| sum of the boundaries alone | {sum:.1} |\n| all at once (aggregate) | {together:.1} ({:.1}% of the sum) |",
        100.0 * together / sum
    );
    println!("{line}");
    let _ = writeln!(report, "{line}");
}

/// Device time of back-to-back copies of `bytes` from device `a` to `b`, the crate's safe
/// `memcpy_dtod` and the raw `cuMemcpyAsync` interleaved, both with the stream's context current,
/// and the safe copy with none current: per-copy medians of `reps` rounds, seconds.
pub(crate) fn back_to_back(gpus: &Gpus, a: usize, b: usize, bytes: usize, reps: usize) -> BackToBack {
    let (ea, eb) = (&gpus.engines[a], &gpus.engines[b]);
    let stream = ea.default_stream().clone();
    let events = (CudaEvent::new(ea.context(), true).unwrap(), CudaEvent::new(ea.context(), true).unwrap());
    let src = filled(ea, bytes, 5);
    let mut dst = filled(eb, bytes, 6);
    let (s, d) = (src.device_ptr(), dst.device_ptr());
    let iters = (256 * MIB / bytes).clamp(1, 200) as u64;
    let (mut crate_times, mut raw_times, mut unbound_times, mut unchecked_times) =
        (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    for rep in 0..reps + 2 {
        // The safe copy as the thread found it (no context current: the copy makes the stream's
        // context current and restores the previous one, two `cuCtxSetCurrent` more).
        let u = device_time(&stream, &events, iters, || stream.memcpy_dtod(&src, &mut dst).unwrap());
        // Both loops with the stream's context current, the state the raw calls are documented
        // for (the crate then makes one `cuCtxGetCurrent` per copy and no switch).
        let bound = ea.context().bind().unwrap();
        let c = device_time(&stream, &events, iters, || stream.memcpy_dtod(&src, &mut dst).unwrap());
        let r = device_time(&stream, &events, iters, || raw!(cuMemcpyAsync(d, s, bytes, stream.raw())));
        drop(bound);
        // The safe copy inside `Context::bound_unchecked` (no context query per copy).
        // SAFETY: the closure runs the crate's calls only; nothing else changes the context.
        let q = unsafe {
            ea.context().bound_unchecked(|| {
                device_time(&stream, &events, iters, || stream.memcpy_dtod(&src, &mut dst).unwrap())
            })
        }
        .unwrap();
        if rep >= 2 {
            crate_times.push(c.as_secs_f64());
            raw_times.push(r.as_secs_f64());
            unbound_times.push(u.as_secs_f64());
            unchecked_times.push(q.as_secs_f64());
        }
    }
    eb.synchronize().unwrap();
    let per_copy = |times: &mut Vec<f64>| median(times) / iters as f64;
    BackToBack {
        safe: per_copy(&mut crate_times),
        raw: per_copy(&mut raw_times),
        unbound: per_copy(&mut unbound_times),
        unchecked: per_copy(&mut unchecked_times),
    }
}

/// The safe copy against `cuMemcpyAsync`, copies back to back ([`back_to_back`]): within each
/// device 4 KiB to 1 GiB, between the first two devices (if they are peers) 4 KiB to 16 MiB. The
/// small sizes show the copy's own cost where the host's issue bounds it, the large ones that the
/// copy moves the bytes as fast as the raw call. The targets table checks the first device's copies
/// and the peer copies, both directions, at every size.
pub(crate) fn copies(gpus: &Gpus, report: &mut String) {
    let mut pairs = vec![(0, 0)];
    if gpus.peers {
        pairs.extend([(1, 1), (0, 1), (1, 0)]);
    }
    let _ = writeln!(
        report,
        "\n| copy back to back | safe (µs per copy) | raw (µs per copy) | raw / safe | safe, no context current (µs) | safe in bound_unchecked (µs) | raw / that |\n| --- | ---: | ---: | ---: | ---: | ---: | ---: |"
    );
    for (a, b) in pairs {
        // Within a device every size, 4 KiB to 1 GiB; between two the targets table has the
        // larger ones.
        let largest = if a == b { usize::MAX } else { 16 * MIB };
        for bytes in COPY_SIZES.into_iter().filter(|&bytes| bytes <= largest) {
            let BackToBack { safe, raw, unbound, unchecked } = back_to_back(gpus, a, b, bytes, 9);
            let line = format!(
                "| {a} -> {b} {} | {:.3} | {:.3} | {:.3} | {:.3} | {:.3} | {:.3} |",
                label(bytes),
                safe * 1e6,
                raw * 1e6,
                raw / safe,
                unbound * 1e6,
                unchecked * 1e6,
                raw / unchecked
            );
            println!("COPY {line}");
            let _ = writeln!(report, "{line}");
        }
    }
}

/// Device time per copy of copies issued back to back (seconds).
pub(crate) struct BackToBack {
    /// The safe copy, with the stream's context current.
    pub(crate) safe: f64,
    /// `cuMemcpyAsync`, with the stream's context current.
    pub(crate) raw: f64,
    /// The safe copy with no context current.
    pub(crate) unbound: f64,
    /// The safe copy inside `Context::bound_unchecked` of the stream's context.
    pub(crate) unchecked: f64,
}

/// The engine-facing paths against their references, each with its target:
/// receiving in place vs `rx`, deferred readback vs the raw calls it makes, and one host thread
/// per stage vs one thread driving every stage.
pub(crate) fn engine_paths(gpus: &Gpus, report: &mut String) {
    let mut checks: Vec<(String, String, bool)> = Vec::new();
    let us = 1e6;
    // In place, 32 KiB, on the peer boundary if there is one.
    let (name, devices, policy) = transports(gpus).into_iter().find(|t| t.0 == "peer").unwrap_or(transports(gpus)[0]);
    let mut boundary = Boundary::new(gpus, devices, policy, 64 * MIB);
    boundary.set_bytes(32 * KIB);
    boundary.host_times(false, 50);
    boundary.host_times_in_place(false, 50);
    boundary.host_times_in_place(true, 50);
    let (mut copy, mut in_place, mut raw_in_place) = (Vec::new(), Vec::new(), Vec::new());
    for _ in 0..6 {
        let (t, r) = boundary.host_times(false, 200);
        copy.extend(t.iter().zip(&r).map(|(a, b)| a + b));
        in_place.extend(boundary.host_times_in_place(false, 200));
        raw_in_place.extend(boundary.host_times_in_place(true, 200));
    }
    let (copy, in_place, raw_in_place) = (median(&mut copy), median(&mut in_place), median(&mut raw_in_place));
    checks.push((
        format!("{name} 32 KiB: tx + in-place receive ≤ 0.7× tx + rx (host)"),
        format!(
            "{:.2} µs vs tx + rx {:.2} µs ({:.3}×); raw in place {:.2} µs",
            in_place * us,
            copy * us,
            in_place / copy,
            raw_in_place * us
        ),
        in_place <= 0.7 * copy,
    ));
    // One 64 MiB step received in place, against the raw peer copy, event and cross-device wait.
    boundary.set_bytes(64 * MIB);
    boundary.hop_times(false, 3, true);
    boundary.hop_times(true, 3, true);
    let (mut crate_hops, mut raw_hops) = (Vec::new(), Vec::new());
    for _ in 0..5 {
        crate_hops.extend(boundary.hop_times(false, 8, true));
        raw_hops.extend(boundary.hop_times(true, 8, true));
    }
    let (crate_hop, raw_hop) = (median(&mut crate_hops), median(&mut raw_hops));
    let gbs = |seconds: f64| (64 * MIB) as f64 / seconds / 1e9;
    checks.push((
        format!("{name} 64 MiB single step received in place ≥ 0.97× raw in place"),
        format!(
            "{:.1} µs ({:.1} GB/s) vs raw {:.1} µs ({:.1} GB/s): {:.3}×",
            crate_hop * us,
            gbs(crate_hop),
            raw_hop * us,
            gbs(raw_hop),
            raw_hop / crate_hop
        ),
        raw_hop / crate_hop >= 0.97,
    ));
    drop(boundary);

    // Deferred readback of 32 KiB from the last stage: the crate's call against the raw calls
    // (record on the stage stream, wait on the readback stream, D2H issue, record after it).
    let last = gpus.engines.len().min(2) - 1;
    let rt = PpNRt::new(PpConfig::with_devices(&[0, last as i32]), &gpus.engines[0]).unwrap();
    let e = rt.engine(1, &gpus.engines[0]).unwrap().clone();
    let stage = rt.stage_stream(1).unwrap().clone();
    let readback = rt.readback_stream().clone();
    let n = 32 * KIB / 4;
    let mut pinned = PinnedHostBuffer::<u32>::new(e.context(), n, false).unwrap();
    let (mark, done) = (CudaEvent::new(e.context(), false).unwrap(), CudaEvent::new(e.context(), false).unwrap());
    let source = {
        let _stage = rt.enter(1).unwrap();
        let mut source = e.alloc::<u32>(n).unwrap();
        e.fill_pattern(&mut source, 9).unwrap();
        source
    };
    let (mut crate_times, mut raw_times) = (Vec::new(), Vec::new());
    // The whole cycle a decode loop pays: the call, the wait for the values, reading them, and
    // giving the buffers back; raw: the calls, the event wait, reading the pinned buffer.
    let (mut crate_cycles, mut raw_cycles) = (Vec::new(), Vec::new());
    let expected_last = ppnrt::kernels::pattern(9, (n - 1) as u64);
    for round in 0..1200 {
        let logits = {
            let _stage = rt.enter(1).unwrap();
            let mut logits = e.alloc::<u32>(n).unwrap();
            stage.memcpy_dtod(&source, &mut logits).unwrap();
            logits
        };
        rt.synchronize().unwrap();
        // Both inside the last stage's scope, where a decode loop starts its readback (after the
        // stage's last kernels; `examples/processes.rs`, the README's loops).
        let (crate_s, crate_cycle) = {
            let _stage = rt.enter(1).unwrap();
            let t0 = Instant::now();
            let pending = rt.readback(logits).unwrap();
            let crate_s = t0.elapsed().as_secs_f64();
            let last_value = pending.wait().unwrap()[n - 1];
            drop(pending);
            let crate_cycle = t0.elapsed().as_secs_f64();
            assert_eq!(last_value, expected_last);
            (crate_s, crate_cycle)
        };
        rt.synchronize().unwrap();
        let (raw_s, raw_cycle) = {
            let _stage = rt.enter(1).unwrap();
            let t0 = Instant::now();
            raw!(cuCtxSetCurrent(e.context().raw()));
            raw!(cuEventRecord(mark.raw(), stage.raw()));
            raw!(cuStreamWaitEvent(readback.raw(), mark.raw(), 0));
            raw!(cuMemcpyDtoHAsync_v2(pinned.as_mut_ptr().cast(), source.device_ptr(), n * 4, readback.raw()));
            raw!(cuEventRecord(done.raw(), readback.raw()));
            let raw_s = t0.elapsed().as_secs_f64();
            raw!(cuEventSynchronize(done.raw()));
            // SAFETY: the copy into the pinned buffer completed (the event wait above).
            let last_value = unsafe { *pinned.as_mut_ptr().add(n - 1) };
            let raw_cycle = t0.elapsed().as_secs_f64();
            assert_eq!(last_value, expected_last);
            (raw_s, raw_cycle)
        };
        readback.synchronize().unwrap();
        if round >= 200 {
            crate_times.push(crate_s);
            raw_times.push(raw_s);
            crate_cycles.push(crate_cycle);
            raw_cycles.push(raw_cycle);
        }
    }
    let (c, r) = (median(&mut crate_times), median(&mut raw_times));
    checks.push((
        "deferred readback 32 KiB: host cost per step ≤ 2 µs".into(),
        format!("{:.2} µs (raw record + wait + D2H issue + record {:.2} µs, {:.3}×)", c * us, r * us, c / r),
        c * us <= 2.0,
    ));
    let (c, r) = (median(&mut crate_cycles), median(&mut raw_cycles));
    checks.push((
        "deferred readback 32 KiB, the whole cycle (call, wait, values, buffers back) ≤ 1.05× raw".into(),
        format!(
            "{:.2} µs (raw record + wait + D2H + record + event wait + read {:.2} µs, {:.3}×)",
            c * us,
            r * us,
            c / r
        ),
        c / r <= 1.05,
    ));
    drop(rt);

    // One host thread per stage against one thread: 4 stages over the GPUs, 1 KiB activations.
    let map: Vec<i32> = (0..4).map(|s| (s % gpus.engines.len().min(2)) as i32).collect();
    let steps = 2_000;
    threads::one_thread(&gpus.engines[0], &map, 2, 100);
    threads::thread_per_stage(&gpus.engines[0], &map, 2, 100);
    let (expected, one) = threads::one_thread(&gpus.engines[0], &map, 2, steps);
    let (got, many) = threads::thread_per_stage(&gpus.engines[0], &map, 2, steps);
    assert!(got == expected, "thread-per-stage outputs differ");
    let ratio = many.as_secs_f64() / one.as_secs_f64();
    checks.push((
        format!("one thread per stage ({map:?}, {steps} steps) within 1.15× one thread's time"),
        format!(
            "{:.2} vs {:.2} µs per step ({ratio:.3}×)",
            many.as_secs_f64() / steps as f64 * us,
            one.as_secs_f64() / steps as f64 * us
        ),
        ratio <= 1.15,
    ));

    let _ = writeln!(report, "\n| engine path | measured | met |\n| --- | --- | --- |");
    for (name, measured, met) in &checks {
        let line = format!("| {name} | {measured} | {} |", if *met { "yes" } else { "NO" });
        println!("TARGET {line}");
        let _ = writeln!(report, "{line}");
    }
}
