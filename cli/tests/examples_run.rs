//! The examples in `examples/` work as their doc comments say, under `tensorwire launch`.

use std::path::PathBuf;
use std::process::Command;

/// `cargo test` (and nextest) build the examples next to the binary, in `examples/`.
fn example(name: &str) -> PathBuf {
    let bin = PathBuf::from(env!("CARGO_BIN_EXE_tensorwire"));
    let path = bin.parent().unwrap().join("examples").join(name);
    assert!(
        path.exists(),
        "{} was not built (cargo test builds examples)",
        path.display()
    );
    path
}

fn launch(nproc: &str, program: PathBuf) -> String {
    let out = Command::new(env!("CARGO_BIN_EXE_tensorwire"))
        .args(["launch", "--nproc", nproc, "--"])
        .arg(program)
        .env_remove("TENSORWIRE_SECRET")
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert_eq!(
        out.status.code(),
        Some(0),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    stdout
}

#[test]
fn ping() {
    let out = launch("2", example("ping"));
    assert!(out.contains("worker0 -> worker1: 1000 pings, p50"), "{out}");
    assert!(out.contains("worker1 -> worker0: 1000 pings, p50"), "{out}");
}

#[test]
fn parameter_server() {
    let out = launch("3", example("parameter_server"));
    assert!(
        out.contains("trainer1: final loss") && out.contains("trainer2: final loss"),
        "{out}"
    );
    let weights = out
        .lines()
        .find(|l| l.contains("weights after training"))
        .unwrap();
    assert!(
        weights.contains("0.9"),
        "the weights moved towards 1.0: {weights}"
    );
}

/// Started by hand, without `tensorwire launch`: a clean error naming the missing variable and
/// how to run it, exit code 1, no panic.
#[test]
fn examples_without_rank_say_which_variable_is_missing() {
    for name in ["ping", "parameter_server"] {
        let out = Command::new(example(name))
            .env_remove("RANK")
            .env_remove("SLURM_PROCID")
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{name}: {stderr}");
        assert!(stderr.contains("RANK"), "{name}: {stderr}");
        assert!(stderr.contains("tensorwire launch"), "{name}: {stderr}");
        assert!(!stderr.contains("panicked"), "{name}: {stderr}");
    }
}
