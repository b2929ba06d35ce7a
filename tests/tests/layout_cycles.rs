//! No import circle between the modules of a crate: if module `a` uses `b`, `b` (or anything
//! `b` uses) does not use `a`. A circle means two concerns that cannot be read, tested or moved
//! apart; shared helpers belong in a module of their own that imports neither side.
//!
//! Checked on the sources, at two granularities, by one finder:
//! - **every module**: every path a module names (`use` items and paths in code, test modules
//!   aside) that resolves to another module of the same crate (`crate::`, `super::`, `self::`, a
//!   child module by its bare name, or a name the crate root re-exports) is an edge, but for paths
//!   into the module's own submodules and into the crate root itself: a module declares, uses and
//!   re-exports its children (its facade, as quinn-proto's `connection` does), so children may
//!   use what their parent defines;
//! - **top-level modules**: the same edges between the crate's top-level modules (a module and
//!   its submodules one unit). This finds what the first cannot: a circle through a parent that
//!   re-exports its child (`a::x` uses `b`, `b` uses `a`'s re-export of `a::x`'s item).
//!
//! Binaries under `src/bin/` are crates of their own and are left out.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// Crates whose modules still form a circle, each waiting for its split (issue "One node in
/// core, one driver in rpc"). Nothing new joins; a test fails if one listed has no circle left,
/// so that it leaves the list.
const WAITING: &[&str] = &[];

/// A module's path from its crate root (`[]` for `lib.rs`/`main.rs`).
type ModPath = Vec<String>;

fn workspace_root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .unwrap()
        .to_owned()
}

/// The module of each source file under `src` (binaries and test-only files aside).
fn modules(src: &Path) -> BTreeMap<ModPath, PathBuf> {
    fn walk(dir: &Path, prefix: &ModPath, out: &mut BTreeMap<ModPath, PathBuf>) {
        let Ok(entries) = std::fs::read_dir(dir) else {
            return;
        };
        for entry in entries {
            let path = entry.unwrap().path();
            let name = path.file_name().unwrap().to_string_lossy().into_owned();
            if path.is_dir() {
                if prefix.is_empty() && name == "bin" || name == "tests" {
                    continue;
                }
                let mut p = prefix.clone();
                p.push(name);
                walk(&path, &p, out);
            } else if let Some(stem) = name.strip_suffix(".rs") {
                if stem == "tests" {
                    continue;
                }
                let module = match stem {
                    "lib" | "main" if prefix.is_empty() => prefix.clone(),
                    "mod" => prefix.clone(),
                    _ => {
                        let mut p = prefix.clone();
                        p.push(stem.to_owned());
                        p
                    }
                };
                out.entry(module).or_insert(path);
            }
        }
    }
    let mut out = BTreeMap::new();
    walk(src, &Vec::new(), &mut out);
    out
}

/// The source without comments and without its test module (a top-level `#[cfg(test)]`
/// followed by `mod`).
fn code(text: &str) -> String {
    let lines: Vec<&str> = text.lines().collect();
    let mut out = String::new();
    for (i, line) in lines.iter().enumerate() {
        let next_is_mod = lines.get(i + 1).is_some_and(|next| {
            let next = next.trim_start();
            next.starts_with("mod ") || next.starts_with("pub mod ") || next.contains(" mod ")
        });
        if line.trim() == "#[cfg(test)]" && !line.starts_with(' ') && next_is_mod {
            break;
        }
        let kept = line.find("//").map_or(*line, |at| &line[..at]);
        out.push_str(kept);
        out.push('\n');
    }
    out
}

#[derive(Debug, PartialEq)]
enum Token {
    Ident(String),
    Colons,
    Open,
    Close,
    Comma,
    Other,
}

fn tokens(code: &str) -> Vec<Token> {
    let chars: Vec<char> = code.chars().collect();
    let mut out = Vec::new();
    let mut i = 0;
    while i < chars.len() {
        let c = chars[i];
        if c.is_alphanumeric() || c == '_' {
            let start = i;
            while i < chars.len() && (chars[i].is_alphanumeric() || chars[i] == '_') {
                i += 1;
            }
            out.push(Token::Ident(chars[start..i].iter().collect()));
            continue;
        }
        if c == '"' {
            // Skip string literals (escapes included), so that text is not read as paths.
            i += 1;
            while i < chars.len() && chars[i] != '"' {
                i += if chars[i] == '\\' { 2 } else { 1 };
            }
            i += 1;
            out.push(Token::Other);
            continue;
        }
        match c {
            ':' if chars.get(i + 1) == Some(&':') => {
                out.push(Token::Colons);
                i += 2;
                continue;
            }
            '{' => out.push(Token::Open),
            '}' => out.push(Token::Close),
            ',' => out.push(Token::Comma),
            c if c.is_whitespace() => {}
            _ => out.push(Token::Other),
        }
        i += 1;
    }
    out
}

/// Every path in the tokens, `use` groups expanded (`a::{b, c::d}` gives `a::b`, `a::c::d`).
fn paths(tokens: &[Token]) -> Vec<Vec<String>> {
    /// Reads the path starting at `i` (after `prefix`), pushing each complete path; returns the
    /// index after it.
    fn path(
        tokens: &[Token],
        mut i: usize,
        prefix: Vec<String>,
        out: &mut Vec<Vec<String>>,
    ) -> usize {
        let mut segments = prefix;
        loop {
            match tokens.get(i) {
                Some(Token::Ident(s)) => {
                    segments.push(s.clone());
                    i += 1;
                    if tokens.get(i) == Some(&Token::Colons) {
                        i += 1;
                        continue;
                    }
                    out.push(segments);
                    return i;
                }
                Some(Token::Open) => {
                    i += 1;
                    loop {
                        match tokens.get(i) {
                            Some(Token::Close) => return i + 1,
                            Some(Token::Comma) => i += 1,
                            Some(Token::Ident(_)) | Some(Token::Open) => {
                                i = path(tokens, i, segments.clone(), out);
                            }
                            None => return i,
                            // `*`, `self as x` and the like: the group names this prefix.
                            Some(_) => {
                                out.push(segments.clone());
                                i += 1;
                            }
                        }
                    }
                }
                _ => {
                    out.push(segments);
                    return i;
                }
            }
        }
    }
    let mut out = Vec::new();
    let mut i = 0;
    while i < tokens.len() {
        let starts = matches!(tokens.get(i), Some(Token::Ident(_)))
            && tokens.get(i + 1) == Some(&Token::Colons)
            && (i == 0 || tokens[i - 1] != Token::Colons);
        if starts {
            i = path(tokens, i, Vec::new(), &mut out);
        } else {
            i += 1;
        }
    }
    out
}

/// The module of the crate a path from `from` names, if it names one.
fn resolve(
    from: &ModPath,
    segments: &[String],
    known: &BTreeMap<ModPath, PathBuf>,
) -> Option<ModPath> {
    let mut base = from.clone();
    let mut rest = segments;
    match segments.first().map(String::as_str) {
        Some("crate") => {
            base.clear();
            rest = &segments[1..];
        }
        Some("self") => rest = &segments[1..],
        Some("super") => {
            while rest.first().map(String::as_str) == Some("super") {
                base.pop()?;
                rest = &rest[1..];
            }
        }
        Some(first) => {
            let mut child = from.clone();
            child.push(first.to_owned());
            if !known.contains_key(&child) {
                return None;
            }
        }
        None => return None,
    }
    for segment in rest {
        let mut next = base.clone();
        next.push(segment.clone());
        if !known.contains_key(&next) {
            break;
        }
        base = next;
    }
    Some(base)
}

/// The names the crate root imports from its modules (`pub use agent::{Agent, x::Y}` maps
/// `Agent` to `agent` and `Y` to `agent::x`): a path to `crate::Agent` is a use of `agent`.
fn root_reexports(known: &BTreeMap<ModPath, PathBuf>) -> BTreeMap<String, ModPath> {
    let mut out = BTreeMap::new();
    let Some(root) = known.get(&Vec::new()) else {
        return out;
    };
    let text = code(&std::fs::read_to_string(root).unwrap());
    let toks = tokens(&text);
    for (i, t) in toks.iter().enumerate() {
        // Every `use` of the root (`pub` or not, both make `crate::Name`), up to its `;`.
        if *t != Token::Ident("use".into()) {
            continue;
        }
        let end = toks[i..]
            .iter()
            .position(|t| *t == Token::Other)
            .map_or(toks.len(), |at| i + at);
        for p in paths(&toks[i + 1..end]) {
            let Some((name, module)) = p.split_last() else {
                continue;
            };
            let target = resolve(&Vec::new(), module, known).unwrap_or_default();
            if !target.is_empty() {
                out.insert(name.clone(), target);
            }
        }
    }
    out
}

/// The import edges between a crate's modules (the root exempt).
fn edges(known: &BTreeMap<ModPath, PathBuf>) -> BTreeMap<ModPath, BTreeSet<ModPath>> {
    let reexports = root_reexports(known);
    let mut out = BTreeMap::new();
    for (module, file) in known {
        let mut to = BTreeSet::new();
        if !module.is_empty() {
            let text = code(&std::fs::read_to_string(file).unwrap());
            for p in paths(&tokens(&text)) {
                let target = resolve(module, &p, known).and_then(|t| {
                    // `crate::Name` where the root re-exports `Name` from one of its modules.
                    match (t.is_empty(), p.first().map(String::as_str), p.get(1)) {
                        (true, Some("crate"), Some(name)) => reexports.get(name).cloned(),
                        _ => Some(t),
                    }
                });
                if let Some(target) = target {
                    // A module using its own submodules is its facade (as the crate root is).
                    if !target.is_empty() && !target.starts_with(module) {
                        to.insert(target);
                    }
                }
            }
        }
        out.insert(module.clone(), to);
    }
    out
}

/// The circles: strongly connected components of more than one module (Tarjan's algorithm).
fn circles(graph: &BTreeMap<ModPath, BTreeSet<ModPath>>) -> Vec<Vec<ModPath>> {
    struct State<'a> {
        graph: &'a BTreeMap<ModPath, BTreeSet<ModPath>>,
        index: BTreeMap<&'a ModPath, usize>,
        low: BTreeMap<&'a ModPath, usize>,
        stack: Vec<&'a ModPath>,
        on_stack: BTreeSet<&'a ModPath>,
        out: Vec<Vec<ModPath>>,
    }
    fn visit<'a>(s: &mut State<'a>, v: &'a ModPath) {
        let n = s.index.len();
        s.index.insert(v, n);
        s.low.insert(v, n);
        s.stack.push(v);
        s.on_stack.insert(v);
        for w in s.graph.get(v).into_iter().flatten() {
            let Some((w, _)) = s.graph.get_key_value(w) else {
                continue;
            };
            if !s.index.contains_key(w) {
                visit(s, w);
                let low = s.low[v].min(s.low[w]);
                s.low.insert(v, low);
            } else if s.on_stack.contains(w) {
                let low = s.low[v].min(s.index[w]);
                s.low.insert(v, low);
            }
        }
        if s.low[v] == s.index[v] {
            let mut component = Vec::new();
            while let Some(w) = s.stack.pop() {
                s.on_stack.remove(w);
                component.push(w.clone());
                if w == v {
                    break;
                }
            }
            if component.len() > 1 {
                component.sort();
                s.out.push(component);
            }
        }
    }
    let mut s = State {
        graph,
        index: BTreeMap::new(),
        low: BTreeMap::new(),
        stack: Vec::new(),
        on_stack: BTreeSet::new(),
        out: Vec::new(),
    };
    for v in graph.keys() {
        if !s.index.contains_key(v) {
            visit(&mut s, v);
        }
    }
    s.out
}

/// The same edges between top-level modules: each module stands for the top-level module it
/// belongs to (`agent::x` for `agent`), and edges inside one top-level module drop out.
fn top_level(graph: &BTreeMap<ModPath, BTreeSet<ModPath>>) -> BTreeMap<ModPath, BTreeSet<ModPath>> {
    let unit = |m: &ModPath| m.iter().take(1).cloned().collect::<ModPath>();
    let mut out: BTreeMap<ModPath, BTreeSet<ModPath>> = BTreeMap::new();
    for (from, to) in graph {
        let from = unit(from);
        let targets = out.entry(from.clone()).or_default();
        targets.extend(to.iter().map(unit).filter(|t| *t != from));
    }
    out
}

/// Every crate of the workspace (its directory name) with its module graph.
fn workspace_graphs() -> Vec<(String, BTreeMap<ModPath, BTreeSet<ModPath>>)> {
    let root = workspace_root();
    let mut out = Vec::new();
    let mut crates: Vec<PathBuf> = std::fs::read_dir(&root)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.join("Cargo.toml").is_file() && p.join("src").is_dir())
        .collect();
    crates.sort();
    assert!(crates.len() > 10, "found only {} crates", crates.len());
    for krate in crates {
        let name = krate.file_name().unwrap().to_string_lossy().into_owned();
        if name == "target" || name.starts_with('.') {
            continue;
        }
        let known = modules(&krate.join("src"));
        out.push((name, edges(&known)));
    }
    out
}

#[test]
fn no_crate_has_an_import_circle() {
    let mut failures = Vec::new();
    let mut seen = BTreeSet::new();
    for (krate, graph) in workspace_graphs() {
        let edge_count: usize = graph.values().map(BTreeSet::len).sum();
        if edge_count > 0 {
            seen.insert(krate.clone());
        }
        let mut found = circles(&graph);
        // A circle of top-level modules not already reported module by module.
        for circle in circles(&top_level(&graph)) {
            let covered = found
                .iter()
                .any(|f| circle.iter().all(|u| f.iter().any(|m| m.starts_with(u))));
            if !covered {
                found.push(circle);
            }
        }
        let waiting = WAITING.contains(&krate.as_str());
        match (found.is_empty(), waiting) {
            (true, true) => failures.push(format!(
                "{krate} has no import circle left: remove it from WAITING"
            )),
            (false, false) => {
                for circle in found {
                    let names: Vec<String> = circle.iter().map(|m| m.join("::")).collect();
                    failures.push(format!("{krate}: {}", names.join(" <-> ")));
                }
            }
            _ => {}
        }
    }
    // The walk reads real edges (a finder that sees none finds no circle either).
    for expected in ["core", "rpc", "mesh", "process-group", "store", "cli"] {
        assert!(
            seen.contains(expected),
            "no import edge found in {expected}: {seen:?}"
        );
    }
    assert!(
        failures.is_empty(),
        "import circles between modules (move what both sides use into a module of its own):\n  {}",
        failures.join("\n  ")
    );
}

#[test]
fn a_circle_through_use_groups_super_and_bare_child_paths_is_found() {
    let dir = std::env::temp_dir().join(format!("tw-layout-cycles-{}", std::process::id()));
    let src = dir.join("src");
    std::fs::create_dir_all(src.join("a")).unwrap();
    std::fs::write(src.join("lib.rs"), "mod a;\nmod c;\nuse a::b::X;\n").unwrap();
    std::fs::write(
        src.join("a/mod.rs"),
        "pub mod b;\npub use b::X;\n// use crate::c; (a comment)\n",
    )
    .unwrap();
    // b -> c through a use group, c -> a::b through a path in code: a circle of two.
    std::fs::write(src.join("a/b.rs"), "use super::{super::c::{Y, self}};\n").unwrap();
    std::fs::write(
        src.join("c.rs"),
        "fn f() { crate::a::b::g(\"crate::a\"); }\n#[cfg(test)]\nmod tests {\n    use crate::a;\n}\n",
    )
    .unwrap();
    let known = modules(&src);
    let graph = edges(&known);
    let found = circles(&graph);
    std::fs::remove_dir_all(&dir).unwrap();
    let a = vec!["a".to_owned()];
    let b = vec!["a".to_owned(), "b".to_owned()];
    let c = vec!["c".to_owned()];
    assert!(graph[&a].is_empty(), "a using its child b is no edge");
    assert_eq!(graph[&b], BTreeSet::from([c.clone()]));
    assert_eq!(graph[&c], BTreeSet::from([b.clone()]));
    assert_eq!(found, vec![vec![b, c]]);
}

#[test]
fn a_circle_through_a_parent_that_reexports_its_child_is_found_between_top_level_modules() {
    let dir = std::env::temp_dir().join(format!("tw-layout-reexport-{}", std::process::id()));
    let src = dir.join("src");
    std::fs::create_dir_all(src.join("a")).unwrap();
    // The root re-exports `X` from `a::x`; `a::x` uses `b`; `b` uses `crate::X`: module by
    // module, `b` -> `a::x` -> `b` is a circle through the root's re-export; `a` itself
    // re-exports its child (no edge), and between top-level modules it is `a` <-> `b`.
    std::fs::write(src.join("lib.rs"), "mod a;\nmod b;\npub use a::x::X;\n").unwrap();
    std::fs::write(src.join("a/mod.rs"), "pub mod x;\npub use x::X;\n").unwrap();
    std::fs::write(src.join("a/x.rs"), "pub struct X(crate::b::B);\n").unwrap();
    std::fs::write(src.join("b.rs"), "pub struct B;\nfn f(_: &crate::X) {}\n").unwrap();
    // c uses d through d's parent's re-export, d uses c: only the top-level view sees it.
    std::fs::create_dir_all(src.join("p")).unwrap();
    std::fs::write(src.join("p/mod.rs"), "pub mod d;\npub use d::D;\n").unwrap();
    std::fs::write(src.join("p/d.rs"), "pub struct D(crate::c::C);\n").unwrap();
    std::fs::write(
        src.join("c.rs"),
        "pub struct C;\nfn g(_: &crate::p::D) {}\n",
    )
    .unwrap();
    let known = modules(&src);
    let graph = edges(&known);
    std::fs::remove_dir_all(&dir).unwrap();
    let m = |s: &str| s.split("::").map(str::to_owned).collect::<ModPath>();
    assert_eq!(
        graph[&m("b")],
        BTreeSet::from([m("a::x")]),
        "crate::X resolves to a::x"
    );
    assert_eq!(circles(&graph), vec![vec![m("a::x"), m("b")]]);
    assert_eq!(
        graph[&m("c")],
        BTreeSet::from([m("p")]),
        "p::D is p's re-export"
    );
    assert_eq!(
        circles(&top_level(&graph)),
        vec![vec![m("a"), m("b")], vec![m("c"), m("p")]]
    );
}
