//! Groups of processes with this one as rank 0, and the hidden `bench curve-worker` that is
//! each other rank.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use tensorwire_rpc::{init_rpc, Agent, RpcOptions};

use super::super::bench_common::runtime;
use super::super::bench_rpc::functions;
use super::CurveWorkerArgs;

/// A group whose rank 0 is this process: the store it serves, the other ranks' processes.
pub(crate) struct Group {
    pub(crate) agent: Agent,
    children: Vec<Child>,
    /// Wall time from starting the first process until every rank returned from `init_rpc`.
    pub(super) init_wall: Duration,
    /// How long `init_rpc` took in this process (rank 0).
    pub(super) init_rank0: Duration,
    /// The longest `init_rpc` of the other ranks, each timed in its own process.
    pub(super) init_slowest_other: Duration,
    _store: tensorwire_store::TcpStoreServer,
}

impl Drop for Group {
    fn drop(&mut self) {
        for c in &mut self.children {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// Sets the transport of this process's next group and of the ranks it starts. Called while
/// no group is up; the environment is read when an agent listens and dials.
pub(super) fn set_transport(transport: &str) {
    std::env::set_var("TENSORWIRE_TRANSPORT", transport);
}

/// Starts a group of `world` processes on 127.0.0.1 (this one rank 0) with a fresh secret.
pub(super) async fn start_group(world: usize, timeout: Duration) -> Result<Group> {
    start_group_with(world, timeout, &[]).await
}

/// [`start_group`], with `extra` arguments for the other ranks' `bench curve-worker`.
pub(crate) async fn start_group_with(
    world: usize,
    timeout: Duration,
    extra: &[&str],
) -> Result<Group> {
    use tensorwire_store::{ClusterSecret, ServerConfig, TcpStoreServer};
    let secret = format!("{:032x}", rand::random::<u128>());
    let store = TcpStoreServer::bind(
        SocketAddr::from(([127, 0, 0, 1], 0)),
        ServerConfig {
            secret: Some(ClusterSecret::new(secret.as_bytes().to_vec())?),
            ..ServerConfig::default()
        },
    )
    .await
    .context("serving the store")?;
    let port = store.local_addr().port();
    let exe = std::env::current_exe().context("finding this executable")?;
    let started = Instant::now();
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel::<(usize, Result<Duration, String>)>();
    let mut children = Vec::with_capacity(world - 1);
    for rank in 1..world {
        let mut child = Command::new(&exe)
            .args(["bench", "curve-worker"])
            .args(["--rank", &rank.to_string(), "--world", &world.to_string()])
            .args(["--port", &port.to_string()])
            .args(["--timeout", &timeout.as_secs().to_string()])
            .args(extra)
            .env("TENSORWIRE_BENCH_SECRET", &secret)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .spawn()
            .context("starting a rank")?;
        let out = child.stdout.take().context("a rank's output")?;
        let tx = tx.clone();
        std::thread::spawn(move || {
            let mut said = None;
            for line in BufReader::new(out).lines() {
                let Ok(line) = line else { break };
                if let Some(us) = line.strip_prefix("INIT ").and_then(|s| s.parse().ok()) {
                    said = Some(Duration::from_micros(us));
                    break;
                }
            }
            let _ = tx.send((
                rank,
                said.ok_or_else(|| format!("rank {rank} ended before its init finished")),
            ));
        });
        children.push(child);
    }
    drop(tx);
    let t = Instant::now();
    let agent = init_rpc(
        "w0",
        0,
        Some(world),
        options(port, 0, world, secret.as_bytes(), timeout),
    )
    .await
    .with_context(|| format!("init_rpc of rank 0 of {world}"))?;
    let init_rank0 = t.elapsed();
    let mut slowest = Duration::ZERO;
    let deadline = Instant::now() + timeout;
    // Waited for on the runtime: rank 0's agent keeps serving the others meanwhile.
    for _ in 1..world {
        let left = deadline.saturating_duration_since(Instant::now());
        let (_, took) = tokio::time::timeout(left, rx.recv())
            .await
            .ok()
            .flatten()
            .context("a rank did not say its init finished in time")?;
        slowest = slowest.max(took.map_err(anyhow::Error::msg)?);
    }
    Ok(Group {
        agent,
        children,
        init_wall: started.elapsed(),
        init_rank0,
        init_slowest_other: slowest,
        _store: store,
    })
}

impl Group {
    /// Shuts the group down gracefully and checks that every rank exited successfully.
    pub(crate) async fn finish(mut self, timeout: Duration) -> Result<()> {
        self.agent
            .shutdown(tensorwire_rpc::Shutdown::graceful(timeout))
            .await?;
        let deadline = Instant::now() + timeout;
        // Each exit is waited for on a blocking thread (a process gives no future to await);
        // a rank still running at the deadline is killed by its pid.
        let waits: Vec<_> = std::mem::take(&mut self.children)
            .into_iter()
            .map(|mut child| {
                let pid = rustix::process::Pid::from_child(&child);
                (pid, tokio::task::spawn_blocking(move || child.wait()))
            })
            .collect();
        let mut failure = None;
        for (i, (pid, wait)) in waits.into_iter().enumerate() {
            let left = deadline.saturating_duration_since(Instant::now());
            match tokio::time::timeout(left, wait).await {
                Ok(status) => {
                    let status = status??;
                    if !status.success() && failure.is_none() {
                        failure = Some(format!("rank {} failed ({status})", i + 1));
                    }
                }
                Err(_) => {
                    let _ = rustix::process::kill_process(pid, rustix::process::Signal::KILL);
                    failure.get_or_insert(format!("rank {} did not exit", i + 1));
                }
            }
        }
        if let Some(failure) = failure {
            bail!(failure);
        }
        self.children.clear();
        Ok(())
    }
}

fn options(port: u16, rank: usize, world: usize, secret: &[u8], timeout: Duration) -> RpcOptions {
    RpcOptions {
        init_method: format!("tcp://127.0.0.1:{port}?rank={rank}&world_size={world}"),
        init_timeout: timeout,
        secret: Some(secret.to_vec()),
        functions: functions(),
        ..RpcOptions::default()
    }
}

/// `bench curve-worker`: a rank that serves calls until the group shuts down, or a process of
/// the raw rendezvous.
pub(crate) fn worker(args: &CurveWorkerArgs) -> Result<()> {
    if let Some(addr) = args.raw_rendezvous {
        let mut s = TcpStream::connect(addr)?;
        s.write_all(&[1])?;
        let mut go = [0u8; 1];
        s.read_exact(&mut go)?;
        return Ok(());
    }
    let secret =
        std::env::var("TENSORWIRE_BENCH_SECRET").context("a rank needs TENSORWIRE_BENCH_SECRET")?;
    let timeout = Duration::from_secs(args.timeout);
    runtime(1)?.block_on(async move {
        let t = Instant::now();
        let agent = init_rpc(
            &format!("w{}", args.rank),
            args.rank,
            Some(args.world),
            options(args.port, args.rank, args.world, secret.as_bytes(), timeout),
        )
        .await?;
        println!("INIT {}", t.elapsed().as_micros());
        std::io::stdout().flush()?;
        #[cfg(feature = "autograd-candle")]
        let _dist = if args.autograd {
            let dist = super::super::bench_autograd::serve(&agent, args.rank)?;
            agent
                .barrier(super::super::bench_autograd::READY_BARRIER, timeout)
                .await?;
            Some(dist)
        } else {
            None
        };
        #[cfg(not(feature = "autograd-candle"))]
        if args.autograd {
            bail!("built without the `autograd-candle` feature");
        }
        agent
            .shutdown(tensorwire_rpc::Shutdown::graceful(Duration::from_secs(
                3600,
            )))
            .await?;
        Ok(())
    })
}
