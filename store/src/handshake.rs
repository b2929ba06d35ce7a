//! The optional cluster secret of the TCP store: a challenge-response step before c10d's
//! `VALIDATE`.
//!
//! # Protocol
//!
//! When the server has a secret, the first bytes a client sends must be tensorwire's
//! [`AUTH_HELLO`](crate::protocol::AUTH_HELLO) query (`0xA5`, outside c10d's query range) with a
//! fresh 32-byte client nonce `cn`:
//!
//! 1. client → server: `0xA5`, `cn`
//! 2. server → client: status `0`, a fresh 32-byte server nonce `sn`,
//!    `HMAC-SHA256(secret, "tensorwire-auth-v1 tensorwire-store-v1 server" ‖ cn ‖ sn)` (the
//!    cluster secret's [`mac`](ClusterSecret::mac), shared with the transports' handshake).
//!    (A server without a secret answers status `1` and keeps the connection unauthenticated.)
//! 3. the client checks the server's MAC (so a client with a secret never talks to a store that
//!    does not know it), then sends `0xA6`, the MAC with label `tensorwire-store-v1 client`
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

use tensorwire_core::auth::ClusterSecret;

use crate::protocol::AUTH_LEN;

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

/// The server's proof: the cluster secret's MAC (see [`ClusterSecret::mac`]) of both nonces.
pub(crate) fn server_mac(secret: &ClusterSecret, cn: &[u8], sn: &[u8]) -> [u8; AUTH_LEN] {
    secret.mac(SERVER_LABEL, cn, sn)
}

/// The client's proof.
pub(crate) fn client_mac(secret: &ClusterSecret, cn: &[u8], sn: &[u8]) -> [u8; AUTH_LEN] {
    secret.mac(CLIENT_LABEL, cn, sn)
}

pub(crate) use tensorwire_core::auth::macs_equal;

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
        let s = ClusterSecret::new("abc").unwrap();
        let t = ClusterSecret::new("abd").unwrap();
        let (cn, sn) = ([1u8; 32], [2u8; 32]);
        assert_ne!(server_mac(&s, &cn, &sn), client_mac(&s, &cn, &sn));
        assert_ne!(client_mac(&s, &cn, &sn), client_mac(&t, &cn, &sn));
        assert_ne!(client_mac(&s, &cn, &sn), client_mac(&s, &cn, &[3u8; 32]));
        assert!(macs_equal(
            &client_mac(&s, &cn, &sn),
            &client_mac(&s, &cn, &sn)
        ));
        assert_ne!(nonce(), nonce());
    }
}
