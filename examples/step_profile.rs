//! A tool (not a lesson: the numbered examples are those): runs one hot-path operation a given
//! number of times, so that what the crate's own code costs
//! per operation can be counted: `scripts/count-instructions.sh` runs it under callgrind against
//! the driver double (no GPU needed) at two step counts and takes the difference. It runs on GPUs
//! too; timing belongs to `cargo bench`, this only checks that every step succeeds.
//!
//! ```text
//! step_profile [MODE [STEPS]] [--unchecked]   (default: peer with two devices, else local;
//!                                               1000 steps)
//!   peer      tx + rx + drop of the received buffer, stages on devices 0 and 1 (32 KiB)
//!   local     the same with both stages on device 0, whose context is current (the one
//!             context of both stages, as a stage's thread has it)
//!   staged    the same through pinned host memory (host-staged), stages on devices 0 and 1 (or 0)
//!   copy      safe memcpy_dtod of 32 KiB from device 0 to device 1 (or 0), device 0's context
//!             current
//!   launch    a launch of a kernel with two slice arguments (the helper copy kernel, 32 KiB,
//!             both slices on device 0), device 0's context current
//!   list      the same launch with its four parameters in a `KernelArgList` built for it (as
//!             an engine passes a kernel of many parameters)
//!   readback  a 32 KiB deferred readback from the last stage (its logits made first each step),
//!             the last stage's context current
//!   loop      the loop alone, with its synchronisation every 32 steps and no operation: what
//!             the other modes' counts hold beside their operation
//!   decode    one eager decode step of the bench's (8 stages on device 0 × 20 toy layers, 32 KiB
//!             of f32 received into each stage's activations with `rx_into`, sent on with `tx`),
//!             each stage's context bound for its calls, as the bench's step binds it
//!
//!   --unchecked   the loop runs inside `Context::bound_unchecked` of the context that the
//!                 mode has current (device 0's for decode), as a stage's own loop may: the
//!                 calls for that context make no context query (no effect on peer and staged,
//!                 which have none current)
//! ```
//! Exit status: 0 when every step succeeded; 1 on an error (no GPU included); 2 for a bad command
//! line.
use std::process::ExitCode;

use ppnrt::{CudaSlice, Device, DeviceSlice, Engine, PpConfig, PpNRt, TransportPolicy};

/// Elements of `u32` per operation: 32 KiB, the bench's decode-step activation.
const N: usize = 8192;

/// Stages, layers per stage and ring slots of the `decode` mode (the bench's eager decode step).
const DECODE_STAGES: usize = 8;
const DECODE_LAYERS: u32 = 20;
const DECODE_SLOTS: usize = 2;

/// `N` words of [`ppnrt::kernels::pattern`] under `seed`, made on the host.
fn words(seed: u32) -> Vec<u32> {
    (0..N as u64).map(|i| ppnrt::kernels::pattern(seed, i)).collect()
}

/// `decode`: the bench's eager decode step, `steps` times.
fn decode(steps: usize, unchecked: bool) -> ppnrt::Result<()> {
    let primary = Engine::new(0)?;
    let rt = PpNRt::new(PpConfig::with_devices(&[0; DECODE_STAGES]).with_slots(DECODE_SLOTS), &primary)?;
    let input: Vec<f32> = (0..N).map(|i| (i % 97) as f32 * 0.01 + 0.5).collect();
    let mut acts = (0..DECODE_STAGES)
        .map(|s| {
            let _stage = rt.enter(s)?;
            let engine = rt.engine(s, &primary)?;
            let mut x = engine.alloc_persistent::<f32>(N)?;
            engine.htod_into(&input, &mut x)?;
            Ok(x)
        })
        .collect::<ppnrt::Result<Vec<CudaSlice<f32>>>>()?;
    rt.synchronize()?;
    let steps_loop = || -> ppnrt::Result<()> {
        for step in 0..steps {
            if step % 32 == 0 {
                rt.synchronize()?;
            }
            let k = step % DECODE_SLOTS;
            for (s, x) in acts.iter_mut().enumerate() {
                let engine = rt.engine(s, &primary)?;
                let _stage = rt.enter(s)?;
                let _bound = engine.context().bind()?;
                if s > 0 {
                    rt.rx_into(s - 1, k, x)?;
                }
                for layer in 0..DECODE_LAYERS {
                    engine.toy_layer(x, k as u32, layer)?;
                }
                if s + 1 < DECODE_STAGES {
                    rt.tx(s, x, N)?;
                }
            }
        }
        Ok(())
    };
    // Each stage's context is bound for its calls inside the loop; `--unchecked` puts the whole
    // loop in device 0's scope (every stage is there).
    in_binding(unchecked.then(|| primary.context().as_ref()), unchecked, steps_loop)?;
    rt.synchronize()?;
    println!("decode: {steps} steps of {DECODE_STAGES} stages × {DECODE_LAYERS} layers");
    Ok(())
}

/// Runs the counted loop with `current` bound around it (none: the loop binds what it needs), or,
/// with `unchecked`, inside `current`'s `Context::bound_unchecked`.
fn in_binding(
    current: Option<&ppnrt::Context>,
    unchecked: bool,
    steps_loop: impl FnOnce() -> ppnrt::Result<()>,
) -> ppnrt::Result<()> {
    match current {
        // SAFETY: nothing in the loop changes the current context but the crate's own calls.
        Some(context) if unchecked => unsafe { context.bound_unchecked(steps_loop)? },
        Some(context) => {
            let _bound = context.bind()?;
            steps_loop()
        }
        None => steps_loop(),
    }
}

fn run(mode: &str, steps: usize, unchecked: bool) -> Result<(), Box<dyn std::error::Error>> {
    if mode == "decode" {
        return Ok(decode(steps, unchecked)?);
    }
    let primary = Engine::new(0)?;
    // `peer` needs two devices (a one-device machine gets the configuration's typed error);
    // `copy` and `readback` use device 1 when there is one.
    let second = if mode == "peer" || Device::count()? > 1 { 1 } else { 0 };
    let devices: &[i32] = if mode == "local" { &[0, 0] } else { &[0, second] };
    let config = PpConfig::with_devices(devices);
    let config = if mode == "staged" { config.with_transport(TransportPolicy::Staged) } else { config };
    let rt = PpNRt::new(config, &primary)?;
    let (e0, e1) = (rt.engine(0, &primary)?.clone(), rt.engine(1, &primary)?.clone());
    let x = {
        let _stage = rt.enter(0)?;
        e0.htod(&words(3))?
    };
    let stream = e0.default_stream().clone();
    let mut src = e0.alloc_persistent::<u32>(N)?;
    e0.htod_into(&words(4), &mut src)?;
    let mut dst = e1.alloc_persistent::<u32>(N)?;
    e1.htod_into(&words(5), &mut dst)?;
    rt.synchronize()?;
    // A kernel with two slice arguments (the helper copy kernel), for `launch`, on device 0's
    // stream with both slices there.
    let module = ppnrt::Module::load_ptx(e0.context(), "helpers", ppnrt::kernels::HELPERS_PTX)?;
    let copy_kernel = module.function("ppnrt_copy_bytes")?;
    let mut near = e0.alloc_persistent::<u32>(N)?;
    e0.htod_into(&words(6), &mut near)?;
    let config = ppnrt::LaunchConfig::for_elements(N * 4 / 16, 1024);
    // The copy, the launch, the local boundary and the readback run with their stream's context
    // current, as a stage's thread would have it (the boundaries across devices bind each side's
    // context in turn).
    // The mode's operation, chosen once (the loop counts the operation, not the choice), and the
    // engine whose context its thread has current.
    enum Op {
        Boundary,
        Copy,
        Launch,
        List,
        Readback,
        Nothing,
    }
    let (op, current) = match mode {
        "peer" | "staged" => (Op::Boundary, None),
        "local" => (Op::Boundary, Some(&e0)),
        "copy" => (Op::Copy, Some(&e0)),
        "launch" => (Op::Launch, Some(&e0)),
        "list" => (Op::List, Some(&e0)),
        // The last stage's thread, which made the logits.
        "readback" => (Op::Readback, Some(&e1)),
        "loop" => (Op::Nothing, Some(&e0)),
        other => return Err(format!("mode {other}: expected one of {}", MODES.join(", ")).into()),
    };
    let steps_loop = || -> ppnrt::Result<()> {
        for step in 0..steps {
            if step % 32 == 0 {
                rt.synchronize()?;
                stream.synchronize()?;
            }
            match op {
                Op::Boundary => {
                    let slot = rt.tx(0, &x, N)?;
                    drop(rt.rx::<u32>(0, slot, N)?);
                }
                Op::Copy => stream.memcpy_dtod(&src, &mut dst)?,
                // SAFETY: `ppnrt_copy_bytes(dst, src, n16, tail)` copies n16 × 16 bytes (and `tail`
                // more) from src to dst; both hold N u32 = N / 4 × 16 bytes.
                Op::Launch => unsafe { stream.launch(&copy_kernel, config, (&mut near, &src, (N / 4) as u64, 0u64))? },
                Op::List => {
                    let args = ppnrt::KernelArgList::new().arg(&mut near).arg(&src).arg((N / 4) as u64).arg(0u64);
                    // SAFETY: as for `launch`: the same kernel and parameters.
                    unsafe { stream.launch(&copy_kernel, config, args)? }
                }
                Op::Readback => {
                    let _stage = rt.enter(1)?;
                    let mut logits = e1.alloc::<u32>(N)?;
                    rt.stage_stream(1)?.memcpy_dtod(&dst, &mut logits)?;
                    drop(rt.readback(logits)?);
                }
                Op::Nothing => std::hint::black_box(()),
            }
        }
        Ok(())
    };
    in_binding(current.map(|engine| engine.context().as_ref()), unchecked, steps_loop)?;
    rt.synchronize()?;
    stream.synchronize()?;
    println!("{mode}: {steps} steps, {} bytes each", x.byte_len());
    Ok(())
}

const MODES: [&str; 9] = ["peer", "local", "staged", "copy", "launch", "list", "readback", "decode", "loop"];

/// The command line.
struct Args {
    mode: Option<String>,
    steps: usize,
    unchecked: bool,
    help: bool,
}

/// The command line: the mode (if given), the steps, `--unchecked`, and whether help was asked for.
fn parse_args() -> Result<Args, String> {
    use lexopt::prelude::*;
    let (mut mode, mut steps, mut unchecked, mut help) = (None, 1000usize, false, false);
    let mut parser = lexopt::Parser::from_env();
    while let Some(arg) = parser.next().map_err(|e| e.to_string())? {
        match arg {
            Value(value) if mode.is_none() => {
                let text = value.string().map_err(|e| e.to_string())?;
                if !MODES.contains(&text.as_str()) {
                    return Err(format!("mode {text}: expected one of {}", MODES.join(", ")));
                }
                mode = Some(text);
            }
            Value(value) => {
                let text = value.string().map_err(|e| e.to_string())?;
                steps = text.parse().map_err(|e| format!("steps {text}: {e}"))?;
                if !(1..=1_000_000_000).contains(&steps) {
                    return Err(format!("steps {text}: must be between 1 and 1000000000"));
                }
            }
            Long("unchecked") => unchecked = true,
            Short('h') | Long("help") => help = true,
            other => return Err(other.unexpected().to_string()),
        }
    }
    Ok(Args { mode, steps, unchecked, help })
}

const SYNOPSIS: &str = "usage: step_profile [MODE [STEPS]] [--unchecked] [-h|--help]";

const HELP: &str = "\
Runs one hot-path operation STEPS times (default 1000), for counting the crate's own instructions
per operation (scripts/count-instructions.sh); MODE (default: peer with two devices, else local):
  peer      tx + rx + drop, stages on devices 0 and 1 (32 KiB)
  local     the same with both stages on device 0
  staged    the same through pinned host memory
  copy      memcpy_dtod of 32 KiB from device 0 to device 1 (or 0)
  launch    a launch of a kernel with two slice arguments
  list      the same launch through a KernelArgList
  readback  a 32 KiB deferred readback from the last stage
  decode    one eager decode step of 8 stages x 20 toy layers
  loop      the loop alone, no operation
  --unchecked   the loop runs inside Context::bound_unchecked of the mode's current context
  -h, --help    this text
Exit status 0 when every step succeeded; 1 on an error (no GPU included); 2 for a bad command line.";

fn main() -> ExitCode {
    let Args { mode, steps, unchecked, .. } = match parse_args() {
        Ok(Args { help: true, .. }) => {
            println!("{SYNOPSIS}\n\n{HELP}");
            return ExitCode::SUCCESS;
        }
        Ok(args) => args,
        Err(e) => {
            eprintln!("step_profile: {e}\n{SYNOPSIS}");
            return ExitCode::from(2);
        }
    };
    let two_devices = Device::count().is_ok_and(|count| count > 1);
    let mode = mode.unwrap_or_else(|| if two_devices { "peer" } else { "local" }.into());
    match run(&mode, steps, unchecked) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("step_profile {mode}: {}", ppnrt::error::chain(&*e));
            ExitCode::FAILURE
        }
    }
}
