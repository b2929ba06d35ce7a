//! A deterministic simulator that runs one schedule per rank over in-memory mailboxes.
//!
//! Each ordered pair of ranks is a FIFO mailbox. Sends are posted when a rank starts a step and
//! carry the buffer as it was then; a step completes when all its receives have arrived *and*
//! its peers have consumed all its sends (rendezvous: no buffering is assumed, the strictest
//! model an executor can run under). A pass that makes no progress while some rank is
//! unfinished is a deadlock, reported with the ranks each blocked rank waits on; a message of
//! the wrong length is a mismatch.
//!
//! It also measures the depth of the schedule in message latencies (a message posted at time t
//! to a rank that reached its receive at time u completes at max(t, u) + 1) and tracks, per
//! rank, which ranks' entry into the collective it has heard of (for the barrier's guarantee).

use std::ops::Range;

use super::{Apply, Schedule, Step};
use crate::sim::Links;

/// What every rank ended with.
#[derive(Debug)]
pub(super) struct Outcome {
    /// Each rank's buffer at the end.
    pub(super) buffers: Vec<Vec<u8>>,
    /// The length of the longest chain of messages, in message latencies.
    pub(super) depth: usize,
    /// Bit i of `heard[r]` is set when rank r has (transitively) received a message from rank i
    /// that was sent after i started; its own bit is always set.
    pub(super) heard: Vec<u128>,
}

struct Message {
    data: Vec<u8>,
    posted: usize,
    heard: u128,
}

#[derive(Default)]
struct RankState {
    step: usize,
    posted: bool,
    start: usize,
    end: usize,
    done: Vec<bool>,
    outstanding: usize,
}

/// Runs `schedules` (one per rank, in rank order) with `inputs` written into each rank's input
/// range, and returns the buffers; an error names the rank, step and peers involved.
pub(super) fn run(schedules: &[Schedule], inputs: &[Vec<u8>]) -> Result<Outcome, String> {
    let n = schedules.len();
    if n == 0 || n > 128 || inputs.len() != n {
        return Err(format!("bad world: {n} schedules, {} inputs", inputs.len()));
    }
    let mut buffers = Vec::with_capacity(n);
    for (r, (schedule, input)) in schedules.iter().zip(inputs).enumerate() {
        validate(r, n, schedule)?;
        let mut buffer = vec![0u8; schedule.buffer_len()];
        let range = schedule.input_range();
        if input.len() != range.len() {
            return Err(format!(
                "rank {r}: input of {} bytes for an input range of {}",
                input.len(),
                range.len()
            ));
        }
        buffer[range].copy_from_slice(input);
        if let Some((from, to)) = schedule.local_copy() {
            buffer.copy_within(from, to.start);
        }
        buffers.push(buffer);
    }
    let mut heard: Vec<u128> = (0..n).map(|r| 1u128 << r).collect();
    // One FIFO per ordered pair (sender, receiver).
    let mut mailboxes: Links<(usize, usize), Message> = Links::new();
    let mut states: Vec<RankState> = (0..n).map(|_| RankState::default()).collect();
    loop {
        let mut progress = false;
        let mut finished = 0;
        for r in 0..n {
            let steps = schedules[r].steps();
            loop {
                let state = &mut states[r];
                let Some(step) = steps.get(state.step) else {
                    finished += 1;
                    break;
                };
                if !state.posted {
                    for send in step.sends() {
                        let mut data = Vec::with_capacity(send.len());
                        for range in send.ranges() {
                            data.extend_from_slice(&buffers[r][range.clone()]);
                        }
                        mailboxes.send(
                            (r, send.peer()),
                            Message {
                                data,
                                posted: state.start,
                                heard: heard[r],
                            },
                        );
                    }
                    state.outstanding = step.sends().len();
                    state.done.clear();
                    state.done.resize(step.receives().len(), false);
                    state.end = state.start;
                    state.posted = true;
                    progress = true;
                }
                for (i, recv) in step.receives().iter().enumerate() {
                    if states[r].done[i] {
                        continue;
                    }
                    let peer = recv.peer();
                    let Some(message) = mailboxes.pop((peer, r)) else {
                        continue;
                    };
                    recv.apply(&mut buffers[r], &message.data).map_err(|e| {
                        format!(
                            "rank {r} step {}: mismatched send/receive: {e}",
                            states[r].step
                        )
                    })?;
                    heard[r] |= message.heard;
                    let at = message.posted.max(states[r].start) + 1;
                    states[r].done[i] = true;
                    states[r].end = states[r].end.max(at);
                    states[peer].outstanding -= 1;
                    states[peer].end = states[peer].end.max(at);
                    progress = true;
                }
                let state = &mut states[r];
                if state.outstanding == 0 && state.done.iter().all(|d| *d) {
                    state.step += 1;
                    state.start = state.end;
                    state.posted = false;
                } else {
                    break;
                }
            }
        }
        if finished == n {
            break;
        }
        if !progress {
            return Err(deadlock(schedules, &states));
        }
    }
    for ((from, to), mailbox) in mailboxes.iter() {
        let left = mailbox.count();
        if left > 0 {
            return Err(format!(
                "{left} unmatched message(s) from rank {from} to rank {to}"
            ));
        }
    }
    let depth = states.iter().map(|s| s.start).max().unwrap_or(0);
    Ok(Outcome {
        buffers,
        depth,
        heard,
    })
}

fn deadlock(schedules: &[Schedule], states: &[RankState]) -> String {
    let mut report = String::from("deadlock:");
    for (r, state) in states.iter().enumerate() {
        let Some(step) = schedules[r].steps().get(state.step) else {
            continue;
        };
        let waits: Vec<usize> = step
            .receives()
            .iter()
            .zip(&state.done)
            .filter(|(_, done)| !**done)
            .map(|(recv, _)| recv.peer())
            .collect();
        report.push_str(&format!(
            " rank {r} at step {} waits on receives from {waits:?} and on {} unconsumed send(s);",
            state.step, state.outstanding
        ));
    }
    report
}

/// Checks peers and ranges, and that a step's storing receives overlap neither each other nor
/// its sends (so an executor may receive in place while sending).
fn validate(r: usize, n: usize, schedule: &Schedule) -> Result<(), String> {
    if schedule.rank() != r || schedule.world() != n {
        return Err(format!(
            "schedule {r} says rank {} of {}",
            schedule.rank(),
            schedule.world()
        ));
    }
    let len = schedule.buffer_len();
    let input = schedule.input_range();
    if input.start > input.end || input.end > len {
        return Err(format!(
            "rank {r}: input range {input:?} outside {len} bytes"
        ));
    }
    for (s, step) in schedule.steps().iter().enumerate() {
        let peers = step
            .sends()
            .iter()
            .map(|t| (t.peer(), t.ranges()))
            .chain(step.receives().iter().map(|t| (t.peer(), t.ranges())));
        for (peer, ranges) in peers {
            if peer >= n || peer == r {
                return Err(format!("rank {r} step {s}: bad peer {peer}"));
            }
            if let Some(bad) = ranges.iter().find(|x| x.start > x.end || x.end > len) {
                return Err(format!(
                    "rank {r} step {s}: range {bad:?} outside {len} bytes"
                ));
            }
        }
        let received: Vec<(&Range<usize>, bool)> = step
            .receives()
            .iter()
            .flat_map(|x| {
                x.ranges()
                    .iter()
                    .map(move |g| (g, x.action() == Apply::Store))
            })
            .collect();
        for (i, (a, _)) in received.iter().enumerate() {
            for (b, _) in &received[i + 1..] {
                if overlaps(a, b) {
                    return Err(format!(
                        "rank {r} step {s}: receives overlap at {a:?}, {b:?}"
                    ));
                }
            }
        }
        let sent = step.sends().iter().flat_map(|t| t.ranges());
        for x in sent {
            if let Some((y, _)) = received.iter().find(|(y, store)| *store && overlaps(x, y)) {
                return Err(format!(
                    "rank {r} step {s}: stored receive {y:?} overlaps send {x:?}"
                ));
            }
        }
    }
    Ok(())
}

fn overlaps(a: &Range<usize>, b: &Range<usize>) -> bool {
    a.start < b.end && b.start < a.end
}

/// Builds a step by hand, for the simulator's own tests.
pub(super) fn hand_step(
    sends: &[(usize, Range<usize>)],
    receives: &[(usize, Range<usize>)],
) -> Step {
    use super::{Receive, Transfer};
    Step {
        sends: sends
            .iter()
            .map(|(peer, range)| Transfer {
                peer: *peer,
                ranges: vec![range.clone()],
            })
            .collect(),
        receives: receives
            .iter()
            .map(|(peer, range)| Receive {
                peer: *peer,
                ranges: vec![range.clone()],
                action: Apply::Store,
            })
            .collect(),
    }
}

/// Builds a schedule by hand, for the simulator's own tests.
pub(super) fn hand_schedule(rank: usize, world: usize, len: usize, steps: Vec<Step>) -> Schedule {
    Schedule {
        rank,
        world,
        buffer_len: len,
        input: 0..len,
        output: 0..len,
        local: None,
        steps,
    }
}
