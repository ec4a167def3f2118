//! Lesson 1: allocate, copy and read back, with two streams and no join in sight: a buffer
//! written on one stream and copied on another is ordered by the crate's rule (the copy waits for
//! the write).
//!
//! ```text
//! cargo run --release --example 01_alloc_copy
//! ```
//! No arguments but `--help`; exit status 0 when the copy is identical, 1 on an error, 2 for a
//! bad argument.
use std::process::ExitCode;

use ppnrt::{CudaSlice, CudaStream, Engine};

fn run() -> Result<(), Box<dyn std::error::Error>> {
    let engine = Engine::new(0)?; // device 0's primary context and its stream
    let n = 1 << 20;
    let host: Vec<u32> = (0..n as u32).map(|i| i.wrapping_mul(2_654_435_761)).collect();
    let x = engine.htod(&host)?; // allocated and written on the engine's stream
    // Another stream copies it: the copy waits for the write above, by itself.
    let other = CudaStream::new(engine.context())?;
    let mut y = CudaSlice::<u32>::alloc(&other, n)?;
    other.memcpy_dtod(&x, &mut y)?;
    drop(x); // freed after the copy that reads it
    let back = engine.dtoh(&y)?; // waits for the copy, on the engine's stream
    if let Some(i) = back.iter().zip(&host).position(|(a, b)| a != b) {
        return Err(format!("the copy changed element {i}: {} read back as {}", host[i], back[i]).into());
    }
    println!("01_alloc_copy: {n} u32 written on one stream, copied on another, read back: identical");
    Ok(())
}

fn main() -> ExitCode {
    let usage = "usage: 01_alloc_copy [-h|--help]";
    if let Some(arg) = std::env::args_os().nth(1) {
        if arg == "-h" || arg == "--help" {
            println!("{usage}\n\nLesson 1: a buffer written on one stream, copied on another, read back.");
            return ExitCode::SUCCESS;
        }
        eprintln!("01_alloc_copy: unexpected argument '{}'\n{usage}", arg.to_string_lossy());
        return ExitCode::from(2);
    }
    match run() {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("01_alloc_copy: {}", ppnrt::error::chain(&*e));
            ExitCode::FAILURE
        }
    }
}
