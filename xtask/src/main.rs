//! Developer tasks for tensorwire: `cargo xtask <task>`.
//!
//! - `ci`: what CI runs: format check, clippy with `-D warnings`, every test (nextest when
//!   installed, else `cargo test`), doc tests, and the docs build with warnings denied.

use std::process::Command;

use anyhow::{bail, Context, Result};

fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    match args.first().map(String::as_str) {
        Some("ci") => ci(),
        Some(other) => bail!("unknown task {other:?}; tasks: ci"),
        None => bail!("usage: cargo xtask <task>; tasks: ci"),
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
