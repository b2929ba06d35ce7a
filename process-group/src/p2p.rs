//! Point-to-point messages (`send`/`recv`, `isend`/`irecv`) over the mesh.
//!
//! Point-to-point messages share the mesh's connections with collectives but not their
//! sequence numbers: only two ranks take part, so they cannot take places in a sequence every
//! rank keeps. Each message is filed under a key of its own instead, in the upper half of the
//! key space (collectives count up from zero and never get there): the tag, and how many
//! messages with that tag the sender had sent to that receiver before. The receiver numbers
//! its receives from that sender with that tag the same way, **when each is issued**, so the
//! n-th `recv(src, tag)` issued gets the n-th message `src` sent with `tag`, however the
//! messages and the receives then overtake one another (an `irecv` on its own task, or two
//! `isend`s whose frames race).
//!
//! Keys belong to the pair of ranks, not to a group: the world group and its subgroups
//! share the counters, keyed by world rank, so the n-th receive from a rank with a tag gets
//! the n-th message that rank sent here with that tag, whichever group each was issued on.
//!
//! A receive that times out keeps its place: the message it waited for, should it arrive
//! later, is never delivered (it stays filed until the group is dropped), and the next
//! receive gets the message after it.

use std::collections::HashMap;
use std::sync::Mutex;

/// The bit that marks a point-to-point key.
const P2P: u64 = 1 << 63;
/// Bits of the per-(peer, tag) message number in a key. Numbers wrap after 2³¹ messages, by
/// which time the message that shares a key with a new one has long been taken.
const NUMBER_BITS: u32 = 31;

/// The mesh key of the `n`-th message with `tag` between an ordered pair of ranks.
pub(crate) fn key(tag: u32, n: u64) -> u64 {
    P2P | u64::from(tag) << NUMBER_BITS | (n & ((1 << NUMBER_BITS) - 1))
}

/// Per (peer, tag) counters of messages issued in one direction.
#[derive(Default)]
pub(crate) struct Counters {
    next: Mutex<HashMap<(usize, u32), u64>>,
}

impl Counters {
    /// The number of the next message with `tag` to or from `peer`, counted.
    pub(crate) fn take(&self, peer: usize, tag: u32) -> u64 {
        let mut next = self.next.lock().unwrap_or_else(|e| e.into_inner());
        let n = next.entry((peer, tag)).or_insert(0);
        let taken = *n;
        *n += 1;
        taken
    }

    /// The number the next message with `tag` to or from `peer` will get.
    pub(crate) fn peek(&self, peer: usize, tag: u32) -> u64 {
        let next = self.next.lock().unwrap_or_else(|e| e.into_inner());
        next.get(&(peer, tag)).copied().unwrap_or(0)
    }

    /// Takes number `n` for `peer` and `tag` if it is still the next one (a receive from any
    /// source claims the message it saw arrive); false when another receive took it first.
    pub(crate) fn claim(&self, peer: usize, tag: u32, n: u64) -> bool {
        let mut next = self.next.lock().unwrap_or_else(|e| e.into_inner());
        let next = next.entry((peer, tag)).or_insert(0);
        if *next != n {
            return false;
        }
        *next += 1;
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_are_apart_from_collectives_and_from_each_other() {
        assert!(key(0, 0) >= P2P);
        assert_ne!(key(1, 0), key(0, 1));
        assert_ne!(key(u32::MAX, 5), key(u32::MAX - 1, 5));
        assert_eq!(
            key(7, 1 << NUMBER_BITS),
            key(7, 0),
            "numbers wrap within their bits"
        );
        let c = Counters::default();
        assert_eq!(
            (c.take(1, 5), c.take(1, 5), c.take(2, 5), c.take(1, 6)),
            (0, 1, 0, 0)
        );
        assert_eq!(c.peek(1, 5), 2);
        assert!(!c.claim(1, 5, 1), "taken already");
        assert!(c.claim(1, 5, 2));
        assert_eq!((c.peek(1, 5), c.take(1, 5)), (3, 3));
    }
}
