//! `tensorwire bench autograd`: the distributed backward pass of three model shapes over four
//! processes on this host, against the same model's backward in one process, measured in the
//! same run, with the cost model "local backward + hops × round trip" and what it leaves
//! unexplained. A hop is a gradient request that cannot start before the previous one: each is
//! an RPC answered only once the work it started, nested requests included, is done (FAST
//! mode's completion), so each costs a whole round trip on the critical path.
//!
//! This process is the trainer (rank 0, `w0`); ranks 1 to 3 (`w1`..`w3`) each hold one weight
//! `w_r` and serve `hop`: `y = tanh(x * w_r + w_r)` on the tracked input, then, when the route
//! names further workers, a nested call of `hop` on the next one with `y`. The loss is
//! `sum((y - target)^2)` on the trainer. Shapes (the input does not require a gradient, so, as
//! in PyTorch, no gradient goes back to the trainer for it):
//!
//! - `chain`: `w1 -> w2 -> w3` nested. The gradient goes 0 -> 1 -> 2 -> 3, and back 3 -> 2 -> 1
//!   for the inputs of the nested calls: 5 hops.
//! - `diamond`: `w1 -> w3` and `w2 -> w3` at once, the results summed: per branch 0 -> 1 -> 3
//!   -> 1, the branches at the same time: 3 hops.
//! - `ps` (parameter server): `w1` twice in a row, the trainer's own `tanh` between: 0 -> 1 for
//!   the second call, 1 -> 0 for its input, 0 -> 1 for the first call: 3 hops.
//!
//! `dist_forward_us` (with `forward_calls_in_a_row`) times the forward pass, the same RPCs
//! carrying the same tensors, for comparison. Each figure is the median over `--steps` passes, each pass in a fresh context released after
//! it (the release is not timed). `rpc_rtt_p50_us` is `rpc_sync` of a no-op to `w1` measured in
//! blocks between the shapes, `raw_tcp_pingpong_p50_us` plain TCP to an echo process likewise.

use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use serde_json::{json, Map, Value};
use tensorwire::autograd_candle::candle_core::{self, Device, Tensor as CTensor, Var};
use tensorwire::autograd_candle::CandleEngine;
use tensorwire_dist_autograd::{AutogradCall, DistAutograd};
use tensorwire_rpc::Agent;

use super::bench_common::median_us;
use super::bench_common::{blocking, runtime};
use super::bench_raw_tcp::Raw;
use super::Usage;

/// Width of every layer.
const DIM: usize = 64;
/// Ranks of the group: the trainer and three workers.
const WORLD: usize = 4;

/// Arguments of `tensorwire bench autograd`.
#[derive(Debug, clap::Args)]
pub(crate) struct AutogradArgs {
    /// Backward passes per shape (after a tenth as many for warm-up).
    #[arg(long, default_value_t = 300)]
    steps: usize,
    /// Shapes to measure, comma-separated: chain, diamond, ps.
    #[arg(long, value_delimiter = ',', default_value = "chain,diamond,ps")]
    shapes: Vec<String>,
    /// Write the results as one JSON object to this file (else to standard output).
    #[arg(long)]
    json: Option<std::path::PathBuf>,
    /// Bound on starting the processes and on each step, in seconds.
    #[arg(long, default_value_t = 120)]
    timeout: u64,
}

fn vector(seed: usize, scale: f32) -> Vec<f32> {
    (0..DIM)
        .map(|i| scale * (((i * 7 + seed * 13) % 17) as f32 / 17.0 - 0.4))
        .collect()
}

/// The weight of rank `rank`, a leaf that requires a gradient.
fn weight(rank: usize) -> Result<CTensor> {
    let v: Vec<f32> = vector(10 + rank, 1.0).iter().map(|x| x + 1.0).collect();
    let t = CTensor::from_vec(v, DIM, &Device::Cpu)?;
    Ok(Var::from_tensor(&t)?.as_tensor().clone())
}

fn input() -> Result<CTensor> {
    Ok(CTensor::from_vec(vector(1, 2.0), DIM, &Device::Cpu)?)
}

fn layer(x: &CTensor, w: &CTensor) -> candle_core::Result<CTensor> {
    x.mul(w)?.add(w)?.tanh()
}

fn loss_of(y: &CTensor) -> Result<CTensor> {
    let target = CTensor::from_vec(vector(5, 1.0), DIM, &Device::Cpu)?;
    Ok(y.sub(&target)?.sqr()?.sum_all()?)
}

/// Sets up distributed autograd on a rank and registers `hop` (see the module docs).
pub(crate) fn serve(agent: &Agent, rank: usize) -> Result<DistAutograd<CandleEngine>> {
    let dist = DistAutograd::new(agent, CandleEngine::new())?;
    let w = weight(rank)?;
    dist.register(
        "hop",
        move |call: AutogradCall<CandleEngine>, route: Vec<String>, ts: Vec<CTensor>| {
            let w = w.clone();
            async move {
                let x = ts.first().ok_or("hop: no input tensor")?;
                let y = layer(x, &w).map_err(|e| e.to_string())?;
                match route.split_first() {
                    None => Ok(((), vec![y])),
                    Some((next, rest)) => {
                        let ((), out) = call
                            .context()
                            .rpc_sync(next, "hop", &rest.to_vec(), &[y], None)
                            .await
                            .map_err(|e| e.to_string())?;
                        Ok(((), out))
                    }
                }
            }
        },
    )?;
    Ok(dist)
}

/// The name under which every rank waits until all have registered `hop`.
pub(crate) const READY_BARRIER: &str = "bench-autograd-ready";

/// A shape: its forward pass distributed and in one process, and its gradient messages in a
/// row.
#[derive(Debug, Clone, Copy)]
enum Shape {
    Chain,
    Diamond,
    Ps,
}

impl Shape {
    fn parse(s: &str) -> Result<Self> {
        Ok(match s {
            "chain" => Shape::Chain,
            "diamond" => Shape::Diamond,
            "ps" => Shape::Ps,
            other => bail!(Usage(format!(
                "--shapes takes chain, diamond and ps, not {other:?}"
            ))),
        })
    }

    fn name(self) -> &'static str {
        match self {
            Shape::Chain => "chain",
            Shape::Diamond => "diamond",
            Shape::Ps => "ps",
        }
    }

    /// Gradient requests that must go one after another (see the module docs).
    fn hops(self) -> usize {
        match self {
            Shape::Chain => 5,
            Shape::Diamond | Shape::Ps => 3,
        }
    }

    /// Calls of the forward pass that go one after another (nested or in sequence): the
    /// forward's own "hops", for comparison.
    fn forward_calls(self) -> usize {
        match self {
            Shape::Chain => 3,
            Shape::Diamond | Shape::Ps => 2,
        }
    }

    /// The output of the distributed forward pass in `ctx`.
    async fn forward(
        self,
        ctx: &tensorwire_dist_autograd::AutogradContext<CandleEngine>,
        x: &CTensor,
    ) -> Result<CTensor> {
        let hop = |to: &'static str, route: Vec<String>, t: CTensor| async move {
            let ((), out) = ctx.rpc_sync(to, "hop", &route, &[t], None).await?;
            out.into_iter().next().context("hop returned no tensor")
        };
        Ok(match self {
            Shape::Chain => hop("w1", vec!["w2".into(), "w3".into()], x.clone()).await?,
            Shape::Diamond => {
                let (a, b) = tokio::try_join!(
                    hop("w1", vec!["w3".into()], x.clone()),
                    hop("w2", vec!["w3".into()], x.clone())
                )?;
                a.add(&b)?
            }
            Shape::Ps => {
                let h = hop("w1", vec![], x.clone()).await?.tanh()?;
                hop("w1", vec![], h).await?
            }
        })
    }

    /// The same output in one process, with `w[r]` for rank r's weight.
    fn local(self, x: &CTensor, w: &[CTensor]) -> Result<CTensor> {
        Ok(match self {
            Shape::Chain => layer(&layer(&layer(x, &w[1])?, &w[2])?, &w[3])?,
            Shape::Diamond => {
                layer(&layer(x, &w[1])?, &w[3])?.add(&layer(&layer(x, &w[2])?, &w[3])?)?
            }
            Shape::Ps => layer(&layer(x, &w[1])?.tanh()?, &w[1])?,
        })
    }
}

/// 200 raw ping-pongs, then 200 `rpc_sync` no-ops to `w1`, their times added to the lists.
async fn round_trips(
    agent: &Agent,
    raw: &mut Raw,
    rtts: &mut Vec<Duration>,
    raw_rtts: &mut Vec<Duration>,
) -> Result<()> {
    raw_rtts.extend(blocking(|| raw.pingpong(200))?);
    for i in 0..200u64 {
        let t = Instant::now();
        let _: u64 = agent.rpc_sync("w1", "noop", &i, None).await?;
        rtts.push(t.elapsed());
    }
    Ok(())
}

/// `tensorwire bench autograd`.
pub(crate) fn run(args: &AutogradArgs) -> Result<()> {
    let shapes = args
        .shapes
        .iter()
        .map(|s| Shape::parse(s))
        .collect::<Result<Vec<_>>>()?;
    if args.steps == 0 || shapes.is_empty() {
        bail!(Usage(
            "--steps must be at least 1 and --shapes name a shape".into()
        ));
    }
    let timeout = Duration::from_secs(args.timeout);
    std::env::set_var(tensorwire_rendezvous::LAUNCHER_STORE_ENV, "1");
    std::env::set_var("TENSORWIRE_TRANSPORT", "tcp");
    let mut raw = Raw::start_process(&[]).context("raw TCP baseline")?;
    let bar = super::bench_common::progress(shapes.len() as u64, "autograd");
    let (rows, rtt, raw_rtt) = runtime(1)?.block_on(async {
        let group = super::bench_curves::start_group_with(WORLD, timeout, &["--autograd"]).await?;
        let agent = &group.agent;
        let dist = serve(agent, 0)?;
        agent.barrier(READY_BARRIER, timeout).await?;
        let (mut rtts, mut raw_rtts) = (Vec::new(), Vec::new());
        round_trips(agent, &mut raw, &mut rtts, &mut raw_rtts).await?;
        let weights: Vec<CTensor> = (0..WORLD).map(weight).collect::<Result<_>>()?;
        let x = input()?;
        let mut rows = Vec::new();
        for shape in &shapes {
            bar.set_message(shape.name());
            let (mut dist_t, mut local_t, mut fwd_t) = (Vec::new(), Vec::new(), Vec::new());
            let mut max_loss_diff = 0f32;
            let warm = (args.steps / 10).max(2);
            for step in 0..warm + args.steps {
                let ctx = dist.context()?;
                let t = Instant::now();
                let y = shape.forward(&ctx, &x).await?;
                let forward_took = t.elapsed();
                let loss = loss_of(&y)?;
                let t = Instant::now();
                ctx.backward(&[(loss.clone(), None)], false).await?;
                let took = t.elapsed();
                ctx.release().await?;

                let local_loss = loss_of(&shape.local(&x, &weights)?)?;
                let t = Instant::now();
                let grads = local_loss.backward()?;
                let local_took = t.elapsed();
                std::hint::black_box(grads);
                let diff = (loss.to_scalar::<f32>()? - local_loss.to_scalar::<f32>()?).abs();
                max_loss_diff = max_loss_diff.max(diff);
                if step >= warm {
                    dist_t.push(took);
                    local_t.push(local_took);
                    fwd_t.push(forward_took);
                }
            }
            // The same model: a distributed forward pass that differs is a bug, not noise.
            if max_loss_diff > 1e-3 {
                bail!(
                    "{}: the distributed loss differs from the local one by {max_loss_diff}",
                    shape.name()
                );
            }
            rows.push((
                *shape,
                median_us(dist_t),
                median_us(local_t),
                median_us(fwd_t),
                max_loss_diff,
            ));
            round_trips(agent, &mut raw, &mut rtts, &mut raw_rtts).await?;
            bar.inc(1);
        }
        group.finish(timeout).await?;
        anyhow::Ok((rows, median_us(rtts), median_us(raw_rtts)))
    })?;
    bar.finish_and_clear();
    raw.finish()?;
    let mut out = Map::new();
    let mut shapes_out = Map::new();
    for (shape, dist, local, forward, loss_diff) in rows {
        let hops = shape.hops();
        let expected = local + hops as f64 * rtt;
        shapes_out.insert(
            shape.name().into(),
            json!({
                "dist_backward_us": dist,
                "dist_forward_us": forward,
                "forward_calls_in_a_row": shape.forward_calls(),
                "local_backward_us": local,
                "dist_over_local": dist / local,
                "overhead_us": dist - local,
                "hops": hops,
                "overhead_in_round_trips": (dist - local) / rtt,
                "expected_us": expected,
                "unexplained_us": dist - expected,
                "max_abs_loss_diff_vs_local": loss_diff,
            }),
        );
    }
    out.insert("shapes".into(), Value::Object(shapes_out));
    out.insert("rpc_rtt_p50_us".into(), json!(rtt));
    out.insert("raw_tcp_pingpong_p50_us".into(), json!(raw_rtt));
    out.insert("rpc_rtt_over_raw".into(), json!(rtt / raw_rtt));
    out.insert(
        "model".into(),
        json!("expected_us = local_backward_us + hops x rpc_rtt_p50_us (hops: gradient requests one after another, each answered once its nested work is done); unexplained_us is the rest"),
    );
    out.insert(
        "settings".into(),
        json!({"steps": args.steps, "dim": DIM, "processes": WORLD, "transport": "tcp"}),
    );
    out.insert("raw_baseline".into(), json!("process"));
    super::bench_common::write_json(&out, args.json.as_ref())
}
