//! The crate's docs read as text: every public type shows a rendered example in its docs, and
//! the contributor's pages (`CONTRIBUTING.md`, `docs/ARCHITECTURE.md`) name only paths that exist.

use std::path::{Path, PathBuf};

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// Every `.rs` file under `dir`, sorted.
fn rust_files(dir: &Path) -> Vec<PathBuf> {
    let mut files = Vec::new();
    let mut dirs = vec![dir.to_path_buf()];
    while let Some(dir) = dirs.pop() {
        for entry in std::fs::read_dir(dir).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                dirs.push(path);
            } else if path.extension().is_some_and(|e| e == "rs") {
                files.push(path);
            }
        }
    }
    files.sort();
    files
}

/// The public types with no example, by design: (file under `src/`, type, why).
const WITHOUT_EXAMPLE: &[(&str, &str, &str)] = &[
    ("lib.rs", "ReadmeDoctests", "exists only under cfg(doctest): its docs are the README's examples"),
    ("interop.rs", "Lend", "sealed: a private module's trait, no caller can name it"),
    ("interop.rs", "LendMut", "sealed: a private module's trait, no caller can name it"),
    ("safe/memory.rs", "Sealed", "sealed: a private module's trait, no caller can name it"),
    ("safe/launch/mod.rs", "Own", "sealed: a private module's marker, no caller can name it"),
    ("safe/helpers.rs", "TestKernels", "a test fixture of the `testing` feature, not rendered on docs.rs"),
    ("pp/fault.rs", "ProtocolFault", "a test fixture of the `testing` feature, not rendered on docs.rs"),
];

/// A fence's info string that makes a rendered, compiled example: Rust that is built (and run
/// or not), never `ignore`, `text` or `compile_fail`.
fn is_example_fence(info: &str) -> bool {
    info.split(',')
        .map(str::trim)
        .all(|word| matches!(word, "" | "rust" | "no_run" | "should_panic") || word.starts_with("edition"))
}

/// The public types (`pub struct`, `enum`, `trait`, `type` at any depth) of `source` with no
/// example in the doc comment above them: (line, kind, name).
fn types_without_example(source: &str) -> Vec<(usize, String, String)> {
    let lines: Vec<&str> = source.lines().collect();
    let mut missing = Vec::new();
    for (at, line) in lines.iter().enumerate() {
        let code = line.trim_start();
        let Some(rest) = code.strip_prefix("pub ") else { continue };
        let rest = rest.strip_prefix("unsafe ").unwrap_or(rest);
        let Some((kind, rest)) = ["struct ", "enum ", "trait ", "type "]
            .iter()
            .find_map(|kind| rest.strip_prefix(kind).map(|rest| (kind.trim(), rest)))
        else {
            continue;
        };
        let name: String = rest.chars().take_while(|c| c.is_alphanumeric() || *c == '_').collect();
        // The doc comment and attributes above the item (an attribute may span lines).
        let mut doc = Vec::new();
        let mut hidden = false;
        let mut above = at;
        while above > 0 {
            let previous = lines[above - 1].trim();
            if let Some(text) = previous.strip_prefix("///") {
                doc.push(text.trim());
            } else if previous.starts_with("#[") {
                hidden |= previous.contains("doc(hidden)");
            } else if previous.ends_with(']') || previous.ends_with(")]") || previous.ends_with(',') {
                // The tail of an attribute over several lines: up to its `#[`.
                while above > 1 && !lines[above - 1].trim().starts_with("#[") {
                    above -= 1;
                }
            } else {
                break;
            }
            above -= 1;
        }
        // The fences in order (the walk went upwards): an opening one whose info is an example's.
        doc.reverse();
        let mut open = false;
        let mut example = false;
        for text in &doc {
            if let Some(info) = text.strip_prefix("```") {
                example |= !open && is_example_fence(info);
                open = !open;
            }
        }
        // Not rendered: nothing to show.
        if !example && !hidden {
            missing.push((at + 1, kind.to_string(), name));
        }
    }
    missing
}

/// Every public type of the crate has at least one example in its docs, which rustdoc renders
/// and `cargo test` compiles: what `ppnrt::Xxx` is for, shown as code an engine author writes.
/// The generated bindings (`src/sys/`), the types rustdoc hides (`#[doc(hidden)]`) and those named
/// in [`WITHOUT_EXAMPLE`] (each with its reason) are the exceptions. The scan can fail: it finds the type of a planted source without
/// an example, and none of one with.
#[test]
fn every_public_type_has_a_rendered_example() {
    let planted = "/// A type.\n///\n/// ```text\n/// not code\n/// ```\n#[derive(Debug)]\n#[cfg_attr(\n    docsrs,\n    doc(cfg(x))\n)]\npub struct Bare;\n\n/// Shown.\n///\n/// ```no_run\n/// let x = 1;\n/// ```\n#[derive(Debug)]\npub(crate) struct Hidden;\n/// Shown.\n///\n/// ```\n/// let y = 2;\n/// ```\n#[derive(Debug)]\npub enum Shown { A }\n    pub trait Indented {}\n#[doc(hidden)]\npub struct Hook;\n";
    let found: Vec<String> = types_without_example(planted).into_iter().map(|(_, _, name)| name).collect();
    assert_eq!(found, ["Bare", "Indented"], "the scan itself");

    let src = root().join("src");
    let mut missing = Vec::new();
    let mut excused = Vec::new();
    for file in rust_files(&src) {
        let relative = file.strip_prefix(&src).unwrap().to_string_lossy().replace('\\', "/");
        if relative.starts_with("sys/") {
            // Generated by bindgen from the driver's and NCCL's headers.
            continue;
        }
        let source = std::fs::read_to_string(&file).unwrap();
        for (line, kind, name) in types_without_example(&source) {
            if WITHOUT_EXAMPLE.iter().any(|(f, n, _)| *f == relative && *n == name) {
                excused.push((relative.clone(), name));
            } else {
                missing.push(format!("src/{relative}:{line}: pub {kind} {name}"));
            }
        }
    }
    assert!(
        missing.is_empty(),
        "public types without an example in their docs (add one, `no_run` where it needs a GPU):\n{}",
        missing.join("\n")
    );
    for (file, name, why) in WITHOUT_EXAMPLE {
        assert!(
            excused.iter().any(|(f, n)| f == file && n == name),
            "src/{file}: `{name}` is excused ({why}) but has an example now or is gone: remove it from the list"
        );
    }
}

/// The folders of the package a page's paths start from; the crate's modules (`safe/`, `pp/`, ...)
/// are named from `src/` too.
const TOPS: &[&str] = &["src/", "tests/", "scripts/", "examples/", "benches/", "docs/", "kernels/"];
const MODULES: &[&str] = &["safe/", "pp/", "nccl/", "auth/", "result/", "sys/", "rendezvous/"];

/// The paths a page names, each with its line: words that start with one of [`TOPS`], or with
/// one of [`MODULES`] (given from `src/`). A `{a,b}` part stands for each of its words; a part in
/// capitals (`NAME`), with `<` or `*`, for any name in its folder.
fn named_paths(text: &str) -> Vec<(usize, String)> {
    let mut paths = Vec::new();
    for (at, line) in text.lines().enumerate() {
        let bytes = line.as_bytes();
        for top in TOPS.iter().chain(MODULES) {
            let mut from = 0;
            while let Some(found) = line[from..].find(top) {
                let start = from + found;
                from = start + top.len();
                let before = start.checked_sub(1).map(|b| bytes[b]);
                if before.is_some_and(|b| b.is_ascii_alphanumeric() || b"_./-:".contains(&b)) {
                    continue;
                }
                let word: String = line[start..]
                    .chars()
                    .take_while(|c| c.is_ascii_alphanumeric() || "_./-*<>{},".contains(*c))
                    .collect();
                // A sentence's comma or full stop after the path, or a list of paths.
                let word = word.split(", ").next().unwrap().trim_end_matches(['.', ',']);
                let word =
                    if word.contains('{') { word.to_string() } else { word.split(',').next().unwrap().to_string() };
                let word = if MODULES.contains(top) { format!("src/{word}") } else { word };
                paths.push((at + 1, word));
            }
        }
    }
    paths
}

/// Whether `path` (as [`named_paths`] gives it) exists under `root`.
fn path_exists(root: &Path, path: &str) -> bool {
    if let (Some(open), Some(close)) = (path.find('{'), path.find('}')) {
        return path[open + 1..close]
            .split(',')
            .all(|each| path_exists(root, &format!("{}{each}{}", &path[..open], &path[close + 1..])));
    }
    let mut at = root.to_path_buf();
    for part in path.trim_end_matches('/').split('/') {
        let stem = part.split('.').next().unwrap_or("");
        let any =
            part.contains(['<', '*']) || (!stem.is_empty() && stem.chars().all(|c| c.is_ascii_uppercase() || c == '_'));
        if any {
            return at.is_dir();
        }
        at.push(part);
    }
    at.exists()
}

/// `CONTRIBUTING.md` and `docs/ARCHITECTURE.md` name only files and folders that exist: a file
/// moved or renamed fails here until the page follows it. The check can fail: a planted page
/// with a path that is gone is caught, and its placeholders are not.
#[test]
fn the_contributor_pages_name_only_paths_that_exist() {
    let root = root();
    let planted = "See `src/engine.rs`, tests/host/{main,docs}.rs, `safe/memory.rs` and `tests/<tier>/NAME.rs`.\nThen src/gone.rs, `pp/gone.rs` or tests/{host,nowhere}/main.rs.";
    let stale: Vec<String> =
        named_paths(planted).into_iter().filter(|(_, path)| !path_exists(&root, path)).map(|(_, path)| path).collect();
    assert_eq!(stale, ["src/gone.rs", "tests/{host,nowhere}/main.rs", "src/pp/gone.rs"], "the scan itself");

    let mut stale = Vec::new();
    for page in ["CONTRIBUTING.md", "docs/ARCHITECTURE.md"] {
        let text = std::fs::read_to_string(root.join(page)).unwrap();
        let paths = named_paths(&text);
        assert!(paths.len() >= 5, "{page}: the scan finds its paths ({paths:?})");
        for (line, path) in paths {
            // The published package leaves `scripts/` out: its paths are checked in the repository.
            let top = path.split('/').next().unwrap();
            if !root.join(top).is_dir() {
                continue;
            }
            if !path_exists(&root, &path) {
                stale.push(format!("{page}:{line}: {path}"));
            }
        }
    }
    assert!(stale.is_empty(), "paths named that do not exist (the file moved?):\n{}", stale.join("\n"));
}
