//! The fault sweeps of a graph step and of a capture: every driver call fails in turn.

use super::*;

/// How one graph step of the graph fault sweep ended.
#[derive(Debug)]
pub(crate) enum GraphSwept {
    /// Every call succeeded: the slot the step used and the last stage's values read back.
    Delivered(usize, Vec<f32>),
    /// Writing the step's input failed: nothing was launched.
    NotLaunched(Error),
    /// The launch failed: some stages may have run.
    LaunchFailed(Error),
    /// The step ran (in slot `.0`); copying its output out or reading it back failed.
    NotReadBack(usize, Error),
}

/// The last stage's activations, copied out on its stream and read back.
pub(crate) fn read_last_stage(
    rt: &PpNRt,
    primary: &Engine,
    buffers: &graphs::StepBuffers,
    n: usize,
) -> ppnrt::Result<Vec<f32>> {
    let last = rt.n_stages() - 1;
    let engine = rt.engine(last, primary)?;
    let _stage = rt.enter(last)?;
    let mut out = engine.alloc::<f32>(n)?;
    engine.dtod(&buffers.acts[last], &mut out)?;
    Ok(rt.readback(out)?.wait()?.to_vec())
}

/// One graph step: the input written into stage 0's activations, the step launched, the last
/// stage's activations read back.
pub(crate) fn graph_sweep_step(
    rt: &PpNRt,
    primary: &Engine,
    step: &mut ppnrt::StepGraphs<'_, f32>,
    buffers: &mut graphs::StepBuffers,
    input: &[f32],
) -> GraphSwept {
    let e0 = rt.engine(0, primary).unwrap();
    if let Err(e) = rt.enter(0).and_then(|_stage| Ok(e0.htod_into(input, &mut buffers.acts[0])?)) {
        return GraphSwept::NotLaunched(e);
    }
    let slot = match step.launch() {
        Ok(slot) => slot,
        Err(e) => return GraphSwept::LaunchFailed(e),
    };
    match read_last_stage(rt, primary, buffers, input.len()) {
        Ok(values) => GraphSwept::Delivered(slot, values),
        Err(e) => GraphSwept::NotReadBack(slot, e),
    }
}

/// The fault sweep in graph mode: every driver call of a warm graph step (the input's copy, each
/// stage's graph launch with the protocol's waits and records, the copy out and readback) is
/// failed in turn, one per run: two stages on two GPUs and on one, four stages alternating over
/// two GPUs, the slot copied or read in place. Whatever call fails, the step returns a typed error
/// naming it, or delivers the right values.
/// A failed launch is finished as documented on [`StepGraphs::launch`](ppnrt::StepGraphs::launch):
/// `launch` again, and where it answers that a stage is behind, `launch_stage` of that stage and
/// of each later one;
/// the step then delivers its values, bitwise, and so do the next ones. No queued work touches
/// freed memory, through the runtime's drop too.
#[test]
fn every_failing_driver_call_of_a_graph_step_is_an_error_that_loses_nothing() {
    with_double("every_failing_driver_call_of_a_graph_step_is_an_error_that_loses_nothing", |double| {
        const WARM: usize = 3;
        const AFTER: usize = 3;
        let n = 1024;
        let primary = Engine::new(0).unwrap();
        let inputs: Vec<Vec<f32>> = (0..WARM + 1 + AFTER)
            .map(|t| (0..n).map(|i| ((i * 7 + t * 13) % 101) as f32 * 0.125 - 3.0).collect())
            .collect();
        // The model's output for input t run with step parameter (slot) k: expected[k][t].
        let expected: Vec<Vec<Vec<f32>>> = (0..2).map(|k| graphs::reference(&primary, &inputs, |_| k)).collect();
        let same =
            |a: &[f32], b: &[f32]| a.len() == b.len() && a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits());
        let mut cases = 0;
        let mut finished_by_stage = 0;
        for devices in [&[0, 1][..], &[0, 0], &[0, 1, 0, 1]] {
            for in_place in [false, true] {
                let what = format!("graph mode {devices:?}{}", if in_place { " in place" } else { "" });
                let config = PpConfig::with_devices(devices).with_slots(2);
                let run =
                    |check_calls: &mut dyn FnMut(&PpNRt, &mut ppnrt::StepGraphs<'_, f32>, &mut graphs::StepBuffers)| {
                        let rt = PpNRt::new(config.clone(), &primary).unwrap();
                        let mut buffers = graphs::StepBuffers::new(&rt, &primary, n);
                        let mut step = graphs::capture(&rt, &primary, &mut buffers, n, in_place).unwrap();
                        for (t, input) in inputs.iter().enumerate().take(WARM) {
                            match graph_sweep_step(&rt, &primary, &mut step, &mut buffers, input) {
                                GraphSwept::Delivered(k, values) => {
                                    assert!(same(&values, &expected[k][t]), "{what}: warm step {t}")
                                }
                                other => panic!("{what}: warm step {t}: {other:?}"),
                            }
                        }
                        double.flush();
                        raw!(cuCtxSetCurrent(std::ptr::null_mut()));
                        check_calls(&rt, &mut step, &mut buffers);
                        drop(step);
                        drop(buffers);
                        drop(rt);
                    };
                // The driver calls of one warm graph step, per entry point.
                let mut calls: Vec<(String, u64)> = Vec::new();
                run(&mut |rt, step, buffers| {
                    let mut swept = None;
                    calls = double
                        .calls_made_by(|| swept = Some(graph_sweep_step(rt, &primary, step, buffers, &inputs[WARM])));
                    assert!(matches!(swept, Some(GraphSwept::Delivered(..))), "{what}: {swept:?}");
                });
                assert!(calls.iter().any(|(entry, _)| entry == "cuGraphLaunch"), "{what}: {calls:?}");
                cases += sweep_calls(double, &calls, &what, |injected| {
                    let case = injected.case.clone();
                    run(&mut |rt, step, buffers| {
                        injected.arm();
                        let swept = graph_sweep_step(rt, &primary, step, buffers, &inputs[WARM]);
                        injected.disarm();
                        let named = |e: &Error| injected.assert_named(e);
                        let (slot, values) = match swept {
                            GraphSwept::Delivered(slot, values) => (slot, values),
                            GraphSwept::NotReadBack(slot, e) => {
                                named(&e);
                                (slot, read_last_stage(rt, &primary, buffers, n).unwrap())
                            }
                            GraphSwept::NotLaunched(e) | GraphSwept::LaunchFailed(e) => {
                                named(&e);
                                // Finished as documented: the input again, then `launch`; a
                                // stage left behind is launched alone.
                                match graph_sweep_step(rt, &primary, step, buffers, &inputs[WARM]) {
                                    GraphSwept::Delivered(slot, values) => (slot, values),
                                    GraphSwept::LaunchFailed(Error::Pipeline(
                                        ppnrt::PpError::GraphStageOutOfStep { stage, .. },
                                    )) => {
                                        // That stage, then each later one.
                                        let mut slot = 0;
                                        for behind in stage..rt.n_stages() {
                                            slot = step
                                                .launch_stage(behind, std::time::Duration::from_secs(1))
                                                .unwrap_or_else(|e| {
                                                    panic!("{case}: stage {behind} could not catch up: {e}")
                                                });
                                        }
                                        finished_by_stage += 1;
                                        (slot, read_last_stage(rt, &primary, buffers, n).unwrap())
                                    }
                                    other => panic!("{case}: the step could not be finished: {other:?}"),
                                }
                            }
                        };
                        assert!(same(&values, &expected[slot][WARM]), "{case}: wrong values (slot {slot})");
                        for (t, input) in inputs.iter().enumerate().skip(WARM + 1) {
                            match graph_sweep_step(rt, &primary, step, buffers, input) {
                                GraphSwept::Delivered(k, values) => {
                                    assert!(same(&values, &expected[k][t]), "{case}: step {t} wrong")
                                }
                                other => panic!("{case}: step {t} after the failure: {other:?}"),
                            }
                        }
                    });
                });
            }
        }
        println!(
            "graph fault sweep: {cases} runs, each with one failing driver call; {finished_by_stage} finished by launch_stage"
        );
    });
}

/// Bitwise equality of two runs of the toy model.
pub(crate) fn same_f32_bits(a: &[f32], b: &[f32]) -> bool {
    a.len() == b.len() && a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits())
}

/// The toy model's inputs, and its outputs for each: `outputs[k][t]` is input t's run with step
/// parameter (slot) k.
#[derive(Clone, Copy)]
pub(crate) struct ToyRuns<'a> {
    pub(crate) inputs: &'a [Vec<f32>],
    pub(crate) outputs: &'a [Vec<Vec<f32>>],
}

/// Graph steps `steps` of the inputs, each bitwise the model's output for its slot.
pub(crate) fn graph_steps_deliver(
    rt: &PpNRt,
    primary: &Engine,
    step: &mut ppnrt::StepGraphs<'_, f32>,
    buffers: &mut graphs::StepBuffers,
    runs: ToyRuns<'_>,
    steps: std::ops::Range<usize>,
    case: &str,
) {
    for t in steps {
        match graph_sweep_step(rt, primary, step, buffers, &runs.inputs[t]) {
            GraphSwept::Delivered(k, values) => {
                assert!(same_f32_bits(&values, &runs.outputs[k][t]), "{case}: graph step {t}")
            }
            other => panic!("{case}: graph step {t}: {other:?}"),
        }
    }
}

/// An eager step of `inputs[t]` (step parameter 0), bitwise the model's output.
pub(crate) fn eager_step_delivers(rt: &PpNRt, primary: &Engine, runs: ToyRuns<'_>, t: usize, case: &str) {
    let out = graphs::eager_step(rt, primary, &runs.inputs[t], 0);
    let last = rt.n_stages() - 1;
    let _stage = rt.enter(last).unwrap();
    let values = rt.engine(last, primary).unwrap().dtoh(&out).unwrap();
    assert!(same_f32_bits(&values, &runs.outputs[0][t]), "{case}: eager step {t}");
}

/// What the capture sweep captures: the pipeline, whether a stage reads its slot in place, and
/// whether the capture swept is a re-capture of graphs already launched.
pub(crate) struct CaptureSetup {
    pub(crate) config: PpConfig,
    pub(crate) in_place: bool,
    pub(crate) recapturing: bool,
}

/// One run of the capture sweep: a warm runtime (eager steps, and for a re-capture a capture
/// and graph steps), then the capture or re-capture with `fault` injected, then the checks.
/// Returns the driver calls the capture made.
pub(crate) fn capture_sweep_run(
    double: &double::Double,
    primary: &Engine,
    setup: &CaptureSetup,
    runs: ToyRuns<'_>,
    mut fault: Option<&mut Injected<'_>>,
    case: &str,
) -> Vec<(String, u64)> {
    let CaptureSetup { config, in_place, recapturing } = setup;
    let (in_place, recapturing) = (*in_place, *recapturing);
    let n = runs.inputs[0].len();
    let rt = PpNRt::new(config.clone(), primary).unwrap();
    let mut buffers = graphs::StepBuffers::new(&rt, primary, n);
    eager_step_delivers(&rt, primary, runs, 0, case);
    let mut step = if recapturing {
        let mut step = graphs::capture(&rt, primary, &mut buffers, n, in_place).unwrap();
        graph_steps_deliver(&rt, primary, &mut step, &mut buffers, runs, 1..3, case);
        Some(step)
    } else {
        None
    };
    double.flush();
    raw!(cuCtxSetCurrent(std::ptr::null_mut()));
    if let Some(injected) = fault.as_deref_mut() {
        injected.arm();
    }
    let mut captured = None;
    let calls = double.calls_made_by(|| {
        captured = Some(match step.as_mut() {
            Some(step) => graphs::recapture(step, &rt, primary, &mut buffers, n, in_place).map(|()| None),
            None => graphs::capture(&rt, primary, &mut buffers, n, in_place).map(Some),
        });
    });
    if let Some(injected) = fault {
        let recorded = injected.disarm();
        if captured.as_ref().is_some_and(Result::is_ok) {
            // A failure the capture got over is recorded.
            assert!(recorded.iter().any(|e| injected.names(e)), "{case}: unreported: {recorded:?}");
        }
    }
    match captured.expect("ran above") {
        Ok(Some(fresh)) => step = Some(fresh),
        Ok(None) => {}
        Err(e) => {
            assert!(
                matches!(e, Error::Cuda(CudaError::Driver(_)) | Error::Cuda(CudaError::Capture(_))),
                "{case}: not a driver or capture error: {e}"
            );
            // The runtime stays usable: an eager step delivers (no stream is left capturing).
            eager_step_delivers(&rt, primary, runs, 3, case);
            if step.is_none() {
                step = Some(graphs::capture(&rt, primary, &mut buffers, n, in_place).unwrap());
            }
        }
    }
    let step_ref = step.as_mut().expect("captured above");
    // The graphs as they are now: the old ones, new ones, or stale until captured again.
    if let GraphSwept::LaunchFailed(Error::Pipeline(ppnrt::PpError::GraphStale { .. })) =
        graph_sweep_step(&rt, primary, step_ref, &mut buffers, &runs.inputs[4])
    {
        graphs::recapture(step_ref, &rt, primary, &mut buffers, n, in_place).unwrap();
        graph_steps_deliver(&rt, primary, step_ref, &mut buffers, runs, 4..5, case);
    }
    graph_steps_deliver(&rt, primary, step_ref, &mut buffers, runs, 5..7, case);
    eager_step_delivers(&rt, primary, runs, 7, case);
    drop(step);
    drop(buffers);
    drop(rt);
    calls
}

/// The fault sweep of captures: every driver call of a first capture (`capture_step`) and of a
/// re-capture (`recapture`) of a warm pipeline is failed in turn, one per run, on two devices
/// and on one, the slot copied or read in place. A failed capture is a typed error and leaves
/// the runtime usable (an eager step delivers: no stream is left capturing) and, for a
/// re-capture, the graphs as `recapture` documents (the old ones, or stale until captured
/// again); every later graph and eager step delivers bitwise; no queued work touches freed
/// memory.
#[test]
fn every_failing_driver_call_of_a_capture_is_an_error_that_loses_nothing() {
    with_double("every_failing_driver_call_of_a_capture_is_an_error_that_loses_nothing", |double| {
        let n = 1024;
        let primary = Engine::new(0).unwrap();
        let inputs: Vec<Vec<f32>> =
            (0..8).map(|t| (0..n).map(|i| ((i * 5 + t * 17) % 97) as f32 * 0.25 - 7.0).collect()).collect();
        let expected: Vec<Vec<Vec<f32>>> = (0..2).map(|k| graphs::reference(&primary, &inputs, |_| k)).collect();
        let runs = ToyRuns { inputs: &inputs, outputs: &expected };
        let mut cases = 0;
        for devices in [[0, 1], [0, 0]] {
            for in_place in [false, true] {
                for recapturing in [false, true] {
                    let setup =
                        CaptureSetup { config: PpConfig::with_devices(&devices).with_slots(2), in_place, recapturing };
                    let what = format!(
                        "{} {devices:?}{}",
                        if recapturing { "re-capture" } else { "capture" },
                        if in_place { " in place" } else { "" }
                    );
                    // Counted on a second run: the first may make one-time calls (a module's load,
                    // peer access) that later runs do not.
                    let counted = || capture_sweep_run(double, &primary, &setup, runs, None, &what);
                    counted();
                    let calls = counted();
                    assert!(calls.iter().any(|(entry, _)| entry == "cuStreamBeginCapture_v2"), "{what}: {calls:?}");
                    cases += sweep_calls(double, &calls, &what, |injected| {
                        let case = injected.case.clone();
                        capture_sweep_run(double, &primary, &setup, runs, Some(injected), &case);
                    });
                }
            }
        }
        println!("capture fault sweep: {cases} runs, each with one failing driver call");
    });
}
