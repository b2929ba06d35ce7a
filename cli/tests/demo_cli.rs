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

/// Over QUIC with a certificate per rank from the launcher (`launch --quic-certs`): the workers
/// name themselves `ps` and `trainerN`, which no certificate names, and the agent takes each
/// rank-certified connection's own record.
#[test]
fn the_demo_trains_over_quic_with_rank_certificates() {
    let out = Command::new(env!("CARGO_BIN_EXE_tensorwire"))
        .args(["demo", "--quic", "--trainers", "2", "--steps", "2"])
        .env_remove("TENSORWIRE_SECRET")
        .env_remove("TENSORWIRE_TLS_DIR")
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(0), "{stdout}\n{stderr}");
    assert!(stdout.contains("training converged"), "{stdout}");
    assert_eq!(stdout.matches("step 2:").count(), 2, "{stdout}");
}

#[test]
fn bad_demo_arguments_exit_2() {
    let out = Command::new(env!("CARGO_BIN_EXE_tensorwire"))
        .args(["demo", "--trainers", "0"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
}

/// RUST_LOG reaches the demo's workers (every command sets up logging the same way).
#[test]
fn rust_log_shows_the_workers_logs() {
    let run = |log: Option<&str>| {
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_tensorwire"));
        cmd.args(["demo", "--trainers", "1", "--steps", "2"])
            .env_remove("TENSORWIRE_SECRET")
            .env_remove("RUST_LOG");
        if let Some(log) = log {
            cmd.env("RUST_LOG", log);
        }
        let out = cmd.output().unwrap();
        assert_eq!(out.status.code(), Some(0));
        String::from_utf8_lossy(&out.stderr).into_owned()
    };
    let logged = run(Some("tensorwire_store=info"));
    assert!(
        logged.contains("INFO") && logged.contains("store server listening"),
        "{logged}"
    );
    let quiet = run(None);
    assert!(!quiet.contains("store server listening"), "{quiet}");
}

/// `--help` documents the exit codes and RUST_LOG.
#[test]
fn help_documents_exit_codes() {
    let out = Command::new(env!("CARGO_BIN_EXE_tensorwire"))
        .arg("--help")
        .output()
        .unwrap();
    let help = String::from_utf8_lossy(&out.stdout);
    assert!(help.contains("Exit codes: 0 success; 1"), "{help}");
    assert!(help.contains("2 a usage"), "{help}");
    assert!(help.contains("RUST_LOG"), "{help}");
}
