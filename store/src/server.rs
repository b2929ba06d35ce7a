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
//!
//! # Bounds
//!
//! One client must not take the server down, so the server keeps to bounds PyTorch's server
//! does not have (each a field of [`ServerConfig`], and a flag of `tensorwire store serve`):
//! how many connections are open, how long a connection may take to authenticate and
//! validate, how many keys and how many bytes of keys and values the table holds, how large a
//! value may grow (`APPEND` included), how large a request and a reply may be, and how many
//! reply bytes may wait for a client that does not read. A request that would pass a bound is
//! refused as a malformed one is: the connection is closed with a warning that names the
//! bound and the client, the table is left as it was, and everyone else is served on.
//!
//! Replies are not assembled under the table's lock: a `GET` or `MULTI_GET` takes shared
//! handles on the stored values under the lock and writes them after releasing it, as the
//! socket accepts them. While more than [`ServerConfig::max_queued_bytes`] wait for a client,
//! its requests are not read (back-pressure); a client that accepts nothing for
//! [`ServerConfig::write_stall_timeout`] is dropped.
//!
//! # One memory budget
//!
//! [`ServerConfig::memory_budget`] bounds everything the server holds for its clients (see
//! [`ServerStats::memory_used`]): keys and values; values that left the table (overwritten,
//! deleted) while a queued reply still shares them, until it is written; request bytes read
//! and not yet handled; reply bytes that are the connection's own (copies of small values,
//! numbers, popped queue items). A reply that shares a stored value costs nothing more. Keys
//! and values may not take the last sixteenth of the budget (at most 16 MiB), which is kept
//! for the connections, so a full table does not stop the server reading requests (a `DELETE`
//! among them). A connection reads at most 64 KiB at a time, and only what the budget has room
//! for; it handles a request only while the budget has room for a small reply. A request
//! whose rest finds no room is refused (the bound `memory_budget`); a connection that waits
//! for room longer than [`ServerConfig::write_stall_timeout`] is refused the same way. Not
//! counted: the spare capacity of buffers, and the bookkeeping of keys, waits and connections.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use bytes::{Buf, BufMut, Bytes, BytesMut};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::tcp::{ReadHalf, WriteHalf};
use tokio::net::{TcpListener, TcpStream, ToSocketAddrs};
use tokio::sync::mpsc::{unbounded_channel, UnboundedReceiver};
use tokio::sync::watch;
use tokio::task::{JoinHandle, JoinSet};
use tokio::time::Instant;
use tracing::{debug, info, warn};

use crate::handshake;
use crate::protocol::{
    self, Limits, Request, CHECK_NOT_READY, CHECK_READY, CLOSING_REASONS_KEY,
    CONNECTIONS_FULL_MARKER, VALIDATION_MAGIC, WAIT_CANCELED, WAIT_STOP_WAITING,
};
use crate::table::{Arrival, Budget, KvState};
use output::Output;
use refusal::{
    malformed, no_room, refused_count, refused_write, too_long_a_reply, too_many_waits, Refusal,
};
use tensorwire_core::auth::ClusterSecret;

#[doc(hidden)]
pub mod fuzzing;
mod output;
mod refusal;

/// Configuration of a [`TcpStoreServer`]: its secret and its bounds.
///
/// One client must not take the server down, so the server keeps to bounds PyTorch's server
/// does not have; the defaults are far above what a training job's rendezvous and process
/// groups use. A request that would pass a bound is refused as a malformed one is: that
/// connection is closed (c10d has no error reply) with a warning naming the bound and the
/// client, the table is left as it was, and everyone else is served on. Replies are written
/// from shared handles on the stored values after the table's lock is released. While more
/// than [`max_queued_bytes`](ServerConfig::max_queued_bytes) of replies wait for a client, its
/// requests are not read; a client that then reads none for
/// [`write_stall_timeout`](ServerConfig::write_stall_timeout) is dropped.
/// [`TcpStoreServer::stats`] reports the server's own accounting.
#[derive(Debug, Clone)]
pub struct ServerConfig {
    /// Size limits on requests: key length, value size (which also bounds what `APPEND` grows a
    /// value to), keys per request and request size.
    pub limits: Limits,
    /// When set, clients must authenticate first (see [`crate::handshake`]); PyTorch clients cannot.
    pub secret: Option<ClusterSecret>,
    /// Most waits one connection may have parked at once (a client parks at most one).
    pub max_waits_per_connection: usize,
    /// Most connections open at once; a connection past it is closed as soon as accepted.
    /// Default 65,536 (a rank holds one or two; the open-file limit may well bind first).
    pub max_connections: usize,
    /// Longest time from accepting a connection to its `VALIDATE` (the authentication
    /// included). Default 30 s.
    pub handshake_timeout: Duration,
    /// Longest silence of a connection that has not yet validated. Default 10 s.
    pub unauthenticated_idle_timeout: Duration,
    /// Most keys held: keys with a value plus items in queues. Default 1,048,576.
    pub max_stored_keys: usize,
    /// The server's memory budget: keys and values, values still being written after they
    /// left the table, request bytes buffered and reply copies, all together (see
    /// [`ServerStats::memory_used`]); keys and values may use all but a sixteenth of it (at most
    /// 16 MiB), kept for the connections. Default 1 GiB.
    pub memory_budget: usize,
    /// Largest reply to one request (a `MULTI_GET` or `LIST_KEYS`), in bytes. Default 64 MiB.
    pub max_response_len: usize,
    /// Reply bytes waiting for a client past which its requests are no longer read, until it
    /// has read some. Default 16 MiB.
    pub max_queued_bytes: usize,
    /// Longest time a client with replies waiting may accept none of them before it is
    /// dropped. Default 30 s.
    pub write_stall_timeout: Duration,
}

impl Default for ServerConfig {
    fn default() -> Self {
        ServerConfig {
            limits: Limits::default(),
            secret: None,
            max_waits_per_connection: 64,
            max_connections: 64 * 1024,
            handshake_timeout: Duration::from_secs(30),
            unauthenticated_idle_timeout: Duration::from_secs(10),
            max_stored_keys: 1024 * 1024,
            memory_budget: 1024 * 1024 * 1024,
            max_response_len: 64 * 1024 * 1024,
            max_queued_bytes: 16 * 1024 * 1024,
            write_stall_timeout: Duration::from_secs(30),
        }
    }
}

/// What a running server holds, from its own accounting.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct ServerStats {
    /// Bytes of keys and values held, with values that left the table while a reply still
    /// shares them (part of [`memory_used`](Self::memory_used)).
    pub bytes_held: usize,
    /// Keys with a value plus items in queues (bounded by [`ServerConfig::max_stored_keys`]).
    pub keys_held: usize,
    /// Open connections (bounded by [`ServerConfig::max_connections`]).
    pub connections: usize,
    /// Reply bytes waiting to be written, all connections together (values shared with the
    /// table are counted in full). At most [`ServerConfig::max_queued_bytes`] plus one reply a
    /// connection.
    pub bytes_queued: usize,
    /// Request bytes read and not yet handled, all connections together. At most
    /// [`Limits::max_request_len`] plus one read a connection.
    pub bytes_buffered: usize,
    /// What counts against [`ServerConfig::memory_budget`]: keys and values, values that left
    /// the table while a reply still shares them, request bytes buffered, and reply bytes
    /// queued that the table does not share (copies, popped queue items).
    pub memory_used: usize,
}

struct Shared {
    state: Mutex<KvState>,
    config: ServerConfig,
    next_conn: AtomicU64,
    connections: AtomicUsize,
    queued: AtomicUsize,
    buffered: AtomicUsize,
    /// Reply bytes queued that the table does not share (see `Output::own`).
    own: AtomicUsize,
    /// Told when a connection's memory shrinks while some connection waits for room.
    freed: tokio::sync::Notify,
    /// Connections waiting for room in the memory budget (so that nobody else takes the
    /// notifier's lock when none waits).
    starving: AtomicUsize,
    /// The table's bytes (`KvState::bytes_held`) as of the last release of its lock, so that
    /// a connection can see the budget's room without taking the lock (the table checks its
    /// own limit under the lock whenever it stores).
    table_bytes: AtomicUsize,
}

/// The table, locked; its bytes are published to [`Shared::table_bytes`] when it is released.
struct Table<'a> {
    state: MutexGuard<'a, KvState>,
    published: &'a AtomicUsize,
}

impl std::ops::Deref for Table<'_> {
    type Target = KvState;
    fn deref(&self) -> &KvState {
        &self.state
    }
}

impl std::ops::DerefMut for Table<'_> {
    fn deref_mut(&mut self) -> &mut KvState {
        &mut self.state
    }
}

impl Drop for Table<'_> {
    fn drop(&mut self) {
        self.published
            .store(self.state.bytes_held(), Ordering::Relaxed);
    }
}

impl Shared {
    fn new(config: ServerConfig) -> Self {
        let budget = Budget {
            max_value_len: config.limits.max_value_len,
            max_entries: config.max_stored_keys,
            max_bytes: config.memory_budget,
            reserve: connection_reserve(config.memory_budget),
        };
        Shared {
            state: Mutex::new(KvState::with_budget(budget)),
            config,
            next_conn: AtomicU64::new(0),
            connections: AtomicUsize::new(0),
            queued: AtomicUsize::new(0),
            buffered: AtomicUsize::new(0),
            own: AtomicUsize::new(0),
            freed: tokio::sync::Notify::new(),
            starving: AtomicUsize::new(0),
            table_bytes: AtomicUsize::new(0),
        }
    }

    /// What the connections hold against the memory budget.
    fn outside(&self) -> usize {
        self.buffered.load(Ordering::Relaxed) + self.own.load(Ordering::Relaxed)
    }

    /// The table, told what the connections hold now (so that its writes keep the whole
    /// server within the memory budget).
    fn lock(&self) -> Table<'_> {
        let mut state = self.state.lock().unwrap_or_else(|e| e.into_inner());
        state.set_outside(self.outside());
        Table {
            state,
            published: &self.table_bytes,
        }
    }

    /// Bytes of the memory budget nothing uses now: what `KvState::room` says, without the
    /// lock (each request would otherwise take it three times, and the connections of a busy
    /// server contend for it).
    fn room(&self) -> usize {
        self.config
            .memory_budget
            .saturating_sub(self.table_bytes.load(Ordering::Relaxed) + self.outside())
    }

    fn stats(&self) -> ServerStats {
        let (bytes_held, keys_held) = {
            let mut state = self.lock();
            state.sweep();
            (state.bytes_held(), state.entries())
        };
        let outside = self.outside();
        ServerStats {
            bytes_held,
            keys_held,
            connections: self.connections.load(Ordering::Relaxed),
            bytes_queued: self.queued.load(Ordering::Relaxed),
            bytes_buffered: self.buffered.load(Ordering::Relaxed),
            memory_used: bytes_held + outside,
        }
    }
}

/// The part of the memory budget that keys and values may not take, kept for the
/// connections' requests and replies: a sixteenth, at most 16 MiB.
fn connection_reserve(budget: usize) -> usize {
    (budget / 16).min(16 * 1024 * 1024)
}

/// Most bytes one read takes from a socket (and from the memory budget).
const READ_CHUNK: usize = 64 * 1024;

/// Room a connection needs before it handles a request: more than any reply without a value
/// takes (the largest, a `CANCEL_WAIT` that answers every parked wait, is two bytes a wait).
const SMALL_REPLY: usize = 1024;

/// One connection's share of a gauge of [`Shared`] (queued or buffered bytes), given back when
/// the connection ends.
struct Gauge<'a> {
    total: &'a AtomicUsize,
    mine: usize,
}

impl Gauge<'_> {
    fn set(&mut self, now: usize) {
        if now > self.mine {
            self.total.fetch_add(now - self.mine, Ordering::Relaxed);
        } else if now < self.mine {
            self.total.fetch_sub(self.mine - now, Ordering::Relaxed);
        }
        self.mine = now;
    }
}

impl Drop for Gauge<'_> {
    fn drop(&mut self) {
        self.set(0);
    }
}

/// A connection counted in [`Shared::starving`] while this lives.
struct Waiting<'a>(&'a AtomicUsize);

impl<'a> Waiting<'a> {
    fn new(count: &'a AtomicUsize) -> Self {
        count.fetch_add(1, Ordering::SeqCst);
        Waiting(count)
    }
}

impl Drop for Waiting<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

/// One connection's share of the memory gauges: request bytes buffered and reply bytes of its
/// own; whoever waits for room is told when they shrink.
struct Memory<'a> {
    buffered: Gauge<'a>,
    own: Gauge<'a>,
    freed: &'a tokio::sync::Notify,
    starving: &'a AtomicUsize,
}

impl Memory<'_> {
    fn set(&mut self, buffered: usize, own: usize) {
        let shrank = buffered < self.buffered.mine || own < self.own.mine;
        self.buffered.set(buffered);
        self.own.set(own);
        if shrank && self.starving.load(Ordering::SeqCst) > 0 {
            self.freed.notify_waiters();
        }
    }
}

impl Drop for Memory<'_> {
    fn drop(&mut self) {
        self.set(0, 0);
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
    shared: Arc<Shared>,
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
        let shared = Arc::new(Shared::new(config));
        info!(%local_addr, secret = shared.config.secret.is_some(), "store server listening");
        let task = tokio::spawn(accept_loop(listener, shared.clone(), stopped));
        TcpStoreServer {
            local_addr,
            shared,
            stop,
            task: Some(task),
        }
    }

    /// The address the server listens on.
    pub fn local_addr(&self) -> SocketAddr {
        self.local_addr
    }

    /// What the server holds now: bytes and keys in the table, connections, queued replies.
    pub fn stats(&self) -> ServerStats {
        self.shared.stats()
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
                    let max = shared.config.max_connections;
                    if shared.connections.load(Ordering::Relaxed) >= max {
                        warn!(
                            %peer,
                            "refusing a store connection: {max} connections are open, the bound \
                             max_connections (--max-connections)"
                        );
                        // A tensorwire client reads this where the PING echo would be and
                        // names the bound; the socket is fresh, so the write does not block.
                        let _ = stream.try_write(&CONNECTIONS_FULL_MARKER.to_ne_bytes());
                        drop(stream);
                        continue;
                    }
                    shared.connections.fetch_add(1, Ordering::Relaxed);
                    let id = shared.next_conn.fetch_add(1, Ordering::Relaxed);
                    let shared = shared.clone();
                    let stopped = stopped.clone();
                    connections.spawn(async move {
                        let reason = serve_connection(stream, id, &shared, stopped).await;
                        shared.lock().cancel_owner(id);
                        shared.connections.fetch_sub(1, Ordering::Relaxed);
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
    let mut output = Output::default();
    let mut gauge = Gauge {
        total: &shared.queued,
        mine: 0,
    };
    let mut memory = Memory {
        buffered: Gauge {
            total: &shared.buffered,
            mine: 0,
        },
        own: Gauge {
            total: &shared.own,
            mine: 0,
        },
        freed: &shared.freed,
        starving: &shared.starving,
    };
    let (notify, mut fired) = unbounded_channel();
    let accepted = Instant::now();
    let mut last_read = accepted;
    // Since when replies have waited with none written.
    let mut stalled_since: Option<Instant> = None;
    // Since when the connection has waited for room in the memory budget.
    let mut starved_since: Option<Instant> = None;
    let (mut reader, mut writer) = stream.split();
    // The connection's one timer, moved to each turn's deadline (a busy connection arms none),
    // and dropped while no deadline applies: a sleep left in tokio's wheel after the handshake
    // would give every wait of this runtime's reactor in `epoll_wait` a timeout (an hrtimer
    // armed and cancelled in the kernel per wait; issue 45), the agent's on rank 0 included.
    let mut timer = std::pin::pin!(None::<tokio::time::Sleep>);
    // The server's stop, one future for the connection's life (a `changed()` made every turn
    // registered with the watch's notifier and left it again on each request).
    let stop = async move {
        let _ = stopped.changed().await;
    };
    tokio::pin!(stop);
    loop {
        // Told when memory is freed, once this connection waits for room (see below).
        let mut freed = None;
        let mut starved = false;
        // Back-pressure: requests wait in `input` (and the socket) while replies pile up, or
        // while the memory budget has no room for a reply.
        while output.len() < config.max_queued_bytes {
            let (request, used) = match protocol::decode_request(&input, &config.limits) {
                Ok(Some(decoded)) => decoded,
                Ok(None) => break,
                Err(e) => {
                    return refuse(malformed(e), &mut output, &mut reader, &mut writer, config)
                        .await
                }
            };
            if phase == Phase::Ready && shared.room() < SMALL_REPLY {
                starved = true;
                break;
            }
            input.advance(used);
            // The request is the decoded one's now: the table counts what it stores.
            memory.set(input.len(), output.own());
            let step = handle(
                request,
                &mut phase,
                id,
                shared,
                &notify,
                &mut fired,
                &mut output,
            );
            memory.set(input.len(), output.own());
            gauge.set(output.len());
            if let Err(refusal) = step {
                return refuse(refusal, &mut output, &mut reader, &mut writer, config).await;
            }
        }
        if !output.is_empty() {
            let full = output.len() >= config.max_queued_bytes;
            if let Err(e) = output.try_write_now(&writer) {
                return e.into();
            }
            // Requests that waited for room in the queue are decoded now (the socket took
            // some of it), not after the next read, which may never come.
            if full && output.len() < config.max_queued_bytes && !starved {
                continue;
            }
        }
        gauge.set(output.len());
        memory.set(input.len(), output.own());
        let reading = output.len() < config.max_queued_bytes && !starved;
        // A read takes its bytes from the budget's room.
        let grant = if reading {
            shared.room().min(READ_CHUNK)
        } else {
            0
        };
        if reading && grant == 0 && !input.is_empty() {
            // Part of a request is in, and the budget has no room for the rest: it would not
            // fit in the table either.
            let refusal = Refusal::at(
                "memory_budget",
                format!(
                    "no room in the memory budget of {} bytes (the bound memory_budget, --memory-budget) for the rest of \
                     a request ({} bytes of it read); {} bytes are in use",
                    config.memory_budget,
                    input.len(),
                    shared.stats().memory_used
                ),
            );
            return refuse(refusal, &mut output, &mut reader, &mut writer, config).await;
        }
        starved |= reading && grant == 0;
        // Counted among the connections waiting for room until this turn of the loop ends.
        let _waiting = starved.then(|| Waiting::new(&shared.starving));
        if starved {
            // Registered before the room is looked at again, so that nothing freed in
            // between is missed.
            let mut notified = Box::pin(shared.freed.notified());
            notified.as_mut().enable();
            if shared.room() >= SMALL_REPLY {
                continue;
            }
            freed = Some(notified);
        }
        // The clock is read only when a deadline is armed (a busy connection has none).
        let now = if phase != Phase::Ready || !output.is_empty() || starved {
            Instant::now()
        } else {
            accepted
        };
        if output.is_empty() {
            stalled_since = None;
        }
        if !starved {
            starved_since = None;
        }
        let mut expiry = if phase != Phase::Ready {
            let handshake = accepted + config.handshake_timeout;
            let idle = last_read + config.unauthenticated_idle_timeout;
            if handshake <= idle {
                Some((handshake, Expiry::Handshake))
            } else {
                Some((idle, Expiry::Idle))
            }
        } else if !output.is_empty() {
            let since = *stalled_since.get_or_insert(now);
            Some((since + config.write_stall_timeout, Expiry::Stall))
        } else {
            None
        };
        if starved {
            let at = *starved_since.get_or_insert(now) + config.write_stall_timeout;
            if expiry.is_none_or(|(other, _)| at < other) {
                expiry = Some((at, Expiry::Memory));
            }
        }
        let (at, why) = match expiry {
            Some((at, why)) => (at, Some(why)),
            None => (now, None),
        };
        let armed = timer.as_ref().as_pin_ref().map(|armed| armed.deadline());
        match (why.is_some(), armed) {
            (false, None) => {}
            (false, Some(_)) => timer.set(None),
            (true, Some(armed)) if armed == at => {}
            (true, Some(_)) => {
                if let Some(armed) = timer.as_mut().as_pin_mut() {
                    armed.reset(at);
                }
            }
            (true, None) => timer.set(Some(tokio::time::sleep_until(at))),
        }
        if grant > 0 && input.capacity() == input.len() {
            // Grows by doubling (from 4 KiB), never by more than the grant.
            input.reserve(grant.min(input.len().max(4096)));
        }
        let mut limited = (&mut input).limit(grant);
        // Biased, in this order: a request is read without first polling the other
        // branches (no random pick either); writes cannot starve, as reading stops once
        // replies queue up, and tokio's cooperative budget gives the rest their turn.
        tokio::select! {
            biased;
            read = reader.read_buf(&mut limited), if grant > 0 => match read {
                Ok(0) => return Closed::Eof,
                // Only an unauthenticated connection's idle time is bounded.
                Ok(_) if phase != Phase::Ready => last_read = Instant::now(),
                Ok(_) => {}
                Err(e) => return e.into(),
            },
            written = output.write_some(&mut writer), if !output.is_empty() => match written {
                Ok(_) => stalled_since = None,
                Err(e) => return e.into(),
            },
            Some(_) = fired.recv() => {
                output.reply();
                output.push(WAIT_STOP_WAITING);
            }
            _ = async { if let Some(freed) = freed.as_mut() { freed.await } }, if starved => {}
            () = &mut stop => return Closed::Shutdown,
            () = async {
                if let Some(armed) = timer.as_mut().as_pin_mut() {
                    armed.await;
                }
            }, if why.is_some() => {
                if let Some(Expiry::Memory) = why {
                    let refusal = Refusal::at(
                        "memory_budget",
                        format!(
                            "waited {:?} (the bound write_stall_timeout) for room in the memory \
                             budget of {} bytes (the bound memory_budget, --memory-budget) to \
                             read or answer a request; {} bytes are in use",
                            config.write_stall_timeout,
                            config.memory_budget,
                            shared.stats().memory_used
                        ),
                    );
                    return refuse(refusal, &mut output, &mut reader, &mut writer, config).await;
                }
                return Closed::Refused(expired(why, config, output.len()));
            }
        }
    }
}

/// How long a connection closed over a refusal that its client was told of is read (and the
/// bytes dropped) after the refusal is sent, so that requests it had already sent do not turn
/// the close into a reset, which could discard the refusal before the client reads it.
const LINGER: Duration = Duration::from_secs(1);

/// Closes a connection over `refusal`: writes what was answered before it (the auth
/// rejection, say) and, to a client that asked for reasons, the refusal, unless the client
/// does not read; then, for such a client, ends the stream cleanly.
async fn refuse(
    refusal: Refusal,
    output: &mut Output,
    reader: &mut ReadHalf<'_>,
    writer: &mut WriteHalf<'_>,
    config: &ServerConfig,
) -> Closed {
    let told = output.is_tagged();
    output.refuse(refusal.bound, &refusal.reason);
    let flush = output.write_all(writer);
    let _ = tokio::time::timeout(config.write_stall_timeout, flush).await;
    if told {
        let _ = writer.shutdown().await;
        let mut sink = [0u8; 4096];
        let drain = async { while matches!(reader.read(&mut sink).await, Ok(n) if n > 0) {} };
        let _ = tokio::time::timeout(LINGER, drain).await;
    }
    Closed::Refused(refusal.reason)
}

/// Which time bound a connection is up against.
#[derive(Clone, Copy)]
enum Expiry {
    Handshake,
    Idle,
    Stall,
    Memory,
}

/// Why a connection whose time bound expired is closed.
fn expired(why: Option<Expiry>, config: &ServerConfig, queued: usize) -> String {
    match why {
        Some(Expiry::Handshake) => format!(
            "did not validate within {:?}, the bound handshake_timeout (--handshake-timeout)",
            config.handshake_timeout
        ),
        Some(Expiry::Idle) => format!(
            "silent for {:?} before validating, the bound unauthenticated_idle_timeout \
             (--unauthenticated-idle-timeout)",
            config.unauthenticated_idle_timeout
        ),
        Some(Expiry::Stall | Expiry::Memory) | None => format!(
            "read none of its {queued} queued reply bytes for {:?}, the bound \
             write_stall_timeout (--write-stall-timeout); its requests had stopped being read \
             past max_queued_bytes = {} (--max-queued-bytes)",
            config.write_stall_timeout, config.max_queued_bytes
        ),
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
    out: &mut Output,
) -> Result<(), Refusal> {
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
            )
            .into())
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
                Err("authentication failed: wrong cluster secret"
                    .to_owned()
                    .into())
            }
        }
        (Phase::AuthProof { .. }, other) => Err(format!(
            "expected the authentication proof, got query type {}",
            other.query_byte()
        )
        .into()),
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
        )
        .into()),
        (Phase::Validate, other) => Err(format!(
            "the first query must be VALIDATE, got query type {}",
            other.query_byte()
        )
        .into()),
        (Phase::Ready, request) => serve(request, id, shared, notify, fired, out),
    }
}

fn serve(
    request: Request,
    id: u64,
    shared: &Shared,
    notify: &tokio::sync::mpsc::UnboundedSender<u64>,
    fired: &mut UnboundedReceiver<u64>,
    out: &mut Output,
) -> Result<(), Refusal> {
    match request {
        Request::Ping { nonce } => {
            out.reply();
            out.extend_from_slice(&nonce.to_ne_bytes());
        }
        Request::Set { key, value } => shared
            .lock()
            .set(&key, Bytes::from(value))
            .map_err(|e| refused_write("SET", &key, e))?,
        Request::CompareSet {
            key,
            expected,
            desired,
        } => {
            let mut state = shared.lock();
            // The reply may be a copy of `expected` (a missing key): it is counted as the
            // connection's own, and must fit.
            let reply = 8 + expected.len().max(desired.len());
            if reply > state.room() {
                return Err(no_room("COMPARE_SET", reply, state.room(), shared));
            }
            let value = state
                .compare_set(&key, &expected, Bytes::from(desired))
                .map_err(|e| refused_write("COMPARE_SET", &key, e))?;
            drop(state);
            out.reply();
            out.put_owned_value(value);
        }
        Request::Get { key } => {
            // A handle on the stored value; it is written after the lock is released.
            let value = shared.lock().get(&key).cloned().unwrap_or_default();
            out.reply();
            out.put_value(value);
        }
        Request::Add { key, delta } => match shared.lock().add(&key, delta) {
            Ok(sum) => {
                out.reply();
                out.extend_from_slice(&sum.to_ne_bytes());
            }
            Err(e) => return Err(refused_count("add", &key, e)),
        },
        Request::Barrier { key, world_size } => {
            let mut state = shared.lock();
            if state.parked_by(id) >= shared.config.max_waits_per_connection {
                return Err(too_many_waits(shared));
            }
            match state.barrier(&key, world_size, id, notify.clone()) {
                Ok(Arrival::Released) => {
                    out.reply();
                    out.push(WAIT_STOP_WAITING);
                }
                // Answered through `fired` once the count reaches the world size.
                Ok(Arrival::Parked(_)) => {}
                Err(e) => return Err(refused_count("barrier", &key, e)),
            }
        }
        Request::Check { keys } if keys.len() == 1 && keys[0] == CLOSING_REASONS_KEY => {
            // tensorwire's client asks for tagged replies and named refusals; the key is
            // never stored (see `protocol`).
            out.reply();
            out.push(CHECK_READY);
            out.tag_replies();
        }
        Request::Check { keys } => {
            let ready = shared.lock().check(&keys);
            out.reply();
            out.push(if ready { CHECK_READY } else { CHECK_NOT_READY });
        }
        Request::Wait { keys } => {
            let mut state = shared.lock();
            if state.parked_by(id) >= shared.config.max_waits_per_connection {
                return Err(too_many_waits(shared));
            }
            if state.park(&keys, id, notify.clone()).is_none() {
                out.reply();
                out.push(WAIT_STOP_WAITING);
            }
        }
        Request::GetNumKeys => {
            let len = shared.lock().len() as i64;
            out.reply();
            out.extend_from_slice(&len.to_ne_bytes());
        }
        Request::DeleteKey { key } => {
            let deleted = shared.lock().delete(&key);
            out.reply();
            out.extend_from_slice(&i64::from(deleted).to_ne_bytes());
        }
        Request::Append { key, value } => shared
            .lock()
            .append(&key, &value)
            .map_err(|e| refused_write("APPEND", &key, e))?,
        Request::MultiGet { keys } => {
            // Handles on the stored values; written after the lock is released.
            let (values, room): (Vec<Bytes>, usize) = {
                let state = shared.lock();
                let values = keys
                    .iter()
                    .map(|key| state.get(key).cloned().unwrap_or_default())
                    .collect();
                (values, state.room())
            };
            let len: usize = values.iter().map(|v| 8 + v.len()).sum();
            if len > shared.config.max_response_len {
                return Err(too_long_a_reply("MULTI_GET", keys.len(), len, shared));
            }
            // Small values are copied into the reply: those bytes are the connection's own.
            let copied: usize = values.iter().map(|v| 8 + output::copied_len(v)).sum();
            if copied > room {
                return Err(no_room("MULTI_GET", copied, room, shared));
            }
            out.reply();
            for value in values {
                out.put_value(value);
            }
        }
        Request::MultiSet { pairs } => {
            let first = pairs.first().map(|(k, _)| k.clone()).unwrap_or_default();
            let pairs = pairs
                .into_iter()
                .map(|(k, v)| (k, Bytes::from(v)))
                .collect();
            shared
                .lock()
                .set_all(pairs)
                .map_err(|e| refused_write("MULTI_SET", &first, e))?;
        }
        Request::CancelWait => {
            // After this no wait of ours can fire, so whatever fired before is in the channel:
            // answer those first, as c10d's client expects STOP_WAITING before WAIT_CANCELED.
            shared.lock().cancel_owner(id);
            while fired.try_recv().is_ok() {
                out.reply();
                out.push(WAIT_STOP_WAITING);
            }
            out.reply();
            out.push(WAIT_CANCELED);
        }
        Request::QueuePush { key, value } => shared
            .lock()
            .queue_push(&key, Bytes::from(value))
            .map_err(|e| refused_write("QUEUE_PUSH", &key, e))?,
        Request::QueuePop { key } => {
            // The item leaves the table for the reply: the same bytes, now the connection's.
            let (len, item) = shared.lock().queue_pop(&key);
            out.reply();
            out.extend_from_slice(&(len as i64).to_ne_bytes());
            if let Some(item) = item {
                out.put_owned_value(item);
            }
        }
        Request::QueueLen { key } => {
            let len = shared.lock().queue_len(&key);
            out.reply();
            out.extend_from_slice(&(len as i64).to_ne_bytes());
        }
        Request::ListKeys => {
            let state = shared.lock();
            let len: usize = 8 + state.keys().map(|k| 8 + k.len()).sum::<usize>();
            if len > shared.config.max_response_len {
                return Err(too_long_a_reply("LIST_KEYS", state.len(), len, shared));
            }
            if len > state.room() {
                return Err(no_room("LIST_KEYS", len, state.room(), shared));
            }
            // Keys are short and few next to values (bounded by the reply bound just checked).
            out.reply();
            out.extend_from_slice(&(state.len() as u64).to_ne_bytes());
            for key in state.keys() {
                out.extend_from_slice(&(key.len() as u64).to_ne_bytes());
                out.extend_from_slice(key);
            }
        }
        Request::Validate { .. } => return Err("VALIDATE sent twice".to_owned().into()),
        Request::AuthHello { .. } | Request::AuthProof { .. } => {
            return Err("authentication query after validation".to_owned().into())
        }
    }
    Ok(())
}
