//! Process groups of tensorwire: groups, collectives and work handles over the mesh, and
//! `torch.distributed._dist2`'s backend registry.
//!
//! - [`Group`]: the built-in process group. Its collectives run the schedules of
//!   [`tensorwire_core::collective`] over a mesh of [`Transport`](tensorwire_core::ports::transport::Transport)
//!   connections; [`CollectivesExt`] adds typed `all_reduce`, `all_gather_object` and
//!   `broadcast_object` to any [`ProcessGroup`](tensorwire_core::ports::process_group::ProcessGroup).
//! - `torch.distributed._dist2`'s API: [`register_backend`], [`new_group`] (`env://`,
//!   [`env_init`]), [`current_process_group`], [`with_process_group`]; the built-in backend
//!   `tensorwire` (alias `gloo`) is [`TensorwireFactory`]; with the feature `nccl`, the `nccl`
//!   backend of `tensorwire-devices-cuda` is registered too.
//!
//! The stores ([`tensorwire_store`]), rendezvous ([`tensorwire_rendezvous`]), the mesh
//! ([`tensorwire_mesh`]) and the `nccl` backend lived here; they are re-exported under their
//! old paths, so code written against them keeps compiling.

mod backend;
mod executor;
mod group;
mod p2p;
pub mod work;

#[cfg(feature = "tcp")]
pub use backend::TensorwireFactory;

pub use backend::{
    backend_registered, current_process_group, new_group, register_backend, with_process_group,
    with_process_group_sync, BackendOptions, DynFactory, NewGroupError, TENSORWIRE_BACKEND,
};
pub use group::{
    arena_bytes_from_env, CollectivePath, CollectivesExt, Element, Group, GroupOptions,
    ARENA_BYTES_ENV, COLLECTIVES_ENV, DEFAULT_COLLECTIVE_TIMEOUT, INLINE_GATHER_BYTES,
    MAX_BLOCK_BYTES,
};
pub use tensorwire_core::auth::ClusterSecret;
/// The collectives every group offers (byte and tensor forms), as extension traits of the
/// `ProcessGroup` port: import them to call `barrier`, `all_reduce_tensor`, ... on a group.
pub use tensorwire_core::ports::process_group::{Collectives, TensorCollectives};
pub use work::Work;

pub use tensorwire_core::ports::store::{Store, StoreError};

// The stores moved to `tensorwire-store`; their old paths here stay for existing code.
/// The store's cluster-secret step: moved to [`tensorwire_store::handshake`].
pub use tensorwire_store::handshake as auth;
/// The c10d store's wire format: moved to [`tensorwire_store::protocol`].
pub use tensorwire_store::protocol as wire;
pub use tensorwire_store::{
    backoff, file, ClientConfig, FileStore, InMemoryStore, ServerConfig, TcpStoreClient,
    TcpStoreServer, DEFAULT_TIMEOUT,
};

// Rendezvous moved to `tensorwire-rendezvous`; its old paths here stay for existing code.
/// `env://`, `tcp://` and `file://`: moved to [`tensorwire_rendezvous::init_method`].
pub use tensorwire_rendezvous::init_method as rendezvous;
pub use tensorwire_rendezvous::{
    address, advertise_ip, env_init, hostlist, launcher_env, rendezvous, route_ip, AddressError,
    DistEnv, LauncherEnvError, Rendezvous, RendezvousError, RendezvousOptions,
};

// The mesh moved to `tensorwire-mesh`; its old paths here stay for existing code.
pub use tensorwire_mesh::{link, mesh, FrameSink, PeerEnd};

/// The `nccl` backend (feature `nccl`): moved to `tensorwire_devices_cuda::nccl_group`.
#[cfg(feature = "nccl")]
pub use tensorwire_devices_cuda::nccl_group as nccl;
/// The setup exchange of the `nccl` backend: moved to `tensorwire_devices_cuda::nccl_group`.
#[cfg(feature = "nccl")]
pub use tensorwire_devices_cuda::nccl_group::setup;
