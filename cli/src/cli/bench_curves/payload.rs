//! `bench curve payload`: `rpc_sync` with a tensor of 8 B to 256 MiB, TCP and shm, against
//! raw TCP and `memcpy`.

use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use serde_json::{json, Map, Value};
use tensorwire_core::tensor::Tensor;

use super::super::bench_common::{blocking, runtime};
use super::super::bench_common::{mbps, progress};
use super::super::bench_raw_tcp::Raw;
use super::super::Usage;
use super::group::{set_transport, start_group};
use super::output::{finish, us, Panel, Series};
use super::PayloadArgs;

/// Where each transport changes how it moves a frame, in bytes, with what changes.
pub(super) fn strategy_switches() -> Vec<(&'static str, usize, &'static str)> {
    let mut v = vec![(
        "tcp",
        // transport-tcp/src/connection.rs, DIRECT_READ_MIN.
        64 << 10,
        "payloads of 64 KiB and more are read straight into their buffer, smaller ones through the 64 KiB read buffer",
    )];
    // transport-shm/src/connection.rs, DIRECT_MIN.
    v.push((
        "shm",
        4096,
        "from 4 KiB the receiver copies out of the ring straight into the payload's buffer",
    ));
    #[cfg(feature = "shm")]
    v.push((
        "shm",
        tensorwire_transport_shm::ShmConfig::new(
            tensorwire_transport_shm::ClusterSecret::new(vec![0; 32]).expect("32 bytes"),
        )
        .slab_min,
        "frames from here on are copied once into a reused sealed slab instead of the ring",
    ));
    v
}

pub(super) fn payload(args: &PayloadArgs) -> Result<()> {
    if args.sizes.is_empty() || args.sizes.iter().any(|s| *s < 8 || s % 4 != 0) {
        bail!(Usage(format!(
            "--sizes must be multiples of 4 of at least 8 bytes (got {:?})",
            args.sizes
        )));
    }
    if let Some(t) = args
        .transports
        .iter()
        .find(|t| !["tcp", "shm"].contains(&t.as_str()))
    {
        bail!(Usage(format!("--transports takes tcp and shm, not {t:?}")));
    }
    if args.rounds == 0 {
        bail!(Usage("--rounds must be at least 1".into()));
    }
    let timeout = Duration::from_secs(args.out.timeout);
    let mut sizes = args.sizes.clone();
    sizes.sort_unstable();
    sizes.dedup();
    let rounds_for = |size: usize| (((64 << 20) / size).min(args.rounds)).max(3);
    let mut raw = Raw::start_process(&sizes).context("raw TCP baseline")?;
    let largest = sizes.last().copied().unwrap_or(8);
    let raw_data = vec![7u8; largest];
    // memcpy between buffers faulted in beforehand: the limit of any transfer on one host.
    let mut src = vec![5u8; largest];
    let mut dst = vec![0u8; largest];
    let rt = runtime(1)?;
    let bar = progress((sizes.len() * args.transports.len()) as u64, "payload");
    let mut points = Vec::new();
    for transport in &args.transports {
        set_transport(transport);
        let rows = rt.block_on(async {
            let group = start_group(2, timeout).await?;
            let mut rows = Vec::new();
            for &size in &sizes {
                bar.set_message(format!("{transport} {size} B"));
                let floats = vec![1.0f32; size / 4];
                let tensor = Tensor::from_f32(vec![floats.len()], &floats)?;
                drop(floats);
                let rounds = rounds_for(size);
                let (mut tw, mut rw, mut mc) = (Vec::new(), Vec::new(), Vec::new());
                for round in 0..=rounds {
                    src[round % size] = round as u8;
                    let t = Instant::now();
                    dst[..size].copy_from_slice(std::hint::black_box(&src[..size]));
                    let copy = t.elapsed();
                    std::hint::black_box(&dst);
                    let r = blocking(|| raw.bulk(&raw_data[..size]))?;
                    let t = Instant::now();
                    let n: u64 = group.agent.rpc_sync(1u32, "nbytes", &tensor, None).await?;
                    let took = t.elapsed();
                    if n as usize != size {
                        bail!("the callee saw {n} bytes instead of {size}");
                    }
                    // Round 0 warms up buffers and pages.
                    if round > 0 {
                        tw.push(took);
                        rw.push(r);
                        mc.push(copy);
                    }
                }
                tw.sort();
                rw.sort();
                mc.sort();
                let (t50, r50, m50) = (tw[tw.len() / 2], rw[rw.len() / 2], mc[mc.len() / 2]);
                rows.push(json!({
                    "x": size,
                    "bytes": size,
                    "transport": transport,
                    "rpc_sync_p50_us": us(t50),
                    "raw_tcp_p50_us": us(r50),
                    "memcpy_p50_us": us(m50),
                    "rpc_MBps": mbps(size, t50),
                    "raw_tcp_MBps": mbps(size, r50),
                    "memcpy_MBps": mbps(size, m50.max(Duration::from_nanos(1))),
                    "ratio": us(t50) / us(r50),
                    "rounds": rounds,
                }));
                bar.inc(1);
            }
            group.finish(timeout).await?;
            anyhow::Ok(rows)
        })?;
        points.extend(rows);
    }
    bar.finish_and_clear();
    raw.finish()?;
    let switches = strategy_switches();
    let of = |transport: &str, field: &str| -> Vec<(f64, f64)> {
        points
            .iter()
            .filter(|p| p["transport"] == transport)
            .filter_map(|p| Some((p["x"].as_f64()?, p[field].as_f64()?)))
            .collect()
    };
    let mut series = Vec::new();
    for t in &args.transports {
        series.push(Series::new(format!("rpc_sync, {t}"), of(t, "rpc_MBps")));
    }
    let first = args.transports.first().map(String::as_str).unwrap_or("tcp");
    series.push(Series::new("raw TCP transfer", of(first, "raw_tcp_MBps")));
    series.push(Series::new("memcpy", of(first, "memcpy_MBps")));
    let marks = switches
        .iter()
        .filter(|(t, ..)| args.transports.iter().any(|x| x == t))
        .map(|(t, at, _)| (*at as f64, format!("{t} switches at {} KiB", at >> 10)))
        .collect();
    let panels = [Panel {
        title: "payload size: rpc_sync with a tensor against raw TCP and memcpy".into(),
        x_desc: "bytes".into(),
        y_desc: "MB/s (10^6 bytes per second, round trip)".into(),
        series,
        marks,
    }];
    let mut json = Map::new();
    json.insert("x".into(), json!("tensor bytes per call"));
    json.insert(
        "ratio_is".into(),
        json!("rpc_sync p50 over raw TCP transfer p50 of the same bytes (time; above 1 is slower)"),
    );
    json.insert(
        "raw_baseline".into(),
        json!("the same bytes over plain TCP to an echo process that acknowledges each transfer with one byte, alternating with the calls; memcpy of the same bytes"),
    );
    json.insert(
        "strategy_switches".into(),
        Value::Array(
            switches
                .iter()
                .map(|(t, at, what)| json!({"transport": t, "bytes": at, "what": what}))
                .collect(),
        ),
    );
    json.insert("points".into(), Value::Array(points));
    finish("payload", &args.out, json, &panels)
}
