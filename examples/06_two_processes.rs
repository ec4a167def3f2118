//! Lesson 6: two processes, one stage each: rank 0 makes each step's input, runs its layers and
//! sends; rank 1 receives over NCCL, runs the rest, reads the output back and checks it against
//! one engine. Without `PPNRT_RANK` it starts both ranks itself, as `scripts/launch-local.sh 0,1`
//! would: a job secret and a free rendezvous port of their own; with one GPU both ranks on it
//! (NCCL over loopback sockets), with more one GPU each.
//! `cargo run --release --example 06_two_processes` (no arguments but `--help`); exit status 0
//! when every step matches, 1 on an error or a mismatch, 2 for a bad argument or configuration.
use std::process::{Command, ExitCode};
use std::time::Duration;

use ppnrt::{Device, Engine, PpConfig, PpNRt};

const LAYERS: u32 = 8; // per stage
const N: usize = 8192;
const STEPS: usize = 100;

type Error = Box<dyn std::error::Error>;

fn input(step: usize) -> Vec<f32> {
    (0..N).map(|i| ((i * 7 + step) % 509) as f32 / 509.0).collect()
}

fn rank(config: PpConfig) -> Result<String, Error> {
    let engine = Engine::new(0)?; // each rank's own GPU 0
    let rt = PpNRt::new(config, &engine)?; // returns once both ranks have met
    let timeout = Duration::from_secs(60);
    for k in 0..STEPS {
        if rt.owns_stage(0) {
            let _stage = rt.enter(0)?;
            let mut x = engine.htod(&input(k))?;
            for layer in 0..LAYERS {
                engine.toy_layer(&mut x, k as u32, layer)?;
            }
            rt.tx_wait(0, &x, N, timeout)?; // parks while rank 1 still holds the slot
        } else {
            let _stage = rt.enter(1)?;
            let mut x = rt.rx_wait::<f32>(0, k % rt.n_slots(), N, timeout)?;
            for layer in LAYERS..2 * LAYERS {
                engine.toy_layer(&mut x, k as u32, layer)?;
            }
            let output = rt.readback(x)?.wait()?.to_vec();
            let mut y = engine.htod(&input(k))?;
            for layer in 0..2 * LAYERS {
                engine.toy_layer(&mut y, k as u32, layer)?;
            }
            let expected = engine.dtoh(&y)?;
            if let Some(i) = output.iter().zip(&expected).position(|(a, b)| a.to_bits() != b.to_bits()) {
                return Err(format!("step {k}, element {i}: received {}, one engine {}", output[i], expected[i]).into());
            }
        }
    }
    rt.synchronize()?;
    let done = if rt.rank() == 1 { "identical to one engine" } else { "sent" };
    Ok(format!("rank {}: {STEPS} steps, {done}", rt.rank()))
}

/// Starts ranks 0 and 1 of this program and waits for both.
fn launch() -> Result<(), Error> {
    let port = std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?.port();
    let mut random = [0u8; 32]; // the job secret: only these two ranks can join
    std::io::Read::read_exact(&mut std::fs::File::open("/dev/urandom")?, &mut random)?;
    let secret: String = random.iter().map(|b| format!("{b:02x}")).collect();
    let (gpus, exe) = (Device::count()?, std::env::current_exe()?);
    let mut children = Vec::new();
    for r in 0..2 {
        let mut child = Command::new(&exe);
        child.envs([("PPNRT_RANKS", "0,1"), ("PPNRT_DEVICES", "0,0"), ("PPNRT_JOB_SECRET", &secret)]);
        child.env("PPNRT_RANK", r.to_string()).env("PPNRT_RENDEZVOUS", format!("127.0.0.1:{port}"));
        if gpus >= 2 {
            child.env("CUDA_VISIBLE_DEVICES", r.to_string());
        } else {
            // Both ranks on GPU 0: NCCL treats them as two hosts and uses loopback sockets.
            child.env("NCCL_HOSTID", format!("ppnrt-example-rank-{r}")).env("NCCL_SOCKET_IFNAME", "lo");
            child.envs([("NCCL_P2P_DISABLE", "1"), ("NCCL_SHM_DISABLE", "1")]);
        }
        children.push(child.spawn().map_err(|e| format!("starting rank {r}: {e}"))?);
    }
    for (r, mut child) in children.into_iter().enumerate() {
        let status = child.wait().map_err(|e| format!("waiting for rank {r}: {e}"))?;
        if !status.success() {
            return Err(format!("rank {r} ended with {status}").into());
        }
    }
    Ok(())
}

fn main() -> ExitCode {
    let usage = "usage: 06_two_processes [-h|--help]   (a rank of its own with PPNRT_RANK and the PPNRT_* settings)";
    if let Some(arg) = std::env::args_os().nth(1) {
        if arg == "-h" || arg == "--help" {
            println!("{usage}\n\nLesson 6: two processes, one stage each, over NCCL; checked against one engine.");
            return ExitCode::SUCCESS;
        }
        eprintln!("06_two_processes: unexpected argument '{}'\n{usage}", arg.to_string_lossy());
        return ExitCode::from(2);
    }
    let result = if std::env::var_os("PPNRT_RANK").is_none() {
        launch()
    } else {
        match PpConfig::from_env() {
            Ok(config) => rank(config).map(|done| println!("06_two_processes: {done}")),
            Err(e) => {
                eprintln!("06_two_processes: {}", ppnrt::error::chain(&ppnrt::Error::Config(e)));
                return ExitCode::from(2);
            }
        }
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("06_two_processes: {}", ppnrt::error::chain(&*e));
            ExitCode::FAILURE
        }
    }
}
