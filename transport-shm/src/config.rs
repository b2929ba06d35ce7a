//! Configuration of the shared-memory transport.

use std::time::Duration;

use tensorwire_core::auth::ClusterSecret;
use tensorwire_core::ports::transport::{ConfigError, TransportError};
use tensorwire_core::wire::{WireLimits, DEFAULT_BUFFER_REUSE};

/// The environment variable [`ShmConfig::from_env`] reads the cluster secret from (the same
/// one the TCP transport reads).
pub const SECRET_ENV: &str = "TENSORWIRE_SECRET";

/// Overrides [`ShmConfig::spin`] in [`ShmConfig::from_env`] and in the same-host selection
/// (`SelectingTransport::from_tcp_config`): microseconds, `0` to sleep at once.
pub const SPIN_ENV: &str = "TENSORWIRE_SHM_SPIN_US";

/// Smallest ring a peer may offer (one page).
pub(crate) const MIN_RING: usize = 4096;
/// Largest ring a peer may offer.
pub(crate) const MAX_RING: usize = 1 << 30;

/// How a [`ShmTransport`](crate::ShmTransport) authenticates, what frames it accepts and how
/// large its rings are.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct ShmConfig {
    secret: Option<ClusterSecret>,
    /// Limits on frames sent and received.
    pub limits: WireLimits,
    /// How long the authentication handshake and the exchange of rings may take.
    pub handshake_timeout: Duration,
    /// Bytes of the ring each side receives on (a power of two, 4 KiB to 1 GiB; default 2 MiB).
    /// Frames smaller than [`segment_min`](Self::segment_min) stream through it.
    pub ring_bytes: usize,
    /// Frames of this many bytes and more (encoded) are written once into a sealed memfd segment
    /// of their own instead of streaming through the ring: a fixed number of system calls
    /// whatever their size, and no copy on the receiving side, but fresh pages for every frame
    /// (the kernel zeroes, maps and frees them), which costs more than the second copy of the
    /// ring on the machines measured. Off by default (`usize::MAX`).
    pub segment_min: usize,
    /// Frames of this many bytes and more (encoded; default 1 MiB) are written once into a
    /// *slab*: a memfd of the sender's, sealed against resizing, that the receiver maps once and
    /// the sender reuses. The receiver hands the payloads up as [`Bytes`](bytes::Bytes) over the
    /// mapping, without copying them; when the last of them is dropped, the sender may write the
    /// slab again. One copy in all, no system call per frame once the slab exists, and no fresh
    /// pages. While every slab is still referenced (a receiver that keeps its tensors), frames
    /// stream through the ring instead, so a receiver never holds up a sender.
    pub slab_min: usize,
    /// Bytes of slabs a sender keeps per connection at most (default 256 MiB; at most 8 slabs),
    /// and bytes of the peer's slabs a receiver maps per connection at most: a peer that sends
    /// a new slab past it is refused (the connection fails with an error naming the budget).
    pub slab_bytes: usize,
    /// How long a side that waits for data or ring space polls the ring before it sleeps on its
    /// eventfd (default 20 µs): busy polling while that pays off, then `sched_yield`; only the
    /// latter when the process may run on one core only (the peer then needs that core).
    pub spin: Duration,
    /// Bytes of receive buffers kept for reuse (see
    /// [`FrameDecoder::with_buffer_reuse`](tensorwire_core::wire::FrameDecoder::with_buffer_reuse)).
    pub buffer_reuse: usize,
}

impl ShmConfig {
    /// Authenticates with `secret`.
    pub fn new(secret: ClusterSecret) -> Self {
        Self::with_secret(Some(secret))
    }

    /// Runs WITHOUT the cluster secret: any process of the same user that finds the listener
    /// can talk to the worker (other users are still refused through `SO_PEERCRED`). Only for
    /// experiments; [`ShmTransport::new`](crate::ShmTransport::new) logs a warning.
    pub fn insecure() -> Self {
        Self::with_secret(None)
    }

    fn with_secret(secret: Option<ClusterSecret>) -> Self {
        ShmConfig {
            secret,
            limits: WireLimits::default(),
            handshake_timeout: Duration::from_secs(10),
            ring_bytes: 2 << 20,
            segment_min: usize::MAX,
            slab_min: 1 << 20,
            slab_bytes: 256 << 20,
            spin: Duration::from_micros(20),
            buffer_reuse: DEFAULT_BUFFER_REUSE,
        }
    }

    /// Takes the secret from the `TENSORWIRE_SECRET` environment variable; without it, fails
    /// with a message saying how to set one. [`SPIN_ENV`] applies when set.
    pub fn from_env() -> Result<Self, TransportError> {
        match std::env::var_os(SECRET_ENV) {
            Some(value) if !value.is_empty() => {
                let secret = ClusterSecret::new(value.into_encoded_bytes()).map_err(|source| {
                    ConfigError::Secret {
                        var: SECRET_ENV,
                        source,
                    }
                })?;
                Self::new(secret).with_spin_from(|name| std::env::var(name).ok())
            }
            _ => Err(ConfigError::NoSecret {
                var: SECRET_ENV,
                insecure: "ShmConfig::insecure",
            }
            .into()),
        }
    }

    /// These settings with other frame limits.
    pub fn with_limits(mut self, limits: WireLimits) -> Self {
        self.limits = limits;
        self
    }

    /// These settings with another ring size (a power of two, 4 KiB to 1 GiB).
    pub fn with_ring_bytes(mut self, bytes: usize) -> Self {
        self.ring_bytes = bytes;
        self
    }

    /// These settings with another threshold for sealed segments.
    pub fn with_segment_min(mut self, bytes: usize) -> Self {
        self.segment_min = bytes;
        self
    }

    /// These settings with another threshold for slabs (`usize::MAX`: none).
    pub fn with_slab_min(mut self, bytes: usize) -> Self {
        self.slab_min = bytes;
        self
    }

    /// These settings with another budget for slabs per connection.
    pub fn with_slab_bytes(mut self, bytes: usize) -> Self {
        self.slab_bytes = bytes;
        self
    }

    /// These settings with another polling time before sleeping.
    pub fn with_spin(mut self, spin: Duration) -> Self {
        self.spin = spin;
        self
    }

    /// These settings with [`SPIN_ENV`] applied, as `env` looks it up (microseconds; `0`
    /// sleeps at once).
    ///
    /// # Errors
    /// [`TransportError::Config`] naming the variable when the value is not a whole number.
    pub fn with_spin_from(
        self,
        env: impl Fn(&str) -> Option<String>,
    ) -> Result<Self, TransportError> {
        match tensorwire_core::spin::budget_from_env(SPIN_ENV, env) {
            Ok(Some(spin)) => Ok(self.with_spin(spin)),
            Ok(None) => Ok(self),
            Err(bad) => Err(ConfigError::from(bad).into()),
        }
    }

    /// These settings with another handshake timeout.
    pub fn with_handshake_timeout(mut self, timeout: Duration) -> Self {
        self.handshake_timeout = timeout;
        self
    }

    /// The secret, or `None` when insecure.
    pub fn secret(&self) -> Option<&ClusterSecret> {
        self.secret.as_ref()
    }

    /// Checks the settings that are not checked by their types.
    pub(crate) fn validate(&self) -> Result<(), TransportError> {
        if !self.ring_bytes.is_power_of_two() || !(MIN_RING..=MAX_RING).contains(&self.ring_bytes) {
            return Err(ConfigError::Setting {
                setting: "ShmConfig::ring_bytes",
                value: self.ring_bytes as u64,
                expected: format!("a power of two from {MIN_RING} to {MAX_RING}"),
            }
            .into());
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn env<'a>(vars: &'a [(&'a str, &'a str)]) -> impl Fn(&str) -> Option<String> + 'a {
        move |name| {
            vars.iter()
                .find(|(k, _)| *k == name)
                .map(|(_, v)| v.to_string())
        }
    }

    #[test]
    fn a_ring_size_out_of_range_is_a_setting_error_naming_it() {
        for bytes in [3 * 4096, MIN_RING / 2, MAX_RING * 2] {
            match ShmConfig::insecure().with_ring_bytes(bytes).validate() {
                Err(TransportError::Config(ConfigError::Setting { setting, value, .. })) => {
                    assert_eq!((setting, value), ("ShmConfig::ring_bytes", bytes as u64))
                }
                other => panic!("{bytes}: {other:?}"),
            }
        }
        assert!(ShmConfig::insecure()
            .with_ring_bytes(MIN_RING)
            .validate()
            .is_ok());
    }

    #[test]
    fn spin_comes_from_the_environment_and_a_malformed_value_names_the_variable() {
        let default = ShmConfig::insecure().spin;
        assert_eq!(default, Duration::from_micros(20));
        let c = ShmConfig::insecure().with_spin_from(env(&[])).unwrap();
        assert_eq!(c.spin, default);
        let c = ShmConfig::insecure()
            .with_spin_from(env(&[(SPIN_ENV, " 200 ")]))
            .unwrap();
        assert_eq!(c.spin, Duration::from_micros(200));
        let c = ShmConfig::insecure()
            .with_spin_from(env(&[(SPIN_ENV, "0")]))
            .unwrap();
        assert_eq!(c.spin, Duration::ZERO);
        let msg = ShmConfig::insecure()
            .with_spin_from(env(&[(SPIN_ENV, "lots")]))
            .unwrap_err()
            .to_string();
        assert!(msg.contains(SPIN_ENV) && msg.contains("\"lots\""), "{msg}");
    }
}
