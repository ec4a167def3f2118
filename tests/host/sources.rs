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
/// `nccl`, `loader`, `local_channel` (the shared control block's mapping) and `interop` (cudarc's raw handles) opt in) — except NCCL's send and receive in `pp::remote`, which are
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
    assert!(files.iter().any(|f| f.ends_with("pp/runtime/step_graph/launch.rs")), "the walk reaches nested modules");
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
        [
            "pub mod interop;",
            "pub mod loader;",
            "pub mod local_channel;",
            "pub mod nccl;",
            "pub mod result;",
            "pub mod safe;",
            "pub mod sys;"
        ]
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

/// The lines of `source` where a `cfg` of the `testing` feature (`#[cfg(...)]`, `cfg!(...)`,
/// `#[cfg_attr(...)]` naming `feature = "testing"`) sits inside a function body. Comments are
/// skipped, and braces in string and character literals do not count; a function body is the
/// block that follows `fn NAME` (a `fn(` pointer type opens none, a declaration that ends in `;`
/// has none), and everything nested in it.
fn testing_cfgs_in_fn_bodies(source: &str) -> Vec<usize> {
    // The code with comments blanked and every brace inside a literal blanked (lines kept).
    let bytes = source.as_bytes();
    let mut code = String::with_capacity(source.len());
    let mut at = 0;
    let blank = |text: &str, code: &mut String| {
        code.extend(text.chars().map(|c| {
            if c == '\n' {
                '\n'
            } else if c == '{' || c == '}' {
                ' '
            } else {
                c
            }
        }))
    };
    while at < bytes.len() {
        let rest = &source[at..];
        if rest.starts_with("//") {
            let end = rest.find('\n').unwrap_or(rest.len());
            code.push_str(&" ".repeat(end));
            at += end;
        } else if rest.starts_with("/*") {
            let (mut depth, mut end) = (0usize, 0);
            while end < rest.len() {
                if rest[end..].starts_with("/*") {
                    depth += 1;
                    end += 2;
                } else if rest[end..].starts_with("*/") {
                    depth -= 1;
                    end += 2;
                    if depth == 0 {
                        break;
                    }
                } else {
                    end += rest[end..].chars().next().unwrap().len_utf8();
                }
            }
            code.extend(rest[..end].chars().map(|c| if c == '\n' { '\n' } else { ' ' }));
            at += end;
        } else if let Some(hashes) = rest.strip_prefix('r').map(|r| r.len() - r.trim_start_matches('#').len())
            && rest[1 + hashes..].starts_with('"')
            && !source[..at].ends_with(|c: char| c.is_alphanumeric() || c == '_')
        {
            let close = format!("\"{}", "#".repeat(hashes));
            let end = 2 + hashes + rest[2 + hashes..].find(&close).unwrap() + close.len();
            blank(&rest[..end], &mut code);
            at += end;
        } else if rest.starts_with('"') {
            let mut end = 1;
            while !rest[end..].starts_with('"') {
                end += if rest[end..].starts_with('\\') { 2 } else { rest[end..].chars().next().unwrap().len_utf8() };
            }
            blank(&rest[..end + 1], &mut code);
            at += end + 1;
        } else if let Some(inner) = rest.strip_prefix('\'') {
            // A character literal ('x', '\n', '\'', '\u{7b}'), or a lifetime ('a), left alone.
            let len = if inner.starts_with('\\') {
                inner.get(2..).and_then(|after| after.find('\'')).map(|end| end + 4)
            } else {
                let c = inner.chars().next().unwrap_or(' ').len_utf8();
                inner[c..].starts_with('\'').then_some(c + 2)
            };
            let end = len.unwrap_or(1);
            blank(&rest[..end], &mut code);
            at += end;
        } else {
            let c = rest.chars().next().unwrap();
            code.push(c);
            at += c.len_utf8();
        }
    }
    // Each `cfg` that names the feature, by byte offset.
    let mut cfgs = Vec::new();
    for (start, _) in code.match_indices("cfg") {
        let before = code[..start].chars().next_back().unwrap_or(' ');
        let after = &code[start + 3..];
        let after = after.strip_prefix("_attr").or_else(|| after.strip_prefix('!')).unwrap_or(after).trim_start();
        if before.is_alphanumeric() || before == '_' || !after.starts_with('(') {
            continue;
        }
        let mut depth = 0;
        let end = after
            .char_indices()
            .find(|&(_, c)| {
                depth += i32::from(c == '(') - i32::from(c == ')');
                depth == 0
            })
            .map_or(after.len(), |(end, _)| end);
        let words: String = after[..end].split_whitespace().collect();
        if words.contains("feature=\"testing\"") {
            cfgs.push(start);
        }
    }
    // Walk the braces: each open brace is a function body (or inside one) or not.
    let mut stack: Vec<bool> = Vec::new();
    let mut pending_fn = false;
    let mut found = Vec::new();
    let mut next_cfg = cfgs.iter().peekable();
    let chars: Vec<(usize, char)> = code.char_indices().collect();
    for (i, &(offset, c)) in chars.iter().enumerate() {
        while let Some(&&cfg) = next_cfg.peek() {
            if cfg > offset {
                break;
            }
            if stack.last() == Some(&true) {
                found.push(code[..cfg].matches('\n').count() + 1);
            }
            next_cfg.next();
        }
        let inside = stack.last() == Some(&true);
        match c {
            '{' => {
                stack.push(inside || pending_fn);
                pending_fn = false;
            }
            '}' => {
                stack.pop();
                pending_fn = false;
            }
            ';' if !inside => pending_fn = false,
            'f' if !inside => {
                let before = if i == 0 { ' ' } else { chars[i - 1].1 };
                let word = code[offset..].starts_with("fn")
                    && !(before.is_alphanumeric() || before == '_')
                    && code[offset + 2..].starts_with(char::is_whitespace);
                // `fn name`: an item, whose body (if any) opens with the next brace; `fn(`: a type.
                if word && code[offset + 2..].trim_start().starts_with(|c: char| c.is_alphabetic() || c == '_') {
                    pending_fn = true;
                }
            }
            _ => {}
        }
    }
    found
}

/// No function body in `src/` carries a `cfg` of the `testing` feature: test hooks are reached
/// through `pp::fault`'s named points (empty without the feature) or are items of their own
/// (a test-only function, method, field or constant may carry the `cfg`). The check can fail:
/// it finds the planted cases below and passes the allowed ones.
#[test]
fn no_function_body_carries_a_testing_cfg() {
    let planted = r##"
#[cfg(feature = "testing")]
fn test_only() { hook(); }
struct S { #[cfg(feature = "testing")] field: u8, callback: fn(u8) -> u8 }
type F = fn();
trait T { #[cfg(feature = "testing")] fn declared(&self); }
impl S {
    /// A doc's `#[cfg(feature = "testing")]` is no attribute.
    fn production(&self, open: &str) -> Result<(), String> {
        let _ = ("{", '{', r#"}"#, '\'', '\u{7b}', "\"{");
        // #[cfg(feature = "testing")] in a comment
        #[cfg(feature = "testing")]
        hook();
        Ok(())
    }
    #[cfg(not(feature = "testing"))]
    fn inert(&self) {}
    fn generic<T: Fn() -> u8>(&self, f: T) where T: Copy {
        let g = || {
            if cfg!(feature = "testing") { f(); }
        };
    }
}
fn last() { #[cfg_attr(not(feature = "testing"), allow(unused))] let x = 1; }
"##;
    assert_eq!(testing_cfgs_in_fn_bodies(planted), [12, 20, 24], "the scan finds the planted cases and only those");
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut dirs = vec![root];
    let mut found = Vec::new();
    let mut scanned = 0;
    while let Some(dir) = dirs.pop() {
        for entry in std::fs::read_dir(dir).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                dirs.push(path);
            } else if path.extension().is_some_and(|e| e == "rs") {
                let text = std::fs::read_to_string(&path).unwrap();
                scanned += 1;
                found.extend(
                    testing_cfgs_in_fn_bodies(&text).into_iter().map(|line| format!("{}:{line}", path.display())),
                );
            }
        }
    }
    assert!(scanned > 50, "the walk reaches every module ({scanned} files)");
    assert!(found.is_empty(), "a `testing` cfg inside a function body (use `pp::fault`'s points): {found:?}");
}
