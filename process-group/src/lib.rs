//! Stores and rendezvous for tensorwire process groups.
//!
//! - [`TcpStoreServer`] and [`TcpStoreClient`]: PyTorch c10d `TCPStore`'s wire protocol
//!   ([`wire`]), so PyTorch's `TCPStore` clients can use our server and our client can use
//!   PyTorch's server. Optional cluster secret ([`auth`]).
//! - [`FileStore`]: a store in a file shared by processes, in PyTorch `FileStore`'s format.
//! - [`InMemoryStore`]: a store inside one process.
//! - [`rendezvous`](rendezvous::rendezvous): `env://`, `tcp://host:port?rank=R&world_size=N`
//!   and `file:///path?rank=R&world_size=N`, as `torch.distributed` understands them.
//!
//! All stores implement [`tensorwire_core::ports::store::Store`].

use std::time::Duration;

pub mod auth;
pub mod backoff;
mod client;
pub mod file;
mod memory;
pub mod rendezvous;
mod server;
mod state;
pub mod wire;

pub use auth::Secret;
pub use client::{ClientConfig, TcpStoreClient};
pub use file::FileStore;

pub use memory::InMemoryStore;
pub use rendezvous::{rendezvous, Rendezvous, RendezvousError, RendezvousOptions};

pub use server::{ServerConfig, TcpStoreServer};
pub use tensorwire_core::ports::store::{Store, StoreError};

/// The default timeout of store operations: 300 s, as PyTorch's `TCPStore`.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(300);
