//! Graph-mode scenarios shared by `tests/gpu/graphs_on_gpu.rs` (GPU) and `tests/double/` (driver double).
#![allow(dead_code, unreachable_pub)]

use std::sync::Arc;

use crate::common::{Rng, say};
use ppnrt::{
    CaptureError, CaptureMode, CudaError, CudaSlice, CudaStream, Engine, Error, PinnedHostBuffer, PpConfig, PpError,
    PpNRt, SlotState, StageCapture, StepGraphs,
};

pub const TOTAL_LAYERS: u32 = 12;

/// Layers of stage `s` out of `n_stages`: a contiguous share of TOTAL_LAYERS.
pub fn layers_of(s: usize, n_stages: usize) -> std::ops::Range<u32> {
    let per = |s: usize| (s as u32 * TOTAL_LAYERS) / n_stages as u32;
    per(s)..per(s + 1)
}

/// The model on one stream: input `r` runs every layer with step parameter `step_of(r)`.
pub fn reference(engine: &Engine, inputs: &[Vec<f32>], step_of: impl Fn(usize) -> u32) -> Vec<Vec<f32>> {
    inputs
        .iter()
        .enumerate()
        .map(|(r, input)| {
            let mut x = engine.htod(input).unwrap();
            for layer in 0..TOTAL_LAYERS {
                engine.toy_layer(&mut x, step_of(r), layer).unwrap();
            }
            engine.dtoh(&x).unwrap()
        })
        .collect()
}

/// Persistent per-stage activations and the last stage's output, allocated before a capture.
pub struct StepBuffers {
    pub acts: Vec<CudaSlice<f32>>,
}

impl StepBuffers {
    pub fn new(rt: &PpNRt, primary: &Engine, n: usize) -> StepBuffers {
        let acts = (0..rt.n_stages())
            .map(|s| {
                let _scope = rt.enter(s).unwrap();
                let mut x = rt.engine(s, primary).unwrap().alloc_persistent::<f32>(n).unwrap();
                rt.stage_stream(s).unwrap().memset_bytes(&mut x, 0).unwrap();
                x
            })
            .collect();
        StepBuffers { acts }
    }
}

/// The toy model's step, as a capture's body: stage `s` receives into its activations (stage 0
/// finds its input there), runs its layers with step parameter = the slot, and sends.
pub fn toy_step<'a>(
    rt: &'a PpNRt,
    primary: &'a Engine,
    buffers: &'a mut StepBuffers,
    in_place: bool,
) -> impl FnMut(&mut StageCapture<'_, f32>) -> Result<(), Error> + 'a {
    let n_stages = rt.n_stages();
    move |stage: &mut StageCapture<'_, f32>| {
        let s = stage.stage();
        let engine = rt.engine(s, primary)?;
        let x = &mut buffers.acts[s];
        if s > 0 {
            if in_place && s % 2 == 1 {
                // In place: the first layer reads the slot by copying it with the SMs (a kernel
                // that reads the slot's memory inside the graph).
                let received = stage.received()?;
                engine.copy_with_sms(&received, x)?;
            } else {
                stage.rx_into(x)?;
            }
        }
        for layer in layers_of(s, n_stages) {
            engine.toy_layer(x, stage.slot() as u32, layer)?;
        }
        if s + 1 < n_stages {
            stage.tx(x)?;
        }
        Ok(())
    }
}

/// Captures the toy model's step ([`toy_step`]).
pub fn capture<'rt>(
    rt: &'rt PpNRt,
    primary: &Engine,
    buffers: &mut StepBuffers,
    n: usize,
    in_place: bool,
) -> Result<StepGraphs<'rt, f32>, Error> {
    rt.capture_step::<f32>(n, toy_step(rt, primary, buffers, in_place))
}

/// Captures the toy model's step again into `step` ([`toy_step`]).
pub fn recapture(
    step: &mut StepGraphs<'_, f32>,
    rt: &PpNRt,
    primary: &Engine,
    buffers: &mut StepBuffers,
    n: usize,
    in_place: bool,
) -> Result<(), Error> {
    step.recapture(n, toy_step(rt, primary, buffers, in_place))
}

/// One eager step with the same work as the captured one (step parameter `step`); returns the
/// output on the last stage.
pub fn eager_step(rt: &PpNRt, primary: &Engine, input: &[f32], step: u32) -> CudaSlice<f32> {
    eager_step_with(rt, primary, input, step, || {})
}

/// [`eager_step`], with `half_way` called once boundary 0 is crossed (its `tx` made, not
/// received yet); not called with one stage.
pub fn eager_step_with(
    rt: &PpNRt,
    primary: &Engine,
    input: &[f32],
    step: u32,
    half_way: impl FnOnce(),
) -> CudaSlice<f32> {
    let mut half_way = Some(half_way);
    let n_stages = rt.n_stages();
    let n = input.len();
    let mut slot = None;
    let mut out = None;
    for s in 0..n_stages {
        let engine = rt.engine(s, primary).unwrap();
        let _scope = rt.enter(s).unwrap();
        let mut x = match slot {
            None => engine.htod(input).unwrap(),
            Some(index) => rt.rx::<f32>(s - 1, index, n).unwrap(),
        };
        for layer in layers_of(s, n_stages) {
            engine.toy_layer(&mut x, step, layer).unwrap();
        }
        if s + 1 < n_stages {
            slot = Some(rt.tx(s, &x, n).unwrap());
            if let Some(half_way) = half_way.take() {
                half_way();
            }
        } else {
            out = Some(x);
        }
    }
    out.unwrap()
}

fn same_bits(a: &[f32], b: &[f32]) -> bool {
    a.len() == b.len() && a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits())
}

/// Graph steps (every third step eager instead) through `config` give bitwise the reference's
/// outputs. Returns how many steps ran.
pub fn graph_steps_match(primary: &Engine, config: PpConfig, inputs: &[Vec<f32>], expected: &[Vec<f32>]) -> usize {
    let rt = PpNRt::new(config.clone(), primary).unwrap();
    let n = inputs[0].len();
    let n_stages = rt.n_stages();
    let last = n_stages - 1;
    let mut buffers = StepBuffers::new(&rt, primary, n);
    let in_place = config.slots() % 2 == 0;
    let mut step = capture(&rt, primary, &mut buffers, n, in_place).unwrap();
    let last_engine = rt.engine(last, primary).unwrap();
    let mut outputs = Vec::new();
    for (r, input) in inputs.iter().enumerate() {
        if r % 3 == 2 {
            // An eager step between graph steps, with the step parameter the graph would use.
            let slot = if n_stages > 1 { r % rt.n_slots() } else { 0 };
            let out = eager_step(&rt, primary, input, slot as u32);
            outputs.push(out);
            continue;
        }
        {
            let _scope = rt.enter(0).unwrap();
            rt.engine(0, primary).unwrap().htod_into(input, &mut buffers.acts[0]).unwrap();
        }
        let slot = step.launch().unwrap();
        if n_stages > 1 {
            assert_eq!(slot, r % rt.n_slots(), "{config}: graph step {r} used slot {slot}");
        }
        // Keep this step's output: an ordered copy on the last stage (no host wait).
        let _scope = rt.enter(last).unwrap();
        let mut out = last_engine.alloc::<f32>(n).unwrap();
        last_engine.dtod(&buffers.acts[last], &mut out).unwrap();
        outputs.push(out);
    }
    let _scope = rt.enter(last).unwrap();
    for (r, out) in outputs.iter().enumerate() {
        let got = last_engine.dtoh(out).unwrap();
        assert!(
            same_bits(&got, &expected[r]),
            "{config}: step {r} ({}) differs",
            if r % 3 == 2 { "eager" } else { "graph" }
        );
    }
    inputs.len()
}

/// The stage counts, maps and slot counts graph mode is checked on.
pub fn graph_configs(devices: i32, quick: bool) -> Vec<PpConfig> {
    let stage_counts: Vec<usize> = if quick { vec![1, 2, 3, 8] } else { (1..=8).collect() };
    let slot_counts: Vec<usize> = if quick { vec![1, 2] } else { (1..=4).collect() };
    let mut configs = Vec::new();
    for &n_stages in &stage_counts {
        let mut maps = vec![vec![0; n_stages]];
        if devices >= 2 && n_stages >= 2 {
            maps.push((0..n_stages).map(|s| (s * 2 / n_stages) as i32).collect());
            maps.push((0..n_stages).map(|s| (s % 2) as i32).collect());
        }
        for map in maps {
            for &slots in &slot_counts {
                configs.push(PpConfig::with_devices(&map).with_slots(slots));
            }
        }
    }
    configs
}

/// Every configuration's graph steps match the one-stage model bitwise.
pub fn graph_mode_matches_eager_and_one_stage(test: &str, primary: &Engine, devices: i32, quick: bool) {
    let mut rng = Rng::new(14);
    let n = 3000;
    let steps = 7;
    let inputs: Vec<Vec<f32>> = (0..steps).map(|_| rng.vec_f32(n)).collect();
    let mut runs = 0;
    for config in graph_configs(devices, quick) {
        let slots = config.slots();
        let one_stage = config.n_stages() == 1;
        let expected = reference(primary, &inputs, |r| if one_stage { 0 } else { (r % slots) as u32 });
        graph_steps_match(primary, config, &inputs, &expected);
        runs += 1;
    }
    say(&format!("{test}: {runs} configurations, {steps} steps each, bitwise identical"));
}

/// A call that cannot be captured is a typed error naming it, the capture is invalidated, and
/// the runtime, its slots and streams stay usable.
pub fn capture_misuse_is_a_typed_error(primary: &Engine, devices: &[i32]) {
    let rt = PpNRt::new(PpConfig::with_devices(devices).with_slots(2), primary).unwrap();
    let n = 1024;
    let mut buffers = StepBuffers::new(&rt, primary, n);
    let illegal: [(&str, &str); 4] = [
        ("synchronize", "CudaStream::synchronize"),
        ("alloc", "CudaSlice::alloc on a capturing stream"),
        ("pinned copy", "a copy to or from pinned host memory"),
        ("host copy", "CudaStream::memcpy_dtoh"),
    ];
    // Pinned memory allocated before the captures (an allocation is no capturable call either).
    let mut pinned = PinnedHostBuffer::<f32>::new(rt.stage_stream(0).unwrap().context(), n, false).unwrap();
    for (what, call) in illegal {
        for swallow in [false, true] {
            let result = rt.capture_step::<f32>(n, |stage| {
                let s = stage.stage();
                let stream = Arc::clone(stage.stream());
                let x = &mut buffers.acts[s];
                let misuse = match what {
                    "synchronize" => stream.synchronize(),
                    "alloc" => CudaSlice::<f32>::alloc(&stream, 16).map(drop),
                    "pinned copy" => stream.memcpy_dtoh_pinned(x, &mut pinned),
                    _ => {
                        let mut host = vec![0f32; n];
                        stream.memcpy_dtoh(x, &mut host)
                    }
                };
                match misuse {
                    Err(CudaError::Capture(CaptureError::IllegalCall { call: named })) => {
                        assert_eq!(named, call, "{what}: the error names the call")
                    }
                    other => panic!("{what}: expected an IllegalCall error, got {other:?}"),
                }
                if !swallow {
                    misuse?;
                }
                if s + 1 < rt.n_stages() {
                    stage.tx(x)?;
                }
                Ok(())
            });
            let err = result.expect_err("a capture with an illegal call must fail");
            match (&err, swallow) {
                (Error::Cuda(CudaError::Capture(CaptureError::IllegalCall { call: named })), false) => {
                    assert_eq!(*named, call)
                }
                (Error::Cuda(CudaError::Capture(CaptureError::Invalidated { call: named })), true) => {
                    assert_eq!(named, call)
                }
                _ => panic!("{what} (error swallowed: {swallow}): unexpected {err:?}"),
            }
            for s in 0..rt.n_stages() {
                assert!(!rt.stage_stream(s).unwrap().is_capturing(), "{what}: stage {s} still capturing");
            }
        }
    }
    // Everything stays usable: an eager step, then a proper capture and a graph step.
    let input: Vec<f32> = (0..n).map(|i| i as f32 * 0.25).collect();
    let eager = eager_step(&rt, primary, &input, 0);
    let last = rt.n_stages() - 1;
    let eager_out = {
        let _scope = rt.enter(last).unwrap();
        rt.engine(last, primary).unwrap().dtoh(&eager).unwrap()
    };
    let mut step = capture(&rt, primary, &mut buffers, n, false).unwrap();
    {
        let _scope = rt.enter(0).unwrap();
        rt.engine(0, primary).unwrap().htod_into(&input, &mut buffers.acts[0]).unwrap();
    }
    // The rings moved one slot with the eager step: this graph step uses slot 1.
    let graph_slot = if rt.n_stages() > 1 { 1 } else { 0 };
    assert_eq!(step.launch().unwrap(), graph_slot);
    let graph_out = {
        let _scope = rt.enter(last).unwrap();
        rt.engine(last, primary).unwrap().dtoh(&buffers.acts[last]).unwrap()
    };
    let expected_eager = reference(primary, std::slice::from_ref(&input), |_| 0);
    let expected_graph = reference(primary, std::slice::from_ref(&input), |_| graph_slot as u32);
    assert!(same_bits(&eager_out, &expected_eager[0]), "the eager step after failed captures");
    assert!(same_bits(&graph_out, &expected_graph[0]), "the graph step after failed captures");
}

/// Graph steps are refused, with nothing enqueued, when the rings do not match them: a slot
/// still filled by an eager `tx` (in any slot of a ring the step uses: the step would overtake
/// it), a ring out of step, a slot reallocated since the capture.
pub fn mismatched_graph_steps_are_refused(primary: &Engine, devices: &[i32]) {
    let rt = PpNRt::new(PpConfig::with_devices(devices).with_slots(2), primary).unwrap();
    let n = 512;
    let mut buffers = StepBuffers::new(&rt, primary, n);
    let mut step = capture(&rt, primary, &mut buffers, n, false).unwrap();
    let engine0 = rt.engine(0, primary).unwrap();
    // Boundary 0 crossed eagerly, boundary 1 not: out of step.
    let x = {
        let _scope = rt.enter(0).unwrap();
        engine0.htod(&vec![1f32; n]).unwrap()
    };
    let slot = rt.tx(0, &x, n).unwrap();
    match step.launch() {
        Err(Error::Pipeline(PpError::GraphOutOfStep { boundary: 1, expected: 1, found: 0 })) => {}
        other => panic!("expected GraphOutOfStep on boundary 1, got {other:?}"),
    }
    {
        let _scope = rt.enter(1).unwrap();
        let y = rt.rx::<f32>(0, slot, n).unwrap();
        let _slot = rt.tx(1, &y, n).unwrap();
    }
    // Every ring at slot 1 now, but slot 0 of boundary 1 still holds the eager tx, which a graph
    // step on slot 1 would overtake: refused.
    match step.launch() {
        Err(Error::Pipeline(PpError::SlotState { boundary: 1, slot: 0, found: SlotState::Filled { .. }, .. })) => {}
        other => panic!("expected a SlotState error, got {other:?}"),
    }
    rt.discard_unreceived(1).unwrap();
    // Nothing unreceived: the graph steps run on slot 1, then slot 0.
    assert_eq!(step.launch().unwrap(), 1);
    assert_eq!(step.launch().unwrap(), 0);
    // An eager tx of a larger length reallocates slot 1: the graphs are stale.
    let big = {
        let _scope = rt.enter(0).unwrap();
        engine0.htod(&vec![2f32; 64 * n]).unwrap()
    };
    let slot = rt.tx(0, &big, 64 * n).unwrap();
    assert_eq!(slot, 1);
    rt.discard_unreceived(0).unwrap();
    {
        let _scope = rt.enter(1).unwrap();
        let y = rt.engine(1, primary).unwrap().htod(&vec![3f32; n]).unwrap();
        let _ = rt.tx(1, &y, n).unwrap();
    }
    rt.discard_unreceived(1).unwrap();
    // Slot 0 is as captured; slot 1 of boundary 0 was reallocated.
    assert_eq!(step.launch().unwrap(), 0);
    match step.launch() {
        Err(Error::Pipeline(PpError::GraphStale { boundary: 0, slot: 1 })) => {}
        other => panic!("expected the stale graphs to be refused, got {other:?}"),
    }
    // A re-capture makes them current again.
    step.recapture(n, |stage| {
        let s = stage.stage();
        if s > 0 {
            stage.rx_into(&mut buffers.acts[s])?;
        }
        if s + 1 < rt.n_stages() {
            stage.tx(&buffers.acts[s])?;
        }
        Ok(())
    })
    .unwrap();
    step.launch().unwrap();
    rt.synchronize().unwrap();
}

/// A graph holds the memory its work touches alive, and its launch is ordered after that
/// memory's earlier writes on other streams and before its later uses.
pub fn graphs_keep_their_memory_alive_and_ordered(engine: &Engine) {
    let capture_stream = engine.stream().unwrap();
    let other = CudaStream::new(engine.context()).unwrap();
    let n = 4096;
    let mut src = CudaSlice::<u32>::alloc_persistent(&other, n).unwrap();
    let mut dst = CudaSlice::<u32>::alloc_persistent(&other, n).unwrap();
    other.memset_u32(&mut dst, 0).unwrap();
    let scratch = CudaSlice::<u32>::alloc_persistent(&other, n).unwrap();
    let capture = capture_stream.begin_capture(CaptureMode::ThreadLocal).unwrap();
    assert!(capture_stream.is_capturing());
    // cuMemAlloc cannot be captured (and would break a thread-local capture).
    match CudaSlice::<u32>::alloc_persistent(&other, n) {
        Err(CudaError::Capture(CaptureError::IllegalCall { call })) => assert!(call.contains("cuMemAlloc"), "{call}"),
        other => panic!("expected an IllegalCall error, got {other:?}"),
    }
    capture_stream.memcpy_dtod(&src, &mut dst).unwrap();
    // A buffer dropped during the capture is freed when it ends, not inside the graph.
    drop(scratch);
    match capture.end() {
        Err(CudaError::Capture(CaptureError::Invalidated { call })) => assert!(call.contains("cuMemAlloc"), "{call}"),
        other => panic!("expected the capture to be invalidated, got {other:?}"),
    }
    // A stream-ordered buffer of the capturing stream dropped during the capture: its free is held
    // back until the capture ends (a free inside the capture would break it).
    let pooled = CudaSlice::<u32>::alloc(&capture_stream, n).unwrap();
    // Likewise a pinned host buffer, whose free waits on the host.
    let pinned = PinnedHostBuffer::<u32>::new(capture_stream.context(), n, false).unwrap();
    let capture = capture_stream.begin_capture(CaptureMode::ThreadLocal).unwrap();
    capture_stream.memcpy_dtod(&src, &mut dst).unwrap();
    drop(pooled);
    drop(pinned);
    let graph = capture.end().unwrap();
    assert!(ppnrt::take_drop_errors().is_empty(), "the held-back free failed");
    assert!(!capture_stream.is_capturing());
    assert_eq!(graph.footprint_len(), 2);
    let mut exec = graph.instantiate().unwrap();
    drop(graph);
    for round in 0..3u32 {
        // Written on another stream: the launch waits for it.
        other.memset_u32(&mut src, 0x1000 + round).unwrap();
        exec.launch(&capture_stream).unwrap();
        // Read on the other stream: waits for the launch.
        let mut host = vec![0u32; n];
        other.memcpy_dtoh(&dst, &mut host).unwrap();
        assert!(host.iter().all(|&v| v == 0x1000 + round), "round {round}: the launch was not ordered");
    }
    // The graph keeps src alive: dropping the slice frees nothing the graph still uses.
    other.memset_u32(&mut src, 0x2222).unwrap();
    drop(src);
    exec.launch(&capture_stream).unwrap();
    let mut host = vec![0u32; n];
    other.memcpy_dtoh(&dst, &mut host).unwrap();
    assert!(host.iter().all(|&v| v == 0x2222));
    // Update from a re-capture of the same shape, into another destination.
    let mut dst2 = CudaSlice::<u32>::alloc_persistent(&other, n).unwrap();
    let mut src2 = CudaSlice::<u32>::alloc_persistent(&other, n).unwrap();
    other.memset_u32(&mut src2, 0x3333).unwrap();
    let capture = capture_stream.begin_capture(CaptureMode::Relaxed).unwrap();
    capture_stream.memcpy_dtod(&src2, &mut dst2).unwrap();
    let graph = capture.end().unwrap();
    exec.update(&graph).unwrap();
    exec.launch(&capture_stream).unwrap();
    other.memcpy_dtoh(&dst2, &mut host).unwrap();
    assert!(host.iter().all(|&v| v == 0x3333));
    // Another topology: refused with a typed error, the graph unchanged.
    let capture = capture_stream.begin_capture(CaptureMode::Global).unwrap();
    capture_stream.memcpy_dtod(&src2, &mut dst2).unwrap();
    capture_stream.memset_u32(&mut dst, 7).unwrap();
    let graph = capture.end().unwrap();
    match exec.update(&graph) {
        Err(CudaError::Capture(CaptureError::UpdateRefused { .. })) => {}
        other => panic!("expected UpdateRefused, got {other:?}"),
    }
    other.memset_u32(&mut src2, 0x4444).unwrap();
    exec.launch(&capture_stream).unwrap();
    other.memcpy_dtoh(&dst2, &mut host).unwrap();
    assert!(host.iter().all(|&v| v == 0x4444));
    // A capture on a stream that is capturing, and on the legacy stream, are refused.
    let capture = capture_stream.begin_capture(CaptureMode::ThreadLocal).unwrap();
    match capture_stream.begin_capture(CaptureMode::ThreadLocal) {
        Err(CudaError::Capture(CaptureError::CannotBegin { .. })) => {}
        other => panic!("expected CannotBegin, got {other:?}"),
    }
    // A graph's launch cannot be captured (the driver refuses it): refused, nothing enqueued.
    match exec.launch(&capture_stream) {
        Err(CudaError::Capture(CaptureError::IllegalCall { call })) => {
            assert!(call.contains("GraphExec::launch"), "{call}")
        }
        other => panic!("expected a launch into a capture to be refused, got {other:?}"),
    }
    // Dropping an unended capture discards it; the stream works normally afterwards.
    drop(capture);
    capture_stream.synchronize().unwrap();
    drop(exec);
    capture_stream.synchronize().unwrap();
    other.synchronize().unwrap();
}

/// One thread per stage replays its own stage's graph (`launch_stage`) for `steps` steps: the
/// outputs match the one-stage model bitwise, and the whole-step `launch` refuses to run while
/// the stages are out of step.
pub fn one_thread_per_stage_replays_graphs(primary: &Engine, devices: &[i32], slots: usize, steps: usize) {
    use std::time::Duration;
    let config = PpConfig::with_devices(devices).with_slots(slots);
    let rt = PpNRt::new(config.clone(), primary).unwrap();
    let n = 2048;
    let n_stages = rt.n_stages();
    let last = n_stages - 1;
    let mut rng = Rng::new(77);
    let inputs: Vec<Vec<f32>> = (0..steps).map(|_| rng.vec_f32(n)).collect();
    let mut buffers = StepBuffers::new(&rt, primary, n);
    let mut step = capture(&rt, primary, &mut buffers, n, slots % 2 == 0).unwrap();
    // Stage 0 alone runs ahead: the whole-step launch is refused (stages out of step).
    if n_stages > 1 {
        {
            let _scope = rt.enter(0).unwrap();
            rt.engine(0, primary).unwrap().htod_into(&inputs[0], &mut buffers.acts[0]).unwrap();
        }
        assert_eq!(step.launch_stage(0, Duration::from_secs(5)).unwrap(), 0);
        match step.launch() {
            Err(Error::Pipeline(PpError::GraphOutOfStep { .. }))
            | Err(Error::Pipeline(PpError::GraphStageOutOfStep { .. })) => {}
            other => panic!("expected the whole-step launch to be refused, got {other:?}"),
        }
    }
    let mut acts = std::mem::take(&mut buffers.acts);
    let step = &step;
    let outputs: Vec<Vec<f32>> = std::thread::scope(|scope| {
        let mut handles = Vec::new();
        for (s, x) in acts.iter_mut().enumerate() {
            let (rt, inputs) = (&rt, &inputs);
            handles.push(scope.spawn(move || {
                let engine = rt.engine(s, primary).unwrap();
                let _scope = rt.enter(s).unwrap();
                let mut outs = Vec::new();
                // Stage 0 already ran step 0 above (with more than one stage).
                let first = usize::from(s == 0 && n_stages > 1);
                for (r, input) in inputs.iter().enumerate().skip(first) {
                    if s == 0 {
                        engine.htod_into(input, x).unwrap();
                    }
                    let slot = step.launch_stage(s, Duration::from_secs(30)).unwrap();
                    assert_eq!(slot, if n_stages > 1 { r % slots } else { 0 }, "stage {s}, step {r}");
                    if s == last {
                        let mut out = engine.alloc::<f32>(n).unwrap();
                        engine.dtod(&*x, &mut out).unwrap();
                        outs.push(out);
                    }
                }
                outs.iter().map(|out| engine.dtoh(out).unwrap()).collect::<Vec<_>>()
            }));
        }
        handles.into_iter().map(|h| h.join().unwrap()).last().unwrap()
    });
    let expected = reference(primary, &inputs, |r| if n_stages > 1 { (r % slots) as u32 } else { 0 });
    assert_eq!(outputs.len(), steps);
    for (r, (got, want)) in outputs.iter().zip(&expected).enumerate() {
        assert!(same_bits(got, want), "{config}: step {r} differs");
    }
    say(&format!("one_thread_per_stage_replays_graphs: {config}, {steps} steps, bitwise identical"));
}

/// `launch_stage` refuses what it cannot run with a typed error, before anything is enqueued,
/// and loses nothing: a stage out of range, an input that never comes (timeout), an input slot an
/// eager `tx` filled with another length (the eager data still arrives whole), an output ring an
/// eager step moved. The graph work already launched still gives the reference's output.
/// `devices` must give three stages.
pub fn launch_stage_refusals_lose_nothing(primary: &Engine, devices: &[i32]) {
    use std::time::Duration;
    let rt = PpNRt::new(PpConfig::with_devices(devices).with_slots(3), primary).unwrap();
    assert_eq!(rt.n_stages(), 3, "the scenario needs three stages");
    let n = 512;
    let mut rng = Rng::new(91);
    let input = rng.vec_f32(n);
    let mut buffers = StepBuffers::new(&rt, primary, n);
    let step = capture(&rt, primary, &mut buffers, n, false).unwrap();
    let short = Duration::from_millis(50);
    match step.launch_stage(3, short) {
        Err(Error::Pipeline(PpError::StageOutOfRange { stage: 3, n_stages: 3 })) => {}
        other => panic!("expected StageOutOfRange, got {other:?}"),
    }
    // Nothing sent yet: stage 1 times out waiting for its input, and nothing moves.
    match step.launch_stage(1, short) {
        Err(Error::Pipeline(PpError::Timeout { boundary: 0, slot: 0, call: "rx", .. })) => {}
        other => panic!("expected stage 1 to time out on boundary 0, got {other:?}"),
    }
    {
        let _scope = rt.enter(0).unwrap();
        rt.engine(0, primary).unwrap().htod_into(&input, &mut buffers.acts[0]).unwrap();
    }
    assert_eq!(step.launch_stage(0, short).unwrap(), 0);
    // An eager tx of half the length fills boundary 0's next slot (1).
    let half: Vec<f32> = rng.vec_f32(n / 2);
    let eager = {
        let _scope = rt.enter(0).unwrap();
        rt.engine(0, primary).unwrap().htod(&half).unwrap()
    };
    assert_eq!(rt.tx(0, &eager, n / 2).unwrap(), 1);
    assert_eq!(step.launch_stage(1, short).unwrap(), 0);
    // Stage 1's next input is the eager one: refused by length, the slot left filled.
    match step.launch_stage(1, short) {
        Err(Error::Pipeline(PpError::RxLengthMismatch { boundary: 0, slot: 1, requested, sent }))
            if requested == n && sent == n / 2 => {}
        other => panic!("expected RxLengthMismatch on boundary 0 slot 1, got {other:?}"),
    }
    let received = {
        let _scope = rt.enter(1).unwrap();
        let y = rt.rx::<f32>(0, 1, n / 2).unwrap();
        rt.engine(1, primary).unwrap().dtoh(&y).unwrap()
    };
    assert!(same_bits(&received, &half), "the eager tx's data did not arrive whole");
    // Boundary 0's ring moved past stage 0's next slot (1): refused as out of step.
    match step.launch_stage(0, short) {
        Err(Error::Pipeline(PpError::GraphOutOfStep { boundary: 0, expected: 1, found: 2 })) => {}
        other => panic!("expected GraphOutOfStep on boundary 0, got {other:?}"),
    }
    // The graph step that did run reaches the last stage with the reference's output.
    assert_eq!(step.launch_stage(2, short).unwrap(), 0);
    let out = {
        let _scope = rt.enter(2).unwrap();
        rt.engine(2, primary).unwrap().dtoh(&buffers.acts[2]).unwrap()
    };
    let expected = reference(primary, std::slice::from_ref(&input), |_| 0);
    assert!(same_bits(&out, &expected[0]), "the graph step's output differs from the reference");
    rt.synchronize().unwrap();
    say("launch_stage_refusals_lose_nothing: out of range, timeout, length mismatch, out of step refused");
}

/// Two graphs that write one buffer, launched at once from two threads on two streams, run one
/// after the other in the order the buffer's bookkeeping records: a reader ordered after "the last
/// write" sees the value the buffer keeps once everything has completed. Returns how many rounds
/// went against the recorded order (0 when the rule holds).
pub fn graphs_launched_from_two_threads_keep_their_order(engine: &Engine, rounds: usize) -> usize {
    use std::sync::atomic::{AtomicUsize, Ordering};
    let n = 1 << 14;
    let (first, second, reader) = (
        engine.stream().unwrap(),
        CudaStream::new(engine.context()).unwrap(),
        CudaStream::new(engine.context()).unwrap(),
    );
    let mut shared = CudaSlice::<u32>::alloc_persistent(&reader, n).unwrap();
    reader.memset_u32(&mut shared, 0).unwrap();
    let mut record = |stream: &Arc<CudaStream>, value: u32| {
        let capture = stream.begin_capture(CaptureMode::ThreadLocal).unwrap();
        stream.memset_u32(&mut shared, value).unwrap();
        capture.end().unwrap().instantiate().unwrap()
    };
    let (mut writes_a, mut writes_b) = (record(&first, 0xA), record(&second, 0xB));
    let mut against = 0;
    for round in 0..rounds {
        reader.memset_u32(&mut shared, 0).unwrap();
        let ready = AtomicUsize::new(0);
        std::thread::scope(|scope| {
            for (exec, stream) in [(&mut writes_a, &first), (&mut writes_b, &second)] {
                let ready = &ready;
                scope.spawn(move || {
                    ready.fetch_add(1, Ordering::SeqCst);
                    while ready.load(Ordering::SeqCst) < 2 {
                        std::hint::spin_loop();
                    }
                    exec.launch(stream).unwrap();
                });
            }
        });
        // Ordered after the buffer's last recorded write (and so, by the rule, after both).
        let mut seen = vec![0u32; n];
        reader.memcpy_dtoh(&shared, &mut seen).unwrap();
        engine.context().synchronize().unwrap();
        let mut kept = vec![0u32; n];
        reader.memcpy_dtoh(&shared, &mut kept).unwrap();
        assert!(seen.iter().all(|&v| v == seen[0]), "round {round}: a torn read");
        assert!(seen[0] == 0xA || seen[0] == 0xB, "round {round}: read {:#x} before both writes", seen[0]);
        if seen != kept {
            against += 1;
        }
    }
    for stream in [&first, &second, &reader] {
        stream.synchronize().unwrap();
    }
    say(&format!(
        "graphs_launched_from_two_threads_keep_their_order: {rounds} races, {against} against the recorded order"
    ));
    against
}

/// Two threads that race to launch the same stage never launch it twice for one slot: each
/// `launch_stage` that succeeds has a slot of its own, and the loser of a race gets a typed error.
pub fn racing_launches_of_one_stage_never_share_a_slot(primary: &Engine, devices: &[i32], rounds: usize) {
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::time::Duration;
    let rt = PpNRt::new(PpConfig::with_devices(devices).with_slots(2), primary).unwrap();
    assert_eq!(rt.n_stages(), 2, "the scenario needs two stages");
    let n = 256;
    let mut buffers = StepBuffers::new(&rt, primary, n);
    let step = capture(&rt, primary, &mut buffers, n, false).unwrap();
    let mut both = 0;
    for round in 0..rounds {
        // Both racers spin until both are running, then launch at once.
        let ready = AtomicUsize::new(0);
        let results: Vec<Result<usize, Error>> = std::thread::scope(|scope| {
            let racers: Vec<_> = (0..2)
                .map(|_| {
                    scope.spawn(|| {
                        ready.fetch_add(1, Ordering::SeqCst);
                        while ready.load(Ordering::SeqCst) < 2 {
                            std::hint::spin_loop();
                        }
                        step.launch_stage(0, Duration::from_millis(2))
                    })
                })
                .collect();
            racers.into_iter().map(|racer| racer.join().unwrap()).collect()
        });
        let mut slots: Vec<usize> = results.iter().filter_map(|result| result.as_ref().ok().copied()).collect();
        assert!(!slots.is_empty(), "round {round}: neither launch ran: {results:?}");
        for result in &results {
            match result {
                Ok(_)
                | Err(Error::Pipeline(PpError::GraphOutOfStep { .. }))
                | Err(Error::Pipeline(PpError::SlotState { .. }))
                | Err(Error::Pipeline(PpError::Timeout { .. })) => {}
                Err(other) => panic!("round {round}: unexpected error {other:?}"),
            }
        }
        slots.sort_unstable();
        slots.dedup();
        let succeeded = results.iter().filter(|result| result.is_ok()).count();
        assert_eq!(slots.len(), succeeded, "round {round}: two launches of stage 0 on one slot: {results:?}");
        both += usize::from(succeeded == 2);
        // Stage 1 receives what stage 0 sent, in slot order.
        for _ in 0..succeeded {
            step.launch_stage(1, Duration::from_secs(5)).unwrap();
        }
    }
    rt.synchronize().unwrap();
    say(&format!(
        "racing_launches_of_one_stage_never_share_a_slot: {rounds} races, {both} with both launches on their own slots"
    ));
}

/// How one step of a random schedule runs.
#[derive(Debug, Clone, Copy)]
pub enum StepKind {
    /// `rx` / layers / `tx`, stage by stage.
    Eager,
    /// `StepGraphs::launch`.
    Graph,
    /// `StepGraphs::launch_stage` for each stage in turn.
    StageByStage,
    /// An eager step, with a whole-step `StepGraphs::launch` tried when it is half-way (boundary
    /// 0 crossed, not received): refused, since it would overtake the eager step (a slot still
    /// filled) or the rings stand apart (out of step), and changing nothing.
    Interrupted,
}

/// Runs `kinds` as consecutive steps through `config` and checks every step's output against the
/// one-stage model with the same step parameters (the slot each step used).
pub fn random_schedule_matches(primary: &Engine, config: PpConfig, kinds: &[StepKind], seed: u64) {
    use std::time::Duration;
    let rt = PpNRt::new(config.clone(), primary).unwrap();
    let n = 512;
    let n_stages = rt.n_stages();
    let last = n_stages - 1;
    let mut rng = Rng::new(seed);
    let inputs: Vec<Vec<f32>> = kinds.iter().map(|_| rng.vec_f32(n)).collect();
    let mut buffers = StepBuffers::new(&rt, primary, n);
    let mut step = capture(&rt, primary, &mut buffers, n, seed % 2 == 0).unwrap();
    let last_engine = rt.engine(last, primary).unwrap();
    let mut outputs = Vec::new();
    let mut params = Vec::new();
    for (r, kind) in kinds.iter().enumerate() {
        // The slot this step uses: the rings' next (every ring is there between steps).
        let slot = if n_stages > 1 { r % rt.n_slots() } else { 0 };
        params.push(slot as u32);
        match kind {
            StepKind::Eager => outputs.push(eager_step(&rt, primary, &inputs[r], slot as u32)),
            StepKind::Interrupted => {
                let half_way = || match step.launch() {
                    Err(Error::Pipeline(PpError::SlotState {
                        boundary: 0, found: SlotState::Filled { .. }, ..
                    })) => {}
                    Err(Error::Pipeline(PpError::GraphOutOfStep { boundary: 1, .. })) if n_stages > 2 => {}
                    other => panic!("{config}: step {r}: a graph launch with an eager step half-way gave {other:?}"),
                };
                outputs.push(eager_step_with(&rt, primary, &inputs[r], slot as u32, half_way));
            }
            StepKind::Graph | StepKind::StageByStage => {
                {
                    let _scope = rt.enter(0).unwrap();
                    rt.engine(0, primary).unwrap().htod_into(&inputs[r], &mut buffers.acts[0]).unwrap();
                }
                if matches!(kind, StepKind::Graph) {
                    assert_eq!(step.launch().unwrap(), slot, "{config}: step {r}");
                } else {
                    for s in 0..n_stages {
                        assert_eq!(step.launch_stage(s, Duration::from_secs(5)).unwrap(), slot, "{config}: step {r}");
                    }
                }
                let _scope = rt.enter(last).unwrap();
                let mut out = last_engine.alloc::<f32>(n).unwrap();
                last_engine.dtod(&buffers.acts[last], &mut out).unwrap();
                outputs.push(out);
            }
        }
    }
    let expected = reference(primary, &inputs, |r| params[r]);
    let _scope = rt.enter(last).unwrap();
    for (r, out) in outputs.iter().enumerate() {
        let got = last_engine.dtoh(out).unwrap();
        assert!(same_bits(&got, &expected[r]), "{config}: step {r} ({:?}) of {kinds:?} differs", kinds[r]);
    }
}

/// Attacks on the graph layer: an executable graph and its memory dropped right after a launch
/// (nothing freed under the run); a capture body that panics (the stream stops capturing and the
/// slots come back); a global capture refuses other threads' synchronising calls while it lasts.
pub fn graph_misuse_leaves_everything_sound(primary: &Engine, devices: &[i32]) {
    // Dropped right after the launch: the frees wait for the run.
    let stream = primary.stream().unwrap();
    let other = CudaStream::new(primary.context()).unwrap();
    let n = 1 << 14;
    let mut src = CudaSlice::<u32>::alloc_persistent(&other, n).unwrap();
    let mut dst = CudaSlice::<u32>::alloc(&other, n).unwrap();
    other.memset_u32(&mut src, 0x5a5a).unwrap();
    other.memset_u32(&mut dst, 0).unwrap();
    let recording = stream.begin_capture(CaptureMode::ThreadLocal).unwrap();
    stream.memcpy_dtod(&src, &mut dst).unwrap();
    let mut exec = recording.end().unwrap().instantiate().unwrap();
    exec.launch(&stream).unwrap();
    drop(exec);
    drop(src);
    drop(dst);
    stream.synchronize().unwrap();
    other.synchronize().unwrap();
    assert!(ppnrt::take_drop_errors().is_empty());

    // A panicking capture body: nothing stays captured or taken.
    let rt = PpNRt::new(PpConfig::with_devices(devices).with_slots(2), primary).unwrap();
    let mut buffers = StepBuffers::new(&rt, primary, 256);
    let panicked = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        let _ = rt.capture_step::<f32>(256, |stage| {
            if stage.stage() + 1 == rt.n_stages() {
                panic!("the engine's code panicked during the capture");
            }
            stage.tx(&buffers.acts[stage.stage()])
        });
    }));
    assert!(panicked.is_err());
    for s in 0..rt.n_stages() {
        assert!(!rt.stage_stream(s).unwrap().is_capturing(), "stage {s} still capturing after a panic");
    }
    // The runtime works on: an eager step, then a capture and a graph step.
    let input: Vec<f32> = (0..256).map(|i| i as f32).collect();
    let out = eager_step(&rt, primary, &input, 0);
    drop(out);
    let mut step = capture(&rt, primary, &mut buffers, 256, false).unwrap();
    step.launch().unwrap();
    rt.synchronize().unwrap();

    // A global capture refuses another thread's synchronisation while it lasts, and only then.
    let recording = stream.begin_capture(CaptureMode::Global).unwrap();
    let refused = std::thread::scope(|scope| scope.spawn(|| other.synchronize()).join().unwrap());
    match refused {
        Err(CudaError::Capture(CaptureError::IllegalCall { call })) => assert_eq!(call, "CudaStream::synchronize"),
        other => panic!("expected the global capture to refuse another thread's sync, got {other:?}"),
    }
    assert!(matches!(recording.end(), Err(CudaError::Capture(CaptureError::Invalidated { .. }))));
    std::thread::scope(|scope| scope.spawn(|| other.synchronize()).join().unwrap()).unwrap();
    // A thread-local capture does not restrict other threads.
    let recording = stream.begin_capture(CaptureMode::ThreadLocal).unwrap();
    std::thread::scope(|scope| scope.spawn(|| other.synchronize()).join().unwrap()).unwrap();
    recording.end().unwrap();
}
