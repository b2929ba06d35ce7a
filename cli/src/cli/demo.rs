//! `tensorwire demo`: a parameter server and trainers on this machine, in separate processes.
//!
//! Rank 0 is the parameter server `ps`; ranks 1.. are trainers. Every worker has two simulated
//! CUDA devices (host memory posing as GPUs, so the demo runs anywhere), and each trainer maps
//! its `cuda:0` to the server's `cuda:1`. The server creates its state with `remote` (on
//! itself) and hands the reference to every trainer inside `rpc_async` arguments; the trainers
//! call methods on it through the reference (`rref.rpc_sync`), fetching weights (which land on
//! their `cuda:0` by the server's reverse map) and sending gradients (which land on the
//! server's `cuda:1` by their map). A barrier and an all_gather end the run, and the server
//! prints a summary.

use std::process::ExitCode;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{anyhow, Context, Result};
use serde::{Deserialize, Serialize};
use tensorwire_core::device::Device;
use tensorwire_core::devices_sim::SimulatedDevices;
use tensorwire_core::ports::device::relocate;
use tensorwire_core::tensor::Tensor;
use tensorwire_rpc::{init_rpc, Functions, RRef, RpcOptions};

/// Arguments of `tensorwire demo`.
#[derive(Debug, clap::Args)]
pub(crate) struct Args {
    /// Number of trainer processes.
    #[arg(long, default_value_t = 2, value_parser = clap::value_parser!(u32).range(1..=64))]
    trainers: u32,
    /// Training steps per trainer.
    #[arg(long, default_value_t = 5, value_parser = clap::value_parser!(u32).range(1..=10_000))]
    steps: u32,
    /// Run over QUIC, each worker with a certificate for its rank issued by the launcher
    /// (`launch --quic-certs`): the workers' names are their own choice, their ranks are not.
    #[arg(long)]
    quic: bool,
    /// Run as one worker of the demo (set by the demo itself).
    #[arg(long, hide = true)]
    worker: bool,
    /// Another demo.
    #[command(subcommand)]
    kind: Option<Kind>,
}

/// The other demos.
#[derive(Debug, clap::Subcommand)]
pub(crate) enum Kind {
    /// Distributed autograd: a model split across 3 processes (parameter server, trainer, a
    /// worker in a chain), trained with the distributed optimizer and compared with the same
    /// model in one process (needs the feature `autograd-candle`).
    Autograd(AutogradArgs),
}

/// Arguments of `tensorwire demo autograd`.
#[derive(Debug, clap::Args)]
pub(crate) struct AutogradArgs {
    /// Training steps.
    #[arg(long, default_value_t = 5, value_parser = clap::value_parser!(u32).range(1..=10_000))]
    steps: u32,
    /// Print one JSON object on standard output (workers' logs go to standard error).
    #[arg(long)]
    json: bool,
    /// Run as one worker of the demo (set by the demo itself).
    #[arg(long, hide = true)]
    worker: bool,
}

#[cfg(feature = "autograd-candle")]
fn run_autograd(args: AutogradArgs) -> ExitCode {
    use tensorwire_cli::autograd_demo;
    if args.worker {
        let rt = match tokio::runtime::Builder::new_multi_thread()
            .enable_all()
            .build()
        {
            Ok(rt) => rt,
            Err(e) => {
                eprintln!("demo worker: cannot start a runtime: {e}");
                return ExitCode::FAILURE;
            }
        };
        return match rt.block_on(autograd_demo::worker(args.steps as usize)) {
            Ok(Some(report)) => match serde_json::to_string(&report) {
                Ok(json) => {
                    println!("REPORT {json}");
                    ExitCode::SUCCESS
                }
                Err(e) => {
                    eprintln!("demo worker: {e}");
                    ExitCode::FAILURE
                }
            },
            Ok(None) => ExitCode::SUCCESS,
            Err(e) => {
                eprintln!("demo worker failed: {e:#}");
                ExitCode::FAILURE
            }
        };
    }
    let exe = match std::env::current_exe() {
        Ok(p) => p.to_string_lossy().into_owned(),
        Err(e) => {
            eprintln!("tensorwire demo autograd: cannot find this program's path: {e}");
            return ExitCode::FAILURE;
        }
    };
    let worker_args: Vec<String> = vec![
        "demo".into(),
        "autograd".into(),
        "--worker".into(),
        "--steps".into(),
        args.steps.to_string(),
    ];
    match autograd_demo::run_local(&exe, &worker_args) {
        Ok(r) if args.json => match serde_json::to_string(&r) {
            Ok(json) => {
                println!("{json}");
                ExitCode::SUCCESS
            }
            Err(e) => {
                eprintln!("tensorwire demo autograd: {e}");
                ExitCode::FAILURE
            }
        },
        Ok(r) => {
            println!(
                "distributed autograd: {} workers (ps, trainer, worker), {} steps",
                r.workers, r.steps
            );
            println!("loss {:.5} -> {:.5}", r.loss_first, r.loss_last);
            println!(
                "first-step gradients vs one process: max abs diff {:.3e}; losses: max abs diff {:.3e}",
                r.max_abs_grad_diff_vs_local, r.max_abs_loss_diff_vs_local
            );
            println!(
                "backward: distributed {:.0} us, one process {:.0} us (ratio {:.1})",
                r.dist_backward_us, r.local_backward_us, r.dist_backward_over_local_backward
            );
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("tensorwire demo autograd: {e:#}");
            ExitCode::FAILURE
        }
    }
}

#[cfg(not(feature = "autograd-candle"))]
fn run_autograd(_: AutogradArgs) -> ExitCode {
    eprintln!(
        "tensorwire demo autograd: this build has no autograd engine; build with \
         `--features autograd-candle`"
    );
    ExitCode::from(2)
}

pub(crate) fn run(args: Args) -> ExitCode {
    if let Some(Kind::Autograd(a)) = args.kind {
        return run_autograd(a);
    }
    if args.worker {
        return match worker(&args) {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => {
                eprintln!("demo worker failed: {e:#}");
                ExitCode::FAILURE
            }
        };
    }
    let exe = match std::env::current_exe() {
        Ok(p) => p.to_string_lossy().into_owned(),
        Err(e) => {
            eprintln!("tensorwire demo: cannot find this program's path: {e}");
            return ExitCode::FAILURE;
        }
    };
    println!(
        "tensorwire demo: 1 parameter server + {} trainers, {} steps each, on 127.0.0.1 (simulated GPUs)",
        args.trainers, args.steps
    );
    let mut command = vec![
        exe,
        "demo".into(),
        "--worker".into(),
        "--trainers".into(),
        args.trainers.to_string(),
        "--steps".into(),
        args.steps.to_string(),
    ];
    let mut launch = crate::cli::launch::Args::local(args.trainers + 1, Vec::new());
    // The CA of a QUIC demo: made for this run, its key read by the launcher only.
    let ca_dir = args.quic.then(|| {
        std::env::temp_dir().join(format!(
            "tensorwire-demo-ca-{}-{}",
            std::process::id(),
            rand::random::<u64>()
        ))
    });
    if let Some(dir) = &ca_dir {
        command.push("--quic".into());
        launch = launch.with_quic_certs(dir.clone());
    }
    launch.command = command;
    let code = crate::cli::launch::run(launch);
    if let Some(dir) = &ca_dir {
        let _ = std::fs::remove_dir_all(dir);
    }
    code
}

const DIM: usize = 8;
const LR: f32 = 0.25;

/// The server's state, kept on its `cuda:1`.
struct ParamServer {
    backend: Arc<SimulatedDevices>,
    weights: tokio::sync::Mutex<Tensor>,
    version: Mutex<u64>,
}

impl Serialize for ParamServer {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let version = *self
            .version
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        version.serialize(s)
    }
}

/// What a trainer reports back.
#[derive(Debug, Serialize, Deserialize)]
struct Report {
    trainer: String,
    first_loss: f32,
    last_loss: f32,
    weights_landed_on: String,
    last_version: u64,
}

fn env_usize(name: &str) -> Result<usize> {
    std::env::var(name)
        .with_context(|| format!("{name} is not set (run through `tensorwire demo`)"))?
        .parse()
        .with_context(|| format!("{name} is not a number"))
}

async fn host_values(backend: &SimulatedDevices, t: &Tensor) -> Result<Vec<f32>, String> {
    let host = relocate(backend, t, Device::Cpu)
        .await
        .map_err(|e| e.to_string())?;
    host.to_f32_vec()
        .ok_or_else(|| "not an f32 tensor".to_owned())
}

fn functions(backend: Arc<SimulatedDevices>, steps: u32) -> Functions {
    let f = Functions::new();
    let b = Arc::clone(&backend);
    f.register("make_ps", move |dim: usize| {
        let b = Arc::clone(&b);
        async move {
            let zeros = Tensor::from_f32(vec![dim], &vec![0.0; dim]).map_err(|e| e.to_string())?;
            let on_gpu = relocate(&*b, &zeros, Device::Cuda(1))
                .await
                .map_err(|e| e.to_string())?;
            Ok::<_, String>(ParamServer {
                backend: b,
                weights: tokio::sync::Mutex::new(on_gpu),
                version: Mutex::new(0),
            })
        }
    })
    .expect("each name is registered once");
    f.register_method("get_weights", |ps: Arc<ParamServer>, (): ()| async move {
        Ok::<_, String>(ps.weights.lock().await.clone())
    })
    .expect("each name is registered once");
    f.register_method(
        "apply_gradient",
        |ps: Arc<ParamServer>, grad: Tensor| async move {
            let arrived = grad.device();
            let g = host_values(&ps.backend, &grad).await?;
            let mut w = ps.weights.lock().await;
            let mut values = host_values(&ps.backend, &w).await?;
            for (v, d) in values.iter_mut().zip(&g) {
                *v -= LR * d;
            }
            let updated =
                Tensor::from_f32(vec![values.len()], &values).map_err(|e| e.to_string())?;
            *w = relocate(&*ps.backend, &updated, Device::Cuda(1))
                .await
                .map_err(|e| e.to_string())?;
            let mut version = ps
                .version
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            *version += 1;
            Ok::<_, String>((*version, arrived.to_string()))
        },
    )
    .expect("each name is registered once");
    let b = Arc::clone(&backend);
    f.register("train", move |ps: RRef<ParamServer>| {
        let b = Arc::clone(&b);
        async move {
            let me = format!("trainer{}", std::env::var("RANK").unwrap_or_default());
            let target = vec![1.0f32; DIM];
            let (mut first_loss, mut last_loss, mut landed, mut last_version) = (None, 0.0, String::new(), 0);
            for step in 1..=steps {
                let w: Tensor = ps.rpc_sync("get_weights", &(), None).await.map_err(|e| e.to_string())?;
                landed = w.device().to_string();
                let values = host_values(&b, &w).await?;
                let grad: Vec<f32> = values.iter().zip(&target).map(|(w, t)| w - t).collect();
                let loss: f32 = grad.iter().map(|g| g * g).sum::<f32>() / DIM as f32;
                first_loss.get_or_insert(loss);
                last_loss = loss;
                let grad = Tensor::from_f32(vec![DIM], &grad).map_err(|e| e.to_string())?;
                let grad = relocate(&*b, &grad, Device::Cuda(0)).await.map_err(|e| e.to_string())?;
                let (version, arrived): (u64, String) = ps.rpc_sync("apply_gradient", &grad, None).await.map_err(|e| e.to_string())?;
                last_version = version;
                println!("{me} step {step}: loss {loss:.4}; weights arrived on {landed}, gradient sent from cuda:0 landed on ps:{arrived}; server version {version}");
            }
            Ok::<_, String>(Report { trainer: me, first_loss: first_loss.unwrap_or(0.0), last_loss, weights_landed_on: landed, last_version })
        }
    }).expect("each name is registered once");
    f
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn worker(args: &Args) -> Result<()> {
    let (rank, world) = (env_usize("RANK")?, env_usize("WORLD_SIZE")?);
    let name = if rank == 0 {
        "ps".to_owned()
    } else {
        format!("trainer{rank}")
    };
    let backend = Arc::new(SimulatedDevices::new(2));
    let mut options = RpcOptions {
        functions: functions(Arc::clone(&backend), args.steps),
        device_backend: backend,
        ..RpcOptions::default()
    };
    if rank != 0 {
        options.set_device_map("ps", &[("cuda:0", "cuda:1")])?;
    }
    if args.quic {
        // The folder comes from the launcher (`TENSORWIRE_TLS_DIR`): `ca.pem` and this
        // worker's `rank-N` certificate, which certifies whatever name it takes.
        options = options.with_backend("QUIC");
    }
    let started = Instant::now();
    let agent = init_rpc(&name, rank, Some(world), options).await?;
    println!(
        "{name}: joined a group of {world} in {} ms; handles devices {:?}",
        started.elapsed().as_millis(),
        agent
            .devices()
            .iter()
            .map(ToString::to_string)
            .collect::<Vec<_>>()
    );

    let mut reports = Vec::new();
    if rank == 0 {
        let ps: RRef<ParamServer> = agent.remote("ps", "make_ps", &DIM, None)?;
        let calls: Vec<_> = (1..world as u32)
            .map(|t| agent.rpc_async::<_, Report>(t, "train", &ps, None))
            .collect::<Result<_, _>>()?;
        for c in calls {
            reports.push(c.await?);
        }
        let state = ps.local_value().await?;
        let weights = state.weights.lock().await.clone();
        let values = host_values(&state.backend, &weights)
            .await
            .map_err(|e| anyhow!(e))?;
        let mean = values.iter().sum::<f32>() / values.len() as f32;
        println!(
            "ps: weights live on {}; mean weight {mean:.4} (target 1.0)",
            weights.device()
        );
    }
    agent
        .barrier("demo-trained", Duration::from_secs(60))
        .await?;
    let devices: Vec<String> = agent
        .all_gather(
            "demo-devices",
            &format!(
                "{name}: {:?}",
                agent
                    .devices()
                    .iter()
                    .map(ToString::to_string)
                    .collect::<Vec<_>>()
            ),
            Duration::from_secs(60),
        )
        .await?;
    if rank == 0 {
        println!("---- summary ----");
        for r in &reports {
            println!(
                "{}: loss {:.4} -> {:.4} (weights landed on {}, last server version {})",
                r.trainer, r.first_loss, r.last_loss, r.weights_landed_on, r.last_version
            );
        }
        println!("devices by worker (all_gather): {}", devices.join("; "));
        let improved = reports.iter().all(|r| r.last_loss < r.first_loss);
        println!(
            "training {}; {} RPC workers; total {} ms",
            if improved {
                "converged"
            } else {
                "did NOT converge"
            },
            world,
            started.elapsed().as_millis()
        );
        if !improved {
            return Err(anyhow!("the loss did not go down"));
        }
    }
    agent
        .shutdown(tensorwire_rpc::Shutdown::graceful(Duration::from_secs(30)))
        .await?;
    Ok(())
}
