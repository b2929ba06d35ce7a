//! The workspace's shape, checked on its sources: no source file of a crate (`*/src/**.rs`,
//! test modules aside) is over 1,200 lines, so that a module keeps to one concern and a reader
//! can hold it. A file that grows past the bound is split into submodules by concern.

use std::path::{Path, PathBuf};

/// The bound, in lines.
const MAX_LINES: usize = 1200;

/// Files over the bound that are known and waiting for their split (each on the branch of the
/// work that is changing it now). Nothing new joins them; each leaves once split.
const WAITING: [&str; 0] = [];

/// Every `.rs` file under `dir`, skipping test modules (`tests.rs`, `tests/`).
fn sources(dir: &Path, out: &mut Vec<PathBuf>) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for entry in entries {
        let path = entry.unwrap().path();
        let name = path.file_name().unwrap().to_string_lossy().into_owned();
        if path.is_dir() {
            if name != "tests" {
                sources(&path, out);
            }
        } else if name.ends_with(".rs") && name != "tests.rs" {
            out.push(path);
        }
    }
}

/// Every crate's `src` file with its line count, paths relative to the workspace root.
fn line_counts() -> Vec<(String, usize)> {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .unwrap()
        .to_owned();
    let mut files = Vec::new();
    for entry in std::fs::read_dir(&root).unwrap() {
        let krate = entry.unwrap().path();
        let name = krate.file_name().unwrap().to_string_lossy().into_owned();
        // Build output and the fuzz workspace's own target directory are not sources.
        if name == "target" || name.starts_with('.') || !krate.join("Cargo.toml").is_file() {
            continue;
        }
        sources(&krate.join("src"), &mut files);
    }
    assert!(files.len() > 100, "found only {} source files", files.len());
    let mut out: Vec<(String, usize)> = files
        .into_iter()
        .map(|f| {
            let lines = std::fs::read_to_string(&f).unwrap().lines().count();
            let rel = f.strip_prefix(&root).unwrap().display().to_string();
            (rel, lines)
        })
        .collect();
    out.sort();
    out
}

#[test]
fn no_source_file_is_over_1200_lines() {
    let counts = line_counts();
    assert!(
        counts.iter().any(|(f, _)| f == "rpc/src/agent.rs"),
        "the walk missed rpc/src: {counts:?}"
    );
    let long: Vec<&(String, usize)> = counts
        .iter()
        .filter(|(f, lines)| *lines > MAX_LINES && !WAITING.contains(&f.as_str()))
        .collect();
    assert!(
        long.is_empty(),
        "files over {MAX_LINES} lines (split them into submodules by concern): {long:?}"
    );
    // A waiting file that was split leaves the list.
    let done: Vec<&&str> = WAITING
        .iter()
        .filter(|w| counts.iter().any(|(f, l)| f == *w && *l <= MAX_LINES))
        .collect();
    assert!(
        done.is_empty(),
        "no longer over the bound; remove from WAITING: {done:?}"
    );
}
