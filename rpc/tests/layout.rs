//! The shape DESIGN asks of `rpc/src` ("The agent as a driver"), checked on the source: time
//! only through the runtime module, `impl Agent` only in `agent.rs`, no reaching into the
//! agent's state from outside it.

use std::path::{Path, PathBuf};

/// Every `.rs` file under `rpc/src`, with its path relative to it.
fn sources() -> Vec<(String, String)> {
    fn walk(dir: &Path, root: &Path, out: &mut Vec<(String, String)>) {
        for entry in std::fs::read_dir(dir).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                walk(&path, root, out);
            } else if path.extension().is_some_and(|e| e == "rs") {
                let rel = path.strip_prefix(root).unwrap().display().to_string();
                out.push((rel, std::fs::read_to_string(&path).unwrap()));
            }
        }
    }
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut out = Vec::new();
    walk(&root, &root, &mut out);
    out.sort();
    assert!(out.iter().any(|(f, _)| f == "agent.rs"), "{out:?}");
    out
}

/// The files (other than `allowed`) whose code contains any of `needles`.
fn offenders(needles: &[&str], allowed: &[&str]) -> Vec<String> {
    sources()
        .into_iter()
        .filter(|(file, _)| !allowed.contains(&file.as_str()))
        .filter(|(_, text)| {
            text.lines()
                .map(str::trim_start)
                .filter(|l| !l.starts_with("//"))
                .any(|l| needles.iter().any(|n| l.contains(n)))
        })
        .map(|(file, _)| file)
        .collect()
}

#[test]
fn time_is_read_only_through_the_runtime() {
    let allowed = ["runtime.rs"];
    let found = offenders(&["Instant::now", "tokio::time"], &allowed);
    assert!(found.is_empty(), "these read time directly: {found:?}");
}

#[test]
fn only_agent_rs_adds_methods_to_the_agent() {
    let allowed = ["agent.rs"];
    let found = offenders(&["impl Agent {", "impl Agent{"], &allowed);
    assert!(found.is_empty(), "`impl Agent` outside agent.rs: {found:?}");
}

/// The agent itself: its handle and the modules of its insides.
const AGENT: [&str; 8] = [
    "agent.rs",
    "state.rs",
    "driver.rs",
    "links.rs",
    "serve.rs",
    "shutdown.rs",
    "init/mod.rs",
    "init/static_group.rs",
];

#[test]
fn nothing_outside_the_agent_reaches_into_its_endpoint() {
    let found = offenders(&["lock().ep", ".ep."], &AGENT);
    assert!(offenders(&[".ep."], &[]).contains(&"links.rs".to_owned()));
    assert!(
        found.is_empty(),
        "the endpoint is used directly in: {found:?}"
    );
}

#[test]
fn no_source_file_is_over_1200_lines() {
    let long: Vec<(String, usize)> = sources()
        .into_iter()
        .map(|(file, text)| (file, text.lines().count()))
        .filter(|(_, lines)| *lines > 1200)
        .collect();
    assert!(long.is_empty(), "files over 1,200 lines: {long:?}");
}

#[test]
fn the_codec_context_is_passed_not_kept_in_thread_locals() {
    let found = offenders(&["thread_local!"], &[]);
    assert!(found.is_empty(), "thread-locals in: {found:?}");
}

/// The top-level module (`agent`, `init`...) a file of `rpc/src` belongs to: a module and its
/// submodules are one unit (a child using its parent is part of the parent's implementation).
fn unit_of(file: &str) -> String {
    let first = file.split('/').next().unwrap();
    first.strip_suffix(".rs").unwrap_or(first).to_owned()
}

/// `text` without comments (whole-line `//` comments, doc comments included).
fn code(text: &str) -> String {
    text.lines()
        .filter(|l| !l.trim_start().starts_with("//"))
        .collect::<Vec<_>>()
        .join("\n")
}

/// The paths a `use` tree names, `prefix` first: `a::{b, c::{d, e}}` gives `a::b`, `a::c::d`,
/// `a::c::e`.
fn expand(prefix: &str, tree: &str) -> Vec<String> {
    let tree = tree.trim();
    let join = |p: &str, s: &str| {
        if p.is_empty() {
            s.to_owned()
        } else {
            format!("{p}::{s}")
        }
    };
    if let Some(open) = tree.find('{') {
        let head = tree[..open].trim().trim_end_matches("::");
        let prefix = join(prefix, head);
        let inner = &tree[open + 1..tree.rfind('}').unwrap()];
        let (mut depth, mut start, mut out) = (0, 0, Vec::new());
        for (i, ch) in inner.char_indices() {
            match ch {
                '{' => depth += 1,
                '}' => depth -= 1,
                ',' if depth == 0 => {
                    out.extend(expand(&prefix, &inner[start..i]));
                    start = i + 1;
                }
                _ => {}
            }
        }
        out.extend(expand(&prefix, &inner[start..]));
        return out;
    }
    if tree.is_empty() {
        return Vec::new();
    }
    let path = tree.split(" as ").next().unwrap().trim();
    vec![join(prefix, path)]
}

/// Every `crate::`/`super::` path in `text` (in `use` declarations, expanded, and inline in
/// code), made absolute from the crate root for a file of module `module`.
fn crate_paths(module: &[String], text: &str) -> Vec<Vec<String>> {
    let text = code(text);
    let mut raw = Vec::new();
    // `use` declarations (possibly `pub(crate) use`), up to their `;`.
    let mut rest = text.as_str();
    let mut inline = String::new();
    while let Some(at) = rest.find("use ") {
        let word_start = at == 0
            || !rest[..at]
                .chars()
                .next_back()
                .is_some_and(|c| c.is_alphanumeric() || c == '_');
        inline.push_str(&rest[..at]);
        let after = &rest[at + 4..];
        let tree_start = after.trim_start();
        if word_start
            && ["crate::", "super::", "self::"]
                .iter()
                .any(|p| tree_start.starts_with(p))
        {
            let end = after.find(';').unwrap_or(after.len());
            raw.extend(expand("", &after[..end]));
            rest = &after[end..];
        } else {
            inline.push_str("use ");
            rest = after;
        }
    }
    inline.push_str(rest);
    // Inline paths: `crate::a::b` and `super::a` anywhere else.
    for start in ["crate::", "super::"] {
        let mut from = 0;
        while let Some(at) = inline[from..].find(start) {
            let at = from + at;
            let before_ok = !inline[..at]
                .chars()
                .next_back()
                .is_some_and(|c| c.is_alphanumeric() || c == '_' || c == ':');
            let len = inline[at..]
                .find(|c: char| !(c.is_alphanumeric() || c == '_' || c == ':'))
                .unwrap_or(inline.len() - at);
            if before_ok {
                raw.push(inline[at..at + len].trim_end_matches(':').to_owned());
            }
            from = at + len.max(1);
        }
    }
    raw.into_iter()
        .filter_map(|p| {
            let mut segs: Vec<&str> = p.split("::").filter(|s| !s.is_empty()).collect();
            let mut base: Vec<String> = match *segs.first()? {
                "crate" => Vec::new(),
                "self" | "super" => module.to_vec(),
                _ => return None,
            };
            if segs[0] == "crate" || segs[0] == "self" {
                segs.remove(0);
            }
            while segs.first() == Some(&"super") {
                base.pop()?;
                segs.remove(0);
            }
            base.extend(segs.into_iter().map(str::to_owned));
            Some(base)
        })
        .collect()
}

/// The import graph of `rpc/src` between top-level modules: for each, the others it names.
/// A path to a name the crate root re-exports (`crate::Shutdown`) counts as one to the module
/// that defines it.
fn import_graph() -> std::collections::BTreeMap<String, std::collections::BTreeSet<String>> {
    use std::collections::{BTreeMap, BTreeSet};
    let files = sources();
    let modules: BTreeSet<String> = files
        .iter()
        .filter(|(f, _)| f != "lib.rs")
        .map(|(f, _)| unit_of(f))
        .collect();
    // The root's re-exports: `pub use agent::{Agent, ...}` names `Agent` in `agent`.
    let lib = &files.iter().find(|(f, _)| f == "lib.rs").unwrap().1;
    let mut reexports = BTreeMap::new();
    for line in code(lib).split(';') {
        let line = line.trim();
        let Some(tree) = line.strip_prefix("pub use ") else {
            continue;
        };
        for path in expand("", tree) {
            let segs: Vec<&str> = path.split("::").collect();
            if segs.len() >= 2 && modules.contains(segs[0]) {
                reexports.insert(segs[segs.len() - 1].to_owned(), segs[0].to_owned());
            }
        }
    }
    let mut graph: BTreeMap<String, BTreeSet<String>> = modules
        .iter()
        .map(|m| (m.clone(), BTreeSet::new()))
        .collect();
    for (file, text) in &files {
        // Test modules use the crate as its users do; they are not part of its layering.
        if file == "lib.rs" || file.ends_with("tests.rs") {
            continue;
        }
        let unit = unit_of(file);
        let trimmed = file.trim_end_matches(".rs").trim_end_matches("/mod");
        let module: Vec<String> = trimmed.split('/').map(str::to_owned).collect();
        for path in crate_paths(&module, text) {
            let Some(first) = path.first() else { continue };
            let target = if modules.contains(first) {
                first.clone()
            } else if let Some(m) = reexports.get(first) {
                m.clone()
            } else {
                continue;
            };
            if target != unit {
                graph.get_mut(&unit).unwrap().insert(target);
            }
        }
    }
    graph
}

/// The strongly connected components of `graph` with more than one module (its circles), by
/// Tarjan's algorithm.
fn circles(
    graph: &std::collections::BTreeMap<String, std::collections::BTreeSet<String>>,
) -> Vec<Vec<String>> {
    use std::collections::BTreeMap;
    struct Tarjan<'g> {
        graph: &'g BTreeMap<String, std::collections::BTreeSet<String>>,
        index: BTreeMap<&'g str, usize>,
        low: BTreeMap<&'g str, usize>,
        stack: Vec<&'g str>,
        on_stack: std::collections::BTreeSet<&'g str>,
        out: Vec<Vec<String>>,
    }
    impl<'g> Tarjan<'g> {
        fn visit(&mut self, v: &'g str) {
            let i = self.index.len();
            self.index.insert(v, i);
            self.low.insert(v, i);
            self.stack.push(v);
            self.on_stack.insert(v);
            for w in &self.graph[v] {
                let w = w.as_str();
                if !self.index.contains_key(w) {
                    self.visit(w);
                    let lw = self.low[w];
                    let lv = self.low.get_mut(v).unwrap();
                    *lv = (*lv).min(lw);
                } else if self.on_stack.contains(w) {
                    let iw = self.index[w];
                    let lv = self.low.get_mut(v).unwrap();
                    *lv = (*lv).min(iw);
                }
            }
            if self.low[v] == self.index[v] {
                let mut scc = Vec::new();
                loop {
                    let w = self.stack.pop().unwrap();
                    self.on_stack.remove(w);
                    scc.push(w.to_owned());
                    if w == v {
                        break;
                    }
                }
                if scc.len() > 1 {
                    scc.sort();
                    self.out.push(scc);
                }
            }
        }
    }
    let mut t = Tarjan {
        graph,
        index: BTreeMap::new(),
        low: BTreeMap::new(),
        stack: Vec::new(),
        on_stack: Default::default(),
        out: Vec::new(),
    };
    for v in graph.keys() {
        if !t.index.contains_key(v.as_str()) {
            t.visit(v);
        }
    }
    t.out.sort();
    t.out
}

#[test]
fn the_circle_finder_finds_circles_and_only_circles() {
    let g = |edges: &[(&str, &str)]| {
        let mut g = std::collections::BTreeMap::<String, std::collections::BTreeSet<String>>::new();
        for (a, b) in edges {
            g.entry((*a).to_owned())
                .or_default()
                .insert((*b).to_owned());
            g.entry((*b).to_owned()).or_default();
        }
        g
    };
    assert!(circles(&g(&[("a", "b"), ("b", "c"), ("a", "c")])).is_empty());
    assert_eq!(
        circles(&g(&[
            ("a", "b"),
            ("b", "c"),
            ("c", "a"),
            ("c", "d"),
            ("d", "e"),
            ("e", "d")
        ])),
        vec![vec!["a", "b", "c"], vec!["d", "e"]]
    );
    assert_eq!(
        expand("", "crate::{a::{B, c::D}, e as f}"),
        ["crate::a::B", "crate::a::c::D", "crate::e"]
    );
    let paths = crate_paths(
        &["init".to_owned(), "dynamic".to_owned()],
        "use super::{x, y::Z};\n// use crate::commented::Out;\nfn f() { crate::agent::g(); }",
    );
    assert_eq!(
        paths,
        [
            vec!["init", "x"],
            vec!["init", "y", "Z"],
            vec!["agent", "g"]
        ]
    );
}

/// The modules still in import circles, waiting for their types to move to the modules that
/// own them. Nothing joins them, and each leaves the list once out of every circle.
const STILL_CIRCLING: [&str; 0] = [];

#[test]
fn no_module_joins_an_import_circle() {
    let graph = import_graph();
    assert!(graph["agent"].contains("state"), "{graph:?}");
    let found = circles(&graph);
    let circling: std::collections::BTreeSet<&str> =
        found.iter().flatten().map(String::as_str).collect();
    let joined: Vec<&&str> = circling
        .iter()
        .filter(|m| !STILL_CIRCLING.contains(m))
        .collect();
    assert!(
        joined.is_empty(),
        "these modules joined an import circle: {joined:?} (circles: {found:?}); move the \
         types they share to the module that owns them"
    );
    let out: Vec<&&str> = STILL_CIRCLING
        .iter()
        .filter(|m| !circling.contains(*m))
        .collect();
    assert!(
        out.is_empty(),
        "no longer in an import circle; remove from STILL_CIRCLING: {out:?}"
    );
}
