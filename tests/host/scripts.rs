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

/// An executable script at `path` with `body` after its `#!/bin/sh` line.
fn script(path: &Path, body: &str) {
    std::fs::create_dir_all(path.parent().unwrap()).unwrap();
    std::fs::write(path, format!("#!/bin/sh\n{body}\n")).unwrap();
    assert!(Command::new("chmod").arg("+x").arg(path).status().unwrap().success());
}

/// The gate follows the tiers: its tests phase runs the executables of the GPU tier and the
/// library's own (not the double and host tiers', which CI runs; `GATE_TIERS` names others), and
/// its sanitize phase runs the
/// GPU tier but `faults`, the `gpu` executable one module at a time, with each module's own
/// exceptions (initcheck skips the pipeline's thread-per-stage loops; racecheck runs each in a
/// process of its own). Run on a bundle of stand-in executables that note how they were called,
/// with a stand-in `compute-sanitizer`.
#[test]
fn the_gpu_gate_runs_the_gpu_tier_and_unit_tests_and_sanitizes_the_gpu_tier_by_module() {
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(format!("scripts-tiers-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let ran = dir.join("ran.txt");
    let bundle = dir.join("bundle");
    let gpu_tests = "driver::devices_are_listed: test\\npipeline::one_thread_per_stage_matches_one_thread: test\\npipeline::engine_and_enter_follow_the_stage_map: test";
    let tiers = [("gpu", "gpu"), ("faults", "gpu"), ("singleton", "gpu"), ("double", "double"), ("nccl", "double")];
    let tiers = tiers.iter().chain(&[("host", "host"), ("no_driver", "host"), ("unit", "unit")]);
    let mut listed = String::new();
    for (name, tier) in tiers {
        let list = if *name == "gpu" { gpu_tests } else { "x: test" };
        script(
            &bundle.join("tests").join(name),
            &format!(
                "[ \"$1\" = --list ] && {{ printf '{list}\\n'; exit 0; }}\necho \"test {name} $*\" >> '{}'",
                ran.display()
            ),
        );
        listed.push_str(&format!("{name} {tier}\n"));
    }
    std::fs::write(bundle.join("tiers"), listed).unwrap();
    let bin = dir.join("bin");
    script(&bin.join("compute-sanitizer"), &format!("echo \"sanitizer $*\" >> '{}'", ran.display()));
    let path = std::env::join_paths(
        std::iter::once(bin.clone()).chain(std::env::split_paths(&std::env::var_os("PATH").unwrap_or_default())),
    )
    .unwrap();
    let tools = PathBuf::from("initcheck racecheck");
    let one = PathBuf::from("1");
    let Some(output) = bash(
        "scripts/gpu-gate.sh",
        &["tests,sanitize"],
        &[
            ("GATE_BUNDLE", &bundle),
            ("GATE_OUT", &dir.join("logs")),
            ("PPNRT_REQUIRE_GPUS", &one),
            ("GATE_SANITIZE_TOOLS", &tools),
            ("PATH", Path::new(&path)),
        ],
    ) else {
        return;
    };
    assert_eq!(output.status.code(), Some(0), "{}", described(&output));
    let ran = std::fs::read_to_string(&ran).unwrap();
    let mut tested: Vec<&str> = ran.lines().filter_map(|l| l.strip_prefix("test ")?.split(' ').next()).collect();
    tested.sort();
    tested.dedup();
    // The tests phase ran these (the GPU tier, the unit tests, and `nccl` of the double tier, which
    // reaches the GPUs and NCCL on a GPU machine); the sanitizer (whose stand-in runs nothing) none.
    assert_eq!(tested, ["faults", "gpu", "nccl", "singleton", "unit"], "{ran}");
    let sanitized: Vec<&str> = ran.lines().filter_map(|l| l.strip_prefix("sanitizer ")).collect();
    let runs = |tool: &str, what: &str| sanitized.iter().filter(|l| l.contains(tool) && l.contains(what)).count();
    for tool in ["initcheck", "racecheck"] {
        assert_eq!(runs(tool, "/tests/gpu driver:: --test-threads=1"), 1, "{tool}: {ran}");
        assert_eq!(runs(tool, "/tests/singleton --test-threads=1"), 1, "{tool}: {ran}");
        assert_eq!(runs(tool, "/tests/faults"), 0, "{tool}: {ran}");
        assert_eq!(runs(tool, "/tests/nccl"), 0, "{tool}: {ran}");
        assert_eq!(runs(tool, "/tests/host"), 0, "{tool}: {ran}");
    }
    assert_eq!(runs("initcheck", "/tests/gpu pipeline:: --test-threads=1 --skip _matches_one_thread"), 1, "{ran}");
    assert_eq!(
        runs("racecheck", "/tests/gpu --test-threads=1 --exact pipeline::one_thread_per_stage_matches_one_thread"),
        1,
        "{ran}"
    );
    assert_eq!(runs("racecheck", "/tests/gpu pipeline:: --test-threads=1 --skip _matches_one_thread"), 1, "{ran}");
    // GATE_TIERS picks the tiers: the double tier's executables alone.
    std::fs::remove_file(dir.join("ran.txt")).unwrap();
    let double = PathBuf::from("double");
    let Some(output) = bash(
        "scripts/gpu-gate.sh",
        &["tests"],
        &[
            ("GATE_BUNDLE", &bundle),
            ("GATE_OUT", &dir.join("logs")),
            ("PPNRT_REQUIRE_GPUS", &one),
            ("GATE_TIERS", &double),
        ],
    ) else {
        return;
    };
    assert_eq!(output.status.code(), Some(0), "{}", described(&output));
    let ran = std::fs::read_to_string(dir.join("ran.txt")).unwrap();
    let mut tested: Vec<&str> = ran.lines().filter_map(|l| l.strip_prefix("test ")?.split(' ').next()).collect();
    tested.sort();
    assert_eq!(tested, ["double", "nccl"], "{ran}");
    let _ = std::fs::remove_dir_all(dir);
}
