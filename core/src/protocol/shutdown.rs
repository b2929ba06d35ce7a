//! Graceful shutdown as a termination detection, over the members' own connections (no store,
//! no polling): the driver starts it with [`Endpoint::begin_graceful_shutdown`] (a static group:
//! every member stops together) or [`Endpoint::begin_leave`] (one worker leaves a dynamic
//! group), and learns the outcome from [`Event::ShutdownComplete`].
//!
//! # A group's shutdown: rounds until two agree
//! A graceful shutdown must not cut work that is still spreading: a function that starts a
//! nested call and returns without awaiting it (a fire-and-forget chain) answers its own caller
//! while its nested call is still on its way, so "every member's own calls are answered" says
//! nothing about the calls those calls started. PyTorch's `_wait_all_workers` repeats a global
//! count until a round sees no work; we do the same without a leader:
//!
//! 1. *Settle*: wait until this worker is idle ([`Endpoint::is_idle`]: no call of ours
//!    awaiting a reply, no request being served, no control message unacknowledged, no body
//!    being prepared).
//! 2. *Report*: send every member [`ShutdownSignal`] `{ round, activity }`: the round number
//!    (1, 2, …) and this worker's *activity*, a count of the protocol messages it has sent and
//!    received and of the requests it answered (shutdown messages not counted).
//! 3. *Decide*: once every member's report of the round is in, every member decides the same
//!    thing, from the same reports: if the round is the second or later and **every** member
//!    (this worker included) reported the same activity as in the round before, the group has
//!    terminated: the shutdown is complete, and the endpoint stops taking new calls
//!    ([`RunState::ShuttingDown`]). Otherwise the next round begins (back to 1).
//!
//! Why this is safe: a member reports only when idle, and sends its report of round `r + 1`
//! only after it has every member's report of round `r`. So the moment the last report of round
//! `r` was sent lies, for every member, between its own two reports. A member whose activity
//! did not change between them sent and received nothing in between, so it was idle at that
//! moment too. At that moment every member was idle; and every message in flight keeps its
//! sender or its receiver from being idle (a request: the caller waits for the reply; a reply:
//! the caller has not had it; a control message: its sender waits for the acknowledgement; an
//! acknowledgement: the same). So nothing was in flight and no member was working: nothing
//! can start again except new work a user starts after the shutdown, which is refused. Work
//! started before every worker called shutdown, however far it spreads, is never refused.
//! Rounds cost one message per member pair each, and a busy member holds a round back (it
//! reports only when idle) instead of letting rounds spin; an idle group completes in two.
//!
//! A report's round must follow the sender's last one, may be at most one ahead of ours (a
//! member sends round `r + 1` only once it has our round `r`), and its activity never goes
//! down: anything else is a [`ProtocolViolation::ShutdownOutOfOrder`]. Connections keep their
//! order, so a member that completed and closed its connections has delivered its last report
//! first. A member lost before its report of the round we wait for can never send it: the
//! shutdown fails at once, naming it. At the deadline the shutdown fails naming who is missing:
//! the members whose report did not come, or the peers this worker's unfinished work is with.
//!
//! # Leaving a dynamic group
//! The leaver refuses new requests, waits until its own calls are answered, nothing is
//! outstanding here and the references it passed on are confirmed by their owners, and is
//! done; the others are not waited for (the membership protocol removes it from them).

pub mod plan;

use std::collections::BTreeSet;

use crate::hashing::HashMap;
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

use super::{
    Endpoint, Event, Header, LostCause, Payload, ProtocolViolation, RunState, Transmit, WorkerId,
};

/// One member's report in a round of a graceful shutdown (see the [module docs](self)).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct ShutdownSignal {
    /// The round, from 1.
    pub round: u32,
    /// The sender's count of protocol messages sent and received and requests answered,
    /// when it reported (it reports only when idle).
    pub activity: u64,
}

/// How far a graceful shutdown got.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum ShutdownPhase {
    /// Leaving a dynamic group: waiting for this worker's own calls to be answered.
    DrainingOwnCalls,
    /// Waiting until nothing is outstanding here (to report the next round, or to leave).
    Settling,
    /// Waiting for every member's report of the current round.
    WaitingForReports,
    /// Complete.
    Done,
}

impl ShutdownPhase {
    fn describe(self) -> &'static str {
        match self {
            Self::DrainingOwnCalls => "this worker's calls are not all answered",
            Self::Settling => "calls, requests or reference messages are still outstanding here",
            Self::WaitingForReports => "not every member reported that it is idle",
            Self::Done => "complete",
        }
    }
}

/// Why a graceful shutdown did not complete.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{}{}{}", .phase.describe(), lost_words(*.lost, .causes), .reported_by.map(|w| format!(" (as worker {w} reported: its own shutdown failed waiting for them)")).unwrap_or_default())]
#[non_exhaustive]
pub struct ShutdownError {
    /// The phase it stopped in.
    pub phase: ShutdownPhase,
    /// Who it was waiting for, in rank order.
    pub missing: Vec<WorkerId>,
    /// Whether it failed because a member was lost (else: the deadline passed).
    pub lost: bool,
    /// Why each member this worker saw lost was lost, in rank order (the endpoint's first
    /// cause of each): empty when the deadline passed or another member reported the failure.
    pub causes: Vec<(WorkerId, LostCause)>,
    /// The member whose failed shutdown made this one fail, naming `missing` (a report about
    /// other workers is that member's word, and the error says whose); `None`: this worker
    /// saw the failure itself.
    pub reported_by: Option<WorkerId>,
}

/// " (a member was lost)", with each cause this worker knows ("rank 0: …").
fn lost_words(lost: bool, causes: &[(WorkerId, LostCause)]) -> String {
    match (lost, causes) {
        (false, _) => String::new(),
        (true, []) => " (a member was lost)".to_owned(),
        (true, causes) => {
            let each: Vec<String> = causes
                .iter()
                .map(|(w, cause)| format!("rank {w}: {cause}"))
                .collect();
            format!(" (a member was lost: {})", each.join("; "))
        }
    }
}

#[derive(Debug)]
pub(super) struct Shutdown {
    /// The other members (empty when leaving a dynamic group).
    members: BTreeSet<WorkerId>,
    /// Whether only this worker leaves (a dynamic group): it settles without telling anyone.
    leave: bool,
    deadline: Option<Instant>,
    phase: ShutdownPhase,
    /// Our reports: the latest (its round is the round we wait for) and the one before.
    reports: Reports,
    /// Waiting for reports, the last walk of the members found none lost and one report of
    /// this round missing, and neither a report nor a loss has come since: only a report, a
    /// failure or a loss moves the shutdown on, so the messages served meanwhile ask no walk
    /// of their own. Cleared when a report comes, a peer is lost or forgotten and the phase
    /// changes.
    missing_known: bool,
}

/// A member's last two reports.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
struct Reports {
    latest: Option<ShutdownSignal>,
    previous: Option<ShutdownSignal>,
}

impl Reports {
    fn round(&self) -> u32 {
        self.latest.map_or(0, |s| s.round)
    }

    fn push(&mut self, signal: ShutdownSignal) {
        self.previous = self.latest.replace(signal);
    }

    /// The activity reported in `round`, if that is one of the two kept.
    fn activity_in(&self, round: u32) -> Option<u64> {
        [self.latest, self.previous]
            .into_iter()
            .flatten()
            .find(|s| s.round == round)
            .map(|s| s.activity)
    }

    /// Whether `round` (≥ 2) reported the same activity as the round before it.
    fn unchanged_in(&self, round: u32) -> bool {
        round >= 2
            && matches!(
                (self.activity_in(round), self.activity_in(round - 1)),
                (Some(a), Some(b)) if a == b
            )
    }
}

/// The most a graceful shutdown's endpoint deadline comes before the caller's
/// ([`graceful_deadline`]).
pub const GRACEFUL_MARGIN: Duration = Duration::from_millis(500);

/// The deadline to give [`Endpoint::begin_graceful_shutdown`] when the caller's whole shutdown
/// (`timeout` long) ends at `deadline`: a little before it (a tenth of the timeout, at most
/// [`GRACEFUL_MARGIN`]), so that the endpoint's error, which names who is missing, is the one
/// returned rather than the caller's own timeout.
pub fn graceful_deadline(deadline: Instant, timeout: Duration) -> Instant {
    let margin = (timeout / 10).min(GRACEFUL_MARGIN);
    deadline.checked_sub(margin).unwrap_or(deadline)
}

/// The shutdown state of an endpoint: its own shutdown, and what its peers said of theirs
/// (which can arrive before this worker begins its own).
#[derive(Debug, Default)]
pub(super) struct ShutdownState {
    ours: Option<Shutdown>,
    /// Each peer's last two reports. Bounded: one record per peer, two reports each.
    heard: HashMap<WorkerId, Reports>,
    /// Peers whose shutdown failed, with who they waited for and whether those were lost.
    failed: HashMap<WorkerId, (Vec<WorkerId>, bool)>,
    /// Messages sent and received and requests answered (see [`ShutdownSignal::activity`]).
    activity: u64,
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
            phase: ShutdownPhase::Settling,
            reports: Reports::default(),
            missing_known: false,
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
            reports: Reports::default(),
            missing_known: false,
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

    /// The round of the graceful shutdown this worker reported last (0: none yet).
    pub fn shutdown_round(&self) -> u32 {
        self.shutdown.ours.as_ref().map_or(0, |s| s.reports.round())
    }

    /// The deadline of a shutdown in progress, for [`poll_timeout`](Self::poll_timeout).
    pub(super) fn shutdown_deadline(&self) -> Option<Instant> {
        self.shutdown
            .ours
            .as_ref()
            .filter(|s| s.phase != ShutdownPhase::Done)
            .and_then(|s| s.deadline)
    }

    /// Counts a message sent or received, or a request answered, for the termination
    /// detection (shutdown messages are not counted: see the [module docs](self)).
    pub(super) fn count_activity(&mut self, header: Option<&Header>) {
        if !matches!(
            header,
            Some(Header::Shutdown { .. } | Header::ShutdownFailed { .. })
        ) {
            self.shutdown.activity = self.shutdown.activity.wrapping_add(1);
        }
    }

    /// Whether `from` may send `signal`: the round after its last one, at most one round ahead
    /// of ours, and an activity that did not go down.
    pub(super) fn check_shutdown_signal(
        &self,
        from: WorkerId,
        signal: ShutdownSignal,
    ) -> Result<(), ProtocolViolation> {
        let heard = self.shutdown.heard.get(&from).copied().unwrap_or_default();
        let ours = self.shutdown_round();
        let in_order = signal.round == heard.round() + 1
            && signal.round <= ours + 1
            && heard.latest.is_none_or(|l| signal.activity >= l.activity);
        if in_order {
            Ok(())
        } else {
            Err(ProtocolViolation::ShutdownOutOfOrder {
                signal,
                after: heard.latest,
                our_round: ours,
            })
        }
    }

    /// Whether `from` may say its shutdown failed, naming `missing`: once (a shutdown ends
    /// once), and naming each worker once, in rank order, as an honest sender's list is.
    pub(super) fn check_shutdown_failed(
        &self,
        from: WorkerId,
        missing: &[WorkerId],
    ) -> Result<(), ProtocolViolation> {
        if self.shutdown.failed.contains_key(&from) {
            return Err(ProtocolViolation::ForgedShutdownFailure {
                what: "a second report that its shutdown failed",
            });
        }
        if missing.windows(2).any(|w| w[0] >= w[1]) {
            return Err(ProtocolViolation::ForgedShutdownFailure {
                what: "a list of missing workers that is not in rank order or names one twice",
            });
        }
        Ok(())
    }

    pub(super) fn on_shutdown_signal(&mut self, from: WorkerId, signal: ShutdownSignal) {
        self.shutdown.heard.entry(from).or_default().push(signal);
        self.forget_missing_reports();
        self.advance_shutdown();
    }

    /// A peer that (re)joins starts with a clean slate.
    pub(super) fn forget_shutdown_of(&mut self, peer: WorkerId) {
        self.shutdown.heard.remove(&peer);
        self.shutdown.failed.remove(&peer);
        self.forget_missing_reports();
    }

    /// What the reports heard say must be walked again ([`Shutdown::missing_known`]).
    pub(super) fn forget_missing_reports(&mut self) {
        if let Some(s) = self.shutdown.ours.as_mut() {
            s.missing_known = false;
        }
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
        if self.shutdown.failed.is_empty() {
            return false;
        }
        let Some(s) = self.shutdown.ours.as_ref() else {
            return false;
        };
        let Some((reporter, (missing, lost))) = s
            .members
            .iter()
            .find_map(|m| Some((*m, self.shutdown.failed.get(m)?.clone())))
        else {
            return false;
        };
        self.finish_shutdown_with(ShutdownError {
            phase,
            missing,
            lost,
            causes: Vec::new(),
            reported_by: Some(reporter),
        });
        true
    }

    /// Moves the shutdown on as far as the state allows. Called after every input that can
    /// change what it waits for.
    // Inlined: most calls find no shutdown, or one waiting for a report known missing with
    // nothing come since that could move it (the messages served meanwhile, after every one).
    #[inline]
    pub(super) fn advance_shutdown(&mut self) {
        match &self.shutdown.ours {
            None => {}
            // Set only while waiting for reports, after a walk that found no member lost and
            // one report missing; a report, a loss, a forgotten peer or a new phase clear it.
            Some(s) if s.missing_known && self.shutdown.failed.is_empty() => {}
            Some(_) => self.advance_shutdown_walk(),
        }
    }

    /// [`advance_shutdown`](Self::advance_shutdown) past its quick answers.
    fn advance_shutdown_walk(&mut self) {
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
                    ShutdownPhase::Settling
                }
                ShutdownPhase::Settling => {
                    if self.fail_if_member_lost(phase) || !self.is_idle() {
                        return;
                    }
                    if leave {
                        // A leaver also waits until the references it passed on are confirmed
                        // by their owners: once it is gone, its own fork no longer keeps them
                        // alive.
                        if self.used.values().any(|u| !u.pending_children.is_empty()) {
                            return;
                        }
                        ShutdownPhase::Done
                    } else {
                        self.report_round();
                        ShutdownPhase::WaitingForReports
                    }
                }
                ShutdownPhase::WaitingForReports => {
                    if self.fail_if_member_lost(phase) {
                        return;
                    }
                    if self.reports_missing() {
                        return;
                    }
                    if self.round_agrees() {
                        ShutdownPhase::Done
                    } else {
                        ShutdownPhase::Settling
                    }
                }
                ShutdownPhase::Done => return,
            };
            if let Some(s) = self.shutdown.ours.as_mut() {
                s.phase = next;
                s.missing_known = false;
            }
            if next == ShutdownPhase::Done {
                if self.state == RunState::Running {
                    self.state = RunState::ShuttingDown;
                }
                self.events
                    .push_back(Event::ShutdownComplete { outcome: Ok(()) });
                return;
            }
        }
    }

    /// Sends every member our report of the next round.
    fn report_round(&mut self) {
        let activity = self.shutdown.activity;
        let Some(s) = self.shutdown.ours.as_mut() else {
            return;
        };
        let signal = ShutdownSignal {
            round: s.reports.round() + 1,
            activity,
        };
        s.reports.push(signal);
        let members: Vec<WorkerId> = s.members.iter().copied().collect();
        for to in members {
            if !self.lost.contains_key(&to) {
                self.send_out(Transmit {
                    to,
                    header: Header::Shutdown { signal },
                    body: None,
                });
            }
        }
    }

    /// Whether every member, this worker included, reported the same activity in the current
    /// round as in the one before (the group terminated: see the [module docs](self)).
    fn round_agrees(&self) -> bool {
        let Some(s) = self.shutdown.ours.as_ref() else {
            return false;
        };
        let round = s.reports.round();
        s.reports.unchanged_in(round)
            && s.members.iter().all(|m| {
                self.shutdown
                    .heard
                    .get(m)
                    .is_some_and(|r| r.unchanged_in(round))
            })
    }

    /// The members whose report of the round we wait for has not come.
    fn missing_reports(&self) -> Vec<WorkerId> {
        self.members_not_reported().collect()
    }

    /// Whether a member has not reported this round yet (`missing_reports` without the
    /// list: asked after every message while a shutdown waits). The members are walked only
    /// when a report came since the last walk found one missing ([`Shutdown::missing_known`]).
    fn reports_missing(&mut self) -> bool {
        if self.shutdown.ours.as_ref().is_some_and(|s| s.missing_known) {
            return true;
        }
        let missing = self.members_not_reported().next().is_some();
        if let Some(s) = self.shutdown.ours.as_mut() {
            s.missing_known = missing;
        }
        missing
    }

    fn members_not_reported(&self) -> impl Iterator<Item = WorkerId> + '_ {
        let ours = self.shutdown.ours.as_ref();
        let round = ours.map(|s| s.reports.round());
        ours.into_iter()
            .flat_map(|s| s.members.iter().copied())
            .filter(move |m| {
                self.shutdown
                    .heard
                    .get(m)
                    .is_none_or(|r| round.is_some_and(|round| r.activity_in(round).is_none()))
            })
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
            ShutdownPhase::Settling => {
                let mut with: BTreeSet<WorkerId> = self.pending.values().map(|p| p.to).collect();
                with.extend(self.incoming.iter().map(|t| t.from));
                with.extend(self.unacked.values().map(|u| u.to));
                with.extend(self.deferred.values().map(|d| d.to));
                with.extend(self.children.values().map(|(_, to)| *to));
                with.into_iter().collect()
            }
            ShutdownPhase::WaitingForReports => self.missing_reports(),
            ShutdownPhase::Done => return,
        };
        self.finish_shutdown_with(ShutdownError {
            phase,
            missing,
            lost: false,
            causes: Vec::new(),
            reported_by: None,
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
            if !self.lost.contains_key(&to) {
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

    /// Members lost before their report of the round we wait for (or, settling, of the next
    /// one) can never send it: fail naming them. A member that completed and closed its
    /// connections delivered its last report first, and we complete on that same round.
    fn fail_if_member_lost(&mut self, phase: ShutdownPhase) -> bool {
        // Only a lost peer can be a member gone (checked after every message while a
        // shutdown waits: no walk of the members when none is lost).
        if self.lost.is_empty() {
            return false;
        }
        let Some(s) = self.shutdown.ours.as_ref() else {
            return false;
        };
        let round = match phase {
            ShutdownPhase::WaitingForReports => s.reports.round(),
            _ => s.reports.round() + 1,
        };
        let gone: Vec<WorkerId> = s
            .members
            .iter()
            .copied()
            .filter(|m| {
                self.lost.contains_key(m)
                    && self
                        .shutdown
                        .heard
                        .get(m)
                        .is_none_or(|r| r.activity_in(round).is_none())
            })
            .collect();
        if gone.is_empty() {
            return false;
        }
        let causes = gone
            .iter()
            .filter_map(|m| Some((*m, self.lost.get(m)?.clone())))
            .collect();
        self.finish_shutdown_with(ShutdownError {
            phase,
            missing: gone,
            lost: true,
            causes,
            reported_by: None,
        });
        true
    }
}
