//! The process-graphs table: a decode-like step (20 toy layers per stage, 32 KiB activations,
//! two slots) replayed as graphs across processes (`capture_step` on each rank, then
//! `StepGraphs::launch`) beside the same step issued eagerly across processes (`rx_wait`, a copy
//! into the stage's activations, the layers, `tx`), and both in one process, in the same run. Two
//! ranks, stages [0, 1] and [0, 1, 0, 1]; with two GPUs each rank sees one and NCCL goes over
//! NVLink; with one GPU both ranks share it and NCCL goes over its socket transport on loopback
//! (the in-process pipeline then runs every stage on that GPU). Figures: the pipelined step (a
//! run of steps issued back to back, from the end of the warm-up to the end of the run, both
//! after a synchronisation; on the last rank, whose launches wait for the steps to arrive, this
//! is the pipeline's throughput) and the median host time of one step's issue on the first rank.
//! The last stage's activations after the run are compared bitwise across the four variants.

use std::fmt::Write as _;
use std::time::{Duration, Instant};

use ppnrt::{CudaSlice, Engine, PpConfig, PpNRt};

use super::processes::{Nccl, ranks};
use super::{Gpus, median, say};

/// Set for a rank of this table: `eager` or `graph`.
pub(super) const DRIVER_VAR: &str = "PPNRT_BENCH_GRAPH_DRIVER";
const LAYERS: u32 = 20;
const N: usize = 8192; // 32 KiB of f32
const SLOTS: usize = 2;
const WARM_UP: usize = 100;
const STEPS: usize = 2000;
const WAIT: Duration = Duration::from_secs(60);

/// What one run of the workload measured, where it ran.
#[derive(Clone, Copy)]
struct Figures {
    /// µs per step over the run (the last stage's process: the pipeline's throughput).
    pipelined: f64,
    /// Median µs of one step's issue on the first stage's process.
    issue: f64,
    /// FNV-1a of the last stage's activations after the run.
    digest: u64,
}

fn digest(values: &[f32]) -> u64 {
    values
        .iter()
        .flat_map(|v| v.to_bits().to_le_bytes())
        .fold(0xcbf2_9ce4_8422_2325, |hash, byte| (hash ^ u64::from(byte)).wrapping_mul(0x0100_0000_01b3))
}

/// One eager step of this process's stages on slot `k`, as the graphs do it.
fn eager_step(rt: &PpNRt, primary: &Engine, acts: &mut [Option<CudaSlice<f32>>], k: usize) {
    let n_stages = rt.n_stages();
    for (s, x) in acts.iter_mut().enumerate().filter_map(|(s, x)| x.as_mut().map(|x| (s, x))) {
        let engine = rt.engine(s, primary).unwrap();
        let _scope = rt.enter(s).unwrap();
        if s > 0 {
            let received = rt.rx_wait::<f32>(s - 1, k, N, WAIT).unwrap();
            engine.dtod(&received, x).unwrap();
        }
        for layer in 0..LAYERS {
            engine.toy_layer(x, k as u32, layer).unwrap();
        }
        if s + 1 < n_stages {
            assert_eq!(rt.tx_wait(s, x, N, WAIT).unwrap(), k);
        }
    }
}

/// Runs the workload on this process's stages of `rt` (all of them in one process); returns the
/// pipelined step (µs), the median issue of one step (µs) and, where the last stage runs here,
/// the digest of its activations.
fn run(rt: &PpNRt, primary: &Engine, graph: bool) -> (f64, f64, Option<u64>) {
    let n_stages = rt.n_stages();
    let input: Vec<f32> = (0..N).map(|i| (i % 977) as f32 * 0.25 + 1.0).collect();
    let mut acts: Vec<Option<CudaSlice<f32>>> = (0..n_stages)
        .map(|s| {
            rt.owns_stage(s).then(|| {
                let _scope = rt.enter(s).unwrap();
                let engine = rt.engine(s, primary).unwrap();
                let mut x = engine.alloc_persistent::<f32>(N).unwrap();
                engine.htod_into(&input, &mut x).unwrap();
                x
            })
        })
        .collect();
    rt.synchronize().unwrap();
    let mut graphs = graph.then(|| {
        rt.capture_step::<f32>(N, |stage| {
            let s = stage.stage();
            let engine = rt.engine(s, primary)?;
            let x = acts[s].as_mut().expect("a stage of this process");
            if s > 0 {
                stage.rx_into(x)?;
            }
            for layer in 0..LAYERS {
                engine.toy_layer(x, stage.slot() as u32, layer)?;
            }
            if s + 1 < n_stages {
                stage.tx(x)?;
            }
            Ok(())
        })
        .unwrap()
    });
    let mut issue = Vec::with_capacity(STEPS);
    let mut start = Instant::now();
    for t in 0..WARM_UP + STEPS {
        if t == WARM_UP {
            rt.synchronize().unwrap();
            start = Instant::now();
        }
        let k = t % SLOTS;
        let call = Instant::now();
        match graphs.as_mut() {
            Some(graphs) => assert_eq!(graphs.launch().unwrap(), k),
            None => eager_step(rt, primary, &mut acts, k),
        }
        if t >= WARM_UP {
            issue.push(call.elapsed().as_secs_f64() * 1e6);
        }
    }
    rt.synchronize().unwrap();
    let pipelined = start.elapsed().as_secs_f64() * 1e6 / STEPS as f64;
    drop(graphs);
    let last = n_stages - 1;
    let out = acts[last].as_ref().map(|x| {
        let _scope = rt.enter(last).unwrap();
        digest(&rt.engine(last, primary).unwrap().dtoh(x).unwrap())
    });
    (pipelined, median(&mut issue), out)
}

/// A rank of this table (`PPNRT_BENCH_PROCESS_ROLE=graph-steps`): prints its RESULT lines.
pub(super) fn rank_role(rt: &PpNRt, primary: &Engine) {
    let graph = std::env::var(DRIVER_VAR).is_ok_and(|driver| driver == "graph");
    let (pipelined, issue, out) = run(rt, primary, graph);
    if rt.owns_stage(0) {
        println!("RESULT issue {issue}");
    }
    if let Some(out) = out {
        println!("RESULT pipelined {pipelined}");
        // In two exact halves: RESULT values are read as f64.
        println!("RESULT digest_hi {}", out >> 32);
        println!("RESULT digest_lo {}", out & 0xffff_ffff);
    }
}

pub(crate) fn process_graphs(gpus: &Gpus, report: &mut String) {
    if let Err(e) = ppnrt::nccl::nccl() {
        say(&format!("process-graphs table skipped: {e}"));
        return;
    }
    let primary = &gpus.engines[0];
    let two = gpus.engines.len() >= 2 && gpus.peers;
    let nccl = Nccl { sockets: !two, no_graph_mixing: false, recv_graphs: true, shared_gpu: !two };
    let transport = if two { "NVLink, one GPU per rank" } else { "sockets, both ranks on one GPU" };
    let _ = writeln!(
        report,
        "\n### Graph mode across processes (2 ranks, NCCL over {transport}; 20 toy layers per stage, 32 KiB, {SLOTS} slots, runs of {STEPS} steps)\n"
    );
    let _ = writeln!(
        report,
        "| stages (ranks) | variant | pipelined step (µs) | host issue of one step, first rank (µs) | output |"
    );
    let _ = writeln!(report, "| --- | --- | ---: | ---: | --- |");
    for stage_ranks in [&[0_i32, 1][..], &[0, 1, 0, 1][..]] {
        let devices: Vec<i32> = stage_ranks.iter().map(|&r| if two { r } else { 0 }).collect();
        let in_process = |graph: bool| {
            let rt = PpNRt::new(PpConfig::with_devices(&devices).with_slots(SLOTS), primary).unwrap();
            let (pipelined, issue, out) = run(&rt, primary, graph);
            Figures { pipelined, issue, digest: out.expect("one process runs the last stage") }
        };
        let listed = stage_ranks.iter().map(ToString::to_string).collect::<Vec<_>>().join(",");
        let across = |graph: bool| {
            let driver = if graph { "graph" } else { "eager" };
            let results = ranks("graph-steps", &listed, nccl, &[(DRIVER_VAR, driver)]);
            let get = |key: &str| results.iter().find(|(k, _)| k == key).map_or(f64::NAN, |&(_, v)| v);
            Figures {
                pipelined: get("pipelined"),
                issue: get("issue"),
                digest: ((get("digest_hi") as u64) << 32) | get("digest_lo") as u64,
            }
        };
        let variants = [
            ("in one process, eager", in_process(false)),
            ("in one process, graph mode", in_process(true)),
            ("across processes, eager", across(false)),
            ("across processes, graph mode", across(true)),
        ];
        let reference = variants[0].1.digest;
        for (name, f) in &variants {
            let same = if f.digest == reference { "bitwise the first row's" } else { "DIFFERS" };
            let line =
                format!("| {} ({listed}) | {name} | {:.2} | {:.2} | {same} |", stage_ranks.len(), f.pipelined, f.issue);
            println!("{line}");
            let _ = writeln!(report, "{line}");
        }
        let (eager, graph, local_graph) = (variants[2].1, variants[3].1, variants[1].1);
        let line = format!(
            "\n{} stages across processes: graph mode's pipelined step {:.3}× the eager one's, {:.3}× graph mode's in one process; host issue {:.3}× the eager one's.\n",
            stage_ranks.len(),
            graph.pipelined / eager.pipelined,
            graph.pipelined / local_graph.pipelined,
            graph.issue / eager.issue
        );
        println!("{line}");
        let _ = writeln!(report, "{line}");
        assert!(variants.iter().all(|(_, f)| f.digest == reference), "graph mode across processes changed the output");
    }
}
