//! What a rank takes into its collective inboxes from a peer, decided without I/O.
//!
//! A mesh files every collective message by (peer, group, sequence number) until a collective
//! takes it. An authenticated peer may only send collective frames for groups it is a member
//! of, and may only make this rank hold so much; [`Admission`] decides, for each frame, whether
//! it is taken or is a [`MeshViolation`] of its sender (whom the mesh then drops):
//!
//! | bound ([`InboxLimits`]) | default | a frame beyond it |
//! |---|---|---|
//! | group membership | the group's ranks | [`MeshViolation::NotInGroup`] |
//! | `group_id_window` | 1,024 ids beyond the newest group made here | [`MeshViolation::UnknownGroup`] |
//! | `sequence_window` | 65,536 beyond this rank's newest collective in the group | [`MeshViolation::AheadOfWindow`] |
//! | `buffered_messages` | 65,536 not yet taken, per peer | [`MeshViolation::InboxFull`] |
//! | their bytes | the peer's memory budget ([`crate::budget`], 256 MiB), shared with what else it makes this rank hold | [`MeshViolation::OverBudget`] |
//!
//! A message a collective is already waiting for is always taken (it is handed over at once);
//! so is a peer's first unclaimed message, and one message of a peer that holds nothing else
//! passes the budget whatever its size, so one honest message larger than the budget still
//! passes. Groups are made on each rank without a round trip, so a peer
//! may send for a group this rank has not made yet: such frames are held (within the bounds)
//! and checked against the members once the group is made ([`Admission::register_group`]).
//! An abort names its sender's own rank ([`check_abort`]); a disagreement notice must be one its
//! sender could have seen ([`Admission::check_disagreement`]).
//!
//! ```
//! use tensorwire_core::collective::inbox::{Admission, Held, InboxLimits};
//! use tensorwire_core::ports::process_group::MeshViolation;
//!
//! let mut a = Admission::new(3, InboxLimits::default());
//! a.register_group(1, &[0, 1]);
//! let held = Held::default();
//! assert_eq!(a.check(1, Some((1, 0)), 8, false, held), Ok(()));
//! assert_eq!(
//!     a.check(2, Some((1, 0)), 8, false, held),
//!     Err(MeshViolation::NotInGroup { group: 1 })
//! );
//! ```

use std::collections::BTreeMap;

use super::MeshViolation;
use crate::collective::Signature;

/// The bounds on what one peer may make this rank hold in its collective inboxes (see the
/// module docs for the defaults and what a peer that passes one gets).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct InboxLimits {
    /// How many sequence numbers a peer's frames may run ahead of this rank's newest
    /// collective in the same group.
    pub sequence_window: u64,
    /// How many group ids beyond the newest group made on this rank a frame may name.
    pub group_id_window: u64,
    /// Messages a peer may have waiting that no collective has taken.
    pub buffered_messages: usize,
}

impl Default for InboxLimits {
    fn default() -> Self {
        InboxLimits {
            sequence_window: 1 << 16,
            group_id_window: 1024,
            buffered_messages: 1 << 16,
        }
    }
}

/// What a peer's inbox holds now: messages that arrived and no collective has taken.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Held {
    /// Their payload bytes.
    pub bytes: usize,
    /// How many.
    pub messages: usize,
}

/// The groups this rank knows and how far it has got in each: the state every incoming
/// collective frame is checked against.
#[derive(Debug, Clone)]
pub struct Admission {
    limits: InboxLimits,
    /// Members (world ranks) of each group made here; 0 is the world.
    groups: BTreeMap<u64, Box<[usize]>>,
    /// The newest sequence number this rank has sent, awaited or received in each group.
    here: BTreeMap<u64, u64>,
    /// The hosts (world ranks, leader first) of each group made here that runs hierarchically.
    hierarchies: BTreeMap<u64, Vec<Vec<usize>>>,
}

impl Admission {
    /// A rank of a world of `world` ranks, which knows only the world group (id 0).
    pub fn new(world: usize, limits: InboxLimits) -> Self {
        let mut groups = BTreeMap::new();
        groups.insert(0, (0..world).collect());
        Admission {
            limits,
            groups,
            here: BTreeMap::new(),
            hierarchies: BTreeMap::new(),
        }
    }

    /// The bounds in force.
    pub fn limits(&self) -> InboxLimits {
        self.limits
    }

    /// Group `id` was made on this rank with `members` (world ranks). Frames held for it from
    /// other ranks must now be checked with [`Admission::is_member`].
    pub fn register_group(&mut self, id: u64, members: &[usize]) {
        self.groups.insert(id, members.into());
    }

    /// Whether world rank `rank` may send frames for group `id` (`None`: the group is not
    /// made here yet).
    pub fn is_member(&self, id: u64, rank: usize) -> Option<bool> {
        self.groups.get(&id).map(|m| m.contains(&rank))
    }

    /// This rank sent, awaits or received a message of collective `seq` of group `id`.
    pub fn touched(&mut self, id: u64, seq: u64) {
        let here = self.here.entry(id).or_insert(seq);
        *here = (*here).max(seq);
    }

    /// Whether this rank has reached collective `seq` of group `id` (sent, awaited or taken
    /// a message of it or of a later one).
    pub fn reached(&self, id: u64, seq: u64) -> bool {
        self.here.get(&id).is_some_and(|here| seq <= *here)
    }

    /// Whether world rank `sender` may have a message of `len` bytes filed: for collective
    /// `seq` of group `id` (`key`), or for a point-to-point exchange (`key` `None`, ordered by
    /// the pair alone). `waited_on`: a collective here already waits for exactly this
    /// message. `held`: what the sender's inbox holds before this message. The message's bytes
    /// (`_len`) are not decided here but by the sender's memory budget ([`crate::budget`]),
    /// which the mesh charges once the message passes this check.
    pub fn check(
        &self,
        sender: usize,
        key: Option<(u64, u64)>,
        _len: usize,
        waited_on: bool,
        held: Held,
    ) -> Result<(), MeshViolation> {
        if let Some((group, seq)) = key {
            match self.is_member(group, sender) {
                Some(false) => return Err(MeshViolation::NotInGroup { group }),
                Some(true) => {}
                None => {
                    let newest = self.groups.keys().next_back().copied().unwrap_or(0);
                    if group > newest.saturating_add(self.limits.group_id_window) {
                        return Err(MeshViolation::UnknownGroup {
                            group,
                            newest,
                            window: self.limits.group_id_window,
                        });
                    }
                }
            }
            let here = self.here.get(&group).copied().unwrap_or(0);
            if seq > here.saturating_add(self.limits.sequence_window) {
                return Err(MeshViolation::AheadOfWindow {
                    group,
                    seq,
                    here,
                    window: self.limits.sequence_window,
                });
            }
        }
        if waited_on || held.messages == 0 {
            return Ok(());
        }
        if held.messages >= self.limits.buffered_messages {
            return Err(MeshViolation::InboxFull {
                what: "messages",
                limit: self.limits.buffered_messages,
            });
        }
        Ok(())
    }
}

impl Admission {
    /// Whether world rank `sender` may send a disagreement notice saying that world rank
    /// `peer`'s message of collective `seq` of group `group` ran `theirs` where `sender` ran
    /// `ours`:
    ///
    /// - the sender reports only what it saw itself, so `peer` is another rank (not `sender`);
    /// - the group is made here, and `peer` and `sender` are both its members;
    /// - the two sides differ (a rank breaks its group only on a signature unlike its own);
    /// - `seq` is within `InboxLimits::sequence_window` of the newest collective this rank
    ///   has reached in that group (as for a data frame).
    ///
    /// Anything else is [`MeshViolation::ForgedDisagreement`] of the sender, which the mesh
    /// drops instead of blaming `peer`. A notice that passes is believed as the sender's
    /// report (the error names it), since only the sender saw the message it reports.
    pub fn check_disagreement(
        &self,
        sender: usize,
        group: u64,
        peer: usize,
        seq: u64,
        theirs: &Signature,
        ours: &Signature,
    ) -> Result<(), MeshViolation> {
        let forged = |reason| {
            Err(MeshViolation::ForgedDisagreement {
                group,
                peer,
                seq,
                reason,
            })
        };
        if peer == sender {
            return forged("it named itself as the rank that disagreed with it");
        }
        let Some(members) = self.groups.get(&group) else {
            return forged("no such group is made here");
        };
        if !members.contains(&sender) {
            return forged("it is not a member of that group");
        }
        if !members.contains(&peer) {
            return forged("the rank it blamed is not a member of that group");
        }
        if theirs.encode() == ours.encode() {
            return forged("both sides ran the same collective");
        }
        let newest = self.here.get(&group).copied().unwrap_or(0);
        if seq > newest.saturating_add(self.limits.sequence_window) {
            return forged("the collective is beyond the group's sequence window here");
        }
        Ok(())
    }
}

impl Admission {
    /// Group `id`, made here, runs hierarchically over `hosts` (world ranks, each host's
    /// ascending): reports of its failed stages are checked against them.
    pub fn register_hosts(&mut self, id: u64, hosts: Vec<Vec<usize>>) {
        self.hierarchies.insert(id, hosts);
    }

    /// Whether world rank `sender` may report that `ranks` failed in a stage of a collective
    /// of hierarchical group `group`: the group runs hierarchically here, and
    /// [`check_stage_report`](crate::collective::stage_failure::check_stage_report) passes.
    /// Anything else is [`MeshViolation::ForgedStageReport`] of the sender.
    pub fn check_stage_report(
        &self,
        sender: usize,
        group: u64,
        ranks: &[usize],
    ) -> Result<(), MeshViolation> {
        let Some(hosts) = self.hierarchies.get(&group) else {
            return Err(MeshViolation::ForgedStageReport {
                group,
                reason: "no such group runs across hosts here",
            });
        };
        crate::collective::stage_failure::check_stage_report(hosts, group, sender, ranks)
    }
}

/// Whether world rank `sender` may send an abort naming `named`: only its own.
pub fn check_abort(sender: usize, named: usize) -> Result<(), MeshViolation> {
    if sender == named {
        Ok(())
    } else {
        Err(MeshViolation::ForeignAbort { named })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn limits() -> InboxLimits {
        InboxLimits {
            sequence_window: 10,
            group_id_window: 2,
            buffered_messages: 3,
        }
    }

    #[test]
    fn a_disagreement_notice_must_be_one_its_sender_could_have_seen() {
        let mut a = Admission::new(4, limits());
        a.register_group(1, &[0, 1]);
        a.touched(0, 5);
        let (b, g) = (Signature::Barrier, Signature::AllGatherLengths);
        let forged = |group, peer, seq, reason| {
            Err(MeshViolation::ForgedDisagreement {
                group,
                peer,
                seq,
                reason,
            })
        };
        // An honest notice: rank 2 saw rank 1 run a barrier where it ran an all_gather, in the
        // world group.
        assert_eq!(a.check_disagreement(2, 0, 1, 5, &b, &g), Ok(()));
        // Within the window of the group's newest collective here; one beyond it is not.
        assert_eq!(a.check_disagreement(2, 0, 1, 15, &b, &g), Ok(()));
        assert_eq!(
            a.check_disagreement(2, 0, 1, 16, &b, &g),
            forged(
                0,
                1,
                16,
                "the collective is beyond the group's sequence window here"
            )
        );
        // The window is the named group's: group 1 has run nothing here yet.
        assert_eq!(a.check_disagreement(0, 1, 1, 10, &b, &g), Ok(()));
        assert_eq!(
            a.check_disagreement(0, 1, 1, 11, &b, &g),
            forged(
                1,
                1,
                11,
                "the collective is beyond the group's sequence window here"
            )
        );
        assert_eq!(
            a.check_disagreement(2, 0, 2, 5, &b, &g),
            forged(
                0,
                2,
                5,
                "it named itself as the rank that disagreed with it"
            )
        );
        assert_eq!(
            a.check_disagreement(2, 0, 1, 5, &b, &b),
            forged(0, 1, 5, "both sides ran the same collective")
        );
        // Rank 9 is in no group here; rank 2 is not in group 1, whose members are 0 and 1.
        assert_eq!(
            a.check_disagreement(2, 0, 9, 5, &b, &g),
            forged(0, 9, 5, "the rank it blamed is not a member of that group")
        );
        assert_eq!(
            a.check_disagreement(2, 1, 1, 0, &b, &g),
            forged(1, 1, 0, "it is not a member of that group")
        );
        assert_eq!(
            a.check_disagreement(1, 1, 2, 0, &b, &g),
            forged(1, 2, 0, "the rank it blamed is not a member of that group")
        );
        // A group not made here.
        assert_eq!(
            a.check_disagreement(1, 7, 0, 0, &b, &g),
            forged(7, 0, 0, "no such group is made here")
        );
        // Both members of the subgroup may report on it.
        assert_eq!(a.check_disagreement(0, 1, 1, 0, &b, &g), Ok(()));
        assert_eq!(a.check_disagreement(1, 1, 0, 0, &b, &g), Ok(()));
    }

    #[test]
    fn an_abort_may_name_only_its_sender() {
        assert_eq!(check_abort(2, 2), Ok(()));
        assert_eq!(
            check_abort(2, 1),
            Err(MeshViolation::ForeignAbort { named: 1 })
        );
    }

    #[test]
    fn frames_for_a_group_are_taken_only_from_its_members() {
        let mut a = Admission::new(4, limits());
        let none = Held::default();
        for r in 0..4 {
            assert_eq!(a.check(r, Some((0, 0)), 1, false, none), Ok(()));
        }
        a.register_group(1, &[1, 3]);
        assert_eq!(a.check(3, Some((1, 0)), 1, false, none), Ok(()));
        assert_eq!(
            a.check(2, Some((1, 0)), 1, false, none),
            Err(MeshViolation::NotInGroup { group: 1 })
        );
        // Waiting for it changes nothing: a non-member is never heard.
        assert_eq!(
            a.check(0, Some((1, 0)), 1, true, none),
            Err(MeshViolation::NotInGroup { group: 1 })
        );
        // A group not made here yet: held if close to the newest, refused if far beyond.
        assert_eq!(a.is_member(3, 2), None);
        assert_eq!(a.check(2, Some((3, 0)), 1, false, none), Ok(()));
        assert_eq!(
            a.check(2, Some((4, 0)), 1, false, none),
            Err(MeshViolation::UnknownGroup {
                group: 4,
                newest: 1,
                window: 2
            })
        );
        a.register_group(3, &[0, 1]);
        assert_eq!(a.is_member(3, 2), Some(false));
        assert_eq!(a.check(2, Some((5, 0)), 1, false, none), Ok(()));
    }

    #[test]
    fn sequence_numbers_beyond_the_window_are_refused() {
        let mut a = Admission::new(2, limits());
        let none = Held::default();
        assert_eq!(a.check(1, Some((0, 10)), 0, false, none), Ok(()));
        assert_eq!(
            a.check(1, Some((0, 11)), 0, false, none),
            Err(MeshViolation::AheadOfWindow {
                group: 0,
                seq: 11,
                here: 0,
                window: 10
            })
        );
        assert!(!a.reached(0, 0));
        a.touched(0, 5);
        a.touched(0, 3);
        assert!(a.reached(0, 5) && !a.reached(0, 6) && !a.reached(1, 0));
        assert_eq!(a.check(1, Some((0, 15)), 0, false, none), Ok(()));
        assert!(a.check(1, Some((0, 16)), 0, false, none).is_err());
        // Windows are per group; point-to-point messages have none.
        assert!(a.check(0, Some((0, u64::MAX)), 0, false, none).is_err());
        assert_eq!(a.check(1, None, 0, false, none), Ok(()));
    }

    #[test]
    fn what_a_peer_holds_is_bounded_by_count() {
        let a = Admission::new(2, limits());
        let held = |bytes, messages| Held { bytes, messages };
        // The first unclaimed message passes whatever its size.
        assert_eq!(a.check(1, None, 1000, false, held(0, 0)), Ok(()));
        assert_eq!(a.check(1, Some((0, 1)), 60, false, held(40, 1)), Ok(()));
        assert_eq!(
            a.check(1, Some((0, 1)), 0, false, held(0, 3)),
            Err(MeshViolation::InboxFull {
                what: "messages",
                limit: 3
            })
        );
        // A message a collective waits for is handed over at once.
        assert_eq!(a.check(1, Some((0, 1)), 500, true, held(90, 3)), Ok(()));
    }

    #[test]
    fn a_stage_report_is_believed_only_for_a_group_that_runs_across_hosts_here() {
        let mut a = Admission::new(4, limits());
        let unknown = Err(MeshViolation::ForgedStageReport {
            group: 0,
            reason: "no such group runs across hosts here",
        });
        assert_eq!(a.check_stage_report(1, 0, &[0]), unknown);
        a.register_hosts(0, vec![vec![0, 1], vec![2, 3]]);
        assert_eq!(a.check_stage_report(1, 0, &[0]), Ok(()));
        assert_eq!(a.check_stage_report(2, 0, &[0]), Ok(()));
        assert!(a.check_stage_report(3, 0, &[1]).is_err());
        assert!(a.check_stage_report(1, 2, &[0]).is_err());
    }
}
