//! The endpoint's debug view: what it holds and waits for ([`Endpoint::debug_info`]).

use super::*;

/// A snapshot of an endpoint's references and calls ([`Endpoint::debug_info`]).
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct DebugInfo {
    /// Running, shutting down or stopped.
    pub state: RunState,
    /// The references this worker owns, by id.
    pub owned: Vec<OwnedInfo>,
    /// The forks this worker holds of references owned elsewhere, by fork id.
    pub forks: Vec<ForkInfo>,
    /// Our calls awaiting a reply, per callee.
    pub calls_in_flight: std::collections::BTreeMap<WorkerId, usize>,
    /// Requests we have not answered yet, per caller.
    pub requests_being_served: std::collections::BTreeMap<WorkerId, usize>,
    /// Control messages (fork requests, child accepts, deletes) not yet acknowledged.
    pub unacknowledged_control: usize,
    /// Records kept to acknowledge resent control messages without handling them twice (bounded
    /// by the control messages in flight, not by how many were ever received).
    pub idempotence_records: usize,
}

impl DebugInfo {
    /// Whether the application still holds references: a user fork with live handles, or an
    /// owned value with local handles.
    pub fn holds_references(&self) -> bool {
        self.forks.iter().any(|f| f.handles > 0) || self.owned.iter().any(|o| o.local_handles > 0)
    }
}

/// The references and calls, as the agent's debug view says them: "owned references r (n
/// forks elsewhere, m handles here, ...); forks held f of r on rank o (h handles, pending
/// user); calls in flight {..}; requests being served {..}".
impl fmt::Display for DebugInfo {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "owned references {}; forks held {}; calls in flight {:?}; requests being served {:?}",
            self.owned
                .iter()
                .map(|o| format!(
                    "{} ({} forks elsewhere, {} handles here{}{})",
                    o.rref,
                    o.forks,
                    o.local_handles,
                    if o.request_holds > 0 {
                        format!(", held by {} requests being served", o.request_holds)
                    } else {
                        String::new()
                    },
                    if o.being_created {
                        ", being created"
                    } else {
                        ""
                    }
                ))
                .collect::<Vec<_>>()
                .join(", "),
            self.forks
                .iter()
                .map(|u| format!(
                    "{} of {} on rank {} ({} handles{})",
                    u.fork,
                    u.rref,
                    u.owner,
                    u.handles,
                    if u.confirmed { "" } else { ", pending user" }
                ))
                .collect::<Vec<_>>()
                .join(", "),
            self.calls_in_flight,
            self.requests_being_served,
        )
    }
}

/// An owned reference in [`DebugInfo`].
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct OwnedInfo {
    /// The reference.
    pub rref: RRefId,
    /// Forks held by other workers.
    pub forks: usize,
    /// Handles held on this worker.
    pub local_handles: u32,
    /// Requests being served here that name it (as their target, or among their arguments),
    /// each holding the value until it is answered.
    pub request_holds: u32,
    /// The value is still being created.
    pub being_created: bool,
}

/// A user fork in [`DebugInfo`].
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct ForkInfo {
    /// The reference.
    pub rref: RRefId,
    /// The fork.
    pub fork: ForkId,
    /// The owner.
    pub owner: WorkerId,
    /// Whether the owner has confirmed it (a pending user, if not).
    pub confirmed: bool,
    /// Handles held on this worker.
    pub handles: u32,
    /// Forks made from it that the owner has not confirmed yet.
    pub pending_children: usize,
}

impl<B: Payload> Endpoint<B> {
    /// What this endpoint holds and waits for, for debugging (PyTorch's `_get_debug_info` and
    /// `_rref_context_get_debug_info`).
    pub fn debug_info(&self) -> DebugInfo {
        let mut owned: Vec<OwnedInfo> = self
            .owned
            .iter()
            .map(|(rref, o)| OwnedInfo {
                rref: *rref,
                forks: o.forks.len(),
                local_handles: o.local_handles,
                request_holds: o.request_holds,
                being_created: o.state.is_none(),
            })
            .collect();
        owned.sort_by_key(|o| o.rref);
        let mut forks: Vec<ForkInfo> = self
            .used
            .iter()
            .map(|(fork, u)| ForkInfo {
                rref: u.rref,
                fork: *fork,
                owner: u.owner,
                confirmed: u.confirmed,
                handles: u.handles,
                pending_children: u.pending_children.len(),
            })
            .collect();
        forks.sort_by_key(|f| f.fork);
        let mut calls_in_flight = std::collections::BTreeMap::new();
        for p in self.pending.values() {
            *calls_in_flight.entry(p.to).or_insert(0) += 1;
        }
        let mut requests_being_served = std::collections::BTreeMap::new();
        for t in self.incoming.iter() {
            *requests_being_served.entry(t.from).or_insert(0) += 1;
        }
        DebugInfo {
            state: self.state,
            owned,
            forks,
            calls_in_flight,
            requests_being_served,
            unacknowledged_control: self.unacked.len(),
            idempotence_records: self.seen_control.values().map(|s| s.ids.len()).sum(),
        }
    }
}
