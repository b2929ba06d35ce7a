//! A minimal `env://` rendezvous for [`new_group`](crate::new_group): the store helper's full
//! rendezvous (`env://`, `tcp://`, `file://`) had not landed when this was written.
//!
//! Reads `RANK`, `WORLD_SIZE`, `MASTER_ADDR`, `MASTER_PORT` (in that order, failing with
//! PyTorch's texts for a missing or bad one). Rank 0 serves the TCP store on
//! `MASTER_ADDR:MASTER_PORT` (port 0 picks a free one, see [`EnvRendezvous::master_port`]);
//! every rank, rank 0 included, connects to it as a client, with retries up to the timeout.
//! When `TENSORWIRE_SECRET` is set, the store requires it. Within one process, ranks that
//! rendezvous again on the same address reuse the store (and rank 0 its server), as
//! PyTorch's multi-tenant `TCPStore` does.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::{Arc, LazyLock, Mutex, Weak};
use std::time::Duration;

use async_trait::async_trait;
use tensorwire_core::ports::store::{Store, StoreError};

use crate::{ClientConfig, Secret, ServerConfig, TcpStoreClient, TcpStoreServer};

/// The environment variable holding the cluster secret (shared with the TCP transport).
pub const SECRET_ENV: &str = "TENSORWIRE_SECRET";

/// Why an `env://` rendezvous failed. Messages start as PyTorch's do.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum RendezvousError {
    /// A variable is missing.
    #[error("Error initializing torch.distributed using env:// rendezvous: environment variable {0} expected, but not set")]
    Missing(&'static str),
    /// A variable does not parse.
    #[error("Error initializing torch.distributed using env:// rendezvous: environment variable {var} must be {what}, got {value:?}")]
    Invalid {
        /// The variable.
        var: &'static str,
        /// What it must be.
        what: &'static str,
        /// Its value.
        value: String,
    },
    /// The rank is not below the world size.
    #[error("Error initializing torch.distributed using env:// rendezvous: RANK {rank} is out of range for WORLD_SIZE {world_size}")]
    RankOutOfRange {
        /// The rank.
        rank: usize,
        /// The world size.
        world_size: usize,
    },
    /// Rank 0 could not serve the store.
    #[error("rank 0 cannot serve the store on {addr}: {reason}")]
    Serve {
        /// The address.
        addr: String,
        /// The OS error.
        reason: String,
    },
    /// The store could not be reached.
    #[error(transparent)]
    Store(#[from] StoreError),
}

/// The outcome of an `env://` rendezvous.
#[derive(Clone)]
pub struct EnvRendezvous {
    /// The store, shared by all ranks (rank 0 serves it; dropping every clone stops it).
    pub store: Arc<dyn Store>,
    /// This rank.
    pub rank: usize,
    /// The number of ranks.
    pub world_size: usize,
    /// `MASTER_ADDR`.
    pub master_addr: String,
    /// The store's port (the one rank 0 picked when `MASTER_PORT` was 0).
    pub master_port: u16,
}

impl std::fmt::Debug for EnvRendezvous {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EnvRendezvous")
            .field("rank", &self.rank)
            .field("world_size", &self.world_size)
            .field("master_addr", &self.master_addr)
            .field("master_port", &self.master_port)
            .finish_non_exhaustive()
    }
}

fn var(name: &'static str) -> Result<String, RendezvousError> {
    match std::env::var(name) {
        Ok(v) if !v.is_empty() => Ok(v),
        _ => Err(RendezvousError::Missing(name)),
    }
}

fn number<T: std::str::FromStr>(
    name: &'static str,
    what: &'static str,
) -> Result<T, RendezvousError> {
    let value = var(name)?;
    value.trim().parse().map_err(|_| RendezvousError::Invalid {
        var: name,
        what,
        value,
    })
}

/// A store client that also owns the server it talks to (rank 0).
struct HostedStore {
    client: TcpStoreClient,
    _server: Option<TcpStoreServer>,
}

type Tenants = Mutex<HashMap<(String, u16), Weak<HostedStore>>>;

/// Stores this process already holds, by (MASTER_ADDR, port).
static TENANTS: LazyLock<Tenants> = LazyLock::new(|| Mutex::new(HashMap::new()));

/// Rendezvous through `env://`, bounded by `timeout`.
///
/// # Errors
/// [`RendezvousError`] naming the missing or bad variable, or the store failure.
pub async fn env_rendezvous(timeout: Duration) -> Result<EnvRendezvous, RendezvousError> {
    let rank: usize = number("RANK", "a non-negative integer")?;
    let world_size: usize = number("WORLD_SIZE", "a positive integer")?;
    let master_addr = var("MASTER_ADDR")?;
    let port: u16 = number("MASTER_PORT", "a port number")?;
    if world_size == 0 {
        return Err(RendezvousError::Invalid {
            var: "WORLD_SIZE",
            what: "a positive integer",
            value: "0".into(),
        });
    }
    if rank >= world_size {
        return Err(RendezvousError::RankOutOfRange { rank, world_size });
    }
    let secret = std::env::var_os(SECRET_ENV).and_then(|s| Secret::new(s.into_encoded_bytes()));

    let existing = TENANTS
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .get(&(master_addr.clone(), port))
        .and_then(Weak::upgrade);
    let (hosted, master_port) = match existing {
        Some(h) => (h, port),
        None => {
            let server = if rank == 0 {
                let config = ServerConfig {
                    secret: secret.clone(),
                    ..ServerConfig::default()
                };
                let server = TcpStoreServer::bind((master_addr.as_str(), port), config)
                    .await
                    .map_err(|e| RendezvousError::Serve {
                        addr: format!("{master_addr}:{port}"),
                        reason: e.to_string(),
                    })?;
                Some(server)
            } else {
                None
            };
            let actual_port = server.as_ref().map_or(port, |s| s.local_addr().port());
            let addr = match server.as_ref().map(TcpStoreServer::local_addr) {
                Some(SocketAddr::V6(a)) => format!("[{}]:{actual_port}", a.ip()),
                Some(SocketAddr::V4(a)) => format!("{}:{actual_port}", a.ip()),
                None => format!("{master_addr}:{port}"),
            };
            let client = TcpStoreClient::connect(
                &addr,
                ClientConfig {
                    timeout,
                    connect_timeout: timeout,
                    secret,
                    ..ClientConfig::default()
                },
            )
            .await?;
            let hosted = Arc::new(HostedStore {
                client,
                _server: server,
            });
            let mut tenants = TENANTS.lock().unwrap_or_else(|e| e.into_inner());
            tenants.retain(|_, w| w.strong_count() > 0);
            tenants.insert((master_addr.clone(), port), Arc::downgrade(&hosted));
            if actual_port != port {
                tenants.insert((master_addr.clone(), actual_port), Arc::downgrade(&hosted));
            }
            (hosted, actual_port)
        }
    };
    Ok(EnvRendezvous {
        store: hosted,
        rank,
        world_size,
        master_addr,
        master_port,
    })
}

#[async_trait]
impl Store for HostedStore {
    async fn set(&self, key: &str, value: &[u8]) -> Result<(), StoreError> {
        self.client.set(key, value).await
    }
    async fn get(&self, key: &str) -> Result<Vec<u8>, StoreError> {
        self.client.get(key).await
    }
    async fn add(&self, key: &str, delta: i64) -> Result<i64, StoreError> {
        self.client.add(key, delta).await
    }
    async fn check(&self, keys: &[&str]) -> Result<bool, StoreError> {
        self.client.check(keys).await
    }
    async fn wait(&self, keys: &[&str], timeout: Duration) -> Result<(), StoreError> {
        self.client.wait(keys, timeout).await
    }
    async fn compare_set(
        &self,
        key: &str,
        expected: &[u8],
        desired: &[u8],
    ) -> Result<Vec<u8>, StoreError> {
        self.client.compare_set(key, expected, desired).await
    }
    async fn delete_key(&self, key: &str) -> Result<bool, StoreError> {
        self.client.delete_key(key).await
    }
    async fn num_keys(&self) -> Result<i64, StoreError> {
        self.client.num_keys().await
    }
    async fn append(&self, key: &str, value: &[u8]) -> Result<(), StoreError> {
        self.client.append(key, value).await
    }
    async fn multi_get(&self, keys: &[&str]) -> Result<Vec<Vec<u8>>, StoreError> {
        self.client.multi_get(keys).await
    }
    async fn multi_set(&self, keys: &[&str], values: &[&[u8]]) -> Result<(), StoreError> {
        self.client.multi_set(keys, values).await
    }
    fn timeout(&self) -> Duration {
        self.client.timeout()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn errors_read_like_pytorch() {
        assert_eq!(
            RendezvousError::Missing("MASTER_ADDR").to_string(),
            "Error initializing torch.distributed using env:// rendezvous: environment \
             variable MASTER_ADDR expected, but not set"
        );
    }
}
