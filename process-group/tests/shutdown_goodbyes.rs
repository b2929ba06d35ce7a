//! A group's shutdown says goodbye to every peer side by side: a peer that does not read
//! delays nobody else's goodbye (over real loopback TCP, one process).

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tensorwire_core::identity::Credentials;
use tensorwire_core::ports::process_group::{Collectives, ProcessGroup, ProcessGroupError};
use tensorwire_core::ports::store::Store;
use tensorwire_core::ports::transport::{
    Connection, IdentityError, Listener, Transport, TransportError,
};
use tensorwire_core::wire::Frame;
use tensorwire_process_group::{CollectivePath, Group, GroupOptions, InMemoryStore};
use tensorwire_transport_tcp::{ClusterSecret, TcpConfig, TcpTransport};

/// TCP whose first dialled connection stops taking single-frame sends (a goodbye) once
/// `jam` is set: a peer that does not read, as the sender sees it.
struct Jamming {
    inner: TcpTransport,
    jam: Arc<AtomicBool>,
    dialled: AtomicUsize,
}

struct Jammable {
    inner: Box<dyn Connection>,
    jam: Option<Arc<AtomicBool>>,
}

#[async_trait::async_trait]
impl Transport for Jamming {
    fn name(&self) -> &'static str {
        self.inner.name()
    }

    async fn listen(&self, addr: SocketAddr) -> Result<Box<dyn Listener>, TransportError> {
        self.inner.listen(addr).await
    }

    async fn connect(&self, addr: SocketAddr) -> Result<Box<dyn Connection>, TransportError> {
        let first = self.dialled.fetch_add(1, Ordering::Relaxed) == 0;
        Ok(Box::new(Jammable {
            inner: self.inner.connect(addr).await?,
            jam: first.then(|| Arc::clone(&self.jam)),
        }))
    }

    fn credentials(&self) -> Credentials {
        self.inner.credentials()
    }
}

#[async_trait::async_trait]
impl Connection for Jammable {
    fn peer_addr(&self) -> SocketAddr {
        self.inner.peer_addr()
    }

    fn transport(&self) -> &'static str {
        self.inner.transport()
    }

    fn check_peer_name(&self, name: &str) -> Result<(), IdentityError> {
        self.inner.check_peer_name(name)
    }

    fn peer_credentials(&self) -> Credentials {
        self.inner.peer_credentials()
    }

    fn bill_to(&self, account: tensorwire_core::budget::Account) {
        self.inner.bill_to(account);
    }

    async fn send(&self, frame: Frame) -> Result<(), TransportError> {
        if self.jam.as_ref().is_some_and(|j| j.load(Ordering::Relaxed)) {
            std::future::pending::<()>().await;
        }
        self.inner.send(frame).await
    }

    async fn send_many(&self, frames: Vec<Frame>) -> Result<(), TransportError> {
        self.inner.send_many(frames).await
    }

    async fn recv(&self) -> Result<Frame, TransportError> {
        self.inner.recv().await
    }

    async fn close(&self) -> Result<(), TransportError> {
        self.inner.close().await
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_peer_that_does_not_read_delays_no_other_peers_goodbye() {
    let secret = ClusterSecret::new(b"goodbye test secret".to_vec()).unwrap();
    let tcp = || TcpTransport::new(TcpConfig::new(secret.clone())).unwrap();
    let jam = Arc::new(AtomicBool::new(false));
    let store: Arc<dyn Store> = Arc::new(InMemoryStore::new());
    let options = GroupOptions::new("goodbyes")
        .with_timeout(Duration::from_secs(30))
        .with_collectives(CollectivePath::Links);
    let mut tasks = Vec::new();
    for rank in 0..3 {
        // The first link rank 0 dials is the jammed one.
        let transport: Arc<dyn Transport> = if rank == 0 {
            Arc::new(Jamming {
                inner: tcp(),
                jam: Arc::clone(&jam),
                dialled: AtomicUsize::new(0),
            })
        } else {
            Arc::new(tcp())
        };
        let (store, options) = (Arc::clone(&store), options.clone());
        tasks.push(tokio::spawn(async move {
            Group::connect(store, transport, rank, 3, options).await
        }));
    }
    let mut gs = Vec::new();
    for t in tasks {
        gs.push(t.await.unwrap().unwrap());
    }
    let (g0, g1, g2) = (gs[0].clone(), gs[1].clone(), gs[2].clone());
    jam.store(true, Ordering::Relaxed);
    // Rank 0's goodbye on the jammed link waits out its timeout (seconds); meanwhile the
    // other peer hears its own: its barrier fails naming rank 0 as having left.
    let shutdown = tokio::spawn(async move { g0.shutdown().await });
    let mut one = tokio::spawn(async move { g1.barrier().await });
    let mut two = tokio::spawn(async move { g2.barrier().await });
    let first = tokio::time::timeout(Duration::from_secs(60), async {
        tokio::select! {
            r = &mut one => r,
            r = &mut two => r,
        }
    })
    .await
    .expect("no peer learnt that rank 0 left")
    .unwrap();
    let err = first.unwrap_err();
    assert!(
        matches!(err, ProcessGroupError::PeerLeft { rank: 0, .. }),
        "{err}"
    );
    assert!(
        !shutdown.is_finished(),
        "the other peer heard its goodbye only once the jammed one had timed out"
    );
    shutdown.await.unwrap();
    // (The jammed peer waits on: its goodbye never went out.)
    one.abort();
    two.abort();
}
