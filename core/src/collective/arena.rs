//! Arena plans: the collectives of ranks on one host, through one shared segment.
//!
//! Ranks of a group that share a host map one segment for the group (the *arena*): a slot per
//! rank, each in two halves of [`ArenaPlan::slot_bytes`] bytes, and one counter per rank. A
//! collective is a plan of **phases**; in phase `k` of the arena's life (counted over every
//! collective the group has run) each rank, in order:
//!
//! 1. if it writes in this phase, waits until the ranks that read the same half of its slot the
//!    last time it wrote there have moved on (their counters reached that phase + 2: they finished
//!    those reads before they wrote their next phase), see [`ArenaState::free_waits`];
//! 2. copies its [`ArenaWrite`]s from its buffer into half `k % 2` of its slot;
//! 3. publishes its counter as `k + 1` ([`ArenaState::posted`]);
//! 4. waits until each rank of [`ArenaPhase::waits_on`] has published `k + 1`;
//! 5. applies its [`ArenaRead`]s: copies (or reduces) ranges of those ranks' half `k % 2` into
//!    its buffer; then its [`ArenaFold`]s: folds the same range of several of those halves and
//!    its own bytes, in rank order, into its buffer in one pass.
//!
//! So every block is copied once into the arena and once out, reductions run over the slots
//! (each rank folding its share of a large message, in rank order, its own operand where it
//! lies in its buffer, and handing the result to the others, so that every rank ends with
//! bitwise identical results), and a message larger than a slot streams through it in
//! as many phases as it needs, double-buffered. A plan is a pure function of the rank, the world
//! size, the sizes and the slot size, like the link [`Schedule`](super::Schedule)s; the
//! simulation (`arena_sim`) runs every plan for every world size up to 64 with seeded
//! interleavings, checking results and that no read ever sees a half that was overwritten or not
//! yet written. The waits of steps 1 and 4, and the failures they end in (a rank that died, or
//! did not come by the deadline), are decided in [`arena_wait`](super::arena_wait); a failure
//! stays in the [`ArenaState`] for every later collective.
//!
//! | collective | phases per chunk | who writes | who reads |
//! |---|---|---|---|
//! | [`barrier`] | 1 | nobody | nothing; waits on everyone |
//! | [`broadcast`] | 1 | the root | every other rank |
//! | [`all_gather`] | 1 | everyone, its block | everyone, every other block |
//! | [`all_reduce`] | 1 (small: every rank reduces everything) or 2 (each rank folds its share, then everyone copies the shares) | everyone (large: all but its own share) | everyone |
//! | [`reduce`](fn@reduce) | 1 (small) or 2 | everyone | the root (and, for large, everyone its share) |
//! | [`reduce_scatter`] | 1 | everyone, a piece for each other rank | everyone, its own piece of every other slot (folded with its own) |
//! | [`gather`] | 1 | everyone but the root | the root |
//! | [`scatter`] | 1 | the root, a piece for each rank | every other rank |
//! | [`all_to_all`] | 1 | everyone, a piece for each rank | everyone, its piece of every slot |

use std::ops::Range;

use super::arena_wait::ArenaFailure;
pub use super::arena_wait::{counter, reached};
use super::{CollectiveError, ElementType, ReduceOp};

/// Every offset into a slot, and every piece a slot is cut into, is a multiple of this (a cache
/// line, and a multiple of every element's size).
pub const ARENA_ALIGN: usize = 64;

/// Bytes of a message up to which [`all_reduce`] and [`reduce`](fn@reduce) take one phase per
/// chunk, each reading rank reducing every slot itself (one synchronisation); above it, each
/// rank reduces its share and the shares are copied in a second phase.
pub const ARENA_REDUCE_ALL_MAX_BYTES: usize = 16 * 1024;

/// One copy from this rank's buffer into its own slot (the half of the phase).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ArenaWrite {
    /// The bytes of the buffer.
    pub from: Range<usize>,
    /// Where they go in the slot's half.
    pub to: usize,
}

/// One read from a rank's slot (the half of the phase) into this rank's buffer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ArenaRead {
    /// The rank whose slot is read (may be this rank: reductions read every slot in rank order).
    pub peer: usize,
    /// Where the bytes start in that slot's half.
    pub from: usize,
    /// Where they go in the buffer (its length is the read's length).
    pub to: Range<usize>,
    /// Combine with the buffer's bytes (with the plan's [`ArenaPlan::reduction`]) instead of
    /// storing them.
    pub reduce: bool,
}

/// A fold of the same range of several ranks' slots (the half of the phase) and of this rank's
/// own bytes, in a given order, into this rank's buffer (with the plan's
/// [`ArenaPlan::reduction`]), in one pass: [`fold_in_order`](super::fold_in_order). A rank
/// reduces its share of a large reduction so, its own operand taken where it lies in its
/// buffer (never copied into its slot first).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ArenaFold {
    /// Where the operands start in each of those slots' half.
    pub from: usize,
    /// Where the result goes in the buffer; this rank's own operand is the bytes there before
    /// the fold.
    pub to: Range<usize>,
    /// The ranks whose operands are folded, in this order (this rank for its own bytes).
    pub order: Vec<usize>,
}

/// One phase of a plan, for one rank.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ArenaPhase {
    /// Copies into this rank's slot, before it publishes the phase.
    pub writes: Vec<ArenaWrite>,
    /// The ranks that read this rank's slot in this phase (never itself), so that it waits
    /// for them before it writes that half again.
    pub readers: Vec<usize>,
    /// The ranks whose publication of this phase this rank waits for before its reads.
    pub waits_on: Vec<usize>,
    /// Reads from slots, applied in order, after the waits.
    pub reads: Vec<ArenaRead>,
    /// Folds, applied in order after the reads.
    pub folds: Vec<ArenaFold>,
}

/// A collective as phases through the arena, for one rank: pure data.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ArenaPlan {
    rank: usize,
    world: usize,
    slot_bytes: usize,
    buffer_len: usize,
    input: Range<usize>,
    output: Range<usize>,
    local: Option<(Range<usize>, Range<usize>)>,
    reduction: Option<(ElementType, ReduceOp)>,
    phases: Vec<ArenaPhase>,
    /// What was settled about the plan when it was made ([`Settled`]).
    settled: Settled,
}

/// What core settles about a plan once, when it makes it, so that an executor running a kept
/// plan again and again does not look again at every call.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
struct Settled {
    /// Its reductions fit its reads ([`ArenaPlan::check_reductions`] found nothing).
    reductions_fit: bool,
    /// It only signals ([`ArenaPlan::signals_only`]).
    signals_only: bool,
}

impl ArenaPlan {
    /// This rank.
    pub fn rank(&self) -> usize {
        self.rank
    }
    /// The world size.
    pub fn world(&self) -> usize {
        self.world
    }
    /// The bytes of one half of a slot the plan was made for.
    pub fn slot_bytes(&self) -> usize {
        self.slot_bytes
    }
    /// The length of this rank's buffer.
    pub fn buffer_len(&self) -> usize {
        self.buffer_len
    }
    /// Where this rank's input goes in its buffer before the first phase.
    pub fn input_range(&self) -> Range<usize> {
        self.input.clone()
    }
    /// Where the result is in the buffer after the last phase.
    pub fn output_range(&self) -> Range<usize> {
        self.output.clone()
    }
    /// A copy within the buffer to make before the first phase (`from`, `to`): an
    /// all_to_all's block to itself.
    pub fn local_copy(&self) -> Option<(Range<usize>, Range<usize>)> {
        self.local.clone()
    }
    /// The element type and operation of reducing reads.
    pub fn reduction(&self) -> Option<(ElementType, ReduceOp)> {
        self.reduction
    }
    /// The phases, in order. Every rank of a collective has the same number.
    pub fn phases(&self) -> &[ArenaPhase] {
        &self.phases
    }

    /// Whether this plan, run over a buffer of which only the input range holds anything
    /// (the rest never written, the local copy's source within the input), writes every byte
    /// of the buffer before it draws on it and leaves none unwritten: each write into the
    /// slot, each reducing read and the local copy take only bytes the input or an earlier
    /// plain read put there, and by the end the plain reads and the input cover the whole
    /// buffer. The executor may then start from a buffer it has not cleared (an all_gather's
    /// receiving buffer, which would otherwise be zeroed first: as many bytes written again as
    /// the collective receives).
    pub fn fills_buffer(&self) -> bool {
        let mut filled = Filled::default();
        filled.add(self.input.clone());
        if let Some((from, to)) = &self.local {
            if !filled.covers(from) {
                return false;
            }
            filled.add(to.clone());
        }
        for phase in &self.phases {
            if !phase.writes.iter().all(|w| filled.covers(&w.from)) {
                return false;
            }
            for read in &phase.reads {
                if read.reduce {
                    if !filled.covers(&read.to) {
                        return false;
                    }
                } else {
                    filled.add(read.to.clone());
                }
            }
            for fold in &phase.folds {
                if fold.order.contains(&self.rank) && !filled.covers(&fold.to) {
                    return false;
                }
                filled.add(fold.to.clone());
            }
        }
        filled.covers(&(0..self.buffer_len))
    }

    /// Refuses a plan whose reducing reads have no reduction, or whose reduction does not fit
    /// them (an operation the element type does not support, a read of a part of an element):
    /// the reason. Settled when core made the plan, so a kept plan is not walked again.
    #[inline]
    pub fn check_reductions(&self) -> Result<(), String> {
        if self.settled.reductions_fit {
            return Ok(());
        }
        self.reduction_misfit()
    }

    /// [`check_reductions`](Self::check_reductions)'s walk over the reads.
    fn reduction_misfit(&self) -> Result<(), String> {
        let reads = self.phases.iter().flat_map(|p| &p.reads);
        let folds = self.phases.iter().flat_map(|p| &p.folds);
        let reducing = reads
            .filter(|r| r.reduce)
            .map(|r| r.to.len())
            .chain(folds.map(|f| f.to.len()));
        for len in reducing {
            let (element, op) = self
                .reduction
                .ok_or_else(|| "a reducing read without a reduction".to_owned())?;
            op.check(element).map_err(|e| e.to_string())?;
            if len % element.size() != 0 {
                return Err(format!(
                    "a reducing read of {len} bytes, not whole {element:?} elements"
                ));
            }
        }
        Ok(())
    }

    /// Whether the plan only signals: one phase that copies nothing (no writes, no reads, no
    /// local copy, an empty buffer), in which each rank publishes the phase and waits for its
    /// `waits_on`: a [`barrier`]'s. An executor may run such a plan without the general
    /// step's copies and bookkeeping.
    #[inline]
    pub fn signals_only(&self) -> bool {
        self.settled.signals_only
    }

    /// The plan with what core settles about it recorded (see [`Settled`]): the last step of
    /// every constructor.
    fn settle(mut self) -> Self {
        self.settled = Settled {
            reductions_fit: self.reduction_misfit().is_ok(),
            signals_only: self.buffer_len == 0
                && self.local.is_none()
                && matches!(&self.phases[..], [p] if p.writes.is_empty() && p.reads.is_empty() && p.folds.is_empty()),
        };
        self
    }

    /// The phases, to break a plan in a test (what was settled about it is forgotten: it is
    /// looked at again at every run).
    #[cfg(test)]
    pub(super) fn phases_mut(&mut self) -> &mut [ArenaPhase] {
        self.settled = Settled::default();
        &mut self.phases
    }
}

/// Disjoint, sorted, merged byte ranges: what a plan has written of its buffer so far.
#[derive(Default)]
struct Filled(Vec<Range<usize>>);

impl Filled {
    fn add(&mut self, r: Range<usize>) {
        if r.is_empty() {
            return;
        }
        // The ranges that touch or overlap `r` merge with it.
        let first = self.0.partition_point(|x| x.end < r.start);
        let last = self.0.partition_point(|x| x.start <= r.end);
        let merged = if first < last {
            self.0[first].start.min(r.start)..self.0[last - 1].end.max(r.end)
        } else {
            r
        };
        self.0.splice(first..last, [merged]);
    }

    fn covers(&self, r: &Range<usize>) -> bool {
        if r.is_empty() {
            return true;
        }
        let i = self.0.partition_point(|x| x.end < r.end);
        self.0
            .get(i)
            .is_some_and(|x| x.start <= r.start && r.end <= x.end)
    }
}

/// What a rank remembers between phases, across every collective of its arena: the phase
/// number and, for each half of its slot, who read it last. Every rank keeps one, and runs
/// every plan's phases through it.
#[derive(Debug, Clone, Default)]
pub struct ArenaState {
    phase: u64,
    /// For each half: the phase it was last written in, and the ranks that read it then.
    last: [(u64, Vec<usize>); 2],
    /// The first collective that failed: the ranks are out of step for good.
    failure: Option<ArenaFailure>,
}

impl ArenaState {
    /// A fresh arena's state (every counter at 0).
    pub fn new() -> Self {
        Self::default()
    }

    /// The number of the phase this rank is in (phases it has published so far).
    pub fn phase(&self) -> u64 {
        self.phase
    }

    /// The half of its slot this rank writes and the others read in the current phase.
    pub fn half(&self) -> usize {
        (self.phase % 2) as usize
    }

    /// What to wait for before writing the current phase's half: each rank that read it last
    /// time, and the counter it must have published.
    pub fn free_waits(&self) -> impl Iterator<Item = (usize, u32)> + '_ {
        let (written, readers) = &self.last[self.half()];
        let target = counter(written + 2);
        readers.iter().map(move |r| (*r, target))
    }

    /// [`free_waits`](Self::free_waits) as the ranks and the one counter value they must all
    /// have published (no allocation: the executor's fast path looks at these first).
    pub fn free_wait(&self) -> (&[usize], u32) {
        let (written, readers) = &self.last[self.half()];
        (readers, counter(written + 2))
    }

    /// What to wait for after publishing `phase` (the phase [`posted`](Self::posted) just
    /// published): each rank of its `waits_on`, and the counter value of that publication.
    pub fn phase_waits(&self, phase: &ArenaPhase) -> Vec<(usize, u32)> {
        let target = self.phase_target();
        phase.waits_on.iter().map(|q| (*q, target)).collect()
    }

    /// The counter value every rank of a phase's `waits_on` must have published after
    /// [`posted`](Self::posted) (the one value of [`phase_waits`](Self::phase_waits)).
    pub fn phase_target(&self) -> u32 {
        counter(self.phase)
    }

    /// Records that a collective failed (see [`arena_wait`](super::arena_wait)): the first
    /// failure stays, and is returned, for this one and every later collective.
    pub fn fail(&mut self, failure: ArenaFailure) -> ArenaFailure {
        self.failure.get_or_insert(failure).clone()
    }

    /// The failure every collective through this arena now fails with, if one failed.
    pub fn failure(&self) -> Option<&ArenaFailure> {
        self.failure.as_ref()
    }

    /// Records that this rank wrote (if `wrote`) for `readers` and publishes the current phase:
    /// returns the counter value to store, which every rank of the phase's `waits_on` waits for.
    pub fn posted(&mut self, wrote: bool, readers: &[usize]) -> u32 {
        if wrote {
            // The half's vector is reused: no allocation once it has held as many readers.
            let half = self.half();
            let last = &mut self.last[half];
            last.0 = self.phase;
            last.1.clear();
            last.1.extend_from_slice(readers);
        }
        self.phase += 1;
        counter(self.phase)
    }
}

/// The bytes of one half of a slot for a segment of `arena_bytes` shared by `world` ranks
/// (each has two halves), rounded down to [`ARENA_ALIGN`].
pub fn slot_bytes(arena_bytes: usize, world: usize) -> usize {
    let world = world.max(1);
    arena_bytes / (2 * world) / ARENA_ALIGN * ARENA_ALIGN
}

fn check(rank: usize, world: usize, slot: usize) -> Result<(), CollectiveError> {
    if world == 0 {
        return Err(CollectiveError::EmptyWorld);
    }
    if rank >= world {
        return Err(CollectiveError::RankOutOfRange { rank, world });
    }
    if slot < ARENA_ALIGN * world || slot % ARENA_ALIGN != 0 {
        return Err(CollectiveError::ArenaTooSmall {
            slot_bytes: slot,
            world,
        });
    }
    Ok(())
}

fn check_root(root: usize, world: usize) -> Result<(), CollectiveError> {
    if root >= world {
        return Err(CollectiveError::RootOutOfRange { root, world });
    }
    Ok(())
}

/// The piece of `range` a phase carries: `piece` bytes from `index * piece` on (empty past
/// its end).
fn piece_of(range: &Range<usize>, index: usize, piece: usize) -> Range<usize> {
    let start = range
        .start
        .saturating_add(index.saturating_mul(piece))
        .min(range.end);
    start..start.saturating_add(piece).min(range.end)
}

fn chunks(len: usize, piece: usize) -> usize {
    len.div_ceil(piece)
}

/// The per-rank piece of a slot cut into one piece per rank.
fn per_rank_piece(slot: usize, world: usize) -> usize {
    slot / world / ARENA_ALIGN * ARENA_ALIGN
}

/// Offsets of blocks laid out one after another.
fn layout(lens: &[usize]) -> Result<Vec<Range<usize>>, CollectiveError> {
    let mut at = 0usize;
    lens.iter()
        .map(|len| {
            let start = at;
            at = at.checked_add(*len).ok_or(CollectiveError::SizeOverflow)?;
            Ok(start..at)
        })
        .collect()
}

fn others(rank: usize, world: usize) -> Vec<usize> {
    (0..world).filter(|q| *q != rank).collect()
}

fn plan(
    rank: usize,
    world: usize,
    slot: usize,
    buffer_len: usize,
    input: Range<usize>,
    output: Range<usize>,
    phases: Vec<ArenaPhase>,
) -> ArenaPlan {
    ArenaPlan {
        rank,
        world,
        slot_bytes: slot,
        buffer_len,
        input,
        output,
        local: None,
        reduction: None,
        phases,
        settled: Settled::default(),
    }
    .settle()
}

/// A barrier: one phase in which every rank publishes and waits for every other.
///
/// # Errors
/// [`CollectiveError::EmptyWorld`], [`CollectiveError::RankOutOfRange`],
/// [`CollectiveError::ArenaTooSmall`].
pub fn barrier(rank: usize, world: usize, slot: usize) -> Result<ArenaPlan, CollectiveError> {
    check(rank, world, slot)?;
    let phase = ArenaPhase {
        waits_on: others(rank, world),
        ..ArenaPhase::default()
    };
    Ok(plan(rank, world, slot, 0, 0..0, 0..0, vec![phase]))
}

/// Broadcast of `len` bytes from `root`: the root writes a slot's worth a phase, every other
/// rank copies it out.
///
/// # Errors
/// As [`barrier`], and [`CollectiveError::RootOutOfRange`].
pub fn broadcast(
    rank: usize,
    world: usize,
    root: usize,
    len: usize,
    slot: usize,
) -> Result<ArenaPlan, CollectiveError> {
    check(rank, world, slot)?;
    check_root(root, world)?;
    let all = 0..len;
    let phases = (0..chunks(len, slot).max(1))
        .map(|i| {
            let piece = piece_of(&all, i, slot);
            let mut phase = ArenaPhase::default();
            if piece.is_empty() {
                return phase;
            }
            if rank == root {
                phase.writes.push(ArenaWrite { from: piece, to: 0 });
                phase.readers = others(rank, world);
            } else {
                phase.waits_on.push(root);
                phase.reads.push(ArenaRead {
                    peer: root,
                    from: 0,
                    to: piece,
                    reduce: false,
                });
            }
            phase
        })
        .collect();
    let input = if rank == root { 0..len } else { 0..0 };
    Ok(plan(rank, world, slot, len, input, 0..len, phases))
}

/// All-gather of one block per rank (`lens[i]` bytes from rank i, the world size is
/// `lens.len()`): the buffer holds the blocks in rank order; each phase every rank writes the
/// next slot's worth of its block and copies out everyone else's.
///
/// # Errors
/// As [`barrier`], and [`CollectiveError::SizeOverflow`].
pub fn all_gather(rank: usize, lens: &[usize], slot: usize) -> Result<ArenaPlan, CollectiveError> {
    let world = lens.len();
    check(rank, world, slot)?;
    let blocks = layout(lens)?;
    let count = lens.iter().map(|l| chunks(*l, slot)).max().unwrap_or(0);
    let phases = (0..count.max(1))
        .map(|i| {
            let mut phase = ArenaPhase::default();
            let mine = piece_of(&blocks[rank], i, slot);
            if !mine.is_empty() {
                phase.writes.push(ArenaWrite { from: mine, to: 0 });
                phase.readers = others(rank, world);
            }
            for q in others(rank, world) {
                let theirs = piece_of(&blocks[q], i, slot);
                if !theirs.is_empty() {
                    phase.waits_on.push(q);
                    phase.reads.push(ArenaRead {
                        peer: q,
                        from: 0,
                        to: theirs,
                        reduce: false,
                    });
                }
            }
            phase
        })
        .collect();
    let total = blocks.last().map_or(0, |b| b.end);
    Ok(plan(
        rank,
        world,
        slot,
        total,
        blocks[rank].clone(),
        0..total,
        phases,
    ))
}

/// Splits `elements` elements into `world` shares of whole elements (the last ones may be
/// smaller or empty), as byte ranges from `base`.
fn shares(base: usize, elements: usize, size: usize, world: usize) -> Vec<Range<usize>> {
    let each = elements.div_ceil(world);
    (0..world)
        .map(|r| {
            let start = (r * each).min(elements);
            let end = ((r + 1) * each).min(elements);
            base + start * size..base + end * size
        })
        .collect()
}

/// The writes of a chunk into a slot (at its offset within the chunk) but for `hole`, a part of
/// it (none when empty).
fn around(chunk: &Range<usize>, hole: &Range<usize>) -> Vec<ArenaWrite> {
    if hole.is_empty() {
        return vec![ArenaWrite {
            from: chunk.clone(),
            to: 0,
        }];
    }
    [chunk.start..hole.start, hole.end..chunk.end]
        .into_iter()
        .filter(|r| !r.is_empty())
        .map(|from| ArenaWrite {
            to: from.start - chunk.start,
            from,
        })
        .collect()
}

/// Reads of `to` from the same offset of every slot, in rank order: stored from rank 0,
/// reduced with each later rank's.
fn reduce_reads(world: usize, from: usize, to: &Range<usize>) -> Vec<ArenaRead> {
    (0..world)
        .map(|q| ArenaRead {
            peer: q,
            from,
            to: to.clone(),
            reduce: q != 0,
        })
        .collect()
}

/// The reduction phases of `all_reduce` (`gather_shares`: every rank copies the shares) or
/// `reduce` (only `root` does), over a buffer of `count` elements.
fn reduction_phases(
    rank: usize,
    world: usize,
    count: usize,
    element: ElementType,
    slot: usize,
    root: Option<usize>,
) -> Vec<ArenaPhase> {
    let size = element.size();
    let len = count * size;
    let small = len <= ARENA_REDUCE_ALL_MAX_BYTES;
    let all = 0..len;
    let mut phases = Vec::new();
    for i in 0..chunks(len, slot).max(1) {
        let chunk = piece_of(&all, i, slot);
        if chunk.is_empty() {
            phases.push(ArenaPhase::default());
            continue;
        }
        let reducer = |r: usize| root.is_none_or(|root| root == r);
        if small || world == 1 {
            // Everyone writes the chunk; each reducing rank folds every slot in rank order.
            let mut phase = ArenaPhase {
                writes: vec![ArenaWrite {
                    from: chunk.clone(),
                    to: 0,
                }],
                readers: others(rank, world)
                    .into_iter()
                    .filter(|q| reducer(*q))
                    .collect(),
                ..ArenaPhase::default()
            };
            if reducer(rank) {
                phase.waits_on = others(rank, world);
                phase.reads = reduce_reads(world, 0, &chunk);
            }
            phases.push(phase);
            continue;
        }
        // Each rank folds its share of the chunk from every other slot and its own buffer (its
        // own share never goes into its slot), then the shares are copied (to every rank, or to
        // the root).
        let parts = shares(chunk.start, chunk.len() / size, size, world);
        let mine = parts[rank].clone();
        let readers: Vec<usize> = others(rank, world)
            .into_iter()
            .filter(|q| !parts[*q].is_empty())
            .collect();
        let mut first = ArenaPhase {
            writes: around(&chunk, &mine),
            readers,
            ..ArenaPhase::default()
        };
        if !mine.is_empty() {
            first.waits_on = others(rank, world);
            first.folds = vec![ArenaFold {
                from: mine.start - chunk.start,
                to: mine.clone(),
                order: (0..world).collect(),
            }];
        }
        phases.push(first);
        let mut second = ArenaPhase::default();
        if !mine.is_empty() && root != Some(rank) {
            second.writes.push(ArenaWrite {
                from: mine.clone(),
                to: 0,
            });
            second.readers = match root {
                Some(root) => vec![root],
                None => others(rank, world),
            };
        }
        if reducer(rank) {
            for q in others(rank, world) {
                if !parts[q].is_empty() {
                    second.waits_on.push(q);
                    second.reads.push(ArenaRead {
                        peer: q,
                        from: 0,
                        to: parts[q].clone(),
                        reduce: false,
                    });
                }
            }
        }
        phases.push(second);
    }
    phases
}

fn check_reduction(element: ElementType, op: ReduceOp) -> Result<(), CollectiveError> {
    op.check(element)
}

/// All-reduce of `count` elements: up to [`ARENA_REDUCE_ALL_MAX_BYTES`] every rank writes
/// its data and folds every slot in rank order (one phase); above it, chunks of a slot, each
/// rank writing the others' shares into its slot and folding its own share (from the other
/// slots and its own buffer, in rank order) into its buffer, then everyone copying the shares. Every rank
/// ends with bitwise identical results. ([`ReduceOp::Avg`] still needs
/// [`ReduceOp::finish`].)
///
/// # Errors
/// As [`barrier`], [`CollectiveError::UnsupportedReduction`], [`CollectiveError::SizeOverflow`].
pub fn all_reduce(
    rank: usize,
    world: usize,
    count: usize,
    element: ElementType,
    op: ReduceOp,
    slot: usize,
) -> Result<ArenaPlan, CollectiveError> {
    check(rank, world, slot)?;
    check_reduction(element, op)?;
    let len = count
        .checked_mul(element.size())
        .ok_or(CollectiveError::SizeOverflow)?;
    let phases = reduction_phases(rank, world, count, element, slot, None);
    let mut p = plan(rank, world, slot, len, 0..len, 0..len, phases);
    p.reduction = Some((element, op));
    Ok(p.settle())
}

/// Reduce of `count` elements to `root`: as [`all_reduce`], but only the root folds (small)
/// or collects the shares (large). Other ranks' buffers are scratch.
///
/// # Errors
/// As [`all_reduce`], and [`CollectiveError::RootOutOfRange`].
pub fn reduce(
    rank: usize,
    world: usize,
    root: usize,
    count: usize,
    element: ElementType,
    op: ReduceOp,
    slot: usize,
) -> Result<ArenaPlan, CollectiveError> {
    check(rank, world, slot)?;
    check_root(root, world)?;
    check_reduction(element, op)?;
    let len = count
        .checked_mul(element.size())
        .ok_or(CollectiveError::SizeOverflow)?;
    let phases = reduction_phases(rank, world, count, element, slot, Some(root));
    let mut p = plan(rank, world, slot, len, 0..len, 0..len, phases);
    p.reduction = Some((element, op));
    Ok(p.settle())
}

/// Reduce-scatter: the buffer holds every rank's segment (`counts[i]` elements for rank i), in
/// rank order; rank i ends with segment i reduced over every rank. Each phase every rank writes
/// the next piece of every other rank's segment (a slot cut into one piece per rank), and each
/// rank folds its own piece from every other slot and its own buffer, in rank order.
///
/// # Errors
/// As [`all_reduce`].
pub fn reduce_scatter(
    rank: usize,
    counts: &[usize],
    element: ElementType,
    op: ReduceOp,
    slot: usize,
) -> Result<ArenaPlan, CollectiveError> {
    let world = counts.len();
    check(rank, world, slot)?;
    check_reduction(element, op)?;
    let size = element.size();
    let lens = counts
        .iter()
        .map(|c| c.checked_mul(size).ok_or(CollectiveError::SizeOverflow))
        .collect::<Result<Vec<_>, _>>()?;
    let segments = layout(&lens)?;
    let piece = per_rank_piece(slot, world);
    let count = lens.iter().map(|l| chunks(*l, piece)).max().unwrap_or(0);
    let phases = (0..count.max(1))
        .map(|i| {
            let mut phase = ArenaPhase::default();
            // Its own piece stays in its buffer: it folds it with the others' there.
            for (d, segment) in segments.iter().enumerate() {
                let part = piece_of(segment, i, piece);
                if !part.is_empty() && d != rank {
                    phase.writes.push(ArenaWrite {
                        from: part,
                        to: d * piece,
                    });
                    phase.readers.push(d);
                }
            }
            let mine = piece_of(&segments[rank], i, piece);
            if !mine.is_empty() {
                phase.waits_on = others(rank, world);
                phase.folds = vec![ArenaFold {
                    from: rank * piece,
                    to: mine,
                    order: (0..world).collect(),
                }];
            }
            phase
        })
        .collect();
    let total = segments.last().map_or(0, |s| s.end);
    let mut p = plan(
        rank,
        world,
        slot,
        total,
        0..total,
        segments[rank].clone(),
        phases,
    );
    p.reduction = Some((element, op));
    Ok(p.settle())
}

/// Gather to `root` (`lens[i]` bytes from rank i): the root's buffer holds every block in rank
/// order, another rank's only its own. Each phase every other rank writes the next slot's worth
/// of its block and the root copies them out.
///
/// # Errors
/// As [`broadcast`], and [`CollectiveError::SizeOverflow`].
pub fn gather(
    rank: usize,
    root: usize,
    lens: &[usize],
    slot: usize,
) -> Result<ArenaPlan, CollectiveError> {
    let world = lens.len();
    check(rank, world, slot)?;
    check_root(root, world)?;
    let blocks = layout(lens)?;
    let count = lens.iter().map(|l| chunks(*l, slot)).max().unwrap_or(0);
    let own = 0..lens[rank];
    let phases = (0..count.max(1))
        .map(|i| {
            let mut phase = ArenaPhase::default();
            if rank != root {
                let mine = piece_of(&own, i, slot);
                if !mine.is_empty() {
                    phase.writes.push(ArenaWrite { from: mine, to: 0 });
                    phase.readers = vec![root];
                }
                return phase;
            }
            for q in others(rank, world) {
                let theirs = piece_of(&blocks[q], i, slot);
                if !theirs.is_empty() {
                    phase.waits_on.push(q);
                    phase.reads.push(ArenaRead {
                        peer: q,
                        from: 0,
                        to: theirs,
                        reduce: false,
                    });
                }
            }
            phase
        })
        .collect();
    Ok(if rank == root {
        let total = blocks.last().map_or(0, |b| b.end);
        plan(
            rank,
            world,
            slot,
            total,
            blocks[rank].clone(),
            0..total,
            phases,
        )
    } else {
        plan(rank, world, slot, own.len(), own.clone(), own, phases)
    })
}

/// Scatter from `root` (`lens[i]` bytes for rank i): the root's buffer holds every block in
/// rank order, another rank's its own. Each phase the root writes the next piece of every
/// other rank's block (a slot cut into one piece per rank) and each copies its own out.
///
/// # Errors
/// As [`gather`].
pub fn scatter(
    rank: usize,
    root: usize,
    lens: &[usize],
    slot: usize,
) -> Result<ArenaPlan, CollectiveError> {
    let world = lens.len();
    check(rank, world, slot)?;
    check_root(root, world)?;
    let blocks = layout(lens)?;
    let piece = per_rank_piece(slot, world);
    let count = lens
        .iter()
        .enumerate()
        .filter(|(r, _)| *r != root)
        .map(|(_, l)| chunks(*l, piece))
        .max()
        .unwrap_or(0);
    let own = 0..lens[rank];
    let phases = (0..count.max(1))
        .map(|i| {
            let mut phase = ArenaPhase::default();
            if rank == root {
                for q in others(rank, world) {
                    let part = piece_of(&blocks[q], i, piece);
                    if !part.is_empty() {
                        phase.writes.push(ArenaWrite {
                            from: part,
                            to: q * piece,
                        });
                        phase.readers.push(q);
                    }
                }
            } else {
                let mine = piece_of(&own, i, piece);
                if !mine.is_empty() {
                    phase.waits_on.push(root);
                    phase.reads.push(ArenaRead {
                        peer: root,
                        from: rank * piece,
                        to: mine,
                        reduce: false,
                    });
                }
            }
            phase
        })
        .collect();
    Ok(if rank == root {
        let total = blocks.last().map_or(0, |b| b.end);
        plan(
            rank,
            world,
            slot,
            total,
            0..total,
            blocks[rank].clone(),
            phases,
        )
    } else {
        plan(rank, world, slot, own.len(), 0..0, own, phases)
    })
}

/// All-to-all: `lens[s][d]` is the length of the block rank s sends rank d (every rank passes
/// the whole matrix, which an exchange of the split sizes gives it). The buffer holds the
/// blocks this rank sends, in rank order (its input), then the blocks it receives, in rank
/// order (its output); its block to itself is a [local copy](ArenaPlan::local_copy). Each phase
/// every rank writes the next piece of each block it sends (a slot cut into one piece per rank)
/// and copies its own piece out of every slot.
///
/// # Errors
/// As [`barrier`], [`CollectiveError::LengthsCount`] when the matrix is not square,
/// [`CollectiveError::SizeOverflow`].
pub fn all_to_all(
    rank: usize,
    lens: &[Vec<usize>],
    slot: usize,
) -> Result<ArenaPlan, CollectiveError> {
    let world = lens.len();
    check(rank, world, slot)?;
    if let Some(row) = lens.iter().find(|row| row.len() != world) {
        return Err(CollectiveError::LengthsCount {
            lens: row.len(),
            world,
        });
    }
    let sent = layout(&lens[rank])?;
    let sent_len = sent.last().map_or(0, |b| b.end);
    let column: Vec<usize> = lens.iter().map(|row| row[rank]).collect();
    let received: Vec<Range<usize>> = layout(&column)?
        .into_iter()
        .map(|r| r.start + sent_len..r.end + sent_len)
        .collect();
    let total = received.last().map_or(sent_len, |b| b.end);
    let piece = per_rank_piece(slot, world);
    let count = (0..world)
        .flat_map(|s| (0..world).filter(move |d| *d != s).map(move |d| (s, d)))
        .map(|(s, d)| chunks(lens[s][d], piece))
        .max()
        .unwrap_or(0);
    let phases = (0..count.max(1))
        .map(|i| {
            let mut phase = ArenaPhase::default();
            for d in others(rank, world) {
                let part = piece_of(&sent[d], i, piece);
                if !part.is_empty() {
                    phase.writes.push(ArenaWrite {
                        from: part,
                        to: d * piece,
                    });
                    phase.readers.push(d);
                }
            }
            for q in others(rank, world) {
                let part = piece_of(&received[q], i, piece);
                if !part.is_empty() {
                    phase.waits_on.push(q);
                    phase.reads.push(ArenaRead {
                        peer: q,
                        from: rank * piece,
                        to: part,
                        reduce: false,
                    });
                }
            }
            phase
        })
        .collect();
    let mut p = plan(
        rank,
        world,
        slot,
        total,
        0..sent_len,
        sent_len..total,
        phases,
    );
    if lens[rank][rank] > 0 {
        p.local = Some((sent[rank].clone(), received[rank].clone()));
    }
    Ok(p.settle())
}
