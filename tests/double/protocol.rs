//! The ordering rule and the boundary protocol through the double: kernel arguments, slot
//! events, thread per stage, readbacks, in-place receives, zero-sized elements, the driver calls
//! a step makes.

use super::*;

/// The ordering rule as a user meets it: produced on one stream, consumed on another; dropped on
/// its owner under a late reader. And the broken variant (a raw address) is caught: the double
/// runs unordered work late, so the consumer reads before the producer ran, or after the free.
#[test]
fn buffers_are_ordered_across_streams_without_a_join() {
    with_double("buffers_are_ordered_across_streams_without_a_join", |double| {
        let e = Engine::new(0).unwrap();
        assert_eq!(ordering::produced_on_one_stream_consumed_on_another(&e, 200, 7, ordering::Handoff::Ordered), 0);
        assert_eq!(ordering::dropped_on_its_owner_while_read_elsewhere(&e, 200, 11, ordering::Handoff::Ordered), 0);
        assert_eq!(ordering::rewritten_on_its_own_stream_after_a_read_elsewhere(&e, 200, 17), 0);
        assert_eq!(ordering::pinned_rewritten_on_its_own_stream_after_a_host_read(&e, 200, 19), 0);
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
        fn buffer_uses<'a>(&'a self, _each: &mut dyn FnMut(ppnrt::BufferUse<'a>)) {}
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
            *self.begun.borrow_mut() =
                Some(self.stream.begin_capture(ppnrt::CaptureMode::Relaxed).map(drop).map_err(Into::into));
            let mut ns = self.ns;
            f(&mut [(&raw mut ns).cast()])
        }
        fn buffer_uses<'a>(&'a self, _each: &mut dyn FnMut(ppnrt::BufferUse<'a>)) {}
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
            Err(ppnrt::Error::Cuda(ppnrt::CudaError::Capture(ppnrt::CaptureError::CannotBegin { reason }))) => {
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
        let rt = PpNRt::new(PpConfig::with_devices(&[0, 1]).with_slots(1), &primary).unwrap();
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
        let rt = PpNRt::new(PpConfig::with_devices(&[0, 1]).with_slots(1), &primary).unwrap();
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
        assert!(matches!(rt.readback(wrong), Err(Error::Cuda(CudaError::WrongDevice { expected: 1, found: 0, .. }))));
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
            let rt = PpNRt::new(PpConfig::with_devices(&devices).with_slots(1).with_fault(fault), &primary).unwrap();
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
        let rt = PpNRt::new(PpConfig::with_devices(&[0, 1]).with_transport(TransportPolicy::Staged), &primary).unwrap();
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
        let rt = PpNRt::new(PpConfig::with_devices(&[0, 1]).with_slots(1), &primary).unwrap();
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
            let rt = PpNRt::new(PpConfig::with_devices(&devices).with_transport(transport), &primary).unwrap();
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

/// A pipeline of `config`'s two stages, stage 0's engine and a 32 KiB input on it, after four
/// boundary steps (slot buffers made, pooled events there): the steady state the driver-call
/// counts below measure.
fn warm_boundary(config: PpConfig, primary: &Engine) -> (PpNRt, Engine, CudaSlice<u32>) {
    let rt = PpNRt::new(config, primary).unwrap();
    let e = rt.engine(0, primary).unwrap().clone();
    let x = {
        let _stage = rt.enter(0).unwrap();
        e.htod(&[1u32; 8192]).unwrap()
    };
    for _ in 0..4 {
        boundary_step(&rt, &x);
    }
    (rt, e, x)
}

/// One boundary step: `tx` of `x` at boundary 0, its `rx`, the received buffer dropped.
fn boundary_step(rt: &PpNRt, x: &CudaSlice<u32>) {
    let slot = rt.tx(0, x, 8192).unwrap();
    drop(rt.rx::<u32>(0, slot, 8192).unwrap());
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
            let (rt, e, x) = warm_boundary(PpConfig::with_devices(&devices).with_sm_copies(sm), &primary);
            let step = || boundary_step(&rt, &x);
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

/// Inside [`Context::bound_unchecked`](ppnrt::Context::bound_unchecked) the calls for its
/// context make no context call at all: a local boundary step none, a peer one only the RX
/// stage's bindings there and back (`rx` and the output's free). A binding of another context
/// inside the scope suspends it: a call for the scope's context then binds it again (the double
/// refuses stream work of a context that is not current), and once that binding is undone the
/// scope holds again. The scope puts back what was current before, also when its closure
/// unwinds.
#[test]
fn an_unchecked_binding_makes_no_context_query_and_yields_to_another_binding() {
    with_double("an_unchecked_binding_makes_no_context_query_and_yields_to_another_binding", |double| {
        let primary = Engine::new(0).unwrap();
        for (devices, label) in [([0, 1], "peer"), ([0, 0], "local")] {
            let (rt, e, x) = warm_boundary(PpConfig::with_devices(&devices), &primary);
            let step = || boundary_step(&rt, &x);
            // Counted on this thread (threads an earlier test left behind may make calls too), and
            // inside the scope (its own binding is not a step's).
            // SAFETY: nothing in the closure changes the current context but the crate's calls.
            let (queries, switches) = unsafe {
                e.context().bound_unchecked(|| {
                    let before = (double.thread_context_queries(), double.thread_context_switches());
                    for _ in 0..100 {
                        step();
                    }
                    (double.thread_context_queries() - before.0, double.thread_context_switches() - before.1)
                })
            }
            .unwrap();
            let (queries, switches) = (queries as f64 / 100.0, switches as f64 / 100.0);
            common::say(&format!(
                "context calls per tx+rx step in an unchecked binding ({label}): {queries} cuCtxGetCurrent, {switches} cuCtxSetCurrent"
            ));
            let peer = devices[0] != devices[1];
            assert_eq!(queries, if peer { 2.0 } else { 0.0 }, "{label}");
            assert_eq!(switches, if peer { 4.0 } else { 0.0 }, "{label}");
            rt.synchronize().unwrap();
        }

        let (e0, e1) = (Engine::new(0).unwrap(), Engine::new(1).unwrap());
        let mut a = e0.htod(&[2u32; 64]).unwrap();
        e0.fill_u32(&mut a, 4).unwrap(); // warm-up: the helper kernels' module
        // SAFETY: null unbinds.
        unsafe { ppnrt::result::context::set_current(std::ptr::null_mut()) }.unwrap();
        let current = || ppnrt::result::context::get_current().unwrap();
        // SAFETY: nothing in the closure changes the current context but the crate's calls.
        unsafe {
            e0.context().bound_unchecked(|| {
                assert_eq!(current(), e0.context().raw());
                let other = e1.context().bind().unwrap();
                assert_eq!(current(), e1.context().raw());
                // The scope is suspended: this call binds e0's context (else the double refuses
                // the launch on e0's stream) and puts e1's back.
                e0.fill_u32(&mut a, 5).unwrap();
                assert_eq!(current(), e1.context().raw(), "the call put back the binding it found");
                drop(other);
                assert_eq!(current(), e0.context().raw());
                // The scope holds again: no query.
                let queries = double.thread_context_queries();
                e0.fill_u32(&mut a, 6).unwrap();
                assert_eq!(double.thread_context_queries(), queries, "a call inside the scope queried the driver");
            })
        }
        .unwrap();
        assert!(current().is_null(), "the scope put back what was current before");
        assert_eq!(e0.dtoh(&a).unwrap(), vec![6u32; 64]);
        let unwound = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            // SAFETY: as above.
            unsafe { e1.context().bound_unchecked(|| panic!("inside the scope")) }
        }));
        assert!(unwound.is_err());
        assert!(current().is_null(), "an unwinding scope put back what was current before");
    });
}

/// A scope suspended by one binding stays suspended while a later binding switches away from its
/// context again: inside `bound_unchecked(e0)`, bind e1, bind e0, make a call on e1 (it binds e1
/// and puts e0 back), undo the e0 binding (e1 is current again), then a call on e0 must bind e0.
#[test]
fn a_scope_stays_suspended_after_a_nested_binding_of_its_context_is_undone() {
    with_double("a_scope_stays_suspended_after_a_nested_binding_of_its_context_is_undone", |_double| {
        let (e0, e1) = (Engine::new(0).unwrap(), Engine::new(1).unwrap());
        let (mut a, mut b) = (e0.htod(&[1u32; 64]).unwrap(), e1.htod(&[1u32; 64]).unwrap());
        // SAFETY: null unbinds.
        unsafe { ppnrt::result::context::set_current(std::ptr::null_mut()) }.unwrap();
        let current = || ppnrt::result::context::get_current().unwrap();
        // SAFETY: nothing in the closure changes the current context but the crate's calls.
        unsafe {
            e0.context().bound_unchecked(|| {
                let to_e1 = e1.context().bind().unwrap();
                let back_to_e0 = e0.context().bind().unwrap();
                e1.fill_u32(&mut b, 2).unwrap();
                assert_eq!(current(), e0.context().raw(), "the call on e1 put e0 back");
                drop(back_to_e0);
                assert_eq!(current(), e1.context().raw());
                // e1 is current: this call must bind e0 (the double refuses a launch on e0's
                // stream in e1's context) and put e1 back.
                e0.fill_u32(&mut a, 3).unwrap();
                assert_eq!(current(), e1.context().raw(), "the call on e0 put e1 back");
                drop(to_e1);
                assert_eq!(current(), e0.context().raw());
            })
        }
        .unwrap();
        assert!(current().is_null());
        assert_eq!((e0.dtoh(&a).unwrap(), e1.dtoh(&b).unwrap()), (vec![3u32; 64], vec![2u32; 64]));
    });
}

/// A context handle with its lowest bit set (the bit a suspended call scope is marked with) is
/// refused by `Context::primary` with a typed error naming it, and the reference taken is given
/// back; the next retain of that device's context works.
#[test]
fn a_context_handle_with_its_lowest_bit_set_is_refused_and_given_back() {
    with_double("a_context_handle_with_its_lowest_bit_set_is_refused_and_given_back", |double| {
        let device = ppnrt::Device::get(1).unwrap();
        let held = ppnrt::Context::primary(&device).unwrap(); // the context stays alive meanwhile
        let releases = double.calls("cuDevicePrimaryCtxRelease_v2");
        double.odd_context_next();
        match ppnrt::Context::primary(&device) {
            Err(CudaError::Misaligned { address, align: 2, .. }) => {
                assert_eq!(address, held.raw().addr() as u64 + 1, "the error names the handle");
            }
            other => panic!("an odd context handle: expected a Misaligned error, got {other:?}"),
        }
        assert_eq!(double.calls("cuDevicePrimaryCtxRelease_v2"), releases + 1, "the reference was given back");
        let again = ppnrt::Context::primary(&device).unwrap();
        assert_eq!(again.raw(), held.raw());
    });
}

/// Nested bindings, unchecked scopes and calls on either device's stream, in any order: every
/// call succeeds (the double refuses stream work of a context that is not current), leaves the
/// current context as it found it, and makes no context query when it is for the innermost
/// unchecked scope's context and no binding opened inside that scope is live.
pub(crate) mod bindings {
    use super::*;
    use proptest::prelude::*;

    /// One step of a thread's life with contexts.
    #[derive(Clone, Debug)]
    pub(crate) enum Step {
        /// An engine call on device `0`'s or `1`'s stream (a launch and a copy).
        Call(usize),
        /// `Context::bind` of a device's context around the inner steps.
        Bind(usize, Vec<Step>),
        /// `Context::bound_unchecked` of a device's context around the inner steps.
        Unchecked(usize, Vec<Step>),
        /// `cuCtxSetCurrent` of a device's context (or none) by another library: only outside
        /// every unchecked scope (inside one it breaks the scope's contract).
        Foreign(Option<usize>),
        /// A launch on device `0`'s or `1`'s stream whose kernel parameter's code (the caller's,
        /// run by the crate mid-launch) makes another device's context (or none) current: the
        /// launch binds its own again and puts back what it found, inside a scope or not.
        SwitchingLaunch(usize, Option<usize>),
    }

    /// A kernel parameter whose code makes `to` current (null unbinds).
    struct Switching {
        ns: u64,
        to: ppnrt::sys::CUcontext,
    }

    impl ppnrt::KernelParam for Switching {
        type Raw = u64;
        fn raw_param(&self) -> u64 {
            // SAFETY: a live primary context of the double (its engine outlives the launch), or
            // null.
            unsafe { ppnrt::result::context::set_current(self.to) }.unwrap();
            self.ns
        }
    }

    fn steps() -> impl Strategy<Value = Vec<Step>> {
        let leaf = prop_oneof![
            (0usize..2).prop_map(Step::Call),
            proptest::option::of(0usize..2).prop_map(Step::Foreign),
            ((0usize..2), proptest::option::of(0usize..2)).prop_map(|(d, to)| Step::SwitchingLaunch(d, to)),
        ];
        let step = leaf.prop_recursive(4, 48, 5, |inner| {
            prop_oneof![
                (0usize..2).prop_map(Step::Call),
                ((0usize..2), proptest::collection::vec(inner.clone(), 0..5)).prop_map(|(d, v)| Step::Bind(d, v)),
                ((0usize..2), proptest::collection::vec(inner, 0..5)).prop_map(|(d, v)| Step::Unchecked(d, v)),
            ]
        });
        proptest::collection::vec(step, 1..8)
    }

    /// Where a thread stands: the engines, their buffers, and what the model expects.
    struct Thread<'a> {
        double: &'a crate::double::Double,
        engines: &'a [Engine; 2],
        /// `ppnrt_spin_ns` of each device.
        spin: [ppnrt::Function; 2],
        buffers: Vec<CudaSlice<u32>>,
        calls: u32,
    }

    impl Thread<'_> {
        fn raw(&self, device: Option<usize>) -> ppnrt::sys::CUcontext {
            device.map_or(std::ptr::null_mut(), |d| self.engines[d].context().raw())
        }

        /// Runs `steps` with `current` current; `scope` is the innermost unchecked scope's device.
        /// The scope holds (its calls make no context query) exactly while its device is current.
        fn run(&mut self, steps: &[Step], current: &mut Option<usize>, scope: Option<usize>, in_scope: bool) {
            for step in steps {
                match step {
                    Step::Call(d) => {
                        self.calls += 1;
                        let value = self.calls;
                        let queries = self.double.thread_context_queries();
                        self.engines[*d].fill_u32(&mut self.buffers[*d], value).unwrap();
                        let mut copy = self.engines[*d].alloc::<u32>(64).unwrap();
                        self.engines[*d].default_stream().memcpy_dtod(&self.buffers[*d], &mut copy).unwrap();
                        let queried = self.double.thread_context_queries() - queries;
                        if scope == Some(*d) && *current == Some(*d) {
                            assert_eq!(queried, 0, "a call in its unchecked scope, its device current, queried");
                        } else {
                            assert!(queried > 0, "a call outside a holding scope of its device made no query");
                        }
                        assert_eq!(self.engines[*d].dtoh(&copy).unwrap(), vec![value; 64]);
                        assert_eq!(
                            ppnrt::result::context::get_current().unwrap(),
                            self.raw(*current),
                            "the call changed the context"
                        );
                    }
                    Step::Bind(d, inner) => {
                        let guard = self.engines[*d].context().bind().unwrap();
                        let mut now = Some(*d);
                        let switched = *current != Some(*d);
                        self.run(inner, &mut now, scope, in_scope);
                        drop(guard);
                        // A binding that switched puts back what was current before it; one that
                        // found its context current changes nothing, also not what another
                        // library made current inside it.
                        if !switched {
                            *current = now;
                        }
                        assert_eq!(
                            ppnrt::result::context::get_current().unwrap(),
                            self.raw(*current),
                            "a binding's drop"
                        );
                    }
                    Step::Unchecked(d, inner) => {
                        let mut now = Some(*d);
                        // SAFETY: the steps inside change the context only through the crate
                        // (`Foreign` steps run only outside every unchecked scope).
                        unsafe {
                            self.engines[*d].context().bound_unchecked(|| self.run(inner, &mut now, Some(*d), true))
                        }
                        .unwrap();
                        assert_eq!(ppnrt::result::context::get_current().unwrap(), self.raw(*current), "a scope's end");
                    }
                    Step::SwitchingLaunch(d, to) => {
                        let switching = Switching { ns: 10, to: self.raw(*to) };
                        let stream = self.engines[*d].default_stream();
                        // SAFETY: ppnrt_spin_ns(uint64_t) touches no memory; one u64 parameter is
                        // passed; the parameter's code ends no capture.
                        unsafe { stream.launch(&self.spin[*d], ppnrt::LaunchConfig::for_elements(1, 1), (switching,)) }
                            .unwrap();
                        assert_eq!(
                            ppnrt::result::context::get_current().unwrap(),
                            self.raw(*current),
                            "a launch whose parameter switched contexts left another current"
                        );
                    }
                    Step::Foreign(d) => {
                        if !in_scope {
                            // SAFETY: a live primary context of the double, or null.
                            unsafe { ppnrt::result::context::set_current(self.raw(*d)) }.unwrap();
                            *current = *d;
                        }
                    }
                }
            }
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: crate::PROPTEST_CASES, ..ProptestConfig::default() })]

        #[test]
        fn any_nesting_of_bindings_and_unchecked_scopes_keeps_every_call_in_its_context(steps in steps()) {
            with_double("any_nesting_of_bindings_and_unchecked_scopes_keeps_every_call_in_its_context", |double| {
                let engines = [Engine::new(0).unwrap(), Engine::new(1).unwrap()];
                let buffers = engines.iter().map(|e| e.alloc_zeroed::<u32>(64).unwrap()).collect();
                let spin = engines.each_ref().map(|e| {
                    e.load_ptx("testing", ppnrt::kernels::TESTING_PTX).unwrap().function("ppnrt_spin_ns").unwrap()
                });
                // SAFETY: null unbinds.
                unsafe { ppnrt::result::context::set_current(std::ptr::null_mut()) }.unwrap();
                let mut thread = Thread { double, engines: &engines, spin, buffers, calls: 0 };
                let mut current = None;
                thread.run(&steps, &mut current, None, false);
                assert_eq!(ppnrt::result::context::get_current().unwrap(), thread.raw(current));
                // SAFETY: null unbinds.
                unsafe { ppnrt::result::context::set_current(std::ptr::null_mut()) }.unwrap();
            });
        }
    }
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
