//! Configuration of the TCP transport.

use std::time::Duration;

use tensorwire_core::auth::ClusterSecret;
use tensorwire_core::ports::transport::TransportError;
use tensorwire_core::wire::{WireLimits, DEFAULT_BUFFER_REUSE};

/// The environment variable [`TcpConfig::from_env`] reads the cluster secret from.
pub const SECRET_ENV: &str = "TENSORWIRE_SECRET";

/// How a [`TcpTransport`](crate::TcpTransport) authenticates and what frames it accepts.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct TcpConfig {
    secret: Option<ClusterSecret>,
    /// Limits on frames sent and received.
    pub limits: WireLimits,
    /// How long the authentication handshake may take, on either side.
    pub handshake_timeout: Duration,
    /// Bytes of large receive buffers each connection keeps for reuse once the application has
    /// dropped the frames that used them (see
    /// [`FrameDecoder::with_buffer_reuse`](tensorwire_core::wire::FrameDecoder::with_buffer_reuse));
    /// 0 turns reuse off.
    pub buffer_reuse: usize,
}

impl TcpConfig {
    /// Authenticates with `secret`.
    pub fn new(secret: ClusterSecret) -> Self {
        TcpConfig {
            secret: Some(secret),
            limits: WireLimits::default(),
            handshake_timeout: Duration::from_secs(10),
            buffer_reuse: DEFAULT_BUFFER_REUSE,
        }
    }

    /// Runs WITHOUT authentication: anyone who reaches the port can talk to the worker. Only
    /// for experiments on a trusted machine; [`TcpTransport::new`](crate::TcpTransport::new)
    /// logs a warning.
    pub fn insecure() -> Self {
        TcpConfig {
            secret: None,
            limits: WireLimits::default(),
            handshake_timeout: Duration::from_secs(10),
            buffer_reuse: DEFAULT_BUFFER_REUSE,
        }
    }

    /// Takes the secret from the `TENSORWIRE_SECRET` environment variable. Without it, fails
    /// with a message saying how to set one (or to ask for [`insecure`](Self::insecure)).
    pub fn from_env() -> Result<Self, TransportError> {
        Self::resolve(None, false)
    }

    /// The secret from configuration (`secret`), else from `TENSORWIRE_SECRET`, else no secret
    /// if `insecure` is set; otherwise an error.
    pub fn resolve(secret: Option<ClusterSecret>, insecure: bool) -> Result<Self, TransportError> {
        if let Some(secret) = secret {
            return Ok(Self::new(secret));
        }
        match std::env::var_os(SECRET_ENV) {
            Some(value) if !value.is_empty() => {
                let secret = ClusterSecret::new(value.into_encoded_bytes())
                    .map_err(|e| TransportError::Config(format!("{SECRET_ENV}: {e}")))?;
                Ok(Self::new(secret))
            }
            _ if insecure => Ok(Self::insecure()),
            _ => Err(TransportError::Config(format!(
                "no cluster secret: set {SECRET_ENV} (the same value on every worker) or \
                 configure one; to run without authentication, ask for it explicitly (insecure)"
            ))),
        }
    }

    /// These settings with other frame limits.
    pub fn with_limits(mut self, limits: WireLimits) -> Self {
        self.limits = limits;
        self
    }

    /// These settings with another budget for reused receive buffers.
    pub fn with_buffer_reuse(mut self, bytes: usize) -> Self {
        self.buffer_reuse = bytes;
        self
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
}
