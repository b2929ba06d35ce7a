//! Settings of the QUIC transport, tuned for bulk tensors between cluster nodes.

use std::sync::Arc;
use std::time::Duration;

use quinn::{IdleTimeout, MtuDiscoveryConfig, TransportConfig, VarInt};

use tensorwire_core::wire::WireLimits;

use crate::tls::ClusterTls;
use crate::QuicError;

/// Overrides [`QuicConfig::idle_timeout`] in [`QuicConfig::with_liveness_from`]
/// (milliseconds).
pub const IDLE_TIMEOUT_ENV: &str = "TENSORWIRE_QUIC_IDLE_TIMEOUT_MS";

/// Overrides [`QuicConfig::keep_alive`] in [`QuicConfig::with_liveness_from`] (milliseconds).
pub const KEEP_ALIVE_ENV: &str = "TENSORWIRE_QUIC_KEEPALIVE_MS";

/// Settings of a [`QuicTransport`](crate::QuicTransport).
#[derive(Debug, Clone)]
pub struct QuicConfig {
    /// Certificates: this node's identity and the cluster CA.
    pub tls: ClusterTls,
    /// UDP send and receive buffers to ask the kernel for (bytes).
    pub socket_buffer_bytes: usize,
    /// Flow-control window of one stream (bytes): how much of one frame may be in flight.
    pub stream_receive_window: u64,
    /// Flow-control window of a whole connection (bytes).
    pub connection_receive_window: u64,
    /// Bytes a connection may have buffered for sending.
    pub send_window: u64,
    /// Frames a peer may have in flight to us at once (concurrent unidirectional streams).
    pub max_concurrent_frames: u32,
    /// Bytes of frames read from the peer and not yet taken by `recv` (whole and partly read
    /// ones together) at most: a peer past it fails the connection with
    /// [`TransportError::PendingBytes`](tensorwire_core::ports::transport::TransportError).
    /// One frame alone may pass it (the largest frame is `limits.max_frame_len`). Default
    /// 1 GiB.
    pub max_pending_bytes: usize,
    /// UDP payload size to start with towards remote peers (bytes); 1200 is safe everywhere.
    pub initial_mtu: u16,
    /// Largest UDP payload MTU discovery may probe for towards remote peers (bytes); 1452 fits
    /// Ethernet. Datagrams are batched with segmentation offload (GSO) where the OS has it.
    pub max_mtu: u16,
    /// Largest UDP payload for peers on a loopback address (bytes); MTU discovery reaches it
    /// within a few round trips (starting there outright stalled the handshake).
    ///
    /// Loopback carries 64 KiB datagrams, and every datagram costs a system call and a round of
    /// packet protection on each side, so large datagrams multiply bulk throughput (measured:
    /// about 3x at 60,000 bytes against 1,452). Segmentation offload is turned off for these
    /// connections: with quinn 0.11, GSO batches of datagrams above 1,452 bytes stalled streams
    /// in our tests. 0 treats loopback peers like remote ones.
    pub loopback_mtu: u16,
    /// Flow-control window (stream and connection) for peers on a loopback address (bytes).
    ///
    /// On one machine the round trip is tens of microseconds, so a few MiB keep the pipe full,
    /// while a window larger than the receiving socket's kernel buffer only lets bursts
    /// overflow it: the losses halve the congestion window and cost retransmissions (measured:
    /// 3% loss and half the throughput with 64 MiB windows, none with 4 MiB).
    pub loopback_receive_window: u64,
    /// A connection that hears nothing from its peer for this long is closed, and whatever
    /// waits on it fails: with keep-alives flowing, this is how long a peer that died or was
    /// cut off goes unnoticed at most. Default 10 s (quinn's own default is 30 s).
    pub idle_timeout: Duration,
    /// Keep-alive interval: a connection with nothing to send pings its peer this often, so
    /// a live but idle peer keeps it open. Must be shorter than
    /// [`idle_timeout`](Self::idle_timeout) (a few of them fit in one). Default 2 s.
    pub keep_alive: Duration,
    /// Deadline for a connection attempt, handshake and admission included.
    pub connect_timeout: Duration,
    /// Bounds on frames, enforced on both sending and receiving (core's wire limits; the
    /// largest frame is 1 GiB by default).
    pub limits: WireLimits,
}

impl QuicConfig {
    /// Defaults for `tls`: 16 MiB socket buffers, 64 MiB stream and 256 MiB connection
    /// windows (4 MiB on loopback), 4096 concurrent frames, MTU discovery up to 1452 bytes (60,000 on loopback), core's default wire limits.
    pub fn new(tls: ClusterTls) -> Self {
        Self {
            tls,
            socket_buffer_bytes: 16 << 20,
            stream_receive_window: 64 << 20,
            connection_receive_window: 256 << 20,
            send_window: 256 << 20,
            max_concurrent_frames: 4096,
            max_pending_bytes: 1 << 30,
            initial_mtu: 1200,
            max_mtu: 1452,
            loopback_mtu: 60_000,
            loopback_receive_window: 4 << 20,
            idle_timeout: Duration::from_secs(10),
            keep_alive: Duration::from_secs(2),
            connect_timeout: Duration::from_secs(10),
            limits: WireLimits::default(),
        }
    }

    /// These settings with [`IDLE_TIMEOUT_ENV`] and [`KEEP_ALIVE_ENV`] applied, as `env` looks
    /// them up (whole milliseconds), checked: both positive, the keep-alive shorter than the
    /// idle timeout.
    ///
    /// ```
    /// # use std::time::Duration;
    /// # use tensorwire_transport_quic::{certs::ClusterCa, ClusterTls, QuicConfig};
    /// # let ca = ClusterCa::generate().unwrap();
    /// # let tls = ClusterTls::new(ca.issue_node("w0").unwrap(), vec![ca.cert_der().clone()]);
    /// let config = QuicConfig::new(tls)
    ///     .with_liveness_from(|name| std::env::var(name).ok())
    ///     .unwrap();
    /// assert!(config.keep_alive < config.idle_timeout);
    /// ```
    ///
    /// # Errors
    /// [`QuicError::Setting`] naming the variable.
    pub fn with_liveness_from(
        mut self,
        env: impl Fn(&str) -> Option<String>,
    ) -> Result<Self, QuicError> {
        for (name, field) in [
            (IDLE_TIMEOUT_ENV, &mut self.idle_timeout),
            (KEEP_ALIVE_ENV, &mut self.keep_alive),
        ] {
            if let Some(value) = env(name) {
                match value.trim().parse::<u64>() {
                    Ok(ms) if ms > 0 => *field = Duration::from_millis(ms),
                    _ => {
                        return Err(QuicError::Setting {
                            setting: name.to_owned(),
                            reason: format!(
                                "{value:?} is not a positive whole number of milliseconds"
                            ),
                        })
                    }
                }
            }
        }
        if self.keep_alive >= self.idle_timeout {
            return Err(QuicError::Setting {
                setting: format!("{KEEP_ALIVE_ENV} / {IDLE_TIMEOUT_ENV}"),
                reason: format!(
                    "the keep-alive interval ({:?}) must be shorter than the idle timeout ({:?}), \
                     or idle connections close",
                    self.keep_alive, self.idle_timeout
                ),
            });
        }
        Ok(self)
    }

    /// quinn's transport configuration for a peer on a loopback address or elsewhere.
    pub(crate) fn transport(&self, loopback: bool) -> Arc<TransportConfig> {
        let mut t = TransportConfig::default();
        let var = |v: u64| VarInt::from_u64(v).unwrap_or(VarInt::MAX);
        let (stream_window, connection_window) = if loopback {
            (self.loopback_receive_window, self.loopback_receive_window)
        } else {
            (self.stream_receive_window, self.connection_receive_window)
        };
        t.stream_receive_window(var(stream_window))
            .receive_window(var(connection_window))
            .send_window(self.send_window)
            .max_concurrent_uni_streams(self.max_concurrent_frames.into())
            .max_concurrent_bidi_streams(0u32.into())
            .keep_alive_interval(Some(self.keep_alive))
            .max_idle_timeout(IdleTimeout::try_from(self.idle_timeout).ok());
        let initial = self.initial_mtu.max(1200);
        let bound = if loopback && self.loopback_mtu >= 1200 {
            t.enable_segmentation_offload(false);
            self.loopback_mtu
        } else {
            self.max_mtu
        };
        t.initial_mtu(initial);
        let mut mtu = MtuDiscoveryConfig::default();
        mtu.upper_bound(bound.max(initial));
        t.mtu_discovery_config(Some(mtu));
        Arc::new(t)
    }

    /// The largest UDP payload this node accepts (advertised to peers).
    pub(crate) fn max_udp_payload(&self) -> u16 {
        self.max_mtu.max(self.loopback_mtu).clamp(1200, 65527)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::certs::ClusterCa;

    fn config() -> QuicConfig {
        let ca = ClusterCa::generate().unwrap();
        QuicConfig::new(ClusterTls::new(
            ca.issue_node("w0").unwrap(),
            vec![ca.cert_der().clone()],
        ))
    }

    #[test]
    fn a_dead_peer_is_noticed_within_ten_seconds_by_default() {
        let c = config().with_liveness_from(|_| None).unwrap();
        assert_eq!(c.idle_timeout, Duration::from_secs(10));
        assert_eq!(c.keep_alive, Duration::from_secs(2));
    }

    #[test]
    fn liveness_comes_from_the_environment() {
        let c = config()
            .with_liveness_from(|name| match name {
                IDLE_TIMEOUT_ENV => Some("1500".into()),
                KEEP_ALIVE_ENV => Some("300".into()),
                _ => None,
            })
            .unwrap();
        assert_eq!(c.idle_timeout, Duration::from_millis(1500));
        assert_eq!(c.keep_alive, Duration::from_millis(300));
    }

    #[test]
    fn bad_liveness_settings_are_errors_naming_the_variable() {
        let e = config()
            .with_liveness_from(|name| (name == IDLE_TIMEOUT_ENV).then(|| "0".into()))
            .unwrap_err()
            .to_string();
        assert!(e.contains(IDLE_TIMEOUT_ENV) && e.contains("\"0\""), "{e}");
        // A keep-alive as long as the idle timeout would let idle connections close.
        let e = config()
            .with_liveness_from(|name| (name == KEEP_ALIVE_ENV).then(|| "10000".into()))
            .unwrap_err()
            .to_string();
        assert!(e.contains("must be shorter than the idle timeout"), "{e}");
    }
}
