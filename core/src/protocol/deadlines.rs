//! The deadlines of our own calls that come in order ([`InOrder`]): a call made with the same
//! timeout as the one before it (the agent's default, above all) has a deadline no earlier
//! than that one's, so it goes to the back of a queue instead of into the endpoint's ordered
//! timer set (an insert and a remove of a tree node per call). A deadline earlier than the
//! queue's last stays in the set; the endpoint takes the earlier of the two firsts, as the one
//! set would, in the same order (deadline, then id).

use std::collections::VecDeque;
use std::time::Instant;

use super::MessageId;

/// At least this many calls ended out of order before the queue is swept of them.
const SWEEP_FROM: usize = 32;

/// The deadlines of pending calls, in order, each at or after the one before it. A call that
/// ends before its deadline leaves its entry until it is first (then it goes with the first
/// live one's end) or until the ended ones are as many as the live ones (then they are swept):
/// the queue holds at most about twice the pending calls whose deadline it took.
#[derive(Debug, Default)]
pub(super) struct InOrder {
    queue: VecDeque<(Instant, MessageId)>,
    /// Entries of calls that ended, not at the front (the front is always a pending call's).
    ended: usize,
}

impl InOrder {
    /// Takes call `id`'s `deadline` if it is not earlier than the last one taken: true if
    /// taken (else the caller keeps it in its timer set).
    pub(super) fn push(&mut self, deadline: Instant, id: MessageId) -> bool {
        if self.queue.back().is_some_and(|(last, _)| deadline < *last) {
            return false;
        }
        self.queue.push_back((deadline, id));
        true
    }

    /// The earliest deadline taken, with its call (a pending one).
    pub(super) fn first(&self) -> Option<(Instant, MessageId)> {
        self.queue.front().copied()
    }

    /// Call `id`, whose deadline this took, ended (answered, failed, or expired): its entry
    /// goes at once if it is first (with the ended ones behind it), else later. `pending` says
    /// whether a call is still pending.
    pub(super) fn remove(&mut self, id: MessageId, pending: impl Fn(MessageId) -> bool) {
        if self.queue.front().is_some_and(|(_, first)| *first == id) {
            self.queue.pop_front();
            while self.ended > 0 {
                match self.queue.front() {
                    Some((_, next)) if !pending(*next) => {
                        self.queue.pop_front();
                        self.ended -= 1;
                    }
                    _ => break,
                }
            }
            return;
        }
        self.ended += 1;
        if self.ended >= SWEEP_FROM && self.ended * 2 >= self.queue.len() {
            self.queue.retain(|(_, call)| *call != id && pending(*call));
            self.ended = 0;
        }
    }

    /// Forgets every deadline (the endpoint stopped).
    pub(super) fn clear(&mut self) {
        self.queue.clear();
        self.ended = 0;
    }

    /// The entries held, pending calls' and ended ones'.
    #[cfg(test)]
    pub(super) fn len(&self) -> usize {
        self.queue.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashSet;
    use std::time::Duration;

    #[test]
    fn deadlines_in_order_are_taken_and_an_earlier_one_is_not() {
        let t = Instant::now();
        let mut q = InOrder::default();
        assert!(q.push(t, 1));
        assert!(q.push(t, 2), "an equal deadline keeps the order");
        assert!(q.push(t + Duration::from_secs(1), 3));
        assert!(!q.push(t + Duration::from_millis(500), 4));
        assert_eq!(q.first(), Some((t, 1)));
    }

    /// Calls ending out of order: the first is always a pending call's, and the ended ones
    /// are swept once they are as many as the pending ones, so the queue stays within about
    /// twice the pending calls whatever the number of calls made.
    #[test]
    fn the_first_is_pending_and_ended_calls_are_bounded() {
        let t = Instant::now();
        let mut q = InOrder::default();
        let mut pending = HashSet::new();
        // One call that stays pending, then many that end out of order behind it.
        assert!(q.push(t, 0));
        pending.insert(0);
        for id in 1..10_000u64 {
            assert!(q.push(t + Duration::from_millis(id), id));
            pending.insert(id);
            if id % 3 != 0 {
                pending.remove(&id);
                q.remove(id, |c| pending.contains(&c));
            }
            assert_eq!(q.first().map(|(_, c)| c), Some(0));
            assert!(
                q.len() <= 2 * pending.len() + SWEEP_FROM,
                "{} entries for {} pending",
                q.len(),
                pending.len()
            );
        }
        // The first ends: the ended ones right behind it go with it.
        pending.remove(&0);
        q.remove(0, |c| pending.contains(&c));
        let (_, first) = q.first().unwrap();
        assert!(pending.contains(&first));
        // Every call ends, in order of id: nothing is left.
        let mut ids: Vec<u64> = pending.iter().copied().collect();
        ids.sort_unstable();
        for id in ids {
            pending.remove(&id);
            q.remove(id, |c| pending.contains(&c));
            if let Some((_, first)) = q.first() {
                assert!(pending.contains(&first));
            }
        }
        assert_eq!(q.len(), 0);
        q.clear();
        assert_eq!(q.first(), None);
    }
}
