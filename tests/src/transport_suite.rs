//! The transport conformance suite: one set of checks, generic over the
//! [`Transport`] port, run for every adapter.
//!
//! An adapter provides a [`Harness`] (how to build a transport that belongs to the cluster,
//! transports that do not, and a raw byte channel past authentication) and instantiates every
//! case with [`transport_conformance!`](crate::transport_conformance):
//!
//! ```ignore
//! tensorwire_tests::transport_conformance!(my_harness());
//! ```
//!
//! or calls the `async fn`s here one by one. Every wait is under a timeout, so a broken adapter
//! fails a test instead of hanging it.

use std::collections::BTreeSet;
use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{anyhow, bail, ensure, Context, Result};
use async_trait::async_trait;
use bytes::Bytes;
use tensorwire_core::ports::transport::{Connection, Listener, Transport, TransportError};
use tensorwire_core::wire::{encode_preamble, Frame, WireError, WireLimits, MAGIC, VERSION};

/// How long one step may take before a case fails.
pub const STEP: Duration = Duration::from_secs(30);
/// How long the biggest frames (256 MiB, debug build) may take.
pub const BIG_STEP: Duration = Duration::from_secs(180);

/// What the suite needs from an adapter.
#[async_trait]
pub trait Harness: Send + Sync + 'static {
    /// A transport that belongs to the cluster (right secret, certificate signed by the cluster
    /// CA). Two calls give two transports that accept each other.
    fn transport(&self) -> Arc<dyn Transport>;

    /// Transports that must be refused by [`transport`](Self::transport)'s listeners, each with
    /// a name for messages: wrong secret, missing secret, foreign certificate, ...
    fn foreign_transports(&self) -> Vec<(&'static str, Arc<dyn Transport>)>;

    /// A channel that passes authentication with `addr`'s listener and then carries raw bytes,
    /// for sending what a well-behaved transport never sends (TCP: the stream after the
    /// handshake; QUIC: a stream on an authenticated connection).
    async fn raw_connect(&self, addr: SocketAddr) -> Result<Box<dyn RawChannel>>;

    /// Sends `bytes` to the listener at `addr` without authenticating first, then returns once
    /// the listener has shown it will not go on with it (TCP: closed the connection).
    async fn send_unauthenticated(&self, addr: SocketAddr, bytes: &[u8]) -> Result<()>;
}

/// Raw bytes to a listener, past authentication.
#[async_trait]
pub trait RawChannel: Send {
    /// Writes `bytes`.
    async fn write(&mut self, bytes: &[u8]) -> Result<()>;

    /// Waits until the other side has closed the channel (reading gives end of stream, a reset,
    /// or the stream is stopped). The caller bounds it with a timeout.
    async fn closed_by_peer(&mut self) -> Result<()>;

    /// Closes the channel abruptly (TCP: drop the socket; QUIC: finish or reset the stream).
    async fn close(self: Box<Self>) -> Result<()>;
}

/// Runs `fut` under `limit`; a timeout is an error naming `what`.
pub async fn within<T>(limit: Duration, what: &str, fut: impl Future<Output = T>) -> Result<T> {
    tokio::time::timeout(limit, fut)
        .await
        .map_err(|_| anyhow!("timed out after {limit:?} while {what}"))
}

fn localhost() -> SocketAddr {
    SocketAddr::from(([127, 0, 0, 1], 0))
}

/// A listener of a cluster transport on an ephemeral loopback port.
pub async fn listen(h: &impl Harness) -> Result<Box<dyn Listener>> {
    within(STEP, "listening", h.transport().listen(localhost()))
        .await?
        .context("listen on 127.0.0.1:0")
}

/// Connects a fresh cluster transport to `listener` and accepts; returns (client, server).
pub async fn connect_pair(
    h: &impl Harness,
    listener: &dyn Listener,
) -> Result<(Arc<dyn Connection>, Arc<dyn Connection>)> {
    let transport = h.transport();
    let addr = listener.local_addr();
    let (client, server) = within(STEP, "connecting and accepting", async {
        tokio::join!(transport.connect(addr), listener.accept())
    })
    .await?;
    Ok((
        Arc::from(client.context("connect")?),
        Arc::from(server.context("accept")?),
    ))
}

fn pattern(len: usize, seed: u8) -> Bytes {
    // Bytes cycling through 251 values (a prime), so misplaced chunks do not compare equal.
    let period: Vec<u8> = (0..251u16).map(|i| (i as u8).wrapping_add(seed)).collect();
    let mut v = period.repeat(len / 251 + 1);
    v.truncate(len);
    Bytes::from(v)
}

fn numbered(seq: u32, payload_len: usize) -> Frame {
    Frame::message(
        Bytes::copy_from_slice(&seq.to_le_bytes()),
        vec![pattern(payload_len, seq as u8)],
    )
}

fn seq_of(frame: &Frame) -> Result<u32> {
    let bytes: [u8; 4] = frame.header[..]
        .try_into()
        .map_err(|_| anyhow!("header of {} bytes, expected 4", frame.header.len()))?;
    Ok(u32::from_le_bytes(bytes))
}

async fn recv(conn: &dyn Connection, what: &str) -> Result<Frame> {
    within(STEP, what, conn.recv())
        .await?
        .with_context(|| what.to_owned())
}

async fn send(conn: &dyn Connection, frame: Frame, what: &str) -> Result<()> {
    within(STEP, what, conn.send(frame))
        .await?
        .with_context(|| what.to_owned())
}

/// The listener still accepts a cluster peer, and a frame goes both ways.
pub async fn assert_listener_serves(h: &impl Harness, listener: &dyn Listener) -> Result<()> {
    let (client, server) = connect_pair(h, listener)
        .await
        .context("the listener no longer accepts cluster peers")?;
    send(&*client, numbered(7, 10), "sending after a bad peer").await?;
    let got = recv(&*server, "receiving after a bad peer").await?;
    ensure!(got == numbered(7, 10), "frame garbled after a bad peer");
    send(&*server, numbered(8, 10), "answering after a bad peer").await?;
    ensure!(recv(&*client, "receiving the answer").await? == numbered(8, 10));
    Ok(())
}

/// Frames sent one after the other arrive in order, per peer and in both directions, with two
/// peers on one listener at once.
pub async fn ordering_per_peer(h: impl Harness) -> Result<()> {
    const N: u32 = 300;
    let listener = listen(&h).await?;
    let mut pairs = Vec::new();
    for _ in 0..2 {
        pairs.push(connect_pair(&h, &*listener).await?);
    }
    let mut tasks = tokio::task::JoinSet::new();
    for (p, (client, server)) in pairs.into_iter().enumerate() {
        for (dir, from, to) in [
            ("up", client.clone(), server.clone()),
            ("down", server, client),
        ] {
            tasks.spawn(async move {
                let sender = tokio::spawn(async move {
                    for seq in 0..N {
                        send(
                            &*from,
                            numbered(seq, (seq as usize % 7) * 1000),
                            "sending in order",
                        )
                        .await?;
                    }
                    anyhow::Ok(())
                });
                for seq in 0..N {
                    let got = recv(&*to, "receiving in order").await?;
                    let got_seq = seq_of(&got)?;
                    ensure!(
                        got_seq == seq,
                        "peer {p} {dir}: frame {got_seq} arrived where {seq} was expected"
                    );
                    ensure!(
                        got == numbered(seq, (seq as usize % 7) * 1000),
                        "frame {seq} garbled"
                    );
                }
                sender.await??;
                anyhow::Ok(())
            });
        }
    }
    while let Some(res) = tasks.join_next().await {
        res??;
    }
    Ok(())
}

/// `send_many` puts batches on the wire in order and intact: small and large frames mixed,
/// batches of 1 to 200 frames, more segments than one vectored write takes.
pub async fn batches_keep_order(h: impl Harness) -> Result<()> {
    let listener = listen(&h).await?;
    let (client, server) = connect_pair(&h, &*listener).await?;
    let sizes = |seq: u32| match seq % 5 {
        0 => 0,
        1 => 7,
        2 => 70_000,
        3 => 1 << 20,
        _ => 300,
    };
    let sender = tokio::spawn(async move {
        let mut seq = 0u32;
        for batch in [1u32, 2, 3, 64, 65, 200, 5] {
            let frames: Vec<Frame> = (seq..seq + batch).map(|s| numbered(s, sizes(s))).collect();
            seq += batch;
            within(STEP, "send_many", client.send_many(frames)).await??;
        }
        anyhow::Ok(seq)
    });
    let total: u32 = [1u32, 2, 3, 64, 65, 200, 5].iter().sum();
    for seq in 0..total {
        let got = recv(&*server, "receiving a batched frame").await?;
        ensure!(
            seq_of(&got)? == seq,
            "batched frame {} arrived where {seq} was expected",
            seq_of(&got)?
        );
        ensure!(
            got == numbered(seq, sizes(seq)),
            "batched frame {seq} garbled"
        );
    }
    ensure!(sender.await?? == total);
    Ok(())
}

/// Frames of 0 bytes up to 256 MiB arrive intact; frames with many or empty payloads too.
pub async fn frame_sizes(h: impl Harness) -> Result<()> {
    let listener = listen(&h).await?;
    let (client, server) = connect_pair(&h, &*listener).await?;
    let shapes: Vec<Frame> = vec![
        Frame::message(Bytes::new(), vec![]),
        Frame::control(Bytes::from_static(b"only a header"), vec![]),
        Frame::message(
            Bytes::new(),
            vec![Bytes::new(), pattern(1, 1), Bytes::new()],
        ),
        Frame::message(
            pattern(100, 2),
            (0..50)
                .map(|i| pattern(i * 37, i as u8))
                .collect::<Vec<_>>(),
        ),
    ];
    for (i, frame) in shapes.into_iter().enumerate() {
        send(&*client, frame.clone(), "sending a frame shape").await?;
        ensure!(
            recv(&*server, "receiving a frame shape").await? == frame,
            "shape {i} garbled"
        );
    }
    for size in [1usize, 4096, 65_535, 65_536, (1 << 20) + 1, (16 << 20) + 3] {
        let frame = Frame::message(pattern(17, 3), vec![pattern(size, 9)]);
        let (sent, got) = tokio::join!(
            send(&*client, frame.clone(), "sending a large frame"),
            recv(&*server, "receiving a large frame")
        );
        sent?;
        ensure!(
            got? == frame,
            "frame with a payload of {size} bytes garbled"
        );
        // And back.
        let (sent, got) = tokio::join!(
            send(&*server, frame.clone(), "echoing a large frame"),
            recv(&*client, "receiving an echoed large frame")
        );
        sent?;
        ensure!(
            got? == frame,
            "echoed frame with a payload of {size} bytes garbled"
        );
    }
    let size = 256 << 20;
    let frame = Frame::message(pattern(5, 4), vec![pattern(size, 11)]);
    let (sent, got) = within(BIG_STEP, "moving a 256 MiB frame", async {
        tokio::join!(client.send(frame.clone()), server.recv())
    })
    .await?;
    sent.context("sending 256 MiB")?;
    let got = got.context("receiving 256 MiB")?;
    ensure!(
        got.payloads.len() == 1 && got.payloads[0].len() == size,
        "256 MiB frame has the wrong shape"
    );
    ensure!(got == frame, "256 MiB frame garbled");
    Ok(())
}

/// 1,000 frames sent concurrently on one connection all arrive, intact, exactly once.
pub async fn concurrent_in_flight(h: impl Harness) -> Result<()> {
    const N: u32 = 1000;
    let listener = listen(&h).await?;
    let (client, server) = connect_pair(&h, &*listener).await?;
    let receiver = tokio::spawn(async move {
        let mut seen = BTreeSet::new();
        for _ in 0..N {
            let frame = recv(&*server, "receiving concurrent frames").await?;
            let seq = seq_of(&frame)?;
            ensure!(
                frame == numbered(seq, seq as usize * 3),
                "frame {seq} garbled"
            );
            ensure!(seen.insert(seq), "frame {seq} arrived twice");
        }
        anyhow::Ok(seen)
    });
    let mut senders = tokio::task::JoinSet::new();
    for seq in 0..N {
        let client = client.clone();
        senders.spawn(async move { client.send(numbered(seq, seq as usize * 3)).await });
    }
    within(STEP, "sending 1,000 concurrent frames", async {
        while let Some(res) = senders.join_next().await {
            res??;
        }
        anyhow::Ok(())
    })
    .await??;
    let seen = within(STEP, "receiving 1,000 concurrent frames", receiver).await???;
    ensure!(
        seen == (0..N).collect::<BTreeSet<_>>(),
        "some frames never arrived"
    );
    Ok(())
}

/// A peer that goes away in the middle of a frame gives the other side an error, not a hang;
/// a peer that goes away while we send gives the sender an error.
pub async fn peer_closes_mid_frame(h: impl Harness) -> Result<()> {
    let listener = listen(&h).await?;
    // The peer announces a 1 MiB payload, sends 1,000 bytes of it, and closes.
    let frame = Frame::message(Bytes::from_static(b"cut"), vec![pattern(1 << 20, 0)]);
    let preamble = encode_preamble(&frame, &WireLimits::default())?;
    let addr = listener.local_addr();
    let (raw, server) = within(STEP, "raw connect and accept", async {
        tokio::join!(h.raw_connect(addr), listener.accept())
    })
    .await?;
    let mut raw = raw?;
    let server = server?;
    raw.write(&preamble).await?;
    raw.write(b"cut").await?;
    raw.write(&frame.payloads[0][..1000]).await?;
    raw.close().await?;
    match within(STEP, "receiving a cut-off frame", server.recv()).await? {
        Err(TransportError::ClosedMidFrame { peer, source }) => {
            ensure!(
                peer == server.peer_addr(),
                "error names {peer}, not the peer"
            );
            ensure!(
                matches!(source, WireError::Truncated { .. }),
                "unexpected cause {source}"
            );
        }
        Err(other) => bail!("a cut-off frame gave {other}, expected ClosedMidFrame"),
        Ok(f) => bail!("a cut-off frame was delivered: {:?}", f.header),
    }

    // The receiver goes away while we send large frames: send fails, no hang.
    let (client, server) = connect_pair(&h, &*listener).await?;
    drop(server);
    let big = Frame::message(Bytes::new(), vec![pattern(4 << 20, 1)]);
    let outcome = within(STEP, "sending to a peer that went away", async {
        for _ in 0..1000 {
            client.send(big.clone()).await?;
        }
        Ok::<(), TransportError>(())
    })
    .await?;
    ensure!(
        outcome.is_err(),
        "1,000 frames of 4 MiB went to a closed peer without an error"
    );
    let got = within(STEP, "receiving from a peer that went away", client.recv()).await?;
    ensure!(got.is_err(), "received a frame from a peer that went away");
    assert_listener_serves(&h, &*listener).await
}

/// A clean close between frames gives [`TransportError::Closed`] after the frames sent.
pub async fn clean_close(h: impl Harness) -> Result<()> {
    let listener = listen(&h).await?;
    let (client, server) = connect_pair(&h, &*listener).await?;
    send(&*client, numbered(1, 100), "sending before closing").await?;
    within(STEP, "closing", client.close()).await??;
    ensure!(recv(&*server, "receiving before the close").await? == numbered(1, 100));
    match within(STEP, "receiving the close", server.recv()).await? {
        Err(e) if e.is_clean_close() => {}
        Err(e) => bail!("clean close gave {e}, expected Closed"),
        Ok(_) => bail!("a frame arrived after the close"),
    }
    // The other direction still works until the server closes too.
    send(&*server, numbered(2, 10), "sending to a half-closed peer").await?;
    ensure!(recv(&*client, "receiving on a half-closed connection").await? == numbered(2, 10));
    Ok(())
}

async fn bad_bytes_are_refused(
    h: &impl Harness,
    listener: &dyn Listener,
    bytes: &[u8],
    check: impl Fn(&WireError) -> bool,
    what: &str,
) -> Result<()> {
    let addr = listener.local_addr();
    let (raw, server) = within(STEP, "raw connect and accept", async {
        tokio::join!(h.raw_connect(addr), listener.accept())
    })
    .await?;
    let mut raw = raw?;
    let server = server?;
    raw.write(bytes).await?;
    match within(STEP, "receiving bad bytes", server.recv()).await? {
        Err(TransportError::Wire { source, .. }) if check(&source) => {}
        Err(e) => bail!("{what} gave {e}, expected another wire error"),
        Ok(f) => bail!("{what} was delivered as a frame: {:?}", f.header),
    }
    within(
        STEP,
        "waiting for the connection to be closed",
        raw.closed_by_peer(),
    )
    .await?
    .with_context(|| format!("after {what}"))?;
    // Later receives fail too, at once.
    ensure!(within(STEP, "receiving again", server.recv())
        .await?
        .is_err());
    Ok(())
}

/// Garbage after authentication: that connection is closed, the listener keeps serving.
/// Garbage instead of authentication: refused, the listener keeps serving.
pub async fn garbage_is_refused(h: impl Harness) -> Result<()> {
    let listener = listen(&h).await?;
    let mut garbage = pattern(4096, 77).to_vec();
    garbage[..4].copy_from_slice(b"GET ");
    bad_bytes_are_refused(
        &h,
        &*listener,
        &garbage,
        |e| matches!(e, WireError::BadMagic { .. }),
        "garbage",
    )
    .await?;
    assert_listener_serves(&h, &*listener).await?;
    within(
        STEP,
        "sending garbage without authenticating",
        h.send_unauthenticated(listener.local_addr(), &garbage),
    )
    .await??;
    within(
        STEP,
        "sending nothing without authenticating",
        h.send_unauthenticated(listener.local_addr(), b""),
    )
    .await??;
    assert_listener_serves(&h, &*listener).await
}

/// Length prefixes over the limits close the connection before anything is allocated; the
/// listener keeps serving.
pub async fn oversized_lengths_are_refused(h: impl Harness) -> Result<()> {
    let listener = listen(&h).await?;
    let prefix = |table_len: u32, body_len: u64| {
        let mut v = MAGIC.to_vec();
        v.extend_from_slice(&[VERSION, 1, 0, 0]);
        v.extend_from_slice(&table_len.to_le_bytes());
        v.extend_from_slice(&body_len.to_le_bytes());
        v
    };
    bad_bytes_are_refused(
        &h,
        &*listener,
        &prefix(2, u64::MAX),
        |e| matches!(e, WireError::FrameTooLarge { len: u64::MAX, .. }),
        "a body length of 2^64-1",
    )
    .await?;
    bad_bytes_are_refused(
        &h,
        &*listener,
        &prefix(2, (1 << 30) + 1),
        |e| matches!(e, WireError::FrameTooLarge { .. }),
        "a body length of 1 GiB + 1",
    )
    .await?;
    bad_bytes_are_refused(
        &h,
        &*listener,
        &prefix(u32::MAX, 1 << 29),
        |e| matches!(e, WireError::FrameHeaderTooLarge { .. }),
        "a frame-header length of 4 GiB",
    )
    .await?;
    assert_listener_serves(&h, &*listener).await
}

/// Peers without the cluster's credentials are refused with an authentication error; the
/// listener never hands them out and keeps serving.
pub async fn foreign_peers_are_refused(h: impl Harness) -> Result<()> {
    let listener = listen(&h).await?;
    let foreign = h.foreign_transports();
    ensure!(
        !foreign.is_empty(),
        "the harness names no foreign transports"
    );
    for (name, transport) in foreign {
        let outcome = within(
            STEP,
            "connecting with foreign credentials",
            transport.connect(listener.local_addr()),
        )
        .await?;
        match outcome {
            Err(TransportError::Authentication { reason, .. }) => {
                ensure!(!reason.is_empty(), "{name}: empty reason");
            }
            Err(e) => bail!("{name}: refused with {e}, expected an authentication error"),
            Ok(conn) => {
                // Some stacks (TLS 1.3) only learn of the refusal on first use.
                let used = within(STEP, "using a refused connection", async {
                    conn.send(numbered(0, 1)).await?;
                    conn.recv().await
                })
                .await?;
                match used {
                    Err(TransportError::Authentication { .. }) => {}
                    Err(e) => bail!("{name}: connection refused late with {e}, expected an authentication error"),
                    Ok(_) => bail!("{name}: a peer with foreign credentials got a frame through"),
                }
            }
        }
        // The next accepted connection is a cluster peer's, not the foreign one.
        assert_listener_serves(&h, &*listener)
            .await
            .with_context(|| format!("after refusing {name}"))?;
    }
    Ok(())
}

/// Instantiates every case of the conformance suite as a `#[tokio::test]` for a harness
/// expression (evaluated once per case).
#[macro_export]
macro_rules! transport_conformance {
    ($harness:expr) => {
        $crate::transport_conformance!(@case $harness;
            ordering_per_peer, batches_keep_order, frame_sizes, concurrent_in_flight, peer_closes_mid_frame,
            clean_close, garbage_is_refused, oversized_lengths_are_refused,
            foreign_peers_are_refused);
    };
    (@case $harness:expr; $($case:ident),*) => {
        $(
            #[::tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn $case() -> ::anyhow::Result<()> {
                $crate::transport_suite::$case($harness).await
            }
        )*
    };
}
