//! Capabilities: 128-bit values that only a worker given them can present, derived by their
//! maker from a key of its own (`HMAC-SHA256(key, label ‖ id)`), for ids that are easy to guess.
//! Remote references ([`protocol`](crate::protocol)) and distributed autograd contexts
//! ([`autograd`](crate::autograd)) use them.

use hmac::{Hmac, Mac};
use sha2::Sha256;
use subtle::ConstantTimeEq;

/// A capability.
pub type Capability = u128;

/// The capability of the id made of `parts`, under `key`, for the use named by `label`.
pub(crate) fn derive(key: &[u8; 32], label: &[u8], parts: &[u64]) -> Capability {
    // HMAC accepts keys of any length; new_from_slice cannot fail for it.
    let mut mac =
        <Hmac<Sha256> as Mac>::new_from_slice(key).expect("HMAC takes keys of any length");
    mac.update(label);
    for part in parts {
        mac.update(&part.to_le_bytes());
    }
    let out = mac.finalize().into_bytes();
    let mut bytes = [0u8; 16];
    bytes.copy_from_slice(&out[..16]);
    u128::from_le_bytes(bytes)
}

/// Whether two capabilities are equal, in time independent of where they differ.
pub(crate) fn same(a: Capability, b: Capability) -> bool {
    a.to_le_bytes().ct_eq(&b.to_le_bytes()).into()
}

/// The key a state machine starts with: fixed per worker, so not secret. Drivers replace it
/// with real entropy before anything is made (simulations: a seeded generator).
pub(crate) fn default_key(me: u32) -> [u8; 32] {
    let mut key = [0u8; 32];
    key[..8].copy_from_slice(&u64::from(me).to_le_bytes());
    key
}
