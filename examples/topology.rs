//! A tool (not a lesson: the numbered examples are those): devices, the peer matrix, and
//! bandwidth and latency matrices between every pair of GPUs (unidirectional and bidirectional),
//! in the manner of NVIDIA's p2pBandwidthLatencyTest.
//!
//! ```text
//! topology [--bytes BYTES] [--reps R]
//! ```
//! Bandwidth: median of R (default 10) timed copies of BYTES (default 256 MiB) with CUDA events;
//! the diagonal is a copy within one device (bytes copied, not bytes read plus written).
//! Latency: device time per copy over 1,000 back-to-back 4-byte copies. Peer access is enabled
//! between every pair that supports it.
//!
//! Exit status: 0 on success; 1 on an error (with no GPU it prints why); 2 for a bad command
//! line.

use std::process::ExitCode;

use ppnrt::{CudaEvent, CudaSlice, CudaStream, Device, DeviceSlice, Engine, enable_peer_access};

fn median(mut values: Vec<f64>) -> f64 {
    values.sort_by(|a, b| a.total_cmp(b));
    values[values.len() / 2]
}

/// Device seconds of `f` on `stream`.
fn timed(stream: &CudaStream, f: impl FnOnce() -> ppnrt::Result<()>) -> ppnrt::Result<f64> {
    let start = CudaEvent::new(stream.context(), true)?;
    let end = CudaEvent::new(stream.context(), true)?;
    start.record(stream)?;
    f()?;
    end.record(stream)?;
    end.synchronize()?;
    Ok(f64::from(end.elapsed_ms(&start)?) / 1e3)
}

fn matrix(
    title: &str,
    n: usize,
    unit: &str,
    mut cell: impl FnMut(usize, usize) -> ppnrt::Result<f64>,
) -> ppnrt::Result<()> {
    println!("\n{title} ({unit})");
    print!("   D\\D");
    for j in 0..n {
        print!("{j:>10}");
    }
    println!();
    for i in 0..n {
        print!("{i:>6}");
        for j in 0..n {
            print!("{:>10.2}", cell(i, j)?);
        }
        println!();
    }
    Ok(())
}

const SYNOPSIS: &str = "usage: topology [--bytes BYTES] [--reps R] [-h|--help]";

const HELP: &str = "\
Devices, the peer matrix, and bandwidth and latency matrices between every pair of GPUs.
  --bytes BYTES   bytes per timed copy (default 268435456 = 256 MiB)
  --reps R        timed copies per figure, the median is reported (default 10)
  -h, --help      this text
Exit status 0 on success; 1 on an error (no GPU included); 2 for a bad command line.";

/// The command line.
struct Args {
    bytes: usize,
    reps: usize,
    help: bool,
}

fn parse_args() -> Result<Args, String> {
    use lexopt::prelude::*;
    let mut args = Args { bytes: 256 << 20, reps: 10, help: false };
    let mut parser = lexopt::Parser::from_env();
    let number = |flag: &str, parser: &mut lexopt::Parser, range: std::ops::RangeInclusive<usize>| {
        let text = parser.value().and_then(|v| v.string()).map_err(|e| e.to_string())?;
        let value: usize = text.parse().map_err(|e| format!("{flag} {text}: {e}"))?;
        if !range.contains(&value) {
            return Err(format!("{flag} {text}: must be between {} and {}", range.start(), range.end()));
        }
        Ok(value)
    };
    while let Some(arg) = parser.next().map_err(|e| e.to_string())? {
        match arg {
            Long("bytes") => args.bytes = number("--bytes", &mut parser, 4..=(16usize << 30))?,
            Long("reps") => args.reps = number("--reps", &mut parser, 1..=100_000)?,
            Long("bench") => {} // tolerated: `cargo bench` passes it to every target
            Short('h') | Long("help") => args.help = true,
            other => return Err(other.unexpected().to_string()),
        }
    }
    Ok(args)
}

fn run(Args { bytes, reps, .. }: Args) -> Result<(), String> {
    let devices = Device::all().map_err(|e| format!("no GPU: {}", ppnrt::error::chain(&e)))?;
    if devices.is_empty() {
        return Err("no GPU: the driver sees no device".into());
    }
    let driver = ppnrt::loader::driver().map_err(|e| ppnrt::error::chain(&e))?;
    println!("driver: CUDA {} ({})", driver.version(), driver.library());
    fn err(e: impl std::error::Error + 'static) -> String {
        ppnrt::error::chain(&e)
    }
    for d in &devices {
        let (major, minor) = d.compute_capability().map_err(err)?;
        println!(
            "device {}: {}, sm_{major}{minor}, {} SMs, {:.1} GiB, PCI {}",
            d.ordinal(),
            d.name().map_err(err)?,
            d.multiprocessor_count().map_err(err)?,
            d.total_memory().map_err(err)? as f64 / (1u64 << 30) as f64,
            d.pci_bus_id().map_err(err)?
        );
    }
    let n = devices.len();
    let peers = Device::peer_matrix().map_err(err)?;
    println!("\npeer access (access / performance rank / native atomics)");
    for (i, row) in peers.iter().enumerate() {
        let cells: Vec<String> = row
            .iter()
            .enumerate()
            .map(|(j, p)| {
                if i == j {
                    "   -   ".to_string()
                } else {
                    format!(
                        "{} r{} {}",
                        if p.access_supported { "Y" } else { "N" },
                        p.performance_rank,
                        if p.native_atomics { "A" } else { "-" }
                    )
                }
            })
            .collect();
        println!("{i:>6}  {}", cells.join("  "));
    }
    let engines: Vec<Engine> = (0..n as i32).map(Engine::new).collect::<Result<_, _>>().map_err(err)?;
    for i in 0..n {
        for j in i + 1..n {
            if peers[i][j].access_supported && peers[j][i].access_supported {
                enable_peer_access(engines[i].context(), engines[j].context()).map_err(err)?;
            }
        }
    }
    let words = bytes / 4;
    // The copies' source data, made once on the host.
    let host: Vec<u32> = (0..words as u64).map(|i| ppnrt::kernels::pattern(1, i)).collect();
    let buffers: Vec<(CudaSlice<u32>, CudaSlice<u32>)> = engines
        .iter()
        .map(|e| {
            let mut a = e.alloc_persistent::<u32>(words)?;
            e.htod_into(&host, &mut a)?;
            let b = e.alloc_persistent::<u32>(words)?;
            e.synchronize()?;
            Ok((a, b))
        })
        .collect::<ppnrt::Result<_>>()
        .map_err(err)?;
    // Copies are issued on the source device's stream, into the destination's second buffer.
    let copy = |i: usize, j: usize, count: usize| -> ppnrt::Result<()> {
        let stream = engines[i].default_stream();
        let src = buffers[i].0.slice(..count)?;
        // SAFETY: both ranges are live persistent allocations of at least count words; peer
        // access is on (or the driver stages the copy); no other work touches them meanwhile.
        Ok(unsafe { stream.copy_bytes_async(buffers[j].1.device_ptr(), src.device_ptr(), count * 4) }?)
    };
    let gbs = |seconds: f64| bytes as f64 / seconds / 1e9;
    matrix(&format!("unidirectional bandwidth, {} MiB copies", bytes >> 20), n, "GB/s", |i, j| {
        copy(i, j, words)?;
        let times = (0..reps)
            .map(|_| timed(engines[i].default_stream(), || copy(i, j, words)))
            .collect::<Result<Vec<_>, _>>()?;
        Ok(gbs(median(times)))
    })
    .map_err(err)?;
    matrix("bidirectional bandwidth, both directions at once (sum)", n, "GB/s", |i, j| {
        if i == j {
            return Ok(f64::NAN);
        }
        let mut times = Vec::new();
        for _ in 0..reps {
            // Start both copies together: stream j waits for an event recorded on stream i.
            let start = CudaEvent::new(engines[i].context(), true)?;
            let end_i = CudaEvent::new(engines[i].context(), true)?;
            let end_j = CudaEvent::new(engines[j].context(), false)?;
            engines[i].synchronize()?;
            engines[j].synchronize()?;
            start.record(engines[i].default_stream())?;
            engines[j].default_stream().wait(&start)?;
            copy(i, j, words)?;
            copy(j, i, words)?;
            end_j.record(engines[j].default_stream())?;
            engines[i].default_stream().wait(&end_j)?;
            end_i.record(engines[i].default_stream())?;
            end_i.synchronize()?;
            times.push(f64::from(end_i.elapsed_ms(&start)?) / 1e3);
        }
        Ok(2.0 * gbs(median(times)))
    })
    .map_err(err)?;
    matrix("latency, 4-byte copies back to back", n, "µs", |i, j| {
        let count = 1000;
        copy(i, j, 1)?;
        let seconds = timed(engines[i].default_stream(), || (0..count).try_for_each(|_| copy(i, j, 1)))?;
        Ok(seconds / count as f64 * 1e6)
    })
    .map_err(err)?;
    for e in &engines {
        e.synchronize().map_err(err)?;
    }
    Ok(())
}

fn main() -> ExitCode {
    let args = match parse_args() {
        Ok(args) => args,
        Err(e) => {
            eprintln!("topology: {e}\n{SYNOPSIS}");
            return ExitCode::from(2);
        }
    };
    if args.help {
        println!("{SYNOPSIS}\n\n{HELP}");
        return ExitCode::SUCCESS;
    }
    match run(args) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("topology: {e}");
            ExitCode::FAILURE
        }
    }
}
