//! The cluster-secret handshake of the transports, driven once for all of them.
//!
//! [`crate::auth`] decides the challenge-response; this module runs it over a
//! [`HandshakeChannel`], which an adapter implements by moving fixed-size messages (TCP: bytes
//! on the stream; shm: one packet per message on its Unix socket). The steps, their order and
//! every error a peer can cause are decided here, so the adapters cannot drift apart. Nonces
//! come in from the caller: the core has no source of randomness.

use std::net::SocketAddr;

use async_trait::async_trait;

use crate::auth::{
    self, AuthError, ClientHandshake, ClusterSecret, Hello, ServerHandshake, CHALLENGE_LEN,
    HELLO_LEN, NONCE_LEN, PROOF_LEN, VERDICT_LEN, VERDICT_OK,
};
use crate::ports::transport::TransportError;

/// How an adapter moves the handshake's messages.
#[async_trait]
pub trait HandshakeChannel: Send {
    /// The peer, for errors.
    fn peer(&self) -> SocketAddr;

    /// Receives one message of exactly `buf.len()` bytes. If the peer closes the channel
    /// first, the error is [`handshake_failed`] with `closed` as its reason.
    async fn recv(&mut self, buf: &mut [u8], closed: &str) -> Result<(), TransportError>;

    /// Sends one message.
    async fn send(&mut self, msg: &[u8]) -> Result<(), TransportError>;
}

/// The error of a handshake that failed because of what the peer did (or did not) prove.
pub fn handshake_failed(
    peer: SocketAddr,
    reason: impl Into<String>,
    source: Option<AuthError>,
) -> TransportError {
    TransportError::Authentication {
        peer,
        reason: reason.into(),
        source,
    }
}

async fn recv<const N: usize>(
    ch: &mut (dyn HandshakeChannel + '_),
    closed: &str,
) -> Result<[u8; N], TransportError> {
    let mut buf = [0u8; N];
    ch.recv(&mut buf, closed).await?;
    Ok(buf)
}

/// The connecting side: proves it knows `secret` and checks that the listener does (without a
/// secret: asks to be let in unauthenticated, which only an insecure listener allows).
pub async fn authenticate_client(
    ch: &mut (dyn HandshakeChannel + '_),
    secret: Option<&ClusterSecret>,
    nonce: [u8; NONCE_LEN],
) -> Result<(), TransportError> {
    let peer = ch.peer();
    let Some(secret) = secret else {
        ch.send(&auth::insecure_hello()).await?;
        let verdict: [u8; VERDICT_LEN] = recv(
            ch,
            "the listener requires a cluster secret and this side has none \
             (set TENSORWIRE_SECRET to the cluster's secret)",
        )
        .await?;
        return if verdict == VERDICT_OK {
            Ok(())
        } else {
            Err(handshake_failed(
                peer,
                "the listener refused the connection",
                Some(AuthError::Refused),
            ))
        };
    };
    let (hs, hello) = ClientHandshake::start(secret.clone(), nonce);
    ch.send(&hello).await?;
    let challenge: [u8; CHALLENGE_LEN] = recv(
        ch,
        "the listener closed the connection during the handshake \
         (it runs without a secret, or is not a tensorwire listener)",
    )
    .await?;
    let proof = hs.handle_challenge(&challenge).map_err(|e| {
        handshake_failed(
            peer,
            "wrong cluster secret: the listener's proof does not match ours",
            Some(e),
        )
    })?;
    ch.send(&proof).await?;
    let verdict: [u8; VERDICT_LEN] =
        recv(ch, "the listener refused our proof of the cluster secret").await?;
    hs.handle_verdict(&verdict)
        .map_err(|e| handshake_failed(peer, "the listener refused the handshake", Some(e)))
}

/// The accepting side: checks that the peer knows `secret` and proves that it does (without a
/// secret: lets in only a peer that asks to be let in unauthenticated).
pub async fn authenticate_server(
    ch: &mut (dyn HandshakeChannel + '_),
    secret: Option<&ClusterSecret>,
    nonce: [u8; NONCE_LEN],
) -> Result<(), TransportError> {
    let peer = ch.peer();
    let hello: [u8; HELLO_LEN] =
        recv(ch, "the peer closed the connection before its handshake").await?;
    let Some(secret) = secret else {
        return match auth::parse_hello(&hello) {
            Ok(Hello::Insecure) => ch.send(&VERDICT_OK).await,
            Ok(Hello::Authenticated(_)) => Err(handshake_failed(
                peer,
                "the peer authenticates with a cluster secret, but this listener runs without one",
                Some(AuthError::PeerHasSecret),
            )),
            Err(e) => Err(handshake_failed(
                peer,
                "the peer did not start a handshake",
                Some(e),
            )),
        };
    };
    let mut hs = ServerHandshake::new(secret.clone(), nonce);
    let challenge = hs
        .handle_hello(&hello)
        .map_err(|e| handshake_failed(peer, e.to_string(), Some(e)))?;
    ch.send(&challenge).await?;
    let proof: [u8; PROOF_LEN] = recv(
        ch,
        "the peer closed the connection during the handshake (it does not know the secret)",
    )
    .await?;
    let verdict = hs
        .handle_proof(&proof)
        .map_err(|e| handshake_failed(peer, "wrong cluster secret", Some(e)))?;
    ch.send(&verdict).await
}

/// How many times a dialer meets a connection closed mid-handshake, with no verdict, before
/// it takes that as final (see [`dial_gives_up`]).
pub const CLOSED_HANDSHAKES_RETRIED: u32 = 3;

/// Whether a dialer stops for good on `error`, having met `closed_before` handshakes that
/// ended without a verdict before this one. A verdict (a refusal, a proof that does not
/// match: an [`AuthError`] source) is final at once. A connection
/// closed mid-handshake is ambiguous: a listener without the secret closes so, but so does
/// a listener that is going away, whose address refuses the next dial (a transient end,
/// retried as one). It is final only once it repeats past [`CLOSED_HANDSHAKES_RETRIED`].
/// Any other error is not an authentication's and is left to the dialer's deadline.
pub fn dial_gives_up(error: &TransportError, closed_before: u32) -> bool {
    match error {
        TransportError::Authentication {
            source: Some(_), ..
        } => true,
        TransportError::Authentication { source: None, .. } => {
            closed_before >= CLOSED_HANDSHAKES_RETRIED
        }
        _ => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::auth::AuthError;

    #[test]
    fn a_verdict_is_final_and_a_handshake_cut_short_only_once_it_repeats() {
        let peer: SocketAddr = "127.0.0.1:9".parse().unwrap();
        let refused = handshake_failed(peer, "refused", Some(AuthError::Refused));
        assert!(dial_gives_up(&refused, 0));
        let cut = handshake_failed(peer, "the listener closed the connection", None);
        for before in 0..CLOSED_HANDSHAKES_RETRIED {
            assert!(!dial_gives_up(&cut, before), "after {before}");
        }
        assert!(dial_gives_up(&cut, CLOSED_HANDSHAKES_RETRIED));
        let refused_tcp = TransportError::io(
            peer,
            "connecting",
            &std::io::Error::from(std::io::ErrorKind::ConnectionRefused),
        );
        assert!(!dial_gives_up(&refused_tcp, 100));
    }
}
