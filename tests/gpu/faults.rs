//! Faults: a kernel that traps makes later calls on its context return a typed "context is
//! unusable" error (not a hang, not garbage), and a process that exits with live buffers,
//! streams, events and a live runtime exits cleanly. Each scenario runs in a child process (this
//! test binary again, running one ignored test), so the rest of the suite goes on.

#[path = "../common/mod.rs"]
mod common;

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::needs::{Needs, requires};
use common::say;
use ppnrt::{CudaError, CudaEvent, CudaStream, Engine, PinnedHostBuffer, PpConfig, PpNRt};

const CHILD_VAR: &str = "PPNRT_FAULT_CHILD";

/// Runs the ignored test `name` of this binary in a child process; returns (success, stdout, stderr).
fn run_child(name: &str) -> (bool, String, String) {
    let exe = std::env::current_exe().unwrap();
    let mut child = Command::new(exe)
        .args([name, "--exact", "--ignored", "--nocapture", "--test-threads=1"])
        .env(CHILD_VAR, "1")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        if child.try_wait().unwrap().is_some() {
            break;
        }
        if Instant::now() > deadline {
            child.kill().unwrap();
            panic!("child {name} hung for 120 s");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let output = child.wait_with_output().unwrap();
    (
        output.status.success(),
        String::from_utf8_lossy(&output.stdout).into_owned(),
        String::from_utf8_lossy(&output.stderr).into_owned(),
    )
}

#[test]
fn a_trap_makes_later_calls_on_the_context_return_context_unusable() {
    let Some(_gpus) = requires("a_trap_makes_later_calls_on_the_context_return_context_unusable", Needs::gpus(1))
    else {
        return;
    };
    let (ok, stdout, stderr) = run_child("child_trap");
    say(&format!("child_trap: {}", stdout.lines().filter(|l| l.starts_with("CHILD")).collect::<Vec<_>>().join(" | ")));
    assert!(ok && stdout.contains("CHILD-OK"), "child failed:\n{stdout}\n{stderr}");
}

#[test]
#[ignore = "runs in a child process of a_trap_makes_later_calls_on_the_context_return_context_unusable"]
fn child_trap() {
    assert!(std::env::var(CHILD_VAR).is_ok(), "run through the parent test");
    let engine = Engine::new(0).unwrap();
    let mut before = engine.htod(&[1u32; 1024]).unwrap();
    engine.synchronize().unwrap();
    engine.inject_trap().unwrap();
    let err = engine.synchronize().unwrap_err();
    println!("CHILD synchronize after trap: {err}");
    assert!(matches!(err, CudaError::ContextUnusable { .. }), "{err:?}");
    // Every later call on the context fails the same way; none hangs or returns data.
    let again = engine.htod(&[2u32; 16]).map(|_| ()).and_then(|()| engine.synchronize()).unwrap_err();
    assert!(matches!(again, CudaError::ContextUnusable { .. }), "{again:?}");
    assert!(engine.dtoh(&before).is_err());
    assert!(engine.fill_u32(&mut before, 3).and_then(|()| engine.synchronize()).is_err());
    println!("CHILD-OK");
}

#[test]
fn exiting_with_live_objects_is_clean() {
    let Some(_gpus) = requires("exiting_with_live_objects_is_clean", Needs::gpus(1)) else { return };
    let (ok, stdout, stderr) = run_child("child_exit_with_live_objects");
    assert!(ok, "child failed:\n{stdout}\n{stderr}");
    assert!(stdout.contains("CHILD-EXITING"), "{stdout}");
    assert!(stderr.trim().is_empty(), "the child printed to stderr:\n{stderr}");
}

#[test]
#[ignore = "runs in a child process of exiting_with_live_objects_is_clean"]
fn child_exit_with_live_objects() {
    assert!(std::env::var(CHILD_VAR).is_ok(), "run through the parent test");
    let devices = ppnrt::Device::count().unwrap();
    let engine = Engine::new(0).unwrap();
    let map: Vec<i32> = (0..4).map(|s| s % devices.min(2)).collect();
    let runtime = PpNRt::new(PpConfig::with_devices(&map), &engine).unwrap();
    let global = PpNRt::get(&engine).unwrap();
    let stream = CudaStream::new(engine.context()).unwrap();
    let event = CudaEvent::new(engine.context(), true).unwrap();
    let pinned = PinnedHostBuffer::<f32>::new(engine.context(), 1 << 20, false).unwrap();
    let mut buffer = engine.alloc::<u32>(1 << 20).unwrap();
    engine.fill_pattern(&mut buffer, 1).unwrap();
    let slot = runtime.tx(0, &buffer, 1 << 20).unwrap();
    let received = runtime.rx::<u32>(0, slot, 1 << 20).unwrap();
    engine.spin(50_000_000).unwrap(); // work still in flight at exit
    event.record(engine.default_stream()).unwrap();
    println!("CHILD-EXITING with {} stage(s) live, global {}", runtime.n_stages(), global.n_stages());
    // Leak everything and leave without running destructors, as a process killed by exit() does.
    std::mem::forget((runtime, stream, event, pinned, buffer, received, engine));
    std::process::exit(0);
}
