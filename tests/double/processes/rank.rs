//! What a rank does in its child process: the modes `child_rank` runs (the pipeline, graph
//! steps, the contract, slow posts, captures while a slot grows, a killed peer).

use super::*;

pub(crate) fn unix_ms() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).unwrap().as_millis() as u64
}

/// The step this rank's loop is at (its stage threads' furthest), for [`report_a_stall`].
pub(crate) static AT_STEP: AtomicU64 = AtomicU64::new(0);

pub(crate) fn at_step(t: u64) {
    AT_STEP.fetch_max(t, Ordering::Relaxed);
}

/// Sets its flag when dropped.
pub(crate) struct SetOnDrop<'a>(pub(crate) &'a AtomicBool);

impl Drop for SetOnDrop<'_> {
    fn drop(&mut self) {
        self.0.store(true, Ordering::Relaxed);
    }
}

/// Prints, once, where this rank stands when its loop has not moved for `after` (set a little
/// before the harness dumps the ranks' threads, see [`stall_dump_after`]): the step and each
/// receiver thread's state, so that a stalled launch's output says which step each side waits
/// for.
pub(crate) fn report_a_stall(rt: &PpNRt, finished: &AtomicBool, after: Duration) {
    let mut seen = (AT_STEP.load(Ordering::Relaxed), Instant::now());
    while !finished.load(Ordering::Relaxed) {
        std::thread::sleep(Duration::from_millis(100));
        let now = AT_STEP.load(Ordering::Relaxed);
        if now != seen.0 {
            seen = (now, Instant::now());
        } else if seen.1.elapsed() >= after {
            let receivers: Vec<String> = (0..rt.n_boundaries())
                .filter_map(|b| Some(format!("boundary {b}: {}", rt.receiver_state(b).ok()??)))
                .collect();
            println!(
                "CHILD-STALLED rank {} at step {now} for {:?}: receiver threads {receivers:?}",
                rt.rank(),
                seen.1.elapsed()
            );
            return;
        }
    }
}

pub(crate) fn run_mode(mode: &str, rt: &PpNRt, primary: &Engine, seed: u64, steps: u64, dir: &Path) {
    match mode {
        "pipeline" => run_pipeline(rt, primary, seed, steps, dir),
        "graphs" => run_graphs(rt, primary, seed, steps, dir, GraphDriver::Launch),
        "graphs-interleaved" => run_graphs(rt, primary, seed, steps, dir, GraphDriver::Interleaved),
        "graphs-threads" => run_graphs(rt, primary, seed, steps, dir, GraphDriver::ThreadPerStage),
        "graph-order" => graph_order(rt, primary),
        "contract" => contract(rt, primary),
        "slow-post" => slow_post(rt, primary),
        "grow-in-capture" => grow_in_capture(rt, primary, dir),
        "kill" => survive_a_kill(rt, primary, seed, dir),
        other => panic!("unknown mode {other}"),
    }
}

/// One step of this rank's stages; returns the last stage's output when this rank runs it.
pub(crate) fn step(rt: &PpNRt, primary: &Engine, seed: u64, t: u64) -> Result<Option<ppnrt::CudaSlice<f32>>, Error> {
    at_step(t);
    let n_stages = rt.n_stages();
    let n = length_of(seed, t);
    let slot = (t % rt.n_slots() as u64) as usize;
    let mut carried: Option<(usize, usize)> = None; // (boundary, slot) of an in-process tx
    for s in (0..n_stages).filter(|&s| rt.owns_stage(s)) {
        let engine = rt.engine(s, primary)?;
        let _scope = rt.enter(s)?;
        let mut x = if s == 0 {
            engine.htod(&input_of(seed, t))?
        } else {
            let index = match carried {
                Some((b, index)) if b == s - 1 => index,
                _ => slot,
            };
            rt.rx_wait::<f32>(s - 1, index, n, WAIT)?
        };
        // Random delays on the device (a spin kernel): after a receive (the slot's next receive
        // must wait for its copy out), and before a send (a receive not waited for reads the
        // slot before the data lands).
        let mut delays = Rng::new(seed ^ (t << 8) ^ s as u64);
        let max_delay = max_delay_ns();
        if s > 0 {
            engine.spin(delays.below(max_delay))?;
        }
        for layer in layers_of(s, n_stages) {
            engine.toy_layer(&mut x, t as u32, layer)?;
        }
        if s + 1 < n_stages {
            engine.spin(delays.below(max_delay))?;
            carried = Some((s, rt.tx(s, &x, n)?));
        } else {
            return Ok(Some(x));
        }
    }
    Ok(None)
}

pub(crate) fn run_pipeline(rt: &PpNRt, primary: &Engine, seed: u64, steps: u64, dir: &Path) {
    let mut digests = OutputDigests::default();
    for t in 0..steps {
        let stepped = step(rt, primary, seed, t).unwrap_or_else(|e| {
            // Where each receiver thread of this rank stands: a diagnosis of a wait that timed out.
            let receivers: Vec<String> = (0..rt.n_boundaries())
                .filter_map(|b| Some(format!("boundary {b}: {}", rt.receiver_state(b).ok()??)))
                .collect();
            panic!("step {t} failed: {e}; receiver threads: {receivers:?}")
        });
        if let Some(out) = stepped {
            digests.add(rt, out, t + 1 == steps);
        }
    }
    finish_run(rt, dir, rt.owns_stage(rt.n_stages() - 1).then_some(digests.text));
}

/// The last stage's outputs, read back as their steps end (at most four readbacks in flight) and
/// digested in step order.
#[derive(Default)]
pub(crate) struct OutputDigests {
    pub(crate) pending: VecDeque<PendingReadback<f32>>,
    pub(crate) text: String,
}

impl OutputDigests {
    /// Reads a step's output back and digests the readbacks that are due (every one after the
    /// run's last step).
    pub(crate) fn add(&mut self, rt: &PpNRt, out: ppnrt::CudaSlice<f32>, last_step: bool) {
        self.pending.push_back(rt.readback(out).unwrap());
        while self.pending.len() > 4 || (last_step && !self.pending.is_empty()) {
            let done = self.pending.pop_front().unwrap();
            self.text.push_str(&format!("{:016x}\n", digest(done.wait().unwrap())));
        }
    }
}

/// The end of a rank's run: its streams idle, its receives through captured graphs counted for
/// the parent (`GRAPH-RECEIVES`), and the digests written where it ran the last stage.
pub(crate) fn finish_run(rt: &PpNRt, dir: &Path, digests: Option<String>) {
    rt.synchronize().unwrap();
    let graph_receives: u64 = (0..rt.n_boundaries()).map(|b| rt.graph_receives(b).unwrap()).sum();
    println!("GRAPH-RECEIVES {graph_receives}");
    if let Some(digests) = digests {
        std::fs::write(dir.join("digests"), digests).unwrap();
    }
}

/// How a rank replays its graph steps.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(crate) enum GraphDriver {
    /// `launch`: this rank's stages in turn, from one thread.
    Launch,
    /// `launch`, with some steps eager instead (`rx_wait` or `rx_in_place_wait`, the same
    /// kernels, `tx_wait`), on a pattern of each rank's own: the ranks need not agree on which
    /// steps are graphs.
    Interleaved,
    /// `launch_stage`, each stage of this rank from a thread of its own.
    ThreadPerStage,
}

/// Graph mode: this rank's stages captured once (step parameter = the slot), then `steps` steps
/// replayed as `driver` says; the last stage's rank reads each output back and writes the
/// digests. A stage spins half the longest delay on its device after receiving and before
/// sending.
pub(crate) fn run_graphs(rt: &PpNRt, primary: &Engine, seed: u64, steps: u64, dir: &Path, driver: GraphDriver) {
    let n = GRAPH_N;
    let n_stages = rt.n_stages();
    let spin_ns = max_delay_ns() / 2;
    let mut acts: Vec<Option<ppnrt::CudaSlice<f32>>> = (0..n_stages)
        .map(|s| {
            rt.owns_stage(s).then(|| {
                let _scope = rt.enter(s).unwrap();
                let mut x = rt.engine(s, primary).unwrap().alloc_persistent::<f32>(n).unwrap();
                rt.stage_stream(s).unwrap().memset_bytes(&mut x, 0).unwrap();
                x
            })
        })
        .collect();
    if let Some(ms) = std::env::var(CAPTURE_DELAY_VAR).ok().and_then(|ms| ms.parse().ok()) {
        std::thread::sleep(Duration::from_millis(ms));
    }
    let mut step = rt
        .capture_step::<f32>(n, |stage| {
            let s = stage.stage();
            let engine = rt.engine(s, primary)?;
            let x = acts[s].as_mut().expect("a stage of this rank");
            if s > 0 {
                if s % 2 == 1 {
                    // In place: a kernel reads the slot itself inside the graph.
                    engine.copy_with_sms(&stage.received()?, x)?;
                } else {
                    stage.rx_into(x)?;
                }
                engine.spin(spin_ns)?;
            }
            for layer in layers_of(s, n_stages) {
                engine.toy_layer(x, stage.slot() as u32, layer)?;
            }
            if s + 1 < n_stages {
                engine.spin(spin_ns)?;
                stage.tx(x)?;
            }
            Ok(())
        })
        .unwrap();
    println!("CHILD rank {}: {} graphs captured", rt.rank(), step.n_graphs());
    let digests = if driver == GraphDriver::ThreadPerStage {
        graph_steps_thread_per_stage(rt, primary, &step, &mut acts, seed, steps)
    } else {
        graph_steps_one_thread(rt, primary, &mut step, &mut acts, seed, steps, driver == GraphDriver::Interleaved)
    };
    drop(step);
    finish_run(rt, dir, digests);
}

/// Replays `steps` steps from this thread: `launch`, or with `interleaved` some steps eager
/// instead on a pattern of each rank's own; returns the digests when this rank runs the last
/// stage.
pub(crate) fn graph_steps_one_thread(
    rt: &PpNRt,
    primary: &Engine,
    step: &mut StepGraphs<'_, f32>,
    acts: &mut [Option<ppnrt::CudaSlice<f32>>],
    seed: u64,
    steps: u64,
    interleaved: bool,
) -> Option<String> {
    let last = rt.n_stages() - 1;
    let spin_ns = max_delay_ns() / 2;
    let mut digests = OutputDigests::default();
    for t in 0..steps {
        at_step(t);
        if let Some(input) = acts[0].as_mut() {
            let _scope = rt.enter(0).unwrap();
            rt.engine(0, primary).unwrap().htod_into(&graph_input_of(seed, t), input).unwrap();
        }
        // Rank 0 runs every other pair of steps eagerly, rank 1 every third run of three.
        if interleaved && (t / (rt.rank() as u64 + 2)) % 3 == 1 {
            eager_graph_step(rt, primary, acts, t, spin_ns).unwrap_or_else(|e| panic!("eager step {t} failed: {e}"));
        } else {
            step.launch().unwrap_or_else(|e| panic!("graph step {t} failed: {e}"));
        }
        if let Some(output) = acts[last].as_ref() {
            let _scope = rt.enter(last).unwrap();
            let engine = rt.engine(last, primary).unwrap();
            let mut out = engine.alloc::<f32>(output.len()).unwrap();
            engine.dtod(output, &mut out).unwrap();
            digests.add(rt, out, t + 1 == steps);
        }
    }
    rt.owns_stage(last).then_some(digests.text)
}

/// Replays `steps` graph steps with one thread per stage of this rank, each calling
/// `launch_stage` for its stage (the first stage's thread uploads the step's input, the last
/// stage's reads the output back); returns the digests when this rank runs the last stage.
pub(crate) fn graph_steps_thread_per_stage(
    rt: &PpNRt,
    primary: &Engine,
    step: &StepGraphs<'_, f32>,
    acts: &mut [Option<ppnrt::CudaSlice<f32>>],
    seed: u64,
    steps: u64,
) -> Option<String> {
    let last = rt.n_stages() - 1;
    std::thread::scope(|scope| {
        let threads: Vec<_> = acts
            .iter_mut()
            .enumerate()
            .filter_map(|(s, x)| x.as_mut().map(|x| (s, x)))
            .map(|(s, x)| {
                scope.spawn(move || {
                    let _scope = rt.enter(s).unwrap();
                    let engine = rt.engine(s, primary).unwrap();
                    let mut digests = OutputDigests::default();
                    for t in 0..steps {
                        at_step(t);
                        if s == 0 {
                            engine.htod_into(&graph_input_of(seed, t), x).unwrap();
                        }
                        step.launch_stage(s, WAIT).unwrap_or_else(|e| panic!("stage {s}, graph step {t} failed: {e}"));
                        if s == last {
                            let mut out = engine.alloc::<f32>(x.len()).unwrap();
                            engine.dtod(x, &mut out).unwrap();
                            digests.add(rt, out, t + 1 == steps);
                        }
                    }
                    (s == last).then_some(digests.text)
                })
            })
            .collect();
        threads.into_iter().filter_map(|thread| thread.join().unwrap()).next()
    })
}

/// One step of this rank's stages done eagerly, as its graphs do it (the same kernels, with the
/// slot the step uses as the toy layer's parameter): odd stages receive in place.
pub(crate) fn eager_graph_step(
    rt: &PpNRt,
    primary: &Engine,
    acts: &mut [Option<ppnrt::CudaSlice<f32>>],
    t: u64,
    spin_ns: u64,
) -> Result<(), Error> {
    let n = GRAPH_N;
    let n_stages = rt.n_stages();
    let k = (t % rt.n_slots() as u64) as usize;
    for s in (0..n_stages).filter(|&s| rt.owns_stage(s)) {
        let _scope = rt.enter(s)?;
        let engine = rt.engine(s, primary)?;
        let x = acts[s].as_mut().expect("a stage of this rank");
        if s > 0 {
            if s % 2 == 1 {
                let received = rt.rx_in_place_wait::<f32>(s - 1, k, n, WAIT)?;
                engine.copy_with_sms(&received.view()?, x)?;
            } else {
                let received = rt.rx_wait::<f32>(s - 1, k, n, WAIT)?;
                engine.dtod(&received, x)?;
            }
            engine.spin(spin_ns)?;
        }
        for layer in layers_of(s, n_stages) {
            engine.toy_layer(x, k as u32, layer)?;
        }
        if s + 1 < n_stages {
            engine.spin(spin_ns)?;
            let slot = rt.tx_wait(s, x, n, WAIT)?;
            assert_eq!(slot, k, "stage {s}: eager tx of step {t} went to slot {slot}");
        }
    }
    Ok(())
}

/// Two stages, ranks [0, 1], 2 slots, graph mode: rank 0 launches 6 graph steps, step t sending
/// `t + 0.5` everywhere. Rank 1 interleaves: a launch (step 0), an eager `rx` (step 1), a launch
/// (step 2). Then it takes slot 0 out of turn (step 4, skipping step 3): its next launch, which
/// would read step 5 from slot 1, finds step 3 there and is refused with
/// `PpError::GraphStepOrder`, enqueuing nothing; steps 3 and 5 are still there to receive.
pub(crate) fn graph_order(rt: &PpNRt, primary: &Engine) {
    let n = 1000;
    let s = rt.rank();
    let _scope = rt.enter(s).unwrap();
    let engine = rt.engine(s, primary).unwrap();
    let mut x = engine.alloc_persistent::<f32>(n).unwrap();
    engine.htod_into(&vec![-1.0; n], &mut x).unwrap();
    let mut step = rt
        .capture_step::<f32>(n, |stage| if stage.stage() == 0 { stage.tx(&x) } else { stage.rx_into(&mut x) })
        .unwrap();
    let value = |t: u64| vec![t as f32 + 0.5; n];
    if s == 0 {
        for t in 0..6 {
            engine.htod_into(&value(t), &mut x).unwrap();
            assert_eq!(step.launch().unwrap(), (t % 2) as usize);
        }
        rt.synchronize().unwrap();
        return;
    }
    let eager = |slot| engine.dtoh(&rt.rx_wait::<f32>(0, slot, n, WAIT).unwrap()).unwrap();
    assert_eq!(step.launch().unwrap(), 0);
    assert_eq!(engine.dtoh(&x).unwrap(), value(0), "graph step 0");
    assert_eq!(eager(1), value(1), "eager step 1");
    assert_eq!(step.launch().unwrap(), 0);
    assert_eq!(engine.dtoh(&x).unwrap(), value(2), "graph step 2 after an eager step");
    println!("GRAPH-INTERLEAVED graph, eager, graph: steps 0, 1, 2 as sent");
    assert_eq!(eager(0), value(4), "slot 0 out of turn holds step 4");
    match step.launch() {
        Err(Error::Pipeline(PpError::GraphStepOrder { boundary: 0, expected: 5, found: 3 })) => {
            println!("GRAPH-STEP-ORDER refused: expected step 5, slot 1 holds step 3");
        }
        other => panic!("expected GraphStepOrder, got {other:?}"),
    }
    assert_eq!(engine.dtoh(&x).unwrap(), value(2), "the refused launch changed the stage's buffer");
    assert_eq!(eager(1), value(3), "step 3 after the refusal");
    assert_eq!(eager(1), value(5), "step 5 after the refusal");
}

/// Two stages, ranks [0, 1]: misuse on either side is a typed error that loses nothing.
pub(crate) fn contract(rt: &PpNRt, primary: &Engine) {
    let n = 1000;
    let values: Vec<f32> = (0..n).map(|i| i as f32 * 0.5 - 7.0).collect();
    match rt.rank() {
        0 => {
            let refused = rt.rx::<f32>(0, 0, n).unwrap_err();
            assert!(
                matches!(refused, Error::Pipeline(PpError::StageNotOwned { stage: 1, owner: 1, rank: 0 })),
                "{refused}"
            );
            assert!(matches!(rt.enter(1).unwrap_err(), Error::Pipeline(PpError::StageNotOwned { .. })));
            assert!(matches!(rt.record_done().unwrap_err(), Error::Pipeline(PpError::StageNotOwned { .. })));
            let x = primary.htod(&values).unwrap();
            assert!(matches!(rt.tx(0, &x, n + 1).unwrap_err(), Error::Cuda(CudaError::OutOfBounds { .. })));
            assert!(matches!(rt.tx(0, &x, 0).unwrap_err(), Error::Pipeline(PpError::ZeroLength { .. })));
            let _scope = rt.enter(0).unwrap();
            // A step to another process cannot be captured: announced once, replayed at will.
            refused_in_capture(rt, 0, "PpNRt::tx to another rank", || rt.tx(0, &x, n).map(drop));
            for step in 0..3 {
                assert_eq!(rt.tx(0, &x, n).unwrap(), step % 2);
            }
            println!("CHILD rank 0 sent 3 steps");
        }
        _ => {
            let refused = rt.tx(0, &primary.htod(&values).unwrap(), n).unwrap_err();
            assert!(
                matches!(refused, Error::Pipeline(PpError::StageNotOwned { stage: 0, owner: 0, rank: 1 })),
                "{refused}"
            );
            let _scope = rt.enter(1).unwrap();
            // A step from another process cannot be received in a capture either.
            refused_in_capture(rt, 1, "PpNRt::rx", || rt.rx::<f32>(0, 0, n).map(drop));
            let short = rt.rx_wait::<f32>(0, 0, n - 1, WAIT).unwrap_err();
            assert!(
                matches!(short, Error::Pipeline(PpError::RxLengthMismatch { requested: 999, sent: 1000, .. })),
                "{short}"
            );
            println!("CHILD length mismatch: {short}");
            let typed = rt.rx::<u32>(0, 0, n).unwrap_err();
            assert!(
                matches!(typed, Error::Pipeline(PpError::RxTypeMismatch { requested: "u32", sent: "f32", .. })),
                "{typed}"
            );
            println!("CHILD type mismatch: {typed}");
            for step in 0..3 {
                let got = rt.rx_wait::<f32>(0, step % 2, n, WAIT).unwrap();
                let host = primary.dtoh(&got).unwrap();
                assert!(host.iter().zip(&values).all(|(a, b)| a.to_bits() == b.to_bits()), "step {step} corrupted");
            }
            let late = rt.rx_wait::<f32>(0, 1, n, Duration::from_millis(200)).unwrap_err();
            assert!(matches!(late, Error::Pipeline(PpError::Timeout { .. } | PpError::PeerFailed { .. })), "{late}");
            println!("CHILD rank 1 received 3 steps bitwise after the refusals");
        }
    }
    rt.synchronize().unwrap();
}

/// Steps 0 and 1 of [`SLOW_POST_LENGTHS`] from rank 0; rank 1's receiver thread is held up
/// [`SLOW_POST`] in posting step 1's receive (the NCCL double's slow receive). Meanwhile rank 1
/// receives step 0 at once, and a bounded wait for step 1 ends on time with a typed timeout;
/// step 1 arrives intact afterwards. Prints `CHILD-SLOW-POST <ms to receive step 0> <ms the
/// bounded wait took>`.
pub(crate) fn slow_post(rt: &PpNRt, primary: &Engine) {
    let values = |n: usize, step: usize| -> Vec<f32> { (0..n).map(|i| (i * 3 + step) as f32 - 11.5).collect() };
    if rt.rank() == 0 {
        // This rank's end of boundary 0 sends: it has no receiver thread.
        assert_eq!(rt.receiver_state(0).unwrap(), None);
        let out_of_range = rt.receiver_state(1).unwrap_err();
        assert!(
            matches!(out_of_range, Error::Pipeline(PpError::BoundaryOutOfRange { boundary: 1, .. })),
            "{out_of_range}"
        );
        let _scope = rt.enter(0).unwrap();
        for (step, n) in SLOW_POST_LENGTHS.into_iter().enumerate() {
            let x = primary.htod(&values(n, step)).unwrap();
            assert_eq!(rt.tx(0, &x, n).unwrap(), step);
        }
        println!("CHILD rank 0 sent 2 steps");
    } else {
        let _scope = rt.enter(1).unwrap();
        let [n0, n1] = SLOW_POST_LENGTHS;
        // By now step 1's record has come, and the receiver thread is posting its receive.
        std::thread::sleep(SLOW_POST / 5);
        let started = Instant::now();
        let first = rt.rx_wait::<f32>(0, 0, n0, WAIT).unwrap();
        let first_after = started.elapsed();
        let started = Instant::now();
        let early = rt.rx_wait::<f32>(0, 1, n1, SLOW_POST / 10).unwrap_err();
        let bounded = started.elapsed();
        assert!(matches!(early, Error::Pipeline(PpError::Timeout { .. })), "{early}");
        // The receiver thread says where it is: posting step 1.
        let state = rt.receiver_state(0).unwrap().expect("boundary 0 comes from another rank");
        assert!(matches!(state, ReceiverState::Posting { step: 1, .. }), "{state}");
        println!("CHILD receiver while held up: {state}");
        let second = rt.rx_wait::<f32>(0, 1, n1, WAIT).unwrap();
        let state = rt.receiver_state(0).unwrap().expect("boundary 0 comes from another rank");
        assert!(matches!(state, ReceiverState::AwaitingRecord { step: 2, .. } | ReceiverState::Stopped), "{state}");
        for (step, (got, n)) in [(first, n0), (second, n1)].into_iter().enumerate() {
            let host = primary.dtoh(&got).unwrap();
            assert!(
                host.iter().zip(&values(n, step)).all(|(a, b)| a.to_bits() == b.to_bits()),
                "step {step} corrupted"
            );
        }
        println!("CHILD-SLOW-POST {} {}", first_after.as_millis(), bounded.as_millis());
    }
    rt.synchronize().unwrap();
}

/// Rank 1 captures work on its stage's stream (the RX stage of boundary 0) while its receiver
/// thread takes in rank 0's first step, growing the slot from nothing to the step's size. The
/// capture must end whole, and the step arrive intact. Prints `CHILD-CAPTURE-WHOLE`.
pub(crate) fn grow_in_capture(rt: &PpNRt, primary: &Engine, dir: &Path) {
    let n = 1 << 16;
    let values: Vec<f32> = (0..n).map(|i| i as f32 * 0.25 - 3.0).collect();
    let capturing = dir.join("capturing");
    if rt.rank() == 0 {
        let _scope = rt.enter(0).unwrap();
        let x = primary.htod(&values).unwrap();
        let deadline = Instant::now() + WAIT;
        while !capturing.exists() {
            assert!(Instant::now() < deadline, "rank 1 never began its capture");
            std::thread::sleep(Duration::from_millis(5));
        }
        rt.tx(0, &x, n).unwrap();
        println!("CHILD rank 0 sent its step");
    } else {
        let engine = rt.engine(1, primary).unwrap();
        let _scope = rt.enter(1).unwrap();
        let capture = rt.stage_stream(1).unwrap().begin_capture(CaptureMode::Relaxed).unwrap();
        engine.spin(1_000).unwrap();
        std::fs::write(&capturing, b"").unwrap();
        // The step arrives, and its slot grows, while the capture goes on.
        std::thread::sleep(Duration::from_secs(1));
        let graph = capture.end().unwrap_or_else(|e| panic!("the receiver thread broke the RX stage's capture: {e}"));
        graph.instantiate().unwrap();
        let got = primary.dtoh(&rt.rx_wait::<f32>(0, 0, n, WAIT).unwrap()).unwrap();
        assert!(got.iter().zip(&values).all(|(a, b)| a.to_bits() == b.to_bits()), "the step was corrupted");
        println!("CHILD-CAPTURE-WHOLE");
    }
    rt.synchronize().unwrap();
}

/// Begins a capture on stage `stage`'s stream, makes `call`, and checks that it is refused as
/// `CaptureError::IllegalCall` naming `name` and that ending the capture gives `Invalidated`.
pub(crate) fn refused_in_capture(rt: &PpNRt, stage: usize, name: &str, call: impl FnOnce() -> Result<(), Error>) {
    let capture = rt.stage_stream(stage).unwrap().begin_capture(CaptureMode::Relaxed).unwrap();
    let captured = call().unwrap_err();
    assert!(
        matches!(&captured, Error::Cuda(CudaError::Capture(CaptureError::IllegalCall { call })) if *call == name),
        "{captured}"
    );
    let ended = capture.end().unwrap_err();
    assert!(matches!(ended, CudaError::Capture(CaptureError::Invalidated { .. })), "{ended}");
    println!("CHILD capture refused: {captured}");
}

/// Runs steps until a call fails; the failure must be `PeerFailed` (printed with the time).
pub(crate) fn survive_a_kill(rt: &PpNRt, primary: &Engine, seed: u64, dir: &Path) {
    let mut t = 0u64;
    let error = loop {
        let result = step(rt, primary, seed, t).and_then(|out| match out {
            Some(out) if rt.rank() == 0 => rt.readback(out).and_then(|p| p.wait().map(|_| ())),
            _ => Ok(()),
        });
        if let Err(e) = result {
            break e;
        }
        t += 1;
        if t == 50 && rt.rank() == 0 {
            std::fs::write(dir.join("running"), b"").unwrap();
        }
    };
    let noticed = unix_ms();
    assert!(matches!(error, Error::Pipeline(PpError::PeerFailed { .. })), "not a typed peer failure: {error:?}");
    println!("CHILD-PEER-FAILED {noticed} after {t} steps: {error}");
}
