//! Host tests through the CUDA driver double (`tests/driver_double/cuda_double.c`): the soundness
//! scenarios of `common/soundness.rs`, and error injection on each call that protects work
//! already enqueued; with the NCCL double (`tests/driver_double/nccl_double.c`) too, two ranks of
//! one pipeline as threads of this process, each driver and NCCL call of their steps, setup and
//! teardown failed in turn. They run on every machine with a C compiler (CI sets
//! `PPNRT_REQUIRE_DOUBLE` so that a missing compiler fails rather than skips).
//!
//! The double runs queued work only when something synchronises, and then only what that needs:
//! work left unordered runs as late as possible, so a missing wait shows up deterministically as
//! a wrong value or a counted access to freed memory (a "violation").

mod common;

#[path = "common/double.rs"]
mod double;
#[path = "common/ordering.rs"]
mod ordering;
#[path = "common/ranks.rs"]
mod ranks;
#[path = "common/raw_driver.rs"]
mod raw_driver;
#[path = "common/soundness.rs"]
mod soundness;
#[path = "common/threads.rs"]
mod threads;

use std::process::Command;
use std::sync::Arc;

use double::with_double;
use ranks::{try_two_ranks, two_ranks};
use raw_driver::raw;

use ppnrt::{
    CudaSlice, CudaStream, DeviceSlice, Engine, Error, PinnedHostBuffer, PpConfig, PpNRt, StreamOverride,
    TransportPolicy,
};

const OUT_OF_MEMORY: i32 = 2;
/// `ncclInternalError`.
const NCCL_INTERNAL_ERROR: i32 = 3;

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
const EVERY_TRANSPORT: [([i32; 2], TransportPolicy); 3] =
    [([0, 1], TransportPolicy::Staged), ([0, 1], TransportPolicy::Auto), ([0, 0], TransportPolicy::Auto)];

/// A `tx` whose event record fails leaves no copy in flight: the next, larger `tx` reallocates
/// the slot, and the failed copy must not land in the freed buffer (pinned memory for
/// `HostStaged`, device memory for `Peer` and `Local`).
#[test]
fn a_failed_tx_leaves_no_copy_in_flight() {
    with_double("a_failed_tx_leaves_no_copy_in_flight", |double| {
        let primary = Engine::new(0).unwrap();
        for (devices, policy) in EVERY_TRANSPORT {
            let rt = PpNRt::new(PpConfig::with_devices(&devices).transport(policy), &primary).unwrap();
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
            let rt = PpNRt::new(PpConfig::with_devices(&devices).transport(policy), &primary).unwrap();
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
        type Op = fn(&Engine, &Arc<CudaStream>, &CudaSlice<u32>, &mut CudaSlice<u32>) -> ppnrt::Result<()>;
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
            assert!(matches!(err, Error::Driver(_)), "{what}: {err}");
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
fn run_child(name: &str, library: &std::path::Path, env: &[(&str, &str)]) {
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
fn devices_without_memory_pools_fall_back_to_plain_allocations() {
    with_double("devices_without_memory_pools_fall_back_to_plain_allocations", |double| {
        run_child("child_without_pools", &double.path, &[("PPNRT_DOUBLE_NO_POOLS", "1")]);
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
/// so the helper kernels are a typed error and the pipeline keeps its copies on the copy engines.
#[test]
fn a_cuda_12_4_driver_gets_every_feature_it_has() {
    with_double("a_cuda_12_4_driver_gets_every_feature_it_has", |_| {
        let library = double::build(&["PPNRT_DOUBLE_CUDA_12_4"]).expect("the double builds");
        run_child("child_cuda_12_4", &library, &[]);
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
        Error::Driver(err) => assert!(err.is_unrunnable_code(), "{err}"),
        other => panic!("expected the driver's PTX error, got {other}"),
    }
    let rt = PpNRt::new(PpConfig::with_devices(&[0, 0]), &e).unwrap();
    assert!(!rt.sm_copies(0).unwrap(), "boundary copies stay on the copy engines");
    let _stage = rt.enter(0).unwrap();
    let slot = rt.tx(0, &x, 1 << 20).unwrap();
    let got = rt.rx::<u32>(0, slot, 1 << 20).unwrap();
    assert_eq!(e.dtoh(&got).unwrap(), vec![1u32; 1 << 20]);
    double.flush();
    assert_eq!(double.violations(), 0, "{}", double.last_violation());
}

/// The ordering rule as a user meets it: produced on one stream, consumed on another; dropped on
/// its owner under a late reader. And the broken variant (a raw address) is caught: the double
/// runs unordered work late, so the consumer reads before the producer ran, or after the free.
#[test]
fn buffers_are_ordered_across_streams_without_a_join() {
    with_double("buffers_are_ordered_across_streams_without_a_join", |double| {
        let e = Engine::new(0).unwrap();
        assert_eq!(ordering::produced_on_one_stream_consumed_on_another(&e, 200, 7, ordering::Handoff::Ordered), 0);
        assert_eq!(ordering::dropped_on_its_owner_while_read_elsewhere(&e, 200, 11, ordering::Handoff::Ordered), 0);
        let e1 = Engine::new(1).unwrap();
        for (from, to) in [(&e, &e1), (&e1, &e)] {
            let across =
                ordering::produced_on_one_device_consumed_on_another(from, to, 200, 13, ordering::Handoff::Ordered);
            assert_eq!(across, Some(0));
        }
        double.flush();
        assert_eq!(double.violations(), 0, "{}", double.last_violation());
    });
}

#[test]
fn a_consumer_the_ordering_rule_cannot_see_is_caught() {
    let Some((_serial, double)) = double::setup("a_consumer_the_ordering_rule_cannot_see_is_caught") else { return };
    let e = Engine::new(0).unwrap();
    let produced = ordering::produced_on_one_stream_consumed_on_another(&e, 50, 7, ordering::Handoff::RawAddress);
    assert!(produced > 0, "an unordered consumer went unnoticed");
    let before = double.violations();
    let dropped = ordering::dropped_on_its_owner_while_read_elsewhere(&e, 50, 11, ordering::Handoff::RawAddress);
    double.flush();
    assert!(dropped > 0 || double.violations() > before, "a read after free went unnoticed");
    let e1 = Engine::new(1).unwrap();
    let across = ordering::produced_on_one_device_consumed_on_another(&e, &e1, 50, 13, ordering::Handoff::RawAddress);
    assert!(across.expect("the double has peer access") > 0, "an unordered consumer on another device went unnoticed");
}

/// A caller's `KernelArgs` that changes the thread's current context while the launch runs
/// (as another library might): the launch still completes in the right context, later calls in
/// the same operation are not misled, and the caller's context is current afterwards.
#[test]
fn a_kernel_args_implementation_that_switches_contexts_misleads_nothing() {
    struct Switching<'a> {
        ns: u64,
        other: &'a ppnrt::Context,
    }
    impl ppnrt::KernelArgs for Switching<'_> {
        fn with_params<R>(&self, f: impl FnOnce(&mut [*mut std::ffi::c_void]) -> R) -> R {
            // SAFETY: `other` is a live, retained primary context.
            unsafe { ppnrt::result::context::set_current(self.other.raw()) }.unwrap();
            let mut ns = self.ns;
            f(&mut [(&raw mut ns).cast()])
        }
        fn buffer_uses(&self) -> [Option<ppnrt::BufferUse<'_>>; ppnrt::MAX_KERNEL_PARAMS] {
            [None; ppnrt::MAX_KERNEL_PARAMS]
        }
    }
    with_double("a_kernel_args_implementation_that_switches_contexts_misleads_nothing", |_| {
        let (e0, e1) = (Engine::new(0).unwrap(), Engine::new(1).unwrap());
        let spin = e0.test_kernels().unwrap();
        let _ = spin; // loads the module in e0's context
        let f = e0.load_ptx("testing", ppnrt::kernels::TESTING_PTX).unwrap().function("ppnrt_spin_ns").unwrap();
        let stream = e0.default_stream();
        // SAFETY: ppnrt_spin_ns(uint64_t) touches no memory; one u64 parameter is passed.
        unsafe {
            stream.launch(&f, ppnrt::LaunchConfig::for_elements(1, 1), Switching { ns: 1000, other: e1.context() })
        }
        .unwrap();
        // SAFETY: null unbinds.
        unsafe { ppnrt::result::context::set_current(std::ptr::null_mut()) }.unwrap();
        let x = e0.htod(&[1u32; 64]).unwrap();
        assert_eq!(x.ordinal(), 0);
        assert_eq!(e0.dtoh(&x).unwrap(), vec![1u32; 64]);
        assert!(ppnrt::result::context::get_current().unwrap().is_null(), "the caller's (no) context is current");
        stream.synchronize().unwrap();
    });
}

/// The same through a caller's `KernelParam` inside one of the crate's tuples: its `raw_param`
/// runs in the middle of the launch, so the tuple counts as foreign and the launch binds the
/// stream's context again (the double refuses the launch otherwise).
#[test]
fn a_kernel_param_that_switches_contexts_misleads_nothing() {
    struct SwitchingNs<'a> {
        ns: u64,
        other: &'a ppnrt::Context,
    }
    impl ppnrt::KernelParam for SwitchingNs<'_> {
        type Raw = u64;
        fn raw_param(&self) -> u64 {
            // SAFETY: `other` is a live, retained primary context.
            unsafe { ppnrt::result::context::set_current(self.other.raw()) }.unwrap();
            self.ns
        }
    }
    with_double("a_kernel_param_that_switches_contexts_misleads_nothing", |_| {
        let (e0, e1) = (Engine::new(0).unwrap(), Engine::new(1).unwrap());
        let f = e0.load_ptx("testing", ppnrt::kernels::TESTING_PTX).unwrap().function("ppnrt_spin_ns").unwrap();
        let stream = e0.default_stream();
        // SAFETY: null unbinds.
        unsafe { ppnrt::result::context::set_current(std::ptr::null_mut()) }.unwrap();
        // SAFETY: ppnrt_spin_ns(uint64_t) touches no memory; one u64 parameter is passed.
        unsafe {
            stream.launch(&f, ppnrt::LaunchConfig::for_elements(1, 1), (SwitchingNs { ns: 1000, other: e1.context() },))
        }
        .unwrap();
        assert!(ppnrt::result::context::get_current().unwrap().is_null(), "the caller's (no) context is current");
        let x = e0.htod(&[2u32; 64]).unwrap();
        assert_eq!(e0.dtoh(&x).unwrap(), vec![2u32; 64]);
        stream.synchronize().unwrap();
    });
}

/// A caller's `KernelArgs` whose own code enqueues on the launch stream (re-entering the
/// stream's enqueue gate, which must not deadlock) and tries to begin a capture of it (refused
/// with a typed error: the launch in progress saw the stream not capturing).
#[test]
fn kernel_args_that_enqueue_or_capture_on_the_launch_stream_neither_hang_nor_split_the_launch() {
    type Outcome = std::rc::Rc<std::cell::RefCell<Option<ppnrt::Result<()>>>>;
    struct Meddling<'a> {
        ns: u64,
        stream: &'a Arc<ppnrt::CudaStream>,
        scratch: std::cell::RefCell<&'a mut ppnrt::CudaSlice<u32>>,
        begun: Outcome,
    }
    impl ppnrt::KernelArgs for Meddling<'_> {
        fn with_params<R>(&self, f: impl FnOnce(&mut [*mut std::ffi::c_void]) -> R) -> R {
            self.stream.memset_u32(*self.scratch.borrow_mut(), 5).unwrap();
            *self.begun.borrow_mut() = Some(self.stream.begin_capture(ppnrt::CaptureMode::Relaxed).map(drop));
            let mut ns = self.ns;
            f(&mut [(&raw mut ns).cast()])
        }
        fn buffer_uses(&self) -> [Option<ppnrt::BufferUse<'_>>; ppnrt::MAX_KERNEL_PARAMS] {
            [None; ppnrt::MAX_KERNEL_PARAMS]
        }
    }
    with_double("kernel_args_that_enqueue_or_capture_on_the_launch_stream_neither_hang_nor_split_the_launch", |_| {
        let e = Engine::new(0).unwrap();
        let f = e.load_ptx("testing", ppnrt::kernels::TESTING_PTX).unwrap().function("ppnrt_spin_ns").unwrap();
        let stream = ppnrt::CudaStream::new(e.context()).unwrap();
        let mut scratch = ppnrt::CudaSlice::<u32>::alloc(&stream, 16).unwrap();
        let begun = Outcome::default();
        let args = Meddling {
            ns: 1000,
            stream: &stream,
            scratch: std::cell::RefCell::new(&mut scratch),
            begun: begun.clone(),
        };
        // SAFETY: ppnrt_spin_ns(uint64_t) touches no memory; one u64 parameter is passed; the
        // arguments' code ends no capture.
        unsafe { stream.launch(&f, ppnrt::LaunchConfig::for_elements(1, 1), args) }.unwrap();
        match begun.borrow_mut().take().expect("the arguments' code ran") {
            Err(ppnrt::Error::Capture(ppnrt::CaptureError::CannotBegin { reason })) => {
                assert!(reason.contains("enqueueing"), "{reason}");
            }
            other => panic!("a capture began inside a launch on its stream: {other:?}"),
        }
        assert!(!stream.is_capturing());
        let mut host = vec![0u32; 16];
        stream.memcpy_dtoh(&scratch, &mut host).unwrap();
        assert_eq!(host, vec![5u32; 16]);
    });
}

/// A launch keeps the states of the buffers it orders locked from its waits to its notes, except
/// while a caller's parameter code runs: a `KernelParam` whose `raw_param` reads, through the
/// crate, the very buffer the launch reads must neither deadlock nor disturb the ordering. (With
/// the states held locked across that code, the copy inside `raw_param` would wait for a lock
/// its own thread holds: the launch below then never returns and the test fails on its timeout.)
#[test]
fn parameter_code_that_uses_a_launched_buffer_does_not_deadlock() {
    struct ReadingLength<'a> {
        src: &'a ppnrt::CudaSlice<u32>,
        stream: &'a Arc<ppnrt::CudaStream>,
        seen: &'a std::cell::Cell<u32>,
    }
    impl ppnrt::KernelParam for ReadingLength<'_> {
        type Raw = u64;
        fn raw_param(&self) -> u64 {
            let mut host = vec![0u32; self.src.len()];
            self.stream.memcpy_dtoh(self.src, &mut host).unwrap();
            self.seen.set(host[3]);
            self.src.len() as u64
        }
    }
    with_double("parameter_code_that_uses_a_launched_buffer_does_not_deadlock", |_| {
        let (done_tx, done_rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let e = Engine::new(0).unwrap();
            let checksum =
                e.load_ptx("testing", ppnrt::kernels::TESTING_PTX).unwrap().function("ppnrt_checksum_u32").unwrap();
            let stream = e.default_stream().clone();
            let values: Vec<u32> = (0..256u32).map(|i| i * 7 + 1).collect();
            let src = e.htod(&values).unwrap();
            let mut out = e.htod(&[0u64]).unwrap();
            let seen = std::cell::Cell::new(0);
            let length = ReadingLength { src: &src, stream: &stream, seen: &seen };
            // SAFETY: ppnrt_checksum_u32(const uint32_t* src, uint64_t n, unsigned long long* out)
            // reads src[i] for i < n = src's length and adds into out[0] (one element).
            unsafe { stream.launch(&checksum, ppnrt::LaunchConfig::for_elements(256, 4), (&src, length, &mut out)) }
                .unwrap();
            assert_eq!(seen.get(), 22, "the parameter's code read the buffer");
            let sum = e.dtoh(&out).unwrap()[0];
            done_tx.send(sum).unwrap();
        });
        let values: Vec<u32> = (0..256u32).map(|i| i * 7 + 1).collect();
        let expected = ppnrt::kernels::checksum(&values);
        match done_rx.recv_timeout(std::time::Duration::from_secs(60)) {
            Ok(sum) => assert_eq!(sum, expected, "the checksum kernel saw the buffer"),
            Err(_) => panic!("a launch whose parameter code reads a launched buffer did not return in 60 s"),
        }
    });
}

/// A slot's events are reused from step to step (the read's event that a write retires serves
/// the next read), but only within one context: a slot lent in place and read by a stream of the
/// TX device, then received by a copy on the RX device's stream, records an event of the RX
/// context there. (Reusing the TX device's event would make the receive fail: the double, like
/// the driver, refuses to record an event on a stream of another context.)
#[test]
fn slot_events_are_reused_within_their_context_only() {
    with_double("slot_events_are_reused_within_their_context_only", |_| {
        let primary = Engine::new(0).unwrap();
        let rt = PpNRt::new(PpConfig::with_devices(&[0, 1]).slots(1), &primary).unwrap();
        let e0 = rt.engine(0, &primary).unwrap().clone();
        let reader = ppnrt::CudaStream::new(e0.context()).unwrap();
        let n = 256;
        for step in 0..4u32 {
            let x = {
                let _stage = rt.enter(0).unwrap();
                let mut x = e0.alloc::<u32>(n).unwrap();
                e0.fill_pattern(&mut x, step).unwrap();
                x
            };
            let slot = rt.tx(0, &x, n).unwrap();
            if step % 2 == 0 {
                // Lent in place, read by a stream of the TX device (another library's kernel).
                let mut received = rt.rx_in_place::<u32>(0, slot, n).unwrap();
                received.order_on(&reader).unwrap();
                drop(received);
            } else {
                let out = rt.rx::<u32>(0, slot, n).unwrap();
                let e1 = rt.engine(1, &primary).unwrap();
                let host = e1.dtoh(&out).unwrap();
                assert_eq!(host, (0..n as u64).map(|i| ppnrt::kernels::pattern(step, i)).collect::<Vec<_>>());
            }
        }
        rt.synchronize().unwrap();
        assert!(ppnrt::take_drop_errors().is_empty(), "a drop failed");
    });
}

/// One host thread per stage, parked in `tx_wait` / `rx_wait`: the same outputs, bit for bit, as
/// one thread driving every stage.
#[test]
fn one_thread_per_stage_matches_one_thread() {
    with_double("one_thread_per_stage_matches_one_thread", |_| {
        let primary = Engine::new(0).unwrap();
        for (devices, slots) in [(&[0, 0, 1, 1][..], 2), (&[0, 1, 0, 1, 0, 1, 0, 1][..], 1), (&[0, 1][..], 3)] {
            let (expected, _) = threads::one_thread(&primary, devices, slots, 60);
            let (got, _) = threads::thread_per_stage(&primary, devices, slots, 60);
            assert!(got == expected, "{devices:?}, {slots} slot(s): outputs differ");
        }
    });
}

/// The waiting calls give up after their timeout with a typed error, having enqueued nothing.
#[test]
fn waiting_calls_time_out_with_a_typed_error() {
    with_double("waiting_calls_time_out_with_a_typed_error", |_| {
        let primary = Engine::new(0).unwrap();
        let rt = PpNRt::new(PpConfig::with_devices(&[0, 1]).slots(1), &primary).unwrap();
        let timeout = std::time::Duration::from_millis(50);
        let started = std::time::Instant::now();
        match rt.rx_wait::<u32>(0, 0, 16, timeout).unwrap_err() {
            Error::Pipeline(ppnrt::PpError::Timeout {
                call: "rx",
                slot: 0,
                found: ppnrt::SlotState::NeverFilled,
                ..
            }) => {}
            other => panic!("expected a timeout, got {other}"),
        }
        assert!(started.elapsed() >= timeout);
        let x = {
            let _stage = rt.enter(0).unwrap();
            rt.engine(0, &primary).unwrap().htod(&[7u32; 16]).unwrap()
        };
        assert_eq!(rt.tx_wait(0, &x, 16, timeout).unwrap(), 0);
        let err = rt.tx_wait(0, &x, 16, timeout).unwrap_err();
        assert!(matches!(err, Error::Pipeline(ppnrt::PpError::Timeout { call: "tx", .. })), "{err}");
        // The refused calls enqueued nothing: the first payload arrives intact.
        let got = rt.rx_wait::<u32>(0, 0, 16, timeout).unwrap();
        assert_eq!(rt.engine(1, &primary).unwrap().dtoh(&got).unwrap(), vec![7u32; 16]);
    });
}

/// Deferred readback: every step's values arrive bitwise, pinned buffers are reused, and the
/// stage stream never waits for the readback stream (its work runs while the readback's is still
/// queued, even after the pending readback and its device buffer were dropped).
#[test]
fn readbacks_arrive_and_never_hold_up_the_stage_stream() {
    with_double("readbacks_arrive_and_never_hold_up_the_stage_stream", |double| {
        let primary = Engine::new(0).unwrap();
        let rt = PpNRt::new(PpConfig::with_devices(&[0, 1]), &primary).unwrap();
        let e = rt.engine(1, &primary).unwrap().clone();
        let n = 3000;
        let mut pending = std::collections::VecDeque::new();
        for step in 0..40u32 {
            let logits = {
                let _last = rt.enter(1).unwrap();
                let mut logits = e.alloc::<u32>(n).unwrap();
                e.fill_pattern(&mut logits, step).unwrap();
                logits
            };
            pending.push_back((step, rt.readback(logits).unwrap()));
            if pending.len() > 3 {
                let (seed, readback) = pending.pop_front().unwrap();
                let expected: Vec<u32> = (0..n as u64).map(|i| ppnrt::kernels::pattern(seed, i)).collect();
                assert_eq!(readback.wait().unwrap(), &expected[..], "step {seed}");
                assert_eq!(readback.try_get().unwrap(), Some(&expected[..]));
            }
        }
        drop(pending);
        rt.synchronize().unwrap();

        // The readback stream is held up (a long spin queued on it); the stage stream's work does
        // not wait for it, not even for the free of the buffer that was read back.
        {
            let _readback = ppnrt::StreamOverride::new(rt.readback_stream().clone()).unwrap();
            e.spin(1_000_000).unwrap();
        }
        let logits = {
            let _last = rt.enter(1).unwrap();
            let mut logits = e.alloc::<u32>(n).unwrap();
            e.fill_u32(&mut logits, 5).unwrap();
            logits
        };
        let readback = rt.readback(logits).unwrap();
        assert_eq!(readback.try_get().unwrap(), None, "the copy waits behind the spin");
        drop(readback);
        let stage = rt.stage_stream(1).unwrap();
        {
            let _last = rt.enter(1).unwrap();
            let mut next = e.alloc::<u32>(n).unwrap();
            e.fill_u32(&mut next, 6).unwrap();
        }
        stage.synchronize().unwrap();
        assert!(double.pending() > 0, "the stage stream waited for the readback stream");
        rt.synchronize().unwrap();
    });
}

/// A readback's driver calls, in steady state: the readback stream waits for the step once (an
/// event recorded on the stage stream), copies, records its completion; freeing the device buffer
/// on the readback stream afterwards needs no second wait for the step.
#[test]
fn a_readback_waits_for_its_step_once_copy_and_free_together() {
    with_double("a_readback_waits_for_its_step_once_copy_and_free_together", |double| {
        let primary = Engine::new(0).unwrap();
        let rt = PpNRt::new(PpConfig::with_devices(&[0, 1]), &primary).unwrap();
        let e = rt.engine(1, &primary).unwrap().clone();
        let n = 3000;
        let step = |seed: u32| {
            let _last = rt.enter(1).unwrap();
            let mut logits = e.alloc::<u32>(n).unwrap();
            e.fill_pattern(&mut logits, seed).unwrap();
            let pending = rt.readback(logits).unwrap();
            let expected: Vec<u32> = (0..n as u64).map(|i| ppnrt::kernels::pattern(seed, i)).collect();
            assert_eq!(pending.wait().unwrap(), &expected[..], "step {seed}");
        };
        step(1); // warm-up: the pinned buffer and pooled events
        let mut seed = 2;
        let calls = double.calls_per_run(
            &["cuStreamWaitEvent", "cuEventRecord", "cuMemcpyDtoHAsync_v2", "cuMemFreeAsync"],
            20,
            || {
                step(seed);
                seed += 1;
            },
        );
        common::say(&format!("driver calls per readback step: {:?}", calls.0));
        assert_eq!(calls.of("cuStreamWaitEvent"), 1.0, "the copy's wait orders the free too");
        assert_eq!(calls.of("cuMemcpyDtoHAsync_v2"), 1.0);
        assert_eq!(calls.of("cuMemFreeAsync"), 1.0);
        assert_eq!(calls.of("cuEventRecord"), 2.0, "the step's mark and the copy's completion");
        rt.synchronize().unwrap();
    });
}

/// A readback of a buffer that is not on the last stage's device is refused, nothing enqueued.
#[test]
fn a_readback_from_another_device_is_refused() {
    with_double("a_readback_from_another_device_is_refused", |_| {
        let primary = Engine::new(0).unwrap();
        let rt = PpNRt::new(PpConfig::with_devices(&[0, 1]), &primary).unwrap();
        let wrong = primary.htod(&[1u32; 8]).unwrap();
        assert!(matches!(rt.readback(wrong), Err(Error::WrongDevice { expected: 1, found: 0, .. })));
    });
}

/// Receiving in place: the stage reads the slot itself (no copy), and the next `tx` into it, once
/// the guard dropped, waits for the reads made through the view (the double
/// runs the sender's stream first: were the write not ordered after the read, the read would see
/// the new data). A deliberately broken protocol (no wait for the reads) is caught the same way.
#[test]
fn a_slot_received_in_place_is_read_before_it_is_refilled() {
    with_double("a_slot_received_in_place_is_read_before_it_is_refilled", |_| {
        let primary = Engine::new(0).unwrap();
        for (devices, fault, expect_ok) in [
            ([0, 1], ppnrt::pp::ProtocolFault::None, true),
            ([0, 0], ppnrt::pp::ProtocolFault::None, true),
            ([0, 1], ppnrt::pp::ProtocolFault::SkipRxWait, false),
        ] {
            let rt = PpNRt::new(PpConfig::with_devices(&devices).slots(1).inject_fault(fault), &primary).unwrap();
            let (e0, e1) = (rt.engine(0, &primary).unwrap().clone(), rt.engine(1, &primary).unwrap().clone());
            let n = 2048;
            let send = |seed: u32| {
                let _stage = rt.enter(0).unwrap();
                let mut x = e0.alloc::<u32>(n).unwrap();
                e0.fill_pattern(&mut x, seed).unwrap();
                rt.tx(0, &x, n).unwrap()
            };
            let slot = send(1);
            let mut sum = {
                let _stage = rt.enter(1).unwrap();
                e1.alloc_zeroed::<u64>(1).unwrap()
            };
            {
                let received = rt.rx_in_place::<u32>(0, slot, n).unwrap();
                assert!(received.is_in_place());
                let _stage = rt.enter(1).unwrap();
                e1.spin(500_000).unwrap();
                e1.checksum_into(&received.view().unwrap(), &mut sum).unwrap();
            }
            send(2); // overwrites the slot as soon as the reads allow
            rt.stage_stream(0).unwrap().synchronize().unwrap(); // the sender's stream runs first
            let expected =
                ppnrt::kernels::checksum(&(0..n as u64).map(|i| ppnrt::kernels::pattern(1, i)).collect::<Vec<_>>());
            let got = e1.dtoh(&sum).unwrap()[0];
            assert_eq!(got == expected, expect_ok, "{devices:?} {fault:?}");
            let received = rt.rx_in_place::<u32>(0, slot, n).unwrap();
            let values = e1.dtoh(&received.view().unwrap()).unwrap();
            assert_eq!(values, (0..n as u64).map(|i| ppnrt::kernels::pattern(2, i)).collect::<Vec<_>>());
            drop(received);
            rt.synchronize().unwrap();
        }
    });
}

/// A host-staged boundary cannot lend its pinned slot to kernels: the guard holds a copy.
#[test]
fn a_host_staged_slot_is_received_as_a_copy() {
    with_double("a_host_staged_slot_is_received_as_a_copy", |_| {
        let primary = Engine::new(0).unwrap();
        let rt = PpNRt::new(PpConfig::with_devices(&[0, 1]).transport(TransportPolicy::Staged), &primary).unwrap();
        let x = {
            let _stage = rt.enter(0).unwrap();
            rt.engine(0, &primary).unwrap().htod(&[9u32; 100]).unwrap()
        };
        let slot = rt.tx(0, &x, 100).unwrap();
        let received = rt.rx_in_place::<u32>(0, slot, 100).unwrap();
        assert!(!received.is_in_place());
        assert_eq!(rt.engine(1, &primary).unwrap().dtoh(&received.view().unwrap()).unwrap(), vec![9u32; 100]);
    });
}

/// A consumer that reads the lent slot by other means (a raw address, as another library's
/// kernel would) orders itself with `order_on`: it reads the new data, and the next `tx` waits for
/// it (the double runs the sender's stream first).
#[test]
fn order_on_orders_a_consumer_the_rule_cannot_see() {
    with_double("order_on_orders_a_consumer_the_rule_cannot_see", |_| {
        let primary = Engine::new(0).unwrap();
        let rt = PpNRt::new(PpConfig::with_devices(&[0, 1]).slots(1), &primary).unwrap();
        let (e0, e1) = (rt.engine(0, &primary).unwrap().clone(), rt.engine(1, &primary).unwrap().clone());
        let n = 1024;
        let send = |seed: u32| {
            let _stage = rt.enter(0).unwrap();
            let mut x = e0.alloc::<u32>(n).unwrap();
            e0.fill_pattern(&mut x, seed).unwrap();
            rt.tx(0, &x, n).unwrap()
        };
        let checksum =
            e1.load_ptx("testing", ppnrt::kernels::TESTING_PTX).unwrap().function("ppnrt_checksum_u32").unwrap();
        let stage1 = rt.stage_stream(1).unwrap().clone();
        let slot = send(3);
        let mut sum = {
            let _stage = rt.enter(1).unwrap();
            e1.alloc_zeroed::<u64>(1).unwrap()
        };
        {
            let mut received = rt.rx_in_place::<u32>(0, slot, n).unwrap();
            received.order_on(&stage1).unwrap();
            let address = received.view().unwrap().device_ptr();
            // SAFETY: ppnrt_checksum_u32(const uint32_t*, uint64_t, unsigned long long*) reads n
            // words at `address` (the lent slot, alive while `received` is) into sum[0].
            unsafe { stage1.launch(&checksum, ppnrt::LaunchConfig::for_elements(n, 4), (address, n as u64, &mut sum)) }
                .unwrap();
        }
        send(4);
        rt.stage_stream(0).unwrap().synchronize().unwrap();
        let expected =
            ppnrt::kernels::checksum(&(0..n as u64).map(|i| ppnrt::kernels::pattern(3, i)).collect::<Vec<_>>());
        assert_eq!(e1.dtoh(&sum).unwrap()[0], expected);
    });
}

/// `order_on` for two consumer streams orders both of them (peer and host-staged boundaries; the
/// double runs the sender's stream first, then the receiver's, and counts any read of freed
/// memory).
#[test]
fn order_on_two_streams_orders_both_consumers() {
    for transport in [TransportPolicy::Auto, TransportPolicy::Staged] {
        with_double("order_on_two_streams_orders_both_consumers", |_| {
            soundness::order_on_orders_every_consumer(&Engine::new(0).unwrap(), &[0, 1], transport);
        });
    }
}

/// A zero-sized element type (it carries no bytes) crosses every kind of boundary as a typed
/// step: `tx` into a slot that has no buffer yet, `rx`, the in-place receive and the readback
/// give back `n` elements, with no panic.
#[test]
fn zero_sized_elements_cross_a_boundary() {
    #[derive(Clone, Copy, Debug, Default, PartialEq)]
    struct NoBytes;
    // SAFETY: a zero-sized type has one (empty) bit pattern, no padding, pointers or drop glue;
    // its name is its own.
    unsafe impl ppnrt::DeviceRepr for NoBytes {
        const NAME: &'static str = "NoBytes";
    }
    with_double("zero_sized_elements_cross_a_boundary", |_| {
        let primary = Engine::new(0).unwrap();
        for (devices, transport) in
            [([0, 0], TransportPolicy::Auto), ([0, 1], TransportPolicy::Auto), ([0, 1], TransportPolicy::Staged)]
        {
            let rt = PpNRt::new(PpConfig::with_devices(&devices).transport(transport), &primary).unwrap();
            let (e0, e1) = (rt.engine(0, &primary).unwrap().clone(), rt.engine(1, &primary).unwrap().clone());
            let x = {
                let _stage = rt.enter(0).unwrap();
                e0.htod(&[NoBytes; 5]).unwrap()
            };
            let slot = rt.tx(0, &x, 5).unwrap();
            let y = rt.rx::<NoBytes>(0, slot, 5).unwrap();
            assert_eq!(e1.dtoh(&y).unwrap(), vec![NoBytes; 5], "{devices:?} {transport:?}");
            let slot = rt.tx(0, &x, 3).unwrap();
            {
                let received = rt.rx_in_place::<NoBytes>(0, slot, 3).unwrap();
                assert_eq!(received.view().unwrap().len(), 3);
            }
            let readback = {
                let _stage = rt.enter(1).unwrap();
                rt.readback(e1.htod(&[NoBytes; 7]).unwrap()).unwrap()
            };
            assert_eq!(readback.wait().unwrap().len(), 7);
            // A mismatched type is still refused.
            let slot = rt.tx(0, &x, 5).unwrap();
            assert!(matches!(rt.rx::<u32>(0, slot, 5), Err(Error::Pipeline(ppnrt::PpError::RxTypeMismatch { .. }))));
            rt.synchronize().unwrap();
        }
    });
}

/// What a boundary step costs in driver calls, in steady state: the protocol's calls (per `tx`:
/// a wait for the slot's last reader, the copy, its event record; per `rx`: a wait for the copy
/// in, an allocation, the copy out, its event record; the free) and nothing else — no event
/// created, no query — plus the price of leaving the caller's current context as it was: one
/// `cuCtxGetCurrent` per call (`tx`, `rx`, the output's free), and a `cuCtxSetCurrent` there and
/// back for each of them that works in another context than the caller's (here the caller has
/// the TX stage's context current, as a thread driving that stage would).
#[test]
fn a_boundary_step_makes_the_protocols_driver_calls_and_no_more() {
    with_double("a_boundary_step_makes_the_protocols_driver_calls_and_no_more", |double| {
        let primary = Engine::new(0).unwrap();
        for (devices, label, sm) in
            [([0, 1], "peer", false), ([0, 0], "local", false), ([0, 0], "local, SM copies", true)]
        {
            let rt = PpNRt::new(PpConfig::with_devices(&devices).sm_copies(sm), &primary).unwrap();
            let e = rt.engine(0, &primary).unwrap().clone();
            let x = {
                let _stage = rt.enter(0).unwrap();
                e.htod(&[1u32; 8192]).unwrap()
            };
            let step = || {
                let slot = rt.tx(0, &x, 8192).unwrap();
                drop(rt.rx::<u32>(0, slot, 8192).unwrap());
            };
            for _ in 0..4 {
                step(); // warm-up: slot buffers and pooled events
            }
            // SAFETY: the TX stage's primary context, retained by the runtime's engines.
            unsafe { ppnrt::result::context::set_current(e.context().raw()) }.unwrap();
            let entries = [
                "cuCtxGetCurrent",
                "cuCtxSetCurrent",
                "cuStreamWaitEvent",
                "cuMemcpyAsync",
                "cuLaunchKernel",
                "cuEventRecord",
                "cuMemAllocAsync",
                "cuMemFreeAsync",
                "cuEventCreate",
                "cuEventQuery",
                "cuStreamQuery",
            ];
            let per_step = double.calls_per_run(&entries, 100, step);
            common::say(&format!("driver calls per tx+rx step ({label}): {:?}", per_step.0));
            let calls = |entry: &str| per_step.of(entry);
            assert_eq!(calls("cuStreamWaitEvent"), 2.0, "{label}");
            assert_eq!(calls("cuMemcpyAsync") + calls("cuLaunchKernel"), 2.0, "{label}");
            assert_eq!(calls("cuLaunchKernel"), if sm { 2.0 } else { 0.0 }, "{label}");
            assert_eq!(calls("cuEventRecord"), 2.0, "{label}");
            assert_eq!(calls("cuMemAllocAsync"), 1.0, "{label}");
            assert_eq!(calls("cuMemFreeAsync"), 1.0, "{label}");
            assert_eq!(calls("cuEventCreate") + calls("cuEventQuery") + calls("cuStreamQuery"), 0.0, "{label}");
            assert_eq!(calls("cuCtxGetCurrent"), 3.0, "{label}");
            // rx and the free run in the RX stage's context: there and back for each when the
            // stages are on two devices.
            assert_eq!(calls("cuCtxSetCurrent"), if devices[0] != devices[1] { 4.0 } else { 0.0 }, "{label}");
            rt.synchronize().unwrap();
        }
    });
}

/// Launches that reach a peer's memory enable peer access once per pair of live contexts, not per
/// launch.
#[test]
fn peer_access_is_enabled_once_per_pair_not_per_launch() {
    with_double("peer_access_is_enabled_once_per_pair_not_per_launch", |double| {
        let (e0, e1) = (Engine::new(0).unwrap(), Engine::new(1).unwrap());
        let src = e1.alloc_persistent::<u32>(1024).unwrap();
        let mut dst = e0.alloc::<u32>(1024).unwrap();
        e0.copy_with_sms(&src, &mut dst).unwrap();
        let (enables, queries) = (double.calls("cuCtxEnablePeerAccess"), double.calls("cuDeviceCanAccessPeer"));
        for _ in 0..10 {
            e0.copy_with_sms(&src, &mut dst).unwrap();
        }
        assert_eq!(double.calls("cuCtxEnablePeerAccess"), enables);
        assert_eq!(double.calls("cuDeviceCanAccessPeer"), queries);
        e0.synchronize().unwrap();
    });
}

#[path = "common/graphs.rs"]
mod graphs;

#[test]
fn graph_mode_matches_eager_and_one_stage_through_the_double() {
    with_double("graph_mode_matches_eager_and_one_stage_through_the_double", |_| {
        let primary = Engine::new(0).unwrap();
        graphs::graph_mode_matches_eager_and_one_stage("graph_mode (double)", &primary, 2, true);
    });
}

#[test]
fn capture_misuse_is_a_typed_error_through_the_double() {
    with_double("capture_misuse_is_a_typed_error_through_the_double", |_| {
        let primary = Engine::new(0).unwrap();
        graphs::capture_misuse_is_a_typed_error(&primary, &[0, 1, 0]);
        graphs::capture_misuse_is_a_typed_error(&primary, &[0]);
    });
}

#[test]
fn mismatched_graph_steps_are_refused_through_the_double() {
    with_double("mismatched_graph_steps_are_refused_through_the_double", |_| {
        let primary = Engine::new(0).unwrap();
        graphs::mismatched_graph_steps_are_refused(&primary, &[0, 1, 0]);
    });
}

#[test]
fn graphs_launched_from_two_threads_keep_their_order_through_the_double() {
    with_double("graphs_launched_from_two_threads_keep_their_order_through_the_double", |_| {
        let against = graphs::graphs_launched_from_two_threads_keep_their_order(&Engine::new(0).unwrap(), 300);
        assert_eq!(against, 0, "graph launches from two threads ran against the buffer's recorded order");
    });
}

#[test]
fn graphs_keep_their_memory_alive_and_ordered_through_the_double() {
    with_double("graphs_keep_their_memory_alive_and_ordered_through_the_double", |_| {
        graphs::graphs_keep_their_memory_alive_and_ordered(&Engine::new(0).unwrap());
    });
}

#[test]
fn one_thread_per_stage_replays_graphs_through_the_double() {
    with_double("one_thread_per_stage_replays_graphs_through_the_double", |_| {
        let primary = Engine::new(0).unwrap();
        graphs::one_thread_per_stage_replays_graphs(&primary, &[0, 1, 0, 1], 2, 12);
        graphs::one_thread_per_stage_replays_graphs(&primary, &[0, 0, 1], 3, 10);
        graphs::one_thread_per_stage_replays_graphs(&primary, &[0], 1, 5);
    });
}

#[test]
fn launch_stage_refusals_lose_nothing_through_the_double() {
    with_double("launch_stage_refusals_lose_nothing_through_the_double", |_| {
        graphs::launch_stage_refusals_lose_nothing(&Engine::new(0).unwrap(), &[0, 1, 0]);
    });
}

#[test]
fn racing_launches_of_one_stage_never_share_a_slot_through_the_double() {
    with_double("racing_launches_of_one_stage_never_share_a_slot_through_the_double", |_| {
        graphs::racing_launches_of_one_stage_never_share_a_slot(&Engine::new(0).unwrap(), &[0, 1], 300);
    });
}

/// Many steps of one thread per stage, with stages running up to a ring's length ahead of each
/// other: every stage's slot count stays right while the others' move. (The runtime once read the
/// first ring's position outside its lock: a stage that fell behind was sent a step ahead, and
/// this test failed in most runs.)
#[test]
fn one_thread_per_stage_keeps_its_slot_count_under_contention_through_the_double() {
    with_double("one_thread_per_stage_keeps_its_slot_count_under_contention_through_the_double", |_| {
        let primary = Engine::new(0).unwrap();
        for _ in 0..4 {
            graphs::one_thread_per_stage_replays_graphs(&primary, &[0, 0, 1], 3, 200);
            graphs::one_thread_per_stage_replays_graphs(&primary, &[0, 1, 0, 1], 2, 200);
        }
    });
}

mod schedules {
    use super::*;
    use graphs::StepKind;
    use proptest::prelude::*;

    fn kind() -> impl Strategy<Value = StepKind> {
        prop_oneof![Just(StepKind::Eager), Just(StepKind::Graph), Just(StepKind::StageByStage)]
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 48, ..ProptestConfig::default() })]

        /// Any interleaving of eager steps, whole-step graph launches and stage-by-stage graph
        /// launches, on any stage map over two devices with 1–3 slots, gives bitwise the
        /// one-stage model's outputs.
        #[test]
        fn any_interleaving_of_eager_and_graph_steps_matches_one_stage(
            map in proptest::collection::vec(0i32..2, 1..6),
            slots in 1usize..4,
            kinds in proptest::collection::vec(kind(), 1..10),
            seed in any::<u64>(),
        ) {
            with_double("any_interleaving_of_eager_and_graph_steps_matches_one_stage", |_| {
                let primary = Engine::new(0).unwrap();
                graphs::random_schedule_matches(&primary, PpConfig::with_devices(&map).slots(slots), &kinds, seed);
            });
        }
    }
}

#[test]
fn graph_misuse_leaves_everything_sound_through_the_double() {
    with_double("graph_misuse_leaves_everything_sound_through_the_double", |_| {
        let primary = Engine::new(0).unwrap();
        graphs::graph_misuse_leaves_everything_sound(&primary, &[0, 1, 0]);
    });
}

#[test]
fn a_graph_step_makes_one_launch_per_stage_and_the_protocols_calls_only() {
    with_double("a_graph_step_makes_one_launch_per_stage_and_the_protocols_calls_only", |double| {
        let primary = Engine::new(0).unwrap();
        for (devices, label) in [(vec![0, 1, 0, 1], "alternating"), (vec![0, 0, 0, 0], "one device")] {
            let rt = PpNRt::new(PpConfig::with_devices(&devices).slots(2), &primary).unwrap();
            let n = 4096;
            let mut buffers = graphs::StepBuffers::new(&rt, &primary, n);
            let mut step = graphs::capture(&rt, &primary, &mut buffers, n, false).unwrap();
            for _ in 0..4 {
                step.launch().unwrap(); // warm-up: every slot used once, pooled events made
            }
            let entries = [
                "cuGraphLaunch",
                "cuStreamWaitEvent",
                "cuEventRecord",
                "cuLaunchKernel",
                "cuMemcpyAsync",
                "cuMemAllocAsync",
                "cuMemFreeAsync",
                "cuEventCreate",
                "cuEventQuery",
                "cuStreamQuery",
                "cuStreamSynchronize",
            ];
            let per_step = double.calls_per_run(&entries, 50, || {
                step.launch().unwrap();
            });
            let calls = |entry: &str| per_step.of(entry);
            let boundaries = (devices.len() - 1) as f64;
            common::say(&format!("driver calls per graph step ({label}): {:?}", per_step.0));
            assert_eq!(calls("cuGraphLaunch"), devices.len() as f64, "{label}: one launch per stage");
            // Per boundary: the reader waits for the write, the writer for the read; each side
            // records its use.
            assert_eq!(calls("cuStreamWaitEvent"), 2.0 * boundaries, "{label}");
            assert_eq!(calls("cuEventRecord"), 2.0 * boundaries, "{label}");
            for entry in [
                "cuLaunchKernel",
                "cuMemcpyAsync",
                "cuMemAllocAsync",
                "cuMemFreeAsync",
                "cuEventCreate",
                "cuEventQuery",
                "cuStreamQuery",
                "cuStreamSynchronize",
            ] {
                assert_eq!(calls(entry), 0.0, "{label}: {entry}");
            }
            rt.synchronize().unwrap();
        }
    });
}

/// A rank builds only its own stages: another rank's device ordinal is never checked here, its
/// own must be present (a `ConfigError` before any network call), and a rendezvous nobody
/// answers is a typed timeout within the peer timeout, not a hang.
#[test]
fn a_rank_builds_only_its_stages_and_a_silent_rendezvous_times_out_typed() {
    with_double("a_rank_builds_only_its_stages_and_a_silent_rendezvous_times_out_typed", |_| {
        let primary = Engine::new(0).unwrap();
        let unused = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap();
        let silent = format!("127.0.0.1:{}", unused.port()); // nobody listens there once dropped
        let timeout = std::time::Duration::from_millis(300);
        let config = |devices: &[i32]| {
            PpConfig::with_devices(devices).ranks(&[1, 0, 1]).rank(1).rendezvous(&silent).peer_timeout(timeout)
        };
        // Rank 1 runs stages 0 and 2; stage 1's device 99 is rank 0's business.
        let start = std::time::Instant::now();
        let err = PpNRt::new(config(&[0, 99, 0]), &primary).unwrap_err();
        assert!(
            matches!(err, Error::Rendezvous(ppnrt::rendezvous::RendezvousError::Timeout { .. })),
            "expected a rendezvous timeout, got {err}"
        );
        assert!(start.elapsed() < timeout * 10, "gave up after {:?}", start.elapsed());
        // Its own stage on a device that is not there is refused first.
        let err = PpNRt::new(config(&[99, 0, 0]), &primary).unwrap_err();
        assert!(matches!(&err, Error::Config(e) if e.setting == "PPNRT_DEVICES" && e.reason.contains("99")), "{err}");
    });
}

/// A stream that reads a buffer written on another stream waits for that write once, however
/// many times it reads the buffer; a new write is waited for again, and every read sees the
/// write it follows.
#[test]
fn a_stream_waits_once_per_write_it_reads_not_once_per_read() {
    with_double("a_stream_waits_once_per_write_it_reads_not_once_per_read", |double| {
        let e = Engine::new(0).unwrap();
        let writer = CudaStream::new(e.context()).unwrap();
        let reader = CudaStream::new(e.context()).unwrap();
        let mut x = CudaSlice::<u32>::alloc(&writer, 1024).unwrap();
        let mut outs: Vec<CudaSlice<u32>> = (0..4).map(|_| CudaSlice::<u32>::alloc(&reader, 1024).unwrap()).collect();
        writer.synchronize().unwrap();
        reader.synchronize().unwrap();
        writer.memset_u32(&mut x, 7).unwrap();
        let waits = double.calls_per_run(&["cuStreamWaitEvent"], 1, || {
            for out in &mut outs[..3] {
                reader.memcpy_dtod(&x, out).unwrap();
            }
        });
        assert_eq!(waits.of("cuStreamWaitEvent"), 1.0, "three reads of one write");
        writer.memset_u32(&mut x, 9).unwrap();
        let waits = double.calls_per_run(&["cuStreamWaitEvent"], 1, || {
            reader.memcpy_dtod(&x, &mut outs[3]).unwrap();
        });
        assert_eq!(waits.of("cuStreamWaitEvent"), 1.0, "a new write is waited for again");
        for (i, out) in outs.iter().enumerate() {
            let expected = if i < 3 { 7 } else { 9 };
            assert!(e.dtoh(out).unwrap().iter().all(|&v| v == expected), "read {i} saw another write");
        }
        drop(outs);
        drop(x);
        writer.synchronize().unwrap();
        reader.synchronize().unwrap();
        assert_eq!(double.violations(), 0, "{}", double.last_violation());
    });
}

/// One failing driver call of a fault sweep: the `nth` call of `entry`, counted from when it is
/// armed (an entry point of the NCCL double when `in_nccl`).
struct Injected<'d> {
    double: &'d double::Double,
    in_nccl: bool,
    entry: &'d str,
    nth: i32,
    /// Names the run in assertion messages.
    case: String,
    calls_before: Option<u64>,
}

impl Injected<'_> {
    /// Calls of the entry so far.
    fn calls(&self) -> u64 {
        if self.in_nccl { double::nccl_double().calls(self.entry) } else { self.double.calls(self.entry) }
    }

    /// Makes the call fail from here on: right before the operation swept.
    fn arm(&mut self) {
        self.calls_before = Some(self.calls());
        if self.in_nccl {
            double::nccl_double().fail(self.entry, self.nth, NCCL_INTERNAL_ERROR);
        } else {
            self.double.fail(self.entry, self.nth, OUT_OF_MEMORY);
        }
    }

    /// Whether the operation reached the failing call.
    fn reached(&self) -> bool {
        self.calls() - self.calls_before.expect("armed before") >= self.nth as u64
    }

    /// Ends the failure, right after the operation, and checks that the operation reached it;
    /// returns the errors recorded meanwhile for `take_drop_errors`.
    fn disarm(&mut self) -> Vec<Error> {
        self.disarm_within(std::time::Duration::ZERO)
    }

    /// [`disarm`](Self::disarm) for a call that a background thread may make: waits up to
    /// `within` for it first.
    fn disarm_within(&mut self, within: std::time::Duration) -> Vec<Error> {
        let (reached, errors) = self.disarm_if_reached_within(within);
        assert!(reached, "{}: the failure was not reached", self.case);
        errors
    }

    /// [`disarm_within`](Self::disarm_within) for an operation whose calls depend on timing:
    /// whether the failure was reached, and the errors recorded meanwhile.
    fn disarm_if_reached_within(&mut self, within: std::time::Duration) -> (bool, Vec<Error>) {
        let until = std::time::Instant::now() + within;
        while !self.reached() && std::time::Instant::now() < until {
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
        self.double.clear_faults();
        if self.in_nccl {
            double::nccl_double().clear_faults();
        }
        (self.reached(), ppnrt::take_drop_errors())
    }

    /// Whether `error` names the failing call.
    fn names(&self, error: &Error) -> bool {
        error.to_string().contains(self.entry.trim_end_matches("_v2"))
    }

    /// Asserts that `error` names the failing call.
    fn assert_named(&self, error: &Error) {
        assert!(self.names(error), "{}: the error does not name the call: {error}", self.case);
    }
}

/// Runs `run` once for each driver call that one operation makes (`calls`: entry points, calls
/// each), with that call failing: `run` sets the operation up, [`arm`](Injected::arm)s the
/// failure right before it and [`disarm`](Injected::disarm)s it right after, and checks the
/// outcome. After each run, once every queued operation ran, the double must have seen no access
/// to freed memory. Returns the number of runs.
fn sweep_calls(
    double: &double::Double,
    calls: &[(String, u64)],
    what: &str,
    mut run: impl FnMut(&mut Injected<'_>),
) -> usize {
    let mut runs = 0;
    for (entry, made) in calls {
        for nth in 1..=*made as i32 {
            let case = format!("{what}: call {nth} of {made} to {entry} failing");
            let mut injected = Injected { double, in_nccl: false, entry, nth, case, calls_before: None };
            double.flush();
            let _ = ppnrt::take_drop_errors();
            let violations = double.violations();
            run(&mut injected);
            assert!(injected.calls_before.is_some(), "{}: never armed", injected.case);
            double.clear_faults();
            double.flush();
            assert_eq!(double.violations(), violations, "{}: {}", injected.case, double.last_violation());
            let _ = ppnrt::take_drop_errors();
            runs += 1;
        }
    }
    runs
}

/// How one step of the fault sweep ended.
#[derive(Debug)]
enum Swept {
    /// Every call succeeded: the values read back.
    Delivered(Vec<u32>),
    /// `tx` (or entering its stage) failed: nothing was sent.
    NotSent(Error),
    /// `tx` succeeded and receiving failed: the slot to receive again.
    NotReceived(usize, Error),
    /// Received, and a later call failed (the copy out of the slot, the readback or its wait);
    /// for a failed wait, what a second wait gave.
    NotReadBack(Error, Option<Vec<u32>>),
}

/// Receives slot `slot` of boundary 0 (a copy by `rx`, or in place and copied out on the stage's
/// stream) and reads it back: `Delivered`, `NotReceived` when the receive failed, or
/// `NotReadBack` (for a failed wait, with what a second wait gave).
fn receive_and_read_back(rt: &PpNRt, e1: &Engine, slot: usize, n: usize, in_place: bool) -> Swept {
    receive_and_read_back_within(rt, e1, slot, n, in_place, None)
}

/// [`receive_and_read_back`], waiting up to `wait` for the slot to be filled when given (a
/// boundary from another rank fills it in the background).
fn receive_and_read_back_within(
    rt: &PpNRt,
    e1: &Engine,
    slot: usize,
    n: usize,
    in_place: bool,
    wait: Option<std::time::Duration>,
) -> Swept {
    let stage = match rt.enter(1) {
        Ok(stage) => stage,
        Err(e) => return Swept::NotReceived(slot, e),
    };
    let received = if in_place {
        let lent = match wait.map_or_else(|| rt.rx_in_place::<u32>(0, slot, n), |t| rt.rx_in_place_wait(0, slot, n, t))
        {
            Ok(lent) => lent,
            Err(e) => return Swept::NotReceived(slot, e),
        };
        let copied = e1.alloc::<u32>(n).and_then(|mut out| {
            e1.dtod(&lent.view()?, &mut out)?;
            Ok(out)
        });
        match copied {
            Ok(out) => out,
            Err(e) => return Swept::NotReadBack(e, None),
        }
    } else {
        match wait.map_or_else(|| rt.rx::<u32>(0, slot, n), |t| rt.rx_wait(0, slot, n, t)) {
            Ok(received) => received,
            Err(e) => return Swept::NotReceived(slot, e),
        }
    };
    let pending = match rt.readback(received) {
        Ok(pending) => pending,
        Err(e) => return Swept::NotReadBack(e, None),
    };
    drop(stage);
    match pending.wait() {
        Ok(values) => Swept::Delivered(values.to_vec()),
        // A boundary from another rank failed: the values are not given, now or later.
        Err(e) if peer_failed(&e) => Swept::NotReadBack(e, None),
        Err(e) => {
            // A failed wait loses nothing: the next one gives the values.
            let again = pending.wait().map(<[u32]>::to_vec).unwrap_or_else(|e| panic!("the second wait failed: {e}"));
            Swept::NotReadBack(e, Some(again))
        }
    }
}

/// One decode-like step for the fault sweep: `tx` of `input` from stage 0, the receive on
/// stage 1, a deferred readback of what arrived.
fn sweep_step(rt: &PpNRt, e1: &Engine, input: &CudaSlice<u32>, n: usize, in_place: bool) -> Swept {
    match rt.enter(0).and_then(|_stage| rt.tx(0, input, n)) {
        Ok(slot) => receive_and_read_back(rt, e1, slot, n, in_place),
        Err(e) => Swept::NotSent(e),
    }
}

/// The fault sweep: every driver call that a warm step makes (`tx`, `rx` or an in-place receive
/// copied out, a deferred readback and its wait, the drops) is failed in turn, one per run, on
/// every transport. Whatever call fails, the step returns a typed error naming it or delivers
/// the right values (a failure the crate can only record, in a drop); a step whose `tx` went out
/// but whose receive failed is received by a second try, whole; a readback whose wait failed
/// gives its values to a second wait; and the next steps deliver their values. The step's input is dropped at once and the next step is larger (its slot is
/// allocated again, the old one freed), so work a failed call left queued and unordered would
/// touch freed memory: the double counts every such access, through the runtime's drop too.
#[test]
fn every_failing_driver_call_of_a_step_is_an_error_that_loses_nothing() {
    with_double("every_failing_driver_call_of_a_step_is_an_error_that_loses_nothing", |double| {
        const WARM: usize = 4;
        const AFTER: usize = 3;
        let n = 4096;
        // Step t's length: the step after the swept one is four times as long, so its slot grows.
        let len = |t: usize| if t == WARM + 1 { 4 * n } else { n };
        let data = |t: usize| -> Vec<u32> {
            (0..len(t) as u32).map(|i| i.wrapping_mul(2_654_435_761) ^ ((t as u32) << 20 | 0x5a5)).collect()
        };
        let primary = Engine::new(0).unwrap();
        let mut cases = 0;
        for (devices, policy) in EVERY_TRANSPORT {
            for in_place in [false, true] {
                let what = format!("{policy:?} {devices:?}{}", if in_place { " in place" } else { "" });
                // A runtime with its inputs made and WARM steps run: every slot, event and
                // pinned buffer a step of length n needs exists.
                let warm = || {
                    let rt = PpNRt::new(PpConfig::with_devices(&devices).transport(policy), &primary).unwrap();
                    let (e0, e1) = (rt.engine(0, &primary).unwrap().clone(), rt.engine(1, &primary).unwrap().clone());
                    let inputs: Vec<Option<CudaSlice<u32>>> = {
                        let _stage = rt.enter(0).unwrap();
                        (0..WARM + 1 + AFTER).map(|t| Some(e0.htod(&data(t)).unwrap())).collect()
                    };
                    for (t, input) in inputs.iter().enumerate().take(WARM) {
                        match sweep_step(&rt, &e1, input.as_ref().unwrap(), n, in_place) {
                            Swept::Delivered(values) => assert!(values == data(t), "{what}: warm step {t}"),
                            other => panic!("{what}: warm step {t}: {other:?}"),
                        }
                    }
                    double.flush();
                    // Each step starts with no context current: a failed restore of the current
                    // context in an earlier run changes nothing here.
                    raw!(cuCtxSetCurrent(std::ptr::null_mut()));
                    (rt, e1, inputs)
                };
                // The driver calls of one warm step, per entry point.
                let calls: Vec<(String, u64)> = {
                    let (rt, e1, inputs) = warm();
                    let mut step = None;
                    let calls = double.calls_made_by(|| {
                        step = Some(sweep_step(&rt, &e1, inputs[WARM].as_ref().unwrap(), n, in_place))
                    });
                    assert!(matches!(step, Some(Swept::Delivered(_))), "{what}: {step:?}");
                    calls
                };
                assert!(calls.iter().map(|(_, c)| c).sum::<u64>() >= 5, "{what}: a step made only {calls:?}");
                cases += sweep_calls(double, &calls, &what, |injected| {
                    let case = injected.case.clone();
                    let (rt, e1, mut inputs) = warm();
                    injected.arm();
                    let outcome = sweep_step(&rt, &e1, inputs[WARM].as_ref().unwrap(), n, in_place);
                    injected.disarm();
                    // Freed at once: its free waits for whatever the step left reading it.
                    inputs[WARM] = None;
                    match &outcome {
                        Swept::Delivered(values) => assert!(*values == data(WARM), "{case}: wrong values delivered"),
                        Swept::NotSent(e) | Swept::NotReadBack(e, None) => injected.assert_named(e),
                        Swept::NotReadBack(e, Some(again)) => {
                            injected.assert_named(e);
                            assert!(*again == data(WARM), "{case}: the second wait gave wrong values");
                        }
                        Swept::NotReceived(slot, e) => {
                            injected.assert_named(e);
                            match receive_and_read_back(&rt, &e1, *slot, n, in_place) {
                                Swept::Delivered(again) => {
                                    assert!(again == data(WARM), "{case}: the second receive got wrong values")
                                }
                                other => panic!("{case}: the second receive: {other:?}"),
                            }
                        }
                    }
                    for (t, input) in inputs.iter().enumerate().skip(WARM + 1) {
                        match sweep_step(&rt, &e1, input.as_ref().unwrap(), len(t), in_place) {
                            Swept::Delivered(values) => assert!(values == data(t), "{case}: step {t} wrong"),
                            other => panic!("{case}: step {t} after the failure: {other:?}"),
                        }
                    }
                });
            }
        }
        println!("fault sweep: {cases} runs, each with one failing driver call");
    });
}

/// How one graph step of the graph fault sweep ended.
#[derive(Debug)]
enum GraphSwept {
    /// Every call succeeded: the slot the step used and the last stage's values read back.
    Delivered(usize, Vec<f32>),
    /// Writing the step's input failed: nothing was launched.
    NotLaunched(Error),
    /// The launch failed: some stages may have run.
    LaunchFailed(Error),
    /// The step ran (in slot `.0`); copying its output out or reading it back failed.
    NotReadBack(usize, Error),
}

/// The last stage's activations, copied out on its stream and read back.
fn read_last_stage(rt: &PpNRt, primary: &Engine, buffers: &graphs::StepBuffers, n: usize) -> ppnrt::Result<Vec<f32>> {
    let last = rt.n_stages() - 1;
    let engine = rt.engine(last, primary)?;
    let _stage = rt.enter(last)?;
    let mut out = engine.alloc::<f32>(n)?;
    engine.dtod(&buffers.acts[last], &mut out)?;
    Ok(rt.readback(out)?.wait()?.to_vec())
}

/// One graph step: the input written into stage 0's activations, the step launched, the last
/// stage's activations read back.
fn graph_sweep_step(
    rt: &PpNRt,
    primary: &Engine,
    step: &mut ppnrt::StepGraphs<'_, f32>,
    buffers: &mut graphs::StepBuffers,
    input: &[f32],
) -> GraphSwept {
    let e0 = rt.engine(0, primary).unwrap();
    if let Err(e) = rt.enter(0).and_then(|_stage| e0.htod_into(input, &mut buffers.acts[0])) {
        return GraphSwept::NotLaunched(e);
    }
    let slot = match step.launch() {
        Ok(slot) => slot,
        Err(e) => return GraphSwept::LaunchFailed(e),
    };
    match read_last_stage(rt, primary, buffers, input.len()) {
        Ok(values) => GraphSwept::Delivered(slot, values),
        Err(e) => GraphSwept::NotReadBack(slot, e),
    }
}

/// The fault sweep in graph mode: every driver call of a warm graph step (the input's copy, each
/// stage's graph launch with the protocol's waits and records, the copy out and readback) is
/// failed in turn, one per run: two stages on two GPUs and on one, four stages alternating over
/// two GPUs, the slot copied or read in place. Whatever call fails, the step returns a typed error
/// naming it, or delivers the right values.
/// A failed launch is finished as documented on [`StepGraphs::launch`](ppnrt::StepGraphs::launch):
/// `launch` again, and where it answers that a stage is behind, `launch_stage` of that stage and
/// of each later one;
/// the step then delivers its values, bitwise, and so do the next ones. No queued work touches
/// freed memory, through the runtime's drop too.
#[test]
fn every_failing_driver_call_of_a_graph_step_is_an_error_that_loses_nothing() {
    with_double("every_failing_driver_call_of_a_graph_step_is_an_error_that_loses_nothing", |double| {
        const WARM: usize = 3;
        const AFTER: usize = 3;
        let n = 1024;
        let primary = Engine::new(0).unwrap();
        let inputs: Vec<Vec<f32>> = (0..WARM + 1 + AFTER)
            .map(|t| (0..n).map(|i| ((i * 7 + t * 13) % 101) as f32 * 0.125 - 3.0).collect())
            .collect();
        // The model's output for input t run with step parameter (slot) k: expected[k][t].
        let expected: Vec<Vec<Vec<f32>>> = (0..2).map(|k| graphs::reference(&primary, &inputs, |_| k)).collect();
        let same =
            |a: &[f32], b: &[f32]| a.len() == b.len() && a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits());
        let mut cases = 0;
        let mut finished_by_stage = 0;
        for devices in [&[0, 1][..], &[0, 0], &[0, 1, 0, 1]] {
            for in_place in [false, true] {
                let what = format!("graph mode {devices:?}{}", if in_place { " in place" } else { "" });
                let config = PpConfig::with_devices(devices).slots(2);
                let run =
                    |check_calls: &mut dyn FnMut(&PpNRt, &mut ppnrt::StepGraphs<'_, f32>, &mut graphs::StepBuffers)| {
                        let rt = PpNRt::new(config.clone(), &primary).unwrap();
                        let mut buffers = graphs::StepBuffers::new(&rt, &primary, n);
                        let mut step = graphs::capture(&rt, &primary, &mut buffers, n, in_place).unwrap();
                        for (t, input) in inputs.iter().enumerate().take(WARM) {
                            match graph_sweep_step(&rt, &primary, &mut step, &mut buffers, input) {
                                GraphSwept::Delivered(k, values) => {
                                    assert!(same(&values, &expected[k][t]), "{what}: warm step {t}")
                                }
                                other => panic!("{what}: warm step {t}: {other:?}"),
                            }
                        }
                        double.flush();
                        raw!(cuCtxSetCurrent(std::ptr::null_mut()));
                        check_calls(&rt, &mut step, &mut buffers);
                        drop(step);
                        drop(buffers);
                        drop(rt);
                    };
                // The driver calls of one warm graph step, per entry point.
                let mut calls: Vec<(String, u64)> = Vec::new();
                run(&mut |rt, step, buffers| {
                    let mut swept = None;
                    calls = double
                        .calls_made_by(|| swept = Some(graph_sweep_step(rt, &primary, step, buffers, &inputs[WARM])));
                    assert!(matches!(swept, Some(GraphSwept::Delivered(..))), "{what}: {swept:?}");
                });
                assert!(calls.iter().any(|(entry, _)| entry == "cuGraphLaunch"), "{what}: {calls:?}");
                cases += sweep_calls(double, &calls, &what, |injected| {
                    let case = injected.case.clone();
                    run(&mut |rt, step, buffers| {
                        injected.arm();
                        let swept = graph_sweep_step(rt, &primary, step, buffers, &inputs[WARM]);
                        injected.disarm();
                        let named = |e: &Error| injected.assert_named(e);
                        let (slot, values) = match swept {
                            GraphSwept::Delivered(slot, values) => (slot, values),
                            GraphSwept::NotReadBack(slot, e) => {
                                named(&e);
                                (slot, read_last_stage(rt, &primary, buffers, n).unwrap())
                            }
                            GraphSwept::NotLaunched(e) | GraphSwept::LaunchFailed(e) => {
                                named(&e);
                                // Finished as documented: the input again, then `launch`; a
                                // stage left behind is launched alone.
                                match graph_sweep_step(rt, &primary, step, buffers, &inputs[WARM]) {
                                    GraphSwept::Delivered(slot, values) => (slot, values),
                                    GraphSwept::LaunchFailed(Error::Pipeline(
                                        ppnrt::PpError::GraphStageOutOfStep { stage, .. },
                                    )) => {
                                        // That stage, then each later one.
                                        let mut slot = 0;
                                        for behind in stage..rt.n_stages() {
                                            slot = step
                                                .launch_stage(behind, std::time::Duration::from_secs(1))
                                                .unwrap_or_else(|e| {
                                                    panic!("{case}: stage {behind} could not catch up: {e}")
                                                });
                                        }
                                        finished_by_stage += 1;
                                        (slot, read_last_stage(rt, &primary, buffers, n).unwrap())
                                    }
                                    other => panic!("{case}: the step could not be finished: {other:?}"),
                                }
                            }
                        };
                        assert!(same(&values, &expected[slot][WARM]), "{case}: wrong values (slot {slot})");
                        for (t, input) in inputs.iter().enumerate().skip(WARM + 1) {
                            match graph_sweep_step(rt, &primary, step, buffers, input) {
                                GraphSwept::Delivered(k, values) => {
                                    assert!(same(&values, &expected[k][t]), "{case}: step {t} wrong")
                                }
                                other => panic!("{case}: step {t} after the failure: {other:?}"),
                            }
                        }
                    });
                });
            }
        }
        println!(
            "graph fault sweep: {cases} runs, each with one failing driver call; {finished_by_stage} finished by launch_stage"
        );
    });
}

/// Bitwise equality of two runs of the toy model.
fn same_f32_bits(a: &[f32], b: &[f32]) -> bool {
    a.len() == b.len() && a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits())
}

/// The toy model's inputs, and its outputs for each: `outputs[k][t]` is input t's run with step
/// parameter (slot) k.
#[derive(Clone, Copy)]
struct ToyRuns<'a> {
    inputs: &'a [Vec<f32>],
    outputs: &'a [Vec<Vec<f32>>],
}

/// Graph steps `steps` of the inputs, each bitwise the model's output for its slot.
fn graph_steps_deliver(
    rt: &PpNRt,
    primary: &Engine,
    step: &mut ppnrt::StepGraphs<'_, f32>,
    buffers: &mut graphs::StepBuffers,
    runs: ToyRuns<'_>,
    steps: std::ops::Range<usize>,
    case: &str,
) {
    for t in steps {
        match graph_sweep_step(rt, primary, step, buffers, &runs.inputs[t]) {
            GraphSwept::Delivered(k, values) => {
                assert!(same_f32_bits(&values, &runs.outputs[k][t]), "{case}: graph step {t}")
            }
            other => panic!("{case}: graph step {t}: {other:?}"),
        }
    }
}

/// An eager step of `inputs[t]` (step parameter 0), bitwise the model's output.
fn eager_step_delivers(rt: &PpNRt, primary: &Engine, runs: ToyRuns<'_>, t: usize, case: &str) {
    let out = graphs::eager_step(rt, primary, &runs.inputs[t], 0);
    let last = rt.n_stages() - 1;
    let _stage = rt.enter(last).unwrap();
    let values = rt.engine(last, primary).unwrap().dtoh(&out).unwrap();
    assert!(same_f32_bits(&values, &runs.outputs[0][t]), "{case}: eager step {t}");
}

/// What the capture sweep captures: the pipeline, whether a stage reads its slot in place, and
/// whether the capture swept is a re-capture of graphs already launched.
struct CaptureSetup {
    config: PpConfig,
    in_place: bool,
    recapturing: bool,
}

/// One run of the capture sweep: a warm runtime (eager steps, and for a re-capture a capture
/// and graph steps), then the capture or re-capture with `fault` injected, then the checks.
/// Returns the driver calls the capture made.
fn capture_sweep_run(
    double: &double::Double,
    primary: &Engine,
    setup: &CaptureSetup,
    runs: ToyRuns<'_>,
    mut fault: Option<&mut Injected<'_>>,
    case: &str,
) -> Vec<(String, u64)> {
    let CaptureSetup { config, in_place, recapturing } = setup;
    let (in_place, recapturing) = (*in_place, *recapturing);
    let n = runs.inputs[0].len();
    let rt = PpNRt::new(config.clone(), primary).unwrap();
    let mut buffers = graphs::StepBuffers::new(&rt, primary, n);
    eager_step_delivers(&rt, primary, runs, 0, case);
    let mut step = if recapturing {
        let mut step = graphs::capture(&rt, primary, &mut buffers, n, in_place).unwrap();
        graph_steps_deliver(&rt, primary, &mut step, &mut buffers, runs, 1..3, case);
        Some(step)
    } else {
        None
    };
    double.flush();
    raw!(cuCtxSetCurrent(std::ptr::null_mut()));
    if let Some(injected) = fault.as_deref_mut() {
        injected.arm();
    }
    let mut captured = None;
    let calls = double.calls_made_by(|| {
        captured = Some(match step.as_mut() {
            Some(step) => graphs::recapture(step, &rt, primary, &mut buffers, n, in_place).map(|()| None),
            None => graphs::capture(&rt, primary, &mut buffers, n, in_place).map(Some),
        });
    });
    if let Some(injected) = fault {
        let recorded = injected.disarm();
        if captured.as_ref().is_some_and(Result::is_ok) {
            // A failure the capture got over is recorded.
            assert!(recorded.iter().any(|e| injected.names(e)), "{case}: unreported: {recorded:?}");
        }
    }
    match captured.expect("ran above") {
        Ok(Some(fresh)) => step = Some(fresh),
        Ok(None) => {}
        Err(e) => {
            assert!(matches!(e, Error::Driver(_) | Error::Capture(_)), "{case}: not a driver or capture error: {e}");
            // The runtime stays usable: an eager step delivers (no stream is left capturing).
            eager_step_delivers(&rt, primary, runs, 3, case);
            if step.is_none() {
                step = Some(graphs::capture(&rt, primary, &mut buffers, n, in_place).unwrap());
            }
        }
    }
    let step_ref = step.as_mut().expect("captured above");
    // The graphs as they are now: the old ones, new ones, or stale until captured again.
    if let GraphSwept::LaunchFailed(Error::Pipeline(ppnrt::PpError::GraphStale { .. })) =
        graph_sweep_step(&rt, primary, step_ref, &mut buffers, &runs.inputs[4])
    {
        graphs::recapture(step_ref, &rt, primary, &mut buffers, n, in_place).unwrap();
        graph_steps_deliver(&rt, primary, step_ref, &mut buffers, runs, 4..5, case);
    }
    graph_steps_deliver(&rt, primary, step_ref, &mut buffers, runs, 5..7, case);
    eager_step_delivers(&rt, primary, runs, 7, case);
    drop(step);
    drop(buffers);
    drop(rt);
    calls
}

/// The fault sweep of captures: every driver call of a first capture (`capture_step`) and of a
/// re-capture (`recapture`) of a warm pipeline is failed in turn, one per run, on two devices
/// and on one, the slot copied or read in place. A failed capture is a typed error and leaves
/// the runtime usable (an eager step delivers: no stream is left capturing) and, for a
/// re-capture, the graphs as `recapture` documents (the old ones, or stale until captured
/// again); every later graph and eager step delivers bitwise; no queued work touches freed
/// memory.
#[test]
fn every_failing_driver_call_of_a_capture_is_an_error_that_loses_nothing() {
    with_double("every_failing_driver_call_of_a_capture_is_an_error_that_loses_nothing", |double| {
        let n = 1024;
        let primary = Engine::new(0).unwrap();
        let inputs: Vec<Vec<f32>> =
            (0..8).map(|t| (0..n).map(|i| ((i * 5 + t * 17) % 97) as f32 * 0.25 - 7.0).collect()).collect();
        let expected: Vec<Vec<Vec<f32>>> = (0..2).map(|k| graphs::reference(&primary, &inputs, |_| k)).collect();
        let runs = ToyRuns { inputs: &inputs, outputs: &expected };
        let mut cases = 0;
        for devices in [[0, 1], [0, 0]] {
            for in_place in [false, true] {
                for recapturing in [false, true] {
                    let setup =
                        CaptureSetup { config: PpConfig::with_devices(&devices).slots(2), in_place, recapturing };
                    let what = format!(
                        "{} {devices:?}{}",
                        if recapturing { "re-capture" } else { "capture" },
                        if in_place { " in place" } else { "" }
                    );
                    // Counted on a second run: the first may make one-time calls (a module's load,
                    // peer access) that later runs do not.
                    let counted = || capture_sweep_run(double, &primary, &setup, runs, None, &what);
                    counted();
                    let calls = counted();
                    assert!(calls.iter().any(|(entry, _)| entry == "cuStreamBeginCapture_v2"), "{what}: {calls:?}");
                    cases += sweep_calls(double, &calls, &what, |injected| {
                        let case = injected.case.clone();
                        capture_sweep_run(double, &primary, &setup, runs, Some(injected), &case);
                    });
                }
            }
        }
        println!("capture fault sweep: {cases} runs, each with one failing driver call");
    });
}

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
            let config = PpConfig::with_devices(&devices).transport(policy);
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
            let config = PpConfig::with_devices(&devices).transport(policy);
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
fn safe_chain(e: &Engine, data: &[u32]) -> ppnrt::Result<(Vec<u32>, Vec<u32>)> {
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

/// How long a remote sweep's receive waits for its slot: far past the peer timeout, so that a
/// receive that times out was stalled, not slow.
const REMOTE_RECEIVE_WAIT: std::time::Duration = std::time::Duration::from_secs(10);

/// Drops runtimes (one rank's, or both ranks'), failing when that takes longer than `limit` (a
/// hang); returns the errors the drops recorded.
fn drop_ranks_within<R: Send + 'static>(ranks: R, limit: std::time::Duration, case: &str) -> Vec<Error> {
    let (done, finished) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        drop(ranks);
        let _ = done.send(ppnrt::take_drop_errors());
    });
    finished.recv_timeout(limit).unwrap_or_else(|_| panic!("{case}: dropping the ranks took over {limit:?}"))
}

/// One step across the two ranks: rank 0's `tx` of `input`, rank 1's receive (waiting for the
/// slot to be filled) and deferred readback.
fn remote_step(ranks: &(PpNRt, PpNRt), e1: &Engine, input: &CudaSlice<u32>, n: usize, in_place: bool) -> Swept {
    match ranks.0.enter(0).and_then(|_stage| ranks.0.tx(0, input, n)) {
        Ok(slot) => receive_and_read_back_within(&ranks.1, e1, slot, n, in_place, Some(REMOTE_RECEIVE_WAIT)),
        Err(e) => Swept::NotSent(e),
    }
}

/// Whether `e` is the typed failure of a boundary to another rank.
fn peer_failed(e: &Error) -> bool {
    matches!(e, Error::Pipeline(ppnrt::PpError::PeerFailed { .. }))
}

/// What one run of a sweep across ranks saw: whether it reached its failing call, the errors calls
/// returned, and those drops recorded.
struct RanksRun {
    reached: bool,
    errors: Vec<Error>,
    drop_errors: Vec<Error>,
}

/// The loop of the sweeps across ranks, [`sweep_calls`] for calls of either double made by either
/// rank: runs `run` once for each call of `faults` (`true` for the NCCL double's, the entry point,
/// the calls made), with that call failing. `run` sets the ranks up, [`arm`](Injected::arm)s the
/// failure, disarms it and reports what it saw. After each run: a run that reached its failure
/// saw an error naming the call (a failure the crate got over is recorded); once every queued
/// operation ran, nothing touched freed memory, and at most one allocation per drop error is
/// left (a drop that cannot order or free its memory leaves it allocated, since it may be in
/// use, and records why). The runs that did not reach their failure go into `unreached`. Returns
/// the number of runs.
fn sweep_across_ranks(
    double: &double::Double,
    faults: &[(bool, String, u64)],
    what: &str,
    unreached: &mut Vec<String>,
    mut run: impl FnMut(&mut Injected<'_>) -> RanksRun,
) -> usize {
    let mut runs = 0;
    for (in_nccl, entry, made) in faults {
        for nth in 1..=*made as i32 {
            let case = format!("{what}: call {nth} of {made} to {entry} failing");
            let mut injected =
                Injected { double, in_nccl: *in_nccl, entry, nth, case: case.clone(), calls_before: None };
            let _ = ppnrt::take_drop_errors();
            let violations = double.violations();
            double.flush();
            let live_before = double.live_allocations();
            let RanksRun { reached, errors, drop_errors } = run(&mut injected);
            if reached {
                assert!(
                    errors.iter().chain(&drop_errors).any(|e| injected.names(e)),
                    "{case}: no error names the call: {errors:?}; recorded by drops: {drop_errors:?}"
                );
            } else {
                // A call the measured run made and this one did not: the receive's capture waits
                // for NCCL's work on a clock (at most a millisecond), and takes NCCL's call when
                // it finds the work still running; a setup's waits for the other rank poll.
                unreached.push(case.clone());
            }
            double.clear_faults();
            double.flush();
            assert_eq!(double.violations(), violations, "{case}: {}", double.last_violation());
            let (live, live_pinned) = double.live_allocations();
            let left = (live - live_before.0) + (live_pinned - live_before.1);
            assert!(
                left <= drop_errors.len() as u64,
                "{case}: {left} allocation(s) left, {} drop error(s) recorded: {drop_errors:?}",
                drop_errors.len()
            );
            runs += 1;
        }
    }
    runs
}

/// The operation swept by
/// [`every_failing_call_across_ranks_is_an_error_in_bounded_time_that_loses_nothing`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum RemoteSwept {
    /// A step of the warm steps' length: received through the receive graph captured for it.
    Steady,
    /// A step of a length not seen before: NCCL's receive call (the slot grows).
    NewLength,
    /// The second step of a new length in a row: its receive is captured, then launched.
    Captured,
    /// Both runtimes dropped, with a step's readback and the input's free still queued.
    Teardown,
}

/// The NCCL double's calls that `body` makes, per entry point, but for the watchdog's polls of
/// asynchronous errors (made on a clock, not by the operation).
fn nccl_calls_made_by(body: impl FnOnce()) -> Vec<(String, u64)> {
    let mut made = double::nccl_double().calls_made_by(body);
    made.retain(|(entry, _)| entry != "ncclCommGetAsyncError");
    made
}

/// The fault sweep across ranks: two ranks of one pipeline (threads of this process, through
/// the driver and NCCL doubles) run warm steps, then every driver call and NCCL call that one
/// more operation makes (a steady step received through its captured graph, a step of a new
/// length, a step whose receive is captured, each received by copy and in place; and the two
/// runtimes' teardown) is failed in turn, one per run, and so is the watchdog's next poll of
/// NCCL's asynchronous error. Whatever call fails, in whichever rank: nothing hangs (a receive
/// waits far past the peer timeout and must not time out; the drops are bounded); an error
/// names the failing call; a receive that failed in its own rank (the link alive) is received
/// again whole; a link that failed makes every later step fail `PeerFailed` in both ranks, never
/// stall or deliver wrong data; a run that saw no `PeerFailed` delivers its next steps; and once
/// both runtimes are dropped and every queued operation ran, nothing touched freed memory (the
/// NCCL double's sends and receives included) and no allocation is left.
#[test]
fn every_failing_call_across_ranks_is_an_error_in_bounded_time_that_loses_nothing() {
    with_double("every_failing_call_across_ranks_is_an_error_in_bounded_time_that_loses_nothing", |double| {
        double::nccl_double().clear_faults();
        const WARM: usize = 5;
        const AFTER: usize = 3;
        let peer_timeout = std::time::Duration::from_secs(3);
        let drop_limit = peer_timeout * 4;
        let n = 2048;
        let mut cases = 0;
        let mut unreached = Vec::new();
        for swept in [RemoteSwept::Steady, RemoteSwept::NewLength, RemoteSwept::Captured, RemoteSwept::Teardown] {
            for in_place in [false, true] {
                if swept == RemoteSwept::Teardown && in_place {
                    continue;
                }
                let what = format!("across ranks, {swept:?}{}", if in_place { " in place" } else { "" });
                // Step t's length; the swept step is step WARM.
                let len = |t: usize| match swept {
                    RemoteSwept::NewLength if t == WARM => 3 * n,
                    RemoteSwept::Captured if t == WARM - 1 || t == WARM => 3 * n,
                    _ => n,
                };
                let data = |t: usize| -> Vec<u32> {
                    (0..len(t) as u32).map(|i| i.wrapping_mul(2_654_435_761) ^ ((t as u32) << 20 | 0x7e1)).collect()
                };
                // Two ranks with their inputs made and WARM steps run.
                let warm = || {
                    let ranks = two_ranks(peer_timeout);
                    let primary = Engine::new(0).unwrap();
                    let (e0, e1) =
                        (ranks.0.engine(0, &primary).unwrap().clone(), ranks.1.engine(1, &primary).unwrap().clone());
                    let inputs: Vec<Option<CudaSlice<u32>>> = {
                        let _stage = ranks.0.enter(0).unwrap();
                        (0..WARM + 1 + AFTER).map(|t| Some(e0.htod(&data(t)).unwrap())).collect()
                    };
                    for (t, input) in inputs.iter().enumerate().take(WARM) {
                        match remote_step(&ranks, &e1, input.as_ref().unwrap(), len(t), in_place) {
                            Swept::Delivered(values) => assert!(values == data(t), "{what}: warm step {t}"),
                            other => panic!("{what}: warm step {t}: {other:?}"),
                        }
                    }
                    double.flush();
                    // Each run starts with no context current: a failed restore of the current
                    // context in an earlier run changes nothing here.
                    raw!(cuCtxSetCurrent(std::ptr::null_mut()));
                    (ranks, e1, inputs)
                };
                // For the teardown swept: step WARM sent and its readback queued.
                let last_step_queued = |ranks: &(PpNRt, PpNRt), inputs: &[Option<CudaSlice<u32>>]| {
                    let slot = ranks.0.tx(0, inputs[WARM].as_ref().unwrap(), len(WARM)).unwrap();
                    let received = ranks.1.rx_wait::<u32>(0, slot, len(WARM), REMOTE_RECEIVE_WAIT).unwrap();
                    ranks.1.readback(received).unwrap()
                };
                // The teardown swept: the inputs freed, the readback dropped unread, both runtimes
                // dropped; the errors the drops recorded.
                let teardown = |ranks: (PpNRt, PpNRt), inputs: Vec<Option<CudaSlice<u32>>>, pending| -> Vec<Error> {
                    drop(inputs);
                    drop::<ppnrt::pp::PendingReadback<u32>>(pending);
                    drop_ranks_within(ranks, drop_limit, &what)
                };
                // The calls of one swept operation, per entry point, in each library.
                let (driver_calls, nccl_calls) = {
                    let (ranks, e1, inputs) = warm();
                    let mut ranks = Some(ranks);
                    let mut inputs = Some(inputs);
                    let mut nccl_made = Vec::new();
                    let mut pending = (swept == RemoteSwept::Teardown)
                        .then(|| last_step_queued(ranks.as_ref().unwrap(), inputs.as_ref().unwrap()));
                    let driver_made = double.calls_made_by(|| {
                        nccl_made = nccl_calls_made_by(|| {
                            if let Some(pending) = pending.take() {
                                let errors = teardown(ranks.take().unwrap(), inputs.take().unwrap(), pending);
                                assert!(errors.is_empty(), "{what}: {errors:?}");
                            } else {
                                let input = inputs.as_ref().unwrap()[WARM].as_ref().unwrap();
                                let step = remote_step(ranks.as_ref().unwrap(), &e1, input, len(WARM), in_place);
                                assert!(matches!(&step, Swept::Delivered(v) if *v == data(WARM)), "{what}: {step:?}");
                            }
                        });
                    });
                    drop(inputs);
                    if let Some(ranks) = ranks {
                        let errors = drop_ranks_within(ranks, drop_limit, &what);
                        assert!(errors.is_empty(), "{what}: {errors:?}");
                    }
                    (driver_made, nccl_made)
                };
                assert!(
                    nccl_calls.iter().any(|(entry, _)| entry == "ncclSend" || entry == "ncclCommDestroy"),
                    "{what}: no NCCL call: {nccl_calls:?}"
                );
                let mut faults: Vec<(bool, String, u64)> =
                    driver_calls.into_iter().map(|(e, c)| (false, e, c)).collect();
                faults.extend(nccl_calls.into_iter().map(|(e, c)| (true, e, c)));
                if swept == RemoteSwept::Steady && !in_place {
                    faults.push((true, "ncclCommGetAsyncError".to_string(), 1));
                }
                cases += sweep_across_ranks(double, &faults, &what, &mut unreached, |injected| {
                    let case = injected.case.clone();
                    let (ranks, e1, mut inputs) = warm();
                    // The errors calls returned, and those drops recorded.
                    let mut errors: Vec<Error> = Vec::new();
                    let mut drop_errors: Vec<Error> = Vec::new();
                    // The watchdog's poll comes on its clock; the operation's calls are made
                    // when it returns.
                    let within = if injected.entry == "ncclCommGetAsyncError" {
                        drop_limit
                    } else {
                        std::time::Duration::from_millis(100)
                    };
                    let reached = if swept == RemoteSwept::Teardown {
                        let pending = last_step_queued(&ranks, &inputs);
                        injected.arm();
                        drop_errors.extend(teardown(ranks, inputs, pending));
                        let (reached, recorded) = injected.disarm_if_reached_within(within);
                        drop_errors.extend(recorded);
                        reached
                    } else {
                        injected.arm();
                        let input = inputs[WARM].as_ref().unwrap();
                        let outcome = remote_step(&ranks, &e1, input, len(WARM), in_place);
                        let (reached, recorded) = injected.disarm_if_reached_within(within);
                        // A failure on a clock (the watchdog's poll) may fail the link between
                        // two calls; any other failure is met by a call.
                        let on_a_clock = injected.entry == "ncclCommGetAsyncError";
                        drop_errors.extend(recorded);
                        inputs[WARM] = None;
                        match outcome {
                            Swept::Delivered(values) => assert!(values == data(WARM), "{case}: wrong values"),
                            Swept::NotSent(e) | Swept::NotReadBack(e, None) => errors.push(e),
                            Swept::NotReadBack(e, Some(again)) => {
                                assert!(again == data(WARM), "{case}: the second wait gave wrong values");
                                errors.push(e);
                            }
                            Swept::NotReceived(slot, e) => {
                                let again = receive_and_read_back_within(
                                    &ranks.1,
                                    &e1,
                                    slot,
                                    len(WARM),
                                    in_place,
                                    Some(REMOTE_RECEIVE_WAIT),
                                );
                                match again {
                                    Swept::Delivered(values) if !peer_failed(&e) => {
                                        assert!(values == data(WARM), "{case}: the second receive: wrong values")
                                    }
                                    Swept::NotReceived(_, again) if peer_failed(&e) && peer_failed(&again) => {}
                                    other => panic!("{case}: the receive failed with {e}; again: {other:?}"),
                                }
                                errors.push(e);
                            }
                        }
                        // The next steps: delivered, or, once the link failed, `PeerFailed`.
                        let mut link_failed = errors.iter().any(peer_failed);
                        let saw_peer_failed = link_failed;
                        for (t, input) in inputs.iter().enumerate().skip(WARM + 1) {
                            match remote_step(&ranks, &e1, input.as_ref().unwrap(), len(t), in_place) {
                                Swept::Delivered(values) => {
                                    assert!(!link_failed, "{case}: step {t} delivered after the link failed");
                                    assert!(values == data(t), "{case}: step {t}: wrong values");
                                }
                                Swept::NotSent(e) | Swept::NotReceived(_, e) | Swept::NotReadBack(e, None)
                                    if peer_failed(&e) =>
                                {
                                    link_failed = true;
                                    errors.push(e);
                                }
                                other => panic!("{case}: step {t} after the failure: {other:?}"),
                            }
                        }
                        assert!(
                            saw_peer_failed || !link_failed || on_a_clock,
                            "{case}: the link failed after a step that did not report it"
                        );
                        if link_failed {
                            // Each rank's own account of the failure (the rank that failed first
                            // says why; its peer, that the connection closed, which it learns
                            // within milliseconds: until then a call of it may still succeed).
                            let until = std::time::Instant::now() + drop_limit;
                            let short = std::time::Duration::from_millis(1);
                            let mut accounts = 0;
                            while accounts < 2 && std::time::Instant::now() < until {
                                accounts = 0;
                                for account in [
                                    ranks.1.rx_wait::<u32>(0, 0, n, short).err(),
                                    ranks.0.tx(0, inputs[0].as_ref().unwrap(), n).err(),
                                ]
                                .into_iter()
                                .flatten()
                                .filter(peer_failed)
                                {
                                    errors.push(account);
                                    accounts += 1;
                                }
                            }
                            assert_eq!(accounts, 2, "{case}: a rank never learned that the link failed");
                        }
                        drop(inputs);
                        drop_errors.extend(drop_ranks_within(ranks, drop_limit, &case));
                        reached
                    };
                    RanksRun { reached, errors, drop_errors }
                });
            }
        }
        println!(
            "fault sweep across ranks: {cases} runs, each with one failing driver or NCCL call; {} of them did \
             not reach it: {unreached:?}",
            unreached.len()
        );
        assert!(unreached.len() * 10 <= cases, "the failure was not reached in too many runs");
    });
}

/// The setup sweep across ranks: every driver call and NCCL call that building two ranks of one
/// pipeline makes (the rendezvous, each rank's stages and streams, the communicator's join, the
/// first message that proves the link) is failed in turn, in whichever rank makes it, one per
/// run; so are the first polls of NCCL during the join. Whatever call fails: both setups end
/// within a bound of the peer timeout (never a hang); a rank whose setup failed returns a typed
/// error, and one of the errors names the failing call (a failure a setup got over is recorded);
/// two ranks whose setups both succeeded run a step bitwise; and once everything is dropped and
/// every queued operation ran, nothing is left allocated beyond one allocation per drop that
/// recorded it could not free safely, and nothing touched freed memory.
#[test]
fn every_failing_call_of_a_setup_across_ranks_is_a_typed_error_in_bounded_time() {
    with_double("every_failing_call_of_a_setup_across_ranks_is_a_typed_error_in_bounded_time", |double| {
        double::nccl_double().clear_faults();
        let peer_timeout = std::time::Duration::from_millis(700);
        let bound = peer_timeout * 4;
        let n = 1024;
        let data: Vec<u32> = (0..n as u32).map(|i| i.wrapping_mul(2_654_435_761) ^ 0x5e7).collect();
        // One step across the two ranks, bitwise.
        let step_delivers = |ranks: &(PpNRt, PpNRt), case: &str| {
            let primary = Engine::new(0).unwrap();
            let (e0, e1) = (ranks.0.engine(0, &primary).unwrap(), ranks.1.engine(1, &primary).unwrap());
            let input = {
                let _stage = ranks.0.enter(0).unwrap();
                e0.htod(&data).unwrap()
            };
            match remote_step(ranks, e1, &input, n, false) {
                Swept::Delivered(values) => assert!(values == data, "{case}: wrong values"),
                other => panic!("{case}: the step after the setup: {other:?}"),
            }
        };
        double.flush();
        let _ = ppnrt::take_drop_errors();
        // The calls of a setup, per entry point: the fewest of three setups (the waits for the
        // other rank poll, as many times as the wait lasts).
        let measured: Vec<Vec<(bool, String, u64)>> = (0..3)
            .map(|_| {
                let mut built = None;
                let mut nccl_made = Vec::new();
                let primary = Engine::new(0).unwrap();
                let driver_made = double.calls_made_by(|| {
                    nccl_made = nccl_calls_made_by(|| built = Some(try_two_ranks(&primary, peer_timeout)));
                });
                let (zero, one) = built.unwrap();
                let ranks = (zero.unwrap(), one.unwrap());
                step_delivers(&ranks, "a measured setup");
                let errors = drop_ranks_within(ranks, bound, "a measured setup");
                assert!(errors.is_empty(), "{errors:?}");
                driver_made
                    .into_iter()
                    .map(|(e, c)| (false, e, c))
                    .chain(nccl_made.into_iter().map(|(e, c)| (true, e, c)))
                    .collect()
            })
            .collect();
        let fewest = |in_nccl: bool, entry: &str| {
            measured
                .iter()
                .map(|calls| calls.iter().find(|(n, e, _)| *n == in_nccl && e == entry).map_or(0, |(_, _, c)| *c))
                .min()
                .unwrap()
        };
        let mut faults: Vec<(bool, String, u64)> = measured[0]
            .iter()
            .map(|(in_nccl, entry, _)| (*in_nccl, entry.clone(), fewest(*in_nccl, entry)))
            .filter(|(_, _, calls)| *calls > 0)
            .collect();
        assert!(
            faults.iter().any(|(in_nccl, entry, _)| *in_nccl && entry == "ncclCommInitRankConfig"),
            "the setup made no NCCL join: {faults:?}"
        );
        faults.push((true, "ncclCommGetAsyncError".to_string(), 2));
        let mut slowest = std::time::Duration::ZERO;
        let mut unreached = Vec::new();
        let cases = sweep_across_ranks(double, &faults, "setup across ranks", &mut unreached, |injected| {
            let case = injected.case.clone();
            // Each run starts with no context current: a failed restore of the current
            // context in an earlier run changes nothing here.
            raw!(cuCtxSetCurrent(std::ptr::null_mut()));
            // The primary engine made before the failure: it is the caller's, not the setup's.
            let primary = Engine::new(0).unwrap();
            let started = std::time::Instant::now();
            injected.arm();
            let (zero, one) = try_two_ranks(&primary, peer_timeout);
            let took = started.elapsed();
            let (reached, mut drop_errors) = injected.disarm_if_reached_within(std::time::Duration::from_millis(100));
            assert!(took < bound, "{case}: the setups took {took:?}");
            slowest = slowest.max(took);
            let mut errors = Vec::new();
            match (zero, one) {
                (Ok(zero), Ok(one)) => {
                    let ranks = (zero, one);
                    step_delivers(&ranks, &case);
                    drop_errors.extend(drop_ranks_within(ranks, bound, &case));
                }
                (zero, one) => {
                    for built in [zero, one] {
                        match built {
                            Ok(rt) => drop_errors.extend(drop_ranks_within(rt, bound, &case)),
                            Err(e) => errors.push(e),
                        }
                    }
                }
            }
            RanksRun { reached, errors, drop_errors }
        });
        println!(
            "setup fault sweep across ranks: {cases} runs, each with one failing driver or NCCL call, the slowest \
             {slowest:?}; {} of them did not reach it: {unreached:?}",
            unreached.len()
        );
        assert!(unreached.len() * 10 <= cases, "the failure was not reached in too many runs");
    });
}

/// A readback whose values came through a boundary from another rank is not given once that
/// boundary failed: the failure aborts the communicator, which cuts short a receive still queued
/// (the NCCL double then leaves the slot as it was, as NCCL's abort ends its kernels), so the
/// values would be an earlier step's. Each round: warm steps, one more step received and read
/// back with nothing run yet, then the watchdog's next poll of NCCL fails (in either rank: the
/// other learns it from the connection), and the readback is waited for only once rank 1's
/// boundary failed. The wait must give `PeerFailed` or, where the receive ran before the failure
/// (a poll of the receive's completion ran it), this step's values; never another step's. With
/// the check taken out (mutation `readback-after-failure`), the wait gives the earlier step's.
#[test]
fn a_readback_fed_by_a_failed_boundary_is_refused() {
    with_double("a_readback_fed_by_a_failed_boundary_is_refused", |double| {
        let nccl = double::nccl_double();
        nccl.clear_faults();
        let n = 1024;
        let data =
            |t: u32| -> Vec<u32> { (0..n as u32).map(|i| i.wrapping_mul(2_654_435_761) ^ (t << 20 | 0x3b)).collect() };
        let (mut refused, mut given) = (0, 0);
        for round in 0..12 {
            let ranks = two_ranks(std::time::Duration::from_secs(3));
            let primary = Engine::new(0).unwrap();
            let (e0, e1) = (ranks.0.engine(0, &primary).unwrap().clone(), ranks.1.engine(1, &primary).unwrap().clone());
            let inputs: Vec<CudaSlice<u32>> = {
                let _stage = ranks.0.enter(0).unwrap();
                (0..4).map(|t| e0.htod(&data(t)).unwrap()).collect()
            };
            for (t, input) in inputs.iter().enumerate().take(3) {
                match remote_step(&ranks, &e1, input, n, false) {
                    Swept::Delivered(values) => assert!(values == data(t as u32), "round {round}: warm step {t}"),
                    other => panic!("round {round}: warm step {t}: {other:?}"),
                }
            }
            let slot = ranks.0.tx(0, &inputs[3], n).unwrap();
            let pending = {
                let _stage = ranks.1.enter(1).unwrap();
                let received = ranks.1.rx_wait::<u32>(0, slot, n, REMOTE_RECEIVE_WAIT).unwrap();
                ranks.1.readback(received).unwrap()
            };
            nccl.fail("ncclCommGetAsyncError", 1, NCCL_INTERNAL_ERROR);
            let until = std::time::Instant::now() + REMOTE_RECEIVE_WAIT;
            let next = (slot + 1) % ranks.1.n_slots();
            loop {
                match ranks.1.rx_wait::<u32>(0, next, n, std::time::Duration::from_millis(1)) {
                    Err(e) if peer_failed(&e) => break,
                    _ => assert!(std::time::Instant::now() < until, "round {round}: rank 1's boundary never failed"),
                }
            }
            nccl.clear_faults();
            match pending.wait() {
                Err(e) if peer_failed(&e) => refused += 1,
                Ok(values) => {
                    assert!(values == data(3), "round {round}: the values of another step were given");
                    given += 1;
                }
                Err(e) => panic!("round {round}: {e}"),
            }
            drop(pending);
            drop(inputs);
            drop_ranks_within(ranks, REMOTE_RECEIVE_WAIT, "a readback fed by a failed boundary");
            let _ = ppnrt::take_drop_errors();
        }
        println!("readbacks after their boundary failed: {refused} refused, {given} given (their receive had run)");
        assert!(refused > 0, "no receive was still queued when its boundary failed");
        double.flush();
    });
}
