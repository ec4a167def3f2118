//! The teardown of boundaries between ranks, through the driver and NCCL doubles: a sending
//! rank's close checks its own sends as well as the receiving rank's confirmation, and a
//! receiving rank that stops with a receive pending tells a slow peer from a lost step.

use crate::{double, ranks};

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use double::with_double;
use ppnrt::pp::{ProtocolFault, ReceiverState};
use ppnrt::{CudaSlice, Engine, Error, PpError, PpNRt, ProcessTransport};

const N: usize = 2048;

/// Stage `stage`'s input of step `seed`: `N` pattern values on its stream.
fn input(rt: &PpNRt, primary: &Engine, stage: usize, seed: u32) -> CudaSlice<u32> {
    let _stage = rt.enter(stage).unwrap();
    let engine = rt.engine(stage, primary).unwrap();
    let mut x = engine.alloc::<u32>(N).unwrap();
    engine.fill_pattern(&mut x, seed).unwrap();
    x
}

/// Drops `what` on a thread of its own; the errors the drop recorded, or `None` when it did not
/// return within `limit` (the thread is left behind, and ends with the test process).
fn drop_within<T: Send + 'static>(what: T, limit: Duration) -> Option<Vec<ppnrt::DropError>> {
    let (done, dropped) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        drop(what);
        let _ = done.send(ppnrt::take_drop_errors());
    });
    dropped.recv_timeout(limit).ok()
}

fn peer_failed(e: &ppnrt::DropError) -> Option<&str> {
    match e.downcast_ref() {
        Some(Error::Pipeline(PpError::PeerFailed { reason, .. })) => Some(reason),
        _ => None,
    }
}

/// Sets an environment variable of the NCCL double for as long as it lives.
struct DoubleSetting(&'static str);

impl DoubleSetting {
    fn on(name: &'static str, value: &str) -> DoubleSetting {
        // SAFETY: tests through the double run one at a time (`with_double` holds its lock), and
        // nothing else of this process reads the environment while one of them sets it.
        unsafe { std::env::set_var(name, value) };
        DoubleSetting(name)
    }
}

impl Drop for DoubleSetting {
    fn drop(&mut self) {
        // SAFETY: as in `on`.
        unsafe { std::env::remove_var(self.0) };
    }
}

/// A receiving rank that lies over NCCL (it takes each step without posting its receive, then
/// confirms the close: [`ProtocolFault::ConfirmWithoutReceiving`]) cannot hang the sending
/// rank's drop. NCCL's sends larger than its buffers complete only once their receive ran (the
/// NCCL double's `PPNRT_NCCL_DOUBLE_SEND_WAITS_RECV`), so the sending rank's stream still waits
/// in its last send when the confirmation comes, which an honest peer never sends before every
/// step was received: the close finds the send pending within the peer timeout and fails the
/// boundary (aborted: the abort ends the send), and the drop returns, recording a `PeerFailed`
/// that names the send. Taking the confirmation as a clean close (mutation
/// `nccl-lying-close-trusted`) leaves the drop's stream synchronisation waiting for ever. An
/// honest receiving rank's close stays clean, no error recorded, also while the caller's own
/// work queued on the sending stage's stream after the last send is still held: the close looks
/// at an event recorded right after the send, not at the stream's end (mutation
/// `nccl-close-witness-at-stream-end` fails that close for want of the caller's work).
#[test]
fn a_close_confirmed_while_an_nccl_send_waits_for_its_receive_cannot_hang_the_sending_ranks_drop() {
    static HELD_OPEN: AtomicBool = AtomicBool::new(false);
    with_double(
        "a_close_confirmed_while_an_nccl_send_waits_for_its_receive_cannot_hang_the_sending_ranks_drop",
        |double| {
            let _waits = DoubleSetting::on("PPNRT_NCCL_DOUBLE_SEND_WAITS_RECV", "1");
            let timeout = Duration::from_millis(800);
            let primary = Engine::new(0).unwrap();
            for lying in [false, true] {
                let ranks = ranks::two_ranks_configured(timeout, |rank, config| {
                    let config = config.with_process_transport(ProcessTransport::Nccl);
                    if rank == 1 && lying { config.with_fault(ProtocolFault::ConfirmWithoutReceiving) } else { config }
                });
                for seed in [1, 2] {
                    let x = input(&ranks.0, &primary, 0, seed);
                    ranks.0.enter(0).and_then(|_stage| ranks.0.tx(0, &x, N)).unwrap();
                }
                let (zero, one) = ranks;
                let start = Instant::now();
                let errors = if lying {
                    drop_within(zero, 4 * timeout)
                        .unwrap_or_else(|| panic!("the sending rank's drop took over {:?}", start.elapsed()))
                } else {
                    // The caller's next work on the sending stage's stream, held past the close's
                    // bound (a long kernel, say).
                    HELD_OPEN.store(false, Ordering::Release);
                    double.gate(zero.stage_stream(0).unwrap(), &HELD_OPEN);
                    let opener = std::thread::spawn(|| {
                        std::thread::sleep(Duration::from_millis(1600));
                        HELD_OPEN.store(true, Ordering::Release);
                    });
                    let errors = drop_within(zero, Duration::from_secs(10))
                        .unwrap_or_else(|| panic!("the sending rank's drop took over {:?}", start.elapsed()));
                    opener.join().unwrap();
                    errors
                };
                let took = start.elapsed();
                if lying {
                    assert!(took < 3 * timeout, "the sending rank's drop took {took:?}");
                    let reasons: Vec<&str> = errors.iter().filter_map(peer_failed).collect();
                    assert!(
                        reasons.len() == errors.len()
                            && reasons.iter().any(|reason| reason.contains("send of step 1 had not completed")),
                        "the lie is not reported typed, naming the send: {errors:?}"
                    );
                } else {
                    assert!(errors.is_empty(), "an honest peer's close: {errors:?}");
                }
                let errors = drop_within(one, Duration::from_secs(10)).expect("the receiving rank's drop returned");
                assert!(errors.is_empty(), "lying {lying}: the receiving rank's drop: {errors:?}");
            }
        },
    );
}

/// Two ranks of a pipeline of four stages over NCCL, the stages alternating between them (rank 0
/// runs stages 0 and 2, rank 1 stages 1 and 3): rank 1 receives two boundaries from rank 0 (0
/// and 2) and sends one to it (1). Each configuration passed through `configure(rank, config)`.
fn alternating_ranks(
    timeout: Duration,
    configure: impl Fn(usize, ppnrt::PpConfig) -> ppnrt::PpConfig + Sync,
) -> (PpNRt, PpNRt) {
    let mut ranks = ranks::ranks_of(&[0, 1, 0, 1], &[0, 1, 0, 1], timeout, |rank, config| {
        configure(rank, config.with_process_transport(ProcessTransport::Nccl))
    })
    .into_iter();
    (ranks.next().unwrap(), ranks.next().unwrap())
}

/// A receiving rank whose runtime stops while its peer is slow, not gone, takes the steps the
/// peer announced: each receiver drains its pending receive within the peer timeout (T) from when
/// it stopped, and the drop records nothing; a peer slower than that is a `PeerFailed` recorded by
/// the drop. Here rank 1 stops with a receive pending on each of its two boundaries from rank 0,
/// whose sends wait behind its stages' own work (held on gates).
/// - Within the timeout: boundary 2's receive is still being posted when the drop begins (the
///   NCCL double holds the post for T / 2), so its drain runs from T / 2 to 1.5 T; boundary 0's
///   step comes at 0.4 T, boundary 2's at 1.2 T. Rank 1's drains must keep showing rank 0 signs
///   of life: a rank that drains in silence (mutation `drain-in-silence`: the watchdog stopped
///   before the receivers) looks hung to rank 0 after T, which fails the boundary and aborts the
///   very send the drain waits for, and the slow peer's step is lost as if it never came.
/// - Past it: boundary 0's step comes at 0.4 T, boundary 2's at 1.6 T, both receives posted
///   before the drop: the drains run at once and the drop ends about T after it began; drains one
///   after another (mutation `receivers-drain-one-by-one`) end 1.4 T after, boundary 2's drain
///   beginning only once boundary 0's ended.
#[test]
fn a_runtime_stopping_with_receives_pending_takes_a_slow_peers_steps_and_fails_only_past_the_timeout() {
    static OPEN_0: AtomicBool = AtomicBool::new(false);
    static OPEN_2: AtomicBool = AtomicBool::new(false);
    with_double(
        "a_runtime_stopping_with_receives_pending_takes_a_slow_peers_steps_and_fails_only_past_the_timeout",
        |double| {
            let _orphan = DoubleSetting::on("PPNRT_NCCL_DOUBLE_ORPHAN_RECV", "1");
            let _async = DoubleSetting::on("PPNRT_NCCL_DOUBLE_ASYNC_SEND", "1");
            let timeout = Duration::from_millis(1500);
            let primary = Engine::new(0).unwrap();
            let state = |rt: &PpNRt, b: usize| rt.receiver_state(b).unwrap().unwrap();
            let until = |what: &str, done: &dyn Fn() -> bool| {
                let deadline = Instant::now() + Duration::from_secs(5);
                while !done() {
                    assert!(Instant::now() < deadline, "{what}");
                    std::thread::sleep(Duration::from_millis(1));
                }
            };
            for past_the_timeout in [false, true] {
                let (zero, one) = alternating_ranks(timeout, |_, config| config);
                // Rank 0 announces a step on boundaries 0 and 2; each send waits behind a gate.
                OPEN_0.store(false, Ordering::Release);
                OPEN_2.store(false, Ordering::Release);
                let mut slow_post = None;
                for (stage, open) in [(0, &OPEN_0), (2, &OPEN_2)] {
                    if stage == 2 && !past_the_timeout {
                        // Boundary 0's receive is posted, no other is: only boundary 2's post
                        // reads the setting.
                        until("boundary 0's receive posted", &|| {
                            matches!(state(&one, 0), ReceiverState::AwaitingRecord { step: 1, .. })
                        });
                        let held_us = (timeout / 2).as_micros().to_string();
                        slow_post = Some(DoubleSetting::on("PPNRT_NCCL_DOUBLE_POST_US", &format!("0:{held_us}")));
                    }
                    let x = input(&zero, &primary, stage, 30 + stage as u32);
                    double.gate(zero.stage_stream(stage).unwrap(), open);
                    zero.enter(stage).and_then(|_stage| zero.tx(stage, &x, N)).unwrap();
                }
                let posted = |b: usize| matches!(state(&one, b), ReceiverState::AwaitingRecord { step: 1, .. });
                match past_the_timeout {
                    false => until("boundary 2's receive being posted", &|| {
                        matches!(state(&one, 2), ReceiverState::Posting { step: 0, .. })
                    }),
                    true => until("both receives posted", &|| posted(0) && posted(2)),
                }
                let start = Instant::now();
                let opener = std::thread::spawn(move || {
                    std::thread::sleep(timeout * 4 / 10);
                    OPEN_0.store(true, Ordering::Release);
                    std::thread::sleep(if past_the_timeout { timeout * 12 / 10 } else { timeout * 8 / 10 });
                    OPEN_2.store(true, Ordering::Release);
                });
                let errors = drop_within(one, Duration::from_secs(10)).expect("rank 1's drop returned");
                let took = start.elapsed();
                opener.join().unwrap();
                drop(slow_post);
                let reasons: Vec<&str> = errors.iter().filter_map(peer_failed).collect();
                if past_the_timeout {
                    assert!(
                        reasons.len() == errors.len()
                            && reasons.iter().any(|reason| reason.contains("stopped with a receive pending")),
                        "a peer slower than the timeout: rank 1's drop: {errors:?}"
                    );
                    // One peer timeout for both drains (and a margin for a loaded machine).
                    assert!(took < timeout * 12 / 10, "rank 1's drop took {took:?}");
                } else {
                    assert!(errors.is_empty(), "a peer slow within the timeout: rank 1's drop ({took:?}): {errors:?}");
                }
                // Rank 0 learns that rank 1 left (its boundaries fail); its drop returns.
                drop_within(zero, Duration::from_secs(10)).expect("rank 0's drop returned");
            }
        },
    );
}

/// A receiving rank whose runtime stops with a receive pending, when the peer's end ends that
/// receive without its data (the peer fails its boundary and aborts; the NCCL double then lets
/// the receive run cut short, reporting the peer's end as the communicator's asynchronous
/// error), fails the boundary: the receive stream drained, but not with the step. The step's
/// readback, pending across the drop, is refused (`PeerFailed`) instead of giving the slot's old
/// bytes as `Ok` (mutation `stop-drain-trusts-idle`).
#[test]
fn a_receive_the_peer_cut_short_while_the_runtime_stopped_is_never_read_back_as_ok() {
    static OPEN: AtomicBool = AtomicBool::new(false);
    with_double("a_receive_the_peer_cut_short_while_the_runtime_stopped_is_never_read_back_as_ok", |double| {
        let _async = DoubleSetting::on("PPNRT_NCCL_DOUBLE_ASYNC_SEND", "1");
        let timeout = Duration::from_millis(800);
        let primary = Engine::new(0).unwrap();
        let (zero, one) =
            ranks::two_ranks_configured(timeout, |_, config| config.with_process_transport(ProcessTransport::Nccl));
        // Rank 0 announces step 0; its send waits behind a gate.
        OPEN.store(false, Ordering::Release);
        let x = input(&zero, &primary, 0, 40);
        double.gate(zero.stage_stream(0).unwrap(), &OPEN);
        zero.enter(0).and_then(|_stage| zero.tx(0, &x, N)).unwrap();
        // Rank 1 takes it (over NCCL the receive returns once posted) and reads it back.
        let pending = {
            let _stage = one.enter(1).unwrap();
            let received = one.rx_wait::<u32>(0, 0, N, Duration::from_secs(5)).unwrap();
            one.readback(received).unwrap()
        };
        let dropping = std::thread::spawn(move || drop_within(one, Duration::from_secs(10)));
        std::thread::sleep(Duration::from_millis(200)); // rank 1's receiver drains
        // Rank 0's next send fails: it fails its boundary and aborts it.
        let y = input(&zero, &primary, 0, 41);
        double::nccl_double().fail("ncclSend", 1, crate::NCCL_INTERNAL_ERROR);
        let sent = zero.enter(0).and_then(|_stage| zero.tx(0, &y, N));
        double::nccl_double().clear_faults();
        assert!(sent.is_err(), "rank 0's failing send: {sent:?}");
        let errors = dropping.join().unwrap().expect("rank 1's drop returned");
        let outcome = pending.wait().map(<[u32]>::to_vec);
        OPEN.store(true, Ordering::Release);
        drop_within(zero, Duration::from_secs(10)).expect("rank 0's drop returned");
        assert!(
            matches!(&outcome, Err(Error::Pipeline(PpError::PeerFailed { .. }))),
            "a step cut short by the peer read back: {:?} (drop errors {errors:?})",
            outcome.as_ref().map(|values| &values[..4])
        );
    });
}

/// A receiving rank asked to close by a peer whose announced step never came fails the boundary
/// within the peer timeout of the close, even while that peer stays connected and silent (it
/// hangs in its close: here its failure is held back for seconds,
/// [`ProtocolFault::SlowToFail`], and its send waits behind its stage's own work): the receiver
/// thread's wait for its receives at the close is bounded. Unbounded (mutation
/// `close-drain-unbounded`), the receiver thread waits until the peer's connection ends, which a
/// hung peer's never does.
#[test]
fn a_close_whose_step_never_comes_fails_the_boundary_within_the_timeout_while_the_peer_hangs() {
    static OPEN: AtomicBool = AtomicBool::new(false);
    with_double(
        "a_close_whose_step_never_comes_fails_the_boundary_within_the_timeout_while_the_peer_hangs",
        |double| {
            let _orphan = DoubleSetting::on("PPNRT_NCCL_DOUBLE_ORPHAN_RECV", "1");
            let _async = DoubleSetting::on("PPNRT_NCCL_DOUBLE_ASYNC_SEND", "1");
            let timeout = Duration::from_millis(800);
            let hangs = Duration::from_secs(4);
            let primary = Engine::new(0).unwrap();
            let (zero, one) = ranks::two_ranks_configured(timeout, |rank, config| {
                let config = config.with_process_transport(ProcessTransport::Nccl);
                if rank == 0 { config.with_fault(ProtocolFault::SlowToFail(hangs.as_millis() as u64)) } else { config }
            });
            // Rank 0 announces step 0; its send waits behind a gate.
            OPEN.store(false, Ordering::Release);
            let x = input(&zero, &primary, 0, 50);
            double.gate(zero.stage_stream(0).unwrap(), &OPEN);
            zero.enter(0).and_then(|_stage| zero.tx(0, &x, N)).unwrap();
            std::thread::sleep(Duration::from_millis(100)); // rank 1 posts the receive
            let start = Instant::now();
            let dropping = std::thread::spawn(move || drop_within(zero, Duration::from_secs(20)));
            while !matches!(one.receiver_state(0).unwrap(), Some(ppnrt::pp::ReceiverState::Stopped))
                && start.elapsed() < hangs + 2 * timeout
            {
                std::thread::sleep(Duration::from_millis(10));
            }
            let stopped = start.elapsed();
            OPEN.store(true, Ordering::Release);
            dropping.join().unwrap().expect("rank 0's drop returned");
            let errors = drop_within(one, Duration::from_secs(10)).expect("rank 1's drop returned");
            assert!(
                stopped < 2 * timeout,
                "rank 1's receiver stopped {stopped:?} after rank 0's close began (peer timeout {timeout:?})"
            );
            assert!(
                errors.iter().filter_map(peer_failed).any(|reason| reason.contains("did not complete after the close")),
                "rank 1 records the lost step: {errors:?}"
            );
        },
    );
}

/// A sending rank that closes cleanly while the receiving rank's stage holds every slot (its
/// receiver thread waits for a slot for the last step announced, watching the connection): the
/// close is in progress, the connection open, and the stage takes its steps within the peer
/// timeout. Every step arrives whole and both drops record nothing, over NCCL and over IPC: the
/// receiver's watch fails a link only when the peer's end closed, which an honest sending rank
/// does only once its close is confirmed, after every step arrived.
#[test]
fn a_clean_close_while_the_receiving_stage_holds_every_slot_stays_clean() {
    with_double("a_clean_close_while_the_receiving_stage_holds_every_slot_stays_clean", |_| {
        let timeout = Duration::from_millis(1500);
        let primary = Engine::new(0).unwrap();
        let _ = ppnrt::take_drop_errors();
        for transport in [ProcessTransport::Nccl, ProcessTransport::Ipc] {
            let (zero, one) = ranks::two_ranks_configured(timeout, |_, config| {
                config.with_slots(2).with_process_transport(transport)
            });
            let inputs: Vec<CudaSlice<u32>> = (0..3).map(|t| input(&zero, &primary, 0, 50 + t)).collect();
            for x in &inputs {
                zero.enter(0).and_then(|_stage| zero.tx(0, x, N)).unwrap();
            }
            // Rank 1's receiver holds steps 0 and 1 and waits for a slot for step 2.
            let deadline = Instant::now() + Duration::from_secs(5);
            while !matches!(
                one.receiver_state(0).unwrap(),
                Some(ppnrt::pp::ReceiverState::AwaitingFreeSlot { step: 2, .. })
            ) {
                assert!(Instant::now() < deadline, "{transport}: {:?}", one.receiver_state(0));
                std::thread::sleep(Duration::from_millis(1));
            }
            // Rank 0 closes (its drop); rank 1's stage takes its steps a while later.
            let closing = std::thread::spawn(move || {
                drop((inputs, zero));
                ppnrt::take_drop_errors()
            });
            std::thread::sleep(timeout / 3);
            let e1 = one.engine(1, &primary).unwrap().clone();
            let taken: Vec<ppnrt::Result<Vec<u32>>> = (0..3)
                .map(|t| {
                    let _stage = one.enter(1)?;
                    let got = one.rx_wait::<u32>(0, t % 2, N, Duration::from_secs(5))?;
                    Ok(e1.dtoh(&got)?)
                })
                .collect();
            let zero_errors = closing.join().unwrap();
            let one_errors = drop_within(one, Duration::from_secs(10)).expect("rank 1's drop returned");
            let expected: Vec<Vec<u32>> = (0..3u32)
                .map(|t| {
                    let x = primary.alloc::<u32>(N).unwrap();
                    let mut x = x;
                    primary.fill_pattern(&mut x, 50 + t).unwrap();
                    primary.dtoh(&x).unwrap()
                })
                .collect();
            for (t, got) in taken.iter().enumerate() {
                assert!(
                    got.as_ref().is_ok_and(|v| *v == expected[t]),
                    "{transport}: step {t}: {:?}",
                    got.as_ref().err()
                );
            }
            assert!(zero_errors.is_empty() && one_errors.is_empty(), "{transport}: {zero_errors:?} {one_errors:?}");
        }
    });
}
