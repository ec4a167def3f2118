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

#[path = "transport/graph_mode.rs"]
mod graph_mode;
#[path = "transport/host_model.rs"]
mod host_model;
#[path = "transport/process_graphs.rs"]
mod process_graphs;
#[path = "transport/processes.rs"]
mod processes;

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

/// One boundary through the crate, and the same calls made raw, sharing streams and slot memory
/// layout (separate buffers and events).
struct Boundary {
    rt: PpNRt,
    x: CudaSlice<u32>,
    n: usize,
    raw: RawBoundary,
    done: CudaEvent,
}

enum RawSlotBuffer {
    Device(CudaSlice<u8>),
    Host(PinnedHostBuffer<u8>),
}

struct RawSlot {
    buffer: RawSlotBuffer,
    ev_tx: CudaEvent,
    ev_rx: CudaEvent,
    rx_recorded: bool,
}

/// The protocol written directly against the driver, making the crate's calls: per `tx` one
/// context bind, a wait, a copy, a record; per `rx` one bind, a wait, a stream-ordered
/// allocation, a copy, a record; the output is freed stream-ordered, as the crate's `CudaSlice`
/// drop does. Copies within a device up to `SM_COPY_MAX_BYTES` launch the SM copy kernel.
struct RawBoundary {
    tx_stream: Arc<CudaStream>,
    rx_stream: Arc<CudaStream>,
    slots: Vec<RawSlot>,
    next: usize,
    /// Whether TX and RX share a device (`tx` then copies within it too).
    local: bool,
    /// The SM copy kernel in the RX device's context, and its grid-size cap.
    copy: Function,
    max_blocks: u32,
}

impl RawBoundary {
    fn tx(&mut self, x: CUdeviceptr, bytes: usize) -> usize {
        let index = self.next;
        let slot = &mut self.slots[index];
        let stream: CUstream = self.tx_stream.raw();
        raw!(cuCtxSetCurrent(self.tx_stream.context().raw()));
        if slot.rx_recorded {
            raw!(cuStreamWaitEvent(stream, slot.ev_rx.raw(), 0));
        }
        let local = self.local;
        match &mut slot.buffer {
            RawSlotBuffer::Device(buffer) if local => {
                launch_or_copy(&self.copy, self.max_blocks, buffer.device_ptr(), x, bytes, stream)
            }
            RawSlotBuffer::Device(buffer) => raw!(cuMemcpyAsync(buffer.device_ptr(), x, bytes, stream)),
            RawSlotBuffer::Host(buffer) => raw!(cuMemcpyDtoHAsync_v2(buffer.as_mut_ptr().cast(), x, bytes, stream)),
        }
        raw!(cuEventRecord(slot.ev_tx.raw(), stream));
        self.next = (index + 1) % self.slots.len();
        index
    }

    fn rx(&mut self, index: usize, bytes: usize) -> CUdeviceptr {
        let slot = &mut self.slots[index];
        let stream: CUstream = self.rx_stream.raw();
        raw!(cuCtxSetCurrent(self.rx_stream.context().raw()));
        raw!(cuStreamWaitEvent(stream, slot.ev_tx.raw(), 0));
        let mut out: CUdeviceptr = 0;
        raw!(cuMemAllocAsync(&mut out, bytes, stream));
        match &slot.buffer {
            RawSlotBuffer::Device(buffer) => {
                launch_or_copy(&self.copy, self.max_blocks, out, buffer.device_ptr(), bytes, stream)
            }
            RawSlotBuffer::Host(buffer) => raw!(cuMemcpyHtoDAsync_v2(out, buffer.as_ptr().cast(), bytes, stream)),
        }
        raw!(cuEventRecord(slot.ev_rx.raw(), stream));
        slot.rx_recorded = true;
        out
    }

    /// The raw in-place receive: the RX stream waits for the slot's `ev_tx` and the slot's
    /// `ev_rx` is recorded after the consumer's work (here: none), no allocation, no copy.
    fn rx_in_place(&mut self, index: usize) {
        let slot = &mut self.slots[index];
        let stream: CUstream = self.rx_stream.raw();
        raw!(cuCtxSetCurrent(self.rx_stream.context().raw()));
        raw!(cuStreamWaitEvent(stream, slot.ev_tx.raw(), 0));
        raw!(cuEventRecord(slot.ev_rx.raw(), stream));
        slot.rx_recorded = true;
    }

    fn free(&self, out: CUdeviceptr) {
        raw!(cuMemFreeAsync(out, self.rx_stream.raw()));
    }
}

/// A copy within one device, as the crate makes it: the SM copy kernel (a raw `cuLaunchKernel`)
/// up to `SM_COPY_MAX_BYTES` with both addresses 16-byte aligned, else `cuMemcpyAsync`.
fn launch_or_copy(
    copy: &Function,
    max_blocks: u32,
    dst: CUdeviceptr,
    src: CUdeviceptr,
    bytes: usize,
    stream: CUstream,
) {
    if bytes <= SM_COPY_MAX_BYTES && dst % 16 == 0 && src % 16 == 0 {
        let config = LaunchConfig::for_elements(bytes / 16 + 1, max_blocks);
        let (mut d, mut s, mut n16, mut tail) = (dst, src, (bytes / 16) as u64, (bytes % 16) as u64);
        let mut params: [*mut std::ffi::c_void; 4] =
            [(&raw mut d).cast(), (&raw mut s).cast(), (&raw mut n16).cast(), (&raw mut tail).cast()];
        raw!(cuLaunchKernel(
            copy.raw(),
            config.grid.0,
            1,
            1,
            config.block.0,
            1,
            1,
            0,
            stream,
            params.as_mut_ptr(),
            std::ptr::null_mut(),
        ));
    } else {
        raw!(cuMemcpyAsync(dst, src, bytes, stream));
    }
}

impl Boundary {
    fn new(gpus: &Gpus, devices: [i32; 2], policy: TransportPolicy, max_bytes: usize) -> Boundary {
        let primary = &gpus.engines[0];
        let config = PpConfig::with_devices(&devices).transport(policy).reserve_bytes(max_bytes);
        let rt = PpNRt::new(config, primary).unwrap();
        let (tx_engine, rx_engine) = (rt.engine(0, primary).unwrap().clone(), rt.engine(1, primary).unwrap().clone());
        let x = {
            let _scope = rt.enter(0).unwrap();
            let mut x = tx_engine.alloc::<u32>(max_bytes / 4).unwrap();
            tx_engine.fill_pattern(&mut x, 3).unwrap();
            x
        };
        let (tx_stream, rx_stream) = (rt.stage_stream(0).unwrap().clone(), rt.stage_stream(1).unwrap().clone());
        let staged = policy == TransportPolicy::Staged;
        let slots = (0..rt.n_slots())
            .map(|_| RawSlot {
                buffer: if staged {
                    RawSlotBuffer::Host(PinnedHostBuffer::new(rx_engine.context(), max_bytes, false).unwrap())
                } else {
                    RawSlotBuffer::Device(CudaSlice::alloc_persistent(&rx_stream, max_bytes).unwrap())
                },
                ev_tx: CudaEvent::new(tx_engine.context(), false).unwrap(),
                ev_rx: CudaEvent::new(rx_engine.context(), false).unwrap(),
                rx_recorded: false,
            })
            .collect();
        let done = CudaEvent::new(rx_engine.context(), false).unwrap();
        rt.synchronize().unwrap();
        let copy = Module::load_ptx(rx_engine.context(), "helpers", ppnrt::kernels::HELPERS_PTX)
            .unwrap()
            .function("ppnrt_copy_bytes")
            .unwrap();
        let raw = RawBoundary {
            tx_stream,
            rx_stream,
            slots,
            next: 0,
            local: devices[0] == devices[1],
            copy,
            max_blocks: rx_engine.max_blocks(),
        };
        Boundary { rt, x, n: 0, raw, done }
    }

    fn set_bytes(&mut self, bytes: usize) {
        self.n = bytes / 4;
    }

    fn step_crate(&self) {
        let slot = self.rt.tx(0, &self.x, self.n).unwrap();
        drop(self.rt.rx::<u32>(0, slot, self.n).unwrap());
    }

    fn step_raw(&mut self) {
        let slot = self.raw.tx(self.x.device_ptr(), self.n * 4);
        let out = self.raw.rx(slot, self.n * 4);
        self.raw.free(out);
    }

    fn sync(&self) {
        self.rt.synchronize().unwrap();
    }

    /// Host seconds of (tx, rx) per call, each issued into an idle queue.
    fn host_times(&mut self, raw: bool, iters: usize) -> (Vec<f64>, Vec<f64>) {
        let (mut txs, mut rxs) = (Vec::with_capacity(iters), Vec::with_capacity(iters));
        for i in 0..iters {
            if i % 32 == 0 || self.n * 4 >= MIB {
                self.sync();
            }
            let t0 = Instant::now();
            if raw {
                let slot = self.raw.tx(self.x.device_ptr(), self.n * 4);
                let t1 = Instant::now();
                let out = self.raw.rx(slot, self.n * 4);
                let t2 = Instant::now();
                self.raw.free(out);
                txs.push((t1 - t0).as_secs_f64());
                rxs.push((t2 - t1).as_secs_f64());
            } else {
                let slot = self.rt.tx(0, &self.x, self.n).unwrap();
                let t1 = Instant::now();
                let out = self.rt.rx::<u32>(0, slot, self.n).unwrap();
                let t2 = Instant::now();
                drop(out);
                txs.push((t1 - t0).as_secs_f64());
                rxs.push((t2 - t1).as_secs_f64());
            }
        }
        self.sync();
        (txs, rxs)
    }

    /// Host seconds of `tx` + in-place receive (guard taken, the consumer's read of the view
    /// ordered on the RX stream, guard dropped) per step, each issued into an idle queue.
    fn host_times_in_place(&mut self, raw: bool, iters: usize) -> Vec<f64> {
        let mut times = Vec::with_capacity(iters);
        for i in 0..iters {
            if i % 32 == 0 {
                self.sync();
            }
            let t0 = Instant::now();
            if raw {
                let slot = self.raw.tx(self.x.device_ptr(), self.n * 4);
                self.raw.rx_in_place(slot);
            } else {
                let slot = self.rt.tx(0, &self.x, self.n).unwrap();
                let mut received = self.rt.rx_in_place::<u32>(0, slot, self.n).unwrap();
                received.order_on(self.rt.stage_stream(1).unwrap()).unwrap();
                drop(received);
            }
            times.push(t0.elapsed().as_secs_f64());
        }
        self.sync();
        times
    }

    /// Seconds per step with `steps` steps in flight (host clock, final synchronisation included).
    fn pipelined(&mut self, raw: bool, steps: usize) -> f64 {
        self.sync();
        let t0 = Instant::now();
        for _ in 0..steps {
            if raw { self.step_raw() } else { self.step_crate() }
        }
        self.sync();
        t0.elapsed().as_secs_f64() / steps as f64
    }

    /// Seconds from `tx` issue to the RX stage's data being ready, one hop at a time: received by
    /// a copy out of the slot (`rx`), or in place (the RX stream waits for the slot, no copy).
    fn hop_times(&mut self, raw: bool, iters: usize, in_place: bool) -> Vec<f64> {
        let mut times = Vec::with_capacity(iters);
        for _ in 0..iters {
            self.sync();
            let t0 = Instant::now();
            // The received buffers are freed after the clock stops, as a stage would later.
            let (mut raw_out, mut crate_out) = (None, None);
            if raw {
                let slot = self.raw.tx(self.x.device_ptr(), self.n * 4);
                if in_place {
                    self.raw.rx_in_place(slot);
                } else {
                    raw_out = Some(self.raw.rx(slot, self.n * 4));
                }
                raw!(cuEventRecord(self.done.raw(), self.raw.rx_stream.raw()));
                raw!(cuEventSynchronize(self.done.raw()));
            } else {
                let slot = self.rt.tx(0, &self.x, self.n).unwrap();
                let rx_stream = self.rt.stage_stream(1).unwrap();
                if in_place {
                    let mut received = self.rt.rx_in_place::<u32>(0, slot, self.n).unwrap();
                    received.order_on(rx_stream).unwrap();
                } else {
                    crate_out = Some(self.rt.rx::<u32>(0, slot, self.n).unwrap());
                }
                self.done.record(rx_stream).unwrap();
                self.done.synchronize().unwrap();
            }
            times.push(t0.elapsed().as_secs_f64());
            if let Some(out) = raw_out {
                self.raw.free(out);
            }
            drop(crate_out);
        }
        times
    }
}

fn boundary_groups(c: &mut Criterion, gpus: &Gpus) {
    let mut step = c.benchmark_group("boundary_step");
    for (name, devices, policy) in transports(gpus) {
        let mut boundary = Boundary::new(gpus, devices, policy, 64 * MIB);
        for bytes in BOUNDARY_SIZES {
            boundary.set_bytes(bytes);
            step.throughput(Throughput::Bytes(bytes as u64));
            step.sample_size(if bytes >= 16 * MIB { 10 } else { 30 });
            step.bench_function(BenchmarkId::new(format!("crate/{name}"), label(bytes)), |bench| {
                bench.iter_custom(|iters| {
                    Duration::from_secs_f64(boundary.pipelined(false, iters as usize) * iters as f64)
                })
            });
            step.bench_function(BenchmarkId::new(format!("raw/{name}"), label(bytes)), |bench| {
                bench.iter_custom(|iters| {
                    Duration::from_secs_f64(boundary.pipelined(true, iters as usize) * iters as f64)
                })
            });
        }
    }
    step.finish();
    let mut host = c.benchmark_group("boundary_host_tx_rx");
    for (name, devices, policy) in transports(gpus) {
        let mut boundary = Boundary::new(gpus, devices, policy, 64 * MIB);
        for bytes in [16 * KIB, 32 * KIB, 256 * KIB] {
            boundary.set_bytes(bytes);
            for (who, raw) in [("crate", false), ("raw", true)] {
                host.bench_function(BenchmarkId::new(format!("{who}/{name}"), label(bytes)), |bench| {
                    bench.iter_custom(|iters| {
                        let (txs, rxs) = boundary.host_times(raw, iters as usize);
                        Duration::from_secs_f64(txs.iter().sum::<f64>() + rxs.iter().sum::<f64>())
                    })
                });
            }
        }
    }
    host.finish();
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

/// Host cost of each driver call a peer boundary step makes, one call type at a time, issued into
/// an idle queue: where the time of `tx` and `rx` goes.
fn call_costs(gpus: &Gpus, report: &mut String) {
    if !gpus.peers {
        return;
    }
    let (e0, e1) = (&gpus.engines[0], &gpus.engines[1]);
    let (s0, s1) = (e0.default_stream().clone(), e1.default_stream().clone());
    let bytes = 32 * KIB;
    let src = filled(e0, bytes, 7);
    let mut dst = filled(e1, bytes, 8);
    let ev0 = CudaEvent::new(e0.context(), false).unwrap();
    let ev1 = CudaEvent::new(e1.context(), false).unwrap();
    ev1.record(&s1).unwrap();
    let (c0, c1) = (e0.context().raw(), e1.context().raw());
    let (src_ptr, dst_ptr) = (src.device_ptr(), dst.device_ptr());
    let iters = 3000;
    let _ =
        writeln!(report, "\n| driver call (peer boundary, 32 KiB) | host median | host p99 |\n| --- | ---: | ---: |");
    let mut measure = |name: &str, call: &mut dyn FnMut()| {
        let mut times = Vec::with_capacity(iters);
        for i in 0..iters {
            if i % 64 == 0 {
                s0.synchronize().unwrap();
                s1.synchronize().unwrap();
            }
            let t = Instant::now();
            call();
            times.push(t.elapsed().as_secs_f64() * 1e6);
        }
        s0.synchronize().unwrap();
        s1.synchronize().unwrap();
        let line = format!("| {name} | {:.2} µs | {:.2} µs |", median(&mut times), percentile(&mut times, 0.99));
        println!("{line}");
        let _ = writeln!(report, "{line}");
    };
    measure("cuCtxSetCurrent (context already current)", &mut || raw!(cuCtxSetCurrent(c0)));
    measure("cuCtxSetCurrent x2 (switch device and back)", &mut || {
        raw!(cuCtxSetCurrent(c1));
        raw!(cuCtxSetCurrent(c0));
    });
    measure("cuStreamWaitEvent (event of the other device)", &mut || raw!(cuStreamWaitEvent(s0.raw(), ev1.raw(), 0)));
    measure("cuMemcpyAsync 32 KiB to the peer", &mut || raw!(cuMemcpyAsync(dst_ptr, src_ptr, bytes, s0.raw())));
    // The safe copy's cost beside the raw call, and the one driver call it adds (with the
    // stream's context current, as here, it makes no other).
    measure("cuCtxGetCurrent + cuMemcpyAsync 32 KiB to the peer", &mut || {
        let mut current: ppnrt::sys::CUcontext = std::ptr::null_mut();
        raw!(cuCtxGetCurrent(&mut current));
        raw!(cuMemcpyAsync(dst_ptr, src_ptr, bytes, s0.raw()));
    });
    measure("safe memcpy_dtod 32 KiB to the peer (its context current)", &mut || {
        s0.memcpy_dtod(&src, &mut dst).unwrap()
    });
    measure("cuEventRecord", &mut || raw!(cuEventRecord(ev0.raw(), s0.raw())));
    // Each raw call runs with its stream's context current, set outside the timed calls.
    raw!(cuCtxSetCurrent(c1));
    measure("cuMemAllocAsync + cuMemFreeAsync 32 KiB", &mut || {
        let mut p: CUdeviceptr = 0;
        raw!(cuMemAllocAsync(&mut p, bytes, s1.raw()));
        raw!(cuMemFreeAsync(p, s1.raw()));
    });
    measure("cuMemcpyAsync 16 KiB within a device", &mut || {
        raw!(cuMemcpyAsync(dst_ptr, dst_ptr + (bytes / 2) as u64, bytes / 2, s1.raw()))
    });
    // Alternatives for the same-device copy that every `rx` makes, and for the waits.
    let half = (bytes / 2) as u64;
    measure("cuMemcpyDtoDAsync 16 KiB within a device", &mut || {
        raw!(cuMemcpyDtoDAsync_v2(dst_ptr, dst_ptr + half, bytes / 2, s1.raw()))
    });
    let module = Module::load_ptx(e1.context(), "helpers", ppnrt::kernels::HELPERS_PTX).unwrap();
    let copy = module.function("ppnrt_copy_bytes").unwrap();
    let sm_blocks = e1.max_blocks();
    measure("cuLaunchKernel SM copy 16 KiB within a device", &mut || {
        launch_or_copy(&copy, sm_blocks, dst_ptr, dst_ptr + half, bytes / 2, s1.raw())
    });
    measure("cuEventQuery (completed, this device)", &mut || {
        let _ = ev0.is_complete().unwrap();
    });
    measure("cuEventQuery (completed, other device)", &mut || {
        let _ = ev1.is_complete().unwrap();
    });
    raw!(cuCtxSetCurrent(c0));
    measure("cuStreamWaitEvent (event of this device)", &mut || raw!(cuStreamWaitEvent(s0.raw(), ev0.raw(), 0)));
    measure("cuStreamWriteValue32 into peer memory", &mut || raw!(cuStreamWriteValue32_v2(s0.raw(), dst_ptr, 1, 0)));
    raw!(cuCtxSetCurrent(c1));
    measure("cuStreamWaitValue32 (already satisfied)", &mut || {
        raw!(cuStreamWaitValue32_v2(s1.raw(), dst_ptr, 0, CUstreamWaitValue_flags::CU_STREAM_WAIT_VALUE_GEQ.0))
    });
    // Device time of a same-device copy, copy engine against SM kernel, by size.
    let big = 64 * MIB;
    let scratch = filled(e1, 2 * big, 9);
    let (from, to) = (scratch.device_ptr(), scratch.device_ptr() + big as u64);
    let events = (CudaEvent::new(e1.context(), true).unwrap(), CudaEvent::new(e1.context(), true).unwrap());
    let _ = writeln!(
        report,
        "\n| copy within a device, device time per copy back to back | copy engine | SM kernel |\n| --- | ---: | ---: |"
    );
    for size in [16 * KIB, 256 * KIB, MIB, 4 * MIB, 16 * MIB, 64 * MIB] {
        let reps = (256 * MIB / size).clamp(20, 1000) as u64;
        let config = LaunchConfig::for_elements(size / 16 + 1, sm_blocks);
        let per_copy = |use_kernel: bool| {
            let time = device_time(&s1, &events, reps, || {
                if use_kernel {
                    // SAFETY (bench): ppnrt_copy_bytes(dst, src, n16, tail) between two disjoint
                    // 64 MiB halves of one live buffer on s1's device; size ≤ 64 MiB.
                    unsafe { s1.launch(&copy, config, (to, from, (size / 16) as u64, 0u64)).unwrap() }
                } else {
                    raw!(cuMemcpyAsync(to, from, size, s1.raw()))
                }
            });
            time.as_secs_f64() * 1e6 / reps as f64
        };
        let (engine, kernel) = (per_copy(false), per_copy(true));
        let line = format!("| {} | {engine:.2} µs | {kernel:.2} µs |", label(size));
        println!("{line}");
        let _ = writeln!(report, "{line}");
    }
    drop(scratch);
    drop((src, dst));
}

/// Every boundary of a pipeline with one stage per GPU moving 64 MiB at once, against the sum of
/// the same boundaries measured one at a time (NVLink and copy-engine contention show as a ratio
/// below 1). With two GPUs this is the one boundary 0 -> 1 and the ratio is 1 by construction.
fn aggregate(gpus: &Gpus, report: &mut String) {
    let n = gpus.engines.len();
    if n < 2 {
        return;
    }
    let bytes = 64 * MIB;
    let words = bytes / 4;
    let devices: Vec<i32> = (0..n as i32).collect();
    let primary = &gpus.engines[0];
    let rt = PpNRt::new(PpConfig::with_devices(&devices).reserve_bytes(bytes), primary).unwrap();
    let xs: Vec<CudaSlice<u32>> = (0..n - 1)
        .map(|b| {
            let engine = rt.engine(b, primary).unwrap();
            let _scope = rt.enter(b).unwrap();
            let mut x = engine.alloc::<u32>(words).unwrap();
            engine.fill_pattern(&mut x, b as u32).unwrap();
            x
        })
        .collect();
    let steps = 30;
    let run = |boundaries: &[usize]| -> f64 {
        for _ in 0..3 {
            for &b in boundaries {
                let slot = rt.tx(b, &xs[b], words).unwrap();
                drop(rt.rx::<u32>(b, slot, words).unwrap());
            }
        }
        rt.synchronize().unwrap();
        let t0 = Instant::now();
        for _ in 0..steps {
            for &b in boundaries {
                let slot = rt.tx(b, &xs[b], words).unwrap();
                drop(rt.rx::<u32>(b, slot, words).unwrap());
            }
        }
        rt.synchronize().unwrap();
        (boundaries.len() * steps * bytes) as f64 / t0.elapsed().as_secs_f64() / 1e9
    };
    let alone: Vec<f64> = (0..n - 1).map(|b| run(&[b])).collect();
    let all: Vec<usize> = (0..n - 1).collect();
    let together = run(&all);
    let sum: f64 = alone.iter().sum();
    let _ =
        writeln!(report, "\n| every boundary at once, 64 MiB, stages on devices {devices:?} | GB/s |\n| --- | ---: |");
    for (b, gbs) in alone.iter().enumerate() {
        let _ = writeln!(report, "| boundary {b} ({} -> {}) alone | {gbs:.1} |", b, b + 1);
    }
    let line = format!(
        "| sum of the boundaries alone | {sum:.1} |\n| all at once (aggregate) | {together:.1} ({:.1}% of the sum) |",
        100.0 * together / sum
    );
    println!("{line}");
    let _ = writeln!(report, "{line}");
}

/// Device time of back-to-back copies of `bytes` from device `a` to `b`, the crate's safe
/// `memcpy_dtod` and the raw `cuMemcpyAsync` interleaved, both with the stream's context current,
/// and the safe copy with none current: per-copy medians of `reps` rounds, seconds.
fn back_to_back(gpus: &Gpus, a: usize, b: usize, bytes: usize, reps: usize) -> BackToBack {
    let (ea, eb) = (&gpus.engines[a], &gpus.engines[b]);
    let stream = ea.default_stream().clone();
    let events = (CudaEvent::new(ea.context(), true).unwrap(), CudaEvent::new(ea.context(), true).unwrap());
    let src = filled(ea, bytes, 5);
    let mut dst = filled(eb, bytes, 6);
    let (s, d) = (src.device_ptr(), dst.device_ptr());
    let iters = (256 * MIB / bytes).clamp(1, 200) as u64;
    let (mut crate_times, mut raw_times, mut unbound_times) = (Vec::new(), Vec::new(), Vec::new());
    for rep in 0..reps + 2 {
        // The safe copy as the thread found it (no context current: the copy makes the stream's
        // context current and restores the previous one, two `cuCtxSetCurrent` more).
        let u = device_time(&stream, &events, iters, || stream.memcpy_dtod(&src, &mut dst).unwrap());
        // Both loops with the stream's context current, the state the raw calls are documented
        // for (the crate then makes one `cuCtxGetCurrent` per copy and no switch).
        let bound = ea.context().bind().unwrap();
        let c = device_time(&stream, &events, iters, || stream.memcpy_dtod(&src, &mut dst).unwrap());
        let r = device_time(&stream, &events, iters, || raw!(cuMemcpyAsync(d, s, bytes, stream.raw())));
        drop(bound);
        if rep >= 2 {
            crate_times.push(c.as_secs_f64());
            raw_times.push(r.as_secs_f64());
            unbound_times.push(u.as_secs_f64());
        }
    }
    eb.synchronize().unwrap();
    let per_copy = |times: &mut Vec<f64>| median(times) / iters as f64;
    BackToBack {
        safe: per_copy(&mut crate_times),
        raw: per_copy(&mut raw_times),
        unbound: per_copy(&mut unbound_times),
    }
}

/// The safe copy against `cuMemcpyAsync`, copies back to back ([`back_to_back`]), 4 KiB to 16
/// MiB, within each device and between the first two devices if they are peers: the copy's own
/// cost where the host's issue bounds it. The targets table checks the peer copies at every size.
fn copies(gpus: &Gpus, report: &mut String) {
    let mut pairs = vec![(0, 0)];
    if gpus.peers {
        pairs.extend([(1, 1), (0, 1), (1, 0)]);
    }
    let _ = writeln!(
        report,
        "\n| copy back to back | safe (µs per copy) | raw (µs per copy) | raw / safe | safe, no context current (µs) |\n| --- | ---: | ---: | ---: | ---: |"
    );
    for (a, b) in pairs {
        for bytes in COPY_SIZES.into_iter().filter(|&bytes| bytes <= 16 * MIB) {
            let BackToBack { safe, raw, unbound } = back_to_back(gpus, a, b, bytes, 9);
            let line = format!(
                "| {a} -> {b} {} | {:.3} | {:.3} | {:.3} | {:.3} |",
                label(bytes),
                safe * 1e6,
                raw * 1e6,
                raw / safe,
                unbound * 1e6
            );
            println!("COPY {line}");
            let _ = writeln!(report, "{line}");
        }
    }
}

/// Device time per copy of copies issued back to back (seconds).
struct BackToBack {
    /// The safe copy, with the stream's context current.
    safe: f64,
    /// `cuMemcpyAsync`, with the stream's context current.
    raw: f64,
    /// The safe copy with no context current.
    unbound: f64,
}

/// The engine-facing paths against their references, each with its target:
/// receiving in place vs `rx`, deferred readback vs the raw calls it makes, and one host thread
/// per stage vs one thread driving every stage.
fn engine_paths(gpus: &Gpus, report: &mut String) {
    let mut checks: Vec<(String, String, bool)> = Vec::new();
    let us = 1e6;
    // In place, 32 KiB, on the peer boundary if there is one.
    let (name, devices, policy) = transports(gpus).into_iter().find(|t| t.0 == "peer").unwrap_or(transports(gpus)[0]);
    let mut boundary = Boundary::new(gpus, devices, policy, 64 * MIB);
    boundary.set_bytes(32 * KIB);
    boundary.host_times(false, 50);
    boundary.host_times_in_place(false, 50);
    boundary.host_times_in_place(true, 50);
    let (mut copy, mut in_place, mut raw_in_place) = (Vec::new(), Vec::new(), Vec::new());
    for _ in 0..6 {
        let (t, r) = boundary.host_times(false, 200);
        copy.extend(t.iter().zip(&r).map(|(a, b)| a + b));
        in_place.extend(boundary.host_times_in_place(false, 200));
        raw_in_place.extend(boundary.host_times_in_place(true, 200));
    }
    let (copy, in_place, raw_in_place) = (median(&mut copy), median(&mut in_place), median(&mut raw_in_place));
    checks.push((
        format!("{name} 32 KiB: tx + in-place receive ≤ 0.7× tx + rx (host)"),
        format!(
            "{:.2} µs vs tx + rx {:.2} µs ({:.3}×); raw in place {:.2} µs",
            in_place * us,
            copy * us,
            in_place / copy,
            raw_in_place * us
        ),
        in_place <= 0.7 * copy,
    ));
    // One 64 MiB step received in place, against the raw peer copy, event and cross-device wait.
    boundary.set_bytes(64 * MIB);
    boundary.hop_times(false, 3, true);
    boundary.hop_times(true, 3, true);
    let (mut crate_hops, mut raw_hops) = (Vec::new(), Vec::new());
    for _ in 0..5 {
        crate_hops.extend(boundary.hop_times(false, 8, true));
        raw_hops.extend(boundary.hop_times(true, 8, true));
    }
    let (crate_hop, raw_hop) = (median(&mut crate_hops), median(&mut raw_hops));
    let gbs = |seconds: f64| (64 * MIB) as f64 / seconds / 1e9;
    checks.push((
        format!("{name} 64 MiB single step received in place ≥ 0.97× raw in place"),
        format!(
            "{:.1} µs ({:.1} GB/s) vs raw {:.1} µs ({:.1} GB/s): {:.3}×",
            crate_hop * us,
            gbs(crate_hop),
            raw_hop * us,
            gbs(raw_hop),
            raw_hop / crate_hop
        ),
        raw_hop / crate_hop >= 0.97,
    ));
    drop(boundary);

    // Deferred readback of 32 KiB from the last stage: the crate's call against the raw calls
    // (record on the stage stream, wait on the readback stream, D2H issue, record after it).
    let last = gpus.engines.len().min(2) - 1;
    let rt = PpNRt::new(PpConfig::with_devices(&[0, last as i32]), &gpus.engines[0]).unwrap();
    let e = rt.engine(1, &gpus.engines[0]).unwrap().clone();
    let stage = rt.stage_stream(1).unwrap().clone();
    let readback = rt.readback_stream().clone();
    let n = 32 * KIB / 4;
    let mut pinned = PinnedHostBuffer::<u32>::new(e.context(), n, false).unwrap();
    let (mark, done) = (CudaEvent::new(e.context(), false).unwrap(), CudaEvent::new(e.context(), false).unwrap());
    let source = {
        let _stage = rt.enter(1).unwrap();
        let mut source = e.alloc::<u32>(n).unwrap();
        e.fill_pattern(&mut source, 9).unwrap();
        source
    };
    let (mut crate_times, mut raw_times) = (Vec::new(), Vec::new());
    for round in 0..1200 {
        let logits = {
            let _stage = rt.enter(1).unwrap();
            let mut logits = e.alloc::<u32>(n).unwrap();
            stage.memcpy_dtod(&source, &mut logits).unwrap();
            logits
        };
        rt.synchronize().unwrap();
        // Both inside the last stage's scope, where a decode loop starts its readback (after the
        // stage's last kernels; `examples/processes.rs`, the README's loops).
        let crate_s = {
            let _stage = rt.enter(1).unwrap();
            let t0 = Instant::now();
            let pending = rt.readback(logits).unwrap();
            let crate_s = t0.elapsed().as_secs_f64();
            assert_eq!(pending.wait().unwrap()[n - 1], ppnrt::kernels::pattern(9, (n - 1) as u64));
            crate_s
        };
        rt.synchronize().unwrap();
        let raw_s = {
            let _stage = rt.enter(1).unwrap();
            let t0 = Instant::now();
            raw!(cuCtxSetCurrent(e.context().raw()));
            raw!(cuEventRecord(mark.raw(), stage.raw()));
            raw!(cuStreamWaitEvent(readback.raw(), mark.raw(), 0));
            raw!(cuMemcpyDtoHAsync_v2(pinned.as_mut_ptr().cast(), source.device_ptr(), n * 4, readback.raw()));
            raw!(cuEventRecord(done.raw(), readback.raw()));
            t0.elapsed().as_secs_f64()
        };
        readback.synchronize().unwrap();
        if round >= 200 {
            crate_times.push(crate_s);
            raw_times.push(raw_s);
        }
    }
    let (c, r) = (median(&mut crate_times), median(&mut raw_times));
    checks.push((
        "deferred readback 32 KiB: host cost per step ≤ 2 µs".into(),
        format!("{:.2} µs (raw record + wait + D2H issue + record {:.2} µs, {:.3}×)", c * us, r * us, c / r),
        c * us <= 2.0,
    ));
    drop(rt);

    // One host thread per stage against one thread: 4 stages over the GPUs, 1 KiB activations.
    let map: Vec<i32> = (0..4).map(|s| (s % gpus.engines.len().min(2)) as i32).collect();
    let steps = 2_000;
    threads::one_thread(&gpus.engines[0], &map, 2, 100);
    threads::thread_per_stage(&gpus.engines[0], &map, 2, 100);
    let (expected, one) = threads::one_thread(&gpus.engines[0], &map, 2, steps);
    let (got, many) = threads::thread_per_stage(&gpus.engines[0], &map, 2, steps);
    assert!(got == expected, "thread-per-stage outputs differ");
    let ratio = many.as_secs_f64() / one.as_secs_f64();
    checks.push((
        format!("one thread per stage ({map:?}, {steps} steps) within 1.15× one thread's time"),
        format!(
            "{:.2} vs {:.2} µs per step ({ratio:.3}×)",
            many.as_secs_f64() / steps as f64 * us,
            one.as_secs_f64() / steps as f64 * us
        ),
        ratio <= 1.15,
    ));

    let _ = writeln!(report, "\n| engine path | measured | met |\n| --- | --- | --- |");
    for (name, measured, met) in &checks {
        let line = format!("| {name} | {measured} | {} |", if *met { "yes" } else { "NO" });
        println!("TARGET {line}");
        let _ = writeln!(report, "{line}");
    }
}

fn targets(gpus: &Gpus, rows: &[Row], report: &mut String) {
    let find = |figure: &str| rows.iter().find(|r| r.figure == figure);
    let mut checks: Vec<(String, String, bool)> = Vec::new();
    if gpus.peers {
        for (a, b) in [(0, 1), (1, 0)] {
            for bytes in COPY_SIZES {
                let BackToBack { safe, raw, unbound } = back_to_back(gpus, a, b, bytes, 7);
                checks.push((
                    format!("safe copy {a}->{b} {} back to back ≥ 0.95× raw", label(bytes)),
                    format!(
                        "{:.2} vs raw {:.2} µs per copy ({:.3}×; with no context current {:.2} µs, {:.3}×)",
                        safe * 1e6,
                        raw * 1e6,
                        raw / safe,
                        unbound * 1e6,
                        raw / unbound
                    ),
                    raw / safe >= 0.95,
                ));
            }
        }
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
