//! Rendezvous: how the ranks of a group find a shared store and each other.
//!
//! - [`rendezvous`]: `env://`, `tcp://host:port?rank=R&world_size=N` and
//!   `file:///path?rank=R&world_size=N`, as `torch.distributed` understands them
//!   ([`init_method`]); [`env_init`]: `env://` for process groups, with the store reused within
//!   one process. [`store_host`]: who serves the store (rank 0, `tensorwire launch`, or
//!   torchrun's agent, which every rank joins as a plain c10d client).
//! - [`DistEnv`]: the environments launchers give their workers (torchrun, Slurm, PyTorchJob,
//!   `tensorwire launch`), [`launcher_env`]; Slurm's compressed host lists, [`hostlist`].
//! - [`advertise_ip`] and [`route_ip`]: the address a worker advertises to its peers
//!   ([`address`]).

pub mod address;
pub mod env_init;
pub mod hostlist;
pub mod init_method;
pub mod launcher_env;

pub use address::{advertise_ip, route_ip, AddressError};
pub use init_method::{
    rendezvous, store_host, Rendezvous, RendezvousError, RendezvousOptions, StoreHost,
    LAUNCHER_STORE_ENV, TORCHELASTIC_AGENT_STORE_ENV,
};
pub use launcher_env::{DistEnv, LauncherEnvError};
