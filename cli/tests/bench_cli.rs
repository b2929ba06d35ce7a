//! `tensorwire bench transport`: the JSON keys the issue asks for, and a clear error for a
//! transport that is not built in.

use std::process::Command;

#[test]
fn bench_transport_tcp_writes_every_key() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let file = dir.join("bench.json");
    let out = Command::new(env!("CARGO_BIN_EXE_tensorwire"))
        .args(["bench", "transport", "--transport", "tcp", "--json"])
        .arg(&file)
        .args(["--pingpong", "200", "--bulk-64mib", "1", "--bulk-1mib", "2"])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: serde_json::Value = serde_json::from_slice(&std::fs::read(&file).unwrap()).unwrap();
    assert_eq!(v["transport"], "tcp");
    for key in [
        "raw_tcp_pingpong_p50_us",
        "raw_tcp_bulk_64MiB_MBps",
        "frame_pingpong_p50_us",
        "frame_pingpong_p99_us",
        "frame_bulk_1MiB_MBps",
        "frame_bulk_64MiB_MBps",
    ] {
        let x = v[key]
            .as_f64()
            .unwrap_or_else(|| panic!("{key} missing in {v}"));
        assert!(x > 0.0 && x.is_finite(), "{key} = {x}");
    }
    for ratio in ["pingpong_p50", "bulk_1MiB", "bulk_64MiB"] {
        let x = v["ratios"][ratio]
            .as_f64()
            .unwrap_or_else(|| panic!("ratio {ratio} missing"));
        assert!(x > 0.0 && x.is_finite(), "{ratio} = {x}");
    }
}

#[cfg(not(feature = "quic"))]
#[test]
fn bench_transport_quic_says_it_is_not_built_in() {
    let out = Command::new(env!("CARGO_BIN_EXE_tensorwire"))
        .args(["bench", "transport", "--transport", "quic"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("QUIC not built in"), "{err}");
}

#[test]
fn bench_rpc_writes_every_key() {
    bench_rpc_over("tcp");
}

/// The agent over shared memory (`--transport shm`), against the same raw TCP baseline.
#[test]
fn bench_rpc_over_shared_memory_writes_every_key() {
    bench_rpc_over("shm");
}

fn bench_rpc_over(transport: &str) {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let json = dir.join("rpc.json");
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_tensorwire"))
        .args([
            "bench",
            "rpc",
            "--calls",
            "100",
            "--async-calls",
            "500",
            "--in-flight",
            "50",
            "--tensor-64mib",
            "1",
            "--transport",
            transport,
            "--json",
        ])
        .arg(&json)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    for key in [
        "rpc_sync_p50_us",
        "rpc_sync_p99_us",
        "rpc_async_calls_per_s",
        "rpc_tensor_1MiB_MBps",
        "rpc_tensor_64MiB_MBps",
        "remote_to_here_p50_us",
        "raw_tcp_pingpong_p50_us",
        "raw_tcp_bulk_64MiB_MBps",
    ] {
        let x = v[key]
            .as_f64()
            .unwrap_or_else(|| panic!("{key} missing: {v}"));
        assert!(x.is_finite() && x > 0.0, "{key} = {x}");
    }
    assert!(
        v["ratios"]["rpc_sync_p50_over_raw_pingpong_p50"]
            .as_f64()
            .unwrap()
            > 0.0
    );
    assert_eq!(v["transport"], transport);
    assert_eq!(v["raw_baseline"], "process");
    // Over shared memory, the same-host floor of the same run, with its ratio and the target.
    if transport == "shm" {
        for key in ["raw_shm_pingpong_p50_us", "raw_shm_pingpong_p99_us"] {
            let x = v[key]
                .as_f64()
                .unwrap_or_else(|| panic!("{key} missing: {v}"));
            assert!(x.is_finite() && x > 0.0, "{key} = {x}");
        }
        let r = v["ratios"]["rpc_sync_p50_over_raw_shm_pingpong_p50"]
            .as_f64()
            .unwrap_or_else(|| panic!("the shm ratio is missing: {v}"));
        assert!(r.is_finite() && r > 0.0, "{r}");
        assert!(v["targets"]["shm: rpc_sync p50 <= 2x raw shm ping-pong"].is_boolean());
        let text = String::from_utf8_lossy(&out.stderr);
        assert!(text.contains("x raw shm ping-pong"), "{text}");
    } else {
        assert!(v.get("raw_shm_pingpong_p50_us").is_none(), "{v}");
    }
}

/// `bench store`: the rendezvous of 200 clients from this process finishes and is reported,
/// for our server and a baseline server in the same run.
#[test]
fn bench_store_reports_the_rendezvous() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let json = dir.join("store.json");
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_tensorwire"))
        .args([
            "bench",
            "store",
            "--clients",
            "1,200",
            "--rounds",
            "2",
            "--timeout",
            "60",
            "--baseline",
            env!("CARGO_BIN_EXE_tensorwire"),
            "--json",
        ])
        .arg(&json)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    for n in [1, 200] {
        let s = v[format!("clients_{n}")]["rendezvous_s"]
            .as_f64()
            .unwrap_or_else(|| panic!("clients_{n} missing: {v}"));
        assert!(s.is_finite() && s > 0.0, "{n}: {s}");
        // The baseline server (here the same binary) ran the same load in the same run.
        let base = v[format!("clients_{n}")]["baseline_rendezvous_s"]
            .as_f64()
            .unwrap_or_else(|| panic!("clients_{n} has no baseline: {v}"));
        let ratio = v[format!("clients_{n}")]["rendezvous_over_baseline"]
            .as_f64()
            .unwrap();
        assert!((ratio - s / base).abs() < 1e-9, "{n}: {v}");
    }
    assert_eq!(v["settings"]["rounds"], 2, "{v}");
}

#[cfg(feature = "quic")]
#[test]
fn bench_transport_quic_writes_every_key() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let json = dir.join("quic.json");
    let out = Command::new(env!("CARGO_BIN_EXE_tensorwire"))
        .args([
            "bench",
            "transport",
            "--transport",
            "quic",
            "--pingpong",
            "200",
            "--bulk-64mib",
            "1",
            "--bulk-1mib",
            "5",
            "--json",
        ])
        .arg(&json)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    assert_eq!(v["transport"], "quic");
    for key in [
        "frame_pingpong_p50_us",
        "frame_bulk_64MiB_MBps",
        "raw_tcp_pingpong_p50_us",
        "raw_tcp_bulk_64MiB_MBps",
    ] {
        let x = v[key]
            .as_f64()
            .unwrap_or_else(|| panic!("{key} missing: {v}"));
        assert!(x.is_finite() && x > 0.0, "{key} = {x}");
    }
}

/// `bench rpc --sync-only`: the run to profile measures `rpc_sync` and its raw baselines only.
#[test]
fn bench_rpc_sync_only_measures_rpc_sync_alone() {
    let tmp = tempfile::tempdir().unwrap();
    let json = tmp.path().join("rpc.json");
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_tensorwire"))
        .args([
            "bench",
            "rpc",
            "--calls",
            "100",
            "--sync-only",
            "--idle-ms",
            "0",
        ])
        .args(["--transport", "shm", "--json"])
        .arg(&json)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    for key in [
        "rpc_sync_p50_us",
        "raw_tcp_pingpong_p50_us",
        "raw_shm_pingpong_p50_us",
    ] {
        assert!(v[key].as_f64().is_some_and(|x| x > 0.0), "{key}: {v}");
    }
    for key in [
        "rpc_async_calls_per_s",
        "remote_to_here_p50_us",
        "idle_cpu_us_per_s_caller",
    ] {
        assert!(v.get(key).is_none(), "{key} measured: {v}");
    }
}

/// The hidden raw shared-memory echo refuses a descriptor that is not its page, as a usage
/// error naming it, instead of mapping or polling anything.
#[test]
fn the_raw_shm_echo_names_a_bad_descriptor() {
    for (fd, says) in [("-1", "not a file descriptor"), ("0", "--fd 0")] {
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_tensorwire"))
            .args(["bench", "raw-shm-echo", &format!("--fd={fd}")])
            .stdin(std::process::Stdio::null())
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "fd {fd}: {err}");
        assert!(err.contains(says), "fd {fd}: {err}");
    }
}
