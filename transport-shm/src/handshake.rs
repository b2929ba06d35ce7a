//! Setting up a connection over its Unix socket: the peer's user (`SO_PEERCRED`), the cluster
//! secret (core's challenge-response, one packet per message), then the exchange of rings and
//! eventfds (`SCM_RIGHTS`).

use std::net::SocketAddr;
use std::os::fd::{AsFd, OwnedFd};

use async_trait::async_trait;
use rand::RngCore;
use rustix::event::EventfdFlags;
use tensorwire_core::auth::{AuthError, ClusterSecret, NONCE_LEN};
use tensorwire_core::ports::handshake::{
    authenticate_client, authenticate_server, handshake_failed, HandshakeChannel,
};
use tensorwire_core::ports::transport::TransportError;
use tokio::io::unix::AsyncFd;

use crate::config::{MAX_RING, MIN_RING};
use crate::ring::Ring;
use crate::sock;

/// Magic and version of the setup packet that carries a side's ring and eventfds.
const SETUP_MAGIC: [u8; 8] = *b"TWSHM001";
const SETUP_LEN: usize = 16;

/// What a finished setup hands to the connection.
#[derive(Debug)]
pub(crate) struct Link {
    pub(crate) sock: AsyncFd<OwnedFd>,
    /// The ring we receive on (we created it).
    pub(crate) rx: Ring,
    /// The ring we send on (the peer created it).
    pub(crate) tx: Ring,
    /// Ours: readable when the peer has published data in `rx`.
    pub(crate) data_efd: OwnedFd,
    /// Ours: readable when the peer has released space in `tx`.
    pub(crate) space_efd: OwnedFd,
    /// The peer's: we write it after publishing data in `tx`.
    pub(crate) peer_data_efd: OwnedFd,
    /// The peer's: we write it after releasing space in `rx`.
    pub(crate) peer_space_efd: OwnedFd,
}

fn nonce() -> [u8; NONCE_LEN] {
    let mut n = [0u8; NONCE_LEN];
    rand::rngs::OsRng.fill_bytes(&mut n);
    n
}

/// Refuses a peer that runs as another user.
pub(crate) fn check_same_user(sock: impl AsFd, peer: SocketAddr) -> Result<u32, TransportError> {
    let (uid, pid) =
        sock::peer_cred(sock).map_err(|e| TransportError::io(peer, "reading SO_PEERCRED", &e))?;
    let me = sock::my_uid();
    if uid != me {
        return Err(handshake_failed(
            peer,
            format!(
                "the peer (pid {pid}) runs as uid {uid} and this process as uid {me}: the \
                 shared-memory transport connects processes of one user only"
            ),
            None,
        ));
    }
    Ok(pid)
}

/// The Unix socket during the handshake: one packet per message, of exactly its length.
struct Packets<'a> {
    sock: &'a AsyncFd<OwnedFd>,
    peer: SocketAddr,
}

#[async_trait]
impl HandshakeChannel for Packets<'_> {
    fn peer(&self) -> SocketAddr {
        self.peer
    }

    async fn recv(&mut self, msg: &mut [u8], closed: &str) -> Result<(), TransportError> {
        // One byte more than expected, to notice a longer packet.
        let mut buf = vec![0u8; msg.len() + 1];
        let packet = sock::recv_packet(self.sock, &mut buf)
            .await
            .map_err(|e| TransportError::io(self.peer, "authenticating", &e))?;
        if packet.len == 0 {
            return Err(handshake_failed(self.peer, closed, None));
        }
        if packet.len != msg.len() || packet.truncated || !packet.fds.is_empty() {
            return Err(handshake_failed(
                self.peer,
                format!(
                    "the peer sent a handshake message of {} bytes, expected {}",
                    packet.len,
                    msg.len()
                ),
                Some(AuthError::NotAHandshake),
            ));
        }
        msg.copy_from_slice(&buf[..msg.len()]);
        Ok(())
    }

    async fn send(&mut self, msg: &[u8]) -> Result<(), TransportError> {
        sock::send_packet(self.sock, msg, &[])
            .await
            .map_err(|e| TransportError::io(self.peer, "authenticating", &e))
    }
}

fn setup_error(peer: SocketAddr, what: impl std::fmt::Display) -> TransportError {
    TransportError::Io {
        addr: peer,
        op: "setting up shared memory",
        kind: std::io::ErrorKind::InvalidData,
        message: what.to_string(),
    }
}

/// After authentication: each side sends the ring it receives on and its two eventfds, and maps
/// the peer's. Sending first and then receiving cannot deadlock: one packet fits the socket.
async fn exchange(
    sock: AsyncFd<OwnedFd>,
    ring_bytes: usize,
    peer: SocketAddr,
) -> Result<Link, TransportError> {
    let os = |op: &'static str| move |e: std::io::Error| TransportError::io(peer, op, &e);
    let (rx, rx_fd) = Ring::create(ring_bytes).map_err(|e| setup_error(peer, e))?;
    let efd = || {
        rustix::event::eventfd(0, EventfdFlags::CLOEXEC | EventfdFlags::NONBLOCK)
            .map_err(|e| TransportError::io(peer, "creating an eventfd", &e.into()))
    };
    let (data_efd, space_efd) = (efd()?, efd()?);
    let mut setup = [0u8; SETUP_LEN];
    setup[..8].copy_from_slice(&SETUP_MAGIC);
    setup[8..].copy_from_slice(&(ring_bytes as u64).to_le_bytes());
    sock::send_packet(
        &sock,
        &setup,
        &[rx_fd.as_fd(), data_efd.as_fd(), space_efd.as_fd()],
    )
    .await
    .map_err(os("sending the rings"))?;
    drop(rx_fd);

    let mut buf = [0u8; SETUP_LEN + 1];
    let packet = sock::recv_packet(&sock, &mut buf)
        .await
        .map_err(os("receiving the rings"))?;
    if packet.len == 0 {
        return Err(TransportError::Closed { peer });
    }
    if packet.len != SETUP_LEN
        || packet.truncated
        || buf[..8] != SETUP_MAGIC
        || packet.fds.len() != 3
    {
        return Err(setup_error(
            peer,
            format!(
                "the peer's ring setup is malformed ({} bytes, {} descriptors)",
                packet.len,
                packet.fds.len()
            ),
        ));
    }
    let cap = u64::from_le_bytes(buf[8..16].try_into().unwrap_or_default());
    if !cap.is_power_of_two() || !(MIN_RING as u64..=MAX_RING as u64).contains(&cap) {
        return Err(setup_error(
            peer,
            format!("the peer offers a ring of {cap} bytes (not a power of two from {MIN_RING} to {MAX_RING})"),
        ));
    }
    let mut fds = packet.fds.into_iter();
    let (Some(tx_fd), Some(peer_data_efd), Some(peer_space_efd)) =
        (fds.next(), fds.next(), fds.next())
    else {
        return Err(setup_error(peer, "descriptors missing"));
    };
    let tx = Ring::open(&tx_fd, cap as usize).map_err(|e| setup_error(peer, e))?;
    for fd in [&peer_data_efd, &peer_space_efd] {
        // Our wake-ups must never block, whatever the peer passed.
        rustix::io::ioctl_fionbio(fd, true)
            .map_err(|e| TransportError::io(peer, "preparing the peer's eventfd", &e.into()))?;
    }
    Ok(Link {
        sock,
        rx,
        tx,
        data_efd,
        space_efd,
        peer_data_efd,
        peer_space_efd,
    })
}

/// The connecting side: same user, secret, rings.
pub(crate) async fn client(
    sock: AsyncFd<OwnedFd>,
    secret: Option<&ClusterSecret>,
    ring_bytes: usize,
    peer: SocketAddr,
) -> Result<Link, TransportError> {
    check_same_user(&sock, peer)?;
    authenticate_client(&mut Packets { sock: &sock, peer }, secret, nonce()).await?;
    exchange(sock, ring_bytes, peer).await
}

/// The accepting side (the caller has checked the user, which names the peer).
pub(crate) async fn server(
    sock: AsyncFd<OwnedFd>,
    secret: Option<&ClusterSecret>,
    ring_bytes: usize,
    peer: SocketAddr,
) -> Result<Link, TransportError> {
    authenticate_server(&mut Packets { sock: &sock, peer }, secret, nonce()).await?;
    exchange(sock, ring_bytes, peer).await
}
