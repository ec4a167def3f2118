//! Lesson 2: launch your own kernel: load a fatbin as an engine ships it
//! (`tests/data/test_params.fatbin`, from `tests/data/test_params.cu`) and launch its
//! twelve-parameter kernel, with a `#[repr(C)]` struct, `bf16`, `f16` and `bool` among the
//! parameters; the output is checked on the host.
//!
//! ```text
//! cargo run --release --example 02_launch_kernel
//! ```
//! No arguments but `--help`; exit status 0 when the output is exact, 1 on an error, 2 for a bad
//! argument.
use std::process::ExitCode;

use ppnrt::{Engine, KernelArgList, LaunchConfig, Module, bf16, by_value, f16};

/// As `tests/data/test_params.cu` declares it.
#[derive(Clone, Copy)]
#[repr(C)]
struct Shape {
    rows: u32,
    cols: u32,
    scale: f32,
}

static FATBIN: &[u8] = include_bytes!("../tests/data/test_params.fatbin");

fn run() -> Result<(), Box<dyn std::error::Error>> {
    let engine = Engine::new(0)?;
    let module = Module::load_image(engine.context(), "test_params", FATBIN)?;
    let kernel = module.function("ppnrt_test_params12")?;
    let n = 1 << 16;
    let input: Vec<f32> = (0..n).map(|i| (i % 64) as f32).collect();
    let x = engine.htod(&input)?;
    let mut y = engine.alloc::<f32>(n)?;
    let shape = Shape { rows: 3, cols: 5, scale: 0.25 };
    let args = KernelArgList::new()
        .arg(&x) // read by the kernel: ordered after its last write
        .arg(&mut y) // written: later uses wait for the kernel
        .arg(n as u64)
        .arg(by_value(shape))
        .arg(bf16::from_f32(1.5))
        .arg(true) // negate
        .arg(-4i32)
        .arg(200u8)
        .arg(0.125f64)
        .arg(f16::from_f32(-2.0))
        .arg(7i64)
        .arg(9u32);
    let stream = engine.stream()?;
    // SAFETY: the arguments match the kernel's twelve parameters in order, size and meaning; it
    // reads n elements of x and writes n of y, nothing else.
    unsafe { stream.launch(&kernel, LaunchConfig::for_elements(n, 1024), args)? };
    let output = engine.dtoh(&y)?;
    let offset = 1.5 - 4.0 + 200.0 + 0.125 - 2.0 + 7.0 + 9.0 + 15.0;
    let expected: Vec<f32> = input.iter().map(|v| -(v * 0.25 + offset)).collect();
    if let Some(i) = output.iter().zip(&expected).position(|(a, b)| a != b) {
        return Err(format!(
            "element {i}: the kernel wrote {}, the host's arithmetic gives {}",
            output[i], expected[i]
        )
        .into());
    }
    println!("02_launch_kernel: a 12-parameter kernel from a fatbin, {n} elements: exact");
    Ok(())
}

fn main() -> ExitCode {
    let usage = "usage: 02_launch_kernel [-h|--help]";
    if let Some(arg) = std::env::args_os().nth(1) {
        if arg == "-h" || arg == "--help" {
            println!("{usage}\n\nLesson 2: a twelve-parameter kernel from a fatbin, checked on the host.");
            return ExitCode::SUCCESS;
        }
        eprintln!("02_launch_kernel: unexpected argument '{}'\n{usage}", arg.to_string_lossy());
        return ExitCode::from(2);
    }
    match run() {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("02_launch_kernel: {}", ppnrt::error::chain(&*e));
            ExitCode::FAILURE
        }
    }
}
