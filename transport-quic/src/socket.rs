//! The UDP socket under a QUIC endpoint, with raised kernel buffers.
//!
//! Default UDP buffers (about 200 KiB on Linux) drop packets as soon as a bulk transfer outruns
//! the reader for a moment, and every drop costs QUIC a loss-recovery round. We ask for larger
//! buffers and log what the kernel actually granted: Linux caps the request at
//! `net.core.rmem_max` / `net.core.wmem_max` (and reports twice the granted size).

use std::net::SocketAddr;

use socket2::{Domain, Protocol, Socket, Type};

use crate::QuicError;

/// Kernel buffer sizes granted to a socket, in bytes, as the OS reports them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GrantedBuffers {
    /// `SO_SNDBUF` after the request.
    pub send: usize,
    /// `SO_RCVBUF` after the request.
    pub recv: usize,
}

/// Binds a UDP socket on `addr` with send and receive buffers of `buffer_bytes` requested.
///
/// A refusal to raise a buffer is logged, not fatal: QUIC works with small buffers, only
/// slower.
pub fn bind_udp(
    addr: SocketAddr,
    buffer_bytes: usize,
) -> Result<(std::net::UdpSocket, GrantedBuffers), QuicError> {
    let err = |source| QuicError::Socket { addr, source };
    let socket =
        Socket::new(Domain::for_address(addr), Type::DGRAM, Some(Protocol::UDP)).map_err(err)?;
    if addr.is_ipv6() {
        // Dual-stack where the OS allows it; failure only means IPv6-only, which is fine.
        let _ = socket.set_only_v6(false);
    }
    if let Err(e) = socket.set_send_buffer_size(buffer_bytes) {
        tracing::warn!(%addr, requested = buffer_bytes, error = %e, "cannot raise the UDP send buffer");
    }
    if let Err(e) = socket.set_recv_buffer_size(buffer_bytes) {
        tracing::warn!(%addr, requested = buffer_bytes, error = %e, "cannot raise the UDP receive buffer");
    }
    let granted = GrantedBuffers {
        send: socket.send_buffer_size().map_err(err)?,
        recv: socket.recv_buffer_size().map_err(err)?,
    };
    if granted.recv < buffer_bytes || granted.send < buffer_bytes {
        tracing::info!(
            %addr,
            requested = buffer_bytes,
            send = granted.send,
            recv = granted.recv,
            "UDP buffers smaller than requested (raise net.core.rmem_max / wmem_max for more)"
        );
    } else {
        tracing::debug!(%addr, send = granted.send, recv = granted.recv, "UDP buffers granted");
    }
    socket.bind(&addr.into()).map_err(err)?;
    socket.set_nonblocking(true).map_err(err)?;
    Ok((socket.into(), granted))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn binds_an_ephemeral_port_and_reports_buffers() {
        let (socket, granted) = bind_udp("127.0.0.1:0".parse().unwrap(), 8 << 20).unwrap();
        assert_ne!(socket.local_addr().unwrap().port(), 0);
        assert!(granted.send > 0 && granted.recv > 0, "{granted:?}");
    }
}
