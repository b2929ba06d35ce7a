//! Graceful shutdown as phases of the protocol, over the members' own connections (no store, no
//! polling): the driver starts it with [`Endpoint::begin_graceful_shutdown`] (a static group:
//! every member stops together) or [`Endpoint::begin_leave`] (one worker leaves a dynamic
//! group), and learns the outcome from [`Event::ShutdownComplete`].
//!
//! A group's shutdown, on every member:
//! 1. *Drain ours*: wait until this worker's own calls are answered, then tell every member
//!    [`ShutdownSignal::Drained`].
//! 2. Wait until every member said `Drained`: nobody has a call in flight, so no new request
//!    will arrive (a function served on behalf of a caller finishes before that caller's call
//!    is answered, so its nested calls are answered before its caller drains).
//! 3. *Settle*: wait until nothing is outstanding here (requests answered, control messages
//!    acknowledged, bodies supplied), stop taking new calls ([`RunState::ShuttingDown`]), and
//!    tell every member [`ShutdownSignal::Idle`].
//! 4. *Leave*: once every member said `Idle`, the shutdown is complete; the driver stops.
//!
//! Connections keep their order, so a member that completed and closed its connections has
//! delivered its `Idle` first. A member lost before it said `Idle` can never say it: the
//! shutdown fails at once, naming it. At the deadline the shutdown fails naming who is missing:
//! the members whose signal did not come, or the peers this worker's unanswered calls and
//! unfinished work are with.

use std::collections::{BTreeSet, HashMap};
use std::time::Instant;

use serde::{Deserialize, Serialize};

use super::{Endpoint, Event, Header, Payload, ProtocolViolation, RunState, Transmit, WorkerId};

/// What a member tells every other during a graceful shutdown.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
pub enum ShutdownSignal {
    /// Every call of the sender is answered.
    Drained,
    /// The sender has nothing outstanding and takes no new calls.
    Idle,
}

/// How far a graceful shutdown got.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ShutdownPhase {
    /// Waiting for this worker's own calls to be answered.
    DrainingOwnCalls,
    /// Waiting for every member to say its calls are answered.
    WaitingForDrained,
    /// Waiting until nothing is outstanding here.
    Settling,
    /// Waiting for every member to say it is idle.
    WaitingForIdle,
    /// Complete.
    Done,
}

impl ShutdownPhase {
    fn describe(self) -> &'static str {
        match self {
            Self::DrainingOwnCalls => "this worker's calls are not all answered",
            Self::WaitingForDrained => "not every member has its calls answered",
            Self::Settling => {
                "requests are still being served or references still being released here"
            }
            Self::WaitingForIdle => "not every member is idle",
            Self::Done => "complete",
        }
    }
}

/// Why a graceful shutdown did not complete.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{}{}", .phase.describe(), if *.lost { " (a member was lost)" } else { "" })]
#[non_exhaustive]
pub struct ShutdownError {
    /// The phase it stopped in.
    pub phase: ShutdownPhase,
    /// Who it was waiting for, in rank order.
    pub missing: Vec<WorkerId>,
    /// Whether it failed because a member was lost (else: the deadline passed).
    pub lost: bool,
}

#[derive(Debug)]
pub(super) struct Shutdown {
    /// The other members (empty when leaving a dynamic group).
    members: BTreeSet<WorkerId>,
    /// Whether only this worker leaves (a dynamic group): it settles without telling anyone.
    leave: bool,
    deadline: Option<Instant>,
    phase: ShutdownPhase,
}

/// The shutdown state of an endpoint: its own shutdown, and what its peers said of theirs
/// (which can arrive before this worker begins its own).
#[derive(Debug, Default)]
pub(super) struct ShutdownState {
    ours: Option<Shutdown>,
    /// The latest signal from each peer.
    heard: HashMap<WorkerId, ShutdownSignal>,
    /// Peers whose shutdown failed, with who they waited for and whether those were lost.
    failed: HashMap<WorkerId, (Vec<WorkerId>, bool)>,
}

impl<B: Payload> Endpoint<B> {
    /// Begins a graceful shutdown of the whole group with the other `members` (see the
    /// [module docs](self)). `deadline` bounds it (`None`: no bound). The outcome comes as
    /// [`Event::ShutdownComplete`]. Calling it again changes nothing.
    pub fn begin_graceful_shutdown(
        &mut self,
        members: impl IntoIterator<Item = WorkerId>,
        deadline: Option<Instant>,
    ) {
        if self.shutdown.ours.is_some() {
            return;
        }
        let me = self.me;
        self.shutdown.ours = Some(Shutdown {
            members: members.into_iter().filter(|m| *m != me).collect(),
            leave: false,
            deadline,
            phase: ShutdownPhase::DrainingOwnCalls,
        });
        self.advance_shutdown();
    }

    /// Begins leaving a dynamic group: new requests from peers are refused from now on
    /// (requests already taken are answered); complete (by `deadline`) once this worker's own
    /// calls are answered, nothing is outstanding here (requests answered, control messages
    /// acknowledged) and every reference it passed on is confirmed by its owner; it then takes
    /// no new work. The others are not waited for: the membership protocol then removes this
    /// worker from them. The outcome comes as [`Event::ShutdownComplete`].
    pub fn begin_leave(&mut self, deadline: Option<Instant>) {
        if self.shutdown.ours.is_some() {
            return;
        }
        self.shutdown.ours = Some(Shutdown {
            members: BTreeSet::new(),
            leave: true,
            deadline,
            phase: ShutdownPhase::DrainingOwnCalls,
        });
        self.advance_shutdown();
    }

    /// Whether this worker began leaving a dynamic group ([`begin_leave`](Self::begin_leave)).
    pub fn is_leaving(&self) -> bool {
        self.shutdown.ours.as_ref().is_some_and(|s| s.leave)
    }

    /// The phase of this worker's graceful shutdown, if one began.
    pub fn shutdown_phase(&self) -> Option<ShutdownPhase> {
        self.shutdown.ours.as_ref().map(|s| s.phase)
    }

    /// The deadline of a shutdown in progress, for [`poll_timeout`](Self::poll_timeout).
    pub(super) fn shutdown_deadline(&self) -> Option<Instant> {
        self.shutdown
            .ours
            .as_ref()
            .filter(|s| s.phase != ShutdownPhase::Done)
            .and_then(|s| s.deadline)
    }

    /// Whether `from` may send `signal`: `Idle` only after `Drained`, each once.
    pub(super) fn check_shutdown_signal(
        &self,
        from: WorkerId,
        signal: ShutdownSignal,
    ) -> Result<(), ProtocolViolation> {
        let expected = match self.shutdown.heard.get(&from) {
            None => ShutdownSignal::Drained,
            Some(ShutdownSignal::Drained) => ShutdownSignal::Idle,
            Some(ShutdownSignal::Idle) => {
                return Err(ProtocolViolation::ShutdownOutOfOrder {
                    signal,
                    after: Some(ShutdownSignal::Idle),
                })
            }
        };
        if signal == expected {
            Ok(())
        } else {
            Err(ProtocolViolation::ShutdownOutOfOrder {
                signal,
                after: self.shutdown.heard.get(&from).copied(),
            })
        }
    }

    pub(super) fn on_shutdown_signal(&mut self, from: WorkerId, signal: ShutdownSignal) {
        self.shutdown.heard.insert(from, signal);
        self.advance_shutdown();
    }

    /// A peer that (re)joins starts with a clean slate.
    pub(super) fn forget_shutdown_of(&mut self, peer: WorkerId) {
        self.shutdown.heard.remove(&peer);
        self.shutdown.failed.remove(&peer);
    }

    /// A member's shutdown failed: ours fails too, naming whom it waited for (or the member
    /// itself, if it waited for us). Bounded: one record per peer.
    pub(super) fn on_shutdown_failed(
        &mut self,
        from: WorkerId,
        mut missing: Vec<WorkerId>,
        lost: bool,
    ) {
        let me = self.me;
        missing.retain(|m| *m != me);
        missing.sort_unstable();
        missing.dedup();
        if missing.is_empty() {
            missing.push(from);
        }
        self.shutdown.failed.insert(from, (missing, lost));
        self.advance_shutdown();
    }

    /// A member whose shutdown failed makes ours fail, naming what it named.
    fn fail_if_member_failed(&mut self, phase: ShutdownPhase) -> bool {
        let Some(s) = self.shutdown.ours.as_ref() else {
            return false;
        };
        let Some((missing, lost)) = s
            .members
            .iter()
            .find_map(|m| self.shutdown.failed.get(m))
            .cloned()
        else {
            return false;
        };
        self.finish_shutdown_with(ShutdownError {
            phase,
            missing,
            lost,
        });
        true
    }

    /// Moves the shutdown on as far as the state allows. Called after every input that can
    /// change what it waits for.
    pub(super) fn advance_shutdown(&mut self) {
        loop {
            let Some(s) = self.shutdown.ours.as_ref() else {
                return;
            };
            let (phase, leave) = (s.phase, s.leave);
            if phase != ShutdownPhase::Done && self.fail_if_member_failed(phase) {
                return;
            }
            let next = match phase {
                ShutdownPhase::DrainingOwnCalls => {
                    if !(self.pending.is_empty() && self.deferred.is_empty()) {
                        return;
                    }
                    if leave {
                        // No member to tell: settle (below), then leave.
                        ShutdownPhase::Settling
                    } else {
                        self.signal_members(ShutdownSignal::Drained);
                        ShutdownPhase::WaitingForDrained
                    }
                }
                ShutdownPhase::WaitingForDrained => {
                    if self.fail_if_member_lost(phase) {
                        return;
                    }
                    if !self.missing_signal(ShutdownSignal::Drained).is_empty() {
                        return;
                    }
                    ShutdownPhase::Settling
                }
                ShutdownPhase::Settling => {
                    if self.fail_if_member_lost(phase) || !self.is_idle() {
                        return;
                    }
                    // A leaver also waits until the references it passed on are confirmed by
                    // their owners: once it is gone, its own fork no longer keeps them alive.
                    if leave && self.used.values().any(|u| !u.pending_children.is_empty()) {
                        return;
                    }
                    if self.state == RunState::Running {
                        self.state = RunState::ShuttingDown;
                    }
                    self.signal_members(ShutdownSignal::Idle);
                    ShutdownPhase::WaitingForIdle
                }
                ShutdownPhase::WaitingForIdle => {
                    if self.fail_if_member_lost(phase) {
                        return;
                    }
                    if !self.missing_signal(ShutdownSignal::Idle).is_empty() {
                        return;
                    }
                    ShutdownPhase::Done
                }
                ShutdownPhase::Done => return,
            };
            if let Some(s) = self.shutdown.ours.as_mut() {
                s.phase = next;
            }
            if next == ShutdownPhase::Done {
                self.events
                    .push_back(Event::ShutdownComplete { outcome: Ok(()) });
                return;
            }
        }
    }

    /// At the deadline, a shutdown not yet complete fails naming who it waits for.
    pub(super) fn expire_shutdown(&mut self, now: Instant) {
        let Some(s) = self.shutdown.ours.as_ref() else {
            return;
        };
        if s.phase == ShutdownPhase::Done || s.deadline.is_none_or(|d| d > now) {
            return;
        }
        let phase = s.phase;
        let missing = match phase {
            ShutdownPhase::DrainingOwnCalls => {
                let mut to: BTreeSet<WorkerId> = self.pending.values().map(|p| p.to).collect();
                to.extend(self.deferred.values().map(|d| d.to));
                to.into_iter().collect()
            }
            ShutdownPhase::WaitingForDrained => self.missing_signal(ShutdownSignal::Drained),
            ShutdownPhase::Settling => {
                let mut with: BTreeSet<WorkerId> = self.pending.values().map(|p| p.to).collect();
                with.extend(self.incoming.iter().map(|t| t.from));
                with.extend(self.unacked.values().map(|u| u.to));
                with.extend(self.deferred.values().map(|d| d.to));
                with.extend(self.children.values().map(|(_, to)| *to));
                with.into_iter().collect()
            }
            ShutdownPhase::WaitingForIdle => self.missing_signal(ShutdownSignal::Idle),
            ShutdownPhase::Done => return,
        };
        self.finish_shutdown_with(ShutdownError {
            phase,
            missing,
            lost: false,
        });
    }

    fn finish_shutdown_with(&mut self, err: ShutdownError) {
        if let Some(s) = self.shutdown.ours.as_mut() {
            s.phase = ShutdownPhase::Done;
        }
        // The others learn why before this worker goes (its connections keep their order).
        let members: Vec<WorkerId> = self
            .shutdown
            .ours
            .as_ref()
            .map(|s| s.members.iter().copied().collect())
            .unwrap_or_default();
        for to in members {
            if !self.lost.contains(&to) {
                self.send_out(Transmit {
                    to,
                    header: Header::ShutdownFailed {
                        missing: err.missing.clone(),
                        lost: err.lost,
                    },
                    body: None,
                });
            }
        }
        self.events
            .push_back(Event::ShutdownComplete { outcome: Err(err) });
    }

    /// Members lost before they said `Idle` can never say it: fail naming them.
    fn fail_if_member_lost(&mut self, phase: ShutdownPhase) -> bool {
        let Some(s) = self.shutdown.ours.as_ref() else {
            return false;
        };
        let gone: Vec<WorkerId> = s
            .members
            .iter()
            .copied()
            .filter(|m| {
                self.lost.contains(m) && self.shutdown.heard.get(m) != Some(&ShutdownSignal::Idle)
            })
            .collect();
        if gone.is_empty() {
            return false;
        }
        self.finish_shutdown_with(ShutdownError {
            phase,
            missing: gone,
            lost: true,
        });
        true
    }

    /// The members that have not said `signal` (or a later one).
    fn missing_signal(&self, signal: ShutdownSignal) -> Vec<WorkerId> {
        let Some(s) = self.shutdown.ours.as_ref() else {
            return Vec::new();
        };
        s.members
            .iter()
            .copied()
            .filter(|m| self.shutdown.heard.get(m).is_none_or(|h| *h < signal))
            .collect()
    }

    fn signal_members(&mut self, signal: ShutdownSignal) {
        let members: Vec<WorkerId> = self
            .shutdown
            .ours
            .as_ref()
            .map(|s| s.members.iter().copied().collect())
            .unwrap_or_default();
        for to in members {
            if self.lost.contains(&to) {
                continue;
            }
            self.send_out(Transmit {
                to,
                header: Header::Shutdown { signal },
                body: None,
            });
        }
    }
}
