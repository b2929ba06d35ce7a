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
//!
//! - [`Group`]: the built-in process group. Its collectives run the schedules of
//!   [`tensorwire_core::collective`] over a mesh of [`Transport`](tensorwire_core::ports::transport::Transport)
//!   connections; [`CollectivesExt`] adds typed `all_reduce`, `all_gather_object` and
//!   `broadcast_object` to any [`ProcessGroup`](tensorwire_core::ports::process_group::ProcessGroup).
//! - `torch.distributed._dist2`'s API: [`register_backend`], [`new_group`] (`env://`,
//!   [`env_init`]), [`current_process_group`], [`with_process_group`]; the built-in backend
//!   `tensorwire` (alias `gloo`) is [`TensorwireFactory`].

use std::time::Duration;

pub mod address;
pub mod auth;
mod backend;
pub mod backoff;
mod client;
pub mod env_init;
mod executor;
pub mod file;
mod group;
pub mod hostlist;
pub mod launcher_env;
pub mod link;
mod memory;
pub mod mesh;
#[cfg(feature = "nccl")]
pub mod nccl;
mod p2p;
pub mod rendezvous;
mod server;
pub mod setup;
mod state;
pub mod wire;
pub mod work;

#[cfg(feature = "tcp")]
pub use backend::TensorwireFactory;
/// The store server without sockets, for the fuzz targets in `fuzz/`. Not part of the API.
#[doc(hidden)]
pub use server::fuzzing;

pub use backend::{
    backend_registered, current_process_group, new_group, register_backend, with_process_group,
    with_process_group_sync, BackendOptions, DynFactory, NewGroupError, TENSORWIRE_BACKEND,
};
pub use client::{ClientConfig, TcpStoreClient};
pub use file::FileStore;
pub use group::{
    CollectivesExt, Element, Group, GroupOptions, DEFAULT_COLLECTIVE_TIMEOUT, INLINE_GATHER_BYTES,
    MAX_BLOCK_BYTES,
};
pub use mesh::FrameSink;
pub use tensorwire_core::auth::ClusterSecret;
pub use work::Work;

pub use address::{advertise_ip, route_ip, AddressError};
pub use launcher_env::{DistEnv, LauncherEnvError};
pub use memory::InMemoryStore;
pub use rendezvous::{rendezvous, Rendezvous, RendezvousError, RendezvousOptions};

pub use server::{ServerConfig, TcpStoreServer};
pub use tensorwire_core::ports::store::{Store, StoreError};

/// The default timeout of store operations: 300 s, as PyTorch's `TCPStore`.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(300);
