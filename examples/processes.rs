//! A tool (not a lesson: the numbered examples are those, `06_two_processes` for this topic): a
//! decode loop whose stages run in several processes: run one copy per rank, each with the
//! same `PPNRT_*` configuration plus its own `PPNRT_RANK` (`scripts/launch-local.sh` starts the
//! ranks of one host; on several hosts, start one per host with `PPNRT_RENDEZVOUS` naming rank
//! 0's address).
//!
//! ```text
//! scripts/launch-local.sh 0,1,0,1 --one-gpu-per-rank -- target/release/examples/processes --steps 200
//! ```
//!
//! Every rank runs its own stages of each step: stage 0 makes the step's input, each stage runs
//! its share of a toy model's layers, and boundaries between ranks go through NCCL (`tx` and
//! `rx_wait` as within one process). The rank of the last stage reads each step's output back
//! with `readback` (overlapping the next steps) and checks it bitwise against one engine
//! running the whole model. Exit status 0 when identical; 1 on a mismatch or an error (no GPU
//! included); 2 for a bad command line or configuration.
//!
//! `--graph` runs each step as CUDA graphs: every rank captures its own stages once
//! (`capture_step`, one graph per stage per ring slot; a layer's step parameter is then the
//! slot) and replays them (`launch`); boundaries between ranks stay NCCL's, around the graphs.

use std::collections::VecDeque;
use std::process::ExitCode;
use std::time::{Duration, Instant};

use ppnrt::pp::PendingReadback;
use ppnrt::{CudaSlice, Device, Engine, PpConfig, PpNRt};

const LAYERS: u32 = 12;
const N: usize = 8192;

fn input(step: usize) -> Vec<f32> {
    (0..N).map(|i| ppnrt::kernels::pattern(step as u32, i as u64) as f32 / u32::MAX as f32 - 0.5).collect()
}

fn layers_of(s: usize, n_stages: usize) -> std::ops::Range<u32> {
    let per = |s: usize| (s as u32 * LAYERS) / n_stages as u32;
    per(s)..per(s + 1)
}

const SYNOPSIS: &str = "usage: processes [--steps N] [--graph] [-h|--help]";

const HELP: &str = "\
One rank of a decode loop whose stages run in several processes, checked bit for bit against
one engine. Its placement comes from the PPNRT_* variables (PPNRT_RANKS, PPNRT_RANK,
PPNRT_RENDEZVOUS, PPNRT_DEVICES, PPNRT_JOB_SECRET, ...); scripts/launch-local.sh starts the
ranks of one host.
  --steps N         decode steps (default 200)
  --graph           run each step as CUDA graphs, each rank replaying its own stages
  -h, --help        this text
Exit status 0 when identical; 1 on a mismatch or an error (no GPU included); 2 for a bad
command line or configuration (checked before the GPU).";

/// The command line: steps, graph mode, help.
fn parse_args() -> Result<(usize, bool, bool), String> {
    use lexopt::prelude::*;
    let (mut steps, mut graph, mut help) = (200usize, false, false);
    let mut parser = lexopt::Parser::from_env();
    while let Some(arg) = parser.next().map_err(|e| e.to_string())? {
        match arg {
            Long("steps") => {
                let text = parser.value().and_then(|v| v.string()).map_err(|e| e.to_string())?;
                steps = text.parse().map_err(|e| format!("--steps {text}: {e}"))?;
                if !(1..=100_000_000).contains(&steps) {
                    return Err(format!("--steps {text}: must be between 1 and 100000000"));
                }
            }
            Long("graph") => graph = true,
            Short('h') | Long("help") => help = true,
            Long("bench") => {} // tolerated: `cargo bench` passes it to every target
            other => return Err(other.unexpected().to_string()),
        }
    }
    Ok((steps, graph, help))
}

fn run(config: PpConfig, steps: usize, graph: bool) -> Result<(), String> {
    fn chain(e: impl std::error::Error + 'static) -> String {
        ppnrt::error::chain(&e)
    }
    let primary = Engine::new(0).map_err(chain)?;
    let rt = PpNRt::new(config, &primary).map_err(chain)?;
    println!("rank {}: {}", rt.rank(), rt.plan());
    let n_stages = rt.n_stages();
    let last = n_stages - 1;
    let timeout = Duration::from_secs(60);
    let mut pending: VecDeque<(usize, PendingReadback<f32>)> = VecDeque::new();
    let (mut checked, started) = (0, Instant::now());
    // The step parameter of a layer: the step, or in graph mode the slot (fixed in each graph).
    let n_slots = rt.n_slots();
    let parameter = move |step: usize| if graph { (step % n_slots) as u32 } else { step as u32 };
    let mut check = |step: usize, values: &[f32]| -> Result<(), String> {
        let mut x = primary.htod(&input(step)).map_err(chain)?;
        for layer in 0..LAYERS {
            primary.toy_layer(&mut x, parameter(step), layer).map_err(chain)?;
        }
        let expected = primary.dtoh(&x).map_err(chain)?;
        if let Some(i) = values.iter().zip(&expected).position(|(a, b)| a.to_bits() != b.to_bits()) {
            return Err(format!(
                "step {step}: output differs from one engine's at element {i}: {}, one engine {}",
                values[i], expected[i]
            ));
        }
        checked += 1;
        Ok(())
    };
    if graph {
        // Persistent activations of this rank's stages, allocated before the capture.
        let mut acts: Vec<Option<CudaSlice<f32>>> = Vec::new();
        for s in 0..n_stages {
            let owned = rt.owns_stage(s);
            acts.push(if owned {
                Some(rt.engine(s, &primary).map_err(chain)?.alloc_persistent::<f32>(N).map_err(chain)?)
            } else {
                None
            });
        }
        let mut graphs = rt
            .capture_step::<f32>(N, |stage| {
                let s = stage.stage();
                let engine = rt.engine(s, &primary)?;
                let x = acts[s].as_mut().expect("a stage of this rank");
                if s > 0 {
                    stage.rx_into(x)?;
                }
                for layer in layers_of(s, n_stages) {
                    engine.toy_layer(x, stage.slot() as u32, layer)?;
                }
                if s < last {
                    stage.tx(x)?;
                }
                Ok(())
            })
            .map_err(chain)?;
        for step in 0..steps {
            if let Some(x) = acts[0].as_mut() {
                let _scope = rt.enter(0).map_err(chain)?;
                rt.engine(0, &primary).map_err(chain)?.htod_into(&input(step), x).map_err(chain)?;
            }
            graphs.launch().map_err(chain)?;
            if let Some(y) = acts[last].as_ref() {
                let engine = rt.engine(last, &primary).map_err(chain)?;
                let _scope = rt.enter(last).map_err(chain)?;
                let mut out = engine.alloc::<f32>(N).map_err(chain)?;
                engine.dtod(y, &mut out).map_err(chain)?;
                pending.push_back((step, rt.readback(out).map_err(chain)?));
            }
            while pending.len() > 4 || (step + 1 == steps && !pending.is_empty()) {
                let (done, readback) = pending.pop_front().expect("not empty");
                check(done, readback.wait().map_err(chain)?)?;
            }
        }
    }
    for step in (0..steps).filter(|_| !graph) {
        let slot = step % rt.n_slots();
        let mut carried = None;
        for s in (0..n_stages).filter(|&s| rt.owns_stage(s)) {
            let engine = rt.engine(s, &primary).map_err(chain)?;
            let _scope = rt.enter(s).map_err(chain)?;
            let mut x = match (s, carried) {
                (0, _) => engine.htod(&input(step)).map_err(chain)?,
                (_, Some((b, index))) if b + 1 == s => rt.rx::<f32>(b, index, N).map_err(chain)?,
                _ => rt.rx_wait::<f32>(s - 1, slot, N, timeout).map_err(chain)?,
            };
            for layer in layers_of(s, n_stages) {
                engine.toy_layer(&mut x, step as u32, layer).map_err(chain)?;
            }
            if s == last {
                pending.push_back((step, rt.readback(x).map_err(chain)?));
            } else {
                carried = Some((s, rt.tx(s, &x, N).map_err(chain)?));
            }
        }
        while pending.len() > 4 || (step + 1 == steps && !pending.is_empty()) {
            let (done, readback) = pending.pop_front().expect("not empty");
            check(done, readback.wait().map_err(chain)?)?;
        }
    }
    rt.synchronize().map_err(chain)?;
    if rt.owns_stage(last) {
        println!(
            "outputs: bitwise identical to one engine after {checked} steps ({:.1} ms)",
            started.elapsed().as_secs_f64() * 1e3
        );
    } else {
        println!("rank {}: ran its stages of {steps} steps", rt.rank());
    }
    Ok(())
}

fn main() -> ExitCode {
    let (steps, graph, help) = match parse_args() {
        Ok(parsed) => parsed,
        Err(e) => {
            eprintln!("processes: {e}\n{SYNOPSIS}");
            return ExitCode::from(2);
        }
    };
    if help {
        println!("{SYNOPSIS}\n\n{HELP}");
        return ExitCode::SUCCESS;
    }
    let config = match PpConfig::from_env() {
        Ok(config) => config,
        Err(e) => {
            eprintln!("processes: {}", ppnrt::error::chain(&ppnrt::Error::Config(e)));
            return ExitCode::from(2);
        }
    };
    match Device::count() {
        Ok(n) if n > 0 => {}
        Ok(_) => {
            eprintln!("processes: no GPU: the driver sees no device");
            return ExitCode::FAILURE;
        }
        Err(e) => {
            eprintln!("processes: no GPU: {}", ppnrt::error::chain(&e));
            return ExitCode::FAILURE;
        }
    }
    match run(config, steps, graph) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("processes: {e}");
            ExitCode::FAILURE
        }
    }
}
