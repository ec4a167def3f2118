//! The README's quick start: a two-stage pipeline on one or two GPUs.
use std::process::ExitCode;

use ppnrt::{Device, Engine, PpConfig, PpNRt};

fn run() -> ppnrt::Result<()> {
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

    let same = output.iter().zip(&input).all(|(a, b)| a.to_bits() == b.to_bits());
    println!("{n} elements through {} stage(s): {}", rt.n_stages(), if same { "identical" } else { "DIFFERENT" });
    assert!(same, "the boundary changed the data");
    Ok(())
}

fn main() -> ExitCode {
    match run() {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {}", ppnrt::error::chain(&e));
            ExitCode::FAILURE
        }
    }
}
