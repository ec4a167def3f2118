//! Launching the ranks of a test as child processes of this binary, and reading what they
//! wrote: the launch, its stall dumps, the digests and the transports used.

use super::*;

/// One launch of the ranks.
pub(crate) struct Launch<'a> {
    pub(crate) mode: &'a str,
    pub(crate) ranks: &'a [usize],
    pub(crate) slots: usize,
    pub(crate) steps: u64,
    pub(crate) seed: u64,
    pub(crate) sockets: bool,
    /// A command that wraps rank 1 (compute-sanitizer).
    pub(crate) wrap_rank1: Option<&'a [String]>,
    /// Break the protocol on purpose: `rx` does not wait for the NCCL receive.
    pub(crate) broken: bool,
    /// The longest random device delay around each boundary, if not the default.
    pub(crate) max_delay_ns: Option<u64>,
    /// `PPNRT_PEER_TIMEOUT_MS`, if not 30 s.
    pub(crate) peer_timeout_ms: Option<u64>,
    /// Break the liveness check on purpose: a silent peer does not fail the link.
    pub(crate) ignore_silence: bool,
    /// Setup faults, by rank (see [`SETUP_FAULT_VAR`]).
    pub(crate) setup_faults: &'a [(usize, &'a str)],
    /// Variables set for one rank only (rank, name, value).
    pub(crate) rank_env: &'a [(usize, &'a str, &'a str)],
}

impl Launch<'_> {
    /// Starts one child per rank; rank r sees GPU r only.
    pub(crate) fn spawn(&self, dir: &Path, port: u16) -> Vec<Child> {
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
                // Over NCCL unless the launch says otherwise (in `rank_env`, see `OVER_IPC`).
                command.env("PPNRT_PROCESS_TRANSPORT", "nccl");
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
    /// output). The rendezvous port is free when picked ([`crate::common::rendezvous_port`], below
    /// the ephemeral range, so no connection takes it), but another process that binds it
    /// explicitly before rank 0 listens makes rank 0 fail with the typed `Address` error naming
    /// it: the launch is then made again on another port, at most three times.
    pub(crate) fn run(&self, dir: &Path, limit: Duration) -> Vec<(bool, String)> {
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

    pub(crate) fn run_on(&self, dir: &Path, limit: Duration, port: u16) -> Vec<(bool, String)> {
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
pub(crate) fn stall_dump_after() -> Option<Duration> {
    std::env::var("PPNRT_TEST_STALL_DUMP_S").ok()?.parse().ok().map(Duration::from_secs_f64)
}

/// Writes, for each rank still running, its threads (name, state, kernel wait channel) and, where
/// `cuda-gdb` or `gdb` is on the PATH, every thread's stack, into `dir/stall-rank<r>.txt`, and
/// says where.
pub(crate) fn dump_stalled(launch: &Launch<'_>, dir: &Path, children: &mut [Child], running: Duration) {
    let label = format!("{} ranks {:?}", launch.mode, launch.ranks);
    dump_threads(&label, dir, children, running);
}

/// [`dump_stalled`] for ranks named by `label`: each still running rank's threads and stacks.
pub(crate) fn dump_threads(label: &str, dir: &Path, children: &mut [Child], running: Duration) {
    let debugger = ["cuda-gdb", "gdb"].into_iter().find(|tool| {
        Command::new("sh").args(["-c", &format!("command -v {tool}")]).output().is_ok_and(|o| o.status.success())
    });
    for (rank, child) in children.iter_mut().enumerate() {
        if !matches!(child.try_wait(), Ok(None)) {
            continue;
        }
        let pid = child.id();
        let mut text = format!("{label}: rank {rank} (pid {pid}) still running after {running:?}\n");
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
pub(crate) fn every_rank_ok(name: &str, results: &[(bool, String)]) {
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

pub(crate) fn output_of(child: Child) -> (bool, String) {
    let out = child.wait_with_output().unwrap();
    (out.status.success(), format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr)))
}

pub(crate) fn read_digests(dir: &Path) -> Vec<u64> {
    let text = std::fs::read_to_string(dir.join("digests")).unwrap_or_default();
    text.lines().map(|line| u64::from_str_radix(line.trim(), 16).unwrap()).collect()
}

/// Whether the tests run through the driver and NCCL doubles (see
/// [`double::doubles_unless_a_gpu`]). Every test calls it first (through [`ready`]).
pub(crate) fn through_doubles() -> bool {
    double::doubles_unless_a_gpu()
}

/// Whether the ranks share GPU 0 (this machine has one), NCCL then over sockets.
pub(crate) fn sharing_one_gpu() -> bool {
    ppnrt::Device::count().is_ok_and(|count| count < 2)
}

pub(crate) fn ready(test: &str) -> Option<Engine> {
    if through_doubles() {
        say(&format!("{test}: no GPU: through the driver and NCCL doubles"));
    }
    let gpus = requires(test, Needs::gpus(1).nccl())?;
    if sharing_one_gpu() {
        say(&format!("{test}: one GPU: both ranks share it, NCCL over sockets (NCCL_HOSTID per rank)"));
    }
    Some(gpus.engine(0))
}

/// The NCCL transports the ranks' NCCL logs (files in `dir`) name (`P2P/CUMEM`, `NET/Socket`, ...).
pub(crate) fn transports_used(dir: &Path) -> Vec<String> {
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

/// The `rank_env` of a launch of two ranks over the IPC transport, with slots for the largest
/// step of the pipeline modes (launches are over NCCL otherwise).
pub(crate) const OVER_IPC: &[(usize, &str, &str)] = &[
    (0, "PPNRT_PROCESS_TRANSPORT", "ipc"),
    (1, "PPNRT_PROCESS_TRANSPORT", "ipc"),
    (0, "PPNRT_RESERVE_BYTES", "1048576"),
    (1, "PPNRT_RESERVE_BYTES", "1048576"),
];

/// The pipeline launch of `ranks` with a seed of its own.
pub(crate) fn pipeline_launch(ranks: &[usize], slots: usize, steps: u64, sockets: bool) -> Launch<'_> {
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
pub(crate) fn mismatches_against_reference(engine: &Engine, name: &str, launch: &Launch<'_>) -> usize {
    let dir = scratch(name);
    let started = Instant::now();
    let results = launch.run(&dir, Duration::from_secs(240));
    every_rank_ok(name, &results);
    let transports = transports_used(&dir);
    let over_ipc = launch.rank_env.iter().any(|&(_, name, value)| name == "PPNRT_PROCESS_TRANSPORT" && value == "ipc");
    if over_ipc && !through_doubles() {
        // The steps moved between the ranks' own mappings: NCCL connected nothing.
        assert!(transports.is_empty(), "{name}: over IPC, NCCL's logs name {transports:?}");
    } else if (launch.sockets || sharing_one_gpu()) && !through_doubles() {
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
pub(crate) fn assert_receives_captured(test: &str) {
    let graph_receives = GRAPH_RECEIVES.replace(0);
    assert!(
        captured_receives_off() || graph_receives > 0,
        "{test}: no receive of its scenarios went through a captured graph"
    );
}

/// Whether `NCCL_GRAPH_MIXING_SUPPORT=0` turns the ranks' captured receives off.
pub(crate) fn captured_receives_off() -> bool {
    std::env::var("NCCL_GRAPH_MIXING_SUPPORT").is_ok_and(|value| value.trim().parse::<i64>() == Ok(0))
}

pub(crate) fn matches_reference(engine: &Engine, name: &str, ranks: &[usize], slots: usize, steps: u64, sockets: bool) {
    let mismatches = mismatches_against_reference(engine, name, &pipeline_launch(ranks, slots, steps, sockets));
    assert_eq!(mismatches, 0, "{name}: outputs differ from one engine's");
}

/// How long the NCCL double holds up the posting of a receive in
/// [`a_receive_held_up_while_posted_holds_up_no_other_slot`], and the lengths of its two steps
/// (different, so that each is posted by NCCL's receive call, not a captured graph).
pub(crate) const SLOW_POST: Duration = Duration::from_secs(3);
pub(crate) const SLOW_POST_LENGTHS: [usize; 2] = [1000, 700];

/// Starts ranks [0, 1] in setup mode with `faults` (rank 1 exits before its join), waits for
/// rank 1's exit, then at most 12 s for rank 0's typed error; returns how long after the exit
/// it came, and its line (or the end of rank 0's output). Rank 0 is killed afterwards.
pub(crate) fn die_during_setup(name: &str, faults: &[(usize, &str)]) -> (Option<Duration>, String) {
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
    if status.code() != Some(86) {
        let _ = survivor.kill();
        panic!(
            "{name}: rank 1 did not exit where the fault puts it ({status}): {:?}; rank 0: {:?}",
            output_of(victim),
            output_of(survivor)
        );
    }
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
pub(crate) fn running_ranks(
    name: &str,
    seed: u64,
    peer_timeout_ms: Option<u64>,
    ignore_silence: bool,
    rank_env: &'static [(usize, &'static str, &'static str)],
) -> (Vec<Child>, PathBuf) {
    let dir = scratch(name);
    let launch = Launch {
        mode: "kill",
        seed,
        peer_timeout_ms,
        ignore_silence,
        rank_env,
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
pub(crate) fn peer_failure(output: &str, since: u64) -> Option<(Duration, String)> {
    let line = output.lines().find_map(|l| l.find("CHILD-PEER-FAILED").map(|at| l[at..].to_string()))?;
    let noticed_at: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some((Duration::from_millis(noticed_at.saturating_sub(since)), line))
}

/// Runs ranks [0, 1, 0] in kill mode with a peer timeout of 2 s, stops rank 1 once they run,
/// and waits at most 12 s for rank 0 to report a typed peer failure; returns how long after the
/// stop it did, and its line (or the end of its output). Both ranks are killed afterwards.
pub(crate) fn stop_a_rank(
    name: &str,
    ignore_silence: bool,
    rank_env: &'static [(usize, &'static str, &'static str)],
) -> (Option<Duration>, String) {
    let (mut children, _dir) = running_ranks(name, 13, Some(2_000), ignore_silence, rank_env);
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
