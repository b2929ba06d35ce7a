//! What waits on our own messages, kept by message id without hashing: an endpoint's ids
//! only grow ([`MessageId`]s are handed out one after another), so a waiter taken just after
//! its message's id is made goes to the back of a queue kept in id order, and is found again
//! by a binary search over the few in flight (one, for a caller that waits on each call).

use std::collections::VecDeque;

use super::MessageId;

/// At least this many entries taken out of the middle before the queue is swept of them.
const SWEEP_FROM: usize = 32;

/// Values under message ids, in id order. One taken from the front goes with the taken ones
/// behind it; one taken from elsewhere leaves an empty entry until it reaches the front or the
/// empty entries are as many as the live ones (then they are swept): the queue holds at most
/// about twice the live values, however many come and go. An id lower than the last one held
/// is put in its place (a binary search and an insert), not refused.
#[derive(Debug)]
pub struct ById<T> {
    queue: VecDeque<(MessageId, Option<T>)>,
    /// Values held (the entries that are not empty).
    live: usize,
}

impl<T> Default for ById<T> {
    fn default() -> Self {
        Self {
            queue: VecDeque::new(),
            live: 0,
        }
    }
}

impl<T> ById<T> {
    /// Keeps `value` under `id`, in place of (and giving back) the one held under it.
    pub fn insert(&mut self, id: MessageId, value: T) -> Option<T> {
        if self.queue.back().is_none_or(|(last, _)| *last < id) {
            self.queue.push_back((id, Some(value)));
            self.live += 1;
            return None;
        }
        match self.position(id) {
            Ok(i) => {
                let old = self.queue[i].1.replace(value);
                if old.is_none() {
                    self.live += 1;
                }
                old
            }
            Err(i) => {
                self.queue.insert(i, (id, Some(value)));
                self.live += 1;
                None
            }
        }
    }

    /// Takes the value under `id`, if one is held.
    pub fn remove(&mut self, id: MessageId) -> Option<T> {
        // The usual case first: the oldest (or the only) one in flight.
        let i = match self.queue.front() {
            Some((first, _)) if *first == id => 0,
            _ => self.position(id).ok()?,
        };
        let value = self.queue[i].1.take()?;
        self.live -= 1;
        while self.queue.front().is_some_and(|(_, v)| v.is_none()) {
            self.queue.pop_front();
        }
        while self.queue.back().is_some_and(|(_, v)| v.is_none()) {
            self.queue.pop_back();
        }
        let empty = self.queue.len() - self.live;
        if empty >= SWEEP_FROM && empty >= self.live {
            self.queue.retain(|(_, v)| v.is_some());
        }
        Some(value)
    }

    /// The value under `id`, if one is held.
    pub fn get_mut(&mut self, id: MessageId) -> Option<&mut T> {
        let i = match self.queue.front() {
            Some((first, _)) if *first == id => 0,
            _ => self.position(id).ok()?,
        };
        self.queue[i].1.as_mut()
    }

    /// The values held, in id order.
    pub fn into_values(self) -> impl Iterator<Item = T> {
        self.queue.into_iter().filter_map(|(_, v)| v)
    }

    /// How many values are held.
    pub fn len(&self) -> usize {
        self.live
    }

    /// Whether no value is held.
    pub fn is_empty(&self) -> bool {
        self.live == 0
    }

    /// Entries kept, empty ones included (what the sweep bounds).
    pub fn entries(&self) -> usize {
        self.queue.len()
    }

    fn position(&self, id: MessageId) -> Result<usize, usize> {
        self.queue.binary_search_by_key(&id, |(at, _)| *at)
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use super::*;

    /// The map's answers agree with a `HashMap`'s through ids coming and going in any order,
    /// and the empty entries stay bounded while one value stays held at the front.
    #[test]
    fn agrees_with_a_hash_map_and_stays_bounded() {
        let mut by_id = ById::default();
        let mut map = HashMap::new();
        let mut seed = 0x2545_f491_4f6c_dd1d_u64;
        let mut next = || {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            seed
        };
        assert_eq!(by_id.insert(0, u64::MAX), None);
        map.insert(0, u64::MAX);
        for id in 1..20_000u64 {
            assert_eq!(by_id.insert(id, id), map.insert(id, id));
            // Take some live one now and then, and an id never held or long gone.
            if next() % 3 != 0 {
                let live: Vec<u64> = map.keys().copied().filter(|k| *k != 0).collect();
                if !live.is_empty() {
                    let pick = live[(next() as usize) % live.len()];
                    assert_eq!(by_id.remove(pick), map.remove(&pick));
                }
            }
            let other = next() % (id + 2);
            assert_eq!(by_id.remove(other).is_some(), map.remove(&other).is_some());
            assert_eq!(by_id.len(), map.len());
            assert!(by_id.entries() <= 2 * by_id.len() + SWEEP_FROM, "{id}");
        }
    }

    #[test]
    fn an_id_out_of_order_goes_in_its_place_and_a_held_one_is_replaced() {
        let mut by_id = ById::default();
        by_id.insert(5, 'a');
        by_id.insert(9, 'b');
        assert_eq!(by_id.insert(7, 'c'), None);
        assert_eq!(by_id.insert(9, 'd'), Some('b'));
        *by_id.get_mut(5).unwrap() = 'e';
        assert_eq!(by_id.get_mut(6), None);
        assert_eq!(by_id.remove(5), Some('e'));
        by_id.insert(5, 'a');
        assert_eq!(by_id.len(), 3);
        assert_eq!(by_id.remove(7), Some('c'));
        assert_eq!(by_id.remove(7), None);
        assert_eq!(by_id.remove(5), Some('a'));
        assert_eq!(by_id.remove(9), Some('d'));
        assert!(by_id.is_empty());
        assert_eq!(by_id.entries(), 0);
        by_id.insert(3, 'x');
        by_id.insert(4, 'y');
        by_id.remove(3);
        by_id.insert(2, 'z');
        assert_eq!(by_id.into_values().collect::<String>(), "zy");
    }
}
