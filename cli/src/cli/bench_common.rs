//! What every benchmark shares: sizes, statistics, progress bars, JSON output and runtimes.
//! A leaf module: it imports no benchmark, so that every benchmark may import it.

use std::io::IsTerminal;
use std::path::PathBuf;
use std::time::Duration;

use anyhow::{Context, Result};
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use serde_json::Value;

/// Size of a ping-pong message, raw and framed (as the frame's message header).
pub(crate) const SMALL: usize = 64;
pub(crate) const MIB: usize = 1 << 20;

/// A progress bar on standard error, hidden when it is not a terminal.
pub(crate) fn progress(len: u64, what: &str) -> ProgressBar {
    let target = if std::io::stderr().is_terminal() {
        ProgressDrawTarget::stderr()
    } else {
        ProgressDrawTarget::hidden()
    };
    let bar = ProgressBar::with_draw_target(Some(len), target);
    bar.set_style(
        ProgressStyle::with_template("{msg:32} [{bar:30}] {pos}/{len} {elapsed}")
            .unwrap_or_else(|_| ProgressStyle::default_bar()),
    );
    bar.set_message(what.to_owned());
    bar
}

/// The `p` quantile (0 to 1) of `sorted`, in microseconds: the benchmarks' one percentile.
// Exact, from the sorted samples: a run keeps at most some thousands of them, so a histogram
// (hdrhistogram) would save nothing and add its bucket error.
pub(crate) fn percentile(sorted: &[Duration], p: f64) -> f64 {
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i.min(sorted.len() - 1)].as_secs_f64() * 1e6
}

pub(crate) fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// Megabytes (10^6 bytes) per second.
pub(crate) fn mbps(bytes: usize, took: Duration) -> f64 {
    bytes as f64 / took.as_secs_f64() / 1e6
}

/// Writes the results: to `path` (and a copy to standard error) or to standard output.
pub(crate) fn write_json(
    out: &serde_json::Map<String, Value>,
    path: Option<&PathBuf>,
) -> Result<()> {
    let text = serde_json::to_string_pretty(&Value::Object(out.clone()))?;
    match path {
        Some(path) => {
            std::fs::write(path, format!("{text}\n"))
                .with_context(|| format!("writing {}", path.display()))?;
            eprintln!("{text}");
            eprintln!("tensorwire bench: wrote {}", path.display());
        }
        None => println!("{text}"),
    }
    Ok(())
}

pub(crate) fn median_us(mut v: Vec<Duration>) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    v.sort();
    percentile(&v, 0.5)
}

pub(crate) fn runtime(threads: usize) -> Result<tokio::runtime::Runtime> {
    let mut builder = if threads <= 1 {
        tokio::runtime::Builder::new_current_thread()
    } else {
        let mut b = tokio::runtime::Builder::new_multi_thread();
        b.worker_threads(threads);
        b
    };
    Ok(builder.enable_all().build()?)
}

/// Runs a blocking raw-baseline step from async code (on a current-thread runtime the thread
/// simply blocks: nothing else must run meanwhile).
pub(crate) fn blocking<T>(f: impl FnOnce() -> T) -> T {
    match tokio::runtime::Handle::current().runtime_flavor() {
        tokio::runtime::RuntimeFlavor::MultiThread => tokio::task::block_in_place(f),
        _ => f(),
    }
}
