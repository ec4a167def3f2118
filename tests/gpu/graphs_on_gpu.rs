//! Graph mode on the GPUs present: the scenarios of `common/graphs.rs` (graph steps bitwise
//! identical to eager steps and to the one-stage model for 1–8 stages on one and two GPUs,
//! contiguous and alternating, 1–4 slots, eager and graph steps interleaved; capture misuse;
//! mismatched steps refused; `launch_stage`'s refusals and racing launches; graphs keep their
//! memory alive and ordered; no graph step overtakes an eager step left half-way, and a capture
//! refuses rings out of step). `tests/double/` runs
//! the same scenarios without a GPU.

use crate::{common, graph_order, graphs};

use std::sync::{Mutex, MutexGuard};

use common::needs::{Needs, requires};
use ppnrt::Engine;

/// The scenarios run one at a time: a global capture refuses every thread's synchronising calls
/// while it lasts, and drop errors are kept process-wide.
fn serial() -> MutexGuard<'static, ()> {
    static SERIAL: Mutex<()> = Mutex::new(());
    SERIAL.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// Runs `scenario` with the stages on device 0 (`one_gpu`), then, with two GPUs present, on both
/// (`two_gpus`); skips, saying why, without a GPU.
fn on_one_gpu_then_two(test: &str, one_gpu: &[i32], two_gpus: &[i32], scenario: impl Fn(&Engine, &[i32])) {
    let _serial = serial();
    let Some(gpus) = requires(test, Needs::gpus(1)) else { return };
    let devices = gpus.count();
    let primary = Engine::new(0).unwrap();
    scenario(&primary, one_gpu);
    if devices >= 2 {
        scenario(&primary, two_gpus);
    }
}

#[test]
fn graph_mode_matches_eager_and_one_stage() {
    let _serial = serial();
    let test = "graph_mode_matches_eager_and_one_stage";
    let Some(gpus) = requires(test, Needs::gpus(1)) else { return };
    let devices = gpus.count();
    let quick = std::env::var_os("PPNRT_TEST_QUICK").is_some();
    graphs::graph_mode_matches_eager_and_one_stage(test, &Engine::new(0).unwrap(), devices.min(2), quick);
}

#[test]
fn capture_misuse_is_a_typed_error() {
    let _serial = serial();
    let Some(gpus) = requires("capture_misuse_is_a_typed_error", Needs::gpus(1)) else { return };
    let devices = gpus.count();
    let primary = Engine::new(0).unwrap();
    graphs::capture_misuse_is_a_typed_error(&primary, &[0]);
    graphs::capture_misuse_is_a_typed_error(&primary, &[0, 0, 0]);
    if devices >= 2 {
        graphs::capture_misuse_is_a_typed_error(&primary, &[0, 1, 0]);
    }
}

#[test]
fn mismatched_graph_steps_are_refused() {
    on_one_gpu_then_two(
        "mismatched_graph_steps_are_refused",
        &[0, 0, 0],
        &[0, 1, 0],
        graphs::mismatched_graph_steps_are_refused,
    );
}

#[test]
fn launch_stage_refusals_lose_nothing() {
    on_one_gpu_then_two(
        "launch_stage_refusals_lose_nothing",
        &[0, 0, 0],
        &[0, 1, 0],
        graphs::launch_stage_refusals_lose_nothing,
    );
}

#[test]
fn racing_launches_of_one_stage_never_share_a_slot() {
    on_one_gpu_then_two("racing_launches_of_one_stage_never_share_a_slot", &[0, 0], &[0, 1], |primary, devices| {
        graphs::racing_launches_of_one_stage_never_share_a_slot(primary, devices, 300)
    });
}

#[test]
fn graphs_launched_from_two_threads_keep_their_order() {
    let _serial = serial();
    let Some(_gpus) = requires("graphs_launched_from_two_threads_keep_their_order", Needs::gpus(1)) else { return };
    let against = graphs::graphs_launched_from_two_threads_keep_their_order(&Engine::new(0).unwrap(), 2000);
    assert_eq!(against, 0, "graph launches from two threads ran against the buffer's recorded order");
}

#[test]
fn graphs_keep_their_memory_alive_and_ordered() {
    let _serial = serial();
    let Some(_gpus) = requires("graphs_keep_their_memory_alive_and_ordered", Needs::gpus(1)) else { return };
    graphs::graphs_keep_their_memory_alive_and_ordered(&Engine::new(0).unwrap());
}

#[test]
fn one_thread_per_stage_replays_graphs() {
    let _serial = serial();
    let Some(gpus) = requires("one_thread_per_stage_replays_graphs", Needs::gpus(1)) else { return };
    let devices = gpus.count();
    let primary = Engine::new(0).unwrap();
    let steps = if std::env::var_os("PPNRT_TEST_QUICK").is_some() { 20 } else { 500 };
    graphs::one_thread_per_stage_replays_graphs(&primary, &[0, 0, 0, 0], 2, steps);
    if devices >= 2 {
        graphs::one_thread_per_stage_replays_graphs(&primary, &[0, 1, 0, 1], 2, steps);
        graphs::one_thread_per_stage_replays_graphs(&primary, &[0, 0, 1, 1], 3, steps);
    }
}

#[test]
fn graph_misuse_leaves_everything_sound() {
    let _serial = serial();
    let Some(gpus) = requires("graph_misuse_leaves_everything_sound", Needs::gpus(1)) else { return };
    let devices = gpus.count();
    let primary = Engine::new(0).unwrap();
    graphs::graph_misuse_leaves_everything_sound(&primary, if devices >= 2 { &[0, 1, 0] } else { &[0, 0, 0] });
}

#[test]
fn a_graph_step_never_overtakes_an_unreceived_eager_step() {
    on_one_gpu_then_two(
        "a_graph_step_never_overtakes_an_unreceived_eager_step",
        &[0, 0],
        &[0, 1],
        graph_order::a_graph_step_never_overtakes_an_unreceived_eager_step,
    );
}

#[test]
fn a_capture_refuses_rings_out_of_step() {
    on_one_gpu_then_two(
        "a_capture_refuses_rings_out_of_step",
        &[0, 0, 0],
        &[0, 1, 0],
        graph_order::a_capture_refuses_rings_out_of_step,
    );
}
