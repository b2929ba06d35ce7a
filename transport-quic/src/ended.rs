//! quinn's connection and stream errors as the port's typed errors, mapped once here: a clean
//! close is [`TransportError::Closed`], a refused certificate
//! [`TransportError::Authentication`], anything else [`TransportError::Ended`] with how it
//! ended as data ([`Ended`]), never quinn's text in a string.

use std::net::SocketAddr;

use quinn::{ConnectError, ConnectionError, StoppedError, VarInt, WriteError};
use tensorwire_core::ports::transport::{ConfigError, Ended, TransportError};

/// The application close code of a connection both sides are done with.
pub(crate) const CODE_DONE: u32 = 0;
/// The application close code of a connection closed for what its peer sent.
pub(crate) const CODE_MALFORMED: u32 = 1;

/// The most bytes of a peer's close reason kept (QUIC bounds it by a packet already; this
/// keeps what a hostile peer can put into our errors and logs small).
const MAX_REASON: usize = 256;

/// Whether a QUIC close code is a TLS alert (certificate refused and the like).
pub(crate) fn is_crypto(code: quinn::TransportErrorCode) -> bool {
    (u64::from(code) & !0xff) == 0x100
}

/// Whether the connection ended as a clean close between frames: the peer's close with
/// [`CODE_DONE`], either side's plain close, the peer's stack closing it, or a reset.
fn is_clean(e: &ConnectionError) -> bool {
    match e {
        ConnectionError::ApplicationClosed(close) => close.error_code == VarInt::from(CODE_DONE),
        ConnectionError::LocallyClosed
        | ConnectionError::Reset
        | ConnectionError::ConnectionClosed(_) => true,
        ConnectionError::TimedOut
        | ConnectionError::TransportError(_)
        | ConnectionError::VersionMismatch
        | ConnectionError::CidsExhausted => false,
    }
}

/// A peer's words, at most [`MAX_REASON`] bytes of them, invalid UTF-8 replaced.
fn words(reason: &[u8]) -> String {
    String::from_utf8_lossy(&reason[..reason.len().min(MAX_REASON)]).into_owned()
}

/// How the connection ended, as data.
pub(crate) fn how(e: &ConnectionError) -> Ended {
    match e {
        ConnectionError::TimedOut => Ended::IdleTimeout,
        ConnectionError::ApplicationClosed(close) => Ended::ClosedByPeer {
            code: close.error_code.into_inner(),
            reason: words(&close.reason),
        },
        ConnectionError::ConnectionClosed(close) => Ended::Protocol {
            code: u64::from(close.error_code),
            reason: words(&close.reason),
        },
        ConnectionError::TransportError(te) => Ended::Protocol {
            code: u64::from(te.code),
            reason: words(te.reason.as_bytes()),
        },
        ConnectionError::Reset => Ended::Reset,
        ConnectionError::VersionMismatch => Ended::VersionMismatch,
        ConnectionError::LocallyClosed => Ended::ClosedHere,
        ConnectionError::CidsExhausted => Ended::IdsExhausted,
    }
}

/// How a receiving side ended: `None` for a clean close.
pub(crate) fn unclean(e: &ConnectionError) -> Option<Ended> {
    (!is_clean(e)).then(|| how(e))
}

/// The error of `op` on a connection that was lost.
pub(crate) fn lost(peer: SocketAddr, op: &'static str, e: &ConnectionError) -> TransportError {
    match unclean(e) {
        None => TransportError::Closed { peer },
        Some(how) => TransportError::Ended { peer, op, how },
    }
}

/// The error of a write (`op`) on a stream.
pub(crate) fn write(peer: SocketAddr, op: &'static str, e: &WriteError) -> TransportError {
    let how = match e {
        WriteError::ConnectionLost(c) => return lost(peer, op, c),
        WriteError::Stopped(code) => Ended::StreamStopped {
            code: code.into_inner(),
        },
        WriteError::ClosedStream => Ended::StreamClosed,
        WriteError::ZeroRttRejected => Ended::EarlyDataRejected,
    };
    TransportError::Ended { peer, op, how }
}

/// The error of waiting (`op`) for the peer to acknowledge a stream.
pub(crate) fn stopped(peer: SocketAddr, op: &'static str, e: &StoppedError) -> TransportError {
    match e {
        StoppedError::ConnectionLost(c) => lost(peer, op, c),
        StoppedError::ZeroRttRejected => TransportError::Ended {
            peer,
            op,
            how: Ended::EarlyDataRejected,
        },
    }
}

/// The error of finishing a stream that was finished or reset already.
pub(crate) fn stream_closed(peer: SocketAddr, op: &'static str) -> TransportError {
    TransportError::Ended {
        peer,
        op,
        how: Ended::StreamClosed,
    }
}

/// A connection quinn would not start (before any packet was sent).
pub(crate) fn refused(peer: SocketAddr, e: &ConnectError) -> TransportError {
    let op = "connecting";
    let how = match e {
        ConnectError::EndpointStopping => Ended::EndpointStopped,
        ConnectError::CidsExhausted => Ended::IdsExhausted,
        ConnectError::UnsupportedVersion => Ended::VersionMismatch,
        ConnectError::InvalidServerName(name) => {
            return ConfigError::ServerName { name: name.clone() }.into()
        }
        ConnectError::InvalidRemoteAddress(addr) => {
            return TransportError::Io {
                addr: *addr,
                op,
                kind: std::io::ErrorKind::InvalidInput,
                message: "QUIC cannot connect to this address (port 0, or another address family \
                          than the local endpoint's)"
                    .to_owned(),
            }
        }
        ConnectError::NoDefaultClientConfig => {
            return ConfigError::NoClientConfig { transport: "QUIC" }.into()
        }
    };
    TransportError::Ended { peer, op, how }
}

/// A failed handshake, naming certificate problems as such; `op` is `"connecting"` or
/// `"accepting"`.
pub(crate) fn handshake(peer: SocketAddr, op: &'static str, e: &ConnectionError) -> TransportError {
    // The alerts' descriptions are TLS's own fixed text (a code and its name), not a peer's
    // words.
    let reason = match e {
        ConnectionError::TransportError(te) if is_crypto(te.code) => format!(
            "we refused the peer's certificate: it is not signed by the cluster CA or is \
             otherwise invalid ({te})"
        ),
        ConnectionError::ConnectionClosed(close) if is_crypto(close.error_code) => format!(
            "the peer refused our certificate: it is not signed by the peer's cluster CA or is \
             otherwise invalid ({close})"
        ),
        other => {
            return TransportError::Ended {
                peer,
                op,
                how: how(other),
            }
        }
    };
    TransportError::Authentication {
        peer,
        reason,
        source: None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use bytes::Bytes;
    use quinn::{ApplicationClose, ConnectionClose, TransportErrorCode};

    fn peer() -> SocketAddr {
        "127.0.0.1:4433".parse().unwrap()
    }

    fn closed_by_app(code: u32, reason: &[u8]) -> ConnectionError {
        ConnectionError::ApplicationClosed(ApplicationClose {
            error_code: VarInt::from(code),
            reason: Bytes::copy_from_slice(reason),
        })
    }

    /// Every way quinn says a connection ended maps to one typed answer: the clean ones to
    /// `Closed`, the rest to `Ended` with its data.
    #[test]
    fn each_connection_error_maps_to_its_typed_end() {
        let cases: Vec<(ConnectionError, Option<Ended>)> = vec![
            (closed_by_app(CODE_DONE, b"done"), None),
            (ConnectionError::LocallyClosed, None),
            (ConnectionError::Reset, None),
            (
                ConnectionError::ConnectionClosed(ConnectionClose {
                    error_code: TransportErrorCode::NO_ERROR,
                    frame_type: None,
                    reason: Bytes::new(),
                }),
                None,
            ),
            (ConnectionError::TimedOut, Some(Ended::IdleTimeout)),
            (
                closed_by_app(CODE_MALFORMED, b"bad admission"),
                Some(Ended::ClosedByPeer {
                    code: 1,
                    reason: "bad admission".into(),
                }),
            ),
            (
                ConnectionError::VersionMismatch,
                Some(Ended::VersionMismatch),
            ),
            (ConnectionError::CidsExhausted, Some(Ended::IdsExhausted)),
        ];
        for (error, expected) in cases {
            assert_eq!(unclean(&error), expected, "{error}");
            match (lost(peer(), "sending", &error), expected) {
                (TransportError::Closed { peer: p }, None) => assert_eq!(p, peer()),
                (TransportError::Ended { peer: p, op, how }, Some(expected)) => {
                    assert_eq!((p, op, how), (peer(), "sending", expected));
                }
                (other, expected) => panic!("{error}: {other} (expected {expected:?})"),
            }
        }
    }

    /// A hostile peer's close reason is kept short and lossily decoded, never trusted as text.
    #[test]
    fn a_peers_long_or_invalid_reason_is_bounded() {
        let mut reason = vec![b'x'; 2 * MAX_REASON];
        reason[0] = 0xff;
        let Some(Ended::ClosedByPeer { code, reason }) = unclean(&closed_by_app(9, &reason)) else {
            panic!("not a close by the peer");
        };
        assert_eq!(code, 9);
        assert!(reason.starts_with('\u{fffd}'), "{reason:?}");
        assert!(reason.len() <= MAX_REASON + 2, "{}", reason.len());
    }

    /// Stream errors say which part of the stream failed; a lost connection under a write
    /// is the connection's end.
    #[test]
    fn stream_errors_are_typed() {
        let e = write(peer(), "sending", &WriteError::Stopped(VarInt::from(5u32)));
        assert_eq!(
            e,
            TransportError::Ended {
                peer: peer(),
                op: "sending",
                how: Ended::StreamStopped { code: 5 }
            }
        );
        let e = write(
            peer(),
            "sending",
            &WriteError::ConnectionLost(ConnectionError::TimedOut),
        );
        assert!(
            matches!(
                e,
                TransportError::Ended {
                    how: Ended::IdleTimeout,
                    ..
                }
            ),
            "{e}"
        );
        let e = stopped(peer(), "closing", &StoppedError::ZeroRttRejected);
        assert!(e.to_string().contains("0-RTT"), "{e}");
        assert!(stream_closed(peer(), "sending")
            .to_string()
            .contains("finished or reset"));
    }

    /// A handshake refused over certificates is an authentication error; any other failure
    /// is how the connection ended.
    #[test]
    fn handshakes_name_certificate_refusals() {
        let alert = ConnectionError::ConnectionClosed(ConnectionClose {
            error_code: TransportErrorCode::crypto(0x2a),
            frame_type: None,
            reason: Bytes::new(),
        });
        match handshake(peer(), "connecting", &alert) {
            TransportError::Authentication { reason, .. } => {
                assert!(
                    reason.starts_with("the peer refused our certificate"),
                    "{reason}"
                );
            }
            other => panic!("{other}"),
        }
        assert_eq!(
            handshake(peer(), "accepting", &ConnectionError::TimedOut),
            TransportError::Ended {
                peer: peer(),
                op: "accepting",
                how: Ended::IdleTimeout
            }
        );
    }
}
