//! Challenge-response authentication on a shared cluster secret (sans-IO).
//!
//! Both sides prove that they know the [`ClusterSecret`] without sending it, each over a fresh
//! nonce of the other side, so a recorded handshake cannot be replayed and neither side can be
//! used as an oracle for the other's proof:
//!
//! ```text
//! connecting side (client)                               accepting side (server)
//!   HELLO     = "TWAUTH01" ‖ client_nonce          ─────▶
//!                                                  ◀─────  CHALLENGE = server_nonce ‖
//!                                                             HMAC(secret, "server" ‖ cn ‖ sn)
//!   checks the server's proof (constant time)
//!   PROOF     = HMAC(secret, "client" ‖ cn ‖ sn)   ─────▶
//!                                                          checks the client's proof
//!                                                  ◀─────  VERDICT = "TWAUTHOK"
//! ```
//!
//! A connecting side that runs without a secret (explicitly insecure) sends
//! [`insecure_hello`] instead; an accepting side without a secret answers it with the verdict
//! at once, one with a secret closes the connection (and vice versa), so a missing secret on
//! either side shows up as a failed handshake rather than as garbled frames.
//!
//! Nonces come from the caller (this crate has no random source). Messages have fixed lengths,
//! so a transport reads exactly [`HELLO_LEN`], [`CHALLENGE_LEN`], [`PROOF_LEN`] and
//! [`VERDICT_LEN`] bytes; it only moves them. A side that finds a wrong proof closes the
//! connection without a verdict; the connecting side then reports that authentication failed.
//! HMAC-SHA256 is RustCrypto's (`hmac`, `sha2`); proofs are compared with `subtle`.

use std::fmt;

use hmac::{Hmac, Mac};
use sha2::Sha256;
use subtle::ConstantTimeEq;

/// Length of a nonce in bytes.
pub const NONCE_LEN: usize = 32;
/// Length of an HMAC-SHA256 proof in bytes.
pub const MAC_LEN: usize = 32;
/// Magic and version at the start of HELLO.
pub const HELLO_MAGIC: [u8; 8] = *b"TWAUTH01";
/// Magic of HELLO from a connecting side that runs without a secret (explicitly insecure). It
/// lets both sides say clearly that one of them has no secret, instead of failing obscurely.
pub const HELLO_INSECURE_MAGIC: [u8; 8] = *b"TWNOAUTH";
/// The accepting side's verdict when the connecting side proved the secret.
pub const VERDICT_OK: [u8; 8] = *b"TWAUTHOK";
/// Length of HELLO (client to server).
pub const HELLO_LEN: usize = HELLO_MAGIC.len() + NONCE_LEN;
/// Length of CHALLENGE (server to client).
pub const CHALLENGE_LEN: usize = NONCE_LEN + MAC_LEN;
/// Length of PROOF (client to server).
pub const PROOF_LEN: usize = MAC_LEN;
/// Length of VERDICT (server to client).
pub const VERDICT_LEN: usize = VERDICT_OK.len();

/// A cluster secret. Its `Debug` output never shows the value.
#[derive(Clone)]
pub struct ClusterSecret(Vec<u8>);

impl ClusterSecret {
    /// A secret from its bytes; empty secrets are refused.
    pub fn new(secret: impl Into<Vec<u8>>) -> Result<Self, AuthError> {
        let secret = secret.into();
        if secret.is_empty() {
            return Err(AuthError::EmptySecret);
        }
        Ok(ClusterSecret(secret))
    }

    fn mac(&self, label: &[u8], client_nonce: &[u8], server_nonce: &[u8]) -> [u8; MAC_LEN] {
        // HMAC accepts keys of any length; new_from_slice cannot fail for it.
        let mut mac = <Hmac<Sha256> as Mac>::new_from_slice(&self.0)
            .unwrap_or_else(|_| unreachable!("HMAC takes keys of any length"));
        mac.update(b"tensorwire-auth-v1 ");
        mac.update(label);
        mac.update(client_nonce);
        mac.update(server_nonce);
        mac.finalize().into_bytes().into()
    }
}

impl fmt::Debug for ClusterSecret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("ClusterSecret(<redacted>)")
    }
}

/// Why a handshake failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum AuthError {
    /// An empty cluster secret was configured.
    #[error("the cluster secret is empty")]
    EmptySecret,
    /// HELLO did not start with [`HELLO_MAGIC`]: the peer is not a tensorwire client with
    /// authentication enabled.
    #[error("the peer did not start the authentication handshake (not a tensorwire peer, or one without a secret)")]
    NotAHandshake,
    /// The connecting side runs without a secret, but the accepting side requires one.
    #[error("the connecting side has no cluster secret, but this side requires one")]
    PeerHasNoSecret,
    /// The connecting side authenticates, but the accepting side runs without a secret.
    #[error("the connecting side authenticates with a cluster secret, but this side runs without one (insecure)")]
    PeerHasSecret,
    /// The accepting side's proof is wrong: it does not know the cluster secret.
    #[error("the accepting side does not know the cluster secret (its proof does not match)")]
    ServerProofMismatch,
    /// The connecting side's proof is wrong: it does not know the cluster secret.
    #[error("the connecting side does not know the cluster secret (its proof does not match)")]
    ClientProofMismatch,
    /// The accepting side answered with something other than [`VERDICT_OK`].
    #[error("the accepting side refused the handshake")]
    Refused,
}

/// HELLO of a connecting side that runs without a secret. An accepting side without a secret
/// answers it with [`VERDICT_OK`]; one with a secret closes the connection.
pub fn insecure_hello() -> [u8; HELLO_LEN] {
    let mut hello = [0u8; HELLO_LEN];
    hello[..HELLO_MAGIC.len()].copy_from_slice(&HELLO_INSECURE_MAGIC);
    hello
}

/// What a HELLO announces.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Hello {
    /// The connecting side authenticates; its nonce.
    Authenticated([u8; NONCE_LEN]),
    /// The connecting side runs without a secret.
    Insecure,
}

/// Reads a HELLO.
pub fn parse_hello(hello: &[u8; HELLO_LEN]) -> Result<Hello, AuthError> {
    let (magic, nonce) = hello.split_at(HELLO_MAGIC.len());
    if magic == HELLO_MAGIC {
        let mut n = [0u8; NONCE_LEN];
        n.copy_from_slice(nonce);
        Ok(Hello::Authenticated(n))
    } else if magic == HELLO_INSECURE_MAGIC {
        Ok(Hello::Insecure)
    } else {
        Err(AuthError::NotAHandshake)
    }
}

/// The connecting side of a handshake.
#[derive(Debug)]
pub struct ClientHandshake {
    secret: ClusterSecret,
    nonce: [u8; NONCE_LEN],
}

impl ClientHandshake {
    /// Starts a handshake with a fresh random `nonce`; returns it and HELLO to send.
    pub fn start(secret: ClusterSecret, nonce: [u8; NONCE_LEN]) -> (Self, [u8; HELLO_LEN]) {
        let mut hello = [0u8; HELLO_LEN];
        hello[..HELLO_MAGIC.len()].copy_from_slice(&HELLO_MAGIC);
        hello[HELLO_MAGIC.len()..].copy_from_slice(&nonce);
        (ClientHandshake { secret, nonce }, hello)
    }

    /// Checks the server's CHALLENGE; on success returns PROOF to send.
    pub fn handle_challenge(
        &self,
        challenge: &[u8; CHALLENGE_LEN],
    ) -> Result<[u8; PROOF_LEN], AuthError> {
        let (server_nonce, server_proof) = challenge.split_at(NONCE_LEN);
        let expected = self.secret.mac(b"server", &self.nonce, server_nonce);
        if !bool::from(expected.ct_eq(server_proof)) {
            return Err(AuthError::ServerProofMismatch);
        }
        Ok(self.secret.mac(b"client", &self.nonce, server_nonce))
    }

    /// Checks the server's VERDICT.
    pub fn handle_verdict(&self, verdict: &[u8; VERDICT_LEN]) -> Result<(), AuthError> {
        if verdict == &VERDICT_OK {
            Ok(())
        } else {
            Err(AuthError::Refused)
        }
    }
}

/// The accepting side of a handshake.
#[derive(Debug)]
pub struct ServerHandshake {
    secret: ClusterSecret,
    nonce: [u8; NONCE_LEN],
    client_nonce: Option<[u8; NONCE_LEN]>,
}

impl ServerHandshake {
    /// Prepares a handshake with a fresh random `nonce`.
    pub fn new(secret: ClusterSecret, nonce: [u8; NONCE_LEN]) -> Self {
        ServerHandshake {
            secret,
            nonce,
            client_nonce: None,
        }
    }

    /// Checks HELLO; returns CHALLENGE to send.
    pub fn handle_hello(
        &mut self,
        hello: &[u8; HELLO_LEN],
    ) -> Result<[u8; CHALLENGE_LEN], AuthError> {
        let cn = match parse_hello(hello)? {
            Hello::Authenticated(cn) => cn,
            Hello::Insecure => return Err(AuthError::PeerHasNoSecret),
        };
        self.client_nonce = Some(cn);
        let mut challenge = [0u8; CHALLENGE_LEN];
        challenge[..NONCE_LEN].copy_from_slice(&self.nonce);
        challenge[NONCE_LEN..].copy_from_slice(&self.secret.mac(b"server", &cn, &self.nonce));
        Ok(challenge)
    }

    /// Checks the client's PROOF; returns VERDICT to send. Without a prior HELLO, refuses.
    pub fn handle_proof(&self, proof: &[u8; PROOF_LEN]) -> Result<[u8; VERDICT_LEN], AuthError> {
        let Some(cn) = self.client_nonce else {
            return Err(AuthError::NotAHandshake);
        };
        let expected = self.secret.mac(b"client", &cn, &self.nonce);
        if bool::from(expected.ct_eq(proof)) {
            Ok(VERDICT_OK)
        } else {
            Err(AuthError::ClientProofMismatch)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn run(client: &[u8], server: &[u8], cn: [u8; 32], sn: [u8; 32]) -> Result<(), AuthError> {
        let (c, hello) = ClientHandshake::start(ClusterSecret::new(client).unwrap(), cn);
        let mut s = ServerHandshake::new(ClusterSecret::new(server).unwrap(), sn);
        let challenge = s.handle_hello(&hello)?;
        let proof = c.handle_challenge(&challenge)?;
        let verdict = s.handle_proof(&proof)?;
        c.handle_verdict(&verdict)
    }

    proptest! {
        #[test]
        fn same_secret_succeeds(secret in proptest::collection::vec(any::<u8>(), 1..64),
                                cn in any::<[u8; 32]>(), sn in any::<[u8; 32]>()) {
            prop_assert_eq!(run(&secret, &secret, cn, sn), Ok(()));
        }

        #[test]
        fn different_secrets_fail_at_the_client(a in proptest::collection::vec(any::<u8>(), 1..64),
                                                b in proptest::collection::vec(any::<u8>(), 1..64),
                                                cn in any::<[u8; 32]>(), sn in any::<[u8; 32]>()) {
            prop_assume!(a != b);
            prop_assert_eq!(run(&a, &b, cn, sn), Err(AuthError::ServerProofMismatch));
        }
    }

    #[test]
    fn a_client_without_the_secret_is_refused_by_the_server() {
        let mut s = ServerHandshake::new(ClusterSecret::new("right").unwrap(), [2; 32]);
        let (_, hello) = ClientHandshake::start(ClusterSecret::new("wrong").unwrap(), [1; 32]);
        s.handle_hello(&hello).unwrap();
        assert_eq!(
            s.handle_proof(&[0u8; PROOF_LEN]),
            Err(AuthError::ClientProofMismatch)
        );
        // A proof for other nonces (a replay) is refused too.
        let (c, _) = ClientHandshake::start(ClusterSecret::new("right").unwrap(), [1; 32]);
        let other = ServerHandshake::new(ClusterSecret::new("right").unwrap(), [3; 32]);
        let mut other = other;
        let ch = other.handle_hello(&hello).unwrap();
        let replayed = c.handle_challenge(&ch).unwrap();
        assert_eq!(
            s.handle_proof(&replayed),
            Err(AuthError::ClientProofMismatch)
        );
    }

    #[test]
    fn garbage_and_out_of_order_messages_are_refused() {
        let mut s = ServerHandshake::new(ClusterSecret::new("k").unwrap(), [0; 32]);
        assert_eq!(
            s.handle_proof(&[0; PROOF_LEN]),
            Err(AuthError::NotAHandshake)
        );
        assert_eq!(
            s.handle_hello(&[0x41; HELLO_LEN]),
            Err(AuthError::NotAHandshake)
        );
        let (c, _) = ClientHandshake::start(ClusterSecret::new("k").unwrap(), [0; 32]);
        assert_eq!(c.handle_verdict(&[0; VERDICT_LEN]), Err(AuthError::Refused));
    }

    #[test]
    fn secrets_never_print() {
        let s = ClusterSecret::new("hunter2").unwrap();
        assert!(!format!("{s:?}").contains("hunter2"));
        assert!(matches!(
            ClusterSecret::new(""),
            Err(AuthError::EmptySecret)
        ));
    }
}
