//! A Llama-family decoder in candle, its layers split over S pipeline stages, with ppnrt moving
//! the hidden states between the stages' cudarc buffers (`ppnrt::interop`, no copy beyond the
//! boundary's own).
//!
//! The reference is candle-transformers' own `Llama` on one device. candle-transformers keeps its
//! decoder layers private, so the stages run the same layers written here from candle-nn and
//! candle-transformers' public parts, op for op as `candle_transformers::models::llama` runs
//! them; the weights are random from a fixed seed (each tensor from its name, so every split
//! gets the same values). Each decode step's logits must be bitwise identical to the
//! reference's: a prompt's prefill, then greedy decoding, each stage on its own candle stream,
//! which is also the stage's ppnrt stream (`PpNRt::with_stage_streams`): a stage's candle work
//! and its sends and receives run in one stream's order, with no join.
//!
//! Eager only: candle allocates every tensor and grows the KV cache by concatenation, so a step's
//! shapes and addresses change from token to token and a captured step graph would not replay it.
//!
//! Build with `scripts/build-candle-example.sh` (candle links the CUDA libraries; the script
//! fetches them); `candle-llama --help` for the options.

mod model;
mod weights;

use std::process::ExitCode;
use std::sync::Arc;
use std::time::Instant;

use candle_core::cuda_backend::{CudaDevice, CudaStorage};
use candle_core::op::BackpropOp;
use candle_core::{DType, Device, Storage, Tensor};
use half::bf16;
use ppnrt::interop::EngineStream;
use ppnrt::{Engine, PpConfig, PpNRt};

use model::{Shape, StagePart};

const HELP: &str = "\
candle-llama: a Llama decoder (candle, bf16, random weights from a seed) split over pipeline
stages with ppnrt, checked bitwise against candle-transformers' Llama on one device.

Options:
  --stages LIST      stage counts to run, each against the reference (default 2,4,8)
  --gpus G           spread the stages over GPUs 0..G, contiguously (default 1)
  --layers L         decoder layers (default 16)
  --hidden H         hidden size (default 2048)
  --intermediate I   MLP size (default 5632)
  --heads A          attention heads (default 32)
  --kv-heads K       key/value heads (default 4)
  --vocab V          vocabulary size (default 32000)
  --prompt P         prompt tokens, prefilled in one step (default 16)
  --tokens T         tokens decoded after the prompt (default 64)
  --seed N           weight and prompt seed (default 42)
  -h, --help         this text
";

/// The run's settings, checked before any GPU is touched.
struct Args {
    stages: Vec<usize>,
    gpus: usize,
    shape: Shape,
    prompt: usize,
    tokens: usize,
    seed: u64,
}

fn parse_args() -> Result<Option<Args>, String> {
    use lexopt::prelude::*;
    let mut args = Args { stages: vec![2, 4, 8], gpus: 1, shape: Shape::default(), prompt: 16, tokens: 64, seed: 42 };
    let mut parser = lexopt::Parser::from_env();
    let number = |parser: &mut lexopt::Parser, name: &str| -> Result<usize, String> {
        let value = parser.value().map_err(|e| e.to_string())?;
        let text = value.to_string_lossy().into_owned();
        text.parse::<usize>().map_err(|_| format!("{name}: {text:?} is not a whole number"))
    };
    while let Some(arg) = parser.next().map_err(|e| e.to_string())? {
        match arg {
            Long("stages") => {
                let value = parser.value().map_err(|e| e.to_string())?.to_string_lossy().into_owned();
                args.stages = value
                    .split(',')
                    .map(|s| s.trim().parse::<usize>().map_err(|_| format!("--stages: {s:?} is not a whole number")))
                    .collect::<Result<_, _>>()?;
            }
            Long("gpus") => args.gpus = number(&mut parser, "--gpus")?,
            Long("layers") => args.shape.layers = number(&mut parser, "--layers")?,
            Long("hidden") => args.shape.hidden = number(&mut parser, "--hidden")?,
            Long("intermediate") => args.shape.intermediate = number(&mut parser, "--intermediate")?,
            Long("heads") => args.shape.heads = number(&mut parser, "--heads")?,
            Long("kv-heads") => args.shape.kv_heads = number(&mut parser, "--kv-heads")?,
            Long("vocab") => args.shape.vocab = number(&mut parser, "--vocab")?,
            Long("prompt") => args.prompt = number(&mut parser, "--prompt")?,
            Long("tokens") => args.tokens = number(&mut parser, "--tokens")?,
            Long("seed") => args.seed = number(&mut parser, "--seed")? as u64,
            Short('h') | Long("help") => {
                print!("{HELP}");
                return Ok(None);
            }
            other => return Err(format!("{} (see --help)", other.unexpected())),
        }
    }
    args.shape.check()?;
    if args.gpus == 0 {
        return Err("--gpus: 0; at least one GPU".into());
    }
    for &s in &args.stages {
        if s == 0 || s > args.shape.layers {
            return Err(format!("--stages: {s} stages for {} layers; each stage needs a layer", args.shape.layers));
        }
    }
    if args.prompt == 0 || args.prompt + args.tokens > args.shape.max_positions {
        return Err(format!(
            "--prompt {} and --tokens {}: the prompt needs a token, and both together at most {} positions",
            args.prompt, args.tokens, args.shape.max_positions
        ));
    }
    Ok(Some(args))
}

fn main() -> ExitCode {
    let args = match parse_args() {
        Ok(Some(args)) => args,
        Ok(None) => return ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("candle-llama: {e}");
            return ExitCode::from(2);
        }
    };
    match run(&args) {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::FAILURE,
        Err(e) => {
            eprintln!("candle-llama: {e}");
            ExitCode::FAILURE
        }
    }
}

/// What can fail in a run: candle's errors and ppnrt's, each as text with its source.
type BoxError = Box<dyn std::error::Error>;

/// A ppnrt error as text with its sources.
fn text<E: std::error::Error + 'static>(e: E) -> BoxError {
    ppnrt::error::chain(&e).into()
}

/// Each step's logits, the time a step took, and the host time its boundary calls took.
struct Decoded {
    logits: Vec<Vec<f32>>,
    step_ms: Vec<f64>,
    boundary_ms: Vec<f64>,
}

fn run(args: &Args) -> Result<bool, BoxError> {
    let present = ppnrt::Device::count().map_err(text)? as usize;
    if present < args.gpus {
        return Err(format!("--gpus {}: {present} GPU(s) present", args.gpus).into());
    }
    let shape = &args.shape;
    let prompt: Vec<u32> = (0..args.prompt).map(|i| weights::token(args.seed, i, shape.vocab)).collect();
    println!(
        "model: {} layers, hidden {}, MLP {}, {} heads ({} key/value), vocabulary {}, bf16, {:.2} G parameters; \
         prompt {} tokens, then {} decoded",
        shape.layers,
        shape.hidden,
        shape.intermediate,
        shape.heads,
        shape.kv_heads,
        shape.vocab,
        shape.parameters() as f64 / 1e9,
        args.prompt,
        args.tokens
    );

    let reference = decode_reference(args, &prompt)?;
    report("candle-transformers Llama, one device", &reference, None);
    let one_stage = decode_staged(args, &prompt, 1)?;
    let mut all_equal = compare("this example's layers, one stage, no boundary", &reference, &one_stage);
    report("this example's layers, one stage", &one_stage, None);
    for &stages in &args.stages {
        let staged = decode_staged(args, &prompt, stages)?;
        let devices = stage_devices(stages, args.gpus);
        let label = format!("{stages} stages on GPUs {devices:?}");
        all_equal &= compare(&label, &reference, &staged);
        report(&label, &staged, Some(&one_stage));
    }
    println!("{}", if all_equal { "all runs bitwise identical to the reference" } else { "MISMATCH" });
    Ok(all_equal)
}

/// The device of each of `stages` stages over `gpus` GPUs, contiguously.
fn stage_devices(stages: usize, gpus: usize) -> Vec<usize> {
    (0..stages).map(|s| s * gpus / stages).collect()
}

/// candle-transformers' Llama on GPU 0: the prompt in one step, then greedy decoding.
fn decode_reference(args: &Args, prompt: &[u32]) -> Result<Decoded, BoxError> {
    use candle_transformers::models::llama::{Cache, Llama};
    let device = Device::Cuda(CudaDevice::new_with_stream(0)?);
    let config = args.shape.config();
    let vb = weights::var_builder(args.seed, &device);
    let model = Llama::load(vb, &config)?;
    let mut cache = Cache::new(true, DType::BF16, &config, &device)?;
    decode_loop(args, prompt, &device, |tokens, position, _| Ok(model.forward(tokens, position, &mut cache)?))
}

/// The prompt's prefill and greedy decoding, `forward` running one step: each step's logits
/// (read back to the host, which also ends the step) and its time.
fn decode_loop(
    args: &Args,
    prompt: &[u32],
    device: &Device,
    mut forward: impl FnMut(&Tensor, usize, &mut f64) -> Result<Tensor, BoxError>,
) -> Result<Decoded, BoxError> {
    let mut decoded = Decoded { logits: Vec::new(), step_ms: Vec::new(), boundary_ms: Vec::new() };
    let mut input = prompt.to_vec();
    let mut position = 0;
    for _ in 0..=args.tokens {
        let start = Instant::now();
        let tokens = Tensor::new(input.as_slice(), device)?.unsqueeze(0)?;
        let mut boundary_ms = 0.0;
        let logits: Vec<f32> = forward(&tokens, position, &mut boundary_ms)?.squeeze(0)?.to_vec1()?;
        decoded.step_ms.push(start.elapsed().as_secs_f64() * 1e3);
        decoded.boundary_ms.push(boundary_ms);
        position += input.len();
        let next = logits
            .iter()
            .enumerate()
            .fold((0, f32::NEG_INFINITY), |best, (i, &v)| if v > best.1 { (i, v) } else { best })
            .0;
        input = vec![next as u32];
        decoded.logits.push(logits);
    }
    Ok(decoded)
}

/// This example's layers split over `stages` stages, ppnrt moving the hidden states.
fn decode_staged(args: &Args, prompt: &[u32], stages: usize) -> Result<Decoded, BoxError> {
    let shape = &args.shape;
    let devices = stage_devices(stages, args.gpus);
    // One ppnrt engine per GPU (each on the device's primary context, which candle shares).
    let engines = (0..args.gpus as i32).map(Engine::new).collect::<Result<Vec<_>, _>>().map_err(text)?;
    // One candle device (its own stream) per stage; the stage's layers on it.
    let mut parts = Vec::with_capacity(stages);
    let mut streams = Vec::with_capacity(stages);
    let mut engine_streams = Vec::with_capacity(stages);
    for (s, &ordinal) in devices.iter().enumerate() {
        let cuda = CudaDevice::new_with_stream(ordinal)?;
        let engine_stream = EngineStream::new(&engines[ordinal], &cuda.cuda_stream()).map_err(text)?;
        streams.push(Some(Arc::clone(engine_stream.stream())));
        engine_streams.push(engine_stream);
        let layers = (s * shape.layers / stages)..((s + 1) * shape.layers / stages);
        parts.push(StagePart::load(args.seed, shape, layers, s == 0, s + 1 == stages, cuda)?);
    }
    let config = PpConfig::with_devices(&devices.iter().map(|&d| d as i32).collect::<Vec<_>>());
    let rt = PpNRt::with_stage_streams(config, &engines[devices[0]], &streams).map_err(text)?;
    let first_device = parts[0].device().clone();
    decode_loop(args, prompt, &first_device, |tokens, position, boundary_ms| {
        let seq = tokens.dims()[1];
        let mut x = parts[0].embed(tokens)?;
        let mut slot = 0;
        for s in 0..stages {
            if s > 0 {
                let start = Instant::now();
                x = receive(&rt, &engine_streams[s], s - 1, slot, &parts[s], (1, seq, shape.hidden))?;
                *boundary_ms += start.elapsed().as_secs_f64() * 1e3;
            }
            x = parts[s].forward(&x, position)?;
            if s + 1 < stages {
                let start = Instant::now();
                slot = send(&rt, &engine_streams[s], s, &x)?;
                *boundary_ms += start.elapsed().as_secs_f64() * 1e3;
            }
        }
        Ok(x)
    })
}

/// Sends stage `b`'s hidden states across boundary `b` from the tensor's own cudarc buffer.
fn send(rt: &PpNRt, engine_stream: &EngineStream, b: usize, x: &Tensor) -> Result<usize, BoxError> {
    let x = x.contiguous()?;
    let (storage, layout) = x.storage_and_layout();
    let Storage::Cuda(cuda) = &*storage else { return Err("a stage's hidden states are not on a GPU".into()) };
    let n = layout.shape().elem_count();
    let start = layout.start_offset();
    let view = cuda.as_cuda_slice::<bf16>()?.slice(start..start + n);
    let _stage = rt.enter(b).map_err(text)?;
    let slot = engine_stream.read(&view, |lent| rt.tx(b, &lent, n)).map_err(text)?;
    Ok(slot.map_err(text)?)
}

/// Receives boundary `b`'s step (sent into `slot`) into a fresh cudarc buffer of the next stage, as a tensor.
fn receive(
    rt: &PpNRt,
    engine_stream: &EngineStream,
    b: usize,
    slot: usize,
    part: &StagePart,
    dims: (usize, usize, usize),
) -> Result<Tensor, BoxError> {
    let n = dims.0 * dims.1 * dims.2;
    let cuda = part.cuda_device();
    // SAFETY: every element is written by the receive below before anything reads the buffer.
    let mut buffer = unsafe { cuda.cuda_stream().alloc::<bf16>(n)? };
    {
        let _stage = rt.enter(b + 1).map_err(text)?;
        engine_stream.write(&mut buffer, |mut lent| rt.rx_into(b, slot, &mut lent)).map_err(text)?.map_err(text)?;
    }
    let storage = Storage::Cuda(CudaStorage::wrap_cuda_slice(buffer, cuda.clone()));
    Ok(Tensor::from_storage(storage, dims, BackpropOp::none(), false))
}

/// Whether `run`'s logits equal the reference's bit for bit, step by step; prints the verdict.
fn compare(label: &str, reference: &Decoded, run: &Decoded) -> bool {
    let steps = reference.logits.len();
    for (step, (a, b)) in reference.logits.iter().zip(&run.logits).enumerate() {
        let differing = a.iter().zip(b).filter(|(x, y)| x.to_bits() != y.to_bits()).count();
        if a.len() != b.len() || differing > 0 {
            println!("{label}: step {step}: {differing} of {} logits differ from the reference", a.len());
            return false;
        }
    }
    println!("{label}: the logits of all {steps} steps bitwise identical to the reference");
    true
}

/// Per-token latency (the decode steps, not the prefill) and tokens per second; the host time
/// of the boundary calls (`tx`, `rx_into` and their lends) per step and its share of a step;
/// beside the one-stage run, what the split adds to a step in all.
fn report(label: &str, run: &Decoded, one_stage: Option<&Decoded>) {
    let median = |values: &[f64]| {
        let mut values = values[1..].to_vec();
        values.sort_by(f64::total_cmp);
        values[values.len() / 2]
    };
    let ms = median(&run.step_ms);
    let mut line = format!(
        "{label}: prefill {:.2} ms, decode {ms:.3} ms per token (median), {:.1} tokens/s",
        run.step_ms[0],
        1e3 / ms
    );
    if let Some(base) = one_stage {
        let (boundaries, base_ms) = (median(&run.boundary_ms), median(&base.step_ms));
        line += &format!(
            "; boundaries {:.1} µs per step ({:.2}% of a step); beside one stage {:+.3} ms ({:+.2}%)",
            boundaries * 1e3,
            boundaries / ms * 100.0,
            ms - base_ms,
            (ms - base_ms) / ms * 100.0
        );
    }
    println!("{line}");
}
