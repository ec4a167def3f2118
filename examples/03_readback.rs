//! Lesson 3: a decode loop that reads every step's output back without stalling the stages: a
//! two-stage pipeline of the toy model (`Engine::toy_layer`), each step's output handed to
//! `readback` and collected two steps later, checked against one engine running the whole model.
//!
//! ```text
//! cargo run --release --example 03_readback
//! ```
//! No arguments but `--help`; exit status 0 when every step matches, 1 on an error or a
//! mismatch, 2 for a bad argument.
use std::collections::VecDeque;
use std::process::ExitCode;

use ppnrt::{Device, Engine, PpConfig, PpNRt};

const LAYERS: u32 = 8;

type Error = Box<dyn std::error::Error>;

/// An error naming the first element where `output` differs from `expected`, bit for bit.
fn compare(step: u32, output: &[f32], expected: &[f32]) -> Result<(), Error> {
    match output.iter().zip(expected).position(|(a, b)| a.to_bits() != b.to_bits()) {
        Some(i) => {
            Err(format!("step {step}, element {i}: the pipeline gave {}, one engine {}", output[i], expected[i]).into())
        }
        None => Ok(()),
    }
}

fn run() -> Result<(), Error> {
    let primary = Engine::new(0)?;
    let second = if Device::count()? > 1 { 1 } else { 0 };
    let rt = PpNRt::new(PpConfig::with_devices(&[0, second]), &primary)?;
    let n = 8192;
    let input = |step: u32| -> Vec<f32> { (0..n).map(|i| ((i as u32 ^ step) % 97) as f32 / 97.0).collect() };
    let mut pending = VecDeque::new();
    let mut checked = 0;
    let mut check = |step: u32, values: &[f32]| -> Result<(), Error> {
        let mut x = primary.htod(&input(step))?;
        for layer in 0..2 * LAYERS {
            primary.toy_layer(&mut x, step, layer)?;
        }
        compare(step, values, &primary.dtoh(&x)?)?;
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
        while pending.len() > 2 {
            let Some((step, readback)) = pending.pop_front() else { break };
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
    let usage = "usage: 03_readback [-h|--help]";
    if let Some(arg) = std::env::args_os().nth(1) {
        if arg == "-h" || arg == "--help" {
            println!("{usage}\n\nLesson 3: every step's output read back two steps late, checked against one engine.");
            return ExitCode::SUCCESS;
        }
        eprintln!("03_readback: unexpected argument '{}'\n{usage}", arg.to_string_lossy());
        return ExitCode::from(2);
    }
    match run() {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("03_readback: {}", ppnrt::error::chain(&*e));
            ExitCode::FAILURE
        }
    }
}
