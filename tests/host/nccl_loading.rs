//! NCCL loaded at run time, with no driver and no NCCL installed: a missing, incomplete or
//! too-old library is a typed error, and an unusable candidate is skipped for a later one
//! (checked with small stand-in libraries built by the system C compiler).

use std::path::PathBuf;
use std::process::Command;

use crate::common::say;
use ppnrt::nccl::{MINIMUM_VERSION, Nccl, NcclError, NcclVersion};

/// Builds a shared library from `source` (C) and returns its path, or `None` after saying why.
fn stand_in(name: &str, source: &str) -> Option<PathBuf> {
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("nccl-stand-ins");
    std::fs::create_dir_all(&dir).unwrap();
    let c = dir.join(format!("{name}.c"));
    let so = dir.join(format!("lib{name}-{}.so", std::process::id()));
    std::fs::write(&c, source).unwrap();
    let compiler = std::env::var("CC").unwrap_or_else(|_| "cc".into());
    match Command::new(&compiler).args(["-shared", "-fPIC", "-o"]).arg(&so).arg(&c).output() {
        Ok(out) if out.status.success() => Some(so),
        Ok(out) => panic!("{compiler} failed: {}", String::from_utf8_lossy(&out.stderr)),
        Err(e) => {
            say(&format!("SKIPPED {name}: no C compiler `{compiler}`: {e}"));
            None
        }
    }
}

#[test]
fn an_nccl_older_than_the_minimum_is_a_typed_error() {
    let Some(library) = stand_in("old_nccl", "int ncclGetVersion(int* v) { *v = 2608; return 0; }\n") else { return };
    let path = library.to_string_lossy().into_owned();
    match Nccl::load(std::slice::from_ref(&path)) {
        Err(NcclError::TooOld { library, found, required }) => {
            assert_eq!(library, path);
            assert_eq!(found, NcclVersion { major: 2, minor: 6, patch: 8 });
            assert_eq!(required, MINIMUM_VERSION);
        }
        other => panic!("expected TooOld, got {other:?}"),
    }
}

#[test]
fn a_library_without_nccl_is_a_typed_error() {
    let Some(library) = stand_in("not_nccl", "int unrelated(void) { return 0; }\n") else { return };
    let path = library.to_string_lossy().into_owned();
    match Nccl::load(std::slice::from_ref(&path)) {
        Err(NcclError::MissingEntryPoint { library, symbol }) => {
            assert_eq!(library, path);
            assert_eq!(symbol, "ncclGetVersion");
        }
        other => panic!("expected MissingEntryPoint, got {other:?}"),
    }
    match Nccl::load(&["/nonexistent/libnccl.so.2".to_string()]) {
        Err(NcclError::NotFound { tried }) => assert!(tried[0].to_string().contains("/nonexistent/libnccl.so.2")),
        other => panic!("expected NotFound, got {other:?}"),
    }
}

/// A candidate too old (or not NCCL at all) is skipped for a later usable one, instead of failing
/// the load; when none is usable, the error names every candidate and why it was skipped.
#[test]
fn an_unusable_candidate_is_skipped_for_a_later_one() {
    let Some(old) = stand_in("old_nccl_skipped", "int ncclGetVersion(int* v) { *v = 2608; return 0; }\n") else {
        return;
    };
    let Some(not_nccl) = stand_in("not_nccl_skipped", "int unrelated(void) { return 0; }\n") else { return };
    let Some(new) = stand_in("new_nccl", "int ncclGetVersion(int* v) { *v = 22809; return 0; }\n") else { return };
    let [old, not_nccl, new] = [old, not_nccl, new].map(|path| path.to_string_lossy().into_owned());
    let loaded = Nccl::load(&[old.clone(), not_nccl.clone(), new.clone()]).unwrap();
    assert_eq!(loaded.library(), new);
    assert_eq!(loaded.version(), NcclVersion { major: 2, minor: 28, patch: 9 });
    let absent = "/nonexistent/libnccl.so.2".to_string();
    match Nccl::load(&[old.clone(), not_nccl.clone(), absent.clone()]) {
        Err(e @ NcclError::NotFound { .. }) => {
            let NcclError::NotFound { tried } = &e else { unreachable!() };
            let named: Vec<&str> = tried.iter().map(|attempt| attempt.candidate.as_str()).collect();
            assert_eq!(named, [old.as_str(), not_nccl.as_str(), absent.as_str()]);
            assert!(tried[0].reason.contains("2.6.8") && tried[0].reason.contains("2.7.0"), "{e}");
            assert!(tried[1].reason.contains("ncclGetVersion"), "{e}");
            assert!(tried[2].reason.contains("nonexistent"), "{e}");
        }
        other => panic!("expected NotFound naming each candidate, got {other:?}"),
    }
}
