//! `env://` for process groups' `new_group`: the store helper's
//! [`rendezvous`](crate::rendezvous()), plus reuse of the store within one process.
//!
//! Rank 0 serves the TCP store on `MASTER_ADDR:MASTER_PORT` (port 0 picks a free one, see
//! [`EnvRendezvous::master_port`]); every rank connects as a client with retries up to the
//! timeout. When `TENSORWIRE_SECRET` is set, the store requires it. Under a launcher that
//! serves the store (`tensorwire launch`, torchrun), every rank connects to the launcher's
//! ([`store_host`](crate::store_host)). The join counter is not
//! waited on: setting up the mesh waits for every rank anyway, and names the missing ones.
//!
//! Within one process, a second rendezvous on the same `MASTER_ADDR:MASTER_PORT` reuses the
//! first one's store (and rank 0 its server) while any group still holds it, as PyTorch's
//! multi-tenant `TCPStore` does; so a process can create several groups in a row.

use std::collections::HashMap;
use std::sync::{Arc, LazyLock, Mutex, Weak};
use std::time::Duration;

use async_trait::async_trait;
use tensorwire_core::ports::store::{Store, StoreError};

use crate::init_method::{rendezvous, Rendezvous, RendezvousError, RendezvousOptions};
use crate::launcher_env::{launcher_var_from_process, MASTER_ADDR, MASTER_PORT};
use tensorwire_store::ClusterSecret;

/// The environment variable holding the cluster secret (shared with the TCP transport).
pub const SECRET_ENV: &str = "TENSORWIRE_SECRET";

/// The outcome of an `env://` rendezvous.
#[derive(Clone)]
pub struct EnvRendezvous {
    /// The store, shared by all ranks (on rank 0 it keeps the server alive; dropping every
    /// clone stops it).
    pub store: Arc<dyn Store>,
    /// This rank.
    pub rank: usize,
    /// The number of ranks.
    pub world_size: usize,
    /// The store's port (the one rank 0 picked when `MASTER_PORT` was 0).
    pub master_port: u16,
}

impl std::fmt::Debug for EnvRendezvous {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EnvRendezvous")
            .field("rank", &self.rank)
            .field("world_size", &self.world_size)
            .field("master_port", &self.master_port)
            .finish_non_exhaustive()
    }
}

/// A rendezvous kept alive (with rank 0's server) by the stores handed out.
struct Hosted {
    rendezvous: Rendezvous,
    master_port: u16,
}

type Tenants = Mutex<HashMap<(String, String), Weak<Hosted>>>;

/// Rendezvous this process holds, by (`MASTER_ADDR`, `MASTER_PORT`) as given and as bound.
static TENANTS: LazyLock<Tenants> = LazyLock::new(|| Mutex::new(HashMap::new()));

/// Rendezvous through `env://`, bounded by `timeout`.
///
/// # Errors
/// [`RendezvousError`]: PyTorch's texts for a missing or bad variable, or the store failure.
pub async fn env_rendezvous(timeout: Duration) -> Result<EnvRendezvous, RendezvousError> {
    // As the rendezvous reads them: explicit variables, else Slurm's.
    let var = |name| {
        launcher_var_from_process(name)
            .ok()
            .flatten()
            .unwrap_or_default()
    };
    let key = (var(MASTER_ADDR), var(MASTER_PORT));
    let existing = TENANTS
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .get(&key)
        .and_then(Weak::upgrade);
    let hosted = match existing {
        Some(h) => h,
        None => {
            let options = RendezvousOptions {
                timeout,
                secret: std::env::var_os(SECRET_ENV)
                    .and_then(|s| ClusterSecret::new(s.into_encoded_bytes()).ok()),
                wait_for_all: false,
                ..RendezvousOptions::default()
            };
            let rendezvous = rendezvous("env://", options).await?;
            let master_port = rendezvous
                .server_addr()
                .map(|a| a.port())
                .unwrap_or_else(|| key.1.trim().parse().unwrap_or(0));
            let hosted = Arc::new(Hosted {
                rendezvous,
                master_port,
            });
            let mut tenants = TENANTS.lock().unwrap_or_else(|e| e.into_inner());
            tenants.retain(|_, w| w.strong_count() > 0);
            tenants.insert(key.clone(), Arc::downgrade(&hosted));
            tenants.insert(
                (key.0.clone(), master_port.to_string()),
                Arc::downgrade(&hosted),
            );
            hosted
        }
    };
    Ok(EnvRendezvous {
        rank: hosted.rendezvous.rank,
        world_size: hosted.rendezvous.world_size,
        master_port: hosted.master_port,
        store: hosted,
    })
}

#[async_trait]
impl Store for Hosted {
    async fn set(&self, key: &str, value: &[u8]) -> Result<(), StoreError> {
        self.rendezvous.store.set(key, value).await
    }
    async fn get(&self, key: &str) -> Result<Vec<u8>, StoreError> {
        self.rendezvous.store.get(key).await
    }
    async fn add(&self, key: &str, delta: i64) -> Result<i64, StoreError> {
        self.rendezvous.store.add(key, delta).await
    }
    async fn check(&self, keys: &[&str]) -> Result<bool, StoreError> {
        self.rendezvous.store.check(keys).await
    }
    async fn wait(&self, keys: &[&str], timeout: Duration) -> Result<(), StoreError> {
        self.rendezvous.store.wait(keys, timeout).await
    }
    async fn compare_set(
        &self,
        key: &str,
        expected: &[u8],
        desired: &[u8],
    ) -> Result<Vec<u8>, StoreError> {
        self.rendezvous
            .store
            .compare_set(key, expected, desired)
            .await
    }
    async fn delete_key(&self, key: &str) -> Result<bool, StoreError> {
        self.rendezvous.store.delete_key(key).await
    }
    async fn num_keys(&self) -> Result<i64, StoreError> {
        self.rendezvous.store.num_keys().await
    }
    async fn append(&self, key: &str, value: &[u8]) -> Result<(), StoreError> {
        self.rendezvous.store.append(key, value).await
    }
    async fn multi_get(&self, keys: &[&str]) -> Result<Vec<Vec<u8>>, StoreError> {
        self.rendezvous.store.multi_get(keys).await
    }
    async fn multi_set(&self, keys: &[&str], values: &[&[u8]]) -> Result<(), StoreError> {
        self.rendezvous.store.multi_set(keys, values).await
    }
    async fn barrier(
        &self,
        key: &str,
        world_size: i64,
        timeout: Duration,
    ) -> Result<(), StoreError> {
        self.rendezvous
            .store
            .barrier(key, world_size, timeout)
            .await
    }
    fn timeout(&self) -> Duration {
        self.rendezvous.store.timeout()
    }
}
