//! The fault campaign across processes, through the CUDA driver and NCCL doubles (no GPU): a
//! three-rank pipeline ([0, 1, 2], one stage each, each rank a thread with a runtime of its own)
//! runs a decode loop of the toy model while one fault strikes at a random step: a rank goes
//! away (its runtime dropped mid-run, as a process that exits), NCCL reports an asynchronous error
//! in a random rank, rank 0 announces a step and never sends it, a sending rank's record is
//! forged (altered after its seal), replayed or cut short, strangers (silent, garbage, a wrong
//! secret) crowd rank 0's rendezvous during the setup, or NCCL's asynchronous-error poll fails
//! during the setup, as a rank's link posts its first receive (which NCCL completes in the
//! background). Every rank reads every step it receives; the last rank reads each output back
//! and checks it bitwise against one engine.
//!
//! The boundaries between the ranks are NCCL's in one cycle of the faults and IPC in the next.
//! With `PPNRT_CAMPAIGN_MIXED=1`, every third cycle runs over one of each (rank 1 receiving over
//! one and sending over the other: devices [0, 1, 1] or [1, 1, 0] with peer access off, so that
//! only the boundary within a device can be IPC). Off by default: once in a fresh-clone CI run
//! (debug build, the first mixed run, no fault) the NCCL double reported a receive captured into
//! a graph while one NCCL operation of the process had not run ("a call posted into a capture
//! while 1 NCCL operation(s) of the process had not run"), and the receive failed, typed; not
//! understood yet (450 release runs under load with 144 mixed ones passed, as did another CI
//! run).
//!
//! Every run must end, on every rank, with exact outputs or with a typed error, within its bound:
//! never wrong data as `Ok`, never a hang, and nothing touches freed memory (the doubles check
//! every copy, send and receive when it runs). The counts are printed (and kept in
//! `docs/RELIABILITY.md`).
//!
//! `cargo test` runs one round of 45 runs. Races show more often under load and in a release
//! build: `PPNRT_CAMPAIGN_ROUNDS=<n>` runs `n` rounds (each draws its own steps) and
//! `PPNRT_CAMPAIGN_LOAD=<k>` keeps `k` threads busy meanwhile, e.g.
//! `PPNRT_CAMPAIGN_ROUNDS=20 PPNRT_CAMPAIGN_LOAD=2 cargo test --release --test campaign` (CI).

#[path = "../common/mod.rs"]
mod common;

#[path = "../common/double.rs"]
mod double;

use std::sync::{Barrier, mpsc};
use std::time::{Duration, Instant};

use common::Rng;
use double::with_double;
use ppnrt::nccl::{NcclComm, NcclError, NcclUniqueId, P2p, group};
use ppnrt::{CudaSlice, CudaStream, Engine, Error, JobAccess, JobSecret, PpConfig, PpError, PpNRt, Transport};

const N: usize = 2048;
const LAYERS: u32 = 3;
const STEPS: u32 = 40;
const SECRET: &str = "the campaign's job secret, 32 by";

/// The transports of a run's two boundaries.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Carriers {
    Nccl,
    Ipc,
    /// One of each: IPC first (devices [1, 1, 0]) or NCCL first ([0, 1, 1]), peer access off.
    Mixed {
        ipc_first: bool,
    },
}

impl Carriers {
    /// The stages' devices, the setting between ranks, and the transports the plan must give.
    fn devices(self) -> [i32; 3] {
        match self {
            Carriers::Nccl | Carriers::Ipc => [0, 1, 0],
            Carriers::Mixed { ipc_first: true } => [1, 1, 0],
            Carriers::Mixed { ipc_first: false } => [0, 1, 1],
        }
    }

    fn setting(self) -> ppnrt::ProcessTransport {
        match self {
            Carriers::Nccl => ppnrt::ProcessTransport::Nccl,
            Carriers::Ipc => ppnrt::ProcessTransport::Ipc,
            Carriers::Mixed { .. } => ppnrt::ProcessTransport::Auto,
        }
    }

    fn planned(self) -> [Transport; 2] {
        match self {
            Carriers::Nccl => [Transport::Nccl; 2],
            Carriers::Ipc => [Transport::Ipc; 2],
            Carriers::Mixed { ipc_first: true } => [Transport::Ipc, Transport::Nccl],
            Carriers::Mixed { ipc_first: false } => [Transport::Nccl, Transport::Ipc],
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq)]
enum Fault {
    None,
    /// Rank `rank` goes away before step `step`.
    RankGone {
        rank: usize,
        step: u32,
    },
    /// NCCL's next asynchronous-error poll fails (in whichever rank polls first) at step `step`.
    AsyncError {
        step: u32,
    },
    /// Rank 0 announces its steps and never sends them.
    AnnounceOnly,
    /// Strangers at rank 0's rendezvous during the setup.
    Strangers,
    /// Rank `rank` (0 or 1) alters its record of step `step` after sealing it.
    Forged {
        rank: usize,
        step: u64,
    },
    /// Rank `rank` writes its record of step `step` twice.
    Replayed {
        rank: usize,
        step: u64,
    },
    /// Rank `rank` writes half its record of step `step` and ends the connection.
    Truncated {
        rank: usize,
        step: u64,
    },
    /// During the setup, every poll of NCCL's asynchronous error fails for `ms` after a rank
    /// posts its first receive (a link's first message), in whichever ranks poll.
    SetupAsyncError {
        ms: u64,
    },
}

/// How one rank's run ended.
#[derive(Debug)]
enum Ended {
    /// Every step done (and, on the last rank, checked exact).
    Exact(u32),
    /// A typed error after `done` steps.
    Typed { done: u32, error: String },
}

fn input(step: u32) -> Vec<f32> {
    (0..N).map(|i| ppnrt::kernels::pattern(step, i as u64) as f32 / u32::MAX as f32 - 0.5).collect()
}

/// One rank's loop; returns how it ended, or `Err` for wrong data delivered as `Ok`.
fn rank_loop(rank: usize, rt: PpNRt, fault: Fault, wait: Duration) -> Result<Ended, String> {
    let primary = Engine::new(0).map_err(|e| e.to_string())?;
    let engine = rt.engine(rank, &primary).map_err(|e| e.to_string())?.clone();
    let typed = |done: u32, e: Error| -> Result<Ended, String> {
        match e {
            Error::Pipeline(PpError::PeerFailed { .. } | PpError::Timeout { .. }) | Error::Nccl(_) => {
                Ok(Ended::Typed { done, error: e.to_string() })
            }
            other => Err(format!("rank {rank}: an untyped or unexpected error after {done} steps: {other}")),
        }
    };
    let mut pending = std::collections::VecDeque::new();
    for step in 0..STEPS {
        if fault == (Fault::RankGone { rank, step }) {
            return Ok(Ended::Typed { done: step, error: "went away".into() });
        }
        if fault == (Fault::AsyncError { step }) && rank == 0 {
            double::nccl_double().fail("ncclCommGetAsyncError", 1, 3);
        }
        let _stage = match rt.enter(rank) {
            Ok(stage) => stage,
            Err(e) => return typed(step, e),
        };
        let mut x = if rank == 0 {
            engine.htod(&input(step)).map_err(|e| e.to_string())?
        } else {
            match rt.rx_wait::<f32>(rank - 1, (step % rt.n_slots() as u32) as usize, N, wait) {
                Ok(x) => x,
                Err(e) => return typed(step, e),
            }
        };
        for layer in 0..LAYERS {
            engine.toy_layer(&mut x, step, rank as u32 * LAYERS + layer).map_err(|e| e.to_string())?;
        }
        if rank < 2 {
            if let Err(e) = rt.tx_wait(rank, &x, N, wait) {
                return typed(step, e);
            }
        } else {
            match rt.readback(x) {
                Ok(readback) => pending.push_back((step, readback)),
                Err(e) => return typed(step, e),
            }
            // The reference is computed on device 0, outside the stage (which may be on another).
            drop(_stage);
            while pending.len() > 2 || (step + 1 == STEPS && !pending.is_empty()) {
                let (done, readback) = pending.pop_front().expect("pending");
                let values = match readback.wait() {
                    Ok(values) => values.to_vec(),
                    Err(e) => return typed(done, e),
                };
                let mut reference = primary.htod(&input(done)).map_err(|e| e.to_string())?;
                for layer in 0..3 * LAYERS {
                    primary.toy_layer(&mut reference, done, layer).map_err(|e| e.to_string())?;
                }
                let reference = primary.dtoh(&reference).map_err(|e| e.to_string())?;
                if values.iter().zip(&reference).any(|(a, b)| a.to_bits() != b.to_bits()) {
                    return Err(format!("rank 2: step {done} read back as Ok with wrong values ({fault:?})"));
                }
            }
        }
    }
    Ok(Ended::Exact(STEPS))
}

/// Strangers at `addr` while the ranks meet: silent connections, garbage, and a process with
/// another secret. They come once rank 0 listens: a connection to a port nobody listens on can
/// connect to itself (TCP's simultaneous open, when the kernel picks that port for its own end),
/// and would hold the port rank 0 is about to bind.
fn crowd(addr: String) {
    let port = addr.rsplit(':').next().and_then(|port| port.parse::<u16>().ok()).expect("an address with a port");
    let mut held = Vec::new();
    let listening = Instant::now() + Duration::from_secs(5);
    while Instant::now() < listening {
        match std::net::TcpStream::connect(&addr) {
            Ok(stream) if stream.local_addr().is_ok_and(|own| own.port() != port) => {
                held.push(stream);
                break;
            }
            // Connected to itself (dropped at once), or nobody listens yet.
            Ok(_) | Err(_) => std::thread::sleep(Duration::from_millis(2)),
        }
    }
    let deadline = Instant::now() + Duration::from_millis(600);
    while Instant::now() < deadline {
        if let Ok(mut stream) = std::net::TcpStream::connect(&addr) {
            let _ = std::io::Write::write_all(&mut stream, b"GET / HTTP/1.0\r\n\r\n");
            held.push(stream);
        }
        let stranger = ppnrt::rendezvous::Rendezvous {
            addr: addr.clone(),
            rank: 1,
            world: 3,
            fingerprint: "a stranger".into(),
            timeout: Duration::from_millis(200),
            access: JobAccess::Secret(JobSecret::new("a stranger's guess at the secret").unwrap()),
        };
        let _ = stranger.join();
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Makes the calls of the NCCL double's `ncclCommGetAsyncError` fail for `ms` once a rank posts
/// its first receive after `recvs_before` (waited for at most 5 s): the double's fault table is
/// filled anew (eight faults, each of the next call) every 50 µs meanwhile.
fn fail_polls_after_first_receive(recvs_before: u64, ms: u64) {
    let nccl = double::nccl_double();
    let deadline = Instant::now() + Duration::from_secs(5);
    while nccl.calls("ncclRecv") == recvs_before && Instant::now() < deadline {
        std::hint::spin_loop();
    }
    let until = Instant::now() + Duration::from_millis(ms);
    while Instant::now() < until {
        nccl.clear_faults();
        for _ in 0..8 {
            nccl.fail("ncclCommGetAsyncError", 1, 3);
        }
        std::thread::sleep(Duration::from_micros(50));
    }
    nccl.clear_faults();
}

/// A number from the environment variable `name`, else `default`.
fn from_env(name: &str, default: usize) -> usize {
    std::env::var(name).map_or(default, |value| value.parse().unwrap_or_else(|_| panic!("{name}={value:?}: a count")))
}

#[test]
fn every_run_ends_exact_or_typed_on_every_rank_never_wrong_never_hung() {
    with_double("every_run_ends_exact_or_typed_on_every_rank_never_wrong_never_hung", |double| {
        let rounds = from_env("PPNRT_CAMPAIGN_ROUNDS", 1);
        let stop_load = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let load: Vec<_> = (0..from_env("PPNRT_CAMPAIGN_LOAD", 0))
            .map(|_| {
                let stop = std::sync::Arc::clone(&stop_load);
                std::thread::spawn(move || {
                    while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                        std::hint::spin_loop();
                    }
                })
            })
            .collect();
        // SAFETY: tests through the double run one at a time (`with_double` holds its lock), and
        // nothing else of this process reads the environment while this test sets it.
        unsafe {
            std::env::set_var("PPNRT_NCCL_DOUBLE_ORPHAN_RECV", "1");
            std::env::set_var("PPNRT_NCCL_DOUBLE_ASYNC_SEND", "1");
        }
        // Long enough that a busy machine's stalls are no silence (signs of life go out every
        // tenth of it), short enough that a run with a dead peer ends in seconds.
        let peer_timeout = Duration::from_millis(1500);
        let wait = Duration::from_secs(4);
        let bound = Duration::from_secs(20);
        let runs = 45 * rounds;
        // NCCL, IPC, and (`PPNRT_CAMPAIGN_MIXED=1`, see the module docs) one of each.
        let cycles = if from_env("PPNRT_CAMPAIGN_MIXED", 0) == 1 { 3 } else { 2 };
        let mut rng = Rng::new(0xca3a_1914);
        let (mut exact, mut typed_runs, mut typed_ranks) = (0, 0, 0);
        let mut by_fault = std::collections::BTreeMap::<&str, usize>::new();
        let mut by_carriers = std::collections::BTreeMap::<String, usize>::new();
        let mut samples = std::collections::BTreeMap::<&str, String>::new();
        for run in 0..runs {
            let (sender, step) = (rng.below(2) as usize, rng.below(u64::from(STEPS)));
            let fault = match run % 9 {
                0 => Fault::None,
                1 => Fault::RankGone { rank: rng.below(3) as usize, step: step as u32 },
                2 => Fault::AsyncError { step: step as u32 },
                3 => Fault::AnnounceOnly,
                4 => Fault::Forged { rank: sender, step },
                5 => Fault::Replayed { rank: sender, step },
                6 => Fault::Truncated { rank: sender, step },
                7 => Fault::Strangers,
                _ => Fault::SetupAsyncError { ms: 1 + step % 8 },
            };
            let name = match fault {
                Fault::None => "none",
                Fault::RankGone { .. } => "a rank goes away",
                Fault::AsyncError { .. } => "an NCCL asynchronous error",
                Fault::AnnounceOnly => "a step announced, never sent",
                Fault::Strangers => "strangers at the rendezvous",
                Fault::Forged { .. } => "a record forged",
                Fault::Replayed { .. } => "a record replayed",
                Fault::Truncated { .. } => "a record cut short",
                Fault::SetupAsyncError { .. } => "an NCCL poll failing in the setup",
            };
            *by_fault.entry(name).or_default() += 1;
            // Every fault over both transports between ranks of one host, and over one of each.
            let carriers = match ((run / 9) % cycles, run / (9 * cycles)) {
                (0, _) => Carriers::Nccl,
                (1, _) => Carriers::Ipc,
                (_, round) => Carriers::Mixed { ipc_first: round % 2 == 1 },
            };
            *by_carriers.entry(format!("{carriers:?}")).or_default() += 1;
            double.no_peer(matches!(carriers, Carriers::Mixed { .. }));
            let port = common::rendezvous_port();
            let addr = format!("127.0.0.1:{port}");
            if fault == Fault::Strangers {
                let addr = addr.clone();
                std::thread::spawn(move || crowd(addr));
            }
            let poll_fault = match fault {
                Fault::SetupAsyncError { ms } => {
                    let recvs = double::nccl_double().calls("ncclRecv");
                    Some(std::thread::spawn(move || fail_polls_after_first_receive(recvs, ms)))
                }
                _ => None,
            };
            let (done, ended) = mpsc::channel();
            let started = Instant::now();
            for rank in 0..3 {
                let (done, addr) = (done.clone(), addr.clone());
                std::thread::spawn(move || {
                    let primary = Engine::new(0).unwrap();
                    let mut config = PpConfig::with_devices(&carriers.devices())
                        .with_ranks(&[0, 1, 2])
                        .with_rank(rank)
                        .with_rendezvous(&addr)
                        .with_peer_timeout(peer_timeout)
                        .with_job_access(JobAccess::Secret(JobSecret::new(SECRET).unwrap()))
                        .with_process_transport(carriers.setting());
                    use ppnrt::pp::ProtocolFault;
                    let injected = match fault {
                        Fault::AnnounceOnly if rank == 0 => Some(ProtocolFault::AnnounceWithoutSend),
                        Fault::Forged { rank: r, step } if r == rank => Some(ProtocolFault::ForgeRecordAt(step)),
                        Fault::Replayed { rank: r, step } if r == rank => Some(ProtocolFault::ReplayRecordAt(step)),
                        Fault::Truncated { rank: r, step } if r == rank => Some(ProtocolFault::TruncateRecordAt(step)),
                        _ => None,
                    };
                    if let Some(injected) = injected {
                        config = config.with_fault(injected);
                    }
                    let outcome = match PpNRt::new(config, &primary) {
                        Ok(rt) => {
                            let planned: Vec<Transport> = rt.plan().boundaries.iter().map(|b| b.transport).collect();
                            match planned == carriers.planned() {
                                true => rank_loop(rank, rt, fault, wait),
                                false => Err(format!("rank {rank}: {carriers:?} planned as {planned:?}")),
                            }
                        }
                        Err(e) => Ok(Ended::Typed { done: 0, error: format!("setup: {e}") }),
                    };
                    let _ = done.send((rank, outcome, Instant::now()));
                });
            }
            let mut outcomes = Vec::new();
            for _ in 0..3 {
                let left = bound.saturating_sub(started.elapsed());
                let (rank, outcome, at) = ended
                    .recv_timeout(left)
                    .unwrap_or_else(|_| panic!("run {run} ({fault:?}): a rank hung past {bound:?}"));
                let outcome = outcome.unwrap_or_else(|wrong| panic!("run {run}: {wrong}"));
                outcomes.push((rank, outcome, at.duration_since(started)));
            }
            if let Some(poll_fault) = poll_fault {
                poll_fault.join().unwrap();
            }
            double::nccl_double().clear_faults();
            double.no_peer(false);
            let mut typed = Vec::new();
            for (rank, outcome, at) in &outcomes {
                match outcome {
                    Ended::Exact(steps) => assert_eq!(*steps, STEPS, "run {run}: rank {rank}"),
                    Ended::Typed { done, error } => {
                        assert!(*done <= STEPS && !error.is_empty(), "run {run}: rank {rank}: {outcome:?}");
                        samples
                            .entry(name)
                            .or_insert_with(|| format!("rank {rank} after {done} steps, {at:?}: {error}"));
                        typed.push(rank);
                    }
                }
            }
            if typed.is_empty() {
                exact += 1;
            } else {
                typed_runs += 1;
                typed_ranks += typed.len();
            }
            if matches!(fault, Fault::None | Fault::Strangers) {
                assert!(typed.is_empty(), "run {run} ({fault:?}): {outcomes:?}");
            }
            let _ = ppnrt::take_drop_errors();
        }
        stop_load.store(true, std::sync::atomic::Ordering::Relaxed);
        load.into_iter().for_each(|busy| busy.join().unwrap());
        // SAFETY: as above.
        unsafe {
            std::env::remove_var("PPNRT_NCCL_DOUBLE_ORPHAN_RECV");
            std::env::remove_var("PPNRT_NCCL_DOUBLE_ASYNC_SEND");
        }
        println!(
            "campaign: {runs} runs of 3 ranks × {STEPS} steps ({by_fault:?}; {by_carriers:?}): {exact} exact on every rank, \
             {typed_runs} ended with typed errors ({typed_ranks} rank endings typed), 0 wrong as Ok, 0 hung"
        );
        for (fault, sample) in &samples {
            println!("campaign: {fault}: e.g. {sample}");
        }
        assert!(typed_runs > 0, "no fault struck");
    });
}

/// A receive that fails while NCCL completes it in the background never writes its buffer
/// after the caller let the buffer go. The first receive of a non-blocking communicator
/// connects it in the background (`ncclInProgress`), and the call polls NCCL's asynchronous
/// error until the receive is enqueued; here that poll fails (as the campaign's asynchronous
/// error did when it struck a rank's setup, during the receive of a link's first message). The
/// call returns the error and its buffer is freed at once, as the setup's was. The communicator
/// must be aborted before the call returns (else NCCL enqueues the receive afterwards, and it
/// copies the message that arrived into freed memory: the NCCL double checks its receives'
/// buffers when they run), and the free must wait for the receive NCCL enqueued meanwhile (with
/// one communicator, its abort takes effect 50 ms late here, so the receive is enqueued first:
/// it runs, aborted, before its buffer goes, and nothing of it stays queued). Deterministic: nothing else polls
/// NCCL when the fault is set. Through `NcclComm::recv`, through a group of one receive, and
/// through a group of two communicators' receives (the one whose poll did not fail must settle
/// too, not go on in the background).
#[test]
fn a_receive_that_fails_while_nccl_completes_it_never_writes_its_freed_buffer() {
    for (grouped, comms) in [(false, 1), (true, 1), (true, 2)] {
        a_failed_receive_never_writes_its_freed_buffer(grouped, comms);
    }
}

fn a_failed_receive_never_writes_its_freed_buffer(grouped: bool, n: usize) {
    let test = &format!("a failed receive (grouped: {grouped}, communicators: {n})");
    with_double(test, |double| {
        let before = double.violations();
        let ids: Vec<_> = (0..n).map(|_| NcclUniqueId::new().unwrap().to_bytes()).collect();
        let bound = Duration::from_secs(5);
        let join = |engine: &Engine, rank| -> Vec<NcclComm> {
            let watched = |bytes| {
                let id = NcclUniqueId::from_bytes(bytes);
                NcclComm::init_rank_watched(engine.context(), 2, &id, rank, bound, || Ok::<(), NcclError>(())).unwrap()
            };
            ids.iter().map(watched).collect()
        };
        let (sent, done) = (Barrier::new(2), Barrier::new(2));
        std::thread::scope(|scope| {
            // The sender is each communicator's rank 1, the receiver its rank 0 (whose abort the
            // double delays).
            scope.spawn(|| {
                let engine = Engine::new(0).unwrap();
                let comms = join(&engine, 1);
                let stream = CudaStream::new(engine.context()).unwrap();
                let message = engine.htod(&[1u32, 2, 3, 4]).unwrap();
                for comm in &comms {
                    // SAFETY: rank 0 receives the same four `u32`s.
                    unsafe { comm.send(&stream, &message, 0) }.unwrap();
                }
                stream.synchronize().unwrap();
                sent.wait();
                done.wait();
            });
            let engine = Engine::new(1).unwrap();
            let comms = join(&engine, 0);
            sent.wait();
            let pending = double.pending();
            // With two communicators the failed one's abort is prompt: the other one's receive is
            // still being enqueued when it ends.
            let abort_delay = if n == 1 { "50" } else { "0" };
            // SAFETY: tests through the double run one at a time (`with_double` holds its lock),
            // and nothing else of this process reads the environment while this test sets it.
            unsafe { std::env::set_var("PPNRT_NCCL_DOUBLE_SEND_ABORT_DELAY_MS", abort_delay) };
            // The next poll of NCCL's asynchronous error is a receive's own, while NCCL connects.
            double::nccl_double().fail("ncclCommGetAsyncError", 1, 3);
            let stream = CudaStream::new(engine.context()).unwrap();
            // Plain memory of another stream, as a link's first message's: its free waits on
            // the host for its uses, the receive's only if noted.
            let owner = CudaStream::new(engine.context()).unwrap();
            let mut buffers: Vec<_> =
                comms.iter().map(|_| CudaSlice::<u32>::alloc_persistent(&owner, 4).unwrap()).collect();
            // SAFETY: rank 1 sent four `u32`s on each communicator.
            let received = unsafe {
                if grouped {
                    let ops: Vec<_> = comms
                        .iter()
                        .zip(&mut buffers)
                        .map(|(comm, buffer)| P2p::recv(comm, &stream, buffer, 1))
                        .collect();
                    group(&ops)
                } else {
                    comms[0].recv(&stream, &mut buffers[0], 1)
                }
            };
            // SAFETY: as above.
            unsafe { std::env::remove_var("PPNRT_NCCL_DOUBLE_SEND_ABORT_DELAY_MS") };
            assert!(
                matches!(&received, Err(NcclError::Call { call: "ncclCommGetAsyncError", .. })),
                "the receive's poll failed: {received:?}"
            );
            let returned = double.pending();
            drop(buffers);
            let left_queued = double.pending().saturating_sub(pending);
            // Until a communicator is seen aborted, or NCCL enqueued a receive in the background
            // (at most 2 s); with two, until the other one's background work is done too.
            let deadline = Instant::now() + Duration::from_secs(2);
            let aborted = loop {
                let aborted = comms.iter().any(|comm| matches!(comm.async_error(), Err(NcclError::Aborted { .. })));
                if aborted || double.pending() > returned || Instant::now() > deadline {
                    break aborted;
                }
                std::thread::sleep(Duration::from_millis(1));
            };
            if n > 1 {
                std::thread::sleep(Duration::from_millis(100));
            }
            // Dropped while its peer lives (a healthy communicator is destroyed, not aborted:
            // what arrived stays for the receives queued).
            drop(comms);
            done.wait();
            double.flush();
            assert_eq!(double.violations(), before, "{test}: {}", double.last_violation());
            assert!(aborted, "{test}: the communicator whose call did not settle was not aborted");
            assert_eq!(left_queued, 0, "{test}: a buffer was freed with its receive still queued");
        });
        let _ = ppnrt::take_drop_errors();
    });
}
