//! Shared helpers for tensorwire's cross-crate and multi-process tests.
//!
//! - [`transport_suite`]: the transport conformance suite, generic over the `Transport` port.
//! - [`netns`]: simulated hosts (network namespaces joined by a bridge) for multi-host tests.
//! - [`workload`]: the functions every multi-process RPC worker serves.
//! - [`world`]: a world of worker processes (rank 0 announces its store; no polling sleeps).
//! - [`announce_store_addr`]: how a worker with `MASTER_PORT=0` says where its store listens.
//! - [`hold_until_stdin_closes`]: how a worker waits for the test to end it.

pub mod netns;
pub mod transport_suite;
pub mod workload;
pub mod world;

/// With `MASTER_PORT=0`, rank 0's store listens on a port of the system's choosing: print the
/// rendezvous's log line that says where (`... rank 0 hosts the store addr=HOST:PORT ...`), so
/// the test can start the other ranks with it.
/// `TW_LOG` (a tracing filter, say `tensorwire_transport_shm::select=info`) adds those log
/// lines, as the transport chosen for each peer.
pub fn announce_store_addr() {
    let mut filter = std::env::var("TW_LOG").unwrap_or_default();
    if std::env::var("RANK").as_deref() == Ok("0")
        && std::env::var("MASTER_PORT").as_deref() == Ok("0")
    {
        filter = format!("tensorwire_rendezvous::init_method=info,{filter}");
    }
    if !filter.is_empty() {
        tracing_subscriber::fmt()
            .with_env_filter(filter.trim_end_matches(','))
            .with_ansi(false)
            .with_writer(std::io::stdout)
            .init();
    }
}

/// Holds a worker that the test ends itself, in place of a sleep of some bound: returns once
/// the worker's stdin is closed. [`world::World`] keeps each worker's stdin open until it kills
/// or waits for it, and a test process that dies closes it too, so no worker outlives its test.
pub fn hold_until_stdin_closes() {
    use std::io::Read;
    let mut stdin = std::io::stdin().lock();
    let mut sink = [0u8; 256];
    while matches!(stdin.read(&mut sink), Ok(n) if n > 0) {}
}

/// [`hold_until_stdin_closes`] for an async worker (read on a blocking thread).
pub async fn hold_until_stdin_closes_async() {
    let _ = tokio::task::spawn_blocking(hold_until_stdin_closes).await;
}

/// Forwards every line `child` writes to stdout or stderr to `tx`, tagged with `rank`, each
/// stream on a thread of its own (the multi-process tests read their workers this way).
pub fn forward_lines(
    child: &mut std::process::Child,
    rank: usize,
    tx: &std::sync::mpsc::Sender<(usize, String)>,
) {
    use std::io::BufRead;
    let out = child
        .stdout
        .take()
        .map(|s| Box::new(s) as Box<dyn std::io::Read + Send>);
    let err = child
        .stderr
        .take()
        .map(|s| Box::new(s) as Box<dyn std::io::Read + Send>);
    for stream in [out, err].into_iter().flatten() {
        let tx = tx.clone();
        std::thread::spawn(move || {
            for line in std::io::BufReader::new(stream)
                .lines()
                .map_while(Result::ok)
            {
                let _ = tx.send((rank, line));
            }
        });
    }
}

/// The worker binary `name` for a multi-process test: the one in `TW_BIN_DIR` when that is set
/// (the GPU bundle runs the test executables on another machine, next to their workers), else
/// `built`, the path cargo compiled in (`env!("CARGO_BIN_EXE_<name>")`).
pub fn worker_bin(name: &str, built: &str) -> std::path::PathBuf {
    match std::env::var_os("TW_BIN_DIR") {
        Some(dir) => std::path::Path::new(&dir).join(name),
        None => built.into(),
    }
}

/// The Python with PyTorch for the interoperability tests (`TENSORWIRE_TORCH_PYTHON`, else
/// `python3`).
pub fn torch_python() -> String {
    std::env::var("TENSORWIRE_TORCH_PYTHON").unwrap_or_else(|_| "python3".to_owned())
}

/// `Some(reason)` when [`torch_python`] has no `torch` package. Only found, not imported: every
/// test asks, nextest runs each test in a process of its own, and importing torch costs seconds
/// of CPU (CI checks once, in `.ci/run`, that `torch.distributed` imports).
pub fn torch_missing() -> Option<String> {
    let python = torch_python();
    match std::process::Command::new(&python)
        .args([
            "-c",
            "import importlib.util, sys; sys.exit(importlib.util.find_spec('torch') is None)",
        ])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .status()
    {
        Ok(s) if s.success() => None,
        Ok(_) => Some(format!("{python} has no torch package")),
        Err(e) => Some(format!("cannot run {python}: {e}")),
    }
}

/// Returns from the test, printing `SKIPPED: <what> needs torch (<reason>)`, when torch is
/// missing; panics instead when `TENSORWIRE_REQUIRE_TORCH` is set (CI sets it after installing
/// torch: a skip there would hide a broken install).
#[macro_export]
macro_rules! require_torch {
    ($what:expr) => {
        if let Some(reason) = $crate::torch_missing() {
            if std::env::var_os("TENSORWIRE_REQUIRE_TORCH").is_some() {
                panic!("TENSORWIRE_REQUIRE_TORCH is set but torch is missing: {reason}");
            }
            eprintln!(
                "SKIPPED: {} needs torch ({reason}); set TENSORWIRE_TORCH_PYTHON",
                $what
            );
            return;
        }
    };
}

/// Every `.rs` file under `dir`, skipping test modules (`tests.rs`, `tests/`): what the layout
/// tests read.
pub fn source_files(dir: &std::path::Path, out: &mut Vec<std::path::PathBuf>) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for entry in entries {
        let path = entry.unwrap().path();
        let name = path.file_name().unwrap().to_string_lossy().into_owned();
        if path.is_dir() {
            if name != "tests" {
                source_files(&path, out);
            }
        } else if name.ends_with(".rs") && name != "tests.rs" {
            out.push(path);
        }
    }
}
