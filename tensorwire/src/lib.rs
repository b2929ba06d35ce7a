//! tensorwire: distributed RPC for Rust.
//!
//! This crate is what users add. It re-exports the pure core ([`core`]), the RPC agent
//! ([`rpc`]), process groups and stores ([`process_group`]), and the adapters picked by Cargo
//! features (`tcp`, the default; `quic`; `shm`; `cuda`). Start with the [`guide`].

// docs.rs (`--cfg docsrs`, nightly) marks each item with the Cargo feature it needs.
#![cfg_attr(docsrs, feature(doc_cfg))]

pub use tensorwire_core as core;

pub mod guide;

/// Distributed autograd's local engine on candle (feature `autograd-candle`).
#[cfg(feature = "autograd-candle")]
pub use tensorwire_autograd_candle as autograd_candle;
/// The CUDA device backend (feature `cuda`).
#[cfg(feature = "cuda")]
pub use tensorwire_devices_cuda as devices_cuda;
/// Stores (c10d `TCPStore`-compatible TCP, file, in-memory) and rendezvous.
pub use tensorwire_process_group as process_group;

/// The RPC agent: `init_rpc`, `rpc_sync`/`rpc_async`/`remote`, `RRef`, shutdown.
pub use tensorwire_rpc as rpc;
/// The TCP transport (Cargo feature `tcp`, on by default).
#[cfg(feature = "tcp")]
pub use tensorwire_transport_tcp as transport_tcp;

/// The QUIC transport (Cargo feature `quic`).
#[cfg(feature = "quic")]
pub use tensorwire_transport_quic as transport_quic;

/// The shared-memory transport for peers on one host (Cargo feature `shm`, Linux).
#[cfg(feature = "shm")]
pub use tensorwire_transport_shm as transport_shm;
