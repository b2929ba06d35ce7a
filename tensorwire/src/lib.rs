//! tensorwire: distributed RPC for Rust.
//!
//! This crate is what users add. It re-exports the pure core ([`core`]), the RPC agent
//! ([`rpc`]), process groups ([`process_group`]), the c10d store ([`store`]), rendezvous
//! ([`rendezvous`]), and the adapters picked by Cargo features (`tcp`, the default; `quic`;
//! `shm`; `cuda`). Start with the [`guide`].

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
/// Process groups and collectives; also re-exports the stores and rendezvous under their old
/// paths.
pub use tensorwire_process_group as process_group;
/// Rendezvous: `env://`, `tcp://`, `file://`, launcher environments, addresses.
pub use tensorwire_rendezvous as rendezvous;
/// The c10d store: `TCPStore`-compatible server and client, file store, in-memory store.
pub use tensorwire_store as store;

/// The RPC agent: `init_rpc`, `rpc_sync`/`rpc_async`/`remote`, `RRef`, shutdown.
///
/// Distributed autograd and the distributed optimizer, which lived in this crate until they
/// got their own ([`dist_autograd`]), are re-exported here too, so their
/// old paths (`tensorwire::rpc::DistAutograd`, ...) keep working. So does
/// `tensorwire::rpc::faults`, now `tensorwire_testkit::faults`, with the `faults` feature:
///
/// ```
/// # #[cfg(feature = "faults")] {
/// use tensorwire::rpc::faults::{Fault, FaultAction, FaultyBackend, MessageKind};
///
/// let backend = FaultyBackend::new().with_fault(1, Fault::new(MessageKind::Reply, FaultAction::Drop, 1));
/// assert_eq!(backend.injected(1), 0);
/// # }
/// ```
pub mod rpc {
    pub use tensorwire_dist_autograd::{
        Adagrad, Adam, AdamW, AutogradCall, AutogradContext, BuiltinState, DistAutograd,
        DistAutogradError, DistributedOptimizer, LocalOptimizer, Optimizer, Parameter, RmsProp,
        Sgd, TensorList, TrackedValue,
    };
    pub use tensorwire_rpc::*;
    /// Fault injection for tests (PyTorch's faulty agent), under its old path: it lives in
    /// `tensorwire_testkit::faults` now. Feature `faults`.
    #[cfg(feature = "faults")]
    pub use tensorwire_testkit::faults;
    /// The in-memory transport, under its old path (now `tensorwire::transport_memory`).
    pub use tensorwire_transport_memory as memory;
}
/// Distributed autograd (PyTorch's FAST mode) and the distributed optimizer, on the RPC
/// agent; the local engine is a port (`autograd_candle` is its adapter).
pub use tensorwire_dist_autograd as dist_autograd;
/// The TCP transport (Cargo feature `tcp`, on by default).
#[cfg(feature = "tcp")]
pub use tensorwire_transport_tcp as transport_tcp;

/// The in-memory transport: whole clusters in one process, in virtual time (tests,
/// simulations).
pub use tensorwire_transport_memory as transport_memory;

/// The QUIC transport (Cargo feature `quic`).
#[cfg(feature = "quic")]
pub use tensorwire_transport_quic as transport_quic;

/// The shared-memory transport for peers on one host (Cargo feature `shm`, Linux).
#[cfg(feature = "shm")]
pub use tensorwire_transport_shm as transport_shm;
