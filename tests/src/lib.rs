//! Shared helpers for tensorwire's cross-crate and multi-process tests.
//!
//! - [`transport_suite`]: the transport conformance suite, generic over the `Transport` port.
//! - [`netns`]: simulated hosts (network namespaces joined by a bridge) for multi-host tests.
//! - [`workload`]: the functions every multi-process RPC worker serves.

pub mod netns;
pub mod transport_suite;
pub mod workload;
