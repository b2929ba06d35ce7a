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
}

/// `bench store`: the rendezvous of 200 clients from this process finishes and is reported.
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
            "--timeout",
            "60",
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
    }
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
