//! Which collectives a disagreement fails, decided without I/O.
//!
//! Ranks that ran different collectives under sequence number N of a group find out when one
//! of them receives a message whose [`Signature`](super::Signature) is not its own; it tells
//! every other rank (the mesh's disagreement notice), and each rank records what it found or
//! was told in its [`Disagreements`]. What a recorded disagreement about (group, N) fails:
//!
//! | collective | fails? | why |
//! |---|---|---|
//! | the same group, sequence number ≥ N | yes, at once (waiting or not started) | the ranks no longer agree on what it is, nor on what comes after it |
//! | the same group, sequence number < N | no: it completes from its peers' messages | it came before the disagreement: no rank fails it for this reason, so every message of it is sent (a rank that found the disagreement about N had issued it, and finishes it) |
//! | another group over the same connections | yes, at once | see below |
//! | a point-to-point message | yes, at once | see below |
//!
//! So a rank still finishing collective N − 1 when the notice about N arrives (its last peer's
//! message for N − 1 may come after the notice, on another connection) completes it, and fails
//! N. A peer's message for an earlier collective that never comes is the usual timeout or dead
//! peer.
//!
//! Other groups and point-to-point messages have no place in the group's order: the ranks
//! could not agree without another exchange which of them came before the disagreement, and
//! a rank that went on with one while a peer had already failed it would wait for that peer
//! until the timeout. They fail at once, as the mesh documents for every failure of its
//! connections (a rank out of step in one group cannot vouch for another).
//!
//! Several disagreements fail everything any of them fails; for one group the lowest
//! sequence number counts.
//!
//! ```
//! use tensorwire_core::collective::disagreement::Disagreements;
//!
//! let mut found = Disagreements::new();
//! // Rank 1 ran something else as collective 7 of the world group (id 0).
//! assert!(found.record(0, 7, "rank 1 ran barrier as collective #7"));
//! assert_eq!(found.failure(Some((0, 6))), None); // still completes
//! assert!(found.failure(Some((0, 7))).is_some());
//! assert!(found.failure(Some((0, 8))).is_some());
//! assert!(found.failure(Some((3, 0))).is_some()); // another group
//! assert!(found.failure(None).is_some()); // a point-to-point message
//! ```

/// The disagreements recorded on a rank, each with what to report (`E`, the error), and
/// which collectives they fail (see the module docs).
#[derive(Debug, Clone)]
pub struct Disagreements<E> {
    /// One per group, in the order first recorded: the lowest sequence number found there.
    found: Vec<Found<E>>,
}

#[derive(Debug, Clone)]
struct Found<E> {
    group: u64,
    seq: u64,
    what: E,
}

impl<E> Default for Disagreements<E> {
    fn default() -> Self {
        Disagreements { found: Vec::new() }
    }
}

impl<E> Disagreements<E> {
    /// None recorded: nothing fails.
    pub fn new() -> Self {
        Self::default()
    }

    /// Whether none is recorded.
    pub fn is_empty(&self) -> bool {
        self.found.is_empty()
    }

    /// Records a disagreement about collective `seq` of group `group`, reported as `what`;
    /// whether it fails anything that was not failed before (a first one in that group, or
    /// one about an earlier collective there, whose `what` then replaces the later one's).
    pub fn record(&mut self, group: u64, seq: u64, what: E) -> bool {
        match self.found.iter_mut().find(|f| f.group == group) {
            Some(f) if f.seq <= seq => false,
            Some(f) => {
                f.seq = seq;
                f.what = what;
                true
            }
            None => {
                self.found.push(Found { group, seq, what });
                true
            }
        }
    }

    /// What fails collective `seq` of group `group` (`key` `Some((group, seq))`), or a
    /// point-to-point message (`key` `None`): the disagreement in the same group at or before
    /// `seq`, else the first one recorded in another group (any one, for a point-to-point
    /// message); `None` when no disagreement recorded fails it.
    pub fn failure(&self, key: Option<(u64, u64)>) -> Option<&E> {
        let found = match key {
            Some((group, seq)) => self
                .found
                .iter()
                .find(|f| f.group == group && f.seq <= seq)
                .or_else(|| self.found.iter().find(|f| f.group != group)),
            None => self.found.first(),
        };
        found.map(|f| &f.what)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn a_disagreement_fails_its_collective_and_later_ones_of_its_group_not_earlier_ones() {
        let mut d = Disagreements::new();
        assert!(d.is_empty());
        for key in [Some((0, 0)), Some((1, 9)), None] {
            assert_eq!(d.failure(key), None, "{key:?} failed with nothing recorded");
        }
        assert!(d.record(0, 5, "world #5"));
        assert!(!d.is_empty());
        // The collective before it completes; it and every later one fail.
        for seq in 0..5 {
            assert_eq!(d.failure(Some((0, seq))), None, "world #{seq}");
        }
        for seq in [5, 6, 1 << 40] {
            assert_eq!(d.failure(Some((0, seq))), Some(&"world #5"), "world #{seq}");
        }
        // Other groups and point-to-point messages fail at once, whatever their number.
        assert_eq!(d.failure(Some((1, 0))), Some(&"world #5"));
        assert_eq!(d.failure(None), Some(&"world #5"));
        // A later one in the same group fails nothing new; an earlier one moves the cut.
        assert!(!d.record(0, 7, "world #7"));
        assert!(!d.record(0, 5, "world #5 again"));
        assert_eq!(d.failure(Some((0, 9))), Some(&"world #5"));
        assert_eq!(d.failure(Some((0, 3))), None);
        assert!(d.record(0, 3, "world #3"));
        assert_eq!(d.failure(Some((0, 3))), Some(&"world #3"));
        assert_eq!(d.failure(Some((0, 9))), Some(&"world #3"));
        assert_eq!(d.failure(Some((0, 2))), None);
        // One in a subgroup fails the world's earlier collectives too (another group), and
        // the subgroup's earlier ones still complete.
        assert!(d.record(2, 4, "subgroup 2 #4"));
        assert_eq!(d.failure(Some((0, 2))), Some(&"subgroup 2 #4"));
        assert_eq!(d.failure(Some((2, 3))), Some(&"world #3"));
        assert_eq!(d.failure(Some((2, 4))), Some(&"subgroup 2 #4"));
        // A point-to-point message reports the first one recorded.
        assert_eq!(d.failure(None), Some(&"world #3"));
    }

    #[test]
    fn the_issue_44_race_fails_the_reduce_scatter_not_the_barrier_before_it() {
        // Rank 2 is still in the barrier (#0) when ranks 0 and 1 report the reduce_scatter
        // (#1); both reports arrive, in either order.
        for order in [[0usize, 1], [1, 0]] {
            let mut d = Disagreements::new();
            for reporter in order {
                d.record(0, 1, reporter);
            }
            assert_eq!(d.failure(Some((0, 0))), None);
            assert_eq!(d.failure(Some((0, 1))), Some(&order[0]));
        }
    }

    /// What fails `key` by the rule in the module docs, from the records alone.
    fn fails(records: &[(u64, u64)], key: Option<(u64, u64)>) -> bool {
        match key {
            None => !records.is_empty(),
            Some((group, seq)) => records.iter().any(|&(g, s)| g != group || s <= seq),
        }
    }

    proptest! {
        #[test]
        fn failure_follows_the_rule_whatever_the_order_of_records(
            records in proptest::collection::vec((0u64..3, 0u64..8), 0..6),
            keys in proptest::collection::vec(proptest::option::of((0u64..3, 0u64..10)), 1..12),
        ) {
            let mut d = Disagreements::new();
            let mut failed_before: Vec<bool> = vec![false; keys.len()];
            for (i, &(group, seq)) in records.iter().enumerate() {
                let new = d.record(group, seq, (group, seq));
                let before = &records[..i];
                let expect_new = !before.iter().any(|&(g, s)| g == group && s <= seq);
                prop_assert_eq!(new, expect_new);
                let now = &records[..=i];
                for (k, key) in keys.iter().enumerate() {
                    let failure = d.failure(*key);
                    prop_assert_eq!(failure.is_some(), fails(now, *key), "{:?} after {:?}", key, now);
                    // Once failed, always failed.
                    prop_assert!(failure.is_some() || !failed_before[k]);
                    failed_before[k] = failure.is_some();
                    // What it reports is a recorded disagreement that fails it.
                    if let Some(&(g, s)) = failure {
                        prop_assert!(now.contains(&(g, s)));
                        prop_assert!(fails(&[(g, s)], *key));
                    }
                }
            }
        }
    }
}
