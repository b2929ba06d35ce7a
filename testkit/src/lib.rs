//! Test helpers for tensorwire, shared by the crates' tests and published for users' tests (as
//! tower-test is for tower): a dev-dependency, except that the facade re-exports [`faults`]
//! under its old path with its `faults` feature.
//!
//! - [`MemoryCluster`]: agents of one group over the in-memory network and an in-memory store,
//!   for tests in virtual time (tokio's paused clock), each host with its kill switch and,
//!   optionally, faults per rank ([`faults`]: PyTorch's faulty agent).
//! - [`TcpCluster`]: agents over real loopback TCP with a cluster secret, through `init_rpc`,
//!   meeting through a file store in a temporary folder: no port is picked in advance (every
//!   agent listens on port 0 and publishes the port it got), so nothing can take it first.
//! - [`wait_until`] and [`wait_for`]: wait for a condition, by its deadline.
//! - [`RecordingDevices`]: a device backend that records where it copies tensors to.
//! - [`CapturedLogs`]: a log writer whose text a test reads back.
//! - [`hostile`]: a hostile peer, a worker that joins a group for real and then sends, with the
//!   agent's own encoding, messages it has no right to send.
//! - [`nets`]: the real transports (TCP, shm, QUIC) a hostile-peer table runs over.
//! - [`faults`]: PyTorch's faulty agent, as a transport wrapper and an RPC backend.
//!
//! ```
//! use std::time::Duration;
//! use tensorwire_testkit::{MemoryCluster, wait_until};
//!
//! # tokio::runtime::Builder::new_current_thread().enable_all().start_paused(true).build().unwrap().block_on(async {
//! let cluster = MemoryCluster::new();
//! let agents = cluster.group(2, |_, _| {}).await.unwrap();
//! assert_eq!(agents[1].worker_info().name, "w1");
//! wait_until("both see each other", Duration::from_secs(10), || {
//!     agents.iter().all(|a| a.worker_infos().len() == 2)
//! })
//! .await;
//! # for a in agents { a.shutdown(tensorwire_rpc::Shutdown::Immediate).await.unwrap(); }
//! # });
//! ```

mod cluster;
mod devices;
pub mod faults;
pub mod hostile;
mod logs;
pub mod nets;
mod wait;

pub use cluster::{base_options, MemoryCluster, StartError, TcpCluster};
pub use devices::RecordingDevices;
pub use logs::CapturedLogs;
pub use wait::{wait_for, wait_until};

/// The in-memory network (hosts with kill switches), from `tensorwire_rpc`.
pub use tensorwire_transport_memory as memory;
