//! Two processes, one stage each: rank 0 makes each step's input, runs its layers and sends;
//! rank 1 receives over NCCL, runs the rest, reads the output back and checks it against one
//! engine. Without `PPNRT_RANK` it starts both ranks itself, as `scripts/launch-local.sh 0,1`
//! would: a job secret and a free rendezvous port of their own; with one GPU both ranks on it
//! (NCCL over loopback sockets), with more one GPU each.
//! `cargo run --release --example 06_two_processes`
use std::process::{Command, ExitCode};
use std::time::Duration;

use ppnrt::{Device, Engine, PpConfig, PpNRt};

const LAYERS: u32 = 8; // per stage
const N: usize = 8192;
const STEPS: usize = 100;

fn input(step: usize) -> Vec<f32> {
    (0..N).map(|i| ((i * 7 + step) % 509) as f32 / 509.0).collect()
}

fn rank(config: PpConfig) -> ppnrt::Result<String> {
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
            assert!(engine.dtoh(&y)? == output, "step {k}: differs from one engine's");
        }
    }
    rt.synchronize()?;
    let done = if rt.rank() == 1 { "identical to one engine" } else { "sent" };
    Ok(format!("rank {}: {STEPS} steps, {done}", rt.rank()))
}

/// Starts ranks 0 and 1 of this program and waits for both.
fn launch() -> Result<(), String> {
    let port =
        std::net::TcpListener::bind("127.0.0.1:0").and_then(|l| l.local_addr()).map_err(|e| e.to_string())?.port();
    let mut random = [0u8; 32]; // the job secret: only these two ranks can join
    let urandom = std::fs::File::open("/dev/urandom").and_then(|mut f| std::io::Read::read_exact(&mut f, &mut random));
    urandom.map_err(|e| e.to_string())?;
    let secret: String = random.iter().map(|b| format!("{b:02x}")).collect();
    let (gpus, exe) = (Device::count().map_err(|e| ppnrt::error::chain(&e))?, std::env::current_exe());
    let exe = exe.map_err(|e| e.to_string())?;
    let children: Vec<_> = (0..2)
        .map(|r| {
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
            child.spawn().map_err(|e| format!("rank {r}: {e}"))
        })
        .collect::<Result<_, _>>()?;
    children.into_iter().enumerate().try_for_each(|(r, mut child): (usize, std::process::Child)| match child.wait() {
        Ok(status) if status.success() => Ok(()),
        ended => Err(format!("rank {r} ended with {ended:?}")),
    })
}

fn main() -> ExitCode {
    let result = if std::env::var_os("PPNRT_RANK").is_none() {
        launch()
    } else {
        PpConfig::from_env()
            .map_err(|e| ppnrt::error::chain(&ppnrt::Error::Config(e)))
            .and_then(|config| rank(config).map_err(|e| ppnrt::error::chain(&e)))
            .map(|done| println!("06_two_processes: {done}"))
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("06_two_processes: {e}");
            ExitCode::from(2)
        }
    }
}
