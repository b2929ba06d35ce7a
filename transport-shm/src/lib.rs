//! tensorwire's same-host transport: a [`Transport`] over shared memory, for peers on one host.
//!
//! # Addressing
//! The [`Transport`] port speaks [`SocketAddr`]s. A shared-memory listener is a Unix socket in
//! the *abstract namespace* named `tensorwire-shm:<port>`: only the port of the address names it,
//! the IP is kept for display (so `127.0.0.1:7000` and `0.0.0.0:7000` are the same listener).
//! `listen` on port 0 picks a free id from 1024 to 65535, and [`Listener::local_addr`] returns
//! the address with that port, which `connect` accepts. Abstract names vanish with the socket
//! (nothing to clean up in the file system) and are scoped to the network namespace: "same host"
//! means same network namespace, as for loopback TCP. The ids are not TCP ports: a worker can use
//! port 29500 for both transports. The accepting side names its peer by process id, as
//! `127.0.0.(pid >> 16):(pid & 0xffff)` (most pids read as the port).
//!
//! # Setup and authentication
//! The Unix socket (`SOCK_SEQPACKET`) carries the setup:
//! 1. both sides check with `SO_PEERCRED` that the other runs as the same (effective) user;
//! 2. the cluster secret, with the challenge-response of [`tensorwire_core::auth`] that TCP uses
//!    (one packet per message). A peer with a wrong or missing secret is refused; the listener
//!    logs it and keeps accepting, the connecting side gets
//!    [`TransportError::Authentication`];
//! 3. each side sends, with `SCM_RIGHTS`, the ring it receives on (a memfd sealed against
//!    resizing) and two eventfds, and maps the peer's ring after checking its size and seals.
//!
//! # Data path
//! Each direction has a single-producer, single-consumer ring (2 MiB by default,
//! [`ShmConfig::ring_bytes`]) that carries the frames in the wire format TCP uses, so the same
//! bounded [`FrameDecoder`](tensorwire_core::wire::FrameDecoder) checks them. The sender copies a
//! frame into the ring in records of at most 64 KiB, publishing each at once; the receiver copies
//! each out (a large payload straight into its final, reused buffer) and releases the space at
//! once. A large frame thus streams through with the two copies overlapped on two cores, and
//! since each side sees the other progress within its polling time, neither sleeps: 64 MiB moves
//! without a system call per chunk (on one core, the sides hand over with `sched_yield`).
//!
//! Frames of 1 MiB and more ([`ShmConfig::slab_min`]) take another path: the sender writes them
//! once into a *slab*, a memfd of its own sealed against resizing (not against writes), which it
//! creates the first time (its descriptor goes over the Unix socket with `SCM_RIGHTS`) and reuses
//! afterwards; the ring carries a 32-byte record naming the slab and the use. The receiver maps
//! each slab once, read-only, and hands the payloads up as [`Bytes`](bytes::Bytes) over the
//! mapping without copying them (the small frame header is copied). When the last of those bytes
//! is dropped, the receiver stores the use number in the ring's header, and only then does the
//! sender write that slab again: a receiver that keeps a tensor keeps it unchanged. While every
//! slab is still referenced (or the budget, [`ShmConfig::slab_bytes`], is spent), frames stream
//! through the ring instead, so a receiver never holds up a sender. One copy in all, and no
//! system call per frame once the slab exists. *Deliberate difference from the sealed segments
//! below:* a misbehaving sender of the same user could change a slab's bytes while the receiver
//! reads them (never their length or place); a process of the same user can write our memory
//! through `/proc/PID/mem` anyway.
//!
//! Optionally ([`ShmConfig::segment_min`]), frames from a given size on are written once into a
//! memfd of their own, sealed against writes and resizing, whose descriptor goes over the Unix
//! socket (`SCM_RIGHTS`); the ring carries a 16-byte record that says where it belongs in the
//! stream. The receiver checks the seals and size, maps it read-only and hands out the payloads
//! as [`Bytes`](bytes::Bytes) that own the mapping: one copy in all and a fixed number of system
//! calls whatever the size, but fresh pages per frame, which the kernel must zero, map and free
//! (7 times slower than the ring for 64 MiB on the virtual machines we measured, so off by
//! default). At most 8 segments are in flight per direction.
//!
//! A side that waits (for data, or for ring space) polls for [`ShmConfig::spin`] (20 µs), letting
//! its runtime's other tasks run between looks (every other time through tokio's own yield, so
//! that a current-thread runtime's `block_on` future runs too: see
//! [`Turn`](tensorwire_core::spin::Turn)), then
//! raises a flag in the ring and sleeps on its eventfd; the other side writes the eventfd only
//! when it finds the flag raised, so a busy connection makes no system calls at all.
//!
//! # A peer that goes away, or misbehaves
//! A task per connection reads the Unix socket: segment descriptors, and its end. The socket ends
//! when the peer drops the connection or its process dies (even by `SIGKILL`); the task then wakes
//! every waiter, a receiver gets what was published before, then
//! [`TransportError::Closed`] (or [`TransportError::ClosedMidFrame`]), a sender an error.
//! [`Connection::close`] closes one direction only (a flag in the ring).
//!
//! The shared memory is untrusted: each side keeps its own position privately, reads the other's
//! once per step and checks it against the capacity, copies record headers before checking them,
//! and masks every offset into the ring. Bad contents give [`TransportError::Wire`] (naming the
//! [`RingError`] or the [`WireError`](tensorwire_core::wire::WireError)) and close the connection;
//! a segment must be sealed and exactly as long as announced before it is mapped.
//!
//! ```no_run
//! use bytes::Bytes;
//! use tensorwire_core::ports::transport::Transport;
//! use tensorwire_core::wire::Frame;
//! use tensorwire_transport_shm::{ShmConfig, ShmTransport};
//!
//! # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
//! let transport = ShmTransport::new(ShmConfig::from_env()?)?; // reads TENSORWIRE_SECRET
//! let listener = transport.listen("127.0.0.1:0".parse()?).await?;
//! let client = transport.connect(listener.local_addr()).await?;
//! let server = listener.accept().await?;
//! client.send(Frame::message(Bytes::from_static(b"hi"), vec![])).await?;
//! assert_eq!(&server.recv().await?.header[..], b"hi");
//! # Ok(()) }
//! ```

#![cfg(target_os = "linux")]

pub mod arena;
mod config;
mod connection;
#[doc(hidden)]
pub mod fuzzing;
mod handshake;
mod listener;
mod mem;
mod private;
mod ring;
#[cfg(feature = "tcp")]
pub mod select;
mod sock;
#[cfg(feature = "__testing")]
#[doc(hidden)]
pub mod testing;

use std::net::SocketAddr;
use std::sync::Arc;

use async_trait::async_trait;
use tensorwire_core::ports::transport::{Connection, Listener, Transport, TransportError};

pub use config::{ShmConfig, SECRET_ENV, SPIN_ENV};
pub use private::{private_view, PrivateView, PRIVATE_VIEW_MIN};
pub use ring::RingError;
#[cfg(feature = "tcp")]
pub use select::{SelectingTransport, Selection, TRANSPORT_ENV};
pub use tensorwire_core::auth::ClusterSecret;

/// The shared-memory [`Transport`], for peers on the same host.
#[derive(Debug, Clone)]
pub struct ShmTransport {
    config: Arc<ShmConfig>,
}

impl ShmTransport {
    /// A transport with `config`. Warns (through `tracing`) when it runs without a secret.
    pub fn new(config: ShmConfig) -> Result<Self, TransportError> {
        config.validate()?;
        if config.secret().is_none() {
            tracing::warn!(
                "tensorwire shared-memory transport runs WITHOUT the cluster secret (insecure): \
                 any process of this user can talk to this worker; set {SECRET_ENV}"
            );
        }
        Ok(ShmTransport {
            config: Arc::new(config),
        })
    }

    /// The configuration.
    pub fn config(&self) -> &ShmConfig {
        &self.config
    }

    pub(crate) async fn connect_shm(
        &self,
        addr: SocketAddr,
    ) -> Result<connection::ShmConnection, TransportError> {
        let sock = sock::connect(addr)
            .await
            .map_err(|e| TransportError::io(addr, "connecting", &e))?;
        self.setup(sock, addr).await
    }

    /// Authenticates over `sock`, just connected to the listener of the peer at `addr`, and
    /// maps the rings.
    pub(crate) async fn setup(
        &self,
        sock: tokio::io::unix::AsyncFd<std::os::fd::OwnedFd>,
        addr: SocketAddr,
    ) -> Result<connection::ShmConnection, TransportError> {
        let link = tokio::time::timeout(
            self.config.handshake_timeout,
            handshake::client(sock, self.config.secret(), self.config.ring_bytes, addr),
        )
        .await
        .map_err(|_| TransportError::Authentication {
            peer: addr,
            reason: format!(
                "the listener did not complete the handshake within {:?}",
                self.config.handshake_timeout
            ),
            source: None,
        })??;
        connection::ShmConnection::new(
            link,
            addr,
            self.config.limits,
            self.config.segment_min,
            (self.config.slab_min, self.config.slab_bytes),
            self.config.spin,
            self.config.buffer_reuse,
        )
    }
}

#[async_trait]
impl Transport for ShmTransport {
    fn name(&self) -> &'static str {
        "shm"
    }

    async fn listen(&self, addr: SocketAddr) -> Result<Box<dyn Listener>, TransportError> {
        Ok(Box::new(listener::ShmListener::bind(
            addr,
            self.config.clone(),
        )?))
    }

    async fn connect(&self, addr: SocketAddr) -> Result<Box<dyn Connection>, TransportError> {
        Ok(Box::new(self.connect_shm(addr).await?))
    }
}

#[cfg(test)]
mod tests {
    use std::time::{Duration, Instant};

    use bytes::Bytes;
    use tensorwire_core::wire::{Frame, WireLimits};

    use super::*;

    /// On tokio's current-thread runtime the `block_on` future (an application's `main`) runs
    /// only when no task is ready or after `event_interval` turns. A reader polling the ring
    /// must still let it run: here the frame it waits for is sent by that future. The runtime's
    /// event interval is made endless and the polling budget long (10 s), so a reader that only
    /// requeued itself would hold the sender off until it gave up and slept, 10 s later.
    #[test]
    fn a_polling_reader_lets_the_block_on_future_send_what_it_waits_for() {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .event_interval(u32::MAX)
            .build()
            .unwrap();
        let took = rt.block_on(async {
            let secret = ClusterSecret::new(vec![7; 32]).unwrap();
            let config = ShmConfig::new(secret).with_spin(Duration::from_secs(10));
            let transport = ShmTransport::new(config).unwrap();
            let listener = transport
                .listen("127.0.0.1:0".parse().unwrap())
                .await
                .unwrap();
            let client = transport.connect(listener.local_addr()).await.unwrap();
            let server = listener.accept().await.unwrap();
            let (started_tx, started_rx) = tokio::sync::oneshot::channel();
            let reader = tokio::spawn(async move {
                let _ = started_tx.send(());
                server.recv().await
            });
            // The reader is about to poll: from here on it is the only ready task, and this
            // future runs again only when the reader lets it.
            let began = Instant::now();
            started_rx.await.unwrap();
            client
                .send(Frame::message(Bytes::from_static(b"go"), vec![]))
                .await
                .unwrap();
            let frame = reader.await.unwrap().unwrap();
            assert_eq!(&frame.header[..], b"go");
            began.elapsed()
        });
        assert!(
            took < Duration::from_secs(5),
            "the reader held the block_on future off for {took:?}"
        );
    }

    /// `try_send_now` copies small frames into the ring at once. What a full ring does not
    /// take is held and goes first with the next `send_many` (or before `close`'s end of
    /// stream): a later frame never overtakes it, through `try_send_now` (which then takes
    /// nothing) or `send_many`. A frame that may need a slab takes nothing; one over the
    /// limits fails.
    #[tokio::test]
    async fn try_send_now_writes_at_once_or_holds_the_rest_for_the_next_send() {
        let secret = ClusterSecret::new(vec![7; 32]).unwrap();
        let mut limits = WireLimits::default();
        limits.max_message_header_len = 1024;
        let config = ShmConfig::new(secret)
            .with_ring_bytes(4096)
            .with_limits(limits);
        let transport = ShmTransport::new(config).unwrap();
        let listener = transport
            .listen("127.0.0.1:0".parse().unwrap())
            .await
            .unwrap();
        let client = transport.connect(listener.local_addr()).await.unwrap();
        let server = listener.accept().await.unwrap();
        let frame = |i: u8, len: usize| Frame::message(vec![i], vec![Bytes::from(vec![i; len])]);
        let check = |got: Frame, i: u8, len: usize| {
            assert_eq!(&got.header[..], &[i], "frame {i} in its place");
            assert_eq!(got.payloads.len(), 1);
            assert!(got.payloads[0].len() == len && got.payloads[0].iter().all(|&b| b == i));
        };

        let mut frames = vec![frame(0, 100)];
        assert!(matches!(client.try_send_now(&mut frames), Some(Ok(()))));
        assert!(frames.is_empty());
        check(server.recv().await.unwrap(), 0, 100);
        // A single frame longer than one record (a quarter of the ring) is not copied whole:
        // it goes in several records, as any frame.
        let mut frames = vec![frame(9, 1500)];
        assert!(matches!(client.try_send_now(&mut frames), Some(Ok(()))));
        assert!(frames.is_empty());
        check(server.recv().await.unwrap(), 9, 1500);

        // Nobody reads: the 4 KiB ring takes two frames of 1,500 bytes, not three.
        let mut frames = vec![frame(1, 1500), frame(2, 1500), frame(3, 1500)];
        assert!(
            client.try_send_now(&mut frames).is_none(),
            "the ring is full"
        );
        assert!(frames.is_empty(), "what was not written is held");
        let mut later = vec![frame(4, 10)];
        assert!(
            client.try_send_now(&mut later).is_none(),
            "held frames go first"
        );
        assert_eq!(later.len(), 1, "nothing taken");
        let received = async {
            for (i, len) in [(1, 1500), (2, 1500), (3, 1500), (4, 10)] {
                check(server.recv().await.unwrap(), i, len);
            }
        };
        let (sent, ()) = tokio::join!(client.send_many(later), received);
        sent.unwrap();

        // A frame that may need a slab (1 MiB by default) is left to `send_many`.
        let mut large = vec![frame(8, 1 << 20)];
        assert!(client.try_send_now(&mut large).is_none());
        assert_eq!(large.len(), 1, "nothing taken");
        // Over the limits: an error, nothing sent.
        let mut huge = vec![Frame::message(vec![0u8; 2000], vec![])];
        assert!(matches!(
            client.try_send_now(&mut huge),
            Some(Err(TransportError::Wire { .. }))
        ));

        // Held frames are written before the end of the stream.
        let mut frames = vec![frame(5, 1500), frame(6, 1500), frame(7, 1500)];
        assert!(client.try_send_now(&mut frames).is_none());
        let received = async {
            for i in 5..=7 {
                check(server.recv().await.unwrap(), i, 1500);
            }
            server.recv().await
        };
        let (closed, end) = tokio::join!(client.close(), received);
        closed.unwrap();
        assert!(matches!(end, Err(TransportError::Closed { .. })), "{end:?}");
    }

    /// A transport with the default settings, and a listener of it on a free port.
    pub(crate) async fn listening() -> (ShmTransport, Box<dyn Listener>) {
        listening_with(|config| config).await
    }

    /// A transport with the default settings as `change` changes them, and a listener of it
    /// on a free port.
    async fn listening_with(
        change: impl FnOnce(ShmConfig) -> ShmConfig,
    ) -> (ShmTransport, Box<dyn Listener>) {
        let secret = ClusterSecret::new(vec![7; 32]).unwrap();
        let transport = ShmTransport::new(change(ShmConfig::new(secret))).unwrap();
        let listener = transport
            .listen("127.0.0.1:0".parse().unwrap())
            .await
            .unwrap();
        (transport, listener)
    }

    /// While a `send_many` is under way (its frame part-written into a full ring, the rest
    /// waiting for space), a `try_send_now` takes nothing, so that the two never interleave in
    /// the ring; once the send ends, the next is written at once, after it. A send dropped
    /// half-way puts the send side back broken: a `try_send_now` then fails.
    #[tokio::test]
    async fn try_send_now_takes_nothing_while_a_send_many_is_under_way() {
        let (transport, listener) = listening_with(|c| c.with_ring_bytes(4096)).await;
        let client = transport.connect(listener.local_addr()).await.unwrap();
        let server = listener.accept().await.unwrap();
        let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
        // Nobody reads yet: 64 KiB (streamed through the ring: below the slab size) do not fit
        // in the 4 KiB ring, so after its first poll the send is under way.
        let big = || Frame::message(&b"big"[..], vec![Bytes::from(vec![7u8; 64 << 10])]);
        let small = || vec![Frame::message(&b"small"[..], vec![])];
        let mut send = client.send_many(vec![big()]);
        assert!(std::future::Future::poll(send.as_mut(), &mut cx).is_pending());
        let mut frames = small();
        assert!(client.try_send_now(&mut frames).is_none());
        assert_eq!(frames.len(), 1, "nothing taken while a send is under way");
        let (sent, got) = tokio::join!(send, server.recv());
        sent.unwrap();
        let got = got.unwrap();
        assert_eq!(&got.header[..], b"big");
        assert_eq!(got.payloads.len(), 1);
        assert!(got.payloads[0].len() == 64 << 10 && got.payloads[0].iter().all(|&b| b == 7));
        // The send ended: the next is written at once, after it.
        assert!(matches!(client.try_send_now(&mut frames), Some(Ok(()))));
        assert!(frames.is_empty());
        assert_eq!(&server.recv().await.unwrap().header[..], b"small");
        // A send dropped half-way puts the send side back, broken.
        let mut send = client.send_many(vec![big()]);
        assert!(std::future::Future::poll(send.as_mut(), &mut cx).is_pending());
        drop(send);
        let mut frames = small();
        let after = client.try_send_now(&mut frames);
        assert!(
            matches!(after, Some(Err(TransportError::Io { op: "sending", .. }))),
            "{after:?}"
        );
    }

    /// The reader (`into_frames`) takes the receive side with it: it gets every frame, in
    /// order, with no lock a frame, and a `recv` besides it fails with a typed error (it
    /// neither waits for ever nor takes the reader's frames).
    #[tokio::test]
    async fn the_reader_takes_the_receive_side_and_a_recv_besides_it_fails() {
        let (transport, listener) = listening().await;
        let client = transport.connect(listener.local_addr()).await.unwrap();
        let server: std::sync::Arc<dyn Connection> = listener.accept().await.unwrap().into();
        // Before the reader is made, `recv` works.
        client
            .send(Frame::message(Bytes::from_static(b"first"), vec![]))
            .await
            .unwrap();
        assert_eq!(&server.recv().await.unwrap().header[..], b"first");
        let mut frames = std::sync::Arc::clone(&server).into_frames();
        for (i, header) in [&b"one"[..], b"two"].into_iter().enumerate() {
            let payload = Bytes::from(vec![i as u8; 10]);
            client
                .send(Frame::message(Bytes::from(header), vec![payload.clone()]))
                .await
                .unwrap();
            if i == 1 {
                let err = server.recv().await.unwrap_err();
                assert!(
                    matches!(
                        err,
                        TransportError::Io {
                            op: "receiving",
                            ..
                        }
                    ),
                    "{err:?}"
                );
            }
            let frame = std::future::poll_fn(|cx| frames.poll_recv(cx))
                .await
                .unwrap();
            assert_eq!(
                (&frame.header[..], &frame.payloads[..]),
                (header, &[payload][..])
            );
        }
        client.close().await.unwrap();
        let end = std::future::poll_fn(|cx| frames.poll_recv(cx)).await;
        assert!(matches!(end, Err(TransportError::Closed { .. })), "{end:?}");
    }
}
