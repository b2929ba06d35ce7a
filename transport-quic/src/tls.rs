//! rustls configurations for mutual TLS under the cluster CA, with an explicit crypto provider.
//!
//! Every builder here is given `rustls::crypto::ring::default_provider()` explicitly; nothing
//! relies on a process-wide default provider, so linking another provider (aws-lc-rs) into the
//! same binary changes nothing here.

use std::sync::Arc;

use quinn::crypto::rustls::{QuicClientConfig, QuicServerConfig};
use rustls::crypto::CryptoProvider;
use rustls::server::WebPkiClientVerifier;
use rustls::RootCertStore;
use rustls_pki_types::CertificateDer;

use crate::certs::{NodeIdentity, CLUSTER_SERVER_NAME};
use crate::QuicError;

/// The ALPN protocol name both sides require.
pub const ALPN: &[u8] = b"tensorwire/1";

/// What a node needs to take part in a cluster over QUIC: its own identity and the cluster CA
/// certificates it trusts.
#[derive(Debug, Clone)]
pub struct ClusterTls {
    identity: NodeIdentity,
    roots: Vec<CertificateDer<'static>>,
    server_name: String,
}

impl ClusterTls {
    /// A node `identity` trusting the CA certificates in `cluster_ca` (usually one).
    ///
    /// Clients ask for [`CLUSTER_SERVER_NAME`], which every certificate issued by
    /// [`ClusterCa::issue_node`](crate::certs::ClusterCa::issue_node) carries; use
    /// [`ClusterTls::with_server_name`] for certificates made elsewhere.
    pub fn new(identity: NodeIdentity, cluster_ca: Vec<CertificateDer<'static>>) -> Self {
        Self {
            identity,
            roots: cluster_ca,
            server_name: CLUSTER_SERVER_NAME.to_string(),
        }
    }

    /// Loads everything from PEM files: the cluster CA certificate(s), this node's chain and key.
    pub fn from_pem_files(
        ca_path: &std::path::Path,
        cert_path: &std::path::Path,
        key_path: &std::path::Path,
    ) -> Result<Self, QuicError> {
        let roots = crate::certs::load_certs(ca_path, "cluster CA certificate")?;
        Ok(Self::new(
            NodeIdentity::from_pem_files(cert_path, key_path)?,
            roots,
        ))
    }

    /// Sets the DNS name clients require in server certificates (default
    /// [`CLUSTER_SERVER_NAME`]).
    pub fn with_server_name(mut self, name: impl Into<String>) -> Self {
        self.server_name = name.into();
        self
    }

    /// This node's identity (its certificate chain and key).
    pub fn identity(&self) -> &NodeIdentity {
        &self.identity
    }

    /// The DNS name clients require in server certificates.
    pub fn server_name(&self) -> &str {
        &self.server_name
    }

    fn provider() -> Arc<CryptoProvider> {
        Arc::new(rustls::crypto::ring::default_provider())
    }

    fn root_store(&self) -> Result<Arc<RootCertStore>, QuicError> {
        let mut roots = RootCertStore::empty();
        for cert in &self.roots {
            roots.add(cert.clone()).map_err(|e| QuicError::Tls {
                what: "cluster CA certificate",
                reason: e.to_string(),
            })?;
        }
        if roots.is_empty() {
            return Err(QuicError::Tls {
                what: "cluster CA certificate",
                reason: "no cluster CA certificate given".into(),
            });
        }
        Ok(Arc::new(roots))
    }

    /// The QUIC server crypto: TLS 1.3, client certificates required and verified against the
    /// cluster CA.
    pub fn server_crypto(&self) -> Result<QuicServerConfig, QuicError> {
        let provider = Self::provider();
        let verifier =
            WebPkiClientVerifier::builder_with_provider(self.root_store()?, provider.clone())
                .build()
                .map_err(|e| QuicError::Tls {
                    what: "client certificate verifier",
                    reason: e.to_string(),
                })?;
        let mut config = rustls::ServerConfig::builder_with_provider(provider)
            .with_protocol_versions(&[&rustls::version::TLS13])
            .map_err(|e| QuicError::Tls {
                what: "server protocol versions",
                reason: e.to_string(),
            })?
            .with_client_cert_verifier(verifier)
            .with_single_cert(
                self.identity.chain().to_vec(),
                self.identity.key().clone_key(),
            )
            .map_err(|e| QuicError::Tls {
                what: "server certificate and key",
                reason: e.to_string(),
            })?;
        config.alpn_protocols = vec![ALPN.to_vec()];
        QuicServerConfig::try_from(config).map_err(|e| QuicError::Tls {
            what: "QUIC server crypto",
            reason: e.to_string(),
        })
    }

    /// The QUIC client crypto: TLS 1.3, server certificates verified against the cluster CA, our
    /// own certificate presented.
    pub fn client_crypto(&self) -> Result<QuicClientConfig, QuicError> {
        let mut config = rustls::ClientConfig::builder_with_provider(Self::provider())
            .with_protocol_versions(&[&rustls::version::TLS13])
            .map_err(|e| QuicError::Tls {
                what: "client protocol versions",
                reason: e.to_string(),
            })?
            .with_root_certificates(self.root_store()?)
            .with_client_auth_cert(
                self.identity.chain().to_vec(),
                self.identity.key().clone_key(),
            )
            .map_err(|e| QuicError::Tls {
                what: "client certificate and key",
                reason: e.to_string(),
            })?;
        config.alpn_protocols = vec![ALPN.to_vec()];
        QuicClientConfig::try_from(config).map_err(|e| QuicError::Tls {
            what: "QUIC client crypto",
            reason: e.to_string(),
        })
    }
}
