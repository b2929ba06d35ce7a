//! `tensorwire demo autograd --json`: three real processes train a split model with
//! distributed autograd; the output is one JSON object with the figures.
#![cfg(feature = "autograd-candle")]

use std::process::Command;

#[test]
fn the_autograd_demo_matches_one_process_and_learns() {
    let out = Command::new(env!("CARGO_BIN_EXE_tensorwire"))
        .args(["demo", "autograd", "--json", "--steps", "4"])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    let stdout = String::from_utf8(out.stdout).unwrap();
    let v: serde_json::Value = serde_json::from_str(stdout.trim())
        .unwrap_or_else(|e| panic!("not one JSON object ({e}): {stdout}"));
    for key in [
        "workers",
        "steps",
        "max_abs_grad_diff_vs_local",
        "loss_first",
        "loss_last",
        "dist_backward_over_local_backward",
    ] {
        assert!(v.get(key).is_some(), "no {key} in {v}");
    }
    assert_eq!(
        (v["workers"].as_u64(), v["steps"].as_u64()),
        (Some(3), Some(4))
    );
    let f = |k: &str| v[k].as_f64().unwrap();
    assert!(f("max_abs_grad_diff_vs_local") <= 1e-5, "{v}");
    assert!(f("loss_last") < f("loss_first"), "{v}");
    assert!(f("dist_backward_over_local_backward") > 0.0, "{v}");
}
