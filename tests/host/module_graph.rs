//! The files inside `safe/`, `pp/` and `nccl/` form layers: no circle between them but the named exceptions.

/// Inside `safe/`, `pp/` and `nccl/` the files form layers as well: no file (module) depends on
/// itself through its siblings, but for the exceptions named below, each with its reason. A file
/// depends on a sibling when its code (not its docs: a doc link is a pointer for the reader) names
/// an item of it: through a path (`super::x::Item`, `crate::safe::x::Item`, a `use` of one), through
/// the front door's re-exports (`super::Item`, `crate::Item`, resolved to the file that defines the
/// item), or through a glob import (`use super::*`: each name the file uses is looked up where the
/// glob points). A subfolder is one node with its file (`launch.rs`/`launch/mod.rs` and
/// `launch/*.rs` are `launch`); a folder's `mod.rs` is the node `mod`, whose re-exports are its
/// front door (no dependency) while the rest of its code depends like any file's. The check can
/// fail: it finds a circle in a small tree written for it (a glob one way, a path the other), and
/// in the safe layer's graph with one dependency planted.
#[test]
fn the_files_inside_safe_pp_and_nccl_have_no_cycle() {
    use std::collections::{BTreeMap, BTreeSet};

    // The check itself, on a tree with a circle: `x` names `Y` through its glob of the parent,
    // `y` names `super::X`, which the parent re-exports from `x` by a glob.
    let planted = std::env::temp_dir().join(format!("ppnrt-no-cycle-{}", std::process::id()));
    std::fs::create_dir_all(planted.join("a")).unwrap();
    std::fs::write(planted.join("lib.rs"), "mod a;\n").unwrap();
    std::fs::write(planted.join("a/mod.rs"), "mod x;\nmod y;\npub use x::*;\npub use y::Y;\n").unwrap();
    std::fs::write(planted.join("a/x.rs"), "use super::*;\n\npub struct X;\n\nfn f(_: Y) {}\n").unwrap();
    std::fs::write(planted.join("a/y.rs"), "pub struct Y;\n\nfn g(_: super::X) {}\n").unwrap();
    let small = files::Graph::of(&planted, &["a"]);
    std::fs::remove_dir_all(&planted).unwrap();
    let a = &small.levels["a"];
    assert!(files::cycle_of(a).is_some(), "the check finds the circle through a glob and a re-export: {a:?}");

    let src = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let graph = files::Graph::of(&src, &["safe", "pp", "nccl"]);
    // Each exception: the dependency allowed, and why. The safe layer's is its one tie upward.
    let allowed: [(&str, &str, &str, &str); 4] = [
        (
            "safe",
            "capture",
            "memory",
            "a capture's footprint holds the device memory its work touches alive (capture.rs's opening doc)",
        ),
        ("safe", "capture", "ordering", "the footprint records each allocation's use (`Use`), for the graph's launch"),
        ("nccl", "settle", "comm", "settling takes the communicator, whose calls settle"),
        ("nccl", "p2p", "comm", "a group's calls take the communicators, whose file starts groups"),
    ];
    let mut levels = graph.levels.clone();
    for (level, from, to, _why) in allowed {
        let removed =
            levels.get_mut(level).and_then(|edges| edges.get_mut(from)).is_some_and(|to_set| to_set.remove(to));
        // Each exception is kept current: once the tie goes, so must its entry.
        assert!(removed, "{level}: the exception {from} -> {to} is no longer needed: remove it");
    }
    // The safe layer's graph is read (the stream reads the capture registry, the copies the door),
    // and a planted dependency closes a circle in it.
    let safe = &levels["safe"];
    assert!(safe["stream"].contains("capture") && safe["copy"].contains("enqueue"), "{safe:?}");
    let mut broken: BTreeMap<String, BTreeSet<String>> = safe.clone();
    broken.entry("context".into()).or_default().insert("memory".into());
    assert!(files::cycle_of(&broken).is_some(), "the check finds a circle when `context` names `memory`");
    for (level, edges) in &levels {
        if let Some(cycle) = files::cycle_of(edges) {
            let evidence: Vec<String> = cycle
                .windows(2)
                .map(|step| format!("{} -> {}: {}", step[0], step[1], graph.evidence(level, &step[0], &step[1])))
                .collect();
            panic!("src/{level}/: files depend on each other in a circle:\n{}", evidence.join("\n"));
        }
    }
}

/// The module graph of the crate's source, read file by file (see
/// `the_files_inside_safe_pp_and_nccl_have_no_cycle`).
mod files {
    use std::collections::{BTreeMap, BTreeSet};
    use std::path::{Path, PathBuf};

    /// A module's path from the crate root (`["safe", "launch", "param"]`).
    type ModPath = Vec<String>;

    /// Dependencies between the modules directly inside one folder.
    pub(super) type Edges = BTreeMap<String, BTreeSet<String>>;

    /// How a `use` binds a name: under its own name, another (`as`), or everything (`*`).
    #[derive(Clone, PartialEq)]
    enum Bind {
        Name,
        Alias(String),
        Glob,
    }

    struct File {
        path: PathBuf,
        module: ModPath,
        /// A `mod.rs` or `lib.rs` (or `x.rs` beside a folder `x/`): a folder's front door.
        front_door: bool,
        /// Each line's code (comments and docs blanked).
        lines: Vec<String>,
        /// Each line's module (the file's, or an inline module's inside it).
        scope: Vec<ModPath>,
    }

    struct Use {
        line: usize,
        scope: ModPath,
        target: Option<ModPath>,
        bind: Bind,
        public: bool,
    }

    pub(super) struct Graph {
        /// Per folder checked: its modules' dependencies.
        pub(super) levels: BTreeMap<String, Edges>,
        /// Per folder, dependency: the lines that make it.
        evidence: BTreeMap<(String, String, String), Vec<String>>,
    }

    impl Graph {
        /// Where `level`'s module `from` names `to` (the first few places).
        pub(super) fn evidence(&self, level: &str, from: &str, to: &str) -> String {
            let key = (level.to_string(), from.to_string(), to.to_string());
            self.evidence
                .get(&key)
                .map(|at| at.iter().take(4).cloned().collect::<Vec<_>>().join(", "))
                .unwrap_or_default()
        }

        /// The graph of the modules directly inside each folder of `levels` (folders of `root`).
        pub(super) fn of(root: &Path, levels: &[&str]) -> Graph {
            Reader::read(root).graph(root, levels)
        }
    }

    /// A circle in `edges`, as the path around it.
    pub(super) fn cycle_of(edges: &Edges) -> Option<Vec<String>> {
        for start in edges.keys() {
            let mut stack = vec![vec![start.clone()]];
            let mut seen = BTreeSet::new();
            while let Some(path) = stack.pop() {
                for next in edges.get(path.last().unwrap()).into_iter().flatten() {
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
    }

    fn is_ident_start(c: u8) -> bool {
        c.is_ascii_alphabetic() || c == b'_'
    }

    fn is_ident(c: u8) -> bool {
        c.is_ascii_alphanumeric() || c == b'_'
    }

    /// The identifier at `at` of `s`, if one starts there.
    fn ident_at(s: &[u8], at: usize) -> Option<String> {
        if at >= s.len() || !is_ident_start(s[at]) {
            return None;
        }
        let end = (at..s.len()).find(|&i| !is_ident(s[i])).unwrap_or(s.len());
        Some(String::from_utf8_lossy(&s[at..end]).into_owned())
    }

    /// A line's code: comments and doc comments blanked, `pub(in path)` read as `pub(crate)`
    /// (a visibility names no dependency).
    fn code_of(line: &str) -> String {
        if line.trim_start().starts_with("//") {
            return String::new();
        }
        let mut code = line.split("//").next().unwrap_or("").to_string();
        while let Some(at) = code.find("pub(in ") {
            let end = code[at..].find(')').map_or(code.len(), |e| at + e + 1);
            code.replace_range(at..end, "pub(crate)");
        }
        code
    }

    /// `line` without its leading visibility (`pub`, `pub(...)`) and whitespace.
    fn after_visibility(line: &str) -> (bool, &str) {
        let rest = line.trim_start();
        match rest.strip_prefix("pub") {
            Some(after) if after.starts_with('(') => (true, after[after.find(')').unwrap() + 1..].trim_start()),
            Some(after) if after.starts_with(' ') => (true, after.trim_start()),
            _ => (false, rest),
        }
    }

    /// The name of an inline module that `line` opens (`mod tests {`).
    fn inline_module(line: &str) -> Option<String> {
        let rest = after_visibility(line).1.strip_prefix("mod ")?;
        let name = ident_at(rest.as_bytes(), 0)?;
        (rest[name.len()..].trim() == "{").then_some(name)
    }

    /// The name of the item that `line` defines (`fn`, `struct`, ..., `macro_rules!`).
    fn item_defined(line: &str) -> Option<String> {
        let mut rest = after_visibility(line).1;
        if let Some(name) = rest.strip_prefix("macro_rules!") {
            return ident_at(name.trim_start().as_bytes(), 0);
        }
        loop {
            let word = ident_at(rest.as_bytes(), 0)?;
            let after = rest[word.len()..].trim_start();
            match word.as_str() {
                "unsafe" | "async" => rest = after,
                "const" if after.starts_with("fn ") => rest = after,
                "fn" | "struct" | "enum" | "trait" | "type" | "const" | "static" | "union" => {
                    return ident_at(after.as_bytes(), 0);
                }
                _ => return None,
            }
        }
    }

    /// The use tree at `at` of `s` (`a::b::{c, d as e, f::*}`): each leaf's path and binding, and
    /// where the tree ends.
    fn use_tree(s: &[u8], mut at: usize, prefix: &[String]) -> (Vec<(Vec<String>, Bind)>, usize) {
        let mut path = prefix.to_vec();
        loop {
            while at < s.len() && s[at].is_ascii_whitespace() {
                at += 1;
            }
            if at < s.len() && s[at] == b'{' {
                at += 1;
                let mut leaves = Vec::new();
                loop {
                    while at < s.len() && (s[at].is_ascii_whitespace() || s[at] == b',') {
                        at += 1;
                    }
                    if at >= s.len() || s[at] == b'}' {
                        return (leaves, at + 1);
                    }
                    let (more, end) = use_tree(s, at, &path);
                    leaves.extend(more);
                    at = if end > at { end } else { at + 1 };
                }
            }
            if at < s.len() && s[at] == b'*' {
                return (vec![(path, Bind::Glob)], at + 1);
            }
            let Some(name) = ident_at(s, at) else {
                return (if path.is_empty() { vec![] } else { vec![(path, Bind::Name)] }, at);
            };
            at += name.len();
            path.push(name);
            if s[at..].starts_with(b"::") {
                at += 2;
                continue;
            }
            let rest = &s[at..];
            let spaces = rest.iter().take_while(|c| c.is_ascii_whitespace()).count();
            if spaces > 0 && rest[spaces..].starts_with(b"as ") {
                let alias_at = at + spaces + 3;
                let alias_at = alias_at + s[alias_at..].iter().take_while(|c| c.is_ascii_whitespace()).count();
                if let Some(alias) = ident_at(s, alias_at) {
                    return (vec![(path, Bind::Alias(alias.clone()))], alias_at + alias.len());
                }
            }
            return (vec![(path, Bind::Name)], at);
        }
    }

    struct Reader {
        files: Vec<File>,
        modules: BTreeSet<ModPath>,
        /// Each module's file's module (an inline module's is its file's).
        home: BTreeMap<ModPath, ModPath>,
        uses: Vec<Vec<(Use, (usize, usize))>>,
        binds: BTreeMap<ModPath, BTreeMap<String, ModPath>>,
        globs: BTreeMap<ModPath, Vec<ModPath>>,
        defined: BTreeMap<ModPath, BTreeSet<String>>,
    }

    impl Reader {
        fn read(root: &Path) -> Reader {
            let mut paths = Vec::new();
            let mut dirs = vec![root.to_path_buf()];
            while let Some(dir) = dirs.pop() {
                for entry in std::fs::read_dir(dir).unwrap() {
                    let path = entry.unwrap().path();
                    if path.is_dir() {
                        dirs.push(path);
                    } else if path.extension().is_some_and(|e| e == "rs")
                        && !path.ends_with("driver_bindings.rs")
                        && !path.ends_with("nccl_bindings.rs")
                    {
                        paths.push(path);
                    }
                }
            }
            paths.sort();
            let mut reader = Reader {
                files: Vec::new(),
                modules: BTreeSet::new(),
                home: BTreeMap::new(),
                uses: Vec::new(),
                binds: BTreeMap::new(),
                globs: BTreeMap::new(),
                defined: BTreeMap::new(),
            };
            for path in paths {
                let relative = path.strip_prefix(root).unwrap().with_extension("");
                let mut module: ModPath = relative.iter().map(|c| c.to_string_lossy().into_owned()).collect();
                let mut front_door = path.with_extension("").is_dir();
                if matches!(module.last().map(String::as_str), Some("mod" | "lib")) {
                    module.pop();
                    front_door = true;
                }
                let text = std::fs::read_to_string(&path).unwrap();
                let lines: Vec<String> = text.lines().map(code_of).collect();
                // Inline modules, by rustfmt's layout: `mod x {` closes at the `}` of its indent.
                let mut scope = Vec::with_capacity(lines.len());
                let mut open: Vec<(String, ModPath)> = Vec::new();
                for line in &lines {
                    if open.last().is_some_and(|(indent, _)| *line == format!("{indent}}}")) {
                        scope.push(open.pop().unwrap().1);
                        continue;
                    }
                    let current = open.last().map_or(&module, |(_, inner)| inner).clone();
                    if let Some(name) = inline_module(line) {
                        let inner = [current.clone(), vec![name]].concat();
                        reader.modules.insert(inner.clone());
                        reader.home.insert(inner.clone(), module.clone());
                        let indent = line[..line.len() - line.trim_start().len()].to_string();
                        open.push((indent, inner));
                    }
                    scope.push(current);
                }
                reader.modules.insert(module.clone());
                reader.home.insert(module.clone(), module.clone());
                reader.files.push(File { path, module, front_door, lines, scope });
            }
            for index in 0..reader.files.len() {
                let uses = reader.read_uses(index);
                reader.uses.push(uses);
            }
            reader
        }

        /// A path as written in `scope` (`super::x`, `crate::y`, `self::z`, `child::w`), from the
        /// crate root; `None` for another crate's.
        fn absolute(&self, scope: &ModPath, path: &[String]) -> Option<ModPath> {
            let mut base = scope.clone();
            let mut at = 0;
            match path.first()?.as_str() {
                "crate" => {
                    base.clear();
                    at = 1;
                }
                "self" => at = 1,
                "super" => {
                    while path.get(at).is_some_and(|s| s == "super") {
                        base.pop();
                        at += 1;
                    }
                }
                first => {
                    if !self.modules.contains(&[scope.clone(), vec![first.to_string()]].concat()) {
                        return None;
                    }
                }
            }
            Some([base, path[at..].to_vec()].concat())
        }

        /// The `use` statements of a file, with their spans; records their bindings and the
        /// items the file defines.
        fn read_uses(&mut self, index: usize) -> Vec<(Use, (usize, usize))> {
            let file = &self.files[index];
            let text = file.lines.join("\n");
            let bytes = text.as_bytes();
            let mut starts = vec![0];
            for line in &file.lines {
                starts.push(starts.last().unwrap() + line.len() + 1);
            }
            let mut found = Vec::new();
            let mut binds = Vec::new();
            let mut defined = Vec::new();
            for (line, code) in file.lines.iter().enumerate() {
                let scope = &file.scope[line];
                let depth = scope.len() - file.module.len();
                let indent = code.len() - code.trim_start().len();
                if let Some(name) = item_defined(code).filter(|_| indent == 4 * depth) {
                    defined.push((scope.clone(), name));
                }
                let (public, rest) = after_visibility(code);
                let Some(tree) = rest.strip_prefix("use ") else { continue };
                let at = starts[line] + (code.len() - tree.len());
                let (leaves, end) = use_tree(bytes, at, &[]);
                for (path, bind) in leaves {
                    let target = self.absolute(scope, &path);
                    if let Some(target) = &target {
                        match &bind {
                            Bind::Glob => binds.push((scope.clone(), None, target.clone())),
                            Bind::Alias(alias) => binds.push((scope.clone(), Some(alias.clone()), target.clone())),
                            Bind::Name if path.last().is_some_and(|l| l == "self") => {
                                let module = target[..target.len() - 1].to_vec();
                                binds.push((scope.clone(), Some(path[path.len() - 2].clone()), module));
                            }
                            Bind::Name => binds.push((scope.clone(), path.last().cloned(), target.clone())),
                        }
                    }
                    found.push((Use { line, scope: scope.clone(), target, bind, public }, (starts[line], end)));
                }
            }
            for (scope, name, target) in binds {
                match name {
                    Some(name) => {
                        self.binds.entry(scope).or_default().insert(name, target);
                    }
                    None => self.globs.entry(scope).or_default().push(target),
                }
            }
            for (scope, name) in defined {
                self.defined.entry(scope).or_default().insert(name);
            }
            found
        }

        /// The module that holds what `path` (from the root) names.
        fn resolve(&self, path: &[String], seen: &mut BTreeSet<(ModPath, String)>) -> ModPath {
            let mut module = Vec::new();
            for (at, segment) in path.iter().enumerate() {
                let inner = [module.clone(), vec![segment.clone()]].concat();
                if self.modules.contains(&inner) {
                    module = inner;
                    continue;
                }
                return match self.name_in(&module, segment, seen) {
                    Some(found) if found != module && !self.modules.contains(&found) => {
                        self.resolve(&[found, path[at + 1..].to_vec()].concat(), seen)
                    }
                    Some(found) => found,
                    None => module,
                };
            }
            module
        }

        /// Where the name `name`, seen from module `module`, comes from: a module, the module that
        /// defines the item, or the path a `use` binds it to; `None` when `module` has no such name.
        fn name_in(&self, module: &ModPath, name: &str, seen: &mut BTreeSet<(ModPath, String)>) -> Option<ModPath> {
            if !seen.insert((module.clone(), name.to_string())) {
                return None;
            }
            let inner = [module.clone(), vec![name.to_string()]].concat();
            if self.modules.contains(&inner) {
                return Some(inner);
            }
            if self.defined.get(module).is_some_and(|items| items.contains(name)) {
                return Some(module.clone());
            }
            if let Some(target) = self.binds.get(module).and_then(|names| names.get(name)) {
                return Some(self.resolve(target, seen));
            }
            for glob in self.globs.get(module).into_iter().flatten() {
                let from = self.resolve(glob, seen);
                if &from != module {
                    if let Some(found) = self.name_in(&from, name, seen) {
                        return Some(found);
                    }
                }
            }
            None
        }

        fn graph(&self, root: &Path, levels: &[&str]) -> Graph {
            let mut graph = Graph { levels: BTreeMap::new(), evidence: BTreeMap::new() };
            for level in levels {
                graph.levels.insert(level.to_string(), Edges::new());
            }
            let mut add = |file: &File, target: ModPath, line: usize, name: &str| {
                // A target inside an inline module is its file's.
                let mut target = target;
                while !target.is_empty() && !self.home.contains_key(&target) {
                    target.pop();
                }
                let target = self.home.get(&target).cloned().unwrap_or(target);
                let Some(level) = levels.iter().find(|l| file.module.first().is_some_and(|f| f == *l)) else { return };
                if target.first().is_none_or(|t| t != level)
                    || file.module.len() > 1 && target.len() > 1 && file.module[1] == target[1]
                {
                    return;
                }
                let node = |m: &ModPath| m.get(1).cloned().unwrap_or_else(|| "mod".to_string());
                let (from, to) = (node(&file.module), node(&target));
                if from == to {
                    return;
                }
                graph.levels.get_mut(*level).unwrap().entry(from.clone()).or_default().insert(to.clone());
                let at = format!("{}:{} {name}", file.path.strip_prefix(root).unwrap().display(), line + 1);
                graph.evidence.entry((level.to_string(), from, to)).or_default().push(at);
            };
            for (index, file) in self.files.iter().enumerate() {
                let text = file.lines.join("\n");
                let bytes = text.as_bytes();
                let mut starts = vec![0];
                for line in &file.lines {
                    starts.push(starts.last().unwrap() + line.len() + 1);
                }
                let line_of = |at: usize| starts.partition_point(|&s| s <= at) - 1;
                let spans: Vec<(usize, usize)> = self.uses[index].iter().map(|(_, span)| *span).collect();
                let in_use = |at: usize| spans.iter().any(|&(start, end)| start <= at && at < end);
                // What `use` statements name (a front door's own re-exports name nothing; a glob
                // names what the file then uses, below).
                for (used, _) in &self.uses[index] {
                    let Some(target) = &used.target else { continue };
                    if used.bind == Bind::Glob || file.front_door && used.public && used.scope == file.module {
                        continue;
                    }
                    add(file, self.resolve(target, &mut BTreeSet::new()), used.line, "use");
                }
                // Paths in code: `crate::`, `super::`, `self::`, or a child module's.
                let mut at = 0;
                while at < bytes.len() {
                    let starts_ident = is_ident_start(bytes[at])
                        && (at == 0 || !(is_ident(bytes[at - 1]) || b"$:.".contains(&bytes[at - 1])));
                    if !starts_ident || in_use(at) {
                        at += 1;
                        continue;
                    }
                    let word = ident_at(bytes, at).unwrap();
                    let line = line_of(at);
                    let scope = &file.scope[line];
                    let next = at + word.len();
                    let is_path = bytes[next..].starts_with(b"::")
                        && (matches!(word.as_str(), "crate" | "super" | "self")
                            || self.modules.contains(&[scope.clone(), vec![word.clone()]].concat()));
                    if is_path {
                        let (leaves, end) = use_tree(bytes, at, &[]);
                        for (path, _) in leaves {
                            if let Some(target) = self.absolute(scope, &path) {
                                add(file, self.resolve(&target, &mut BTreeSet::new()), line, &path.join("::"));
                            }
                        }
                        at = end.max(next);
                        continue;
                    }
                    // A name the file takes through a glob import.
                    let before = text[..at].trim_end();
                    let globbed = !before.ends_with("::")
                        && !before.ends_with('.')
                        && self.globs.contains_key(scope)
                        && !self.defined.get(scope).is_some_and(|items| items.contains(&word))
                        && !self.binds.get(scope).is_some_and(|names| names.contains_key(&word))
                        && item_defined(&file.lines[line]).is_none_or(|item| item != word)
                        && inline_module(&file.lines[line]).is_none()
                        && !after_visibility(&file.lines[line]).1.starts_with("mod ");
                    if globbed {
                        for glob in &self.globs[scope] {
                            let from = self.resolve(glob, &mut BTreeSet::new());
                            if let Some(found) = self.name_in(&from, &word, &mut BTreeSet::new()) {
                                add(file, found, line, &word);
                                break;
                            }
                        }
                    }
                    at = next;
                }
            }
            graph
        }
    }
}
