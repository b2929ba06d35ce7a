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

/// The agent itself: its handle and the modules of its insides (the drivers of the
/// membership, the gathers and the IPC state among them: all are the node's, beside the
/// endpoint; the IPC driver's tests drive the node's IPC state as an export would).
const AGENT: [&str; 12] = [
    "agent.rs",
    "state.rs",
    "driver.rs",
    "gather.rs",
    "ipc.rs",
    "ipc/tests.rs",
    "links.rs",
    "membership.rs",
    "serve.rs",
    "shutdown.rs",
    "init/mod.rs",
    "init/static_group.rs",
];

#[test]
fn nothing_outside_the_agent_reaches_into_its_endpoint() {
    let found = offenders(&["lock().ep", ".ep.", ".node.", "lock().node"], &AGENT);
    assert!(offenders(&[".node."], &[]).contains(&"links.rs".to_owned()));
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
