//! The teardown of boundaries between ranks, through the driver and NCCL doubles: a sending
//! rank's close checks its own sends as well as the receiving rank's confirmation, and a
//! receiving rank that stops with a receive pending tells a slow peer from a lost step.

use crate::{double, ranks};

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use double::with_double;
use ppnrt::pp::ProtocolFault;
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
