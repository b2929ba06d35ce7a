//! `bench curve init`: `init_rpc` wall time against world size, against a raw rendezvous.

use std::io::{Read, Write};
use std::net::TcpListener;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use serde_json::{json, Map, Value};

use super::super::bench_common::progress;
use super::super::bench_common::runtime;
use super::group::{set_transport, start_group};
use super::output::{check_worlds, finish, ms, xy, Panel, Series};
use super::InitArgs;

/// The raw rendezvous of `world` processes: the wall time from starting the first until each
/// has dialled this one and been told that all have.
pub(super) fn raw_rendezvous(world: usize, timeout: Duration) -> Result<Duration> {
    let listener = TcpListener::bind("127.0.0.1:0")?;
    let addr = listener.local_addr()?;
    let exe = std::env::current_exe()?;
    let started = Instant::now();
    let mut children = Vec::with_capacity(world - 1);
    for _ in 1..world {
        children.push(
            Command::new(&exe)
                .args([
                    "bench",
                    "curve-worker",
                    "--raw-rendezvous",
                    &addr.to_string(),
                ])
                .stdin(Stdio::null())
                .spawn()
                .context("starting a raw rendezvous process")?,
        );
    }
    let mut conns = Vec::with_capacity(world - 1);
    listener.set_nonblocking(false)?;
    let deadline = Instant::now() + timeout;
    while conns.len() < world - 1 {
        if Instant::now() > deadline {
            for c in &mut children {
                let _ = c.kill();
                let _ = c.wait();
            }
            bail!("the raw rendezvous of {world} did not finish within {timeout:?}");
        }
        let (mut s, _) = listener.accept()?;
        let mut hello = [0u8; 1];
        s.read_exact(&mut hello)?;
        conns.push(s);
    }
    for s in &mut conns {
        s.write_all(&[1])?;
    }
    let took = started.elapsed();
    drop(conns);
    for (i, mut c) in children.into_iter().enumerate() {
        let status = c.wait()?;
        if !status.success() {
            bail!("raw rendezvous process {} failed ({status})", i + 1);
        }
    }
    Ok(took)
}

/// The world size whose init `bench curve init` holds to a goal, and the goal.
pub(super) const INIT_GOAL: (usize, Duration) = (64, Duration::from_secs(5));

pub(super) fn init(args: &InitArgs) -> Result<()> {
    check_worlds(&args.world, 1024)?;
    let timeout = Duration::from_secs(args.out.timeout);
    set_transport(&args.transport);
    let rt = runtime(1)?;
    let bar = progress(args.world.len() as u64, "init");
    // The first processes started pay for a cold binary: a throw-away raw round first.
    raw_rendezvous(2, timeout)?;
    let mut points = Vec::new();
    for &world in &args.world {
        bar.set_message(format!("init of {world}"));
        let raw = raw_rendezvous(world, timeout)?;
        let point = rt.block_on(async {
            let group = start_group(world, timeout).await?;
            let point = json!({
                "x": world,
                "world": world,
                "init_wall_ms": ms(group.init_wall),
                "init_rpc_rank0_ms": ms(group.init_rank0),
                "init_rpc_slowest_other_ms": ms(group.init_slowest_other),
                "raw_rendezvous_ms": ms(raw),
                "ratio": group.init_wall.as_secs_f64() / raw.as_secs_f64(),
            });
            group.finish(timeout).await?;
            anyhow::Ok(point)
        })?;
        points.push(point);
        bar.inc(1);
    }
    bar.finish_and_clear();
    let mut json = Map::new();
    let (goal_world, goal) = INIT_GOAL;
    if let Some(p) = points.iter().find(|p| p["world"] == goal_world) {
        let wall = p["init_wall_ms"].as_f64().unwrap_or(f64::NAN);
        json.insert(
            "targets_met".into(),
            json!({ format!("init_rpc w{goal_world} < {} s", goal.as_secs()): wall < ms(goal) }),
        );
    }
    let panels = [Panel {
        title: "init_rpc against world size (processes on this host)".into(),
        x_desc: "world size".into(),
        y_desc: "milliseconds".into(),
        series: vec![
            Series::new(
                "start to every init_rpc returned",
                xy(&points, "init_wall_ms"),
            ),
            Series::new("init_rpc on rank 0", xy(&points, "init_rpc_rank0_ms")),
            Series::new(
                "raw rendezvous (star, plain TCP)",
                xy(&points, "raw_rendezvous_ms"),
            ),
        ],
        marks: vec![],
    }];
    json.insert("x".into(), json!("world size"));
    json.insert(
        "ratio_is".into(),
        json!("init_wall_ms over raw_rendezvous_ms"),
    );
    json.insert(
        "raw_baseline".into(),
        json!("the same number of processes of this binary started the same way, each dialling the benchmark over plain TCP and waiting until all have (a star, no secret, no mesh)"),
    );
    json.insert("transport".into(), json!(args.transport));
    json.insert("points".into(), Value::Array(points));
    finish("init", &args.out, json, &panels)
}
