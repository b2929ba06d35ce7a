//! The model of the `dist_autograd` example and of `tensorwire demo autograd`: a model split
//! across three processes, trained with distributed autograd and the
//! [`DistributedOptimizer`](tensorwire_dist_autograd::DistributedOptimizer), and compared with the same model in one process.
//!
//! - `ps` (rank 0), the parameter server, holds `w1` and `w2` as
//!   [`Parameter`](tensorwire_dist_autograd::Parameter)s in remote
//!   references;
//! - `trainer` (rank 1) holds its own layer `w0` (in a local reference, so the same optimizer
//!   steps it) and computes the loss;
//! - `worker` (rank 2) sits in a chain: the trainer sends it `h1`, and it calls the parameter
//!   server's `w2` itself (a nested call in the same context) before it answers.
//!
//! ```text
//! h1 = tanh(x * w1 + w1)                       on ps      (trainer -> ps, RRef method)
//! z  = 2 h1 + 1;  h2 = tanh(z * w2 + w2) / 2   on worker, w2 on ps (trainer -> worker -> ps)
//! y  = h2 * w0;   loss = sum((y - target)^2)   on trainer
//! ```

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// The demo's error: whatever went wrong, as text with its source.
pub type Error = Box<dyn std::error::Error + Send + Sync>;
type Result<T> = std::result::Result<T, Error>;

/// `what` as an error, when `x` is `None` or an error.
fn need<T, E: std::fmt::Display>(x: std::result::Result<T, E>, what: &str) -> Result<T> {
    x.map_err(|e| format!("{what}: {e}").into())
}

fn some<T>(x: Option<T>, what: &str) -> Result<T> {
    x.ok_or_else(|| what.into())
}
use serde::{Deserialize, Serialize};
use tensorwire::autograd_candle::candle_core::{self, Device, Tensor as CTensor, Var};
use tensorwire::autograd_candle::CandleEngine;
use tensorwire_core::autograd::optim::{Optimizer, OptimizerState, Sgd};
use tensorwire_core::autograd::ContextId;
use tensorwire_dist_autograd::{AutogradCall, DistAutograd, DistributedOptimizer, Parameter};
use tensorwire_rpc::{init_rpc, Functions, RRef, RpcOptions};

/// Width of every layer.
pub const DIM: usize = 16;

/// The optimizer both runs use.
pub const OPTIMIZER: Optimizer = Optimizer::Sgd(Sgd::new(0.02).momentum(0.9));

/// What the trainer reports (the demo's `--json` output).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Report {
    /// Worker processes.
    pub workers: usize,
    /// Training steps.
    pub steps: usize,
    /// Largest absolute difference between a distributed and a one-process gradient at the
    /// first step, over every parameter.
    pub max_abs_grad_diff_vs_local: f32,
    /// Largest absolute difference between the losses of the two runs, over all steps.
    pub max_abs_loss_diff_vs_local: f32,
    /// The loss at the first step.
    pub loss_first: f32,
    /// The loss at the last step.
    pub loss_last: f32,
    /// Mean time of a distributed backward over mean time of the same backward in one
    /// process, measured in the same run.
    pub dist_backward_over_local_backward: f64,
    /// Mean distributed backward, microseconds.
    pub dist_backward_us: f64,
    /// Mean one-process backward, microseconds.
    pub local_backward_us: f64,
}

fn init(seed: usize, scale: f32) -> Vec<f32> {
    (0..DIM)
        .map(|i| scale * (((i * 7 + seed * 13) % 17) as f32 / 17.0 - 0.4))
        .collect()
}

fn input() -> CTensor {
    CTensor::from_vec(init(1, 2.0), DIM, &Device::Cpu).expect("shape")
}

fn target() -> CTensor {
    CTensor::from_vec(init(5, 1.0), DIM, &Device::Cpu).expect("shape")
}

fn var(values: Vec<f32>) -> Result<CTensor> {
    let t = CTensor::from_vec(values, DIM, &Device::Cpu)?;
    Ok(Var::from_tensor(&t)?.as_tensor().clone())
}

fn w_init(i: usize) -> Vec<f32> {
    let mut v = init(10 + i, 1.0);
    for x in &mut v {
        *x += 1.0;
    }
    v
}

fn layer1(x: &CTensor, w1: &CTensor) -> candle_core::Result<CTensor> {
    x.mul(w1)?.add(w1)?.tanh()
}

fn chain_pre(h1: &CTensor) -> candle_core::Result<CTensor> {
    h1.affine(2.0, 1.0)
}

fn layer2(z: &CTensor, w2: &CTensor) -> candle_core::Result<CTensor> {
    z.mul(w2)?.add(w2)?.tanh()
}

fn loss_of(h2: &CTensor, w0: &CTensor) -> candle_core::Result<CTensor> {
    h2.mul(w0)?.sub(&target())?.sqr()?.sum_all()
}

fn values(t: &CTensor) -> Result<Vec<f32>> {
    Ok(t.to_vec1::<f32>()?)
}

/// The autograd functions every worker registers.
fn register(dist: &DistAutograd<CandleEngine>) -> Result<()> {
    dist.register_method(
        "layer",
        |_call: AutogradCall<CandleEngine>,
         p: Arc<Parameter<CandleEngine>>,
         (): (),
         ts: Vec<CTensor>| async move {
            let x = ts.first().ok_or("no input")?;
            Ok(((), vec![layer2(x, p.tensor()).map_err(|e| e.to_string())?]))
        },
    )?;
    dist.register_method(
        "layer1",
        |_call: AutogradCall<CandleEngine>,
         p: Arc<Parameter<CandleEngine>>,
         (): (),
         ts: Vec<CTensor>| async move {
            let x = ts.first().ok_or("no input")?;
            Ok(((), vec![layer1(x, p.tensor()).map_err(|e| e.to_string())?]))
        },
    )?;
    // The worker's part of the chain: it calls the parameter server itself.
    dist.register(
        "chain",
        |call: AutogradCall<CandleEngine>, w2: RRef<Parameter<CandleEngine>>, ts: Vec<CTensor>| async move {
            let h1 = ts.first().ok_or("no input")?;
            let z = chain_pre(h1).map_err(|e| e.to_string())?;
            let ((), out) = call
                .context()
                .rref_rpc_sync(&w2, "layer", &(), &[z], None)
                .await
                .map_err(|e| e.to_string())?;
            let h2 = out[0].affine(0.5, 0.0).map_err(|e| e.to_string())?;
            Ok(((), vec![h2]))
        },
    )?;
    Ok(())
}

/// Runs one worker of the demo (rank and world from the environment); the trainer returns its
/// report.
pub async fn worker(steps: usize) -> Result<Option<Report>> {
    let rank: usize = need(need(std::env::var("RANK"), "RANK")?.parse(), "RANK")?;
    let world: usize = need(
        need(std::env::var("WORLD_SIZE"), "WORLD_SIZE")?.parse(),
        "WORLD_SIZE",
    )?;
    if world != 3 {
        return Err(format!("the demo runs on 3 workers, not {world}").into());
    }
    let name = ["ps", "trainer", "worker"][rank];
    let functions = Functions::new();
    functions.register("make_param", |i: usize| async move {
        let t = var(w_init(i)).map_err(|e| e.to_string())?;
        Ok::<_, String>(Parameter::new(&CandleEngine::new(), t))
    })?;
    let agent = init_rpc(
        name,
        rank,
        Some(world),
        RpcOptions {
            functions,
            ..RpcOptions::default()
        },
    )
    .await?;
    let dist = DistAutograd::new(&agent, CandleEngine::new())?;
    register(&dist)?;
    // A parameter's gradient in a context, read on its owner.
    let d = dist.clone();
    agent.functions().register_method(
        "grad",
        move |p: Arc<Parameter<CandleEngine>>, context: ContextId| {
            let d = d.clone();
            async move {
                let g = d
                    .gradients(context)
                    .and_then(|g| g.get(&p.tensor().id()).cloned())
                    .ok_or_else(|| format!("no gradient in {context}"))?;
                g.to_vec1::<f32>().map_err(|e| e.to_string())
            }
        },
    )?;
    agent
        .barrier("autograd-demo", Duration::from_secs(60))
        .await?;
    let report = if rank == 1 {
        Some(train(&agent, &dist, steps).await?)
    } else {
        None
    };
    agent
        .barrier("autograd-demo-done", Duration::from_secs(600))
        .await?;
    agent
        .shutdown(tensorwire_rpc::Shutdown::graceful(Duration::from_secs(30)))
        .await?;
    Ok(report)
}

async fn train(
    agent: &tensorwire_rpc::Agent,
    dist: &DistAutograd<CandleEngine>,
    steps: usize,
) -> Result<Report> {
    let w1: RRef<Parameter<CandleEngine>> = agent.remote("ps", "make_param", &1usize, None)?;
    let w2: RRef<Parameter<CandleEngine>> = agent.remote("ps", "make_param", &2usize, None)?;
    let w0 = agent.local_rref(Parameter::new(&CandleEngine::new(), var(w_init(0))?))?;
    let w0_tensor = w0.local_value().await?.tensor().clone();
    let params = vec![w0.clone(), w1.clone(), w2.clone()];
    let opt = DistributedOptimizer::new(dist, params.clone(), OPTIMIZER)?;

    // The same model in one process.
    let local: Vec<CTensor> = (0..3).map(|i| var(w_init(i))).collect::<Result<_>>()?;
    let mut states = vec![OptimizerState::default(); 3];

    let (mut loss_first, mut loss_last) = (0.0, 0.0);
    let mut max_grad_diff = 0.0f32;
    let mut max_loss_diff = 0.0f32;
    let (mut dist_time, mut local_time) = (Duration::ZERO, Duration::ZERO);
    for step in 0..steps {
        let ctx = dist.context()?;
        let ((), h1) = ctx
            .rref_rpc_sync(&w1, "layer1", &(), &[input()], None)
            .await?;
        let ((), h2) = ctx.rpc_sync("worker", "chain", &w2, &h1, None).await?;
        let loss = loss_of(&h2[0], &w0_tensor)?;
        let t = Instant::now();
        ctx.backward(&[(loss.clone(), None)], false).await?;
        dist_time += t.elapsed();
        let loss = loss.to_scalar::<f32>()?;

        let h2l =
            layer2(&chain_pre(&layer1(&input(), &local[1])?)?, &local[2])?.affine(0.5, 0.0)?;
        let local_loss = loss_of(&h2l, &local[0])?;
        let t = Instant::now();
        let grads = local_loss.backward()?;
        local_time += t.elapsed();
        max_loss_diff = max_loss_diff.max((local_loss.to_scalar::<f32>()? - loss).abs());

        if step == 0 {
            loss_first = loss;
            for (i, p) in params.iter().enumerate() {
                let got: Vec<f32> = p.rpc_sync("grad", &ctx.id(), None).await?;
                let want = values(some(grads.get(&local[i]), "a local gradient")?)?;
                for (g, w) in got.iter().zip(&want) {
                    max_grad_diff = max_grad_diff.max((g - w).abs());
                }
            }
        }
        loss_last = loss;
        opt.step(ctx.id()).await?;
        ctx.release().await?;
        for (i, p) in local.iter().enumerate() {
            let mut v = values(p)?;
            let g = values(some(grads.get(p), "a local gradient")?)?;
            need(OPTIMIZER.step(&mut states[i], &mut v, &g), "local step")?;
            Var::from_tensor(p)?.set(&CTensor::from_vec(v, DIM, &Device::Cpu)?)?;
        }
    }
    let n = steps.max(1) as f64;
    let dist_us = dist_time.as_secs_f64() * 1e6 / n;
    let local_us = local_time.as_secs_f64() * 1e6 / n;
    Ok(Report {
        workers: 3,
        steps,
        max_abs_grad_diff_vs_local: max_grad_diff,
        max_abs_loss_diff_vs_local: max_loss_diff,
        loss_first,
        loss_last,
        dist_backward_over_local_backward: dist_us / local_us.max(1e-9),
        dist_backward_us: dist_us,
        local_backward_us: local_us,
    })
}

/// Starts the 3 workers as processes of `exe` (with `args`, which make it call [`worker`] and
/// print its report as `REPORT <json>`), on 127.0.0.1, and returns the trainer's report.
/// Other output of the workers goes to standard error.
///
/// The group's store is served here, as `tensorwire launch` serves a job's, on a port the
/// system picks (`TENSORWIRE_LAUNCHER_STORE=1` tells rank 0 to connect to it instead of
/// hosting one): no port is reserved and released first.
pub fn run_local(exe: &str, args: &[String]) -> Result<Report> {
    use tensorwire_rendezvous::LAUNCHER_STORE_ENV;
    use tensorwire_store::{ClusterSecret, ServerConfig, TcpStoreServer};
    let nonce = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos())
        .unwrap_or_default();
    let secret = format!("autograd-demo-{}-{nonce}", std::process::id());
    // One thread serves the store while this one waits on the workers.
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()?;
    let server = rt.block_on(TcpStoreServer::bind(
        std::net::SocketAddr::from((std::net::Ipv4Addr::LOCALHOST, 0)),
        ServerConfig {
            secret: Some(ClusterSecret::new(secret.as_bytes().to_vec())?),
            ..ServerConfig::default()
        },
    ))?;
    let port = server.local_addr().port().to_string();
    let mut children = Vec::new();
    for rank in 0..3 {
        children.push(
            Command::new(exe)
                .args(args)
                .env("RANK", rank.to_string())
                .env("WORLD_SIZE", "3")
                .env("MASTER_ADDR", "127.0.0.1")
                .env("MASTER_PORT", &port)
                .env("TENSORWIRE_SECRET", &secret)
                .env(LAUNCHER_STORE_ENV, "1")
                .stdout(Stdio::piped())
                .spawn()
                .map_err(|e| format!("starting {exe}: {e}"))?,
        );
    }
    let mut report = None;
    for (rank, child) in children.iter_mut().enumerate() {
        let out = some(child.stdout.take(), "a worker's output")?;
        for line in BufReader::new(out).lines() {
            let line = line?;
            match line.strip_prefix("REPORT ") {
                Some(json) => report = Some(serde_json::from_str::<Report>(json)?),
                None => eprintln!("[{rank}] {line}"),
            }
        }
    }
    for (rank, mut child) in children.into_iter().enumerate() {
        let status = child.wait()?;
        if !status.success() {
            return Err(format!("worker {rank} failed: {status}").into());
        }
    }
    drop(server);
    drop(rt);
    some(report, "the trainer printed no report")
}
