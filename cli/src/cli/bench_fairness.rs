//! `tensorwire bench fairness`: an honest caller's latency while another peer floods the same
//! worker, against the same caller's latency without a flood, measured in one run.
//!
//! Three agents on loopback TCP, each on a runtime (an OS thread) of its own: `w0` serves, `w1`
//! calls it (`rpc_sync` of a small value, one after the other) and `w2` floods it. Three phases:
//!
//! - `none`: no flood (the baseline);
//! - `unread`: `w2` stops reading and sends `--in-flight / 8` calls whose replies are 64 KiB
//!   each every 10 ms, whatever comes back: its replies wait unread at `w0` (which holds its
//!   requests past the hold mark; without holding, `w0` runs them all until its queue for `w2`
//!   passes the budget and it drops `w2`);
//! - `requests`: `w2` reads, and keeps `--in-flight` small calls outstanding (a request flood:
//!   `w0` runs at most `RUNNING_PER_PEER` of them at once, in turn with `w1`'s).
//!
//! The flooder's thread runs at `--flooder-nice` (19): it stands for a peer on another host,
//! whose own work is not the victim's cost.
//!
//! Reported: p50 and p99 of `w1`'s calls in each phase and each flood's ratio to `none` (the
//! goal: p99 within 2x). Absolute times on a shared machine are noise; the ratios are the point.

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use serde_json::{json, Map};
use tensorwire_core::ports::transport::{
    Connection, IdentityError, Listener, Transport, TransportError,
};
use tensorwire_core::wire::Frame;
use tensorwire_rpc::{start_agent, Agent, Functions, Rendezvous, RpcOptions};

use super::bench_common::{percentile, write_json};

/// Arguments of `tensorwire bench fairness`.
#[derive(Debug, clap::Args)]
pub(crate) struct FairnessArgs {
    /// The honest caller's calls per phase.
    #[arg(long, default_value_t = 2000)]
    calls: usize,
    /// Calls the flooding peer keeps outstanding.
    #[arg(long, default_value_t = 1024)]
    in_flight: usize,
    /// The nice value of the flooding peer's thread. It stands for a peer on another host:
    /// in this one process its own work (making requests) would otherwise take the CPU the
    /// flood is meant to cost the victim, which is what is measured. 0 to compete equally.
    #[arg(long, default_value_t = 19, allow_negative_numbers = true)]
    flooder_nice: i32,
    /// Turn the victim's holding off (hold mark and running share without bound): the
    /// figures of a worker that runs every request it reads, for comparison in one run.
    #[arg(long)]
    no_hold: bool,
    /// Write the results as one JSON object to this file (else to standard output).
    #[arg(long)]
    json: Option<PathBuf>,
}

/// Each reply of the `unread` flood.
const BULK: usize = 64 << 10;

pub(crate) fn run(args: &FairnessArgs) -> Result<()> {
    let nice = args.flooder_nice;
    let runtimes: Vec<tokio::runtime::Runtime> = (0..3)
        .map(|rank| {
            let mut b = tokio::runtime::Builder::new_multi_thread();
            b.worker_threads(1).enable_all();
            if rank == 2 {
                // On Linux a nice value is a thread's: this one's only.
                b.on_thread_start(move || {
                    let _ = rustix::process::setpriority_process(None, nice);
                });
            }
            b.build()
        })
        .collect::<std::io::Result<_>>()?;
    let main = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let gate = Arc::new(AtomicBool::new(true));
    let opened = Arc::new(tokio::sync::Notify::new());
    let secret: [u8; 32] = rand::random();
    let secret = tensorwire_transport_tcp::ClusterSecret::new(secret.to_vec())?;
    let store: Arc<dyn tensorwire_core::ports::store::Store> =
        Arc::new(tensorwire_store::InMemoryStore::new());
    let starts: Vec<_> = runtimes
        .iter()
        .enumerate()
        .map(|(rank, rt)| {
            let tcp = tensorwire_transport_tcp::TcpTransport::new(
                tensorwire_transport_tcp::TcpConfig::new(secret.clone()),
            );
            let (gate, opened, store) = (gate.clone(), opened.clone(), store.clone());
            rt.spawn(async move {
                let tcp = tcp?;
                let transport: Arc<dyn Transport> = if rank == 2 {
                    Arc::new(Gated {
                        inner: tcp,
                        gate,
                        opened,
                    })
                } else {
                    Arc::new(tcp)
                };
                let options = RpcOptions {
                    listen_ip: Some(std::net::Ipv4Addr::LOCALHOST.into()),
                    init_timeout: Duration::from_secs(60),
                    ..RpcOptions::new().with_functions(functions())
                };
                let rdv = Rendezvous::from_store(store, rank, 3);
                let agent =
                    start_agent(transport, rdv, &format!("w{rank}"), rank, Some(3), options)
                        .await?;
                Ok::<_, anyhow::Error>(agent)
            })
        })
        .collect();
    let agents: Vec<Agent> = main.block_on(async {
        let mut agents = Vec::new();
        for s in starts {
            agents.push(s.await.context("an agent's task")??);
        }
        Ok::<_, anyhow::Error>(agents)
    })?;

    if args.no_hold {
        let budget = agents[0].budget();
        budget.set_hold_mark(usize::MAX);
        budget.set_running_cap(usize::MAX);
    }
    let mut out = Map::new();
    let mut p99 = Vec::new();
    let mut lost = None;
    // The never-reading flood last: without holding, it ends with w2 dropped.
    for phase in ["none", "requests", "unread"] {
        let stop = Arc::new(AtomicBool::new(false));
        let flood = match phase {
            "none" => None,
            _ => {
                let unread = phase == "unread";
                if unread {
                    gate.store(false, Ordering::Release);
                }
                Some(runtimes[2].spawn(flood(
                    agents[2].clone(),
                    unread,
                    args.in_flight,
                    stop.clone(),
                )))
            }
        };
        // The flood is under way before the first measured call.
        let honest = agents[1].clone();
        let calls = args.calls;
        let samples = main.block_on(async {
            if flood.is_some() {
                tokio::time::sleep(Duration::from_millis(300)).await;
            }
            runtimes[1]
                .spawn(async move {
                    let mut samples = Vec::with_capacity(calls);
                    for i in 0..calls as u32 {
                        let t = Instant::now();
                        let back: u32 = honest.rpc_sync("w0", "ping", &i, None).await?;
                        samples.push(t.elapsed());
                        anyhow::ensure!(back == i, "ping {i} came back as {back}");
                    }
                    Ok::<_, anyhow::Error>(samples)
                })
                .await
                .context("the honest caller's task")?
        })?;
        stop.store(true, Ordering::Release);
        gate.store(true, Ordering::Release);
        opened.notify_waiters();
        let flooded = match flood {
            Some(f) => main.block_on(f).context("the flood's task")??,
            None => 0,
        };
        let held = agents[0].budget().peak(2);
        if !agents[0].connections().iter().any(|c| c.peer.id == 2) {
            // Dropped (past its budget): the next flood cannot run.
            lost.get_or_insert(phase);
        }
        let mut sorted = samples;
        sorted.sort();
        let (p50, p99_us) = (percentile(&sorted, 0.5), percentile(&sorted, 0.99));
        p99.push(p99_us);
        out.insert(
            phase.to_owned(),
            json!({
                "p50_us": p50,
                "p99_us": p99_us,
                "max_us": percentile(&sorted, 1.0),
                "calls": sorted.len(),
                "flood_calls_answered": flooded,
                "w0_peak_bytes_held_for_w2": held,
            }),
        );
    }
    out.insert("w2_dropped_in".into(), json!(lost));
    out.insert(
        "ratios".into(),
        json!({
            "p99_unread_over_none": p99[2] / p99[0],
            "p99_requests_over_none": p99[1] / p99[0],
        }),
    );
    out.insert(
        "setup".into(),
        json!({
            "transport": "tcp",
            "calls": args.calls,
            "in_flight": args.in_flight,
            "flooder_nice": args.flooder_nice,
            "holding": !args.no_hold,
            "unread_reply_bytes": BULK,
            "hold_mark_bytes": if args.no_hold { None } else { Some(agents[0].budget().limit() / tensorwire_core::budget::HOLD_REQUESTS_FRACTION) },
            "running_per_peer": tensorwire_core::budget::RUNNING_PER_PEER,
        }),
    );
    for agent in agents {
        main.block_on(agent.shutdown(tensorwire_rpc::Shutdown::Immediate))
            .ok();
    }
    write_json(&out, args.json.as_ref())
}

fn functions() -> Functions {
    let f = Functions::new();
    let ok = f
        .register("ping", |x: u32| async move { Ok::<_, String>(x) })
        .and_then(|()| {
            f.register(
                "bulk",
                |_: u32| async move { Ok::<_, String>(vec![7u8; BULK]) },
            )
        });
    debug_assert!(ok.is_ok(), "each name is registered once");
    f
}

/// Floods `w0` from `w2` until `stop`. While it does not read (`unread`): `in_flight / 8` new
/// `bulk` calls every 10 ms, whatever came back (nothing does), so that the victim's queue for
/// it would pass any budget; else it keeps `in_flight` `ping` calls outstanding. Returns how
/// many calls were answered.
async fn flood(
    agent: Agent,
    unread: bool,
    in_flight: usize,
    stop: Arc<AtomicBool>,
) -> Result<usize> {
    let answered = Arc::new(AtomicUsize::new(0));
    let mut calls = tokio::task::JoinSet::new();
    let mut i = 0u32;
    while !stop.load(Ordering::Acquire) {
        if unread {
            for _ in 0..(in_flight / 8).max(1) {
                let answered = answered.clone();
                let Ok(call) = agent.rpc_async::<_, Vec<u8>>("w0", "bulk", &i, None) else {
                    // The victim dropped it (its budget): the flood is over.
                    break;
                };
                calls.spawn(async move {
                    if call.await.is_ok() {
                        answered.fetch_add(1, Ordering::Relaxed);
                    }
                });
                i = i.wrapping_add(1);
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
            continue;
        }
        while calls.len() < in_flight && !stop.load(Ordering::Acquire) {
            let answered = answered.clone();
            let call = agent.rpc_async::<_, u32>("w0", "ping", &i, None)?;
            calls.spawn(async move {
                if call.await.is_ok() {
                    answered.fetch_add(1, Ordering::Relaxed);
                }
            });
            i = i.wrapping_add(1);
        }
        let _ = tokio::time::timeout(Duration::from_millis(20), calls.join_next()).await;
    }
    while calls.join_next().await.is_some() {}
    Ok(answered.load(Ordering::Relaxed))
}

/// TCP whose connections read only while `gate` is set (the peer that stops reading).
struct Gated {
    inner: tensorwire_transport_tcp::TcpTransport,
    gate: Arc<AtomicBool>,
    opened: Arc<tokio::sync::Notify>,
}

struct GatedListener {
    inner: Box<dyn Listener>,
    gate: Arc<AtomicBool>,
    opened: Arc<tokio::sync::Notify>,
}

struct GatedConnection {
    inner: Box<dyn Connection>,
    gate: Arc<AtomicBool>,
    opened: Arc<tokio::sync::Notify>,
}

#[async_trait::async_trait]
impl Transport for Gated {
    fn name(&self) -> &'static str {
        self.inner.name()
    }

    async fn listen(
        &self,
        addr: std::net::SocketAddr,
    ) -> Result<Box<dyn Listener>, TransportError> {
        Ok(Box::new(GatedListener {
            inner: self.inner.listen(addr).await?,
            gate: self.gate.clone(),
            opened: self.opened.clone(),
        }))
    }

    async fn connect(
        &self,
        addr: std::net::SocketAddr,
    ) -> Result<Box<dyn Connection>, TransportError> {
        Ok(Box::new(GatedConnection {
            inner: self.inner.connect(addr).await?,
            gate: self.gate.clone(),
            opened: self.opened.clone(),
        }))
    }
}

#[async_trait::async_trait]
impl Listener for GatedListener {
    fn local_addr(&self) -> std::net::SocketAddr {
        self.inner.local_addr()
    }

    async fn accept(&self) -> Result<Box<dyn Connection>, TransportError> {
        Ok(Box::new(GatedConnection {
            inner: self.inner.accept().await?,
            gate: self.gate.clone(),
            opened: self.opened.clone(),
        }))
    }
}

#[async_trait::async_trait]
impl Connection for GatedConnection {
    fn peer_addr(&self) -> std::net::SocketAddr {
        self.inner.peer_addr()
    }

    fn transport(&self) -> &'static str {
        self.inner.transport()
    }

    fn check_peer_name(&self, name: &str) -> Result<(), IdentityError> {
        self.inner.check_peer_name(name)
    }

    fn peer_credentials(&self) -> tensorwire_core::identity::Credentials {
        self.inner.peer_credentials()
    }

    fn bill_to(&self, account: tensorwire_core::budget::Account) {
        self.inner.bill_to(account);
    }

    async fn send(&self, frame: Frame) -> Result<(), TransportError> {
        self.inner.send(frame).await
    }

    async fn send_many(&self, frames: Vec<Frame>) -> Result<(), TransportError> {
        self.inner.send_many(frames).await
    }

    async fn recv(&self) -> Result<Frame, TransportError> {
        loop {
            let opened = self.opened.notified();
            tokio::pin!(opened);
            opened.as_mut().enable();
            if self.gate.load(Ordering::Acquire) {
                break;
            }
            opened.await;
        }
        self.inner.recv().await
    }

    async fn close(&self) -> Result<(), TransportError> {
        self.inner.close().await
    }
}
