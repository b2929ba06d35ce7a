//! Developer tasks for tensorwire: `cargo xtask <task>`.
//!
//! - `ci`: what CI runs: format check, clippy with `-D warnings`, every test (nextest when
//!   installed, else `cargo test`), doc tests, and the docs build with warnings denied.
//! - `fuzz TARGET [--seconds N]`: runs a cargo-fuzz target of `fuzz/` (`wire`: the frame
//!   decoder) for N seconds (default 60), installing cargo-fuzz if missing. Not part of `ci`.

use std::process::Command;

use anyhow::{bail, Context, Result};

fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    match args.first().map(String::as_str) {
        Some("ci") => ci(),
        Some("fuzz") => fuzz(&args[1..]),
        Some(other) => bail!("unknown task {other:?}; tasks: ci, fuzz"),
        None => bail!("usage: cargo xtask <task>; tasks: ci, fuzz"),
    }
}

/// Runs a command from the workspace root, failing with its command line if it fails.
fn run(program: &str, args: &[&str], envs: &[(&str, &str)]) -> Result<()> {
    let line = format!("{program} {}", args.join(" "));
    eprintln!("xtask: $ {line}");
    let status = Command::new(program)
        .args(args)
        .envs(envs.iter().copied())
        .current_dir(workspace_root())
        .status()
        .with_context(|| format!("could not start `{line}`"))?;
    if !status.success() {
        bail!("`{line}` failed with {status}");
    }
    Ok(())
}

fn workspace_root() -> std::path::PathBuf {
    std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("xtask lives one level below the workspace root")
        .to_path_buf()
}

fn has_nextest() -> bool {
    Command::new("cargo")
        .args(["nextest", "--version"])
        .output()
        .map(|o| o.status.success())
        .unwrap_or(false)
}

fn ci() -> Result<()> {
    run("cargo", &["fmt", "--all", "--", "--check"], &[])?;
    run(
        "cargo",
        &[
            "clippy",
            "--workspace",
            "--all-targets",
            "--",
            "-D",
            "warnings",
        ],
        &[],
    )?;
    if has_nextest() {
        run(
            "cargo",
            &["nextest", "run", "--workspace", "--no-fail-fast"],
            &[],
        )?;
        // nextest does not run doc tests.
        run("cargo", &["test", "--workspace", "--doc"], &[])?;
    } else {
        eprintln!("xtask: cargo-nextest not found; using cargo test");
        run("cargo", &["test", "--workspace", "--no-fail-fast"], &[])?;
    }
    run(
        "cargo",
        &["doc", "--workspace", "--no-deps"],
        &[("RUSTDOCFLAGS", "-D warnings")],
    )?;
    eprintln!("xtask: ci passed");
    Ok(())
}

/// Fuzz targets in `fuzz/fuzz_targets/`.
const FUZZ_TARGETS: &[&str] = &["wire"];

fn fuzz(args: &[String]) -> Result<()> {
    let usage = || {
        format!(
            "usage: cargo xtask fuzz TARGET [--seconds N]; targets: {}",
            FUZZ_TARGETS.join(", ")
        )
    };
    let mut target = None;
    let mut seconds: u64 = 60;
    let mut rest = args.iter();
    while let Some(arg) = rest.next() {
        match arg.as_str() {
            "--seconds" => {
                let n = rest.next().with_context(usage)?;
                seconds = n
                    .parse()
                    .with_context(|| format!("--seconds takes a whole number, not {n:?}"))?;
            }
            t if target.is_none() && !t.starts_with('-') => target = Some(t.to_owned()),
            other => bail!("unexpected argument {other:?}; {}", usage()),
        }
    }
    let target = target.with_context(usage)?;
    if !FUZZ_TARGETS.contains(&target.as_str()) {
        bail!("unknown fuzz target {target:?}; {}", usage());
    }
    if seconds == 0 {
        bail!("--seconds must be at least 1");
    }
    let has_cargo_fuzz = Command::new("cargo")
        .args(["fuzz", "--version"])
        .output()
        .map(|o| o.status.success())
        .unwrap_or(false);
    if !has_cargo_fuzz {
        eprintln!("xtask: cargo-fuzz not found; installing it");
        run("cargo", &["install", "cargo-fuzz", "--locked"], &[])?;
    }
    // cargo-fuzz passes nightly-only flags (-Z sanitizer, -C passes=sancov); RUSTC_BOOTSTRAP
    // lets the stable toolchain accept them.
    let max_time = format!("-max_total_time={seconds}");
    run(
        "cargo",
        &[
            "fuzz",
            "run",
            &target,
            "--",
            &max_time,
            "-rss_limit_mb=2048",
            "-print_final_stats=1",
        ],
        &[("RUSTC_BOOTSTRAP", "1")],
    )?;
    eprintln!("xtask: fuzzed {target} for {seconds} s without a finding");
    Ok(())
}
