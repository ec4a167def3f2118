//! The IPC boundary's flag words (the receiving rank's control block, both ranks' host waits)
//! against what a peer or a caller may do, ranks as threads of this process, through the doubles
//! (whose stream waits compare cyclically, as the driver's). A lying peer: any process of the
//! user may open the receiving rank's control block (its memfd, through `/proc/<pid>/fd`) with the
//! public [`ControlBlock::open`] and write any value into it; a `consumed` word lied past every
//! step does not keep the sending rank's stream waiting after a failure, nor does a peer that
//! keeps lying (the stream waits on words only its own rank writes), and a `filled` word lied past
//! the release value fails the receive, and a receiving rank that confirms the close while a
//! copy still waits for its slot fails the close, never holding the sending rank's drop; the
//! copy that release skips leaves its slot's `filled` word saying "released", never "filled". A
//! caller:
//! a slot lent in place is freed for the sender only once the reads through the lend completed,
//! more slots than a block holds are a configuration error, and a receive outlasts the peer
//! timeout while the sending rank's heartbeat shows it alive.

use crate::{double, ranks};

use std::collections::HashSet;
use std::os::unix::fs::MetadataExt;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use double::with_double;
use ppnrt::local_channel::ControlBlock;
use ppnrt::{CudaSlice, Engine};

const N: usize = 2048;

/// The inodes of this process's open control blocks, each with one descriptor's path.
pub(crate) fn control_blocks() -> Vec<(u64, std::path::PathBuf)> {
    let mut found = Vec::new();
    for entry in std::fs::read_dir("/proc/self/fd").unwrap().flatten() {
        let path = entry.path();
        let is_block =
            std::fs::read_link(&path).is_ok_and(|target| target.to_string_lossy().starts_with("/memfd:ppnrt-control"));
        if let (true, Ok(meta)) = (is_block, std::fs::metadata(&path)) {
            found.push((meta.ino(), path));
        }
    }
    found
}

/// The control block of `slots` slots opened in this process since `before` was listed, mapped
/// again as another process of the user maps it (through `/proc/<pid>/fd`).
pub(crate) fn opened_as_peer(before: &HashSet<u64>, slots: usize) -> ControlBlock {
    let (_, path) = control_blocks()
        .into_iter()
        .find(|(ino, _)| !before.contains(ino))
        .expect("the boundary's control block is open in this process");
    let file = std::fs::OpenOptions::new().read(true).write(true).open(&path).unwrap();
    ControlBlock::open(file.into(), slots).unwrap()
}

fn pattern(seed: u32, n: usize) -> Vec<u32> {
    (0..n as u64).map(|i| ppnrt::kernels::pattern(seed, i)).collect()
}

/// Step `t`'s values on rank 0's stage.
fn step_input(rt: &ppnrt::PpNRt, primary: &Engine, t: u32) -> CudaSlice<u32> {
    let _stage = rt.enter(0).unwrap();
    let engine = rt.engine(0, primary).unwrap();
    let mut x = engine.alloc::<u32>(N).unwrap();
    engine.fill_pattern(&mut x, 100 + t).unwrap();
    x
}

/// A receiving rank that lies in its `consumed` words: once the sending rank's stream waits on
/// the device for slots not freed yet (its stage runs late, a gate), the liar writes `u64::MAX`
/// into them, a value below every step for a stream's cyclic comparison. The boundary then fails
/// (a forged record); the sending rank's stream must still drain: its gates take the block's
/// value only up to the step waited for, and a failure releases them.
#[test]
fn a_consumed_word_lied_past_every_step_does_not_keep_the_sending_rank_waiting_after_a_failure() {
    with_double(
        "a_consumed_word_lied_past_every_step_does_not_keep_the_sending_rank_waiting_after_a_failure",
        |double| {
            static TX_GATE: AtomicBool = AtomicBool::new(false);
            TX_GATE.store(false, Ordering::SeqCst);
            let timeout = Duration::from_millis(800);
            let primary = Engine::new(0).unwrap();
            let before: HashSet<u64> = control_blocks().into_iter().map(|(ino, _)| ino).collect();
            let ranks = ranks::two_ranks_configured(timeout, |_, config| {
                config.with_slots(2).with_fault(ppnrt::pp::ProtocolFault::ForgeRecordAt(2))
            });
            let liar = opened_as_peer(&before, 2);
            let inputs: Vec<CudaSlice<u32>> = (0..5).map(|t| step_input(&ranks.0, &primary, t)).collect();
            double.gate(ranks.0.stage_stream(0).unwrap(), &TX_GATE);
            for input in &inputs {
                ranks.0.enter(0).and_then(|_stage| ranks.0.tx(0, input, N)).unwrap();
            }
            // Steps 2 to 4 found their slots not freed: their waits are queued on rank 0's stream.
            for slot in 0..2 {
                liar.publish_consumed(slot, u64::MAX);
            }
            TX_GATE.store(true, Ordering::SeqCst);
            let start = std::time::Instant::now();
            while !matches!(ranks.1.receiver_state(0), Ok(Some(ppnrt::pp::ReceiverState::Stopped))) {
                assert!(start.elapsed() < 4 * timeout, "rank 1 did not fail the boundary");
                std::thread::sleep(Duration::from_millis(20));
            }
            let (zero, one) = ranks;
            // Rank 0 fails its end too (the peer's end closed), and releases.
            drop(one);
            let drained = {
                let stream = Arc::clone(zero.stage_stream(0).unwrap());
                let (done, finished) = std::sync::mpsc::channel();
                std::thread::spawn(move || {
                    let _ = done.send(stream.synchronize());
                });
                finished.recv_timeout(Duration::from_secs(5))
            };
            let errors = crate::drop_ranks_within((inputs, zero, liar), Duration::from_secs(15), "the ranks");
            assert!(
                matches!(drained, Ok(Ok(()))),
                "rank 0's stream did not drain after the failure: {drained:?} (drops: {errors:?})"
            );
        },
    );
}

/// A ring of more slots than a control block holds is a configuration error naming the setting
/// and the value, on both ranks, before any boundary is set up (never a peer failure of the IPC
/// setup); the block itself refuses that many slots by name too.
#[test]
fn more_slots_than_a_control_block_holds_are_a_config_error() {
    with_double("more_slots_than_a_control_block_holds_are_a_config_error", |_| {
        let too_many = ControlBlock::MAX_SLOTS + 1;
        let refused = ControlBlock::create(too_many).unwrap_err();
        assert!(refused.to_string().contains(&format!("{too_many} slot(s)")), "{refused}");
        let primary = Engine::new(0).unwrap();
        let (zero, one) = ranks::try_two_ranks_configured(&primary, Duration::from_millis(800), |_, config| {
            config.with_slots(too_many).with_process_transport(ppnrt::ProcessTransport::Ipc)
        });
        for (rank, built) in [zero, one].into_iter().enumerate() {
            match built {
                Err(ppnrt::Error::Config(e)) => {
                    assert_eq!(
                        (e.setting, e.value.as_str()),
                        ("PpConfig::with_slots", too_many.to_string().as_str()),
                        "rank {rank}: {e}"
                    );
                }
                other => panic!("rank {rank}: {} slots gave {:?}", too_many, other.map(|_| ())),
            }
        }
    });
}

/// A slot lent in place is freed for the sending rank, ahead of the step's record or at it, only
/// once the reads made through the lend have completed, also after the guard was dropped: rank
/// 1's stage copies out of the lent slot behind a gate and drops the guard; rank 0 sends the
/// steps that come back to the slot at once. The copy out reads the lent step, and the later
/// step arrives whole.
#[test]
fn a_slot_lent_in_place_is_freed_only_once_the_reads_through_the_lend_completed() {
    with_double("a_slot_lent_in_place_is_freed_only_once_the_reads_through_the_lend_completed", |double| {
        static RX_GATE: AtomicBool = AtomicBool::new(false);
        RX_GATE.store(false, Ordering::SeqCst);
        let primary = Engine::new(0).unwrap();
        let ranks = ranks::two_ranks_configured(Duration::from_secs(5), |_, config| config.with_slots(2));
        let e1 = ranks.1.engine(1, &primary).unwrap().clone();
        let inputs: Vec<CudaSlice<u32>> = (0..3).map(|t| step_input(&ranks.0, &primary, t)).collect();
        let send = |t: usize| ranks.0.enter(0).and_then(|_stage| ranks.0.tx(0, &inputs[t], N)).unwrap();
        let wait = Duration::from_secs(5);
        let stage1 = ranks.1.enter(1).unwrap();
        let slot = send(0);
        let guard = ranks.1.rx_in_place_wait::<u32>(0, slot, N, wait).unwrap();
        let mut held = e1.alloc::<u32>(N).unwrap();
        double.gate(ranks.1.stage_stream(1).unwrap(), &RX_GATE);
        e1.dtod(&guard.view().unwrap(), &mut held).unwrap();
        drop(guard);
        send(1);
        send(2);
        // Long enough for rank 1's receiver to see both records and the lent slot free in its ring.
        std::thread::sleep(Duration::from_millis(300));
        RX_GATE.store(true, Ordering::SeqCst);
        assert!(e1.dtoh(&held).unwrap() == pattern(100, N), "the lent step was overwritten before its read ran");
        for t in 1..3 {
            let y = ranks.1.rx_wait::<u32>(0, t % 2, N, wait).unwrap();
            assert!(e1.dtoh(&y).unwrap() == pattern(100 + t as u32, N), "step {t}: wrong values");
        }
        drop(stage1);
        drop(inputs);
        let errors = crate::drop_ranks_within(ranks, Duration::from_secs(15), "the ranks");
        assert!(errors.is_empty(), "{errors:?}");
    });
}

/// A receiving rank that keeps lying (`u64::MAX` written into its `consumed` words again and
/// again, after the failure's release too) cannot keep the sending rank's stream waiting: that
/// stream waits only on gate words of the sending rank's own (private memory no other process
/// reaches), which its forwarder raises from the block and the failure's release sets for good.
/// The sending rank's drop returns within the peer timeout, every failure typed. With the
/// stream waiting on the peer's `consumed` word instead (mutation `ipc-tx-waits-on-peer-word`),
/// the drop waits as long as the lie lasts.
#[test]
fn a_peer_that_keeps_lying_cannot_hang_the_sending_ranks_drop() {
    with_double("a_peer_that_keeps_lying_cannot_hang_the_sending_ranks_drop", |double| {
        static TX_GATE: AtomicBool = AtomicBool::new(false);
        static LYING: AtomicBool = AtomicBool::new(true);
        TX_GATE.store(false, Ordering::SeqCst);
        LYING.store(true, Ordering::SeqCst);
        let timeout = Duration::from_millis(800);
        let primary = Engine::new(0).unwrap();
        let before: HashSet<u64> = control_blocks().into_iter().map(|(ino, _)| ino).collect();
        let ranks = ranks::two_ranks_configured(timeout, |_, config| {
            config.with_slots(2).with_fault(ppnrt::pp::ProtocolFault::ForgeRecordAt(2))
        });
        let liar = Arc::new(opened_as_peer(&before, 2));
        let inputs: Vec<CudaSlice<u32>> = (0..5).map(|t| step_input(&ranks.0, &primary, t)).collect();
        double.gate(ranks.0.stage_stream(0).unwrap(), &TX_GATE);
        for input in &inputs {
            ranks.0.enter(0).and_then(|_stage| ranks.0.tx(0, input, N)).unwrap();
        }
        let lying = std::thread::spawn({
            let liar = Arc::clone(&liar);
            move || {
                while LYING.load(Ordering::SeqCst) {
                    for slot in 0..2 {
                        liar.publish_consumed(slot, u64::MAX);
                    }
                    std::thread::yield_now();
                }
            }
        });
        TX_GATE.store(true, Ordering::SeqCst);
        let start = std::time::Instant::now();
        while !matches!(ranks.1.receiver_state(0), Ok(Some(ppnrt::pp::ReceiverState::Stopped))) {
            assert!(start.elapsed() < 4 * timeout, "rank 1 did not fail the boundary");
            std::thread::sleep(Duration::from_millis(20));
        }
        let (zero, one) = ranks;
        drop(one);
        let start = std::time::Instant::now();
        let (done, finished) = std::sync::mpsc::channel();
        let dropping = std::thread::spawn(move || {
            drop((inputs, zero));
            let _ = done.send(crate::typed_drop_errors());
        });
        let dropped = finished.recv_timeout(4 * timeout);
        let took = start.elapsed();
        // The lie ends (the words released as the crate releases them), so a drop still waiting
        // returns and nothing of this test outlives it.
        LYING.store(false, Ordering::SeqCst);
        lying.join().unwrap();
        for slot in 0..2 {
            liar.publish_consumed(slot, 1 << 62);
        }
        // A drop still waiting is left behind (its thread ends with the test process).
        let errors = dropped.unwrap_or_else(|_| panic!("rank 0's drop took over {took:?} (peer timeout {timeout:?})"));
        dropping.join().unwrap();
        assert!(
            !errors.is_empty() && errors.iter().all(crate::sweep_ranks::peer_failed),
            "the failure is not reported typed: {errors:?}"
        );
    });
}

/// A receive that waits on the host for a copy the sending rank's stage runs late (a gate held
/// for several peer timeouts) is not failed while the sending rank lives: its watchdog's
/// heartbeat in the block shows it alive (the connection is not read meanwhile), whatever other
/// links the sending rank has (here none). The step then arrives whole.
#[test]
fn a_receive_waits_past_the_peer_timeout_for_a_live_senders_late_copy() {
    with_double("a_receive_waits_past_the_peer_timeout_for_a_live_senders_late_copy", |double| {
        static TX_GATE: AtomicBool = AtomicBool::new(false);
        TX_GATE.store(false, Ordering::SeqCst);
        let timeout = Duration::from_millis(500);
        let primary = Engine::new(0).unwrap();
        let ranks = ranks::two_ranks_configured(timeout, |_, config| config.with_slots(2));
        let x = step_input(&ranks.0, &primary, 0);
        ranks.0.stage_stream(0).unwrap().synchronize().unwrap();
        double.gate(ranks.0.stage_stream(0).unwrap(), &TX_GATE);
        ranks.0.enter(0).and_then(|_stage| ranks.0.tx(0, &x, N)).unwrap();
        let gate = std::thread::spawn(move || {
            std::thread::sleep(3 * timeout);
            TX_GATE.store(true, Ordering::SeqCst);
        });
        let values = ranks.1.enter(1).and_then(|_stage| {
            let y = ranks.1.rx_wait::<u32>(0, 0, N, Duration::from_secs(10))?;
            ranks.1.readback(y)?.wait().map(<[u32]>::to_vec)
        });
        gate.join().unwrap();
        assert!(values.as_ref().is_ok_and(|v| *v == pattern(100, N)), "step 0: {:?}", values.map(|v| v.len()));
        drop(x);
        let errors = crate::drop_ranks_within(ranks, Duration::from_secs(15), "the ranks");
        assert!(errors.is_empty(), "{errors:?}");
    });
}

/// A `filled` word lied past the release value (`u64::MAX`) while a receive waits for the
/// sending rank's copy (its stage runs late, a gate) is the link's failure, typed: the receive
/// never returns the slot as filled.
#[test]
fn a_filled_word_lied_past_the_release_fails_the_receive_typed() {
    with_double("a_filled_word_lied_past_the_release_fails_the_receive_typed", |double| {
        static TX_GATE: AtomicBool = AtomicBool::new(false);
        TX_GATE.store(false, Ordering::SeqCst);
        let timeout = Duration::from_millis(800);
        let primary = Engine::new(0).unwrap();
        let before: HashSet<u64> = control_blocks().into_iter().map(|(ino, _)| ino).collect();
        let ranks = ranks::two_ranks_configured(timeout, |_, config| config.with_slots(2));
        let liar = opened_as_peer(&before, 2);
        let x = step_input(&ranks.0, &primary, 0);
        ranks.0.stage_stream(0).unwrap().synchronize().unwrap();
        double.gate(ranks.0.stage_stream(0).unwrap(), &TX_GATE);
        ranks.0.enter(0).and_then(|_stage| ranks.0.tx(0, &x, N)).unwrap();
        liar.publish_filled(0, u64::MAX);
        let received = ranks.1.enter(1).and_then(|_stage| ranks.1.rx_wait::<u32>(0, 0, N, Duration::from_secs(5)));
        TX_GATE.store(true, Ordering::SeqCst);
        assert!(
            matches!(received, Err(ppnrt::Error::Pipeline(ppnrt::PpError::PeerFailed { .. }))),
            "a receive with its filled word lied past the release: {:?}",
            received.map(|y| y.len())
        );
        drop(x);
        let _ = crate::drop_ranks_within((ranks, liar), Duration::from_secs(15), "the ranks");
    });
}

/// The sending rank's forwarder, asleep while no wait is pending, is woken by a step that must
/// wait for its slot: with one slot, each step `k` is sent while rank 1 still holds step `k - 1`
/// lent in place (the forwarder idle for 25 ms before), then the lend is dropped, and the step
/// arrives soon after, well before the forwarder's next poll (10 ms) would have found the slot
/// freed. Every step arrives whole. With the wake left out (mutation `ipc-forwarder-not-woken`),
/// each step waits for that poll.
#[test]
fn a_sleeping_forwarder_is_woken_by_a_step_that_waits_for_its_slot() {
    with_double("a_sleeping_forwarder_is_woken_by_a_step_that_waits_for_its_slot", |_| {
        let primary = Engine::new(0).unwrap();
        let ranks = ranks::two_ranks_configured(Duration::from_secs(5), |_, config| config.with_slots(1));
        let e1 = ranks.1.engine(1, &primary).unwrap().clone();
        let steps = 26;
        let inputs: Vec<CudaSlice<u32>> = (0..steps).map(|t| step_input(&ranks.0, &primary, t)).collect();
        let send = |t: usize| ranks.0.enter(0).and_then(|_stage| ranks.0.tx(0, &inputs[t], N)).unwrap();
        let wait = Duration::from_secs(5);
        let stage1 = ranks.1.enter(1).unwrap();
        send(0);
        let mut guard = ranks.1.rx_in_place_wait::<u32>(0, 0, N, wait).unwrap();
        let mut took = Vec::new();
        for t in 1..steps as usize {
            assert!(e1.dtoh(&guard.view().unwrap()).unwrap() == pattern(100 + t as u32 - 1, N), "step {}", t - 1);
            std::thread::sleep(Duration::from_millis(25));
            send(t);
            let start = std::time::Instant::now();
            drop(guard);
            guard = ranks.1.rx_in_place_wait::<u32>(0, 0, N, wait).unwrap();
            took.push(start.elapsed());
        }
        assert!(e1.dtoh(&guard.view().unwrap()).unwrap() == pattern(100 + steps - 1, N), "the last step");
        drop(guard);
        took.sort();
        let median = took[took.len() / 2];
        assert!(
            median < Duration::from_micros(2500),
            "the median step took {median:?} after its slot was freed: {took:?}"
        );
        drop(stage1);
        drop(inputs);
        let errors = crate::drop_ranks_within(ranks, Duration::from_secs(15), "the ranks");
        assert!(errors.is_empty(), "{errors:?}");
    });
}

/// A receiving rank that lies about having received every step (its receiver takes each step
/// without freeing its slot or waiting for the copy, then confirms the close) cannot keep the
/// sending rank's drop waiting: rank 0's stream still waits on a gate for a slot never freed when
/// the confirmation comes, which an honest peer never sends before every copy ran; the close is
/// failed (typed), the gates released, and the drop returns within the peer timeout. Taking the
/// confirmation as a clean close (mutation `ipc-lying-close-trusted`) leaves the stream waiting
/// for good.
#[test]
fn a_close_confirmed_while_a_copy_waits_for_its_slot_cannot_hang_the_sending_ranks_drop() {
    with_double("a_close_confirmed_while_a_copy_waits_for_its_slot_cannot_hang_the_sending_ranks_drop", |_| {
        let timeout = Duration::from_millis(800);
        let primary = Engine::new(0).unwrap();
        let ranks = ranks::two_ranks_configured(timeout, |rank, config| {
            let config = config.with_slots(2);
            if rank == 1 { config.with_fault(ppnrt::pp::ProtocolFault::ReceiveWithoutFreeing) } else { config }
        });
        let inputs: Vec<CudaSlice<u32>> = (0..5).map(|t| step_input(&ranks.0, &primary, t)).collect();
        for input in &inputs {
            ranks.0.enter(0).and_then(|_stage| ranks.0.tx(0, input, N)).unwrap();
        }
        // Rank 1 takes every step (none of its slots freed): steps 2 to 4 wait on rank 0's gates.
        for t in 0..5 {
            let taken = ranks
                .1
                .enter(1)
                .and_then(|_stage| ranks.1.rx_wait::<u32>(0, t % 2, N, Duration::from_secs(5)).map(drop));
            assert!(taken.is_ok(), "rank 1's step {t}: {taken:?}");
        }
        let (zero, one) = ranks;
        let start = std::time::Instant::now();
        let (done, finished) = std::sync::mpsc::channel();
        let dropping = std::thread::spawn(move || {
            drop((inputs, zero));
            let _ = done.send(crate::typed_drop_errors());
        });
        let dropped = finished.recv_timeout(4 * timeout);
        let took = start.elapsed();
        // A drop still waiting is left behind (its thread ends with the test process).
        let errors = dropped.unwrap_or_else(|_| panic!("rank 0's drop took over {took:?} (peer timeout {timeout:?})"));
        dropping.join().unwrap();
        assert!(
            !errors.is_empty() && errors.iter().all(crate::sweep_ranks::peer_failed),
            "the lie is not reported typed: {errors:?}"
        );
        let _ = crate::drop_ranks_within(one, Duration::from_secs(15), "rank 1");
    });
}

/// A copy that a failure skipped never reads as filled. Rank 1 lies that it received every step
/// (it frees no slot), so rank 0's copy of step 2 waits on its gate for slot 0; rank 0's close
/// finds that wait pending, fails the boundary and releases its gates, and the copy behind the
/// wait writes nothing. Its signal, slot 0's `filled` word, must then say "released" (`1 << 62`),
/// never step 2's `3`: a receiving rank that had not learned of the failure yet (a slow one) would
/// take the slot as holding step 2. Rank 0's stream is held right after the step's signal (a gate
/// of the double), so that the release's own writes of the word come later; rank 1, which has not
/// failed, writes it nowhere. A copy-engine copy and write-value there (mutation
/// `ipc-gated-copy-off`), or a signal that ignores the gate (`ipc-gated-signal-unconditional`),
/// write `3`.
#[test]
fn a_copy_a_failure_skipped_signals_its_slot_released_never_filled() {
    with_double("a_copy_a_failure_skipped_signals_its_slot_released_never_filled", |double| {
        static TX_HOLD: AtomicBool = AtomicBool::new(false);
        TX_HOLD.store(false, Ordering::SeqCst);
        let timeout = Duration::from_millis(500);
        let primary = Engine::new(0).unwrap();
        let before: HashSet<u64> = control_blocks().into_iter().map(|(ino, _)| ino).collect();
        let ranks = ranks::two_ranks_configured(timeout, |rank, config| {
            let config = config.with_slots(2);
            if rank == 1 { config.with_fault(ppnrt::pp::ProtocolFault::ReceiveWithoutFreeing) } else { config }
        });
        let block = opened_as_peer(&before, 2);
        let inputs: Vec<CudaSlice<u32>> = (0..3).map(|t| step_input(&ranks.0, &primary, t)).collect();
        for input in &inputs {
            ranks.0.enter(0).and_then(|_stage| ranks.0.tx(0, input, N)).unwrap();
        }
        // Behind step 2's wait, copy and signal: whatever rank 0's release queues after them.
        double.gate(ranks.0.stage_stream(0).unwrap(), &TX_HOLD);
        for t in 0..3 {
            let taken = ranks
                .1
                .enter(1)
                .and_then(|_stage| ranks.1.rx_wait::<u32>(0, t % 2, N, Duration::from_secs(5)).map(drop));
            assert!(taken.is_ok(), "rank 1's step {t}: {taken:?}");
        }
        let (zero, one) = ranks;
        let (done, finished) = std::sync::mpsc::channel();
        let dropping = std::thread::spawn(move || {
            drop((inputs, zero));
            let _ = done.send(crate::typed_drop_errors());
        });
        // Slot 0's word holds step 0's `1` until step 2's signal runs, once the release met its wait.
        let start = std::time::Instant::now();
        let signalled = loop {
            let filled = block.filled(0);
            if filled > 1 || start.elapsed() > 8 * timeout {
                break filled;
            }
            std::thread::sleep(Duration::from_millis(2));
        };
        TX_HOLD.store(true, Ordering::SeqCst);
        let errors = finished.recv_timeout(8 * timeout);
        let _ = crate::drop_ranks_within((one, block), Duration::from_secs(15), "rank 1");
        assert_eq!(signalled, 1 << 62, "slot 0's filled word after the copy of step 2 was skipped (3: filled)");
        let errors = errors.unwrap_or_else(|_| panic!("rank 0's drop did not return once its stream was let go"));
        dropping.join().unwrap();
        assert!(
            !errors.is_empty() && errors.iter().all(crate::sweep_ranks::peer_failed),
            "the lie is not reported typed: {errors:?}"
        );
    });
}

/// A `consumed` word at the release value (`1 << 62`, what the receiving rank writes when its end
/// fails, or a lie) frees no slot: the copies the sending rank queues for it are cancelled, not
/// run. Rank 1 lends both slots in place (steps 0 and 1); rank 0's copy of step 2 waits on its
/// gate for slot 0; then the block's `consumed` words of both slots are set to the release value,
/// and rank 0 sends step 3 into slot 1. Neither lent slot is written, and both `filled` words say
/// "released". The forwarder taking the release value as a step (capped at the step waited for,
/// mutation `ipc-released-consumed-as-step`) lets step 2's copy run into slot 0; `tx` taking it as
/// a free slot (`ipc-released-consumed-as-free`) copies step 3 into slot 1 with no wait.
#[test]
fn a_released_consumed_word_frees_no_slot_and_cancels_the_copies_for_it() {
    with_double("a_released_consumed_word_frees_no_slot_and_cancels_the_copies_for_it", |_| {
        let timeout = Duration::from_millis(500);
        let wait = Duration::from_secs(5);
        let primary = Engine::new(0).unwrap();
        let before: HashSet<u64> = control_blocks().into_iter().map(|(ino, _)| ino).collect();
        let ranks = ranks::two_ranks_configured(timeout, |_, config| config.with_slots(2));
        let block = opened_as_peer(&before, 2);
        let e1 = ranks.1.engine(1, &primary).unwrap().clone();
        let inputs: Vec<CudaSlice<u32>> = (0..4).map(|t| step_input(&ranks.0, &primary, t)).collect();
        let send = |t: usize| ranks.0.enter(0).and_then(|_stage| ranks.0.tx(0, &inputs[t], N)).unwrap();
        let stage1 = ranks.1.enter(1).unwrap();
        let lent: Vec<_> = (0..2).map(|t| ranks.1.rx_in_place_wait::<u32>(0, send(t), N, wait).unwrap()).collect();
        assert_eq!(send(2), 0, "step 2's slot");
        for slot in 0..2 {
            block.publish_consumed(slot, 1 << 62);
        }
        assert_eq!(send(3), 1, "step 3's slot");
        // Each slot's word holds its step's `t + 1` until the next step's signal runs.
        let start = std::time::Instant::now();
        let signalled = loop {
            let words = [block.filled(0), block.filled(1)];
            if (words[0] > 1 && words[1] > 2) || start.elapsed() > 8 * timeout {
                break words;
            }
            std::thread::sleep(Duration::from_millis(2));
        };
        let held: Vec<Vec<u32>> = lent
            .iter()
            .map(|guard| {
                let mut copy = e1.alloc::<u32>(N).unwrap();
                e1.dtod(&guard.view().unwrap(), &mut copy).unwrap();
                e1.dtoh(&copy).unwrap()
            })
            .collect();
        drop(lent);
        drop(stage1);
        let errors = crate::drop_ranks_within((inputs, ranks, block), Duration::from_secs(15), "the ranks");
        for (t, values) in held.iter().enumerate() {
            assert!(
                *values == pattern(100 + t as u32, N),
                "slot {t}, lent with step {t}, was written (step {}'s values: {}; drops: {errors:?})",
                t + 2,
                *values == pattern(102 + t as u32, N)
            );
        }
        assert_eq!(signalled, [1 << 62; 2], "the filled words after the copies of steps 2 and 3 (3, 4: filled)");
    });
}

/// A receiving rank that frees its slots out of order (a lie in its `consumed` words: slot 1
/// said free for step 3 while slot 0 still holds step 0) leaves the sending rank's stream waiting
/// on its gate for slot 0 (step 2's copy) when step 3's copy, into the slot said free, is queued
/// with no wait of its own. When that copy's notes fail (the ordering rule's event record), the
/// rule waits on the host for the stream, which the queued wait of step 2 holds until the liar
/// frees slot 0: the send must release its gates first as a copy that waits does, and fail at once
/// naming the call. A flagged copy that releases only when it queued a wait itself waits for the
/// peer timeout instead (the watchdog, which cannot read the connection while the `tx` holds it,
/// then takes the peer for silent) and reports that silence.
#[test]
fn a_send_whose_note_fails_behind_an_earlier_steps_queued_wait_fails_at_once_naming_the_call() {
    with_double(
        "a_send_whose_note_fails_behind_an_earlier_steps_queued_wait_fails_at_once_naming_the_call",
        |double| {
            let timeout = Duration::from_millis(800);
            let wait = Duration::from_secs(5);
            let primary = Engine::new(0).unwrap();
            let before: HashSet<u64> = control_blocks().into_iter().map(|(ino, _)| ino).collect();
            let ranks = Arc::new(ranks::two_ranks_configured(timeout, |_, config| config.with_slots(2)));
            let liar = opened_as_peer(&before, 2);
            let inputs: Arc<Vec<CudaSlice<u32>>> =
                Arc::new((0..4).map(|t| step_input(&ranks.0, &primary, t)).collect());
            let send = |t: usize| ranks.0.enter(0).and_then(|_stage| ranks.0.tx(0, &inputs[t], N));
            let stage1 = ranks.1.enter(1).unwrap();
            let lent: Vec<_> =
                (0..2).map(|t| ranks.1.rx_in_place_wait::<u32>(0, send(t).unwrap(), N, wait).unwrap()).collect();
            // Slot 0 is lent with step 0: step 2's copy waits on the device for its gate.
            assert_eq!(send(2).unwrap(), 0, "step 2's slot");
            // The lie: slot 1 free for step 3 (its copy queued with no wait, behind step 2's).
            liar.publish_consumed(1, 3);
            double.fail("cuEventRecord", 1, crate::OUT_OF_MEMORY);
            let (finished, sender) = crate::ipc_gated::send_on_a_thread(&ranks, &inputs, 3);
            let sent = finished.recv_timeout(4 * timeout);
            double.clear_faults();
            drop(lent);
            drop(stage1);
            let (sent, took) = sent.expect("the send did not return");
            sender.join().unwrap();
            let errors = crate::drop_ranks_within((inputs, ranks, liar), Duration::from_secs(15), "the ranks");
            assert!(
                sent.as_ref().is_err_and(|e| e.to_string().contains("cuEventRecord")) && took < timeout / 2,
                "after {took:?}: {sent:?} (drops: {errors:?})"
            );
        },
    );
}
