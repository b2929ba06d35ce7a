//! The wire format of PyTorch c10d's `TCPStore`, as a pure (sans-IO) codec.
//!
//! Every request is one query-type byte followed by its arguments; there is no length prefix
//! for the request as a whole. Arguments are:
//!
//! - strings (keys) and byte vectors (values): a `u64` length, then the bytes;
//! - key lists: a `u64` count, then that many strings;
//! - integers: raw `u32`/`i64`/`u64` in the host's byte order (c10d copies the in-memory
//!   representation, so on every platform PyTorch ships for this is little-endian).
//!
//! | byte | query          | arguments                        | response                          |
//! |------|----------------|----------------------------------|-----------------------------------|
//! | 0    | `VALIDATE`     | `u32` magic `0x3C85F7CE`         | none                              |
//! | 1    | `SET`          | key, value                       | none                              |
//! | 2    | `COMPARE_SET`  | key, expected, desired           | value held afterwards             |
//! | 3    | `GET`          | key                              | value (empty when missing)        |
//! | 4    | `ADD`          | key, `i64` delta                 | `i64` new value                   |
//! | 5    | `CHECK`        | key list                         | `u8` 0 = ready, 1 = not ready     |
//! | 6    | `WAIT`         | key list                         | `u8` 0 = stop waiting (when set)  |
//! | 7    | `GETNUMKEYS`   | none                             | `i64`                             |
//! | 8    | `DELETE_KEY`   | key                              | `i64` number deleted (0 or 1)     |
//! | 9    | `APPEND`       | key, value                       | none                              |
//! | 10   | `MULTI_GET`    | key list                         | one value per key                 |
//! | 11   | `MULTI_SET`    | `u64` count, (key, value) pairs  | none                              |
//! | 12   | `CANCEL_WAIT`  | none                             | `u8` 1 = wait canceled            |
//! | 13   | `PING`         | `u32` nonce                      | the same `u32`                    |
//! | 14   | `QUEUE_PUSH`   | key, value                       | none                              |
//! | 15   | `QUEUE_POP`    | key                              | `i64` length before, value if > 0 |
//! | 16   | `QUEUE_LEN`    | key                              | `i64`                             |
//! | 17   | `LIST_KEYS`    | none                             | `u64` count, then the keys        |
//! | 18   | `BARRIER`      | key, `i64` world size            | `u8` 0 = stop waiting (when met)  |
//!
//! What was checked against PyTorch 2.15, and how:
//!
//! - The list itself, 0 to 18 and nothing more: c10d's `QueryType` enum in PyTorch's
//!   `torch/csrc/distributed/c10d/TCPStoreBackend.hpp` (the source that has `barrier`; the
//!   wheel ships no copy of this header) ends `..., PING, QUEUE_PUSH, QUEUE_POP, QUEUE_LEN,
//!   LIST_KEYS, BARRIER`, and the torch 2.15.0 wheel's own server closes a validated
//!   connection that sends any byte from 19 to 255
//!   (`pytorchs_server_knows_no_query_type_past_barrier` in `tests/pytorch_interop.rs`).
//! - Every request, 0 to 18, as 2.15's client (`TCPStore.cpp`) sends it: the wheel's client,
//!   talking to a scripted server, sends exactly the bytes of [`Request::encode`]
//!   (`pytorchs_client_sends_our_encoding`).
//! - Every answer, and what the server does to the table, from 2.15's libuv server
//!   (`TCPStoreLibUvBackend.cpp`, PyTorch's default) and its legacy one (`TCPStoreBackend.cpp`),
//!   then by running one script against the wheel's server and against ours and comparing
//!   (`same_results_from_pytorchs_server_and_ours`, `same_barriers_on_pytorchs_server_and_ours`).
//!
//! Queues are separate from keys: `num_keys` and `LIST_KEYS` do not count them, `CHECK` and
//! `WAIT` count a non-empty queue as present, and a push releases one waiter.
//!
//! `BARRIER` adds one to the decimal count held by its key (an ordinary key: `GET` reads it and
//! `GETNUMKEYS` counts it) and answers `STOP_WAITING` once the count reaches the world size,
//! releasing every arrival parked on the key at the same moment. Until then the arrival is
//! parked like a `WAIT`, and a client that gives up sends `CANCEL_WAIT` as after a `WAIT`. The
//! count is never reset: an arrival that gave up has still counted, and a later arrival on a
//! reached key is answered at once.
//! Any write that wakes a `WAIT` on the key (a `SET`, say) releases its parked arrivals too,
//! before the count is reached: PyTorch's server does the same (`set-releases` in
//! `same_barriers_on_pytorchs_server_and_ours`).
//!
//! A client's first request must be `VALIDATE` with the magic number; PyTorch's client then
//! sends `PING` with its process id as nonce. `GET` is sent by clients only after a `WAIT` for
//! the key, which is how `get` "waits for the key". When a `WAIT` times out on the client, it
//! sends `CANCEL_WAIT`; the server answers `WAIT_CANCELED`, preceded by `STOP_WAITING` if the
//! keys arrived in between.
//!
//! tensorwire adds two query types, outside c10d's range, for the optional cluster secret
//! (see [`crate::handshake`]): [`AUTH_HELLO`] and [`AUTH_PROOF`].
//!
//! # Refusals that name their bound
//!
//! c10d has no error reply: a server that refuses a request can only close the connection.
//! tensorwire's server refuses requests that reach one of its bounds (see
//! `ServerConfig`), and tensorwire's client asks to be told why, in a way PyTorch's server
//! answers harmlessly: right after `VALIDATE` and `PING` it sends `CHECK` of the one key
//! [`CLOSING_REASONS_KEY`] (it starts with a NUL byte, so no c10d client, which prefixes keys
//! with `/`, sends it). PyTorch's server answers `NOT_READY` and nothing changes. tensorwire's
//! server answers `READY` without storing anything, and from then on, on that connection only:
//!
//! - every reply (each `STOP_WAITING` and `WAIT_CANCELED` counts as one) starts with the
//!   status byte [`REPLY_OK`];
//! - a refused request is answered, in place of its reply, with [`REPLY_REFUSED`], then the
//!   name of the bound reached (a c10d string: `u64` length, bytes; empty when the request was
//!   malformed rather than over a bound) and the reason (a c10d string), and the connection
//!   is closed. A request with no reply (`SET`, `APPEND`, `MULTI_SET`, `QUEUE_PUSH`) that is
//!   refused is so reported where the client reads its next reply.
//!
//! A connection that did not ask (PyTorch's client, or any other c10d client) sees c10d's
//! behaviour: the connection closes, with the reason in the server's log only. A connection
//! refused because [`max_connections`](crate::ServerConfig::max_connections) are open gets
//! the four bytes [`CONNECTIONS_FULL_MARKER`] where the `PING` echo would be, then the close;
//! PyTorch's client reports a ping mismatch.

use std::fmt;

/// The number a client sends with `VALIDATE` (c10d's `validationMagicNumber`).
pub const VALIDATION_MAGIC: u32 = 0x3C85_F7CE;

/// tensorwire's authentication request: the client's 32-byte nonce follows.
pub const AUTH_HELLO: u8 = 0xA5;
/// tensorwire's authentication proof: the client's 32-byte HMAC follows.
pub const AUTH_PROOF: u8 = 0xA6;

/// Length of the nonces and MACs of the authentication step.
pub const AUTH_LEN: usize = 32;

/// The key whose `CHECK` (alone, right after validation) asks tensorwire's server to tag
/// replies and name its refusals (see [the module documentation](self)).
pub const CLOSING_REASONS_KEY: &[u8] = b"\0tw/reasons";
/// Status byte before each reply on a connection that asked for reasons: the reply follows.
pub const REPLY_OK: u8 = 0;
/// Status byte in place of a reply on a connection that asked for reasons: the bound and the
/// reason follow, then the server closes the connection.
pub const REPLY_REFUSED: u8 = 0xEE;
/// Four bytes a server at its connection bound sends in place of the `PING` echo before
/// closing a new connection (native byte order, as the echo).
pub const CONNECTIONS_FULL_MARKER: u32 = 0xA5A5_0C0F;

/// c10d's query types (`c10d::detail::QueryType`), in wire order.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum QueryType {
    /// Client validation with the magic number.
    Validate = 0,
    /// Set a key.
    Set = 1,
    /// Compare and set.
    CompareSet = 2,
    /// Read a key (after waiting for it).
    Get = 3,
    /// Add to an integer key.
    Add = 4,
    /// Whether keys exist.
    Check = 5,
    /// Wait for keys.
    Wait = 6,
    /// Number of keys.
    GetNumKeys = 7,
    /// Delete a key.
    DeleteKey = 8,
    /// Append to a key.
    Append = 9,
    /// Read several keys.
    MultiGet = 10,
    /// Set several keys.
    MultiSet = 11,
    /// Cancel the pending wait of this connection.
    CancelWait = 12,
    /// Echo a nonce.
    Ping = 13,
    /// Push onto a queue (PyTorch 2.x `queue_push`).
    QueuePush = 14,
    /// Pop from a queue.
    QueuePop = 15,
    /// Length of a queue.
    QueueLen = 16,
    /// All keys.
    ListKeys = 17,
    /// Count in at a barrier and wait for the world size (PyTorch 2.15 `barrier`).
    Barrier = 18,
}

/// c10d's `CheckResponseType::READY`.
pub const CHECK_READY: u8 = 0;
/// c10d's `CheckResponseType::NOT_READY`.
pub const CHECK_NOT_READY: u8 = 1;
/// c10d's `WaitResponseType::STOP_WAITING`.
pub const WAIT_STOP_WAITING: u8 = 0;
/// c10d's `WaitResponseType::WAIT_CANCELED`.
pub const WAIT_CANCELED: u8 = 1;

/// Size limits a peer enforces on requests.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// Longest key, in bytes (c10d: 8 KiB).
    pub max_key_len: usize,
    /// Largest value, in bytes (c10d: 8 MiB).
    pub max_value_len: usize,
    /// Most keys in one request (c10d: 128 Ki).
    pub max_keys: usize,
    /// Largest request as a whole, in bytes (bounds `MULTI_SET` and what a server buffers).
    pub max_request_len: usize,
}

impl Default for Limits {
    /// The limits of PyTorch's libuv store server, so that whatever a PyTorch client may send to
    /// a PyTorch server is accepted here too.
    fn default() -> Self {
        Limits {
            max_key_len: 8 * 1024,
            max_value_len: 8 * 1024 * 1024,
            max_keys: 128 * 1024,
            max_request_len: 64 * 1024 * 1024,
        }
    }
}

/// One request, decoded.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Request {
    /// `VALIDATE` with the number sent.
    Validate {
        /// Should be [`VALIDATION_MAGIC`].
        magic: u32,
    },
    /// `SET`.
    Set {
        /// Key.
        key: Vec<u8>,
        /// Value.
        value: Vec<u8>,
    },
    /// `COMPARE_SET`.
    CompareSet {
        /// Key.
        key: Vec<u8>,
        /// Expected current value.
        expected: Vec<u8>,
        /// Value to store when it matches.
        desired: Vec<u8>,
    },
    /// `GET`.
    Get {
        /// Key.
        key: Vec<u8>,
    },
    /// `ADD`.
    Add {
        /// Key.
        key: Vec<u8>,
        /// Amount to add.
        delta: i64,
    },
    /// `CHECK`.
    Check {
        /// Keys.
        keys: Vec<Vec<u8>>,
    },
    /// `WAIT`.
    Wait {
        /// Keys.
        keys: Vec<Vec<u8>>,
    },
    /// `GETNUMKEYS`.
    GetNumKeys,
    /// `DELETE_KEY`.
    DeleteKey {
        /// Key.
        key: Vec<u8>,
    },
    /// `APPEND`.
    Append {
        /// Key.
        key: Vec<u8>,
        /// Bytes to append.
        value: Vec<u8>,
    },
    /// `MULTI_GET`.
    MultiGet {
        /// Keys.
        keys: Vec<Vec<u8>>,
    },
    /// `MULTI_SET`.
    MultiSet {
        /// (key, value) pairs.
        pairs: Vec<(Vec<u8>, Vec<u8>)>,
    },
    /// `CANCEL_WAIT`.
    CancelWait,
    /// `PING`.
    Ping {
        /// Echoed back.
        nonce: u32,
    },
    /// `QUEUE_PUSH`.
    QueuePush {
        /// Queue name.
        key: Vec<u8>,
        /// Item.
        value: Vec<u8>,
    },
    /// `QUEUE_POP`.
    QueuePop {
        /// Queue name.
        key: Vec<u8>,
    },
    /// `QUEUE_LEN`.
    QueueLen {
        /// Queue name.
        key: Vec<u8>,
    },
    /// `LIST_KEYS`.
    ListKeys,
    /// `BARRIER`.
    Barrier {
        /// The barrier's key, which holds its count.
        key: Vec<u8>,
        /// How many arrivals release the barrier.
        world_size: i64,
    },
    /// tensorwire's [`AUTH_HELLO`].
    AuthHello {
        /// The client's nonce.
        nonce: [u8; AUTH_LEN],
    },
    /// tensorwire's [`AUTH_PROOF`].
    AuthProof {
        /// The client's MAC.
        mac: [u8; AUTH_LEN],
    },
}

impl Request {
    /// The query byte that starts this request.
    pub fn query_byte(&self) -> u8 {
        match self {
            Request::Validate { .. } => QueryType::Validate as u8,
            Request::Set { .. } => QueryType::Set as u8,
            Request::CompareSet { .. } => QueryType::CompareSet as u8,
            Request::Get { .. } => QueryType::Get as u8,
            Request::Add { .. } => QueryType::Add as u8,
            Request::Check { .. } => QueryType::Check as u8,
            Request::Wait { .. } => QueryType::Wait as u8,
            Request::GetNumKeys => QueryType::GetNumKeys as u8,
            Request::DeleteKey { .. } => QueryType::DeleteKey as u8,
            Request::Append { .. } => QueryType::Append as u8,
            Request::MultiGet { .. } => QueryType::MultiGet as u8,
            Request::MultiSet { .. } => QueryType::MultiSet as u8,
            Request::CancelWait => QueryType::CancelWait as u8,
            Request::Ping { .. } => QueryType::Ping as u8,
            Request::QueuePush { .. } => QueryType::QueuePush as u8,
            Request::QueuePop { .. } => QueryType::QueuePop as u8,
            Request::QueueLen { .. } => QueryType::QueueLen as u8,
            Request::ListKeys => QueryType::ListKeys as u8,
            Request::Barrier { .. } => QueryType::Barrier as u8,
            Request::AuthHello { .. } => AUTH_HELLO,
            Request::AuthProof { .. } => AUTH_PROOF,
        }
    }

    /// Appends the encoding of this request to `out`.
    pub fn encode(&self, out: &mut Vec<u8>) {
        out.push(self.query_byte());
        match self {
            Request::Validate { magic } => out.extend_from_slice(&magic.to_ne_bytes()),
            Request::Set { key, value }
            | Request::Append { key, value }
            | Request::QueuePush { key, value } => {
                put_bytes(out, key);
                put_bytes(out, value);
            }
            Request::CompareSet {
                key,
                expected,
                desired,
            } => {
                put_bytes(out, key);
                put_bytes(out, expected);
                put_bytes(out, desired);
            }
            Request::Get { key }
            | Request::DeleteKey { key }
            | Request::QueuePop { key }
            | Request::QueueLen { key } => put_bytes(out, key),
            Request::Add { key, delta } => {
                put_bytes(out, key);
                out.extend_from_slice(&delta.to_ne_bytes());
            }
            Request::Barrier { key, world_size } => {
                put_bytes(out, key);
                out.extend_from_slice(&world_size.to_ne_bytes());
            }
            Request::Check { keys } | Request::Wait { keys } | Request::MultiGet { keys } => {
                out.extend_from_slice(&(keys.len() as u64).to_ne_bytes());
                for key in keys {
                    put_bytes(out, key);
                }
            }
            Request::MultiSet { pairs } => {
                out.extend_from_slice(&(pairs.len() as u64).to_ne_bytes());
                for (key, value) in pairs {
                    put_bytes(out, key);
                    put_bytes(out, value);
                }
            }
            Request::GetNumKeys | Request::CancelWait | Request::ListKeys => {}
            Request::Ping { nonce } => out.extend_from_slice(&nonce.to_ne_bytes()),
            Request::AuthHello { nonce } => out.extend_from_slice(nonce),
            Request::AuthProof { mac } => out.extend_from_slice(mac),
        }
    }
}

/// Appends a c10d string or vector: `u64` length, then the bytes.
pub fn put_bytes(out: &mut Vec<u8>, bytes: &[u8]) {
    out.extend_from_slice(&(bytes.len() as u64).to_ne_bytes());
    out.extend_from_slice(bytes);
}

/// Why a request could not be decoded. The connection that sent it is closed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum WireError {
    /// The first byte is not a known query type.
    #[error("unknown query type {0}")]
    UnknownQuery(u8),
    /// A key is longer than allowed.
    #[error("key of {len} bytes exceeds the limit of {max} bytes")]
    KeyTooLarge {
        /// Declared length.
        len: u64,
        /// Limit.
        max: usize,
    },
    /// A value is larger than allowed.
    #[error("value of {len} bytes exceeds the limit of {max} bytes")]
    ValueTooLarge {
        /// Declared length.
        len: u64,
        /// Limit.
        max: usize,
    },
    /// Too many keys in one request.
    #[error("{count} keys in one request exceed the limit of {max}")]
    TooManyKeys {
        /// Declared count.
        count: u64,
        /// Limit.
        max: usize,
    },
    /// The request is larger than allowed as a whole.
    #[error("request of at least {len} bytes exceeds the limit of {max} bytes")]
    RequestTooLarge {
        /// Bytes needed so far.
        len: u64,
        /// Limit.
        max: usize,
    },
}

/// Decodes the request at the start of `buf`.
///
/// Returns `Ok(None)` when `buf` holds only the beginning of a request (read more and call
/// again), `Ok(Some((request, consumed)))` when a whole request is there. A declared length
/// over a limit is an error as soon as the length itself has arrived, so nothing of the claimed
/// size is ever buffered or allocated. A request over `max_request_len` is refused however its
/// bytes arrive, all at once or in pieces.
pub fn decode_request(buf: &[u8], limits: &Limits) -> Result<Option<(Request, usize)>, WireError> {
    let mut r = Reader {
        buf,
        pos: 0,
        limits,
    };
    match r.request() {
        Ok(_) if r.pos > limits.max_request_len => Err(WireError::RequestTooLarge {
            len: r.pos as u64,
            max: limits.max_request_len,
        }),
        Ok(req) => Ok(Some((req, r.pos))),
        Err(Short::Incomplete) => Ok(None),
        Err(Short::Bad(e)) => Err(e),
    }
}

enum Short {
    Incomplete,
    Bad(WireError),
}

impl From<WireError> for Short {
    fn from(e: WireError) -> Self {
        Short::Bad(e)
    }
}

struct Reader<'a> {
    buf: &'a [u8],
    pos: usize,
    limits: &'a Limits,
}

impl Reader<'_> {
    fn take(&mut self, n: usize) -> Result<&[u8], Short> {
        if self.buf.len() - self.pos < n {
            // The bytes are not here yet; make sure that waiting for them stays bounded.
            let needed = self.pos as u64 + n as u64;
            if needed > self.limits.max_request_len as u64 {
                return Err(WireError::RequestTooLarge {
                    len: needed,
                    max: self.limits.max_request_len,
                }
                .into());
            }
            return Err(Short::Incomplete);
        }
        let s = &self.buf[self.pos..self.pos + n];
        self.pos += n;
        Ok(s)
    }

    fn array<const N: usize>(&mut self) -> Result<[u8; N], Short> {
        let mut a = [0u8; N];
        a.copy_from_slice(self.take(N)?);
        Ok(a)
    }

    fn u64(&mut self) -> Result<u64, Short> {
        Ok(u64::from_ne_bytes(self.array()?))
    }

    fn sized(&mut self, len: u64) -> Result<Vec<u8>, Short> {
        // `len` was checked against a limit far below usize::MAX by the caller.
        Ok(self.take(len as usize)?.to_vec())
    }

    fn key(&mut self) -> Result<Vec<u8>, Short> {
        let len = self.u64()?;
        if len > self.limits.max_key_len as u64 {
            return Err(WireError::KeyTooLarge {
                len,
                max: self.limits.max_key_len,
            }
            .into());
        }
        self.sized(len)
    }

    fn value(&mut self) -> Result<Vec<u8>, Short> {
        let len = self.u64()?;
        if len > self.limits.max_value_len as u64 {
            return Err(WireError::ValueTooLarge {
                len,
                max: self.limits.max_value_len,
            }
            .into());
        }
        self.sized(len)
    }

    fn count(&mut self) -> Result<usize, Short> {
        let count = self.u64()?;
        if count > self.limits.max_keys as u64 {
            return Err(WireError::TooManyKeys {
                count,
                max: self.limits.max_keys,
            }
            .into());
        }
        Ok(count as usize)
    }

    fn keys(&mut self) -> Result<Vec<Vec<u8>>, Short> {
        let count = self.count()?;
        // Grow as keys arrive rather than trusting the count for an allocation.
        let mut keys = Vec::with_capacity(count.min(1024));
        for _ in 0..count {
            keys.push(self.key()?);
        }
        Ok(keys)
    }

    fn request(&mut self) -> Result<Request, Short> {
        let [q] = self.array::<1>()?;
        let req = match q {
            0 => Request::Validate {
                magic: u32::from_ne_bytes(self.array()?),
            },
            1 => Request::Set {
                key: self.key()?,
                value: self.value()?,
            },
            2 => Request::CompareSet {
                key: self.key()?,
                expected: self.value()?,
                desired: self.value()?,
            },
            3 => Request::Get { key: self.key()? },
            4 => Request::Add {
                key: self.key()?,
                delta: i64::from_ne_bytes(self.array()?),
            },
            5 => Request::Check { keys: self.keys()? },
            6 => Request::Wait { keys: self.keys()? },
            7 => Request::GetNumKeys,
            8 => Request::DeleteKey { key: self.key()? },
            9 => Request::Append {
                key: self.key()?,
                value: self.value()?,
            },
            10 => Request::MultiGet { keys: self.keys()? },
            11 => {
                let count = self.count()?;
                let mut pairs = Vec::with_capacity(count.min(1024));
                for _ in 0..count {
                    let key = self.key()?;
                    let value = self.value()?;
                    pairs.push((key, value));
                }
                Request::MultiSet { pairs }
            }
            12 => Request::CancelWait,
            13 => Request::Ping {
                nonce: u32::from_ne_bytes(self.array()?),
            },
            14 => Request::QueuePush {
                key: self.key()?,
                value: self.value()?,
            },
            15 => Request::QueuePop { key: self.key()? },
            16 => Request::QueueLen { key: self.key()? },
            17 => Request::ListKeys,
            18 => Request::Barrier {
                key: self.key()?,
                world_size: i64::from_ne_bytes(self.array()?),
            },
            AUTH_HELLO => Request::AuthHello {
                nonce: self.array()?,
            },
            AUTH_PROOF => Request::AuthProof { mac: self.array()? },
            other => return Err(WireError::UnknownQuery(other).into()),
        };
        Ok(req)
    }
}

/// Parses an integer the way c10d's `std::stoll` does: leading whitespace, an optional sign,
/// then decimal digits up to the first non-digit. `None` when there is no digit or the number
/// does not fit in an `i64`.
pub fn parse_c10d_int(bytes: &[u8]) -> Option<i64> {
    let mut i = 0;
    while i < bytes.len() && matches!(bytes[i], b' ' | b'\t' | b'\n' | b'\r' | 0x0b | 0x0c) {
        i += 1;
    }
    let negative = match bytes.get(i) {
        Some(b'-') => {
            i += 1;
            true
        }
        Some(b'+') => {
            i += 1;
            false
        }
        _ => false,
    };
    let start = i;
    let mut value: i64 = 0;
    while let Some(d) = bytes.get(i).filter(|b| b.is_ascii_digit()) {
        let digit = i64::from(d - b'0');
        value = value.checked_mul(10)?;
        value = if negative {
            value.checked_sub(digit)?
        } else {
            value.checked_add(digit)?
        };
        i += 1;
    }
    (i > start).then_some(value)
}

/// Shows a key for logs and errors: UTF-8 text as is, other bytes escaped.
pub struct KeyDisplay<'a>(pub &'a [u8]);

impl fmt::Display for KeyDisplay<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let shown = &self.0[..self.0.len().min(128)];
        write!(f, "{:?}", String::from_utf8_lossy(shown))?;
        if self.0.len() > 128 {
            write!(f, " (cut, {} bytes)", self.0.len())?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn roundtrip(req: Request) {
        let mut out = Vec::new();
        req.encode(&mut out);
        let limits = Limits::default();
        let (back, used) = decode_request(&out, &limits).unwrap().unwrap();
        assert_eq!(back, req);
        assert_eq!(used, out.len());
        // Every strict prefix is incomplete, never an error or a wrong request.
        for cut in 0..out.len() {
            assert_eq!(
                decode_request(&out[..cut], &limits),
                Ok(None),
                "prefix {cut}"
            );
        }
    }

    #[test]
    fn set_is_query_byte_then_length_prefixed_key_and_value() {
        let mut out = Vec::new();
        Request::Set {
            key: b"/k".to_vec(),
            value: b"xyz".to_vec(),
        }
        .encode(&mut out);
        let mut expected = vec![1u8];
        expected.extend_from_slice(&2u64.to_ne_bytes());
        expected.extend_from_slice(b"/k");
        expected.extend_from_slice(&3u64.to_ne_bytes());
        expected.extend_from_slice(b"xyz");
        assert_eq!(out, expected);
    }

    #[test]
    fn validate_carries_the_magic_number() {
        let mut out = Vec::new();
        Request::Validate {
            magic: VALIDATION_MAGIC,
        }
        .encode(&mut out);
        assert_eq!(out[0], 0);
        assert_eq!(out[1..], 0x3C85_F7CEu32.to_ne_bytes());
    }

    #[test]
    fn every_request_roundtrips() {
        for req in [
            Request::Validate { magic: 7 },
            Request::Ping { nonce: 42 },
            Request::Get { key: b"a".to_vec() },
            Request::Add {
                key: b"c".to_vec(),
                delta: -5,
            },
            Request::CompareSet {
                key: b"k".to_vec(),
                expected: vec![],
                desired: b"d".to_vec(),
            },
            Request::Check {
                keys: vec![b"a".to_vec(), b"bb".to_vec()],
            },
            Request::Wait { keys: vec![] },
            Request::GetNumKeys,
            Request::DeleteKey { key: b"k".to_vec() },
            Request::Append {
                key: b"k".to_vec(),
                value: vec![0, 1, 2],
            },
            Request::MultiGet {
                keys: vec![b"x".to_vec()],
            },
            Request::MultiSet {
                pairs: vec![(b"x".to_vec(), b"1".to_vec()), (b"y".to_vec(), vec![])],
            },
            Request::CancelWait,
            Request::QueuePush {
                key: b"q".to_vec(),
                value: b"item".to_vec(),
            },
            Request::QueuePop { key: b"q".to_vec() },
            Request::QueueLen { key: b"q".to_vec() },
            Request::ListKeys,
            Request::Barrier {
                key: b"/b".to_vec(),
                world_size: -3,
            },
            Request::AuthHello { nonce: [9; 32] },
            Request::AuthProof { mac: [3; 32] },
        ] {
            roundtrip(req);
        }
    }

    #[test]
    fn query_types_have_c10d_numbers() {
        assert_eq!(QueryType::Validate as u8, 0);
        assert_eq!(QueryType::Wait as u8, 6);
        assert_eq!(QueryType::CancelWait as u8, 12);
        assert_eq!(QueryType::Ping as u8, 13);
        assert_eq!(QueryType::ListKeys as u8, 17);
        assert_eq!(QueryType::Barrier as u8, 18);
    }

    #[test]
    fn barrier_bytes_are_those_of_pytorchs_client() {
        // Recorded from torch 2.15.0's `TCPStore.barrier("bar", 3)` (little-endian host).
        let recorded: &[u8] = &[
            0x12, 0x04, 0, 0, 0, 0, 0, 0, 0, b'/', b'b', b'a', b'r', 0x03, 0, 0, 0, 0, 0, 0, 0,
        ];
        let mut out = Vec::new();
        Request::Barrier {
            key: b"/bar".to_vec(),
            world_size: 3,
        }
        .encode(&mut out);
        if cfg!(target_endian = "little") {
            assert_eq!(out, recorded);
        }
        let (decoded, used) = decode_request(&out, &Limits::default()).unwrap().unwrap();
        assert_eq!(used, out.len());
        assert_eq!(
            decoded,
            Request::Barrier {
                key: b"/bar".to_vec(),
                world_size: 3
            }
        );
    }

    #[test]
    fn the_first_byte_past_barrier_is_unknown() {
        assert_eq!(
            decode_request(&[19], &Limits::default()),
            Err(WireError::UnknownQuery(19))
        );
    }

    #[test]
    fn unknown_query_is_an_error() {
        assert_eq!(
            decode_request(&[200], &Limits::default()),
            Err(WireError::UnknownQuery(200))
        );
    }

    #[test]
    fn oversized_lengths_fail_before_their_bytes_arrive() {
        let limits = Limits {
            max_key_len: 4,
            max_value_len: 8,
            max_keys: 2,
            max_request_len: 1 << 20,
        };
        let mut key = vec![3u8];
        key.extend_from_slice(&5u64.to_ne_bytes());
        assert_eq!(
            decode_request(&key, &limits),
            Err(WireError::KeyTooLarge { len: 5, max: 4 })
        );
        let mut value = vec![1u8];
        put_bytes(&mut value, b"k");
        value.extend_from_slice(&u64::MAX.to_ne_bytes());
        assert_eq!(
            decode_request(&value, &limits),
            Err(WireError::ValueTooLarge {
                len: u64::MAX,
                max: 8
            })
        );
        let mut keys = vec![6u8];
        keys.extend_from_slice(&3u64.to_ne_bytes());
        assert_eq!(
            decode_request(&keys, &limits),
            Err(WireError::TooManyKeys { count: 3, max: 2 })
        );
    }

    #[test]
    fn a_request_larger_than_the_total_limit_is_refused_while_incomplete() {
        let limits = Limits {
            max_request_len: 100,
            ..Limits::default()
        };
        let mut req = vec![1u8];
        put_bytes(&mut req, b"k");
        req.extend_from_slice(&200u64.to_ne_bytes());
        assert!(matches!(
            decode_request(&req, &limits),
            Err(WireError::RequestTooLarge { .. })
        ));
    }

    /// Found by the `store` fuzz target: a request over `max_request_len` was refused when its
    /// bytes arrived in pieces but accepted when they arrived in one read.
    #[test]
    fn a_request_over_the_total_limit_is_refused_however_it_arrives() {
        let limits = Limits {
            max_request_len: 200,
            ..Limits::default()
        };
        let mut req = Vec::new();
        Request::Set {
            key: vec![b'k'; 64],
            value: vec![b'v'; 128],
        }
        .encode(&mut req);
        assert_eq!(req.len(), 209);
        let refused = Err(WireError::RequestTooLarge { len: 209, max: 200 });
        assert_eq!(decode_request(&req, &limits), refused, "all at once");
        assert!(
            matches!(
                decode_request(&req[..100], &limits),
                Err(WireError::RequestTooLarge { .. })
            ),
            "in pieces"
        );
        // At the limit exactly, it is accepted.
        let at_limit = Limits {
            max_request_len: 209,
            ..Limits::default()
        };
        assert!(matches!(
            decode_request(&req, &at_limit),
            Ok(Some((_, 209)))
        ));
    }

    #[test]
    fn stoll_compatible_integers() {
        assert_eq!(parse_c10d_int(b"42"), Some(42));
        assert_eq!(parse_c10d_int(b"  -7xyz"), Some(-7));
        assert_eq!(parse_c10d_int(b"+3"), Some(3));
        assert_eq!(parse_c10d_int(b"abc"), None);
        assert_eq!(parse_c10d_int(b""), None);
        assert_eq!(parse_c10d_int(b"-"), None);
        assert_eq!(parse_c10d_int(b"9223372036854775807"), Some(i64::MAX));
        assert_eq!(parse_c10d_int(b"-9223372036854775808"), Some(i64::MIN));
        assert_eq!(parse_c10d_int(b"9223372036854775808"), None);
    }

    proptest! {
        #[test]
        fn decoding_arbitrary_bytes_never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..256)) {
            let limits = Limits { max_key_len: 64, max_value_len: 64, max_keys: 8, max_request_len: 4096 };
            let _ = decode_request(&bytes, &limits);
        }

        #[test]
        fn set_roundtrips(key in proptest::collection::vec(any::<u8>(), 0..64),
                          value in proptest::collection::vec(any::<u8>(), 0..256)) {
            let req = Request::Set { key, value };
            let mut out = Vec::new();
            req.encode(&mut out);
            let (back, used) = decode_request(&out, &Limits::default()).unwrap().unwrap();
            prop_assert_eq!(back, req);
            prop_assert_eq!(used, out.len());
        }

        #[test]
        fn integers_roundtrip_through_decimal_text(n in any::<i64>()) {
            prop_assert_eq!(parse_c10d_int(n.to_string().as_bytes()), Some(n));
        }
    }
}
