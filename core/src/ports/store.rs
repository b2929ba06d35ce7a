//! The [`Store`] port: a c10d-style key-value store used for rendezvous and coordination.
//!
//! The command set is the one of PyTorch's `c10d::Store` (`TCPStore`, `FileStore`, `HashStore`):
//! `set`, `get` (which waits for the key), `add` (which keeps the value as a decimal string),
//! `check`, `wait`, `compare_set`, `delete_key`, `num_keys`, `append`, `multi_get`,
//! `multi_set` and `barrier`. Adapters (a TCP store speaking `TCPStore`'s wire protocol, a file
//! store, an in-memory store) live in `tensorwire-store`.
//!
//! Keys are strings, values are bytes. Errors are [`StoreError`]s that name the keys involved.

use std::time::Duration;

use async_trait::async_trait;

/// A key-value store shared by the ranks of a group.
///
/// Every method may be called concurrently from several tasks; an implementation serialises
/// what it must. Semantics follow PyTorch's `c10d::Store`:
///
/// - [`get`](Store::get) waits up to [`timeout`](Store::timeout) for the key to exist.
/// - [`add`](Store::add) treats a missing key as `0`, stores the sum as a decimal string and
///   returns it.
/// - [`compare_set`](Store::compare_set) sets `desired` when the current value equals `expected`
///   (a missing key matches an empty `expected`) and returns the value the key holds afterwards;
///   for a missing key with a non-empty `expected` it changes nothing and returns `expected`.
/// - [`barrier`](Store::barrier) counts the caller in under a key and returns once `world_size`
///   callers have been counted. The count is never reset: an arrival that timed out has still
///   counted, and a later arrival on a key whose count already reached `world_size` returns at
///   once. Use a fresh key for each barrier.
///
/// ```
/// # use tensorwire_core::ports::store::{Store, StoreError};
/// async fn publish(store: &dyn Store, rank: usize, addr: &str) -> Result<(), StoreError> {
///     store.set(&format!("addr/{rank}"), addr.as_bytes()).await?;
///     let arrived = store.add("arrived", 1).await?;
///     assert!(arrived >= 1);
///     Ok(())
/// }
/// # let _ = publish;
/// ```
#[async_trait]
pub trait Store: Send + Sync {
    /// Sets `key` to `value`, replacing any previous value, and wakes waiters on `key`.
    async fn set(&self, key: &str, value: &[u8]) -> Result<(), StoreError>;

    /// Returns the value of `key`, waiting up to [`timeout`](Store::timeout) for it to be set.
    async fn get(&self, key: &str) -> Result<Vec<u8>, StoreError>;

    /// Adds `delta` to the integer held by `key` (missing counts as 0) and returns the new value.
    async fn add(&self, key: &str, delta: i64) -> Result<i64, StoreError>;

    /// Whether all `keys` exist right now (never waits).
    async fn check(&self, keys: &[&str]) -> Result<bool, StoreError>;

    /// Waits until all `keys` exist, at most `timeout`.
    async fn wait(&self, keys: &[&str], timeout: Duration) -> Result<(), StoreError>;

    /// Atomically replaces the value of `key` by `desired` if it equals `expected`; returns the
    /// value held afterwards (see the trait documentation for missing keys).
    async fn compare_set(
        &self,
        key: &str,
        expected: &[u8],
        desired: &[u8],
    ) -> Result<Vec<u8>, StoreError>;

    /// Deletes `key`; returns whether it existed.
    async fn delete_key(&self, key: &str) -> Result<bool, StoreError>;

    /// The number of keys in the store (including keys used internally, as in PyTorch).
    async fn num_keys(&self) -> Result<i64, StoreError>;

    /// Appends `value` to the value of `key` (creating it when missing).
    async fn append(&self, key: &str, value: &[u8]) -> Result<(), StoreError>;

    /// Returns the values of all `keys`, waiting up to [`timeout`](Store::timeout) for them.
    async fn multi_get(&self, keys: &[&str]) -> Result<Vec<Vec<u8>>, StoreError>;

    /// Sets every `keys[i]` to `values[i]`; the two slices must have the same length.
    async fn multi_set(&self, keys: &[&str], values: &[&[u8]]) -> Result<(), StoreError>;

    /// Counts the caller in at the barrier `key` and waits, at most `timeout`, until
    /// `world_size` callers have been counted there (PyTorch's `Store.barrier`).
    ///
    /// A `world_size` of 1 or less returns at once. The count stays in the store as ordinary
    /// keys, so it shows in [`num_keys`](Store::num_keys); where it lives follows PyTorch's
    /// store of the same kind, so that PyTorch's processes and ours meet at one barrier: the
    /// TCP store keeps it in `key` itself as a decimal count (PyTorch's `TCPStore` server;
    /// the in-memory store does the same), the file store in `key/num_members`, with
    /// `key/last_member` set by the last arrival (PyTorch's `FileStore`). On timeout the error is [`StoreError::BarrierTimeout`], and the
    /// arrival has still counted.
    ///
    /// Implementations must not build this from [`add`](Store::add) and [`wait`](Store::wait)
    /// when their store has its own barrier (a TCP client must send the store's `BARRIER`
    /// query), which is why there is no default method.
    async fn barrier(
        &self,
        key: &str,
        world_size: i64,
        timeout: Duration,
    ) -> Result<(), StoreError>;

    /// The default timeout of [`get`](Store::get) and [`multi_get`](Store::multi_get).
    fn timeout(&self) -> Duration;
}

/// [`Store::barrier`] for a store that has no barrier of its own, from its `add`, `set` and
/// `wait`, with PyTorch's keys (`<key>/num_members` counts the arrivals, the last one sets
/// `<key>/last_member`): the file store's, and the Python package's over a store c10d passes.
///
/// # Errors
/// [`StoreError::BarrierTimeout`] when the last arrival does not come within `timeout`; the
/// store's own errors otherwise.
pub async fn barrier_by_counting<S: Store + ?Sized>(
    store: &S,
    key: &str,
    world_size: i64,
    timeout: Duration,
) -> Result<(), StoreError> {
    let last = format!("{key}/last_member");
    let arrived = store.add(&format!("{key}/num_members"), 1).await?;
    if arrived == world_size.max(1) {
        store.set(&last, b"1").await?;
    }
    store.wait(&[&last], timeout).await.map_err(|e| match e {
        StoreError::Timeout { .. } => StoreError::barrier_timeout(key, world_size, timeout),
        other => other,
    })
}

/// Why a [`Store`] operation failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum StoreError {
    /// The keys did not all appear within the timeout.
    #[error("timed out after {timeout:?} waiting for key(s) {}", KeyList(.keys))]
    Timeout {
        /// The keys that were awaited.
        keys: Vec<String>,
        /// How long the caller waited.
        timeout: Duration,
    },
    /// Fewer than `world_size` arrivals were counted at a [`barrier`](Store::barrier) within
    /// the timeout. The message starts as PyTorch's `TCPStore` client's does.
    #[error(
        "barrier timeout after {}ms, key: {key:?} (waiting for {world_size} arrivals; this one \
         has still counted)",
        timeout.as_millis()
    )]
    BarrierTimeout {
        /// The barrier's key.
        key: String,
        /// The number of arrivals awaited.
        world_size: i64,
        /// How long the caller waited.
        timeout: Duration,
    },
    /// A key is longer than the store accepts.
    #[error("key {key:?} is {len} bytes long; the store accepts keys of at most {max} bytes")]
    KeyTooLarge {
        /// The key (cut to its first 64 characters).
        key: String,
        /// Its length in bytes.
        len: usize,
        /// The limit.
        max: usize,
    },
    /// A value is larger than the store accepts.
    #[error(
        "value for key {key:?} is {len} bytes; the store accepts values of at most {max} bytes"
    )]
    ValueTooLarge {
        /// The key the value was meant for.
        key: String,
        /// Its length in bytes.
        len: usize,
        /// The limit.
        max: usize,
    },
    /// A request names more keys than the store accepts at once.
    #[error("{count} keys in one request; the store accepts at most {max}")]
    TooManyKeys {
        /// The number of keys in the request.
        count: usize,
        /// The limit.
        max: usize,
    },
    /// `add` found a value that is not a decimal integer.
    #[error(
        "key {key:?} holds {value:?}, which is not a decimal integer, so `add` cannot update it"
    )]
    NotAnInteger {
        /// The key.
        key: String,
        /// Its current value (lossy UTF-8, cut to 64 characters).
        value: String,
    },
    /// The arguments are inconsistent (for example `multi_set` with more keys than values).
    #[error("invalid store request: {reason}")]
    InvalidArgument {
        /// What is wrong.
        reason: String,
    },
    /// The connection to the store could not be made or was lost.
    #[error("store connection to {addr}: {reason}")]
    Connection {
        /// The store's address.
        addr: String,
        /// What happened.
        reason: String,
    },
    /// The peer sent something the protocol does not allow.
    #[error("store protocol error with {addr}: {reason}")]
    Protocol {
        /// The peer's address.
        addr: String,
        /// What was wrong.
        reason: String,
    },
    /// The store refused a request and closed the connection, and said why (tensorwire's
    /// server does so to its own client; c10d has no error reply, so PyTorch's server and
    /// clients only close). A refused request without a reply (`set`, `append`, `multi_set`,
    /// `queue_push`) is reported by the next request on the connection.
    #[error("the store at {addr} refused a request and closed the connection: {reason}")]
    Refused {
        /// The store's address.
        addr: String,
        /// The server's bound that the request reached, by its configuration name (such as
        /// `memory_budget` or `limits.max_value_len`); empty when the request was refused for
        /// another reason (a malformed request, `add` on a value that is not an integer).
        bound: String,
        /// The server's reason, which names the bound and its `store serve` flag.
        reason: String,
    },
    /// Authentication with the cluster secret failed or was refused.
    #[error("store authentication with {addr} failed: {reason}")]
    Auth {
        /// The peer's address.
        addr: String,
        /// Why.
        reason: String,
    },
    /// A file-backed store could not read or write its file.
    #[error("store file {path}: {reason}")]
    File {
        /// The file.
        path: String,
        /// What failed.
        reason: String,
    },
}

impl StoreError {
    /// A [`StoreError::Timeout`] for `keys`.
    pub fn timeout(keys: &[&str], timeout: Duration) -> Self {
        StoreError::Timeout {
            keys: keys.iter().map(|k| (*k).to_owned()).collect(),
            timeout,
        }
    }

    /// A [`StoreError::BarrierTimeout`] for `key`.
    pub fn barrier_timeout(key: &str, world_size: i64, timeout: Duration) -> Self {
        StoreError::BarrierTimeout {
            key: key.to_owned(),
            world_size,
            timeout,
        }
    }

    /// A [`StoreError::KeyTooLarge`] for `key`, keeping only its first 64 characters.
    pub fn key_too_large(key: &str, max: usize) -> Self {
        StoreError::KeyTooLarge {
            key: key.chars().take(64).collect(),
            len: key.len(),
            max,
        }
    }
}

/// Displays keys as `"a", "b"`, or `(none)`.
struct KeyList<'a>(&'a [String]);

impl std::fmt::Display for KeyList<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.0.is_empty() {
            return f.write_str("(none)");
        }
        for (i, key) in self.0.iter().enumerate() {
            if i > 0 {
                f.write_str(", ")?;
            }
            write!(f, "{key:?}")?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn timeout_names_every_key() {
        let err = StoreError::timeout(&["rank/0", "rank/1"], Duration::from_millis(1500));
        assert_eq!(
            err.to_string(),
            "timed out after 1.5s waiting for key(s) \"rank/0\", \"rank/1\""
        );
    }

    #[test]
    fn barrier_timeout_reads_as_pytorchs_and_names_the_key() {
        let err = StoreError::barrier_timeout("lonely", 3, Duration::from_millis(300));
        assert_eq!(
            err.to_string(),
            "barrier timeout after 300ms, key: \"lonely\" (waiting for 3 arrivals; this one has \
             still counted)"
        );
    }

    #[test]
    fn key_too_large_cuts_the_key_but_keeps_its_length() {
        let key = "k".repeat(100);
        let err = StoreError::key_too_large(&key, 10);
        match &err {
            StoreError::KeyTooLarge { key, len, max } => {
                assert_eq!(key.len(), 64);
                assert_eq!(*len, 100);
                assert_eq!(*max, 10);
            }
            other => panic!("unexpected {other:?}"),
        }
        assert!(err.to_string().contains("100 bytes long"));
    }

    #[test]
    fn the_trait_is_object_safe() {
        fn takes(_: Option<&dyn Store>) {}
        takes(None);
    }
}
