//! Configuration of the TCP transport.

use std::time::Duration;

use tensorwire_core::auth::ClusterSecret;
use tensorwire_core::ports::transport::{ConfigError, TransportError};
use tensorwire_core::wire::{WireLimits, DEFAULT_BUFFER_REUSE};

/// The environment variable [`TcpConfig::from_env`] reads the cluster secret from.
pub const SECRET_ENV: &str = "TENSORWIRE_SECRET";

/// Overrides [`TcpConfig::keepalive`] in [`TcpConfig::resolve`] and [`TcpConfig::from_env`]:
/// milliseconds, `0` turns keepalive probes off.
pub const KEEPALIVE_ENV: &str = "TENSORWIRE_TCP_KEEPALIVE_MS";

/// Overrides [`TcpConfig::dead_peer_timeout`] in [`TcpConfig::resolve`] and
/// [`TcpConfig::from_env`]: milliseconds, `0` leaves it to the operating system (hours).
pub const DEAD_PEER_ENV: &str = "TENSORWIRE_TCP_DEAD_PEER_MS";

/// Overrides [`TcpConfig::spin`] in [`TcpConfig::resolve`] and [`TcpConfig::from_env`]:
/// microseconds, `0` turns polling off (a receive then always waits in the runtime's `epoll`).
pub const SPIN_ENV: &str = "TENSORWIRE_TCP_SPIN_US";

/// Default [`TcpConfig::spin`]: off.
///
/// Measured twice on the same kind of 2-core VM, the same release binary, spin 50 µs against 0,
/// alternating runs. On an idle machine, unpinned, `rpc_sync` p50 was 10.5–11.3 µs against
/// 74–80 µs (the cross-core wake-up through `epoll` that polling avoids); pinned, no
/// difference. On 2026-11-26, with two other engineers' builds loading the machine (load
/// average 6–9 on 2 cores), medians of 5 runs each (`docs/bench/spin.md`), spin on over off:
/// unpinned `rpc_sync` p50 0.99× (11.2 against 11.3 µs; the slow wake-up did not occur with
/// or without it), `rpc_async` calls/s 0.59×, a 2-rank TCP barrier 1.41× and an 8-rank one
/// 1.18× slower; pinned `rpc_sync` 1.01×, calls/s 0.69×, barriers 1.40× and 1.16×. Idle CPU
/// does not grow while idle: the agents' extra was about 60 µs once after the last send (1 s
/// pause: +63 µs/s; 5 s pause: +12 µs/s). It pays only on an idle machine and costs
/// throughput and collectives when cores are busy, so it stays opt-in
/// ([`SPIN_ENV`]`=50`).
pub const DEFAULT_SPIN: Duration = Duration::ZERO;

/// Default [`TcpConfig::keepalive`].
pub const DEFAULT_KEEPALIVE: Duration = Duration::from_secs(5);

/// Default [`TcpConfig::handshakes_per_source`].
pub const DEFAULT_HANDSHAKES_PER_SOURCE: usize = 16;

/// Default [`TcpConfig::frame_timeout`].
pub const DEFAULT_FRAME_TIMEOUT: Duration = Duration::from_secs(120);

/// Default [`TcpConfig::dead_peer_timeout`].
pub const DEFAULT_DEAD_PEER_TIMEOUT: Duration = Duration::from_secs(30);

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
    /// Liveness probing of idle connections: after this long without traffic, and then every
    /// this long, the kernel sends a TCP keepalive probe (`TCP_KEEPIDLE` = `TCP_KEEPINTVL`).
    /// `None` turns probes off; then a peer whose host died or whose link was cut is noticed
    /// only when something is sent to it. Default 5 s ([`DEFAULT_KEEPALIVE`]).
    pub keepalive: Option<Duration>,
    /// How long a peer may leave our data or our keepalive probes unanswered before the
    /// connection is declared dead and fails with an I/O error (`TCP_USER_TIMEOUT`; it also
    /// ends keepalive probing). A frozen process still has its kernel answer, so only a dead
    /// host or a cut link trips it. `None` leaves it to the kernel: about 15 minutes of
    /// retransmissions, or 2 hours and 11 minutes of silence before the first keepalive.
    /// Default 30 s ([`DEFAULT_DEAD_PEER_TIMEOUT`]): a dead peer on an idle connection is
    /// noticed within about `dead_peer_timeout + keepalive`.
    pub dead_peer_timeout: Option<Duration>,
    /// How long one frame may take to arrive once its first byte has: a peer that starts a
    /// frame and stalls fails with [`TransportError::FrameTimeout`] and the connection is
    /// closed, its buffers freed. `None`: no bound. Default 120 s ([`DEFAULT_FRAME_TIMEOUT`]),
    /// room for a 1 GiB frame at about 70 Mbit/s.
    pub frame_timeout: Option<Duration>,
    /// Handshakes one source IP address may have in progress at once (of the listener's 256).
    /// A connection beyond it waits for a turn, within its handshake timeout, behind at most
    /// four times as many others from its address (ranks on one host all dial from one
    /// address); beyond those it is closed at once. Default 16
    /// ([`DEFAULT_HANDSHAKES_PER_SOURCE`]): 16 in handshake and 64 waiting.
    pub handshakes_per_source: usize,
    /// How long after a send a receive that finds nothing polls the socket (non-blocking
    /// `recv`, or `sched_yield` when polling does not pay: see [`tensorwire_core::spin`])
    /// before it waits in the runtime's `epoll`: a side that just sent a request expects its
    /// answer soon, and a wake-up through `epoll` across cores costs tens of microseconds on a
    /// virtual machine. A receive with no send in the last `spin` waits at once, so an idle
    /// connection spends no CPU (measured: about 60 µs once after an agent's last send, none
    /// after). `Duration::ZERO` turns polling off. Default off ([`DEFAULT_SPIN`], which has the
    /// measurements); 50 µs is a starting point on an otherwise idle machine, where it pays.
    pub spin: Duration,
}

impl TcpConfig {
    /// Authenticates with `secret`.
    pub fn new(secret: ClusterSecret) -> Self {
        TcpConfig {
            secret: Some(secret),
            limits: WireLimits::default(),
            handshake_timeout: Duration::from_secs(10),
            buffer_reuse: DEFAULT_BUFFER_REUSE,
            keepalive: Some(DEFAULT_KEEPALIVE),
            dead_peer_timeout: Some(DEFAULT_DEAD_PEER_TIMEOUT),
            frame_timeout: Some(DEFAULT_FRAME_TIMEOUT),
            handshakes_per_source: DEFAULT_HANDSHAKES_PER_SOURCE,
            spin: DEFAULT_SPIN,
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
            keepalive: Some(DEFAULT_KEEPALIVE),
            dead_peer_timeout: Some(DEFAULT_DEAD_PEER_TIMEOUT),
            frame_timeout: Some(DEFAULT_FRAME_TIMEOUT),
            handshakes_per_source: DEFAULT_HANDSHAKES_PER_SOURCE,
            spin: DEFAULT_SPIN,
        }
    }

    /// Takes the secret from the `TENSORWIRE_SECRET` environment variable. Without it, fails
    /// with a message saying how to set one (or to ask for [`insecure`](Self::insecure)).
    /// Liveness settings come from [`KEEPALIVE_ENV`] and [`DEAD_PEER_ENV`] when set.
    pub fn from_env() -> Result<Self, TransportError> {
        Self::resolve(None, false)
    }

    /// The secret from configuration (`secret`), else from `TENSORWIRE_SECRET`, else no secret
    /// if `insecure` is set; otherwise an error. Liveness settings come from [`KEEPALIVE_ENV`]
    /// and [`DEAD_PEER_ENV`] when set (a malformed value is an error naming the variable).
    pub fn resolve(secret: Option<ClusterSecret>, insecure: bool) -> Result<Self, TransportError> {
        let config = Self::resolve_secret(secret, insecure)?;
        let env = |name: &str| std::env::var(name).ok();
        config.with_liveness_from(env)?.with_spin_from(env)
    }

    fn resolve_secret(
        secret: Option<ClusterSecret>,
        insecure: bool,
    ) -> Result<Self, TransportError> {
        if let Some(secret) = secret {
            return Ok(Self::new(secret));
        }
        match std::env::var_os(SECRET_ENV) {
            Some(value) if !value.is_empty() => {
                let secret = ClusterSecret::new(value.into_encoded_bytes()).map_err(|source| {
                    ConfigError::Secret {
                        var: SECRET_ENV,
                        source,
                    }
                })?;
                Ok(Self::new(secret))
            }
            _ if insecure => Ok(Self::insecure()),
            _ => Err(ConfigError::NoSecret {
                var: SECRET_ENV,
                insecure: "insecure",
            }
            .into()),
        }
    }

    /// These settings with another per-frame deadline (`None`: no bound).
    pub fn with_frame_timeout(mut self, timeout: Option<Duration>) -> Self {
        self.frame_timeout = timeout;
        self
    }

    /// These settings with another bound on handshakes in progress per source address.
    pub fn with_handshakes_per_source(mut self, limit: usize) -> Self {
        self.handshakes_per_source = limit;
        self
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

    /// These settings with other liveness probing: keepalive probes after `keepalive` of
    /// silence and every `keepalive` after that, and a connection declared dead once the peer
    /// has left data or probes unanswered for `dead_peer_timeout` (see the fields).
    pub fn with_liveness(
        mut self,
        keepalive: Option<Duration>,
        dead_peer_timeout: Option<Duration>,
    ) -> Self {
        self.keepalive = keepalive;
        self.dead_peer_timeout = dead_peer_timeout;
        self
    }

    /// These settings with another [`spin`](Self::spin) (`Duration::ZERO`: never poll).
    pub fn with_spin(mut self, spin: Duration) -> Self {
        self.spin = spin;
        self
    }

    /// These settings with [`SPIN_ENV`] applied, as `env` looks it up (microseconds; `0` turns
    /// polling off).
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

    /// These settings with [`KEEPALIVE_ENV`] and [`DEAD_PEER_ENV`] applied, as `env` looks
    /// them up (milliseconds; `0` turns the setting off).
    ///
    /// # Errors
    /// [`TransportError::Config`] naming the variable when a value is not a whole number.
    pub fn with_liveness_from(
        mut self,
        env: impl Fn(&str) -> Option<String>,
    ) -> Result<Self, TransportError> {
        let ms = |name: &str| -> Result<Option<Option<Duration>>, TransportError> {
            let ms = tensorwire_core::env::whole_number(
                name,
                &env,
                "a whole number of milliseconds (0 turns it off)",
            )
            .map_err(ConfigError::from)?;
            Ok(ms.map(|ms| (ms > 0).then(|| Duration::from_millis(ms))))
        };
        if let Some(keepalive) = ms(KEEPALIVE_ENV)? {
            self.keepalive = keepalive;
        }
        if let Some(dead) = ms(DEAD_PEER_ENV)? {
            self.dead_peer_timeout = dead;
        }
        Ok(self)
    }

    /// The secret, or `None` when insecure.
    pub fn secret(&self) -> Option<&ClusterSecret> {
        self.secret.as_ref()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn env<'a>(vars: &'a [(&'a str, &'a str)]) -> impl Fn(&str) -> Option<String> + 'a {
        move |name| {
            vars.iter()
                .find(|(k, _)| *k == name)
                .map(|(_, v)| (*v).to_owned())
        }
    }

    #[test]
    fn liveness_defaults_bound_a_dead_peer_to_seconds() {
        let c = TcpConfig::insecure();
        assert_eq!(c.keepalive, Some(DEFAULT_KEEPALIVE));
        assert_eq!(c.dead_peer_timeout, Some(DEFAULT_DEAD_PEER_TIMEOUT));
        let c = c.with_liveness_from(env(&[])).unwrap();
        assert_eq!(c.keepalive, Some(DEFAULT_KEEPALIVE));
    }

    #[test]
    fn liveness_comes_from_the_environment_and_zero_turns_it_off() {
        let c = TcpConfig::insecure()
            .with_liveness_from(env(&[(KEEPALIVE_ENV, "250"), (DEAD_PEER_ENV, "0")]))
            .unwrap();
        assert_eq!(c.keepalive, Some(Duration::from_millis(250)));
        assert_eq!(c.dead_peer_timeout, None);
    }

    #[test]
    fn a_malformed_liveness_variable_is_an_error_naming_it() {
        let e = TcpConfig::insecure()
            .with_liveness_from(env(&[(DEAD_PEER_ENV, "5s")]))
            .unwrap_err();
        let msg = e.to_string();
        assert!(
            msg.contains(DEAD_PEER_ENV) && msg.contains("\"5s\""),
            "{msg}"
        );
        match e {
            TransportError::Config(ConfigError::Variable(bad)) => {
                assert_eq!(
                    (bad.var.as_str(), bad.value.as_str()),
                    (DEAD_PEER_ENV, "5s")
                )
            }
            other => panic!("not a variable's error: {other:?}"),
        }
    }

    #[test]
    fn spin_comes_from_the_environment_and_a_malformed_value_names_the_variable() {
        assert_eq!(TcpConfig::insecure().spin, DEFAULT_SPIN);
        let c = TcpConfig::insecure()
            .with_spin_from(env(&[(SPIN_ENV, "0")]))
            .unwrap();
        assert_eq!(c.spin, Duration::ZERO);
        let c = TcpConfig::insecure()
            .with_spin_from(env(&[(SPIN_ENV, " 120 ")]))
            .unwrap();
        assert_eq!(c.spin, Duration::from_micros(120));
        let e = TcpConfig::insecure()
            .with_spin_from(env(&[(SPIN_ENV, "fast")]))
            .unwrap_err();
        let msg = e.to_string();
        assert!(msg.contains(SPIN_ENV) && msg.contains("\"fast\""), "{msg}");
        assert!(
            matches!(&e, TransportError::Config(ConfigError::Variable(bad)) if bad.var == SPIN_ENV),
            "{e:?}"
        );
    }
}
