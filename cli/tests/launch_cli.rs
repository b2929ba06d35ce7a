//! `tensorwire launch` with real processes: environment, failure propagation, bad arguments.

use std::process::Command;
use std::time::{Duration, Instant};

fn launch(args: &[&str]) -> (Option<i32>, String, String, Duration) {
    let start = Instant::now();
    let out = Command::new(env!("CARGO_BIN_EXE_tensorwire"))
        .arg("launch")
        .args(args)
        .env_remove("TENSORWIRE_SECRET")
        .output()
        .unwrap();
    (
        out.status.code(),
        String::from_utf8(out.stdout).unwrap(),
        String::from_utf8(out.stderr).unwrap(),
        start.elapsed(),
    )
}

#[test]
fn every_worker_gets_its_rendezvous_variables() {
    let (code, out, err, _) = launch(&[
        "--nproc",
        "4",
        "--",
        "sh",
        "-c",
        "echo rank=$RANK local=$LOCAL_RANK world=$WORLD_SIZE addr=$MASTER_ADDR port=$MASTER_PORT secret=${#TENSORWIRE_SECRET}",
    ]);
    assert_eq!(code, Some(0), "{err}");
    let mut lines: Vec<&str> = out.lines().collect();
    lines.sort_unstable();
    assert_eq!(lines.len(), 4, "{out}");
    let port = lines[0]
        .split("port=")
        .nth(1)
        .unwrap()
        .split(' ')
        .next()
        .unwrap()
        .to_owned();
    assert!(port.parse::<u16>().unwrap() > 0);
    for (r, line) in lines.iter().enumerate() {
        assert_eq!(
            *line,
            format!("[rank {r}] rank={r} local={r} world=4 addr=127.0.0.1 port={port} secret=64")
        );
    }
}

/// `--quic-certs`: each worker's folder holds the CA certificate and its own rank's certificate
/// and key, never the CA key nor another rank's key; the CA stays where it was; the folders are
/// gone once the launcher exits.
#[test]
fn quic_certs_give_each_worker_its_own_rank_certificate_and_never_the_ca_key() {
    let ca = tempfile::tempdir().unwrap();
    let ca_dir = ca.path().to_str().unwrap();
    let (code, out, err, _) = launch(&[
        "--nproc",
        "3",
        "--quic-certs",
        ca_dir,
        "--",
        "sh",
        "-c",
        "echo dir=$TENSORWIRE_TLS_DIR files=$(ls $TENSORWIRE_TLS_DIR | tr '\\n' ,) \
         ca=$(grep -c 'BEGIN CERTIFICATE' $TENSORWIRE_TLS_DIR/ca.pem)",
    ]);
    assert_eq!(code, Some(0), "{err}");
    let mut lines: Vec<&str> = out.lines().collect();
    lines.sort_unstable();
    assert_eq!(lines.len(), 3, "{out}");
    for (r, line) in lines.iter().enumerate() {
        assert!(
            line.ends_with(&format!("files=ca.pem,rank-{r}.key.pem,rank-{r}.pem, ca=1")),
            "{line}"
        );
        let dir = line
            .split("dir=")
            .nth(1)
            .unwrap()
            .split(' ')
            .next()
            .unwrap();
        assert!(dir.ends_with(&format!("rank-{r}")), "{dir}");
        assert!(
            !std::path::Path::new(dir).exists(),
            "{dir} outlived the launcher"
        );
    }
    assert!(ca.path().join("ca.key.pem").exists());
    assert!(ca.path().join("ca.pem").exists());
}

#[test]
fn insecure_passes_no_secret_and_warns() {
    let (code, out, err, _) = launch(&[
        "--nproc",
        "1",
        "--insecure",
        "--no-prefix",
        "--",
        "sh",
        "-c",
        "echo ${TENSORWIRE_SECRET:-none} $TENSORWIRE_INSECURE",
    ]);
    assert_eq!((code, out.as_str()), (Some(0), "none 1\n"));
    assert!(
        err.contains("warning: --insecure") && err.contains("trusted network"),
        "{err}"
    );
}

#[test]
fn a_failing_worker_stops_the_others_and_sets_the_exit_code() {
    let (code, _, err, took) = launch(&[
        "--nproc",
        "3",
        "--grace",
        "1",
        "--",
        "sh",
        "-c",
        "if [ $RANK = 2 ]; then sleep 0.3; exit 7; fi; trap '' TERM; sleep 60",
    ]);
    assert_eq!(code, Some(7), "{err}");
    assert!(err.contains("rank 2 exited with code 7"), "{err}");
    assert!(took < Duration::from_secs(20), "took {took:?}");
}

#[test]
fn a_killed_worker_reports_its_signal() {
    let (code, _, err, took) = launch(&[
        "--nproc",
        "2",
        "--",
        "sh",
        "-c",
        "if [ $RANK = 0 ]; then kill -9 $$; fi; sleep 60",
    ]);
    assert_eq!(code, Some(128 + 9), "{err}");
    assert!(err.contains("rank 0 was killed by signal 9"), "{err}");
    assert!(took < Duration::from_secs(20), "took {took:?}");
}

#[test]
fn bad_arguments_exit_2_with_a_message() {
    let (code, _, err, _) = launch(&["--nproc", "0", "--", "true"]);
    assert_eq!(code, Some(2));
    assert!(err.contains("--nproc"), "{err}");
    let (code, _, err, _) = launch(&["--nproc", "2"]);
    assert_eq!(code, Some(2));
    assert!(err.contains("COMMAND"), "{err}");
    let (code, _, err, _) = launch(&["--nproc", "2", "--", "/no/such/program"]);
    assert_eq!(code, Some(2));
    assert!(err.contains("cannot start \"/no/such/program\""), "{err}");
    let (code, _, err, _) = launch(&[
        "--nproc",
        "1",
        "--secret-file",
        "/no/such/secret",
        "--",
        "true",
    ]);
    assert_eq!(code, Some(2));
    assert!(err.contains("/no/such/secret"), "{err}");
}
