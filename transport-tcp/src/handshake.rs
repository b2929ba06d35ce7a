//! Moves the bytes of the core's challenge-response handshake over a TCP stream.

use std::net::SocketAddr;

use rand::RngCore;
use tensorwire_core::auth::{
    self, AuthError, ClientHandshake, ClusterSecret, Hello, ServerHandshake, CHALLENGE_LEN,
    HELLO_LEN, NONCE_LEN, PROOF_LEN, VERDICT_LEN, VERDICT_OK,
};
use tensorwire_core::ports::transport::TransportError;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

fn nonce() -> [u8; NONCE_LEN] {
    let mut n = [0u8; NONCE_LEN];
    rand::rngs::OsRng.fill_bytes(&mut n);
    n
}

fn failed(
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

async fn read_msg<const N: usize>(
    stream: &mut TcpStream,
    peer: SocketAddr,
    closed: &str,
) -> Result<[u8; N], TransportError> {
    let mut buf = [0u8; N];
    match stream.read_exact(&mut buf).await {
        Ok(_) => Ok(buf),
        Err(e)
            if matches!(
                e.kind(),
                std::io::ErrorKind::UnexpectedEof
                    | std::io::ErrorKind::ConnectionReset
                    | std::io::ErrorKind::ConnectionAborted
                    | std::io::ErrorKind::BrokenPipe
            ) =>
        {
            Err(failed(peer, closed, None))
        }
        Err(e) => Err(TransportError::io(peer, "authenticating", &e)),
    }
}

async fn write_msg(
    stream: &mut TcpStream,
    peer: SocketAddr,
    msg: &[u8],
) -> Result<(), TransportError> {
    stream
        .write_all(msg)
        .await
        .map_err(|e| TransportError::io(peer, "authenticating", &e))
}

/// The connecting side.
pub(crate) async fn client(
    stream: &mut TcpStream,
    secret: Option<&ClusterSecret>,
    peer: SocketAddr,
) -> Result<(), TransportError> {
    let Some(secret) = secret else {
        write_msg(stream, peer, &auth::insecure_hello()).await?;
        let verdict: [u8; VERDICT_LEN] = read_msg(
            stream,
            peer,
            "the listener requires a cluster secret and this side has none \
             (set TENSORWIRE_SECRET to the cluster's secret)",
        )
        .await?;
        return if verdict == VERDICT_OK {
            Ok(())
        } else {
            Err(failed(
                peer,
                "the listener refused the connection",
                Some(AuthError::Refused),
            ))
        };
    };
    let (hs, hello) = ClientHandshake::start(secret.clone(), nonce());
    write_msg(stream, peer, &hello).await?;
    let challenge: [u8; CHALLENGE_LEN] = read_msg(
        stream,
        peer,
        "the listener closed the connection during the handshake \
         (it runs without a secret, or is not a tensorwire listener)",
    )
    .await?;
    let proof = hs.handle_challenge(&challenge).map_err(|e| {
        failed(
            peer,
            "wrong cluster secret: the listener's proof does not match ours",
            Some(e),
        )
    })?;
    write_msg(stream, peer, &proof).await?;
    let verdict: [u8; VERDICT_LEN] = read_msg(
        stream,
        peer,
        "the listener refused our proof of the cluster secret",
    )
    .await?;
    hs.handle_verdict(&verdict)
        .map_err(|e| failed(peer, "the listener refused the handshake", Some(e)))
}

/// The accepting side. On failure the caller drops (closes) the stream.
pub(crate) async fn server(
    stream: &mut TcpStream,
    secret: Option<&ClusterSecret>,
    peer: SocketAddr,
) -> Result<(), TransportError> {
    let hello: [u8; HELLO_LEN] = read_msg(
        stream,
        peer,
        "the peer closed the connection before its handshake",
    )
    .await?;
    let Some(secret) = secret else {
        return match auth::parse_hello(&hello) {
            Ok(Hello::Insecure) => write_msg(stream, peer, &VERDICT_OK).await,
            Ok(Hello::Authenticated(_)) => Err(failed(
                peer,
                "the peer authenticates with a cluster secret, but this listener runs without one",
                Some(AuthError::PeerHasSecret),
            )),
            Err(e) => Err(failed(peer, "the peer did not start a handshake", Some(e))),
        };
    };
    let mut hs = ServerHandshake::new(secret.clone(), nonce());
    let challenge = hs
        .handle_hello(&hello)
        .map_err(|e| failed(peer, e.to_string(), Some(e)))?;
    write_msg(stream, peer, &challenge).await?;
    let proof: [u8; PROOF_LEN] = read_msg(
        stream,
        peer,
        "the peer closed the connection during the handshake (it does not know the secret)",
    )
    .await?;
    let verdict = hs
        .handle_proof(&proof)
        .map_err(|e| failed(peer, "wrong cluster secret", Some(e)))?;
    write_msg(stream, peer, &verdict).await
}
