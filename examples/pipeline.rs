//! A decode loop of the toy residual model over N pipeline stages.
//!
//! Each step feeds the previous step's output back in (as batch-1 decode does) and passes it
//! through every stage; the last stage records a completion event that ends the step. The same
//! model runs on one stage alongside, and the outputs must match bit for bit.
//!
//! ```text
//! pipeline [--stages N] [--devices 0,0,1,1] [--slots S] [--transport auto|peer|staged]
//!          [--steps K] [--n ELEMENTS] [--layers L] [--graph]
//! ```
//! `--graph` runs each step as CUDA graphs (`PpNRt::capture_step`, one graph per stage per ring
//! slot, replayed by `StepGraphs::launch`); a captured layer's step parameter is then the slot, and
//! the one-stage run uses the same parameters.
//! Defaults: every visible GPU, two stages each; 2 slots; auto transport; 500 steps; 8192
//! elements (32 KiB of f32); 32 layers. Where no flag sets the placement, the `PPNRT_*`
//! variables do (see `PpConfig`). With no GPU it prints why and exits with status 2.

use std::process::ExitCode;
use std::time::Instant;

use ppnrt::{CudaSlice, Device, Engine, PpConfig, PpNRt, TransportPolicy};

struct Args {
    config: PpConfig,
    steps: usize,
    n: usize,
    layers: u32,
    graph: bool,
}

fn parse_args(devices_present: i32) -> Result<Args, String> {
    let mut stages: Option<usize> = None;
    let mut devices: Option<Vec<i32>> = None;
    let mut slots: Option<usize> = None;
    let mut transport: Option<TransportPolicy> = None;
    let (mut steps, mut n, mut layers) = (500usize, 8192usize, 32u32);
    let mut graph = false;
    let mut args = std::env::args().skip(1);
    while let Some(flag) = args.next() {
        let mut value = || args.next().ok_or(format!("{flag} needs a value"));
        let number = |text: String| text.parse::<usize>().map_err(|e| format!("{flag} {text}: {e}"));
        match flag.as_str() {
            "--stages" => stages = Some(number(value()?)?),
            "--devices" => {
                let text = value()?;
                let list = text
                    .split(',')
                    .map(|d| d.trim().parse::<i32>().map_err(|e| format!("--devices {text}: {e}")))
                    .collect::<Result<Vec<_>, _>>()?;
                devices = Some(list);
            }
            "--slots" => slots = Some(number(value()?)?),
            "--transport" => {
                transport = Some(match value()?.as_str() {
                    "auto" => TransportPolicy::Auto,
                    "peer" => TransportPolicy::Peer,
                    "staged" => TransportPolicy::Staged,
                    other => return Err(format!("--transport {other}: expected auto, peer or staged")),
                })
            }
            "--steps" => steps = number(value()?)?,
            "--n" => n = number(value()?)?,
            "--layers" => layers = number(value()?)? as u32,
            "--graph" => graph = true,
            "--bench" => {} // tolerated: `cargo bench` passes it to every target
            other => return Err(format!("unknown flag {other}")),
        }
    }
    let placement_flags = stages.is_some() || devices.is_some() || slots.is_some() || transport.is_some();
    let env_set = ["PPNRT_STAGES", "PPNRT_DEVICES", "PPNRT_SLOTS", "PPNRT_TRANSPORT"]
        .iter()
        .any(|v| std::env::var_os(v).is_some());
    let config = if !placement_flags && env_set {
        PpConfig::from_env().map_err(|e| ppnrt::error::chain(&e))?
    } else {
        let devices = match (devices, stages) {
            (Some(d), _) => d,
            // N stages spread contiguously over the visible GPUs.
            (None, Some(s)) => (0..s).map(|i| (i * devices_present as usize / s.max(1)) as i32).collect(),
            (None, None) => (0..devices_present).flat_map(|d| [d, d]).collect(),
        };
        PpConfig::with_devices(&devices).slots(slots.unwrap_or(2)).transport(transport.unwrap_or_default())
    };
    if n == 0 || steps == 0 || layers == 0 {
        return Err("--n, --steps and --layers must be at least 1".into());
    }
    Ok(Args { config, steps, n, layers, graph })
}

fn percentile(sorted: &[f64], p: f64) -> f64 {
    sorted[((sorted.len() - 1) as f64 * p).round() as usize]
}

/// Runs `steps` decode steps on one stage, step `k`'s layers with step parameter `param(k)`;
/// returns per-step seconds and the final state.
fn single_stage(
    engine: &Engine,
    x0: &[f32],
    steps: usize,
    layers: u32,
    param: &dyn Fn(usize) -> u32,
) -> ppnrt::Result<(Vec<f64>, Vec<f32>)> {
    let mut x = engine.htod(x0)?;
    engine.synchronize()?;
    let mut times = Vec::with_capacity(steps);
    for step in 0..steps {
        let t0 = Instant::now();
        for layer in 0..layers {
            engine.toy_layer(&mut x, param(step), layer)?;
        }
        engine.synchronize()?;
        times.push(t0.elapsed().as_secs_f64());
    }
    Ok((times, engine.dtoh(&x)?))
}

/// Runs `steps` decode steps through the pipeline; returns per-step seconds and the final state.
fn pipelined(
    rt: &PpNRt,
    primary: &Engine,
    x0: &[f32],
    steps: usize,
    layers: u32,
) -> ppnrt::Result<(Vec<f64>, Vec<f32>)> {
    let stages = rt.n_stages();
    let share = |s: usize| (s as u32 * layers) / stages as u32;
    let mut x: CudaSlice<f32> = {
        let _scope = rt.enter(0)?;
        rt.engine(0, primary)?.htod(x0)?
    };
    rt.synchronize()?;
    let n = x0.len();
    let mut times = Vec::with_capacity(steps);
    for step in 0..steps as u32 {
        let t0 = Instant::now();
        for s in 0..stages {
            let engine = rt.engine(s, primary)?;
            let _scope = rt.enter(s)?;
            if s == 0 && step > 0 {
                // The previous step's output comes back to the first stage (the next token).
                let slot = rt.tx_back(&x)?;
                x = slot;
            }
            for layer in share(s)..share(s + 1) {
                engine.toy_layer(&mut x, step, layer)?;
            }
            if s + 1 < stages {
                let slot = rt.tx(s, &x, n)?;
                x = rt.rx(s, slot, n)?;
            }
        }
        rt.record_done()?.synchronize()?;
        times.push(t0.elapsed().as_secs_f64());
    }
    let last = stages - 1;
    let _scope = rt.enter(last)?;
    Ok((times, rt.engine(last, primary)?.dtoh(&x)?))
}

/// Runs `steps` decode steps through the pipeline as CUDA graphs; returns per-step seconds, the
/// final state, and the slot (the captured step parameter) each step used.
fn pipelined_graph(
    rt: &PpNRt,
    primary: &Engine,
    x0: &[f32],
    steps: usize,
    layers: u32,
) -> ppnrt::Result<(Vec<f64>, Vec<f32>, Vec<u32>)> {
    let stages = rt.n_stages();
    let share = |s: usize| (s as u32 * layers) / stages as u32;
    let n = x0.len();
    // Persistent activations per stage: graphs run on memory allocated before the capture.
    let mut acts = Vec::with_capacity(stages);
    for s in 0..stages {
        let _scope = rt.enter(s)?;
        acts.push(rt.engine(s, primary)?.alloc_persistent::<f32>(n)?);
    }
    {
        let _scope = rt.enter(0)?;
        rt.engine(0, primary)?.htod_into(x0, &mut acts[0])?;
    }
    let mut step_graphs = rt.capture_step::<f32>(n, |stage| {
        let s = stage.stage();
        let engine = rt.engine(s, primary)?;
        let x = &mut acts[s];
        if s > 0 {
            stage.rx_into(x)?;
        }
        for layer in share(s)..share(s + 1) {
            engine.toy_layer(x, stage.slot() as u32, layer)?;
        }
        if s + 1 < stages {
            stage.tx(x)?;
        }
        Ok(())
    })?;
    rt.synchronize()?;
    let mut times = Vec::with_capacity(steps);
    let mut slots = Vec::with_capacity(steps);
    for step in 0..steps {
        let t0 = Instant::now();
        if step > 0 && stages > 1 {
            // The previous step's output comes back to the first stage (the next token).
            let (first, rest) = acts.split_at_mut(1);
            rt.stage_stream(0)?.memcpy_dtod(&rest[stages - 2], &mut first[0])?;
        }
        slots.push(step_graphs.launch()? as u32);
        rt.record_done()?.synchronize()?;
        times.push(t0.elapsed().as_secs_f64());
    }
    let last = stages - 1;
    let _scope = rt.enter(last)?;
    Ok((times, rt.engine(last, primary)?.dtoh(&acts[last])?, slots))
}

/// Returning the last stage's output to the first stage for the next step.
trait TxBack {
    fn tx_back(&self, x: &CudaSlice<f32>) -> ppnrt::Result<CudaSlice<f32>>;
}

impl TxBack for PpNRt {
    fn tx_back(&self, x: &CudaSlice<f32>) -> ppnrt::Result<CudaSlice<f32>> {
        let first = self.stage_stream(0)?;
        let mut back = CudaSlice::<f32>::alloc(first, x.len())?;
        first.memcpy_dtod(x, &mut back)?;
        Ok(back)
    }
}

const USAGE: &str = "\
usage: pipeline [--stages N] [--devices 0,0,1,1] [--slots S] [--transport auto|peer|staged]
                [--steps K] [--n ELEMENTS] [--layers L] [--graph]

A decode loop of the toy residual model over N pipeline stages, checked bit for bit against the
same model on one stage.
  --stages N        stage count (default: two per visible GPU)
  --devices LIST    stage-to-device map, e.g. 0,0,1,1 (default: every GPU, two stages each)
  --slots S         slots per boundary ring (default 2)
  --transport T     auto, peer or staged (default auto)
  --steps K         decode steps (default 500)
  --n ELEMENTS      f32 elements per activation (default 8192 = 32 KiB)
  --layers L        toy layers in the model (default 32)
  --graph           run each step as CUDA graphs (capture_step + launch)
Where no flag sets the placement, the PPNRT_* variables do. Exit status 2 on any error.";

fn run() -> Result<(), String> {
    if std::env::args().skip(1).any(|a| a == "--help" || a == "-h") {
        println!("{USAGE}");
        return Ok(());
    }
    let devices = Device::count().map_err(|e| format!("pipeline: no GPU: {e}"))?;
    if devices == 0 {
        return Err("pipeline: no GPU: the driver sees no device".into());
    }
    let args = parse_args(devices)?;
    let primary = Engine::new(0).map_err(|e| ppnrt::error::chain(&e))?;
    let rt = PpNRt::new(args.config.clone(), &primary).map_err(|e| ppnrt::error::chain(&e))?;
    println!("config: {}", args.config);
    println!("plan: {}", rt.plan());
    println!(
        "model: {} layers, {} elements ({} KiB f32), {} steps",
        args.layers,
        args.n,
        args.n * 4 / 1024,
        args.steps
    );
    let x0: Vec<f32> =
        (0..args.n).map(|i| ppnrt::kernels::pattern(42, i as u64) as f32 / u32::MAX as f32 - 0.5).collect();

    // Warm-up (module loads, pool growth), then the measured runs.
    let warm = args.steps.clamp(1, 20);
    let chain = |e: ppnrt::Error| ppnrt::error::chain(&e);
    single_stage(&primary, &x0, warm, args.layers, &|k| k as u32).map_err(chain)?;
    let (mut one, reference, mut many, output) = if args.graph {
        println!("mode: CUDA graphs, one per stage per slot (a layer's step parameter is the slot)");
        pipelined_graph(&rt, &primary, &x0, warm, args.layers).map_err(chain)?;
        let (many, output, slots) = pipelined_graph(&rt, &primary, &x0, args.steps, args.layers).map_err(chain)?;
        let (one, reference) = single_stage(&primary, &x0, args.steps, args.layers, &|k| slots[k]).map_err(chain)?;
        (one, reference, many, output)
    } else {
        pipelined(&rt, &primary, &x0, warm, args.layers).map_err(chain)?;
        let (one, reference) = single_stage(&primary, &x0, args.steps, args.layers, &|k| k as u32).map_err(chain)?;
        let (many, output) = pipelined(&rt, &primary, &x0, args.steps, args.layers).map_err(chain)?;
        (one, reference, many, output)
    };
    one.sort_by(|a, b| a.total_cmp(b));
    many.sort_by(|a, b| a.total_cmp(b));
    let us = 1e6;
    let (one_med, many_med) = (percentile(&one, 0.5) * us, percentile(&many, 0.5) * us);
    println!("one stage : step median {one_med:8.1} µs, p99 {:8.1} µs", percentile(&one, 0.99) * us);
    println!("{} stage(s): step median {many_med:8.1} µs, p99 {:8.1} µs", rt.n_stages(), percentile(&many, 0.99) * us);
    // Each step crosses every boundary once and returns to the first stage once.
    let hops = rt.n_boundaries() + usize::from(rt.n_stages() > 1);
    if hops > 0 {
        println!(
            "transport adds {:.1} µs per boundary crossing (median step difference / {hops})",
            (many_med - one_med) / hops as f64
        );
    }
    let same =
        output.len() == reference.len() && output.iter().zip(&reference).all(|(a, b)| a.to_bits() == b.to_bits());
    if !same {
        let first = output.iter().zip(&reference).position(|(a, b)| a.to_bits() != b.to_bits());
        return Err(format!("outputs differ from the one-stage run (first difference at element {first:?})"));
    }
    println!("outputs: bitwise identical to the one-stage run after {} steps", args.steps);
    Ok(())
}

fn main() -> ExitCode {
    match run() {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("{e}");
            ExitCode::from(2)
        }
    }
}
