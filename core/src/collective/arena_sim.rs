//! The arena simulation: every rank runs its plans through [`ArenaState`] (as the arena's
//! executor does) over a simulated segment, one atomic action at a time, the next rank picked
//! by a seeded generator. Each half of each slot carries the phase it was last written in, and
//! a read checks that it finds the phase it belongs to: a read of a half not yet written, or
//! already overwritten, fails the run; so does a deadlock (nobody can move, somebody is not
//! done). Results are checked against a reference computed directly.

use super::arena::{self, reached, ArenaPlan, ArenaState};
use super::{fold_in_order, reduce_into, ElementType, ReduceOp};
use crate::sim::SimRng;

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Pc {
    Start,
    FreeWait(usize),
    Write,
    Post,
    Wait(usize),
    Read(usize),
}

struct Rank {
    plans: Vec<ArenaPlan>,
    buffers: Vec<Vec<u8>>,
    plan: usize,
    phase: usize,
    pc: Pc,
    state: ArenaState,
    free: Vec<(usize, u32)>,
}

struct Memory {
    data: Vec<[Vec<u8>; 2]>,
    tags: Vec<[Option<u64>; 2]>,
    counters: Vec<u32>,
}

/// Runs, for every rank, its plans in order (`plans[r]`, with `inputs[r][i]` the input of plan
/// i); returns every rank's output of every plan.
fn run(
    plans: Vec<Vec<ArenaPlan>>,
    inputs: Vec<Vec<Vec<u8>>>,
    seed: u64,
) -> Result<Vec<Vec<Vec<u8>>>, String> {
    match simulate(plans, inputs, seed, None)? {
        Outcome::Finished(outputs) => Ok(outputs),
        Outcome::Stuck { .. } => unreachable!("no rank stops"),
    }
}

/// How a simulation ended.
enum Outcome {
    /// Every rank ran every plan: their outputs.
    Finished(Vec<Vec<Vec<u8>>>),
    /// The stopped rank left the others stuck: every counter, and each rank still running
    /// with the wait it is blocked in (rank, counter value), as the executor would pass it to
    /// [`ArenaWait`](super::arena_wait::ArenaWait).
    Stuck {
        counters: Vec<u32>,
        blocked: Vec<(usize, Vec<(usize, u32)>)>,
    },
}

/// As [`run`]; with `stop` = (rank, actions), that rank stops for good after that many atomic
/// actions (a process stopped or killed mid-collective).
fn simulate(
    plans: Vec<Vec<ArenaPlan>>,
    inputs: Vec<Vec<Vec<u8>>>,
    seed: u64,
    stop: Option<(usize, usize)>,
) -> Result<Outcome, String> {
    let world = plans.len();
    let slot = plans[0][0].slot_bytes();
    for i in 0..plans[0].len() {
        let phases = plans[0][i].phases().len();
        for (r, rank) in plans.iter().enumerate() {
            if rank[i].phases().len() != phases {
                return Err(format!(
                    "plan {i}: rank {r} has a different number of phases"
                ));
            }
        }
        check_structure(&plans.iter().map(|p| &p[i]).collect::<Vec<_>>())
            .map_err(|e| format!("plan {i}: {e}"))?;
    }
    let mut mem = Memory {
        data: (0..world)
            .map(|_| [vec![0u8; slot], vec![0u8; slot]])
            .collect(),
        tags: vec![[None, None]; world],
        counters: vec![0; world],
    };
    let mut ranks: Vec<Rank> = plans
        .into_iter()
        .zip(inputs)
        .map(|(plans, inputs)| {
            let buffers = plans
                .iter()
                .zip(inputs)
                .map(|(p, input)| {
                    // A plan that fills its buffer may be run over one never cleared: here
                    // it gets garbage, which must not show in any result.
                    let garbage = if p.fills_buffer() { 0xa5 } else { 0 };
                    let mut b = vec![garbage; p.buffer_len()];
                    b[p.input_range()].copy_from_slice(&input);
                    if let Some((from, to)) = p.local_copy() {
                        b.copy_within(from, to.start);
                    }
                    b
                })
                .collect();
            Rank {
                plans,
                buffers,
                plan: 0,
                phase: 0,
                pc: Pc::Start,
                state: ArenaState::new(),
                free: Vec::new(),
            }
        })
        .collect();
    let mut rng = SimRng::new(seed);
    let mut actions = vec![0usize; world];
    loop {
        let live: Vec<usize> = (0..world)
            .filter(|r| ranks[*r].plan < ranks[*r].plans.len())
            .filter(|r| stop.is_none_or(|(s, n)| *r != s || actions[s] < n))
            .collect();
        if live.is_empty() && stop.is_none() {
            break;
        }
        // Try ranks from a random start until one moves.
        let start = rng.below(live.len().max(1));
        let mut moved = false;
        for k in 0..live.len() {
            let r = live[(start + k) % live.len()];
            if step(r, &mut ranks[r], &mut mem)? {
                actions[r] += 1;
                moved = true;
                break;
            }
        }
        if !moved && stop.is_some() {
            let blocked = live
                .iter()
                .filter(|r| stop.is_none_or(|(s, _)| **r != s))
                .map(|r| (*r, blocked_on(&ranks[*r])))
                .collect();
            return Ok(Outcome::Stuck {
                counters: mem.counters,
                blocked,
            });
        }
        if !moved {
            let blocked: Vec<String> = live
                .iter()
                .map(|r| format!("rank {r} at {:?} of plan {}", ranks[*r].pc, ranks[*r].plan))
                .collect();
            return Err(format!("deadlock: {}", blocked.join(", ")));
        }
    }
    Ok(Outcome::Finished(
        ranks
            .into_iter()
            .map(|r| {
                r.plans
                    .iter()
                    .zip(r.buffers)
                    .map(|(p, b)| b[p.output_range()].to_vec())
                    .collect()
            })
            .collect(),
    ))
}

/// The wait a blocked rank is in: before writing (its readers), or after publishing.
fn blocked_on(rank: &Rank) -> Vec<(usize, u32)> {
    match rank.pc {
        Pc::FreeWait(_) => rank.free.clone(),
        Pc::Wait(_) => rank
            .state
            .phase_waits(&rank.plans[rank.plan].phases()[rank.phase]),
        pc => unreachable!("rank blocked at {pc:?}"),
    }
}

/// Checks that each rank's `readers` are exactly the ranks that read its slot in the phase,
/// that every read of another rank's slot is waited for, and that reads and writes fit.
fn check_structure(plans: &[&ArenaPlan]) -> Result<(), String> {
    let world = plans.len();
    let slot = plans[0].slot_bytes();
    for k in 0..plans[0].phases().len() {
        for (r, plan) in plans.iter().enumerate() {
            let phase = &plan.phases()[k];
            let mut readers: Vec<usize> = (0..world)
                .filter(|q| *q != r)
                .filter(|q| {
                    let theirs = &plans[*q].phases()[k];
                    theirs.reads.iter().any(|x| x.peer == r)
                        || theirs.folds.iter().any(|f| f.order.contains(&r))
                })
                .collect();
            readers.sort_unstable();
            let mut told = phase.readers.clone();
            told.sort_unstable();
            if readers != told {
                return Err(format!(
                    "phase {k}: rank {r} names readers {told:?}, but {readers:?} read its slot"
                ));
            }
            for read in &phase.reads {
                if read.peer != r && !phase.waits_on.contains(&read.peer) {
                    return Err(format!(
                        "phase {k}: rank {r} reads rank {}'s slot without waiting",
                        read.peer
                    ));
                }
                if read.from + read.to.len() > slot || read.to.end > plan.buffer_len() {
                    return Err(format!("phase {k}: rank {r}: a read out of bounds"));
                }
            }
            for fold in &phase.folds {
                if let Some(q) = fold
                    .order
                    .iter()
                    .find(|q| **q != r && !phase.waits_on.contains(q))
                {
                    return Err(format!(
                        "phase {k}: rank {r} folds rank {q}'s slot without waiting"
                    ));
                }
                if fold.from + fold.to.len() > slot
                    || fold.to.end > plan.buffer_len()
                    || fold.order.iter().any(|q| *q >= world)
                {
                    return Err(format!("phase {k}: rank {r}: a fold out of bounds"));
                }
            }
            for write in &phase.writes {
                if write.to + write.from.len() > slot || write.from.end > plan.buffer_len() {
                    return Err(format!("phase {k}: rank {r}: a write out of bounds"));
                }
            }
        }
    }
    Ok(())
}

/// One atomic action of rank `r`; `false` when it is blocked.
fn step(r: usize, rank: &mut Rank, mem: &mut Memory) -> Result<bool, String> {
    let plan = &rank.plans[rank.plan];
    let Some(phase) = plan.phases().get(rank.phase) else {
        rank.plan += 1;
        rank.phase = 0;
        rank.pc = Pc::Start;
        return Ok(true);
    };
    let half = rank.state.half();
    match rank.pc {
        Pc::Start => {
            rank.free = if phase.writes.is_empty() {
                Vec::new()
            } else {
                rank.state.free_waits().collect()
            };
            rank.pc = Pc::FreeWait(0);
        }
        Pc::FreeWait(i) => {
            // Skip past every wait already met (one look at each counter).
            let mut i = i;
            while let Some((q, target)) = rank.free.get(i) {
                if !reached(mem.counters[*q], *target) {
                    if Pc::FreeWait(i) == rank.pc {
                        return Ok(false);
                    }
                    break;
                }
                i += 1;
            }
            rank.pc = if i == rank.free.len() {
                Pc::Write
            } else {
                Pc::FreeWait(i)
            };
        }
        Pc::Write => {
            for w in &phase.writes {
                let buffer = &rank.buffers[rank.plan];
                mem.data[r][half][w.to..w.to + w.from.len()]
                    .copy_from_slice(&buffer[w.from.clone()]);
            }
            if !phase.writes.is_empty() {
                mem.tags[r][half] = Some(rank.state.phase());
            }
            rank.pc = Pc::Post;
        }
        Pc::Post => {
            mem.counters[r] = rank.state.posted(!phase.writes.is_empty(), &phase.readers);
            rank.pc = Pc::Wait(0);
        }
        Pc::Wait(i) => {
            let waits = rank.state.phase_waits(phase);
            let mut i = i;
            while let Some((q, target)) = waits.get(i) {
                if !reached(mem.counters[*q], *target) {
                    if Pc::Wait(i) == rank.pc {
                        return Ok(false);
                    }
                    break;
                }
                i += 1;
            }
            rank.pc = if i == waits.len() {
                Pc::Read(0)
            } else {
                Pc::Wait(i)
            };
        }
        Pc::Read(i) => {
            // The phase this rank published last is the one being read.
            let g = rank.state.phase() - 1;
            let h = (g % 2) as usize;
            let Some(read) = phase.reads.get(i) else {
                let Some(fold) = phase.folds.get(i - phase.reads.len()) else {
                    rank.phase += 1;
                    rank.pc = Pc::Start;
                    return Ok(true);
                };
                let mut operands = Vec::new();
                for &q in &fold.order {
                    if q == r {
                        operands.push(None);
                        continue;
                    }
                    if mem.tags[q][h] != Some(g) {
                        return Err(format!(
                            "rank {r} folded rank {q}'s half {h} in phase {g}, which holds phase {:?}",
                            mem.tags[q][h]
                        ));
                    }
                    operands.push(Some(&mem.data[q][h][fold.from..fold.from + fold.to.len()]));
                }
                let (element, op) = plan.reduction().ok_or("a fold without a reduction")?;
                let dst = &mut rank.buffers[rank.plan][fold.to.clone()];
                fold_in_order(op, element, dst, operands).map_err(|e| e.to_string())?;
                rank.pc = Pc::Read(i + 1);
                return Ok(true);
            };
            if mem.tags[read.peer][h] != Some(g) {
                return Err(format!(
                    "rank {r} read rank {}'s half {h} in phase {g}, which holds phase {:?}",
                    read.peer, mem.tags[read.peer][h]
                ));
            }
            let incoming = mem.data[read.peer][h][read.from..read.from + read.to.len()].to_vec();
            let buffer = &mut rank.buffers[rank.plan];
            let dst = &mut buffer[read.to.clone()];
            if read.reduce {
                let (element, op) = plan
                    .reduction()
                    .ok_or("a reducing read without a reduction")?;
                reduce_into(op, element, dst, &incoming, false).map_err(|e| e.to_string())?;
            } else {
                dst.copy_from_slice(&incoming);
            }
            rank.pc = Pc::Read(i + 1);
        }
    }
    Ok(true)
}

fn bytes(rng: &mut SimRng, len: usize) -> Vec<u8> {
    let mut out = Vec::with_capacity(len + 8);
    while out.len() < len {
        out.extend_from_slice(&rng.next_u64().to_le_bytes());
    }
    out.truncate(len);
    out
}

/// Float bytes that sum without NaN or infinity (small integers in f32).
fn floats(rng: &mut SimRng, count: usize) -> Vec<u8> {
    (0..count)
        .flat_map(|_| ((rng.below(2001) as f32 - 1000.0) / 7.0).to_le_bytes())
        .collect()
}

fn fold(element: ElementType, op: ReduceOp, inputs: &[Vec<u8>]) -> Vec<u8> {
    let mut acc = inputs[0].clone();
    for x in &inputs[1..] {
        reduce_into(op, element, &mut acc, x, false).unwrap();
    }
    acc
}

/// The collectives of one run: plans for every rank, inputs, expected outputs.
struct Case {
    plans: Vec<Vec<ArenaPlan>>,
    inputs: Vec<Vec<Vec<u8>>>,
    expected: Vec<Vec<Vec<u8>>>,
    names: Vec<String>,
}

impl Case {
    fn new(world: usize) -> Self {
        Case {
            plans: vec![Vec::new(); world],
            inputs: vec![Vec::new(); world],
            expected: vec![Vec::new(); world],
            names: Vec::new(),
        }
    }

    fn push(
        &mut self,
        name: String,
        plan: impl Fn(usize) -> ArenaPlan,
        inputs: Vec<Vec<u8>>,
        expected: Vec<Vec<u8>>,
    ) {
        for r in 0..self.plans.len() {
            self.plans[r].push(plan(r));
        }
        for (r, i) in inputs.into_iter().enumerate() {
            self.inputs[r].push(i);
        }
        for (r, e) in expected.into_iter().enumerate() {
            self.expected[r].push(e);
        }
        self.names.push(name);
    }
}

/// Every collective, back to back on one arena, for `world` ranks with slots of `slot` bytes,
/// with sizes that take one phase, several, or none.
fn case(world: usize, slot: usize, rng: &mut SimRng) -> Case {
    let mut c = Case::new(world);
    let n = world;
    c.push(
        "barrier".into(),
        |r| arena::barrier(r, n, slot).unwrap(),
        vec![Vec::new(); n],
        vec![Vec::new(); n],
    );
    for len in [0, 5, slot + 3 * 64 + 1] {
        let root = rng.below(n);
        let data = bytes(rng, len);
        let inputs = (0..n)
            .map(|r| if r == root { data.clone() } else { Vec::new() })
            .collect();
        c.push(
            format!("broadcast {len} from {root}"),
            |r| arena::broadcast(r, n, root, len, slot).unwrap(),
            inputs,
            vec![data; n],
        );
    }
    for max in [0, 40, slot * 2 + 7] {
        let lens: Vec<usize> = (0..n).map(|_| rng.below(max + 1)).collect();
        let blocks: Vec<Vec<u8>> = lens.iter().map(|l| bytes(rng, *l)).collect();
        let all: Vec<u8> = blocks.concat();
        c.push(
            format!("all_gather {lens:?}"),
            |r| arena::all_gather(r, &lens, slot).unwrap(),
            blocks.clone(),
            vec![all.clone(); n],
        );
        let root = rng.below(n);
        let expected = (0..n)
            .map(|r| {
                if r == root {
                    all.clone()
                } else {
                    blocks[r].clone()
                }
            })
            .collect();
        c.push(
            format!("gather {lens:?} to {root}"),
            |r| arena::gather(r, root, &lens, slot).unwrap(),
            blocks.clone(),
            expected,
        );
        let root = rng.below(n);
        let inputs = (0..n)
            .map(|r| if r == root { all.clone() } else { Vec::new() })
            .collect();
        c.push(
            format!("scatter {lens:?} from {root}"),
            |r| arena::scatter(r, root, &lens, slot).unwrap(),
            inputs,
            blocks.clone(),
        );
    }
    // Reductions: small (one phase), large (shares), chunked; exact integers and floats.
    let large = arena::ARENA_REDUCE_ALL_MAX_BYTES / 4 + 3;
    for (count, element, op) in [
        (0, ElementType::I32, ReduceOp::Sum),
        (3, ElementType::I32, ReduceOp::Sum),
        (n + 5, ElementType::F32, ReduceOp::Sum),
        (large, ElementType::F32, ReduceOp::Sum),
        (large / 2, ElementType::I64, ReduceOp::Max),
        (slot / 2 + 1, ElementType::U8, ReduceOp::BXor),
    ] {
        let inputs: Vec<Vec<u8>> = (0..n)
            .map(|_| {
                if element == ElementType::F32 {
                    floats(rng, count)
                } else {
                    bytes(rng, count * element.size())
                }
            })
            .collect();
        let reduced = fold(element, op, &inputs);
        c.push(
            format!("all_reduce {count} {element:?} {op}"),
            |r| arena::all_reduce(r, n, count, element, op, slot).unwrap(),
            inputs.clone(),
            vec![reduced.clone(); n],
        );
        let root = rng.below(n);
        // Only the root's output is checked: the others' buffers are scratch.
        c.push(
            format!("reduce {count} {element:?} {op} to {root}"),
            |r| arena::reduce(r, n, root, count, element, op, slot).unwrap(),
            inputs,
            (0..n)
                .map(|r| {
                    if r == root {
                        reduced.clone()
                    } else {
                        Vec::new()
                    }
                })
                .collect(),
        );
        let counts: Vec<usize> = (0..n).map(|_| rng.below(count / n + 2)).collect();
        let total: usize = counts.iter().sum();
        let inputs: Vec<Vec<u8>> = (0..n).map(|_| bytes(rng, total * 4)).collect();
        let reduced = fold(ElementType::I32, ReduceOp::Sum, &inputs);
        let mut at = 0;
        let expected = counts
            .iter()
            .map(|c| {
                at += c * 4;
                reduced[at - c * 4..at].to_vec()
            })
            .collect();
        c.push(
            format!("reduce_scatter {counts:?}"),
            |r| arena::reduce_scatter(r, &counts, ElementType::I32, ReduceOp::Sum, slot).unwrap(),
            inputs,
            expected,
        );
    }
    for max in [0, 9, slot / n * 2 + 5] {
        let lens: Vec<Vec<usize>> = (0..n)
            .map(|_| (0..n).map(|_| rng.below(max + 1)).collect())
            .collect();
        let blocks: Vec<Vec<Vec<u8>>> = lens
            .iter()
            .map(|row| row.iter().map(|l| bytes(rng, *l)).collect())
            .collect();
        let inputs = blocks.iter().map(|row| row.concat()).collect();
        let expected = (0..n)
            .map(|d| {
                (0..n)
                    .map(|s| blocks[s][d].clone())
                    .collect::<Vec<_>>()
                    .concat()
            })
            .collect();
        c.push(
            format!("all_to_all max {max}"),
            |r| arena::all_to_all(r, &lens, slot).unwrap(),
            inputs,
            expected,
        );
    }
    c
}

fn check_case(world: usize, slot: usize, seed: u64) {
    let mut rng = SimRng::new(seed ^ (world as u64) << 32);
    let c = case(world, slot, &mut rng);
    let outputs = run(c.plans.clone(), c.inputs.clone(), seed).unwrap_or_else(|e| {
        panic!("world {world}, slot {slot}, seed {seed} (replay with TW_SIM_SEED={seed}): {e}")
    });
    for (r, (got, expected)) in outputs.iter().zip(&c.expected).enumerate() {
        for (i, name) in c.names.iter().enumerate() {
            let expected = &expected[i];
            if name.starts_with("reduce ") && expected.is_empty() {
                continue;
            }
            assert_eq!(
                &got[i], expected,
                "world {world}, slot {slot}, seed {seed}: rank {r}'s result of {name}"
            );
        }
    }
}

fn seeds() -> Vec<u64> {
    if let Ok(seed) = std::env::var(crate::sim::SEED_VAR) {
        return vec![seed.parse().expect("TW_SIM_SEED is a number")];
    }
    let n = std::env::var(crate::sim::SEEDS_VAR)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(1);
    (0..n).collect()
}

fn every_collective_through_the_arena(worlds: std::ops::RangeInclusive<usize>) {
    for world in worlds {
        // The smallest slot (one 64-byte piece per rank: everything is chunked) and, up to 16
        // ranks, a roomier one.
        let slots = if world <= 16 {
            vec![64 * world, 64 * world * 3 + 1024]
        } else {
            vec![64 * world]
        };
        for slot in slots {
            for seed in seeds() {
                check_case(world, slot, seed);
            }
        }
    }
}

#[test]
fn every_collective_through_the_arena_for_world_sizes_1_to_16() {
    every_collective_through_the_arena(1..=16);
}

#[test]
fn every_collective_through_the_arena_for_world_sizes_17_to_32() {
    every_collective_through_the_arena(17..=32);
}

#[test]
fn every_collective_through_the_arena_for_world_sizes_33_to_48() {
    every_collective_through_the_arena(33..=48);
}

#[test]
fn every_collective_through_the_arena_for_world_sizes_49_to_64() {
    every_collective_through_the_arena(49..=64);
}

#[test]
fn a_plan_that_forgets_a_wait_is_caught() {
    let world = 4;
    let slot = 64 * world;
    let lens = vec![100; world];
    let mut plans: Vec<Vec<ArenaPlan>> = (0..world)
        .map(|r| vec![arena::all_gather(r, &lens, slot).unwrap()])
        .collect();
    // Rank 1 no longer waits for rank 2 (but still reads its slot): the structure check says so.
    for phase in plans[1][0].phases_mut() {
        phase.waits_on.retain(|q| *q != 2);
    }
    let inputs = (0..world).map(|_| vec![vec![1u8; 100]]).collect();
    let err = run(plans, inputs, 0).unwrap_err();
    assert!(err.contains("without waiting"), "{err}");
}

#[test]
fn a_writer_that_does_not_wait_for_its_readers_is_caught() {
    // Rank 0 broadcasts 3 slots' worth; if rank 0 forgot who read its slot, it would overwrite
    // a half before a slow reader copied it: some interleaving shows the overwrite.
    let world = 3;
    let slot = 64 * world;
    let len = slot * 5;
    let mut failures = 0;
    for seed in 0..50 {
        let mut plans: Vec<Vec<ArenaPlan>> = (0..world)
            .map(|r| vec![arena::broadcast(r, world, 0, len, slot).unwrap()])
            .collect();
        for phase in plans[0][0].phases_mut() {
            phase.readers.clear();
        }
        let inputs = (0..world)
            .map(|r| vec![if r == 0 { vec![7u8; len] } else { Vec::new() }])
            .collect();
        if let Err(e) = run(plans, inputs, seed) {
            assert!(
                e.contains("names readers") || e.contains("holds phase"),
                "{e}"
            );
            failures += 1;
        }
    }
    assert_eq!(failures, 50);
}

#[test]
fn which_plans_fill_their_buffer() {
    let slot = 8 * 64;
    for world in [2, 3, 5] {
        for rank in 0..world {
            // Blocks of every size: none, within a slot, over several phases.
            let lens: Vec<usize> = (0..world).map(|q| q * 300).collect();
            let gather = arena::all_gather(rank, &lens, slot).unwrap();
            assert!(gather.fills_buffer(), "all_gather, rank {rank} of {world}");
            assert!(arena::barrier(rank, world, slot).unwrap().fills_buffer());
            let root = arena::gather(rank, 0, &lens, slot).unwrap();
            assert!(root.fills_buffer(), "gather, rank {rank} of {world}");
            let sum = arena::all_reduce(rank, world, 500, ElementType::F32, ReduceOp::Sum, slot);
            assert!(
                sum.unwrap().fills_buffer(),
                "all_reduce reads into its input"
            );
            // Without one of its reads, some bytes stay unwritten.
            let mut broken = gather.clone();
            if let Some(phase) = broken.phases_mut().iter_mut().find(|p| !p.reads.is_empty()) {
                phase.reads.pop();
                assert!(!broken.fills_buffer(), "rank {rank} of {world}");
            }
            // A write of bytes no read has brought yet.
            let mut early = arena::all_gather(rank, &lens, slot).unwrap();
            let last = early.buffer_len();
            early.phases_mut()[0].writes.push(arena::ArenaWrite {
                from: last - 1..last,
                to: 0,
            });
            assert_eq!(
                early.fills_buffer(),
                early.input_range().end == last,
                "rank {rank} of {world}"
            );
        }
    }
}

#[test]
fn what_core_settles_about_a_plan_when_it_makes_it() {
    let mut rng = SimRng::new(7);
    for world in 1..=9 {
        for slot in [64 * world, 64 * world * 3 + 1024] {
            let c = case(world, slot, &mut rng);
            for (r, plans) in c.plans.iter().enumerate() {
                for (plan, name) in plans.iter().zip(&c.names) {
                    let at = format!("{name}, rank {r} of {world}, slot {slot}");
                    assert_eq!(plan.check_reductions(), Ok(()), "{at}");
                    // The barrier only signals; so may a plan of nothing (a broadcast of 0
                    // bytes), never one that copies.
                    let copies = plan.buffer_len() > 0
                        || plan.local_copy().is_some()
                        || plan.phases().len() != 1
                        || plan
                            .phases()
                            .iter()
                            .any(|p| !p.writes.is_empty() || !p.reads.is_empty());
                    assert_eq!(plan.signals_only(), !copies, "{at}");
                    assert!(plan.signals_only() || name != "barrier", "{at}");
                }
            }
        }
    }
    // A plan broken after it was made is looked at again: a reducing read of part of an
    // element, and one without a reduction.
    let mut part = arena::all_reduce(0, 2, 4, ElementType::F32, ReduceOp::Sum, 1024).unwrap();
    let read = part.phases_mut()[0]
        .reads
        .iter_mut()
        .find(|r| r.reduce)
        .unwrap();
    read.to.end -= 1;
    assert!(part.check_reductions().unwrap_err().contains("not whole"));
    let mut stray = arena::all_gather(0, &[8, 8], 1024).unwrap();
    stray.phases_mut()[0].reads[0].reduce = true;
    assert_eq!(
        stray.check_reductions(),
        Err("a reducing read without a reduction".to_owned())
    );
    // And one that signals no more once it copies.
    let mut barrier = arena::barrier(0, 2, 1024).unwrap();
    assert!(barrier.signals_only());
    barrier.phases_mut()[0].reads.push(arena::ArenaRead {
        peer: 1,
        from: 0,
        to: 0..0,
        reduce: false,
    });
    assert!(!barrier.signals_only());
}

#[test]
fn plans_refuse_bad_arguments() {
    use super::CollectiveError;
    assert_eq!(
        arena::barrier(0, 4, 128).unwrap_err(),
        CollectiveError::ArenaTooSmall {
            slot_bytes: 128,
            world: 4
        }
    );
    assert!(matches!(
        arena::broadcast(0, 2, 2, 1, 4096),
        Err(CollectiveError::RootOutOfRange { root: 2, world: 2 })
    ));
    assert!(matches!(
        arena::all_reduce(0, 2, 1, ElementType::F32, ReduceOp::BXor, 4096),
        Err(CollectiveError::UnsupportedReduction { .. })
    ));
    assert_eq!(arena::slot_bytes(1 << 20, 8), 65536);
}

#[test]
fn counters_compare_across_the_wrap() {
    assert!(reached(5, 5));
    assert!(reached(6, 5));
    assert!(!reached(4, 5));
    assert!(reached(1, u32::MAX));
    assert!(!reached(u32::MAX, 1));
}

/// A rank that stops for good at a random point (a process stopped or killed mid-collective)
/// leaves the others stuck, never spinning on a wrong answer: every rank still running is
/// blocked in a wait whose verdict at the deadline is a timeout naming only ranks that are
/// behind what it waits for, the stopped rank is named by at least one of them (whoever waits
/// for it directly), and once it is known dead those name its death instead.
fn a_rank_that_stops_is_named(worlds: impl Iterator<Item = usize>) {
    use super::arena_wait::{ArenaFailure, ArenaWait, Lost, WaitStep};
    use std::time::{Duration, Instant};
    let t0 = Instant::now();
    let timeout = Duration::from_secs(1);
    for world in worlds {
        for seed in seeds() {
            let mut rng = SimRng::new(seed ^ (world as u64) << 32 ^ 0x5709);
            let slot = 64 * world;
            let c = case(world, slot, &mut rng);
            let stopped = rng.below(world);
            let total: usize = c.plans[stopped]
                .iter()
                .map(|p| 6 * p.phases().len() + 1)
                .sum();
            let after = rng.below(total);
            let replay = format!(
                "world {world}, rank {stopped} stopped after {after} actions (TW_SIM_SEED={seed})"
            );
            let outcome = simulate(
                c.plans.clone(),
                c.inputs.clone(),
                seed,
                Some((stopped, after)),
            )
            .unwrap_or_else(|e| panic!("{replay}: {e}"));
            let Outcome::Stuck { counters, blocked } = outcome else {
                panic!("{replay}: finished");
            };
            let mut named_stopped = blocked.is_empty();
            for (r, targets) in blocked {
                let wait = ArenaWait::new(targets, t0 + timeout, timeout);
                let step = wait.step(|q| counters[q], t0 + timeout, |_| None);
                let WaitStep::Failed(ArenaFailure::Timeout { waiting_on, .. }) = step else {
                    panic!("{replay}: rank {r} at the deadline: {step:?}");
                };
                assert!(!waiting_on.is_empty(), "{replay}: rank {r}");
                assert!(
                    !waiting_on.contains(&r),
                    "{replay}: rank {r} waits on itself"
                );
                for q in &waiting_on {
                    assert!(
                        wait.targets()
                            .iter()
                            .any(|(p, t)| p == q && !reached(counters[*q], *t)),
                        "{replay}: rank {r} names rank {q}, which is not behind"
                    );
                }
                if waiting_on.contains(&stopped) {
                    named_stopped = true;
                    // Once its process is known to have ended, the death is named at once.
                    let lost = |q: usize| (q == stopped).then_some(Lost::Died);
                    assert_eq!(
                        wait.step(|q| counters[q], t0, lost),
                        WaitStep::Failed(ArenaFailure::Died { rank: stopped }),
                        "{replay}: rank {r}"
                    );
                }
            }
            assert!(named_stopped, "{replay}: nobody names the stopped rank");
        }
    }
}

#[test]
fn a_rank_that_stops_is_named_for_world_sizes_2_to_16() {
    a_rank_that_stops_is_named(2..=16);
}

#[test]
fn a_rank_that_stops_is_named_for_world_sizes_17_to_64() {
    // Every fifth size and the largest: the rules do not change with the size, the plans'
    // shapes little.
    a_rank_that_stops_is_named((17..=64).step_by(5).chain([64]));
}

#[test]
fn a_rank_absent_from_a_barrier_is_named_by_every_other_rank() {
    use super::arena_wait::{ArenaFailure, ArenaWait, WaitStep};
    use std::time::{Duration, Instant};
    let t0 = Instant::now();
    let timeout = Duration::from_millis(300);
    for world in 2..=64 {
        let slot = 64 * world;
        let absent = world / 2;
        // Everyone runs a barrier, then a second one that `absent` never comes to.
        let plans: Vec<Vec<ArenaPlan>> = (0..world)
            .map(|r| {
                let b = arena::barrier(r, world, slot).unwrap();
                vec![b.clone(), b]
            })
            .collect();
        let inputs = vec![vec![Vec::new(); 2]; world];
        // The absent rank's first barrier: start, free-wait, write, post, wait, read, next.
        let outcome = simulate(plans, inputs, world as u64, Some((absent, 7))).unwrap();
        let Outcome::Stuck { counters, blocked } = outcome else {
            panic!("world {world}: finished");
        };
        assert_eq!(blocked.len(), world - 1, "world {world}");
        for (r, targets) in blocked {
            let wait = ArenaWait::new(targets, t0 + timeout, timeout);
            assert_eq!(
                wait.step(|q| counters[q], t0 + timeout, |_| None),
                WaitStep::Failed(ArenaFailure::Timeout {
                    waiting_on: vec![absent],
                    timeout
                }),
                "world {world}: rank {r}"
            );
        }
    }
}

mod failures {
    //! Barriers that ranks never come to, and the failure an arena keeps.
    use std::time::{Duration, Instant};

    use super::super::arena::{self, ArenaState};
    use super::super::arena_wait::{ArenaFailure, ArenaWait, Lost, WaitStep};

    const T: Duration = Duration::from_secs(2);

    fn alive(_: usize) -> Option<Lost> {
        None
    }

    #[test]
    fn every_rank_waiting_at_a_barrier_names_the_ranks_that_never_came() {
        // Every world size up to 64, with ranks missing in several patterns: each rank that
        // came (published its phase) times out naming exactly the absent ranks.
        let t0 = Instant::now();
        for world in 2..=64usize {
            let patterns: Vec<Vec<usize>> = vec![
                vec![world - 1],
                vec![0],
                (0..world).filter(|q| q % 3 == 1).collect(),
            ];
            for absent in patterns {
                let slot = 64 * world;
                let mut counters = vec![0u32; world];
                let mut waits = Vec::new();
                for r in (0..world).filter(|r| !absent.contains(r)) {
                    let plan = arena::barrier(r, world, slot).unwrap();
                    let mut state = ArenaState::new();
                    let phase = &plan.phases()[0];
                    counters[r] = state.posted(false, &phase.readers);
                    waits.push((r, ArenaWait::new(state.phase_waits(phase), t0 + T, T)));
                }
                for (r, wait) in waits {
                    assert_eq!(
                        wait.step(|q| counters[q], t0 + T, alive),
                        WaitStep::Failed(ArenaFailure::Timeout {
                            waiting_on: absent.clone(),
                            timeout: T
                        }),
                        "world {world}: rank {r}"
                    );
                }
            }
        }
    }

    #[test]
    fn a_failed_arena_keeps_its_first_failure() {
        let mut state = ArenaState::new();
        assert_eq!(state.failure(), None);
        let first = ArenaFailure::Timeout {
            waiting_on: vec![3],
            timeout: T,
        };
        assert_eq!(state.fail(first.clone()), first);
        // A later failure (the next collective's) does not replace it.
        assert_eq!(state.fail(ArenaFailure::Died { rank: 1 }), first);
        assert_eq!(state.failure(), Some(&first));
    }
}
