//! The one error type of this crate.

use std::net::SocketAddr;
use std::path::PathBuf;

/// What can go wrong setting up the QUIC transport: certificates, keys, TLS configuration, the
/// UDP socket. Failures of connections and frames are the port's
/// [`TransportError`](tensorwire_core::ports::transport::TransportError).
///
/// Messages name the file, address or setting involved.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum QuicError {
    /// A certificate or key file could not be read or holds no usable PEM item.
    #[error("cannot read {what} from {}: {reason}", path.display())]
    Pem {
        /// What was expected in the file (`certificate chain`, `private key`, ...).
        what: &'static str,
        /// The file.
        path: PathBuf,
        /// Why it failed.
        reason: String,
    },
    /// A PEM text (not from a file) held no usable item.
    #[error("cannot decode {what} from PEM text: {reason}")]
    PemText {
        /// What was expected in the text.
        what: &'static str,
        /// Why it failed.
        reason: String,
    },
    /// Writing generated certificates or keys to disk failed.
    #[error("cannot write {}: {source}", path.display())]
    Write {
        /// The file.
        path: PathBuf,
        /// The I/O error.
        source: std::io::Error,
    },
    /// rcgen could not generate a key or certificate.
    #[error("cannot generate {what}: {source}")]
    Generate {
        /// What was being generated.
        what: String,
        /// rcgen's error.
        source: rcgen::Error,
    },
    /// The cluster CA key does not belong to the cluster CA certificate.
    #[error("the cluster CA key does not match the cluster CA certificate (its public key is not in the certificate)")]
    CaKeyMismatch,
    /// rustls refused the TLS configuration (bad certificate, key or CA).
    #[error("invalid TLS configuration ({what}): {reason}")]
    Tls {
        /// Which part of the configuration.
        what: &'static str,
        /// rustls' or quinn's explanation.
        reason: String,
    },
    /// Creating, configuring or binding the UDP socket failed.
    #[error("cannot set up the UDP socket on {addr}: {source}")]
    Socket {
        /// The address being bound.
        addr: SocketAddr,
        /// The I/O error.
        source: std::io::Error,
    },
    /// A setting is out of range or malformed (from configuration or the environment).
    #[error("invalid QUIC setting {setting}: {reason}")]
    Setting {
        /// The setting or environment variable.
        setting: String,
        /// What is wrong and what is expected.
        reason: String,
    },
    /// A wait took longer than its deadline.
    #[error("timed out after {after_ms} ms while {what}")]
    Timeout {
        /// What was being waited for.
        what: String,
        /// The deadline in milliseconds.
        after_ms: u64,
    },
}
