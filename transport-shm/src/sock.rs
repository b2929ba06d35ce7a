//! The Unix socket of a connection (`SOCK_SEQPACKET`): message boundaries are kept, so every
//! handshake message and every file descriptor travels as one packet.

use std::io::{IoSlice, IoSliceMut};
use std::mem::MaybeUninit;
use std::net::SocketAddr;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};

use rustix::net::{
    AddressFamily, RecvAncillaryBuffer, RecvAncillaryMessage, RecvFlags, SendAncillaryBuffer,
    SendAncillaryMessage, SendFlags, SocketAddrUnix, SocketFlags, SocketType,
};
use tokio::io::unix::AsyncFd;
use tokio::io::Interest;

/// The most file descriptors one packet carries (the ring setup sends three, the group arena
/// its eventfds this many at a time).
pub(crate) const MAX_FDS: usize = 16;

/// The abstract-namespace name of the listener with id `port`.
pub(crate) fn listener_name(port: u16) -> std::io::Result<SocketAddrUnix> {
    Ok(SocketAddrUnix::new_abstract_name(
        format!("tensorwire-shm:{port}").as_bytes(),
    )?)
}

/// The abstract-namespace name of the shared-memory side of a [`SelectingTransport`]
/// listener whose TCP side listens on `tcp` (`tensorwire-shm-tcp:IP:PORT`, the IP as bound, so
/// `0.0.0.0` or `::` for every interface).
///
/// [`SelectingTransport`]: crate::SelectingTransport
#[cfg(feature = "tcp")]
pub(crate) fn tcp_listener_name(tcp: SocketAddr) -> std::io::Result<SocketAddrUnix> {
    Ok(SocketAddrUnix::new_abstract_name(
        format!("tensorwire-shm-tcp:{tcp}").as_bytes(),
    )?)
}

/// A non-blocking `SOCK_SEQPACKET` Unix socket.
pub(crate) fn socket() -> std::io::Result<OwnedFd> {
    Ok(rustix::net::socket_with(
        AddressFamily::UNIX,
        SocketType::SEQPACKET,
        SocketFlags::NONBLOCK | SocketFlags::CLOEXEC,
        None,
    )?)
}

/// Connects to the listener with id `addr.port()`.
pub(crate) async fn connect(addr: SocketAddr) -> std::io::Result<AsyncFd<OwnedFd>> {
    connect_name(&listener_name(addr.port())?).await
}

/// Connects to the listener named `name` (`ConnectionRefused` when nothing listens there).
pub(crate) async fn connect_name(name: &SocketAddrUnix) -> std::io::Result<AsyncFd<OwnedFd>> {
    let fd = socket()?;
    match rustix::net::connect(&fd, name) {
        Ok(()) => {}
        // A full backlog: Unix sockets do not connect asynchronously, so try again once the
        // listener has made room (rare; a short pause rather than a spin).
        Err(rustix::io::Errno::AGAIN) => {
            let mut tries = 0;
            loop {
                tokio::time::sleep(std::time::Duration::from_millis(1)).await;
                match rustix::net::connect(&fd, name) {
                    Ok(()) | Err(rustix::io::Errno::ISCONN) => break,
                    Err(rustix::io::Errno::AGAIN) if tries < 5000 => tries += 1,
                    Err(e) => return Err(e.into()),
                }
            }
        }
        Err(e) => return Err(e.into()),
    }
    register(fd, Interest::READABLE | Interest::WRITABLE)
}

/// Sends one packet of `bytes` with `fds`.
pub(crate) async fn send_packet(
    sock: &AsyncFd<OwnedFd>,
    bytes: &[u8],
    fds: &[BorrowedFd<'_>],
) -> std::io::Result<()> {
    sock.async_io(Interest::WRITABLE, |fd| {
        let mut space = [MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(MAX_FDS))];
        let mut control = SendAncillaryBuffer::new(&mut space);
        if !fds.is_empty() && !control.push(SendAncillaryMessage::ScmRights(fds)) {
            return Err(std::io::Error::other(
                "too many file descriptors for one packet",
            ));
        }
        let sent = rustix::net::sendmsg(
            fd,
            &[IoSlice::new(bytes)],
            &mut control,
            SendFlags::NOSIGNAL,
        )?;
        if sent != bytes.len() {
            return Err(std::io::Error::other("a packet was cut short"));
        }
        Ok(())
    })
    .await
}

/// One received packet: its length (0 at end of stream) and the descriptors it carried.
#[derive(Debug)]
pub(crate) struct Packet {
    pub(crate) len: usize,
    pub(crate) fds: Vec<OwnedFd>,
    /// The packet was longer than the buffer (or carried more descriptors than allowed).
    pub(crate) truncated: bool,
}

/// Receives one packet into `buf`, without waiting (`WouldBlock` when none is queued).
pub(crate) fn try_recv_packet(fd: BorrowedFd<'_>, buf: &mut [u8]) -> std::io::Result<Packet> {
    let mut space = [MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(MAX_FDS))];
    let mut control = RecvAncillaryBuffer::new(&mut space);
    let msg = rustix::net::recvmsg(
        fd,
        &mut [IoSliceMut::new(buf)],
        &mut control,
        RecvFlags::CMSG_CLOEXEC | RecvFlags::DONTWAIT,
    )?;
    let mut fds = Vec::new();
    for message in control.drain() {
        if let RecvAncillaryMessage::ScmRights(received) = message {
            // Taken (and closed when dropped) even when over the limit.
            fds.extend(received);
        }
    }
    let truncated = msg
        .flags
        .intersects(rustix::net::ReturnFlags::TRUNC | rustix::net::ReturnFlags::CTRUNC)
        || fds.len() > MAX_FDS;
    Ok(Packet {
        len: msg.bytes.min(buf.len()),
        fds,
        truncated,
    })
}

/// Receives one packet into `buf`, waiting for it.
pub(crate) async fn recv_packet(
    sock: &AsyncFd<OwnedFd>,
    buf: &mut [u8],
) -> std::io::Result<Packet> {
    sock.async_io(Interest::READABLE, |fd| try_recv_packet(fd.as_fd(), buf))
        .await
}

/// The effective user and process id of the process at the other end of `sock`.
pub(crate) fn peer_cred(sock: impl AsFd) -> std::io::Result<(u32, u32)> {
    let cred = rustix::net::sockopt::socket_peercred(sock)?;
    Ok((cred.uid.as_raw(), cred.pid.as_raw_nonzero().get() as u32))
}

/// This process's effective user id.
pub(crate) fn my_uid() -> u32 {
    rustix::process::geteuid().as_raw()
}

/// Registers `fd` with the runtime's reactor.
pub(crate) fn register(fd: OwnedFd, interest: Interest) -> std::io::Result<AsyncFd<OwnedFd>> {
    // SAFETY: an `OwnedFd` is open and owned by the `AsyncFd` until it is dropped, and always
    // returns the same descriptor.
    Ok(unsafe { AsyncFd::register_with_interest(fd, interest) }?)
}
