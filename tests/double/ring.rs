//! The slot ring's rules on every eager path, through the CUDA driver double
//! (`tests/driver_double/cuda_double.c`): a boundary call on a stage stream that is being
//! captured is refused and changes nothing; an in-place guard held across the slot's next write,
//! or forgotten, never stops the boundary, and its view keeps reading its own step; a readback of
//! a buffer that a graph holds is given, and the buffer stays usable.
//!
//! The double runs queued work only when something synchronises, and then only what that needs:
//! a missing wait shows up as a wrong value or a counted access to freed memory.

use crate::{double, ranks};

use std::time::Duration;

use double::with_double;
use ppnrt::{CaptureError, CaptureMode, CudaError, CudaSlice, Engine, Error, PpConfig, PpError, PpNRt, SlotState};

const N: usize = 2048;

/// The values `fill_pattern(seed)` writes into `n` elements.
fn pattern(seed: u32, n: usize) -> Vec<u32> {
    (0..n as u64).map(|i| ppnrt::kernels::pattern(seed, i)).collect()
}

/// Stage 0's input of step `seed`: `N` pattern values on its stream.
fn input(rt: &PpNRt, primary: &Engine, seed: u32) -> CudaSlice<u32> {
    let _stage = rt.enter(0).unwrap();
    let engine = rt.engine(0, primary).unwrap();
    let mut x = engine.alloc::<u32>(N).unwrap();
    engine.fill_pattern(&mut x, seed).unwrap();
    x
}

/// A graph step's buffers, allocated before its capture: stage 0's persistent source, filled
/// with `seed`'s pattern, and stage 1's persistent output.
fn copy_step_buffers(rt: &PpNRt, primary: &Engine, seed: u32) -> (CudaSlice<u32>, CudaSlice<u32>) {
    let source = {
        let _stage = rt.enter(0).unwrap();
        let e0 = rt.engine(0, primary).unwrap();
        let mut source = e0.alloc_persistent::<u32>(N).unwrap();
        e0.fill_pattern(&mut source, seed).unwrap();
        source
    };
    let _stage = rt.enter(1).unwrap();
    (source, rt.engine(1, primary).unwrap().alloc_persistent::<u32>(N).unwrap())
}

fn is_illegal_in_capture(e: &Error) -> bool {
    matches!(e, Error::Cuda(CudaError::Capture(CaptureError::IllegalCall { .. })))
}

/// An eager `tx` (or `tx_wait`) on a stage stream that the caller is capturing would record its
/// copy into the caller's graph while the slot said filled now: it is refused, the capture is
/// invalidated, and the slot stays as it was.
#[test]
fn an_eager_tx_on_a_capturing_stage_stream_is_refused_and_changes_nothing() {
    with_double("an_eager_tx_on_a_capturing_stage_stream_is_refused_and_changes_nothing", |_| {
        let primary = Engine::new(0).unwrap();
        for devices in [[0, 0], [0, 1]] {
            let rt = PpNRt::new(PpConfig::with_devices(&devices).with_slots(1), &primary).unwrap();
            let x = input(&rt, &primary, 1);
            let capture = rt.stage_stream(0).unwrap().begin_capture(CaptureMode::Relaxed).unwrap();
            let refused = rt.tx(0, &x, N).unwrap_err();
            assert!(is_illegal_in_capture(&refused), "{devices:?}: {refused}");
            let refused = rt.tx_wait(0, &x, N, Duration::from_millis(50)).unwrap_err();
            assert!(is_illegal_in_capture(&refused), "{devices:?}: {refused}");
            assert!(capture.end().is_err(), "{devices:?}: the capture that met the refused call is invalidated");
            // Nothing was filled.
            let nothing = rt.rx::<u32>(0, 0, N).unwrap_err();
            assert!(
                matches!(nothing, Error::Pipeline(PpError::SlotState { found: SlotState::NeverFilled, .. })),
                "{devices:?}: {nothing}"
            );
            // The boundary works on.
            let x = input(&rt, &primary, 2);
            let slot = rt.tx(0, &x, N).unwrap();
            let _stage = rt.enter(1).unwrap();
            let y = rt.rx::<u32>(0, slot, N).unwrap();
            assert_eq!(rt.engine(1, &primary).unwrap().dtoh(&y).unwrap(), pattern(2, N), "{devices:?}");
        }
    });
}

/// An eager `rx`, `rx_wait` or `rx_in_place` on a stage stream that the caller is capturing
/// would read the slot whenever the graph is launched while the slot said received now: each is
/// refused, the capture invalidated, and the slot still holds its step for the next receive.
#[test]
fn an_eager_receive_on_a_capturing_stage_stream_is_refused_and_changes_nothing() {
    with_double("an_eager_receive_on_a_capturing_stage_stream_is_refused_and_changes_nothing", |_| {
        let primary = Engine::new(0).unwrap();
        for devices in [[0, 0], [0, 1]] {
            let rt = PpNRt::new(PpConfig::with_devices(&devices).with_slots(1), &primary).unwrap();
            let slot = rt.tx(0, &input(&rt, &primary, 3), N).unwrap();
            let capture = rt.stage_stream(1).unwrap().begin_capture(CaptureMode::Relaxed).unwrap();
            let refused = rt.rx::<u32>(0, slot, N).unwrap_err();
            assert!(is_illegal_in_capture(&refused), "{devices:?} rx: {refused}");
            let refused = rt.rx_wait::<u32>(0, slot, N, Duration::from_millis(50)).unwrap_err();
            assert!(is_illegal_in_capture(&refused), "{devices:?} rx_wait: {refused}");
            let refused = rt.rx_in_place::<u32>(0, slot, N).unwrap_err();
            assert!(is_illegal_in_capture(&refused), "{devices:?} rx_in_place: {refused}");
            assert!(capture.end().is_err(), "{devices:?}: the capture that met the refused call is invalidated");
            let received = rt.rx_in_place::<u32>(0, slot, N).unwrap();
            let values = rt.engine(1, &primary).unwrap().dtoh(&received.view().unwrap()).unwrap();
            assert_eq!(values, pattern(3, N), "{devices:?}: the step is still there");
        }
    });
}

/// A guard of a slot received in place that is forgotten (`mem::forget`) keeps its buffer, and the
/// boundary goes on: `tx`, `tx_wait`, `discard_unreceived` and `capture_step` take the slot, each
/// step arrives whole.
#[test]
fn a_forgotten_in_place_guard_does_not_stop_the_boundary() {
    with_double("a_forgotten_in_place_guard_does_not_stop_the_boundary", |_| {
        let primary = Engine::new(0).unwrap();
        for devices in [[0, 0], [0, 1]] {
            let rt = PpNRt::new(PpConfig::with_devices(&devices).with_slots(2), &primary).unwrap();
            let e1 = rt.engine(1, &primary).unwrap().clone();
            for slot in 0..2 {
                assert_eq!(rt.tx(0, &input(&rt, &primary, 10 + slot as u32), N).unwrap(), slot);
                std::mem::forget(rt.rx_in_place::<u32>(0, slot, N).unwrap());
            }
            for step in 0..6u32 {
                let x = input(&rt, &primary, 20 + step);
                let slot = if step % 2 == 0 {
                    rt.tx(0, &x, N).unwrap()
                } else {
                    rt.tx_wait(0, &x, N, Duration::from_millis(200)).unwrap()
                };
                let _stage = rt.enter(1).unwrap();
                let y = rt.rx::<u32>(0, slot, N).unwrap();
                assert_eq!(e1.dtoh(&y).unwrap(), pattern(20 + step, N), "{devices:?} step {step}");
            }
            // Forgotten again, then discarded over, then captured over.
            let slot = rt.tx(0, &input(&rt, &primary, 30), N).unwrap();
            std::mem::forget(rt.rx_in_place::<u32>(0, slot, N).unwrap());
            rt.tx(0, &input(&rt, &primary, 31), N).unwrap();
            assert_eq!(rt.discard_unreceived(0).unwrap(), 1);
            let slot = rt.tx(0, &input(&rt, &primary, 32), N).unwrap();
            std::mem::forget(rt.rx_in_place::<u32>(0, slot, N).unwrap());
            let (source, mut output) = copy_step_buffers(&rt, &primary, 33);
            let mut step =
                rt.capture_step::<u32>(N, |stage| {
                    if stage.stage() == 0 { stage.tx(&source) } else { stage.rx_into(&mut output) }
                })
                .unwrap();
            step.launch().unwrap();
            drop(step);
            assert_eq!(e1.dtoh(&output).unwrap(), pattern(33, N), "{devices:?} graph step");
        }
    });
}

/// A guard held across its slot's next write: the write gives the slot another buffer, the
/// guard's view still reads its own step (the double runs the sender's stream first: were the
/// write made into the lent buffer, the view would read the new step), and the next step is
/// received whole. Held so step after step, the two buffers take turns: nothing is allocated
/// after the first turn.
#[test]
fn a_guard_held_across_the_next_write_reads_its_own_step() {
    with_double("a_guard_held_across_the_next_write_reads_its_own_step", |double| {
        let primary = Engine::new(0).unwrap();
        for devices in [[0, 0], [0, 1]] {
            let rt = PpNRt::new(PpConfig::with_devices(&devices).with_slots(1), &primary).unwrap();
            let e1 = rt.engine(1, &primary).unwrap().clone();
            let mut slot = rt.tx(0, &input(&rt, &primary, 1), N).unwrap();
            let mut allocated_after_first_turn = None;
            for step in 1..12u32 {
                let guard = rt.rx_in_place::<u32>(0, slot, N).unwrap();
                let next = input(&rt, &primary, step + 1);
                slot = rt.tx(0, &next, N).unwrap();
                drop(next);
                rt.stage_stream(0).unwrap().synchronize().unwrap(); // the sender's stream runs first
                let seen = e1.dtoh(&guard.view().unwrap()).unwrap();
                assert_eq!(seen, pattern(step, N), "{devices:?}: the guard of step {step} reads its own step");
                drop(guard);
                rt.synchronize().unwrap();
                // Slot buffers are `cuMemAlloc` memory (the steps' inputs come from the pool).
                let slot_allocations = double.calls("cuMemAlloc_v2");
                match (step, allocated_after_first_turn) {
                    (1, _) => {}
                    (2, _) => allocated_after_first_turn = Some(slot_allocations),
                    (_, Some(first)) => {
                        assert_eq!(slot_allocations, first, "{devices:?} step {step}: a slot buffer was allocated")
                    }
                    (_, None) => unreachable!(),
                }
            }
            let last = rt.rx::<u32>(0, slot, N).unwrap();
            assert_eq!(e1.dtoh(&last).unwrap(), pattern(12, N), "{devices:?}");
        }
    });
}

/// The last stage's output of captured step graphs is read back every step: by `readback_of`,
/// which leaves the buffer to the caller (each step's values arrive although the next launch
/// writes the buffer again: the launch waits for the copy), and by `readback`, which takes a
/// buffer the graphs hold without failing or losing it (the graphs go on writing it).
#[test]
fn a_graph_steps_output_is_read_back_every_step() {
    with_double("a_graph_steps_output_is_read_back_every_step", |_| {
        let primary = Engine::new(0).unwrap();
        for devices in [[0, 0], [0, 1]] {
            let rt = PpNRt::new(PpConfig::with_devices(&devices).with_slots(2), &primary).unwrap();
            let e0 = rt.engine(0, &primary).unwrap().clone();
            let (mut source, mut output) = copy_step_buffers(&rt, &primary, 40);
            let mut step =
                rt.capture_step::<u32>(N, |stage| {
                    if stage.stage() == 0 { stage.tx(&source) } else { stage.rx_into(&mut output) }
                })
                .unwrap();
            let mut pending = Vec::new();
            for k in 0..4u32 {
                {
                    let _stage = rt.enter(0).unwrap();
                    e0.fill_pattern(&mut source, 40 + k).unwrap();
                }
                step.launch().unwrap();
                pending.push(rt.readback_of(&output).unwrap());
            }
            for (k, pending) in pending.iter().enumerate() {
                assert_eq!(pending.wait().unwrap(), pattern(40 + k as u32, N), "{devices:?} step {k}");
            }
            let taken = rt.readback(output).unwrap();
            assert_eq!(taken.wait().unwrap(), pattern(43, N), "{devices:?}: readback of a buffer a graph holds");
            {
                let _stage = rt.enter(0).unwrap();
                e0.fill_pattern(&mut source, 50).unwrap();
            }
            step.launch().unwrap();
            rt.synchronize().unwrap();
            assert_eq!(taken.wait().unwrap(), pattern(43, N), "{devices:?}: the values read back stay");
        }
    });
}

/// A receive from another rank that waits for its step holds nothing a capture needs: a capture
/// of the step's graphs on the receiving rank, begun meanwhile, ends at once (it used to wait
/// until the receive timed out), and the receive then gets its step whole.
#[test]
fn a_receive_waiting_for_another_rank_does_not_hold_up_a_capture() {
    with_double("a_receive_waiting_for_another_rank_does_not_hold_up_a_capture", |_| {
        let wait = Duration::from_secs(4);
        let ranks = ranks::two_ranks(Duration::from_secs(10));
        let e1 = ranks.1.engine(1, &Engine::new(0).unwrap()).unwrap().clone();
        let mut output = {
            let _stage = ranks.1.enter(1).unwrap();
            e1.alloc_persistent::<u32>(N).unwrap()
        };
        std::thread::scope(|scope| {
            let receiving = scope.spawn(|| {
                let _stage = ranks.1.enter(1).unwrap();
                let y = ranks.1.rx_wait::<u32>(0, 0, N, wait)?;
                Ok::<_, Error>(e1.dtoh(&y)?)
            });
            std::thread::sleep(Duration::from_millis(300)); // the receive is waiting
            let start = std::time::Instant::now();
            let step = ranks.1.capture_step::<u32>(N, |stage| stage.rx_into(&mut output)).unwrap();
            let took = start.elapsed();
            drop(step);
            assert!(took < Duration::from_secs(2), "the capture waited {took:?} for the receive");
            let primary = Engine::new(0).unwrap();
            let x = input(&ranks.0, &primary, 7);
            ranks.0.enter(0).and_then(|_stage| ranks.0.tx(0, &x, N)).unwrap();
            assert_eq!(receiving.join().unwrap().unwrap(), pattern(7, N));
        });
    });
}

/// A one-byte element that calls itself `f32`, as a peer process of another build whose `f32`
/// had another size would send it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
#[repr(transparent)]
struct ShortF32(u8);

// SAFETY: one byte, every bit pattern valid, no padding or pointers. Its name is the wrong one on
// purpose: it stands for a peer whose type of that name has another size.
unsafe impl ppnrt::DeviceRepr for ShortF32 {
    const NAME: &'static str = "f32";
}

/// A step from another rank whose element count and type name match the receiver's but whose
/// bytes do not (the sender's `f32` is one byte): `rx` and `rx_in_place` refuse it with
/// `RxSizeMismatch`, nothing is received, and the step is still there for a receive of the
/// sender's own type.
#[test]
fn a_step_of_another_element_size_is_refused_and_kept() {
    with_double("a_step_of_another_element_size_is_refused_and_kept", |_| {
        let ranks = ranks::two_ranks(Duration::from_secs(10));
        let primary = Engine::new(0).unwrap();
        let e1 = ranks.1.engine(1, &primary).unwrap().clone();
        let sent: Vec<ShortF32> = (0..N as u32).map(|i| ShortF32((i * 7) as u8)).collect();
        let x = {
            let _stage = ranks.0.enter(0).unwrap();
            ranks.0.engine(0, &primary).unwrap().htod(&sent).unwrap()
        };
        ranks.0.enter(0).and_then(|_stage| ranks.0.tx(0, &x, N)).unwrap();
        let wait = Duration::from_secs(5);
        let refused = ranks.1.rx_wait::<f32>(0, 0, N, wait).unwrap_err();
        let expected =
            PpError::RxSizeMismatch { boundary: 0, slot: 0, elem: "f32", n: N, requested_size: 4, sent_bytes: N };
        assert_eq!(refused, Error::Pipeline(expected.clone()), "{refused}");
        let refused = ranks.1.rx_in_place::<f32>(0, 0, N).unwrap_err();
        assert_eq!(refused, Error::Pipeline(expected), "{refused}");
        let _stage = ranks.1.enter(1).unwrap();
        let received = ranks.1.rx::<ShortF32>(0, 0, N).unwrap();
        assert_eq!(e1.dtoh(&received).unwrap(), sent);
    });
}

/// A peer that announces a step and never sends its data, then closes its end (it died between
/// the record and the send): the receiving rank's receive of that step would wait for ever (an
/// NCCL receive waits on a peer that died until its own communicator is aborted; the NCCL double
/// does the same with `PPNRT_NCCL_DOUBLE_ORPHAN_RECV`). The receiving rank fails the boundary
/// within the peer timeout of the close, does not confirm the close (the sending rank's drop
/// records the boundary as failed: a step may be lost), and both ranks' drops return: no thread of
/// the runtime waits without a bound. (The receiver thread used to wait for the receive in a
/// stream synchronisation, and the runtime's drop for that thread, for ever; and the receiving
/// rank used to confirm the close whether or not its receives completed.) The same when the
/// receiving rank goes first, its stage's stream waiting for the receive, while the sending rank
/// lives on: its drop fails the boundary within the peer timeout instead of waiting for ever on
/// the stream.
#[test]
fn a_step_announced_and_never_sent_fails_the_boundary_in_bounded_time() {
    with_double("a_step_announced_and_never_sent_fails_the_boundary_in_bounded_time", |_| {
        // SAFETY: tests through the double run one at a time (`with_double` holds its lock), and
        // nothing else of this process reads the environment while this test sets it.
        unsafe { std::env::set_var("PPNRT_NCCL_DOUBLE_ORPHAN_RECV", "1") };
        let timeout = Duration::from_millis(800);
        let mut outcomes = Vec::new();
        for receiver_goes_first in [false, true] {
            let ranks = ranks::two_ranks_configured(timeout, |rank, config| {
                let config = config.with_process_transport(ppnrt::ProcessTransport::Nccl);
                if rank == 0 { config.with_fault(ppnrt::pp::ProtocolFault::AnnounceWithoutSend) } else { config }
            });
            let primary = Engine::new(0).unwrap();
            let x = input(&ranks.0, &primary, 5);
            ranks.0.enter(0).and_then(|_stage| ranks.0.tx(0, &x, N)).unwrap(); // announced, never sent
            drop(x);
            if receiver_goes_first {
                // The stage takes the step: its stream waits for the receive.
                let received = ranks.1.enter(1).and_then(|_stage| ranks.1.rx_wait::<u32>(0, 0, N, timeout)).unwrap();
                drop(received);
            } else {
                std::thread::sleep(Duration::from_millis(100)); // the receiver posts the receive
            }
            let (done, dropped) = std::sync::mpsc::channel();
            let start = std::time::Instant::now();
            std::thread::spawn(move || {
                let (zero, one) = ranks;
                let (first, second) = if receiver_goes_first { (one, zero) } else { (zero, one) };
                // Rank 0 first: its close waits for rank 1's answer, at most the peer timeout.
                drop(first);
                let first_errors = ppnrt::take_drop_errors();
                drop(second);
                let _ = done.send((first_errors, ppnrt::take_drop_errors()));
            });
            let errors = dropped.recv_timeout(Duration::from_secs(10));
            outcomes.push((receiver_goes_first, errors, start.elapsed()));
        }
        // SAFETY: as above.
        unsafe { std::env::remove_var("PPNRT_NCCL_DOUBLE_ORPHAN_RECV") };
        for (receiver_goes_first, errors, took) in outcomes {
            let first = if receiver_goes_first { "the receiving rank" } else { "the sending rank" };
            let (first_errors, second_errors) =
                errors.unwrap_or_else(|_| panic!("{first} dropped first: the drops did not return within 10 s"));
            assert!(took < 4 * timeout, "{first} dropped first: the drops took {took:?}");
            let failed = |errors: &[ppnrt::DropError]| {
                errors.iter().any(|e| matches!(e.downcast_ref(), Some(Error::Pipeline(PpError::PeerFailed { .. }))))
            };
            assert!(
                failed(&first_errors) && failed(&second_errors),
                "{first} dropped first: each rank records the lost step as a failed boundary: \
                 {first_errors:?} then {second_errors:?}"
            );
        }
    });
}

/// End-to-end validity across ranks: rank 0 announces a step and dies before its send ran; rank 1
/// had taken the step (its `rx` returns at once: the data's arrival is ordered on the GPU) and
/// forwarded it to rank 2 over a healthy link; rank 2 reads it back. When rank 1's boundary from
/// rank 0 fails (its receive cut short by the abort), rank 1 fails its other boundaries first, so
/// rank 2's receive never gets the cut-short data, its boundary fails and its readback is refused
/// with `PeerFailed` (every rank ends with a typed error, none with wrong data as `Ok`). With the
/// failure kept to the one link ([`ProtocolFault::ContainedFailure`], the rule broken on purpose),
/// rank 2's readback returns the cut-short slot's stale bytes as `Ok` over NCCL: the test shows
/// what it guards against (over IPC rank 1's receive waits on the host for the copy, so nothing is
/// forwarded and rank 2's receive times out). Run a third time as a loaded machine may run it: rank 1's abort of its link to
/// rank 2 takes effect 60 ms late (the NCCL double's `PPNRT_NCCL_DOUBLE_SEND_ABORT_DELAY_MS`) and
/// rank 2 takes 400 ms to fail its links ([`ProtocolFault::SlowToFail`]): the send that rank 1's
/// stream runs once its receive is cut short must still find its communicator aborted (rank 1
/// aborts its other links first and waits for them, bounded), else rank 2 receives the cut-short
/// step whole and reads it back as `Ok` before it knows of the failure.
#[test]
fn a_step_cut_short_upstream_is_never_read_back_as_ok_downstream() {
    with_double("a_step_cut_short_upstream_is_never_read_back_as_ok_downstream", |_| {
        // SAFETY: tests through the double run one at a time (`with_double` holds its lock), and
        // nothing else of this process reads the environment while this test sets it.
        unsafe {
            std::env::set_var("PPNRT_NCCL_DOUBLE_ORPHAN_RECV", "1");
            std::env::set_var("PPNRT_NCCL_DOUBLE_ASYNC_SEND", "1");
        }
        let timeout = Duration::from_millis(800);
        let mut outcomes = Vec::new();
        // Over NCCL (the aborts' order) and over IPC (the releases' order), each case in turn.
        let cases = [(false, false), (true, false), (false, true)];
        let transports = [ppnrt::ProcessTransport::Nccl, ppnrt::ProcessTransport::Ipc];
        for (transport, (contained, late)) in transports.into_iter().flat_map(|t| cases.map(|c| (t, c))) {
            // SAFETY: as above.
            unsafe {
                if late {
                    std::env::set_var("PPNRT_NCCL_DOUBLE_SEND_ABORT_DELAY_MS", "60");
                } else {
                    std::env::remove_var("PPNRT_NCCL_DOUBLE_SEND_ABORT_DELAY_MS");
                }
            }
            let ranks = ranks::chain_of_ranks(&[0, 1, 0], timeout, |rank, config| {
                let config = config.with_process_transport(transport);
                match rank {
                    0 => config.with_fault(ppnrt::pp::ProtocolFault::AnnounceWithoutSend),
                    1 if contained => config.with_fault(ppnrt::pp::ProtocolFault::ContainedFailure),
                    2 if late => config.with_fault(ppnrt::pp::ProtocolFault::SlowToFail(400)),
                    _ => config,
                }
            });
            let primary = Engine::new(0).unwrap();
            let x = input(&ranks[0], &primary, 11);
            ranks[0].enter(0).and_then(|_stage| ranks[0].tx(0, &x, N)).unwrap(); // announced, never sent
            drop(x);
            let wait = Duration::from_secs(5);
            let mut ranks = ranks.into_iter().map(std::sync::Arc::new);
            let (zero, one, two) = (ranks.next().unwrap(), ranks.next().unwrap(), ranks.next().unwrap());
            // Rank 1 takes the step and forwards it.
            let forward = {
                let one = std::sync::Arc::clone(&one);
                std::thread::spawn(move || {
                    let _stage = one.enter(1)?;
                    let received = one.rx_wait::<u32>(0, 0, N, wait)?;
                    one.tx(1, &received, N).map(|_| ())
                })
            };
            // Rank 2 takes the step and reads it back. Over NCCL the receive returns once posted:
            // the readback is queued before rank 0 goes, as an engine that ran ahead would have
            // it. Over IPC the receive returns once the copy is in, so it waits on a thread.
            let (read, readback) = std::sync::mpsc::channel();
            if transport == ppnrt::ProcessTransport::Nccl {
                let pending = {
                    let _stage = two.enter(2).unwrap();
                    let received = two.rx_wait::<u32>(1, 0, N, wait).unwrap();
                    two.readback(received).unwrap()
                };
                std::thread::spawn(move || {
                    let _ = read.send(pending.wait().map(<[u32]>::to_vec));
                });
            } else {
                let two = std::sync::Arc::clone(&two);
                std::thread::spawn(move || {
                    let values = two.enter(2).and_then(|_stage| {
                        let received = two.rx_wait::<u32>(1, 0, N, wait)?;
                        two.readback(received)?.wait().map(<[u32]>::to_vec)
                    });
                    let _ = read.send(values);
                });
            }
            // Rank 0 goes: rank 1 fails its boundary from it within the peer timeout.
            let (done, dropped) = std::sync::mpsc::channel();
            std::thread::spawn(move || {
                drop(zero);
                let _ = done.send(());
            });
            let outcome = readback.recv_timeout(Duration::from_secs(10)).expect("rank 2's readback returned");
            dropped.recv_timeout(Duration::from_secs(10)).expect("rank 0's drop returned");
            let forwarded = forward.join().unwrap();
            assert!(forwarded.is_ok() || forwarded.as_ref().is_err_and(is_peer_failed), "{forwarded:?}");
            let (done, dropped) = std::sync::mpsc::channel();
            std::thread::spawn(move || {
                drop((one, two));
                let _ = done.send(ppnrt::take_drop_errors());
            });
            dropped.recv_timeout(Duration::from_secs(10)).expect("the other ranks' drops returned");
            outcomes.push(outcome);
        }
        // SAFETY: as above.
        unsafe {
            std::env::remove_var("PPNRT_NCCL_DOUBLE_ORPHAN_RECV");
            std::env::remove_var("PPNRT_NCCL_DOUBLE_ASYNC_SEND");
            std::env::remove_var("PPNRT_NCCL_DOUBLE_SEND_ABORT_DELAY_MS");
        }
        for (transport, outcomes) in transports.iter().zip(outcomes.chunks(cases.len())) {
            match &outcomes[0] {
                Err(e) if is_peer_failed(e) => {}
                other => panic!("over {transport}: rank 2's readback of a step cut short upstream: {other:?}"),
            }
            match (&outcomes[1], transport) {
                (Ok(values), ppnrt::ProcessTransport::Nccl) => assert_ne!(
                    values,
                    &pattern(11, N),
                    "over {transport}: the step was never sent, yet its values arrived"
                ),
                // Over IPC rank 1's receive waits on the host for the copy, so the step that never
                // came is never forwarded: even with the failure contained, rank 2 receives nothing.
                (
                    Err(Error::Pipeline(PpError::Timeout { found: ppnrt::SlotState::NeverFilled, .. })),
                    ppnrt::ProcessTransport::Ipc,
                ) => {}
                (other, _) => panic!(
                    "over {transport}: with the failure contained, rank 2 was expected to read back stale bytes \
                     (NCCL) or to receive nothing (IPC): {other:?}"
                ),
            }
            match &outcomes[2] {
                Err(e) if is_peer_failed(e) => {}
                Ok(values) => panic!(
                    "over {transport}, aborts late: rank 2 read a step cut short upstream back as Ok ({} values, the first {:?})",
                    values.len(),
                    &values[..values.len().min(4)]
                ),
                other => {
                    panic!("over {transport}, aborts late: rank 2's readback of a step cut short upstream: {other:?}")
                }
            }
        }
    });
}

/// The same guarantee when the failure starts on the boundary a rank sends on: rank 0 announces
/// steps and never sends them; rank 1 took step 0 (over NCCL its `rx` returns once the receive is
/// posted) and forwarded it to rank 2, which queued its readback. Then rank 1's boundary to rank 2
/// fails first, on rank 1's side: its send of step 1 fails (NCCL's call returns an error), or rank
/// 1 goes (its runtime dropped: its close of that boundary cannot be confirmed, as rank 2's receive
/// of step 0 never completes). Failing it fails rank 1's boundary from rank 0 too, whose abort cuts
/// the receive of step 0 short, and rank 1's stream runs on into the send of step 0 queued behind
/// it: that send's communicator must be aborted before (a rank aborts the boundaries it sends on
/// before those it receives on, whichever failed first), else rank 2, slow to learn of the failure
/// ([`ProtocolFault::SlowToFail`](ppnrt::pp::ProtocolFault::SlowToFail), a busy machine), receives
/// the cut-short step whole and reads it back as `Ok`. And rank 1's drop returns within its bound:
/// a receive still pending when the runtime stops fails its boundary (aborted) after the peer
/// timeout instead of holding the drop's stream synchronisation for ever; a receiving rank whose
/// receives did not complete does not confirm the close.
#[test]
fn a_step_cut_short_when_the_sending_boundary_fails_first_is_never_read_back_as_ok() {
    with_double("a_step_cut_short_when_the_sending_boundary_fails_first_is_never_read_back_as_ok", |_| {
        // SAFETY: tests through the double run one at a time (`with_double` holds its lock), and
        // nothing else of this process reads the environment while this test sets it.
        unsafe {
            std::env::set_var("PPNRT_NCCL_DOUBLE_ORPHAN_RECV", "1");
            std::env::set_var("PPNRT_NCCL_DOUBLE_ASYNC_SEND", "1");
        }
        let timeout = Duration::from_millis(800);
        let wait = Duration::from_secs(5);
        let mut outcomes = Vec::new();
        for send_fails in [true, false] {
            let ranks = ranks::chain_of_ranks(&[0, 1, 0], timeout, |rank, config| {
                let config = config.with_process_transport(ppnrt::ProcessTransport::Nccl);
                match rank {
                    0 => config.with_fault(ppnrt::pp::ProtocolFault::AnnounceWithoutSend),
                    2 => config.with_fault(ppnrt::pp::ProtocolFault::SlowToFail(400)),
                    _ => config,
                }
            });
            let primary = Engine::new(0).unwrap();
            for seed in [13, 14] {
                let x = input(&ranks[0], &primary, seed);
                ranks[0].enter(0).and_then(|_stage| ranks[0].tx(0, &x, N)).unwrap(); // announced, never sent
            }
            let mut ranks = ranks.into_iter();
            let (zero, one, two) = (ranks.next().unwrap(), ranks.next().unwrap(), ranks.next().unwrap());
            {
                let _stage = one.enter(1).unwrap();
                let received = one.rx_wait::<u32>(0, 0, N, wait).unwrap();
                one.tx(1, &received, N).unwrap();
            }
            let pending = {
                let _stage = two.enter(2).unwrap();
                let received = two.rx_wait::<u32>(1, 0, N, wait).unwrap();
                two.readback(received).unwrap()
            };
            let (read, readback) = std::sync::mpsc::channel();
            std::thread::spawn(move || {
                let _ = read.send(pending.wait().map(<[u32]>::to_vec));
            });
            if send_fails {
                let _stage = one.enter(1).unwrap();
                let received = one.rx_wait::<u32>(0, 1, N, wait).unwrap();
                double::nccl_double().fail("ncclSend", 1, 3);
                let sent = one.tx(1, &received, N);
                double::nccl_double().clear_faults();
                assert!(sent.as_ref().is_err_and(is_peer_failed), "rank 1's failing send: {sent:?}");
            }
            // Rank 1 goes.
            let (done, dropped) = std::sync::mpsc::channel();
            let started = std::time::Instant::now();
            std::thread::spawn(move || {
                drop(one);
                let _ = done.send(());
            });
            let outcome = readback.recv_timeout(Duration::from_secs(10)).expect("rank 2's readback returned");
            dropped.recv_timeout(Duration::from_secs(10)).expect("rank 1's drop returned within 10 s");
            let took = started.elapsed();
            assert!(took < 5 * timeout, "rank 1's drop took {took:?}");
            let (done, dropped) = std::sync::mpsc::channel();
            std::thread::spawn(move || {
                drop((zero, two));
                let _ = done.send(ppnrt::take_drop_errors());
            });
            dropped.recv_timeout(Duration::from_secs(10)).expect("the other ranks' drops returned");
            outcomes.push((send_fails, outcome));
        }
        // SAFETY: as above.
        unsafe {
            std::env::remove_var("PPNRT_NCCL_DOUBLE_ORPHAN_RECV");
            std::env::remove_var("PPNRT_NCCL_DOUBLE_ASYNC_SEND");
        }
        for (send_fails, outcome) in &outcomes {
            let how = if *send_fails { "its send failing" } else { "its drop" };
            match outcome {
                Err(e) if is_peer_failed(e) => {}
                Ok(values) => panic!(
                    "rank 1's boundary to rank 2 failed first ({how}): rank 2 read a step cut short upstream back \
                     as Ok ({} values, the first {:?})",
                    values.len(),
                    &values[..values.len().min(4)]
                ),
                other => panic!("rank 1's boundary to rank 2 failed first ({how}): rank 2's readback: {other:?}"),
            }
        }
    });
}

fn is_peer_failed(e: &Error) -> bool {
    matches!(e, Error::Pipeline(PpError::PeerFailed { .. }))
}

/// `tx_wait` to another rank honours its timeout: with the receiving rank's ring full (its stage
/// took nothing), the wait ends in `Timeout` naming the step the slot holds, and nothing is sent
/// (the steps that follow arrive in order, none lost or doubled); once the receiving stage takes a
/// step, a waiting `tx_wait` goes on within milliseconds (the receiving rank answers the
/// `WAITING` record at once and again at its stage's take). It used to go straight to NCCL's send
/// whatever its timeout.
#[test]
fn tx_wait_to_another_rank_honours_its_timeout_and_loses_nothing() {
    with_double("tx_wait_to_another_rank_honours_its_timeout_and_loses_nothing", |_| {
        let ranks = ranks::two_ranks(Duration::from_secs(5));
        let primary = Engine::new(0).unwrap();
        let e1 = ranks.1.engine(1, &primary).unwrap().clone();
        let inputs: Vec<CudaSlice<u32>> = (0..4).map(|t| input(&ranks.0, &primary, 100 + t)).collect();
        let send = |t: usize, timeout: Duration| {
            ranks.0.enter(0).and_then(|_stage| ranks.0.tx_wait(0, &inputs[t], N, timeout))
        };
        let receive = |slot: usize| -> Vec<u32> {
            let _stage = ranks.1.enter(1).unwrap();
            let received = ranks.1.rx_wait::<u32>(0, slot, N, Duration::from_secs(5)).unwrap();
            e1.dtoh(&received).unwrap()
        };
        // Two slots: two steps go at once.
        assert_eq!(send(0, Duration::from_secs(5)).unwrap(), 0);
        assert_eq!(send(1, Duration::from_secs(5)).unwrap(), 1);
        // The third finds both slots of rank 1 holding steps its stage has not taken.
        let start = std::time::Instant::now();
        let refused = send(2, Duration::from_millis(300)).unwrap_err();
        let took = start.elapsed();
        assert!(
            matches!(
                &refused,
                Error::Pipeline(PpError::Timeout {
                    boundary: 0,
                    slot: 0,
                    call: "tx",
                    found: SlotState::UntakenByPeer { step: 0 },
                    ..
                })
            ),
            "{refused}"
        );
        assert!(took >= Duration::from_millis(300) && took < Duration::from_secs(2), "the wait took {took:?}");
        // Rank 1 takes step 0 a little later: a waiting tx_wait goes on at once.
        std::thread::scope(|scope| {
            let waiting = scope.spawn(|| {
                let start = std::time::Instant::now();
                (send(2, Duration::from_secs(5)), start.elapsed())
            });
            std::thread::sleep(Duration::from_millis(200));
            assert_eq!(receive(0), pattern(100, N), "step 0");
            let (sent, took) = waiting.join().unwrap();
            assert_eq!(sent.unwrap(), 0);
            assert!(took >= Duration::from_millis(150) && took < Duration::from_secs(1), "the tx_wait took {took:?}");
        });
        assert_eq!(receive(1), pattern(101, N), "step 1");
        assert_eq!(send(3, Duration::from_secs(5)).unwrap(), 1);
        assert_eq!(receive(0), pattern(102, N), "step 2: the timed-out wait sent nothing");
        assert_eq!(receive(1), pattern(103, N), "step 3");
    });
}

/// A `tx_wait` to another rank that waits longer than the peer timeout keeps the link alive:
/// while it waits for a free slot, signs of life go on flowing both ways, so the receiving rank
/// never takes the wait for a hung peer, and the wait ends when the slot is freed, within the
/// caller's bound. The wait used to hold the link's control lock, the watchdog then skipped the
/// link, and the receiving rank failed a healthy link after about one peer timeout ("no sign of
/// life from the peer").
#[test]
fn a_tx_wait_longer_than_the_peer_timeout_keeps_the_link_alive() {
    with_double("a_tx_wait_longer_than_the_peer_timeout_keeps_the_link_alive", |_| {
        let ranks = ranks::two_ranks(Duration::from_secs(1));
        let primary = Engine::new(0).unwrap();
        let e1 = ranks.1.engine(1, &primary).unwrap().clone();
        let inputs: Vec<CudaSlice<u32>> = (0..4).map(|t| input(&ranks.0, &primary, 200 + t)).collect();
        let send = |t: usize, timeout: Duration| {
            ranks.0.enter(0).and_then(|_stage| ranks.0.tx_wait(0, &inputs[t], N, timeout))
        };
        let receive = |slot: usize| -> ppnrt::Result<Vec<u32>> {
            let _stage = ranks.1.enter(1)?;
            let received = ranks.1.rx_wait::<u32>(0, slot, N, Duration::from_secs(5))?;
            Ok(e1.dtoh(&received)?)
        };
        assert_eq!(send(0, Duration::from_secs(4)).unwrap(), 0);
        assert_eq!(send(1, Duration::from_secs(4)).unwrap(), 1);
        // Both slots of rank 1 hold untaken steps: the third waits, 2.5 peer timeouts, until
        // rank 1 takes step 0.
        std::thread::scope(|scope| {
            let waiting = scope.spawn(|| {
                let start = std::time::Instant::now();
                (send(2, Duration::from_secs(4)), start.elapsed())
            });
            std::thread::sleep(Duration::from_millis(2500));
            assert_eq!(receive(0).unwrap(), pattern(200, N), "step 0");
            let (sent, took) = waiting.join().unwrap();
            assert_eq!(sent.unwrap(), 0, "the waiting tx_wait");
            assert!(
                took >= Duration::from_millis(2400) && took < Duration::from_millis(3500),
                "the tx_wait took {took:?}"
            );
        });
        assert_eq!(receive(1).unwrap(), pattern(201, N), "step 1");
        assert_eq!(send(3, Duration::from_secs(4)).unwrap(), 1);
        assert_eq!(receive(0).unwrap(), pattern(202, N), "step 2, sent after the long wait");
        assert_eq!(receive(1).unwrap(), pattern(203, N), "step 3");
    });
}

/// An eager step's copies are ordered by the slot's own events (the protocol's `ev_tx` and
/// `ev_rx`), on a local boundary (copy engine and SM copies), a peer and a host-staged one: the next copy into
/// the slot waits for the copy out of it (the TX stream, run first, would otherwise overwrite the
/// step before it is received), and the copy out waits for the copy in (the RX stream, run first,
/// would otherwise read the slot's earlier step). A protocol broken on purpose (no wait for the
/// read, no wait for the write) is caught the same way.
#[test]
fn an_eager_step_is_ordered_by_the_slots_own_events() {
    use ppnrt::pp::ProtocolFault;
    with_double("an_eager_step_is_ordered_by_the_slots_own_events", |_| {
        let primary = Engine::new(0).unwrap();
        for (devices, sm, staged) in
            [([0, 0], false, false), ([0, 0], true, false), ([0, 1], false, false), ([0, 1], false, true)]
        {
            for fault in [ProtocolFault::None, ProtocolFault::SkipRxWait, ProtocolFault::SkipTxWait] {
                let config = PpConfig::with_devices(&devices).with_sm_copies(sm).with_slots(1).with_fault(fault);
                let config = if staged { config.with_transport(ppnrt::TransportPolicy::Staged) } else { config };
                let rt = PpNRt::new(config, &primary).unwrap();
                let e1 = rt.engine(1, &primary).unwrap().clone();
                // Write after read: step 2 is sent into the slot right after step 1's receive.
                let slot = rt.tx(0, &input(&rt, &primary, 1), N).unwrap();
                let first = rt.rx::<u32>(0, slot, N).unwrap();
                rt.tx(0, &input(&rt, &primary, 2), N).unwrap();
                rt.stage_stream(0).unwrap().synchronize().unwrap();
                let first_kept = e1.dtoh(&first).unwrap() == pattern(1, N);
                // Read after write: step 3 is received before its copy in ran.
                let second = rt.rx::<u32>(0, slot, N).unwrap();
                assert_eq!(e1.dtoh(&second).unwrap(), pattern(2, N), "{devices:?} sm {sm} staged {staged} {fault:?}");
                rt.tx(0, &input(&rt, &primary, 3), N).unwrap();
                let third = rt.rx::<u32>(0, slot, N).unwrap();
                rt.stage_stream(1).unwrap().synchronize().unwrap();
                let third_read = e1.dtoh(&third).unwrap() == pattern(3, N);
                let expected = (fault != ProtocolFault::SkipRxWait, fault != ProtocolFault::SkipTxWait);
                assert_eq!((first_kept, third_read), expected, "{devices:?} sm {sm} staged {staged} {fault:?}");
                drop((first, second, third));
                rt.synchronize().unwrap();
            }
        }
    });
}

/// A slot lent in place right after its eager copy in is read after that copy: the ring hands
/// the slot's own events over to the rule as it lends the slot, so the guard's reads (on the RX
/// stream, run first here) wait for the TX stream's copy; and the next copy in, once the guard
/// is gone, waits for those reads (the TX stream, run first, would otherwise overwrite them).
#[test]
fn a_slot_lent_in_place_is_ordered_by_the_rule_from_its_own_events() {
    with_double("a_slot_lent_in_place_is_ordered_by_the_rule_from_its_own_events", |_| {
        let primary = Engine::new(0).unwrap();
        for devices in [[0, 0], [0, 1]] {
            let rt = PpNRt::new(PpConfig::with_devices(&devices).with_slots(1), &primary).unwrap();
            let e1 = rt.engine(1, &primary).unwrap().clone();
            let rx_stream = rt.stage_stream(1).unwrap().clone();
            // A warm slot: one eager step through its own events first.
            let slot = rt.tx(0, &input(&rt, &primary, 1), N).unwrap();
            drop(rt.rx::<u32>(0, slot, N).unwrap());
            rt.tx(0, &input(&rt, &primary, 2), N).unwrap();
            let received = rt.rx_in_place::<u32>(0, slot, N).unwrap();
            let mut copy = CudaSlice::<u32>::alloc(&rx_stream, N).unwrap();
            rx_stream.memcpy_dtod(&received.view().unwrap(), &mut copy).unwrap();
            assert_eq!(e1.dtoh(&copy).unwrap(), pattern(2, N), "{devices:?}: the guard read before the copy in");
            e1.spin(500_000).unwrap();
            rx_stream.memcpy_dtod(&received.view().unwrap(), &mut copy).unwrap();
            drop(received);
            rt.tx(0, &input(&rt, &primary, 3), N).unwrap();
            rt.stage_stream(0).unwrap().synchronize().unwrap();
            assert_eq!(
                e1.dtoh(&copy).unwrap(),
                pattern(2, N),
                "{devices:?}: the next copy in overtook the guard's read"
            );
            assert_eq!(e1.dtoh(&rt.rx::<u32>(0, slot, N).unwrap()).unwrap(), pattern(3, N), "{devices:?}");
            rt.synchronize().unwrap();
        }
    });
}

/// A slot that grows after eager steps frees its old buffer only after their copies: the ring
/// hands the slot's own events over to the rule before the buffer goes (the double counts a copy
/// that touches freed memory), device and pinned slots alike. A step received, and a step
/// discarded whose copy in is still queued, then a larger step.
#[test]
fn a_slot_grown_after_eager_steps_frees_its_buffer_after_their_copies() {
    with_double("a_slot_grown_after_eager_steps_frees_its_buffer_after_their_copies", |_| {
        let primary = Engine::new(0).unwrap();
        for (devices, staged) in [([0, 0], false), ([0, 1], false), ([0, 1], true)] {
            let config = PpConfig::with_devices(&devices).with_slots(1);
            let config = if staged { config.with_transport(ppnrt::TransportPolicy::Staged) } else { config };
            let rt = PpNRt::new(config, &primary).unwrap();
            let e1 = rt.engine(1, &primary).unwrap().clone();
            let slot = rt.tx(0, &input(&rt, &primary, 1), N).unwrap();
            let small = rt.rx::<u32>(0, slot, N).unwrap();
            rt.tx(0, &input(&rt, &primary, 2), N).unwrap();
            assert_eq!(rt.discard_unreceived(0).unwrap(), 1);
            // Four times the bytes: the slot gets a larger buffer, the old one is freed.
            let x = {
                let _stage = rt.enter(0).unwrap();
                let engine = rt.engine(0, &primary).unwrap();
                let mut x = engine.alloc::<u32>(4 * N).unwrap();
                engine.fill_pattern(&mut x, 3).unwrap();
                x
            };
            rt.tx(0, &x, 4 * N).unwrap();
            let large = rt.rx::<u32>(0, slot, 4 * N).unwrap();
            assert_eq!(e1.dtoh(&small).unwrap(), pattern(1, N), "{devices:?} staged {staged}");
            assert_eq!(e1.dtoh(&large).unwrap(), pattern(3, 4 * N), "{devices:?} staged {staged}");
            rt.synchronize().unwrap();
        }
    });
}

/// A slot taken for the capture of step graphs right after an eager step (its copy out still
/// queued) is written by the graphs' launch only after that copy out: the TX stream, run first,
/// would otherwise overwrite the step before it is received.
#[test]
fn a_slot_captured_after_an_eager_step_is_written_after_its_copy_out() {
    with_double("a_slot_captured_after_an_eager_step_is_written_after_its_copy_out", |_| {
        let primary = Engine::new(0).unwrap();
        for devices in [[0, 0], [0, 1]] {
            let rt = PpNRt::new(PpConfig::with_devices(&devices).with_slots(1), &primary).unwrap();
            let e1 = rt.engine(1, &primary).unwrap().clone();
            let slot = rt.tx(0, &input(&rt, &primary, 1), N).unwrap();
            let eager = rt.rx::<u32>(0, slot, N).unwrap();
            let (source, mut output) = copy_step_buffers(&rt, &primary, 2);
            let mut step =
                rt.capture_step::<u32>(N, |stage| {
                    if stage.stage() == 0 { stage.tx(&source) } else { stage.rx_into(&mut output) }
                })
                .unwrap();
            step.launch().unwrap();
            rt.stage_stream(0).unwrap().synchronize().unwrap();
            assert_eq!(e1.dtoh(&eager).unwrap(), pattern(1, N), "{devices:?}: the graph overwrote the eager step");
            assert_eq!(e1.dtoh(&output).unwrap(), pattern(2, N), "{devices:?}");
            rt.synchronize().unwrap();
        }
    });
}
