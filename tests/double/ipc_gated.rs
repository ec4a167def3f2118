//! The IPC sending rank's flagged copy (the copy into the receiving rank's slot and the signal
//! after it, queued behind a wait for the slot when it was not free): when a driver call fails
//! part way, the work the calls before it queued stays queued and runs later, so the buffers it
//! reads and writes stay ordered by the crate's rule, an input dropped after the failed `tx`
//! included (its free waits for the queued copy); and the kernels of the copy a failure cancels,
//! as the double runs them, keep their contract at every alignment and size.

use crate::{OUT_OF_MEMORY, double, ranks};

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, mpsc};
use std::time::Duration;

use double::with_double;
use ppnrt::pp::ReceiverState;
use ppnrt::{CudaSlice, Engine, PpNRt};

const N: usize = 2048;

/// Rank 0's `tx` of `inputs[t]` (its stage 0, boundary 0) on a thread of its own, for a send that
/// may wait: what it returned and how long it took come through the receiver; the thread is
/// joined by the caller once whatever holds the send was let go.
pub(crate) fn send_on_a_thread(
    ranks: &Arc<(PpNRt, PpNRt)>,
    inputs: &Arc<Vec<CudaSlice<u32>>>,
    t: usize,
) -> (mpsc::Receiver<(ppnrt::Result<()>, Duration)>, std::thread::JoinHandle<()>) {
    let (done, finished) = mpsc::channel();
    let (ranks, inputs) = (Arc::clone(ranks), Arc::clone(inputs));
    let sender = std::thread::spawn(move || {
        let start = std::time::Instant::now();
        let sent = ranks.0.enter(0).and_then(|_stage| ranks.0.tx(0, &inputs[t], N)).map(drop);
        let _ = done.send((sent, start.elapsed()));
    });
    (finished, sender)
}

/// A step whose send fails at a later call of its flagged copy, after an earlier call queued work
/// that reads its input: step 0 (its slot free: the copy engine's copy, then a write-value that
/// fails) and step 2 of two slots (its slot still held: the wait, the helper kernel's copy, then
/// the signal kernel's launch that fails). The `tx` fails, typed, naming the call; the input,
/// owned by another stream than the stage's (the primary engine's own), is dropped at once. Its
/// free must wait for the copy queued before the failure, which the rank's stream (held by a
/// gate of the double meanwhile) runs later: nothing touches freed memory. A flagged copy that
/// notes its buffers' uses only when every call succeeded (mutation
/// `ipc-flagged-copy-partly-queued-unordered`) frees the input under the queued copy.
#[test]
fn a_send_that_fails_after_its_copy_was_queued_keeps_its_input_until_the_copy_ran() {
    with_double("a_send_that_fails_after_its_copy_was_queued_keeps_its_input_until_the_copy_ran", |double| {
        static HOLD: AtomicBool = AtomicBool::new(false);
        // The gated step last: a kernel that reaches freed memory ends the context.
        for (step, entry, nth) in [(0, "cuStreamWriteValue64_v2", 1), (2, "cuLaunchKernel", 2)] {
            HOLD.store(false, Ordering::SeqCst);
            let case = format!("step {step}, call {nth} to {entry} failing");
            let primary = Engine::new(0).unwrap();
            let ranks = ranks::two_ranks_configured(Duration::from_millis(500), |_, config| config.with_slots(2));
            let engine = ranks.0.engine(0, &primary).unwrap().clone();
            let earlier: Vec<CudaSlice<u32>> =
                (0..step).map(|t| ranks.0.enter(0).and_then(|_stage| Ok(engine.htod(&[t; N])?)).unwrap()).collect();
            for x in &earlier {
                ranks.0.enter(0).and_then(|_stage| ranks.0.tx(0, x, N)).unwrap();
            }
            // Owned by the primary engine's stream, not the stage's: only the rule orders its free
            // after the stage stream's copy.
            let input = primary.htod(&[7u32; N]).unwrap();
            let stream = Arc::clone(ranks.0.stage_stream(0).unwrap());
            double.gate(&stream, &HOLD);
            let violations = double.violations();
            double.fail(entry, nth, OUT_OF_MEMORY);
            let sent = ranks.0.enter(0).and_then(|_stage| ranks.0.tx(0, &input, N));
            double.clear_faults();
            assert!(
                sent.as_ref().is_err_and(|e| e.to_string().contains(entry.trim_end_matches("_v2"))),
                "{case}: the send gave {sent:?}, not the call's error"
            );
            drop(input);
            // The input's free runs on the primary engine's stream, after what it waits for; the
            // stage stream is let go meanwhile (it would hold the wait for good).
            let opener = std::thread::spawn(|| {
                std::thread::sleep(Duration::from_millis(300));
                HOLD.store(true, Ordering::SeqCst);
            });
            let synchronized = primary.synchronize();
            opener.join().unwrap();
            let _ = crate::drop_ranks_within((earlier, ranks, stream), Duration::from_secs(15), &case);
            double.flush();
            assert_eq!(double.violations(), violations, "{case}: {}", double.last_violation());
            synchronized.unwrap();
        }
    });
}

/// The cancellable copy's kernels through the double's C twins, launched as the sending rank
/// launches them: every alignment and size copied exactly with the gate below the release value,
/// nothing written and "released" signalled at it (`tests/common/gated_kernels.rs`; the GPU tier
/// runs the same on the kernels themselves, and races a release with the copy). A twin that
/// copies whatever the gate says (mutation `double-gated-copy-ungated`) or signals the value
/// whatever it says (`double-gated-signal-ungated`) fails it.
#[test]
fn the_gated_copy_copies_every_alignment_and_writes_nothing_once_released() {
    with_double("the_gated_copy_copies_every_alignment_and_writes_nothing_once_released", |_| {
        let engine = Engine::new(0).unwrap();
        crate::gated_kernels::the_gated_copy_copies_every_alignment_and_writes_nothing_once_released(&engine);
        // The double runs a copy whole (before or after the release), never a part of it.
        let outcomes =
            crate::gated_kernels::a_release_during_the_copy_never_leaves_a_part_signalled_filled(&engine, 1, 2);
        assert_eq!(outcomes.part_released, 0, "{outcomes:?}");
    });
}

/// A send whose flagged copy queued a wait for its slot (step 2 of two slots, rank 1 holding
/// both) and then failed to note its buffers' uses (the ordering rule's event record fails):
/// the rule then waits on the host for the stream, whose wait only the receiving rank's freeing
/// of the slot or a release meets. The `tx` fails at once, naming the call: the copy releases
/// its gates before that wait (the link's failure, which needs the locks the `tx` holds, follows
/// the copy). Without that release (mutation `ipc-unnoted-wait-unreleased`) the `tx` waits until
/// the link's watchdog, which cannot read the connection while the `tx` holds it, takes the peer
/// for silent (the peer timeout), and reports that silence.
#[test]
fn a_send_whose_note_fails_behind_a_queued_wait_fails_at_once_naming_the_call() {
    with_double("a_send_whose_note_fails_behind_a_queued_wait_fails_at_once_naming_the_call", |double| {
        let timeout = Duration::from_millis(800);
        let primary = Engine::new(0).unwrap();
        let ranks = Arc::new(ranks::two_ranks_configured(timeout, |_, config| config.with_slots(2)));
        let engine = ranks.0.engine(0, &primary).unwrap().clone();
        let inputs: Arc<Vec<CudaSlice<u32>>> = Arc::new(
            (0..3u32).map(|t| ranks.0.enter(0).and_then(|_stage| Ok(engine.htod(&[t; N])?)).unwrap()).collect(),
        );
        for x in &inputs[..2] {
            ranks.0.enter(0).and_then(|_stage| ranks.0.tx(0, x, N)).unwrap();
        }
        double.fail("cuEventRecord", 1, OUT_OF_MEMORY);
        let (finished, sender) = send_on_a_thread(&ranks, &inputs, 2);
        let sent = finished.recv_timeout(4 * timeout);
        double.clear_faults();
        let (sent, took) = sent.expect("the send did not return");
        // The ranks are dropped here, their drop errors (the failed boundary's) taken: left
        // behind, they would be another test's.
        sender.join().unwrap();
        let _ = crate::drop_ranks_within((inputs, ranks), Duration::from_secs(15), "the ranks");
        assert!(
            sent.as_ref().is_err_and(|e| e.to_string().contains("cuEventRecord")) && took < timeout / 2,
            "after {took:?}: {sent:?}"
        );
    });
}

/// A receiving rank whose stage holds every slot (it took no step yet) learns of the sending
/// rank's failure within a poll interval or so: its receiver thread, asleep until a slot frees
/// for the next step, watches the link and the connection meanwhile. The failing rank's `tx`
/// returns at once: its failure waits until the next rank knows (at most the peer timeout, see
/// `Link::fail`). Without the watch (mutation `fill-wait-unwatched`) the receiver sleeps on, and
/// the `tx` takes the whole peer timeout.
#[test]
fn a_receiver_whose_stage_holds_every_slot_learns_of_the_senders_failure_at_once() {
    with_double("a_receiver_whose_stage_holds_every_slot_learns_of_the_senders_failure_at_once", |double| {
        let timeout = Duration::from_millis(1500);
        let primary = Engine::new(0).unwrap();
        let ranks = ranks::two_ranks_configured(timeout, |_, config| config.with_slots(2));
        let engine = ranks.0.engine(0, &primary).unwrap().clone();
        let inputs: Vec<CudaSlice<u32>> =
            (0..3u32).map(|t| ranks.0.enter(0).and_then(|_stage| Ok(engine.htod(&[t + 1; N])?)).unwrap()).collect();
        for x in &inputs[..2] {
            ranks.0.enter(0).and_then(|_stage| ranks.0.tx(0, x, N)).unwrap();
        }
        // Both steps copied: rank 1's receiver awaits step 2, whose announcement finds no free
        // slot there.
        let deadline = std::time::Instant::now() + Duration::from_secs(5);
        while !matches!(ranks.1.receiver_state(0).unwrap(), Some(ReceiverState::AwaitingRecord { step: 2, .. })) {
            assert!(std::time::Instant::now() < deadline, "{:?}", ranks.1.receiver_state(0));
            // The double runs a stream's work when it is waited for.
            ranks.0.synchronize().unwrap();
            std::thread::sleep(Duration::from_millis(1));
        }
        // Step 2 is announced (rank 1's receiver then waits for a slot), its send queues its wait
        // for the slot, then its copy kernel's launch fails.
        double.fail("cuLaunchKernel", 1, OUT_OF_MEMORY);
        let start = std::time::Instant::now();
        let sent = ranks.0.enter(0).and_then(|_stage| ranks.0.tx(0, &inputs[2], N));
        let took = start.elapsed();
        double.clear_faults();
        assert!(
            sent.as_ref().is_err_and(|e| e.to_string().contains("cuLaunchKernel")) && took < timeout / 3,
            "after {took:?}: {sent:?}"
        );
        let stopped = std::time::Instant::now() + timeout / 3;
        while !matches!(ranks.1.receiver_state(0).unwrap(), Some(ReceiverState::Stopped)) {
            assert!(std::time::Instant::now() < stopped, "rank 1's receiver: {:?}", ranks.1.receiver_state(0));
            std::thread::sleep(Duration::from_millis(1));
        }
        // Dropped here, their drop errors (the failed boundary's) taken: left behind, they would
        // be another test's.
        let _ = crate::drop_ranks_within((inputs, ranks), Duration::from_secs(15), "the ranks");
    });
}

/// On a driver that cannot run the helper kernels (CUDA 12.4: their PTX is too new), a copy that
/// waits for its slot stays on the copy engine, and a release of its wait lets it run into the
/// slot whatever the receiving rank does with it (module docs of `pp::remote::ipc`, "Failure:":
/// only a failure the receiving rank knows of releases, and then the slot is never trusted). A
/// send whose notes fail behind such a wait must not release it early: the receiving rank, which
/// knows of no failure, still reads the slot lent in place with the step before, and must read
/// that step, not the copy of the next. Here step 0 is lent in place in rank 1's one slot, step
/// 1's copy waits for it, and its notes fail; rank 1 reads its lent slot while the `tx` is in
/// flight, then drops the guard.
#[test]
fn a_send_whose_note_fails_on_a_driver_without_the_helper_kernels_writes_no_slot_still_lent() {
    with_double("a_send_whose_note_fails_on_a_driver_without_the_helper_kernels_writes_no_slot_still_lent", |_| {
        let library = double::build(&["PPNRT_DOUBLE_CUDA_12_4"]).expect("the double builds");
        crate::scenarios::run_child("ipc_gated::child_a_note_failing_behind_a_copy_engine_wait", &library, &[]);
    });
}

#[test]
#[ignore = "runs in a child process of a_send_whose_note_fails_on_a_driver_without_the_helper_kernels_writes_no_slot_still_lent"]
fn child_a_note_failing_behind_a_copy_engine_wait() {
    assert!(std::env::var_os("PPNRT_DOUBLE_CHILD").is_some(), "run through the parent test");
    let Some((_serial, double)) = double::setup("child_a_note_failing_behind_a_copy_engine_wait") else {
        panic!("no double")
    };
    let primary = Engine::new(0).unwrap();
    let timeout = Duration::from_secs(2);
    let wait = Duration::from_secs(5);
    let ranks = Arc::new(ranks::two_ranks_configured(timeout, |_, config| config.with_slots(1)));
    assert_eq!(ranks.0.plan().boundaries[0].transport, ppnrt::Transport::Ipc, "{}", ranks.0.plan());
    let (e0, e1) = (ranks.0.engine(0, &primary).unwrap().clone(), ranks.1.engine(1, &primary).unwrap().clone());
    // Made on rank 0's stage stream: the send's only event record is its note.
    let steps: Arc<Vec<CudaSlice<u32>>> =
        Arc::new((0..2u32).map(|t| ranks.0.enter(0).and_then(|_stage| Ok(e0.htod(&[t + 7; N])?)).unwrap()).collect());
    let stage1 = ranks.1.enter(1).unwrap();
    ranks.0.enter(0).and_then(|_stage| ranks.0.tx(0, &steps[0], N)).unwrap();
    let lent = ranks.1.rx_in_place_wait::<u32>(0, 0, N, wait).unwrap();
    double.fail("cuEventRecord", 1, OUT_OF_MEMORY);
    let (finished, sender) = send_on_a_thread(&ranks, &steps, 1);
    // Well within the peer timeout: rank 1, which knows of no failure, reads its lent slot.
    std::thread::sleep(Duration::from_millis(300));
    let seen = e1.dtoh(&lent.view().unwrap()).unwrap();
    double.clear_faults();
    drop(lent);
    drop(stage1);
    let sent = finished.recv_timeout(4 * timeout).expect("the send returned");
    sender.join().unwrap();
    let errors = crate::drop_ranks_within((steps, ranks), Duration::from_secs(15), "the ranks");
    assert!(
        seen == vec![7u32; N],
        "step 0's slot, still lent, was written: {:?}... (tx: {sent:?}; drops: {errors:?})",
        &seen[..4]
    );
    double.flush();
    assert_eq!(double.violations(), 0, "{}", double.last_violation());
}
