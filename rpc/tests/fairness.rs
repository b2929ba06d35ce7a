//! Fairness: while a peer that never reads floods the victim with requests, the victim stops
//! running them once their replies wait unread (its budget holds the peer's requests:
//! `tensorwire_core::budget::Ledger::holds_requests`), so an honest peer's calls keep being
//! served at once; when the peer reads again, its held requests run, in order, and every one
//! of its calls succeeds. Real TCP on loopback.

use std::future::Future;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use tensorwire_core::ports::transport::{
    Connection, IdentityError, Listener, Transport, TransportError,
};
use tensorwire_core::wire::Frame;
use tensorwire_rpc::{start_agent, Functions, Rendezvous, RpcOptions};
use tensorwire_store::InMemoryStore;
use tensorwire_transport_tcp::{ClusterSecret, TcpConfig, TcpTransport};

const TEST_BOUND: Duration = Duration::from_secs(120);
/// The victim's budget per peer: requests are held from an eighth of it (2 MiB) unread.
const BUDGET: usize = 16 << 20;
/// Each flood reply's size.
const REPLY: usize = 64 << 10;
/// The flood's requests: their replies (64 MiB) would pass the budget four times over.
const FLOOD: usize = 1024;

async fn bounded<T>(f: impl Future<Output = T>) -> T {
    tokio::time::timeout(TEST_BOUND, f)
        .await
        .expect("test took too long")
}

/// TCP whose connections read only while the gate is open.
struct Gated {
    inner: TcpTransport,
    open: tokio::sync::watch::Sender<bool>,
}

struct GatedListener {
    inner: Box<dyn Listener>,
    open: tokio::sync::watch::Receiver<bool>,
}

struct GatedConnection {
    inner: Box<dyn Connection>,
    open: tokio::sync::watch::Receiver<bool>,
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
            open: self.open.subscribe(),
        }))
    }

    async fn connect(
        &self,
        addr: std::net::SocketAddr,
    ) -> Result<Box<dyn Connection>, TransportError> {
        Ok(Box::new(GatedConnection {
            inner: self.inner.connect(addr).await?,
            open: self.open.subscribe(),
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
            open: self.open.clone(),
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
        let mut open = self.open.clone();
        let _ = open.wait_for(|o| *o).await;
        self.inner.recv().await
    }

    async fn close(&self) -> Result<(), TransportError> {
        self.inner.close().await
    }
}

/// `ping` answers at once; `bulk` answers `REPLY` bytes, counting its runs.
fn functions(runs: Arc<AtomicUsize>) -> Functions {
    let f = Functions::new();
    f.register("ping", |x: u32| async move { Ok::<_, String>(x) })
        .unwrap();
    f.register("bulk", move |_: u32| {
        runs.fetch_add(1, Ordering::Relaxed);
        async move { Ok::<_, String>(vec![7u8; REPLY]) }
    })
    .unwrap();
    f
}

/// Three agents on loopback TCP with `BUDGET` per peer; `w2` reads while `open` says so.
async fn cluster(
    runs: &Arc<AtomicUsize>,
) -> (Vec<tensorwire_rpc::Agent>, tokio::sync::watch::Sender<bool>) {
    let store: Arc<dyn tensorwire_core::ports::store::Store> = Arc::new(InMemoryStore::new());
    let secret = ClusterSecret::new(b"fairness test secret".to_vec()).unwrap();
    let (open, _) = tokio::sync::watch::channel(true);
    let world = 3;
    let mut tasks = Vec::new();
    for rank in 0..world {
        let tcp = TcpTransport::new(TcpConfig::new(secret.clone())).unwrap();
        let transport: Arc<dyn Transport> = if rank == 2 {
            Arc::new(Gated {
                inner: tcp,
                open: open.clone(),
            })
        } else {
            Arc::new(tcp)
        };
        let options = RpcOptions::new()
            .with_functions(functions(Arc::clone(runs)))
            .with_peer_budget(BUDGET);
        let options = RpcOptions {
            listen_ip: Some(std::net::Ipv4Addr::LOCALHOST.into()),
            init_timeout: Duration::from_secs(30),
            ..options
        };
        let rdv = Rendezvous::from_store(Arc::clone(&store), rank, world);
        tasks.push(tokio::spawn(async move {
            start_agent(
                transport,
                rdv,
                &format!("w{rank}"),
                rank,
                Some(world),
                options,
            )
            .await
        }));
    }
    let mut agents = Vec::new();
    for t in tasks {
        agents.push(t.await.unwrap().unwrap());
    }
    (agents, open)
}

/// Starts `FLOOD` calls of `w2` to `w0` with `w2` no longer reading, and waits until `w0`
/// holds its requests.
async fn flood_until_held(
    agents: &[tensorwire_rpc::Agent],
    open: &tokio::sync::watch::Sender<bool>,
    runs: &AtomicUsize,
) -> Vec<tensorwire_rpc::RpcFuture<Vec<u8>>> {
    open.send_replace(false);
    let timeout = Some(Duration::from_secs(60));
    let flood: Vec<_> = (0..FLOOD)
        .map(|i| {
            agents[2]
                .rpc_async::<_, Vec<u8>>("w0", "bulk", &(i as u32), timeout)
                .unwrap()
        })
        .collect();
    until_held(&agents[0], runs).await;
    flood
}

/// Waits (60 s at most) until `victim` holds requests of w2's. The budget tells no one when it
/// starts holding, so this looks every 5 ms of real time: the kernel's socket buffers, not a
/// clock the test could pause, decide when that is.
async fn until_held(victim: &tensorwire_rpc::Agent, runs: &AtomicUsize) {
    let started = Instant::now();
    while victim.budget().held(2).requests == 0 {
        assert!(
            started.elapsed() < Duration::from_secs(60),
            "w2's requests are not held though it reads nothing; {} ran, {:?}",
            runs.load(Ordering::Relaxed),
            victim.budget().held(2)
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_peer_that_does_not_read_its_replies_has_its_requests_held_and_honest_calls_go_on() {
    bounded(async {
        let runs = Arc::new(AtomicUsize::new(0));
        let (agents, open) = cluster(&runs).await;
        let (victim, honest) = (&agents[0], &agents[1]);
        let _: u32 = honest.rpc_sync("w0", "ping", &1u32, None).await.unwrap();
        // w2 stops reading and asks w0 for far more than its budget would queue: w0 holds
        // w2's requests once their replies wait unread.
        let flood = flood_until_held(&agents, &open, &runs).await;
        // Meanwhile honest calls are served while w2 still reads nothing: each one is answered
        // while most of the flood waits (before, they waited behind it, and w2 never reading,
        // they would never have been answered). No clock: a loaded machine slows both alike.
        // The held count itself may touch zero for a moment: the kernel's receive buffer for
        // w2 grows by autotuning (up to `tcp_rmem`'s maximum, 32 MiB on some hosts), and each
        // time it takes more of the unread replies w0 lets a few more requests run.
        for i in 0..50u32 {
            let back: u32 = honest.rpc_sync("w0", "ping", &i, None).await.unwrap();
            assert_eq!(back, i);
            let ran = runs.load(Ordering::Relaxed);
            assert!(
                ran < FLOOD,
                "honest call {i} was answered only once all {ran} flood requests had run"
            );
        }
        // And w0 still holds w2's requests: its replies wait unread.
        until_held(victim, &runs).await;
        // Nothing more of the flood ran since, and the held requests stay within the budget:
        // the peer is held, not dropped.
        let ran = runs.load(Ordering::Relaxed);
        assert!(ran < FLOOD, "all {ran} flood requests ran");
        let held = victim.budget().held(2);
        assert!(held.total() <= BUDGET, "{held:?}");
        assert!(victim.connections().iter().any(|c| c.peer.id == 2));

        // w2 reads again: its queue drains, its held requests run in turn, and every one of
        // its calls gets its reply.
        open.send_replace(true);
        for call in flood {
            assert_eq!(call.await.unwrap().len(), REPLY);
        }
        assert_eq!(runs.load(Ordering::Relaxed), FLOOD);
        assert_eq!(victim.budget().held(2).requests, 0);
        drop(agents);
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_held_requests_of_a_peer_that_is_lost_are_dropped_and_their_bytes_freed() {
    bounded(async {
        let runs = Arc::new(AtomicUsize::new(0));
        let (mut agents, open) = cluster(&runs).await;
        let flood = flood_until_held(&agents, &open, &runs).await;
        let ran = runs.load(Ordering::Relaxed);
        // w2 goes away with its requests held at w0: they never run, and w0 holds nothing
        // for it any more.
        let flooder = agents.pop().unwrap();
        flooder
            .shutdown(tensorwire_rpc::Shutdown::Immediate)
            .await
            .ok();
        drop(flood);
        let started = Instant::now();
        while agents[0].budget().held(2) != tensorwire_core::budget::Held::default() {
            assert!(
                started.elapsed() < Duration::from_secs(60),
                "w0 still holds {:?} for the lost w2",
                agents[0].budget().held(2)
            );
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        // The held ones never ran, nor any w0 read once it had w2 as lost (forgotten with
        // it); those w0 had let through before may have run.
        let after = runs.load(Ordering::Relaxed);
        assert!(
            after < FLOOD,
            "all {after} flood requests ran (held at {ran})"
        );
        // The victim goes on serving the honest peer.
        let back: u32 = agents[1].rpc_sync("w0", "ping", &9u32, None).await.unwrap();
        assert_eq!(back, 9);
    })
    .await;
}
