//! A pipeline spanning processes: two ranks (this test binary again, one child process per rank,
//! each seeing one GPU) run 2, 4 and 8 stages, contiguous and alternating, over NCCL through
//! NVLink and over NCCL's socket transport on loopback (the stand-in for two hosts); the last
//! rank's outputs are compared bitwise, step by step, with one engine running the whole model.
//! Also: the contract across the wire (a length or type mismatch is a typed error on the
//! receiver and the data stays receivable; another rank's stage is refused), a rank killed
//! mid-run (the survivor gets a typed error within 10 s), and one rank under compute-sanitizer
//! memcheck.
//!
//! Needs NCCL and a GPU; skips (saying why) otherwise, and fails instead with
//! `PPNRT_REQUIRE_GPUS=1` / `PPNRT_REQUIRE_NCCL=1`. On a machine where no CUDA driver can be
//! loaded, the tests run through the driver double and the NCCL double
//! (`tests/driver_double/`), which move each step between the ranks over a Unix socket; what
//! only a GPU shows (NCCL's transports, memcheck) is then skipped, saying so. With one GPU the
//! two ranks share it: each gets a host id of its own (`NCCL_HOSTID`), so NCCL sees two hosts and
//! moves every step over its socket transport on loopback (the NVLink runs become socket runs,
//! checked from NCCL's log).

mod common;
#[path = "common/double.rs"]
mod double;
#[path = "common/graphs.rs"]
mod graphs;

use std::collections::VecDeque;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use common::{Rng, devices_or_skip, say};
use graphs::layers_of;
use ppnrt::{
    CaptureError, CaptureMode, Engine, Error, PpConfig, PpError, PpNRt, StepGraphs, pp::PendingReadback,
    pp::ReceiverState,
};

const MODE_VAR: &str = "PPNRT_MP_MODE";
const STEPS_VAR: &str = "PPNRT_MP_STEPS";
const SEED_VAR: &str = "PPNRT_MP_SEED";
const OUT_VAR: &str = "PPNRT_MP_OUT";
const FAULT_VAR: &str = "PPNRT_MP_SKIP_TX_WAIT";
const DELAY_VAR: &str = "PPNRT_MP_MAX_DELAY_NS";
const IGNORE_SILENCE_VAR: &str = "PPNRT_MP_IGNORE_SILENCE";
/// A setup fault of one rank: `exit-before-comm-join` or `unwatched`.
const SETUP_FAULT_VAR: &str = "PPNRT_MP_SETUP_FAULT";
/// Graph mode: how long a rank waits before it captures its stages (ms).
const CAPTURE_DELAY_VAR: &str = "PPNRT_MP_CAPTURE_DELAY_MS";
const WAIT: Duration = Duration::from_secs(30);
/// The longest random device delay injected around a boundary (unless the test sets another).
const MAX_DELAY_NS: u64 = 40_000;

fn max_delay_ns() -> u64 {
    std::env::var(DELAY_VAR).ok().and_then(|v| v.parse().ok()).unwrap_or(MAX_DELAY_NS)
}

/// The length of step `t` (1 to 9000 elements; every rank draws the same). Steps come in runs of
/// six of one length, as a decode loop's steady size (boundaries from other ranks then receive
/// through captured graphs); a run's length is one of five lengths of the seed (so each slot's
/// captures are reused, and replaced when a slot keeps more sizes than it may), or, one run in
/// four, a fresh one (slots grow, and captures of their old memory must be dropped).
fn length_of(seed: u64, t: u64) -> usize {
    let run = t / 6;
    let mut draw = Rng::new(seed ^ run.wrapping_mul(0x9e37));
    if draw.below(4) == 0 {
        return 1 + draw.below(9000) as usize;
    }
    let kind = draw.below(5);
    1 + Rng::new(seed ^ 0x1e57 ^ kind.wrapping_mul(0x51)).below(9000) as usize
}

fn input_of(seed: u64, t: u64) -> Vec<f32> {
    Rng::new(seed.rotate_left(17) ^ t).vec_f32(length_of(seed, t))
}

/// FNV-1a over the values' bits.
fn digest(values: &[f32]) -> u64 {
    values.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, v| {
        v.to_bits().to_le_bytes().iter().fold(h, |h, &b| (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3))
    })
}

/// The whole model on one engine (the graph tests' reference): the expected digest of every step.
fn reference_digests(engine: &Engine, seed: u64, steps: u64) -> Vec<u64> {
    (0..steps).map(|t| digest(&graphs::reference(engine, &[input_of(seed, t)], |_| t as u32)[0])).collect()
}

/// The element count of every step in graph mode (one capture serves every step).
const GRAPH_N: usize = 5000;

fn graph_input_of(seed: u64, t: u64) -> Vec<f32> {
    Rng::new(seed.rotate_left(17) ^ t).vec_f32(GRAPH_N)
}

/// The expected digests of a graph-mode launch: step t's input through the whole model with the
/// step parameter of its slot (`t % slots`), as the captured graphs run it.
fn graph_reference_digests(engine: &Engine, seed: u64, steps: u64, slots: usize) -> Vec<u64> {
    (0..steps)
        .map(|t| digest(&graphs::reference(engine, &[graph_input_of(seed, t)], |_| (t % slots as u64) as u32)[0]))
        .collect()
}

fn nccl_or_skip(test: &str) -> bool {
    match ppnrt::nccl::nccl() {
        Ok(_) => true,
        Err(e) if std::env::var_os("PPNRT_REQUIRE_NCCL").is_none() => {
            say(&format!("SKIPPED {test}: {e}"));
            false
        }
        Err(e) => panic!("{test}: PPNRT_REQUIRE_NCCL is set but {e}"),
    }
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

fn scratch(name: &str) -> PathBuf {
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(format!("processes-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// One launch of the ranks.
struct Launch<'a> {
    mode: &'a str,
    ranks: &'a [usize],
    slots: usize,
    steps: u64,
    seed: u64,
    sockets: bool,
    /// A command that wraps rank 1 (compute-sanitizer).
    wrap_rank1: Option<&'a [String]>,
    /// Break the protocol on purpose: `rx` does not wait for the NCCL receive.
    broken: bool,
    /// The longest random device delay around each boundary, if not the default.
    max_delay_ns: Option<u64>,
    /// `PPNRT_PEER_TIMEOUT_MS`, if not 30 s.
    peer_timeout_ms: Option<u64>,
    /// Break the liveness check on purpose: a silent peer does not fail the link.
    ignore_silence: bool,
    /// Setup faults, by rank (see [`SETUP_FAULT_VAR`]).
    setup_faults: &'a [(usize, &'a str)],
    /// Variables set for one rank only (rank, name, value).
    rank_env: &'a [(usize, &'a str, &'a str)],
}

impl Launch<'_> {
    /// Starts one child per rank; rank r sees GPU r only.
    fn spawn(&self, dir: &Path, port: u16) -> Vec<Child> {
        let world = self.ranks.iter().max().unwrap() + 1;
        let exe = std::env::current_exe().unwrap();
        let devices = vec!["0"; self.ranks.len()].join(",");
        let shared = sharing_one_gpu();
        let ranks = self.ranks.iter().map(ToString::to_string).collect::<Vec<_>>().join(",");
        (0..world)
            .map(|rank| {
                let mut command = match (rank, self.wrap_rank1) {
                    (1, Some(wrap)) => {
                        let mut c = Command::new(&wrap[0]);
                        c.args(&wrap[1..]).arg(&exe);
                        c
                    }
                    _ => Command::new(&exe),
                };
                command
                    .args(["child_rank", "--exact", "--ignored", "--nocapture", "--test-threads=1"])
                    .env(MODE_VAR, self.mode)
                    .env(STEPS_VAR, self.steps.to_string())
                    .env(SEED_VAR, self.seed.to_string())
                    .env(OUT_VAR, dir)
                    .env("CUDA_VISIBLE_DEVICES", if shared { "0".to_string() } else { rank.to_string() })
                    .env("PPNRT_DEVICES", &devices)
                    .env("PPNRT_SLOTS", self.slots.to_string())
                    .env("PPNRT_RANKS", &ranks)
                    .env("PPNRT_RANK", rank.to_string())
                    .env("PPNRT_RENDEZVOUS", format!("127.0.0.1:{port}"))
                    .env("PPNRT_PEER_TIMEOUT_MS", self.peer_timeout_ms.unwrap_or(30_000).to_string())
                    .env("NCCL_DEBUG", "INFO")
                    .env("NCCL_DEBUG_SUBSYS", "INIT")
                    .env("NCCL_DEBUG_FILE", dir.join(format!("nccl-rank{rank}.%p.log")))
                    .stdout(Stdio::piped())
                    .stderr(Stdio::piped());
                if self.broken {
                    command.env(FAULT_VAR, "1");
                }
                if self.ignore_silence {
                    command.env(IGNORE_SILENCE_VAR, "1");
                }
                for (_, name, value) in self.rank_env.iter().filter(|(r, _, _)| *r == rank) {
                    command.env(name, value);
                }
                if let Some((_, fault)) = self.setup_faults.iter().find(|(r, _)| *r == rank) {
                    command.env(SETUP_FAULT_VAR, fault);
                }
                if let Some(ns) = self.max_delay_ns {
                    command.env(DELAY_VAR, ns.to_string());
                }
                if self.sockets || shared {
                    command.env("NCCL_P2P_DISABLE", "1").env("NCCL_SHM_DISABLE", "1").env("NCCL_SOCKET_IFNAME", "lo");
                }
                if shared {
                    // Two ranks on one GPU: NCCL refuses that within one host ("duplicate GPU").
                    command.env("NCCL_HOSTID", format!("ppnrt-test-rank-{rank}"));
                }
                command.spawn().unwrap()
            })
            .collect()
    }

    /// Runs the ranks to the end (at most `limit` a launch); returns each rank's (success,
    /// output). The rendezvous port is one the system handed out and the harness closed again, so
    /// another process (NCCL's own sockets included, seen with six test processes at once) can take
    /// it before rank 0 listens: rank 0 then fails with the typed `Address` error naming it and
    /// the launch is made again on another port, at most three times.
    fn run(&self, dir: &Path, limit: Duration) -> Vec<(bool, String)> {
        let mut attempt = 0;
        loop {
            attempt += 1;
            let port = free_port();
            let results = self.run_on(dir, limit, port);
            let taken = format!("Address {{ addr: \"127.0.0.1:{port}\", reason: \"Address already in use");
            if attempt < 3 && results.first().is_some_and(|(ok, output)| !ok && output.contains(&taken)) {
                say(&format!(
                    "{} ranks {:?}: port {port} was taken before rank 0 listened; launching again",
                    self.mode, self.ranks
                ));
                continue;
            }
            return results;
        }
    }

    fn run_on(&self, dir: &Path, limit: Duration, port: u16) -> Vec<(bool, String)> {
        let mut children = self.spawn(dir, port);
        let started = Instant::now();
        let deadline = started + limit;
        // A launch with a rank under a sanitizer is slow, not stalled.
        let mut stall_dump = stall_dump_after().filter(|_| self.wrap_rank1.is_none());
        while children.iter_mut().any(|c| c.try_wait().unwrap().is_none()) {
            if stall_dump.is_some_and(|after| started.elapsed() >= after) {
                stall_dump = None;
                dump_stalled(self, dir, &mut children, started.elapsed());
            }
            if Instant::now() > deadline {
                for child in &mut children {
                    let _ = child.kill();
                }
                let outputs: Vec<_> = children.into_iter().map(output_of).collect();
                panic!("{} ranks {:?} hung for {limit:?}:\n{outputs:#?}", self.mode, self.ranks);
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        children.into_iter().map(output_of).collect()
    }
}

/// `PPNRT_TEST_STALL_DUMP_S`: after how long a launch still running has its ranks' threads
/// dumped (a diagnosis of a hang; off unless set; the GPU gate sets it).
fn stall_dump_after() -> Option<Duration> {
    std::env::var("PPNRT_TEST_STALL_DUMP_S").ok()?.parse().ok().map(Duration::from_secs_f64)
}

/// Writes, for each rank still running, its threads (name, state, kernel wait channel) and, where
/// `cuda-gdb` or `gdb` is on the PATH, every thread's stack, into `dir/stall-rank<r>.txt`, and
/// says where.
fn dump_stalled(launch: &Launch<'_>, dir: &Path, children: &mut [Child], running: Duration) {
    let debugger = ["cuda-gdb", "gdb"].into_iter().find(|tool| {
        Command::new("sh").args(["-c", &format!("command -v {tool}")]).output().is_ok_and(|o| o.status.success())
    });
    for (rank, child) in children.iter_mut().enumerate() {
        if !matches!(child.try_wait(), Ok(None)) {
            continue;
        }
        let pid = child.id();
        let mut text = format!(
            "{} ranks {:?}: rank {rank} (pid {pid}) still running after {running:?}\n",
            launch.mode, launch.ranks
        );
        if let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) {
            for task in tasks.flatten() {
                let path = task.path();
                let read = |name: &str| std::fs::read_to_string(path.join(name)).unwrap_or_default();
                let stat = read("stat");
                let state = stat.rsplit(") ").next().and_then(|rest| rest.split(' ').next()).unwrap_or("?").to_string();
                text.push_str(&format!(
                    "task {} {:<16} state {state} wchan {}\n",
                    task.file_name().to_string_lossy(),
                    read("comm").trim(),
                    read("wchan").trim()
                ));
            }
        }
        if let Some(tool) = debugger {
            let stacks = Command::new("timeout")
                .args(["90", tool, "-p", &pid.to_string(), "-batch", "-ex", "thread apply all bt 30"])
                .output();
            match stacks {
                Ok(out) => {
                    text.push_str(&String::from_utf8_lossy(&out.stdout));
                    text.push_str(&String::from_utf8_lossy(&out.stderr));
                }
                Err(e) => text.push_str(&format!("{tool} did not run: {e}\n")),
            }
        }
        let file = dir.join(format!("stall-rank{rank}.txt"));
        std::fs::write(&file, &text).unwrap();
        say(&format!("stalled: rank {rank}'s threads (also in {}):\n{text}", file.display()));
    }
}

/// Checks that every rank of a launch named `name` exited successfully after its mode ran to
/// the end (`CHILD-OK`); else panics with every rank's output: a rank's failure is often
/// explained by what the other was doing.
fn every_rank_ok(name: &str, results: &[(bool, String)]) {
    let done = |(ok, output): &(bool, String)| *ok && output.contains("CHILD-OK");
    if !results.iter().all(done) {
        let outputs: String = results
            .iter()
            .enumerate()
            .map(|(rank, result)| {
                format!("---- rank {rank} ({}):\n{}\n", if done(result) { "ok" } else { "FAILED" }, result.1)
            })
            .collect();
        panic!("{name}: a rank failed:\n{outputs}");
    }
}

fn output_of(child: Child) -> (bool, String) {
    let out = child.wait_with_output().unwrap();
    (out.status.success(), format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr)))
}

fn read_digests(dir: &Path) -> Vec<u64> {
    let text = std::fs::read_to_string(dir.join("digests")).unwrap_or_default();
    text.lines().map(|line| u64::from_str_radix(line.trim(), 16).unwrap()).collect()
}

/// Whether the tests run through the driver and NCCL doubles (see
/// [`double::doubles_unless_a_gpu`]). Every test calls it first (through [`ready`]).
fn through_doubles() -> bool {
    double::doubles_unless_a_gpu()
}

/// Whether the ranks share GPU 0 (this machine has one), NCCL then over sockets.
fn sharing_one_gpu() -> bool {
    ppnrt::Device::count().is_ok_and(|count| count < 2)
}

fn ready(test: &str) -> Option<Engine> {
    if through_doubles() {
        say(&format!("{test}: no GPU: through the driver and NCCL doubles"));
    }
    devices_or_skip(test, 1)?;
    if sharing_one_gpu() {
        say(&format!("{test}: one GPU: both ranks share it, NCCL over sockets (NCCL_HOSTID per rank)"));
    }
    if !nccl_or_skip(test) {
        return None;
    }
    Some(Engine::new(0).unwrap())
}

/// The NCCL transports the ranks' NCCL logs (files in `dir`) name (`P2P/CUMEM`, `NET/Socket`, ...).
fn transports_used(dir: &Path) -> Vec<String> {
    let logs: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .flatten()
        .filter(|entry| entry.file_name().to_string_lossy().starts_with("nccl-rank"))
        .map(|entry| std::fs::read_to_string(entry.path()).unwrap_or_default())
        .collect();
    let mut found: Vec<String> = logs
        .iter()
        .flat_map(|log| log.lines())
        .filter_map(|line| line.split(" via ").nth(1))
        .map(|via| {
            via.split_whitespace()
                .next()
                .unwrap_or_default()
                .trim_end_matches(|c: char| c.is_ascii_digit() || c == '/')
                .to_string()
        })
        .collect();
    found.sort();
    found.dedup();
    found
}

/// The pipeline launch of `ranks` with a seed of its own.
fn pipeline_launch(ranks: &[usize], slots: usize, steps: u64, sockets: bool) -> Launch<'_> {
    let seed = 0x5eed ^ (ranks.len() as u64 * 31 + slots as u64) ^ u64::from(sockets);
    Launch {
        mode: "pipeline",
        ranks,
        slots,
        steps,
        seed,
        sockets,
        wrap_rank1: None,
        broken: false,
        max_delay_ns: None,
        peer_timeout_ms: None,
        ignore_silence: false,
        setup_faults: &[],
        rank_env: &[],
    }
}

/// Runs `launch` (a pipeline) and compares the last rank's digests with the one-engine
/// reference; returns how many steps differ.
fn mismatches_against_reference(engine: &Engine, name: &str, launch: &Launch<'_>) -> usize {
    let dir = scratch(name);
    let started = Instant::now();
    let results = launch.run(&dir, Duration::from_secs(240));
    every_rank_ok(name, &results);
    let transports = transports_used(&dir);
    if (launch.sockets || sharing_one_gpu()) && !through_doubles() {
        assert!(
            !transports.is_empty() && transports.iter().all(|t| t.starts_with("NET/Socket")),
            "{name}: NCCL was to use sockets only, its logs name {transports:?}"
        );
    }
    let got = read_digests(&dir);
    let expected = if launch.mode.starts_with("graphs") {
        graph_reference_digests(engine, launch.seed, launch.steps, launch.slots)
    } else {
        reference_digests(engine, launch.seed, launch.steps)
    };
    assert_eq!(got.len(), expected.len(), "{name}: the last rank reported {} of {} steps", got.len(), launch.steps);
    let mismatches = got.iter().zip(&expected).filter(|(a, b)| a != b).count();
    // Steps received through captured graphs, over every rank's inbound boundaries.
    let graph_receives: u64 = results
        .iter()
        .flat_map(|(_, output)| output.lines())
        .filter_map(|line| line.trim().strip_prefix("GRAPH-RECEIVES ")?.parse::<u64>().ok())
        .sum();
    say(&format!(
        "{name}: ranks {:?}, {} slot(s), {}{}: {mismatches} mismatches in {} {} steps, \
         {graph_receives} cross-rank receives through captured graphs ({:.1} s)",
        launch.ranks,
        launch.slots,
        if through_doubles() { "through the NCCL double".to_string() } else { format!("NCCL via {transports:?}") },
        if launch.broken { ", protocol broken on purpose" } else { "" },
        launch.steps,
        match launch.mode {
            "graphs" => "graph",
            "graphs-interleaved" => "graph and eager",
            "graphs-threads" => "graph (a thread per stage)",
            _ => "randomized",
        },
        started.elapsed().as_secs_f64()
    ));
    // With NCCL's support for captured receives turned off (`NCCL_GRAPH_MIXING_SUPPORT=0`, which
    // the ranks inherit) none may go through a graph. Else steps come in runs of one length, and
    // the receiver threads capture where they find the process's NCCL work complete: counted
    // here, and each test checks that its scenarios used captured graphs at all
    // (`assert_receives_captured`; one placement may keep NCCL busy on a loaded GPU).
    if captured_receives_off() {
        assert_eq!(graph_receives, 0, "{name}: receives went through captured graphs with NCCL_GRAPH_MIXING_SUPPORT=0");
    }
    GRAPH_RECEIVES.set(GRAPH_RECEIVES.get() + graph_receives);
    mismatches
}

thread_local! {
    /// Cross-rank receives through captured graphs in the scenarios this thread ran so far (a
    /// test runs its scenarios on its own thread).
    static GRAPH_RECEIVES: std::cell::Cell<u64> = const { std::cell::Cell::new(0) };
}

/// Checks that the scenarios `test` ran used captured receives (unless they are turned off).
fn assert_receives_captured(test: &str) {
    let graph_receives = GRAPH_RECEIVES.replace(0);
    assert!(
        captured_receives_off() || graph_receives > 0,
        "{test}: no receive of its scenarios went through a captured graph"
    );
}

/// Whether `NCCL_GRAPH_MIXING_SUPPORT=0` turns the ranks' captured receives off.
fn captured_receives_off() -> bool {
    std::env::var("NCCL_GRAPH_MIXING_SUPPORT").is_ok_and(|value| value.trim().parse::<i64>() == Ok(0))
}

fn matches_reference(engine: &Engine, name: &str, ranks: &[usize], slots: usize, steps: u64, sockets: bool) {
    let mismatches = mismatches_against_reference(engine, name, &pipeline_launch(ranks, slots, steps, sockets));
    assert_eq!(mismatches, 0, "{name}: outputs differ from one engine's");
}

#[test]
fn two_processes_match_one_engine_bitwise() {
    let test = "two_processes_match_one_engine_bitwise";
    let Some(engine) = ready(test) else { return };
    let quick = std::env::var_os("PPNRT_TEST_QUICK").is_some();
    matches_reference(&engine, "2-stages", &[0, 1], 2, if quick { 500 } else { 10_000 }, false);
    matches_reference(&engine, "4-contiguous", &[0, 0, 1, 1], 2, 500, false);
    matches_reference(&engine, "4-alternating", &[0, 1, 0, 1], 3, 500, false);
    matches_reference(&engine, "8-contiguous", &[0, 0, 0, 0, 1, 1, 1, 1], 2, 300, false);
    matches_reference(&engine, "8-alternating", &[0, 1, 0, 1, 0, 1, 0, 1], 4, 300, false);
    assert_receives_captured(test);
}

/// The check above can fail: with `rx` not waiting for the NCCL receive, outputs differ. Both
/// runs use long device delays before each send (up to 1 ms), so the data lands well after the
/// record that announces it.
#[test]
fn a_broken_protocol_across_processes_is_caught() {
    let test = "a_broken_protocol_across_processes_is_caught";
    let Some(engine) = ready(test) else { return };
    let sound = Launch { max_delay_ns: Some(1_000_000), ..pipeline_launch(&[0, 1], 2, 300, false) };
    let sound = mismatches_against_reference(&engine, "sound-long-delays", &sound);
    assert_eq!(sound, 0, "the protocol as specified must not mismatch");
    let broken = Launch { broken: true, max_delay_ns: Some(1_000_000), ..pipeline_launch(&[0, 1], 2, 300, false) };
    let broken = mismatches_against_reference(&engine, "broken-long-delays", &broken);
    assert!(broken > 0, "rx without waiting for the receive went unnoticed");
    assert_receives_captured(test);
}

/// Graph mode across processes: each rank captures its own stages' step once (`capture_step`)
/// and replays it (`launch`: this rank's stages in turn, each waiting for its input from the
/// rank before); the outputs are bitwise one engine's. The same with the protocol broken on
/// purpose (a stage's graph launched without waiting for the receive from the other rank,
/// behind a 1 ms spin before each send) mismatches.
#[test]
fn graph_mode_across_processes_matches_one_engine_bitwise() {
    let test = "graph_mode_across_processes_matches_one_engine_bitwise";
    let Some(engine) = ready(test) else { return };
    let graphs = |ranks, slots, steps| Launch { mode: "graphs", ..pipeline_launch(ranks, slots, steps, false) };
    for (name, ranks, slots, steps) in [
        ("graphs-2-stages", &[0, 1][..], 2, 500),
        ("graphs-4-contiguous", &[0, 0, 1, 1][..], 2, 300),
        ("graphs-4-alternating", &[0, 1, 0, 1][..], 3, 300),
    ] {
        let mismatches = mismatches_against_reference(&engine, name, &graphs(ranks, slots, steps));
        assert_eq!(mismatches, 0, "{name}: graph steps differ from one engine's");
    }
    // Rank 1 captures 300 ms late: rank 0's first steps have filled its slots by then, and its
    // capture keeps them (its graphs read them first).
    let late = [(1, CAPTURE_DELAY_VAR, "300")];
    let late = Launch { rank_env: &late, ..graphs(&[0, 1], 2, 200) };
    let mismatches = mismatches_against_reference(&engine, "graphs-rx-captures-late", &late);
    assert_eq!(mismatches, 0, "graphs-rx-captures-late: graph steps differ from one engine's");
    // Eager steps between graph steps, each rank on a pattern of its own.
    for (name, ranks, slots, steps) in [
        ("graphs-interleaved-2-stages", &[0, 1][..], 2, 300),
        ("graphs-interleaved-4-contiguous", &[0, 0, 1, 1][..], 2, 200),
        ("graphs-interleaved-4-alternating", &[0, 1, 0, 1][..], 3, 200),
    ] {
        let launch = Launch { mode: "graphs-interleaved", ..pipeline_launch(ranks, slots, steps, false) };
        let mismatches = mismatches_against_reference(&engine, name, &launch);
        assert_eq!(mismatches, 0, "{name}: interleaved graph and eager steps differ from one engine's");
    }
    // One thread per stage of each rank (`launch_stage`).
    for (name, ranks, slots, steps) in [
        ("graphs-threads-4-contiguous", &[0, 0, 1, 1][..], 2, 300),
        ("graphs-threads-4-alternating", &[0, 1, 0, 1][..], 3, 300),
    ] {
        let launch = Launch { mode: "graphs-threads", ..pipeline_launch(ranks, slots, steps, false) };
        let mismatches = mismatches_against_reference(&engine, name, &launch);
        assert_eq!(mismatches, 0, "{name}: graph steps of a thread per stage differ from one engine's");
    }
    // An eager receive taken out of turn makes the next launch refuse, typed, and lose nothing.
    let dir = scratch("graph-order");
    let order = Launch { mode: "graph-order", ..pipeline_launch(&[0, 1], 2, 0, false) };
    let results = order.run(&dir, Duration::from_secs(120));
    every_rank_ok("graph-order", &results);
    assert!(results[1].1.contains("GRAPH-INTERLEAVED"), "{}", results[1].1);
    assert!(results[1].1.contains("GRAPH-STEP-ORDER refused"), "{}", results[1].1);
    say("graph-order: graph, eager, graph steps read steps 0, 1, 2; a step taken out of turn: the next launch is \
         refused with GraphStepOrder, and the skipped steps still arrive");
    // The broken protocol shows only if a launch runs before its receive lands: with the GPU
    // shared by many ranks (stress runs) it can run late enough to read the right data, so the
    // spin before each send grows until the run catches it (1, 4, 16 ms around each boundary).
    let caught = [1_000_000, 4_000_000, 16_000_000].into_iter().any(|max_delay_ns| {
        let broken = Launch { broken: true, max_delay_ns: Some(max_delay_ns), ..graphs(&[0, 1], 2, 200) };
        mismatches_against_reference(&engine, "graphs-broken", &broken) > 0
    });
    assert!(caught, "a graph launched without waiting for the receive went unnoticed");
    assert_receives_captured(test);
}

#[test]
fn two_processes_over_sockets_match_one_engine_bitwise() {
    let test = "two_processes_over_sockets_match_one_engine_bitwise";
    let Some(engine) = ready(test) else { return };
    matches_reference(&engine, "sockets-2-stages", &[0, 1], 2, 2000, true);
    matches_reference(&engine, "sockets-4-alternating", &[0, 1, 0, 1], 2, 300, true);
    assert_receives_captured(test);
}

#[test]
fn the_contract_holds_across_processes() {
    let test = "the_contract_holds_across_processes";
    if ready(test).is_none() {
        return;
    }
    let dir = scratch("contract");
    let launch = Launch { mode: "contract", seed: 7, ..pipeline_launch(&[0, 1], 2, 0, false) };
    let results = launch.run(&dir, Duration::from_secs(120));
    for (rank, (ok, output)) in results.iter().enumerate() {
        say(&format!(
            "contract rank {rank}: {}",
            output.lines().filter(|l| l.starts_with("CHILD")).collect::<Vec<_>>().join(" | ")
        ));
        assert!(*ok && output.contains("CHILD-OK"), "rank {rank} failed:\n{output}");
    }
}

/// How long the NCCL double holds up the posting of a receive in
/// [`a_receive_held_up_while_posted_holds_up_no_other_slot`], and the lengths of its two steps
/// (different, so that each is posted by NCCL's receive call, not a captured graph).
const SLOW_POST: Duration = Duration::from_secs(3);
const SLOW_POST_LENGTHS: [usize; 2] = [1000, 700];

/// A receiver thread held up while it posts a step's receive (NCCL completing a connection, a
/// graph launch waiting for its previous launch) holds up neither the RX stage's receive of a
/// step it filled before nor a bounded wait for the held-up step: each returns on time (the
/// thread posts without the ring's lock). Through the NCCL double only, which can hold up a
/// receive call; skipped on a GPU, saying why.
#[test]
fn a_receive_held_up_while_posted_holds_up_no_other_slot() {
    let test = "a_receive_held_up_while_posted_holds_up_no_other_slot";
    if ready(test).is_none() {
        return;
    }
    if !through_doubles() {
        say(&format!("SKIPPED {test}: holding up NCCL's receive call needs the NCCL double"));
        return;
    }
    let dir = scratch("slow-post");
    // Rank 1's receive calls: the setup's probe, step 0, step 1 (held up).
    let held = format!("3:{}", SLOW_POST.as_millis());
    let rank_env = [(1, "PPNRT_NCCL_DOUBLE_SLOW_RECV", held.as_str())];
    let launch = Launch { mode: "slow-post", rank_env: &rank_env, ..pipeline_launch(&[0, 1], 2, 0, false) };
    let results = launch.run(&dir, Duration::from_secs(120));
    every_rank_ok(test, &results);
    let line = results[1].1.lines().find_map(|l| l.strip_prefix("CHILD-SLOW-POST ")).expect("rank 1's timings");
    let [first_ms, bounded_ms]: [u64; 2] =
        line.split_whitespace().map(|v| v.parse().unwrap()).collect::<Vec<_>>().try_into().unwrap();
    say(&format!(
        "{test}: with step 1's posting held up {SLOW_POST:?}: step 0 received after {first_ms} ms, \
         a wait of {:?} for step 1 timed out after {bounded_ms} ms",
        SLOW_POST / 10
    ));
    if let Some(state) = results[1].1.lines().find_map(|l| l.strip_prefix("CHILD receiver while held up: ")) {
        say(&format!("{test}: rank 1's receiver_state(0) meanwhile: {state}"));
    }
    let limit = (SLOW_POST / 3).as_millis() as u64;
    assert!(first_ms < limit, "receiving step 0 waited {first_ms} ms for step 1's posting");
    assert!(bounded_ms < limit, "a wait bounded by {:?} took {bounded_ms} ms", SLOW_POST / 10);
}

/// No receive is captured while another NCCL call of the process posts a send or receive: the
/// NCCL double refuses such a pair (ncclInternalError, the rank fails), and makes each send take
/// 3 ms and each receive 0.1 ms, so that a rank's stage thread is still sending step t + 1 on
/// boundary 0 when its receiver thread, told of step t + 1 on boundary 1 by the other rank, would
/// capture that receive if nothing kept them apart. Captured receives still happen (between the
/// sends), and the outputs match one engine's. Through the NCCL double only; skipped on a GPU, saying why (there the
/// stress of `scripts/stress-processes.sh` runs the real pair).
#[test]
fn no_receive_is_captured_while_another_nccl_call_posts() {
    let test = "no_receive_is_captured_while_another_nccl_call_posts";
    let Some(engine) = ready(test) else { return };
    if !through_doubles() {
        say(&format!("SKIPPED {test}: refusing a capture beside another NCCL call needs the NCCL double"));
        return;
    }
    if captured_receives_off() {
        say(&format!("SKIPPED {test}: NCCL_GRAPH_MIXING_SUPPORT=0 turns captured receives off"));
        return;
    }
    let rank_env = [(0, "PPNRT_NCCL_DOUBLE_POST_US", "3000:100"), (1, "PPNRT_NCCL_DOUBLE_POST_US", "3000:100")];
    // Rank 0 sends on boundaries 0 and 2 from its stage thread while its receiver thread of
    // boundary 1 captures; rank 1 the other way round.
    let launch = Launch { rank_env: &rank_env, ..pipeline_launch(&[0, 1, 0, 1], 2, 300, false) };
    let mismatches = mismatches_against_reference(&engine, "posting-apart", &launch);
    assert_eq!(mismatches, 0, "{test}: outputs differ from one engine's");
    assert_receives_captured(test);
}

/// A slot of a boundary from another rank grows (its receiver thread allocates) while the RX
/// stage's stream is being captured by the stage's thread: the capture is left alone (the slot is
/// the receive stream's memory), and the step arrives intact.
#[test]
fn a_slot_growing_leaves_a_capture_of_the_rx_stage_alone() {
    let test = "a_slot_growing_leaves_a_capture_of_the_rx_stage_alone";
    if ready(test).is_none() {
        return;
    }
    let dir = scratch("grow-in-capture");
    let launch = Launch { mode: "grow-in-capture", ..pipeline_launch(&[0, 1], 2, 0, false) };
    let results = launch.run(&dir, Duration::from_secs(120));
    every_rank_ok(test, &results);
    assert!(results[1].1.contains("CHILD-CAPTURE-WHOLE"), "{}", results[1].1);
    say(&format!("{test}: the capture ended whole; the step arrived intact"));
}

#[test]
fn a_killed_rank_is_a_typed_error_in_the_survivor() {
    let test = "a_killed_rank_is_a_typed_error_in_the_survivor";
    if ready(test).is_none() {
        return;
    }
    let (mut children, _dir) = running_ranks("kill", 9, None, false);
    let mut victim = children.pop().unwrap();
    victim.kill().unwrap(); // SIGKILL: no destructor, no goodbye
    let killed_at = unix_ms();
    let _ = victim.wait();
    let mut survivor = children.pop().unwrap();
    let limit = Instant::now() + Duration::from_secs(30);
    while survivor.try_wait().unwrap().is_none() {
        if Instant::now() > limit {
            survivor.kill().unwrap();
            panic!("the survivor hung for 30 s after its peer was killed:\n{:?}", output_of(survivor));
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    let (ok, output) = output_of(survivor);
    let reported = peer_failure(&output, killed_at);
    let Some((after, line)) = reported.filter(|_| ok) else {
        panic!("the survivor did not report a typed error:\n{output}");
    };
    say(&format!("{test}: typed error {after:?} after the kill: {line}"));
    assert!(after <= Duration::from_secs(10), "the typed error came {after:?} after the kill");
}

/// A rank that stops (SIGSTOP: alive, silent, its NCCL work stalled) mid-run is a typed error in
/// the survivor within 10 s, with a peer timeout of 2 s: the survivor's waits (for the stopped
/// rank's data, and on the host for a readback behind a receive that will not complete) end
/// when its watchdog fails the silent link and aborts its communicator. The check can fail: with
/// the liveness check off, the survivor reports nothing in 12 s.
#[test]
fn a_stopped_rank_is_a_typed_error_in_the_survivor() {
    let test = "a_stopped_rank_is_a_typed_error_in_the_survivor";
    if ready(test).is_none() {
        return;
    }
    let (after, line) = stop_a_rank("stop", false);
    let after = after.unwrap_or_else(|| panic!("{test}: the survivor did not report the stopped rank: {line}"));
    say(&format!("{test}: typed error {after:?} after the stop (peer timeout 2 s): {line}"));
    assert!(after <= Duration::from_secs(10), "the typed error came {after:?} after the stop");
    let (broken, line) = stop_a_rank("stop-no-liveness", true);
    say(&format!(
        "{test}: with the liveness check off: {}",
        broken.map_or("nothing in 12 s".into(), |d| format!("{d:?}: {line}"))
    ));
    assert!(broken.is_none(), "without the liveness check the survivor still reported the stopped rank: {line}");
}

/// A rank that dies during the setup (after the rendezvous, before it joins the NCCL
/// communicator of its boundary) is a typed error in the other rank within 10 s, with a peer
/// timeout of 30 s: the other's join, which NCCL would wait on for ever, ends as soon as the dead
/// rank's end of the boundary's connection closes. Broken on purpose (the setup unwatched: a
/// blocking join), the other rank reports nothing in 12 s.
#[test]
fn a_rank_that_dies_during_setup_is_a_typed_error_in_the_other() {
    let test = "a_rank_that_dies_during_setup_is_a_typed_error_in_the_other";
    if ready(test).is_none() {
        return;
    }
    let (after, line) = die_during_setup("setup-death", &[(1, "exit-before-comm-join")]);
    let after = after.unwrap_or_else(|| panic!("{test}: the surviving rank did not report the dead one: {line}"));
    say(&format!("{test}: typed error {after:?} after the exit: {line}"));
    assert!(after <= Duration::from_secs(10), "the typed error came {after:?} after the exit");
    let (broken, line) = die_during_setup("setup-death-unwatched", &[(0, "unwatched"), (1, "exit-before-comm-join")]);
    say(&format!(
        "{test}: with the setup unwatched: {}",
        broken.map_or("nothing in 12 s".into(), |d| format!("{d:?}: {line}"))
    ));
    assert!(broken.is_none(), "with the setup unwatched the surviving rank still reported: {line}");
}

/// Starts ranks [0, 1] in setup mode with `faults` (rank 1 exits before its join), waits for
/// rank 1's exit, then at most 12 s for rank 0's typed error; returns how long after the exit
/// it came, and its line (or the end of rank 0's output). Rank 0 is killed afterwards.
fn die_during_setup(name: &str, faults: &[(usize, &str)]) -> (Option<Duration>, String) {
    let dir = scratch(name);
    let launch = Launch { mode: "setup", setup_faults: faults, ..pipeline_launch(&[0, 1], 2, 0, false) };
    let mut children = launch.spawn(&dir, free_port());
    let mut victim = children.pop().unwrap();
    let mut survivor = children.pop().unwrap();
    let deadline = Instant::now() + Duration::from_secs(120);
    let status = loop {
        if let Some(status) = victim.try_wait().unwrap() {
            break status;
        }
        if Instant::now() > deadline {
            let _ = victim.kill();
            let _ = survivor.kill();
            panic!("{name}: rank 1 did not exit during its setup: {:?}", output_of(victim));
        }
        std::thread::sleep(Duration::from_millis(5));
    };
    let exited_at = unix_ms();
    assert_eq!(status.code(), Some(86), "{name}: rank 1 did not exit where the fault puts it: {:?}", output_of(victim));
    let limit = Instant::now() + Duration::from_secs(12);
    while survivor.try_wait().unwrap().is_none() && Instant::now() < limit {
        std::thread::sleep(Duration::from_millis(10));
    }
    let _ = survivor.kill();
    let (_, output) = output_of(survivor);
    match peer_failure(&output, exited_at) {
        Some((after, line)) => (Some(after), line),
        None => (None, output.lines().rev().take(5).collect::<Vec<_>>().join(" | ")),
    }
}

/// Starts ranks [0, 1, 0] in kill mode (rank 0 steps until a typed peer failure) and returns
/// them once rank 0 has run 50 steps, with their scratch folder.
fn running_ranks(name: &str, seed: u64, peer_timeout_ms: Option<u64>, ignore_silence: bool) -> (Vec<Child>, PathBuf) {
    let dir = scratch(name);
    let launch = Launch {
        mode: "kill",
        seed,
        peer_timeout_ms,
        ignore_silence,
        ..pipeline_launch(&[0, 1, 0], 2, u64::MAX, false)
    };
    let mut children = launch.spawn(&dir, free_port());
    let running = dir.join("running");
    let deadline = Instant::now() + Duration::from_secs(120);
    while !running.exists() {
        assert!(Instant::now() < deadline, "{name}: the ranks never got going");
        if let Some(status) = children[0].try_wait().unwrap() {
            let rest: Vec<_> = children.into_iter().map(output_of).collect();
            panic!("{name}: rank 0 exited early ({status}): {rest:#?}");
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    (children, dir)
}

/// The survivor's typed peer failure in `output`: how long after `since` (Unix ms) it came, and
/// its line.
fn peer_failure(output: &str, since: u64) -> Option<(Duration, String)> {
    let line = output.lines().find_map(|l| l.find("CHILD-PEER-FAILED").map(|at| l[at..].to_string()))?;
    let noticed_at: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some((Duration::from_millis(noticed_at.saturating_sub(since)), line))
}

/// Runs ranks [0, 1, 0] in kill mode with a peer timeout of 2 s, stops rank 1 once they run,
/// and waits at most 12 s for rank 0 to report a typed peer failure; returns how long after the
/// stop it did, and its line (or the end of its output). Both ranks are killed afterwards.
fn stop_a_rank(name: &str, ignore_silence: bool) -> (Option<Duration>, String) {
    let (mut children, _dir) = running_ranks(name, 13, Some(2_000), ignore_silence);
    let mut stopped = children.pop().unwrap();
    let status = Command::new("kill").args(["-STOP", &stopped.id().to_string()]).status().unwrap();
    assert!(status.success(), "{name}: kill -STOP failed");
    let stopped_at = unix_ms();
    let mut survivor = children.pop().unwrap();
    let limit = Instant::now() + Duration::from_secs(12);
    while survivor.try_wait().unwrap().is_none() && Instant::now() < limit {
        std::thread::sleep(Duration::from_millis(10));
    }
    let _ = survivor.kill();
    let _ = stopped.kill(); // SIGKILL ends a stopped process too
    let _ = stopped.wait();
    let (_, output) = output_of(survivor);
    match peer_failure(&output, stopped_at) {
        Some((after, line)) => (Some(after), line),
        None => (None, output.lines().rev().take(5).collect::<Vec<_>>().join(" | ")),
    }
}

#[test]
fn one_rank_under_memcheck() {
    let test = "one_rank_under_memcheck";
    if ready(test).is_none() {
        return;
    }
    if through_doubles() {
        say(&format!("SKIPPED {test}: memcheck needs a GPU (running through the doubles)"));
        return;
    }
    let sanitizer = std::env::var("PPNRT_COMPUTE_SANITIZER").unwrap_or_else(|_| "compute-sanitizer".into());
    if Command::new(&sanitizer).arg("--version").output().is_err() {
        say(&format!("SKIPPED {test}: `{sanitizer}` not found (set PPNRT_COMPUTE_SANITIZER)"));
        return;
    }
    // NCCL probes kernels of other architectures with `cudaFuncGetAttributes` and expects
    // `cudaErrorNoKernelImageForDevice`: API errors are not reported here (the crate's own API
    // use is checked, API errors included, by the gate's sanitizer phase on every other test).
    let wrap: Vec<String> = ["--tool", "memcheck", "--report-api-errors", "no", "--error-exitcode", "99"]
        .iter()
        .map(ToString::to_string)
        .collect();
    let wrap = [vec![sanitizer], wrap].concat();
    let dir = scratch("memcheck");
    let seed = 11;
    let launch = Launch { seed, wrap_rank1: Some(&wrap), ..pipeline_launch(&[0, 1], 2, 50, false) };
    let results = launch.run(&dir, Duration::from_secs(400));
    for (rank, (ok, output)) in results.iter().enumerate() {
        assert!(ok, "rank {rank} failed:\n{output}");
    }
    let summary = results[1].1.lines().find(|l| l.contains("ERROR SUMMARY")).unwrap_or("no summary").to_string();
    say(&format!("{test}: rank 1 under memcheck: {summary}"));
    assert!(summary.contains("0 errors"), "{}", results[1].1);
    let engine = Engine::new(0).unwrap();
    assert_eq!(read_digests(&dir), reference_digests(&engine, seed, 50));
}

fn unix_ms() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).unwrap().as_millis() as u64
}

#[test]
#[ignore = "one rank of the multi-process tests; run through them"]
fn child_rank() {
    let mode = std::env::var(MODE_VAR).expect("run through the parent tests");
    let steps: u64 = std::env::var(STEPS_VAR).unwrap().parse().unwrap();
    let seed: u64 = std::env::var(SEED_VAR).unwrap().parse().unwrap();
    let dir = PathBuf::from(std::env::var(OUT_VAR).unwrap());
    let primary = Engine::new(0).unwrap();
    let mut config = PpConfig::from_env().unwrap();
    if std::env::var_os(FAULT_VAR).is_some() {
        config = config.inject_fault(ppnrt::pp::ProtocolFault::SkipTxWait);
    }
    if std::env::var_os(IGNORE_SILENCE_VAR).is_some() {
        config = config.inject_fault(ppnrt::pp::ProtocolFault::IgnoreSilence);
    }
    match std::env::var(SETUP_FAULT_VAR).as_deref() {
        Ok("exit-before-comm-join") => config = config.inject_fault(ppnrt::pp::ProtocolFault::ExitBeforeCommJoin),
        Ok("unwatched") => config = config.inject_fault(ppnrt::pp::ProtocolFault::UnwatchedSetup),
        Ok(other) => panic!("unknown setup fault {other}"),
        Err(_) => {}
    }
    if mode == "setup" {
        // A peer dies during the setup: the setup's typed error, when it comes.
        match PpNRt::new(config, &primary) {
            Ok(rt) => println!("CHILD-SETUP-OK rank {}", rt.rank()),
            Err(e) => println!("CHILD-PEER-FAILED {} {e}", unix_ms()),
        }
        return;
    }
    let rt = PpNRt::new(config, &primary).unwrap();
    println!("CHILD rank {} built: {}", rt.rank(), rt.plan());
    let finished = AtomicBool::new(false);
    std::thread::scope(|scope| {
        if let Some(after) = stall_dump_after() {
            let (rt, finished) = (&rt, &finished);
            scope.spawn(move || report_a_stall(rt, finished, after.saturating_sub(Duration::from_secs(5))));
        }
        // Set however the mode ends (a panic included), so that the scope's join returns.
        let _finished = SetOnDrop(&finished);
        run_mode(&mode, &rt, &primary, seed, steps, &dir);
    });
    println!("CHILD-OK");
}

/// The step this rank's loop is at (its stage threads' furthest), for [`report_a_stall`].
static AT_STEP: AtomicU64 = AtomicU64::new(0);

fn at_step(t: u64) {
    AT_STEP.fetch_max(t, Ordering::Relaxed);
}

/// Sets its flag when dropped.
struct SetOnDrop<'a>(&'a AtomicBool);

impl Drop for SetOnDrop<'_> {
    fn drop(&mut self) {
        self.0.store(true, Ordering::Relaxed);
    }
}

/// Prints, once, where this rank stands when its loop has not moved for `after` (set a little
/// before the harness dumps the ranks' threads, see [`stall_dump_after`]): the step and each
/// receiver thread's state, so that a stalled launch's output says which step each side waits
/// for.
fn report_a_stall(rt: &PpNRt, finished: &AtomicBool, after: Duration) {
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

fn run_mode(mode: &str, rt: &PpNRt, primary: &Engine, seed: u64, steps: u64, dir: &Path) {
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
fn step(rt: &PpNRt, primary: &Engine, seed: u64, t: u64) -> Result<Option<ppnrt::CudaSlice<f32>>, Error> {
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

fn run_pipeline(rt: &PpNRt, primary: &Engine, seed: u64, steps: u64, dir: &Path) {
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
struct OutputDigests {
    pending: VecDeque<PendingReadback<f32>>,
    text: String,
}

impl OutputDigests {
    /// Reads a step's output back and digests the readbacks that are due (every one after the
    /// run's last step).
    fn add(&mut self, rt: &PpNRt, out: ppnrt::CudaSlice<f32>, last_step: bool) {
        self.pending.push_back(rt.readback(out).unwrap());
        while self.pending.len() > 4 || (last_step && !self.pending.is_empty()) {
            let done = self.pending.pop_front().unwrap();
            self.text.push_str(&format!("{:016x}\n", digest(done.wait().unwrap())));
        }
    }
}

/// The end of a rank's run: its streams idle, its receives through captured graphs counted for
/// the parent (`GRAPH-RECEIVES`), and the digests written where it ran the last stage.
fn finish_run(rt: &PpNRt, dir: &Path, digests: Option<String>) {
    rt.synchronize().unwrap();
    let graph_receives: u64 = (0..rt.n_boundaries()).map(|b| rt.graph_receives(b).unwrap()).sum();
    println!("GRAPH-RECEIVES {graph_receives}");
    if let Some(digests) = digests {
        std::fs::write(dir.join("digests"), digests).unwrap();
    }
}

/// How a rank replays its graph steps.
#[derive(Clone, Copy, PartialEq, Eq)]
enum GraphDriver {
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
fn run_graphs(rt: &PpNRt, primary: &Engine, seed: u64, steps: u64, dir: &Path, driver: GraphDriver) {
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
fn graph_steps_one_thread(
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
fn graph_steps_thread_per_stage(
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
fn eager_graph_step(
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
fn graph_order(rt: &PpNRt, primary: &Engine) {
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
fn contract(rt: &PpNRt, primary: &Engine) {
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
            assert!(matches!(rt.tx(0, &x, n + 1).unwrap_err(), Error::OutOfBounds { .. }));
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
fn slow_post(rt: &PpNRt, primary: &Engine) {
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
fn grow_in_capture(rt: &PpNRt, primary: &Engine, dir: &Path) {
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
fn refused_in_capture(rt: &PpNRt, stage: usize, name: &str, call: impl FnOnce() -> Result<(), Error>) {
    let capture = rt.stage_stream(stage).unwrap().begin_capture(CaptureMode::Relaxed).unwrap();
    let captured = call().unwrap_err();
    assert!(matches!(&captured, Error::Capture(CaptureError::IllegalCall { call }) if *call == name), "{captured}");
    let ended = capture.end().unwrap_err();
    assert!(matches!(ended, Error::Capture(CaptureError::Invalidated { .. })), "{ended}");
    println!("CHILD capture refused: {captured}");
}

/// Runs steps until a call fails; the failure must be `PeerFailed` (printed with the time).
fn survive_a_kill(rt: &PpNRt, primary: &Engine, seed: u64, dir: &Path) {
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
