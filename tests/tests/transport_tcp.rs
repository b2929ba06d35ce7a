//! The transport conformance suite, run for the TCP adapter.

use std::net::SocketAddr;
use std::sync::Arc;

use anyhow::{ensure, Context, Result};
use async_trait::async_trait;
use tensorwire_core::auth::{ClientHandshake, ClusterSecret, CHALLENGE_LEN, VERDICT_LEN};
use tensorwire_core::ports::transport::Transport;
use tensorwire_tests::transport_suite::{Harness, RawChannel};
use tensorwire_transport_tcp::{TcpConfig, TcpTransport};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

const SECRET: &str = "conformance-suite-secret";

fn secret(s: &str) -> ClusterSecret {
    ClusterSecret::new(s).expect("non-empty secret")
}

struct Tcp;

#[async_trait]
impl Harness for Tcp {
    fn transport(&self) -> Arc<dyn Transport> {
        Arc::new(TcpTransport::new(TcpConfig::new(secret(SECRET))).expect("config"))
    }

    fn foreign_transports(&self) -> Vec<(&'static str, Arc<dyn Transport>)> {
        vec![
            (
                "wrong secret",
                Arc::new(
                    TcpTransport::new(TcpConfig::new(secret("not-the-secret"))).expect("config"),
                ),
            ),
            (
                "no secret (insecure)",
                Arc::new(TcpTransport::new(TcpConfig::insecure()).expect("config")),
            ),
        ]
    }

    async fn raw_connect(&self, addr: SocketAddr) -> Result<Box<dyn RawChannel>> {
        let mut stream = TcpStream::connect(addr).await?;
        let nonce: [u8; 32] = std::array::from_fn(|i| i as u8 ^ 0x5a);
        let (hs, hello) = ClientHandshake::start(secret(SECRET), nonce);
        stream.write_all(&hello).await?;
        let mut challenge = [0u8; CHALLENGE_LEN];
        stream.read_exact(&mut challenge).await?;
        stream.write_all(&hs.handle_challenge(&challenge)?).await?;
        let mut verdict = [0u8; VERDICT_LEN];
        stream.read_exact(&mut verdict).await?;
        hs.handle_verdict(&verdict)?;
        Ok(Box::new(RawTcp(stream)))
    }

    async fn send_unauthenticated(&self, addr: SocketAddr, bytes: &[u8]) -> Result<()> {
        let mut stream = TcpStream::connect(addr).await?;
        // The listener may close before it has read everything; that is fine.
        let _ = stream.write_all(bytes).await;
        let _ = stream.shutdown().await;
        RawTcp(stream).closed_by_peer().await
    }
}

struct RawTcp(TcpStream);

#[async_trait]
impl RawChannel for RawTcp {
    async fn write(&mut self, bytes: &[u8]) -> Result<()> {
        self.0.write_all(bytes).await.context("raw write")
    }

    async fn closed_by_peer(&mut self) -> Result<()> {
        let mut buf = [0u8; 4096];
        let mut junk = 0usize;
        loop {
            match self.0.read(&mut buf).await {
                Ok(0) | Err(_) => return Ok(()),
                // A refusing listener sends at most a handshake message, never frames.
                Ok(n) => {
                    junk += n;
                    ensure!(
                        junk <= 64,
                        "the listener sent {junk} bytes instead of closing"
                    );
                }
            }
        }
    }

    async fn close(self: Box<Self>) -> Result<()> {
        drop(self);
        Ok(())
    }
}

tensorwire_tests::transport_conformance!(Tcp);
