//! `cargo xtask fuzz`: the cargo-fuzz targets of `fuzz/`, built once and run for a bounded
//! time each from the seed corpus kept in `fuzz/corpus/TARGET/`.
//!
//! - `cargo xtask fuzz TARGET [--seconds N] [--dev]`, or `all`: builds the targets (installing
//!   cargo-fuzz when it is missing), then runs each for N seconds (default 60). New inputs go to
//!   `corpus/TARGET/` in the fuzz workspace's target directory (`fuzz/target/`, or
//!   `$CARGO_TARGET_DIR`; kept between runs, not in the repository); a crash, leak,
//!   timeout or out-of-memory input goes to `fuzz/artifacts/TARGET/` and fails the task, which
//!   says how to replay it.
//! - `cargo xtask fuzz seeds`: writes the seed corpus again, from the crates' own encoders
//!   (`fuzz/seeds`).
//!
//! The build uses cargo-fuzz's defaults (release, AddressSanitizer, libFuzzer's coverage
//! instrumentation) plus debug assertions, so that integer overflows are findings too. Only a
//! stable toolchain is installed here; `RUSTC_BOOTSTRAP=1` lets it accept the nightly flags.
//! `--dev` builds them unoptimized (minutes less to build, far fewer runs a second).
//!
//! CI does not fuzz: its tests run every target's body over its seed corpus as a plain test
//! (`tests/tests/fuzz_seeds.rs`), which also keeps the targets compiling and linted.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

use anyhow::{bail, Context, Result};

use crate::{run, workspace_root};

/// The targets in `fuzz/fuzz_targets/`, with what each reads.
pub(crate) const TARGETS: &[(&str, &str)] = &[
    (
        "store",
        "c10d store requests, through the server's handling",
    ),
    ("store_auth", "the store's cluster-secret step"),
    ("handshake", "the transports' cluster-secret handshake"),
    ("wire", "the frame decoder"),
    (
        "rpc",
        "RPC frames through to the decoded header and tensors",
    ),
    (
        "protocol",
        "a hostile peer's forged headers against honest endpoints, checking values",
    ),
    ("file_store", "FileStore's file format"),
    (
        "mesh_frames",
        "the mesh's frames: group frames, hellos and their answers",
    ),
    (
        "membership",
        "dynamic and static membership messages and gather contributions",
    ),
    ("shm_records", "the shm ring's record headers and positions"),
    (
        "quic_prefix",
        "the QUIC stream prefix and the reorder buffer",
    ),
    (
        "store_client",
        "the store client reading a server's replies",
    ),
    (
        "autograd",
        "distributed autograd messages into its state machine",
    ),
    ("slurm", "Slurm host lists and their expansion"),
];

/// Every target's name.
pub(crate) fn all() -> Vec<&'static str> {
    TARGETS.iter().map(|(t, _)| *t).collect()
}

fn usage() -> String {
    let names: Vec<String> = TARGETS
        .iter()
        .map(|(t, what)| format!("{t} ({what})"))
        .collect();
    format!(
        "usage: cargo xtask fuzz TARGET|all [--seconds N] [--dev] | cargo xtask fuzz seeds; targets: {}",
        names.join(", ")
    )
}

/// `cargo xtask fuzz ...`.
pub(crate) fn fuzz(args: &[String]) -> Result<()> {
    let mut target = None;
    let mut seconds: u64 = 60;
    let mut how = Build::Release;
    let mut rest = args.iter();
    while let Some(arg) = rest.next() {
        match arg.as_str() {
            "--dev" => how = Build::Dev,
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
    if seconds == 0 {
        bail!("--seconds must be at least 1");
    }
    match target.as_str() {
        "seeds" => seeds(),
        "all" => run_targets(&all(), seconds, how),
        t if TARGETS.iter().any(|(name, _)| *name == t) => run_targets(&[t], seconds, how),
        other => bail!("unknown fuzz target {other:?}; {}", usage()),
    }
}

/// Writes the seed corpus (a plain build of `fuzz/seeds`).
fn seeds() -> Result<()> {
    run(
        "cargo",
        &[
            "run",
            "--manifest-path",
            "fuzz/Cargo.toml",
            "-p",
            "tensorwire-fuzz-seeds",
        ],
        &[],
    )
}

fn host_triple() -> Result<String> {
    let out = Command::new("rustc")
        .arg("-vV")
        .output()
        .context("cannot run rustc -vV")?;
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .find_map(|l| l.strip_prefix("host: ").map(str::to_owned))
        .context("rustc -vV printed no host triple")
}

/// The fuzz workspace's target directory, as cargo resolves it: `fuzz/target/` by default,
/// `CARGO_TARGET_DIR` or a `build.target-dir` setting when one is given. `cargo fuzz build`
/// puts the binaries in `<it>/<host triple>/release/`.
pub(crate) fn target_dir(root: &Path) -> Result<PathBuf> {
    target_dir_of(metadata_command(root))
}

/// `cargo metadata` of the fuzz workspace (its own workspace, so its own target directory).
fn metadata_command(root: &Path) -> Command {
    let mut cmd = Command::new("cargo");
    cmd.args([
        "metadata",
        "--format-version",
        "1",
        "--no-deps",
        "--manifest-path",
    ])
    .arg(root.join("fuzz/Cargo.toml"))
    .current_dir(root);
    cmd
}

fn target_dir_of(mut metadata: Command) -> Result<PathBuf> {
    let out = metadata.output().context("cannot run cargo metadata")?;
    if !out.status.success() {
        bail!(
            "`cargo metadata` of the fuzz workspace failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    let meta: serde_json::Value =
        serde_json::from_slice(&out.stdout).context("cargo metadata printed no JSON")?;
    meta["target_directory"]
        .as_str()
        .map(PathBuf::from)
        .context("cargo metadata printed no target_directory")
}

/// Installs cargo-fuzz when `cargo fuzz` is missing.
fn ensure_cargo_fuzz() -> Result<()> {
    let has = Command::new("cargo")
        .args(["fuzz", "--version"])
        .output()
        .map(|o| o.status.success())
        .unwrap_or(false);
    if !has {
        eprintln!(
            "xtask: cargo-fuzz not found; installing it with `cargo install cargo-fuzz --locked` \
             (a few minutes; libFuzzer needs a C++ compiler)"
        );
        let started = Instant::now();
        run("cargo", &["install", "cargo-fuzz", "--locked"], &[])?;
        eprintln!(
            "xtask: installed cargo-fuzz in {:.0} s",
            started.elapsed().as_secs_f64()
        );
    }
    Ok(())
}

/// What one run of a target did.
struct Outcome {
    target: String,
    runs: Option<u64>,
    seconds: f64,
    corpus: usize,
    failure: Option<String>,
}

/// How the fuzz targets are built.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(crate) enum Build {
    /// Optimized, with debug assertions: many runs a second, for real fuzzing sessions.
    Release,
    /// Unoptimized (`--dev`): a fraction of the release build's time and of its speed, for a
    /// smoke test that every target builds and runs under the sanitizer, not a search.
    Dev,
}

/// Builds `targets` once, then runs each for `seconds`; fails if any run found something.
fn run_targets(targets: &[&str], seconds: u64, how: Build) -> Result<()> {
    ensure_cargo_fuzz()?;
    let root = workspace_root();
    let target_dir = target_dir(&root)?;
    let (profile, kind) = match how {
        Build::Release => ("release", "a release build"),
        Build::Dev => ("debug", "an unoptimized build"),
    };
    eprintln!(
        "xtask: fuzzing {} target(s) for {seconds} s each: first {kind} with \
         AddressSanitizer into {} (minutes the first time)",
        targets.len(),
        target_dir.display()
    );
    let started = Instant::now();
    let mut build = vec!["fuzz", "build", "--debug-assertions"];
    if how == Build::Dev {
        build.push("--dev");
    }
    // One target: build only it (all: one build of every binary).
    if let [one] = targets {
        build.push(one);
    }
    run("cargo", &build, &[("RUSTC_BOOTSTRAP", "1")])?;
    eprintln!(
        "xtask: built the fuzz targets in {:.0} s",
        started.elapsed().as_secs_f64()
    );
    let bin_dir = target_dir.join(host_triple()?).join(profile);
    let mut outcomes = Vec::new();
    for target in targets {
        outcomes.push(run_one(&root, &target_dir, &bin_dir, target, seconds)?);
    }
    eprintln!("\nxtask: fuzz summary ({seconds} s per target)");
    eprintln!(
        "  {:<12} {:>10} {:>8} {:>8}  result",
        "target", "runs", "seconds", "corpus"
    );
    for o in &outcomes {
        let runs = o.runs.map_or_else(|| "?".to_owned(), |r| r.to_string());
        eprintln!(
            "  {:<12} {:>10} {:>8.0} {:>8}  {}",
            o.target,
            runs,
            o.seconds,
            o.corpus,
            o.failure.as_deref().unwrap_or("no finding")
        );
    }
    let failed: Vec<&str> = outcomes
        .iter()
        .filter(|o| o.failure.is_some())
        .map(|o| o.target.as_str())
        .collect();
    if !failed.is_empty() {
        bail!(
            "fuzzing found inputs that fail: {} (see above)",
            failed.join(", ")
        );
    }
    Ok(())
}

fn files_in(dir: &Path) -> usize {
    std::fs::read_dir(dir).map_or(0, |d| d.count())
}

fn run_one(
    root: &Path,
    target_dir: &Path,
    bin_dir: &Path,
    target: &str,
    seconds: u64,
) -> Result<Outcome> {
    let bin = bin_dir.join(target);
    if !bin.is_file() {
        bail!(
            "cargo fuzz build succeeded but left no {} (the fuzz workspace's target directory is {})",
            bin.display(),
            target_dir.display()
        );
    }
    let seed = root.join("fuzz/corpus").join(target);
    // New inputs go here, not into the repository's seeds.
    let work: PathBuf = target_dir.join("corpus").join(target);
    let artifacts = root.join("fuzz/artifacts").join(target);
    for dir in [&work, &artifacts] {
        std::fs::create_dir_all(dir).with_context(|| format!("cannot create {}", dir.display()))?;
    }
    if files_in(&seed) == 0 {
        bail!(
            "no seed corpus in {} (cargo xtask fuzz seeds writes it)",
            seed.display()
        );
    }
    let args = [
        format!("-max_total_time={seconds}"),
        // An input that takes this long is a hang: a finding.
        "-timeout=10".to_owned(),
        "-rss_limit_mb=2048".to_owned(),
        "-print_final_stats=1".to_owned(),
        format!("-artifact_prefix={}/", artifacts.display()),
        work.display().to_string(),
        seed.display().to_string(),
    ];
    eprintln!("xtask: $ {} {}", bin.display(), args.join(" "));
    let started = Instant::now();
    let out = Command::new(&bin)
        .args(&args)
        .current_dir(root)
        .output()
        .with_context(|| format!("cannot run {}", bin.display()))?;
    let elapsed = started.elapsed().as_secs_f64();
    let log = String::from_utf8_lossy(&out.stderr);
    // "Done 75120 runs in 21 second(s)"; a failure instead reports "stat::number_of_executed_units".
    let runs = log
        .lines()
        .find_map(|l| l.strip_prefix("Done ")?.split(' ').next()?.parse().ok())
        .or_else(|| {
            log.lines().find_map(|l| {
                l.strip_prefix("stat::number_of_executed_units:")?
                    .trim()
                    .parse()
                    .ok()
            })
        });
    let failure = if out.status.success() {
        None
    } else {
        // Show what libFuzzer said about the finding (the tail holds the panic and the file).
        let tail: Vec<&str> = log.lines().rev().take(40).collect();
        for line in tail.iter().rev() {
            eprintln!("  {line}");
        }
        let artifact = log
            .lines()
            .find_map(|l| l.split("Test unit written to ").nth(1))
            .map(str::trim);
        Some(match artifact {
            Some(file) => format!("FOUND ({}); replay: {} {file}", out.status, bin.display()),
            None => format!("FAILED ({})", out.status),
        })
    };
    Ok(Outcome {
        target: target.to_owned(),
        runs,
        seconds: elapsed,
        corpus: files_in(&work) + files_in(&seed),
        failure,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every target in `fuzz/fuzz_targets/` is a binary of the fuzz workspace and in
    /// [`TARGETS`], so that `cargo xtask fuzz all` (and with it CI) runs every one, and has
    /// seeds.
    #[test]
    fn every_fuzz_target_is_listed_built_and_seeded() {
        let root = workspace_root();
        let mut files: Vec<String> = std::fs::read_dir(root.join("fuzz/fuzz_targets"))
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .filter_map(|f| f.strip_suffix(".rs").map(str::to_owned))
            .collect();
        files.sort();
        let mut listed: Vec<String> = all().into_iter().map(str::to_owned).collect();
        listed.sort();
        assert_eq!(files, listed, "fuzz/fuzz_targets/ against xtask's TARGETS");
        let manifest = std::fs::read_to_string(root.join("fuzz/Cargo.toml")).unwrap();
        for t in &listed {
            let bin = format!("name = \"{t}\"\npath = \"fuzz_targets/{t}.rs\"");
            assert!(
                manifest.contains(&bin),
                "fuzz/Cargo.toml has no [[bin]] {t}"
            );
            assert!(
                files_in(&root.join("fuzz/corpus").join(t)) > 0,
                "no seeds in fuzz/corpus/{t} (cargo xtask fuzz seeds)"
            );
        }
    }

    /// The bug this guards against: with `CARGO_TARGET_DIR` set, `cargo fuzz build` wrote the
    /// binaries there while xtask looked in `fuzz/target/`.
    #[test]
    fn cargo_target_dir_moves_the_fuzz_binaries() {
        let root = workspace_root();
        let elsewhere = std::env::temp_dir().join("tensorwire-xtask-target-dir-test");
        let mut cmd = metadata_command(&root);
        cmd.env("CARGO_TARGET_DIR", &elsewhere);
        assert_eq!(target_dir_of(cmd).unwrap(), elsewhere);

        let mut cmd = metadata_command(&root);
        cmd.env_remove("CARGO_TARGET_DIR");
        assert_eq!(target_dir_of(cmd).unwrap(), root.join("fuzz/target"));
    }
}
