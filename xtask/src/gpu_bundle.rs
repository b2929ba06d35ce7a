//! `cargo xtask gpu-bundle [--out DIR] [--run]`: every GPU check, built here in release, in one
//! folder a GPU machine runs with one script.
//!
//! The folder (default `.gpu-bundle/` at the workspace root, git-ignored) holds, stripped:
//!
//! - `bin/`: `tw-gpu-check` (the backend alone, 1-rank NCCL), `tw-gpu-suite` (same-host CUDA
//!   IPC against the staged path, `remote()` with CUDA tensors, the benches, the NCCL timeout
//!   abort and async error), `tw-rpc-worker` and `tw-autograd-worker` (the workers of the
//!   multi-process tests), `tw-pg-worker` (the `nccl` group, every collective) and
//!   `tensorwire` (whose `launch` starts the ranks);
//! - `tests/`: the test executables whose `::cuda` tests run there (`rpc_processes`,
//!   `autograd_processes` of `tensorwire-tests`, `rpc_agent` = `agent` of `tensorwire-rpc`),
//!   finding their workers through `TW_BIN_DIR`;
//! - `run.sh`, `torch_allreduce.py` and `ipc_costs.py` (from `xtask/gpu-bundle/`), `README.txt`.
//!
//! `bin/` and `tests/` travel as `payload.tar.gz` (stripped binaries shrink about threefold),
//! which `run.sh` unpacks into a temporary folder.
//!
//! The packages, binaries and tests are named in [`BINS`] and [`TESTS`] by package and target
//! name only, so that moving code between crates changes one line here. The whole folder must
//! stay under [`MAX_BYTES`] (what travels to a device machine with the working tree). `--run`
//! runs the script here afterwards (without a GPU every check skips with its reason).

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{bail, Context, Result};

use crate::{run, workspace_root};

/// (package, binary) built with [`FEATURES`].
pub(crate) const BINS: &[(&str, &str)] = &[
    ("tensorwire-tests", "tw-gpu-check"),
    ("tensorwire-tests", "tw-gpu-suite"),
    ("tensorwire-tests", "tw-rpc-worker"),
    ("tensorwire-tests", "tw-autograd-worker"),
    ("tensorwire-process-group", "tw-pg-worker"),
    ("tensorwire-cli", "tensorwire"),
];

/// (package, integration test target, name in the bundle).
pub(crate) const TESTS: &[(&str, &str, &str)] = &[
    ("tensorwire-tests", "rpc_processes", "rpc_processes"),
    (
        "tensorwire-tests",
        "autograd_processes",
        "autograd_processes",
    ),
    ("tensorwire-rpc", "agent", "rpc_agent"),
];

/// The features of one build of everything: NCCL in the checks and the `nccl` group, CUDA as
/// the agent's default backend.
pub(crate) const FEATURES: &str =
    "tensorwire-tests/nccl,tensorwire-process-group/nccl,tensorwire-rpc/cuda";

/// The bundle's limit: what travels with the working tree to a device machine.
pub(crate) const MAX_BYTES: u64 = 64 << 20;

const RUN_SH: &str = include_str!("../gpu-bundle/run.sh");
const TORCH_PY: &str = include_str!("../gpu-bundle/torch_allreduce.py");
const IPC_COSTS_PY: &str = include_str!("../gpu-bundle/ipc_costs.py");

fn usage() -> anyhow::Error {
    anyhow::anyhow!("usage: cargo xtask gpu-bundle [--out DIR] [--run]")
}

pub(crate) fn gpu_bundle(args: &[String]) -> Result<()> {
    let root = workspace_root();
    let mut out = root.join(".gpu-bundle");
    let mut run_here = false;
    let mut rest = args.iter();
    while let Some(arg) = rest.next() {
        match arg.as_str() {
            "--out" => out = PathBuf::from(rest.next().ok_or_else(usage)?),
            "--run" => run_here = true,
            _ => return Err(usage()),
        }
    }
    let packages = packages();
    // The binaries, in one build.
    let mut build = vec!["build", "--release"];
    for p in &packages {
        build.extend(["-p", p]);
    }
    build.extend(["--features", FEATURES]);
    for (_, bin) in BINS {
        build.extend(["--bin", bin]);
    }
    run("cargo", &build, &[])?;
    let tests = build_tests(&packages)?;

    if out.exists() {
        std::fs::remove_dir_all(&out).with_context(|| format!("cannot clear {}", out.display()))?;
    }
    for sub in ["bin", "tests"] {
        std::fs::create_dir_all(out.join(sub))
            .with_context(|| format!("cannot create {}", out.display()))?;
    }
    let target = std::env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| root.join("target"));
    for (_, bin) in BINS {
        copy_stripped(
            &target.join("release").join(bin),
            &out.join("bin").join(bin),
        )?;
    }
    for (name, exe) in &tests {
        copy_stripped(exe, &out.join("tests").join(name))?;
    }
    // Stripped Rust binaries shrink about threefold in gzip: they travel as one archive that
    // run.sh unpacks into a temporary folder (gzip is on every machine).
    run_in(&out, "tar", &["-czf", "payload.tar.gz", "bin", "tests"])?;
    for sub in ["bin", "tests"] {
        std::fs::remove_dir_all(out.join(sub))?;
    }
    write(&out.join("run.sh"), RUN_SH, true)?;
    write(&out.join("torch_allreduce.py"), TORCH_PY, false)?;
    write(&out.join("ipc_costs.py"), IPC_COSTS_PY, false)?;
    write(&out.join("README.txt"), &readme(&out), false)?;

    let (bytes, sizes) = folder_size(&out)?;
    for (path, size) in &sizes {
        eprintln!(
            "xtask:   {:>6.1} MiB  {path}",
            *size as f64 / (1 << 20) as f64
        );
    }
    eprintln!(
        "xtask: bundle {} is {:.1} MiB (limit {} MiB)",
        out.display(),
        bytes as f64 / (1 << 20) as f64,
        MAX_BYTES >> 20
    );
    if bytes >= MAX_BYTES {
        bail!(
            "the bundle is {bytes} bytes, over the {MAX_BYTES} bytes a device machine takes with \
             the working tree"
        );
    }
    eprintln!("{}", readme(&out));
    if run_here {
        let script = out.join("run.sh");
        let status = Command::new("bash")
            .arg(&script)
            .arg(&out)
            .status()
            .context("cannot start bash")?;
        if !status.success() {
            bail!("{} failed ({status})", script.display());
        }
    }
    Ok(())
}

/// The packages named in [`BINS`] and [`TESTS`], once each.
fn packages() -> Vec<&'static str> {
    let mut out: Vec<&str> = BINS
        .iter()
        .map(|(p, _)| *p)
        .chain(TESTS.iter().map(|(p, _, _)| *p))
        .collect();
    out.sort_unstable();
    out.dedup();
    out
}

/// Builds the test executables and returns (name in the bundle, path) for each.
fn build_tests(packages: &[&str]) -> Result<Vec<(String, PathBuf)>> {
    let mut args = vec!["test", "--release", "--no-run", "--message-format=json"];
    for p in packages {
        args.extend(["-p", p]);
    }
    args.extend(["--features", FEATURES]);
    for (_, test, _) in TESTS {
        args.extend(["--test", test]);
    }
    eprintln!("xtask: $ cargo {}", args.join(" "));
    let output = Command::new("cargo")
        .args(&args)
        .current_dir(workspace_root())
        .stderr(std::process::Stdio::inherit())
        .output()
        .context("could not start `cargo test --no-run`")?;
    if !output.status.success() {
        bail!("`cargo {}` failed", args.join(" "));
    }
    let mut found = Vec::new();
    for line in String::from_utf8_lossy(&output.stdout).lines() {
        let Ok(msg) = serde_json::from_str::<serde_json::Value>(line) else {
            continue;
        };
        let (Some(exe), Some(name), Some(package)) = (
            msg["executable"].as_str(),
            msg["target"]["name"].as_str(),
            msg["package_id"].as_str(),
        ) else {
            continue;
        };
        if !msg["target"]["kind"]
            .as_array()
            .is_some_and(|k| k.iter().any(|k| k == "test"))
        {
            continue;
        }
        if let Some((_, _, bundled)) = TESTS
            .iter()
            .find(|(p, t, _)| *t == name && package_matches(package, p))
        {
            found.push((bundled.to_string(), PathBuf::from(exe)));
        }
    }
    for (p, t, _) in TESTS {
        if !found
            .iter()
            .any(|(n, _)| TESTS.iter().any(|(p2, t2, b)| b == n && p2 == p && t2 == t))
        {
            bail!("cargo built no test executable for {p} --test {t}");
        }
    }
    Ok(found)
}

/// Whether a cargo package id (`path+file:///.../rpc#tensorwire-rpc@0.1.0` or the older
/// `tensorwire-rpc 0.1.0 (path+...)`) names `package`.
fn package_matches(id: &str, package: &str) -> bool {
    id.starts_with(&format!("{package} "))
        || id.contains(&format!("#{package}@"))
        || id
            .rsplit('/')
            .next()
            .is_some_and(|last| last.split('#').next() == Some(package) && !last.contains('@'))
}

/// Runs `program` in `dir`, failing with its command line if it fails.
fn run_in(dir: &Path, program: &str, args: &[&str]) -> Result<()> {
    let status = Command::new(program)
        .args(args)
        .current_dir(dir)
        .status()
        .with_context(|| format!("could not start {program}"))?;
    if !status.success() {
        bail!(
            "`{program} {}` in {} failed ({status})",
            args.join(" "),
            dir.display()
        );
    }
    Ok(())
}

fn copy_stripped(from: &Path, to: &Path) -> Result<()> {
    std::fs::copy(from, to)
        .with_context(|| format!("cannot copy {} to {}", from.display(), to.display()))?;
    let stripped = Command::new("strip").arg(to).status();
    if !stripped.is_ok_and(|s| s.success()) {
        bail!("`strip {}` failed: the bundle must be small", to.display());
    }
    Ok(())
}

fn write(path: &Path, text: &str, executable: bool) -> Result<()> {
    std::fs::write(path, text).with_context(|| format!("cannot write {}", path.display()))?;
    #[cfg(unix)]
    if executable {
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o755))?;
    }
    #[cfg(not(unix))]
    let _ = executable;
    Ok(())
}

/// Bytes under `dir`, and each file's (relative path, bytes).
fn folder_size(dir: &Path) -> Result<(u64, Vec<(String, u64)>)> {
    let mut total = 0;
    let mut files = Vec::new();
    let mut todo = vec![dir.to_path_buf()];
    while let Some(d) = todo.pop() {
        for entry in std::fs::read_dir(&d)? {
            let entry = entry?;
            let meta = entry.metadata()?;
            if meta.is_dir() {
                todo.push(entry.path());
            } else {
                total += meta.len();
                let rel = entry.path().strip_prefix(dir)?.display().to_string();
                files.push((rel, meta.len()));
            }
        }
    }
    files.sort();
    Ok((total, files))
}

fn readme(out: &Path) -> String {
    let glibc = Command::new("ldd")
        .arg("--version")
        .output()
        .ok()
        .and_then(|o| String::from_utf8(o.stdout).ok())
        .and_then(|s| s.lines().next().map(str::to_owned))
        .unwrap_or_else(|| "unknown".into());
    let commit = Command::new("git")
        .args(["rev-parse", "--short", "HEAD"])
        .current_dir(workspace_root())
        .output()
        .ok()
        .and_then(|o| String::from_utf8(o.stdout).ok())
        .map(|s| s.trim().to_owned())
        .unwrap_or_default();
    let dir = out
        .strip_prefix(workspace_root())
        .unwrap_or(out)
        .display()
        .to_string();
    format!(
        "tensorwire GPU bundle (commit {commit}; built against {glibc}: the machine needs a \
         glibc at least as new)\n\
         \n\
         Run every GPU check and bench (8 minutes at most; REPORT_DIR defaults to $OUT, else\n\
         this folder):\n\
         \x20   bash {dir}/run.sh [REPORT_DIR]\n\
         It prints PASS / FAIL / SKIP (with the reason) per check, `N passed, N failed, N\n\
         skipped`, and writes REPORT_DIR/gpu-report.json (every check with its figures, and the\n\
         ratios: IPC and staged RPC of 256 MiB against a device memcpy, small-call latency with a\n\
         CUDA tensor against a CPU one, NCCL all_reduce of 256 MiB against torch.distributed)\n\
         and REPORT_DIR/gpu-log.txt.\n\
         \n\
         With the `device` tool: run(command=\"bash {dir}/run.sh $OUT\", carry=[\"{dir}\"],\n\
         timeout_s=540). It needs the CUDA driver (libcuda.so.1), NCCL from the Python package\n\
         nvidia-nccl-cu13 (or -cu12) for the nccl checks, and PyTorch for the torch baseline;\n\
         whatever is missing makes its checks skip, saying why.\n"
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn package_ids_of_both_cargo_formats_match() {
        assert!(package_matches(
            "path+file:///w/rpc#tensorwire-rpc@0.1.0",
            "tensorwire-rpc"
        ));
        assert!(package_matches(
            "tensorwire-rpc 0.1.0 (path+file:///w/rpc)",
            "tensorwire-rpc"
        ));
        assert!(package_matches(
            "path+file:///w/tensorwire-rpc#0.1.0",
            "tensorwire-rpc"
        ));
        assert!(!package_matches(
            "path+file:///w/tests#tensorwire-tests@0.1.0",
            "tensorwire-rpc"
        ));
    }

    #[test]
    fn every_bundled_test_has_its_own_name_and_the_script_runs_them() {
        let mut names: Vec<_> = TESTS.iter().map(|(_, _, n)| *n).collect();
        names.dedup();
        assert_eq!(names.len(), TESTS.len());
        for (_, _, n) in TESTS {
            assert!(
                RUN_SH.contains(&format!("$ROOT/tests/{n}")),
                "run.sh does not run {n}"
            );
        }
        for (_, bin) in BINS {
            assert!(
                RUN_SH.contains(&format!("$BIN/{bin}")),
                "run.sh does not run {bin}"
            );
        }
    }
}
