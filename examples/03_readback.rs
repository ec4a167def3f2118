//! A decode loop that reads every step's output back without stalling the stages: a two-stage
//! pipeline of the toy model, each step's output handed to `readback` and collected two steps
//! later, checked against one engine running the whole model.
//!
//! ```text
//! cargo run --release --example 03_readback
//! ```
use std::collections::VecDeque;
use std::process::ExitCode;

use ppnrt::{Device, Engine, PpConfig, PpNRt};

const LAYERS: u32 = 8;

fn run() -> ppnrt::Result<()> {
    let primary = Engine::new(0)?;
    let second = if Device::count()? > 1 { 1 } else { 0 };
    let rt = PpNRt::new(PpConfig::with_devices(&[0, second]), &primary)?;
    let n = 8192;
    let input = |step: u32| -> Vec<f32> { (0..n).map(|i| ((i as u32 ^ step) % 97) as f32 / 97.0).collect() };
    let mut pending = VecDeque::new();
    let mut checked = 0;
    let mut check = |step: u32, values: &[f32]| -> ppnrt::Result<()> {
        let mut x = primary.htod(&input(step))?;
        for layer in 0..2 * LAYERS {
            primary.toy_layer(&mut x, step, layer)?;
        }
        assert!(primary.dtoh(&x)? == values, "step {step}: the pipeline's output differs from one engine's");
        checked += 1;
        Ok(())
    };
    for step in 0..64u32 {
        let slot = {
            let _stage = rt.enter(0)?;
            let mut x = rt.engine(0, &primary)?.htod(&input(step))?;
            for layer in 0..LAYERS {
                rt.engine(0, &primary)?.toy_layer(&mut x, step, layer)?;
            }
            rt.tx(0, &x, n)?
        };
        let out = {
            let _stage = rt.enter(1)?;
            let mut y = rt.rx::<f32>(0, slot, n)?;
            for layer in LAYERS..2 * LAYERS {
                rt.engine(1, &primary)?.toy_layer(&mut y, step, layer)?;
            }
            y
        };
        pending.push_back((step, rt.readback(out)?)); // no stage waits for the copy
        if pending.len() > 2 {
            let (step, readback) = pending.pop_front().expect("three pending");
            check(step, readback.wait()?)?;
        }
    }
    while let Some((step, readback)) = pending.pop_front() {
        check(step, readback.wait()?)?;
    }
    println!("03_readback: {checked} steps read back two steps late, each identical to one engine's");
    Ok(())
}

fn main() -> ExitCode {
    match run() {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("03_readback: {}", ppnrt::error::chain(&e));
            ExitCode::from(2)
        }
    }
}
