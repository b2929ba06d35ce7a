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
        output: 0..0,
        local: None,
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
        output: 0..len,
        local: None,
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
    op.check(element)?;
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
                if rank.is_multiple_of(2) {
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

/// Reduce of `count` elements of `element` with `op` to `root`: a binomial tree, the mirror of
/// [`broadcast`]. The rank at distance `d` from the root (counted upwards, wrapping) receives
/// and reduces from `d + 2^k` for each round k below the lowest set bit of `d`, then sends its
/// partial result to `d − 2^j` (j that bit) and is done. Each partial covers a run of
/// consecutive distances and is the left operand of what it receives, so the root computes
/// one fixed expression in the order of distances. Depth ⌈log₂ world⌉. The root's whole
/// buffer is the result ([`Schedule::output_range`]); other ranks' buffers end as scratch.
///
/// # Errors
/// [`CollectiveError::EmptyWorld`], [`CollectiveError::RankOutOfRange`],
/// [`CollectiveError::RootOutOfRange`], [`CollectiveError::UnsupportedReduction`],
/// [`CollectiveError::SizeOverflow`].
pub fn reduce(
    rank: usize,
    world: usize,
    root: usize,
    count: usize,
    element: ElementType,
    op: ReduceOp,
) -> Result<Schedule, CollectiveError> {
    check_rank(rank, world)?;
    if root >= world {
        return Err(CollectiveError::RootOutOfRange { root, world });
    }
    op.check(element)?;
    let bytes = count
        .checked_mul(element.size())
        .ok_or(CollectiveError::SizeOverflow)?;
    let whole = Blocks::new(std::iter::once(bytes))?;
    let mut plan = Plan::new(
        &whole,
        Apply::Reduce {
            op,
            element,
            incoming_first: false,
        },
    );
    let relative = (rank + world - root) % world;
    let absolute = |v: usize| (v + root) % world;
    let mut distance = 1;
    while distance < world {
        if relative & distance != 0 {
            plan.step(&[(absolute(relative - distance), 0, 1)], &[]);
            break;
        }
        if relative + distance < world {
            plan.step(&[], &[(absolute(relative + distance), 0, 1)]);
        }
        distance *= 2;
    }
    let mut schedule = plan.finish(rank, world, 0..bytes);
    if relative != 0 {
        schedule.output = 0..0;
    }
    Ok(schedule)
}

/// Reduce-scatter: rank i ends with the reduction, over all ranks, of chunk i, where chunk i
/// is `counts[i]` elements (the world size is `counts.len()`; chunks may differ and be empty).
/// Every rank's input is the whole buffer, the chunks in rank order.
///
/// A ring: in step s rank r sends its partial of chunk `r − s − 1` to `r + 1` and reduces the
/// partial of chunk `r − s − 2` it receives from `r − 1` (the incoming partial first), so the
/// partial of chunk c starts at rank c + 1 and reaches rank c complete after N − 1 steps.
/// Bandwidth-optimal; depth N − 1.
///
/// # Errors
/// [`CollectiveError::EmptyWorld`], [`CollectiveError::RankOutOfRange`],
/// [`CollectiveError::UnsupportedReduction`], [`CollectiveError::SizeOverflow`].
pub fn reduce_scatter(
    rank: usize,
    counts: &[usize],
    element: ElementType,
    op: ReduceOp,
) -> Result<Schedule, CollectiveError> {
    let world = counts.len();
    check_rank(rank, world)?;
    op.check(element)?;
    let mut lens = Vec::with_capacity(world);
    for count in counts {
        lens.push(
            count
                .checked_mul(element.size())
                .ok_or(CollectiveError::SizeOverflow)?,
        );
    }
    let chunks = Blocks::new(lens.into_iter())?;
    let mut plan = Plan::new(
        &chunks,
        Apply::Reduce {
            op,
            element,
            incoming_first: true,
        },
    );
    let right = (rank + 1) % world;
    let left = (rank + world - 1) % world;
    for s in 0..world - 1 {
        plan.step(
            &[(right, (rank + 2 * world - s - 1) % world, 1)],
            &[(left, (rank + 2 * world - s - 2) % world, 1)],
        );
    }
    let output = chunks.offsets[rank]..chunks.offsets[rank + 1];
    let mut schedule = plan.finish(rank, world, 0..chunks.total());
    schedule.output = output;
    Ok(schedule)
}

/// Reduce-scatter by direct exchange ([`reduce_scatter`]'s contract: rank i ends with the
/// reduction of chunk i, `counts[i]` elements, chunks in rank order in every rank's buffer):
/// in step k (1 ≤ k < N) rank r sends its own chunk `r + k` straight to rank `r + k` and folds
/// in the chunk `r` it receives from rank `r − k`. Every contribution travels one hop and is
/// never forwarded, so a rank moves only its own chunks (the ring forwards partials of every
/// chunk through every rank); depth N − 1.
///
/// Rank r folds left to right in a fixed order: its own chunk, then rank r − 1's, r − 2's, ...
/// (wrapping) to rank r + 1's, so the same inputs give the same bits on every run, whatever
/// order messages arrive in.
///
/// A rank whose chunk is empty receives nothing, so (as a gather's non-root) it cannot tell
/// whether the others passed the same counts; the ranks that receive can.
///
/// # Errors
/// [`CollectiveError::EmptyWorld`], [`CollectiveError::RankOutOfRange`],
/// [`CollectiveError::UnsupportedReduction`], [`CollectiveError::SizeOverflow`].
pub fn reduce_scatter_v(
    rank: usize,
    counts: &[usize],
    element: ElementType,
    op: ReduceOp,
) -> Result<Schedule, CollectiveError> {
    let world = counts.len();
    check_rank(rank, world)?;
    op.check(element)?;
    let mut lens = Vec::with_capacity(world);
    for count in counts {
        lens.push(
            count
                .checked_mul(element.size())
                .ok_or(CollectiveError::SizeOverflow)?,
        );
    }
    let chunks = Blocks::new(lens.into_iter())?;
    let mut plan = Plan::new(
        &chunks,
        Apply::Reduce {
            op,
            element,
            incoming_first: false,
        },
    );
    for k in 1..world {
        let to = (rank + k) % world;
        let from = (rank + world - k) % world;
        plan.step(&[(to, to, 1)], &[(from, rank, 1)]);
    }
    let output = chunks.offsets[rank]..chunks.offsets[rank + 1];
    let mut schedule = plan.finish(rank, world, 0..chunks.total());
    schedule.output = output;
    Ok(schedule)
}

/// Gather to `root`: every other rank sends its block (`lens[rank]` bytes) to the root in one
/// message; the root receives them all in one step, in rank order. The root's buffer holds
/// every block in rank order ([`Schedule::output_range`]); another rank's buffer is its own
/// block only, so only `lens[rank]` is read there. Empty blocks are not sent.
///
/// # Errors
/// [`CollectiveError::EmptyWorld`], [`CollectiveError::RankOutOfRange`],
/// [`CollectiveError::RootOutOfRange`], [`CollectiveError::SizeOverflow`].
pub fn gather(rank: usize, root: usize, lens: &[usize]) -> Result<Schedule, CollectiveError> {
    flat(rank, root, lens, true)
}

/// Scatter from `root`: the root sends each other rank its block (`lens[i]` bytes for rank
/// i) in one step; the others receive theirs. The root's buffer (its input) holds every block
/// in rank order, and its result is its own block; another rank's buffer is its block only,
/// so only `lens[rank]` is read there. Empty blocks are not sent.
///
/// # Errors
/// As [`gather`].
pub fn scatter(rank: usize, root: usize, lens: &[usize]) -> Result<Schedule, CollectiveError> {
    flat(rank, root, lens, false)
}

/// The one-step root-to-everyone (scatter) or everyone-to-root (gather) schedule.
fn flat(
    rank: usize,
    root: usize,
    lens: &[usize],
    to_root: bool,
) -> Result<Schedule, CollectiveError> {
    let world = lens.len();
    check_rank(rank, world)?;
    if root >= world {
        return Err(CollectiveError::RootOutOfRange { root, world });
    }
    if rank != root {
        let len = lens[rank];
        let ranges: Vec<Range<usize>> = std::iter::once(0..len).filter(|r| !r.is_empty()).collect();
        let mut step = Step::default();
        if len > 0 {
            if to_root {
                step.sends.push(Transfer { peer: root, ranges });
            } else {
                step.receives.push(Receive {
                    peer: root,
                    ranges,
                    action: Apply::Store,
                });
            }
        }
        return Ok(Schedule {
            rank,
            world,
            buffer_len: len,
            input: if to_root { 0..len } else { 0..0 },
            output: if to_root { 0..0 } else { 0..len },
            local: None,
            steps: if len > 0 { vec![step] } else { Vec::new() },
        });
    }
    let blocks = Blocks::new(lens.iter().copied())?;
    let mut plan = Plan::new(&blocks, Apply::Store);
    let others: Vec<(usize, usize, usize)> = (0..world)
        .filter(|peer| *peer != root)
        .map(|peer| (peer, peer, 1))
        .collect();
    if to_root {
        plan.step(&[], &others);
    } else {
        plan.step(&others, &[]);
    }
    let own = blocks.offsets[root]..blocks.offsets[root + 1];
    let whole = 0..blocks.total();
    let mut schedule = plan.finish(
        rank,
        world,
        if to_root { own.clone() } else { whole.clone() },
    );
    schedule.output = if to_root { whole } else { own };
    Ok(schedule)
}

/// All-to-all: rank r sends `send_lens[p]` bytes to each rank p and receives `recv_lens[p]`
/// bytes from each (one list entry per rank; rank p's `send_lens[r]` must equal rank r's
/// `recv_lens[p]`). The buffer is the blocks to send, in rank order (the input), then the
/// blocks received, in rank order (the output); the block a rank sends itself is a
/// [`Schedule::local_copy`]. Step k (1 ≤ k < N) sends to `r + k` and receives from `r − k`.
/// Every pair exchanges one message even when it is empty, so that a rank expecting another
/// length than its peer sends fails on that message instead of waiting for one that never
/// comes.
///
/// # Errors
/// [`CollectiveError::EmptyWorld`], [`CollectiveError::RankOutOfRange`],
/// [`CollectiveError::LengthsCount`] when the two lists differ in length,
/// [`CollectiveError::InputLength`] when this rank's block to itself differs in the two,
/// [`CollectiveError::SizeOverflow`].
pub fn all_to_all(
    rank: usize,
    send_lens: &[usize],
    recv_lens: &[usize],
) -> Result<Schedule, CollectiveError> {
    let world = send_lens.len();
    check_rank(rank, world)?;
    if recv_lens.len() != world {
        return Err(CollectiveError::LengthsCount {
            lens: recv_lens.len(),
            world,
        });
    }
    if send_lens[rank] != recv_lens[rank] {
        return Err(CollectiveError::InputLength {
            rank,
            expected: recv_lens[rank],
            actual: send_lens[rank],
        });
    }
    let blocks = Blocks::new(send_lens.iter().chain(recv_lens).copied())?;
    let send = |p: usize| blocks.offsets[p]..blocks.offsets[p + 1];
    let recv = |p: usize| blocks.offsets[world + p]..blocks.offsets[world + p + 1];
    let some = |r: Range<usize>| if r.is_empty() { Vec::new() } else { vec![r] };
    let steps = (1..world)
        .map(|k| {
            let to = (rank + k) % world;
            let from = (rank + world - k) % world;
            Step {
                sends: vec![Transfer {
                    peer: to,
                    ranges: some(send(to)),
                }],
                receives: vec![Receive {
                    peer: from,
                    ranges: some(recv(from)),
                    action: Apply::Store,
                }],
            }
        })
        .collect();
    Ok(Schedule {
        rank,
        world,
        buffer_len: blocks.total(),
        input: 0..blocks.offsets[world],
        output: blocks.offsets[world]..blocks.total(),
        local: Some((send(rank), recv(rank))),
        steps,
    })
}

/// The monitored barrier of `rank` of `world`: every other rank sends rank 0 an empty
/// message, rank 0 receives them all (in rank order) in one step and then answers each in
/// another. Rank 0 waits on every rank, so when it times out it knows exactly which ranks
/// have not arrived ([`monitored_barrier_missing`] says which to name).
///
/// # Errors
/// [`CollectiveError::EmptyWorld`], [`CollectiveError::RankOutOfRange`].
pub fn monitored_barrier(rank: usize, world: usize) -> Result<Schedule, CollectiveError> {
    check_rank(rank, world)?;
    let empty = |peer| Transfer {
        peer,
        ranges: Vec::new(),
    };
    let hear = |peer| Receive {
        peer,
        ranges: Vec::new(),
        action: Apply::Store,
    };
    let steps = if world == 1 {
        Vec::new()
    } else if rank == 0 {
        vec![
            Step {
                sends: Vec::new(),
                receives: (1..world).map(hear).collect(),
            },
            Step {
                sends: (1..world).map(empty).collect(),
                receives: Vec::new(),
            },
        ]
    } else {
        vec![
            Step {
                sends: vec![empty(0)],
                receives: Vec::new(),
            },
            Step {
                sends: Vec::new(),
                receives: vec![hear(0)],
            },
        ]
    };
    Ok(Schedule {
        rank,
        world,
        buffer_len: 0,
        input: 0..0,
        output: 0..0,
        local: None,
        steps,
    })
}

/// The ranks a failed [`monitored_barrier`] names, given the ranks rank 0 was still waiting
/// for when it timed out: all of them, in rank order, with `wait_all_ranks` (PyTorch's
/// `wait_all_ranks=True`), else only the first.
pub fn monitored_barrier_missing(waiting: &[usize], wait_all_ranks: bool) -> Vec<usize> {
    let mut missing = waiting.to_vec();
    missing.sort_unstable();
    missing.dedup();
    if !wait_all_ranks {
        missing.truncate(1);
    }
    missing
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
        let len = self.blocks.total();
        Schedule {
            rank,
            world,
            buffer_len: len,
            input,
            output: 0..len,
            local: None,
            steps: self.steps,
        }
    }
}
