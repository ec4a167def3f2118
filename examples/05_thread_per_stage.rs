//! Lesson 5: one host thread per stage: four stages (spread over the GPUs present), each driven
//! by a thread of its own with `rx_wait` (parks until the slot is filled) and `tx_wait` (parks
//! while the next slot is taken), the last stage reading every step back; checked against one
//! engine.
//!
//! ```text
//! cargo run --release --example 05_thread_per_stage
//! ```
//! No arguments but `--help`; exit status 0 when every step matches, 1 on an error or a
//! mismatch, 2 for a bad argument.
use std::process::ExitCode;
use std::time::Duration;

use ppnrt::{Device, Engine, PpConfig, PpNRt};

const STAGES: usize = 4;
const LAYERS: u32 = 4; // per stage
const N: usize = 8192;
const STEPS: usize = 48;

fn input(step: usize) -> Vec<f32> {
    (0..N).map(|i| ((i ^ step) % 251) as f32 / 251.0).collect()
}

fn run() -> Result<(), Box<dyn std::error::Error>> {
    let primary = Engine::new(0)?;
    let gpus = Device::count()?.max(1);
    let devices: Vec<i32> = (0..STAGES as i32).map(|s| s * gpus / STAGES as i32).collect();
    let rt = PpNRt::new(PpConfig::with_devices(&devices).with_slots(3), &primary)?;
    let timeout = Duration::from_secs(10);
    let outputs = std::thread::scope(|scope| -> Result<Vec<Vec<f32>>, Box<dyn std::error::Error>> {
        let threads: Vec<_> = (0..STAGES)
            .map(|s| {
                let (rt, primary) = (&rt, &primary);
                scope.spawn(move || -> ppnrt::Result<Vec<Vec<f32>>> {
                    let _stage = rt.enter(s)?; // this thread's work runs on stage s's stream
                    let engine = rt.engine(s, primary)?;
                    let mut outputs = Vec::new();
                    for k in 0..STEPS {
                        let mut x = if s == 0 {
                            engine.htod(&input(k))?
                        } else {
                            // Parks until the sending stage's thread has filled the slot.
                            rt.rx_wait::<f32>(s - 1, k % rt.n_slots(), N, timeout)?
                        };
                        for layer in s as u32 * LAYERS..(s as u32 + 1) * LAYERS {
                            engine.toy_layer(&mut x, k as u32, layer)?;
                        }
                        if s + 1 < STAGES {
                            rt.tx_wait(s, &x, N, timeout)?;
                        } else {
                            outputs.push(rt.readback(x)?.wait()?.to_vec());
                        }
                    }
                    Ok(outputs)
                })
            })
            .collect();
        let mut outputs = Vec::new();
        for (s, thread) in threads.into_iter().enumerate() {
            outputs = thread.join().map_err(|_| format!("the thread of stage {s} panicked"))??;
        }
        Ok(outputs)
    })?;
    for (k, output) in outputs.iter().enumerate() {
        let mut x = primary.htod(&input(k))?;
        for layer in 0..STAGES as u32 * LAYERS {
            primary.toy_layer(&mut x, k as u32, layer)?;
        }
        let expected = primary.dtoh(&x)?;
        if let Some(i) = output.iter().zip(&expected).position(|(a, b)| a.to_bits() != b.to_bits()) {
            return Err(
                format!("step {k}, element {i}: the pipeline gave {}, one engine {}", output[i], expected[i]).into()
            );
        }
    }
    println!("05_thread_per_stage: {STEPS} steps through {STAGES} stages on {gpus} GPU(s), one thread each: identical");
    Ok(())
}

fn main() -> ExitCode {
    let usage = "usage: 05_thread_per_stage [-h|--help]";
    if let Some(arg) = std::env::args_os().nth(1) {
        if arg == "-h" || arg == "--help" {
            println!("{usage}\n\nLesson 5: four stages, one host thread each, checked against one engine.");
            return ExitCode::SUCCESS;
        }
        eprintln!("05_thread_per_stage: unexpected argument '{}'\n{usage}", arg.to_string_lossy());
        return ExitCode::from(2);
    }
    match run() {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("05_thread_per_stage: {}", ppnrt::error::chain(&*e));
            ExitCode::FAILURE
        }
    }
}
