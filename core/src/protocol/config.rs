//! Which [`EndpointConfig`] an agent may start with: every bound must leave an honest peer
//! room to work. A zero makes the endpoint refuse or drop what every peer does (or resend a
//! control message at every turn), so it is refused up front, naming the setting and what it
//! would do, instead of showing later as calls that fail one by one.

use std::time::Duration;

use super::EndpointConfig;

/// A setting of an [`EndpointConfig`] that no agent can work with.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("EndpointConfig::{setting} is zero: {consequence}")]
#[non_exhaustive]
pub struct ConfigError {
    /// The field.
    pub setting: &'static str,
    /// What the endpoint would do with it.
    pub consequence: &'static str,
}

impl EndpointConfig {
    /// Checks the settings: none of them may be zero (see [`ConfigError`]).
    ///
    /// ```
    /// use tensorwire_core::protocol::EndpointConfig;
    ///
    /// assert!(EndpointConfig::default().check().is_ok());
    /// let e = EndpointConfig { requests_per_peer: 0, ..EndpointConfig::default() }
    ///     .check()
    ///     .unwrap_err();
    /// assert_eq!(e.setting, "requests_per_peer");
    /// ```
    pub fn check(&self) -> Result<(), ConfigError> {
        let zero = |setting, consequence| {
            Err(ConfigError {
                setting,
                consequence,
            })
        };
        if self.control_retry == Duration::ZERO {
            return zero(
                "control_retry",
                "an unacknowledged control message would be sent again at every turn",
            );
        }
        let counts = [
            (
                "idempotence_records_per_peer",
                self.idempotence_records_per_peer,
                "no handled control message would be remembered, so a resent one would be lost",
            ),
            (
                "pending_forks_per_peer",
                self.pending_forks_per_peer,
                "a reference passed on before its owner created it would drop its sender",
            ),
            (
                "requests_per_peer",
                self.requests_per_peer,
                "every call, remote and fetch would be refused as busy",
            ),
            (
                "parked_fetches_per_peer",
                self.parked_fetches_per_peer,
                "every fetch of a value still being created would be refused as busy",
            ),
            (
                "references_per_peer",
                self.references_per_peer,
                "every remote would be refused as busy",
            ),
            (
                "peer_budget",
                self.peer_budget,
                "a peer could make this worker hold nothing beyond a single item",
            ),
        ];
        match counts.into_iter().find(|(_, value, _)| *value == 0) {
            Some((setting, _, consequence)) => zero(setting, consequence),
            None => Ok(()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_defaults_pass_and_each_zero_is_refused_by_name() {
        let ok = EndpointConfig::default();
        assert!(ok.check().is_ok());
        let one = EndpointConfig {
            control_retry: Duration::from_nanos(1),
            idempotence_records_per_peer: 1,
            pending_forks_per_peer: 1,
            requests_per_peer: 1,
            parked_fetches_per_peer: 1,
            references_per_peer: 1,
            peer_budget: 1,
        };
        assert!(one.check().is_ok(), "the smallest settings that work pass");
        type Zero = fn(&mut EndpointConfig);
        let zeroed: [(&str, Zero); 7] = [
            ("control_retry", |c| c.control_retry = Duration::ZERO),
            ("idempotence_records_per_peer", |c| {
                c.idempotence_records_per_peer = 0
            }),
            ("pending_forks_per_peer", |c| c.pending_forks_per_peer = 0),
            ("requests_per_peer", |c| c.requests_per_peer = 0),
            ("parked_fetches_per_peer", |c| c.parked_fetches_per_peer = 0),
            ("references_per_peer", |c| c.references_per_peer = 0),
            ("peer_budget", |c| c.peer_budget = 0),
        ];
        for (setting, zero) in zeroed {
            let mut config = one.clone();
            zero(&mut config);
            let e = config.check().unwrap_err();
            assert_eq!(e.setting, setting);
            assert!(
                e.to_string()
                    .starts_with(&format!("EndpointConfig::{setting} is zero: ")),
                "{e}"
            );
        }
    }
}
