//! The README's quick start, the first lesson: a two-stage pipeline on one or two GPUs.
//! `cargo run --release --example quickstart` (no arguments but `--help`); exit status 0 when the
//! data came through unchanged, 1 on an error, 2 for a bad argument.
use std::process::ExitCode;

use ppnrt::{Device, Engine, PpConfig, PpNRt};

fn run() -> Result<(), Box<dyn std::error::Error>> {
    let primary = Engine::new(0)?;
    // Two stages: on GPUs 0 and 1 when there are two, else both on GPU 0.
    let second = if Device::count()? > 1 { 1 } else { 0 };
    let rt = PpNRt::new(PpConfig::with_devices(&[0, second]), &primary)?;
    println!("{}", rt.plan());

    let n = 4096;
    let input: Vec<f32> = (0..n).map(|i| i as f32 / n as f32).collect();
    let x = {
        let _stage0 = rt.enter(0)?; // stage 0's stream is this thread's ambient stream
        let x = rt.engine(0, &primary)?.htod(&input)?;
        // ... stage 0's layers run here, on the ambient stream ...
        x
    };
    let slot = rt.tx(0, &x, n)?; // boundary 0: stage 0 -> stage 1
    let output = {
        let _stage1 = rt.enter(1)?;
        let y = rt.rx::<f32>(0, slot, n)?; // a fresh buffer owned by stage 1's stream
        // ... stage 1's layers run here ...
        rt.engine(1, &primary)?.dtoh(&y)?
    };

    let differs = output.iter().zip(&input).position(|(a, b)| a.to_bits() != b.to_bits());
    let verdict = if differs.is_none() { "identical" } else { "DIFFERENT" };
    println!("{n} elements through {} stage(s): {verdict}", rt.n_stages());
    if let Some(i) = differs {
        return Err(format!("the boundary changed element {i}: {} arrived as {}", input[i], output[i]).into());
    }
    Ok(())
}

fn main() -> ExitCode {
    let usage = "usage: quickstart [-h|--help]";
    if let Some(arg) = std::env::args_os().nth(1) {
        if arg == "-h" || arg == "--help" {
            println!("{usage}\n\nSends 4096 f32 through a two-stage pipeline on one or two GPUs.");
            return ExitCode::SUCCESS;
        }
        eprintln!("quickstart: unexpected argument '{}'\n{usage}", arg.to_string_lossy());
        return ExitCode::from(2);
    }
    match run() {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("quickstart: {}", ppnrt::error::chain(&*e));
            ExitCode::FAILURE
        }
    }
}
