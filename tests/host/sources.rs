//! The crate's sources read as text, no driver needed: the README's quick start is the quickstart
//! example, the layers hold (`engine` and `pp` use no raw pointers and no `unsafe`), and the
//! top-level modules depend on each other without a cycle.

/// The README's quick start is `examples/quickstart.rs`, word for word (the README block is
/// compiled as a doctest, the example runs in the GPU gate).
#[test]
fn the_readme_quick_start_is_the_quickstart_example() {
    let readme = include_str!("../../README.md");
    let example = include_str!("../../examples/quickstart.rs");
    let start = readme.find("```rust,no_run\n").expect("the README has a quick start") + "```rust,no_run\n".len();
    let block = &readme[start..start + readme[start..].find("```").unwrap()];
    assert_eq!(block, example, "README quick start and examples/quickstart.rs differ");
}

/// The layers hold: `engine` and `pp` call only the safe layer below them — no raw device
/// pointers, no `unsafe` (the crate root denies `unsafe_code`; only `sys`, `result`, `safe`,
/// `nccl`, `loader` and `interop` (cudarc's raw handles) opt in) — except NCCL's send and receive in `pp::remote`, which are
/// unsafe because NCCL does not check that a send's count matches its receive's: the links'
/// sealed records carry the counts, and each such call says so (`// SAFETY:` on the line above).
#[test]
fn engine_and_pp_use_no_raw_pointers_and_no_unsafe() {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut files = vec![root.join("engine.rs")];
    let mut dirs = vec![root.join("pp")];
    while let Some(dir) = dirs.pop() {
        for entry in std::fs::read_dir(dir).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() { dirs.push(path) } else { files.push(path) }
        }
    }
    assert!(files.iter().any(|f| f.ends_with("pp/runtime/step_graph.rs")), "the walk reaches nested modules");
    // The only unsafe of `pp`: NCCL's point-to-point calls of the links, and the two functions
    // that post a receive (their contract: the receive is of the announced count).
    let nccl_p2p = ["comm.send(", "comm.recv(", "receive_step(", "capture_receive("];
    for file in &files {
        let text = std::fs::read_to_string(file).unwrap();
        let remote = file.components().any(|c| c.as_os_str() == "remote");
        let lines: Vec<&str> = text.lines().collect();
        for (at, line) in lines.iter().enumerate() {
            let code = line.split("//").next().unwrap_or("");
            if remote && code.contains("unsafe") && nccl_p2p.iter().any(|call| code.contains(call)) {
                let documented = code.contains("unsafe fn")
                    || lines[..at].iter().rev().take(4).any(|above| above.trim_start().starts_with("// SAFETY:"));
                assert!(documented, "{}:{}: an unsafe NCCL call without a SAFETY comment", file.display(), at + 1);
                continue;
            }
            for word in ["unsafe", "CUdeviceptr", "device_ptr"] {
                assert!(
                    !code.contains(word) || code.trim() == "#[allow(unsafe_code)]",
                    "{}:{} uses `{word}`",
                    file.display(),
                    at + 1
                );
            }
        }
        let opts_in = text.matches("allow(unsafe_code)").count();
        let allowed = usize::from(file.ends_with("pp/mod.rs"));
        assert_eq!(opts_in, allowed, "{} opts into unsafe code", file.display());
    }
    let pp = std::fs::read_to_string(root.join("pp/mod.rs")).unwrap();
    assert!(pp.contains("#[allow(unsafe_code)]\nmod remote;"), "only `pp::remote` opts in");
    let lib = std::fs::read_to_string(root.join("lib.rs")).unwrap();
    assert!(lib.contains("#![deny(unsafe_code)]"));
    let opted_in: Vec<&str> = lib
        .lines()
        .zip(lib.lines().skip(1))
        .filter(|(attr, _)| attr.trim() == "#[allow(unsafe_code)]")
        .map(|(_, module)| module.trim())
        .collect();
    assert_eq!(
        opted_in,
        ["pub mod interop;", "pub mod loader;", "pub mod nccl;", "pub mod result;", "pub mod safe;", "pub mod sys;"]
    );
}

/// The crate's top-level modules form layers: no module depends on itself through others. A
/// module depends on `x` when any of its files names `crate::x` (code or docs). The check can
/// fail: it finds a cycle in a graph with one (see the assertion before the walk).
#[test]
fn the_top_level_modules_have_no_cycle() {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut files: Vec<(String, std::path::PathBuf)> = Vec::new();
    let mut dirs = vec![root.clone()];
    while let Some(dir) = dirs.pop() {
        for entry in std::fs::read_dir(dir).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                dirs.push(path);
                continue;
            }
            let relative = path.strip_prefix(&root).unwrap();
            let top = relative.iter().next().unwrap().to_string_lossy().trim_end_matches(".rs").to_string();
            // The root names every module; generated bindings name none.
            if top != "lib" && !relative.ends_with("driver_bindings.rs") && !relative.ends_with("nccl_bindings.rs") {
                files.push((top, path));
            }
        }
    }
    let modules: std::collections::BTreeSet<String> = files.iter().map(|(top, _)| top.clone()).collect();
    let mut depends: std::collections::BTreeMap<String, std::collections::BTreeSet<String>> = Default::default();
    for (top, path) in &files {
        let text = std::fs::read_to_string(path).unwrap();
        for (at, _) in text.match_indices("crate::") {
            let name: String = text[at + 7..]
                .chars()
                .take_while(|c| c.is_ascii_lowercase() || *c == '_' || c.is_ascii_digit())
                .collect();
            if modules.contains(&name) && &name != top {
                depends.entry(top.clone()).or_default().insert(name);
            }
        }
    }
    let cycle_of = |depends: &std::collections::BTreeMap<String, std::collections::BTreeSet<String>>| {
        // Depth-first search from each module, reporting the first path back to it.
        for start in depends.keys() {
            let mut stack = vec![vec![start.clone()]];
            let mut seen = std::collections::BTreeSet::new();
            while let Some(path) = stack.pop() {
                let last = path.last().unwrap();
                for next in depends.get(last).into_iter().flatten() {
                    if next == start {
                        return Some([path.clone(), vec![next.clone()]].concat());
                    }
                    if seen.insert(next.clone()) {
                        stack.push([path.clone(), vec![next.clone()]].concat());
                    }
                }
            }
        }
        None
    };
    let mut broken = depends.clone();
    broken.entry("error".into()).or_default().insert("pp".into());
    assert!(cycle_of(&broken).is_some(), "the check finds a cycle when `error` names `pp`");
    if let Some(cycle) = cycle_of(&depends) {
        panic!("the top-level modules depend on each other in a circle: {}", cycle.join(" -> "));
    }
}
