//! Host-only: the examples' command lines. Every example answers `--help` (usage on stdout,
//! status 0), refuses an unknown argument or a bad value (status 2: a one-line message naming it,
//! then the usage, on stderr) and, with no driver to load, fails with status 1 and the error's
//! chain on stderr, nothing else (no `Debug`, no panic).
//!
//! It runs the example executables that cargo built beside this test's: `target/<profile>/
//! examples/NAME` (a plain `cargo test` or `cargo build --examples` makes them; the scripts'
//! GPU bundle puts them in `examples/` beside its `tests/`). One that is missing, or older than
//! its source or the library's, is skipped with the reason printed.

use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant, SystemTime};

/// Every example (`examples/*.rs`).
const EXAMPLES: [&str; 11] = [
    "quickstart",
    "01_alloc_copy",
    "02_launch_kernel",
    "03_readback",
    "04_graph_mode",
    "05_thread_per_stage",
    "06_two_processes",
    "pipeline",
    "processes",
    "step_profile",
    "topology",
];

/// A bad value for the tools that take values: the arguments and the value the message names.
const BAD_VALUES: [(&str, &[&str], &str); 5] = [
    ("pipeline", &["--steps", "0"], "--steps 0"),
    ("pipeline", &["--transport", "sideways"], "sideways"),
    ("processes", &["--steps", "many"], "--steps many"),
    ("step_profile", &["nosuchmode"], "nosuchmode"),
    ("topology", &["--reps", "0"], "--reps 0"),
];

/// A driver library that does not exist: every example's first driver call fails.
const NO_DRIVER: &str = "/nonexistent/ppnrt-examples-test/libcuda.so.1";

/// What an example did.
struct Ran {
    status: Option<i32>,
    stdout: String,
    stderr: String,
}

/// Runs `exe` with `args` and no `PPNRT_*` setting but a driver path that does not exist (so that
/// an example that reaches the GPU before checking its command line fails visibly, on any
/// machine); kills it after a minute.
fn run(exe: &Path, args: &[&str], env: &[(&str, &str)]) -> Ran {
    let mut command = Command::new(exe);
    command.args(args).stdin(Stdio::null()).stdout(Stdio::piped()).stderr(Stdio::piped());
    for (key, _) in std::env::vars_os() {
        if key.to_str().is_some_and(|k| k.starts_with("PPNRT_")) {
            command.env_remove(key);
        }
    }
    command.env("PPNRT_LIBCUDA_PATH", NO_DRIVER).envs(env.iter().copied());
    let mut child = command.spawn().unwrap_or_else(|e| panic!("{}: cannot start: {e}", exe.display()));
    // Read on threads of their own, so that a child that hangs is killed below.
    fn reader(mut pipe: impl Read + Send + 'static) -> std::thread::JoinHandle<String> {
        std::thread::spawn(move || {
            let mut text = String::new();
            let _ = pipe.read_to_string(&mut text);
            text
        })
    }
    let stdout = reader(child.stdout.take().expect("piped stdout"));
    let stderr = reader(child.stderr.take().expect("piped stderr"));
    let started = Instant::now();
    let status = loop {
        match child.try_wait().expect("try_wait") {
            Some(status) => break status,
            None if started.elapsed() > Duration::from_secs(60) => {
                let _ = child.kill();
                panic!("{} {args:?}: still running after 60 s", exe.display());
            }
            None => std::thread::sleep(Duration::from_millis(10)),
        }
    };
    Ran { status: status.code(), stdout: stdout.join().expect("stdout"), stderr: stderr.join().expect("stderr") }
}

/// The newest modification time of the files under `dir` (recursively) with extension `rs`.
fn newest_source(dir: &Path) -> Option<SystemTime> {
    let mut newest = None;
    for entry in std::fs::read_dir(dir).ok()?.flatten() {
        let path = entry.path();
        let time = if path.is_dir() {
            newest_source(&path)
        } else if path.extension().is_some_and(|e| e == "rs") {
            entry.metadata().and_then(|m| m.modified()).ok()
        } else {
            None
        };
        newest = newest.max(time);
    }
    newest
}

/// The executable of example `name` built beside this test, or why there is none to run.
fn executable(name: &str) -> Result<PathBuf, String> {
    let test = std::env::current_exe().map_err(|e| format!("no path of this test: {e}"))?;
    // target/<profile>/deps/THIS -> target/<profile>/examples/NAME (gpu-bundle/tests/THIS ->
    // gpu-bundle/examples/NAME).
    let dir = test.parent().and_then(Path::parent).ok_or("this test has no grandparent directory")?;
    let exe = dir.join("examples").join(name);
    let built = exe.metadata().and_then(|m| m.modified()).map_err(|_| {
        format!("{} is not there (cargo test --all-targets builds examples as tests; cargo build --examples or a plain cargo test builds it)", exe.display())
    })?;
    // Where the sources are (not on a machine the GPU bundle went to), the executable must be
    // newer than the example's and the library's.
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let sources = [
        newest_source(&root.join("src")),
        root.join("examples").join(format!("{name}.rs")).metadata().and_then(|m| m.modified()).ok(),
    ];
    if sources.into_iter().flatten().any(|source| source > built) {
        return Err(format!("{} is older than its sources (rebuild: cargo build --examples)", exe.display()));
    }
    Ok(exe)
}

#[test]
fn every_example_answers_help_refuses_bad_arguments_and_reports_a_missing_driver_as_one_chain() {
    // The list is every example there is.
    if let Ok(dir) = std::fs::read_dir(Path::new(env!("CARGO_MANIFEST_DIR")).join("examples")) {
        let mut present: Vec<String> =
            dir.flatten().filter_map(|e| e.file_name().to_str()?.strip_suffix(".rs").map(str::to_owned)).collect();
        present.sort();
        let mut listed: Vec<String> = EXAMPLES.iter().map(|s| s.to_string()).collect();
        listed.sort();
        assert_eq!(present, listed, "EXAMPLES must name every examples/*.rs");
    }
    // What an example whose driver cannot be loaded prints after its own prefix: the chain of the
    // loader's error, as the library reports it.
    let load_error = ppnrt::loader::Driver::load(&[NO_DRIVER.to_string()]).err().expect("no driver at that path");
    let no_driver = ppnrt::error::chain(&ppnrt::CudaError::Load(load_error));

    let mut failures = Vec::new();
    let mut ran = 0;
    for name in EXAMPLES {
        let exe = match executable(name) {
            Ok(exe) => exe,
            Err(why) => {
                println!("SKIPPED {name}: {why}");
                continue;
            }
        };
        ran += 1;
        let mut fail = |what: &str, args: &[&str], out: &Ran| {
            failures.push(format!(
                "{name} {args:?}: {what} (status {:?})\n  stdout: {}\n  stderr: {}",
                out.status,
                out.stdout.trim_end(),
                out.stderr.trim_end()
            ))
        };
        let usage = format!("usage: {name}");

        for help in ["--help", "-h"] {
            let out = run(&exe, &[help], &[]);
            if out.status != Some(0) || !out.stdout.starts_with(&usage) || !out.stderr.is_empty() {
                fail("expected status 0 and the usage on stdout, nothing on stderr", &[help], &out);
            }
        }

        let mut bad: Vec<(Vec<&str>, &str)> = vec![(vec!["--no-such-flag"], "--no-such-flag")];
        bad.extend(BAD_VALUES.iter().filter(|(n, ..)| *n == name).map(|(_, args, named)| (args.to_vec(), *named)));
        for (args, named) in bad {
            let out = run(&exe, &args, &[]);
            let mut lines = out.stderr.lines();
            let message = lines.next().unwrap_or_default();
            let hint = lines.next().unwrap_or_default();
            if out.status != Some(2)
                || !message.starts_with(&format!("{name}: "))
                || !message.contains(named)
                || !hint.starts_with(&usage)
                || !out.stdout.is_empty()
            {
                fail(&format!("expected status 2, a line naming {named:?}, then the usage, on stderr"), &args, &out);
            }
        }

        let out = run(&exe, &[], &[]);
        let stderr = out.stderr.trim_end();
        let prefix = stderr.strip_suffix(no_driver.as_str());
        let one_chain = prefix.is_some_and(|p| p.starts_with(name) && p.ends_with(": ") && !p.contains('\n'));
        if out.status != Some(1) || !one_chain {
            fail(
                &format!(
                    "expected status 1 and `{name}...: ` then the loader's error chain ({no_driver:?}), nothing else"
                ),
                &[],
                &out,
            );
        }
    }
    // A rank of 06_two_processes reads its placement from the environment: a bad one is status 2.
    if let Ok(exe) = executable("06_two_processes") {
        let out = run(&exe, &[], &[("PPNRT_RANK", "0"), ("PPNRT_RANKS", "zero,one")]);
        if out.status != Some(2) || !out.stderr.starts_with("06_two_processes: ") || !out.stderr.contains("PPNRT_RANKS")
        {
            failures.push(format!(
                "06_two_processes with PPNRT_RANKS=zero,one: expected status 2 naming it, got {:?}: {}",
                out.status,
                out.stderr.trim_end()
            ));
        }
    }
    println!("{ran} of {} examples run", EXAMPLES.len());
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}
