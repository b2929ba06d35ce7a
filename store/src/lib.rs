//! The c10d store of tensorwire.
//!
//! - [`TcpStoreServer`] and [`TcpStoreClient`]: PyTorch c10d `TCPStore`'s wire protocol
//!   ([`protocol`]), so PyTorch's `TCPStore` clients can use our server and our client can use
//!   PyTorch's server. Optional cluster secret ([`handshake`]).
//! - [`FileStore`]: a store in a file shared by processes, in PyTorch `FileStore`'s format.
//! - [`InMemoryStore`]: a store inside one process.
//!
//! All stores implement [`tensorwire_core::ports::store::Store`].

use std::time::Duration;

pub mod backoff;
mod client;
pub mod file;
pub mod handshake;
mod in_memory;
pub mod protocol;
mod server;
mod table;

/// The store server without sockets, for the fuzz targets in `fuzz/`. Not part of the API.
#[doc(hidden)]
pub use server::fuzzing;

pub use client::{ClientConfig, TcpStoreClient};
pub use file::FileStore;
pub use in_memory::InMemoryStore;
pub use server::{ServerConfig, ServerStats, TcpStoreServer};
pub use tensorwire_core::auth::ClusterSecret;
pub use tensorwire_core::ports::store::{Store, StoreError};

/// The default timeout of store operations: 300 s, as PyTorch's `TCPStore`.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(300);
