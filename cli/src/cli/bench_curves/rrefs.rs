//! `bench curve rrefs`: `rpc_sync` p50 against the number of live remote references held.

use std::time::Duration;

use anyhow::{bail, Context, Result};
use serde_json::{json, Map, Value};

use super::super::bench_common::runtime;
use super::super::bench_raw_tcp::Raw;
use super::super::Usage;
use super::group::{set_transport, start_group};
use super::output::{finish, xy, Panel, Series, BLOCKS};
use super::RrefsArgs;

pub(super) fn rrefs(args: &RrefsArgs) -> Result<()> {
    if args.counts.is_empty() || args.calls < BLOCKS {
        bail!(Usage(format!(
            "--counts needs at least one count and --calls at least {BLOCKS}"
        )));
    }
    let timeout = Duration::from_secs(args.out.timeout);
    set_transport("tcp");
    let mut raw = Raw::start_process(&[]).context("raw TCP baseline")?;
    let rows = runtime(1)?.block_on(async {
        let group = start_group(2, timeout).await?;
        let mut pooled = Vec::new();
        let rows = super::super::bench_rpc::measure_with_rrefs(
            &group.agent,
            1,
            &args.counts,
            args.calls,
            &mut raw,
            &mut pooled,
        )
        .await?;
        group.finish(timeout).await?;
        anyhow::Ok(rows)
    })?;
    raw.finish()?;
    let points: Vec<Value> = rows
        .into_iter()
        .map(|(row, raw_p50)| {
            let p50 = row["rpc_sync_p50_us"].as_f64().unwrap_or(f64::NAN);
            json!({
                "x": row["held"],
                "held": row["held"],
                "rpc_sync_p50_us": p50,
                "rpc_sync_p99_us": row["rpc_sync_p99_us"],
                "remote_batch_of_1000_median_ms": row["remote_batch_of_1000_median_ms"],
                "raw_tcp_pingpong_p50_us": raw_p50,
                "ratio": p50 / raw_p50,
            })
        })
        .collect();
    let held_as_x = |field: &str| -> Vec<(f64, f64)> {
        xy(&points, field)
            .into_iter()
            .map(|(x, y)| (x.max(1.0), y))
            .collect()
    };
    let panels = [Panel {
        title: "rpc_sync against live references held (0 drawn at 1)".into(),
        x_desc: "remote references held".into(),
        y_desc: "microseconds".into(),
        series: vec![
            Series::new("rpc_sync p50", held_as_x("rpc_sync_p50_us")),
            Series::new("rpc_sync p99", held_as_x("rpc_sync_p99_us")),
            Series::new(
                "raw TCP ping-pong p50",
                held_as_x("raw_tcp_pingpong_p50_us"),
            ),
        ],
        marks: vec![],
    }];
    let mut json = Map::new();
    json.insert("x".into(), json!("remote references held by the caller"));
    json.insert(
        "ratio_is".into(),
        json!("rpc_sync p50 over raw ping-pong p50"),
    );
    json.insert(
        "raw_baseline".into(),
        json!("64-byte ping-pong over plain TCP to an echo process, in blocks alternating with the calls"),
    );
    json.insert("transport".into(), json!("tcp"));
    json.insert("calls_per_point".into(), json!(args.calls));
    json.insert("points".into(), Value::Array(points));
    finish("rrefs", &args.out, json, &panels)
}
