//! The transport conformance suite, run for the shared-memory adapter; and a peer process killed
//! in the middle of a frame.

use std::io::BufRead;
use std::net::SocketAddr;
use std::sync::Arc;

use anyhow::{bail, ensure, Context, Result};
use async_trait::async_trait;
use bytes::Bytes;
use tensorwire_core::auth::ClusterSecret;
use tensorwire_core::ports::transport::{Transport, TransportError};
use tensorwire_core::wire::{encode_preamble, Frame, WireError, WireLimits};
use tensorwire_tests::transport_suite::{within, Harness, RawChannel, STEP};
use tensorwire_transport_shm::testing::{self, RawPeer};
use tensorwire_transport_shm::{ShmConfig, ShmTransport};

const SECRET: &str = "conformance-suite-secret";

fn secret(s: &str) -> ClusterSecret {
    ClusterSecret::new(s).expect("non-empty secret")
}

fn cluster() -> ShmTransport {
    ShmTransport::new(ShmConfig::new(secret(SECRET))).expect("config")
}

/// The harness: every frame through the ring, frames of `slab_min` bytes and more through
/// reused slabs, or frames of `segment_min` bytes and more through sealed segments.
struct Shm {
    segment_min: usize,
    slab_min: usize,
}

#[async_trait]
impl Harness for Shm {
    fn transport(&self) -> Arc<dyn Transport> {
        Arc::new(
            ShmTransport::new(
                ShmConfig::new(secret(SECRET))
                    .with_segment_min(self.segment_min)
                    .with_slab_min(self.slab_min),
            )
            .expect("config"),
        )
    }

    fn foreign_transports(&self) -> Vec<(&'static str, Arc<dyn Transport>)> {
        vec![
            (
                "wrong secret",
                Arc::new(
                    ShmTransport::new(ShmConfig::new(secret("not-the-secret"))).expect("config"),
                ),
            ),
            (
                "no secret (insecure)",
                Arc::new(ShmTransport::new(ShmConfig::insecure()).expect("config")),
            ),
        ]
    }

    async fn raw_connect(&self, addr: SocketAddr) -> Result<Box<dyn RawChannel>> {
        Ok(Box::new(RawShm(RawPeer::connect(&cluster(), addr).await?)))
    }

    async fn send_unauthenticated(&self, addr: SocketAddr, bytes: &[u8]) -> Result<()> {
        Ok(testing::send_unauthenticated(addr, bytes).await?)
    }
}

struct RawShm(RawPeer);

#[async_trait]
impl RawChannel for RawShm {
    async fn write(&mut self, bytes: &[u8]) -> Result<()> {
        Ok(self.0.write(bytes).await?)
    }

    async fn closed_by_peer(&mut self) -> Result<()> {
        self.0.closed_by_peer().await;
        Ok(())
    }

    async fn close(self: Box<Self>) -> Result<()> {
        drop(self);
        Ok(())
    }
}

/// Every frame streams through the ring.
mod ring {
    use super::*;
    tensorwire_tests::transport_conformance!(Shm {
        segment_min: usize::MAX,
        slab_min: usize::MAX,
    });
}

/// Frames of 64 KiB and more go through reused slabs (while one is free).
mod slabs {
    use super::*;
    tensorwire_tests::transport_conformance!(Shm {
        segment_min: usize::MAX,
        slab_min: 64 << 10,
    });
}

/// Frames of 64 KiB and more go through sealed memfd segments.
mod segments {
    use super::*;
    tensorwire_tests::transport_conformance!(Shm {
        segment_min: 64 << 10,
        slab_min: usize::MAX,
    });
}

/// `len` bytes cycling through 251 values from `seed`.
fn pattern(len: usize, seed: u8) -> Bytes {
    (0..len)
        .map(|i| ((i % 251) as u8).wrapping_add(seed))
        .collect::<Vec<u8>>()
        .into()
}

/// A receiver that keeps the payloads of large frames while the sender sends more: what it keeps
/// never changes (the sender writes a slab again only once the receiver dropped every byte of
/// it), whether the next frames find a free slab, a new one, or (the budget spent) the ring.
#[tokio::test]
async fn payloads_a_receiver_keeps_are_never_overwritten() -> Result<()> {
    // Room for two slabs of 2 MiB: frames of 1 MiB and more go in slabs while one is free.
    let transport = ShmTransport::new(
        ShmConfig::new(secret(SECRET))
            .with_slab_min(64 << 10)
            .with_slab_bytes(4 << 20),
    )?;
    let listener = transport.listen(([127, 0, 0, 1], 0).into()).await?;
    let (client, server) =
        tokio::join!(transport.connect(listener.local_addr()), listener.accept());
    let (client, server) = (client?, server?);
    let mut kept: Vec<(u8, Bytes)> = Vec::new();
    for round in 0..40u8 {
        let payload = pattern((1 << 20) + usize::from(round) * 4099, round);
        let frame = Frame::message(Bytes::from(vec![round]), vec![payload.clone()]);
        let (sent, got) = within(STEP, "moving a large frame", async {
            tokio::join!(client.send(frame), server.recv())
        })
        .await?;
        sent?;
        let got = got?;
        ensure!(got.header[..] == [round], "round {round}: header garbled");
        ensure!(got.payloads[0] == payload, "round {round}: payload garbled");
        // Keep every third payload for a while, some to the end.
        if round % 3 == 0 {
            kept.push((round, got.payloads[0].clone()));
        }
        if round % 7 == 6 {
            kept.retain(|(r, _)| r % 2 == 0);
        }
        for (r, bytes) in &kept {
            let expected = pattern((1 << 20) + usize::from(*r) * 4099, *r);
            ensure!(
                *bytes == expected,
                "the payload of round {r}, kept by the receiver, changed by round {round}"
            );
        }
        drop(got);
    }
    Ok(())
}

/// A large payload received in a slab is given out writable without a copy: a private
/// (copy-on-write) view of its pages, 64-aligned whatever precedes it in the frame. Writes
/// through the view change neither the received bytes nor what a later frame in the same slab
/// carries; small payloads and bytes not in a slab get no view.
#[tokio::test]
async fn a_private_view_of_a_slab_payload_is_writable_and_private() -> Result<()> {
    use tensorwire_transport_shm::{private_view, PRIVATE_VIEW_MIN};
    let transport = ShmTransport::new(ShmConfig::new(secret(SECRET)).with_slab_min(64 << 10))?;
    let listener = transport.listen(([127, 0, 0, 1], 0).into()).await?;
    let (client, server) =
        tokio::join!(transport.connect(listener.local_addr()), listener.accept());
    let (client, server) = (client?, server?);
    for round in 0..6u8 {
        // Headers and a first payload of odd lengths, so that the large payload would start
        // anywhere if the sender did not place the frame.
        let header = Bytes::from(vec![round; 1 + usize::from(round) * 7]);
        let small = pattern(13 + usize::from(round), round);
        let large = pattern((2 << 20) + usize::from(round) * 3, round);
        let frame = Frame::message(header, vec![small.clone(), large.clone()]);
        let (sent, got) = within(STEP, "moving a large frame", async {
            tokio::join!(client.send(frame), server.recv())
        })
        .await?;
        sent?;
        let got = got?;
        ensure!(
            private_view(&got.payloads[0]).is_none(),
            "a view of {} bytes",
            small.len()
        );
        ensure!(small.len() < PRIVATE_VIEW_MIN);
        let view = private_view(&got.payloads[1]).context("no view of a slab payload")?;
        ensure!(
            view.as_mut_ptr() as usize % 64 == 0,
            "round {round}: view not 64-aligned"
        );
        ensure!(view.len() == large.len());
        // SAFETY: the view is `len` writable bytes of ours while it lives.
        let bytes = unsafe { std::slice::from_raw_parts_mut(view.as_mut_ptr(), view.len()) };
        ensure!(
            *bytes == large[..],
            "round {round}: the view reads other bytes"
        );
        bytes
            .iter_mut()
            .step_by(4096)
            .for_each(|b| *b = b.wrapping_add(1));
        ensure!(
            got.payloads[1] == large,
            "round {round}: a write through the view leaked"
        );
        ensure!(
            bytes[0] == large[0].wrapping_add(1),
            "round {round}: the write was lost"
        );
        drop(got);
        drop(view);
    }
    // Bytes of this process's own get no view.
    ensure!(private_view(&pattern(1 << 20, 0)).is_none());
    Ok(())
}

/// A sender whose slab budget is larger than the receiver's (as a hostile peer's may be):
/// the receiver maps the peer's slabs only up to its own budget, then refuses the connection
/// naming it, instead of mapping whatever the sender makes.
#[tokio::test]
async fn a_receiver_maps_slabs_only_within_its_own_budget() -> Result<()> {
    let config = |budget: usize| {
        ShmConfig::new(secret(SECRET))
            .with_slab_min(64 << 10)
            .with_slab_bytes(budget)
    };
    let sender = ShmTransport::new(config(64 << 20))?;
    let receiver = ShmTransport::new(config(4 << 20))?;
    let listener = receiver.listen(([127, 0, 0, 1], 0).into()).await?;
    let (client, server) = tokio::join!(sender.connect(listener.local_addr()), listener.accept());
    let (client, server) = (client?, server?);
    // The receiver keeps every payload, so each frame needs a new slab of about 2 MiB.
    let mut kept = Vec::new();
    for round in 0..4u8 {
        let frame = Frame::message(Bytes::new(), vec![pattern(2 << 20, round)]);
        let (sent, got) = within(STEP, "moving a large frame", async {
            tokio::join!(client.send(frame), server.recv())
        })
        .await?;
        sent?;
        match got {
            Ok(frame) => kept.push(frame),
            Err(TransportError::Wire {
                source: WireError::MalformedHeader { reason },
                ..
            }) => {
                ensure!(reason.contains("slab budget"), "{reason}");
                ensure!(!kept.is_empty(), "refused the first slab");
                return Ok(());
            }
            Err(e) => bail!("round {round}: {e}"),
        }
    }
    bail!(
        "the receiver mapped {} slabs of 2 MiB within a budget of 4 MiB",
        kept.len()
    )
}

/// Set in the child process of `a_killed_sender_leaves_what_it_sent_readable`.
const SLAB_CHILD_ENV: &str = "TW_SHM_TEST_SLAB_SENDER_ADDR";

/// The child's part: sends one 8 MiB frame (through a slab), says so, waits to be killed.
#[tokio::test]
async fn slab_sender_child() -> Result<()> {
    let Ok(addr) = std::env::var(SLAB_CHILD_ENV) else {
        return Ok(()); // Only meaningful as the child of the test below.
    };
    let conn = cluster().connect(addr.parse()?).await?;
    conn.send(Frame::message(
        Bytes::from_static(b"slab"),
        vec![pattern(8 << 20, 42)],
    ))
    .await?;
    println!("READY");
    std::future::pending::<()>().await;
    Ok(())
}

/// A sender killed (SIGKILL) after sending a large frame: the frame's bytes, which live in the
/// dead process's slab, stay readable and unchanged; the next receive is an error, not a hang.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_sender_leaves_what_it_sent_readable() -> Result<()> {
    let transport = cluster();
    let listener = transport.listen(([127, 0, 0, 1], 0).into()).await?;
    let mut child = std::process::Command::new(std::env::current_exe()?)
        .args([
            "--exact",
            "slab_sender_child",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(SLAB_CHILD_ENV, listener.local_addr().to_string())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .context("starting the peer process")?;
    let server = within(STEP, "accepting the peer process", listener.accept()).await??;
    let frame = within(STEP, "receiving the large frame", server.recv()).await??;
    let stdout = child.stdout.take().context("child stdout")?;
    let ready = tokio::task::spawn_blocking(move || {
        std::io::BufReader::new(stdout)
            .lines()
            .map_while(Result::ok)
            .any(|line| line.contains("READY"))
    });
    ensure!(
        within(STEP, "waiting for the peer", ready).await??,
        "the peer process did not send its frame"
    );
    child.kill()?;
    child.wait()?;
    match within(STEP, "receiving from a killed peer", server.recv()).await? {
        Err(TransportError::Closed { .. } | TransportError::Io { .. }) => {}
        Err(e) => bail!("a killed peer gave {e}, expected Closed"),
        Ok(_) => bail!("a second frame arrived from a killed peer"),
    }
    ensure!(
        frame.header[..] == *b"slab" && frame.payloads[0] == pattern(8 << 20, 42),
        "the frame of a killed sender changed"
    );
    Ok(())
}

/// Set in the child process of `a_killed_peer_gives_an_error_not_a_hang`: the listener to cut a
/// frame on.
const CHILD_ENV: &str = "TW_SHM_TEST_KILLED_PEER_ADDR";

/// The child's part: connects past authentication, writes half of a 1 MiB frame into the ring,
/// says so on standard output, and waits to be killed.
#[tokio::test]
async fn killed_peer_child() -> Result<()> {
    let Ok(addr) = std::env::var(CHILD_ENV) else {
        return Ok(()); // Only meaningful as the child of the test below.
    };
    let raw = RawPeer::connect(&cluster(), addr.parse()?).await?;
    let frame = Frame::message(
        Bytes::from_static(b"cut"),
        vec![Bytes::from(vec![5u8; 1 << 20])],
    );
    raw.write(&encode_preamble(&frame, &WireLimits::default())?)
        .await?;
    raw.write(b"cut").await?;
    raw.write(&frame.payloads[0][..1000]).await?;
    println!("READY");
    std::future::pending::<()>().await;
    Ok(())
}

/// A peer process killed (SIGKILL) in the middle of a frame: the receiver gets ClosedMidFrame,
/// not a hang; a sender to it gets an error.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_peer_gives_an_error_not_a_hang() -> Result<()> {
    let transport = cluster();
    let listener = transport.listen(([127, 0, 0, 1], 0).into()).await?;
    let mut child = std::process::Command::new(std::env::current_exe()?)
        .args([
            "--exact",
            "killed_peer_child",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(CHILD_ENV, listener.local_addr().to_string())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .context("starting the peer process")?;
    let server = within(STEP, "accepting the peer process", listener.accept()).await??;
    let stdout = child.stdout.take().context("child stdout")?;
    let ready = tokio::task::spawn_blocking(move || {
        std::io::BufReader::new(stdout)
            .lines()
            .map_while(Result::ok)
            .any(|line| line.contains("READY"))
    });
    let ready = within(STEP, "waiting for the peer to write half a frame", ready).await??;
    ensure!(ready, "the peer process did not get to write half a frame");
    child.kill()?;
    child.wait()?;
    match within(STEP, "receiving from a killed peer", server.recv()).await? {
        Err(TransportError::ClosedMidFrame { peer, source }) => {
            ensure!(peer == server.peer_addr(), "the error names {peer}");
            ensure!(
                matches!(source, WireError::Truncated { .. }),
                "cause {source}"
            );
        }
        Err(e) => bail!("a killed peer gave {e}, expected ClosedMidFrame"),
        Ok(_) => bail!("a frame arrived from a killed peer"),
    }
    let sent = within(
        STEP,
        "sending to a killed peer",
        server.send(Frame::message(Bytes::from_static(b"x"), vec![])),
    )
    .await?;
    ensure!(sent.is_err(), "a send to a killed peer succeeded");
    Ok(())
}
