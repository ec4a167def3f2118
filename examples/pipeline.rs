//! A tool (not a lesson: the numbered examples are those): a decode loop of the toy residual
//! model (`Engine::toy_layer`) over N pipeline stages, timed and checked.
//!
//! Each step feeds the previous step's output back in (as batch-1 decode does) and passes it
//! through every stage; the last stage records a completion event that ends the step. The same
//! model runs on one stage alongside, and the outputs must match bit for bit.
//!
//! ```text
//! pipeline [--stages N] [--devices 0,0,1,1] [--slots S] [--transport auto|peer|staged]
//!          [--steps K] [--n ELEMENTS] [--layers L] [--graph] [--env] [--help]
//! ```
//! `--graph` runs each step as CUDA graphs (`PpNRt::capture_step`, one graph per stage per ring
//! slot, replayed by `StepGraphs::launch`); a captured layer's step parameter is then the slot, and
//! the one-stage run uses the same parameters.
//! Defaults: every visible GPU, two stages each; 2 slots; auto transport; 500 steps; 8192
//! elements (32 KiB of f32); 32 layers. With `--env` the placement comes from the `PPNRT_*`
//! variables instead (see `PpConfig`).
//!
//! Exit status: 0 when the outputs match; 1 on an error (no GPU included) or a mismatch; 2 for a
//! bad command line or placement, reported before the GPU is asked anything.

use std::process::ExitCode;
use std::time::Instant;

use ppnrt::{CudaSlice, Device, Engine, PpConfig, PpNRt, TransportPolicy};

/// The command line, as given (checked before the GPU is asked anything).
struct Args {
    stages: Option<usize>,
    devices: Option<Vec<i32>>,
    slots: Option<usize>,
    transport: Option<TransportPolicy>,
    /// Read the placement from the `PPNRT_*` variables (`--env`).
    env: bool,
    steps: usize,
    n: usize,
    layers: u32,
    graph: bool,
    help: bool,
}

/// A number of the flag `flag` within `range`, or an error naming both (never truncated).
fn bounded<T>(flag: &str, value: std::ffi::OsString, range: std::ops::RangeInclusive<T>) -> Result<T, String>
where
    T: std::str::FromStr + PartialOrd + std::fmt::Display,
    T::Err: std::fmt::Display,
{
    let text = value.into_string().map_err(|v| format!("{flag} {v:?}: not UTF-8"))?;
    let number = text.trim().parse::<T>().map_err(|e| format!("{flag} {text}: {e}"))?;
    if !range.contains(&number) {
        return Err(format!("{flag} {text}: must be between {} and {}", range.start(), range.end()));
    }
    Ok(number)
}

fn parse_args() -> Result<Args, String> {
    use lexopt::prelude::*;
    let mut args = Args {
        stages: None,
        devices: None,
        slots: None,
        transport: None,
        env: false,
        steps: 500,
        n: 8192,
        layers: 32,
        graph: false,
        help: false,
    };
    let mut parser = lexopt::Parser::from_env();
    let flag_error = |e: lexopt::Error| e.to_string();
    while let Some(arg) = parser.next().map_err(flag_error)? {
        match arg {
            Long("stages") => {
                args.stages = Some(bounded("--stages", parser.value().map_err(flag_error)?, 1..=ppnrt::pp::MAX_STAGES)?)
            }
            Long("devices") => {
                let text = parser.value().map_err(flag_error)?.string().map_err(flag_error)?;
                let list = text
                    .split(',')
                    .map(|d| bounded("--devices", d.into(), 0..=i32::MAX))
                    .collect::<Result<Vec<_>, _>>()?;
                args.devices = Some(list);
            }
            Long("slots") => {
                args.slots = Some(bounded("--slots", parser.value().map_err(flag_error)?, 1..=ppnrt::pp::MAX_SLOTS)?)
            }
            Long("transport") => {
                let text = parser.value().map_err(flag_error)?.string().map_err(flag_error)?;
                args.transport = Some(match text.as_str() {
                    "auto" => TransportPolicy::Auto,
                    "peer" => TransportPolicy::Peer,
                    "staged" => TransportPolicy::Staged,
                    other => return Err(format!("--transport {other}: expected auto, peer or staged")),
                })
            }
            Long("env") => args.env = true,
            Long("steps") => args.steps = bounded("--steps", parser.value().map_err(flag_error)?, 1..=100_000_000)?,
            Long("n") => args.n = bounded("--n", parser.value().map_err(flag_error)?, 1..=(1usize << 30))?,
            Long("layers") => args.layers = bounded("--layers", parser.value().map_err(flag_error)?, 1..=100_000)?,
            Long("graph") => args.graph = true,
            Short('h') | Long("help") => args.help = true,
            Long("bench") => {} // tolerated: `cargo bench` passes it to every target
            other => return Err(other.unexpected().to_string()),
        }
    }
    if args.env && (args.stages.is_some() || args.devices.is_some() || args.slots.is_some() || args.transport.is_some())
    {
        return Err("--env reads the placement from the PPNRT_* variables: give it without placement flags".into());
    }
    if let (Some(stages), Some(devices)) = (args.stages, &args.devices) {
        if devices.len() != stages {
            return Err(format!("--stages {stages} with --devices listing {} device(s)", devices.len()));
        }
    }
    Ok(args)
}

/// The pipeline's configuration: from the flags (stages spread over `devices_present` GPUs by
/// default), or from the environment with `--env`.
fn config_of(args: &Args, devices_present: i32) -> Result<PpConfig, String> {
    if args.env {
        return PpConfig::from_env().map_err(|e| ppnrt::error::chain(&e));
    }
    let devices = match (&args.devices, args.stages) {
        (Some(d), _) => d.clone(),
        // N stages spread contiguously over the visible GPUs.
        (None, Some(s)) => (0..s).map(|i| (i * devices_present as usize / s) as i32).collect(),
        (None, None) => (0..devices_present).flat_map(|d| [d, d]).collect(),
    };
    let config = PpConfig::with_devices(&devices)
        .with_slots(args.slots.unwrap_or(2))
        .with_transport(args.transport.unwrap_or_default());
    config.validate().map_err(|e| ppnrt::error::chain(&e))?;
    Ok(config)
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

const SYNOPSIS: &str = "\
usage: pipeline [--stages N] [--devices 0,0,1,1] [--slots S] [--transport auto|peer|staged]
                [--steps K] [--n ELEMENTS] [--layers L] [--graph] [--env] [-h|--help]";

const HELP: &str = "\
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
  --env             read the placement from the PPNRT_* variables instead (see PpConfig)
  -h, --help        this text
Exit status 0 when the outputs match; 1 on an error (no GPU included) or a mismatch; 2 for a
bad command line or placement (checked before the GPU).";

/// Why a run failed: a bad command line or placement (exit status 2), or an error at run time
/// or a mismatch (1).
enum Failure {
    Usage(String),
    Runtime(String),
}

impl<E: std::error::Error + 'static> From<E> for Failure {
    fn from(e: E) -> Failure {
        Failure::Runtime(ppnrt::error::chain(&e))
    }
}

fn run(args: &Args) -> Result<(), Failure> {
    let devices = Device::count().map_err(|e| Failure::Runtime(format!("no GPU: {}", ppnrt::error::chain(&e))))?;
    if devices == 0 {
        return Err(Failure::Runtime("no GPU: the driver sees no device".into()));
    }
    let config = config_of(args, devices).map_err(Failure::Usage)?;
    let primary = Engine::new(0)?;
    let rt = PpNRt::new(config.clone(), &primary)?;
    println!("config: {config}");
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
    single_stage(&primary, &x0, warm, args.layers, &|k| k as u32)?;
    let (mut one, reference, mut many, output) = if args.graph {
        println!("mode: CUDA graphs, one per stage per slot (a layer's step parameter is the slot)");
        pipelined_graph(&rt, &primary, &x0, warm, args.layers)?;
        let (many, output, slots) = pipelined_graph(&rt, &primary, &x0, args.steps, args.layers)?;
        let (one, reference) = single_stage(&primary, &x0, args.steps, args.layers, &|k| slots[k])?;
        (one, reference, many, output)
    } else {
        pipelined(&rt, &primary, &x0, warm, args.layers)?;
        let (one, reference) = single_stage(&primary, &x0, args.steps, args.layers, &|k| k as u32)?;
        let (many, output) = pipelined(&rt, &primary, &x0, args.steps, args.layers)?;
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
    if output.len() != reference.len() {
        let (got, want) = (output.len(), reference.len());
        return Err(Failure::Runtime(format!("the output has {got} elements, the one-stage run's {want}")));
    }
    if let Some(i) = output.iter().zip(&reference).position(|(a, b)| a.to_bits() != b.to_bits()) {
        return Err(Failure::Runtime(format!(
            "outputs differ from the one-stage run after {} steps: element {i} is {}, the one-stage run's {}",
            args.steps, output[i], reference[i]
        )));
    }
    println!("outputs: bitwise identical to the one-stage run after {} steps", args.steps);
    Ok(())
}

fn main() -> ExitCode {
    let args = match parse_args() {
        Ok(args) => args,
        Err(e) => {
            eprintln!("pipeline: {e}\n{SYNOPSIS}");
            return ExitCode::from(2);
        }
    };
    if args.help {
        println!("{SYNOPSIS}\n\n{HELP}");
        return ExitCode::SUCCESS;
    }
    match run(&args) {
        Ok(()) => ExitCode::SUCCESS,
        Err(Failure::Usage(e)) => {
            eprintln!("pipeline: {e}\n{SYNOPSIS}");
            ExitCode::from(2)
        }
        Err(Failure::Runtime(e)) => {
            eprintln!("pipeline: {e}");
            ExitCode::FAILURE
        }
    }
}
