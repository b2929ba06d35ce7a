//! `tensorwire bench curve ...` at tiny sizes: each curve runs its processes, writes the JSON
//! the guide describes (one point per x, each with its raw baseline and a ratio) and a PNG.
//! Timings are not checked, only that they are there and positive.

use serde_json::Value;

/// Runs `bench curve ARGS --json .. --png ..`, checks the common shape and returns the JSON.
fn curve(name: &str, args: &[&str]) -> Value {
    let tmp = tempfile::tempdir().unwrap();
    let json = tmp.path().join("curve.json");
    let png = tmp.path().join("curve.png");
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_tensorwire"))
        .args(["bench", "curve", name])
        .args(args)
        .args(["--timeout", "60", "--json"])
        .arg(&json)
        .arg("--png")
        .arg(&png)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: Value = serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    assert_eq!(v["curve"], name);
    assert_eq!(v["png"], png.display().to_string());
    for key in ["x", "ratio_is", "raw_baseline"] {
        assert!(v[key].is_string(), "{key} missing: {v}");
    }
    let png_bytes = std::fs::read(&png).unwrap();
    assert_eq!(&png_bytes[..8], b"\x89PNG\r\n\x1a\n", "not a PNG");
    assert!(png_bytes.len() > 1000, "an empty plot");
    for p in v["points"]
        .as_array()
        .unwrap_or_else(|| panic!("no points: {v}"))
    {
        assert!(p["x"].as_f64().is_some(), "a point without x: {p}");
        let r = p["ratio"].as_f64().unwrap_or(f64::NAN);
        assert!(r.is_finite() && r > 0.0, "ratio {r} in {p}");
    }
    v
}

/// The finite, positive numbers `fields` of every point.
fn positive(v: &Value, fields: &[&str]) {
    for p in v["points"].as_array().unwrap() {
        for f in fields {
            let x = p[f].as_f64().unwrap_or(f64::NAN);
            assert!(x.is_finite() && x > 0.0, "{f} = {x} in {p}");
        }
    }
}

fn xs(v: &Value) -> Vec<u64> {
    v["points"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| p["x"].as_u64().unwrap())
        .collect()
}

#[test]
fn rrefs_curve_has_a_point_per_count() {
    let v = curve("rrefs", &["--counts", "50,0", "--calls", "20"]);
    assert_eq!(xs(&v), [0, 50], "sorted counts: {v}");
    positive(&v, &["rpc_sync_p50_us", "raw_tcp_pingpong_p50_us"]);
}

#[test]
fn peers_curve_has_latency_and_rate_per_world() {
    let v = curve(
        "peers",
        &[
            "--world",
            "2,3",
            "--calls",
            "20",
            "--async-calls",
            "30",
            "--in-flight",
            "4",
        ],
    );
    assert_eq!(xs(&v), [1, 2]);
    positive(
        &v,
        &[
            "rpc_sync_p50_us",
            "raw_tcp_pingpong_p50_us",
            "rpc_async_calls_per_s",
            "calls_per_s_over_first",
        ],
    );
}

#[test]
fn init_curve_times_each_world_against_the_raw_rendezvous() {
    let v = curve("init", &["--world", "2,3"]);
    assert_eq!(xs(&v), [2, 3]);
    positive(
        &v,
        &["init_wall_ms", "init_rpc_rank0_ms", "raw_rendezvous_ms"],
    );
}

#[test]
fn payload_curve_covers_both_transports_and_marks_their_switches() {
    let v = curve("payload", &["--sizes", "8,4096", "--rounds", "3"]);
    let points = v["points"].as_array().unwrap();
    for t in ["tcp", "shm"] {
        let sizes: Vec<u64> = points
            .iter()
            .filter(|p| p["transport"] == t)
            .map(|p| p["bytes"].as_u64().unwrap())
            .collect();
        assert_eq!(sizes, [8, 4096], "{t}: {v}");
    }
    positive(&v, &["rpc_MBps", "raw_tcp_MBps", "memcpy_MBps"]);
    let switches = v["strategy_switches"].as_array().unwrap();
    for t in ["tcp", "shm"] {
        assert!(
            switches
                .iter()
                .any(|s| s["transport"] == t && s["bytes"].as_u64().unwrap() > 0),
            "no switch for {t}: {v}"
        );
    }
}

#[test]
fn collectives_curve_has_every_op_world_and_size() {
    let v = curve(
        "collectives",
        &["--world", "2,3", "--sizes", "8,1024", "--iters", "5"],
    );
    let points = v["points"].as_array().unwrap();
    for world in [2, 3] {
        let at = |op: &str, bytes: u64| {
            points
                .iter()
                .filter(|p| p["op"] == op && p["world"] == world && p["bytes"] == bytes)
                .count()
        };
        assert_eq!(at("barrier", 0), 1, "{v}");
        for op in ["broadcast", "all_reduce", "all_gather"] {
            for bytes in [8, 1024] {
                assert_eq!(at(op, bytes), 1, "{op} {bytes} B at world {world}: {v}");
            }
        }
    }
    positive(&v, &["us", "raw_us"]);
}

#[test]
fn a_bad_world_size_is_a_usage_error() {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_tensorwire"))
        .args(["bench", "curve", "init", "--world", "1"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("--world"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// `bench autograd`: each shape's distributed and local backward, its overhead in round trips
/// and the cost model's parts, after the distributed loss matched the local one.
#[cfg(feature = "autograd-candle")]
#[test]
fn bench_autograd_reports_every_shape() {
    let tmp = tempfile::tempdir().unwrap();
    let json = tmp.path().join("autograd.json");
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_tensorwire"))
        .args([
            "bench",
            "autograd",
            "--steps",
            "3",
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
    let v: Value = serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    for key in [
        "rpc_rtt_p50_us",
        "raw_tcp_pingpong_p50_us",
        "rpc_rtt_over_raw",
    ] {
        let x = v[key].as_f64().unwrap_or(f64::NAN);
        assert!(x.is_finite() && x > 0.0, "{key} = {x}: {v}");
    }
    for shape in ["chain", "diamond", "ps"] {
        let s = &v["shapes"][shape];
        for key in [
            "dist_backward_us",
            "local_backward_us",
            "dist_over_local",
            "expected_us",
        ] {
            let x = s[key].as_f64().unwrap_or(f64::NAN);
            assert!(x.is_finite() && x > 0.0, "{shape}.{key} = {x}: {v}");
        }
        assert!(s["hops"].as_u64().unwrap() >= 3, "{v}");
        assert!(
            s["max_abs_loss_diff_vs_local"].as_f64().unwrap() <= 1e-3,
            "{v}"
        );
    }
}

#[test]
fn bench_autograd_rejects_an_unknown_shape() {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_tensorwire"))
        .args(["bench", "autograd", "--shapes", "chain,ring"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("ring") || err.contains("autograd-candle"),
        "{err}"
    );
}
