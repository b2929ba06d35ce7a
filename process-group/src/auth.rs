//! The optional cluster secret of the TCP store: a challenge-response step before c10d's
//! `VALIDATE`.
//!
//! # Protocol
//!
//! When the server has a secret, the first bytes a client sends must be tensorwire's
//! [`AUTH_HELLO`](crate::wire::AUTH_HELLO) query (`0xA5`, outside c10d's query range) with a
//! fresh 32-byte client nonce `cn`:
//!
//! 1. client → server: `0xA5`, `cn`
//! 2. server → client: status `0`, a fresh 32-byte server nonce `sn`,
//!    `HMAC-SHA256(secret, "tensorwire-store-v1 server" ‖ cn ‖ sn)`.
//!    (A server without a secret answers status `1` and keeps the connection unauthenticated.)
//! 3. the client checks the server's MAC (so a client with a secret never talks to a store that
//!    does not know it), then sends `0xA6`, `HMAC-SHA256(secret, "tensorwire-store-v1 client" ‖ cn ‖ sn)`
//! 4. server → client: status `0` (accepted) or `2` (rejected, then the server closes).
//!
//! MACs are compared in constant time. The server nonce makes every proof single-use, so a
//! recorded handshake cannot be replayed. After step 4 the c10d protocol proceeds as usual
//! (`VALIDATE`, `PING`, ...). The secret authenticates peers; it does not encrypt the traffic.
//!
//! # PyTorch clients
//!
//! PyTorch's `TCPStore` cannot perform this step: its first query is `VALIDATE`. A server with a
//! secret therefore refuses it (closes the connection and logs why), and PyTorch reports a
//! network error after its retries. To mix PyTorch and tensorwire ranks in one job, run the
//! store without a secret, on a trusted network. Likewise a tensorwire client with a secret
//! refuses a server without one, and gets no answer at all from PyTorch's server (its handshake
//! times out with an error that says so).

use hmac::{Hmac, Mac};
use sha2::Sha256;
use subtle::ConstantTimeEq;

use crate::wire::AUTH_LEN;

/// Status byte: the challenge follows / the proof is accepted.
pub(crate) const STATUS_OK: u8 = 0;
/// Status byte: this server has no secret.
pub(crate) const STATUS_NO_SECRET: u8 = 1;
/// Status byte: the proof was wrong.
pub(crate) const STATUS_REJECTED: u8 = 2;

/// Four bytes a server with a secret sends to a client that did not authenticate, just before
/// closing. They arrive where a c10d client expects its `PING` echo: tensorwire's client
/// recognises them and fails at once with "the store requires a cluster secret" instead of
/// retrying; PyTorch's client reports a ping mismatch. (No process id reaches this value.)
pub(crate) const AUTH_REQUIRED_MARKER: u32 = 0xA5A5_0A17;

const SERVER_LABEL: &[u8] = b"tensorwire-store-v1 server";
const CLIENT_LABEL: &[u8] = b"tensorwire-store-v1 client";

/// A cluster secret shared by the store server and its clients.
#[derive(Clone)]
pub struct Secret(Vec<u8>);

impl Secret {
    /// A secret from bytes (for example read from a file or an environment variable).
    ///
    /// An empty secret is refused: it would authenticate anyone.
    pub fn new(bytes: impl Into<Vec<u8>>) -> Option<Self> {
        let bytes = bytes.into();
        (!bytes.is_empty()).then_some(Secret(bytes))
    }

    fn mac(&self, label: &[u8], client_nonce: &[u8], server_nonce: &[u8]) -> [u8; AUTH_LEN] {
        let mut mac = <Hmac<Sha256> as Mac>::new_from_slice(&self.0)
            .expect("HMAC accepts keys of any length");
        mac.update(label);
        mac.update(client_nonce);
        mac.update(server_nonce);
        mac.finalize().into_bytes().into()
    }

    /// The server's MAC over both nonces.
    pub(crate) fn server_mac(&self, cn: &[u8], sn: &[u8]) -> [u8; AUTH_LEN] {
        self.mac(SERVER_LABEL, cn, sn)
    }

    /// The client's MAC over both nonces.
    pub(crate) fn client_mac(&self, cn: &[u8], sn: &[u8]) -> [u8; AUTH_LEN] {
        self.mac(CLIENT_LABEL, cn, sn)
    }
}

impl std::fmt::Debug for Secret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Secret(..)")
    }
}

/// Constant-time equality of two MACs.
pub(crate) fn macs_equal(a: &[u8; AUTH_LEN], b: &[u8; AUTH_LEN]) -> bool {
    a.ct_eq(b).into()
}

/// A fresh random nonce.
pub(crate) fn nonce() -> [u8; AUTH_LEN] {
    let mut n = [0u8; AUTH_LEN];
    rand::RngCore::fill_bytes(&mut rand::rngs::OsRng, &mut n);
    n
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn server_and_client_macs_differ_and_depend_on_the_secret() {
        let s = Secret::new("abc").unwrap();
        let t = Secret::new("abd").unwrap();
        let (cn, sn) = ([1u8; 32], [2u8; 32]);
        assert_ne!(s.server_mac(&cn, &sn), s.client_mac(&cn, &sn));
        assert_ne!(s.client_mac(&cn, &sn), t.client_mac(&cn, &sn));
        assert_ne!(s.client_mac(&cn, &sn), s.client_mac(&cn, &[3u8; 32]));
        assert!(macs_equal(&s.client_mac(&cn, &sn), &s.client_mac(&cn, &sn)));
    }

    #[test]
    fn empty_secrets_are_refused_and_never_printed() {
        assert!(Secret::new("").is_none());
        assert_eq!(
            format!("{:?}", Secret::new("hunter2").unwrap()),
            "Secret(..)"
        );
        assert_ne!(nonce(), nonce());
    }
}
