//! What the crate reads from the process's environment, read here with the variables set as a
//! user sets them (this binary's tests change the environment, one at a time): a job secret
//! variable set but empty is a typed error, never "no secret"; the search for NCCL's Python
//! wheel runs no program (a `python3` first on `PATH` is never started) and still finds the
//! wheel of each place Python looks; the transport between ranks is read from its variable.

use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use ppnrt::auth::{JOB_SECRET_FILE_VAR, JOB_SECRET_VAR};
use ppnrt::{JobAccess, PpConfig};

/// Held by every test of this binary while it changes or reads the environment.
static ENVIRONMENT: Mutex<()> = Mutex::new(());

/// Sets (or, with `None`, removes) `vars` for the duration of `body`, then restores them.
fn with_vars<R>(vars: &[(&str, Option<&std::ffi::OsStr>)], body: impl FnOnce() -> R) -> R {
    let _held = ENVIRONMENT.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
    let before: Vec<(&str, Option<OsString>)> = vars.iter().map(|(name, _)| (*name, std::env::var_os(name))).collect();
    let set = |name: &str, value: Option<&std::ffi::OsStr>| match value {
        // SAFETY: every test of this binary changes or reads the environment only while it
        // holds ENVIRONMENT, and the crate's calls here start no thread that reads it.
        Some(value) => unsafe { std::env::set_var(name, value) },
        // SAFETY: as above.
        None => unsafe { std::env::remove_var(name) },
    };
    for (name, value) in vars {
        set(name, *value);
    }
    let result = body();
    for (name, value) in &before {
        set(name, value.as_deref());
    }
    result
}

/// An empty `PPNRT_JOB_SECRET` used to be taken as unset, and the ranks fell back to same-host
/// access without a secret: it is a typed error naming the variable, as is an empty
/// `PPNRT_JOB_SECRET_FILE`.
#[test]
fn an_empty_secret_variable_is_an_error_not_no_secret() {
    let empty = Some(std::ffi::OsStr::new(""));
    for var in [JOB_SECRET_VAR, JOB_SECRET_FILE_VAR] {
        let other = if var == JOB_SECRET_VAR { JOB_SECRET_FILE_VAR } else { JOB_SECRET_VAR };
        let (access, config) =
            with_vars(&[(var, empty), (other, None)], || (JobAccess::from_env(), PpConfig::from_env()));
        let err = access.unwrap_err();
        assert_eq!(err.setting, var, "{err}");
        assert!(err.to_string().contains("set but empty"), "{err}");
        let err = config.unwrap_err();
        assert!(err.to_string().contains(var) && err.to_string().contains("empty"), "{err}");
    }
    let unset = with_vars(&[(JOB_SECRET_VAR, None), (JOB_SECRET_FILE_VAR, None)], JobAccess::from_env);
    assert_eq!(unset.unwrap(), JobAccess::SameHost);
}

/// A fresh directory of this test process.
fn root(name: &str) -> PathBuf {
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(format!("environment-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// A fake wheel library in `site`; its path.
fn wheel(site: &Path) -> String {
    let lib = site.join("nvidia/nccl/lib");
    std::fs::create_dir_all(&lib).unwrap();
    std::fs::write(lib.join("libnccl.so.2"), b"not a library").unwrap();
    lib.join("libnccl.so.2").to_string_lossy().into_owned()
}

/// Loading NCCL used to run `python3` to ask where its packages are: a library must not start
/// processes. A `python3` first on `PATH` that leaves a mark when run is never run, and the
/// wheels of the virtual environment and of that Python's installation are found all the same.
#[cfg(unix)]
#[test]
fn the_nccl_search_runs_no_program_and_finds_the_wheels() {
    use std::os::unix::fs::PermissionsExt;
    let root = root("nccl-search");
    let marker = root.join("python3-was-run");
    let bin = root.join("python/bin");
    std::fs::create_dir_all(&bin).unwrap();
    let python = bin.join("python3");
    std::fs::write(&python, format!("#!/bin/sh\necho run > '{}'\necho '{}'\n", marker.display(), root.display()))
        .unwrap();
    std::fs::set_permissions(&python, std::fs::Permissions::from_mode(0o755)).unwrap();
    let on_path = wheel(&root.join("python/lib/python3.12/site-packages"));
    let venv = wheel(&root.join("venv/lib/python3.11/site-packages"));
    let path = std::env::join_paths([bin.as_path()]).unwrap();
    let venv_dir = root.join("venv").into_os_string();
    let home = root.join("home").into_os_string();
    let candidates = with_vars(
        &[
            ("PATH", Some(path.as_os_str())),
            ("VIRTUAL_ENV", Some(venv_dir.as_os_str())),
            ("HOME", Some(home.as_os_str())),
            ("CONDA_PREFIX", None),
            ("PYTHONPATH", None),
            (ppnrt::nccl::LIBNCCL_PATH_VAR, None),
        ],
        ppnrt::nccl::default_candidates,
    );
    assert!(!marker.exists(), "the search ran `python3` (found its mark at {})", marker.display());
    assert_eq!(candidates.first(), Some(&venv), "{candidates:?}");
    assert!(candidates.contains(&on_path), "{candidates:?}");
    assert_eq!(candidates.last().map(String::as_str), Some("libnccl.so.2"), "{candidates:?}");
    std::fs::remove_dir_all(root).unwrap();
}

/// `PPNRT_PROCESS_TRANSPORT` is read with the other settings: its value reaches the
/// configuration (and its fingerprint), and an unknown one is a typed error naming the variable.
#[test]
fn the_process_transport_is_read_from_its_variable() {
    use ppnrt::ProcessTransport;
    use ppnrt::pp::PROCESS_TRANSPORT_VAR;
    let read =
        |value: &str| with_vars(&[(PROCESS_TRANSPORT_VAR, Some(std::ffi::OsStr::new(value)))], PpConfig::from_env);
    let config = read("nccl").unwrap();
    assert_eq!(config.process_transport(), ProcessTransport::Nccl);
    assert!(config.fingerprint().contains("PPNRT_PROCESS_TRANSPORT=nccl"), "{config}");
    assert_eq!(read("ipc").unwrap().process_transport(), ProcessTransport::Ipc);
    let err = read("shared-memory").unwrap_err();
    assert_eq!((err.setting, err.value.as_str()), (PROCESS_TRANSPORT_VAR, "shared-memory"), "{err}");
    let unset = with_vars(&[(PROCESS_TRANSPORT_VAR, None)], PpConfig::from_env).unwrap();
    assert_eq!(unset.process_transport(), ProcessTransport::Auto);
}
