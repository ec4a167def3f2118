//! Allocate, copy and read back, with two streams and no join in sight: a buffer written on one
//! stream and copied on another is ordered by the crate's rule (the copy waits for the write).
//!
//! ```text
//! cargo run --release --example 01_alloc_copy
//! ```
use std::process::ExitCode;

use ppnrt::{CudaSlice, CudaStream, Engine};

fn run() -> ppnrt::Result<()> {
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
    assert!(back == host, "the copy changed the data");
    println!("01_alloc_copy: {n} u32 written on one stream, copied on another, read back: identical");
    Ok(())
}

fn main() -> ExitCode {
    match run() {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("01_alloc_copy: {}", ppnrt::error::chain(&e));
            ExitCode::from(2)
        }
    }
}
