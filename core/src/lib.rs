//! The pure core of tensorwire.
//!
//! Everything in this crate is deterministic and free of I/O: no sockets, no clocks, no threads,
//! no async runtime. Adapters (transports, stores, device backends) and the RPC agent depend on
//! it; it depends on nothing of ours. Another runtime can reuse its validation, registries and
//! (later) wire format and schedules on their own.
//!
//! - [`device`]: [`Device`](device::Device) (`cpu`, `cuda:N`) and device maps.
//! - [`name`]: worker names with PyTorch's rule.
//! - [`validate`]: the device-map rules of PyTorch's `_validate_device_maps`.
//! - [`reverse`]: reverse device maps and the device list an agent handles.
//! - [`plan`]: a whole cluster plan checked at once (what `tensorwire validate` runs).
//! - [`registry`]: named registries for RPC backends and process-group factories.
//! - [`wire`]: the frame format: fixed prefix, postcard frame header, raw payloads; bounded decoder.
//! - [`ports`]: the traits adapters implement ([`Transport`](ports::transport::Transport), ...).
//! - [`auth`]: challenge-response authentication on a cluster secret (HMAC-SHA256).

pub mod auth;
pub mod device;
pub mod name;
pub mod plan;
pub mod ports;
pub mod registry;
pub mod reverse;
pub mod validate;
pub mod wire;

#[cfg(test)]
mod proptests;
