//! The processes table: a boundary between two processes (NCCL, over NVLink and over NCCL's
//! socket transport on loopback) beside the in-process `Peer` boundary, in the same run, with
//! the same workload code: host cost of `tx` and `rx` at 32 KiB (the receiver is slower than the
//! sender, so its `rx` never waits for data), the isolated hop (half a round trip over stages
//! [0, 1, 0]), the pipelined step at 32 KiB and the throughput at 64 MiB (a stream of steps
//! over [0, 1], timed on the receiver). The in-process boundary and the NCCL boundary with the
//! defaults (the receiver threads launch captured receives) alternate in three rounds, so that
//! each round's ratio compares figures taken seconds apart, and each target counts the median
//! round. Over NVLink the ranks also run once with receives by NCCL's call
//! (`PpConfig::nccl_recv_graphs(false)`) and once with `NCCL_GRAPH_MIXING_SUPPORT=0` set for the
//! ranks (which also turns captured receives off). The ranks are this bench binary again, one
//! child process per rank, each seeing one GPU.

use std::fmt::Write as _;
use std::process::Command;
use std::time::{Duration, Instant};

use ppnrt::{CudaSlice, Engine, PpConfig, PpNRt};

use super::{Gpus, median, say};

#[path = "processes_one_gpu.rs"]
mod one_gpu;

const ROLE_VAR: &str = "PPNRT_BENCH_PROCESS_ROLE";
/// The transport between the ranks.
const TRANSPORT_VAR: &str = "PPNRT_PROCESS_TRANSPORT";
/// Set for ranks that receive by NCCL's call instead of captured graphs.
const NO_RECV_GRAPHS_VAR: &str = "PPNRT_BENCH_NO_RECV_GRAPHS";
pub(super) const SMALL: usize = 8192; // 32 KiB of f32
pub(super) const LARGE: usize = 16 << 20; // 64 MiB of f32
const WAIT: Duration = Duration::from_secs(60);

/// Figures of one transport, in µs (throughput in GB/s).
#[derive(Default, Clone, Copy)]
struct Figures {
    tx: f64,
    rx: f64,
    hop: f64,
    step: f64,
    large_gbs: f64,
    /// NCCL alone (no pipeline): host cost of a send call, of a receive call, and the hop.
    raw_send: f64,
    raw_recv: f64,
    raw_hop: f64,
    /// The same through a non-blocking communicator (`NcclComm::init_rank_watched`, the kind the
    /// boundary uses).
    raw_nb_send: f64,
    raw_nb_recv: f64,
    raw_nb_hop: f64,
    /// Steps of the stream workload the receiver took through captured graphs.
    graph_receives: f64,
}

/// How many rounds the in-process and the default NCCL boundaries alternate in.
const ROUNDS: usize = 3;

/// The median over `rounds` of one figure.
fn median_of(rounds: &[(Figures, Figures)], figure: impl Fn(&(Figures, Figures)) -> f64) -> f64 {
    let mut values: Vec<f64> = rounds.iter().map(figure).collect();
    median(&mut values)
}

fn slot_of(rt: &PpNRt, t: usize) -> usize {
    t % rt.n_slots()
}

fn source(rt: &PpNRt, primary: &Engine, n: usize) -> CudaSlice<f32> {
    let engine = rt.engine(0, primary).unwrap();
    let _scope = rt.enter(0).unwrap();
    let x = engine.htod(&(0..n).map(|i| (i % 977) as f32 * 0.25 + 1.0).collect::<Vec<_>>()).unwrap();
    rt.synchronize().unwrap();
    x
}

/// Stages [0, 1, 0]: the round trip, timed where stage 0 and 2 run; returns the hop (µs).
fn hop(rt: &PpNRt, primary: &Engine) -> Option<f64> {
    let x = if rt.owns_stage(0) { Some(source(rt, primary, SMALL)) } else { None };
    let mut halves = Vec::new();
    for t in 0..330 {
        let start = Instant::now();
        if let Some(x) = &x {
            let _scope = rt.enter(0).unwrap();
            rt.tx(0, x, SMALL).unwrap();
        }
        if rt.owns_stage(1) {
            let _scope = rt.enter(1).unwrap();
            let y = rt.rx_wait::<f32>(0, slot_of(rt, t), SMALL, WAIT).unwrap();
            rt.tx(1, &y, SMALL).unwrap();
        }
        if rt.owns_stage(2) {
            let _scope = rt.enter(2).unwrap();
            let z = rt.rx_wait::<f32>(1, slot_of(rt, t), SMALL, WAIT).unwrap();
            drop(z);
            rt.stage_stream(2).unwrap().synchronize().unwrap();
            if t >= 30 {
                halves.push(start.elapsed().as_secs_f64() * 1e6 / 2.0);
            }
        }
    }
    rt.synchronize().unwrap();
    (!halves.is_empty()).then(|| median(&mut halves))
}

/// Which host cost a run of the stream workload measures.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Cost {
    Tx,
    Rx,
}

/// Stages [0, 1]: host costs (`tx` with the sender the slower side, then `rx` with the receiver
/// the slower side, so neither waits for the other), then the pipelined step at 32 KiB and the
/// throughput at 64 MiB, timed on the receiver. Returns (tx µs, rx µs, step µs, GB/s) for what
/// this process runs.
fn stream(rt: &PpNRt, primary: &Engine) -> (Option<f64>, Option<f64>, Option<f64>, Option<f64>) {
    let (sends, receives) = (rt.owns_stage(0), rt.owns_stage(1));
    let small = if sends { Some(source(rt, primary, SMALL)) } else { None };
    let large = if sends { Some(source(rt, primary, LARGE)) } else { None };
    let (mut tx_costs, mut rx_costs) = (Vec::new(), Vec::new());
    let mut t = 0;
    // Busy, not asleep: a thread woken from sleep pays for cold caches.
    let pause = |us: u64| {
        let until = Instant::now() + Duration::from_micros(us);
        while Instant::now() < until {
            std::hint::spin_loop();
        }
    };
    let mut run = |n: usize, steps: usize, costs: Option<Cost>, t: &mut usize| -> Option<f64> {
        let mut first = None;
        for k in 0..steps {
            if sends {
                // Measuring `tx`, the sender is the slower side: each `tx` finds the pipeline idle,
                // never a queue the sender filled ahead of the receiver.
                if costs == Some(Cost::Tx) {
                    pause(300);
                }
                let x = if n == SMALL { small.as_ref() } else { large.as_ref() }.unwrap();
                let _scope = rt.enter(0).unwrap();
                let start = Instant::now();
                rt.tx(0, x, n).unwrap();
                if costs == Some(Cost::Tx) {
                    tx_costs.push(start.elapsed().as_secs_f64() * 1e6);
                }
            }
            if receives {
                // Measuring `rx`, the receiver is the slower side, so its `rx` never waits for
                // data; the same pauses in one process keep the comparison fair.
                if costs == Some(Cost::Rx) {
                    pause(300);
                }
                let _scope = rt.enter(1).unwrap();
                let start = Instant::now();
                let y = rt.rx_wait::<f32>(0, slot_of(rt, *t), n, WAIT).unwrap();
                if costs == Some(Cost::Rx) {
                    rx_costs.push(start.elapsed().as_secs_f64() * 1e6);
                }
                drop(y);
                if k == 4 {
                    rt.stage_stream(1).unwrap().synchronize().unwrap();
                    first = Some(Instant::now());
                }
            }
            *t += 1;
        }
        rt.synchronize().unwrap();
        first.map(|first| first.elapsed().as_secs_f64() * 1e6 / (steps - 5) as f64)
    };
    run(SMALL, 500, Some(Cost::Tx), &mut t);
    run(SMALL, 500, Some(Cost::Rx), &mut t);
    let step = run(SMALL, 2000, None, &mut t);
    let large_step = run(LARGE, 45, None, &mut t);
    let gbs = large_step.map(|us| (LARGE * 4) as f64 / (us * 1e3));
    let tx = (!tx_costs.is_empty()).then(|| median(&mut tx_costs));
    let rx = (!rx_costs.is_empty()).then(|| median(&mut rx_costs));
    (tx, rx, step, gbs)
}

/// The raw reference: NCCL alone between the two ranks (through `NcclComm`, no pipeline): the
/// host cost of a 32 KiB send and receive call, and half a send/receive round trip (rank 0 waits
/// for the echo on the host), through a blocking communicator and then through a non-blocking
/// one (the kind the boundary joins). Returns, for each, (send µs, recv µs, hop µs) on rank 0.
fn raw_nccl(primary: &Engine) -> [(Option<f64>, Option<f64>, Option<f64>); 2] {
    use ppnrt::nccl::{NcclComm, NcclUniqueId};
    use ppnrt::rendezvous::Rendezvous;
    let rank: usize = std::env::var("PPNRT_RANK").unwrap().parse().unwrap();
    let meet = Rendezvous {
        addr: std::env::var("PPNRT_RENDEZVOUS").unwrap(),
        rank,
        world: 2,
        fingerprint: "raw".into(),
        timeout: Duration::from_secs(60),
        access: ppnrt::JobAccess::from_env().expect("the job's access settings"),
    };
    // Rank 0 hands out two ids: the blocking communicator's and the non-blocking one's.
    let contribution: Vec<u8> = if rank == 0 {
        [NcclUniqueId::new().unwrap().to_bytes(), NcclUniqueId::new().unwrap().to_bytes()].concat()
    } else {
        Vec::new()
    };
    let members = meet.exchange(&contribution).unwrap();
    let ids: Vec<NcclUniqueId> = members[0]
        .bytes
        .chunks_exact(NcclUniqueId::BYTES)
        .map(|bytes| NcclUniqueId::from_bytes(bytes.try_into().unwrap()))
        .collect();
    assert_eq!(ids.len(), 2, "rank 0 hands out two ids");
    [false, true].map(|nonblocking| {
        let id = &ids[usize::from(nonblocking)];
        let comm = if nonblocking {
            NcclComm::init_rank_watched(primary.context(), 2, id, rank as i32, WAIT, || {
                Ok::<(), ppnrt::nccl::NcclError>(())
            })
            .unwrap()
        } else {
            NcclComm::init_rank(primary.context(), 2, id, rank as i32).unwrap()
        };
        send_recv_costs(primary, &comm, rank)
    })
}

/// [`raw_nccl`]'s measurement through one communicator.
fn send_recv_costs(
    primary: &Engine,
    comm: &ppnrt::nccl::NcclComm,
    rank: usize,
) -> (Option<f64>, Option<f64>, Option<f64>) {
    let stream = ppnrt::CudaStream::new(primary.context()).unwrap();
    let mut buf = primary.htod(&vec![1.5f32; SMALL]).unwrap();
    primary.synchronize().unwrap();
    let peer = 1 - rank as i32;
    let (mut sends, mut recvs, mut hops) = (Vec::new(), Vec::new(), Vec::new());
    for k in 0..1330 {
        let start = Instant::now();
        // SAFETY: both ranks send and receive the same buffer's bytes.
        if rank == 0 {
            unsafe { comm.send(&stream, &buf, peer) }.unwrap();
            let sent = Instant::now();
            unsafe { comm.recv(&stream, &mut buf, peer) }.unwrap();
            let received = Instant::now();
            stream.synchronize().unwrap();
            if k >= 30 {
                sends.push((sent - start).as_secs_f64() * 1e6);
                recvs.push((received - sent).as_secs_f64() * 1e6);
                hops.push(start.elapsed().as_secs_f64() * 1e6 / 2.0);
            }
        } else {
            // SAFETY: as above.
            unsafe { comm.recv(&stream, &mut buf, peer) }.unwrap();
            // SAFETY: as above.
            unsafe { comm.send(&stream, &buf, peer) }.unwrap();
            if k % 64 == 0 {
                stream.synchronize().unwrap();
            }
        }
    }
    stream.synchronize().unwrap();
    let pick = |v: &mut Vec<f64>| (!v.is_empty()).then(|| median(v));
    (pick(&mut sends), pick(&mut recvs), pick(&mut hops))
}

/// A child process's work (one rank): returns true when this process is a rank (then `main`
/// does nothing else).
pub(crate) fn run_role() -> bool {
    let Ok(role) = std::env::var(ROLE_VAR) else { return false };
    let primary = Engine::new(0).unwrap();
    if let Some(workload) = role.strip_prefix("raw-ipc-") {
        // The raw two-process IPC loop (no pipeline): see `raw_ipc`.
        let print = |key: &str, value: Option<f64>| {
            if let Some(value) = value {
                println!("RESULT {key} {value}");
            }
        };
        if workload == "hop" {
            print("hop", super::raw_ipc::hop(&primary));
        } else {
            let (step, gbs) = super::raw_ipc::stream(&primary);
            print("step", step);
            print("gbs", gbs);
        }
        return true;
    }
    if role == "raw" {
        let [(send, recv, hop), (nb_send, nb_recv, nb_hop)] = raw_nccl(&primary);
        for (key, value) in [
            ("raw_send", send),
            ("raw_recv", recv),
            ("raw_hop", hop),
            ("raw_nb_send", nb_send),
            ("raw_nb_recv", nb_recv),
            ("raw_nb_hop", nb_hop),
        ] {
            if let Some(value) = value {
                println!("RESULT {key} {value}");
            }
        }
        return true;
    }
    // Slots for the largest step at build: an IPC boundary's slots are mapped by both ranks then
    // and do not grow.
    let config = PpConfig::from_env()
        .unwrap()
        .with_nccl_recv_graphs(std::env::var_os(NO_RECV_GRAPHS_VAR).is_none())
        .with_reserve_bytes(LARGE * std::mem::size_of::<f32>());
    let rt = PpNRt::new(config, &primary).unwrap();
    let print = |key: &str, value: Option<f64>| {
        if let Some(value) = value {
            println!("RESULT {key} {value}");
        }
    };
    match role.as_str() {
        "hop" => print("hop", hop(&rt, &primary)),
        "graph-steps" => super::process_graphs::rank_role(&rt, &primary),

        _ => {
            let (tx, rx, step, gbs) = stream(&rt, &primary);
            print("tx", tx);
            print("rx", rx);
            print("step", step);
            print("gbs", gbs);
            if rt.owns_stage(1) {
                print("graph_receives", Some(rt.graph_receives(0).unwrap() as f64));
            }
        }
    }
    true
}

/// How the ranks' NCCL is set up: over NVLink or its socket transport, with or without
/// `NCCL_GRAPH_MIXING_SUPPORT=0` (no support for mixing graph-captured and eager launches on a
/// communicator; the pipeline then receives by NCCL's call only), and whether the pipeline may
/// receive through captured graphs.
#[derive(Clone, Copy)]
pub(super) struct Nccl {
    pub(super) sockets: bool,
    pub(super) no_graph_mixing: bool,
    pub(super) recv_graphs: bool,
    /// Both ranks on GPU 0 (NCCL refuses two ranks on one GPU of one host unless each has a host
    /// id of its own; use with `sockets`).
    pub(super) shared_gpu: bool,
}

/// Runs one workload as two ranks, with `env` set for both; returns the RESULT lines of both.
pub(super) fn ranks(role: &str, stage_ranks: &str, nccl: Nccl, env: &[(&str, &str)]) -> Vec<(String, f64)> {
    let exe = std::env::current_exe().unwrap();
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let n_stages = stage_ranks.split(',').count();
    let children: Vec<_> = (0..2)
        .map(|rank| {
            let mut command = Command::new(&exe);
            command
                .env(ROLE_VAR, role)
                .env("CUDA_VISIBLE_DEVICES", if nccl.shared_gpu { "0".to_string() } else { rank.to_string() })
                .env("PPNRT_DEVICES", vec!["0"; n_stages].join(","))
                .env("PPNRT_RANKS", stage_ranks)
                .env("PPNRT_RANK", rank.to_string())
                .env("PPNRT_SLOTS", "2")
                .env("PPNRT_RENDEZVOUS", format!("127.0.0.1:{port}"))
                .env("NCCL_NVLS_ENABLE", "0");
            if nccl.no_graph_mixing {
                command.env("NCCL_GRAPH_MIXING_SUPPORT", "0");
            }
            if !nccl.recv_graphs {
                command.env(NO_RECV_GRAPHS_VAR, "1");
            }
            if nccl.sockets {
                command.env("NCCL_P2P_DISABLE", "1").env("NCCL_SHM_DISABLE", "1").env("NCCL_SOCKET_IFNAME", "lo");
            }
            if nccl.shared_gpu {
                command.env("NCCL_HOSTID", format!("ppnrt-bench-rank-{rank}"));
            }
            command.envs(env.iter().copied());
            command.stdout(std::process::Stdio::piped()).stderr(std::process::Stdio::piped()).spawn().unwrap()
        })
        .collect();
    let mut results = Vec::new();
    for child in children {
        let out = child.wait_with_output().unwrap();
        let text = String::from_utf8_lossy(&out.stdout).into_owned();
        assert!(out.status.success(), "a rank failed:\n{text}\n{}", String::from_utf8_lossy(&out.stderr));
        results.extend(text.lines().filter_map(|line| {
            let mut words = line.strip_prefix("RESULT ")?.split_whitespace();
            Some((words.next()?.to_string(), words.next()?.parse().ok()?))
        }));
    }
    results
}

fn figures_of(results: &[(String, f64)]) -> Figures {
    let get = |key: &str| results.iter().find(|(k, _)| k == key).map_or(f64::NAN, |&(_, v)| v);
    Figures {
        tx: get("tx"),
        rx: get("rx"),
        hop: get("hop"),
        step: get("step"),
        large_gbs: get("gbs"),
        raw_send: get("raw_send"),
        raw_recv: get("raw_recv"),
        raw_hop: get("raw_hop"),
        raw_nb_send: get("raw_nb_send"),
        raw_nb_recv: get("raw_nb_recv"),
        raw_nb_hop: get("raw_nb_hop"),
        graph_receives: get("graph_receives"),
    }
}

pub(crate) fn processes(gpus: &Gpus, report: &mut String) {
    if gpus.engines.len() == 1 {
        one_gpu::one_gpu(gpus, report);
        return;
    }
    if gpus.engines.len() < 2 || !gpus.peers {
        say("processes table skipped: needs two GPUs with peer access");
        return;
    }
    if let Err(e) = ppnrt::nccl::nccl() {
        say(&format!("processes table skipped: {e}"));
        return;
    }
    let primary = &gpus.engines[0];
    let measure_in_process = || {
        let rt = PpNRt::new(PpConfig::with_devices(&[0, 1, 0]).with_slots(2), primary).unwrap();
        let hop = hop(&rt, primary).unwrap();
        drop(rt);
        let rt = PpNRt::new(PpConfig::with_devices(&[0, 1]).with_slots(2), primary).unwrap();
        let (tx, rx, step, gbs) = stream(&rt, primary);
        Figures {
            tx: tx.unwrap(),
            rx: rx.unwrap(),
            hop,
            step: step.unwrap(),
            large_gbs: gbs.unwrap(),
            graph_receives: f64::NAN,
            ..Figures::default()
        }
    };
    let across = |nccl: Nccl| {
        let env = [(TRANSPORT_VAR, "nccl")];
        let mut results = ranks("hop", "0,1,0", nccl, &env);
        results.extend(ranks("stream", "0,1", nccl, &env));
        results.extend(ranks("raw", "0,1", nccl, &env));
        figures_of(&results)
    };
    // The in-process boundary and the default NCCL boundary alternate in rounds: each round's
    // ratio compares figures taken a few seconds apart (host costs drift by tens of percent
    // within minutes on these machines), and each target counts the median round.
    let defaults = Nccl { sockets: false, no_graph_mixing: false, recv_graphs: true, shared_gpu: false };
    let rounds: Vec<(Figures, Figures)> = (0..ROUNDS).map(|_| (measure_in_process(), across(defaults))).collect();
    let nvlink_calls = across(Nccl { recv_graphs: false, ..defaults });
    let nvlink_no_mixing = across(Nccl { no_graph_mixing: true, ..defaults });
    let sockets = across(Nccl { sockets: true, ..defaults });
    // The other settings run once; they compare with the in-process rounds' medians.
    let in_process = Figures {
        tx: median_of(&rounds, |(f, _)| f.tx),
        rx: median_of(&rounds, |(f, _)| f.rx),
        hop: median_of(&rounds, |(f, _)| f.hop),
        step: median_of(&rounds, |(f, _)| f.step),
        large_gbs: median_of(&rounds, |(f, _)| f.large_gbs),
        graph_receives: f64::NAN,
        ..Figures::default()
    };
    let _ = writeln!(report, "\n### Boundary between processes (NCCL) beside the in-process peer boundary\n");
    let _ = writeln!(
        report,
        "| boundary | host tx (µs) | host rx (µs) | tx + rx (µs) | isolated hop 32 KiB (µs) | pipelined step 32 KiB (µs) | 64 MiB (GB/s) | receives through graphs |"
    );
    let _ = writeln!(report, "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |");
    let stream_steps = 500 + 500 + 2000 + 45;
    let mut rows: Vec<(String, Figures)> = Vec::new();
    for (r, (in_round, nccl_round)) in rounds.iter().enumerate() {
        rows.push((format!("round {}: in-process peer", r + 1), *in_round));
        rows.push((format!("round {}: NCCL, NVLink", r + 1), *nccl_round));
    }
    rows.push(("NCCL, NVLink, receives by NCCL's call".into(), nvlink_calls));
    rows.push(("NCCL, NVLink, `NCCL_GRAPH_MIXING_SUPPORT=0`".into(), nvlink_no_mixing));
    rows.push(("NCCL, sockets (loopback)".into(), sockets));
    for (name, f) in &rows {
        let graphs = if f.graph_receives.is_nan() {
            "—".to_string()
        } else {
            format!("{} of {stream_steps}", f.graph_receives)
        };
        let line = format!(
            "| {name} | {:.2} | {:.2} | {:.2} | {:.1} | {:.2} | {:.1} | {graphs} |",
            f.tx,
            f.rx,
            f.tx + f.rx,
            f.hop,
            f.step,
            f.large_gbs
        );
        println!("{line}");
        let _ = writeln!(report, "{line}");
    }
    let _ =
        writeln!(report, "\nNCCL alone between the two processes (the raw reference, through `NcclComm`, 32 KiB):\n");
    let _ = writeln!(
        report,
        "| NCCL transport | host send call (µs) | host recv call (µs) | hop: half a send/recv round trip (µs) | non-blocking communicator: send / recv / hop (µs) |"
    );
    let _ = writeln!(report, "| --- | ---: | ---: | ---: | ---: |");
    let mut raw_rows: Vec<(String, Figures)> =
        rounds.iter().enumerate().map(|(r, (_, f))| (format!("NVLink (round {})", r + 1), *f)).collect();
    raw_rows.push(("NVLink, `NCCL_GRAPH_MIXING_SUPPORT=0`".into(), nvlink_no_mixing));
    raw_rows.push(("sockets (loopback)".into(), sockets));
    for (name, f) in &raw_rows {
        let line = format!(
            "| {name} | {:.2} | {:.2} | {:.1} | {:.2} / {:.2} / {:.1} |",
            f.raw_send, f.raw_recv, f.raw_hop, f.raw_nb_send, f.raw_nb_recv, f.raw_nb_hop
        );
        println!("{line}");
        let _ = writeln!(report, "{line}");
    }
    let _ = writeln!(report);
    let mut targets = Vec::new();
    // The default boundary: one ratio per round, the median round counts.
    let per_round = |ratio: &dyn Fn(&Figures, &Figures) -> f64| -> (f64, String) {
        let mut ratios: Vec<f64> = rounds.iter().map(|(a, b)| ratio(a, b)).collect();
        let listed = ratios.iter().map(|r| format!("{r:.2}")).collect::<Vec<_>>().join(", ");
        (median(&mut ratios), listed)
    };
    let (gbs, gbs_rounds) = per_round(&|a, b| b.large_gbs / a.large_gbs);
    targets.push((
        "NCCL: 64 MiB boundary throughput ≥ 85% of the in-process peer boundary".to_string(),
        format!("{:.1}% in the median round (rounds {gbs_rounds})", 100.0 * gbs),
        gbs >= 0.85,
    ));
    let (hop_ratio, hop_rounds) = per_round(&|a, b| b.hop / a.hop);
    targets.push((
        "NCCL: 32 KiB isolated hop ≤ 1.5× the in-process peer hop".to_string(),
        format!("{hop_ratio:.2}× in the median round (rounds {hop_rounds}×)"),
        hop_ratio <= 1.5,
    ));
    let (host_ratio, host_rounds) = per_round(&|a, b| (b.tx + b.rx) / (a.tx + a.rx));
    targets.push((
        "NCCL: host cost per tx + rx ≤ 1.3× in-process".to_string(),
        format!("{host_ratio:.2}× in the median round (rounds {host_rounds}×)"),
        host_ratio <= 1.3,
    ));
    for (setting, f) in
        [(", receives by NCCL's call", nvlink_calls), (", `NCCL_GRAPH_MIXING_SUPPORT=0`", nvlink_no_mixing)]
    {
        targets.push((
            format!("NCCL{setting}: 64 MiB boundary throughput ≥ 85% of the in-process peer boundary"),
            format!(
                "{:.1} vs {:.1} GB/s ({:.1}%; in-process: the rounds' median)",
                f.large_gbs,
                in_process.large_gbs,
                100.0 * f.large_gbs / in_process.large_gbs
            ),
            f.large_gbs >= 0.85 * in_process.large_gbs,
        ));
        targets.push((
            format!("NCCL{setting}: 32 KiB isolated hop ≤ 1.5× the in-process peer hop"),
            format!("{:.1} vs {:.1} µs ({:.2}×)", f.hop, in_process.hop, f.hop / in_process.hop),
            f.hop <= 1.5 * in_process.hop,
        ));
        targets.push((
            format!("NCCL{setting}: host cost per tx + rx ≤ 1.3× in-process"),
            format!(
                "{:.2} vs {:.2} µs ({:.2}×)",
                f.tx + f.rx,
                in_process.tx + in_process.rx,
                (f.tx + f.rx) / (in_process.tx + in_process.rx)
            ),
            f.tx + f.rx <= 1.3 * (in_process.tx + in_process.rx),
        ));
    }
    let (nb_ratio, nb_rounds) = per_round(&|_, b| (b.raw_nb_send + b.raw_nb_recv) / (b.raw_send + b.raw_recv));
    let line = format!(
        "NCCL's send and receive calls through a non-blocking communicator beside a blocking one \
         (no target): {nb_ratio:.2}× in the median round (rounds {nb_rounds}×).\n"
    );
    println!("{line}");
    let _ = writeln!(report, "{line}");
    let (raw_ratio, raw_rounds) = per_round(&|_, b| (b.tx + b.rx) / (b.raw_send + b.raw_recv));
    let line = format!(
        "NCCL's own send and receive calls beside the boundary's tx + rx (no target): the boundary \
         costs {raw_ratio:.2}× them in the median round (rounds {raw_rounds}×).\n"
    );
    println!("{line}");
    let _ = writeln!(report, "{line}");
    for (name, measured, met) in targets {
        let line = format!("| {name} | {measured} | {} |", if met { "yes" } else { "NO" });
        println!("TARGET {line}");
        let _ = writeln!(report, "{line}");
    }
}
