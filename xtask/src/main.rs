//! Developer tasks for tensorwire: `cargo xtask <task>`.
//!
//! - `ci [--quick]`: what CI runs: format check, clippy with `-D warnings`, every test (nextest
//!   when installed, else `cargo test`; one line counts the tests that skipped themselves, with
//!   their reasons grouped), doc tests, and the docs build with warnings denied. `--quick`, the
//!   inner loop, stops after the format check, clippy and the tests (no doc tests, chaos, docs
//!   or feature trees). Both run the Python package's tests (`python/tests`, after building its
//!   wheel) when `TENSORWIRE_PYTHON` names a Python with torch, maturin and pytest; `python`
//!   runs that step alone. The tests and doc tests are built once, with the non-default
//!   features on (`FEATURED`: `cuda`, `quic`, `shm` of `tensorwire`, core's `sim`, `nccl`, ...;
//!   no GPU needed); clippy runs on both the default and that build. `cargo tree` checks that the library has no CLI dependencies and that its features
//!   remove adapters (no TCP transport with `--no-default-features --features quic`, nor with
//!   `shm`). The shared-memory transport (`transport-shm`, a workspace member) runs the
//!   transport conformance suite in `tensorwire-tests` (`tests/tests/transport_shm.rs`).
//! - `features`: the `cargo tree` checks of `ci` alone (no CLI dependencies in the library, no
//!   TCP transport without `tcp`) and clippy of the no-TCP builds.
//! - `gpu [--nccl] [--out DIR]`: builds (release, stripped) the self-contained GPU check binary
//!   `tw-gpu-check` (with `--nccl` also the NCCL checks), the multi-process RPC worker, the CLI
//!   (for `launch`) and with `--nccl` the process-group worker, copies them to `DIR` (default
//!   `.gpu/` at the workspace root), then prints how to run them on a machine with a GPU.
//! - `gpu-bundle [--out DIR] [--run]`: every GPU check (the `nccl` group, the `::cuda` RPC and
//!   autograd tests, CUDA IPC against the staged path, the benches) built in release into one
//!   git-ignored folder (default `.gpu-bundle/`, under 64 MiB) with `run.sh`, which a GPU
//!   machine runs in 8 minutes at most (see `gpu_bundle.rs`); `--run` runs it here too.
//! - `chaos`: faults injected into real worker processes on simulated hosts (network
//!   namespaces): delay and loss, a frozen peer, the store's host killed, a cut link, a killed
//!   QUIC peer; a table and `N passed, N failed` (see `chaos.rs`). Part of `ci` where it can run
//!   (root, namespaces), else skipped with the reason.
//! - `soak --minutes M` (or `--calls N --rrefs N`): long mixed traffic with resident memory and
//!   store key counts sampled, passing when both stay flat; a summary and a PNG plot (see
//!   `soak.rs`). Not part of `ci`.
//! - `fuzz TARGET|all [--seconds N] [--dev]`, `fuzz seeds`: the cargo-fuzz targets of `fuzz/`,
//!   one per parser of network or file bytes, each run for N seconds (default 60) from the seed
//!   corpus in `fuzz/corpus/` (`xtask/src/fuzz.rs`). Not part of `ci`, whose tests run every
//!   target's own code over its seeds (`tests/tests/fuzz_seeds.rs`) without libFuzzer.

use std::process::Command;
use std::sync::Mutex;
use std::time::Instant;

use anyhow::{bail, Context, Result};

mod chaos;
mod fuzz;
mod gpu_bundle;
mod python;
mod skips;
mod soak;

fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    match args.first().map(String::as_str) {
        Some("ci") => match &args[1..] {
            [] => timed_ci(false),
            [quick] if quick == "--quick" => timed_ci(true),
            _ => bail!("usage: cargo xtask ci [--quick]"),
        },
        Some("gpu") => gpu(&args[1..]),
        Some("gpu-bundle") => gpu_bundle::gpu_bundle(&args[1..]),
        Some("fuzz") => fuzz::fuzz(&args[1..]),
        Some("python") => python::check(),
        Some("chaos") => chaos::chaos(&args[1..]),
        Some("soak") => soak::soak(&args[1..]),
        Some("features") => feature_trees(),
        Some(other) => {
            bail!("unknown task {other:?}; tasks: ci, features, gpu, gpu-bundle, fuzz, chaos, soak, python")
        }
        None => bail!(
            "usage: cargo xtask <task>; tasks: ci, features, gpu, gpu-bundle, fuzz, chaos, soak, python"
        ),
    }
}

/// Runs a command from the workspace root, failing with its command line if it fails.
fn run(program: &str, args: &[&str], envs: &[(&str, &str)]) -> Result<()> {
    let line = format!("{program} {}", args.join(" "));
    eprintln!("xtask: $ {line}");
    let started = Instant::now();
    let status = Command::new(program)
        .args(args)
        .envs(envs.iter().copied())
        .current_dir(workspace_root())
        .status()
        .with_context(|| format!("could not start `{line}`"))?;
    record_step(line.clone(), started.elapsed().as_secs_f64());
    if !status.success() {
        bail!("`{line}` failed with {status}");
    }
    Ok(())
}

/// Prints and keeps one command's seconds, for the table `ci` prints at the end.
fn record_step(line: String, seconds: f64) {
    eprintln!("xtask: {seconds:.0} s: {line}");
    STEPS
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
        .push((line, seconds));
}

/// Every command `run` (and `skips::nextest`) ran, with its seconds: `ci` prints them at the end, so that a slow CI
/// says where its time went.
static STEPS: Mutex<Vec<(String, f64)>> = Mutex::new(Vec::new());

/// Prints the commands run so far with their seconds, the slowest first (at most 15), and the
/// total.
fn print_steps() {
    let mut steps = STEPS
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
        .clone();
    let total: f64 = steps.iter().map(|(_, s)| s).sum();
    steps.sort_by(|a, b| b.1.total_cmp(&a.1));
    eprintln!("\nxtask: where the time went ({total:.0} s in commands):");
    for (line, seconds) in steps.iter().take(15) {
        let short: String = line.chars().take(110).collect();
        eprintln!("  {seconds:>6.0} s  {short}");
    }
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

/// `ci`, then where its time went, whether it passed or not.
fn timed_ci(quick: bool) -> Result<()> {
    let outcome = ci(quick);
    print_steps();
    outcome
}

fn ci(quick: bool) -> Result<()> {
    run("cargo", &["fmt", "--all", "--", "--check"], &[])?;
    // Clippy twice: the default features (what users build) and every non-default feature of
    // `FEATURED` (code behind a feature is linted too). Both are check builds.
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
    let features = featured();
    run(
        "cargo",
        &[
            "clippy",
            "--workspace",
            "--all-targets",
            "--features",
            &features,
            "--",
            "-D",
            "warnings",
        ],
        &[],
    )?;
    // One test build, with every feature of `FEATURED` on: the features only add code and
    // tests (the CUDA backend builds and passes its tests without a GPU, its GPU tests print
    // `SKIPPED: ...` with the reason; the `nccl` backend says at `new_group` why it is
    // unavailable; core's simulation kit; the QUIC transport), so one run covers what a default
    // build's run would, and the workspace is compiled once for tests instead of twice. The
    // chaos workers are built with the same features, from the same build.
    chaos::use_test_build(&features);
    if has_nextest() {
        skips::nextest(&["--workspace", "--features", &features, "--no-fail-fast"])?;
        python::check()?;
        if quick {
            eprintln!("xtask: ci --quick passed (the full `cargo xtask ci` goes on with doc tests, chaos, docs and feature trees)");
            return Ok(());
        }
        // nextest does not run doc tests (core's simulation kit's among them, with `sim`).
        run(
            "cargo",
            &["test", "--workspace", "--features", &features, "--doc"],
            &[],
        )?;
    } else {
        eprintln!("xtask: cargo-nextest not found; using cargo test");
        python::check()?;
        let mut test = vec!["test", "--workspace", "--features", &features];
        test.push("--no-fail-fast");
        if quick {
            test.extend(["--lib", "--bins", "--tests"]);
            run("cargo", &test, &[])?;
            eprintln!("xtask: ci --quick passed");
            return Ok(());
        }
        run("cargo", &test, &[])?;
    }
    // Faults injected into real processes on simulated hosts (about 30 s): needs root and
    // network namespaces, else skipped with the reason.
    match chaos::available() {
        Ok(()) => chaos::chaos(&[])?,
        Err(why) => eprintln!("xtask: SKIPPED chaos (needs root and network namespaces): {why}"),
    }
    run(
        "cargo",
        &["doc", "--workspace", "--no-deps"],
        &[("RUSTDOCFLAGS", "-D warnings")],
    )?;
    feature_trees()?;
    eprintln!("xtask: ci passed");
    Ok(())
}

/// Every feature of [`FEATURED`], as one `--features` argument (`package/feature,...`).
fn featured() -> String {
    FEATURED
        .iter()
        .flat_map(|(package, features)| features.iter().map(move |f| format!("{package}/{f}")))
        .collect::<Vec<_>>()
        .join(",")
}

/// The non-default features `ci` builds, lints and tests, per package, all in one build (the
/// CUDA backend, core's simulation kit, the QUIC transport in the CLI and the agent's QUIC
/// backend, the NCCL wrapper and the `nccl` process-group backend, the GPU check with its NCCL
/// steps).
const FEATURED: &[(&str, &[&str])] = &[
    (
        "tensorwire",
        &["cuda", "quic", "shm", "autograd-candle", "faults"],
    ),
    ("tensorwire-rpc", &["quic", "cuda"]),
    ("tensorwire-devices-cuda", &["nccl"]),
    ("tensorwire-process-group", &["nccl"]),
    ("tensorwire-core", &["sim"]),
    ("tensorwire-tests", &["nccl"]),
];

/// The normal dependencies of a package with the given cargo arguments, one crate name a line.
fn tree(args: &[&str]) -> Result<Vec<String>> {
    let mut cmd = vec![
        "tree", "-e", "normal", "--prefix", "none", "--format", "{p}",
    ];
    cmd.extend_from_slice(args);
    eprintln!("xtask: $ cargo {}", cmd.join(" "));
    let out = Command::new("cargo")
        .args(&cmd)
        .current_dir(workspace_root())
        .output()
        .context("could not start `cargo tree`")?;
    if !out.status.success() {
        bail!(
            "`cargo {}` failed: {}",
            cmd.join(" "),
            String::from_utf8_lossy(&out.stderr)
        );
    }
    Ok(String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| l.split_whitespace().next().map(str::to_owned))
        .collect())
}

/// Features remove code: the library carries no CLI dependencies, and without `tcp` no TCP
/// transport is in the tree, in `tensorwire` and in the crates that take transports through the
/// port (`rpc`, `process-group`); the no-TCP library builds.
fn feature_trees() -> Result<()> {
    let cli_only = ["clap", "indicatif", "anyhow", "tracing-subscriber"];
    let lib = tree(&["-p", "tensorwire", "--features", "cuda,quic,shm"])?;
    if let Some(dep) = lib.iter().find(|d| cli_only.contains(&d.as_str())) {
        bail!("the tensorwire library depends on {dep}, a CLI dependency (it belongs in tensorwire-cli)");
    }
    for (package, features) in [
        ("tensorwire", "quic"),
        ("tensorwire", "shm"),
        ("tensorwire-transport-shm", ""),
        ("tensorwire-rpc", "quic"),
        ("tensorwire-process-group", ""),
    ] {
        let deps = tree(&[
            "-p",
            package,
            "--no-default-features",
            "--features",
            features,
        ])?;
        if deps.iter().any(|d| d == "tensorwire-transport-tcp") {
            bail!("{package} without its `tcp` feature still has tensorwire-transport-tcp in its tree");
        }
    }
    for features in ["quic", "shm"] {
        run(
            "cargo",
            &[
                "clippy",
                "-p",
                "tensorwire",
                "--no-default-features",
                "--features",
                features,
                "--",
                "-D",
                "warnings",
            ],
            &[],
        )?;
    }
    run(
        "cargo",
        &[
            "clippy",
            "-p",
            "tensorwire-process-group",
            "--no-default-features",
            "--",
            "-D",
            "warnings",
        ],
        &[],
    )?;
    Ok(())
}

/// Builds the GPU check binaries in release mode and copies them where a GPU machine can pick
/// them up.
fn gpu(args: &[String]) -> Result<()> {
    let root = workspace_root();
    let mut out = root.join(".gpu");
    let mut nccl = false;
    let mut rest = args.iter();
    while let Some(arg) = rest.next() {
        match arg.as_str() {
            "--out" => match rest.next() {
                Some(dir) => out = std::path::PathBuf::from(dir),
                None => bail!("--out needs a folder"),
            },
            "--nccl" => nccl = true,
            _ => bail!("usage: cargo xtask gpu [--nccl] [--out DIR]"),
        }
    }
    // (package, features, binary): the GPU check, the multi-process RPC worker and the CLI
    // (whose `launch` starts the workers), and with --nccl the process-group worker.
    let mut bins = vec![
        (
            "tensorwire-tests",
            if nccl { "nccl" } else { "" },
            "tw-gpu-check",
        ),
        ("tensorwire-tests", "", "tw-rpc-worker"),
        ("tensorwire-cli", "", "tensorwire"),
    ];
    if nccl {
        bins.push(("tensorwire-tests", "nccl", "tw-pg-worker"));
    }
    let target = std::env::var_os("CARGO_TARGET_DIR")
        .map(std::path::PathBuf::from)
        .unwrap_or_else(|| root.join("target"));
    std::fs::create_dir_all(&out).with_context(|| format!("cannot create {}", out.display()))?;
    for (package, features, bin) in bins {
        let mut build = vec!["build", "--release", "-p", package, "--bin", bin];
        if !features.is_empty() {
            build.extend(["--features", features]);
        }
        run("cargo", &build, &[])?;
        let built = target.join("release").join(bin);
        let dest = out.join(bin);
        std::fs::copy(&built, &dest)
            .with_context(|| format!("cannot copy {} to {}", built.display(), dest.display()))?;
        // Smaller to ship; best effort (the binaries work unstripped).
        let _ = Command::new("strip").arg(&dest).status();
    }
    let glibc = Command::new("ldd")
        .arg("--version")
        .output()
        .ok()
        .and_then(|o| String::from_utf8(o.stdout).ok())
        .and_then(|s| s.lines().next().map(str::to_owned))
        .unwrap_or_else(|| "unknown".into());
    let dir = out.display();
    let nccl_part = if nccl {
        format!(
            "\n\
             With --nccl, tw-gpu-check also runs a 1-rank NCCL all_reduce and a 1-rank nccl\n\
             process group. cudarc opens NCCL only as libnccl.so: with the nvidia-nccl-cu12/cu13\n\
             wheel, put a libnccl.so symlink to its lib/libnccl.so.2 in a folder on\n\
             LD_LIBRARY_PATH. An nccl process group of N processes (new_group(\"nccl\"), every\n\
             collective on device tensors, checked), one rank per GPU:\n\
             \x20   {dir}/tensorwire launch --nproc 1 -- {dir}/tw-pg-worker nccl\n"
        )
    } else {
        String::new()
    };
    eprintln!(
        "xtask: built {dir}/tw-gpu-check, tw-rpc-worker, tensorwire{}\n\
         \n\
         Run them on a machine with an NVIDIA GPU and driver (CUDA 12.0 or newer, driver 525+).\n\
         No CUDA toolkit is needed: the driver library libcuda.so.1 is loaded at run time. They\n\
         need a glibc at least as new as this build machine's ({glibc}).\n\
         \n\
         The device checks and staging throughput against raw copies (PASS/FAIL per check, a\n\
         SUMMARY line; exit 0 = all passed, 1 = a check failed, 2 = no usable CUDA device):\n\
         \x20   {dir}/tw-gpu-check [--no-bench] [--bench-mib N]\n\
         The multi-process RPC scenarios on the real CUDA backend (each rank prints OK ...):\n\
         \x20   TW_DEVICES=cuda {dir}/tensorwire launch --nproc 3 -- {dir}/tw-rpc-worker device-tensors\n\
         \x20   (also: basic, inflight, bad-map, dynamic, scale)\n\
         {nccl_part}",
        if nccl { ", tw-pg-worker" } else { "" },
    );
    Ok(())
}
