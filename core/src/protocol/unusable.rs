//! Why a remote reference cannot be used, as its user is told: which error a refusal of the
//! endpoint is ([`RRefFailure::of`]), who is named for a wait that failed
//! ([`ConfirmError::owner_among`]), and the words of each ([`RRefError`]). The agent wraps
//! them in its own error with the reference's id and its owner's name.

use super::membership::WorkerInfo;
use super::{CallError, ConfirmError, RRefHandle, WorkerId};

/// Why a remote reference could not be used (the agent's `RpcError::RRef`).
#[derive(Debug, Clone, thiserror::Error)]
#[non_exhaustive]
pub enum RRefError {
    /// Its value was asked for on a worker that is not its owner.
    #[error("local_value() is only available on the owner, {owner}")]
    NotOwner {
        /// The owner.
        owner: WorkerInfo,
    },
    /// Its owner keeps no value for it any more.
    #[error("the value is gone")]
    Gone,
    /// Its value is of another type than the one asked for.
    #[error("the value is not a {expected}")]
    OtherType {
        /// The type asked for.
        expected: &'static str,
    },
    /// Its owner did not confirm it (the endpoint decided: the owner was lost, the deadline
    /// passed, or its creation failed).
    #[error("{}", unconfirmed(&owner.name, source))]
    Unconfirmed {
        /// The owner.
        owner: WorkerInfo,
        /// What the endpoint decided.
        #[source]
        source: ConfirmError,
    },
    /// The endpoint refuses it (its owner is lost, or it was released).
    #[error("{0}")]
    Refused(#[source] CallError),
}

fn unconfirmed(owner: &str, e: &ConfirmError) -> String {
    match e {
        ConfirmError::OwnerLost { .. } => {
            format!("in the arguments, its owner {owner} was lost before confirming it")
        }
        ConfirmError::Deadline { .. } => format!(
            "in the arguments, its owner {owner} did not confirm it before the call's deadline"
        ),
        ConfirmError::Creation { error, .. } => {
            format!("in the arguments, its creation on {owner} failed: {error}")
        }
    }
}

/// What the endpoint's refusal of a reference's use (a fetch, a method call on it, passing it
/// on) is, as its user is told.
#[derive(Debug, Clone)]
pub enum RRefFailure {
    /// The agent is not running (shut down).
    NotRunning,
    /// Its creation failed, or its `remote()` timed out before the owner confirmed it: the
    /// agent's `RpcError::RRefCreation`, naming the reference and its owner.
    Creation(CallError),
    /// Any other refusal ([`RRefError::Refused`]).
    Refused(RRefError),
}

impl RRefFailure {
    /// Which failure the endpoint's `e` is.
    pub fn of(e: CallError) -> Self {
        match e {
            CallError::NotRunning => RRefFailure::NotRunning,
            e @ (CallError::RRefCreationTimedOut { .. } | CallError::Remote(_)) => {
                RRefFailure::Creation(e)
            }
            other => RRefFailure::Refused(RRefError::Refused(other)),
        }
    }
}

impl ConfirmError {
    /// The owner to name for this failed wait on `handles`: the owner of the handle it names
    /// (the endpoint waits on those only), else the reference's creator, which stands in for
    /// an owner never needed.
    pub fn owner_among(&self, handles: &[RRefHandle]) -> WorkerId {
        let rref = self.rref();
        handles
            .iter()
            .find(|h| h.rref == rref)
            .map_or(rref.created_on, |h| h.owner)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::protocol::{RRefId, RemoteError, RemoteErrorKind};

    fn rref(created_on: WorkerId, local: u64) -> RRefId {
        RRefId { created_on, local }
    }

    #[test]
    fn a_refusal_is_a_creation_failure_only_for_a_failed_or_late_creation() {
        assert!(matches!(
            RRefFailure::of(CallError::NotRunning),
            RRefFailure::NotRunning
        ));
        let remote = CallError::Remote(RemoteError {
            worker: 1,
            kind: RemoteErrorKind::Failed,
            message: "boom".into(),
        });
        assert!(matches!(
            RRefFailure::of(remote),
            RRefFailure::Creation(CallError::Remote(_))
        ));
        let unknown = CallError::UnknownRRef(rref(1, 2));
        let RRefFailure::Refused(e) = RRefFailure::of(unknown.clone()) else {
            panic!("an unknown reference is refused");
        };
        assert_eq!(e.to_string(), unknown.to_string());
    }

    #[test]
    fn an_unconfirmed_reference_names_its_owner_among_the_handles_waited_on() {
        let (r, other) = (rref(3, 1), rref(4, 1));
        let handles = [RRefHandle {
            rref: r,
            fork: r,
            owner: 5,
        }];
        let lost = ConfirmError::OwnerLost { rref: r, owner: 5 };
        assert_eq!(lost.owner_among(&handles), 5);
        let elsewhere = ConfirmError::Deadline {
            rref: other,
            owner: 9,
        };
        assert_eq!(elsewhere.owner_among(&handles), 4);
        let e = RRefError::Unconfirmed {
            owner: WorkerInfo {
                name: "ps".into(),
                id: 5,
            },
            source: lost,
        };
        assert_eq!(
            e.to_string(),
            "in the arguments, its owner ps was lost before confirming it"
        );
    }
}
