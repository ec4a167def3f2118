//! The soundness scenarios of `common/soundness.rs`, failed calls that leave nothing in flight,
//! and older drivers and devices (child processes with a variant of the double).

use super::*;

#[test]
fn pinned_sources_are_read_before_htod_returns() {
    with_double("pinned_sources_are_read_before_htod_returns", |_| {
        soundness::pinned_sources_are_read_before_htod_returns(&Engine::new(0).unwrap());
    });
}

#[test]
fn copy_with_sms_refuses_memory_its_sms_cannot_reach() {
    with_double("copy_with_sms_refuses_memory_its_sms_cannot_reach", |_| {
        soundness::copy_with_sms_refuses_memory_its_sms_cannot_reach(
            &Engine::new(0).unwrap(),
            &Engine::new(1).unwrap(),
        );
    });
}

#[test]
fn stream_overrides_drop_in_any_order() {
    with_double("stream_overrides_drop_in_any_order", |_| {
        soundness::stream_overrides_drop_in_any_order(&Engine::new(0).unwrap());
    });
}

#[test]
fn calls_leave_the_current_context_as_they_found_it() {
    with_double("calls_leave_the_current_context_as_they_found_it", |_| {
        soundness::calls_leave_the_current_context_as_they_found_it(&Engine::new(0).unwrap(), &Engine::new(1).unwrap());
    });
}

#[test]
fn work_beside_a_capture_waits_for_the_writes_before_it() {
    with_double("work_beside_a_capture_waits_for_the_writes_before_it", |_| {
        soundness::work_beside_a_capture_waits_for_the_writes_before_it(&Engine::new(0).unwrap());
    });
}

#[test]
fn work_racing_a_capture_lands_inside_it_or_outside_it() {
    with_double("work_racing_a_capture_lands_inside_it_or_outside_it", |_| {
        soundness::work_racing_a_capture_lands_inside_it_or_outside_it(&Engine::new(0).unwrap(), 20_000);
    });
}

#[test]
fn discarded_slots_are_free_again() {
    with_double("discarded_slots_are_free_again", |_| {
        let primary = Engine::new(0).unwrap();
        soundness::discarded_slots_are_free_again(&primary, &[0, 0]);
        soundness::discarded_slots_are_free_again(&primary, &[0, 1]);
    });
}

/// A boundary of each transport: host-staged and peer across two devices, local on one.
pub(crate) const EVERY_TRANSPORT: [([i32; 2], TransportPolicy); 3] =
    [([0, 1], TransportPolicy::Staged), ([0, 1], TransportPolicy::Auto), ([0, 0], TransportPolicy::Auto)];

/// A `tx` whose event record fails leaves no copy in flight: the next, larger `tx` reallocates
/// the slot, and the failed copy must not land in the freed buffer (pinned memory for
/// `HostStaged`, device memory for `Peer` and `Local`).
#[test]
fn a_failed_tx_leaves_no_copy_in_flight() {
    with_double("a_failed_tx_leaves_no_copy_in_flight", |double| {
        let primary = Engine::new(0).unwrap();
        for (devices, policy) in EVERY_TRANSPORT {
            let rt = PpNRt::new(PpConfig::with_devices(&devices).with_transport(policy), &primary).unwrap();
            let e = rt.engine(0, &primary).unwrap().clone();
            let _stage = rt.enter(0).unwrap();
            let small = e.htod(&[3u32; 1024]).unwrap();
            double.flush(); // only the failing call's own work is counted below
            double.fail("cuEventRecord", 1, OUT_OF_MEMORY);
            let err = rt.tx(0, &small, 1024).unwrap_err();
            assert!(err.to_string().contains("cuEventRecord"), "{err}");
            // The error returned with nothing of the call left queued (its stream was drained).
            assert_eq!(double.pending(), 0, "{policy:?} {devices:?}: work left in flight after the error");
            let big_data: Vec<u32> = (0..1u32 << 18).collect();
            let big = e.htod(&big_data).unwrap();
            let slot = rt.tx(0, &big, big_data.len()).unwrap();
            let got = rt.rx::<u32>(0, slot, big_data.len()).unwrap();
            assert_eq!(e.dtoh(&got).unwrap(), big_data, "{policy:?} {devices:?}");
        }
    });
}

/// An `rx` whose event record fails leaves the slot filled and the data intact: a second `rx`
/// receives it.
#[test]
fn a_failed_rx_can_be_retried() {
    with_double("a_failed_rx_can_be_retried", |double| {
        let primary = Engine::new(0).unwrap();
        let rt = PpNRt::new(PpConfig::with_devices(&[0, 1]), &primary).unwrap();
        let data: Vec<u32> = (0..4096).collect();
        let x = {
            let _stage = rt.enter(0).unwrap();
            rt.engine(0, &primary).unwrap().htod(&data).unwrap()
        };
        let slot = rt.tx(0, &x, data.len()).unwrap();
        let _stage = rt.enter(1).unwrap();
        double.fail("cuEventRecord", 1, OUT_OF_MEMORY);
        assert!(rt.rx::<u32>(0, slot, data.len()).is_err());
        let got = rt.rx::<u32>(0, slot, data.len()).unwrap();
        assert_eq!(rt.engine(1, &primary).unwrap().dtoh(&got).unwrap(), data);
    });
}

/// In a warm ring (every slot's events made and reused), a `tx` or `rx` whose event record fails
/// returns the error with its work drained, and the ring goes on: the next steps deliver their
/// data, ordered (no violation), on every transport.
#[test]
fn a_failed_record_in_a_warm_ring_leaves_it_ordered() {
    with_double("a_failed_record_in_a_warm_ring_leaves_it_ordered", |double| {
        let primary = Engine::new(0).unwrap();
        for (devices, policy) in EVERY_TRANSPORT {
            let rt = PpNRt::new(PpConfig::with_devices(&devices).with_transport(policy), &primary).unwrap();
            let (e0, e1) = (rt.engine(0, &primary).unwrap().clone(), rt.engine(1, &primary).unwrap().clone());
            let step_data =
                |step: u32| -> Vec<u32> { (0..4096u32).map(|i| i.wrapping_mul(2_654_435_761) ^ step).collect() };
            let inputs: Vec<_> = {
                let _stage = rt.enter(0).unwrap();
                (0..12).map(|step| e0.htod(&step_data(step)).unwrap()).collect()
            };
            let step = |at: usize| {
                let slot = rt.tx(0, &inputs[at], 4096).unwrap();
                let got = rt.rx::<u32>(0, slot, 4096).unwrap();
                assert_eq!(e1.dtoh(&got).unwrap(), step_data(at as u32), "{policy:?} {devices:?} step {at}");
            };
            (0..4).for_each(step); // every slot's events made
            double.flush();
            double.fail("cuEventRecord", 1, OUT_OF_MEMORY);
            let err = rt.tx(0, &inputs[4], 4096).unwrap_err();
            assert!(err.to_string().contains("cuEventRecord"), "{policy:?} {devices:?}: {err}");
            assert_eq!(double.pending(), 0, "{policy:?} {devices:?}: the failed tx left work in flight");
            (5..7).for_each(step);
            let slot = rt.tx(0, &inputs[7], 4096).unwrap();
            double.fail("cuEventRecord", 1, OUT_OF_MEMORY);
            assert!(rt.rx::<u32>(0, slot, 4096).is_err(), "{policy:?} {devices:?}");
            let got = rt.rx::<u32>(0, slot, 4096).unwrap();
            assert_eq!(e1.dtoh(&got).unwrap(), step_data(7), "{policy:?} {devices:?}: the retried rx");
            (8..12).for_each(step);
            rt.synchronize().unwrap();
            assert_eq!(double.violations(), 0, "{policy:?} {devices:?}: {}", double.last_violation());
        }
    });
}

/// Pinned copies: a host access whose wait cannot be set up (the event record fails) is an error
/// and leaves the buffer's ordering intact: the next access still waits, and sees the data; the
/// source of a copy out of pinned memory may be overwritten once the access returns.
#[test]
fn failed_waits_on_pinned_buffers_keep_them_ordered() {
    with_double("failed_waits_on_pinned_buffers_keep_them_ordered", |double| {
        let e = Engine::new(0).unwrap();
        let stream = e.default_stream();
        let data: Vec<u32> = (0..8192u32).map(|i| i ^ 0x5a5a).collect();
        let src = e.htod(&data).unwrap();
        let mut host = PinnedHostBuffer::<u32>::new(e.context(), data.len(), false).unwrap();
        stream.memcpy_dtoh_pinned(&src, &mut host).unwrap();
        double.fail("cuEventRecord", 1, OUT_OF_MEMORY);
        assert!(host.as_slice().is_err(), "the wait could not be set up");
        assert_eq!(host.as_slice().unwrap(), &data[..], "the copy into pinned memory was not waited for");

        let mut dst = e.alloc::<u32>(data.len()).unwrap();
        stream.memcpy_htod_pinned(&host, &mut dst).unwrap();
        double.fail("cuEventRecord", 1, OUT_OF_MEMORY);
        assert!(host.as_mut_slice().is_err());
        host.as_mut_slice().unwrap().fill(9);
        assert_eq!(e.dtoh(&dst).unwrap(), data, "the copy out of pinned memory was not waited for");
    });
}

/// Copies, memsets and helper launches on one stream into a buffer owned by another: when the
/// join back into the owner fails, the call waits for its work, so the owner may free the buffer.
#[test]
fn failed_joins_back_into_the_owner_leave_no_work_in_flight() {
    with_double("failed_joins_back_into_the_owner_leave_no_work_in_flight", |double| {
        let e = Engine::new(0).unwrap();
        let worker = CudaStream::new(e.context()).unwrap();
        let owner = CudaStream::new(e.context()).unwrap();
        type Op = fn(&Engine, &Arc<CudaStream>, &CudaSlice<u32>, &mut CudaSlice<u32>) -> Result<(), CudaError>;
        let ops: [(&str, Op); 4] = [
            ("memcpy_dtod", |_, s, src, dst| s.memcpy_dtod(src, dst)),
            ("memset_u32", |_, s, _, dst| s.memset_u32(dst, 7)),
            ("memset_bytes", |_, s, _, dst| s.memset_bytes(dst, 7)),
            ("fill_u32", |e, s, _, dst| {
                let _on_worker = StreamOverride::new(Arc::clone(s))?;
                e.fill_u32(dst, 7)
            }),
        ];
        for (what, op) in ops {
            let src = CudaSlice::<u32>::alloc(&worker, 1 << 16).unwrap();
            let mut dst = CudaSlice::<u32>::alloc(&owner, 1 << 16).unwrap();
            worker.synchronize().unwrap();
            owner.synchronize().unwrap();
            double.fail("cuEventRecord", 1, OUT_OF_MEMORY);
            let err = op(&e, &worker, &src, &mut dst).unwrap_err();
            assert!(matches!(err, CudaError::Driver(_)), "{what}: {err}");
            drop(dst); // freed on `owner`, which nothing ordered after the work on `worker`
            owner.synchronize().unwrap();
            worker.synchronize().unwrap();
            assert_eq!(double.violations(), 0, "{what}: {}", double.last_violation());
        }
    });
}

/// A helper-module load that fails (out of memory) is not kept: the next call loads it.
#[test]
fn a_failed_helper_load_is_retried() {
    with_double("a_failed_helper_load_is_retried", |double| {
        let e = Engine::new(0).unwrap();
        let mut x = e.alloc::<u32>(64).unwrap();
        double.fail("cuModuleLoadData", 1, OUT_OF_MEMORY);
        assert!(e.fill_u32(&mut x, 1).is_err());
        e.fill_u32(&mut x, 1).unwrap();
        assert_eq!(e.dtoh(&x).unwrap(), vec![1; 64]);
        double.fail("cuModuleLoadData", 1, OUT_OF_MEMORY);
        let primary = Engine::new(0).unwrap();
        assert!(PpNRt::new(PpConfig::new(2), &primary).is_err());
        assert!(PpNRt::new(PpConfig::new(2), &primary).is_ok(), "a runtime builds once the load succeeds");
    });
}

/// Asking for the ambient stream from a thread-local destructor, after this crate's thread state
/// is gone, is a typed error (it used to panic inside a destructor, which aborts the process).
#[test]
fn the_ambient_stream_after_thread_teardown_is_a_typed_error() {
    struct AskOnExit(std::sync::mpsc::Sender<String>);
    impl Drop for AskOnExit {
        fn drop(&mut self) {
            let answer = match ppnrt::ambient_stream() {
                Ok(_) => "ok".to_string(),
                Err(e) => e.to_string(),
            };
            let _ = self.0.send(answer);
        }
    }
    thread_local! {
        static ASK: std::cell::RefCell<Option<AskOnExit>> = const { std::cell::RefCell::new(None) };
    }
    let (send, recv) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        // Registered first, so destroyed last: after the crate's own thread-local state.
        ASK.with(|ask| *ask.borrow_mut() = Some(AskOnExit(send)));
        assert!(ppnrt::ambient_stream().unwrap().is_none());
    })
    .join()
    .expect("no panic at thread exit");
    let answer = recv.recv().unwrap();
    assert!(answer.contains("destroyed"), "{answer}");
}

/// Runs the ignored test `name` of this binary in a child process with the double at `library`
/// and `env` set; panics with its output unless it succeeds.
pub(crate) fn run_child(name: &str, library: &std::path::Path, env: &[(&str, &str)]) {
    let output = Command::new(std::env::current_exe().unwrap())
        .args([name, "--exact", "--ignored", "--nocapture", "--test-threads=1"])
        .env("PPNRT_LIBCUDA_PATH", library)
        .env("PPNRT_DOUBLE_CHILD", "1")
        .envs(env.iter().copied())
        .output()
        .unwrap();
    let text = format!("{}{}", String::from_utf8_lossy(&output.stdout), String::from_utf8_lossy(&output.stderr));
    assert!(output.status.success() && text.contains("1 passed"), "child {name} failed:\n{text}");
}

/// Devices without memory pools: stream-ordered allocations fall back to `cuMemAlloc`, and the
/// pipeline works.
#[test]
fn streams_and_kernels_report_their_devices_ordinal_and_a_launch_checks_it() {
    with_double("streams_and_kernels_report_their_devices_ordinal_and_a_launch_checks_it", |_| {
        let engines = [Engine::new(0).unwrap(), Engine::new(1).unwrap()];
        let kernels = engines.each_ref().map(|engine| {
            ppnrt::Module::load_ptx(engine.context(), "helpers", ppnrt::kernels::HELPERS_PTX)
                .unwrap()
                .function("ppnrt_copy_bytes")
                .unwrap()
        });
        for (ordinal, (engine, kernel)) in engines.iter().zip(&kernels).enumerate() {
            let ordinal = ordinal as i32;
            assert_eq!(engine.default_stream().ordinal(), ordinal, "device {ordinal}'s default stream");
            assert_eq!(
                CudaStream::new(engine.context()).unwrap().ordinal(),
                ordinal,
                "a new stream of device {ordinal}"
            );
            assert_eq!(kernel.ordinal(), ordinal, "a kernel of device {ordinal}");
        }
        // Device 0's kernel on device 1's stream is refused before anything is enqueued, naming
        // both devices; device 1's own kernel runs there.
        let stream = engines[1].default_stream();
        let mut dst = engines[1].alloc::<u32>(4).unwrap();
        let src = engines[1].htod(&[1u32, 2, 3, 4]).unwrap();
        let config = ppnrt::LaunchConfig::for_elements(1, 1);
        // SAFETY: ppnrt_copy_bytes(dst, src, n16, tail) copies one 16-byte word: both hold 16 bytes.
        let refused = unsafe { stream.launch(&kernels[0], config, (&mut dst, &src, 1u64, 0u64)) }.unwrap_err();
        assert!(matches!(refused, CudaError::WrongDevice { expected: 1, found: 0, .. }), "{refused}");
        // SAFETY: as above.
        unsafe { stream.launch(&kernels[1], config, (&mut dst, &src, 1u64, 0u64)) }.unwrap();
        assert_eq!(engines[1].dtoh(&dst).unwrap(), [1, 2, 3, 4]);
    });
}

#[test]
fn devices_without_memory_pools_fall_back_to_plain_allocations() {
    with_double("devices_without_memory_pools_fall_back_to_plain_allocations", |double| {
        run_child("scenarios::child_without_pools", &double.path, &[("PPNRT_DOUBLE_NO_POOLS", "1")]);
    });
}

#[test]
#[ignore = "runs in a child process of devices_without_memory_pools_fall_back_to_plain_allocations"]
fn child_without_pools() {
    assert!(std::env::var_os("PPNRT_DOUBLE_CHILD").is_some(), "run through the parent test");
    let Some((_serial, double)) = double::setup("child_without_pools") else { panic!("no double") };
    let primary = Engine::new(0).unwrap();
    assert!(!primary.context().memory_pools_supported());
    let x = primary.htod(&[1u32, 2, 3]).unwrap();
    assert!(!x.is_pooled());
    for devices in [[0, 0], [0, 1]] {
        let rt = PpNRt::new(PpConfig::with_devices(&devices), &primary).unwrap();
        let e = rt.engine(0, &primary).unwrap();
        let _stage = rt.enter(0).unwrap();
        let sent = e.htod(&[4u32; 100]).unwrap();
        let slot = rt.tx(0, &sent, 100).unwrap();
        let got = rt.rx::<u32>(0, slot, 100).unwrap();
        assert!(!got.is_pooled());
        assert_eq!(e.dtoh(&got).unwrap(), vec![4; 100]);
    }
    double.flush();
    assert_eq!(double.violations(), 0, "{}", double.last_violation());
}

/// A CUDA 12.4 driver: `cuEventElapsedTime_v2` (12.8) is missing, so the loader uses
/// `cuEventElapsedTime`; the embedded PTX (ISA of the toolkit that built it) cannot be JIT-compiled,
/// so the helper kernels are a typed error and the pipeline keeps its copies on the copy engines,
/// over IPC between two ranks too (a copy that waits for its slot included: not the helper kernel a
/// failure cancels, which this driver cannot run; refusing the boundary there, mutation
/// `ipc-gated-copy-required`, fails the ranks' setup).
#[test]
fn a_cuda_12_4_driver_gets_every_feature_it_has() {
    with_double("a_cuda_12_4_driver_gets_every_feature_it_has", |_| {
        let library = double::build(&["PPNRT_DOUBLE_CUDA_12_4"]).expect("the double builds");
        run_child("scenarios::child_cuda_12_4", &library, &[]);
    });
}

#[test]
#[ignore = "runs in a child process of a_cuda_12_4_driver_gets_every_feature_it_has"]
fn child_cuda_12_4() {
    assert!(std::env::var_os("PPNRT_DOUBLE_CHILD").is_some(), "run through the parent test");
    let Some((_serial, double)) = double::setup("child_cuda_12_4") else { panic!("no double") };
    let driver = ppnrt::loader::driver().unwrap();
    assert_eq!(driver.version().to_string(), "12.4");
    let e = Engine::new(0).unwrap();
    let start = ppnrt::CudaEvent::new(e.context(), true).unwrap();
    let end = ppnrt::CudaEvent::new(e.context(), true).unwrap();
    start.record(e.default_stream()).unwrap();
    let x = e.htod(&vec![1u32; 1 << 20]).unwrap();
    end.record(e.default_stream()).unwrap();
    end.synchronize().unwrap();
    assert!(end.elapsed_ms(&start).unwrap() >= 0.0, "elapsed time through cuEventElapsedTime");
    let mut y = e.alloc::<u32>(16).unwrap();
    match e.fill_u32(&mut y, 1).unwrap_err() {
        CudaError::Driver(err) => assert!(err.is_unrunnable_code(), "{err}"),
        other => panic!("expected the driver's PTX error, got {other}"),
    }
    let rt = PpNRt::new(PpConfig::with_devices(&[0, 0]), &e).unwrap();
    assert!(!rt.sm_copies(0).unwrap(), "boundary copies stay on the copy engines");
    let _stage = rt.enter(0).unwrap();
    let slot = rt.tx(0, &x, 1 << 20).unwrap();
    let got = rt.rx::<u32>(0, slot, 1 << 20).unwrap();
    assert_eq!(e.dtoh(&got).unwrap(), vec![1u32; 1 << 20]);
    drop((_stage, got, rt));
    // Two ranks over IPC, one slot: step 1 is sent while step 0 is lent in place, so its copy
    // waits on the device for the slot.
    let (zero, one) = ranks::two_ranks_configured(std::time::Duration::from_secs(5), |_, config| config.with_slots(1));
    assert_eq!(zero.plan().boundaries[0].transport, ppnrt::Transport::Ipc, "{}", zero.plan());
    let (e0, e1) = (zero.engine(0, &e).unwrap().clone(), one.engine(1, &e).unwrap().clone());
    let steps: Vec<CudaSlice<u32>> = (0..2u32).map(|t| e0.htod(&vec![t + 7; 4096]).unwrap()).collect();
    let wait = std::time::Duration::from_secs(5);
    let send = |t: usize| zero.enter(0).and_then(|_stage| zero.tx(0, &steps[t], 4096)).unwrap();
    let stage1 = one.enter(1).unwrap();
    send(0);
    let lent = one.rx_in_place_wait::<u32>(0, 0, 4096, wait).unwrap();
    send(1);
    assert_eq!(e1.dtoh(&lent.view().unwrap()).unwrap(), vec![7u32; 4096], "step 0, lent");
    drop(lent);
    let got = one.rx_wait::<u32>(0, 0, 4096, wait).unwrap();
    assert_eq!(e1.dtoh(&got).unwrap(), vec![8u32; 4096], "step 1, sent behind its wait");
    drop((got, stage1));
    let errors = drop_ranks_within((steps, zero, one), std::time::Duration::from_secs(15), "the ranks");
    assert!(errors.is_empty(), "{errors:?}");
    double.flush();
    assert_eq!(double.violations(), 0, "{}", double.last_violation());
}
