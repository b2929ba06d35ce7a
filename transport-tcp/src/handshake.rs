//! Moves the messages of the transports' handshake
//! ([`tensorwire_core::ports::handshake`]) over a TCP stream.

use std::net::SocketAddr;

use async_trait::async_trait;
use rand::RngCore;
use tensorwire_core::auth::{ClusterSecret, NONCE_LEN};
use tensorwire_core::ports::handshake::{
    authenticate_client, authenticate_server, handshake_failed, HandshakeChannel,
};
use tensorwire_core::ports::transport::TransportError;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

fn nonce() -> [u8; NONCE_LEN] {
    let mut n = [0u8; NONCE_LEN];
    rand::rngs::OsRng.fill_bytes(&mut n);
    n
}

/// A TCP stream during the handshake: messages are their bytes, back to back.
struct Stream<'a> {
    stream: &'a mut TcpStream,
    peer: SocketAddr,
}

#[async_trait]
impl HandshakeChannel for Stream<'_> {
    fn peer(&self) -> SocketAddr {
        self.peer
    }

    async fn recv(&mut self, buf: &mut [u8], closed: &str) -> Result<(), TransportError> {
        match self.stream.read_exact(buf).await {
            Ok(_) => Ok(()),
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::UnexpectedEof
                        | std::io::ErrorKind::ConnectionReset
                        | std::io::ErrorKind::ConnectionAborted
                        | std::io::ErrorKind::BrokenPipe
                ) =>
            {
                Err(handshake_failed(self.peer, closed, None))
            }
            Err(e) => Err(TransportError::io(self.peer, "authenticating", &e)),
        }
    }

    async fn send(&mut self, msg: &[u8]) -> Result<(), TransportError> {
        self.stream
            .write_all(msg)
            .await
            .map_err(|e| TransportError::io(self.peer, "authenticating", &e))
    }
}

/// The connecting side.
pub(crate) async fn client(
    stream: &mut TcpStream,
    secret: Option<&ClusterSecret>,
    peer: SocketAddr,
) -> Result<(), TransportError> {
    authenticate_client(&mut Stream { stream, peer }, secret, nonce()).await
}

/// The accepting side. On failure the caller drops (closes) the stream.
pub(crate) async fn server(
    stream: &mut TcpStream,
    secret: Option<&ClusterSecret>,
    peer: SocketAddr,
) -> Result<(), TransportError> {
    authenticate_server(&mut Stream { stream, peer }, secret, nonce()).await
}
