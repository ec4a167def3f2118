//! A decode loop of the toy model with one host thread per stage, using the waiting `tx_wait` /
//! `rx_wait`, against the same loop on one thread. `tests/gpu/pipeline.rs` runs it on the GPUs
//! present, `tests/double/` through the driver double.
#![allow(dead_code, unreachable_pub)]

use std::time::{Duration, Instant};

use ppnrt::kernels::pattern;
use ppnrt::{Engine, PpConfig, PpNRt};

const N: usize = 1024;
const TIMEOUT: Duration = Duration::from_secs(30);

fn input(step: usize) -> Vec<f32> {
    (0..N as u64).map(|i| (pattern(step as u32, i) >> 8) as f32 / (1u32 << 24) as f32).collect()
}

fn bits(values: &[f32]) -> Vec<u32> {
    values.iter().map(|v| v.to_bits()).collect()
}

/// Every step's output, one thread driving every stage in turn; and the wall time.
pub fn one_thread(primary: &Engine, devices: &[i32], slots: usize, steps: usize) -> (Vec<Vec<u32>>, Duration) {
    let rt = PpNRt::new(PpConfig::with_devices(devices).with_slots(slots), primary).unwrap();
    let last = rt.n_stages() - 1;
    let start = Instant::now();
    let mut outputs = Vec::with_capacity(steps);
    for step in 0..steps {
        let mut slot = 0;
        let mut x = None;
        for s in 0..rt.n_stages() {
            let _stage = rt.enter(s).unwrap();
            let e = rt.engine(s, primary).unwrap();
            let mut y = if s == 0 { e.htod(&input(step)).unwrap() } else { rt.rx::<f32>(s - 1, slot, N).unwrap() };
            e.toy_layer(&mut y, step as u32, s as u32).unwrap();
            if s < last {
                slot = rt.tx(s, &y, N).unwrap();
            }
            x = Some(y);
        }
        let e = rt.engine(last, primary).unwrap();
        outputs.push(bits(&e.dtoh(x.as_ref().unwrap()).unwrap()));
    }
    (outputs, start.elapsed())
}

/// How [`thread_per_stage_with`] varies the loop.
#[derive(Debug, Clone, Copy, Default)]
pub struct Variant {
    /// Every slot allocated when the runtime is built (`reserve_bytes`), so no `tx` grows one
    /// while other threads have work in flight.
    pub reserve_slots: bool,
    /// Each thread waits for its stage's stream after every step, so no host thread runs ahead
    /// of the device.
    pub synchronize_each_step: bool,
    /// Every step's input uploaded before the threads start; stage 0 copies it on the device
    /// (no host-to-device copy in the loop).
    pub inputs_on_device: bool,
}

/// Every step's output, one host thread per stage parked in `tx_wait` / `rx_wait`; and the wall
/// time.
pub fn thread_per_stage(primary: &Engine, devices: &[i32], slots: usize, steps: usize) -> (Vec<Vec<u32>>, Duration) {
    thread_per_stage_with(primary, devices, slots, steps, Variant::default())
}

/// [`thread_per_stage`], varied as `variant` says.
pub fn thread_per_stage_with(
    primary: &Engine,
    devices: &[i32],
    slots: usize,
    steps: usize,
    variant: Variant,
) -> (Vec<Vec<u32>>, Duration) {
    let mut config = PpConfig::with_devices(devices).with_slots(slots);
    if variant.reserve_slots {
        config = config.with_reserve_bytes(N * std::mem::size_of::<f32>());
    }
    let rt = PpNRt::new(config, primary).unwrap();
    let last = rt.n_stages() - 1;
    let uploaded: Vec<_> = if variant.inputs_on_device {
        let _stage = rt.enter(0).unwrap();
        let e = rt.engine(0, primary).unwrap();
        let inputs = (0..steps).map(|step| e.htod(&input(step)).unwrap()).collect();
        e.synchronize().unwrap();
        inputs
    } else {
        Vec::new()
    };
    let start = Instant::now();
    let outputs = std::thread::scope(|scope| {
        let workers: Vec<_> = (0..rt.n_stages())
            .map(|s| {
                let (rt, uploaded) = (&rt, &uploaded);
                scope.spawn(move || {
                    let _stage = rt.enter(s).unwrap();
                    let e = rt.engine(s, primary).unwrap();
                    let mut outputs = Vec::new();
                    for step in 0..steps {
                        let mut y = if s == 0 && variant.inputs_on_device {
                            let mut y = e.alloc::<f32>(N).unwrap();
                            e.dtod(uploaded.get(step).expect("every step uploaded"), &mut y).unwrap();
                            y
                        } else if s == 0 {
                            e.htod(&input(step)).unwrap()
                        } else {
                            rt.rx_wait::<f32>(s - 1, step % rt.n_slots(), N, TIMEOUT).unwrap()
                        };
                        e.toy_layer(&mut y, step as u32, s as u32).unwrap();
                        if s < last {
                            assert_eq!(rt.tx_wait(s, &y, N, TIMEOUT).unwrap(), step % rt.n_slots());
                        } else {
                            outputs.push(bits(&e.dtoh(&y).unwrap()));
                        }
                        if variant.synchronize_each_step {
                            e.synchronize().unwrap();
                        }
                    }
                    outputs
                })
            })
            .collect();
        workers.into_iter().map(|w| w.join().unwrap()).last().unwrap()
    });
    (outputs, start.elapsed())
}
