//! The TCP store server: PyTorch c10d `TCPStore`'s protocol (see [`crate::protocol`]) on tokio.
//!
//! One task per connection. A connection's task reads requests into a buffer, decodes every
//! complete one, answers in order, and otherwise sleeps on three events: more bytes, one of its
//! parked waits completing, or shutdown. Waits are parked in the shared table and completed by
//! the write that provides the last missing key; nothing polls.
//!
//! A malformed request (unknown query type, a length over the [`Limits`], a bad magic number,
//! `add` or `barrier` on a value that is not an integer) closes that connection only, as c10d
//! does, with a warning that names the peer and what was wrong; the c10d protocol has no error
//! reply. So does an `add` or `barrier` that would take a count past `i64::MAX`, where
//! PyTorch's server wraps around: the value is left as it was.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use bytes::{Buf, BytesMut};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream, ToSocketAddrs};
use tokio::sync::mpsc::{unbounded_channel, UnboundedReceiver};
use tokio::sync::watch;
use tokio::task::{JoinHandle, JoinSet};
use tracing::{debug, info, warn};

use crate::handshake;
use crate::protocol::{
    self, KeyDisplay, Limits, Request, CHECK_NOT_READY, CHECK_READY, VALIDATION_MAGIC,
    WAIT_CANCELED, WAIT_STOP_WAITING,
};
use crate::table::{AddError, Arrival, KvState};
use tensorwire_core::auth::ClusterSecret;

#[doc(hidden)]
pub mod fuzzing;

/// Configuration of a [`TcpStoreServer`].
#[derive(Debug, Clone)]
pub struct ServerConfig {
    /// Size limits on requests.
    pub limits: Limits,
    /// When set, clients must authenticate first (see [`crate::handshake`]); PyTorch clients cannot.
    pub secret: Option<ClusterSecret>,
    /// Most waits one connection may have parked at once (a client parks at most one).
    pub max_waits_per_connection: usize,
}

impl Default for ServerConfig {
    fn default() -> Self {
        ServerConfig {
            limits: Limits::default(),
            secret: None,
            max_waits_per_connection: 64,
        }
    }
}

struct Shared {
    state: Mutex<KvState>,
    config: ServerConfig,
    next_conn: AtomicU64,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, KvState> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// A running store server. Dropping it (or [`shutdown`](TcpStoreServer::shutdown)) stops it.
///
/// ```
/// # tokio::runtime::Runtime::new().unwrap().block_on(async {
/// use tensorwire_core::ports::store::Store;
/// use tensorwire_store::{ClientConfig, ServerConfig, TcpStoreClient, TcpStoreServer};
///
/// let server = TcpStoreServer::bind("127.0.0.1:0", ServerConfig::default()).await.unwrap();
/// let client = TcpStoreClient::connect(&server.local_addr().to_string(), ClientConfig::default())
///     .await
///     .unwrap();
/// client.set("hello", b"world").await.unwrap();
/// assert_eq!(client.get("hello").await.unwrap(), b"world");
/// server.shutdown().await;
/// # });
/// ```
pub struct TcpStoreServer {
    local_addr: SocketAddr,
    stop: watch::Sender<bool>,
    task: Option<JoinHandle<()>>,
}

impl std::fmt::Debug for TcpStoreServer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TcpStoreServer")
            .field("local_addr", &self.local_addr)
            .finish_non_exhaustive()
    }
}

/// Listens on `addr` with the deepest backlog the system allows (as `TcpListener::bind`
/// otherwise: `SO_REUSEADDR` on Unix).
fn listen_deep(addr: SocketAddr) -> std::io::Result<TcpListener> {
    let socket = if addr.is_ipv4() {
        tokio::net::TcpSocket::new_v4()?
    } else {
        tokio::net::TcpSocket::new_v6()?
    };
    #[cfg(unix)]
    socket.set_reuseaddr(true)?;
    socket.bind(addr)?;
    // The kernel caps it at net.core.somaxconn.
    socket.listen(65_535)
}

impl TcpStoreServer {
    /// Binds `addr` (port 0 picks a free port) and starts serving in the background.
    ///
    /// The listen backlog is as deep as the system allows (`net.core.somaxconn`), not tokio's
    /// 1024: thousands of ranks connect at once at a rendezvous, and a connection that finds the
    /// queue full is retried by the kernel only after a second.
    pub async fn bind(addr: impl ToSocketAddrs, config: ServerConfig) -> std::io::Result<Self> {
        let mut last = None;
        for addr in tokio::net::lookup_host(addr).await? {
            match listen_deep(addr) {
                Ok(listener) => return Ok(Self::serve(listener, config)),
                Err(e) => last = Some(e),
            }
        }
        Err(last.unwrap_or_else(|| {
            std::io::Error::new(
                std::io::ErrorKind::InvalidInput,
                "the address resolved to nothing",
            )
        }))
    }

    /// Serves on an already bound listener.
    pub fn serve(listener: TcpListener, config: ServerConfig) -> Self {
        let local_addr = listener
            .local_addr()
            .expect("a bound listener has a local address");
        let (stop, stopped) = watch::channel(false);
        let shared = Arc::new(Shared {
            state: Mutex::new(KvState::default()),
            config,
            next_conn: AtomicU64::new(0),
        });
        info!(%local_addr, secret = shared.config.secret.is_some(), "store server listening");
        let task = tokio::spawn(accept_loop(listener, shared, stopped));
        TcpStoreServer {
            local_addr,
            stop,
            task: Some(task),
        }
    }

    /// The address the server listens on.
    pub fn local_addr(&self) -> SocketAddr {
        self.local_addr
    }

    /// Stops accepting, closes every connection and waits until the listener and every
    /// connection are closed: when it returns, the port is free to bind again.
    pub async fn shutdown(mut self) {
        let _ = self.stop.send(true);
        if let Some(task) = self.task.take() {
            let _ = task.await;
        }
    }
}

impl Drop for TcpStoreServer {
    fn drop(&mut self) {
        let _ = self.stop.send(true);
    }
}

async fn accept_loop(
    listener: TcpListener,
    shared: Arc<Shared>,
    mut stopped: watch::Receiver<bool>,
) {
    // The connections' tasks, so that stopping the server ends them too.
    let mut connections = JoinSet::new();
    loop {
        tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok((stream, peer)) => {
                    let id = shared.next_conn.fetch_add(1, Ordering::Relaxed);
                    let shared = shared.clone();
                    let stopped = stopped.clone();
                    connections.spawn(async move {
                        let reason = serve_connection(stream, id, &shared, stopped).await;
                        shared.lock().cancel_owner(id);
                        match reason {
                            Closed::Eof | Closed::Shutdown => debug!(%peer, "store connection closed"),
                            Closed::Io(e) => debug!(%peer, error = %e, "store connection lost"),
                            Closed::Refused(why) => warn!(%peer, "closing store connection: {why}"),
                        }
                    });
                }
                // Running out of file descriptors and the like: keep serving the others.
                Err(e) => {
                    warn!(error = %e, "store server failed to accept a connection");
                    tokio::time::sleep(std::time::Duration::from_millis(10)).await;
                }
            },
            Some(_) = connections.join_next() => {}
            _ = stopped.changed() => break,
        }
    }
    drop(listener);
    // Every connection task ends at its next turn on the stop signal; aborting also ends one
    // that is stuck writing to a client that does not read.
    connections.abort_all();
    while connections.join_next().await.is_some() {}
    debug!("store server stopped");
}

enum Closed {
    Eof,
    Shutdown,
    Io(std::io::Error),
    Refused(String),
}

impl From<std::io::Error> for Closed {
    fn from(e: std::io::Error) -> Self {
        Closed::Io(e)
    }
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Phase {
    /// Secret configured: waiting for `AUTH_HELLO`.
    AuthHello,
    /// Challenge sent: waiting for `AUTH_PROOF`.
    AuthProof {
        client_nonce: [u8; protocol::AUTH_LEN],
        server_nonce: [u8; protocol::AUTH_LEN],
    },
    /// Waiting for c10d's `VALIDATE`.
    Validate,
    /// Serving.
    Ready,
}

async fn serve_connection(
    mut stream: TcpStream,
    id: u64,
    shared: &Shared,
    mut stopped: watch::Receiver<bool>,
) -> Closed {
    let _ = stream.set_nodelay(true);
    let config = &shared.config;
    let mut phase = if config.secret.is_some() {
        Phase::AuthHello
    } else {
        Phase::Validate
    };
    let mut input = BytesMut::with_capacity(4096);
    let mut output = Vec::with_capacity(256);
    let (notify, mut fired) = unbounded_channel();
    loop {
        loop {
            let (request, used) = match protocol::decode_request(&input, &config.limits) {
                Ok(Some(decoded)) => decoded,
                Ok(None) => break,
                Err(e) => return Closed::Refused(format!("malformed request: {e}")),
            };
            input.advance(used);
            let step = handle(
                request,
                &mut phase,
                id,
                shared,
                &notify,
                &mut fired,
                &mut output,
            );
            if let Err(why) = step {
                // Send what was answered before the bad request (the auth rejection, say).
                let _ = stream.write_all(&output).await;
                return Closed::Refused(why);
            }
        }
        if !output.is_empty() {
            if let Err(e) = stream.write_all(&output).await {
                return e.into();
            }
            output.clear();
        }
        tokio::select! {
            read = stream.read_buf(&mut input) => match read {
                Ok(0) => return Closed::Eof,
                Ok(_) => {}
                Err(e) => return e.into(),
            },
            Some(_) = fired.recv() => output.push(WAIT_STOP_WAITING),
            _ = stopped.changed() => return Closed::Shutdown,
        }
    }
}

/// Handles one request; `Err` closes the connection with that reason.
fn handle(
    request: Request,
    phase: &mut Phase,
    id: u64,
    shared: &Shared,
    notify: &tokio::sync::mpsc::UnboundedSender<u64>,
    fired: &mut UnboundedReceiver<u64>,
    out: &mut Vec<u8>,
) -> Result<(), String> {
    match (*phase, request) {
        (
            Phase::AuthHello,
            Request::AuthHello {
                nonce: client_nonce,
            },
        ) => {
            let secret = shared
                .config
                .secret
                .as_ref()
                .expect("phase implies a secret");
            let server_nonce = handshake::nonce();
            out.push(handshake::STATUS_OK);
            out.extend_from_slice(&server_nonce);
            out.extend_from_slice(&handshake::server_mac(secret, &client_nonce, &server_nonce));
            *phase = Phase::AuthProof {
                client_nonce,
                server_nonce,
            };
            Ok(())
        }
        (Phase::AuthHello, other) => {
            out.extend_from_slice(&handshake::AUTH_REQUIRED_MARKER.to_ne_bytes());
            Err(format!(
                "unauthenticated client refused (first query type {}): this store has a cluster \
             secret; PyTorch clients cannot authenticate, run the store without a secret for \
             mixed jobs",
                other.query_byte()
            ))
        }
        (
            Phase::AuthProof {
                client_nonce,
                server_nonce,
            },
            Request::AuthProof { mac },
        ) => {
            let secret = shared
                .config
                .secret
                .as_ref()
                .expect("phase implies a secret");
            if handshake::macs_equal(
                &mac,
                &handshake::client_mac(secret, &client_nonce, &server_nonce),
            ) {
                out.push(handshake::STATUS_OK);
                *phase = Phase::Validate;
                Ok(())
            } else {
                out.push(handshake::STATUS_REJECTED);
                Err("authentication failed: wrong cluster secret".to_owned())
            }
        }
        (Phase::AuthProof { .. }, other) => Err(format!(
            "expected the authentication proof, got query type {}",
            other.query_byte()
        )),
        (Phase::Validate, Request::AuthHello { .. }) if shared.config.secret.is_none() => {
            // Tell a tensorwire client with a secret that this server has none; it decides.
            out.push(handshake::STATUS_NO_SECRET);
            Ok(())
        }
        (Phase::Validate, Request::Validate { magic }) if magic == VALIDATION_MAGIC => {
            *phase = Phase::Ready;
            Ok(())
        }
        (Phase::Validate, Request::Validate { magic }) => Err(format!(
            "validation failed: magic number {magic:#010x}, expected {VALIDATION_MAGIC:#010x}"
        )),
        (Phase::Validate, other) => Err(format!(
            "the first query must be VALIDATE, got query type {}",
            other.query_byte()
        )),
        (Phase::Ready, request) => serve(request, id, shared, notify, fired, out),
    }
}

fn serve(
    request: Request,
    id: u64,
    shared: &Shared,
    notify: &tokio::sync::mpsc::UnboundedSender<u64>,
    fired: &mut UnboundedReceiver<u64>,
    out: &mut Vec<u8>,
) -> Result<(), String> {
    match request {
        Request::Ping { nonce } => out.extend_from_slice(&nonce.to_ne_bytes()),
        Request::Set { key, value } => shared.lock().set(key, value),
        Request::CompareSet {
            key,
            expected,
            desired,
        } => {
            let value = shared.lock().compare_set(&key, &expected, desired);
            protocol::put_bytes(out, &value);
        }
        Request::Get { key } => {
            let state = shared.lock();
            protocol::put_bytes(out, state.get(&key).map(Vec::as_slice).unwrap_or_default());
        }
        Request::Add { key, delta } => match shared.lock().add(&key, delta) {
            Ok(sum) => out.extend_from_slice(&sum.to_ne_bytes()),
            Err(e) => return Err(refused_count("add", &key, e)),
        },
        Request::Barrier { key, world_size } => {
            let mut state = shared.lock();
            if state.parked_by(id) >= shared.config.max_waits_per_connection {
                return Err(too_many_waits(shared));
            }
            match state.barrier(&key, world_size, id, notify.clone()) {
                Ok(Arrival::Released) => out.push(WAIT_STOP_WAITING),
                // Answered through `fired` once the count reaches the world size.
                Ok(Arrival::Parked(_)) => {}
                Err(e) => return Err(refused_count("barrier", &key, e)),
            }
        }
        Request::Check { keys } => {
            let ready = shared.lock().check(&keys);
            out.push(if ready { CHECK_READY } else { CHECK_NOT_READY });
        }
        Request::Wait { keys } => {
            let mut state = shared.lock();
            if state.parked_by(id) >= shared.config.max_waits_per_connection {
                return Err(too_many_waits(shared));
            }
            if state.park(&keys, id, notify.clone()).is_none() {
                out.push(WAIT_STOP_WAITING);
            }
        }
        Request::GetNumKeys => out.extend_from_slice(&(shared.lock().len() as i64).to_ne_bytes()),
        Request::DeleteKey { key } => {
            let deleted = shared.lock().delete(&key);
            out.extend_from_slice(&i64::from(deleted).to_ne_bytes());
        }
        Request::Append { key, value } => shared.lock().append(&key, &value),
        Request::MultiGet { keys } => {
            let state = shared.lock();
            for key in &keys {
                protocol::put_bytes(out, state.get(key).map(Vec::as_slice).unwrap_or_default());
            }
        }
        Request::MultiSet { pairs } => {
            let mut state = shared.lock();
            for (key, value) in pairs {
                state.set(key, value);
            }
        }
        Request::CancelWait => {
            // After this no wait of ours can fire, so whatever fired before is in the channel:
            // answer those first, as c10d's client expects STOP_WAITING before WAIT_CANCELED.
            shared.lock().cancel_owner(id);
            while fired.try_recv().is_ok() {
                out.push(WAIT_STOP_WAITING);
            }
            out.push(WAIT_CANCELED);
        }
        Request::QueuePush { key, value } => shared.lock().queue_push(&key, value),
        Request::QueuePop { key } => {
            let (len, item) = shared.lock().queue_pop(&key);
            out.extend_from_slice(&(len as i64).to_ne_bytes());
            if let Some(item) = item {
                protocol::put_bytes(out, &item);
            }
        }
        Request::QueueLen { key } => {
            let len = shared.lock().queue_len(&key);
            out.extend_from_slice(&(len as i64).to_ne_bytes());
        }
        Request::ListKeys => {
            let state = shared.lock();
            out.extend_from_slice(&(state.len() as u64).to_ne_bytes());
            for key in state.keys() {
                protocol::put_bytes(out, key);
            }
        }
        Request::Validate { .. } => return Err("VALIDATE sent twice".to_owned()),
        Request::AuthHello { .. } | Request::AuthProof { .. } => {
            return Err("authentication query after validation".to_owned())
        }
    }
    Ok(())
}

fn too_many_waits(shared: &Shared) -> String {
    format!(
        "more than {} waits parked by one connection",
        shared.config.max_waits_per_connection
    )
}

/// Why an `add` or a `barrier` on `key` was refused.
fn refused_count(op: &str, key: &[u8], e: AddError) -> String {
    match e {
        AddError::NotAnInteger(v) => format!(
            "{op} on key {} whose value {} is not a decimal integer",
            KeyDisplay(key),
            KeyDisplay(&v)
        ),
        AddError::Overflow => format!("{op} on key {} overflows i64", KeyDisplay(key)),
    }
}
