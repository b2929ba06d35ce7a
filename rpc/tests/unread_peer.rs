//! A hostile peer that completes the real setup over TCP (it holds the secret, joins the
//! static group and shares its connections) and then never reads: the victim's queue for it
//! draws from its memory budget (`RpcOptions::with_peer_budget`). Past the budget the victim
//! drops it with `LostCause::OverBudget`, its calls fail naming the budget, the queue is
//! freed, and the victim goes on serving an honest peer. A connection whose send fails frees
//! what was queued for it too (`Agent::queued_bytes` drops back).

use std::future::Future;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tensorwire_core::budget::Use;
use tensorwire_core::ports::transport::{
    Connection, IdentityError, Listener, Transport, TransportError,
};
use tensorwire_core::protocol::{CallError, LostCause};
use tensorwire_core::wire::Frame;
use tensorwire_rpc::{start_agent, Functions, PeerEvent, Rendezvous, RpcError, RpcOptions};
use tensorwire_store::InMemoryStore;
use tensorwire_transport_tcp::{ClusterSecret, TcpConfig, TcpTransport};

const TEST_BOUND: Duration = Duration::from_secs(60);
/// The victim's budget per peer in the test (the default is 256 MiB).
const BOUND: usize = 8 << 20;
/// Each call's argument.
const ARG: usize = 1 << 20;
/// Calls sent to the hostile peer: far more than the bound and the sockets' buffers hold.
const CALLS: usize = 96;

async fn bounded<T>(f: impl Future<Output = T>) -> T {
    tokio::time::timeout(TEST_BOUND, f)
        .await
        .expect("test took too long")
}

/// TCP whose connections stop reading once `stalled` is set (the socket's buffers fill and
/// the sender's writes block, as with a peer that never reads).
/// Its sends, once `failing` is set, wait for a permit of `released` and then fail (a
/// connection that breaks while a writer has frames queued).
struct StallingTransport {
    inner: TcpTransport,
    stalled: Arc<AtomicBool>,
    failing: Arc<SendFailure>,
}

struct SendFailure {
    failing: AtomicBool,
    released: tokio::sync::Semaphore,
}

impl Default for SendFailure {
    fn default() -> Self {
        SendFailure {
            failing: AtomicBool::new(false),
            released: tokio::sync::Semaphore::new(0),
        }
    }
}

impl SendFailure {
    async fn check(&self, peer: std::net::SocketAddr) -> Result<(), TransportError> {
        if !self.failing.load(Ordering::Acquire) {
            return Ok(());
        }
        let _ = self.released.acquire().await;
        Err(TransportError::Closed { peer })
    }
}

struct StallingListener {
    inner: Box<dyn Listener>,
    stalled: Arc<AtomicBool>,
    failing: Arc<SendFailure>,
}

struct StallingConnection {
    inner: Box<dyn Connection>,
    stalled: Arc<AtomicBool>,
    failing: Arc<SendFailure>,
}

#[async_trait::async_trait]
impl Transport for StallingTransport {
    fn name(&self) -> &'static str {
        self.inner.name()
    }

    async fn listen(
        &self,
        addr: std::net::SocketAddr,
    ) -> Result<Box<dyn Listener>, TransportError> {
        Ok(Box::new(StallingListener {
            inner: self.inner.listen(addr).await?,
            stalled: Arc::clone(&self.stalled),
            failing: Arc::clone(&self.failing),
        }))
    }

    async fn connect(
        &self,
        addr: std::net::SocketAddr,
    ) -> Result<Box<dyn Connection>, TransportError> {
        Ok(Box::new(StallingConnection {
            inner: self.inner.connect(addr).await?,
            stalled: Arc::clone(&self.stalled),
            failing: Arc::clone(&self.failing),
        }))
    }
}

#[async_trait::async_trait]
impl Listener for StallingListener {
    fn local_addr(&self) -> std::net::SocketAddr {
        self.inner.local_addr()
    }

    async fn accept(&self) -> Result<Box<dyn Connection>, TransportError> {
        Ok(Box::new(StallingConnection {
            inner: self.inner.accept().await?,
            stalled: Arc::clone(&self.stalled),
            failing: Arc::clone(&self.failing),
        }))
    }
}

#[async_trait::async_trait]
impl Connection for StallingConnection {
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
        self.failing.check(self.peer_addr()).await?;
        self.inner.send(frame).await
    }

    async fn send_many(&self, frames: Vec<Frame>) -> Result<(), TransportError> {
        self.failing.check(self.peer_addr()).await?;
        self.inner.send_many(frames).await
    }

    async fn recv(&self) -> Result<Frame, TransportError> {
        if self.stalled.load(Ordering::Acquire) {
            std::future::pending::<()>().await;
        }
        self.inner.recv().await
    }

    async fn close(&self) -> Result<(), TransportError> {
        self.inner.close().await
    }
}

fn functions() -> Functions {
    let f = Functions::new();
    f.register(
        "len",
        |data: Vec<u8>| async move { Ok::<_, String>(data.len()) },
    )
    .unwrap();
    f
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_peer_that_never_reads_is_dropped_at_the_queue_bound_and_its_queue_freed() {
    bounded(async {
        let store: Arc<dyn tensorwire_core::ports::store::Store> = Arc::new(InMemoryStore::new());
        let secret = ClusterSecret::new(b"unread peer test secret".to_vec()).unwrap();
        let stalled = Arc::new(AtomicBool::new(false));
        let world = 3;
        let mut tasks = Vec::new();
        for rank in 0..world {
            let tcp = TcpTransport::new(TcpConfig::new(secret.clone())).unwrap();
            let transport: Arc<dyn Transport> = if rank == 2 {
                Arc::new(StallingTransport {
                    inner: tcp,
                    stalled: Arc::clone(&stalled),
                    failing: Arc::default(),
                })
            } else {
                Arc::new(tcp)
            };
            let options = RpcOptions::new()
                .with_functions(functions())
                .with_peer_budget(BOUND);
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
        // The hostile peer answers while it reads.
        let n: usize = agents[0]
            .rpc_sync("w2", "len", &vec![7u8; 10], None)
            .await
            .unwrap();
        assert_eq!(n, 10);
        let mut events = agents[0].peer_events();

        // From now on w2 never reads; the victim calls it with 1 MiB each time.
        stalled.store(true, Ordering::Release);
        let arg = vec![1u8; ARG];
        let calls: Vec<_> = (0..CALLS)
            .map(|_| {
                agents[0]
                    .rpc_async::<_, usize>("w2", "len", &arg, None)
                    .unwrap()
            })
            .collect();

        let (worker, cause) = loop {
            match events.recv().await {
                Some(PeerEvent::Lost { worker, cause }) => break (worker, cause),
                Some(_) => {}
                None => panic!("the victim's peer events ended"),
            }
        };
        assert_eq!(worker, 2, "the peer that does not read is the one dropped");
        match &cause {
            LostCause::OverBudget(over) => {
                assert_eq!(over.budget, BOUND);
                assert_eq!(over.what, Use::Queued);
                assert!(over.held.total() + over.asked > BOUND, "{over}");
            }
            other => panic!("dropped for {other}, not for its budget"),
        }
        assert!(
            cause
                .to_string()
                .contains("past its budget of 8388608 bytes per peer (peer_budget)"),
            "{cause}"
        );
        // What was queued for it is freed before its loss is reported.
        assert_eq!(agents[0].queued_bytes(), 0, "the queue for w2 is freed");
        assert_eq!(agents[0].budget().held(2).queued, 0, "and its budget");

        // Every call to it fails naming the bound (none is left hanging), but the one its
        // reader had already begun to read when it stalled, which it answered.
        let mut failed = 0;
        for call in calls {
            match call.await {
                Ok(n) => assert_eq!(n, ARG),
                Err(RpcError::Call {
                    source: CallError::PeerLost { peer, cause },
                    ..
                }) => {
                    assert_eq!(peer, 2);
                    assert!(matches!(cause, LostCause::OverBudget(_)), "{cause}");
                    failed += 1;
                }
                Err(other) => panic!("a call to the peer that never reads failed with {other}"),
            }
        }
        assert!(failed >= CALLS - 1, "only {failed} of {CALLS} calls failed");
        assert!(agents[0].connections().iter().all(|c| c.peer.id != 2));

        // The victim stays up: the honest peer's calls both ways succeed in the same run.
        for _ in 0..5 {
            let n: usize = agents[0]
                .rpc_sync("w1", "len", &vec![3u8; ARG], None)
                .await
                .unwrap();
            assert_eq!(n, ARG);
            let n: usize = agents[1]
                .rpc_sync("w0", "len", &vec![3u8; 1000], None)
                .await
                .unwrap();
            assert_eq!(n, 1000);
        }
        assert_eq!(agents[0].queued_bytes(), 0);
        // Not shut down gracefully: the hostile peer never reads the shutdown's messages.
        drop(agents);
    })
    .await;
}

/// When a peer's connection fails while frames are queued for it, they are dropped and no
/// longer counted: `queued_bytes()` drops back to 0 and the peer's budget is freed (before,
/// the writer stopped at the failed send and the rest of the queue stayed counted).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_send_frees_what_was_queued_for_the_peer() {
    bounded(async {
        let store: Arc<dyn tensorwire_core::ports::store::Store> = Arc::new(InMemoryStore::new());
        let secret = ClusterSecret::new(b"failed send test secret".to_vec()).unwrap();
        let failing = Arc::new(SendFailure::default());
        let world = 2;
        let mut tasks = Vec::new();
        for rank in 0..world {
            let tcp = TcpTransport::new(TcpConfig::new(secret.clone())).unwrap();
            let transport: Arc<dyn Transport> = if rank == 0 {
                Arc::new(StallingTransport {
                    inner: tcp,
                    stalled: Arc::default(),
                    failing: Arc::clone(&failing),
                })
            } else {
                Arc::new(tcp)
            };
            let options = RpcOptions {
                listen_ip: Some(std::net::Ipv4Addr::LOCALHOST.into()),
                init_timeout: Duration::from_secs(30),
                ..RpcOptions::new().with_functions(functions())
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
        let n: usize = agents[0]
            .rpc_sync("w1", "len", &vec![7u8; 10], None)
            .await
            .unwrap();
        assert_eq!(n, 10);
        let mut events = agents[0].peer_events();

        // Sends to w1 now hang, then fail: the calls queue up behind the first.
        failing.failing.store(true, Ordering::Release);
        let arg = vec![1u8; 64 << 10];
        let calls: Vec<_> = (0..32)
            .map(|_| {
                agents[0]
                    .rpc_async::<_, usize>("w1", "len", &arg, None)
                    .unwrap()
            })
            .collect();
        let victim = agents[0].clone();
        tensorwire_testkit::wait_until("frames are queued for w1", TEST_BOUND, move || {
            victim.queued_bytes() > 16 * (64 << 10)
        })
        .await;
        assert!(agents[0].budget().held(1).queued > 0);
        failing.released.add_permits(1 << 20);
        loop {
            match events.recv().await {
                Some(PeerEvent::Lost { worker: 1, .. }) => break,
                Some(_) => {}
                None => panic!("the peer events ended"),
            }
        }
        for call in calls {
            assert!(call.await.is_err());
        }
        let victim = agents[0].clone();
        tensorwire_testkit::wait_until(
            "what was queued for the failed peer is no longer counted",
            Duration::from_secs(10),
            move || victim.queued_bytes() == 0,
        )
        .await;
        assert_eq!(agents[0].budget().held(1).queued, 0);
        drop(agents);
    })
    .await;
}
