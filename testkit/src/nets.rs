//! The real transports a hostile-peer table runs over: one [`Net`] per transport,
//! [`transports`] to make every rank's transport of one run, and [`over_every_net!`](crate::over_every_net)
//! to make a test of each `async fn name(net: Net)` over each.

use std::sync::Arc;

use tensorwire_core::auth::ClusterSecret;
use tensorwire_core::ports::transport::Transport;

/// A real transport over loopback.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Net {
    /// TCP with the cluster secret's handshake.
    Tcp,
    /// Shared memory (its handshake over a local socket), with the cluster secret.
    Shm,
    /// QUIC with node certificates under one cluster CA.
    Quic,
}

/// Every rank's transport for one run over `net`: TCP and shm share one cluster secret, QUIC
/// ranks get a node certificate (`w{rank}`) under one cluster CA made for the run.
///
/// # Panics
///
/// If a transport or certificate cannot be made (a test setup failure).
pub fn transports(net: Net) -> impl Fn(usize) -> Arc<dyn Transport> {
    let secret = ClusterSecret::new(b"hostile peer test secret".to_vec()).expect("a secret");
    let ca = tensorwire_transport_quic::certs::ClusterCa::generate().expect("a cluster CA");
    move |rank| -> Arc<dyn Transport> {
        match net {
            Net::Tcp => Arc::new(
                tensorwire_transport_tcp::TcpTransport::new(
                    tensorwire_transport_tcp::TcpConfig::new(secret.clone()),
                )
                .expect("TCP"),
            ),
            Net::Shm => Arc::new(
                tensorwire_transport_shm::ShmTransport::new(
                    tensorwire_transport_shm::ShmConfig::new(secret.clone()),
                )
                .expect("shm"),
            ),
            Net::Quic => {
                let tls = tensorwire_transport_quic::ClusterTls::new(
                    ca.issue_node(&format!("w{rank}"))
                        .expect("a node certificate"),
                    vec![ca.cert_der().clone()],
                );
                Arc::new(
                    tensorwire_transport_quic::QuicTransport::new(
                        tensorwire_transport_quic::QuicConfig::new(tls),
                    )
                    .expect("QUIC"),
                )
            }
        }
    }
}

/// Makes, for each `async fn name(net: Net)` named, a test `tcp::name`, `shm::name` and
/// `quic::name` that runs it over that transport (on a two-thread tokio runtime). The
/// functions are the caller's, named in the module where the macro is used.
#[macro_export]
macro_rules! over_every_net {
    ($($name:ident),* $(,)?) => {
        mod tcp {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $name() {
                    super::$name($crate::nets::Net::Tcp).await;
                }
            )*
        }
        mod shm {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $name() {
                    super::$name($crate::nets::Net::Shm).await;
                }
            )*
        }
        mod quic {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $name() {
                    super::$name($crate::nets::Net::Quic).await;
                }
            )*
        }
    };
}
