//! Settings of the QUIC transport, tuned for bulk tensors between cluster nodes.

use std::sync::Arc;
use std::time::Duration;

use quinn::{IdleTimeout, MtuDiscoveryConfig, TransportConfig, VarInt};

use tensorwire_core::wire::WireLimits;

use crate::tls::ClusterTls;

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
    /// UDP payload size to start with (bytes); 1200 is safe everywhere.
    pub initial_mtu: u16,
    /// Largest UDP payload MTU discovery may probe for (bytes); 1452 fits Ethernet.
    ///
    /// Larger bounds (jumbo frames, loopback's 64 KiB) stalled streams with quinn 0.11 in our
    /// tests (bidirectional traffic, packets above 1452 bytes never delivered), so the default
    /// stays at quinn's own bound.
    pub max_mtu: u16,
    /// A connection with no traffic for this long is closed.
    pub idle_timeout: Duration,
    /// Keep-alive interval, so idle but wanted connections stay open.
    pub keep_alive: Duration,
    /// Deadline for a connection attempt, handshake and admission included.
    pub connect_timeout: Duration,
    /// Bounds on frames, enforced on both sending and receiving (core's wire limits; the
    /// largest frame is 1 GiB by default).
    pub limits: WireLimits,
}

impl QuicConfig {
    /// Defaults for `tls`: 16 MiB socket buffers, 64 MiB stream and 256 MiB connection
    /// windows, 4096 concurrent frames, MTU discovery up to 1452 bytes, core's default wire limits.
    pub fn new(tls: ClusterTls) -> Self {
        Self {
            tls,
            socket_buffer_bytes: 16 << 20,
            stream_receive_window: 64 << 20,
            connection_receive_window: 256 << 20,
            send_window: 256 << 20,
            max_concurrent_frames: 4096,
            initial_mtu: 1200,
            max_mtu: 1452,
            idle_timeout: Duration::from_secs(30),
            keep_alive: Duration::from_secs(5),
            connect_timeout: Duration::from_secs(10),
            limits: WireLimits::default(),
        }
    }

    /// quinn's transport configuration for these settings.
    pub(crate) fn transport(&self) -> Arc<TransportConfig> {
        let mut t = TransportConfig::default();
        let var = |v: u64| VarInt::from_u64(v).unwrap_or(VarInt::MAX);
        t.stream_receive_window(var(self.stream_receive_window))
            .receive_window(var(self.connection_receive_window))
            .send_window(self.send_window)
            .max_concurrent_uni_streams(self.max_concurrent_frames.into())
            .max_concurrent_bidi_streams(0u32.into())
            .initial_mtu(self.initial_mtu.max(1200))
            .keep_alive_interval(Some(self.keep_alive))
            .max_idle_timeout(IdleTimeout::try_from(self.idle_timeout).ok());
        let mut mtu = MtuDiscoveryConfig::default();
        mtu.upper_bound(self.max_mtu.max(self.initial_mtu.max(1200)));
        t.mtu_discovery_config(Some(mtu));
        Arc::new(t)
    }
}
