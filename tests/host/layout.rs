//! The test tree shows its tiers: every test lives in `tests/host/`, `tests/double/` or
//! `tests/gpu/`, every file there is compiled (a binary of Cargo.toml or a module of one), no GPU
//! test loads the driver double and no host test loads a driver, and each proptest regression
//! file belongs to a source proptest finds it from.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

const TIERS: [&str; 3] = ["host", "double", "gpu"];

fn tests_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests")
}

/// The `.rs` files under `dir`, at any depth.
fn sources(dir: &Path) -> Vec<PathBuf> {
    let mut found = Vec::new();
    let mut dirs = vec![dir.to_path_buf()];
    while let Some(dir) = dirs.pop() {
        for entry in std::fs::read_dir(&dir).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                dirs.push(path);
            } else if path.extension().is_some_and(|e| e == "rs") {
                found.push(path);
            }
        }
    }
    found.sort();
    found
}

/// The paths of Cargo.toml's `[[test]]` targets, relative to the package root.
fn test_binaries() -> Vec<String> {
    let manifest = std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("Cargo.toml")).unwrap();
    let mut paths = Vec::new();
    let mut in_test = false;
    for line in manifest.lines().map(str::trim) {
        if line.starts_with('[') {
            in_test = line == "[[test]]";
        } else if let Some(path) = line.strip_prefix("path = \"").filter(|_| in_test) {
            paths.push(path.trim_end_matches('"').to_string());
        }
    }
    paths
}

/// The files that `file` (a crate root when `root`) compiles through its `mod` declarations, and
/// theirs, added to `into`.
fn compiled_from(file: &Path, root: bool, into: &mut BTreeSet<PathBuf>) {
    let Ok(file) = file.canonicalize() else { return };
    if !into.insert(file.clone()) {
        return;
    }
    let text = std::fs::read_to_string(&file).unwrap();
    let dir = file.parent().unwrap();
    // A crate root or a `mod.rs` holds its modules beside it; another file, in a folder of its
    // own name. A `#[path]` is relative to the file's folder.
    let children =
        if root || file.ends_with("mod.rs") { dir.to_path_buf() } else { dir.join(file.file_stem().unwrap()) };
    let mut path_attr: Option<String> = None;
    for line in text.lines().map(str::trim) {
        if let Some(path) = line.strip_prefix("#[path = \"") {
            path_attr = Some(path.trim_end_matches("\"]").to_string());
            continue;
        }
        let declared = line.strip_prefix("pub ").unwrap_or(line);
        if let Some(name) = declared.strip_prefix("mod ").and_then(|rest| rest.strip_suffix(';')) {
            let module = match path_attr.take() {
                Some(path) => dir.join(path),
                None => children.join(format!("{name}.rs")),
            };
            compiled_from(&module, false, into);
        } else if !line.starts_with("#[") {
            path_attr = None;
        }
    }
}

#[test]
fn every_test_lives_in_its_tier_and_every_file_there_is_compiled() {
    let tests = tests_dir();
    let stray: Vec<_> = std::fs::read_dir(&tests)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "rs"))
        .collect();
    assert!(stray.is_empty(), "tests outside a tier folder (host, double, gpu): {stray:?}");

    let binaries = test_binaries();
    for tier in TIERS {
        assert!(binaries.contains(&format!("tests/{tier}/main.rs")), "no `{tier}` binary in Cargo.toml");
    }
    let mut compiled = BTreeSet::new();
    for binary in &binaries {
        let tier = binary.strip_prefix("tests/").and_then(|rest| rest.split('/').next()).unwrap_or("");
        assert!(TIERS.contains(&tier), "the test binary {binary} is in no tier folder");
        let root = Path::new(env!("CARGO_MANIFEST_DIR")).join(binary);
        assert!(root.is_file(), "Cargo.toml names {binary}, which is not there");
        compiled_from(&root, true, &mut compiled);
    }
    for tier in TIERS {
        for file in sources(&tests.join(tier)) {
            let file = file.canonicalize().unwrap();
            assert!(compiled.contains(&file), "{} is neither a test binary nor a module of one", file.display());
        }
    }
}

#[test]
fn no_gpu_test_loads_the_double_and_no_host_test_loads_a_driver() {
    let tests = tests_dir();
    for file in sources(&tests.join("gpu")) {
        let text = std::fs::read_to_string(&file).unwrap();
        assert!(!text.contains("common/double.rs"), "{}: a GPU test loads the driver double", file.display());
    }
    for file in sources(&tests.join("host")) {
        // `no_driver` loads none on purpose: it points the loader at a missing library first
        // (and this file names the words it looks for).
        if file.ends_with("no_driver.rs") || file.ends_with("layout.rs") {
            continue;
        }
        let text = std::fs::read_to_string(&file).unwrap();
        for word in ["common/double.rs", "Engine::new(", "Device::count(", "requires("] {
            assert!(!text.contains(word), "{}: a host test names `{word}`", file.display());
        }
    }
}

/// proptest keeps a source's regressions in `proptest-regressions/NAME.txt` beside the folder
/// of the nearest `main.rs` or `lib.rs` above the source: for `tests/double/rule.rs`,
/// `tests/proptest-regressions/rule.txt`.
#[test]
fn every_proptest_regression_file_belongs_to_a_proptest() {
    let tests = tests_dir();
    let dir = tests.join("proptest-regressions");
    let Ok(entries) = std::fs::read_dir(&dir) else { return };
    let sources: Vec<PathBuf> = TIERS.iter().flat_map(|tier| sources(&tests.join(tier))).collect();
    for entry in entries {
        let file = entry.unwrap().path();
        let name = file.file_stem().unwrap().to_string_lossy().into_owned();
        let owner = sources.iter().find(|source| {
            source.file_stem().is_some_and(|stem| stem.to_string_lossy() == name)
                && source
                    .parent()
                    .is_some_and(|folder| folder.join("main.rs").is_file() && folder.parent() == Some(&tests))
                && std::fs::read_to_string(source).unwrap().contains("proptest!")
        });
        assert!(owner.is_some(), "{} belongs to no proptest of tests/<tier>/{name}.rs", file.display());
    }
}
