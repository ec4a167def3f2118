//! The fault sweeps of a runtime's build and drop and of the safe layer: every driver call fails
//! in turn; nothing leaks, nothing in use is freed.

use super::*;

/// The fault sweep of a runtime's build: every driver call `PpNRt::new` makes (streams, events,
/// slot buffers, peer access) is failed in turn, one per run, on every transport. A failed build
/// is a typed error naming the call (or, for a failure it can recover from, a build that records
/// the error for `take_drop_errors`) and leaves nothing behind: once the double ran every queued
/// free, as many device and pinned allocations are live as before it; no queued work touched
/// freed memory; and the next build works, its first step delivering its values.
#[test]
fn every_failing_driver_call_of_a_build_is_an_error_that_leaks_nothing() {
    with_double("every_failing_driver_call_of_a_build_is_an_error_that_leaks_nothing", |double| {
        let n = 4096;
        let data: Vec<u32> = (0..n as u32).map(|i| i.wrapping_mul(2_246_822_519) ^ 0x1234_5678).collect();
        let primary = Engine::new(0).unwrap();
        let mut cases = 0;
        for (devices, policy) in EVERY_TRANSPORT {
            let what = format!("{policy:?} {devices:?}");
            let config = PpConfig::with_devices(&devices).with_transport(policy);
            // A build, one step, and the drop.
            let build_and_step = |case: &str| {
                let rt =
                    PpNRt::new(config.clone(), &primary).unwrap_or_else(|e| panic!("{case}: the build failed: {e}"));
                let (e0, e1) = (rt.engine(0, &primary).unwrap().clone(), rt.engine(1, &primary).unwrap().clone());
                let input = {
                    let _stage = rt.enter(0).unwrap();
                    e0.htod(&data).unwrap()
                };
                match sweep_step(&rt, &e1, &input, n, false) {
                    Swept::Delivered(values) => assert!(values == data, "{case}: wrong values"),
                    other => panic!("{case}: {other:?}"),
                }
            };
            // One-time work (module loads, peer access) done first; then the calls of a build.
            build_and_step(&what);
            raw!(cuCtxSetCurrent(std::ptr::null_mut()));
            double.flush();
            let baseline = double.live_allocations();
            let mut built = None;
            let calls = double.calls_made_by(|| built = Some(PpNRt::new(config.clone(), &primary).unwrap()));
            drop(built);
            double.flush();
            assert_eq!(double.live_allocations(), baseline, "{what}: a build and its drop leaked");
            assert!(calls.iter().map(|(_, c)| c).sum::<u64>() >= 5, "{what}: a build made only {calls:?}");
            cases += sweep_calls(double, &calls, &what, |injected| {
                let case = injected.case.clone();
                raw!(cuCtxSetCurrent(std::ptr::null_mut()));
                injected.arm();
                let built = PpNRt::new(config.clone(), &primary);
                let recorded = injected.disarm();
                match built {
                    Err(e) => injected.assert_named(&e),
                    Ok(rt) => {
                        // Only a failure the build can recover from: a guard's restore of the
                        // thread's current context, which it records.
                        assert!(
                            recorded.iter().any(|e| injected.names(e)),
                            "{case}: the build succeeded and recorded no error naming the call: {recorded:?}"
                        );
                        drop(rt);
                    }
                }
                double.flush();
                assert_eq!(double.live_allocations(), baseline, "{case}: allocations left behind");
                build_and_step(&case);
            });
        }
        println!("build fault sweep: {cases} runs, each with one failing driver call");
    });
}

/// The fault sweep of drops with work still queued: a step's `tx` and `rx` issued and not waited
/// for, the received buffer read on another stream; then the input, the received buffer, the
/// other stream's copy and the runtime dropped, in that order. Every driver call those drops make
/// is failed in turn, one per run, on every transport. The failure is recorded for
/// `take_drop_errors`, and no queued work touches freed memory (a buffer whose wait could not be
/// set up is left allocated rather than freed under a copy).
#[test]
fn every_failing_driver_call_of_a_drop_with_work_queued_frees_nothing_in_use() {
    with_double("every_failing_driver_call_of_a_drop_with_work_queued_frees_nothing_in_use", |double| {
        let n = 1 << 16;
        let data: Vec<u32> = (0..n as u32).map(|i| i ^ 0xa5a5_0f0f).collect();
        let primary = Engine::new(0).unwrap();
        let mut cases = 0;
        for (devices, policy) in EVERY_TRANSPORT {
            let what = format!("{policy:?} {devices:?}");
            let config = PpConfig::with_devices(&devices).with_transport(policy);
            // A runtime with one step's copies queued and nothing waited for, and the step's
            // buffers: the input (read by `tx`), the received buffer (read on another stream of
            // its device, so its free must wait for that stream) and that stream's copy.
            let busy = || {
                let rt = PpNRt::new(config.clone(), &primary).unwrap();
                let (e0, e1) = (rt.engine(0, &primary).unwrap().clone(), rt.engine(1, &primary).unwrap().clone());
                let input = {
                    let _stage = rt.enter(0).unwrap();
                    e0.htod(&data).unwrap()
                };
                let slot = rt.enter(0).and_then(|_stage| rt.tx(0, &input, n)).unwrap();
                let received = rt.enter(1).and_then(|_stage| rt.rx::<u32>(0, slot, n)).unwrap();
                let other = CudaStream::new(e1.context()).unwrap();
                let mut copy = CudaSlice::<u32>::alloc(&other, n).unwrap();
                other.memcpy_dtod(&received, &mut copy).unwrap();
                raw!(cuCtxSetCurrent(std::ptr::null_mut()));
                (vec![input, received, copy], rt)
            };
            drop(busy());
            double.flush();
            let held = busy();
            let calls = double.calls_made_by(|| drop(held));
            double.flush();
            assert!(calls.iter().any(|(entry, _)| entry == "cuStreamSynchronize"), "{what}: {calls:?}");
            cases += sweep_calls(double, &calls, &format!("{what}, in the drops"), |injected| {
                let held = busy();
                injected.arm();
                drop(held);
                let recorded = injected.disarm();
                assert!(
                    recorded.iter().any(|e| injected.names(e)),
                    "{}: no recorded error names the call: {recorded:?}",
                    injected.case
                );
            });
        }
        println!("drop fault sweep: {cases} runs, each with one failing driver call");
    });
}

/// A chain of the safe layer's operations across two streams of one device, each buffer used on
/// a stream other than the one that last wrote it: a pageable upload, a copy read on the other
/// stream and its source dropped, a memset, a copy back, a helper kernel's write under an ambient
/// stream after that read, a copy into a pinned buffer and the host's read of it, and a pinned
/// upload read back. Returns what the host read twice (pinned, then through the device).
pub(crate) fn safe_chain(e: &Engine, data: &[u32]) -> ppnrt::Result<(Vec<u32>, Vec<u32>)> {
    let n = data.len();
    let (s1, s2) = (e.stream()?, e.stream()?);
    let mut a = CudaSlice::<u32>::alloc(&s1, n)?;
    s1.memcpy_htod(data, &mut a)?;
    let mut b = CudaSlice::<u32>::alloc(&s2, n)?;
    s2.memcpy_dtod(&a, &mut b)?;
    drop(a);
    let mut c = CudaSlice::<u32>::alloc(&s1, n)?;
    s1.memset_u32(&mut c, 7)?;
    s1.memcpy_dtod(&b, &mut c)?;
    {
        let _on_s2 = StreamOverride::new(Arc::clone(&s2))?;
        e.fill_u32(&mut b, 0)?;
    }
    let mut host = PinnedHostBuffer::<u32>::new(e.context(), n, false)?;
    s2.memcpy_dtoh_pinned(&c, &mut host)?;
    let pinned = host.as_slice()?.to_vec();
    s1.memcpy_htod_pinned(&host, &mut b)?;
    drop(host);
    let back = {
        let _on_s1 = StreamOverride::new(Arc::clone(&s1))?;
        e.dtoh(&b)?
    };
    Ok((pinned, back))
}

/// The fault sweep of the safe layer: every driver call of [`safe_chain`] is failed in turn, one
/// per run. The chain returns a typed error naming the call, or the right values with the failure
/// recorded for `take_drop_errors`; a second chain then delivers; and no queued work touches memory freed meanwhile, the buffers the failed chain
/// dropped on its way out included.
#[test]
fn every_failing_driver_call_of_the_safe_layer_is_an_error_that_loses_nothing() {
    with_double("every_failing_driver_call_of_the_safe_layer_is_an_error_that_loses_nothing", |double| {
        let e = Engine::new(0).unwrap();
        let data: Vec<u32> = (0..1u32 << 14).map(|i| i.wrapping_mul(0x9e37_79b9) ^ 0x00c0_ffee).collect();
        let expected = (data.clone(), data.clone());
        assert_eq!(safe_chain(&e, &data).unwrap(), expected, "the chain itself");
        raw!(cuCtxSetCurrent(std::ptr::null_mut()));
        double.flush();
        let mut chained = None;
        let calls = double.calls_made_by(|| chained = Some(safe_chain(&e, &data).unwrap()));
        assert!(calls.iter().map(|(_, c)| c).sum::<u64>() >= 10, "the chain made only {calls:?}");
        let cases = sweep_calls(double, &calls, "the safe-layer chain", |injected| {
            let case = injected.case.clone();
            raw!(cuCtxSetCurrent(std::ptr::null_mut()));
            injected.arm();
            let outcome = safe_chain(&e, &data);
            let recorded = injected.disarm();
            match outcome {
                Ok(values) => {
                    assert!(values == expected, "{case}: wrong values");
                    // A failure the chain got over is recorded.
                    assert!(recorded.iter().any(|e| injected.names(e)), "{case}: unreported: {recorded:?}");
                }
                Err(err) => injected.assert_named(&err),
            }
            assert!(safe_chain(&e, &data).unwrap() == expected, "{case}: the next chain");
        });
        println!("safe-layer fault sweep: {cases} runs, each with one failing driver call");
    });
}
