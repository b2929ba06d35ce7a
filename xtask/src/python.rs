//! The Python package's check (`python/`): builds the extension as a wheel with maturin (the
//! dev profile: CI time matters more than speed here), installs it into the Python that
//! `TENSORWIRE_PYTHON` names (one with torch, maturin and pytest, as `.ci/run` sets up), and
//! runs `pytest python/tests` there: real processes, compared with gloo in the same run.

use std::path::Path;

use anyhow::{bail, Context, Result};

use crate::{run, workspace_root};

/// Runs the Python tests, or says why they are skipped (no `TENSORWIRE_PYTHON`). With
/// `TENSORWIRE_REQUIRE_TORCH` set (as in CI), a missing Python is a failure.
pub(crate) fn check() -> Result<()> {
    let Some(python) = std::env::var("TENSORWIRE_PYTHON")
        .ok()
        .filter(|p| !p.is_empty())
    else {
        if std::env::var_os("TENSORWIRE_REQUIRE_TORCH").is_some() {
            bail!("TENSORWIRE_REQUIRE_TORCH is set but TENSORWIRE_PYTHON is not: the Python tests cannot run");
        }
        eprintln!("xtask: SKIPPED python tests (set TENSORWIRE_PYTHON to a Python with torch, maturin and pytest)");
        return Ok(());
    };
    let root = workspace_root();
    let target = std::env::var_os("CARGO_TARGET_DIR")
        .map(std::path::PathBuf::from)
        .unwrap_or_else(|| root.join("target"));
    let wheels = target.join("python-wheels");
    if wheels.exists() {
        std::fs::remove_dir_all(&wheels)
            .with_context(|| format!("removing {}", wheels.display()))?;
    }
    let out = wheels
        .to_str()
        .context("the target directory's path is not UTF-8")?;
    run(
        &python,
        &[
            "-m",
            "maturin",
            "build",
            "--profile",
            "dev",
            "-m",
            "python/Cargo.toml",
            "-o",
            out,
            "--interpreter",
            &python,
        ],
        &[],
    )?;
    let wheel = only_wheel(&wheels)?;
    run(
        &python,
        &[
            "-m",
            "pip",
            "install",
            "--quiet",
            "--force-reinstall",
            "--no-deps",
            &wheel,
        ],
        &[],
    )?;
    // Run from the tests' folder so that the installed wheel, not python/tensorwire, is imported.
    run(
        &python,
        &[
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "--rootdir",
            "python",
            "python/tests",
        ],
        &[],
    )
}

fn only_wheel(dir: &Path) -> Result<String> {
    let wheels: Vec<_> = std::fs::read_dir(dir)?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "whl"))
        .collect();
    match wheels.as_slice() {
        [one] => Ok(one.to_string_lossy().into_owned()),
        other => bail!("expected one wheel in {}, found {other:?}", dir.display()),
    }
}
