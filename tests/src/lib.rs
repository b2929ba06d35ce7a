//! Shared helpers for tensorwire's cross-crate and multi-process tests.
//!
//! - [`transport_suite`]: the transport conformance suite, generic over the `Transport` port.

pub mod transport_suite;
