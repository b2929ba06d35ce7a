//! No import circle inside any crate (DESIGN "Shape"): between the top-level modules of each
//! crate's `src`, the imports (`use crate::...`, `super::...`, inline `crate::` paths) form no
//! cycle, so each module can be read, tested and replaced on top of the ones it names.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// Every `.rs` file under `dir`, with its path relative to `root` and its text.
fn walk(dir: &Path, root: &Path, out: &mut Vec<(String, String)>) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for entry in entries {
        let path = entry.unwrap().path();
        if path.is_dir() {
            walk(&path, root, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            let rel = path.strip_prefix(root).unwrap().display().to_string();
            out.push((rel, std::fs::read_to_string(&path).unwrap()));
        }
    }
}

/// Every library crate of the workspace (a folder with `src/lib.rs`), with its source files.
fn crates() -> Vec<(String, Vec<(String, String)>)> {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .unwrap()
        .to_owned();
    let mut out = Vec::new();
    for entry in std::fs::read_dir(&root).unwrap() {
        let krate = entry.unwrap().path();
        let name = krate.file_name().unwrap().to_string_lossy().into_owned();
        if name == "target" || name.starts_with('.') || !krate.join("src/lib.rs").is_file() {
            continue;
        }
        let src = krate.join("src");
        let mut files = Vec::new();
        walk(&src, &src, &mut files);
        files.sort();
        out.push((name, files));
    }
    out.sort();
    out
}

/// The top-level module (`agent`, `init`...) a file of a crate's `src` belongs to: a module and its
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

/// The import graph of a crate's `src` (its files, paths relative to `src`) between top-level
/// modules: for each, the others it names. A path to a name the crate root re-exports
/// (`crate::Shutdown`) counts as one to the module that defines it.
fn import_graph(
    files: &[(String, String)],
) -> std::collections::BTreeMap<String, std::collections::BTreeSet<String>> {
    use std::collections::{BTreeMap, BTreeSet};
    let modules: BTreeSet<String> = files
        .iter()
        .filter(|(f, _)| f != "lib.rs")
        .map(|(f, _)| unit_of(f))
        .collect();
    // The root's re-exports: `pub use agent::{Agent, ...}` names `Agent` in `agent`.
    let Some((_, lib)) = files.iter().find(|(f, _)| f == "lib.rs") else {
        return BTreeMap::new();
    };
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
    for (file, text) in files {
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

/// Circles known and waiting for their move (crate, its modules in the circle). Nothing new
/// joins; each leaves the list once broken.
const STILL_CIRCLING: &[(&str, &[&str])] = &[];

#[test]
fn no_crate_has_an_import_circle() {
    let mut found = BTreeMap::new();
    let mut seen = BTreeSet::new();
    for (name, files) in crates() {
        let graph = import_graph(&files);
        if name == "rpc" {
            assert!(graph["agent"].contains("state"), "rpc's graph: {graph:?}");
        }
        seen.insert(name.clone());
        let known = STILL_CIRCLING
            .iter()
            .find(|(c, _)| *c == name)
            .map_or(&[][..], |(_, m)| *m);
        let circles: Vec<Vec<String>> = circles(&graph)
            .into_iter()
            .filter(|c| c.iter().map(String::as_str).ne(known.iter().copied()))
            .collect();
        if !circles.is_empty() {
            found.insert(name, circles);
        }
    }
    for expected in [
        "core",
        "rpc",
        "mesh",
        "process-group",
        "store",
        "dist-autograd",
    ] {
        assert!(
            seen.contains(expected),
            "the walk missed {expected}: {seen:?}"
        );
    }
    assert!(
        found.is_empty(),
        "import circles (move the types the modules share to the module that owns them): \
         {found:?}"
    );
}
