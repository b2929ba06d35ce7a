//! Many collectives in flight at once, simulated: every rank issues the same random mix of
//! collectives in the same order, and a seeded scheduler interleaves everything (when each
//! rank issues its next call, which round of which call moves next, which message is taken)
//! at random. Messages are matched by (sender, receiver, sequence number) and carry the round's
//! [`Signature`], which the receiver checks, as the process group's mesh does.
//!
//! The driver here numbers rounds as the process group does: arguments checked first, then
//! every round of a call reserved when the call is issued ([`Numbering::AtIssue`]). With
//! [`Numbering::WhenRoundStarts`] (what the process group did before) the simulator finds the
//! ranks disagreeing.

use proptest::prelude::*;

use super::varlen::{self, INLINE_BYTES, SLOT_BYTES};
use super::*;
use crate::sim::{Links, SimRng};

/// One collective as a user calls it, with every rank's arguments.
#[derive(Debug, Clone)]
enum Call {
    Barrier,
    /// Variable-size all_gather: `lens[r]` is rank r's block length.
    AllGather {
        lens: Vec<usize>,
    },
    /// All_gather of blocks whose lengths every rank passes.
    AllGatherWithLens {
        lens: Vec<usize>,
    },
    Broadcast {
        root: usize,
        len: usize,
    },
    /// Broadcast of bytes whose length only the root knows.
    BroadcastBytes {
        root: usize,
        len: usize,
    },
    AllReduce {
        op: ReduceOp,
        element: ElementType,
        count: usize,
    },
    Reduce {
        root: usize,
        op: ReduceOp,
        element: ElementType,
        count: usize,
    },
    ReduceScatter {
        op: ReduceOp,
        element: ElementType,
        counts: Vec<usize>,
    },
    /// Variable-size gather: `lens[r]` is rank r's block length; only the root learns them.
    Gather {
        root: usize,
        lens: Vec<usize>,
    },
    /// Variable-size scatter: the root's block for rank r is `lens[r]` bytes.
    Scatter {
        root: usize,
        lens: Vec<usize>,
    },
    /// `lens[a][b]` bytes from rank a to rank b.
    AllToAll {
        lens: Vec<Vec<usize>>,
    },
    MonitoredBarrier,
}

/// When a later round takes its sequence number.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Numbering {
    /// Every round's number reserved when the call is issued (the rule).
    AtIssue,
    /// A later round numbered when it starts (the old, broken way).
    WhenRoundStarts,
}

/// Call `call`'s input on rank `rank`.
fn input(call: usize, rank: usize, len: usize) -> Vec<u8> {
    (0..len)
        .map(|i| (call * 131 + rank * 31 + i * 7 + (i >> 8)) as u8)
        .collect()
}

/// Small integer values (exact in every element type and under every op's order).
fn reduce_input(call: usize, rank: usize, element: ElementType, count: usize) -> Vec<u8> {
    let mut out = Vec::with_capacity(count * element.size());
    for i in 0..count {
        let v = ((call + rank * 3 + i) % 5) as i64 - 2;
        match element {
            ElementType::F32 => out.extend((v as f32).to_le_bytes()),
            ElementType::F64 => out.extend((v as f64).to_le_bytes()),
            ElementType::I32 => out.extend((v as i32).to_le_bytes()),
            ElementType::I64 => out.extend(v.to_le_bytes()),
            ElementType::I16 => out.extend((v as i16).to_le_bytes()),
            ElementType::F16 => out.extend(half::f16::from_f32(v as f32).to_le_bytes()),
            ElementType::BF16 => out.extend(half::bf16::from_f32(v as f32).to_le_bytes()),
            ElementType::U8 | ElementType::I8 | ElementType::Bool => out.push(v as u8),
        }
    }
    out
}

/// What a call returned on a rank.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Output {
    Done,
    Blocks(Vec<Vec<u8>>),
    Bytes(Vec<u8>),
}

/// One round of a call running on one rank.
struct Round {
    seq: u64,
    signature: Signature,
    schedule: Schedule,
    buffer: Vec<u8>,
    step: usize,
    posted: bool,
    /// Receives of the current step taken so far (they are applied in order).
    taken: usize,
    /// What a later round's output needs from an earlier one (a gather root's slots, a
    /// scatter root's own block).
    extra: Vec<u8>,
}

impl Round {
    fn new(seq: u64, signature: Signature, schedule: Schedule, input: &[u8]) -> Round {
        let mut buffer = vec![0u8; schedule.buffer_len()];
        buffer[schedule.input_range()].copy_from_slice(input);
        if let Some((from, to)) = schedule.local_copy() {
            buffer.copy_within(from, to.start);
        }
        Round {
            seq,
            signature,
            schedule,
            buffer,
            step: 0,
            posted: false,
            taken: 0,
            extra: Vec::new(),
        }
    }
}

/// One call in flight on one rank.
struct Running {
    call: usize,
    /// The first of the call's reserved numbers.
    base: u64,
    round: Round,
}

/// Keyed by (sender, receiver, sequence number).
type Mailboxes = Links<(usize, usize, u64), ([u8; SIGNATURE_LEN], Vec<u8>)>;

struct Rank {
    rank: usize,
    next_seq: u64,
    issued: usize,
    running: Vec<Running>,
    outputs: Vec<Option<Output>>,
}

struct Driver<'a> {
    calls: &'a [Call],
    world: usize,
    numbering: Numbering,
}

impl Driver<'_> {
    /// Issues call `i` on `rank`: checks nothing that could fail here (the generated calls
    /// are valid), reserves its numbers, starts its first round.
    fn issue(&self, rank: &mut Rank, i: usize) -> Result<(), String> {
        let r = rank.rank;
        let world = self.world;
        let rounds = match (&self.calls[i], self.numbering) {
            (
                Call::AllGather { .. }
                | Call::BroadcastBytes { .. }
                | Call::Gather { .. }
                | Call::Scatter { .. },
                Numbering::AtIssue,
            ) => varlen::ROUNDS,
            _ => 1,
        };
        let base = rank.next_seq;
        rank.next_seq += rounds;
        let e = |e: CollectiveError| format!("call {i} on rank {r}: {e}");
        let round = match &self.calls[i] {
            Call::Barrier => {
                Round::new(base, Signature::Barrier, barrier(r, world).map_err(e)?, &[])
            }
            Call::AllGather { lens } => {
                let mine = input(i, r, lens[r]);
                let mut slot = [0u8; SLOT_BYTES];
                varlen::write_slot(&mut slot, &mine);
                let slots = vec![SLOT_BYTES; world];
                let schedule =
                    all_gather(r, &slots, AllGatherAlgorithm::select(&slots)).map_err(e)?;
                Round::new(base, Signature::AllGatherLengths, schedule, &slot)
            }
            Call::AllGatherWithLens { lens } => {
                let schedule = all_gather(r, lens, AllGatherAlgorithm::select(lens)).map_err(e)?;
                Round::new(
                    base,
                    Signature::all_gather(lens),
                    schedule,
                    &input(i, r, lens[r]),
                )
            }
            Call::Broadcast { root, len } => {
                let schedule = broadcast(r, world, *root, *len).map_err(e)?;
                let data = if r == *root {
                    input(i, r, *len)
                } else {
                    Vec::new()
                };
                let signature = Signature::Broadcast {
                    root: *root as u32,
                    len: *len as u64,
                };
                Round::new(base, signature, schedule, &data)
            }
            Call::BroadcastBytes { root, len } => {
                let schedule = broadcast(r, world, *root, SLOT_BYTES).map_err(e)?;
                let mut slot = [0u8; SLOT_BYTES];
                if r == *root {
                    varlen::write_slot(&mut slot, &input(i, r, *len));
                }
                let data: &[u8] = if r == *root { &slot } else { &[] };
                let signature = Signature::BroadcastLength { root: *root as u32 };
                Round::new(base, signature, schedule, data)
            }
            Call::AllReduce { op, element, count } => {
                let algorithm = AllReduceAlgorithm::select(world, *count, *element);
                let schedule = all_reduce(r, world, *count, *element, *op, algorithm).map_err(e)?;
                let signature = Signature::AllReduce {
                    op: *op,
                    element: *element,
                    count: *count as u64,
                };
                Round::new(
                    base,
                    signature,
                    schedule,
                    &reduce_input(i, r, *element, *count),
                )
            }
            _ => self.issue_more(r, i, base)?,
        };
        rank.running.push(Running {
            call: i,
            base,
            round,
        });
        Ok(())
    }

    /// The first round of the calls added for issue 20.
    fn issue_more(&self, r: usize, i: usize, base: u64) -> Result<Round, String> {
        let world = self.world;
        let e = |e: CollectiveError| format!("call {i} on rank {r}: {e}");
        Ok(match &self.calls[i] {
            Call::Reduce {
                root,
                op,
                element,
                count,
            } => {
                let schedule = reduce(r, world, *root, *count, *element, *op).map_err(e)?;
                let signature = Signature::Reduce {
                    op: *op,
                    element: *element,
                    root: *root as u32,
                    count: *count as u64,
                };
                Round::new(
                    base,
                    signature,
                    schedule,
                    &reduce_input(i, r, *element, *count),
                )
            }
            Call::ReduceScatter {
                op,
                element,
                counts,
            } => {
                let schedule = reduce_scatter(r, counts, *element, *op).map_err(e)?;
                let signature = Signature::reduce_scatter(*op, *element, counts);
                let total = counts.iter().sum();
                Round::new(
                    base,
                    signature,
                    schedule,
                    &reduce_input(i, r, *element, total),
                )
            }
            Call::Gather { root, .. } => {
                let schedule = gather(r, *root, &vec![SLOT_BYTES; world]).map_err(e)?;
                let mut slot = [0u8; SLOT_BYTES];
                varlen::write_slot(&mut slot, &self.gather_block(i, r));
                let signature = Signature::GatherLengths { root: *root as u32 };
                Round::new(base, signature, schedule, &slot)
            }
            Call::Scatter { root, lens } => {
                let schedule = scatter(r, *root, &vec![SLOT_BYTES; world]).map_err(e)?;
                let mut slots = Vec::new();
                if r == *root {
                    for (to, len) in lens.iter().enumerate() {
                        let mut slot = [0u8; SLOT_BYTES];
                        varlen::write_slot(&mut slot, &input(i, 100 + to, *len));
                        slots.extend(slot);
                    }
                }
                let signature = Signature::ScatterLengths { root: *root as u32 };
                Round::new(base, signature, schedule, &slots)
            }
            Call::AllToAll { lens } => {
                let send: Vec<usize> = (0..world).map(|p| lens[r][p]).collect();
                let recv: Vec<usize> = (0..world).map(|p| lens[p][r]).collect();
                let schedule = all_to_all(r, &send, &recv).map_err(e)?;
                let data: Vec<u8> = (0..world)
                    .flat_map(|p| input(i, r * 64 + p, lens[r][p]))
                    .collect();
                Round::new(base, Signature::AllToAll, schedule, &data)
            }
            Call::MonitoredBarrier => Round::new(
                base,
                Signature::MonitoredBarrier,
                monitored_barrier(r, world).map_err(e)?,
                &[],
            ),
            _ => return Err(format!("call {i} is not one of issue 20's")),
        })
    }

    /// The root's blocks of gather call `i`: inline ones from the slots, its own from its
    /// input, large ones from `data` in rank order.
    fn assemble_gather(&self, i: usize, root: usize, slots: &[u8], data: &[u8]) -> Vec<Vec<u8>> {
        let mut offset = 0;
        slots
            .chunks_exact(SLOT_BYTES)
            .enumerate()
            .map(|(p, slot)| {
                let slot: &[u8; SLOT_BYTES] = slot.try_into().expect("slot-sized");
                let len = varlen::slot_len(slot) as usize;
                if p == root {
                    self.gather_block(i, p)
                } else if let Some(range) = varlen::inline_range(len as u64) {
                    slot[range].to_vec()
                } else {
                    offset += len;
                    data[offset - len..offset].to_vec()
                }
            })
            .collect()
    }

    /// Rank `r`'s block of gather call `i`.
    fn gather_block(&self, i: usize, r: usize) -> Vec<u8> {
        match &self.calls[i] {
            Call::Gather { lens, .. } => input(i, r, lens[r]),
            _ => Vec::new(),
        }
    }

    /// A round ended: the call's output, or its next round.
    fn round_done(&self, rank: &mut Rank, mut run: Running) -> Result<(), String> {
        let r = rank.rank;
        let world = self.world;
        let i = run.call;
        let second_seq = |rank: &mut Rank| match self.numbering {
            Numbering::AtIssue => run.base + 1,
            Numbering::WhenRoundStarts => {
                rank.next_seq += 1;
                rank.next_seq - 1
            }
        };
        let output = match (&self.calls[i], run.round.signature) {
            (Call::AllGather { .. }, Signature::AllGatherLengths) => {
                let slots: Vec<&[u8; SLOT_BYTES]> = run
                    .round
                    .buffer
                    .chunks_exact(SLOT_BYTES)
                    .map(|c| c.try_into().expect("slot-sized"))
                    .collect();
                let lens: Vec<usize> = slots.iter().map(|s| varlen::slot_len(s) as usize).collect();
                if lens.iter().all(|l| *l <= INLINE_BYTES) {
                    Output::Blocks(
                        slots
                            .iter()
                            .zip(&lens)
                            .map(|(s, l)| {
                                s[varlen::inline_range(*l as u64).expect("inline")].to_vec()
                            })
                            .collect(),
                    )
                } else {
                    let schedule = all_gather(r, &lens, AllGatherAlgorithm::select(&lens))
                        .map_err(|e| e.to_string())?;
                    let seq = second_seq(rank);
                    run.round = Round::new(
                        seq,
                        Signature::all_gather(&lens),
                        schedule,
                        &input(i, r, lens[r]),
                    );
                    rank.running.push(run);
                    return Ok(());
                }
            }
            (Call::BroadcastBytes { root, .. }, Signature::BroadcastLength { .. }) => {
                let slot: &[u8; SLOT_BYTES] = run.round.buffer[..].try_into().expect("slot-sized");
                let len = varlen::slot_len(slot);
                match varlen::inline_range(len) {
                    Some(range) => Output::Bytes(slot[range].to_vec()),
                    None => {
                        let schedule =
                            broadcast(r, world, *root, len as usize).map_err(|e| e.to_string())?;
                        let data = if r == *root {
                            input(i, r, len as usize)
                        } else {
                            Vec::new()
                        };
                        let seq = second_seq(rank);
                        let signature = Signature::Broadcast {
                            root: *root as u32,
                            len,
                        };
                        run.round = Round::new(seq, signature, schedule, &data);
                        rank.running.push(run);
                        return Ok(());
                    }
                }
            }
            (Call::Gather { root, .. }, Signature::GatherLengths { .. }) => {
                let large = |len: usize| if len > INLINE_BYTES { len } else { 0 };
                let mut lens = vec![0; world];
                let mut slots = Vec::new();
                if r == *root {
                    slots = run.round.buffer.clone();
                    for (p, slot) in slots.chunks_exact(SLOT_BYTES).enumerate() {
                        let slot: &[u8; SLOT_BYTES] = slot.try_into().expect("slot-sized");
                        if p != r {
                            lens[p] = large(varlen::slot_len(slot) as usize);
                        }
                    }
                } else {
                    lens[r] = large(self.gather_block(i, r).len());
                }
                if lens.iter().all(|l| *l == 0) {
                    if r != *root {
                        Output::Done
                    } else {
                        Output::Blocks(self.assemble_gather(i, *root, &slots, &[]))
                    }
                } else {
                    let schedule = gather(r, *root, &lens).map_err(|e| e.to_string())?;
                    let data = if r == *root {
                        Vec::new()
                    } else {
                        self.gather_block(i, r)
                    };
                    let seq = second_seq(rank);
                    run.round = Round::new(
                        seq,
                        Signature::Gather { root: *root as u32 },
                        schedule,
                        &data,
                    );
                    // Keep the slots for the root's answer beside the data.
                    run.round.extra = slots;
                    rank.running.push(run);
                    return Ok(());
                }
            }
            (Call::Gather { root, .. }, Signature::Gather { .. }) => {
                if r == *root {
                    let slots = std::mem::take(&mut run.round.extra);
                    Output::Blocks(self.assemble_gather(i, *root, &slots, &run.round.buffer))
                } else {
                    Output::Done
                }
            }
            (Call::Scatter { root, lens }, Signature::ScatterLengths { .. }) => {
                let mine = if r == *root {
                    Some(input(i, 100 + r, lens[r]))
                } else {
                    let slot: &[u8; SLOT_BYTES] =
                        run.round.buffer[..].try_into().expect("slot-sized");
                    varlen::inline_range(varlen::slot_len(slot)).map(|range| slot[range].to_vec())
                };
                let large: Vec<usize> = (0..world)
                    .map(|p| {
                        if p != *root && lens[p] > INLINE_BYTES {
                            lens[p]
                        } else {
                            0
                        }
                    })
                    .collect();
                let needed = if r == *root {
                    large.iter().any(|l| *l > 0)
                } else {
                    mine.is_none()
                };
                match (mine, needed) {
                    (Some(mine), false) => Output::Bytes(mine),
                    (mine, _) => {
                        // Only the root reads other ranks' lengths.
                        let view: Vec<usize> = if r == *root {
                            large.clone()
                        } else {
                            let slot: &[u8; SLOT_BYTES] =
                                run.round.buffer[..].try_into().expect("slot-sized");
                            (0..world)
                                .map(|p| {
                                    if p == r {
                                        varlen::slot_len(slot) as usize
                                    } else {
                                        0
                                    }
                                })
                                .collect()
                        };
                        let schedule = scatter(r, *root, &view).map_err(|e| e.to_string())?;
                        let data: Vec<u8> = if r == *root {
                            (0..world)
                                .filter(|p| large[*p] > 0)
                                .flat_map(|p| input(i, 100 + p, lens[p]))
                                .collect()
                        } else {
                            Vec::new()
                        };
                        let seq = second_seq(rank);
                        run.round = Round::new(
                            seq,
                            Signature::Scatter { root: *root as u32 },
                            schedule,
                            &data,
                        );
                        run.round.extra = mine.unwrap_or_default();
                        rank.running.push(run);
                        return Ok(());
                    }
                }
            }
            (Call::Scatter { root, .. }, Signature::Scatter { .. }) => {
                if r == *root {
                    Output::Bytes(std::mem::take(&mut run.round.extra))
                } else {
                    Output::Bytes(run.round.buffer)
                }
            }
            (Call::Reduce { root, .. }, _) => {
                if r == *root {
                    Output::Bytes(run.round.buffer)
                } else {
                    Output::Done
                }
            }
            (Call::ReduceScatter { .. } | Call::AllToAll { .. }, _) => {
                Output::Bytes(run.round.buffer[run.round.schedule.output_range()].to_vec())
            }
            (Call::MonitoredBarrier, _) => Output::Done,
            (Call::Barrier, _) => Output::Done,
            (Call::AllGather { lens } | Call::AllGatherWithLens { lens }, _) => {
                let mut blocks = Vec::new();
                let mut offset = 0;
                for len in lens {
                    blocks.push(run.round.buffer[offset..offset + len].to_vec());
                    offset += len;
                }
                Output::Blocks(blocks)
            }
            _ => Output::Bytes(run.round.buffer),
        };
        rank.outputs[i] = Some(output);
        Ok(())
    }
}

/// Runs `calls` on `world` ranks, interleaved by `seed`; returns every rank's outputs.
fn run(
    calls: &[Call],
    world: usize,
    seed: u64,
    numbering: Numbering,
) -> Result<Vec<Vec<Output>>, String> {
    let driver = Driver {
        calls,
        world,
        numbering,
    };
    let mut rng = SimRng::new(seed);
    let mut ranks: Vec<Rank> = (0..world)
        .map(|rank| Rank {
            rank,
            next_seq: 0,
            issued: 0,
            running: Vec::new(),
            outputs: vec![None; calls.len()],
        })
        .collect();
    let mut mail: Mailboxes = Links::new();
    loop {
        // Everything that can move: (rank, None) issues the rank's next call, (rank, Some(k))
        // moves its k-th running round.
        let mut movable: Vec<(usize, Option<usize>)> = Vec::new();
        for rank in &ranks {
            if rank.issued < calls.len() {
                movable.push((rank.rank, None));
            }
            for (k, run) in rank.running.iter().enumerate() {
                let round = &run.round;
                let ready = match round.schedule.steps().get(round.step) {
                    None => true,
                    Some(_) if !round.posted => true,
                    Some(step) => step
                        .receives()
                        .get(round.taken)
                        .is_none_or(|recv| mail.is_busy((recv.peer(), rank.rank, round.seq))),
                };
                if ready {
                    movable.push((rank.rank, Some(k)));
                }
            }
        }
        if movable.is_empty() {
            break;
        }
        let (r, which) = movable[rng.below(movable.len())];
        let rank = &mut ranks[r];
        let Some(k) = which else {
            let i = rank.issued;
            rank.issued += 1;
            driver.issue(rank, i)?;
            continue;
        };
        let round = &mut rank.running[k].round;
        let Some(step) = round.schedule.steps().get(round.step) else {
            let run = rank.running.swap_remove(k);
            driver.round_done(rank, run)?;
            continue;
        };
        if !round.posted {
            for send in step.sends() {
                let mut data = Vec::with_capacity(send.len());
                for range in send.ranges() {
                    data.extend_from_slice(&round.buffer[range.clone()]);
                }
                mail.send(
                    (r, send.peer(), round.seq),
                    (round.signature.encode(), data),
                );
            }
            round.posted = true;
        } else if let Some(recv) = step.receives().get(round.taken) {
            let (signature, data) = mail
                .pop((recv.peer(), r, round.seq))
                .ok_or("a movable receive found no message")?;
            if signature != round.signature.encode() {
                return Err(format!(
                    "rank {} ran {:?} as #{}, rank {r} {}",
                    recv.peer(),
                    Signature::decode(&signature),
                    round.seq,
                    round.signature
                ));
            }
            recv.apply(&mut round.buffer, &data)
                .map_err(|e| format!("rank {r} #{}: {e}", round.seq))?;
            round.taken += 1;
        }
        if round.posted && round.taken == step.receives().len() {
            round.step += 1;
            round.posted = false;
            round.taken = 0;
        }
    }
    let mut all = Vec::with_capacity(world);
    for rank in ranks {
        let mut outputs = Vec::with_capacity(calls.len());
        for (i, o) in rank.outputs.into_iter().enumerate() {
            outputs.push(o.ok_or_else(|| {
                format!(
                    "rank {} never finished call {i} ({:?}): deadlock",
                    rank.rank, calls[i]
                )
            })?);
        }
        all.push(outputs);
    }
    if let Some(((from, to, seq), left)) = mail
        .iter()
        .map(|(k, q)| (k, q.count()))
        .find(|(_, left)| *left > 0)
    {
        return Err(format!(
            "{left} message(s) of #{seq} from rank {from} to rank {to} were never taken"
        ));
    }
    Ok(all)
}

/// What every rank must get from call `i`.
fn expected(calls: &[Call], i: usize, world: usize) -> Output {
    match &calls[i] {
        Call::Barrier => Output::Done,
        Call::AllGather { lens } | Call::AllGatherWithLens { lens } => Output::Blocks(
            lens.iter()
                .enumerate()
                .map(|(r, len)| input(i, r, *len))
                .collect(),
        ),
        Call::Broadcast { root, len } | Call::BroadcastBytes { root, len } => {
            Output::Bytes(input(i, *root, *len))
        }
        Call::AllReduce { op, element, count } => {
            let mut acc = reduce_input(i, 0, *element, *count);
            for r in 1..world {
                let incoming = reduce_input(i, r, *element, *count);
                reduce_into(*op, *element, &mut acc, &incoming, false).expect("same lengths");
            }
            Output::Bytes(acc)
        }
        _ => Output::Done,
    }
}

/// What rank `r` must get from call `i` (the same as every rank's, except for the calls of
/// issue 20 whose results differ by rank).
fn expected_on(calls: &[Call], i: usize, world: usize, r: usize) -> Output {
    match &calls[i] {
        Call::Reduce {
            root,
            op,
            element,
            count,
        } => {
            if r != *root {
                return Output::Done;
            }
            let mut acc = reduce_input(i, 0, *element, *count);
            for p in 1..world {
                let incoming = reduce_input(i, p, *element, *count);
                reduce_into(*op, *element, &mut acc, &incoming, false).expect("same lengths");
            }
            Output::Bytes(acc)
        }
        Call::ReduceScatter {
            op,
            element,
            counts,
        } => {
            let total = counts.iter().sum();
            let mut acc = reduce_input(i, 0, *element, total);
            for p in 1..world {
                let incoming = reduce_input(i, p, *element, total);
                reduce_into(*op, *element, &mut acc, &incoming, false).expect("same lengths");
            }
            let start: usize = counts[..r].iter().sum();
            let size = element.size();
            Output::Bytes(acc[start * size..(start + counts[r]) * size].to_vec())
        }
        Call::Gather { root, lens } => {
            if r == *root {
                Output::Blocks(
                    lens.iter()
                        .enumerate()
                        .map(|(p, len)| input(i, p, *len))
                        .collect(),
                )
            } else {
                Output::Done
            }
        }
        Call::Scatter { lens, .. } => Output::Bytes(input(i, 100 + r, lens[r])),
        Call::AllToAll { lens } => Output::Bytes(
            (0..world)
                .flat_map(|p| input(i, p * 64 + r, lens[p][r]))
                .collect(),
        ),
        Call::MonitoredBarrier => Output::Done,
        _ => expected(calls, i, world),
    }
}

fn check(calls: &[Call], world: usize, seed: u64) -> Result<(), String> {
    let outputs = run(calls, world, seed, Numbering::AtIssue)?;
    for (r, outputs) in outputs.iter().enumerate() {
        for (i, got) in outputs.iter().enumerate() {
            if *got != expected_on(calls, i, world, r) {
                return Err(format!(
                    "world {world} seed {seed}: rank {r} got a wrong result for call {i} ({:?})",
                    calls[i]
                ));
            }
        }
    }
    Ok(())
}

fn any_call(world: usize) -> impl Strategy<Value = Call> {
    // Block lengths: empty, inline, just over the inline limit, and (rarely) large enough for
    // the ring.
    let len = prop_oneof![
        4 => Just(0usize),
        8 => 1..=INLINE_BYTES,
        6 => INLINE_BYTES + 1..200,
        1 => Just(6000usize),
    ];
    let lens = proptest::collection::vec(len.clone(), world);
    let pair_lens = proptest::collection::vec(proptest::collection::vec(0usize..80, world), world);
    let counts = proptest::collection::vec(0usize..6, world);
    let count = prop_oneof![
        2 => Just(0usize),
        30 => 1usize..40,
        1 => Just(70_000usize),
    ];
    prop_oneof![
        Just(Call::Barrier),
        lens.clone().prop_map(|lens| Call::AllGather { lens }),
        lens.clone()
            .prop_map(|lens| Call::AllGatherWithLens { lens }),
        (0..world, len.clone()).prop_map(|(root, len)| Call::Broadcast { root, len }),
        (0..world, len).prop_map(|(root, len)| Call::BroadcastBytes { root, len }),
        (proptest::sample::select(supported_pairs()), count)
            .prop_map(|((op, element), count)| Call::AllReduce { op, element, count }),
        (
            0..world,
            proptest::sample::select(supported_pairs()),
            0usize..20
        )
            .prop_map(|(root, (op, element), count)| Call::Reduce {
                root,
                op,
                element,
                count
            }),
        (proptest::sample::select(supported_pairs()), counts).prop_map(
            |((op, element), counts)| Call::ReduceScatter {
                op,
                element,
                counts
            }
        ),
        (0..world, lens.clone()).prop_map(|(root, lens)| Call::Gather { root, lens }),
        (0..world, lens).prop_map(|(root, lens)| Call::Scatter { root, lens }),
        pair_lens.prop_map(|lens| Call::AllToAll { lens }),
        Just(Call::MonitoredBarrier),
    ]
}

/// Every (op, element type) pair gloo supports.
fn supported_pairs() -> Vec<(ReduceOp, ElementType)> {
    ReduceOp::ALL
        .iter()
        .flat_map(|o| ElementType::ALL.iter().map(move |e| (*o, *e)))
        .filter(|(o, e)| o.supports(*e))
        .collect()
}

fn world_and_calls() -> impl Strategy<Value = (usize, Vec<Call>, u64)> {
    (1usize..=16).prop_flat_map(|world| {
        (
            Just(world),
            proptest::collection::vec(any_call(world), 1..14),
            any::<u64>(),
        )
    })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    /// Random mixes of every collective, all in flight together, interleaved at random,
    /// world sizes 1 to 16: every rank gets every call's right result.
    #[test]
    fn concurrent_collectives_issued_in_the_same_order_all_agree(
        (world, calls, seed) in world_and_calls()
    ) {
        if let Err(e) = check(&calls, world, seed) {
            return Err(TestCaseError::fail(e));
        }
    }
}

#[test]
fn every_collective_at_every_world_size_in_one_concurrent_mix() {
    for world in 1..=16 {
        let lens: Vec<usize> = (0..world).map(|r| [0, 5, 56, 57, 300][r % 5]).collect();
        let mut calls = vec![
            Call::Barrier,
            Call::AllGather {
                lens: vec![8; world],
            },
            Call::AllGather { lens: lens.clone() },
            Call::AllGatherWithLens { lens: lens.clone() },
            Call::Broadcast {
                root: world - 1,
                len: 100,
            },
            Call::BroadcastBytes {
                root: world / 2,
                len: 10,
            },
            Call::BroadcastBytes { root: 0, len: 1000 },
        ];
        // A third of the (op, type) pairs per world size: every pair within three sizes.
        let pairs = supported_pairs();
        for (op, element) in pairs.into_iter().skip(world % 3).step_by(3) {
            calls.push(Call::AllReduce {
                op,
                element,
                count: 1 + world,
            });
        }
        calls.extend([
            Call::Reduce {
                root: world / 2,
                op: ReduceOp::Avg,
                element: ElementType::BF16,
                count: 3,
            },
            Call::ReduceScatter {
                op: ReduceOp::BXor,
                element: ElementType::U8,
                counts: (0..world).map(|r| r % 3).collect(),
            },
            Call::Gather {
                root: world - 1,
                lens: lens.clone(),
            },
            Call::Scatter {
                root: 0,
                lens: lens.clone(),
            },
            Call::AllToAll {
                lens: (0..world)
                    .map(|a| (0..world).map(|b| (a * 7 + b * 3) % 70).collect())
                    .collect(),
            },
            Call::MonitoredBarrier,
        ]);
        for seed in 0..8 {
            check(&calls, world, seed).unwrap_or_else(|e| panic!("{e}"));
        }
    }
}

/// The simulator catches what the process group did before: numbering a second round when it
/// starts lets ranks exchange rounds of different calls.
#[test]
fn numbering_second_rounds_when_they_start_is_caught() {
    let world = 4;
    let calls: Vec<Call> = (0..12)
        .map(|i| Call::AllGather {
            lens: vec![64 + i; world],
        })
        .collect();
    let failures = (0..64)
        .filter(
            |seed| match run(&calls, world, *seed, Numbering::WhenRoundStarts) {
                Err(_) => true,
                Ok(outputs) => outputs
                    .iter()
                    .flatten()
                    .enumerate()
                    .any(|(k, got)| *got != expected(&calls, k % calls.len(), world)),
            },
        )
        .count();
    assert!(failures > 0, "no interleaving of 64 showed the old bug");
    for seed in 0..64 {
        check(&calls, world, seed).unwrap_or_else(|e| panic!("{e}"));
    }
}
