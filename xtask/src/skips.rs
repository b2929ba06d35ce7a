//! Tests that skip themselves: a test that needs a GPU, PyTorch or network namespaces passes
//! after printing `SKIPPED: <reason>` where those are missing, and nextest counts it as passed
//! ("0 skipped"). `ci` runs nextest with the output of passing tests kept to the end, keeps
//! those blocks off the terminal, and prints one line instead: how many tests skipped, grouped
//! by reason.

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};

use anyhow::{bail, Context, Result};

use crate::workspace_root;

/// `cargo nextest run ARGS`, its output passed through except the kept output of passing
/// tests, then the line that counts the skips. Fails as nextest does.
pub(crate) fn nextest(args: &[&str]) -> Result<()> {
    let mut all = vec!["nextest", "run"];
    all.extend_from_slice(args);
    // Passing tests' output at the end, after the summary, where it is read and held back.
    all.extend(["--success-output", "final"]);
    let line = format!("cargo {}", all.join(" "));
    eprintln!("xtask: $ {line}");
    let started = std::time::Instant::now();
    let mut child = Command::new("cargo")
        .args(&all)
        .current_dir(workspace_root())
        .stderr(Stdio::piped())
        .spawn()
        .with_context(|| format!("could not start `{line}`"))?;
    let stderr = child.stderr.take().context("nextest's stderr")?;
    let mut scan = Scan::default();
    for l in BufReader::new(stderr).lines() {
        let l = l.context("reading nextest's output")?;
        if let Some(shown) = scan.line(&l) {
            eprintln!("{shown}");
        }
    }
    let status = child.wait().context("waiting for nextest")?;
    eprintln!("{}", scan.summary());
    crate::record_step(line.clone(), started.elapsed().as_secs_f64());
    if !status.success() {
        bail!("`{line}` failed with {status}");
    }
    Ok(())
}

/// Reads nextest's output line by line: what to show, and the skips seen.
#[derive(Default)]
struct Scan {
    /// Past nextest's `Summary` line, where the kept output of passing tests is printed.
    after_summary: bool,
    /// In the kept output of a passing test (held back); `Some(test)`.
    passing_block: Option<String>,
    /// Test -> its first `SKIPPED` reason.
    skipped: BTreeMap<String, String>,
}

impl Scan {
    /// Takes one line of nextest's output; gives it back when it should be shown.
    fn line<'a>(&mut self, line: &'a str) -> Option<&'a str> {
        let trimmed = line.trim_start();
        if !self.after_summary {
            if trimmed.starts_with("Summary [") {
                self.after_summary = true;
            }
            return Some(line);
        }
        // After the summary: a status line ("PASS [ 0.004s] (3/8) crate::binary test") opens
        // a block of that test's kept output.
        if let Some(status) = trimmed.split_whitespace().next() {
            if trimmed[status.len()..].trim_start().starts_with('[') && is_status(status) {
                self.passing_block = (status == "PASS").then(|| test_name(trimmed));
            }
        }
        match &self.passing_block {
            Some(test) => {
                if let Some(reason) = trimmed.strip_prefix("SKIPPED") {
                    self.skipped
                        .entry(test.clone())
                        .or_insert_with(|| reason_group(test, reason));
                }
                None
            }
            None => Some(line),
        }
    }

    /// The one line: how many tests skipped, by reason.
    fn summary(&self) -> String {
        if self.skipped.is_empty() {
            return "xtask: no test skipped itself".to_owned();
        }
        let mut by_reason: BTreeMap<&str, usize> = BTreeMap::new();
        for reason in self.skipped.values() {
            *by_reason.entry(reason).or_default() += 1;
        }
        let mut groups: Vec<(&str, usize)> = by_reason.into_iter().collect();
        groups.sort_by(|a, b| b.1.cmp(&a.1).then(a.0.cmp(b.0)));
        let groups: Vec<String> = groups.iter().map(|(r, n)| format!("{n} {r}")).collect();
        format!(
            "xtask: {} tests skipped themselves (nextest counts them as passed): {}; \
             `cargo nextest run --success-output final` prints each reason in full",
            self.skipped.len(),
            groups.join(", ")
        )
    }
}

fn is_status(word: &str) -> bool {
    matches!(
        word,
        "PASS"
            | "FAIL"
            | "FLAKY"
            | "LEAK"
            | "LEAK-FAIL"
            | "SIGSEGV"
            | "SIGABRT"
            | "TIMEOUT"
            | "ABORT"
            | "SKIP"
    ) || word.starts_with("SIG")
}

/// "PASS [   0.004s] (3/8) crate::binary test" -> "crate::binary test".
fn test_name(status_line: &str) -> String {
    let after_time = status_line
        .split_once(']')
        .map_or(status_line, |(_, r)| r)
        .trim();
    let after_count = match after_time.strip_prefix('(') {
        Some(rest) => rest.split_once(')').map_or(rest, |(_, r)| r).trim(),
        None => after_time,
    };
    after_count.to_owned()
}

/// The part of a `SKIPPED` line that says why, short enough to group by: "SKIPPED: test: no
/// CUDA device (the driver library ...)" -> "no CUDA device"; "SKIPPED the GPU half: no CUDA
/// device (...)" (what was skipped, then why) -> "no CUDA device".
fn reason_group(test: &str, reason: &str) -> String {
    let mut r = match reason.strip_prefix(':') {
        Some(why) => why,
        // "SKIPPED <what> (<why>): <details>", or "SKIPPED <what>: <why>".
        None => match reason.split_once(": ") {
            Some((what, details)) => match what.split_once(" (") {
                Some((_, why)) if why.ends_with(')') => &why[..why.len() - 1],
                _ => details,
            },
            None => reason,
        },
    };
    r = r.trim_start_matches([':', ' ']);
    r = r
        .strip_prefix("SKIPPED")
        .unwrap_or(r)
        .trim_start_matches([':', ' ']);
    let fn_name = test.rsplit([' ', ':']).next().unwrap_or(test);
    if let Some(rest) = r.strip_prefix(fn_name) {
        r = rest.trim_start_matches([':', ' ']);
    }
    let cut = [" (", ": ", "; "]
        .iter()
        .filter_map(|sep| r.find(sep))
        .min()
        .unwrap_or(r.len());
    let short = r[..cut].trim();
    if short.is_empty() {
        "(no reason given)".to_owned()
    } else {
        short.to_owned()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// nextest 0.9's output with `--success-output final` (shape of a real run).
    const RUN: &str = "\
        PASS [   0.004s] (1/4) tensorwire-devices-cuda::cuda plain
        PASS [   0.004s] (2/4) tensorwire-devices-cuda::cuda gpu_round_trips
        FAIL [   0.004s] (3/4) tensorwire-tests::hosts three_hosts
  stdout ───
    the failure's own output
        PASS [   0.010s] (4/4) tensorwire-tests::hosts two_hosts
────────────
     Summary [   0.047s] 4 tests run: 3 passed, 1 failed, 0 skipped
        PASS [   0.004s] (2/4) tensorwire-devices-cuda::cuda gpu_round_trips
  stdout ───

    running 1 test
    SKIPPED: gpu_round_trips: no CUDA device (the CUDA driver library could not be loaded)
    test gpu_round_trips ... ok

        FAIL [   0.004s] (3/4) tensorwire-tests::hosts three_hosts
  stdout ───
    SKIPPED: not counted: this test failed
        PASS [   0.010s] (4/4) tensorwire-tests::hosts two_hosts
  stdout ───
    SKIPPED: cannot simulate hosts with network namespaces: not root
";

    #[test]
    fn reasons_group_by_their_first_words() {
        let g = |test, line: &str| reason_group(test, line.strip_prefix("SKIPPED").unwrap());
        assert_eq!(
            g(
                "c::cuda gpu_x",
                "SKIPPED: gpu_x: no CUDA device (no driver)"
            ),
            "no CUDA device"
        );
        assert_eq!(
            g(
                "r::agent t",
                "SKIPPED the GPU half: no CUDA device (no driver)"
            ),
            "no CUDA device"
        );
        assert_eq!(
            g(
                "p::interop t",
                "SKIPPED: PyTorch interop test needs torch (none); set X"
            ),
            "PyTorch interop test needs torch"
        );
        assert_eq!(
            g(
                "p::mp t",
                "SKIPPED the collectives (no two usable GPUs): rank 0: SETUP-ERROR"
            ),
            "no two usable GPUs"
        );
        assert_eq!(g("t", "SKIPPED"), "(no reason given)");
    }

    #[test]
    fn skips_are_counted_by_reason_and_their_blocks_held_back() {
        let mut scan = Scan::default();
        let shown: Vec<&str> = RUN.lines().filter_map(|l| scan.line(l)).collect();
        // Everything up to the summary is shown; after it, only the failure's block.
        assert!(shown.iter().any(|l| l.contains("Summary [")));
        assert!(shown
            .iter()
            .any(|l| l.contains("not counted: this test failed")));
        assert!(!shown.iter().any(|l| l.contains("no CUDA device")));
        assert!(!shown.iter().any(|l| l.contains("not root")));
        assert_eq!(scan.skipped.len(), 2, "{:?}", scan.skipped);
        assert_eq!(
            scan.skipped["tensorwire-devices-cuda::cuda gpu_round_trips"],
            "no CUDA device"
        );
        assert_eq!(
            scan.summary(),
            "xtask: 2 tests skipped themselves (nextest counts them as passed): \
             1 cannot simulate hosts with network namespaces, 1 no CUDA device; \
             `cargo nextest run --success-output final` prints each reason in full"
        );
    }

    #[test]
    fn no_skips_say_so() {
        let mut scan = Scan::default();
        for l in RUN.lines().take(7) {
            scan.line(l);
        }
        assert_eq!(scan.summary(), "xtask: no test skipped itself");
    }
}
