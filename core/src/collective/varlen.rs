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
//!
//! An all_gather whose caller knows every length ([`BlockLens`]: a tensor all_gather, whose
//! shapes are equal on every rank, or given lengths) skips that first round:
//! [`BlockLens::known`] decides. It still reserves [`ROUNDS`] numbers and runs its data round
//! under the first, so that a rank that skips and one that exchanges (their callers disagree)
//! meet under one number, with different signatures, and are told.

use std::ops::Range;

use super::CollectiveError;

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

/// What an all_gather's caller knows of its blocks' lengths before it runs: whether the group
/// must exchange them first is [`BlockLens::known`]'s decision.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub enum BlockLens {
    /// Nothing: every rank's length is exchanged first (see the [module docs](self)).
    #[default]
    Exchanged,
    /// Every rank's block is as long as this rank's: a tensor all_gather (its shapes must be
    /// equal on every rank, as PyTorch's are).
    Equal,
    /// Rank i's block is `lens[i]` bytes; every rank passes the same lengths.
    Given(Vec<usize>),
}

impl BlockLens {
    /// Every rank's block length when it is known without an exchange, for rank `rank` of
    /// `world` whose own block is `mine` bytes; `Ok(None)` when the lengths must be exchanged.
    ///
    /// Known lengths are part of the data round's signature
    /// ([`Signature::all_gather`](super::Signature::all_gather)), so a rank whose lengths
    /// differ (a tensor of another shape, a rank that lies about its size) runs another
    /// signature than the ranks that wait on its block, and they are told, naming it; and each
    /// rank reads from every other only the bytes its own lengths give, never past a block.
    /// Equal blocks of no bytes are exchanged all the same: such a rank would wait on no other,
    /// and could not tell that another rank's block is not empty.
    ///
    /// # Errors
    /// Given lengths that are not one per rank ([`CollectiveError::LengthsCount`]), or whose
    /// entry for this rank is not `mine` ([`CollectiveError::InputLength`]).
    pub fn known(
        &self,
        rank: usize,
        world: usize,
        mine: usize,
    ) -> Result<Option<Vec<usize>>, CollectiveError> {
        match self {
            BlockLens::Exchanged => Ok(None),
            BlockLens::Equal if mine == 0 => Ok(None),
            BlockLens::Equal => Ok(Some(vec![mine; world])),
            BlockLens::Given(lens) if lens.len() != world => Err(CollectiveError::LengthsCount {
                lens: lens.len(),
                world,
            }),
            BlockLens::Given(lens) if lens.get(rank) != Some(&mine) => {
                Err(CollectiveError::InputLength {
                    rank,
                    expected: lens.get(rank).copied().unwrap_or(0),
                    actual: mine,
                })
            }
            BlockLens::Given(lens) => Ok(Some(lens.clone())),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::collective::Signature;

    #[test]
    fn equal_blocks_skip_the_exchange_unless_empty() {
        assert_eq!(BlockLens::Exchanged.known(0, 3, 8), Ok(None));
        assert_eq!(BlockLens::Equal.known(2, 3, 8), Ok(Some(vec![8; 3])));
        // An empty block waits on no other rank: its lengths are exchanged.
        assert_eq!(BlockLens::Equal.known(1, 3, 0), Ok(None));
        assert_eq!(
            BlockLens::Given(vec![1, 0, 4]).known(1, 3, 0),
            Ok(Some(vec![1, 0, 4]))
        );
    }

    #[test]
    fn given_lengths_are_checked_against_the_world_and_the_block() {
        assert_eq!(
            BlockLens::Given(vec![1, 2]).known(0, 3, 1),
            Err(CollectiveError::LengthsCount { lens: 2, world: 3 })
        );
        assert_eq!(
            BlockLens::Given(vec![1, 2]).known(1, 2, 5),
            Err(CollectiveError::InputLength {
                rank: 1,
                expected: 2,
                actual: 5
            })
        );
        // A rank beyond the lengths (a caller's bug) is refused, not indexed.
        assert!(BlockLens::Given(vec![1, 2]).known(7, 2, 1).is_err());
    }

    #[test]
    fn a_rank_of_another_size_runs_another_signature() {
        // Ranks that skip the exchange compare their known lengths through the signature:
        // a tensor of another shape (or a forged size) is a disagreement, whatever the sizes.
        for (a, b) in [(8, 16), (1, 2), (1 << 20, (1 << 20) + 1), (3, 1 << 30)] {
            let ours = BlockLens::Equal.known(0, 4, a).unwrap().unwrap();
            let theirs = BlockLens::Equal.known(1, 4, b).unwrap().unwrap();
            assert_ne!(Signature::all_gather(&ours), Signature::all_gather(&theirs));
            assert_ne!(
                Signature::all_gather(&ours).word(&[]),
                Signature::all_gather(&theirs).word(&[])
            );
        }
        // The same sizes are the same collective on every rank.
        let a = BlockLens::Equal.known(0, 4, 8).unwrap().unwrap();
        let b = BlockLens::Equal.known(3, 4, 8).unwrap().unwrap();
        assert_eq!(
            Signature::all_gather(&a).word(&[]),
            Signature::all_gather(&b).word(&[])
        );
        // A rank that skips and one that exchanges never take each other's round for theirs.
        assert_ne!(
            Signature::all_gather(&a).word(&[]),
            Signature::AllGatherLengths.word(&[8])
        );
    }

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
