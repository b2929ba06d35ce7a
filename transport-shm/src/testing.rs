//! PRIVATE (feature `__testing`): raw access for the conformance suite's hostile peers. Not
//! part of the API.

use std::net::SocketAddr;

use tensorwire_core::ports::transport::TransportError;

use crate::connection::ShmConnection;
use crate::{sock, ShmTransport};

/// A connection past authentication that writes raw bytes into the peer's ring.
#[derive(Debug)]
pub struct RawPeer(ShmConnection);

impl RawPeer {
    /// Connects and authenticates with `transport`'s settings.
    pub async fn connect(
        transport: &ShmTransport,
        addr: SocketAddr,
    ) -> Result<Self, TransportError> {
        Ok(RawPeer(transport.connect_shm(addr).await?))
    }

    /// Writes `bytes` into the ring as stream data.
    pub async fn write(&self, bytes: &[u8]) -> Result<(), TransportError> {
        self.0.send_raw(bytes).await
    }

    /// Waits until the listener's side has closed the socket.
    pub async fn closed_by_peer(&self) {
        self.0.closed_by_peer().await
    }
}

/// Connects to the listener at `addr`, sends `bytes` as one packet instead of authenticating,
/// and waits until the listener closes the socket.
pub async fn send_unauthenticated(addr: SocketAddr, bytes: &[u8]) -> std::io::Result<()> {
    let sock = sock::connect(addr).await?;
    if !bytes.is_empty() {
        // The listener may already have closed; that is fine.
        let _ = sock::send_packet(&sock, bytes, &[]).await;
    }
    let _ = rustix::net::shutdown(sock.get_ref(), rustix::net::Shutdown::Write);
    let mut buf = [0u8; 256];
    loop {
        match sock::recv_packet(&sock, &mut buf).await {
            Ok(p) if p.len == 0 => return Ok(()),
            Ok(_) => {}
            Err(_) => return Ok(()),
        }
    }
}
