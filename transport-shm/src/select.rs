//! Transport selection: shared memory for peers on this host, TCP for the others.
//!
//! [`SelectingTransport`] is what the RPC backends and process groups build, so that neither
//! the agent nor the mesh chooses anything (as TensorPipe picks its shm channel for a peer on the
//! same machine).
//!
//! - **Listening** on `ip:port` opens the TCP listener there and, beside it, a shared-memory
//!   listener named after the TCP listener's address (`tensorwire-shm-tcp:IP:PORT` in the
//!   abstract Unix namespace). Peers learn one address, the TCP one, as before; `accept` hands out
//!   connections from both.
//! - **Dialling** `ip:port` looks for a shared-memory listener named after that address: the one
//!   for exactly `ip:port`, and, when `ip` is one of this host's addresses (loopback included),
//!   one listening on every interface (`0.0.0.0:port`, `[::]:port`). Since a TCP port is held by
//!   one listener, and abstract Unix names are scoped to the network namespace, such a listener
//!   exists exactly when the peer's TCP listener is in this network namespace: the peer is on
//!   this host (as far as loopback TCP can tell). Then the connection is made over shared memory
//!   (authenticated with the same cluster secret, the peer's user checked with `SO_PEERCRED`);
//!   otherwise over TCP.
//! - `TENSORWIRE_TRANSPORT` ([`TRANSPORT_ENV`]) overrides: `tcp` listens and dials TCP only (no
//!   shared memory at all); `shm` dials only over shared memory (a peer on another host is an
//!   error that says so); `auto`, or the variable unset or empty, selects as above. Any other value
//!   is a [`TransportError::Config`] naming it.
//!
//! Every connection is logged at `info` (target `tensorwire_transport_shm::select`) with the peer
//! and the transport chosen (`transport="shm"` or `"tcp"`), on both sides.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::sync::Arc;

use async_trait::async_trait;
use tensorwire_core::env::BadVariable;
use tensorwire_core::ports::transport::{
    ConfigError, Connection, Listener, Transport, TransportError,
};
use tensorwire_transport_tcp::{TcpConfig, TcpTransport};
use tokio::sync::{mpsc, Mutex};
use tokio::task::JoinHandle;

use crate::{listener, sock, ShmConfig, ShmTransport};

/// The environment variable that overrides transport selection: `tcp`, `shm` or `auto`.
pub const TRANSPORT_ENV: &str = "TENSORWIRE_TRANSPORT";

/// What [`TRANSPORT_ENV`] takes.
const SELECTIONS: &str = "a transport selection: tcp, shm or auto";

/// Which transport a [`SelectingTransport`] uses for a peer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Selection {
    /// Shared memory for peers on this host, TCP for the others (the default).
    Auto,
    /// TCP for every peer; no shared-memory listener.
    Tcp,
    /// Shared memory for every peer; dialling a peer on another host fails.
    Shm,
}

impl Selection {
    /// Parses `tcp`, `shm` or `auto` (any case, surrounding blanks ignored).
    pub fn parse(value: &str) -> Result<Self, TransportError> {
        match value.trim().to_ascii_lowercase().as_str() {
            "auto" => Ok(Selection::Auto),
            "tcp" => Ok(Selection::Tcp),
            "shm" => Ok(Selection::Shm),
            _ => Err(ConfigError::from(BadVariable::new(TRANSPORT_ENV, value, SELECTIONS)).into()),
        }
    }

    /// From [`TRANSPORT_ENV`]: [`Auto`](Self::Auto) when it is unset or empty.
    pub fn from_env() -> Result<Self, TransportError> {
        match std::env::var(TRANSPORT_ENV) {
            Ok(v) if !v.trim().is_empty() => Self::parse(&v),
            Ok(_) | Err(std::env::VarError::NotPresent) => Ok(Selection::Auto),
            Err(std::env::VarError::NotUnicode(v)) => Err(ConfigError::from(BadVariable::new(
                TRANSPORT_ENV,
                v.to_string_lossy(),
                SELECTIONS,
            ))
            .into()),
        }
    }

    /// `"auto"`, `"tcp"` or `"shm"`.
    pub fn name(self) -> &'static str {
        match self {
            Selection::Auto => "auto",
            Selection::Tcp => "tcp",
            Selection::Shm => "shm",
        }
    }
}

/// A [`Transport`] that reaches peers on this host over shared memory and the others over TCP
/// (see the [module docs](self)).
#[derive(Clone)]
pub struct SelectingTransport {
    tcp: Arc<dyn Transport>,
    shm: ShmTransport,
    selection: Selection,
}

impl std::fmt::Debug for SelectingTransport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SelectingTransport")
            .field("tcp", &self.tcp.name())
            .field("selection", &self.selection)
            .finish_non_exhaustive()
    }
}

impl SelectingTransport {
    /// Selects between `tcp` and `shm` as `selection` says.
    pub fn new(tcp: Arc<dyn Transport>, shm: ShmTransport, selection: Selection) -> Self {
        SelectingTransport {
            tcp,
            shm,
            selection,
        }
    }

    /// TCP with `config`, and shared memory with the same cluster secret, frame limits and
    /// handshake timeout (its spin from [`SPIN_ENV`](crate::SPIN_ENV) when set); the selection
    /// from [`TRANSPORT_ENV`] (a bad value is an error, as is a malformed spin).
    pub fn from_tcp_config(config: TcpConfig) -> Result<Self, TransportError> {
        let selection = Selection::from_env()?;
        let shm = match config.secret() {
            Some(secret) => ShmConfig::new(secret.clone()),
            None => ShmConfig::insecure(),
        }
        .with_limits(config.limits)
        .with_handshake_timeout(config.handshake_timeout)
        .with_spin_from(|name| std::env::var(name).ok())?;
        let shm = if selection == Selection::Tcp {
            // Never used: no warning about a missing secret from a transport that stays off.
            ShmTransport {
                config: Arc::new(shm),
            }
        } else {
            ShmTransport::new(shm)?
        };
        Ok(Self::new(
            Arc::new(TcpTransport::new(config)?),
            shm,
            selection,
        ))
    }

    /// The selection in force.
    pub fn selection(&self) -> Selection {
        self.selection
    }

    /// A shared-memory connection to the listener of the peer at `addr`, if one is on this
    /// host; `None` when none is.
    async fn dial_shm(
        &self,
        addr: SocketAddr,
    ) -> Result<Option<Box<dyn Connection>>, TransportError> {
        for name in candidates(addr) {
            let name = sock::tcp_listener_name(name)
                .map_err(|e| TransportError::io(addr, "connecting", &e))?;
            match sock::connect_name(&name).await {
                Ok(socket) => return Ok(Some(Box::new(self.shm.setup(socket, addr).await?))),
                Err(e)
                    if matches!(
                        e.kind(),
                        std::io::ErrorKind::ConnectionRefused | std::io::ErrorKind::NotFound
                    ) => {}
                Err(e) => return Err(TransportError::io(addr, "connecting", &e)),
            }
        }
        Ok(None)
    }
}

/// The TCP listener addresses whose shared-memory listener would be the one a TCP connection to
/// `addr` reaches: `addr` itself, and the wildcard addresses when `addr`'s IP is this host's.
fn candidates(addr: SocketAddr) -> Vec<SocketAddr> {
    let mut out = vec![addr];
    if is_local(addr.ip()) {
        if addr.is_ipv4() {
            out.push(SocketAddr::new(Ipv4Addr::UNSPECIFIED.into(), addr.port()));
        }
        out.push(SocketAddr::new(Ipv6Addr::UNSPECIFIED.into(), addr.port()));
        out.retain(|a| *a == addr || a.ip() != addr.ip());
    }
    out
}

/// Whether `ip` is an address of this host (network namespace): loopback, unspecified, or on
/// one of its interfaces.
fn is_local(ip: IpAddr) -> bool {
    if ip.is_loopback() || ip.is_unspecified() {
        return true;
    }
    if_addrs::get_if_addrs()
        .map(|ifs| ifs.iter().any(|i| i.ip() == ip))
        .unwrap_or(false)
}

#[async_trait]
impl Transport for SelectingTransport {
    fn name(&self) -> &'static str {
        self.selection.name()
    }

    async fn listen(&self, addr: SocketAddr) -> Result<Box<dyn Listener>, TransportError> {
        let tcp = self.tcp.listen(addr).await?;
        let local = tcp.local_addr();
        let (tx, rx) = mpsc::channel(64);
        let mut tasks = vec![tokio::spawn(forward(tcp, "tcp", tx.clone()))];
        if self.selection != Selection::Tcp {
            let name = sock::tcp_listener_name(local)
                .map_err(|e| TransportError::io(local, "listening", &e))?;
            match listener::ShmListener::bind_name(&name, local, self.shm.config.clone()) {
                Ok(shm) => tasks.push(tokio::spawn(forward(Box::new(shm), "shm", tx))),
                Err(e) if self.selection == Selection::Auto => {
                    tracing::warn!(listener = %local, error = %e,
                        "no shared-memory listener beside the TCP one: peers on this host \
                         will connect over TCP");
                }
                Err(e) => return Err(e),
            }
        }
        Ok(Box::new(SelectingListener {
            local,
            ready: Mutex::new(rx),
            tasks,
        }))
    }

    async fn connect(&self, addr: SocketAddr) -> Result<Box<dyn Connection>, TransportError> {
        let conn = match self.selection {
            Selection::Tcp => None,
            Selection::Auto => self.dial_shm(addr).await?,
            Selection::Shm => Some(self.dial_shm(addr).await?.ok_or_else(|| {
                TransportError::from(ConfigError::NoSharedMemoryPeer {
                    addr,
                    var: TRANSPORT_ENV,
                })
            })?),
        };
        let (conn, transport) = match conn {
            Some(conn) => (conn, "shm"),
            None => (self.tcp.connect(addr).await?, "tcp"),
        };
        tracing::info!(peer = %addr, transport, selection = self.selection.name(),
            "connected to a peer");
        Ok(conn)
    }
}

/// Accepted connections (or the error that ended a listener), with the transport's name.
type Accepted = Result<(Box<dyn Connection>, &'static str), TransportError>;

/// Hands `listener`'s connections to the selecting listener until it stops.
async fn forward(
    listener: Box<dyn Listener>,
    transport: &'static str,
    ready: mpsc::Sender<Accepted>,
) {
    loop {
        let accepted = listener.accept().await;
        let failed = accepted.is_err();
        if ready.send(accepted.map(|c| (c, transport))).await.is_err() || failed {
            return;
        }
    }
}

struct SelectingListener {
    local: SocketAddr,
    ready: Mutex<mpsc::Receiver<Accepted>>,
    tasks: Vec<JoinHandle<()>>,
}

impl Drop for SelectingListener {
    fn drop(&mut self) {
        for task in &self.tasks {
            task.abort();
        }
    }
}

#[async_trait]
impl Listener for SelectingListener {
    fn local_addr(&self) -> SocketAddr {
        self.local
    }

    async fn accept(&self) -> Result<Box<dyn Connection>, TransportError> {
        let mut ready = self.ready.lock().await;
        match ready.recv().await {
            Some(Ok((conn, transport))) => {
                tracing::info!(peer = %conn.peer_addr(), listener = %self.local, transport,
                    "accepted a peer");
                Ok(conn)
            }
            Some(Err(e)) => Err(e),
            None => Err(TransportError::Io {
                addr: self.local,
                op: "accepting",
                kind: std::io::ErrorKind::Other,
                message: "the listener's accept tasks stopped".to_owned(),
            }),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use bytes::Bytes;
    use tensorwire_core::auth::ClusterSecret;
    use tensorwire_core::wire::Frame;

    fn transport(selection: Selection, secret: &[u8]) -> SelectingTransport {
        let secret = ClusterSecret::new(secret.to_vec()).unwrap();
        let tcp = TcpTransport::new(TcpConfig::new(secret.clone())).unwrap();
        let shm = ShmTransport::new(ShmConfig::new(secret)).unwrap();
        SelectingTransport::new(Arc::new(tcp), shm, selection)
    }

    /// Connects `client` to a listener of `server`, exchanges a frame, and returns the kind of
    /// connection the server accepted (the shm side names peers by pid as 127.0.0.x).
    async fn round_trip(
        server: &SelectingTransport,
        client: &SelectingTransport,
    ) -> Result<bool, TransportError> {
        let listener = server.listen("127.0.0.1:0".parse().unwrap()).await?;
        let addr = listener.local_addr();
        let dialled = client.connect(addr).await?;
        let accepted = listener.accept().await?;
        dialled
            .send(Frame::message(Bytes::from_static(b"hi"), vec![]))
            .await?;
        assert_eq!(&accepted.recv().await?.header[..], b"hi");
        accepted
            .send(Frame::message(Bytes::from_static(b"yo"), vec![]))
            .await?;
        assert_eq!(&dialled.recv().await?.header[..], b"yo");
        // A TCP connection's peer is the client's socket, on an ephemeral port other than ours;
        // a shared-memory one is named by the client's process id.
        Ok(accepted.peer_addr() == listen_peer_of_this_process())
    }

    fn listen_peer_of_this_process() -> SocketAddr {
        listener::peer_name(std::process::id())
    }

    #[tokio::test]
    async fn auto_picks_shm_on_this_host_and_tcp_forces_tcp() {
        let auto = transport(Selection::Auto, b"selecting-secret");
        let tcp = transport(Selection::Tcp, b"selecting-secret");
        let shm = transport(Selection::Shm, b"selecting-secret");
        assert!(
            round_trip(&auto, &auto).await.unwrap(),
            "auto to auto is shm"
        );
        assert!(round_trip(&auto, &shm).await.unwrap(), "shm to auto is shm");
        assert!(!round_trip(&auto, &tcp).await.unwrap(), "tcp dials tcp");
        assert!(
            !round_trip(&tcp, &auto).await.unwrap(),
            "a tcp listener has no shm side"
        );
        match round_trip(&tcp, &shm).await {
            Err(TransportError::Config(ConfigError::NoSharedMemoryPeer { var, .. })) => {
                assert_eq!(var, "TENSORWIRE_TRANSPORT")
            }
            other => panic!("shm cannot reach a tcp-only listener: {other:?}"),
        }
    }

    #[tokio::test]
    async fn a_wrong_secret_fails_over_shm_too() {
        let server = transport(Selection::Auto, b"selecting-secret");
        let client = transport(Selection::Auto, b"another-secret!!");
        match round_trip(&server, &client).await {
            Err(TransportError::Authentication { .. }) => {}
            other => panic!("expected an authentication error, got {other:?}"),
        }
    }

    #[test]
    fn selection_parses_and_names_a_bad_value() {
        assert_eq!(Selection::parse(" SHM ").unwrap(), Selection::Shm);
        assert_eq!(Selection::parse("tcp").unwrap(), Selection::Tcp);
        assert_eq!(Selection::parse("auto").unwrap(), Selection::Auto);
        let e = Selection::parse("carrier-pigeon").unwrap_err();
        let msg = e.to_string();
        assert!(
            msg.contains("TENSORWIRE_TRANSPORT") && msg.contains("carrier-pigeon"),
            "{msg}"
        );
        assert_eq!(
            e,
            TransportError::Config(ConfigError::Variable(BadVariable::new(
                TRANSPORT_ENV,
                "carrier-pigeon",
                SELECTIONS
            )))
        );
    }

    #[test]
    fn remote_addresses_never_match_a_wildcard_listener() {
        let remote: SocketAddr = "203.0.113.7:29500".parse().unwrap();
        assert_eq!(candidates(remote), vec![remote]);
        let local: SocketAddr = "127.0.0.1:29500".parse().unwrap();
        let c = candidates(local);
        assert!(
            c.contains(&local) && c.contains(&"0.0.0.0:29500".parse().unwrap()),
            "{c:?}"
        );
    }
}
