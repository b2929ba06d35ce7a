//! tensorwire's QUIC transport: quinn + rustls (ring provider, chosen explicitly), mutual TLS
//! under one cluster CA.
//!
//! - [`certs`]: the cluster CA and node certificates, from PEM files or generated (rcgen).
//! - [`tls`]: rustls configurations requiring and verifying certificates on both sides.
//! - [`socket`]: the UDP socket with raised kernel buffers.
//! - [`config`]: transport settings tuned for bulk tensors.
//! - [`QuicTransport`]: the [`Transport`](tensorwire_core::ports::transport::Transport) port,
//!   one QUIC stream per frame.

pub mod certs;
pub mod config;
mod ended;
mod error;
#[doc(hidden)]
pub mod fuzzing;
mod order;
pub mod socket;
pub mod tls;
mod transport;

pub use config::QuicConfig;
pub use error::QuicError;
pub use tls::ClusterTls;
pub use transport::{QuicTransport, ADMIT};
