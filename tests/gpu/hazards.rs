//! Ordering hazards at the boundaries, which compute-sanitizer cannot see.
//!
//! Each run pushes 10,000 steps through one boundary with a unique payload per step (a pattern
//! seeded by the step), random delays (a spin kernel) injected on the TX and RX stage streams,
//! and a device-side checksum of every received buffer (it covers every element and its
//! position), read back once at the end and compared with the host's. The protocol as built must
//! give 0 mismatches; the same test against a deliberately broken protocol (no `ev_rx` wait, or
//! no `ev_tx` wait) must report mismatches, which shows the test can catch the bug.
//!
//! `PPNRT_HAZARD_STEPS` overrides the step count (the GPU gate's short mode lowers it).

use crate::common;

use std::collections::VecDeque;
use std::sync::mpsc;

use common::needs::{Gpus, Needs, requires};
use common::{Rng, on_driver_double, say, under_sanitizer};
use ppnrt::PpError;
use ppnrt::pp::ProtocolFault;
use ppnrt::{Engine, Error, PpConfig, PpNRt, TransportPolicy, kernels};

const N: usize = 4096; // 16 KiB payloads
const MAX_DELAY_NS: u64 = 20_000;

/// Random delays injected before each `tx` (on the TX stream) and each `rx` (on the RX stream),
/// as (TX maximum, RX maximum) in ns. `MIXED` shakes both sides; the skewed profiles hold one
/// side back so the race each wait prevents is open on most steps, whatever the host's speed.
const MIXED: (u64, u64) = (MAX_DELAY_NS, MAX_DELAY_NS);
const RX_LAGS: (u64, u64) = (2_000, 60_000);
const TX_LAGS: (u64, u64) = (60_000, 2_000);

fn steps() -> usize {
    std::env::var("PPNRT_HAZARD_STEPS").ok().and_then(|v| v.parse().ok()).unwrap_or(10_000)
}

fn expected_checksums(steps: usize) -> Vec<u64> {
    let mut words = vec![0u32; N];
    (0..steps)
        .map(|k| {
            let seed = seed_of(k);
            for (i, w) in words.iter_mut().enumerate() {
                *w = kernels::pattern(seed, i as u64);
            }
            kernels::checksum(&words)
        })
        .collect()
}

fn seed_of(step: usize) -> u32 {
    kernels::mix32(step as u32 ^ 0x5eed_0000)
}

/// Runs `steps` through boundary 0 of a 2-stage pipeline and returns the mismatching steps;
/// `in_place` receives with `rx_in_place` (the checksum reads the slot itself) instead of `rx`.
fn hazard_run(
    primary: &Engine,
    config: PpConfig,
    steps: usize,
    expected: &[u64],
    seed: u64,
    delays: (u64, u64),
    in_place: bool,
) -> usize {
    let lag = config.slots();
    let rt = PpNRt::new(config, primary).unwrap();
    let (tx_engine, rx_engine) = (rt.engine(0, primary).unwrap(), rt.engine(1, primary).unwrap());
    let mut sums = {
        let _scope = rt.enter(1).unwrap();
        rx_engine.alloc_zeroed::<u64>(steps).unwrap()
    };
    let mut rng = Rng::new(seed);
    let mut in_flight = VecDeque::new();
    for k in 0..steps + lag {
        if k < steps {
            let _scope = rt.enter(0).unwrap();
            tx_engine.spin(rng.below(delays.0)).unwrap();
            let mut x = tx_engine.alloc::<u32>(N).unwrap();
            tx_engine.fill_pattern(&mut x, seed_of(k)).unwrap();
            in_flight.push_back((k, rt.tx(0, &x, N).unwrap()));
        }
        if in_flight.len() == lag || (k >= steps && !in_flight.is_empty()) {
            let (step, slot) = in_flight.pop_front().unwrap();
            let _scope = rt.enter(1).unwrap();
            rx_engine.spin(rng.below(delays.1)).unwrap();
            let mut sum = sums.slice_mut(step..step + 1).unwrap();
            if in_place {
                let received = rt.rx_in_place::<u32>(0, slot, N).unwrap();
                rx_engine.checksum_into(&received.view().unwrap(), &mut sum).unwrap();
            } else {
                let y = rt.rx::<u32>(0, slot, N).unwrap();
                rx_engine.checksum_into(&y, &mut sum).unwrap();
            }
        }
    }
    let _scope = rt.enter(1).unwrap();
    let got = rx_engine.dtoh(&sums).unwrap();
    got.iter().zip(expected).filter(|(g, e)| g != e).count()
}

struct Case {
    name: &'static str,
    devices: [i32; 2],
    policy: TransportPolicy,
    slots: usize,
}

fn cases(devices: i32) -> Vec<Case> {
    let mut cases = vec![
        Case { name: "local", devices: [0, 0], policy: TransportPolicy::Auto, slots: 1 },
        Case { name: "local", devices: [0, 0], policy: TransportPolicy::Auto, slots: 2 },
        Case { name: "local", devices: [0, 0], policy: TransportPolicy::Auto, slots: 3 },
        Case { name: "staged-local", devices: [0, 0], policy: TransportPolicy::Staged, slots: 2 },
    ];
    if devices >= 2 {
        cases.push(Case { name: "cross-device auto", devices: [0, 1], policy: TransportPolicy::Auto, slots: 1 });
        cases.push(Case { name: "cross-device auto", devices: [0, 1], policy: TransportPolicy::Auto, slots: 2 });
        cases.push(Case { name: "cross-device auto", devices: [1, 0], policy: TransportPolicy::Auto, slots: 4 });
        cases.push(Case { name: "cross-device staged", devices: [0, 1], policy: TransportPolicy::Staged, slots: 2 });
    }
    cases
}

/// Every configuration under every delay profile shows 0 mismatches, receiving by copy or in
/// place (`seed_base` keeps the two tests' random delays apart).
fn no_hazards(test: &str, in_place: bool, seed_base: u64) {
    let Some(gpus) = requires(test, Needs::gpus(1)) else { return };
    let devices = gpus.count();
    let primary = Engine::new(0).unwrap();
    let steps = steps();
    let expected = expected_checksums(steps);
    for (i, case) in cases(devices).iter().enumerate() {
        let config = PpConfig::with_devices(&case.devices).with_slots(case.slots).with_transport(case.policy);
        for (profile, delays) in [("mixed", MIXED), ("rx lags", RX_LAGS), ("tx lags", TX_LAGS)] {
            let bad = hazard_run(&primary, config.clone(), steps, &expected, seed_base + i as u64, delays, in_place);
            say(&format!("{test}: {} ({config}), {profile} delays: {bad} mismatches in {steps} steps", case.name));
            assert_eq!(bad, 0, "{} ({config}), {profile} delays", case.name);
        }
    }
}

#[test]
fn the_protocol_has_no_ordering_hazards() {
    no_hazards("the_protocol_has_no_ordering_hazards", false, 0);
}

#[test]
fn receiving_in_place_has_no_ordering_hazards() {
    no_hazards("receiving_in_place_has_no_ordering_hazards", true, 50);
}

/// What a broken-protocol test runs: the primary engine, the step count, the expected checksums,
/// and each deliberately broken configuration (one and two GPUs; no `ev_rx` wait, no `ev_tx` wait)
/// with the delays that open the race its missing wait would close. `None` (said why) when the
/// test cannot run here.
#[allow(clippy::type_complexity)]
fn broken_protocols(test: &str) -> Option<(Gpus, Engine, usize, Vec<u64>, Vec<(PpConfig, (u64, u64))>)> {
    let gpus = requires(test, Needs::gpus(1))?;
    let devices = gpus.count();
    if under_sanitizer() {
        // The sanitizer serialises the streams' work, which closes the race windows this test
        // needs open; it runs (and must catch the bug) outside the sanitizer.
        say(&format!("SKIPPED {test}: under compute-sanitizer the races cannot occur"));
        return None;
    }
    let primary = Engine::new(0).unwrap();
    if on_driver_double(&primary) {
        // The driver double runs stream work only when something waits for it, in an order that
        // keeps each stream's work together: the race a missing wait opens never runs there.
        say(&format!("SKIPPED {test}: through the driver double the races cannot occur"));
        return None;
    }
    let steps = steps();
    let mut bases = vec![PpConfig::new(2).with_slots(1)];
    if devices >= 2 {
        bases.push(PpConfig::with_devices(&[0, 1]).with_slots(1));
    }
    let broken = bases
        .iter()
        .flat_map(|base| {
            [(ProtocolFault::SkipRxWait, RX_LAGS), (ProtocolFault::SkipTxWait, TX_LAGS)]
                .map(|(fault, delays)| (base.clone().with_fault(fault), delays))
        })
        .collect();
    Some((gpus, primary, steps, expected_checksums(steps), broken))
}

#[test]
fn a_broken_protocol_is_caught() {
    let test = "a_broken_protocol_is_caught";
    let Some((_gpus, primary, steps, expected, broken)) = broken_protocols(test) else { return };
    for (config, delays) in broken {
        for in_place in [false, true] {
            let bad = hazard_run(&primary, config.clone(), steps, &expected, 99, delays, in_place);
            let how = if in_place { "received in place" } else { "received by copy" };
            say(&format!("{test}: {config}, {how}: {bad} mismatches in {steps} steps"));
            assert!(bad > 0, "{config}, {how}: the broken protocol went unnoticed");
        }
    }
}

#[test]
fn two_threads_drive_their_own_stages_of_one_runtime() {
    let test = "two_threads_drive_their_own_stages_of_one_runtime";
    let Some(gpus) = requires(test, Needs::gpus(1)) else { return };
    let devices = gpus.count();
    let primary = Engine::new(0).unwrap();
    let map = if devices >= 2 { [0, 1] } else { [0, 0] };
    let rt = PpNRt::new(PpConfig::with_devices(&map).with_slots(3), &primary).unwrap();
    let steps = steps();
    let expected = expected_checksums(steps);
    let (send, recv) = mpsc::channel::<(usize, usize)>();
    let mut refused = 0usize;
    let bad = std::thread::scope(|scope| {
        let rt = &rt;
        let primary = &primary;
        let receiver = scope.spawn(move || {
            let engine = rt.engine(1, primary).unwrap();
            let _scope = rt.enter(1).unwrap();
            let mut sums = engine.alloc_zeroed::<u64>(steps).unwrap();
            let mut rng = Rng::new(7);
            for (step, slot) in recv {
                engine.spin(rng.below(MAX_DELAY_NS)).unwrap();
                let y = rt.rx::<u32>(0, slot, N).unwrap();
                assert_eq!(y.ordinal(), map[1]);
                engine.checksum_into(&y, &mut sums.slice_mut(step..step + 1).unwrap()).unwrap();
            }
            let got = engine.dtoh(&sums).unwrap();
            got.iter().zip(&expected).filter(|(g, e)| g != e).count()
        });
        let engine = rt.engine(0, primary).unwrap();
        let _scope = rt.enter(0).unwrap();
        let mut rng = Rng::new(8);
        for k in 0..steps {
            engine.spin(rng.below(MAX_DELAY_NS)).unwrap();
            let mut x = engine.alloc::<u32>(N).unwrap();
            engine.fill_pattern(&mut x, seed_of(k)).unwrap();
            // The receiver may lag: a full ring is refused without harm, and the sender retries.
            let slot = loop {
                match rt.tx(0, &x, N) {
                    Ok(slot) => break slot,
                    Err(Error::Pipeline(PpError::SlotState { .. })) => {
                        refused += 1;
                        std::thread::yield_now();
                    }
                    Err(e) => panic!("tx failed: {e}"),
                }
            };
            send.send((k, slot)).unwrap();
        }
        drop(send);
        receiver.join().unwrap()
    });
    say(&format!("{test}: {bad} mismatches in {steps} steps ({refused} tx calls refused on a full ring and retried)"));
    assert_eq!(bad, 0);
}

/// Runs `steps` graph steps of a 2-stage pipeline: stage 0's graph sends a persistent buffer
/// (filled eagerly with the step's pattern before each launch), stage 1's graph checksums the
/// slot in place into a persistent word, copied out eagerly after each launch. Random delays (a
/// spin kernel) run on both stage streams before every launch. Returns the mismatching steps.
fn graph_hazard_run(
    primary: &Engine,
    config: PpConfig,
    steps: usize,
    expected: &[u64],
    seed: u64,
    delays: (u64, u64),
) -> usize {
    let rt = PpNRt::new(config, primary).unwrap();
    let (tx_engine, rx_engine) = (rt.engine(0, primary).unwrap(), rt.engine(1, primary).unwrap());
    let mut x = {
        let _scope = rt.enter(0).unwrap();
        tx_engine.alloc_persistent::<u32>(N).unwrap()
    };
    let (mut sum, mut sums) = {
        let _scope = rt.enter(1).unwrap();
        (rx_engine.alloc_persistent::<u64>(1).unwrap(), rx_engine.alloc_zeroed::<u64>(steps).unwrap())
    };
    let mut step = rt
        .capture_step::<u32>(N, |stage| {
            if stage.stage() == 0 {
                return stage.tx(&x);
            }
            // The checksum kernel accumulates: the graph clears the word first.
            stage.stream().memset_bytes(&mut sum, 0)?;
            Ok(rx_engine.checksum_into(&stage.received()?, &mut sum)?)
        })
        .unwrap();
    let mut rng = Rng::new(seed);
    for k in 0..steps {
        {
            let _scope = rt.enter(0).unwrap();
            tx_engine.fill_pattern(&mut x, seed_of(k)).unwrap();
            tx_engine.spin(rng.below(delays.0)).unwrap();
        }
        {
            let _scope = rt.enter(1).unwrap();
            rx_engine.spin(rng.below(delays.1)).unwrap();
        }
        step.launch().unwrap();
        let _scope = rt.enter(1).unwrap();
        rx_engine.dtod(&sum, &mut sums.slice_mut(k..k + 1).unwrap()).unwrap();
    }
    let _scope = rt.enter(1).unwrap();
    let got = rx_engine.dtoh(&sums).unwrap();
    got.iter().zip(expected).filter(|(g, e)| g != e).count()
}

#[test]
fn graph_steps_have_no_ordering_hazards() {
    let test = "graph_steps_have_no_ordering_hazards";
    let Some(gpus) = requires(test, Needs::gpus(1)) else { return };
    let devices = gpus.count();
    let primary = Engine::new(0).unwrap();
    let steps = steps();
    let expected = expected_checksums(steps);
    let mut configs = vec![PpConfig::new(2).with_slots(1), PpConfig::new(2).with_slots(3)];
    if devices >= 2 {
        configs.push(PpConfig::with_devices(&[0, 1]).with_slots(1));
        configs.push(PpConfig::with_devices(&[1, 0]).with_slots(2));
    }
    for (i, config) in configs.into_iter().enumerate() {
        for (profile, delays) in [("mixed", MIXED), ("rx lags", RX_LAGS), ("tx lags", TX_LAGS)] {
            let bad = graph_hazard_run(&primary, config.clone(), steps, &expected, 200 + i as u64, delays);
            say(&format!("{test}: {config}, {profile} delays: {bad} mismatches in {steps} graph steps"));
            assert_eq!(bad, 0, "{config}, {profile} delays");
        }
    }
}

#[test]
fn a_broken_graph_protocol_is_caught() {
    let test = "a_broken_graph_protocol_is_caught";
    let Some((_gpus, primary, steps, expected, broken)) = broken_protocols(test) else { return };
    // The launch's wait for the slot's write (ev_tx), or for its read (ev_rx), left out.
    for (config, delays) in broken {
        let bad = graph_hazard_run(&primary, config.clone(), steps, &expected, 299, delays);
        say(&format!("{test}: {config}: {bad} mismatches in {steps} graph steps"));
        assert!(bad > 0, "{config}: the broken graph protocol went unnoticed");
    }
}
