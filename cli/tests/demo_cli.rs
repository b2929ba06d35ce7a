//! `tensorwire demo`, the README's main command, runs as written: real processes on loopback.

use std::process::Command;

#[test]
fn the_demo_trains_and_exits_0() {
    let out = Command::new(env!("CARGO_BIN_EXE_tensorwire"))
        .args(["demo", "--trainers", "2", "--steps", "3"])
        .env_remove("TENSORWIRE_SECRET")
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(0), "{stdout}\n{stderr}");
    assert!(stdout.contains("training converged"), "{stdout}");
    assert!(
        stdout.contains("weights arrived on cuda:0, gradient sent from cuda:0 landed on ps:cuda:1"),
        "{stdout}"
    );
    assert!(
        stdout.contains("devices by worker (all_gather): ps: [\"cuda:1\"]"),
        "{stdout}"
    );
    assert_eq!(stdout.matches("step 3:").count(), 2, "{stdout}");
}

#[test]
fn bad_demo_arguments_exit_2() {
    let out = Command::new(env!("CARGO_BIN_EXE_tensorwire"))
        .args(["demo", "--trainers", "0"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
}
