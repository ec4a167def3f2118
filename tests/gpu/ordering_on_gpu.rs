//! The ordering rule on the GPUs present, written as a user would (no join in user code): a
//! buffer produced on one stream and consumed on another, and a buffer dropped on its owner while
//! a delayed reader on another stream still needs it, each on every GPU alone and, with two GPUs,
//! produced on one GPU and read on the other (both ways); a buffer rewritten on its own stream
//! after a read on another stream, and a pinned buffer rewritten after a host read (the rule's
//! plain path). 10,000 randomized rounds each (`PPNRT_HAZARD_STEPS` overrides), and the
//! deliberately broken variant (the consumer gets a raw address the rule cannot see) is shown to
//! fail.

use crate::{common, ordering};

use common::needs::{Needs, requires};
use common::{say, under_sanitizer};
use ordering::Handoff;
use ppnrt::Engine;

fn rounds() -> usize {
    std::env::var("PPNRT_HAZARD_STEPS").ok().and_then(|v| v.parse().ok()).unwrap_or(10_000)
}

#[test]
fn a_buffer_produced_on_one_stream_is_consumed_on_another_without_a_join() {
    let test = "a_buffer_produced_on_one_stream_is_consumed_on_another_without_a_join";
    let Some(gpus) = requires(test, Needs::gpus(1)) else { return };
    let devices = gpus.count();
    for ordinal in 0..devices.min(2) {
        let e = Engine::new(ordinal).unwrap();
        let bad = ordering::produced_on_one_stream_consumed_on_another(&e, rounds(), 7, Handoff::Ordered);
        say(&format!("{test}: device {ordinal}: {bad} wrong checksums in {} rounds", rounds()));
        assert_eq!(bad, 0);
    }
}

#[test]
fn a_buffer_produced_on_one_gpu_is_consumed_on_another_without_a_join() {
    let test = "a_buffer_produced_on_one_gpu_is_consumed_on_another_without_a_join";
    let Some(_gpus) = requires(test, Needs::gpus(2)) else { return };
    let (e0, e1) = (Engine::new(0).unwrap(), Engine::new(1).unwrap());
    for (from, to) in [(&e0, &e1), (&e1, &e0)] {
        let bad =
            ordering::produced_on_one_device_consumed_on_another(from, to, rounds(), 13, Handoff::Ordered).unwrap();
        say(&format!(
            "{test}: device {} -> {}: {bad} wrong checksums in {} rounds",
            from.ordinal(),
            to.ordinal(),
            rounds()
        ));
        assert_eq!(bad, 0);
    }
}

#[test]
fn a_buffer_dropped_on_its_owner_is_not_reused_under_a_late_reader() {
    let test = "a_buffer_dropped_on_its_owner_is_not_reused_under_a_late_reader";
    let Some(gpus) = requires(test, Needs::gpus(1)) else { return };
    let devices = gpus.count();
    for ordinal in 0..devices.min(2) {
        let e = Engine::new(ordinal).unwrap();
        let bad = ordering::dropped_on_its_owner_while_read_elsewhere(&e, rounds() / 10, 11, Handoff::Ordered);
        say(&format!("{test}: device {ordinal}: {bad} wrong checksums in {} rounds", rounds() / 10));
        assert_eq!(bad, 0);
    }
}

#[test]
fn work_on_a_buffers_own_stream_waits_for_reads_elsewhere_and_host_reads_see_it() {
    let test = "work_on_a_buffers_own_stream_waits_for_reads_elsewhere_and_host_reads_see_it";
    let Some(gpus) = requires(test, Needs::gpus(1)) else { return };
    let devices = gpus.count();
    for ordinal in 0..devices.min(2) {
        let e = Engine::new(ordinal).unwrap();
        let rewritten = ordering::rewritten_on_its_own_stream_after_a_read_elsewhere(&e, rounds(), 17);
        let stale = ordering::pinned_rewritten_on_its_own_stream_after_a_host_read(&e, rounds() / 10, 19);
        say(&format!(
            "{test}: device {ordinal}: {rewritten} wrong checksums in {} rounds, {stale} stale host reads in {}",
            rounds(),
            rounds() / 10
        ));
        assert_eq!((rewritten, stale), (0, 0));
    }
}

#[test]
fn the_ordering_checks_catch_a_consumer_the_rule_cannot_see() {
    let test = "the_ordering_checks_catch_a_consumer_the_rule_cannot_see";
    let Some(gpus) = requires(test, Needs::gpus(1)) else { return };
    if under_sanitizer() {
        say(&format!("SKIPPED {test}: under compute-sanitizer the races cannot occur"));
        return;
    }
    let e = Engine::new(0).unwrap();
    let produced = ordering::produced_on_one_stream_consumed_on_another(&e, 2_000, 7, Handoff::RawAddress);
    let dropped = ordering::dropped_on_its_owner_while_read_elsewhere(&e, 1_000, 11, Handoff::RawAddress);
    say(&format!(
        "{test}: raw address: {produced} / 2000 unordered reads wrong, {dropped} / 1000 reads after free wrong"
    ));
    assert!(produced > 0, "an unordered consumer went unnoticed");
    assert!(dropped > 0, "a read after free went unnoticed");
    if gpus.also("across two GPUs", Needs::gpus(1).peer()) {
        let e1 = Engine::new(1).unwrap();
        match ordering::produced_on_one_device_consumed_on_another(&e, &e1, 2_000, 13, Handoff::RawAddress) {
            Some(across) => {
                say(&format!("{test}: raw address across GPUs: {across} / 2000 unordered reads wrong"));
                assert!(across > 0, "an unordered consumer on another GPU went unnoticed");
            }
            None => say(&format!("SKIPPED {test} (across two GPUs): no peer access between GPUs 0 and 1")),
        }
    }
}
