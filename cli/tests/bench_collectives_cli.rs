//! `tensorwire bench collectives`: it starts the processes itself and writes every key the
//! issue asks for, with the raw baselines and ratios from the same run.

use std::process::Command;

#[test]
fn bench_collectives_writes_every_key() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let file = dir.join("collectives.json");
    let out = Command::new(env!("CARGO_BIN_EXE_tensorwire"))
        .args(["bench", "collectives", "--world", "2,3", "--json"])
        .arg(&file)
        .args(["--small-iters", "20", "--large-iters", "2"])
        .args(["--rendezvous-world", "4", "--timeout", "60"])
        .args(["--transport", "shm"])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: serde_json::Value = serde_json::from_slice(&std::fs::read(&file).unwrap()).unwrap();
    let mut keys = vec![
        "raw_tcp_pingpong_p50_us".to_owned(),
        "raw_tcp_bulk_1MiB_us".to_owned(),
        "rendezvous_barrier_w4_ms".to_owned(),
        "rendezvous_barrier_w4_in_process_ms".to_owned(),
    ];
    for n in [2, 3] {
        keys.push(format!("barrier_w{n}_us"));
        keys.push(format!("all_gather_w{n}_8B_us"));
        keys.push(format!("all_gather_w{n}_1MiB_us"));
        keys.push(format!("all_reduce_w{n}_1MiB_us"));
        keys.push(format!("raw_tcp_bulk_{n}x{}MiB_us", n - 1));
        keys.push(format!("raw_tcp_barrier_w{n}_us"));
        keys.push(format!("raw_shm_barrier_w{n}_us"));
        keys.push(format!("raw_tcp_barrier_threads_w{n}_us"));
        keys.push(format!("raw_shm_barrier_threads_w{n}_us"));
        keys.push(format!("memcpy_all_ranks_w{n}_1MiB_us"));
        keys.push(format!("memcpy_all_ranks_w{n}_all_gather_1MiB_us"));
        keys.push(format!("memcpy_all_ranks_w{n}_all_reduce_1MiB_us"));
        keys.push(format!("memcpy_w{n}_all_reduce_1MiB_us"));
        for op in ["all_gather", "all_reduce"] {
            for floor in ["memcpy", "memcpy_all_ranks"] {
                let r = v["ratios"][format!("{op}_w{n}_1MiB_over_{floor}")]
                    .as_f64()
                    .unwrap_or_else(|| panic!("{op} over {floor} for w{n} missing in {v}"));
                assert!(r > 0.0 && r.is_finite());
            }
        }
        // all_reduce's floor is the copy of what each rank must receive, 2 (n - 1) / n MiB,
        // beside the copy of its output's size kept for reference.
        for floor in ["memcpy_output", "memcpy_output_all_ranks"] {
            let r = v["ratios"][format!("all_reduce_w{n}_1MiB_over_{floor}")]
                .as_f64()
                .unwrap_or_else(|| panic!("all_reduce over {floor} for w{n} missing in {v}"));
            assert!(r > 0.0 && r.is_finite());
        }
        for op in ["reduce", "reduce_scatter", "all_to_all", "broadcast"] {
            keys.push(format!("{op}_w{n}_1MiB_us"));
            let r = v["ratios"][format!("{op}_w{n}_1MiB_over_raw_bulk_1MiB")]
                .as_f64()
                .unwrap_or_else(|| panic!("{op} ratio for w{n} missing in {v}"));
            assert!(r > 0.0 && r.is_finite());
        }
        let r = v["ratios"][format!("barrier_w{n}_over_pingpong")]
            .as_f64()
            .unwrap_or_else(|| panic!("ratio for w{n} missing in {v}"));
        assert!(r > 0.0 && r.is_finite());
        let r = v["ratios"][format!("barrier_w{n}_over_raw_shm_barrier")]
            .as_f64()
            .unwrap_or_else(|| panic!("shm barrier ratio for w{n} missing in {v}"));
        assert!(r > 0.0 && r.is_finite());
    }
    assert!(v["targets_met"]["shm: barrier_w2 <= 10 us"].is_boolean());
    for key in keys {
        let x = v[&key]
            .as_f64()
            .unwrap_or_else(|| panic!("{key} missing in {v}"));
        assert!(x > 0.0 && x.is_finite(), "{key} = {x}");
    }
    assert!(v["targets_met"]["barrier_w2 <= 1.5x pingpong"].is_boolean());
    assert_eq!(v["raw_baseline"], "process");
    assert_eq!(v["transport"], "shm");

    // A world of one is refused with a clear message.
    let out = Command::new(env!("CARGO_BIN_EXE_tensorwire"))
        .args(["bench", "collectives", "--world", "1"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("at least 2"));
}

#[test]
fn a_raw_barrier_rank_with_bad_arguments_says_which() {
    let run = |args: &[&str]| {
        let out = Command::new(env!("CARGO_BIN_EXE_tensorwire"))
            .args(["bench", "raw-barrier-rank"])
            .args(args)
            .output()
            .unwrap();
        (
            out.status.code(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    };
    let common = ["--world", "2", "--iters", "1"];
    for (args, says) in [
        (
            vec!["--medium", "tcp", "--rank", "0"],
            "a raw barrier rank is 1 to world - 1",
        ),
        (
            vec!["--medium", "tcp", "--rank", "1", "--sockets", "0"],
            "is not peer:fd",
        ),
        (
            vec!["--medium", "tcp", "--rank", "1", "--sockets", "0:987654"],
            "987654 is not an open descriptor",
        ),
        (
            vec!["--medium", "tcp", "--rank", "1"],
            "names no socket to rank 0",
        ),
        (vec!["--medium", "shm", "--rank", "1"], "needs --fd"),
        (
            vec!["--medium", "shm", "--rank", "1", "--fd", "987654"],
            "987654 is not an open descriptor",
        ),
    ] {
        let mut all = args.clone();
        all.extend(common);
        let (code, err) = run(&all);
        assert_eq!(code, Some(2), "{all:?}: {err}");
        assert!(err.contains(says), "{all:?}: {err}");
    }
}
