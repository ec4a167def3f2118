//! Soundness on the GPUs present: the scenarios of `common/soundness.rs` (pinned sources of
//! `htod`, `copy_with_sms` preconditions, stream guards dropped in any order, the current context
//! across calls, discarded slots, consumers ordered by `order_on`, work beside and racing a
//! capture). `tests/double/` runs the same scenarios without a GPU. Also the capture race's
//! driver calls on the raw driver alone, to tell a sanitizer's trouble with them from the crate's.

use crate::{common, raw_driver, soundness};

use common::needs::{Needs, requires};
use common::say;
use ppnrt::{Engine, TransportPolicy};

#[test]
fn pinned_sources_are_read_before_htod_returns() {
    let Some(_gpus) = requires("pinned_sources_are_read_before_htod_returns", Needs::gpus(1)) else { return };
    soundness::pinned_sources_are_read_before_htod_returns(&Engine::new(0).unwrap());
}

#[test]
fn copy_with_sms_refuses_memory_its_sms_cannot_reach() {
    let Some(_gpus) = requires("copy_with_sms_refuses_memory_its_sms_cannot_reach", Needs::gpus(2)) else { return };
    soundness::copy_with_sms_refuses_memory_its_sms_cannot_reach(&Engine::new(0).unwrap(), &Engine::new(1).unwrap());
}

#[test]
fn stream_overrides_drop_in_any_order() {
    let Some(_gpus) = requires("stream_overrides_drop_in_any_order", Needs::gpus(1)) else { return };
    soundness::stream_overrides_drop_in_any_order(&Engine::new(0).unwrap());
}

#[test]
fn calls_leave_the_current_context_as_they_found_it() {
    let Some(_gpus) = requires("calls_leave_the_current_context_as_they_found_it", Needs::gpus(2)) else { return };
    soundness::calls_leave_the_current_context_as_they_found_it(&Engine::new(0).unwrap(), &Engine::new(1).unwrap());
}

#[test]
fn work_beside_a_capture_waits_for_the_writes_before_it() {
    let Some(_gpus) = requires("work_beside_a_capture_waits_for_the_writes_before_it", Needs::gpus(1)) else { return };
    soundness::work_beside_a_capture_waits_for_the_writes_before_it(&Engine::new(0).unwrap());
}

#[test]
fn work_racing_a_capture_lands_inside_it_or_outside_it() {
    let Some(_gpus) = requires("work_racing_a_capture_lands_inside_it_or_outside_it", Needs::gpus(1)) else { return };
    soundness::work_racing_a_capture_lands_inside_it_or_outside_it(&Engine::new(0).unwrap(), capture_race_rounds());
}

#[test]
fn discarded_slots_are_free_again() {
    let Some(gpus) = requires("discarded_slots_are_free_again", Needs::gpus(1)) else { return };
    let devices = gpus.count();
    let primary = Engine::new(0).unwrap();
    soundness::discarded_slots_are_free_again(&primary, &[0, 0]);
    if devices >= 2 {
        soundness::discarded_slots_are_free_again(&primary, &[0, 1]);
    } else {
        say("discarded_slots_are_free_again: one GPU, the two-device case did not run");
    }
}

#[test]
fn order_on_orders_every_consumer() {
    let Some(gpus) = requires("order_on_orders_every_consumer", Needs::gpus(1)) else { return };
    let devices = gpus.count();
    let primary = Engine::new(0).unwrap();
    let mut maps: Vec<&[i32]> = vec![&[0, 0]];
    if devices >= 2 {
        maps.push(&[0, 1]);
    } else {
        say("order_on_orders_every_consumer: one GPU, the two-device case did not run");
    }
    for devices in maps {
        for transport in [TransportPolicy::Auto, TransportPolicy::Staged] {
            soundness::order_on_orders_every_consumer(&primary, devices, transport);
        }
    }
}

/// The driver calls of `work_racing_a_capture_lands_inside_it_or_outside_it` on the raw driver,
/// with no crate code in the loop, serialised as the crate's enqueue gate serialises them: one
/// thread begins and ends thread-local captures of stream `s`, each while no enqueue on `s` is in
/// progress, while another writes `x` on `s` and copies it to `y` on stream `b` (unordered: only
/// the calls matter here, for running under compute-sanitizer beside the crate's scenario).
#[test]
fn raw_driver_capture_race_runs() {
    raw_capture_race("raw_driver_capture_race_runs", true);
}

/// The same race with no serialisation at all: enqueues on `s` from one thread while another
/// begins and ends captures of it. On driver 580.159.04 (2× H200, 2026-12-01) this hung (no
/// progress in 160 s) and under memcheck died with SIGSEGV within 9 s: the driver does not survive
/// a stream's capture beginning or ending while another thread enqueues on it, which is why every
/// call of the crate that enqueues holds the stream's gate. Not run by default; for probing a
/// driver: `--ignored raw_driver_capture_race_unserialised`.
#[test]
#[ignore = "hangs or crashes the driver (580.159.04): see the doc comment"]
fn raw_driver_capture_race_unserialised() {
    raw_capture_race("raw_driver_capture_race_unserialised", false);
}

/// How many captures the capture races make: `PPNRT_CAPTURE_RACE_ROUNDS`, default 20,000.
fn capture_race_rounds() -> usize {
    std::env::var("PPNRT_CAPTURE_RACE_ROUNDS").ok().and_then(|v| v.parse().ok()).unwrap_or(20_000)
}

/// One thread captures `s` (`PPNRT_CAPTURE_RACE_ROUNDS` times, default 20,000) while another
/// writes on `s` and copies on `b`; `serialised` puts each begin, end and enqueue on `s` under one
/// read-write lock (enqueues shared, begin and end exclusive), as the crate's gate does.
#[allow(unsafe_code)]
fn raw_capture_race(test: &str, serialised: bool) {
    use ppnrt::sys::{CUdeviceptr, CUgraph, CUstream, CUstreamCaptureMode};
    use raw_driver::raw;
    use std::sync::RwLock;
    use std::sync::atomic::{AtomicBool, Ordering};
    let Some(_gpus) = requires(test, Needs::gpus(1)) else { return };
    let captures = capture_race_rounds();
    let e = Engine::new(0).unwrap();
    let ctx = e.context().raw();
    raw!(cuCtxSetCurrent(ctx));
    let n = 1024usize;
    let (mut s, mut b): (CUstream, CUstream) = (std::ptr::null_mut(), std::ptr::null_mut());
    raw!(cuStreamCreate(&mut s, 1));
    raw!(cuStreamCreate(&mut b, 1));
    let (mut x, mut y): (CUdeviceptr, CUdeviceptr) = (0, 0);
    raw!(cuMemAlloc_v2(&mut x, n * 4));
    raw!(cuMemAlloc_v2(&mut y, n * 4));
    raw!(cuMemsetD32Async(x, 0, n, s));
    raw!(cuMemsetD32Async(y, 0, n, b));
    raw!(cuStreamSynchronize(s));
    raw!(cuStreamSynchronize(b));
    let handles = raw_driver::AnyThread((ctx, s, b));
    let gate = RwLock::new(());
    let shared = || serialised.then(|| gate.read().unwrap());
    let exclusive = || serialised.then(|| gate.write().unwrap());
    let stop = AtomicBool::new(false);
    let mut with_nodes = 0usize;
    std::thread::scope(|scope| {
        let writer = scope.spawn(|| {
            let (ctx, s, b) = handles.get();
            raw!(cuCtxSetCurrent(ctx));
            let mut value = 0u32;
            while !stop.load(Ordering::Relaxed) {
                value += 1;
                {
                    let _enqueueing = shared();
                    raw!(cuMemsetD32Async(x, value, n, s));
                }
                raw!(cuMemcpyAsync(y, x, n * 4, b));
            }
            value
        });
        for _ in 0..captures {
            {
                let _beginning = exclusive();
                raw!(cuStreamBeginCapture_v2(s, CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL));
            }
            for _ in 0..200 {
                std::hint::spin_loop();
            }
            let mut graph: CUgraph = std::ptr::null_mut();
            {
                let _ending = exclusive();
                raw!(cuStreamEndCapture(s, &mut graph));
            }
            let mut nodes = 0usize;
            raw!(cuGraphGetNodes(graph, std::ptr::null_mut(), &mut nodes));
            with_nodes += usize::from(nodes > 0);
            raw!(cuGraphDestroy(graph));
        }
        stop.store(true, Ordering::Relaxed);
        let writes = writer.join().unwrap();
        say(&format!(
            "{test}: {captures} captures, {with_nodes} took in some of the {writes} writes of the other thread"
        ));
    });
    raw!(cuStreamSynchronize(s));
    raw!(cuStreamSynchronize(b));
    raw!(cuMemFree_v2(x));
    raw!(cuMemFree_v2(y));
    raw!(cuStreamDestroy_v2(s));
    raw!(cuStreamDestroy_v2(b));
}
