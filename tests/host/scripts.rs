//! The scripts whose exit status decides a pass or a failure, run as a user and the GPU gate run
//! them (no GPU needed): `scripts/launch-local.sh` exits with the status of its first rank that
//! fails (and 0 when every rank succeeds), and `scripts/gpu-gate.sh` fails a multi-process step
//! when one of its ranks fails.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::{Duration, Instant};

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// Runs `bash script args...` in the package root with `env` added; `None`, after saying why,
/// where the script is missing or bash cannot be run.
fn bash(script: &str, args: &[&str], env: &[(&str, &Path)]) -> Option<Output> {
    if !root().join(script).is_file() {
        // The published package leaves the scripts out.
        println!("SKIPPED: no {script} here");
        return None;
    }
    let mut command = Command::new("bash");
    command.current_dir(root()).arg(script).args(args);
    for (name, value) in env {
        command.env(name, value);
    }
    match command.output() {
        Ok(output) => Some(output),
        Err(e) => {
            println!("SKIPPED: cannot run bash: {e}");
            None
        }
    }
}

fn described(output: &Output) -> String {
    format!(
        "status {:?}\nstdout:\n{}\nstderr:\n{}",
        output.status,
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    )
}

/// `scripts/launch-local.sh RANKS --port 1 -- sh -c PROGRAM`: its output and how long it took.
fn launch(ranks: &str, program: &str) -> Option<(Output, Duration)> {
    let start = Instant::now();
    let output = bash("scripts/launch-local.sh", &[ranks, "--port", "1", "--", "sh", "-c", program], &[])?;
    Some((output, start.elapsed()))
}

#[test]
fn launch_local_exits_with_the_first_failing_ranks_status() {
    // Rank 1 exits 3, rank 0 succeeds.
    let Some((output, _)) = launch("0,1", "exit $((PPNRT_RANK * 3))") else { return };
    assert_eq!(output.status.code(), Some(3), "{}", described(&output));
    // Every rank succeeds.
    let Some((output, _)) = launch("0,1,0,1", "echo \"rank $PPNRT_RANK of $PPNRT_RANKS\"") else { return };
    assert_eq!(output.status.code(), Some(0), "{}", described(&output));
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(stdout.contains("[rank 1] rank 1 of 0,1,0,1"), "{}", described(&output));
    // Rank 2 fails while rank 0 would run for a minute (waiting for it, as a rank waits for a
    // peer): the failure's status comes at once and rank 0 is stopped.
    let Some((output, took)) = launch("0,1,2", "[ $PPNRT_RANK = 0 ] && exec sleep 60; exit $((PPNRT_RANK + 3))") else {
        return;
    };
    assert!(matches!(output.status.code(), Some(4 | 5)), "{}", described(&output));
    assert!(took < Duration::from_secs(30), "the launch waited {took:?} for a rank after another failed");
    // A rank killed by a signal fails the launch too (128 + SIGKILL).
    let Some((output, _)) = launch("0,1", "[ $PPNRT_RANK = 1 ] && kill -9 $$; exit 0") else { return };
    assert_eq!(output.status.code(), Some(137), "{}", described(&output));
}

/// A GPU bundle whose one example, `processes`, exits `rank1_status` as rank 1 of a launch
/// (and 0 otherwise), in a fresh folder.
fn bundle_with_processes(name: &str, rank1_status: i32) -> PathBuf {
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(format!("scripts-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let examples = dir.join("bundle/examples");
    std::fs::create_dir_all(&examples).unwrap();
    let program = examples.join("processes");
    std::fs::write(&program, format!("#!/bin/sh\n[ \"${{PPNRT_RANK:-}}\" = 1 ] && exit {rank1_status}\nexit 0\n"))
        .unwrap();
    let made = Command::new("chmod").arg("+x").arg(&program).status().unwrap();
    assert!(made.success());
    dir
}

/// Runs the gate's examples phase on `dir`'s bundle as on a one-GPU machine.
fn gate_examples(dir: &Path) -> Option<Output> {
    let python = Command::new("python3").arg("-c").arg("pass").status();
    if !python.is_ok_and(|status| status.success()) {
        // The gate's launches find a free port with it.
        println!("SKIPPED: python3 cannot be run here, and scripts/launch-local.sh needs it");
        return None;
    }
    let one = PathBuf::from("1");
    bash(
        "scripts/gpu-gate.sh",
        &["examples"],
        &[("GATE_BUNDLE", &dir.join("bundle")), ("GATE_OUT", &dir.join("logs")), ("PPNRT_REQUIRE_GPUS", &one)],
    )
}

#[test]
fn the_gpu_gate_fails_a_multi_process_step_whose_rank_fails() {
    let failing = bundle_with_processes("failing", 3);
    let Some(output) = gate_examples(&failing) else { return };
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert_eq!(output.status.code(), Some(1), "{}", described(&output));
    assert!(stdout.contains("GATE FAIL") && !stdout.contains("GATE PASS"), "{}", described(&output));
    let steps: Vec<&str> =
        stdout.lines().filter(|line| line.starts_with("example processes ") && line.contains(" 0,1,0,1 ")).collect();
    assert_eq!(steps.len(), 2, "{}", described(&output));
    for step in steps {
        assert!(step.contains(" FAIL ") && step.contains("rc=3"), "{step}");
    }
    // The same steps pass when every rank succeeds: the gate's check can pass as well as fail.
    let passing = bundle_with_processes("passing", 0);
    let Some(output) = gate_examples(&passing) else { return };
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert_eq!(output.status.code(), Some(0), "{}", described(&output));
    assert!(stdout.contains("GATE PASS"), "{}", described(&output));
    for dir in [failing, passing] {
        let _ = std::fs::remove_dir_all(dir);
    }
}
