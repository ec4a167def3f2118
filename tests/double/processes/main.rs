//! A pipeline spanning processes: two ranks (this test binary again, one child process per rank,
//! each seeing one GPU) run 2, 4 and 8 stages, contiguous and alternating, over NCCL through
//! NVLink and over NCCL's socket transport on loopback (the stand-in for two hosts); the last
//! rank's outputs are compared bitwise, step by step, with one engine running the whole model.
//! Also: the contract across the wire (a length or type mismatch is a typed error on the
//! receiver and the data stays receivable; another rank's stage is refused), a rank killed
//! mid-run (the survivor gets a typed error within 10 s), and one rank under compute-sanitizer
//! memcheck.
//!
//! Needs NCCL and a GPU; skips (saying why) otherwise, and fails instead with
//! `PPNRT_REQUIRE_GPUS=1` / `PPNRT_REQUIRE_NCCL=1`. On a machine where no CUDA driver can be
//! loaded, the tests run through the driver double and the NCCL double
//! (`tests/driver_double/`), which move each step between the ranks over a Unix socket; what
//! only a GPU shows (NCCL's transports, memcheck) is then skipped, saying so. With one GPU the
//! two ranks share it: each gets a host id of its own (`NCCL_HOSTID`), so NCCL sees two hosts and
//! moves every step over its socket transport on loopback (the NVLink runs become socket runs,
//! checked from NCCL's log).

#[path = "../../common/mod.rs"]
mod common;
#[path = "../../common/double.rs"]
mod double;
#[path = "../../common/graphs.rs"]
mod graphs;
mod launch;
mod rank;

use std::collections::VecDeque;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use common::needs::{Needs, requires};
use common::{Rng, say};
use graphs::layers_of;
use ppnrt::{
    CaptureError, CaptureMode, CudaError, Engine, Error, PpConfig, PpError, PpNRt, StepGraphs, pp::PendingReadback,
    pp::ReceiverState,
};

use launch::*;
use rank::*;

const MODE_VAR: &str = "PPNRT_MP_MODE";
const STEPS_VAR: &str = "PPNRT_MP_STEPS";
const SEED_VAR: &str = "PPNRT_MP_SEED";
const OUT_VAR: &str = "PPNRT_MP_OUT";
const FAULT_VAR: &str = "PPNRT_MP_SKIP_TX_WAIT";
const DELAY_VAR: &str = "PPNRT_MP_MAX_DELAY_NS";
const IGNORE_SILENCE_VAR: &str = "PPNRT_MP_IGNORE_SILENCE";
/// A setup fault of one rank: `exit-before-comm-join` or `unwatched`.
const SETUP_FAULT_VAR: &str = "PPNRT_MP_SETUP_FAULT";
/// Graph mode: how long a rank waits before it captures its stages (ms).
const CAPTURE_DELAY_VAR: &str = "PPNRT_MP_CAPTURE_DELAY_MS";
const WAIT: Duration = Duration::from_secs(30);
/// The longest random device delay injected around a boundary (unless the test sets another).
const MAX_DELAY_NS: u64 = 40_000;

fn max_delay_ns() -> u64 {
    std::env::var(DELAY_VAR).ok().and_then(|v| v.parse().ok()).unwrap_or(MAX_DELAY_NS)
}

/// The length of step `t` (1 to 9000 elements; every rank draws the same). Steps come in runs of
/// six of one length, as a decode loop's steady size (boundaries from other ranks then receive
/// through captured graphs); a run's length is one of five lengths of the seed (so each slot's
/// captures are reused, and replaced when a slot keeps more sizes than it may), or, one run in
/// four, a fresh one (slots grow, and captures of their old memory must be dropped).
fn length_of(seed: u64, t: u64) -> usize {
    let run = t / 6;
    let mut draw = Rng::new(seed ^ run.wrapping_mul(0x9e37));
    if draw.below(4) == 0 {
        return 1 + draw.below(9000) as usize;
    }
    let kind = draw.below(5);
    1 + Rng::new(seed ^ 0x1e57 ^ kind.wrapping_mul(0x51)).below(9000) as usize
}

fn input_of(seed: u64, t: u64) -> Vec<f32> {
    Rng::new(seed.rotate_left(17) ^ t).vec_f32(length_of(seed, t))
}

/// FNV-1a over the values' bits.
fn digest(values: &[f32]) -> u64 {
    values.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, v| {
        v.to_bits().to_le_bytes().iter().fold(h, |h, &b| (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3))
    })
}

/// The whole model on one engine (the graph tests' reference): the expected digest of every step.
fn reference_digests(engine: &Engine, seed: u64, steps: u64) -> Vec<u64> {
    (0..steps).map(|t| digest(&graphs::reference(engine, &[input_of(seed, t)], |_| t as u32)[0])).collect()
}

/// The element count of every step in graph mode (one capture serves every step).
const GRAPH_N: usize = 5000;

fn graph_input_of(seed: u64, t: u64) -> Vec<f32> {
    Rng::new(seed.rotate_left(17) ^ t).vec_f32(GRAPH_N)
}

/// The expected digests of a graph-mode launch: step t's input through the whole model with the
/// step parameter of its slot (`t % slots`), as the captured graphs run it.
fn graph_reference_digests(engine: &Engine, seed: u64, steps: u64, slots: usize) -> Vec<u64> {
    (0..steps)
        .map(|t| digest(&graphs::reference(engine, &[graph_input_of(seed, t)], |_| (t % slots as u64) as u32)[0]))
        .collect()
}

fn free_port() -> u16 {
    common::rendezvous_port()
}

fn scratch(name: &str) -> PathBuf {
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(format!("processes-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

#[test]
fn two_processes_match_one_engine_bitwise() {
    let test = "two_processes_match_one_engine_bitwise";
    let Some(engine) = ready(test) else { return };
    let quick = std::env::var_os("PPNRT_TEST_QUICK").is_some();
    matches_reference(&engine, "2-stages", &[0, 1], 2, if quick { 500 } else { 10_000 }, false);
    matches_reference(&engine, "4-contiguous", &[0, 0, 1, 1], 2, 500, false);
    matches_reference(&engine, "4-alternating", &[0, 1, 0, 1], 3, 500, false);
    matches_reference(&engine, "8-contiguous", &[0, 0, 0, 0, 1, 1, 1, 1], 2, 300, false);
    matches_reference(&engine, "8-alternating", &[0, 1, 0, 1, 0, 1, 0, 1], 4, 300, false);
    assert_receives_captured(test);
}

/// Two processes over the IPC transport (the ranks on one host): every step of a 4-stage pipeline
/// of 2,000 steps, and of 2 and 8 stages, bitwise equal to one engine's.
#[test]
fn two_processes_over_ipc_match_one_engine_bitwise() {
    let test = "two_processes_over_ipc_match_one_engine_bitwise";
    let Some(engine) = ready(test) else { return };
    for (name, ranks, slots, steps) in [
        ("ipc-4-contiguous", &[0, 0, 1, 1][..], 2, 2000),
        ("ipc-2-stages", &[0, 1][..], 2, 500),
        ("ipc-8-alternating", &[0, 1, 0, 1, 0, 1, 0, 1][..], 3, 300),
    ] {
        let launch = Launch { rank_env: OVER_IPC, ..pipeline_launch(ranks, slots, steps, false) };
        assert_eq!(mismatches_against_reference(&engine, name, &launch), 0, "{name}: outputs differ from one engine's");
    }
}

/// Graph mode across processes over the IPC transport: each rank's captured steps read the slots
/// the other rank writes through its own mappings (a ring of fixed buffers, taken out for the
/// capture and put back), captured at once, 300 ms late (rank 0's first steps fill rank 1's slots
/// first, kept by its capture), interleaved with eager steps, and with a thread per stage: the
/// outputs are bitwise one engine's.
#[test]
fn graph_mode_over_ipc_matches_one_engine_bitwise() {
    const LATE_OVER_IPC: &[(usize, &str, &str)] = &[
        (0, "PPNRT_PROCESS_TRANSPORT", "ipc"),
        (1, "PPNRT_PROCESS_TRANSPORT", "ipc"),
        (0, "PPNRT_RESERVE_BYTES", "1048576"),
        (1, "PPNRT_RESERVE_BYTES", "1048576"),
        (1, CAPTURE_DELAY_VAR, "300"),
    ];
    let test = "graph_mode_over_ipc_matches_one_engine_bitwise";
    let Some(engine) = ready(test) else { return };
    for (name, mode, ranks, slots, steps, rank_env) in [
        ("ipc-graphs-2-stages", "graphs", &[0, 1][..], 2, 300, OVER_IPC),
        ("ipc-graphs-4-alternating", "graphs", &[0, 1, 0, 1][..], 3, 200, OVER_IPC),
        ("ipc-graphs-rx-captures-late", "graphs", &[0, 1][..], 2, 200, LATE_OVER_IPC),
        ("ipc-graphs-interleaved-4-contiguous", "graphs-interleaved", &[0, 0, 1, 1][..], 2, 200, OVER_IPC),
        ("ipc-graphs-threads-4-alternating", "graphs-threads", &[0, 1, 0, 1][..], 3, 200, OVER_IPC),
    ] {
        let launch = Launch { mode, rank_env, ..pipeline_launch(ranks, slots, steps, false) };
        assert_eq!(
            mismatches_against_reference(&engine, name, &launch),
            0,
            "{name}: graph steps differ from one engine's"
        );
    }
}

/// The check above can fail: with `rx` not waiting for the NCCL receive, outputs differ. Both
/// runs use long device delays before each send (up to 1 ms), so the data lands well after the
/// record that announces it.
#[test]
fn a_broken_protocol_across_processes_is_caught() {
    let test = "a_broken_protocol_across_processes_is_caught";
    let Some(engine) = ready(test) else { return };
    let sound = Launch { max_delay_ns: Some(1_000_000), ..pipeline_launch(&[0, 1], 2, 300, false) };
    let sound = mismatches_against_reference(&engine, "sound-long-delays", &sound);
    assert_eq!(sound, 0, "the protocol as specified must not mismatch");
    let broken = Launch { broken: true, max_delay_ns: Some(1_000_000), ..pipeline_launch(&[0, 1], 2, 300, false) };
    let broken = mismatches_against_reference(&engine, "broken-long-delays", &broken);
    assert!(broken > 0, "rx without waiting for the receive went unnoticed");
    assert_receives_captured(test);
}

/// Graph mode across processes: each rank captures its own stages' step once (`capture_step`)
/// and replays it (`launch`: this rank's stages in turn, each waiting for its input from the
/// rank before); the outputs are bitwise one engine's. The same with the protocol broken on
/// purpose (a stage's graph launched without waiting for the receive from the other rank,
/// behind a 1 ms spin before each send) mismatches.
#[test]
fn graph_mode_across_processes_matches_one_engine_bitwise() {
    let test = "graph_mode_across_processes_matches_one_engine_bitwise";
    let Some(engine) = ready(test) else { return };
    let graphs = |ranks, slots, steps| Launch { mode: "graphs", ..pipeline_launch(ranks, slots, steps, false) };
    for (name, ranks, slots, steps) in [
        ("graphs-2-stages", &[0, 1][..], 2, 500),
        ("graphs-4-contiguous", &[0, 0, 1, 1][..], 2, 300),
        ("graphs-4-alternating", &[0, 1, 0, 1][..], 3, 300),
    ] {
        let mismatches = mismatches_against_reference(&engine, name, &graphs(ranks, slots, steps));
        assert_eq!(mismatches, 0, "{name}: graph steps differ from one engine's");
    }
    // Rank 1 captures 300 ms late: rank 0's first steps have filled its slots by then, and its
    // capture keeps them (its graphs read them first).
    let late = [(1, CAPTURE_DELAY_VAR, "300")];
    let late = Launch { rank_env: &late, ..graphs(&[0, 1], 2, 200) };
    let mismatches = mismatches_against_reference(&engine, "graphs-rx-captures-late", &late);
    assert_eq!(mismatches, 0, "graphs-rx-captures-late: graph steps differ from one engine's");
    // Eager steps between graph steps, each rank on a pattern of its own.
    for (name, ranks, slots, steps) in [
        ("graphs-interleaved-2-stages", &[0, 1][..], 2, 300),
        ("graphs-interleaved-4-contiguous", &[0, 0, 1, 1][..], 2, 200),
        ("graphs-interleaved-4-alternating", &[0, 1, 0, 1][..], 3, 200),
    ] {
        let launch = Launch { mode: "graphs-interleaved", ..pipeline_launch(ranks, slots, steps, false) };
        let mismatches = mismatches_against_reference(&engine, name, &launch);
        assert_eq!(mismatches, 0, "{name}: interleaved graph and eager steps differ from one engine's");
    }
    // One thread per stage of each rank (`launch_stage`).
    for (name, ranks, slots, steps) in [
        ("graphs-threads-4-contiguous", &[0, 0, 1, 1][..], 2, 300),
        ("graphs-threads-4-alternating", &[0, 1, 0, 1][..], 3, 300),
    ] {
        let launch = Launch { mode: "graphs-threads", ..pipeline_launch(ranks, slots, steps, false) };
        let mismatches = mismatches_against_reference(&engine, name, &launch);
        assert_eq!(mismatches, 0, "{name}: graph steps of a thread per stage differ from one engine's");
    }
    // An eager receive taken out of turn makes the next launch refuse, typed, and lose nothing.
    let dir = scratch("graph-order");
    let order = Launch { mode: "graph-order", ..pipeline_launch(&[0, 1], 2, 0, false) };
    let results = order.run(&dir, Duration::from_secs(120));
    every_rank_ok("graph-order", &results);
    assert!(results[1].1.contains("GRAPH-INTERLEAVED"), "{}", results[1].1);
    assert!(results[1].1.contains("GRAPH-STEP-ORDER refused"), "{}", results[1].1);
    say("graph-order: graph, eager, graph steps read steps 0, 1, 2; a step taken out of turn: the next launch is \
         refused with GraphStepOrder, and the skipped steps still arrive");
    // The broken protocol shows only if a launch runs before its receive lands: with the GPU
    // shared by many ranks (stress runs) it can run late enough to read the right data, so the
    // spin before each send grows until the run catches it (1, 4, 16 ms around each boundary).
    let caught = [1_000_000, 4_000_000, 16_000_000].into_iter().any(|max_delay_ns| {
        let broken = Launch { broken: true, max_delay_ns: Some(max_delay_ns), ..graphs(&[0, 1], 2, 200) };
        mismatches_against_reference(&engine, "graphs-broken", &broken) > 0
    });
    assert!(caught, "a graph launched without waiting for the receive went unnoticed");
    assert_receives_captured(test);
}

#[test]
fn two_processes_over_sockets_match_one_engine_bitwise() {
    let test = "two_processes_over_sockets_match_one_engine_bitwise";
    let Some(engine) = ready(test) else { return };
    matches_reference(&engine, "sockets-2-stages", &[0, 1], 2, 2000, true);
    matches_reference(&engine, "sockets-4-alternating", &[0, 1, 0, 1], 2, 300, true);
    assert_receives_captured(test);
}

#[test]
fn the_contract_holds_across_processes() {
    let test = "the_contract_holds_across_processes";
    if ready(test).is_none() {
        return;
    }
    let dir = scratch("contract");
    let launch = Launch { mode: "contract", seed: 7, ..pipeline_launch(&[0, 1], 2, 0, false) };
    let results = launch.run(&dir, Duration::from_secs(120));
    for (rank, (ok, output)) in results.iter().enumerate() {
        say(&format!(
            "contract rank {rank}: {}",
            output.lines().filter(|l| l.starts_with("CHILD")).collect::<Vec<_>>().join(" | ")
        ));
        assert!(*ok && output.contains("CHILD-OK"), "rank {rank} failed:\n{output}");
    }
}

/// A receiver thread held up while it posts a step's receive (NCCL completing a connection, a
/// graph launch waiting for its previous launch) holds up neither the RX stage's receive of a
/// step it filled before nor a bounded wait for the held-up step: each returns on time (the
/// thread posts without the ring's lock). Through the NCCL double only, which can hold up a
/// receive call; skipped on a GPU, saying why.
#[test]
fn a_receive_held_up_while_posted_holds_up_no_other_slot() {
    let test = "a_receive_held_up_while_posted_holds_up_no_other_slot";
    if ready(test).is_none() {
        return;
    }
    if !through_doubles() {
        say(&format!("SKIPPED {test}: holding up NCCL's receive call needs the NCCL double"));
        return;
    }
    let dir = scratch("slow-post");
    // Rank 1's receive calls: the setup's probe, step 0, step 1 (held up).
    let held = format!("3:{}", SLOW_POST.as_millis());
    let rank_env = [(1, "PPNRT_NCCL_DOUBLE_SLOW_RECV", held.as_str())];
    let launch = Launch { mode: "slow-post", rank_env: &rank_env, ..pipeline_launch(&[0, 1], 2, 0, false) };
    let results = launch.run(&dir, Duration::from_secs(120));
    every_rank_ok(test, &results);
    let line = results[1].1.lines().find_map(|l| l.strip_prefix("CHILD-SLOW-POST ")).expect("rank 1's timings");
    let [first_ms, bounded_ms]: [u64; 2] =
        line.split_whitespace().map(|v| v.parse().unwrap()).collect::<Vec<_>>().try_into().unwrap();
    say(&format!(
        "{test}: with step 1's posting held up {SLOW_POST:?}: step 0 received after {first_ms} ms, \
         a wait of {:?} for step 1 timed out after {bounded_ms} ms",
        SLOW_POST / 10
    ));
    if let Some(state) = results[1].1.lines().find_map(|l| l.strip_prefix("CHILD receiver while held up: ")) {
        say(&format!("{test}: rank 1's receiver_state(0) meanwhile: {state}"));
    }
    let limit = (SLOW_POST / 3).as_millis() as u64;
    assert!(first_ms < limit, "receiving step 0 waited {first_ms} ms for step 1's posting");
    assert!(bounded_ms < limit, "a wait bounded by {:?} took {bounded_ms} ms", SLOW_POST / 10);
}

/// No receive is captured while another NCCL call of the process posts a send or receive: the
/// NCCL double refuses such a pair (ncclInternalError, the rank fails), and makes each send take
/// 3 ms and each receive 0.1 ms, so that a rank's stage thread is still sending step t + 1 on
/// boundary 0 when its receiver thread, told of step t + 1 on boundary 1 by the other rank, would
/// capture that receive if nothing kept them apart. Captured receives still happen (between the
/// sends), and the outputs match one engine's. Through the NCCL double only; skipped on a GPU, saying why (there the
/// stress of `scripts/stress-processes.sh` runs the real pair).
#[test]
fn no_receive_is_captured_while_another_nccl_call_posts() {
    let test = "no_receive_is_captured_while_another_nccl_call_posts";
    let Some(engine) = ready(test) else { return };
    if !through_doubles() {
        say(&format!("SKIPPED {test}: refusing a capture beside another NCCL call needs the NCCL double"));
        return;
    }
    if captured_receives_off() {
        say(&format!("SKIPPED {test}: NCCL_GRAPH_MIXING_SUPPORT=0 turns captured receives off"));
        return;
    }
    let rank_env = [(0, "PPNRT_NCCL_DOUBLE_POST_US", "3000:100"), (1, "PPNRT_NCCL_DOUBLE_POST_US", "3000:100")];
    // Rank 0 sends on boundaries 0 and 2 from its stage thread while its receiver thread of
    // boundary 1 captures; rank 1 the other way round.
    let launch = Launch { rank_env: &rank_env, ..pipeline_launch(&[0, 1, 0, 1], 2, 300, false) };
    let mismatches = mismatches_against_reference(&engine, "posting-apart", &launch);
    assert_eq!(mismatches, 0, "{test}: outputs differ from one engine's");
    assert_receives_captured(test);
}

/// A slot of a boundary from another rank grows (its receiver thread allocates) while the RX
/// stage's stream is being captured by the stage's thread: the capture is left alone (the slot is
/// the receive stream's memory), and the step arrives intact.
#[test]
fn a_slot_growing_leaves_a_capture_of_the_rx_stage_alone() {
    let test = "a_slot_growing_leaves_a_capture_of_the_rx_stage_alone";
    if ready(test).is_none() {
        return;
    }
    let dir = scratch("grow-in-capture");
    let launch = Launch { mode: "grow-in-capture", ..pipeline_launch(&[0, 1], 2, 0, false) };
    let results = launch.run(&dir, Duration::from_secs(120));
    every_rank_ok(test, &results);
    assert!(results[1].1.contains("CHILD-CAPTURE-WHOLE"), "{}", results[1].1);
    say(&format!("{test}: the capture ended whole; the step arrived intact"));
}

#[test]
fn a_killed_rank_is_a_typed_error_in_the_survivor() {
    let test = "a_killed_rank_is_a_typed_error_in_the_survivor";
    if ready(test).is_none() {
        return;
    }
    for (over, rank_env) in [("nccl", &[][..]), ("ipc", OVER_IPC)] {
        killed_rank(test, over, rank_env);
    }
}

/// [`a_killed_rank_is_a_typed_error_in_the_survivor`] over one transport.
fn killed_rank(test: &str, over: &str, rank_env: &'static [(usize, &'static str, &'static str)]) {
    let (mut children, dir) = running_ranks(&format!("kill-{over}"), 9, None, false, rank_env);
    let mut victim = children.pop().unwrap();
    victim.kill().unwrap(); // SIGKILL: no destructor, no goodbye
    let killed_at = unix_ms();
    let _ = victim.wait();
    let mut survivor = children.pop().unwrap();
    let limit = Instant::now() + Duration::from_secs(30);
    while survivor.try_wait().unwrap().is_none() {
        if Instant::now() > limit {
            dump_threads("the survivor of a kill", &dir, std::slice::from_mut(&mut survivor), Duration::from_secs(30));
            survivor.kill().unwrap();
            panic!("the survivor hung for 30 s after its peer was killed:\n{:?}", output_of(survivor));
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    let (ok, output) = output_of(survivor);
    let reported = peer_failure(&output, killed_at);
    let Some((after, line)) = reported.filter(|_| ok) else {
        panic!("the survivor did not report a typed error:\n{output}");
    };
    say(&format!("{test} over {over}: typed error {after:?} after the kill: {line}"));
    assert!(after <= Duration::from_secs(10), "the typed error came {after:?} after the kill");
}

/// A rank that stops (SIGSTOP: alive, silent, its NCCL work stalled) mid-run is a typed error in
/// the survivor within 10 s, with a peer timeout of 2 s: the survivor's waits (for the stopped
/// rank's data, and on the host for a readback behind a receive that will not complete) end
/// when its watchdog fails the silent link and aborts its communicator. The check can fail: with
/// the liveness check off, the survivor reports nothing in 12 s.
#[test]
fn a_stopped_rank_is_a_typed_error_in_the_survivor() {
    let test = "a_stopped_rank_is_a_typed_error_in_the_survivor";
    if ready(test).is_none() {
        return;
    }
    for (over, rank_env) in [("nccl", &[][..]), ("ipc", OVER_IPC)] {
        let (after, line) = stop_a_rank(&format!("stop-{over}"), false, rank_env);
        let after =
            after.unwrap_or_else(|| panic!("{test} over {over}: the survivor did not report the stopped rank: {line}"));
        say(&format!("{test} over {over}: typed error {after:?} after the stop (peer timeout 2 s): {line}"));
        assert!(after <= Duration::from_secs(10), "over {over}: the typed error came {after:?} after the stop");
    }
    let (broken, line) = stop_a_rank("stop-no-liveness", true, &[]);
    say(&format!(
        "{test}: with the liveness check off: {}",
        broken.map_or("nothing in 12 s".into(), |d| format!("{d:?}: {line}"))
    ));
    assert!(broken.is_none(), "without the liveness check the survivor still reported the stopped rank: {line}");
}

/// A rank that dies during the setup (after the rendezvous, before it joins the NCCL
/// communicator of its boundary) is a typed error in the other rank within 10 s, with a peer
/// timeout of 30 s: the other's join, which NCCL would wait on for ever, ends as soon as the dead
/// rank's end of the boundary's connection closes. Broken on purpose (the setup unwatched: a
/// blocking join), the other rank reports nothing in 12 s.
#[test]
fn a_rank_that_dies_during_setup_is_a_typed_error_in_the_other() {
    let test = "a_rank_that_dies_during_setup_is_a_typed_error_in_the_other";
    if ready(test).is_none() {
        return;
    }
    let (after, line) = die_during_setup("setup-death", &[(1, "exit-before-comm-join")]);
    let after = after.unwrap_or_else(|| panic!("{test}: the surviving rank did not report the dead one: {line}"));
    say(&format!("{test}: typed error {after:?} after the exit: {line}"));
    assert!(after <= Duration::from_secs(10), "the typed error came {after:?} after the exit");
    let (broken, line) = die_during_setup("setup-death-unwatched", &[(0, "unwatched"), (1, "exit-before-comm-join")]);
    say(&format!(
        "{test}: with the setup unwatched: {}",
        broken.map_or("nothing in 12 s".into(), |d| format!("{d:?}: {line}"))
    ));
    assert!(broken.is_none(), "with the setup unwatched the surviving rank still reported: {line}");
}

/// A rank that cannot load NCCL still meets the other ranks and says so: the others' setup
/// fails at once with `PeerFailed` naming it (the peer timeout is 30 s), and the rank itself
/// reports its own NCCL error. Rank 0 without NCCL used to fail before the rendezvous, and rank 1
/// after it, each leaving the other to wait.
#[test]
fn a_rank_without_nccl_fails_the_others_setup_at_once() {
    let test = "a_rank_without_nccl_fails_the_others_setup_at_once";
    if ready(test).is_none() {
        return;
    }
    for without in [0usize, 1] {
        let dir = scratch(&format!("no-nccl-{without}"));
        let env = [(without, "PPNRT_LIBNCCL_PATH", "/nonexistent/ppnrt-test/libnccl.so.2")];
        let launch = Launch { mode: "setup", rank_env: &env, ..pipeline_launch(&[0, 1], 2, 0, false) };
        let start = Instant::now();
        let results = launch.run(&dir, Duration::from_secs(25));
        let took = start.elapsed();
        let other = 1 - without;
        let told = format!("rank {without} cannot run its NCCL boundaries");
        assert!(
            results[other].1.contains("CHILD-PEER-FAILED") && results[other].1.contains(&told),
            "{test}: rank {other} was not told that rank {without} has no NCCL:\n{}",
            results[other].1
        );
        assert!(
            results[without].1.contains("CHILD-PEER-FAILED") && results[without].1.contains("/nonexistent/ppnrt-test"),
            "{test}: rank {without} did not report its own NCCL error:\n{}",
            results[without].1
        );
        say(&format!("{test}: rank {without} without NCCL: both ranks failed, typed, in {took:?}"));
        assert!(took < Duration::from_secs(15), "{test}: the ranks took {took:?} (peer timeout 30 s)");
    }
}

/// A job whose boundaries all go over IPC needs no NCCL: with no NCCL to load on either rank
/// (`PPNRT_LIBNCCL_PATH` naming nothing), two ranks run a 4-stage pipeline bitwise equal to one
/// engine's. A setup that demanded NCCL of every rank (or made NCCL ids before the transports
/// were chosen) fails both ranks here.
#[test]
fn an_ipc_only_job_runs_without_nccl() {
    const IPC_WITHOUT_NCCL: &[(usize, &str, &str)] = &[
        (0, "PPNRT_PROCESS_TRANSPORT", "ipc"),
        (1, "PPNRT_PROCESS_TRANSPORT", "ipc"),
        (0, "PPNRT_RESERVE_BYTES", "1048576"),
        (1, "PPNRT_RESERVE_BYTES", "1048576"),
        (0, "PPNRT_LIBNCCL_PATH", "/nonexistent/ppnrt-test/libnccl.so.2"),
        (1, "PPNRT_LIBNCCL_PATH", "/nonexistent/ppnrt-test/libnccl.so.2"),
    ];
    let test = "an_ipc_only_job_runs_without_nccl";
    let Some(engine) = ready(test) else { return };
    let launch = Launch { rank_env: IPC_WITHOUT_NCCL, ..pipeline_launch(&[0, 0, 1, 1], 2, 300, false) };
    assert_eq!(
        mismatches_against_reference(&engine, "ipc-without-nccl", &launch),
        0,
        "{test}: outputs differ from one engine's"
    );
}

#[test]
fn one_rank_under_memcheck() {
    let test = "one_rank_under_memcheck";
    if ready(test).is_none() {
        return;
    }
    if through_doubles() {
        say(&format!("SKIPPED {test}: memcheck needs a GPU (running through the doubles)"));
        return;
    }
    let sanitizer = std::env::var("PPNRT_COMPUTE_SANITIZER").unwrap_or_else(|_| "compute-sanitizer".into());
    if Command::new(&sanitizer).arg("--version").output().is_err() {
        say(&format!("SKIPPED {test}: `{sanitizer}` not found (set PPNRT_COMPUTE_SANITIZER)"));
        return;
    }
    // NCCL probes kernels of other architectures with `cudaFuncGetAttributes` and expects
    // `cudaErrorNoKernelImageForDevice`: API errors are not reported here (the crate's own API
    // use is checked, API errors included, by the gate's sanitizer phase on every other test).
    let wrap: Vec<String> = ["--tool", "memcheck", "--report-api-errors", "no", "--error-exitcode", "99"]
        .iter()
        .map(ToString::to_string)
        .collect();
    let wrap = [vec![sanitizer], wrap].concat();
    let dir = scratch("memcheck");
    let seed = 11;
    let launch = Launch { seed, wrap_rank1: Some(&wrap), ..pipeline_launch(&[0, 1], 2, 50, false) };
    let results = launch.run(&dir, Duration::from_secs(400));
    for (rank, (ok, output)) in results.iter().enumerate() {
        assert!(ok, "rank {rank} failed:\n{output}");
    }
    let summary = results[1].1.lines().find(|l| l.contains("ERROR SUMMARY")).unwrap_or("no summary").to_string();
    say(&format!("{test}: rank 1 under memcheck: {summary}"));
    assert!(summary.contains("0 errors"), "{}", results[1].1);
    let engine = Engine::new(0).unwrap();
    assert_eq!(read_digests(&dir), reference_digests(&engine, seed, 50));
}

#[test]
#[ignore = "one rank of the multi-process tests; run through them"]
fn child_rank() {
    let mode = std::env::var(MODE_VAR).expect("run through the parent tests");
    let steps: u64 = std::env::var(STEPS_VAR).unwrap().parse().unwrap();
    let seed: u64 = std::env::var(SEED_VAR).unwrap().parse().unwrap();
    let dir = PathBuf::from(std::env::var(OUT_VAR).unwrap());
    let primary = Engine::new(0).unwrap();
    let mut config = PpConfig::from_env().unwrap();
    if std::env::var_os(FAULT_VAR).is_some() {
        config = config.with_fault(ppnrt::pp::ProtocolFault::SkipTxWait);
    }
    if std::env::var_os(IGNORE_SILENCE_VAR).is_some() {
        config = config.with_fault(ppnrt::pp::ProtocolFault::IgnoreSilence);
    }
    match std::env::var(SETUP_FAULT_VAR).as_deref() {
        Ok("exit-before-comm-join") => config = config.with_fault(ppnrt::pp::ProtocolFault::ExitBeforeCommJoin),
        Ok("unwatched") => config = config.with_fault(ppnrt::pp::ProtocolFault::UnwatchedSetup),
        Ok(other) => panic!("unknown setup fault {other}"),
        Err(_) => {}
    }
    if mode == "setup" {
        // A peer dies during the setup: the setup's typed error, when it comes.
        match PpNRt::new(config, &primary) {
            Ok(rt) => println!("CHILD-SETUP-OK rank {}", rt.rank()),
            Err(e) => println!("CHILD-PEER-FAILED {} {e}", unix_ms()),
        }
        return;
    }
    let rt = PpNRt::new(config, &primary).unwrap();
    println!("CHILD rank {} built: {}", rt.rank(), rt.plan());
    let finished = AtomicBool::new(false);
    std::thread::scope(|scope| {
        if let Some(after) = stall_dump_after() {
            let (rt, finished) = (&rt, &finished);
            scope.spawn(move || report_a_stall(rt, finished, after.saturating_sub(Duration::from_secs(5))));
        }
        // Set however the mode ends (a panic included), so that the scope's join returns.
        let _finished = SetOnDrop(&finished);
        run_mode(&mode, &rt, &primary, seed, steps, &dir);
    });
    println!("CHILD-OK");
}
