//! The agreement check: before a collective, its ranks make sure they all run the same one.
//!
//! A rank learns that another ran something else only when it *receives* one of that rank's
//! messages (see [`Signature`]). A rank that only sends in a collective (a broadcast's root,
//! a leaf of a reduce's tree) therefore returns `Ok` while its receivers fail, and a user
//! whose last collective was such a broadcast never hears of it; ranks whose schedules wait
//! on each other in a cycle (even ranks reducing to root 0, odd ones to root 1) may all wait
//! until the timeout without anyone seeing a wrong signature.
//!
//! The check is the dissemination [`barrier`](super::barrier) run under the collective's
//! own sequence number, every message carrying the collective's [`Signature`], before the
//! collective's first message. Its schedule is the same whatever the collective, so it never
//! deadlocks, and it has this property (tested below on every assignment of two signatures
//! to up to eight ranks): **a rank finishes the check only if every rank passed the same
//! signature.** Rank i finishes after receiving, for each other rank k, a chain of messages
//! from k to i, each hop sent only after its sender verified everything it had received, so
//! every hop compared equal signatures. Hence when the ranks disagree *no* rank finishes it:
//! the ranks that see a wrong signature fail with the disagreement and tell the others (the
//! group's notice), and every other rank is still waiting for a check message when the notice
//! fails the collective, so it fails too, naming what the others ran, well within the timeout.
//!
//! It costs one barrier per collective. [`DebugLevel`] says which collectives run it:
//! under [`DebugLevel::Detail`] (`TENSORWIRE_DEBUG=detail`, PyTorch's
//! `TORCH_DISTRIBUTED_DEBUG=DETAIL`, which all-gathers each collective's fingerprint before
//! running it) every collective whose rounds all ranks run does; otherwise none, and a rank
//! that only sends learns of a disagreement by its next collective. Every rank of a group must
//! use the same level.

use std::fmt;

use super::{CollectiveError, Schedule, Signature};

/// How much the process groups check, as `TENSORWIRE_DEBUG` sets it (`off`, `info`,
/// `detail`, any case; unset or empty is `off`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum DebugLevel {
    /// No agreement check (the default).
    #[default]
    Off,
    /// As `Off` for collectives (PyTorch's `INFO` adds logging, which tensorwire's
    /// `tracing` spans give at every level).
    Info,
    /// Every collective whose rounds all ranks run is preceded by the agreement check.
    Detail,
}

/// The environment variable that sets the [`DebugLevel`].
pub const DEBUG_ENV: &str = "TENSORWIRE_DEBUG";

/// A `TENSORWIRE_DEBUG` value that is none of `off`, `info`, `detail`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UnknownDebugLevel(pub String);

impl fmt::Display for UnknownDebugLevel {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{DEBUG_ENV}={:?} is not one of off, info, detail",
            self.0
        )
    }
}

impl std::error::Error for UnknownDebugLevel {}

impl DebugLevel {
    /// Parses a `TENSORWIRE_DEBUG` value (case-insensitive; surrounding spaces ignored).
    ///
    /// # Errors
    /// [`UnknownDebugLevel`] naming the value.
    pub fn parse(value: &str) -> Result<DebugLevel, UnknownDebugLevel> {
        match value.trim().to_ascii_lowercase().as_str() {
            "" | "off" => Ok(DebugLevel::Off),
            "info" => Ok(DebugLevel::Info),
            "detail" => Ok(DebugLevel::Detail),
            _ => Err(UnknownDebugLevel(value.to_owned())),
        }
    }

    /// Whether a round with `signature` is preceded by the agreement check at this level.
    ///
    /// Never for a barrier (it is a dissemination barrier carrying its signature: it is its
    /// own check), a monitored barrier (its ranks report to rank 0 themselves), a
    /// point-to-point message, or the second round of a gather or scatter (only the ranks
    /// with large blocks run it; its first round was checked).
    pub fn checks(self, signature: &Signature) -> bool {
        if self != DebugLevel::Detail {
            return false;
        }
        !matches!(
            signature,
            Signature::Barrier
                | Signature::MonitoredBarrier
                | Signature::Send { .. }
                | Signature::Gather { .. }
                | Signature::Scatter { .. }
        )
    }
}

/// The agreement check's schedule for `rank` of `world`: the dissemination barrier (empty
/// messages; run it under the collective's sequence number and signature, before the
/// collective's own schedule).
///
/// # Errors
/// [`CollectiveError::EmptyWorld`], [`CollectiveError::RankOutOfRange`].
pub fn agreement_check(rank: usize, world: usize) -> Result<Schedule, CollectiveError> {
    super::barrier(rank, world)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::collective::{ElementType, ReduceOp};
    use std::collections::VecDeque;

    #[test]
    fn levels_parse_in_any_case_and_unknown_ones_are_named() {
        assert_eq!(DebugLevel::parse(""), Ok(DebugLevel::Off));
        assert_eq!(DebugLevel::parse("OFF"), Ok(DebugLevel::Off));
        assert_eq!(DebugLevel::parse("Info"), Ok(DebugLevel::Info));
        assert_eq!(DebugLevel::parse(" DETAIL "), Ok(DebugLevel::Detail));
        let e = DebugLevel::parse("verbose").unwrap_err();
        assert_eq!(
            e.to_string(),
            "TENSORWIRE_DEBUG=\"verbose\" is not one of off, info, detail"
        );
    }

    #[test]
    fn detail_checks_the_rounds_every_rank_runs() {
        let reduce = Signature::Reduce {
            op: ReduceOp::Sum,
            element: ElementType::F32,
            root: 1,
            count: 4,
        };
        let checked = [
            Signature::Broadcast { root: 0, len: 8 },
            Signature::BroadcastLength { root: 0 },
            reduce,
            Signature::GatherLengths { root: 0 },
            Signature::ScatterLengths { root: 0 },
            Signature::AllGatherLengths,
            Signature::AllToAll,
        ];
        let unchecked = [
            Signature::Barrier,
            Signature::MonitoredBarrier,
            Signature::Send { tag: 3 },
            Signature::Gather { root: 0 },
            Signature::Scatter { root: 0 },
        ];
        for s in &checked {
            assert!(DebugLevel::Detail.checks(s), "{s}");
            assert!(!DebugLevel::Off.checks(s), "{s}");
            assert!(!DebugLevel::Info.checks(s), "{s}");
        }
        for s in &unchecked {
            assert!(!DebugLevel::Detail.checks(s), "{s}");
        }
    }

    /// Runs the check on `world` ranks, rank r passing `sigs[r]`, delivering messages in an
    /// order drawn from `seed`. A rank that receives a wrong signature stops (and sends
    /// nothing more). Returns which ranks finished and which saw a wrong signature.
    fn simulate(sigs: &[u8], seed: u64) -> (Vec<bool>, Vec<bool>) {
        let world = sigs.len();
        let schedules: Vec<Schedule> = (0..world)
            .map(|r| agreement_check(r, world).unwrap())
            .collect();
        // In flight: (from, to, signature). Inboxes per (to, from), FIFO.
        let mut in_flight: Vec<(usize, usize, u8)> = Vec::new();
        let mut inbox: Vec<Vec<VecDeque<u8>>> = vec![vec![VecDeque::new(); world]; world];
        let mut step = vec![0usize; world];
        let mut posted = vec![false; world];
        let mut got = vec![0usize; world];
        let mut failed = vec![false; world];
        let mut rng = seed | 1;
        let mut next = |n: usize| {
            rng ^= rng << 13;
            rng ^= rng >> 7;
            rng ^= rng << 17;
            (rng % n as u64) as usize
        };
        loop {
            let mut progress = false;
            for r in 0..world {
                if failed[r] || step[r] == schedules[r].steps().len() {
                    continue;
                }
                let s = &schedules[r].steps()[step[r]];
                if !posted[r] {
                    for t in s.sends() {
                        in_flight.push((r, t.peer(), sigs[r]));
                    }
                    posted[r] = true;
                    progress = true;
                }
                while got[r] < s.receives().len() {
                    let from = s.receives()[got[r]].peer();
                    match inbox[r][from].pop_front() {
                        Some(sig) if sig == sigs[r] => got[r] += 1,
                        Some(_) => {
                            failed[r] = true;
                            break;
                        }
                        None => break,
                    }
                    progress = true;
                }
                if !failed[r] && got[r] == s.receives().len() {
                    step[r] += 1;
                    posted[r] = false;
                    got[r] = 0;
                    progress = true;
                }
            }
            if !in_flight.is_empty() {
                let (from, to, sig) = in_flight.swap_remove(next(in_flight.len()));
                inbox[to][from].push_back(sig);
                progress = true;
            }
            if !progress {
                break;
            }
        }
        let finished = (0..world)
            .map(|r| !failed[r] && step[r] == schedules[r].steps().len())
            .collect();
        (finished, failed)
    }

    #[test]
    fn no_rank_finishes_the_check_unless_all_ranks_agree() {
        for world in 1..=8usize {
            for mask in 0u32..(1 << world) {
                let sigs: Vec<u8> = (0..world).map(|r| ((mask >> r) & 1) as u8).collect();
                let agree = sigs.iter().all(|s| *s == sigs[0]);
                for seed in 1..=6u64 {
                    let (finished, failed) = simulate(&sigs, seed * 0x9e37_79b9);
                    if agree {
                        assert!(finished.iter().all(|f| *f), "world {world} {sigs:?}");
                    } else {
                        assert!(
                            finished.iter().all(|f| !f),
                            "world {world} {sigs:?} seed {seed}: {finished:?}"
                        );
                        assert!(failed.iter().any(|f| *f), "someone sees it: {sigs:?}");
                    }
                }
            }
        }
    }
}
