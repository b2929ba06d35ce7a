//! The TCP store client: PyTorch c10d `TCPStore`'s protocol (see [`crate::protocol`]).
//!
//! Works against [`TcpStoreServer`](crate::TcpStoreServer) and against PyTorch's own server.
//! Like PyTorch's client it prefixes every key with `/` (configurable), so a key set here as
//! `"x"` is the key `"x"` for a Python `TCPStore` on the same server, and it runs one request at
//! a time per connection (clone the client freely; clones share the connection). A parked
//! `wait`, `get` or `barrier` therefore holds the connection until it returns, as in PyTorch: tasks that
//! must wait concurrently should each [`connect`](TcpStoreClient::connect) their own client.

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use tensorwire_core::ports::store::{Store, StoreError};
use tokio::io::{AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::TcpStream;
use tokio::sync::{Mutex, MutexGuard};
use tokio::time::Instant;
use tracing::debug;

use crate::backoff::Backoff;
use crate::handshake;
use crate::in_memory::check_multi_set;
use crate::protocol::{
    Limits, Request, AUTH_LEN, CHECK_NOT_READY, CHECK_READY, CLOSING_REASONS_KEY,
    CONNECTIONS_FULL_MARKER, REPLY_OK, REPLY_REFUSED, VALIDATION_MAGIC, WAIT_CANCELED,
    WAIT_STOP_WAITING,
};
use crate::DEFAULT_TIMEOUT;
use tensorwire_core::auth::ClusterSecret;

/// How long a timed-out `wait` waits for the store to answer its cancel.
const CANCEL_GRACE: Duration = Duration::from_millis(500);

/// Configuration of a [`TcpStoreClient`].
#[derive(Debug, Clone)]
pub struct ClientConfig {
    /// Default wait of `get`/`multi_get`, and the longest wait for any reply.
    pub timeout: Duration,
    /// How long [`TcpStoreClient::connect`] keeps retrying (exponential backoff with jitter).
    pub connect_timeout: Duration,
    /// Prepended to every key; `"/"` as PyTorch's `TCPStore` does.
    pub key_prefix: String,
    /// The cluster secret, when the server requires one (see [`crate::handshake`]).
    pub secret: Option<ClusterSecret>,
    /// Limits checked before sending, with a typed error (the c10d server would just close).
    pub limits: Limits,
}

impl Default for ClientConfig {
    fn default() -> Self {
        ClientConfig {
            timeout: DEFAULT_TIMEOUT,
            connect_timeout: Duration::from_secs(60),
            key_prefix: "/".to_owned(),
            secret: None,
            limits: Limits::default(),
        }
    }
}

struct Conn {
    stream: BufReader<TcpStream>,
    /// The server tags every reply with a status byte and names its refusals (tensorwire's
    /// server; see [`crate::protocol`]).
    tagged: bool,
    /// Set while a request is in flight; still set afterwards if it was interrupted, in which
    /// case the byte stream is out of step and the connection is unusable.
    interrupted: Option<&'static str>,
}

struct Inner {
    addr: String,
    conn: Mutex<Conn>,
    timeout: Duration,
    limits: Limits,
}

/// A client of a c10d-compatible TCP store. Implements [`Store`].
#[derive(Clone)]
pub struct TcpStoreClient {
    inner: Arc<Inner>,
    prefix: Arc<str>,
}

impl std::fmt::Debug for TcpStoreClient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TcpStoreClient")
            .field("addr", &self.inner.addr)
            .field("prefix", &self.prefix)
            .finish_non_exhaustive()
    }
}

enum Attempt {
    Retry(String),
    Fatal(StoreError),
}

/// Fails unless `addr` has the form `HOST:PORT` (`[V6]:PORT` for IPv6) with a port number.
fn check_addr(addr: &str) -> Result<(), StoreError> {
    let bad = |why: &str| StoreError::Connection {
        addr: addr.to_owned(),
        reason: format!("not a store address: {why} (expected HOST:PORT, such as 10.0.0.1:29500)"),
    };
    let Some((host, port)) = addr.rsplit_once(':') else {
        return Err(bad("no port"));
    };
    if host.is_empty() || host == "[]" {
        return Err(bad("no host"));
    }
    if host.contains(':') && !(host.starts_with('[') && host.ends_with(']')) {
        return Err(bad("an IPv6 host must be in brackets"));
    }
    port.parse::<u16>().map(|_| ()).map_err(|_| {
        bad(&format!(
            "the port {port:?} is not a number from 0 to 65535"
        ))
    })
}

impl TcpStoreClient {
    /// Connects to `addr` (`host:port`), authenticates when a secret is configured, validates
    /// and pings, retrying with exponential backoff and jitter for up to
    /// [`connect_timeout`](ClientConfig::connect_timeout).
    pub async fn connect(addr: &str, config: ClientConfig) -> Result<Self, StoreError> {
        // A malformed address never connects: say so now, not after the retries.
        check_addr(addr)?;
        let started = Instant::now();
        let deadline = started + config.connect_timeout;
        let mut backoff = Backoff::default();
        let mut attempt = 0u32;
        loop {
            attempt += 1;
            match Self::attempt(addr, &config, deadline).await {
                Ok((stream, tagged)) => {
                    debug!(addr, attempt, tagged, "connected to store");
                    return Ok(TcpStoreClient {
                        inner: Arc::new(Inner {
                            addr: addr.to_owned(),
                            conn: Mutex::new(Conn {
                                stream: BufReader::new(stream),
                                tagged,
                                interrupted: None,
                            }),
                            timeout: config.timeout,
                            limits: config.limits,
                        }),
                        prefix: config.key_prefix.into(),
                    });
                }
                Err(Attempt::Fatal(e)) => return Err(e),
                Err(Attempt::Retry(reason)) => {
                    let now = Instant::now();
                    if now >= deadline {
                        return Err(StoreError::Connection {
                            addr: addr.to_owned(),
                            reason: format!(
                                "gave up after {attempt} attempt(s) in {:.1?}: {reason}",
                                now - started
                            ),
                        });
                    }
                    let delay = backoff.next_delay().min(deadline - now);
                    debug!(addr, attempt, ?delay, %reason, "store connection failed; retrying");
                    tokio::time::sleep(delay).await;
                }
            }
        }
    }

    async fn attempt(
        addr: &str,
        config: &ClientConfig,
        deadline: Instant,
    ) -> Result<(TcpStream, bool), Attempt> {
        let remaining = deadline.saturating_duration_since(Instant::now());
        let mut stream = match tokio::time::timeout(remaining, TcpStream::connect(addr)).await {
            Ok(Ok(s)) => s,
            Ok(Err(e)) => return Err(Attempt::Retry(e.to_string())),
            Err(_) => return Err(Attempt::Retry("connect timed out".to_owned())),
        };
        let _ = stream.set_nodelay(true);
        if let Some(secret) = &config.secret {
            authenticate(
                &mut stream,
                addr,
                secret,
                config.timeout.min(Duration::from_secs(30)),
            )
            .await?;
        }
        let mut hello = Vec::with_capacity(16);
        Request::Validate {
            magic: VALIDATION_MAGIC,
        }
        .encode(&mut hello);
        let nonce = std::process::id();
        Request::Ping { nonce }.encode(&mut hello);
        // Ask to be told why a request is refused; PyTorch's server answers NOT_READY. (A
        // store whose keys are shorter than the reserved key cannot be asked.)
        let ask = CLOSING_REASONS_KEY.len() <= config.limits.max_key_len;
        if ask {
            Request::Check {
                keys: vec![CLOSING_REASONS_KEY.to_vec()],
            }
            .encode(&mut hello);
        }
        let handshake = async {
            stream.write_all(&hello).await?;
            let mut echo = [0u8; 4];
            stream.read_exact(&mut echo).await?;
            let echo = u32::from_ne_bytes(echo);
            if echo != nonce || !ask {
                return Ok::<_, std::io::Error>((echo, false));
            }
            let tagged = match stream.read_u8().await? {
                CHECK_READY => true,
                CHECK_NOT_READY => false,
                other => {
                    return Err(std::io::Error::new(
                        std::io::ErrorKind::InvalidData,
                        format!("unexpected reply {other} to CHECK"),
                    ))
                }
            };
            Ok((echo, tagged))
        };
        match tokio::time::timeout(config.timeout, handshake).await {
            Ok(Ok((echo, tagged))) if echo == nonce => Ok((stream, tagged)),
            Ok(Ok((CONNECTIONS_FULL_MARKER, _))) => Err(Attempt::Retry(
                "the store has as many connections open as it allows, its bound \
                 max_connections (--max-connections)"
                    .to_owned(),
            )),
            Ok(Ok((handshake::AUTH_REQUIRED_MARKER, _))) => Err(Attempt::Fatal(StoreError::Auth {
                addr: addr.to_owned(),
                reason: "the store requires a cluster secret; configure the same secret here"
                    .to_owned(),
            })),
            Ok(Ok((echo, _))) => Err(Attempt::Fatal(StoreError::Protocol {
                addr: addr.to_owned(),
                reason: format!("ping failed: sent nonce {nonce}, got {echo} back"),
            })),
            Ok(Err(e)) => Err(Attempt::Retry(format!(
                "validation failed ({e}); if the store requires a cluster secret, configure it"
            ))),
            Err(_) => Err(Attempt::Retry("no answer to ping".to_owned())),
        }
    }

    /// The same connection with another key prefix (`""` addresses keys exactly as stored,
    /// such as PyTorch's `init/` join counter).
    pub fn with_prefix(&self, prefix: &str) -> Self {
        TcpStoreClient {
            inner: self.inner.clone(),
            prefix: prefix.into(),
        }
    }

    /// The address this client connected to.
    pub fn addr(&self) -> &str {
        &self.inner.addr
    }

    /// Sends `PING` and checks the echo.
    pub async fn ping(&self) -> Result<(), StoreError> {
        let nonce = rand::random::<u32>();
        let echo = self
            .exchange("ping", Request::Ping { nonce }, |c| {
                Box::pin(async move { c.read_u32().await })
            })
            .await?;
        if echo != nonce {
            return Err(self.protocol(format!("ping: sent nonce {nonce}, got {echo}")));
        }
        Ok(())
    }

    fn full_key(&self, key: &str) -> Result<Vec<u8>, StoreError> {
        let mut full = Vec::with_capacity(self.prefix.len() + key.len());
        full.extend_from_slice(self.prefix.as_bytes());
        full.extend_from_slice(key.as_bytes());
        if full.len() > self.inner.limits.max_key_len {
            return Err(StoreError::key_too_large(
                key,
                self.inner.limits.max_key_len,
            ));
        }
        Ok(full)
    }

    fn full_keys(&self, keys: &[&str]) -> Result<Vec<Vec<u8>>, StoreError> {
        if keys.len() > self.inner.limits.max_keys {
            return Err(StoreError::TooManyKeys {
                count: keys.len(),
                max: self.inner.limits.max_keys,
            });
        }
        keys.iter().map(|k| self.full_key(k)).collect()
    }

    fn check_value(&self, key: &str, value: &[u8]) -> Result<(), StoreError> {
        if value.len() > self.inner.limits.max_value_len {
            return Err(StoreError::ValueTooLarge {
                key: key.to_owned(),
                len: value.len(),
                max: self.inner.limits.max_value_len,
            });
        }
        Ok(())
    }

    fn protocol(&self, reason: String) -> StoreError {
        StoreError::Protocol {
            addr: self.inner.addr.clone(),
            reason,
        }
    }

    fn io_error(&self, op: &str, e: std::io::Error) -> StoreError {
        if let Some(r) = e.get_ref().and_then(|r| r.downcast_ref::<Refused>()) {
            return StoreError::Refused {
                addr: self.inner.addr.clone(),
                bound: r.bound.clone(),
                reason: r.reason.clone(),
            };
        }
        let reason = if e.kind() == std::io::ErrorKind::UnexpectedEof {
            format!("{op}: the server closed the connection")
        } else {
            format!("{op}: {e}")
        };
        StoreError::Connection {
            addr: self.inner.addr.clone(),
            reason,
        }
    }

    async fn lock(&self, op: &'static str) -> Result<MutexGuard<'_, Conn>, StoreError> {
        let conn = self.inner.conn.lock().await;
        if let Some(previous) = conn.interrupted {
            return Err(StoreError::Connection {
                addr: self.inner.addr.clone(),
                reason: format!(
                    "{op}: an earlier `{previous}` was interrupted mid-request, so this \
                     connection is out of step; connect again"
                ),
            });
        }
        Ok(conn)
    }

    /// Sends `request` and reads its reply with `read`, within the client's timeout.
    async fn exchange<T, F>(
        &self,
        op: &'static str,
        request: Request,
        read: F,
    ) -> Result<T, StoreError>
    where
        F: for<'c> FnOnce(
            &'c mut Conn,
        ) -> std::pin::Pin<
            Box<dyn std::future::Future<Output = std::io::Result<T>> + Send + 'c>,
        >,
    {
        self.request(op, request, true, read).await
    }

    /// Sends `request` and, when it has a reply (`replies`), reads its status (on a tagged
    /// connection) and the reply with `read`, within the client's timeout. A write that fails
    /// on a tagged connection looks for the refusal that closed it.
    async fn request<T, F>(
        &self,
        op: &'static str,
        request: Request,
        replies: bool,
        read: F,
    ) -> Result<T, StoreError>
    where
        F: for<'c> FnOnce(
            &'c mut Conn,
        ) -> std::pin::Pin<
            Box<dyn std::future::Future<Output = std::io::Result<T>> + Send + 'c>,
        >,
    {
        let mut conn = self.lock(op).await?;
        conn.interrupted = Some(op);
        let mut bytes = Vec::new();
        request.encode(&mut bytes);
        let work = async {
            if let Err(e) = conn.stream.get_mut().write_all(&bytes).await {
                return Err(conn.refusal_after(e).await);
            }
            if replies {
                conn.reply_status().await?;
            }
            read(&mut conn).await
        };
        let result = match tokio::time::timeout(self.inner.timeout, work).await {
            Ok(Ok(v)) => v,
            Ok(Err(e)) => return Err(self.io_error(op, e)),
            Err(_) => {
                return Err(StoreError::Connection {
                    addr: self.inner.addr.clone(),
                    reason: format!("{op}: no reply within {:?}", self.inner.timeout),
                })
            }
        };
        conn.interrupted = None;
        Ok(result)
    }

    /// Sends a request that has no reply.
    async fn send_only(&self, op: &'static str, request: Request) -> Result<(), StoreError> {
        self.request(op, request, false, |_| Box::pin(async { Ok(()) }))
            .await
    }

    async fn wait_full(
        &self,
        keys: &[&str],
        full: Vec<Vec<u8>>,
        timeout: Duration,
    ) -> Result<(), StoreError> {
        self.parked("wait", Request::Wait { keys: full }, timeout, || {
            StoreError::timeout(keys, timeout)
        })
        .await
    }

    /// Sends a request that the server parks (`WAIT`, `BARRIER`) and waits up to `timeout` for
    /// its `STOP_WAITING`. On timeout it cancels, as c10d's client does, and fails with
    /// `timed_out()`, unless the server's answer crossed the cancel: then the request was
    /// satisfied and this returns `Ok` (PyTorch's client raises the timeout even then).
    async fn parked(
        &self,
        op: &'static str,
        request: Request,
        timeout: Duration,
        timed_out: impl FnOnce() -> StoreError,
    ) -> Result<(), StoreError> {
        let mut conn = self.lock(op).await?;
        conn.interrupted = Some(op);
        let mut bytes = Vec::new();
        request.encode(&mut bytes);
        if let Err(e) = conn.stream.get_mut().write_all(&bytes).await {
            let e = conn.refusal_after(e).await;
            return Err(self.io_error(op, e));
        }
        let first = match tokio::time::timeout(timeout, conn.read_reply_u8()).await {
            Ok(read) => Some(read.map_err(|e| self.io_error(op, e))?),
            Err(_) => None,
        };
        let outcome = match first {
            Some(WAIT_STOP_WAITING) => Ok(()),
            Some(other) => {
                return Err(self.protocol(format!("{op}: unexpected reply byte {other}")))
            }
            None => {
                // Timed out: cancel, as c10d's client does. The server may have answered
                // meanwhile, in which case STOP_WAITING comes before WAIT_CANCELED.
                let mut cancel = Vec::new();
                Request::CancelWait.encode(&mut cancel);
                let reply = async {
                    conn.stream.get_mut().write_all(&cancel).await?;
                    let a = conn.read_reply_u8().await?;
                    let b = if a == WAIT_STOP_WAITING {
                        Some(conn.read_reply_u8().await?)
                    } else {
                        None
                    };
                    Ok::<_, std::io::Error>((a, b))
                };
                // A live store answers a cancel within a round trip; one that does not (its
                // host died or was cut off) must not stretch the caller's timeout to twice
                // its length: the wait has timed out either way.
                match tokio::time::timeout(CANCEL_GRACE.min(self.inner.timeout), reply).await {
                    Ok(Ok((WAIT_CANCELED, None))) => Err(timed_out()),
                    Ok(Ok((WAIT_STOP_WAITING, Some(WAIT_CANCELED)))) => Ok(()),
                    Ok(Ok((a, b))) => {
                        return Err(
                            self.protocol(format!("cancel_wait: unexpected reply {a} {b:?}"))
                        )
                    }
                    Ok(Err(e)) => return Err(self.io_error("cancel_wait", e)),
                    // The connection stays marked interrupted (out of step): the next request
                    // says so and names the store.
                    Err(_) => {
                        return Err(StoreError::Connection {
                            addr: self.inner.addr.clone(),
                            reason: format!(
                                "{}; the store did not answer the cancel within {:?} either",
                                timed_out(),
                                CANCEL_GRACE.min(self.inner.timeout)
                            ),
                        })
                    }
                }
            }
        };
        conn.interrupted = None;
        outcome
    }
}

/// A refusal the server sent in place of a reply, carried in an `io::Error` to
/// [`TcpStoreClient::io_error`].
#[derive(Debug)]
struct Refused {
    bound: String,
    reason: String,
}

impl std::fmt::Display for Refused {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.reason)
    }
}

impl std::error::Error for Refused {}

/// Longest text of a refusal read (the server's reasons are a few hundred bytes).
const MAX_REFUSAL_LEN: usize = 64 * 1024;

/// Most bytes of a value reserved before they arrive.
const READ_CHUNK: usize = 64 * 1024;

/// How long a failed write waits for the refusal that closed the connection to be read.
const REFUSAL_GRACE: Duration = Duration::from_millis(500);

impl Conn {
    async fn read_u8(&mut self) -> std::io::Result<u8> {
        self.stream.read_u8().await
    }

    /// On a tagged connection, reads the status byte that starts a reply; a refusal comes back
    /// as an error carrying [`Refused`].
    async fn reply_status(&mut self) -> std::io::Result<()> {
        if !self.tagged {
            return Ok(());
        }
        match self.read_u8().await? {
            REPLY_OK => Ok(()),
            REPLY_REFUSED => {
                let bound = self.read_bytes(MAX_REFUSAL_LEN).await?;
                let reason = self.read_bytes(MAX_REFUSAL_LEN).await?;
                Err(std::io::Error::other(Refused {
                    bound: String::from_utf8_lossy(&bound).into_owned(),
                    reason: String::from_utf8_lossy(&reason).into_owned(),
                }))
            }
            other => Err(std::io::Error::new(
                std::io::ErrorKind::InvalidData,
                format!("unexpected reply status {other}"),
            )),
        }
    }

    /// A one-byte reply (`STOP_WAITING`, `WAIT_CANCELED`), after its status when tagged.
    async fn read_reply_u8(&mut self) -> std::io::Result<u8> {
        self.reply_status().await?;
        self.read_u8().await
    }

    /// A write failed (`error`): on a tagged connection the server may have closed it over
    /// an earlier request without a reply, with its refusal already here; return that
    /// instead when it is.
    async fn refusal_after(&mut self, error: std::io::Error) -> std::io::Error {
        if !self.tagged {
            return error;
        }
        match tokio::time::timeout(REFUSAL_GRACE, self.reply_status()).await {
            Ok(Err(refused)) if refused.get_ref().is_some_and(|r| r.is::<Refused>()) => refused,
            _ => error,
        }
    }

    async fn read_u32(&mut self) -> std::io::Result<u32> {
        let mut b = [0u8; 4];
        self.stream.read_exact(&mut b).await?;
        Ok(u32::from_ne_bytes(b))
    }

    async fn read_i64(&mut self) -> std::io::Result<i64> {
        let mut b = [0u8; 8];
        self.stream.read_exact(&mut b).await?;
        Ok(i64::from_ne_bytes(b))
    }

    async fn read_bytes(&mut self, max: usize) -> std::io::Result<Vec<u8>> {
        let mut b = [0u8; 8];
        self.stream.read_exact(&mut b).await?;
        let len = u64::from_ne_bytes(b);
        if len > max as u64 {
            return Err(std::io::Error::new(
                std::io::ErrorKind::InvalidData,
                format!("the server announced a value of {len} bytes, over the limit of {max}"),
            ));
        }
        // Memory follows the bytes that arrive, not the length announced: a server that
        // announces `max` bytes and sends a few costs a few.
        let mut v = Vec::with_capacity((len as usize).min(READ_CHUNK));
        (&mut self.stream).take(len).read_to_end(&mut v).await?;
        if (v.len() as u64) < len {
            return Err(std::io::Error::new(
                std::io::ErrorKind::UnexpectedEof,
                format!(
                    "the server announced a value of {len} bytes and closed after {}",
                    v.len()
                ),
            ));
        }
        Ok(v)
    }
}

async fn authenticate(
    stream: &mut TcpStream,
    addr: &str,
    secret: &ClusterSecret,
    limit: Duration,
) -> Result<(), Attempt> {
    let fatal = |reason: String| {
        Attempt::Fatal(StoreError::Auth {
            addr: addr.to_owned(),
            reason,
        })
    };
    let client_nonce = handshake::nonce();
    let mut hello = Vec::new();
    Request::AuthHello {
        nonce: client_nonce,
    }
    .encode(&mut hello);
    let challenge = async {
        stream.write_all(&hello).await?;
        let status = stream.read_u8().await?;
        if status != handshake::STATUS_OK {
            return Ok(Err(status));
        }
        let mut rest = [0u8; 2 * AUTH_LEN];
        stream.read_exact(&mut rest).await?;
        Ok::<_, std::io::Error>(Ok(rest))
    };
    let rest = match tokio::time::timeout(limit, challenge).await {
        Ok(Ok(Ok(rest))) => rest,
        Ok(Ok(Err(handshake::STATUS_NO_SECRET))) => {
            return Err(fatal(
                "the server has no cluster secret; refusing to use an unauthenticated store \
                 (configure the same secret on both sides, or none on both)"
                    .to_owned(),
            ))
        }
        Ok(Ok(Err(status))) => return Err(fatal(format!("unexpected status {status}"))),
        Ok(Err(e)) => return Err(Attempt::Retry(format!("authentication: {e}"))),
        Err(_) => {
            return Err(fatal(format!(
                "no answer to the authentication request within {limit:?}; the server may be \
                 PyTorch's TCPStore, which does not support a cluster secret"
            )))
        }
    };
    let mut server_nonce = [0u8; AUTH_LEN];
    server_nonce.copy_from_slice(&rest[..AUTH_LEN]);
    let mut server_mac = [0u8; AUTH_LEN];
    server_mac.copy_from_slice(&rest[AUTH_LEN..]);
    if !handshake::macs_equal(
        &server_mac,
        &handshake::server_mac(secret, &client_nonce, &server_nonce),
    ) {
        return Err(fatal(
            "the server does not know our cluster secret".to_owned(),
        ));
    }
    let mut proof = Vec::new();
    Request::AuthProof {
        mac: handshake::client_mac(secret, &client_nonce, &server_nonce),
    }
    .encode(&mut proof);
    let verdict = async {
        stream.write_all(&proof).await?;
        stream.read_u8().await
    };
    match tokio::time::timeout(limit, verdict).await {
        Ok(Ok(handshake::STATUS_OK)) => Ok(()),
        Ok(Ok(handshake::STATUS_REJECTED)) => {
            Err(fatal("the server rejected our cluster secret".to_owned()))
        }
        Ok(Ok(status)) => Err(fatal(format!("unexpected status {status}"))),
        // A server that is closing (its process exiting, or a store stopped and started again
        // on the same port) drops connections mid-handshake: the connection is lost, the
        // secret was not refused, so try again within the deadline.
        Ok(Err(e)) => Err(Attempt::Retry(format!(
            "the connection was lost during authentication: {e}"
        ))),
        Err(_) => Err(fatal(format!("no verdict within {limit:?}"))),
    }
}

#[async_trait]
impl Store for TcpStoreClient {
    async fn set(&self, key: &str, value: &[u8]) -> Result<(), StoreError> {
        let full = self.full_key(key)?;
        self.check_value(key, value)?;
        self.send_only(
            "set",
            Request::Set {
                key: full,
                value: value.to_vec(),
            },
        )
        .await
    }

    async fn get(&self, key: &str) -> Result<Vec<u8>, StoreError> {
        let full = self.full_key(key)?;
        self.wait_full(&[key], vec![full.clone()], self.inner.timeout)
            .await?;
        let max = self.inner.limits.max_value_len;
        self.exchange("get", Request::Get { key: full }, move |c| {
            Box::pin(async move { c.read_bytes(max).await })
        })
        .await
    }

    async fn add(&self, key: &str, delta: i64) -> Result<i64, StoreError> {
        let full = self.full_key(key)?;
        self.exchange("add", Request::Add { key: full, delta }, |c| {
            Box::pin(async move { c.read_i64().await })
        })
        .await
        .map_err(|e| match e {
            StoreError::Connection { addr, reason } => StoreError::Connection {
                addr,
                reason: format!(
                    "{reason} (a server closes the connection when key {key:?} does not hold a \
                     decimal integer)"
                ),
            },
            other => other,
        })
    }

    async fn check(&self, keys: &[&str]) -> Result<bool, StoreError> {
        let full = self.full_keys(keys)?;
        let reply = self
            .exchange("check", Request::Check { keys: full }, |c| {
                Box::pin(async move { c.read_u8().await })
            })
            .await?;
        match reply {
            CHECK_READY => Ok(true),
            CHECK_NOT_READY => Ok(false),
            other => Err(self.protocol(format!("check: unexpected reply byte {other}"))),
        }
    }

    async fn wait(&self, keys: &[&str], timeout: Duration) -> Result<(), StoreError> {
        let full = self.full_keys(keys)?;
        self.wait_full(keys, full, timeout).await
    }

    async fn compare_set(
        &self,
        key: &str,
        expected: &[u8],
        desired: &[u8],
    ) -> Result<Vec<u8>, StoreError> {
        let full = self.full_key(key)?;
        self.check_value(key, expected)?;
        self.check_value(key, desired)?;
        let max = self.inner.limits.max_value_len;
        let request = Request::CompareSet {
            key: full,
            expected: expected.to_vec(),
            desired: desired.to_vec(),
        };
        self.exchange("compare_set", request, move |c| {
            Box::pin(async move { c.read_bytes(max).await })
        })
        .await
    }

    async fn delete_key(&self, key: &str) -> Result<bool, StoreError> {
        let full = self.full_key(key)?;
        let n = self
            .exchange("delete_key", Request::DeleteKey { key: full }, |c| {
                Box::pin(async move { c.read_i64().await })
            })
            .await?;
        Ok(n == 1)
    }

    async fn num_keys(&self) -> Result<i64, StoreError> {
        self.exchange("num_keys", Request::GetNumKeys, |c| {
            Box::pin(async move { c.read_i64().await })
        })
        .await
    }

    async fn append(&self, key: &str, value: &[u8]) -> Result<(), StoreError> {
        let full = self.full_key(key)?;
        self.check_value(key, value)?;
        self.send_only(
            "append",
            Request::Append {
                key: full,
                value: value.to_vec(),
            },
        )
        .await
    }

    async fn multi_get(&self, keys: &[&str]) -> Result<Vec<Vec<u8>>, StoreError> {
        let full = self.full_keys(keys)?;
        self.wait_full(keys, full.clone(), self.inner.timeout)
            .await?;
        let max = self.inner.limits.max_value_len;
        let n = full.len();
        self.exchange("multi_get", Request::MultiGet { keys: full }, move |c| {
            Box::pin(async move {
                let mut values = Vec::with_capacity(n);
                for _ in 0..n {
                    values.push(c.read_bytes(max).await?);
                }
                Ok(values)
            })
        })
        .await
    }

    async fn multi_set(&self, keys: &[&str], values: &[&[u8]]) -> Result<(), StoreError> {
        check_multi_set(keys, values)?;
        let full = self.full_keys(keys)?;
        let mut pairs = Vec::with_capacity(keys.len());
        for ((key, full), value) in keys.iter().zip(full).zip(values) {
            self.check_value(key, value)?;
            pairs.push((full, value.to_vec()));
        }
        self.send_only("multi_set", Request::MultiSet { pairs })
            .await
    }

    async fn barrier(
        &self,
        key: &str,
        world_size: i64,
        timeout: Duration,
    ) -> Result<(), StoreError> {
        let full = self.full_key(key)?;
        let request = Request::Barrier {
            key: full,
            world_size,
        };
        self.parked("barrier", request, timeout, || {
            StoreError::barrier_timeout(key, world_size, timeout)
        })
        .await
        .map_err(|e| match e {
            StoreError::Connection { addr, reason } => StoreError::Connection {
                addr,
                reason: format!(
                    "{reason} (a server closes the connection when barrier key {key:?} does not \
                     hold a decimal integer)"
                ),
            },
            other => other,
        })
    }

    fn timeout(&self) -> Duration {
        self.inner.timeout
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{ServerConfig, TcpStoreServer};
    use tokio::net::TcpListener;

    const LIMIT: Duration = Duration::from_secs(10);

    fn config(secret: &ClusterSecret) -> ClientConfig {
        ClientConfig {
            timeout: LIMIT,
            connect_timeout: LIMIT,
            secret: Some(secret.clone()),
            ..ClientConfig::default()
        }
    }

    /// Plays a server's side of the challenge on `stream` (it knows the secret), reads the
    /// client's proof, and returns without a verdict.
    async fn challenge_then_stop(stream: &mut TcpStream, secret: &ClusterSecret) {
        let mut hello = [0u8; 1 + AUTH_LEN];
        stream.read_exact(&mut hello).await.unwrap();
        assert_eq!(hello[0], crate::protocol::AUTH_HELLO);
        let server_nonce = handshake::nonce();
        let mut reply = vec![handshake::STATUS_OK];
        reply.extend_from_slice(&server_nonce);
        reply.extend_from_slice(&handshake::server_mac(secret, &hello[1..], &server_nonce));
        stream.write_all(&reply).await.unwrap();
        let mut proof = [0u8; 1 + AUTH_LEN];
        stream.read_exact(&mut proof).await.unwrap();
        assert_eq!(proof[0], crate::protocol::AUTH_PROOF);
    }

    /// A plain c10d server's side: the handshake's answers, then `reply`, then the close
    /// (reading what the client sends until it closes too).
    async fn serve_once(listener: TcpListener, reply: Vec<u8>) {
        let (mut s, _) = listener.accept().await.unwrap();
        let mut hello = std::process::id().to_ne_bytes().to_vec();
        hello.push(CHECK_NOT_READY);
        hello.extend_from_slice(&reply);
        s.write_all(&hello).await.unwrap();
        s.shutdown().await.unwrap();
        let mut sink = Vec::new();
        let _ = s.read_to_end(&mut sink).await;
    }

    /// A value's announced length is read against what arrives: a server that announces the
    /// largest value allowed and closes after a few bytes gives a typed error (memory is
    /// reserved as bytes arrive, at most `READ_CHUNK` ahead of them, not the announced length
    /// up front), and a value longer than one step arrives whole.
    #[tokio::test]
    async fn a_value_shorter_than_announced_is_a_typed_error_and_long_ones_arrive_whole() {
        let client_config = ClientConfig {
            timeout: LIMIT,
            connect_timeout: LIMIT,
            ..ClientConfig::default()
        };
        let max = client_config.limits.max_value_len;
        for (announced, sent) in [(max, 5usize), (3 * READ_CHUNK + 7, 3 * READ_CHUNK + 7)] {
            let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
            let addr = listener.local_addr().unwrap().to_string();
            let mut reply = vec![WAIT_STOP_WAITING];
            reply.extend_from_slice(&(announced as u64).to_ne_bytes());
            reply.extend((0..sent).map(|i| i as u8));
            let server = tokio::spawn(serve_once(listener, reply));
            let client = TcpStoreClient::connect(&addr, client_config.clone())
                .await
                .unwrap();
            let got = client.get("k").await;
            if sent < announced {
                let e = got.unwrap_err();
                assert!(
                    matches!(&e, StoreError::Connection { reason, .. }
                        if reason == "get: the server closed the connection"),
                    "{e:?}"
                );
            } else {
                let v = got.unwrap();
                assert_eq!(v.len(), sent);
                assert!(v.iter().enumerate().all(|(i, b)| *b == i as u8));
            }
            drop(client);
            server.await.unwrap();
        }
    }

    #[tokio::test]
    async fn a_connection_lost_during_authentication_is_retried() {
        let secret = ClusterSecret::new("closing store").unwrap();
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        let connecting = tokio::spawn({
            let config = config(&secret);
            async move { TcpStoreClient::connect(&addr, config).await }
        });
        // A store that is closing: the first connection ends in an EOF where the verdict
        // should be, the second in a reset.
        let accept = || async {
            tokio::time::timeout(LIMIT, listener.accept())
                .await
                .expect("the client connects again after losing the connection")
                .unwrap()
                .0
        };
        let mut first = accept().await;
        challenge_then_stop(&mut first, &secret).await;
        drop(first);
        let mut second = accept().await;
        challenge_then_stop(&mut second, &secret).await;
        // Linger 0: closing sends a reset (deprecated only because a non-zero linger blocks).
        #[allow(deprecated)]
        second.set_linger(Some(Duration::ZERO)).unwrap();
        drop(second);
        // Then the store is back on the same listener.
        let server = TcpStoreServer::serve(
            listener,
            ServerConfig {
                secret: Some(secret.clone()),
                ..ServerConfig::default()
            },
        );
        let client = tokio::time::timeout(LIMIT, connecting)
            .await
            .expect("connect returns")
            .unwrap()
            .expect("the third attempt connects");
        client.set("k", b"v").await.unwrap();
        assert_eq!(client.get("k").await.unwrap(), b"v");
        server.shutdown().await;
    }

    #[tokio::test]
    async fn a_rejected_secret_is_fatal_at_once() {
        let secret = ClusterSecret::new("ours").unwrap();
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        let started = Instant::now();
        let connecting = tokio::spawn({
            let config = config(&secret);
            async move { TcpStoreClient::connect(&addr, config).await }
        });
        let (mut stream, _) = listener.accept().await.unwrap();
        challenge_then_stop(&mut stream, &secret).await;
        stream
            .write_all(&[handshake::STATUS_REJECTED])
            .await
            .unwrap();
        drop(stream);
        let err = tokio::time::timeout(LIMIT, connecting)
            .await
            .expect("connect returns")
            .unwrap()
            .expect_err("a rejected secret fails");
        assert!(matches!(err, StoreError::Auth { .. }), "{err}");
        assert!(err.to_string().contains("rejected"), "{err}");
        assert!(
            started.elapsed() < LIMIT / 2,
            "refused at once, not retried until the deadline: {:?}",
            started.elapsed()
        );
    }
}
