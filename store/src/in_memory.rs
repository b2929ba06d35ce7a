//! An in-memory [`Store`] for one process (c10d's `HashStore`): tasks and threads of the same
//! process share it by cloning the handle.
//!
//! It is the table of the TCP store server without the sockets, so it behaves as that server
//! does, `barrier` included: the count lives in the barrier's key. (PyTorch's `HashStore`
//! counts in `key/num_members` instead; no other process can see this store, so only the
//! waiting matters, and it is the same.)

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use async_trait::async_trait;
use tensorwire_core::ports::store::{Store, StoreError};
use tokio::sync::mpsc::{unbounded_channel, UnboundedReceiver};

use bytes::Bytes;

use crate::table::{AddError, AddOrBudget, Arrival, BudgetError, KvState, WaiterId};
use crate::DEFAULT_TIMEOUT;

/// A store in this process's memory. Clones share the same table.
///
/// ```
/// # tokio::runtime::Runtime::new().unwrap().block_on(async {
/// use tensorwire_core::ports::store::Store;
/// use tensorwire_store::InMemoryStore;
///
/// let store = InMemoryStore::new();
/// assert_eq!(store.add("n", 2).await.unwrap(), 2);
/// assert_eq!(store.get("n").await.unwrap(), b"2");
/// # });
/// ```
#[derive(Clone)]
pub struct InMemoryStore {
    state: Arc<Mutex<KvState>>,
    owners: Arc<AtomicU64>,
    timeout: Duration,
}

impl Default for InMemoryStore {
    fn default() -> Self {
        Self::new()
    }
}

impl std::fmt::Debug for InMemoryStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("InMemoryStore")
            .field("timeout", &self.timeout)
            .finish_non_exhaustive()
    }
}

impl InMemoryStore {
    /// An empty store whose `get` waits at most [`DEFAULT_TIMEOUT`].
    pub fn new() -> Self {
        Self::with_timeout(DEFAULT_TIMEOUT)
    }

    /// An empty store whose `get` waits at most `timeout`.
    pub fn with_timeout(timeout: Duration) -> Self {
        InMemoryStore {
            state: Arc::new(Mutex::new(KvState::default())),
            owners: Arc::new(AtomicU64::new(0)),
            timeout,
        }
    }

    fn lock(&self) -> MutexGuard<'_, KvState> {
        // A panic while holding the lock cannot leave the table half-updated in a way that
        // matters more than losing the store, so keep serving.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Waits up to `timeout` for the wait `owner` parked to be released; on timeout cancels it
    /// and fails with `timed_out()`, unless it was released in between.
    async fn parked(
        &self,
        owner: u64,
        mut released: UnboundedReceiver<WaiterId>,
        timeout: Duration,
        timed_out: impl FnOnce() -> StoreError,
    ) -> Result<(), StoreError> {
        match tokio::time::timeout(timeout, released.recv()).await {
            Ok(Some(_)) => Ok(()),
            _ => {
                self.lock().cancel_owner(owner);
                if released.try_recv().is_ok() {
                    return Ok(());
                }
                Err(timed_out())
            }
        }
    }
}

#[async_trait]
impl Store for InMemoryStore {
    async fn set(&self, key: &str, value: &[u8]) -> Result<(), StoreError> {
        self.lock()
            .set(key.as_bytes(), Bytes::copy_from_slice(value))
            .map_err(|e| budget_error(key, e))
    }

    async fn get(&self, key: &str) -> Result<Vec<u8>, StoreError> {
        self.wait(&[key], self.timeout).await?;
        Ok(self
            .lock()
            .get(key.as_bytes())
            .map(|v| v.to_vec())
            .unwrap_or_default())
    }

    async fn add(&self, key: &str, delta: i64) -> Result<i64, StoreError> {
        self.lock()
            .add(key.as_bytes(), delta)
            .map_err(|e| add_error(key, e))
    }

    async fn check(&self, keys: &[&str]) -> Result<bool, StoreError> {
        let keys: Vec<&[u8]> = keys.iter().map(|k| k.as_bytes()).collect();
        Ok(self.lock().check(&keys))
    }

    async fn wait(&self, keys: &[&str], timeout: Duration) -> Result<(), StoreError> {
        let owner = self.owners.fetch_add(1, Ordering::Relaxed);
        let (tx, rx) = unbounded_channel();
        let byte_keys: Vec<&[u8]> = keys.iter().map(|k| k.as_bytes()).collect();
        if self.lock().park(&byte_keys, owner, tx).is_none() {
            return Ok(());
        }
        self.parked(owner, rx, timeout, || StoreError::timeout(keys, timeout))
            .await
    }

    async fn compare_set(
        &self,
        key: &str,
        expected: &[u8],
        desired: &[u8],
    ) -> Result<Vec<u8>, StoreError> {
        self.lock()
            .compare_set(key.as_bytes(), expected, Bytes::copy_from_slice(desired))
            .map(|v| v.to_vec())
            .map_err(|e| budget_error(key, e))
    }

    async fn delete_key(&self, key: &str) -> Result<bool, StoreError> {
        Ok(self.lock().delete(key.as_bytes()))
    }

    async fn num_keys(&self) -> Result<i64, StoreError> {
        Ok(self.lock().len() as i64)
    }

    async fn append(&self, key: &str, value: &[u8]) -> Result<(), StoreError> {
        self.lock()
            .append(key.as_bytes(), value)
            .map_err(|e| budget_error(key, e))
    }

    async fn multi_get(&self, keys: &[&str]) -> Result<Vec<Vec<u8>>, StoreError> {
        self.wait(keys, self.timeout).await?;
        let state = self.lock();
        Ok(keys
            .iter()
            .map(|k| {
                state
                    .get(k.as_bytes())
                    .map(|v| v.to_vec())
                    .unwrap_or_default()
            })
            .collect())
    }

    async fn multi_set(&self, keys: &[&str], values: &[&[u8]]) -> Result<(), StoreError> {
        check_multi_set(keys, values)?;
        let mut state = self.lock();
        for (k, v) in keys.iter().zip(values) {
            state
                .set(k.as_bytes(), Bytes::copy_from_slice(v))
                .map_err(|e| budget_error(k, e))?;
        }
        Ok(())
    }

    async fn barrier(
        &self,
        key: &str,
        world_size: i64,
        timeout: Duration,
    ) -> Result<(), StoreError> {
        let owner = self.owners.fetch_add(1, Ordering::Relaxed);
        let (tx, rx) = unbounded_channel();
        let arrival = self
            .lock()
            .barrier(key.as_bytes(), world_size, owner, tx)
            .map_err(|e| add_error(key, e))?;
        if arrival == Arrival::Released {
            return Ok(());
        }
        self.parked(owner, rx, timeout, || {
            StoreError::barrier_timeout(key, world_size, timeout)
        })
        .await
    }

    fn timeout(&self) -> Duration {
        self.timeout
    }
}

/// The error of an `add` or a `barrier` on `key`.
pub(crate) fn add_error(key: &str, e: AddOrBudget) -> StoreError {
    match e {
        AddOrBudget::Add(e) => count_error(key, e),
        AddOrBudget::Budget(e) => budget_error(key, e),
    }
}

/// A write to `key` the table's budget refused (this store's budget has no bounds, but the
/// table is shared with the server).
fn budget_error(key: &str, e: BudgetError) -> StoreError {
    match e {
        BudgetError::ValueTooLarge { len, max } => StoreError::ValueTooLarge {
            key: key.chars().take(64).collect(),
            len,
            max,
        },
        other => StoreError::InvalidArgument {
            reason: format!("write to key {key:?}: {other}"),
        },
    }
}

fn count_error(key: &str, e: AddError) -> StoreError {
    match e {
        AddError::NotAnInteger(v) => StoreError::NotAnInteger {
            key: key.to_owned(),
            value: String::from_utf8_lossy(&v).chars().take(64).collect(),
        },
        AddError::Overflow => StoreError::InvalidArgument {
            reason: format!("add on key {key:?} overflows a 64-bit integer"),
        },
    }
}

pub(crate) fn check_multi_set(keys: &[&str], values: &[&[u8]]) -> Result<(), StoreError> {
    if keys.len() != values.len() {
        return Err(StoreError::InvalidArgument {
            reason: format!(
                "multi_set got {} keys but {} values",
                keys.len(),
                values.len()
            ),
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn get_waits_for_a_set_from_another_task() {
        let store = InMemoryStore::with_timeout(Duration::from_secs(10));
        let getter = {
            let store = store.clone();
            tokio::spawn(async move { store.get("late").await })
        };
        // Let the getter park first; the result is the same either way.
        tokio::task::yield_now().await;
        store.set("late", b"here").await.unwrap();
        assert_eq!(getter.await.unwrap().unwrap(), b"here");
    }

    #[tokio::test(start_paused = true)]
    async fn wait_times_out_naming_the_missing_keys() {
        let store = InMemoryStore::new();
        store.set("a", b"1").await.unwrap();
        let err = store
            .wait(&["a", "b"], Duration::from_millis(50))
            .await
            .unwrap_err();
        assert_eq!(
            err,
            StoreError::Timeout {
                keys: vec!["a".into(), "b".into()],
                timeout: Duration::from_millis(50)
            }
        );
        // The cancelled wait left nothing parked behind.
        assert_eq!(store.lock().parked_by(0), 0);
    }

    #[tokio::test]
    async fn barrier_releases_everyone_at_the_world_size_and_keeps_the_count() {
        let store = InMemoryStore::new();
        let limit = Duration::from_secs(30);
        let early: Vec<_> = (0..2)
            .map(|_| {
                let store = store.clone();
                tokio::spawn(async move { store.barrier("b", 3, limit).await })
            })
            .collect();
        // In whatever order the three arrive, two of them are parked until the last.
        store.barrier("b", 3, limit).await.unwrap();
        for arrival in early {
            arrival.await.unwrap().unwrap();
        }
        assert_eq!(store.get("b").await.unwrap(), b"3");
        assert_eq!(store.num_keys().await.unwrap(), 1);
        // Reused: goes through at once and counts on.
        store.barrier("b", 3, limit).await.unwrap();
        assert_eq!(store.get("b").await.unwrap(), b"4");
    }

    #[tokio::test(start_paused = true)]
    async fn a_barrier_times_out_naming_its_key_and_has_still_counted() {
        let store = InMemoryStore::new();
        let err = store
            .barrier("lonely", 3, Duration::from_millis(300))
            .await
            .unwrap_err();
        assert_eq!(
            err,
            StoreError::BarrierTimeout {
                key: "lonely".into(),
                world_size: 3,
                timeout: Duration::from_millis(300)
            }
        );
        assert!(err
            .to_string()
            .starts_with("barrier timeout after 300ms, key: \"lonely\""));
        assert_eq!(store.get("lonely").await.unwrap(), b"1");
        assert_eq!(store.lock().parked_by(0), 0);
        store.set("text", b"abc").await.unwrap();
        assert!(matches!(
            store.barrier("text", 2, Duration::from_secs(1)).await,
            Err(StoreError::NotAnInteger { .. })
        ));
    }

    #[tokio::test]
    async fn the_command_set() {
        let store = InMemoryStore::new();
        assert!(!store.check(&["k"]).await.unwrap());
        store.set("k", b"v").await.unwrap();
        store.append("k", b"w").await.unwrap();
        assert_eq!(store.get("k").await.unwrap(), b"vw");
        assert_eq!(store.compare_set("k", b"vw", b"z").await.unwrap(), b"z");
        store.multi_set(&["x", "y"], &[b"1", b"2"]).await.unwrap();
        assert_eq!(
            store.multi_get(&["x", "y"]).await.unwrap(),
            vec![b"1".to_vec(), b"2".to_vec()]
        );
        assert_eq!(store.num_keys().await.unwrap(), 3);
        assert!(store.delete_key("x").await.unwrap());
        assert!(!store.delete_key("x").await.unwrap());
        assert!(matches!(
            store.add("k", 1).await,
            Err(StoreError::NotAnInteger { .. })
        ));
        assert!(matches!(
            store.multi_set(&["a"], &[]).await,
            Err(StoreError::InvalidArgument { .. })
        ));
    }
}
