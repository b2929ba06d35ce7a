//! An in-memory [`Transport`]: agents of one process talk through channels, for tests and
//! simulations in virtual time (tokio's paused clock), the way tarpc's `transport::channel`
//! serves whole client/server stacks without sockets.
//!
//! A [`MemoryNetwork`] is the wire; each [`MemoryTransport`] made from it is one host with its
//! own kill switch. A frame sent at `t` is received no earlier than `t + delay` (the network's
//! configurable delay), and frames of one connection arrive in the order they were sent.
//! [`MemoryTransport::kill`] is a crashed process: every connection it made or accepted breaks
//! at once on both ends (`recv` and `send` fail, naming the peer), its listeners stop, and new
//! connections to or from it are refused.
//!
//! ```
//! # async fn run() -> Result<(), tensorwire_core::ports::transport::TransportError> {
//! use tensorwire_core::ports::transport::Transport;
//! use tensorwire_core::wire::Frame;
//! use tensorwire_transport_memory::MemoryNetwork;
//!
//! let net = MemoryNetwork::new();
//! let (a, b) = (net.transport(), net.transport());
//! let listener = b.listen("127.0.0.1:0".parse().unwrap()).await?;
//! let conn = a.connect(listener.local_addr()).await?;
//! conn.send(Frame::control(b"hi".to_vec(), vec![])).await?;
//! let accepted = listener.accept().await?;
//! assert_eq!(&accepted.recv().await?.header[..], b"hi");
//! # Ok(()) }
//! ```

use std::collections::HashMap;
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use async_trait::async_trait;
// The network keeps tokio's clock, so a paused clock (tokio's `test-util`) drives its delays.
use tensorwire_core::ports::transport::{
    ConfigError, Connection, Ended, IdentityError, Listener, Transport, TransportError,
};
use tensorwire_core::wire::Frame;
use tokio::sync::{mpsc, watch};
use tokio::time::Instant;

/// The wire between in-memory transports: their listeners by address, and the delay of every
/// frame. Cheap to clone; clones are the same network.
#[derive(Clone, Debug, Default)]
pub struct MemoryNetwork {
    inner: Arc<Mutex<Net>>,
}

#[derive(Default)]
struct Net {
    /// Each listener's queue of new connections, and its host's kill switch.
    listeners: HashMap<
        SocketAddr,
        (
            mpsc::UnboundedSender<MemoryConnection>,
            watch::Receiver<bool>,
        ),
    >,
    /// The last port handed out (listeners and the connecting ends' own addresses).
    last_port: u16,
    delay: Duration,
}

impl std::fmt::Debug for Net {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Net")
            .field("listeners", &self.listeners.keys().collect::<Vec<_>>())
            .field("delay", &self.delay)
            .finish()
    }
}

impl MemoryNetwork {
    /// A network that delivers frames as soon as they are sent.
    pub fn new() -> Self {
        Self::default()
    }

    /// A network where every frame takes `delay` (in tokio's clock) to arrive.
    pub fn with_delay(delay: Duration) -> Self {
        let net = Self::default();
        net.lock().delay = delay;
        net
    }

    /// A new host on this network.
    pub fn transport(&self) -> MemoryTransport {
        MemoryTransport {
            net: self.clone(),
            kill: Arc::new(watch::channel(false).0),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Net> {
        self.inner.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn next_port(&self) -> Result<u16, TransportError> {
        let mut net = self.lock();
        net.last_port = net
            .last_port
            .checked_add(1)
            .ok_or(TransportError::Config(ConfigError::PortsExhausted))?;
        Ok(net.last_port)
    }
}

/// One host on a [`MemoryNetwork`], with a kill switch. Cheap to clone; clones are the same
/// host.
#[derive(Clone, Debug)]
pub struct MemoryTransport {
    net: MemoryNetwork,
    kill: Arc<watch::Sender<bool>>,
}

impl MemoryTransport {
    /// Kills this host: its connections break on both ends, its listeners stop accepting, and
    /// it can neither connect nor be connected to any more.
    pub fn kill(&self) {
        self.kill.send_replace(true);
        let mut net = self.net.lock();
        net.listeners.retain(|_, (_, kill)| !*kill.borrow());
    }

    /// Whether [`kill`](Self::kill) was called.
    pub fn is_killed(&self) -> bool {
        *self.kill.borrow()
    }
}

fn refused(addr: SocketAddr, op: &'static str, why: &str) -> TransportError {
    TransportError::Io {
        addr,
        op,
        kind: std::io::ErrorKind::ConnectionRefused,
        message: why.to_owned(),
    }
}

fn reset(addr: SocketAddr, op: &'static str) -> TransportError {
    TransportError::Io {
        addr,
        op,
        kind: std::io::ErrorKind::ConnectionReset,
        message: "the in-memory host at one end was killed".into(),
    }
}

#[async_trait]
impl Transport for MemoryTransport {
    fn name(&self) -> &'static str {
        "memory"
    }

    async fn listen(&self, addr: SocketAddr) -> Result<Box<dyn Listener>, TransportError> {
        if self.is_killed() {
            return Err(refused(addr, "listening", "this host was killed"));
        }
        let port = match addr.port() {
            0 => self.net.next_port()?,
            p => p,
        };
        let local = SocketAddr::new(addr.ip(), port);
        let (tx, rx) = mpsc::unbounded_channel();
        {
            let mut net = self.net.lock();
            if net
                .listeners
                .get(&local)
                .is_some_and(|(l, _)| !l.is_closed())
            {
                return Err(TransportError::Io {
                    addr: local,
                    op: "listening",
                    kind: std::io::ErrorKind::AddrInUse,
                    message: "address in use on the in-memory network".into(),
                });
            }
            net.listeners.insert(local, (tx, self.kill.subscribe()));
        }
        Ok(Box::new(MemoryListener {
            local,
            incoming: tokio::sync::Mutex::new(rx),
            kill: self.kill.subscribe(),
        }))
    }

    async fn connect(&self, addr: SocketAddr) -> Result<Box<dyn Connection>, TransportError> {
        if self.is_killed() {
            return Err(refused(addr, "connecting", "this host was killed"));
        }
        let own = SocketAddr::new(IpAddr::V4(Ipv4Addr::LOCALHOST), self.net.next_port()?);
        let (listener, delay) = {
            let net = self.net.lock();
            (net.listeners.get(&addr).cloned(), net.delay)
        };
        let listener =
            listener.ok_or_else(|| refused(addr, "connecting", "nothing listens there"))?;
        let (listener, server_kill) = listener;
        let (to_server, from_client) = mpsc::unbounded_channel();
        let (to_client, from_server) = mpsc::unbounded_channel();
        let server = MemoryConnection {
            peer: own,
            delay,
            tx: Mutex::new(Some(to_client)),
            rx: tokio::sync::Mutex::new(from_client),
            ends: [server_kill.clone(), self.kill.subscribe()],
        };
        listener
            .send(server)
            .map_err(|_| refused(addr, "connecting", "the listener was closed"))?;
        Ok(Box::new(MemoryConnection {
            peer: addr,
            delay,
            tx: Mutex::new(Some(to_server)),
            rx: tokio::sync::Mutex::new(from_server),
            ends: [self.kill.subscribe(), server_kill],
        }))
    }
}

struct MemoryListener {
    local: SocketAddr,
    incoming: tokio::sync::Mutex<mpsc::UnboundedReceiver<MemoryConnection>>,
    kill: watch::Receiver<bool>,
}

#[async_trait]
impl Listener for MemoryListener {
    fn local_addr(&self) -> SocketAddr {
        self.local
    }

    async fn accept(&self) -> Result<Box<dyn Connection>, TransportError> {
        let mut kill = self.kill.clone();
        let mut incoming = self.incoming.lock().await;
        tokio::select! {
            conn = incoming.recv() => {
                let conn = conn.ok_or_else(|| refused(self.local, "accepting", "the network is gone"))?;
                Ok(Box::new(conn) as Box<dyn Connection>)
            }
            () = killed(&mut kill) => Err(reset(self.local, "accepting")),
        }
    }
}

type Queued = (Instant, Frame);

/// Completes once the host of `switch` is killed; never, if every handle of that host is gone
/// without a kill (the host is then simply idle).
async fn killed(switch: &mut watch::Receiver<bool>) {
    if switch.wait_for(|k| *k).await.is_err() {
        std::future::pending::<()>().await;
    }
}

struct MemoryConnection {
    peer: SocketAddr,
    delay: Duration,
    /// `None` once closed: the peer's `recv` then ends after what was sent.
    tx: Mutex<Option<mpsc::UnboundedSender<Queued>>>,
    rx: tokio::sync::Mutex<mpsc::UnboundedReceiver<Queued>>,
    /// The kill switches of this end's host and of the peer's host.
    ends: [watch::Receiver<bool>; 2],
}

impl MemoryConnection {
    fn killed(&self) -> bool {
        self.ends.iter().any(|e| *e.borrow())
    }
}

#[async_trait]
impl Connection for MemoryConnection {
    fn peer_addr(&self) -> SocketAddr {
        self.peer
    }

    fn transport(&self) -> &'static str {
        "memory"
    }

    fn check_peer_name(&self, _name: &str) -> Result<(), IdentityError> {
        // In-memory peers are all of one test's making: none holds credentials of its own.
        Ok(())
    }

    fn peer_credentials(&self) -> tensorwire_core::identity::Credentials {
        tensorwire_core::identity::Credentials::Membership
    }

    async fn send(&self, frame: Frame) -> Result<(), TransportError> {
        if self.killed() {
            return Err(reset(self.peer, "sending"));
        }
        let at = Instant::now() + self.delay;
        let tx = self.tx.lock().unwrap_or_else(PoisonError::into_inner);
        match tx.as_ref() {
            Some(tx) => tx
                .send((at, frame))
                .map_err(|_| TransportError::Closed { peer: self.peer }),
            None => Err(TransportError::Ended {
                peer: self.peer,
                op: "sending",
                how: Ended::ClosedHere,
            }),
        }
    }

    async fn recv(&self) -> Result<Frame, TransportError> {
        let [mut a, mut b] = self.ends.clone();
        let mut rx = self.rx.lock().await;
        let next = async {
            let (at, frame) = rx
                .recv()
                .await
                .ok_or(TransportError::Closed { peer: self.peer })?;
            tokio::time::sleep_until(at).await;
            Ok(frame)
        };
        tokio::select! {
            biased;
            () = killed(&mut a) => Err(reset(self.peer, "receiving")),
            () = killed(&mut b) => Err(reset(self.peer, "receiving")),
            got = next => got,
        }
    }

    async fn close(&self) -> Result<(), TransportError> {
        self.tx
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take();
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn frame(i: u8) -> Frame {
        Frame::control(vec![i], vec![])
    }

    async fn pair(
        net: &MemoryNetwork,
    ) -> (
        MemoryTransport,
        MemoryTransport,
        Box<dyn Connection>,
        Box<dyn Connection>,
    ) {
        let (a, b) = (net.transport(), net.transport());
        let listener = b.listen("127.0.0.1:0".parse().unwrap()).await.unwrap();
        let client = a.connect(listener.local_addr()).await.unwrap();
        let server = listener.accept().await.unwrap();
        (a, b, client, server)
    }

    #[tokio::test(start_paused = true)]
    async fn frames_arrive_after_the_delay_in_order() {
        let net = MemoryNetwork::with_delay(Duration::from_millis(30));
        let (_a, _b, client, server) = pair(&net).await;
        let t0 = Instant::now();
        for i in 0..5 {
            client.send(frame(i)).await.unwrap();
        }
        for i in 0..5 {
            assert_eq!(server.recv().await.unwrap().header[..], [i]);
        }
        // Sent together, so they arrive together: one delay, not five.
        assert_eq!(Instant::now() - t0, Duration::from_millis(30));
        server.send(frame(9)).await.unwrap();
        assert_eq!(client.recv().await.unwrap().header[..], [9]);
        assert_eq!(Instant::now() - t0, Duration::from_millis(60));
    }

    #[tokio::test(start_paused = true)]
    async fn close_ends_the_peers_reading_after_what_was_sent() {
        let (_a, _b, client, server) = pair(&MemoryNetwork::new()).await;
        client.send(frame(1)).await.unwrap();
        client.close().await.unwrap();
        assert_eq!(server.recv().await.unwrap().header[..], [1]);
        assert!(server.recv().await.unwrap_err().is_clean_close());
        // The other direction still works.
        server.send(frame(2)).await.unwrap();
        assert_eq!(client.recv().await.unwrap().header[..], [2]);
    }

    #[tokio::test(start_paused = true)]
    async fn a_killed_host_breaks_its_connections_on_both_ends_and_refuses_new_ones() {
        let net = MemoryNetwork::new();
        let (a, b, client, server) = pair(&net).await;
        let c = net.transport();
        let listener = b.listen("127.0.0.1:0".parse().unwrap()).await.unwrap();
        let addr = listener.local_addr();
        let reading = tokio::spawn(async move { server.recv().await });
        tokio::task::yield_now().await;
        b.kill();
        let e = reading.await.unwrap().unwrap_err();
        assert!(e.to_string().contains("killed"), "{e}");
        let e = client.send(frame(1)).await.unwrap_err();
        assert!(e.to_string().contains("killed"), "{e}");
        assert!(listener.accept().await.is_err());
        assert!(c.connect(addr).await.is_err());
        assert!(b.connect(addr).await.is_err());
        // The others still talk.
        let l = c.listen("127.0.0.1:0".parse().unwrap()).await.unwrap();
        let conn = a.connect(l.local_addr()).await.unwrap();
        conn.send(frame(3)).await.unwrap();
        assert_eq!(
            l.accept().await.unwrap().recv().await.unwrap().header[..],
            [3]
        );
    }

    #[tokio::test(start_paused = true)]
    async fn addresses_are_unique_and_nothing_listens_at_an_unknown_one() {
        let net = MemoryNetwork::new();
        let t = net.transport();
        let l1 = t.listen("127.0.0.1:0".parse().unwrap()).await.unwrap();
        let l2 = t.listen("127.0.0.1:0".parse().unwrap()).await.unwrap();
        assert_ne!(l1.local_addr(), l2.local_addr());
        let e = t.listen(l1.local_addr()).await.err().unwrap();
        assert!(e.to_string().contains("in use"), "{e}");
        let e = t
            .connect("127.0.0.1:65000".parse().unwrap())
            .await
            .err()
            .unwrap();
        assert!(e.to_string().contains("nothing listens"), "{e}");
    }
}
