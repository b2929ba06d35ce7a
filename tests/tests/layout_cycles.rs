//! No import circle between the modules of a crate: if module `a` uses `b`, `b` (or anything
//! `b` uses) does not use `a`. A circle means two concerns that cannot be read, tested or moved
//! apart; shared helpers belong in a module of their own that imports neither side.
//!
//! Checked on the sources: every path a module names (`use` items and paths in code, test
//! modules aside) that resolves to another module of the same crate (`crate::`, `super::`,
//! `self::`, or a child module by its bare name) is an edge, but for paths into the module's own
//! submodules, and paths into the crate root: a module declares, uses and re-exports its children
//! (its facade, as quinn-proto's `connection` does), so children may use what their parent
//! defines. Binaries under `src/bin/` are crates of their own and are
//! left out.

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

/// The import edges between a crate's modules (the root exempt).
fn edges(known: &BTreeMap<ModPath, PathBuf>) -> BTreeMap<ModPath, BTreeSet<ModPath>> {
    let mut out = BTreeMap::new();
    for (module, file) in known {
        let mut to = BTreeSet::new();
        if !module.is_empty() {
            let text = code(&std::fs::read_to_string(file).unwrap());
            for p in paths(&tokens(&text)) {
                if let Some(target) = resolve(module, &p, known) {
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

/// Every crate of the workspace (its directory name) with the circles among its modules.
fn workspace_circles() -> Vec<(String, Vec<Vec<ModPath>>)> {
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
        out.push((name, circles(&edges(&known))));
    }
    out
}

#[test]
fn no_crate_has_an_import_circle() {
    let mut failures = Vec::new();
    for (krate, found) in workspace_circles() {
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
