//! Collectives of bytes whose lengths are not known everywhere beforehand: two rounds.
//!
//! An all_gather of blocks of any length, and a broadcast of bytes whose length only the root
//! knows, first move one fixed-size slot of [`SLOT_BYTES`] per rank: the length (`u64`,
//! little-endian) and, when they fit in [`INLINE_BYTES`], the bytes themselves. When every
//! rank's bytes fitted, that was all; otherwise a second round moves the data, now that every
//! rank knows every length. Every rank decides alike, because every rank sees the same slots.
//!
//! Such a collective takes [`ROUNDS`] sequence numbers, **both reserved when it is issued**: a
//! second round that took its number when the first one ended would take it in the order the
//! first rounds happen to end on that rank, which differs between ranks when several
//! collectives are in flight, and ranks would then exchange blocks of different collectives.
//! When the first round is all it takes, the second number stays unused on every rank.

use std::ops::Range;

/// The bytes a slot carries inline: blocks up to this size take one round instead of two.
pub const INLINE_BYTES: usize = 56;

/// The size of one slot: the length and [`INLINE_BYTES`] of data.
pub const SLOT_BYTES: usize = 8 + INLINE_BYTES;

/// The sequence numbers a variable-length collective reserves.
pub const ROUNDS: u64 = 2;

/// Writes `data`'s length into `slot`, and `data` itself when it fits.
pub fn write_slot(slot: &mut [u8; SLOT_BYTES], data: &[u8]) {
    slot[..8].copy_from_slice(&(data.len() as u64).to_le_bytes());
    if data.len() <= INLINE_BYTES {
        slot[8..8 + data.len()].copy_from_slice(data);
    }
}

/// The length a slot announces.
pub fn slot_len(slot: &[u8; SLOT_BYTES]) -> u64 {
    let mut len = [0u8; 8];
    len.copy_from_slice(&slot[..8]);
    u64::from_le_bytes(len)
}

/// Where a slot that announces `len` bytes holds them, when it holds them inline.
pub fn inline_range(len: u64) -> Option<Range<usize>> {
    usize::try_from(len)
        .ok()
        .filter(|len| *len <= INLINE_BYTES)
        .map(|len| 8..8 + len)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn small_data_travels_inline_large_data_only_its_length() {
        let mut slot = [0u8; SLOT_BYTES];
        write_slot(&mut slot, b"hello");
        assert_eq!(slot_len(&slot), 5);
        assert_eq!(&slot[inline_range(5).unwrap()], b"hello");
        let big = vec![7u8; INLINE_BYTES + 1];
        let mut slot = [0u8; SLOT_BYTES];
        write_slot(&mut slot, &big);
        assert_eq!(slot_len(&slot), big.len() as u64);
        assert_eq!(inline_range(slot_len(&slot)), None);
        assert!(slot[8..].iter().all(|b| *b == 0));
        let full = vec![9u8; INLINE_BYTES];
        write_slot(&mut slot, &full);
        assert_eq!(&slot[inline_range(INLINE_BYTES as u64).unwrap()], &full[..]);
        assert_eq!(inline_range(u64::MAX), None);
    }
}
