//! NCCL between two ranks: on a machine with two GPUs and NCCL (or, without a GPU, through the
//! driver and NCCL doubles), two ranks in one process
//! exchange buffers bitwise through `NcclComm` send/recv, with blocking and with non-blocking
//! (watched) communicators; a watched join that no other rank answers ends when its caller
//! stops waiting.
//! `PPNRT_REQUIRE_NCCL=1` turns a missing NCCL into a failure instead of a skip.

#[path = "../common/mod.rs"]
mod common;
#[path = "../common/double.rs"]
mod double;

use std::process::Command;
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::needs::{Gpus, Needs, requires};
use common::say;
use ppnrt::nccl::{MAX_GROUP_OPS, NONBLOCKING_VERSION, NcclComm, NcclError, NcclUniqueId, P2p, group};
use ppnrt::{CudaSlice, Engine};

/// `gpus` devices and NCCL (or the doubles), or `None` after saying why the test skips
/// (`PPNRT_REQUIRE_NCCL=1` turns a missing NCCL into a failure).
fn nccl_ready(test: &str, gpus: i32) -> Option<Gpus> {
    if double::doubles_unless_a_gpu() {
        say(&format!("{test}: no GPU: through the driver and NCCL doubles"));
    }
    requires(test, Needs::gpus(gpus).nccl())
}

#[test]
fn two_ranks_exchange_buffers_bitwise() {
    let test = "two_ranks_exchange_buffers_bitwise";
    let Some(gpus) = nccl_ready(test, 2) else { return };
    let loaded = gpus.nccl();
    say(&format!("{test}: NCCL {} from {}", loaded.version(), loaded.library()));
    for watched in [false, true] {
        exchange(test, watched);
    }
}

/// Two ranks (threads, one GPU each) exchange 4 MiB each way in one group, through blocking or
/// watched (non-blocking) communicators.
fn exchange(test: &str, watched: bool) {
    let id = NcclUniqueId::new().unwrap();
    // The id crosses as bytes, as it would between processes.
    let bytes = id.to_bytes();
    let n = 1 << 20;
    // Neither rank drops its communicator before both checked theirs (the NCCL double reports
    // a peer's closed connection as an asynchronous error).
    let checked = &std::sync::Barrier::new(2);
    let results: Vec<(u64, u64)> = std::thread::scope(|scope| {
        let handles: Vec<_> = (0..2)
            .map(|rank| {
                scope.spawn(move || {
                    let engine = Engine::new(rank).unwrap();
                    let id = NcclUniqueId::from_bytes(&bytes);
                    let comm = if watched {
                        NcclComm::init_rank_watched(engine.context(), 2, &id, rank, Duration::from_secs(60), || {
                            Ok::<(), NcclError>(())
                        })
                        .unwrap()
                    } else {
                        NcclComm::init_rank(engine.context(), 2, &id, rank).unwrap()
                    };
                    assert!(matches!(
                        NcclComm::init_rank(engine.context(), 2, &id, 2),
                        Err(NcclError::InvalidRank { rank: 2, n_ranks: 2, .. })
                    ));
                    let stream: Arc<_> = engine.stream().unwrap();
                    let mut mine = CudaSlice::<u32>::alloc(&stream, n).unwrap();
                    engine.fill_pattern(&mut mine, 100 + rank as u32).unwrap();
                    let mut theirs = CudaSlice::<u32>::alloc(&stream, n).unwrap();
                    // Each rank sends its buffer and receives the other's, in one group; the
                    // receive is read at once on another stream, with no join (the group notes
                    // its uses after NCCL enqueued its work).
                    // SAFETY: both ranks send and receive `n` u32 each.
                    let pair = unsafe {
                        [P2p::send(&comm, &stream, &mine, 1 - rank), P2p::recv(&comm, &stream, &mut theirs, 1 - rank)]
                    };
                    group(&pair).unwrap();
                    let reader = ppnrt::CudaStream::new(engine.context()).unwrap();
                    let mut copy = CudaSlice::<u32>::alloc(&reader, n).unwrap();
                    reader.memcpy_dtod(&theirs, &mut copy).unwrap();
                    assert_eq!(engine.checksum(&copy).unwrap(), engine.checksum(&theirs).unwrap());
                    // Refused before anything is issued: a rank outside the communicator, too
                    // many operations.
                    // SAFETY: refused before anything is issued (nothing is sent).
                    let bad =
                        unsafe { [P2p::send(&comm, &stream, &mine, 1 - rank), P2p::send(&comm, &stream, &mine, 7)] };
                    assert!(matches!(group(&bad), Err(NcclError::InvalidRank { rank: 7, n_ranks: 2, .. })));
                    let many: Vec<P2p<'_>> = (0..=MAX_GROUP_OPS)
                        // SAFETY: refused before anything is issued (too many operations).
                        .map(|_| unsafe { P2p::send(&comm, &stream, &mine, 1 - rank) })
                        .collect();
                    assert!(matches!(
                        group(&many),
                        Err(NcclError::GroupTooLarge { ops, max: MAX_GROUP_OPS }) if ops == MAX_GROUP_OPS + 1
                    ));
                    comm.async_error().unwrap();
                    // A communicator keeps alive no more than a few of the streams its caller
                    // posted on and dropped (it notes each for the captures' look at the NCCL
                    // work in flight).
                    let dropped: Vec<std::sync::Weak<ppnrt::CudaStream>> = (0..20)
                        .map(|i| {
                            let fresh = ppnrt::CudaStream::new(engine.context()).unwrap();
                            let mut buf = CudaSlice::<u32>::alloc(&fresh, 16).unwrap();
                            engine.fill_pattern(&mut buf, i).unwrap();
                            // SAFETY: both ranks move 16 u32.
                            unsafe {
                                if rank == 0 { comm.send(&fresh, &buf, 1) } else { comm.recv(&fresh, &mut buf, 0) }
                            }
                            .unwrap();
                            drop(buf);
                            Arc::downgrade(&fresh)
                        })
                        .collect();
                    let alive = dropped.iter().filter(|stream| stream.strong_count() > 0).count();
                    assert!(alive <= 8, "rank {rank}: {alive} of 20 dropped streams still alive");
                    checked.wait();
                    (engine.checksum(&theirs).unwrap(), engine.checksum(&mine).unwrap())
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    // Rank 0 received rank 1's buffer and the other way round.
    assert_eq!(results[0].0, results[1].1, "rank 0 received rank 1's data");
    assert_eq!(results[1].0, results[0].1, "rank 1 received rank 0's data");
    assert_ne!(results[0].1, results[1].1, "the two payloads differ");
    let kind = if watched { "watched (non-blocking)" } else { "blocking" };
    say(&format!("{test}: {kind} communicators: {} bytes each way, bitwise", n * 4));
}

/// A watched join of rank 0 of 2 that no rank 1 ever answers ends with the caller's error as
/// soon as the caller stops waiting (after 1 s here); NCCL's blocking join would wait for ever.
#[test]
fn a_watched_join_nobody_answers_ends_when_the_caller_stops_waiting() {
    let test = "a_watched_join_nobody_answers_ends_when_the_caller_stops_waiting";
    let Some(gpus) = nccl_ready(test, 1) else { return };
    let loaded = gpus.nccl();
    if loaded.version() < NONBLOCKING_VERSION {
        say(&format!(
            "SKIPPED {test}: NCCL {} joins blocking (non-blocking joins need {NONBLOCKING_VERSION})",
            loaded.version()
        ));
        return;
    }
    let engine = Engine::new(0).unwrap();
    let id = NcclUniqueId::new().unwrap();
    let started = Instant::now();
    let mut polls = 0u64;
    let joined = NcclComm::init_rank_watched(engine.context(), 2, &id, 0, Duration::from_secs(60), || {
        polls += 1;
        if started.elapsed() < Duration::from_secs(1) {
            Ok(())
        } else {
            Err(NcclError::Aborted { what: "the test stopped waiting" })
        }
    });
    let took = started.elapsed();
    match joined {
        Err(NcclError::Aborted { what: "the test stopped waiting" }) => {}
        other => panic!("{test}: expected the caller's error, got {other:?}"),
    }
    say(&format!("{test}: the join ended {took:?} after it began ({polls} polls)"));
    assert!(took < Duration::from_secs(5), "the join took {took:?} to end");
    assert!(polls > 10, "the join was polled {polls} times");
    // The device is still usable.
    let stream = engine.stream().unwrap();
    let mut x = CudaSlice::<u32>::alloc(&stream, 1024).unwrap();
    engine.fill_pattern(&mut x, 5).unwrap();
    stream.synchronize().unwrap();
}

/// A call NCCL completes in the background that never completes (the first send and receive of
/// watched communicators, whose connection the NCCL double stalls) fails with
/// `NcclError::TimedOut` after the communicator's bound, and the communicator is aborted: the
/// next call is `NcclError::Aborted`. Through the doubles only (real NCCL cannot be told to
/// stall); the two ranks run in a child process, whose environment stalls the double.
#[test]
fn a_background_call_that_never_completes_times_out_and_aborts() {
    let test = "a_background_call_that_never_completes_times_out_and_aborts";
    if !double::doubles_unless_a_gpu() {
        say(&format!("SKIPPED {test}: needs the NCCL double, which can stall a connection (a GPU is present)"));
        return;
    }
    let output = stalled_child(test, &[]);
    assert_eq!(output.lines().filter(|line| line.contains("STALLED")).count(), 2, "{output}");
}

/// An abort that never returns (NCCL's waits for a thread of its own, which may be stuck inside
/// the driver) keeps no caller: the call whose background work timed out returns its
/// `NcclError::TimedOut` one abort bound later, the abort is reported as
/// `NcclError::AbortStuck`, the communicator refuses every later call and its drop returns at
/// once. Through the doubles only; the ranks run in a child process whose NCCL double stalls the
/// connection and never returns from `ncclCommAbort`, and which must end within 60 s.
#[test]
fn an_abort_that_never_returns_keeps_no_caller() {
    let test = "an_abort_that_never_returns_keeps_no_caller";
    if !double::doubles_unless_a_gpu() {
        say(&format!("SKIPPED {test}: needs the NCCL double, whose abort can hang (a GPU is present)"));
        return;
    }
    let output = stalled_child(test, &[("PPNRT_NCCL_DOUBLE_ABORT_HANGS", "1")]);
    assert_eq!(output.lines().filter(|line| line.contains("abort stuck")).count(), 2, "{output}");
}

/// Runs `stalled_connection_child` in a child process whose NCCL double stalls every connection
/// (and takes `env` besides), for at most 60 s (a child still running then fails `test`: a call
/// kept its caller); checks that it succeeded, says its `STALLED` lines, and returns its output.
fn stalled_child(test: &str, env: &[(&str, &str)]) -> String {
    let mut child = Command::new(std::env::current_exe().unwrap())
        .args(["stalled_connection_child", "--exact", "--ignored", "--nocapture", "--test-threads=1"])
        .env("PPNRT_NCCL_DOUBLE_STALL_CONNECT", "1")
        .envs(env.iter().copied())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(60);
    while child.try_wait().unwrap().is_none() {
        if Instant::now() > deadline {
            child.kill().unwrap();
            let out = child.wait_with_output().unwrap();
            panic!("{test}: the child hung (a call kept its caller):\n{}", String::from_utf8_lossy(&out.stdout));
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let out = child.wait_with_output().unwrap();
    let output = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "{test}: the child failed:\n{output}");
    for line in output.lines().filter_map(|line| line.find("STALLED").map(|at| &line[at..])) {
        say(&format!("{test}: {line}"));
    }
    output
}

#[test]
#[ignore = "the child of a_background_call_that_never_completes_times_out_and_aborts"]
fn stalled_connection_child() {
    assert!(std::env::var_os("PPNRT_NCCL_DOUBLE_STALL_CONNECT").is_some(), "run through the parent test");
    assert!(double::doubles_unless_a_gpu());
    // With the double's abort hanging, each call that times out also waits one bound for it.
    let abort_hangs = std::env::var_os("PPNRT_NCCL_DOUBLE_ABORT_HANGS").is_some();
    let id = NcclUniqueId::new().unwrap();
    let bytes = id.to_bytes();
    let bound = Duration::from_secs(1);
    std::thread::scope(|scope| {
        for rank in 0..2 {
            scope.spawn(move || {
                let engine = Engine::new(rank).unwrap();
                let id = NcclUniqueId::from_bytes(&bytes);
                let comm =
                    NcclComm::init_rank_watched(engine.context(), 2, &id, rank, bound, || Ok::<(), NcclError>(()))
                        .unwrap();
                let stream: Arc<_> = engine.stream().unwrap();
                let mut buf = CudaSlice::<u32>::alloc(&stream, 256).unwrap();
                let started = Instant::now();
                // SAFETY: both ranks move 256 u32.
                let first =
                    unsafe { if rank == 0 { comm.send(&stream, &buf, 1) } else { comm.recv(&stream, &mut buf, 0) } };
                let took = started.elapsed();
                match first {
                    Err(NcclError::TimedOut { waited, .. }) if waited == bound => {}
                    other => panic!("rank {rank}: expected TimedOut, got {other:?}"),
                }
                let least = if abort_hangs { bound * 2 } else { bound };
                assert!(took >= least && took < bound * 5, "rank {rank}: the call took {took:?}");
                // SAFETY: refused (the communicator is aborted), nothing is sent.
                let next = unsafe { comm.send(&stream, &buf, 1 - rank) };
                assert!(matches!(next, Err(NcclError::Aborted { .. })), "rank {rank}: {next:?}");
                println!("STALLED rank {rank}: TimedOut after {took:?}, then Aborted");
                if abort_hangs {
                    let dropped = Instant::now();
                    drop(comm);
                    assert!(dropped.elapsed() < bound, "rank {rank}: the abandoned communicator's drop waited");
                    println!("STALLED rank {rank}: abort stuck, communicator abandoned, dropped at once");
                }
            });
        }
    });
    if abort_hangs {
        let stuck = ppnrt::take_drop_errors()
            .into_iter()
            .filter(|e| matches!(e.downcast_ref(), Some(NcclError::AbortStuck { waited, .. }) if *waited == bound))
            .count();
        assert_eq!(stuck, 2, "each rank's abort is reported as AbortStuck");
    }
}
