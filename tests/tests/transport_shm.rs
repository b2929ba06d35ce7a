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

/// The harness: every frame through the ring (the default), or frames of `segment_min` bytes
/// and more through sealed segments.
struct Shm {
    segment_min: usize,
}

#[async_trait]
impl Harness for Shm {
    fn transport(&self) -> Arc<dyn Transport> {
        Arc::new(
            ShmTransport::new(ShmConfig::new(secret(SECRET)).with_segment_min(self.segment_min))
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
        segment_min: usize::MAX
    });
}

/// Frames of 64 KiB and more go through sealed memfd segments.
mod segments {
    use super::*;
    tensorwire_tests::transport_conformance!(Shm {
        segment_min: 64 << 10
    });
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
