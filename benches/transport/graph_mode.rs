//! The graph-mode table: a full decode step of S = 2, 4, 8 stages alternating over the GPUs, 20
//! small kernels (toy residual layers) per stage, 32 KiB activations, two slots per ring, run
//! five ways in one process: the crate eager (`rx`, layers, `tx`), the crate in graph mode
//! (`capture_step` + `StepGraphs::launch`), and raw driver references — the eager loop, one
//! multi-device graph of the whole step, and one graph per stage per slot with the boundary
//! inside (event wait node, copy, event record node at each end). For each: host issue per step
//! (the issuing thread's time over a run of steps issued back to back, divided by the steps, and
//! the median single call), pipelined step time and isolated step latency (medians), and the final
//! outputs compared bitwise.
#![allow(clippy::needless_range_loop)] // stage indices address several arrays at once

use std::ffi::c_void;
use std::fmt::Write as _;
use std::time::Instant;

use ppnrt::sys::{CUgraph, CUgraphExec, CUgraphNode, CUstreamCaptureMode};
use ppnrt::{CudaEvent, CudaSlice, CudaStream, Engine, Function, LaunchConfig, Module, PpConfig, PpNRt};

use super::{Gpus, launch_or_copy, median, raw, say};

const LAYERS: u32 = 20;
const N: usize = 8192; // 32 KiB of f32
const SLOTS: usize = 2;
/// Steps per timed run (`PPNRT_BENCH_GRAPH_STEPS` overrides): enough for the steady state. The
/// single multi-device graph's launches return in ~20–40 µs for the first few hundred steps, then
/// block at the device's pace (~300 µs at S = 8 on 2× H200); runs of 200 steps measured only the
/// first phase.
const STEPS: usize = 1000;

fn steps_per_run() -> usize {
    std::env::var("PPNRT_BENCH_GRAPH_STEPS").ok().and_then(|v| v.parse().ok()).filter(|&n| n > 0).unwrap_or(STEPS)
}

/// Figures of one variant, in µs.
#[derive(Clone, Copy, Default)]
struct Figures {
    /// The issuing thread's time per step over a run of STEPS steps issued back to back (no
    /// synchronisation inside the run; a call the driver blocks counts in full).
    issue: f64,
    /// The median time of one step's issue within those runs: what a step costs when no call
    /// blocks.
    issue_call: f64,
    pipelined: f64,
    latency: f64,
}

/// Times `step` (one whole step's issue): host issue per step (run total and median call) and
/// pipelined time per step over runs of STEPS steps, and isolated latency (issue + wait) per step.
fn time_steps(mut step: impl FnMut(usize), sync: &dyn Fn()) -> Figures {
    for k in 0..50 {
        step(k);
    }
    sync();
    let (mut issue, mut issue_call, mut pipelined, mut latency) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    let mut k = 0;
    let steps = steps_per_run();
    for _ in 0..5 {
        let start = Instant::now();
        for _ in 0..steps {
            let t = Instant::now();
            step(k);
            issue_call.push(t.elapsed().as_secs_f64());
            k += 1;
        }
        issue.push(start.elapsed().as_secs_f64() / steps as f64);
        sync();
        pipelined.push(start.elapsed().as_secs_f64() / steps as f64);
    }
    for _ in 0..200 {
        let t = Instant::now();
        step(k);
        sync();
        latency.push(t.elapsed().as_secs_f64());
        k += 1;
    }
    Figures {
        issue: median(&mut issue) * 1e6,
        issue_call: median(&mut issue_call) * 1e6,
        pipelined: median(&mut pipelined) * 1e6,
        latency: median(&mut latency) * 1e6,
    }
}

/// The step's input activations (the same for every variant, so outputs compare bitwise).
fn step_input() -> Vec<f32> {
    (0..N).map(|i| ((i * 7919) % 1000) as f32 / 1000.0 - 0.5).collect()
}

/// The device of each of `stages` stages: alternating over GPUs 0 and 1 when `two`, else all on 0.
fn stage_devices(two: bool, stages: usize) -> Vec<i32> {
    (0..stages).map(|s| if two { (s % 2) as i32 } else { 0 }).collect()
}

/// Launches the toy layer on `x` (raw).
fn raw_layer(layer: &Function, max_blocks: u32, x: u64, step: u32, index: u32, stream: ppnrt::sys::CUstream) {
    let config = LaunchConfig::for_elements(N, max_blocks);
    let (mut x, mut n, mut step, mut index) = (x, N as u64, step, index);
    let mut params: [*mut c_void; 4] =
        [(&raw mut x).cast(), (&raw mut n).cast(), (&raw mut step).cast(), (&raw mut index).cast()];
    raw!(cuLaunchKernel(
        layer.raw(),
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
}

/// The raw pipeline: per stage a stream, activations, layer and copy kernels; per boundary and
/// slot a buffer on the RX device and the two protocol events.
struct Raw {
    devices: Vec<i32>,
    streams: Vec<std::sync::Arc<CudaStream>>,
    acts: Vec<CudaSlice<f32>>,
    layers: Vec<Function>,
    copies: Vec<Function>,
    max_blocks: Vec<u32>,
    /// `[boundary][slot]`
    slots: Vec<Vec<CudaSlice<f32>>>,
    ev_tx: Vec<Vec<CudaEvent>>,
    ev_rx: Vec<Vec<CudaEvent>>,
}

impl Raw {
    fn new(gpus: &Gpus, devices: &[i32]) -> Raw {
        let engine = |s: usize| &gpus.engines[devices[s] as usize];
        let s_count = devices.len();
        let streams: Vec<_> = (0..s_count).map(|s| CudaStream::new(engine(s).context()).unwrap()).collect();
        let acts = (0..s_count).map(|s| CudaSlice::<f32>::alloc_persistent(&streams[s], N).unwrap()).collect();
        let module = |s: usize, name: &str, ptx: &str| Module::load_ptx(engine(s).context(), name, ptx).unwrap();
        let layers = (0..s_count)
            .map(|s| module(s, "toy", ppnrt::kernels::TOY_MODEL_PTX).function("ppnrt_toy_layer_f32").unwrap())
            .collect();
        let copies = (0..s_count)
            .map(|s| module(s, "helpers", ppnrt::kernels::HELPERS_PTX).function("ppnrt_copy_bytes").unwrap())
            .collect();
        let max_blocks = (0..s_count).map(|s| engine(s).max_blocks()).collect();
        let boundaries = s_count - 1;
        let slots = (0..boundaries)
            .map(|b| (0..SLOTS).map(|_| CudaSlice::<f32>::alloc_persistent(&streams[b + 1], N).unwrap()).collect())
            .collect();
        let events = |side: usize| -> Vec<Vec<CudaEvent>> {
            (0..boundaries)
                .map(|b| (0..SLOTS).map(|_| CudaEvent::new(engine(b + side).context(), false).unwrap()).collect())
                .collect()
        };
        let (ev_tx, ev_rx) = (events(0), events(1));
        Raw { devices: devices.to_vec(), streams, acts, layers, copies, max_blocks, slots, ev_tx, ev_rx }
    }

    fn ptr<T: ppnrt::DeviceRepr>(slice: &CudaSlice<T>) -> u64 {
        use ppnrt::DeviceSlice;
        slice.device_ptr()
    }

    /// The copy out of the slot and its ev_rx record (stage s > 0), on `stream`.
    fn rx(&self, s: usize, k: usize, stream: ppnrt::sys::CUstream) {
        let b = s - 1;
        launch_or_copy(
            &self.copies[s],
            self.max_blocks[s],
            Self::ptr(&self.acts[s]),
            Self::ptr(&self.slots[b][k]),
            N * 4,
            stream,
        );
    }

    /// The copy into the slot (stage s < S - 1), on `stream`.
    fn tx(&self, s: usize, k: usize, stream: ppnrt::sys::CUstream) {
        let (dst, src) = (Self::ptr(&self.slots[s][k]), Self::ptr(&self.acts[s]));
        if self.devices[s] == self.devices[s + 1] {
            launch_or_copy(&self.copies[s], self.max_blocks[s], dst, src, N * 4, stream);
        } else {
            raw!(cuMemcpyAsync(dst, src, N * 4, stream));
        }
    }

    fn layers(&self, s: usize, k: usize, stream: ppnrt::sys::CUstream) {
        for layer in 0..LAYERS {
            raw_layer(&self.layers[s], self.max_blocks[s], Self::ptr(&self.acts[s]), k as u32, layer, stream);
        }
    }

    /// One eager step on slot k: the protocol's waits and records around the copies.
    fn eager_step(&self, k: usize) {
        let s_count = self.streams.len();
        for s in 0..s_count {
            let _bound = self.bind(s);
            let stream = self.streams[s].raw();
            if s > 0 {
                raw!(cuStreamWaitEvent(stream, self.ev_tx[s - 1][k].raw(), 0));
                self.rx(s, k, stream);
                raw!(cuEventRecord(self.ev_rx[s - 1][k].raw(), stream));
            }
            self.layers(s, k, stream);
            if s + 1 < s_count {
                raw!(cuStreamWaitEvent(stream, self.ev_rx[s][k].raw(), 0));
                self.tx(s, k, stream);
                raw!(cuEventRecord(self.ev_tx[s][k].raw(), stream));
            }
        }
    }

    fn bind(&self, s: usize) -> ppnrt::BoundContext<'_> {
        self.streams[s].context().bind().unwrap()
    }

    /// Captures `work` on stage s's stream into a new graph.
    fn capture(&self, s: usize, work: impl FnOnce(ppnrt::sys::CUstream)) -> CUgraph {
        let _bound = self.bind(s);
        let stream = self.streams[s].raw();
        raw!(cuStreamBeginCapture_v2(stream, CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED));
        work(stream);
        let mut graph: CUgraph = std::ptr::null_mut();
        raw!(cuStreamEndCapture(stream, &mut graph));
        graph
    }

    /// Stage s's step on slot k as one graph with its boundary inside.
    fn stage_graph(&self, s: usize, k: usize) -> CUgraphExec {
        let s_count = self.streams.len();
        let _bound = self.bind(s);
        let mut graph: CUgraph = std::ptr::null_mut();
        raw!(cuGraphCreate(&mut graph, 0));
        let child = |deps: &[CUgraphNode], body: CUgraph| {
            let mut node: CUgraphNode = std::ptr::null_mut();
            raw!(cuGraphAddChildGraphNode(&mut node, graph, deps.as_ptr(), deps.len(), body));
            raw!(cuGraphDestroy(body));
            node
        };
        let mut head: Vec<CUgraphNode> = Vec::new();
        if s > 0 {
            let mut wait: CUgraphNode = std::ptr::null_mut();
            raw!(cuGraphAddEventWaitNode(&mut wait, graph, std::ptr::null(), 0, self.ev_tx[s - 1][k].raw()));
            let copy = child(&[wait], self.capture(s, |stream| self.rx(s, k, stream)));
            let mut record: CUgraphNode = std::ptr::null_mut();
            raw!(cuGraphAddEventRecordNode(&mut record, graph, &copy, 1, self.ev_rx[s - 1][k].raw()));
            head.push(copy);
        }
        let body = child(&head, self.capture(s, |stream| self.layers(s, k, stream)));
        if s + 1 < s_count {
            let mut wait: CUgraphNode = std::ptr::null_mut();
            raw!(cuGraphAddEventWaitNode(&mut wait, graph, std::ptr::null(), 0, self.ev_rx[s][k].raw()));
            let copy = child(&[body, wait], self.capture(s, |stream| self.tx(s, k, stream)));
            let mut record: CUgraphNode = std::ptr::null_mut();
            raw!(cuGraphAddEventRecordNode(&mut record, graph, &copy, 1, self.ev_tx[s][k].raw()));
        }
        let mut exec: CUgraphExec = std::ptr::null_mut();
        raw!(cuGraphInstantiateWithFlags(&mut exec, graph, 0));
        raw!(cuGraphDestroy(graph));
        exec
    }

    /// The whole step on slot k as one graph over every stage's stream (fork and join through
    /// events recorded inside the capture).
    fn multi_device_graph(&self, k: usize) -> CUgraphExec {
        let s_count = self.streams.len();
        let joins: Vec<CudaEvent> =
            (0..s_count).map(|s| CudaEvent::new(self.streams[s].context(), false).unwrap()).collect();
        let origin = self.streams[0].raw();
        let mut graph: CUgraph = std::ptr::null_mut();
        {
            let _bound = self.bind(0);
            raw!(cuStreamBeginCapture_v2(origin, CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED));
        }
        for s in 0..s_count {
            let _bound = self.bind(s);
            let stream = self.streams[s].raw();
            if s > 0 {
                raw!(cuStreamWaitEvent(stream, joins[s - 1].raw(), 0));
                self.rx(s, k, stream);
            }
            self.layers(s, k, stream);
            if s + 1 < s_count {
                self.tx(s, k, stream);
            }
            raw!(cuEventRecord(joins[s].raw(), stream));
        }
        let _bound = self.bind(0);
        raw!(cuStreamWaitEvent(origin, joins[s_count - 1].raw(), 0));
        raw!(cuStreamEndCapture(origin, &mut graph));
        let mut exec: CUgraphExec = std::ptr::null_mut();
        raw!(cuGraphInstantiateWithFlags(&mut exec, graph, 0));
        raw!(cuGraphDestroy(graph));
        exec
    }

    fn sync(&self) {
        for stream in &self.streams {
            stream.synchronize().unwrap();
        }
    }

    fn output(&self) -> Vec<f32> {
        // The one multi-device graph runs every stage from stage 0's stream: wait for all.
        self.sync();
        let last = self.acts.len() - 1;
        let mut host = vec![0f32; N];
        self.streams[last].memcpy_dtoh(&self.acts[last], &mut host).unwrap();
        host
    }

    /// Puts `input` into every stage's activations (pageable source: staged by the call).
    fn reset(&self, input: &[f32]) {
        self.sync();
        for s in 0..self.acts.len() {
            let _bound = self.bind(s);
            raw!(cuMemcpyHtoDAsync_v2(Self::ptr(&self.acts[s]), input.as_ptr().cast(), N * 4, self.streams[s].raw()));
        }
        self.sync();
    }
}

/// The crate's pipeline for `devices`, its persistent activations, and an input.
fn crate_pipeline(gpus: &Gpus, devices: &[i32]) -> (PpNRt, Vec<CudaSlice<f32>>) {
    let primary = &gpus.engines[0];
    let rt = PpNRt::new(PpConfig::with_devices(devices).with_slots(SLOTS), primary).unwrap();
    let acts = (0..rt.n_stages())
        .map(|s| {
            let _scope = rt.enter(s).unwrap();
            rt.engine(s, primary).unwrap().alloc_persistent::<f32>(N).unwrap()
        })
        .collect();
    (rt, acts)
}

/// One eager step of the crate on slot `k`, the work of the raw step's: the slot received into the
/// stage's activations (`rx_into`, one copy, as the raw step and the crate's graph step do), the
/// layers, `tx`; each stage's calls with its context bound once, as the raw step binds it.
fn crate_eager_step(rt: &PpNRt, primary: &Engine, acts: &mut [CudaSlice<f32>], k: usize) {
    for (s, act) in acts.iter_mut().enumerate() {
        let engine = rt.engine(s, primary).unwrap();
        let _scope = rt.enter(s).unwrap();
        let _bound = engine.context().bind().unwrap();
        crate_stage_work(rt, engine, act, s, k);
    }
}

/// [`crate_eager_step`] with each stage's calls inside [`Context::bound_unchecked`] of its
/// context (as a stage's own loop may run): they make no context query.
///
/// [`Context::bound_unchecked`]: ppnrt::Context::bound_unchecked
fn crate_eager_step_unchecked(rt: &PpNRt, primary: &Engine, acts: &mut [CudaSlice<f32>], k: usize) {
    for (s, act) in acts.iter_mut().enumerate() {
        let engine = rt.engine(s, primary).unwrap();
        let _scope = rt.enter(s).unwrap();
        // SAFETY: the closure runs the crate's calls only; nothing else changes the context.
        unsafe { engine.context().bound_unchecked(|| crate_stage_work(rt, engine, act, s, k)) }.unwrap();
    }
}

/// Stage `s`'s share of an eager step on slot `k`: `rx_into` its activations (but the first
/// stage), the layers, `tx` (but the last).
fn crate_stage_work(rt: &PpNRt, engine: &Engine, act: &mut CudaSlice<f32>, s: usize, k: usize) {
    if s > 0 {
        rt.rx_into(s - 1, k, act).unwrap();
    }
    for layer in 0..LAYERS {
        engine.toy_layer(act, k as u32, layer).unwrap();
    }
    if s + 1 < rt.n_stages() {
        assert_eq!(rt.tx(s, act, N).unwrap(), k);
    }
}

fn reset_acts(rt: &PpNRt, primary: &Engine, acts: &mut [CudaSlice<f32>], input: &[f32]) {
    for (s, x) in acts.iter_mut().enumerate() {
        let _scope = rt.enter(s).unwrap();
        rt.engine(s, primary).unwrap().htod_into(input, x).unwrap();
    }
    rt.synchronize().unwrap();
}

fn crate_output(rt: &PpNRt, primary: &Engine, acts: &[CudaSlice<f32>]) -> Vec<f32> {
    let last = rt.n_stages() - 1;
    let _scope = rt.enter(last).unwrap();
    rt.engine(last, primary).unwrap().dtoh(&acts[last]).unwrap()
}

pub(super) fn graph_mode(gpus: &Gpus, report: &mut String) {
    let primary = &gpus.engines[0];
    let two = gpus.engines.len() >= 2 && gpus.peers;
    let input = step_input();
    let _ = writeln!(
        report,
        "\n| S × 20 kernels, 32 KiB, {} | host issue / step (run of {}) | host issue / step (median call) | pipelined step | isolated step |\n| --- | ---: | ---: | ---: | ---: |",
        if two { "stages alternating over 2 GPUs" } else { "one GPU" },
        steps_per_run()
    );
    let mut checks: Vec<(String, String, bool)> = Vec::new();
    // Host issue per step at S = 2 (crate graph mode, raw per-stage graphs): the per-boundary cost
    // is the growth from S = 2 to S = 8 over the six boundaries added.
    let mut at_two: Option<(f64, f64)> = None;
    for s_count in [2usize, 4, 8] {
        let devices = stage_devices(two, s_count);
        let mut outputs: Vec<(&str, Vec<f32>)> = Vec::new();
        // The crate, eager.
        let (rt, mut acts) = crate_pipeline(gpus, &devices);
        reset_acts(&rt, primary, &mut acts, &input);
        let eager = time_steps(|k| crate_eager_step(&rt, primary, &mut acts, k % SLOTS), &|| rt.synchronize().unwrap());
        // Same number of steps again from the input, for the output comparison.
        reset_acts(&rt, primary, &mut acts, &input);
        for k in 0..4 {
            crate_eager_step(&rt, primary, &mut acts, k % SLOTS);
        }
        outputs.push(("crate eager", crate_output(&rt, primary, &acts)));
        // The crate, graph mode.
        let graph = {
            let (acts_ptr, rt_ref) = (&mut acts, &rt);
            let mut step = rt_ref
                .capture_step::<f32>(N, |stage| {
                    let s = stage.stage();
                    let engine = rt_ref.engine(s, primary)?;
                    if s > 0 {
                        stage.rx_into(&mut acts_ptr[s])?;
                    }
                    for layer in 0..LAYERS {
                        engine.toy_layer(&mut acts_ptr[s], stage.slot() as u32, layer)?;
                    }
                    if s + 1 < s_count {
                        stage.tx(&acts_ptr[s])?;
                    }
                    Ok(())
                })
                .unwrap();
            let figures = time_steps(
                |_| {
                    step.launch().unwrap();
                },
                &|| rt_ref.synchronize().unwrap(),
            );
            reset_acts(rt_ref, primary, acts_ptr, &input);
            for _ in 0..4 {
                step.launch().unwrap();
            }
            outputs.push(("crate graph", crate_output(rt_ref, primary, acts_ptr)));
            figures
        };
        drop(acts);
        drop(rt);
        // Raw references.
        let raw = Raw::new(gpus, &devices);
        raw.reset(&input);
        let raw_eager = time_steps(|k| raw.eager_step(k % SLOTS), &|| raw.sync());
        raw.reset(&input);
        for k in 0..4 {
            raw.eager_step(k % SLOTS);
        }
        outputs.push(("raw eager", raw.output()));
        let multi: Vec<CUgraphExec> = (0..SLOTS).map(|k| raw.multi_device_graph(k)).collect();
        let launch_multi = |k: usize| {
            let _bound = raw.bind(0);
            raw!(cuGraphLaunch(multi[k % SLOTS], raw.streams[0].raw()));
        };
        let raw_multi = time_steps(launch_multi, &|| raw.sync());
        raw.reset(&input);
        for k in 0..4 {
            launch_multi(k);
        }
        outputs.push(("raw one multi-device graph", raw.output()));
        let per_stage: Vec<Vec<CUgraphExec>> =
            (0..SLOTS).map(|k| (0..s_count).map(|s| raw.stage_graph(s, k)).collect()).collect();
        let launch_per_stage = |k: usize| {
            for (s, exec) in per_stage[k % SLOTS].iter().enumerate() {
                let _bound = raw.bind(s);
                raw!(cuGraphLaunch(*exec, raw.streams[s].raw()));
            }
        };
        let raw_per_stage = time_steps(launch_per_stage, &|| raw.sync());
        raw.reset(&input);
        for k in 0..4 {
            launch_per_stage(k);
        }
        outputs.push(("raw per-stage graphs", raw.output()));
        for exec in multi.into_iter().chain(per_stage.into_iter().flatten()) {
            raw!(cuGraphExecDestroy(exec));
        }
        for (name, f) in [
            ("crate eager", eager),
            ("crate graph mode", graph),
            ("raw eager", raw_eager),
            ("raw one multi-device graph", raw_multi),
            ("raw per-stage graphs", raw_per_stage),
        ] {
            let _ = writeln!(
                report,
                "| S = {s_count}: {name} | {:.1} µs | {:.1} µs | {:.1} µs | {:.1} µs |",
                f.issue, f.issue_call, f.pipelined, f.latency
            );
        }
        let same = |o: &[f32]| o.iter().zip(&outputs[0].1).all(|(a, b)| a.to_bits() == b.to_bits());
        for (name, o) in &outputs {
            let differing = o.iter().zip(&outputs[0].1).filter(|(a, b)| a.to_bits() != b.to_bits()).count();
            say(&format!(
                "graph mode S={s_count}: {name}: {differing} of {N} elements differ from the crate eager output"
            ));
        }
        let identical = outputs.iter().all(|(_, o)| same(o));
        checks.push((
            format!("S = {s_count}: outputs of every variant bitwise identical"),
            format!("{identical}"),
            identical,
        ));
        if s_count == 2 {
            at_two = Some((graph.issue, raw_per_stage.issue));
        }
        if let (8, Some((graph_two, raw_two))) = (s_count, at_two) {
            let (crate_boundary, raw_boundary) =
                ((graph.issue - graph_two) / 6.0, (raw_per_stage.issue - raw_two) / 6.0);
            checks.push((
                "per boundary (host issue, S = 2 → 8): graph mode ≤ 1.1× raw per-stage graphs".into(),
                format!("{crate_boundary:.1} vs {raw_boundary:.1} µs ({:.3}×)", crate_boundary / raw_boundary),
                crate_boundary <= 1.1 * raw_boundary,
            ));
        }
        if s_count == 8 {
            checks.push((
                "S = 8: graph mode host issue ≤ 0.2× raw eager".into(),
                format!("{:.1} vs {:.1} µs ({:.3}×)", graph.issue, raw_eager.issue, graph.issue / raw_eager.issue),
                graph.issue <= 0.2 * raw_eager.issue,
            ));
            checks.push((
                "S = 8: graph mode host issue ≤ 0.5× raw one multi-device graph".into(),
                format!(
                    "{:.1} vs {:.1} µs ({:.3}×); one call alone (median) {:.1} vs {:.1} µs ({:.3}×)",
                    graph.issue,
                    raw_multi.issue,
                    graph.issue / raw_multi.issue,
                    graph.issue_call,
                    raw_multi.issue_call,
                    graph.issue_call / raw_multi.issue_call
                ),
                graph.issue <= 0.5 * raw_multi.issue,
            ));
            checks.push((
                "S = 8: graph mode host issue ≤ 1.1× raw per-stage graphs".into(),
                format!(
                    "{:.1} vs {:.1} µs ({:.3}×)",
                    graph.issue,
                    raw_per_stage.issue,
                    graph.issue / raw_per_stage.issue
                ),
                graph.issue <= 1.1 * raw_per_stage.issue,
            ));
            checks.push((
                "S = 8: graph mode pipelined step ≤ 1.1× raw per-stage graphs".into(),
                format!(
                    "{:.1} vs {:.1} µs ({:.3}×)",
                    graph.pipelined,
                    raw_per_stage.pipelined,
                    graph.pipelined / raw_per_stage.pipelined
                ),
                graph.pipelined <= 1.1 * raw_per_stage.pipelined,
            ));
        }
    }
    let _ = writeln!(report, "\n| graph-mode target | measured | met |\n| --- | --- | --- |");
    for (target, measured, met) in checks {
        let _ = writeln!(report, "| {target} | {measured} | {} |", if met { "yes" } else { "NO" });
        say(&format!("TARGET {target}: {measured} {}", if met { "met" } else { "NOT MET" }));
    }
}

/// The comparison table's eager decode step: S = 8 stages (alternating over two peer GPUs, else
/// on one) × 20 kernels, 32 KiB, the crate's eager step (`rx`, layers, `tx`) beside the raw
/// driver's, host issue per step (µs, each a run of 200 steps issued back to back, median of six
/// rounds in which the three alternate, after a warm-up of 50 steps each): the crate's step as
/// it binds each stage's context, the same inside `Context::bound_unchecked` per stage, and the
/// raw step. The outputs are checked bitwise against each other after the same steps from the
/// same input.
pub(super) fn eager_decode_row(gpus: &Gpus) -> (f64, f64, f64) {
    const STAGES: usize = 8;
    const ROUNDS: usize = 6;
    const RUN: usize = 200;
    let primary = &gpus.engines[0];
    let two = gpus.engines.len() >= 2 && gpus.peers;
    let devices = stage_devices(two, STAGES);
    let input = step_input();
    let (rt, mut acts) = crate_pipeline(gpus, &devices);
    let raw = Raw::new(gpus, &devices);
    // The same steps from the same input: each crate step must agree with the raw one bit for bit.
    type Step = fn(&PpNRt, &Engine, &mut [CudaSlice<f32>], usize);
    for (step, what) in [
        (crate_eager_step as Step, "the crate's step"),
        (crate_eager_step_unchecked, "the crate's step in unchecked bindings"),
    ] {
        reset_acts(&rt, primary, &mut acts, &input);
        raw.reset(&input);
        for k in 0..4 {
            step(&rt, primary, &mut acts, k % SLOTS);
            raw.eager_step(k % SLOTS);
        }
        assert!(crate_output(&rt, primary, &acts) == raw.output(), "eager decode row: {what} differs from the raw one");
    }
    let (mut crate_issue, mut unchecked_issue, mut raw_issue) = (Vec::new(), Vec::new(), Vec::new());
    let mut k = 0;
    let mut run = |step: &mut dyn FnMut(usize), sync: &dyn Fn(), steps: usize| -> f64 {
        let start = Instant::now();
        for _ in 0..steps {
            step(k % SLOTS);
            k += 1;
        }
        let issue = start.elapsed().as_secs_f64() / steps as f64 * 1e6;
        sync();
        issue
    };
    run(&mut |slot| crate_eager_step(&rt, primary, &mut acts, slot), &|| rt.synchronize().unwrap(), 50);
    run(&mut |slot| crate_eager_step_unchecked(&rt, primary, &mut acts, slot), &|| rt.synchronize().unwrap(), 50);
    run(&mut |slot| raw.eager_step(slot), &|| raw.sync(), 50);
    for _ in 0..ROUNDS {
        crate_issue.push(run(
            &mut |slot| crate_eager_step(&rt, primary, &mut acts, slot),
            &|| rt.synchronize().unwrap(),
            RUN,
        ));
        unchecked_issue.push(run(
            &mut |slot| crate_eager_step_unchecked(&rt, primary, &mut acts, slot),
            &|| rt.synchronize().unwrap(),
            RUN,
        ));
        raw_issue.push(run(&mut |slot| raw.eager_step(slot), &|| raw.sync(), RUN));
    }
    (median(&mut crate_issue), median(&mut unchecked_issue), median(&mut raw_issue))
}
