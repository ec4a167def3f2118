//! Transport benchmarks, each beside a raw-driver loop making the same calls in the same run.
//!
//! - `peer_copy/{crate,sm_kernel,raw}/{a}to{b}/{bytes}`: device time of one copy between two
//!   GPUs (CUDA events around a batch; bytes/s throughput), 4 KiB to 1 GiB, both directions.
//! - `boundary_step/{crate,raw}/{transport}/{bytes}`: one pipelined boundary step (`tx` + `rx`
//!   with many steps in flight), host clock.
//! - `boundary_host/{crate,raw}/{transport}/{bytes}`: host time of `tx` + `rx` issued into an
//!   idle queue.
//!
//! After criterion's groups, a table measures each figure again beside its raw loop with the
//! ratio (host µs of `tx` and of `rx`, pipelined µs per step, isolated hop latency median and
//! p99, throughput), the host cost of each driver call a step makes, every boundary of a
//! one-stage-per-GPU pipeline transferring at once against the sum of each alone, then checks the
//! targets measured on 2× H200. Pair figures use devices 0 and 1; the aggregate uses every GPU. `PPNRT_BENCH_REPORT=path`
//! writes those tables as Markdown too. Without a GPU the bench says why and exits.
#![allow(missing_docs, clippy::undocumented_unsafe_blocks)]

use std::fmt::Write as _;
use std::sync::Arc;
use std::time::{Duration, Instant};

use criterion::{BenchmarkId, Criterion, Throughput};

#[path = "../tests/common/raw_driver.rs"]
mod raw_driver;
#[path = "../tests/common/threads.rs"]
mod threads;
use ppnrt::sys::{CUdeviceptr, CUstream, CUstreamWaitValue_flags};
use ppnrt::{
    CudaEvent, CudaSlice, CudaStream, Device, DeviceSlice, Engine, Function, LaunchConfig, Module, PinnedHostBuffer,
    PpConfig, PpNRt, SM_COPY_MAX_BYTES, TransportPolicy, enable_peer_access,
};
use raw_driver::raw;

const KIB: usize = 1024;
const MIB: usize = 1024 * KIB;
const COPY_SIZES: [usize; 10] =
    [4 * KIB, 16 * KIB, 64 * KIB, 256 * KIB, MIB, 4 * MIB, 16 * MIB, 64 * MIB, 256 * MIB, 1024 * MIB];
const BOUNDARY_SIZES: [usize; 5] = [16 * KIB, 32 * KIB, 256 * KIB, 16 * MIB, 64 * MIB];

#[path = "transport/boundary.rs"]
mod boundary;
#[path = "transport/graph_mode.rs"]
mod graph_mode;
#[path = "transport/host_costs.rs"]
mod host_costs;
#[path = "transport/host_model.rs"]
mod host_model;
#[path = "transport/process_graphs.rs"]
mod process_graphs;
#[path = "transport/processes.rs"]
mod processes;
#[path = "transport/raw_ipc.rs"]
mod raw_ipc;

use boundary::*;
use host_costs::*;

fn label(bytes: usize) -> String {
    if bytes >= MIB { format!("{}MiB", bytes / MIB) } else { format!("{}KiB", bytes / KIB) }
}

fn say(line: &str) {
    use std::io::Write;
    let _ = writeln!(std::io::stderr(), "{line}");
}

fn median(values: &mut [f64]) -> f64 {
    values.sort_by(|a, b| a.total_cmp(b));
    values[values.len() / 2]
}

fn percentile(values: &mut [f64], p: f64) -> f64 {
    values.sort_by(|a, b| a.total_cmp(b));
    values[((values.len() - 1) as f64 * p).round() as usize]
}

/// Device time of `iters` calls of `f` on `stream`, between two timing events.
fn device_time(stream: &CudaStream, events: &(CudaEvent, CudaEvent), iters: u64, mut f: impl FnMut()) -> Duration {
    events.0.record(stream).unwrap();
    for _ in 0..iters {
        f();
    }
    events.1.record(stream).unwrap();
    events.1.synchronize().unwrap();
    Duration::from_secs_f64(f64::from(events.1.elapsed_ms(&events.0).unwrap()) / 1e3)
}

struct Gpus {
    engines: Vec<Engine>,
    peers: bool,
}

impl Gpus {
    fn find() -> Option<Gpus> {
        let count = match Device::count() {
            Ok(count) if count >= 1 => count,
            Ok(_) => {
                say("SKIPPED transport benches: no CUDA device");
                return None;
            }
            Err(e) => {
                say(&format!("SKIPPED transport benches: no usable CUDA driver: {e}"));
                return None;
            }
        };
        let engines: Vec<Engine> = (0..count).map(|d| Engine::new(d).unwrap()).collect();
        let peers = engines.len() >= 2 && engines[0].device().peer_info(engines[1].device()).unwrap().access_supported;
        if peers {
            enable_peer_access(engines[0].context(), engines[1].context()).unwrap();
        }
        for e in &engines {
            say(&format!("device {}: {}", e.ordinal(), e.device().name().unwrap()));
        }
        Some(Gpus { engines, peers })
    }
}

/// A pattern-filled persistent buffer of `bytes` on `engine`'s device.
fn filled(engine: &Engine, bytes: usize, seed: u32) -> CudaSlice<u32> {
    let mut buffer = engine.alloc_persistent::<u32>(bytes / 4).unwrap();
    engine.fill_pattern(&mut buffer, seed).unwrap();
    engine.synchronize().unwrap();
    buffer
}

fn peer_copy(c: &mut Criterion, gpus: &Gpus) {
    if !gpus.peers {
        say("SKIPPED peer_copy: needs two GPUs with peer access");
        return;
    }
    let mut group = c.benchmark_group("peer_copy");
    for (a, b) in [(0usize, 1usize), (1, 0)] {
        let (ea, eb) = (&gpus.engines[a], &gpus.engines[b]);
        let stream = ea.default_stream().clone();
        let events = (CudaEvent::new(ea.context(), true).unwrap(), CudaEvent::new(ea.context(), true).unwrap());
        // Every loop with the stream's context current, the state the raw calls are documented
        // for (see `back_to_back`).
        let _bound = ea.context().bind().unwrap();
        for bytes in COPY_SIZES {
            group.throughput(Throughput::Bytes(bytes as u64));
            group.sample_size(if bytes >= 256 * MIB { 10 } else { 30 });
            let src = filled(ea, bytes, 1);
            let mut dst = filled(eb, bytes, 2);
            let dir = format!("{a}to{b}");
            group.bench_function(BenchmarkId::new(format!("crate/{dir}"), label(bytes)), |bench| {
                bench.iter_custom(|iters| {
                    device_time(&stream, &events, iters, || stream.memcpy_dtod(&src, &mut dst).unwrap())
                })
            });
            group.bench_function(BenchmarkId::new(format!("sm_kernel/{dir}"), label(bytes)), |bench| {
                bench.iter_custom(|iters| {
                    device_time(&stream, &events, iters, || ea.copy_with_sms(&src, &mut dst).unwrap())
                })
            });
            let (s, d, raw_stream) = (src.device_ptr(), dst.device_ptr(), stream.raw());
            group.bench_function(BenchmarkId::new(format!("raw/{dir}"), label(bytes)), |bench| {
                bench.iter_custom(|iters| {
                    device_time(&stream, &events, iters, || raw!(cuMemcpyAsync(d, s, bytes, raw_stream)))
                })
            });
            eb.synchronize().unwrap();
        }
    }
    group.finish();
}

/// The boundaries benchmarked: (name, stage devices, policy).
fn transports(gpus: &Gpus) -> Vec<(&'static str, [i32; 2], TransportPolicy)> {
    let mut list = vec![("local", [0, 0], TransportPolicy::Auto)];
    if gpus.engines.len() >= 2 {
        if gpus.peers {
            list.push(("peer", [0, 1], TransportPolicy::Auto));
        }
        list.push(("host-staged", [0, 1], TransportPolicy::Staged));
    } else {
        list.push(("host-staged", [0, 0], TransportPolicy::Staged));
    }
    list
}

/// One row of the comparison table.
struct Row {
    figure: String,
    crate_value: f64,
    raw_value: f64,
    unit: &'static str,
}

fn comparison(gpus: &Gpus, report: &mut String) -> Vec<Row> {
    let mut rows = Vec::new();
    for (name, devices, policy) in transports(gpus) {
        let mut b = Boundary::new(gpus, devices, policy, 64 * MIB);
        for bytes in BOUNDARY_SIZES {
            b.set_bytes(bytes);
            let big = bytes >= 16 * MIB;
            let (iters, steps) = if big { (36, 48) } else { (1200, 3600) };
            let tag = format!("{name} {}", label(bytes));
            // Warm-up: the first calls pay for module loads and pool growth.
            b.host_times(false, 20);
            b.host_times(true, 20);
            // Crate and raw alternate in rounds, so drift on the host hits both alike.
            const ROUNDS: usize = 6;
            let (mut ctx_, mut crx, mut rtx, mut rrx) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
            let (mut pcs, mut prs, mut hc, mut hr) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
            for _ in 0..ROUNDS {
                let (t, r) = b.host_times(false, iters / ROUNDS);
                ctx_.extend(t);
                crx.extend(r);
                let (t, r) = b.host_times(true, iters / ROUNDS);
                rtx.extend(t);
                rrx.extend(r);
                pcs.push(b.pipelined(false, steps / ROUNDS));
                prs.push(b.pipelined(true, steps / ROUNDS));
                hc.extend(b.hop_times(false, iters / ROUNDS, false));
                hr.extend(b.hop_times(true, iters / ROUNDS, false));
            }
            let us = 1e6;
            let mut both_c: Vec<f64> = ctx_.iter().zip(&crx).map(|(a, b)| a + b).collect();
            let mut both_r: Vec<f64> = rtx.iter().zip(&rrx).map(|(a, b)| a + b).collect();
            let (pc, pr) = (median(&mut pcs), median(&mut prs));
            let mut row = |figure: &str, crate_value: f64, raw_value: f64, unit| {
                rows.push(Row { figure: format!("{tag}: {figure}"), crate_value, raw_value, unit });
            };
            row("host tx", median(&mut ctx_) * us, median(&mut rtx) * us, "µs");
            row("host rx", median(&mut crx) * us, median(&mut rrx) * us, "µs");
            row("host tx+rx", median(&mut both_c) * us, median(&mut both_r) * us, "µs");
            row("pipelined step", pc * us, pr * us, "µs");
            row("throughput", bytes as f64 / pc / 1e9, bytes as f64 / pr / 1e9, "GB/s");
            row("hop median", median(&mut hc) * us, median(&mut hr) * us, "µs");
            row("hop p99", percentile(&mut hc, 0.99) * us, percentile(&mut hr, 0.99) * us, "µs");
        }
    }
    let (crate_step, unchecked_step, raw_step) = graph_mode::eager_decode_row(gpus);
    rows.push(Row {
        figure: "eager decode step, 8 stages × 20 kernels, 32KiB: host issue".to_string(),
        crate_value: crate_step,
        raw_value: raw_step,
        unit: "µs",
    });
    rows.push(Row {
        figure: "eager decode step, 8 stages × 20 kernels, 32KiB, stages in bound_unchecked: host issue".to_string(),
        crate_value: unchecked_step,
        raw_value: raw_step,
        unit: "µs",
    });
    let _ = writeln!(report, "| figure | crate | raw driver | crate / raw |\n| --- | ---: | ---: | ---: |");
    for row in &rows {
        let line = format!(
            "| {} | {:.2} {} | {:.2} {} | {:.3} |",
            row.figure,
            row.crate_value,
            row.unit,
            row.raw_value,
            row.unit,
            row.crate_value / row.raw_value
        );
        println!("{line}");
        let _ = writeln!(report, "{line}");
    }
    rows
}

/// Peer-copy bandwidth (GB/s) of `bytes`, crate copy and raw copy: [`back_to_back`] per-copy
/// times, median of `reps` interleaved rounds.
fn peer_bandwidth(gpus: &Gpus, a: usize, b: usize, bytes: usize, reps: usize) -> (f64, f64) {
    let times = back_to_back(gpus, a, b, bytes, reps);
    (bytes as f64 / times.safe / 1e9, bytes as f64 / times.raw / 1e9)
}

fn targets(gpus: &Gpus, rows: &[Row], report: &mut String) {
    let find = |figure: &str| rows.iter().find(|r| r.figure == figure);
    let mut checks: Vec<(String, String, bool)> = Vec::new();
    // Safe copies back to back at every size, within the first device and, with two peers, both
    // directions between them.
    let mut pairs = vec![(0, 0)];
    if gpus.peers {
        pairs.extend([(0, 1), (1, 0)]);
    }
    for (a, b) in pairs {
        for bytes in COPY_SIZES {
            let BackToBack { safe, raw, unbound, unchecked } = back_to_back(gpus, a, b, bytes, 7);
            checks.push((
                format!("safe copy {a}->{b} {} back to back ≥ 0.97× raw", label(bytes)),
                format!(
                    "{:.2} vs raw {:.2} µs per copy ({:.3}×; with no context current {:.2} µs, {:.3}×; in bound_unchecked {:.2} µs, {:.3}×)",
                    safe * 1e6,
                    raw * 1e6,
                    raw / safe,
                    unbound * 1e6,
                    raw / unbound,
                    unchecked * 1e6,
                    raw / unchecked
                ),
                raw / safe >= 0.97,
            ));
        }
    }
    if gpus.peers {
        for (a, b) in [(0, 1), (1, 0)] {
            for bytes in [128 * MIB, 1024 * MIB] {
                let (c, r) = peer_bandwidth(gpus, a, b, bytes, 9);
                checks.push((
                    format!("peer copy {a}->{b} {} ≥ 99% of raw", label(bytes)),
                    format!("{c:.1} GB/s vs raw {r:.1} GB/s ({:.1}%)", 100.0 * c / r),
                    c >= 0.99 * r,
                ));
            }
        }
        if let Some(row) = find("peer 32KiB: host tx+rx") {
            let ratio = row.crate_value / row.raw_value;
            checks.push((
                "host tx+rx 32 KiB peer ≤ 1.15× raw and ≤ 6 µs".into(),
                format!("{:.2} µs vs raw {:.2} µs ({ratio:.3}×)", row.crate_value, row.raw_value),
                ratio <= 1.15 && row.crate_value <= 6.0,
            ));
        }
        for figure in ["peer 32KiB: host tx+rx", "peer 32KiB: pipelined step", "local 32KiB: host tx+rx"] {
            if let Some(row) = find(figure) {
                let ratio = row.crate_value / row.raw_value;
                checks.push((
                    format!("{figure} ≤ 1.03× the raw loop"),
                    format!("{:.2} µs vs raw {:.2} µs ({ratio:.3}×)", row.crate_value, row.raw_value),
                    ratio <= 1.03,
                ));
            }
        }
        if let Some(row) = find("peer 32KiB: pipelined step") {
            checks.push((
                "pipelined step 32 KiB peer ≤ 6 µs".into(),
                format!("{:.2} µs (raw {:.2} µs)", row.crate_value, row.raw_value),
                row.crate_value <= 6.0,
            ));
        }
        if let (Some(m), Some(p)) = (find("peer 32KiB: hop median"), find("peer 32KiB: hop p99")) {
            checks.push((
                "isolated hop 32 KiB peer: median ≤ 12 µs, p99 ≤ 2× median".into(),
                format!(
                    "median {:.2} µs, p99 {:.2} µs (raw {:.2} / {:.2})",
                    m.crate_value, p.crate_value, m.raw_value, p.raw_value
                ),
                m.crate_value <= 12.0 && p.crate_value <= 2.0 * m.crate_value,
            ));
        }
        if let Some(row) = find("peer 64MiB: throughput") {
            let (_, raw_copy) = peer_bandwidth(gpus, 0, 1, 64 * MIB, 9);
            checks.push((
                "boundary throughput 64 MiB peer ≥ 90% of raw peer copy".into(),
                format!(
                    "{:.1} GB/s vs raw copy {raw_copy:.1} GB/s ({:.1}%)",
                    row.crate_value,
                    100.0 * row.crate_value / raw_copy
                ),
                row.crate_value >= 0.9 * raw_copy,
            ));
        }
    } else {
        checks.push(("targets".into(), "need two GPUs with peer access".into(), false));
    }
    let _ = writeln!(report, "\n| target | measured | met |\n| --- | --- | --- |");
    for (name, measured, met) in &checks {
        let line = format!("| {name} | {measured} | {} |", if *met { "yes" } else { "NO" });
        println!("TARGET {line}");
        let _ = writeln!(report, "{line}");
    }
}

fn main() {
    // A rank of the processes table (this binary started again by it).
    if processes::run_role() {
        return;
    }
    let Some(gpus) = Gpus::find() else { return };
    let mut criterion = Criterion::default().configure_from_args();
    peer_copy(&mut criterion, &gpus);
    boundary_groups(&mut criterion, &gpus);
    criterion.final_summary();
    // The comparison table and targets run only when benchmarking, not under `cargo test`.
    if !std::env::args().any(|a| a == "--bench") {
        return;
    }
    let mut report = String::new();
    let driver = ppnrt::loader::driver().unwrap();
    let _ = writeln!(
        report,
        "Devices: {}; driver CUDA {}.\n",
        gpus.engines.iter().map(|e| e.device().name().unwrap()).collect::<Vec<_>>().join(", "),
        driver.version()
    );
    // PPNRT_BENCH_TABLES=comparison,calls,copies,aggregate,engine,targets,graphs,processes,
    // process-graphs,model picks tables (default: all).
    let tables = std::env::var("PPNRT_BENCH_TABLES").unwrap_or_else(|_| {
        "comparison,calls,copies,aggregate,engine,targets,graphs,processes,process-graphs,model".into()
    });
    let wanted = |name: &str| tables.split(',').any(|t| t.trim() == name);
    let rows = if wanted("comparison") || wanted("targets") { comparison(&gpus, &mut report) } else { Vec::new() };
    if wanted("calls") {
        call_costs(&gpus, &mut report);
    }
    if wanted("copies") {
        copies(&gpus, &mut report);
    }
    if wanted("aggregate") {
        aggregate(&gpus, &mut report);
    }
    if wanted("engine") {
        engine_paths(&gpus, &mut report);
    }
    if wanted("targets") {
        targets(&gpus, &rows, &mut report);
    }
    if wanted("graphs") {
        graph_mode::graph_mode(&gpus, &mut report);
    }
    if wanted("processes") {
        processes::processes(&gpus, &mut report);
    }
    if wanted("process-graphs") {
        process_graphs::process_graphs(&gpus, &mut report);
    }
    if wanted("model") {
        host_model::host_model(&gpus, &mut report);
    }
    if let Ok(path) = std::env::var("PPNRT_BENCH_REPORT") {
        std::fs::write(&path, &report).unwrap();
    }
}
