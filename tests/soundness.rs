//! Soundness on the GPUs present: the scenarios of `common/soundness.rs` (pinned sources of
//! `htod`, `copy_with_sms` preconditions, stream guards dropped in any order, the current context
//! across calls, discarded slots, consumers ordered by `order_on`). `tests/double.rs` runs the same scenarios without a GPU.

mod common;

#[path = "common/soundness.rs"]
mod soundness;

use common::{devices_or_skip, say};
use ppnrt::{Engine, TransportPolicy};

#[test]
fn pinned_sources_are_read_before_htod_returns() {
    if devices_or_skip("pinned_sources_are_read_before_htod_returns", 1).is_none() {
        return;
    }
    soundness::pinned_sources_are_read_before_htod_returns(&Engine::new(0).unwrap());
}

#[test]
fn copy_with_sms_refuses_memory_its_sms_cannot_reach() {
    if devices_or_skip("copy_with_sms_refuses_memory_its_sms_cannot_reach", 2).is_none() {
        return;
    }
    soundness::copy_with_sms_refuses_memory_its_sms_cannot_reach(&Engine::new(0).unwrap(), &Engine::new(1).unwrap());
}

#[test]
fn stream_overrides_drop_in_any_order() {
    if devices_or_skip("stream_overrides_drop_in_any_order", 1).is_none() {
        return;
    }
    soundness::stream_overrides_drop_in_any_order(&Engine::new(0).unwrap());
}

#[test]
fn calls_leave_the_current_context_as_they_found_it() {
    if devices_or_skip("calls_leave_the_current_context_as_they_found_it", 2).is_none() {
        return;
    }
    soundness::calls_leave_the_current_context_as_they_found_it(&Engine::new(0).unwrap(), &Engine::new(1).unwrap());
}

#[test]
fn work_beside_a_capture_waits_for_the_writes_before_it() {
    if devices_or_skip("work_beside_a_capture_waits_for_the_writes_before_it", 1).is_none() {
        return;
    }
    soundness::work_beside_a_capture_waits_for_the_writes_before_it(&Engine::new(0).unwrap());
}

#[test]
fn work_racing_a_capture_lands_inside_it_or_outside_it() {
    if devices_or_skip("work_racing_a_capture_lands_inside_it_or_outside_it", 1).is_none() {
        return;
    }
    soundness::work_racing_a_capture_lands_inside_it_or_outside_it(&Engine::new(0).unwrap(), 20_000);
}

#[test]
fn discarded_slots_are_free_again() {
    let Some(devices) = devices_or_skip("discarded_slots_are_free_again", 1) else { return };
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
    let Some(devices) = devices_or_skip("order_on_orders_every_consumer", 1) else { return };
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
