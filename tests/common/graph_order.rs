//! Graph steps and eager steps left half-way, shared by `tests/gpu/graphs_on_gpu.rs` (GPU) and the driver
//! double's graph tests: a graph step never overtakes an eager step not received yet (both
//! launches refuse it, before anything is enqueued), and a capture refuses rings that stand at
//! different slots, naming each, until the eager step is finished.
#![allow(dead_code, unreachable_pub)]

use crate::common::{Rng, say};
use crate::graphs::{StepBuffers, capture, layers_of, reference};
use ppnrt::{CudaSlice, Engine, Error, PpConfig, PpError, PpNRt, SlotState};

fn same_bits(a: &[f32], b: &[f32]) -> bool {
    a.len() == b.len() && a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits())
}

/// Stage 0's half of an eager step of the toy model (step parameter `param`): its layers on
/// `input`, then its `tx`; returns the slot.
fn eager_first_half(rt: &PpNRt, primary: &Engine, input: &[f32], param: u32) -> usize {
    let engine = rt.engine(0, primary).unwrap();
    let _scope = rt.enter(0).unwrap();
    let mut x = engine.htod(input).unwrap();
    for layer in layers_of(0, rt.n_stages()) {
        engine.toy_layer(&mut x, param, layer).unwrap();
    }
    rt.tx(0, &x, input.len()).unwrap()
}

/// The rest of an eager step whose boundary 0 was crossed into `slot`: every later stage
/// receives, runs its layers and sends; returns the last stage's output.
fn eager_rest(rt: &PpNRt, primary: &Engine, slot: usize, n: usize, param: u32) -> CudaSlice<f32> {
    let n_stages = rt.n_stages();
    let mut slot = slot;
    for s in 1..n_stages {
        let engine = rt.engine(s, primary).unwrap();
        let _scope = rt.enter(s).unwrap();
        let mut y = rt.rx::<f32>(s - 1, slot, n).unwrap();
        for layer in layers_of(s, n_stages) {
            engine.toy_layer(&mut y, param, layer).unwrap();
        }
        if s + 1 == n_stages {
            return y;
        }
        slot = rt.tx(s, &y, n).unwrap();
    }
    unreachable!("a pipeline of two stages or more")
}

/// Writes `input` where stage 0's graph finds it.
fn graph_input(rt: &PpNRt, primary: &Engine, buffers: &mut StepBuffers, input: &[f32]) {
    let _scope = rt.enter(0).unwrap();
    rt.engine(0, primary).unwrap().htod_into(input, &mut buffers.acts[0]).unwrap();
}

/// The last stage's activations, read now.
fn last_output(rt: &PpNRt, primary: &Engine, buffers: &StepBuffers) -> Vec<f32> {
    let last = rt.n_stages() - 1;
    let _scope = rt.enter(last).unwrap();
    rt.engine(last, primary).unwrap().dtoh(&buffers.acts[last]).unwrap()
}

/// Two stages (one boundary of two slots): a graph step, then an eager step left half-way (its
/// `tx` into slot 1, not received). A whole-step `launch` would overtake it (stage 0's graph
/// fills slot 0, stage 1's reads it first): refused with the eager slot's state, nothing
/// enqueued. Once the eager step is received, the graph step runs. The same with
/// `launch_stage`: stage 0's graph may run ahead, but stage 1's is refused until the eager step
/// is received. Every step's output is the one-stage model's, in the order sent.
pub fn a_graph_step_never_overtakes_an_unreceived_eager_step(primary: &Engine, devices: &[i32]) {
    use std::time::Duration;
    let rt = PpNRt::new(PpConfig::with_devices(devices).with_slots(2), primary).unwrap();
    assert_eq!(rt.n_stages(), 2, "the scenario needs two stages");
    let n = 512;
    let mut rng = Rng::new(15);
    let inputs: Vec<Vec<f32>> = (0..5).map(|_| rng.vec_f32(n)).collect();
    // Step r's parameter is the slot it crosses in.
    let expected = reference(primary, &inputs, |r| (r % 2) as u32);
    let mut buffers = StepBuffers::new(&rt, primary, n);
    let mut step = capture(&rt, primary, &mut buffers, n, false).unwrap();
    let last = rt.engine(1, primary).unwrap();
    let mut outputs = Vec::new();

    // Step 0 as a graph (slot 0); step 1 eager, half-way (slot 1).
    graph_input(&rt, primary, &mut buffers, &inputs[0]);
    assert_eq!(step.launch().unwrap(), 0);
    outputs.push(last_output(&rt, primary, &buffers));
    assert_eq!(eager_first_half(&rt, primary, &inputs[1], 1), 1);
    // Step 2 as a whole graph step would overtake step 1.
    graph_input(&rt, primary, &mut buffers, &inputs[2]);
    match step.launch() {
        Err(Error::Pipeline(PpError::SlotState {
            boundary: 0,
            slot: 1,
            call: "StepGraphs::launch",
            found: SlotState::Filled { n: sent, elem: "f32" },
            ..
        })) if sent == n => {}
        other => panic!("expected the launch refused for the unreceived eager step in slot 1, got {other:?}"),
    }
    assert!(same_bits(&last_output(&rt, primary, &buffers), &outputs[0]), "the refused launch ran a stage");
    let out = eager_rest(&rt, primary, 1, n, 1);
    outputs.push(last.dtoh(&out).unwrap());
    assert_eq!(step.launch().unwrap(), 0);
    outputs.push(last_output(&rt, primary, &buffers));

    // Step 3 eager, half-way again (slot 1); step 4 stage by stage.
    assert_eq!(eager_first_half(&rt, primary, &inputs[3], 1), 1);
    graph_input(&rt, primary, &mut buffers, &inputs[4]);
    let short = Duration::from_millis(50);
    assert_eq!(step.launch_stage(0, short).unwrap(), 0, "stage 0 runs ahead into slot 0");
    match step.launch_stage(1, short) {
        Err(Error::Pipeline(PpError::SlotState {
            boundary: 0,
            slot: 1,
            call: "StepGraphs::launch_stage",
            found: SlotState::Filled { .. },
            ..
        })) => {}
        other => panic!("expected stage 1's launch refused for the unreceived eager step in slot 1, got {other:?}"),
    }
    assert!(same_bits(&last_output(&rt, primary, &buffers), &outputs[2]), "the refused launch ran stage 1");
    let out = eager_rest(&rt, primary, 1, n, 1);
    outputs.push(last.dtoh(&out).unwrap());
    assert_eq!(step.launch_stage(1, short).unwrap(), 0);
    outputs.push(last_output(&rt, primary, &buffers));

    for (r, (got, want)) in outputs.iter().zip(&expected).enumerate() {
        assert!(same_bits(got, want), "{devices:?}: step {r} differs from the one-stage model");
    }
    rt.synchronize().unwrap();
    say("a graph step never overtakes an unreceived eager step: launch and launch_stage refused, steps in order");
}

/// Three stages: one `tx` and `rx` more on boundary 0 than on boundary 1 (an eager step
/// crossed only the first boundary), so the rings stand at slots 1 and 0. `capture_step` is
/// refused, naming each ring's slot and how to get back in step, and takes nothing; after the
/// eager step is finished (its `tx` and `rx` on boundary 1) the capture succeeds and its graph
/// steps give the one-stage model's output.
pub fn a_capture_refuses_rings_out_of_step(primary: &Engine, devices: &[i32]) {
    let rt = PpNRt::new(PpConfig::with_devices(devices).with_slots(2), primary).unwrap();
    assert_eq!(rt.n_stages(), 3, "the scenario needs three stages");
    let n = 512;
    let mut rng = Rng::new(16);
    let inputs: Vec<Vec<f32>> = (0..3).map(|_| rng.vec_f32(n)).collect();
    let expected = reference(primary, &inputs, |r| (r % 2) as u32);
    let mut buffers = StepBuffers::new(&rt, primary, n);
    let last = rt.engine(2, primary).unwrap();
    // Step 0 eager, boundary 0 crossed and received, boundary 1 not yet.
    let slot = eager_first_half(&rt, primary, &inputs[0], 0);
    let engine1 = rt.engine(1, primary).unwrap();
    let mut y = {
        let _scope = rt.enter(1).unwrap();
        rt.rx::<f32>(0, slot, n).unwrap()
    };
    let err = match capture(&rt, primary, &mut buffers, n, false) {
        Err(err) => err,
        Ok(_) => panic!("a capture of rings out of step was accepted"),
    };
    match &err {
        Error::Pipeline(PpError::CaptureOutOfStep { rings }) if rings == &[(0, 1), (1, 0)] => {}
        other => panic!("expected CaptureOutOfStep naming both rings, got {other:?}"),
    }
    let text = err.to_string();
    for part in ["boundary 0 at slot 1", "boundary 1 at slot 0", "`tx` and its `rx`", "capture again"] {
        assert!(text.contains(part), "the refusal does not say `{part}`: {text}");
    }
    // Nothing was taken: the eager step finishes as it would have.
    let slot = {
        let _scope = rt.enter(1).unwrap();
        for layer in layers_of(1, 3) {
            engine1.toy_layer(&mut y, 0, layer).unwrap();
        }
        rt.tx(1, &y, n).unwrap()
    };
    let out = {
        let _scope = rt.enter(2).unwrap();
        let mut z = rt.rx::<f32>(1, slot, n).unwrap();
        for layer in layers_of(2, 3) {
            last.toy_layer(&mut z, 0, layer).unwrap();
        }
        last.dtoh(&z).unwrap()
    };
    assert!(same_bits(&out, &expected[0]), "the eager step after the refused capture");
    // In step again: the capture succeeds and its steps run from slot 1.
    let mut step = capture(&rt, primary, &mut buffers, n, false).unwrap();
    for (r, input) in inputs.iter().enumerate().skip(1) {
        graph_input(&rt, primary, &mut buffers, input);
        assert_eq!(step.launch().unwrap(), r % 2);
        assert!(same_bits(&last_output(&rt, primary, &buffers), &expected[r]), "graph step {r}");
    }
    rt.synchronize().unwrap();
    say("a capture of rings out of step is refused, naming each ring's slot; in step again, it succeeds");
}
