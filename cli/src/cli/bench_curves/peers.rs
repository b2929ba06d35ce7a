//! `bench curve peers`: `rpc_sync` p50 and `rpc_async` calls/s against the number of peers.

use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use serde_json::{json, Map, Value};

use super::super::bench_common::{blocking, runtime};
use super::super::bench_common::{percentile, progress};
use super::super::bench_raw_tcp::Raw;
use super::super::Usage;
use super::group::{set_transport, start_group};
use super::output::{check_worlds, finish, xy, Panel, Series, BLOCKS};
use super::PeersArgs;

pub(super) fn peers(args: &PeersArgs) -> Result<()> {
    check_worlds(&args.world, 1024)?;
    if args.calls < BLOCKS || args.async_calls == 0 || args.in_flight == 0 {
        bail!(Usage(format!(
            "--calls must be at least {BLOCKS}; --async-calls and --in-flight at least 1"
        )));
    }
    let timeout = Duration::from_secs(args.out.timeout);
    set_transport(&args.transport);
    let mut points = Vec::new();
    let bar = progress(args.world.len() as u64, "peers");
    let rt = runtime(1)?;
    for &world in &args.world {
        bar.set_message(format!("{} peers", world - 1));
        let mut raw = Raw::start_process_pings(world - 1, &[]).context("raw TCP baseline")?;
        let point = rt.block_on(async {
            let group = start_group(world, timeout).await?;
            let agent = &group.agent;
            let peers = (world - 1) as u32;
            // Warm-up: a call to each peer, a raw round trip on each connection.
            for to in 1..=peers {
                let _: u64 = agent.rpc_sync(to, "noop", &0u64, None).await?;
            }
            blocking(|| raw.pingpong_round_robin(world - 1))?;
            let block = args.calls / BLOCKS;
            let (mut times, mut raw_times) = (Vec::new(), Vec::new());
            for _ in 0..BLOCKS {
                raw_times.extend(blocking(|| raw.pingpong_round_robin(block))?);
                for i in 0..block {
                    let to = 1 + (i as u32 % peers);
                    let t = Instant::now();
                    let _: u64 = agent.rpc_sync(to, "noop", &(i as u64), None).await?;
                    times.push(t.elapsed());
                }
            }
            times.sort();
            raw_times.sort();
            let t = Instant::now();
            let mut pending = std::collections::VecDeque::with_capacity(args.in_flight);
            for i in 0..args.async_calls {
                if pending.len() == args.in_flight {
                    let f: tensorwire_rpc::RpcFuture<u64> =
                        pending.pop_front().context("a call is in flight")?;
                    f.await?;
                }
                let to = 1 + (i as u32 % peers);
                pending.push_back(agent.rpc_async::<_, u64>(to, "noop", &(i as u64), None)?);
            }
            for f in pending {
                f.await?;
            }
            let per_s = args.async_calls as f64 / t.elapsed().as_secs_f64();
            group.finish(timeout).await?;
            let p50 = percentile(&times, 0.5);
            let raw_p50 = percentile(&raw_times, 0.5);
            anyhow::Ok(json!({
                "x": world - 1,
                "peers": world - 1,
                "world": world,
                "rpc_sync_p50_us": p50,
                "rpc_sync_p99_us": percentile(&times, 0.99),
                "raw_tcp_pingpong_p50_us": raw_p50,
                "ratio": p50 / raw_p50,
                "rpc_async_calls_per_s": per_s,
                "raw_round_trips_per_s": 1e6 / raw_p50,
            }))
        })?;
        raw.finish()?;
        points.push(point);
        bar.inc(1);
    }
    bar.finish_and_clear();
    if let Some(first) = points
        .first()
        .and_then(|p| p["rpc_async_calls_per_s"].as_f64())
    {
        for p in &mut points {
            let rate = p["rpc_async_calls_per_s"].as_f64().unwrap_or(f64::NAN);
            p["calls_per_s_over_first"] = json!(rate / first);
        }
    }
    let panels = [
        Panel {
            title: "rpc_sync to each peer in turn, against peers".into(),
            x_desc: "peers called (world - 1)".into(),
            y_desc: "microseconds".into(),
            series: vec![
                Series::new("rpc_sync p50", xy(&points, "rpc_sync_p50_us")),
                Series::new("rpc_sync p99", xy(&points, "rpc_sync_p99_us")),
                Series::new(
                    "raw TCP ping-pong p50",
                    xy(&points, "raw_tcp_pingpong_p50_us"),
                ),
            ],
            marks: vec![],
        },
        Panel {
            title: format!(
                "rpc_async calls/s, {} in flight over the peers",
                args.in_flight
            ),
            x_desc: "peers called (world - 1)".into(),
            y_desc: "calls per second".into(),
            series: vec![
                Series::new("rpc_async calls/s", xy(&points, "rpc_async_calls_per_s")),
                Series::new(
                    "raw sequential round trips/s",
                    xy(&points, "raw_round_trips_per_s"),
                ),
            ],
            marks: vec![],
        },
    ];
    let mut json = Map::new();
    json.insert("x".into(), json!("peers the caller calls in turn"));
    json.insert(
        "ratio_is".into(),
        json!("rpc_sync p50 over raw ping-pong p50"),
    );
    json.insert(
        "raw_baseline".into(),
        json!("64-byte ping-pong over plain TCP to an echo process, one connection per peer used in turn, in blocks alternating with the calls; calls/s is also given over the first point's (calls_per_s_over_first)"),
    );
    json.insert("transport".into(), json!(args.transport));
    json.insert(
        "settings".into(),
        json!({"calls": args.calls, "async_calls": args.async_calls, "in_flight": args.in_flight}),
    );
    json.insert("points".into(), Value::Array(points));
    finish("peers", &args.out, json, &panels)
}
