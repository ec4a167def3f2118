//! `PpNRt` correctness and misuse on a GPU.
//!
//! Correctness: K decode steps of the toy residual model through pipelines of 1 to 8 stages, on
//! one GPU and on two (contiguous and alternating maps), with every transport policy and 1 to 4
//! slots, varying `n` per step, give bitwise the same output as the model run on one stage.
//! Misuse: each error case is caught before anything is enqueued and overwrites nothing.

use crate::{common, raw_threads, threads};

use std::collections::VecDeque;

use common::needs::{Needs, requires};
use common::{POISON, Rng, say, under_sanitizer};
use ppnrt::pp::ProtocolFault;
use ppnrt::{CudaError, CudaSlice, Engine, Error, PpConfig, PpNRt, Transport, TransportPolicy, kernels};
use ppnrt::{PpError, SlotState};

const TOTAL_LAYERS: u32 = 12;

/// Layers of stage `s` out of `n_stages`: a contiguous share of TOTAL_LAYERS.
fn layers_of(s: usize, n_stages: usize) -> std::ops::Range<u32> {
    let per = |s: usize| (s as u32 * TOTAL_LAYERS) / n_stages as u32;
    per(s)..per(s + 1)
}

/// Runs every input through the model on one engine and stream.
fn reference(engine: &Engine, inputs: &[Vec<f32>]) -> Vec<Vec<f32>> {
    inputs
        .iter()
        .enumerate()
        .map(|(step, input)| {
            let mut x = engine.htod(input).unwrap();
            for layer in 0..TOTAL_LAYERS {
                engine.toy_layer(&mut x, step as u32, layer).unwrap();
            }
            engine.dtoh(&x).unwrap()
        })
        .collect()
}

/// Runs every input through the pipeline on a wavefront schedule: stage `s` works on step
/// `tick - s * lag`, so each boundary holds up to `lag` filled slots between host calls.
fn run_pipeline(rt: &PpNRt, primary: &Engine, inputs: &[Vec<f32>], lag: usize) -> Vec<Vec<f32>> {
    let n_stages = rt.n_stages();
    let mut in_flight: Vec<VecDeque<(usize, usize)>> = vec![VecDeque::new(); n_stages.saturating_sub(1)];
    let mut outputs: Vec<Option<CudaSlice<f32>>> = (0..inputs.len()).map(|_| None).collect();
    let ticks = inputs.len() + (n_stages - 1) * lag;
    for tick in 0..ticks {
        for s in (0..n_stages).rev() {
            let Some(step) = tick.checked_sub(s * lag).filter(|&k| k < inputs.len()) else { continue };
            let n = inputs[step].len();
            let engine = rt.engine(s, primary).unwrap();
            let _scope = rt.enter(s).unwrap();
            let mut x = if s == 0 {
                engine.htod(&inputs[step]).unwrap()
            } else {
                let (sent_step, slot) = in_flight[s - 1].pop_front().expect("a step in flight");
                assert_eq!(sent_step, step, "schedule out of order");
                rt.rx::<f32>(s - 1, slot, n).unwrap()
            };
            assert_eq!(x.ordinal(), rt.stage_device(s).unwrap());
            for layer in layers_of(s, n_stages) {
                engine.toy_layer(&mut x, step as u32, layer).unwrap();
            }
            if s + 1 < n_stages {
                let slot = rt.tx(s, &x, n).unwrap();
                in_flight[s].push_back((step, slot));
            } else {
                outputs[step] = Some(x);
            }
        }
    }
    let last = n_stages - 1;
    let engine = rt.engine(last, primary).unwrap();
    let _scope = rt.enter(last).unwrap();
    outputs.into_iter().map(|x| engine.dtoh(&x.expect("every step finished")).unwrap()).collect()
}

fn inputs(rng: &mut Rng, steps: usize, base_n: usize) -> Vec<Vec<f32>> {
    (0..steps).map(|k| rng.vec_f32(base_n + (k * 1237) % base_n)).collect()
}

fn same_bits(a: &[Vec<f32>], b: &[Vec<f32>]) -> bool {
    a.len() == b.len()
        && a.iter().zip(b).all(|(x, y)| x.len() == y.len() && x.iter().zip(y).all(|(p, q)| p.to_bits() == q.to_bits()))
}

fn maps(n_stages: usize, devices: i32) -> Vec<(&'static str, Vec<i32>)> {
    let mut maps = vec![("one-gpu", vec![0; n_stages])];
    if devices >= 2 && n_stages >= 2 {
        maps.push(("contiguous", (0..n_stages).map(|s| (s * 2 / n_stages) as i32).collect()));
        maps.push(("alternating", (0..n_stages).map(|s| (s % 2) as i32).collect()));
    }
    if devices > 2 && n_stages > 2 {
        maps.push(("round-robin over every GPU", (0..n_stages).map(|s| (s % devices as usize) as i32).collect()));
    }
    maps
}

#[test]
fn pipelines_of_1_to_8_stages_match_one_stage_bitwise() {
    let test = "pipelines_of_1_to_8_stages_match_one_stage_bitwise";
    let Some(gpus) = requires(test, Needs::gpus(1)) else { return };
    let devices = gpus.count();
    if devices < 2 {
        say(&format!("{test}: one GPU found; the two-GPU maps are not run"));
    }
    let primary = Engine::new(0).unwrap();
    let mut rng = Rng::new(4);
    let inputs = inputs(&mut rng, 7, 3000);
    let expected = reference(&primary, &inputs);
    // PPNRT_TEST_QUICK (set by the gate under compute-sanitizer) keeps a corner subset.
    let quick = std::env::var_os("PPNRT_TEST_QUICK").is_some();
    let stage_counts: Vec<usize> = if quick { vec![1, 2, 3, 8] } else { (1..=8).collect() };
    let slot_counts: Vec<usize> = if quick { vec![1, 3] } else { (1..=4).collect() };
    let mut runs = 0;
    for &n_stages in &stage_counts {
        for (map_name, map) in maps(n_stages, devices) {
            for policy in [TransportPolicy::Auto, TransportPolicy::Staged] {
                for &slots in &slot_counts {
                    let config = PpConfig::with_devices(&map).with_slots(slots).with_transport(policy);
                    let rt = PpNRt::new(config.clone(), &primary).unwrap();
                    let got = run_pipeline(&rt, &primary, &inputs, slots);
                    assert!(same_bits(&got, &expected), "{config} ({map_name}): output differs; plan {}", rt.plan());
                    runs += 1;
                }
            }
        }
    }
    say(&format!("{test}: {runs} configurations matched bitwise"));
}

#[test]
fn peer_transport_is_chosen_between_peers_and_matches() {
    let test = "peer_transport_is_chosen_between_peers_and_matches";
    let Some(_gpus) = requires(test, Needs::gpus(2)) else { return };
    let primary = Engine::new(0).unwrap();
    let peers = primary.device().peer_info(&ppnrt::Device::get(1).unwrap()).unwrap().access_supported;
    let config = PpConfig::with_devices(&[0, 1, 1, 0]).with_transport(TransportPolicy::Peer);
    if !peers {
        let err = PpNRt::new(config, &primary).unwrap_err();
        say(&format!("{test}: devices 0 and 1 are not peers; peer forced fails as it should: {err}"));
        assert!(matches!(err, Error::Config(_)));
        return;
    }
    let rt = PpNRt::new(config, &primary).unwrap();
    say(&format!("{test}: plan {}", rt.plan()));
    let transports: Vec<_> = rt.plan().boundaries.iter().map(|b| b.transport).collect();
    assert_eq!(transports, vec![Transport::Peer, Transport::Local, Transport::Peer]);
    assert!(rt.cross_device());
    let mut rng = Rng::new(5);
    // Large and growing n: slots are re-allocated safely while the ring is in use.
    let inputs: Vec<Vec<f32>> = [1000usize, 1 << 20, 5000, 3 << 20, 17].iter().map(|&n| rng.vec_f32(n)).collect();
    let expected = reference(&primary, &inputs);
    assert!(same_bits(&run_pipeline(&rt, &primary, &inputs, 2), &expected));
}

#[test]
fn engine_and_enter_follow_the_stage_map() {
    let Some(gpus) = requires("engine_and_enter_follow_the_stage_map", Needs::gpus(1)) else { return };
    let devices = gpus.count();
    let primary = Engine::new(0).unwrap();
    let map: Vec<i32> = if devices >= 2 { vec![0, 1, 0] } else { vec![0, 0, 0] };
    let rt = PpNRt::new(PpConfig::with_devices(&map), &primary).unwrap();
    assert_eq!(rt.n_stages(), 3);
    assert_eq!(rt.cross_device(), devices >= 2);
    for (s, &d) in map.iter().enumerate() {
        let engine = rt.engine(s, &primary).unwrap();
        assert_eq!(engine.ordinal(), d);
        if d == 0 {
            assert!(std::ptr::eq(engine, &primary), "stage {s} on the primary's device uses the primary");
        }
        let _scope = rt.enter(s).unwrap();
        assert!(std::sync::Arc::ptr_eq(&engine.stream().unwrap(), rt.stage_stream(s).unwrap()));
    }
    assert_eq!(rt.enter(3).unwrap_err(), Error::Pipeline(PpError::StageOutOfRange { stage: 3, n_stages: 3 }));
    assert_eq!(
        rt.engine(9, &primary).unwrap_err(),
        Error::Pipeline(PpError::StageOutOfRange { stage: 9, n_stages: 3 })
    );
    // record_done / readback_stream live on the last stage's device.
    let done = rt.record_done().unwrap();
    assert_eq!(done.ordinal(), *map.last().unwrap());
    assert_eq!(rt.readback_stream().ordinal(), *map.last().unwrap());
    rt.readback_stream().wait(&done).unwrap();
    rt.readback_stream().synchronize().unwrap();
}

/// A 2-stage runtime on one device with `slots` slots, and a payload of `n` pattern words.
fn one_boundary(primary: &Engine, slots: usize) -> PpNRt {
    PpNRt::new(PpConfig::new(2).with_slots(slots), primary).unwrap()
}

fn payload(rt: &PpNRt, primary: &Engine, seed: u32, n: usize) -> CudaSlice<u32> {
    let engine = rt.engine(0, primary).unwrap();
    let _scope = rt.enter(0).unwrap();
    let mut x = engine.alloc::<u32>(n).unwrap();
    engine.fill_pattern(&mut x, seed).unwrap();
    x
}

fn received_is(rt: &PpNRt, primary: &Engine, y: &CudaSlice<u32>, seed: u32) -> bool {
    let _scope = rt.enter(1).unwrap();
    let host = rt.engine(1, primary).unwrap().dtoh(y).unwrap();
    host.iter().enumerate().all(|(i, &w)| w == kernels::pattern(seed, i as u64))
}

#[test]
fn misuse_is_a_typed_error_and_overwrites_nothing() {
    let Some(gpu) = requires("misuse_is_a_typed_error_and_overwrites_nothing", Needs::gpus(1)) else { return };
    let primary = gpu.engine(0);
    let rt = one_boundary(&primary, 1);
    let x = payload(&rt, &primary, 1, 1000);

    // Out-of-range boundary, zero n, n larger than x.
    assert_eq!(
        rt.tx(1, &x, 10).unwrap_err(),
        Error::Pipeline(PpError::BoundaryOutOfRange { boundary: 1, n_boundaries: 1 })
    );
    assert_eq!(rt.tx(0, &x, 0).unwrap_err(), Error::Pipeline(PpError::ZeroLength { boundary: 0 }));
    assert_eq!(
        rt.tx(0, &x, 1001).unwrap_err(),
        Error::Cuda(CudaError::OutOfBounds { what: "PpNRt::tx: n exceeds x", start: 0, end: 1001, len: 1000 })
    );
    assert_eq!(
        rt.rx::<u32>(5, 0, 10).unwrap_err(),
        Error::Pipeline(PpError::BoundaryOutOfRange { boundary: 5, n_boundaries: 1 })
    );
    // rx of a slot never filled, out of range, n = 0.
    assert!(matches!(
        rt.rx::<u32>(0, 0, 1000),
        Err(Error::Pipeline(PpError::SlotState { call: "rx", found: SlotState::NeverFilled, .. }))
    ));
    assert_eq!(
        rt.rx::<u32>(0, 1, 1000).unwrap_err(),
        Error::Pipeline(PpError::SlotOutOfRange { boundary: 0, slot: 1, n_slots: 1 })
    );
    assert_eq!(rt.rx::<u32>(0, 0, 0).unwrap_err(), Error::Pipeline(PpError::ZeroLength { boundary: 0 }));

    // A good tx, then a second tx onto the (only) slot before it was received: refused, and the
    // first payload is intact.
    let slot = rt.tx(0, &x, 1000).unwrap();
    assert_eq!(slot, 0);
    let other = payload(&rt, &primary, 2, 1000);
    let err = rt.tx(0, &other, 1000).unwrap_err();
    assert!(
        matches!(
            err,
            Error::Pipeline(PpError::SlotState {
                call: "tx",
                slot: 0,
                found: SlotState::Filled { n: 1000, elem: "u32" },
                ..
            })
        ),
        "{err}"
    );
    // rx with another n or another type: refused, data kept.
    assert_eq!(
        rt.rx::<u32>(0, 0, 999).unwrap_err(),
        Error::Pipeline(PpError::RxLengthMismatch { boundary: 0, slot: 0, requested: 999, sent: 1000 })
    );
    assert_eq!(
        rt.rx::<f32>(0, 0, 1000).unwrap_err(),
        Error::Pipeline(PpError::RxTypeMismatch { boundary: 0, slot: 0, requested: "f32", sent: "u32" })
    );
    let y = {
        let _scope = rt.enter(1).unwrap();
        rt.rx::<u32>(0, 0, 1000).unwrap()
    };
    assert!(received_is(&rt, &primary, &y, 1), "the refused calls changed the slot");
    // Already received.
    assert!(matches!(
        rt.rx::<u32>(0, 0, 1000),
        Err(Error::Pipeline(PpError::SlotState { found: SlotState::Received, .. }))
    ));
    // The runtime is still usable: the refused payload goes through now.
    let slot = rt.tx(0, &other, 1000).unwrap();
    let y2 = rt.rx::<u32>(0, slot, 1000).unwrap();
    assert!(received_is(&rt, &primary, &y2, 2));
    assert!(received_is(&rt, &primary, &y, 1), "an earlier received buffer was overwritten");

    // A prefix transfer: n smaller than x sends x[..n].
    let slot = rt.tx(0, &x, 10).unwrap();
    let y3 = rt.rx::<u32>(0, slot, 10).unwrap();
    assert_eq!(y3.len(), 10);
    assert!(received_is(&rt, &primary, &y3, 1));
    rt.synchronize().unwrap();
}

#[test]
fn x_on_another_device_is_refused() {
    let Some(_gpus) = requires("x_on_another_device_is_refused", Needs::gpus(2)) else { return };
    let primary = Engine::new(0).unwrap();
    let rt = PpNRt::new(PpConfig::with_devices(&[0, 1]), &primary).unwrap();
    let x = Engine::new(1).unwrap().htod(&[POISON; 64]).unwrap();
    assert!(matches!(rt.tx(0, &x, 64), Err(Error::Cuda(CudaError::WrongDevice { expected: 0, found: 1, .. }))));
    // Nothing was filled: rx still says never filled.
    assert!(matches!(rt.rx::<u32>(0, 0, 64), Err(Error::Pipeline(PpError::SlotState { .. }))));
}

#[test]
fn bad_configurations_are_refused_when_built() {
    let Some(gpus) = requires("bad_configurations_are_refused_when_built", Needs::gpus(1)) else { return };
    let count = gpus.count();
    let primary = Engine::new(0).unwrap();
    let err = PpNRt::new(PpConfig::with_devices(&[0, count]), &primary).unwrap_err();
    match err {
        Error::Config(e) => {
            assert_eq!(e.setting, "PpConfig::with_devices");
            assert!(e.reason.contains(&format!("device ordinal {count} is not present")), "{e}");
        }
        other => panic!("expected a config error, got {other:?}"),
    }
    assert!(matches!(PpNRt::new(PpConfig::new(0), &primary), Err(Error::Config(_))));
    assert!(matches!(PpNRt::new(PpConfig::new(2).with_slots(0), &primary), Err(Error::Config(_))));
    // The fault knob exists for hazard tests only; a default config has none.
    assert_eq!(PpConfig::new(2).fault(), ProtocolFault::None);
}

#[test]
fn bf16_and_other_element_types_cross_boundaries() {
    let Some(gpu) = requires("bf16_and_other_element_types_cross_boundaries", Needs::gpus(1)) else { return };
    let primary = gpu.engine(0);
    let rt = PpNRt::new(PpConfig::new(3).with_slots(2), &primary).unwrap();
    let mut rng = Rng::new(6);
    let data: Vec<ppnrt::bf16> = (0..4099).map(|_| ppnrt::bf16::from_f32(rng.next_f32())).collect();
    let x = primary.htod(&data).unwrap();
    let slot = rt.tx(0, &x, data.len()).unwrap();
    let y = rt.rx::<ppnrt::bf16>(0, slot, data.len()).unwrap();
    let slot = rt.tx(1, &y, data.len()).unwrap();
    let z = rt.rx::<ppnrt::bf16>(1, slot, data.len()).unwrap();
    assert!(primary.dtoh(&z).unwrap() == data);
    let bytes: Vec<u8> = rng.vec_u32(333).iter().map(|&w| w as u8).collect();
    let x = primary.htod(&bytes).unwrap();
    let slot = rt.tx(0, &x, bytes.len()).unwrap();
    assert!(primary.dtoh(&rt.rx::<u8>(0, slot, bytes.len()).unwrap()).unwrap() == bytes);
}

/// Every copy path of `tx`/`rx` (SM copy kernel for small aligned copies within a device, the copy
/// engine for unaligned or large ones, peer and host-staged copies) delivers every byte: lengths
/// around the kernel's 16-byte words and tail, around `SM_COPY_MAX_BYTES`, and views that start
/// off a 16-byte boundary.
#[test]
fn every_copy_path_delivers_every_byte() {
    let Some(gpus) = requires("every_copy_path_delivers_every_byte", Needs::gpus(1)) else { return };
    let count = gpus.count();
    let primary = gpus.engine(0);
    let mut placements = vec![
        ("local", vec![0, 0], TransportPolicy::Auto, true),
        ("local, copy engines only", vec![0, 0], TransportPolicy::Auto, false),
        ("staged", vec![0, 0], TransportPolicy::Staged, true),
    ];
    if count >= 2 {
        placements.push(("cross-device", vec![0, 1], TransportPolicy::Auto, true));
        placements.push(("cross-device, copy engines only", vec![1, 0], TransportPolicy::Auto, false));
        placements.push(("cross-device staged", vec![1, 0], TransportPolicy::Staged, true));
    }
    let big = ppnrt::SM_COPY_MAX_BYTES;
    let lengths = [1, 15, 16, 17, 4099, 65_536, big - 1, big, big + 16, big + 4097];
    let mut rng = Rng::new(77);
    for (name, devices, policy, sm_copies) in placements {
        let config = PpConfig::with_devices(&devices).with_slots(2).with_transport(policy).with_sm_copies(sm_copies);
        let rt = PpNRt::new(config, &primary).unwrap();
        let device_slots = rt.plan().boundaries[0].transport != Transport::HostStaged;
        assert_eq!(rt.sm_copies(0).unwrap(), sm_copies && device_slots, "{name}: {}", rt.config());
        for &len in &lengths {
            for offset in [0usize, 3] {
                let data: Vec<u8> = (0..len + offset).map(|_| rng.next_u32() as u8).collect();
                let x = {
                    let _scope = rt.enter(0).unwrap();
                    rt.engine(0, &primary).unwrap().htod(&data).unwrap()
                };
                let view = x.slice(offset..).unwrap();
                let slot = rt.tx(0, &view, len).unwrap();
                let y = rt.rx::<u8>(0, slot, len).unwrap();
                let got = {
                    let _scope = rt.enter(1).unwrap();
                    rt.engine(1, &primary).unwrap().dtoh(&y).unwrap()
                };
                let bad = got.iter().zip(&data[offset..]).filter(|(a, b)| a != b).count();
                assert_eq!(bad, 0, "{name}: {bad} of {len} bytes wrong (view offset {offset})");
            }
        }
        say(&format!(
            "every_copy_path_delivers_every_byte: {name} ({}): {} lengths × 2 offsets exact",
            rt.plan(),
            lengths.len()
        ));
    }
}

/// One host thread per stage, parked in `tx_wait` / `rx_wait` (no polling), gives bitwise the
/// outputs of one thread driving every stage: 4 stages over the GPUs, 10,000 steps
/// (`PPNRT_HAZARD_STEPS` overrides). The wall times are printed, not asserted (the benches
/// measure).
#[test]
fn one_thread_per_stage_matches_one_thread() {
    thread_per_stage_matches_one_thread("one_thread_per_stage_matches_one_thread", threads::Variant::default());
}

/// The same with every slot allocated when the runtime is built: no `tx` allocates a slot while
/// the other stages' threads have work in flight.
#[test]
fn one_thread_per_stage_with_reserved_slots_matches_one_thread() {
    thread_per_stage_matches_one_thread(
        "one_thread_per_stage_with_reserved_slots_matches_one_thread",
        threads::Variant { reserve_slots: true, ..threads::Variant::default() },
    );
}

/// The same with each thread waiting for its stage's stream after every step: no host thread
/// runs ahead of the device.
#[test]
fn one_thread_per_stage_in_lockstep_matches_one_thread() {
    thread_per_stage_matches_one_thread(
        "one_thread_per_stage_in_lockstep_matches_one_thread",
        threads::Variant { synchronize_each_step: true, ..threads::Variant::default() },
    );
}

/// The same with every input uploaded before the threads start: no host-to-device copy in the
/// loop.
#[test]
fn one_thread_per_stage_from_device_inputs_matches_one_thread() {
    thread_per_stage_matches_one_thread(
        "one_thread_per_stage_from_device_inputs_matches_one_thread",
        threads::Variant { inputs_on_device: true, ..threads::Variant::default() },
    );
}

/// The crate's one-thread loop gives bitwise the outputs of the same protocol written against the
/// raw driver, one host thread per stage (`tests/common/raw_threads.rs`), with each slot
/// allocated at its first use and with every slot allocated up front. Four stages on GPU 0,
/// 10,000 steps (`PPNRT_HAZARD_STEPS` overrides).
#[test]
fn raw_driver_thread_per_stage_matches_one_thread() {
    let test = "raw_driver_thread_per_stage_matches_one_thread";
    let Some(_gpus) = requires(test, Needs::gpus(1)) else { return };
    let steps: usize = std::env::var("PPNRT_HAZARD_STEPS").ok().and_then(|v| v.parse().ok()).unwrap_or(10_000);
    let primary = Engine::new(0).unwrap();
    let (expected, _) = threads::one_thread(&primary, &[0, 0, 0, 0], 2, steps);
    for lazy_slots in [true, false] {
        let got = raw_threads::raw_thread_per_stage(4, 2, steps, lazy_slots);
        assert!(
            got == expected,
            "raw loop (slots allocated {}) differs",
            if lazy_slots { "at first use" } else { "up front" }
        );
    }
    say(&format!("{test}: {steps} steps, raw thread-per-stage loop equals the crate's one-thread loop"));
}

fn thread_per_stage_matches_one_thread(test: &str, variant: threads::Variant) {
    let Some(gpus) = requires(test, Needs::gpus(1)) else { return };
    let devices = gpus.count();
    let steps: usize = std::env::var("PPNRT_HAZARD_STEPS").ok().and_then(|v| v.parse().ok()).unwrap_or(10_000);
    let primary = Engine::new(0).unwrap();
    let map: Vec<i32> = (0..4).map(|s| (s / 2) % devices).collect();
    let (expected, one) = threads::one_thread(&primary, &map, 2, steps);
    let (got, many) = threads::thread_per_stage_with(&primary, &map, 2, steps, variant);
    say(&format!(
        "{test}: devices {map:?}, {steps} steps: one thread {:.1} ms, thread per stage {:.1} ms",
        one.as_secs_f64() * 1e3,
        many.as_secs_f64() * 1e3
    ));
    assert!(got == expected, "outputs differ");
}

/// Deferred readback never holds up the stage stream: with a 1 ms spin queued on the readback
/// stream before every readback, 20 steps of 50 µs of stage work still take about 1 ms of the
/// stage stream's time (were the stage stream to wait for the readbacks, over 20 ms); every
/// step's values arrive bitwise.
#[test]
fn readback_never_delays_the_stage_stream() {
    let test = "readback_never_delays_the_stage_stream";
    let Some(gpus) = requires(test, Needs::gpus(1)) else { return };
    let devices = gpus.count();
    let primary = Engine::new(0).unwrap();
    let rt = PpNRt::new(PpConfig::with_devices(&[0, devices.min(2) - 1]), &primary).unwrap();
    let e = rt.engine(1, &primary).unwrap().clone();
    let stage = rt.stage_stream(1).unwrap().clone();
    let (start, end) =
        (ppnrt::CudaEvent::new(e.context(), true).unwrap(), ppnrt::CudaEvent::new(e.context(), true).unwrap());
    let n = 8192;
    let steps = 20u32;
    let mut pending = Vec::new();
    start.record(&stage).unwrap();
    for step in 0..steps {
        let logits = {
            let _last = rt.enter(1).unwrap();
            e.spin(50_000).unwrap();
            let mut logits = e.alloc::<u32>(n).unwrap();
            e.fill_pattern(&mut logits, step).unwrap();
            logits
        };
        {
            let _readback = ppnrt::StreamOverride::new(rt.readback_stream().clone()).unwrap();
            e.spin(1_000_000).unwrap();
        }
        pending.push((step, rt.readback(logits).unwrap()));
    }
    end.record(&stage).unwrap();
    end.synchronize().unwrap();
    let stage_ms = end.elapsed_ms(&start).unwrap();
    for (step, readback) in &pending {
        let expected: Vec<u32> = (0..n as u64).map(|i| kernels::pattern(*step, i)).collect();
        assert_eq!(readback.wait().unwrap(), &expected[..], "step {step}");
    }
    say(&format!(
        "{test}: {steps} steps of stage work took {stage_ms:.2} ms of the stage stream with 1 ms readback spins"
    ));
    if !under_sanitizer() {
        assert!(stage_ms < 10.0, "the stage stream waited for the readbacks: {stage_ms:.2} ms");
    }
}
