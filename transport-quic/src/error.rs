//! The one error type of this crate.

use std::net::SocketAddr;
use std::path::PathBuf;

/// Everything that can go wrong in the QUIC transport.
///
/// Messages name the file, peer address or setting involved and, where there is one, what to do.
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
    /// Connecting to a peer failed before the handshake completed (unreachable, timed out, ...).
    #[error("cannot connect to {addr}: {reason}")]
    Connect {
        /// The peer address.
        addr: SocketAddr,
        /// Why.
        reason: String,
    },
    /// The peer's certificate is not signed by the cluster CA (or is otherwise invalid), so the
    /// peer was refused; or the peer refused our certificate for the same reason.
    #[error("peer {addr} refused: {reason}")]
    UntrustedPeer {
        /// The peer address.
        addr: SocketAddr,
        /// What rustls said about the certificate.
        reason: String,
    },
    /// The connection to a peer was lost or closed.
    #[error("connection to {addr} lost: {reason}")]
    ConnectionLost {
        /// The peer address.
        addr: SocketAddr,
        /// quinn's explanation.
        reason: String,
    },
    /// A frame from a peer was malformed or over the limits; the connection was closed.
    #[error("malformed frame from {addr}, connection closed: {reason}")]
    Malformed {
        /// The peer address.
        addr: SocketAddr,
        /// What was wrong (from the wire decoder).
        reason: String,
    },
    /// A stream carrying a frame ended before the whole frame arrived.
    #[error("peer {addr} closed a stream mid-frame after {got} of {expected} bytes")]
    Truncated {
        /// The peer address.
        addr: SocketAddr,
        /// Bytes received.
        got: u64,
        /// Bytes the frame announced.
        expected: u64,
    },
    /// A wait took longer than its deadline.
    #[error("timed out after {after_ms} ms while {what}")]
    Timeout {
        /// What was being waited for.
        what: String,
        /// The deadline in milliseconds.
        after_ms: u64,
    },
    /// The transport was closed locally.
    #[error("the QUIC transport is closed")]
    Closed,
}
