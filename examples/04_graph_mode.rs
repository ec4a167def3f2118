//! Lesson 4: graph mode: a two-stage decode step captured once per ring slot as CUDA graphs
//! (`capture_step`) and replayed (`launch`), each step's input written before the launch and its
//! output read back after it with `readback_of` (the graph keeps its buffers), checked against one
//! engine running the same layers eagerly (a layer's step parameter is the slot in graph mode).
//!
//! ```text
//! cargo run --release --example 04_graph_mode
//! ```
//! No arguments but `--help`; exit status 0 when every step matches, 1 on an error or a
//! mismatch, 2 for a bad argument.
use std::process::ExitCode;

use ppnrt::{Device, Engine, PpConfig, PpNRt};

const LAYERS: u32 = 8;
const N: usize = 8192;

fn input(step: u32) -> Vec<f32> {
    (0..N).map(|i| ((i as u32).wrapping_mul(31) ^ step) as f32 / 4096.0 - 0.5).collect()
}

fn run() -> Result<(), Box<dyn std::error::Error>> {
    let primary = Engine::new(0)?;
    let second = if Device::count()? > 1 { 1 } else { 0 };
    let rt = PpNRt::new(PpConfig::with_devices(&[0, second]), &primary)?;
    // Persistent activations: a graph runs on memory allocated before its capture.
    let mut acts = Vec::new();
    for s in 0..2 {
        let _stage = rt.enter(s)?;
        acts.push(rt.engine(s, &primary)?.alloc_persistent::<f32>(N)?);
    }
    let mut step = rt.capture_step::<f32>(N, |stage| {
        let s = stage.stage();
        let x = &mut acts[s];
        if s == 1 {
            stage.rx_into(x)?; // the slot, copied into stage 1's buffer inside the graph
        }
        for layer in s as u32 * LAYERS..(s as u32 + 1) * LAYERS {
            rt.engine(s, &primary)?.toy_layer(x, stage.slot() as u32, layer)?;
        }
        if s == 0 {
            stage.tx(x)?;
        }
        Ok(())
    })?;
    let mut checked = 0;
    for k in 0..32u32 {
        {
            let _stage = rt.enter(0)?;
            rt.engine(0, &primary)?.htod_into(&input(k), &mut acts[0])?; // ordered before the launch
        }
        let slot = step.launch()? as u32; // every stage's graph, in order, no host wait
        let output = rt.readback_of(&acts[1])?.wait()?.to_vec();
        let mut x = primary.htod(&input(k))?;
        for layer in 0..2 * LAYERS {
            primary.toy_layer(&mut x, slot, layer)?;
        }
        let expected = primary.dtoh(&x)?;
        if let Some(i) = output.iter().zip(&expected).position(|(a, b)| a.to_bits() != b.to_bits()) {
            return Err(
                format!("step {k}, element {i}: the graphs gave {}, one engine {}", output[i], expected[i]).into()
            );
        }
        checked += 1;
    }
    println!("04_graph_mode: {checked} steps replayed as CUDA graphs, each identical to one engine's");
    Ok(())
}

fn main() -> ExitCode {
    let usage = "usage: 04_graph_mode [-h|--help]";
    if let Some(arg) = std::env::args_os().nth(1) {
        if arg == "-h" || arg == "--help" {
            println!(
                "{usage}\n\nLesson 4: a two-stage step captured as CUDA graphs and replayed, checked against one engine."
            );
            return ExitCode::SUCCESS;
        }
        eprintln!("04_graph_mode: unexpected argument '{}'\n{usage}", arg.to_string_lossy());
        return ExitCode::from(2);
    }
    match run() {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("04_graph_mode: {}", ppnrt::error::chain(&*e));
            ExitCode::FAILURE
        }
    }
}
