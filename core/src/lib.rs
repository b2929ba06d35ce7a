//! The pure core of tensorwire.
//!
//! Everything in this crate is deterministic and free of I/O: no sockets, no clocks, no threads,
//! no async runtime. Adapters (transports, stores, device backends) and the RPC agent depend on
//! it; it depends on nothing of ours. Another runtime can reuse its validation, registries, wire
//! format, protocol state machine and collective schedules on their own.
//!
//! - [`device`]: [`Device`](device::Device) (`cpu`, `cuda:N`) and device maps.
//! - [`name`]: worker names with PyTorch's rule.
//! - [`validate`]: the device-map rules of PyTorch's `_validate_device_maps`.
//! - [`reverse`]: reverse device maps and the device list an agent handles.
//! - [`plan`]: a whole cluster plan checked at once (what `tensorwire validate` runs).
//! - [`registry`]: named registries for RPC backends and process-group factories.
//! - [`tensor`]: a minimal tensor value (dtype, shape, device, storage).
//! - [`placement`]: device maps applied to a message's tensors.
//! - [`codec`]: the postcard formats of core's messages and records, read in one place
//!   ([`Undecodable`](codec::Undecodable) names the format that did not parse).
//! - [`wire`]: the frame format: fixed prefix, postcard frame header, raw payloads; bounded decoder.
//! - [`hashing`]: the maps on the per-message path (std's, with a faster seeded hasher).
//! - [`budget`]: one memory budget per peer, which every byte a peer can make a worker hold
//!   draws from.
//! - [`identity`]: what a peer's credentials prove (membership, or a certified rank), and
//!   whether they let it claim a rank.
//! - [`auth`]: challenge-response authentication on a cluster secret (HMAC-SHA256).
//! - [`protocol`]: the RPC protocol state machine: calls, timeouts, remote references.
//! - [`collective`]: sans-IO schedules for barrier, broadcast, all_gather and all_reduce.
//! - [`autograd`]: distributed autograd (PyTorch's FAST mode) as a state machine, and its simulation.
//! - [`ports`]: the traits adapters implement (transport, store, device backend, process group).
//! - `sim` (tests and the `sim` feature): the simulation kit (seeded RNG, faulty links, virtual
//!   clock) every simulation is built from; `protocol_sim`, a whole-cluster simulation on it.
//! - [`devices_sim`]: the simulated device backend (host memory posing as CUDA devices).
//! - [`ipc`]: same-host CUDA IPC: the path each device tensor takes to a peer, and the
//!   lifetime of shared buffers.
//! - [`spin`]: how a side waits for its peer's answer (poll, yield or sleep), learnt from
//!   earlier waits; shared by the shared-memory and TCP transports.

pub mod auth;
pub mod autograd;
pub mod budget;
pub mod capability;
pub mod codec;
pub mod collective;
pub mod device;
pub mod devices_sim;
pub mod env;
pub mod hashing;
pub mod identity;
pub mod ipc;
pub mod name;
pub mod placement;
pub mod plan;
pub mod ports;
pub mod protocol;
// The simulations: compiled for tests, and for fuzz targets and other crates' tests through the
// `sim` feature; not part of the stable API.
#[cfg(any(test, feature = "sim"))]
pub mod protocol_sim;
pub mod registry;
pub mod reverse;
#[cfg(any(test, feature = "sim"))]
pub mod sim;
pub mod spin;
pub mod tensor;
pub mod validate;
pub mod wire;

#[cfg(test)]
mod proptests;
