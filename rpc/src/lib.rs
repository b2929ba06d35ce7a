//! tensorwire's RPC agent: PyTorch's `torch.distributed.rpc`, in Rust.
//!
//! Workers with names and ranks call each other's registered functions ([`Agent::rpc_sync`],
//! [`Agent::rpc_async`]), create values on other workers and hold references to them
//! ([`Agent::remote`], [`RRef`]), and shut down together ([`Agent::shutdown`]). Only functions
//! registered in [`Functions`] can run remotely ([`Function`] descriptors make calls typed,
//! see [`typed`]); every connection is authenticated with the
//! cluster secret before any message is read.
//!
//! ```no_run
//! use tensorwire_rpc::{init_rpc, Function, Functions, RpcOptions};
//!
//! const ADD: Function<(i64, i64), i64> = Function::new("add");
//!
//! # async fn run() -> Result<(), tensorwire_rpc::RpcError> {
//! let functions = Functions::new();
//! functions.serve(&ADD, |(a, b)| async move { Ok::<_, String>(a + b) })?;
//! // RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT and TENSORWIRE_SECRET come from the
//! // environment (`tensorwire launch` sets them).
//! let rank: usize = std::env::var("RANK").unwrap().parse().unwrap();
//! let agent = init_rpc(&format!("worker{rank}"), rank, Some(2), RpcOptions::new().with_functions(functions)).await?;
//! let sum = agent.call(&ADD, "worker1", &(2, 3)).await?;
//! assert_eq!(sum, 5);
//! agent.shutdown(tensorwire_rpc::Shutdown::graceful(std::time::Duration::from_secs(30))).await?;
//! # Ok(()) }
//! ```
//!
//! Backends: `TCP` with the feature `tcp` (on by default), `QUIC` with the feature `quic`; [`register_backend`] adds
//! others (PyTorch's backend registry).
//!
//! Groups are static (`world_size = Some(n)`) or dynamic (`None`: workers join and leave while
//! the group runs; rank 0 hosts the store and stays).

// docs.rs (`--cfg docsrs`, nightly) marks each item with the Cargo feature it needs.
#![cfg_attr(docsrs, feature(doc_cfg))]

mod agent;
mod backend;
mod context;
mod debug;
mod driver;
mod error;
mod functions;
mod future;
#[doc(hidden)]
pub mod fuzzing;
mod gather;
mod init;
mod init_rpc;
mod ipc;
mod links;
mod membership;
pub mod metrics;
mod options;
pub mod peer_events;
mod queue;
mod rref;
pub mod runtime;
mod serve;
mod shutdown;
mod state;
mod tensors;
pub mod typed;

pub use agent::{Agent, AgentDebugInfo, PeerConnection, RpcFuture, WorkerInfo, WorkerRef};
#[cfg(feature = "tcp")]
pub use backend::TcpBackend;
pub use backend::{
    backend_registered, construct_rpc_backend_options, register_backend, registered_backends,
    DynRpcBackend, TCP_BACKEND, TLS_DIR_ENV,
};
#[cfg(feature = "quic")]
pub use backend::{QuicBackend, QUIC_BACKEND};
pub use context::CallContext;
pub use debug::GatherDebugInfo;
pub use error::{InitError, IntroductionError, RRefError, RpcError, WaitingFor};
pub use init::start_agent;
pub use init_rpc::init_rpc;
pub use metrics::{PeerMetrics, RpcMetrics};
pub use options::{RpcOptions, Shutdown, DEFAULT_RPC_TIMEOUT, IMMEDIATE_CLOSE_TIMEOUT};
pub use peer_events::{PeerEvent, PeerEvents};
pub use rref::RRef;
pub use runtime::{Runtime, TokioRuntime};
pub use serve::Reply;
pub use state::Functions;
pub use tensors::{MalformedTensor, TensorTransferError};
pub use tensorwire_core::protocol::{
    CallError, DebugInfo, ForkInfo, OwnedInfo, RemoteError, RemoteErrorKind,
};
pub use tensorwire_rendezvous::Rendezvous;
pub use typed::{Call, Function, Method, MethodCall, Signature};

#[cfg(test)]
mod tests;
