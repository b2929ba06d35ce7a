//! The transport conformance suite, run for the QUIC adapter, plus QUIC-only refusals.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use async_trait::async_trait;
use tensorwire_core::ports::transport::{Transport, TransportError};
use tensorwire_tests::transport_suite::{Harness, RawChannel};
use tensorwire_transport_quic::certs::ClusterCa;
use tensorwire_transport_quic::{tls::ALPN, ClusterTls, QuicConfig, QuicTransport, ADMIT};

/// A stream tag for a frame (0) with no ordering dependencies (`below` 0, no extras): what the
/// adapter writes in front of every frame.
const FRAME_HEAD: [u8; 10] = [0; 10];

struct Quic {
    ca: ClusterCa,
}

impl Quic {
    fn new() -> Self {
        Self {
            ca: ClusterCa::generate().expect("cluster CA"),
        }
    }

    fn tls(&self, name: &str) -> ClusterTls {
        ClusterTls::new(
            self.ca.issue_node(name).expect("node certificate"),
            vec![self.ca.cert_der().clone()],
        )
    }
}

fn transport_with(tls: ClusterTls) -> Arc<dyn Transport> {
    let mut config = QuicConfig::new(tls);
    config.connect_timeout = Duration::from_secs(10);
    Arc::new(QuicTransport::new(config).expect("QUIC config"))
}

fn loopback() -> SocketAddr {
    SocketAddr::from(([127, 0, 0, 1], 0))
}

/// A raw QUIC client: certificate `tls`, optionally no client certificate at all.
fn raw_endpoint(client: quinn::ClientConfig) -> Result<quinn::Endpoint> {
    let mut endpoint = quinn::Endpoint::client(loopback())?;
    endpoint.set_default_client_config(client);
    Ok(endpoint)
}

#[async_trait]
impl Harness for Quic {
    fn transport(&self) -> Arc<dyn Transport> {
        transport_with(self.tls("member"))
    }

    fn foreign_transports(&self) -> Vec<(&'static str, Arc<dyn Transport>)> {
        let foreign = ClusterCa::generate().expect("foreign CA");
        vec![
            (
                "certificate signed by a foreign CA",
                transport_with(ClusterTls::new(
                    foreign.issue_node("intruder").expect("foreign node"),
                    vec![self.ca.cert_der().clone()],
                )),
            ),
            (
                "a node of another cluster (foreign CA, trusting only it)",
                transport_with(ClusterTls::new(
                    foreign.issue_node("stranger").expect("foreign node"),
                    vec![foreign.cert_der().clone()],
                )),
            ),
        ]
    }

    async fn raw_connect(&self, addr: SocketAddr) -> Result<Box<dyn RawChannel>> {
        let tls = self.tls("raw");
        let endpoint = raw_endpoint(quinn::ClientConfig::new(Arc::new(tls.client_crypto()?)))?;
        let conn = endpoint.connect(addr, tls.server_name())?.await?;
        let mut admission = conn.accept_uni().await?;
        let got = admission.read_to_end(ADMIT.len()).await?;
        anyhow::ensure!(got == ADMIT, "bad admission {got:?}");
        let mut stream = conn.open_uni().await?;
        stream.write_all(&FRAME_HEAD).await?;
        Ok(Box::new(RawQuic {
            _endpoint: endpoint,
            conn,
            stream,
        }))
    }

    async fn send_unauthenticated(&self, addr: SocketAddr, bytes: &[u8]) -> Result<()> {
        // Bytes that are not QUIC at all: the listener drops the datagram.
        let socket = tokio::net::UdpSocket::bind(loopback()).await?;
        socket.send_to(bytes, addr).await?;
        // A QUIC client that presents no certificate: the handshake is refused.
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let mut roots = rustls::RootCertStore::empty();
        roots.add(self.ca.cert_der().clone())?;
        let mut crypto = rustls::ClientConfig::builder_with_provider(provider)
            .with_protocol_versions(&[&rustls::version::TLS13])?
            .with_root_certificates(roots)
            .with_no_client_auth();
        crypto.alpn_protocols = vec![ALPN.to_vec()];
        let quic = quinn::crypto::rustls::QuicClientConfig::try_from(crypto)?;
        let endpoint = raw_endpoint(quinn::ClientConfig::new(Arc::new(quic)))?;
        let conn = match endpoint.connect(addr, "tensorwire.cluster")?.await {
            // Refused during the handshake: the listener will not go on with it.
            Err(_) => return Ok(()),
            Ok(conn) => conn,
        };
        // TLS 1.3: our side finished first; the refusal closes the connection, no admission.
        match conn.accept_uni().await {
            Err(_) => Ok(()),
            Ok(_) => bail!("a client without a certificate was admitted"),
        }
    }
}

struct RawQuic {
    _endpoint: quinn::Endpoint,
    conn: quinn::Connection,
    stream: quinn::SendStream,
}

#[async_trait]
impl RawChannel for RawQuic {
    async fn write(&mut self, bytes: &[u8]) -> Result<()> {
        self.stream.write_all(bytes).await.context("raw QUIC write")
    }

    async fn closed_by_peer(&mut self) -> Result<()> {
        // The adapter closes the whole connection on a bad frame.
        let _reason = self.conn.closed().await;
        Ok(())
    }

    async fn close(mut self: Box<Self>) -> Result<()> {
        // End the stream where it is (mid-frame), let it be acknowledged, then hang up.
        self.stream.finish()?;
        let _ = tokio::time::timeout(Duration::from_secs(5), self.stream.stopped()).await;
        self.conn.close(0u32.into(), b"raw close");
        Ok(())
    }
}

tensorwire_tests::transport_conformance!(Quic::new());

/// A client whose certificate comes from another CA gets an error that says so, and the
/// listener goes on serving members.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn foreign_certificate_error_names_the_cluster_ca() -> Result<()> {
    let h = Quic::new();
    let listener = h.transport().listen(loopback()).await?;
    let foreign = ClusterCa::generate()?;
    let intruder = transport_with(ClusterTls::new(
        foreign.issue_node("intruder")?,
        vec![h.ca.cert_der().clone()],
    ));
    let outcome = tokio::time::timeout(
        Duration::from_secs(30),
        intruder.connect(listener.local_addr()),
    )
    .await
    .context("connect timed out")?;
    match outcome {
        Err(TransportError::Authentication { reason, .. }) => {
            anyhow::ensure!(
                reason.contains("not signed by") && reason.contains("cluster CA"),
                "{reason}"
            );
        }
        Err(e) => bail!("expected an authentication error, got {e}"),
        Ok(_) => bail!("a foreign certificate was admitted"),
    }
    tensorwire_tests::transport_suite::assert_listener_serves(&h, &*listener).await
}
