//! `tensorwire validate` agrees with PyTorch's own device-map rules on many generated plans.
//!
//! Runs `tests/pytorch/diff_validate.py`, which uses the installed torch when it can
//! (`TENSORWIRE_PYTHON` picks the interpreter, default `python3`) and otherwise PyTorch's
//! functions from `shared/reference/seeds`. Skips, saying why, when neither is available.

use std::process::Command;

#[test]
fn validate_agrees_with_pytorch() {
    let python = std::env::var("TENSORWIRE_PYTHON").unwrap_or_else(|_| "python3".into());
    let script = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../tests/pytorch/diff_validate.py"
    );
    let out = match Command::new(&python)
        .args([script, env!("CARGO_BIN_EXE_tensorwire"), "--plans", "1000"])
        .output()
    {
        Ok(out) => out,
        Err(e) => {
            println!("SKIPPED: cannot run {python}: {e}");
            return;
        }
    };
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    match out.status.code() {
        Some(0) => println!("{stdout}"),
        Some(77) => println!("SKIPPED: {stdout}"),
        _ => panic!(
            "differential check failed ({}):\n{stdout}\n{stderr}",
            out.status
        ),
    }
}
