//! tensorwire: distributed RPC for Rust.
//!
//! This crate is what users add. It re-exports the pure core ([`core`]) and, as they land, the
//! adapters picked by Cargo features.

pub use tensorwire_core as core;

/// Stores (c10d `TCPStore`-compatible TCP, file, in-memory) and rendezvous.
pub use tensorwire_process_group as process_group;

/// The TCP transport (Cargo feature `tcp`, on by default).
#[cfg(feature = "tcp")]
pub use tensorwire_transport_tcp as transport_tcp;

/// The QUIC transport (Cargo feature `quic`).
#[cfg(feature = "quic")]
pub use tensorwire_transport_quic as transport_quic;
