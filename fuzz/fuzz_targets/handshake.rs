//! Fuzzes the transports' cluster-secret handshake (`tensorwire_core::ports::handshake`, which
//! TCP and shm run; the decisions are `tensorwire_core::auth`), on either side, with or without
//! a secret, against a scripted peer: each message the side under test receives is arbitrary
//! bytes, the message an honest peer would send (with the same secret, another one, or none),
//! or the peer closing the connection.
//!
//! Must hold: no panic, every failure is `TransportError::Authentication` naming the peer, or
//! the channel's own error; and a side with a secret succeeds only when the peer's proof came
//! from an honest peer with the same secret, a side without one only with an insecure peer.
#![no_main]

use std::future::Future;
use std::net::SocketAddr;
use std::pin::pin;
use std::task::{Context, Poll, Waker};

use async_trait::async_trait;
use libfuzzer_sys::fuzz_target;
use tensorwire_core::auth::{
    self, ClientHandshake, ClusterSecret, Hello, ServerHandshake, CHALLENGE_LEN, HELLO_LEN,
    NONCE_LEN, PROOF_LEN, VERDICT_OK,
};
use tensorwire_core::ports::handshake::{
    authenticate_client, authenticate_server, handshake_failed, HandshakeChannel,
};
use tensorwire_core::ports::transport::TransportError;

const PEER: SocketAddr = SocketAddr::new(std::net::IpAddr::V4(std::net::Ipv4Addr::LOCALHOST), 4000);

/// The peer of the side under test, driven by the fuzz input.
struct Scripted<'a> {
    script: &'a [u8],
    /// What an honest peer knows: its secret (`None`: insecure) and its handshake state.
    honest_secret: Option<ClusterSecret>,
    client: Option<ClientHandshake>,
    server: Option<ServerHandshake>,
    /// What the side under test sent.
    sent: Vec<Vec<u8>>,
    /// What the side under test received, and whether it came from the honest peer.
    received: Vec<(Vec<u8>, bool)>,
    /// Whether the side under test is the accepting one.
    server_side: bool,
}

impl Scripted<'_> {
    /// The message an honest peer sends next, given what it received; `None`: it closes.
    fn honest_message(&mut self, len: usize, we_are_server: bool) -> Option<Vec<u8>> {
        if we_are_server {
            // The peer is a connecting side: HELLO, then PROOF.
            match (len, &self.honest_secret) {
                (HELLO_LEN, Some(s)) => {
                    let (hs, hello) = ClientHandshake::start(s.clone(), [7; NONCE_LEN]);
                    self.client = Some(hs);
                    Some(hello.to_vec())
                }
                (HELLO_LEN, None) => Some(auth::insecure_hello().to_vec()),
                (PROOF_LEN, _) => {
                    let challenge: [u8; CHALLENGE_LEN] =
                        self.sent.last()?.as_slice().try_into().ok()?;
                    self.client
                        .as_ref()?
                        .handle_challenge(&challenge)
                        .ok()
                        .map(|p| p.to_vec())
                }
                _ => None,
            }
        } else {
            // The peer is an accepting side: CHALLENGE (or VERDICT when insecure), then VERDICT.
            let hello: [u8; HELLO_LEN] = self.sent.first()?.as_slice().try_into().ok()?;
            match &self.honest_secret {
                None => match auth::parse_hello(&hello) {
                    Ok(Hello::Insecure) if len == VERDICT_OK.len() => Some(VERDICT_OK.to_vec()),
                    _ => None,
                },
                Some(s) if len == CHALLENGE_LEN => {
                    let mut hs = ServerHandshake::new(s.clone(), [9; NONCE_LEN]);
                    let challenge = hs.handle_hello(&hello).ok()?;
                    self.server = Some(hs);
                    Some(challenge.to_vec())
                }
                Some(_) => {
                    let proof: [u8; PROOF_LEN] = self.sent.last()?.as_slice().try_into().ok()?;
                    self.server
                        .as_ref()?
                        .handle_proof(&proof)
                        .ok()
                        .map(|v| v.to_vec())
                }
            }
        }
    }
}

#[async_trait]
impl HandshakeChannel for Scripted<'_> {
    fn peer(&self) -> SocketAddr {
        PEER
    }

    async fn recv(&mut self, buf: &mut [u8], closed: &str) -> Result<(), TransportError> {
        let we_are_server = self.server_side;
        let Some((&op, rest)) = self.script.split_first() else {
            return Err(handshake_failed(PEER, closed, None));
        };
        self.script = rest;
        match op % 3 {
            0 if self.script.len() >= buf.len() => {
                buf.copy_from_slice(&self.script[..buf.len()]);
                self.script = &self.script[buf.len()..];
                self.received.push((buf.to_vec(), false));
                Ok(())
            }
            1 => match self.honest_message(buf.len(), we_are_server) {
                Some(msg) => {
                    buf.copy_from_slice(&msg);
                    self.received.push((buf.to_vec(), true));
                    Ok(())
                }
                None => Err(handshake_failed(PEER, closed, None)),
            },
            _ => Err(handshake_failed(PEER, closed, None)),
        }
    }

    async fn send(&mut self, msg: &[u8]) -> Result<(), TransportError> {
        self.sent.push(msg.to_vec());
        Ok(())
    }
}

fn ready<F: Future>(fut: F) -> F::Output {
    match pin!(fut).poll(&mut Context::from_waker(Waker::noop())) {
        Poll::Ready(v) => v,
        Poll::Pending => panic!("the handshake waited on a channel that never waits"),
    }
}

fuzz_target!(|data: &[u8]| {
    let Some((&mode, script)) = data.split_first() else {
        return;
    };
    let server_side = mode & 1 != 0;
    let secret = ClusterSecret::new("fuzz-secret").unwrap();
    let ours = (mode & 2 != 0).then(|| secret.clone());
    let theirs = match (mode >> 2) % 3 {
        0 => Some(secret.clone()),
        1 => Some(ClusterSecret::new("another-secret").unwrap()),
        _ => None,
    };
    let same_secret = (mode >> 2) % 3 == 0;
    let mut ch = Scripted {
        script,
        honest_secret: theirs,
        client: None,
        server: None,
        sent: Vec::new(),
        received: Vec::new(),
        server_side,
    };
    let result = if server_side {
        ready(authenticate_server(&mut ch, ours.as_ref(), [3; NONCE_LEN]))
    } else {
        ready(authenticate_client(&mut ch, ours.as_ref(), [5; NONCE_LEN]))
    };
    match result {
        Ok(()) => match (server_side, ours.is_some()) {
            // The PROOF (second message received) came from the honest peer with our secret.
            (true, true) => {
                assert_eq!(ch.received.len(), 2);
                assert!(
                    ch.received[1].1 && same_secret,
                    "a forged proof was accepted"
                );
            }
            // Only an insecure HELLO gets in.
            (true, false) => {
                let hello: [u8; HELLO_LEN] = ch.received[0].0.as_slice().try_into().unwrap();
                assert_eq!(auth::parse_hello(&hello), Ok(Hello::Insecure));
            }
            // The CHALLENGE (first message received) came from the honest peer with our secret.
            (false, true) => {
                assert!(
                    ch.received[0].1 && same_secret,
                    "a forged challenge was accepted"
                );
            }
            (false, false) => {}
        },
        Err(TransportError::Authentication { peer, reason, .. }) => {
            assert_eq!(peer, PEER);
            assert!(!reason.is_empty());
        }
        Err(other) => panic!("unexpected error kind: {other}"),
    }
});
