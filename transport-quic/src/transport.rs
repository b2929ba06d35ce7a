//! The [`Transport`] port over QUIC: one unidirectional stream per frame.
//!
//! # Streams
//! Every frame travels on its own unidirectional stream, so a large tensor in flight does not
//! hold back small calls sent beside it. A stream starts with a one-byte tag:
//!
//! - `FRAME`: ordering dependencies (see `order`), then one frame in core's wire format, then
//!   the end of the stream.
//! - `GOODBYE`: ordering dependencies; the sender called [`Connection::close`].
//! - `GOODBYE_ACK`: the receiver has delivered everything before the peer's goodbye.
//!
//! The very first stream a server opens carries [`ADMIT`]: the client's `connect` waits for it,
//! so a client whose certificate the server refused learns it from `connect` itself (in TLS 1.3
//! the client finishes its handshake before the server has judged the client certificate).
//!
//! # Closing
//! QUIC cannot half-close a connection, and closing it discards data not yet delivered. So
//! `close` sends a goodbye stream; the QUIC connection is closed (code 0) only once both sides
//! have said goodbye and each has acknowledged the other's goodbye. A dropped connection says
//! goodbye on its own, closes as soon as the peer acknowledges it (nobody would read the peer's
//! frames any more), and gives up after a bounded linger.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use bytes::{BufMut, BytesMut};
use quinn::{ConnectionError, ReadError, RecvStream};
use tensorwire_core::identity::Credentials;
use tensorwire_core::ports::transport::{
    ConfigError, Connection, Ended, IdentityError, Listener, Transport, TransportError,
};
use tensorwire_core::wire::{Frame, FrameDecoder, OutgoingFrame, WireError, WireLimits};
use tokio::sync::{mpsc, OwnedSemaphorePermit, Semaphore};
use tokio::task::JoinSet;

use crate::ended::{self, CODE_DONE, CODE_MALFORMED};
use crate::order::{
    self, Decoded, Deps, Prefix, RecvOrder, SendOrder, TAG_FRAME, TAG_GOODBYE, TAG_GOODBYE_ACK,
};
use crate::{QuicConfig, QuicError};

/// What the server writes on its first stream once it has accepted the client's certificate.
pub const ADMIT: &[u8] = b"tensorwire-quic-admit/1";

/// Stream reset code of a send that was cancelled (its future dropped).
const CODE_CANCELLED: u32 = 1;

/// How long a connection dropped without a completed goodbye exchange waits before closing.
const LINGER: Duration = Duration::from_secs(5);

/// The QUIC [`Transport`]: mutual TLS under the cluster CA, one stream per frame.
///
/// ```no_run
/// use std::sync::Arc;
/// use tensorwire_core::ports::transport::Transport;
/// use tensorwire_transport_quic::{certs::ClusterCa, ClusterTls, QuicConfig, QuicTransport};
///
/// # async fn demo() -> anyhow::Result<()> {
/// let ca = ClusterCa::load_or_generate(std::path::Path::new("/tmp/my-cluster"))?;
/// let tls = ClusterTls::new(ca.issue_node("worker0")?, vec![ca.cert_der().clone()]);
/// let transport = QuicTransport::new(QuicConfig::new(tls))?;
/// let listener = transport.listen("127.0.0.1:0".parse()?).await?;
/// println!("listening on {}", listener.local_addr());
/// # Ok(()) }
/// ```
pub struct QuicTransport {
    config: QuicConfig,
    /// Server configurations for remote peers and for peers on a loopback address.
    server: [Arc<quinn::ServerConfig>; 2],
    /// Client configurations for remote peers and for peers on a loopback address.
    client: [quinn::ClientConfig; 2],
    /// One client endpoint per address family, created on first use.
    client_endpoints: Mutex<[Option<quinn::Endpoint>; 2]>,
    /// What this node's own certificate is issued for.
    credentials: Credentials,
}

impl std::fmt::Debug for QuicTransport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("QuicTransport")
            .field("config", &self.config)
            .finish_non_exhaustive()
    }
}

impl QuicTransport {
    /// A transport with `config`; checks the certificates and key right away.
    pub fn new(config: QuicConfig) -> Result<Self, QuicError> {
        let server_crypto = Arc::new(config.tls.server_crypto()?);
        let client_crypto = Arc::new(config.tls.client_crypto()?);
        let server = |loopback| {
            let mut server = quinn::ServerConfig::with_crypto(server_crypto.clone());
            server.transport_config(config.transport(loopback));
            Arc::new(server)
        };
        let client = |loopback| {
            let mut client = quinn::ClientConfig::new(client_crypto.clone());
            client.transport_config(config.transport(loopback));
            client
        };
        let credentials = crate::certs::credentials_of(config.tls.identity().chain());
        Ok(Self {
            credentials,
            server: [server(false), server(true)],
            client: [client(false), client(true)],
            config,
            client_endpoints: Mutex::new([None, None]),
        })
    }

    /// The settings this transport runs with.
    pub fn config(&self) -> &QuicConfig {
        &self.config
    }

    fn endpoint(
        &self,
        addr: SocketAddr,
        server: Option<Arc<quinn::ServerConfig>>,
    ) -> Result<quinn::Endpoint, QuicError> {
        let (socket, _granted) = crate::socket::bind_udp(addr, self.config.socket_buffer_bytes)?;
        let mut endpoint_config = quinn::EndpointConfig::default();
        if self.config.max_udp_payload() > 1472 {
            endpoint_config
                .max_udp_payload_size(self.config.max_udp_payload())
                .map_err(|e| QuicError::Tls {
                    what: "endpoint UDP payload size",
                    reason: e.to_string(),
                })?;
        }
        let runtime = quinn::default_runtime().ok_or_else(|| QuicError::Socket {
            addr,
            source: std::io::Error::other("no async runtime found (run inside tokio)"),
        })?;
        quinn::Endpoint::new(
            endpoint_config,
            server.map(|s| (*s).clone()),
            socket,
            runtime,
        )
        .map_err(|source| QuicError::Socket { addr, source })
    }

    fn client_endpoint(&self, peer: SocketAddr) -> Result<quinn::Endpoint, QuicError> {
        let mut endpoints = self
            .client_endpoints
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        let slot = &mut endpoints[usize::from(peer.is_ipv6())];
        if let Some(ep) = slot {
            return Ok(ep.clone());
        }
        let local: SocketAddr = match (peer.is_ipv6(), peer.ip().is_loopback()) {
            (false, true) => (std::net::Ipv4Addr::LOCALHOST, 0).into(),
            (false, false) => (std::net::Ipv4Addr::UNSPECIFIED, 0).into(),
            (true, true) => (std::net::Ipv6Addr::LOCALHOST, 0).into(),
            (true, false) => (std::net::Ipv6Addr::UNSPECIFIED, 0).into(),
        };
        let ep = self.endpoint(local, None)?;
        *slot = Some(ep.clone());
        Ok(ep)
    }

    fn limits(&self) -> WireLimits {
        self.config.limits
    }
}

/// Whether `addr` is on this machine's loopback (IPv4-mapped IPv6 included): such peers get
/// large datagrams (see [`QuicConfig::loopback_mtu`]).
fn is_loopback(addr: SocketAddr) -> bool {
    match addr.ip() {
        std::net::IpAddr::V4(ip) => ip.is_loopback(),
        std::net::IpAddr::V6(ip) => {
            ip.is_loopback() || ip.to_ipv4_mapped().is_some_and(|v4| v4.is_loopback())
        }
    }
}

/// Socket failures are I/O errors (address in use, ...); the rest is configuration.
fn config_error(e: QuicError) -> TransportError {
    match e {
        QuicError::Socket { addr, source } => {
            TransportError::io(addr, "binding a UDP socket", &source)
        }
        other => ConfigError::Adapter {
            transport: "QUIC",
            message: other.to_string(),
        }
        .into(),
    }
}

#[async_trait]
impl Transport for QuicTransport {
    fn name(&self) -> &'static str {
        "quic"
    }

    fn credentials(&self) -> Credentials {
        self.credentials.clone()
    }

    async fn listen(&self, addr: SocketAddr) -> Result<Box<dyn Listener>, TransportError> {
        let endpoint = self
            .endpoint(addr, Some(self.server[0].clone()))
            .map_err(config_error)?;
        let local_addr = endpoint
            .local_addr()
            .map_err(|e| TransportError::io(addr, "listening", &e))?;
        let (tx, rx) = mpsc::channel(64);
        let ctx = ConnContext {
            endpoint: endpoint.clone(),
            limits: self.limits(),
            max_frames: self.config.max_concurrent_frames as usize,
            max_pending_bytes: self.config.max_pending_bytes,
        };
        let handshake_timeout = self.config.connect_timeout;
        let accept_ep = endpoint.clone();
        let servers = self.server.clone();
        let task = tokio::spawn(async move {
            while let Some(incoming) = accept_ep.accept().await {
                let tx = tx.clone();
                let ctx = ctx.clone();
                let remote = incoming.remote_address();
                let server = servers[usize::from(is_loopback(remote))].clone();
                tokio::spawn(async move {
                    let admitted = admit(incoming, server, ctx);
                    match tokio::time::timeout(handshake_timeout, admitted).await {
                        Ok(Ok(conn)) => {
                            let _ = tx.send(conn).await;
                        }
                        Ok(Err(e)) => tracing::warn!(peer = %remote, "refused QUIC peer: {e}"),
                        Err(_) => tracing::warn!(
                            peer = %remote,
                            "refused QUIC peer: handshake not done within {handshake_timeout:?}"
                        ),
                    }
                });
            }
        });
        tracing::info!(addr = %local_addr, "QUIC listener started");
        Ok(Box::new(QuicListener {
            endpoint,
            local_addr,
            rx: tokio::sync::Mutex::new(rx),
            task,
        }))
    }

    async fn connect(&self, addr: SocketAddr) -> Result<Box<dyn Connection>, TransportError> {
        let endpoint = self.client_endpoint(addr).map_err(config_error)?;
        let connecting = endpoint
            .connect_with(
                self.client[usize::from(is_loopback(addr))].clone(),
                addr,
                self.config.tls.server_name(),
            )
            .map_err(|e| ended::refused(addr, &e))?;
        let ctx = ConnContext {
            endpoint: endpoint.clone(),
            limits: self.limits(),
            max_frames: self.config.max_concurrent_frames as usize,
            max_pending_bytes: self.config.max_pending_bytes,
        };
        let timeout = self.config.connect_timeout;
        let handshake = async move {
            let conn = connecting
                .await
                .map_err(|e| ended::handshake(addr, "connecting", &e))?;
            // Wait for the server's admission: only then has it accepted our certificate.
            let mut first = conn
                .accept_uni()
                .await
                .map_err(|e| ended::handshake(addr, "connecting", &e))?;
            let admit_msg = first.read_to_end(ADMIT.len()).await.map_err(|e| match e {
                quinn::ReadToEndError::Read(ReadError::ConnectionLost(c)) => {
                    ended::handshake(addr, "connecting", &c)
                }
                other => TransportError::Authentication {
                    peer: addr,
                    reason: format!("the peer sent no valid admission: {other}"),
                    source: None,
                },
            })?;
            if admit_msg != ADMIT {
                conn.close(CODE_MALFORMED.into(), b"bad admission");
                return Err(TransportError::Authentication {
                    peer: addr,
                    reason: "the peer is not a tensorwire QUIC node (bad admission message)".into(),
                    source: None,
                });
            }
            // Our stream 0 carries frames; theirs started with the admission.
            Ok(QuicConnection::start(conn, ctx, 0, 1))
        };
        match tokio::time::timeout(timeout, handshake).await {
            Ok(Ok(conn)) => Ok(Box::new(conn)),
            Ok(Err(e)) => Err(e),
            Err(_) => Err(TransportError::Io {
                addr,
                op: "connecting",
                kind: std::io::ErrorKind::TimedOut,
                message: format!("handshake and admission not done within {timeout:?}"),
            }),
        }
    }
}

/// Server side of the handshake: TLS (the client certificate is verified by rustls), then the
/// admission stream.
async fn admit(
    incoming: quinn::Incoming,
    server: Arc<quinn::ServerConfig>,
    ctx: ConnContext,
) -> Result<QuicConnection, TransportError> {
    let remote = incoming.remote_address();
    let op = "accepting";
    let handshake = |e: ConnectionError| ended::handshake(remote, op, &e);
    let conn = incoming
        .accept_with(server)
        .map_err(handshake)?
        .await
        .map_err(handshake)?;
    let mut stream = conn.open_uni().await.map_err(handshake)?;
    let admission = stream.write_all(ADMIT).await;
    admission.map_err(|e| ended::write(remote, op, &e))?;
    stream
        .finish()
        .map_err(|_| ended::stream_closed(remote, op))?;
    tracing::debug!(peer = %remote, "QUIC peer admitted");
    // Our stream 0 was the admission; theirs all carry frames.
    Ok(QuicConnection::start(conn, ctx, 1, 0))
}

/// A QUIC listener; dropping it stops accepting new connections (existing ones go on).
struct QuicListener {
    endpoint: quinn::Endpoint,
    local_addr: SocketAddr,
    rx: tokio::sync::Mutex<mpsc::Receiver<QuicConnection>>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for QuicListener {
    fn drop(&mut self) {
        self.endpoint.set_server_config(None);
        self.task.abort();
    }
}

#[async_trait]
impl Listener for QuicListener {
    fn local_addr(&self) -> SocketAddr {
        self.local_addr
    }

    async fn accept(&self) -> Result<Box<dyn Connection>, TransportError> {
        match self.rx.lock().await.recv().await {
            Some(conn) => Ok(Box::new(conn)),
            None => Err(TransportError::Io {
                addr: self.local_addr,
                op: "accepting",
                kind: std::io::ErrorKind::NotConnected,
                message: "the QUIC endpoint stopped".into(),
            }),
        }
    }
}

/// What a new connection needs from its transport.
#[derive(Clone)]
struct ConnContext {
    /// Kept by every connection: the endpoint's driver must outlive the connection (a dropped
    /// endpoint would not even send the connection's close).
    endpoint: quinn::Endpoint,
    limits: WireLimits,
    max_frames: usize,
    max_pending_bytes: usize,
}

/// How a connection's receiving side ended; repeated by every later `recv`.
#[derive(Debug, Clone)]
enum Terminal {
    Closed,
    /// The peer passed the bound on pending bytes.
    Pending(usize),
    MidFrame(WireError),
    Wire(WireError),
    Ended(Ended),
}

impl Terminal {
    fn to_error(&self, peer: SocketAddr) -> TransportError {
        match self {
            Terminal::Closed => TransportError::Closed { peer },
            Terminal::Pending(limit) => TransportError::PendingBytes {
                peer,
                limit: *limit,
            },
            Terminal::MidFrame(source) => TransportError::ClosedMidFrame {
                peer,
                source: source.clone(),
            },
            Terminal::Wire(source) => TransportError::Wire {
                peer,
                source: source.clone(),
            },
            Terminal::Ended(how) => TransportError::Ended {
                peer,
                op: "receiving",
                how: how.clone(),
            },
        }
    }
}

/// What the reader hands to `recv`.
enum Delivery {
    Frame(Frame, OwnedSemaphorePermit, HeldBytes),
    End(Terminal),
    /// The peer's goodbye; becomes `End(Closed)` when it leaves the order buffer.
    PeerGoodbye,
}

#[derive(Debug, Default)]
struct CloseState {
    /// We sent our goodbye.
    sent_goodbye: bool,
    /// The peer acknowledged our goodbye.
    goodbye_acked: bool,
    /// We delivered the peer's goodbye.
    peer_goodbye: bool,
    /// The handle was dropped: nobody will read what the peer sends any more.
    dropped: bool,
}

struct RecvState {
    order: RecvOrder<Delivery>,
    ended: bool,
}

/// State shared by a connection handle and its background reader.
struct Shared {
    conn: quinn::Connection,
    _endpoint: quinn::Endpoint,
    peer: SocketAddr,
    limits: WireLimits,
    send_order: Mutex<SendOrder>,
    close: Mutex<CloseState>,
    recv_state: Mutex<RecvState>,
    tx: mpsc::UnboundedSender<Delivery>,
    /// Idle frame decoders. A decoder keeps large payload buffers for reuse once the frames
    /// using them are dropped, which spares fresh pages (and a page fault per 4 KiB) for every
    /// large tensor; streams come and go, so the decoders outlive them here.
    decoders: Mutex<Vec<FrameDecoder>>,
    /// Bytes of frames read and not yet taken by `recv`, and their bound.
    pending: Arc<AtomicUsize>,
    max_pending_bytes: usize,
}

/// Bytes of one frame counted in [`Shared::pending`] until it is taken (or dropped).
struct HeldBytes {
    pending: Arc<AtomicUsize>,
    n: usize,
}

impl HeldBytes {
    /// The frame now holds `n` bytes; the connection's total, this frame's included.
    fn set(&mut self, n: usize) -> usize {
        let total = if n >= self.n {
            self.pending.fetch_add(n - self.n, Ordering::AcqRel) + (n - self.n)
        } else {
            self.pending.fetch_sub(self.n - n, Ordering::AcqRel) - (self.n - n)
        };
        self.n = n;
        total
    }
}

impl Drop for HeldBytes {
    fn drop(&mut self) {
        self.pending.fetch_sub(self.n, Ordering::AcqRel);
    }
}

/// Idle decoders kept per connection (each may hold pooled payload buffers).
const IDLE_DECODERS: usize = 2;

impl Shared {
    /// Hands deliveries to `recv`, in order, unless the receiving side has already ended. When
    /// the peer's goodbye comes out of the order buffer (everything sent before it delivered),
    /// `recv` learns of the close and the goodbye is acknowledged.
    fn deliver(self: &Arc<Self>, f: impl FnOnce(&mut RecvOrder<Delivery>) -> Vec<Delivery>) {
        let mut acknowledge = false;
        {
            let mut state = self.recv_state.lock().unwrap_or_else(|e| e.into_inner());
            if state.ended {
                return;
            }
            for d in f(&mut state.order) {
                if state.ended {
                    break;
                }
                let d = match d {
                    Delivery::PeerGoodbye => {
                        acknowledge = true;
                        Delivery::End(Terminal::Closed)
                    }
                    other => other,
                };
                if let Delivery::End(_) = d {
                    state.ended = true;
                }
                let _ = self.tx.send(d);
            }
        }
        if acknowledge {
            self.close
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .peer_goodbye = true;
            let shared = self.clone();
            tokio::spawn(async move {
                let acked = shared
                    .send_stream(
                        TAG_GOODBYE_ACK,
                        None,
                        Vec::new(),
                        "acknowledging goodbye",
                        false,
                    )
                    .await;
                if let Err(e) = acked {
                    tracing::debug!(peer = %shared.peer, "cannot acknowledge goodbye: {e}");
                }
                shared.maybe_finish();
            });
        }
    }

    /// Ends the receiving side now (errors are reported at once, not in order).
    fn end(&self, terminal: Terminal) {
        let mut state = self.recv_state.lock().unwrap_or_else(|e| e.into_inner());
        if !state.ended {
            state.ended = true;
            let _ = self.tx.send(Delivery::End(terminal));
        }
    }

    /// Closes the QUIC connection once both goodbyes are exchanged and acknowledged (or, for a
    /// dropped handle, once the peer has acknowledged ours: nobody reads its frames any more).
    fn maybe_finish(&self) {
        let state = self.close.lock().unwrap_or_else(|e| e.into_inner());
        if state.sent_goodbye && state.goodbye_acked && (state.peer_goodbye || state.dropped) {
            self.conn.close(CODE_DONE.into(), b"done");
        }
    }

    fn fail_malformed(&self, source: WireError) {
        tracing::warn!(peer = %self.peer, "malformed frame, closing the QUIC connection: {source}");
        self.end(Terminal::Wire(source.clone()));
        let reason = source.to_string();
        self.conn.close(
            CODE_MALFORMED.into(),
            &reason.as_bytes()[..reason.len().min(512)],
        );
    }

    /// Sends a stream with `tag` and (for frames and goodbyes) ordering dependencies. `frame`
    /// chunks follow. Cancellation resets the stream and counts it as complete. With
    /// `wait_acked`, returns only once the peer has acknowledged the whole stream.
    async fn send_stream(
        &self,
        tag: u8,
        deps: Option<Deps>,
        frame: Vec<bytes::Bytes>,
        op: &'static str,
        wait_acked: bool,
    ) -> Result<(), TransportError> {
        let stream = self
            .conn
            .open_uni()
            .await
            .map_err(|e| ended::lost(self.peer, op, &e))?;
        let seq = stream.id().index();
        let mut guard = SendGuard {
            shared: self,
            seq,
            stream: Some(stream),
        };
        let mut head = Vec::with_capacity(1 + deps.as_ref().map_or(0, order::encoded_len));
        head.push(tag);
        if let Some(deps) = &deps {
            order::encode(deps, &mut head);
        }
        let mut chunks = Vec::with_capacity(1 + frame.len());
        chunks.push(bytes::Bytes::from(head));
        chunks.extend(frame);
        let stream = guard
            .stream
            .as_mut()
            .expect("stream present until the guard completes");
        stream
            .write_all_chunks(&mut chunks)
            .await
            .map_err(|e| ended::write(self.peer, op, &e))?;
        stream
            .finish()
            .map_err(|_| ended::stream_closed(self.peer, op))?;
        let stream = guard.stream.take();
        drop(guard);
        if let (true, Some(stream)) = (wait_acked, stream) {
            // Resolves once the peer has acknowledged every byte of the stream.
            let acked = stream.stopped().await;
            acked.map_err(|e| ended::stopped(self.peer, op, &e))?;
        }
        Ok(())
    }

    async fn say_goodbye(&self) -> Result<(), TransportError> {
        {
            let mut state = self.close.lock().unwrap_or_else(|e| e.into_inner());
            if state.sent_goodbye {
                return Ok(());
            }
            state.sent_goodbye = true;
        }
        let deps = self.send_order().begin();
        // Wait for the acknowledgement: a caller may stop driving the runtime once `close`
        // returns, and the goodbye must have reached the peer by then.
        self.send_stream(TAG_GOODBYE, Some(deps), Vec::new(), "closing", true)
            .await?;
        self.maybe_finish();
        Ok(())
    }

    fn send_order(&self) -> std::sync::MutexGuard<'_, SendOrder> {
        self.send_order.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// Marks a send complete when it ends; resets the stream if the send was cancelled or failed
/// part-way, so the receiver skips it instead of reporting a truncated frame.
struct SendGuard<'a> {
    shared: &'a Shared,
    seq: u64,
    stream: Option<quinn::SendStream>,
}

impl Drop for SendGuard<'_> {
    fn drop(&mut self) {
        if let Some(mut stream) = self.stream.take() {
            let _ = stream.reset(CODE_CANCELLED.into());
        }
        self.shared.send_order().complete(self.seq);
    }
}

/// A QUIC connection to one authenticated peer.
struct QuicConnection {
    shared: Arc<Shared>,
    rx: tokio::sync::Mutex<(mpsc::UnboundedReceiver<Delivery>, Option<Terminal>)>,
    reader: tokio::task::JoinHandle<()>,
}

impl QuicConnection {
    /// Starts the background reader. `first_send` / `first_recv`: the first stream indices that
    /// carry frames in each direction (the server's stream 0 is the admission).
    fn start(conn: quinn::Connection, ctx: ConnContext, first_send: u64, first_recv: u64) -> Self {
        let (tx, rx) = mpsc::unbounded_channel();
        let shared = Arc::new(Shared {
            peer: conn.remote_address(),
            conn,
            _endpoint: ctx.endpoint,
            limits: ctx.limits,
            send_order: Mutex::new(SendOrder::starting_at(first_send)),
            close: Mutex::new(CloseState::default()),
            recv_state: Mutex::new(RecvState {
                order: RecvOrder::starting_at(first_recv),
                ended: false,
            }),
            tx,
            decoders: Mutex::new(Vec::new()),
            pending: Arc::new(AtomicUsize::new(0)),
            max_pending_bytes: ctx.max_pending_bytes,
        });
        let reader = tokio::spawn(read_loop(shared.clone(), ctx.max_frames));
        Self {
            shared,
            rx: tokio::sync::Mutex::new((rx, None)),
            reader,
        }
    }
}

impl Drop for QuicConnection {
    fn drop(&mut self) {
        let stats = self.shared.conn.stats();
        tracing::debug!(
            peer = %self.shared.peer,
            rtt_us = stats.path.rtt.as_micros() as u64,
            cwnd = stats.path.cwnd,
            mtu = stats.path.current_mtu,
            sent_packets = stats.path.sent_packets,
            lost_packets = stats.path.lost_packets,
            congestion_events = stats.path.congestion_events,
            udp_tx_datagrams = stats.udp_tx.datagrams,
            udp_tx_ios = stats.udp_tx.ios,
            udp_rx_datagrams = stats.udp_rx.datagrams,
            udp_rx_ios = stats.udp_rx.ios,
            "QUIC connection dropped"
        );
        let shared = self.shared.clone();
        shared
            .close
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .dropped = true;
        let reader = self.reader.abort_handle();
        match tokio::runtime::Handle::try_current() {
            Ok(handle) => {
                handle.spawn(async move {
                    // Say goodbye so the peer gets everything sent so far, then give the
                    // exchange a bounded time before closing for good.
                    let _ = tokio::time::timeout(LINGER, async {
                        let _ = shared.say_goodbye().await;
                        shared.maybe_finish();
                        shared.conn.closed().await;
                    })
                    .await;
                    shared.conn.close(CODE_DONE.into(), b"dropped");
                    reader.abort();
                });
            }
            Err(_) => {
                shared.conn.close(CODE_DONE.into(), b"dropped");
                reader.abort();
            }
        }
    }
}

#[async_trait]
impl Connection for QuicConnection {
    fn peer_addr(&self) -> SocketAddr {
        self.shared.peer
    }

    fn transport(&self) -> &'static str {
        "quic"
    }

    fn check_peer_name(&self, name: &str) -> Result<(), IdentityError> {
        let chain = self.shared.conn.peer_identity().and_then(|id| {
            id.downcast::<Vec<rustls_pki_types::CertificateDer<'static>>>()
                .ok()
        });
        crate::certs::check_certified_name(chain.as_deref().map_or(&[], |c| c), name).map_err(
            |reason| IdentityError {
                peer: self.shared.peer,
                name: name.to_owned(),
                reason,
            },
        )
    }

    fn peer_credentials(&self) -> Credentials {
        let chain = self.shared.conn.peer_identity().and_then(|id| {
            id.downcast::<Vec<rustls_pki_types::CertificateDer<'static>>>()
                .ok()
        });
        crate::certs::credentials_of(chain.as_deref().map_or(&[], |c| c))
    }

    async fn send(&self, frame: Frame) -> Result<(), TransportError> {
        let shared = &*self.shared;
        if shared
            .close
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .sent_goodbye
        {
            return Err(TransportError::Ended {
                peer: shared.peer,
                op: "sending",
                how: Ended::ClosedHere,
            });
        }
        let out =
            OutgoingFrame::new(frame, &shared.limits).map_err(|source| TransportError::Wire {
                peer: shared.peer,
                source,
            })?;
        // Snapshot what has completed *before* opening the stream: exactly the frames this one
        // must follow, and all of them on streams with smaller numbers.
        let deps = shared.send_order().begin();
        shared
            .send_stream(TAG_FRAME, Some(deps), out.into_chunks(), "sending", false)
            .await
    }

    async fn recv(&self) -> Result<Frame, TransportError> {
        let mut guard = self.rx.lock().await;
        let (rx, terminal) = &mut *guard;
        if let Some(t) = terminal {
            return Err(t.to_error(self.shared.peer));
        }
        match rx.recv().await {
            Some(Delivery::Frame(frame, _permit, _held)) => Ok(frame),
            Some(Delivery::PeerGoodbye) => {
                // `deliver` turns goodbyes into `End(Closed)`; treat a stray one alike.
                *terminal = Some(Terminal::Closed);
                Err(TransportError::Closed {
                    peer: self.shared.peer,
                })
            }
            Some(Delivery::End(t)) => {
                let err = t.to_error(self.shared.peer);
                *terminal = Some(t);
                Err(err)
            }
            None => {
                *terminal = Some(Terminal::Closed);
                Err(TransportError::Closed {
                    peer: self.shared.peer,
                })
            }
        }
    }

    async fn close(&self) -> Result<(), TransportError> {
        self.shared.say_goodbye().await
    }
}

/// Maps how a connection ended to what `recv` reports between frames.
fn terminal_of(e: &ConnectionError) -> Terminal {
    ended::unclean(e).map_or(Terminal::Closed, Terminal::Ended)
}

/// Accepts the peer's streams in order and reads each in its own task.
async fn read_loop(shared: Arc<Shared>, max_frames: usize) {
    // Bounds frames read but not yet taken by `recv`: a peer cannot make us buffer without end.
    let permits = Arc::new(Semaphore::new(max_frames.max(1)));
    let mut tasks = JoinSet::new();
    let lost = loop {
        while tasks.try_join_next().is_some() {}
        let Ok(permit) = permits.clone().acquire_owned().await else {
            break None;
        };
        match shared.conn.accept_uni().await {
            Ok(stream) => {
                tasks.spawn(read_stream(shared.clone(), stream, permit));
            }
            Err(e) => break Some(e),
        }
    };
    // Streams still being read report their own errors (mid-frame) before the end.
    while tasks.join_next().await.is_some() {}
    let terminal = lost.as_ref().map_or(Terminal::Closed, terminal_of);
    if let Terminal::Ended(how) = &terminal {
        tracing::debug!(peer = %shared.peer, "QUIC connection ended: {how}");
    }
    shared.end(terminal);
}

/// What one stream turned out to carry.
enum Carried {
    Frame(Deps, Frame, HeldBytes),
    Goodbye(Deps),
    GoodbyeAck,
    /// Reset by the sender (a cancelled send): nothing to deliver.
    Cancelled,
}

/// Why reading a stream failed.
enum StreamFailure {
    Malformed(WireError),
    MidFrame(WireError),
    /// The connection ended before any byte of this stream arrived.
    Lost,
    /// Frames read and not yet taken would pass the bound (the bound).
    OverBudget(usize),
}

async fn read_stream(shared: Arc<Shared>, mut stream: RecvStream, permit: OwnedSemaphorePermit) {
    let seq = stream.id().index();
    let carried = read_carried(&mut stream, seq, &shared).await;
    match carried {
        Ok(Carried::Frame(deps, frame, held)) => {
            shared.deliver(|order| order.arrive(seq, deps, Delivery::Frame(frame, permit, held)));
        }
        Ok(Carried::Goodbye(deps)) => {
            shared.deliver(|order| order.arrive(seq, deps, Delivery::PeerGoodbye));
        }
        Ok(Carried::GoodbyeAck) => {
            shared.deliver(|order| order.skip(seq));
            shared
                .close
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .goodbye_acked = true;
            shared.maybe_finish();
        }
        Ok(Carried::Cancelled) => shared.deliver(|order| order.skip(seq)),
        Err(StreamFailure::Malformed(e)) => shared.fail_malformed(e),
        Err(StreamFailure::MidFrame(e)) => shared.end(Terminal::MidFrame(e)),
        Err(StreamFailure::Lost) => {}
        Err(StreamFailure::OverBudget(limit)) => {
            tracing::warn!(peer = %shared.peer, limit, "closing the QUIC connection: too many bytes pending");
            shared.end(Terminal::Pending(limit));
            shared
                .conn
                .close(CODE_MALFORMED.into(), b"too many bytes pending");
        }
    }
}

/// Reads up to `max` bytes of the stream into `dst`; `Ok(false)` at the end of the stream.
async fn read_some(
    stream: &mut RecvStream,
    dst: &mut impl BufMut,
    max: usize,
) -> Result<bool, ReadError> {
    let want = dst.remaining_mut().min(max);
    match stream.read_chunk(want, true).await? {
        Some(chunk) => {
            dst.put_slice(&chunk.bytes);
            Ok(true)
        }
        None => Ok(false),
    }
}

fn truncated(part: &'static str, received: usize, expected: usize) -> WireError {
    WireError::Truncated {
        part,
        received: received as u64,
        expected: expected as u64,
    }
}

/// Reads exactly `n` bytes of a stream's own header (tag, dependencies).
async fn read_head(
    stream: &mut RecvStream,
    buf: &mut BytesMut,
    n: usize,
    any_read: &mut bool,
) -> Result<(), Result<Carried, StreamFailure>> {
    while buf.len() < n {
        let missing = n - buf.len();
        let mut limited = (&mut *buf).limit(missing);
        match read_some(stream, &mut limited, usize::MAX).await {
            Ok(true) => *any_read = true,
            Ok(false) if !*any_read => {
                return Err(Err(StreamFailure::Malformed(WireError::MalformedHeader {
                    reason: "empty stream".into(),
                })))
            }
            Ok(false) => {
                return Err(Err(StreamFailure::MidFrame(truncated(
                    "stream header",
                    buf.len(),
                    n,
                ))))
            }
            Err(ReadError::Reset(_)) => return Err(Ok(Carried::Cancelled)),
            Err(_) if !*any_read => return Err(Err(StreamFailure::Lost)),
            Err(_) => {
                return Err(Err(StreamFailure::MidFrame(truncated(
                    "stream header",
                    buf.len(),
                    n,
                ))))
            }
        }
    }
    Ok(())
}

async fn read_carried(
    stream: &mut RecvStream,
    seq: u64,
    shared: &Shared,
) -> Result<Carried, StreamFailure> {
    let mut any_read = false;
    let mut head = BytesMut::with_capacity(64);
    macro_rules! head {
        ($n:expr) => {
            match read_head(stream, &mut head, $n, &mut any_read).await {
                Ok(()) => {}
                Err(done) => return done,
            }
        };
    }
    let deps = loop {
        match order::decode_prefix(&head, seq) {
            Ok(Decoded::Incomplete { need }) => head!(need),
            Ok(Decoded::Complete(Prefix::GoodbyeAck, _)) => return Ok(Carried::GoodbyeAck),
            Ok(Decoded::Complete(Prefix::Goodbye(deps), _)) => return Ok(Carried::Goodbye(deps)),
            Ok(Decoded::Complete(Prefix::Frame(deps), _)) => break deps,
            Err(e) => {
                return Err(StreamFailure::Malformed(WireError::MalformedHeader {
                    reason: e.to_string(),
                }))
            }
        }
    };

    // The frame: read straight into the decoder's segment buffers where it has them, else into
    // a small staging buffer (prefix and frame header).
    let mut decoder = shared
        .decoders
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .pop()
        .unwrap_or_else(|| FrameDecoder::new(shared.limits));
    let held = HeldBytes {
        pending: shared.pending.clone(),
        n: 0,
    };
    let carried = read_frame(stream, deps, &mut decoder, held, shared.max_pending_bytes).await;
    if carried.is_ok() && !decoder.is_mid_frame() {
        let mut idle = shared.decoders.lock().unwrap_or_else(|e| e.into_inner());
        if idle.len() < IDLE_DECODERS {
            idle.push(decoder);
        }
    }
    carried
}

/// Reads the one frame of a stream with `decoder`, then checks the stream ends there.
async fn read_frame(
    stream: &mut RecvStream,
    deps: Deps,
    decoder: &mut FrameDecoder,
    mut held: HeldBytes,
    max_pending: usize,
) -> Result<Carried, StreamFailure> {
    let mut staging = BytesMut::new();
    loop {
        if let Some(frame) = decoder
            .decode(&mut staging)
            .map_err(StreamFailure::Malformed)?
        {
            // One frame per stream: anything after it is a protocol violation.
            if !staging.is_empty() {
                return Err(StreamFailure::Malformed(WireError::MalformedHeader {
                    reason: "bytes after the frame on its stream".into(),
                }));
            }
            let mut probe = [0u8; 1];
            return match stream.read(&mut probe).await {
                Ok(None) => Ok(Carried::Frame(deps, frame, held)),
                Ok(Some(_)) => Err(StreamFailure::Malformed(WireError::MalformedHeader {
                    reason: "bytes after the frame on its stream".into(),
                })),
                Err(ReadError::Reset(_)) => Ok(Carried::Cancelled),
                Err(_) => Err(StreamFailure::MidFrame(truncated("stream end", 0, 0))),
            };
        }
        let read = match decoder.direct_read_buf(1) {
            Some(mut dst) => read_some(stream, &mut dst, usize::MAX).await,
            None => {
                staging.reserve(4096);
                let mut limited = (&mut staging).limit(4096);
                read_some(stream, &mut limited, 4096).await
            }
        };
        match read {
            Ok(true) => {
                let mine = decoder.received() as usize;
                let total = held.set(mine);
                // One frame alone may pass the bound; frames together may not.
                if total > max_pending && total > mine {
                    return Err(StreamFailure::OverBudget(max_pending));
                }
            }
            Ok(false) => {
                return Err(StreamFailure::MidFrame(
                    decoder
                        .finish()
                        .err()
                        .unwrap_or_else(|| truncated("frame", 0, 0)),
                ))
            }
            Err(ReadError::Reset(_)) => return Ok(Carried::Cancelled),
            Err(_) => {
                return Err(StreamFailure::MidFrame(
                    decoder
                        .finish()
                        .err()
                        .unwrap_or_else(|| truncated("frame", 0, 0)),
                ))
            }
        }
    }
}
