//! `bench curve collectives`: barrier, broadcast, all_reduce and all_gather against world
//! size and message size.

use std::time::Duration;

use anyhow::{bail, Context, Result};
use serde_json::{json, Map, Value};

use super::super::bench_common::progress;
use super::super::bench_raw_tcp::Raw;
use super::super::Usage;
use super::output::{check_worlds, finish, Panel, Series};
use super::CollectivesCurveArgs;

pub(super) fn collectives(args: &CollectivesCurveArgs) -> Result<()> {
    check_worlds(&args.world, 256)?;
    if args.sizes.is_empty() || args.sizes.contains(&0) || args.iters == 0 {
        bail!(Usage(
            "--sizes needs sizes of at least 1 byte and --iters at least 1".into()
        ));
    }
    let mut sizes = args.sizes.clone();
    sizes.sort_unstable();
    sizes.dedup();
    let bar = progress(args.world.len() as u64 + 1, "collectives");
    // Raw bulk transfers of each size, before and after the groups.
    let mut raw = Raw::start_process(&sizes).context("raw TCP baseline")?;
    let data = vec![3u8; sizes.last().copied().unwrap_or(1)];
    let mut raw_times: Vec<Vec<Duration>> = vec![Vec::new(); sizes.len()];
    let mut raw_round = |raw: &mut Raw| -> Result<()> {
        for (i, &size) in sizes.iter().enumerate() {
            let n = super::super::bench_collectives::iters_for(args.iters, size).div_ceil(4);
            for _ in 0..n {
                raw_times[i].push(raw.bulk(&data[..size])?);
            }
        }
        Ok(())
    };
    raw.bulk(&data[..sizes[0]])?;
    raw_round(&mut raw)?;
    let mut groups = Vec::new();
    for &world in &args.world {
        bar.set_message(format!("collectives, {world} processes"));
        let got = super::super::bench_collectives::run_curve_group(
            world,
            &sizes,
            args.iters,
            args.out.timeout,
            &args.transport,
        )
        .with_context(|| format!("world {world}"))?;
        let raw_barrier = super::super::bench_raw_barrier::processes(
            super::super::bench_raw_barrier::Medium::Tcp,
            world,
            args.iters,
        )?;
        groups.push((world, got, raw_barrier));
        raw_round(&mut raw)?;
        bar.inc(1);
    }
    raw.finish()?;
    bar.finish_and_clear();
    let raw_us: Vec<f64> = raw_times
        .into_iter()
        .map(super::super::bench_common::median_us)
        .collect();
    let mut points = Vec::new();
    for (world, got, raw_barrier) in &groups {
        let barrier = got
            .get("barrier_us")
            .and_then(Value::as_f64)
            .unwrap_or(f64::NAN);
        points.push(json!({
            "x": world, "op": "barrier", "world": world, "bytes": 0,
            "us": barrier, "raw_us": raw_barrier, "ratio": barrier / raw_barrier,
        }));
        for op in ["broadcast", "all_reduce", "all_gather"] {
            for (i, &size) in sizes.iter().enumerate() {
                let t = got
                    .get(&format!("{op}_{size}_us"))
                    .and_then(Value::as_f64)
                    .unwrap_or(f64::NAN);
                points.push(json!({
                    "x": world, "op": op, "world": world, "bytes": size,
                    "us": t, "raw_us": raw_us[i], "ratio": t / raw_us[i],
                }));
            }
        }
    }
    let of = |op: &str, bytes: usize, field: &str| -> Vec<(f64, f64)> {
        points
            .iter()
            .filter(|p| p["op"] == op && p["bytes"] == bytes)
            .filter_map(|p| Some((p["x"].as_f64()?, p[field].as_f64()?)))
            .collect()
    };
    let mut panels = vec![Panel {
        title: "barrier against world size".into(),
        x_desc: "world size".into(),
        y_desc: "microseconds (median)".into(),
        series: vec![
            Series::new("barrier", of("barrier", 0, "us")),
            Series::new(
                "raw barrier (processes, plain TCP)",
                of("barrier", 0, "raw_us"),
            ),
        ],
        marks: vec![],
    }];
    for op in ["broadcast", "all_reduce", "all_gather"] {
        let mut series = Vec::new();
        for &size in &sizes {
            series.push(Series::new(format!("{op} {size} B"), of(op, size, "us")));
        }
        for &size in &sizes {
            series.push(Series::new(
                format!("raw TCP {size} B"),
                of(op, size, "raw_us"),
            ));
        }
        panels.push(Panel {
            title: format!("{op} against world size, per message size"),
            x_desc: "world size".into(),
            y_desc: "microseconds (median)".into(),
            series,
            marks: vec![],
        });
    }
    let mut json = Map::new();
    json.insert("x".into(), json!("world size"));
    json.insert(
        "ratio_is".into(),
        json!("us over raw_us (time; above 1 is slower)"),
    );
    json.insert(
        "raw_baseline".into(),
        json!("barrier: the same dissemination barrier among as many processes over blocking loopback sockets; the others: one raw transfer of the message's bytes to an echo process, acknowledged with one byte"),
    );
    json.insert("transport".into(), json!(args.transport));
    json.insert("sizes".into(), json!(sizes));
    json.insert("iters".into(), json!(args.iters));
    json.insert("points".into(), Value::Array(points));
    finish("collectives", &args.out, json, &panels)
}
