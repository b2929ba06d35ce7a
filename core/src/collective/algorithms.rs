//! The schedule builders: one pure function per collective.

use std::ops::Range;

use super::{
    AllGatherAlgorithm, AllReduceAlgorithm, Apply, CollectiveError, ElementType, Receive, ReduceOp,
    Schedule, Step, Transfer,
};

/// The dissemination barrier for `rank` of `world`: in round k it sends an empty message to
/// `(rank + 2^k) mod world` and receives one from `(rank − 2^k) mod world`, for ⌈log₂ world⌉
/// rounds. When a rank finishes, every rank has entered the barrier.
///
/// # Errors
/// [`CollectiveError::EmptyWorld`], [`CollectiveError::RankOutOfRange`].
pub fn barrier(rank: usize, world: usize) -> Result<Schedule, CollectiveError> {
    check_rank(rank, world)?;
    let mut steps = Vec::new();
    let mut distance = 1;
    while distance < world {
        steps.push(Step {
            sends: vec![Transfer {
                peer: (rank + distance) % world,
                ranges: Vec::new(),
            }],
            receives: vec![Receive {
                peer: (rank + world - distance) % world,
                ranges: Vec::new(),
                action: Apply::Store,
            }],
        });
        distance *= 2;
    }
    Ok(Schedule {
        rank,
        world,
        buffer_len: 0,
        input: 0..0,
        steps,
    })
}

/// Binomial-tree broadcast of `len` bytes from `root`: the rank at distance `d` from the root
/// receives in round ⌊log₂ d⌋ and then forwards to `d + 2^k` for each later round k, the
/// largest subtree first. Depth ⌈log₂ world⌉; a zero-length broadcast has no steps.
///
/// # Errors
/// [`CollectiveError::EmptyWorld`], [`CollectiveError::RankOutOfRange`],
/// [`CollectiveError::RootOutOfRange`].
pub fn broadcast(
    rank: usize,
    world: usize,
    root: usize,
    len: usize,
) -> Result<Schedule, CollectiveError> {
    check_rank(rank, world)?;
    if root >= world {
        return Err(CollectiveError::RootOutOfRange { root, world });
    }
    let relative = (rank + world - root) % world;
    let absolute = |v: usize| (v + root) % world;
    let mut steps = Vec::new();
    if len > 0 {
        // The first round in which this rank holds the data and may send.
        let mut distance = 1;
        if relative != 0 {
            let top = 1usize << relative.ilog2();
            steps.push(Step {
                sends: Vec::new(),
                receives: vec![Receive {
                    peer: absolute(relative - top),
                    ranges: std::iter::once(0..len).collect(),
                    action: Apply::Store,
                }],
            });
            distance = top * 2;
        }
        while distance < world {
            if relative + distance < world {
                steps.push(Step {
                    sends: vec![Transfer {
                        peer: absolute(relative + distance),
                        ranges: std::iter::once(0..len).collect(),
                    }],
                    receives: Vec::new(),
                });
            }
            distance *= 2;
        }
    }
    Ok(Schedule {
        rank,
        world,
        buffer_len: len,
        input: if relative == 0 { 0..len } else { 0..0 },
        steps,
    })
}

/// All-gather of one block per rank; `block_lens[i]` is the length of rank i's block and the
/// world size is `block_lens.len()`. The buffer holds the blocks in rank order; blocks may
/// differ in length and be empty (messages of zero bytes are left out on both sides).
///
/// # Errors
/// [`CollectiveError::EmptyWorld`], [`CollectiveError::RankOutOfRange`],
/// [`CollectiveError::SizeOverflow`], and [`CollectiveError::NotPowerOfTwo`] for
/// [`AllGatherAlgorithm::RecursiveDoubling`] on another world size.
pub fn all_gather(
    rank: usize,
    block_lens: &[usize],
    algorithm: AllGatherAlgorithm,
) -> Result<Schedule, CollectiveError> {
    let world = block_lens.len();
    check_rank(rank, world)?;
    let blocks = Blocks::new(block_lens.iter().copied())?;
    let mut plan = Plan::new(&blocks, Apply::Store);
    match algorithm {
        AllGatherAlgorithm::Ring => {
            let right = (rank + 1) % world;
            let left = (rank + world - 1) % world;
            for s in 0..world - 1 {
                plan.step(
                    &[(right, (rank + world - s) % world, 1)],
                    &[(left, (rank + 2 * world - s - 1) % world, 1)],
                );
            }
        }
        AllGatherAlgorithm::Bruck => {
            // Rank r holds blocks [r, r + d) at the start of the round with distance d.
            let mut distance = 1;
            while distance < world {
                let count = distance.min(world - distance);
                plan.step(
                    &[((rank + world - distance) % world, rank, count)],
                    &[((rank + distance) % world, (rank + distance) % world, count)],
                );
                distance *= 2;
            }
        }
        AllGatherAlgorithm::RecursiveDoubling => {
            if !world.is_power_of_two() {
                return Err(CollectiveError::NotPowerOfTwo { world });
            }
            // Rank r holds the aligned group of `mask` blocks that contains r.
            let mut mask = 1;
            while mask < world {
                let partner = rank ^ mask;
                plan.step(
                    &[(partner, rank & !(mask - 1), mask)],
                    &[(partner, partner & !(mask - 1), mask)],
                );
                mask *= 2;
            }
        }
    }
    let input = blocks.offsets[rank]..blocks.offsets[rank + 1];
    Ok(plan.finish(rank, world, input))
}

/// All-reduce of `count` elements of `element` with `op`: every rank ends with the element-wise
/// reduction of all ranks' buffers, bitwise identical on every rank.
///
/// Recursive doubling exchanges the whole buffer ⌊log₂ N⌋ times; the ranks beyond the largest
/// power of two p (the even ranks below `2(N − p)`) first send their buffer to the next rank,
/// which reduces it, and receive the result back at the end. The ring splits the buffer into N
/// chunks (element-aligned, sizes differing by at most one element), reduce-scatters them in
/// N − 1 steps and all-gathers them in N − 1 more.
///
/// # Errors
/// [`CollectiveError::EmptyWorld`], [`CollectiveError::RankOutOfRange`],
/// [`CollectiveError::SizeOverflow`].
pub fn all_reduce(
    rank: usize,
    world: usize,
    count: usize,
    element: ElementType,
    op: ReduceOp,
    algorithm: AllReduceAlgorithm,
) -> Result<Schedule, CollectiveError> {
    check_rank(rank, world)?;
    let reduce = |incoming_first| Apply::Reduce {
        op,
        element,
        incoming_first,
    };
    count
        .checked_mul(element.size())
        .ok_or(CollectiveError::SizeOverflow)?;
    let (base, extra) = (count / world, count % world);
    let chunks = Blocks::new((0..world).map(|i| (base + usize::from(i < extra)) * element.size()))?;
    match algorithm {
        AllReduceAlgorithm::Ring => {
            let right = (rank + 1) % world;
            let left = (rank + world - 1) % world;
            let mut plan = Plan::new(&chunks, reduce(true));
            // The partial sum of chunk c starts at rank c and travels right, the incoming
            // partial as the left operand; rank c − 1 ends with chunk c complete.
            for s in 0..world - 1 {
                plan.step(
                    &[(right, (rank + world - s) % world, 1)],
                    &[(left, (rank + 2 * world - s - 1) % world, 1)],
                );
            }
            plan.action = Apply::Store;
            for s in 0..world - 1 {
                plan.step(
                    &[(right, (rank + 1 + world - s) % world, 1)],
                    &[(left, (rank + world - s) % world, 1)],
                );
            }
            Ok(plan.finish(rank, world, 0..chunks.total()))
        }
        AllReduceAlgorithm::RecursiveDoubling => {
            // The whole buffer as a single block moving between any pair.
            let whole = Blocks::new(std::iter::once(chunks.total()))?;
            let mut plan = Plan::new(&whole, Apply::Store);
            let p = 1usize << world.ilog2();
            let folded = world - p;
            // Ranks below 2·folded pair up: the even one hands its data to the odd one.
            let new_rank = if rank < 2 * folded {
                if rank % 2 == 0 {
                    plan.step(&[(rank + 1, 0, 1)], &[]);
                    plan.step(&[], &[(rank + 1, 0, 1)]);
                    return Ok(plan.finish(rank, world, 0..chunks.total()));
                }
                plan.action = reduce(true);
                plan.step(&[], &[(rank - 1, 0, 1)]);
                rank / 2
            } else {
                rank - folded
            };
            let real = |v: usize| if v < folded { 2 * v + 1 } else { v + folded };
            let mut mask = 1;
            while mask < p {
                let partner = real(new_rank ^ mask);
                plan.action = reduce(partner < rank);
                plan.step(&[(partner, 0, 1)], &[(partner, 0, 1)]);
                mask *= 2;
            }
            if rank < 2 * folded {
                plan.step(&[(rank - 1, 0, 1)], &[]);
            }
            Ok(plan.finish(rank, world, 0..chunks.total()))
        }
    }
}

fn check_rank(rank: usize, world: usize) -> Result<(), CollectiveError> {
    if world == 0 {
        return Err(CollectiveError::EmptyWorld);
    }
    if rank >= world {
        return Err(CollectiveError::RankOutOfRange { rank, world });
    }
    Ok(())
}

/// Consecutive blocks of a buffer, addressed cyclically.
struct Blocks {
    /// `offsets[i]..offsets[i + 1]` is block i; one more entry than blocks.
    offsets: Vec<usize>,
}

impl Blocks {
    fn new(lens: impl Iterator<Item = usize>) -> Result<Self, CollectiveError> {
        let mut offsets = vec![0];
        let mut end = 0usize;
        for len in lens {
            end = end.checked_add(len).ok_or(CollectiveError::SizeOverflow)?;
            offsets.push(end);
        }
        Ok(Blocks { offsets })
    }

    fn count(&self) -> usize {
        self.offsets.len() - 1
    }

    fn total(&self) -> usize {
        self.offsets[self.count()]
    }

    /// The byte ranges of blocks `first, first + 1, ..., first + count − 1` (mod the block
    /// count), in that order, empty ranges left out; `count` is at most the block count.
    fn range(&self, first: usize, count: usize) -> Vec<Range<usize>> {
        let n = self.count();
        let end = first + count;
        let pieces = if end <= n {
            [self.offsets[first]..self.offsets[end], 0..0]
        } else {
            [
                self.offsets[first]..self.offsets[n],
                0..self.offsets[end - n],
            ]
        };
        pieces.into_iter().filter(|r| !r.is_empty()).collect()
    }
}

/// Accumulates the steps of a data collective; transfers of zero bytes are left out, which both
/// ends do alike because they compute the same block sizes.
struct Plan<'a> {
    blocks: &'a Blocks,
    action: Apply,
    steps: Vec<Step>,
}

impl<'a> Plan<'a> {
    fn new(blocks: &'a Blocks, action: Apply) -> Self {
        Plan {
            blocks,
            action,
            steps: Vec::new(),
        }
    }

    /// Adds a step; each entry is (peer, first block, block count).
    fn step(&mut self, sends: &[(usize, usize, usize)], receives: &[(usize, usize, usize)]) {
        let step = Step {
            sends: sends
                .iter()
                .map(|&(peer, first, count)| Transfer {
                    peer,
                    ranges: self.blocks.range(first, count),
                })
                .filter(|t| !t.ranges.is_empty())
                .collect(),
            receives: receives
                .iter()
                .map(|&(peer, first, count)| Receive {
                    peer,
                    ranges: self.blocks.range(first, count),
                    action: self.action,
                })
                .filter(|r| !r.ranges.is_empty())
                .collect(),
        };
        if !step.sends.is_empty() || !step.receives.is_empty() {
            self.steps.push(step);
        }
    }

    fn finish(self, rank: usize, world: usize, input: Range<usize>) -> Schedule {
        Schedule {
            rank,
            world,
            buffer_len: self.blocks.total(),
            input,
            steps: self.steps,
        }
    }
}
