//! Hierarchical collectives: a group whose ranks span several hosts runs each collective
//! within each host (through that host's arena) and between hosts through one leader per
//! host (over the links).
//!
//! A [`HostPlan`] is decided once, when the group is made, from the host each rank is on (every
//! rank holds the same records, so every rank decides the same plan): the hosts, ordered by
//! their lowest rank, each with its ranks in ascending order; the *leader* of a host is its
//! lowest rank. [`HostPlan::stages`] then says, for one rank and one collective, which
//! collectives it runs in order: on its host's group ([`Stage::Host`], ranks numbered within
//! the host) and on the leaders' group ([`Stage::Leaders`], leaders numbered by host). A host
//! of one rank has no host stages.
//!
//! | collective | in host | among the leaders | in host |
//! |---|---|---|---|
//! | barrier | barrier | barrier | barrier (the release) |
//! | all_reduce | reduce to the leader | all_reduce | broadcast from the leader |
//! | reduce (root `q`) | reduce to the leader | reduce to `q`'s leader | `q`'s host only, when `q` is not its leader: broadcast from the leader |
//! | broadcast (root `q`) | `q`'s host only: broadcast from `q` | broadcast from `q`'s leader | the other hosts: broadcast from the leader |
//! | all_gather | gather to the leader | all_gather of each host's blocks ([`pack_blocks`]) | broadcast of every block, in rank order ([`HostPlan::assemble`]) |
//!
//! The other collectives keep the links' schedules over the whole group.
//!
//! Every rank of a host runs the same host stages in the same order, and every leader the
//! same leaders' stages, so the stages of one collective cannot deadlock; the tests check this,
//! and the results against the flat collectives', for every assignment of ranks to hosts up to
//! 8 ranks and for seeded assignments of every world size up to 64.
//!
//! # Floating-point sums
//! A hierarchical sum adds each host's values first (in the arena's order), then the hosts'
//! partial sums (in the links' order), so a float sum may differ in its last bits from the
//! flat path's, which adds in another order. Every rank still ends with bitwise identical
//! results: the leaders' all_reduce gives every leader the same bits and each host copies its
//! leader's. Integer results (and min, max, the bitwise operations) are exactly the flat
//! path's.

use std::ops::Range;

use super::ReduceOp;

/// Which collective a hierarchical plan is made for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HierOp {
    /// A barrier.
    Barrier,
    /// An all_reduce.
    AllReduce,
    /// A reduce to group rank `root`.
    Reduce {
        /// The root, a group rank.
        root: usize,
    },
    /// A broadcast from group rank `root`.
    Broadcast {
        /// The root, a group rank.
        root: usize,
    },
    /// An all_gather of blocks of any length.
    AllGather,
}

/// One collective of a stage, on the host's group or the leaders' group (ranks in that group's
/// numbering).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Step {
    /// A barrier.
    Barrier,
    /// A reduce to `root`, with the collective's [`ReduceOp::step_op`] (the division of an
    /// average comes once, at the end, by the whole group's size).
    Reduce {
        /// The root.
        root: usize,
    },
    /// An all_reduce, with the collective's [`ReduceOp::step_op`].
    AllReduce,
    /// A broadcast from `root`.
    Broadcast {
        /// The root.
        root: usize,
    },
    /// A gather of blocks of any length to `root`.
    Gather {
        /// The root.
        root: usize,
    },
    /// An all_gather of blocks of any length.
    AllGather,
}

/// One stage of a hierarchical collective.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stage {
    /// A collective among the ranks of this rank's host.
    Host(Step),
    /// A collective among the hosts' leaders (this rank is one).
    Leaders(Step),
}

/// The hosts of a group and its leaders: how its collectives run hierarchically.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HostPlan {
    /// The group ranks on each host, ascending; hosts ordered by their lowest rank.
    hosts: Vec<Vec<usize>>,
    /// The host of each group rank.
    host_of: Vec<usize>,
    /// Each rank's place on its host.
    host_rank: Vec<usize>,
}

/// The reduction each stage applies for `op` ([`ReduceOp::step_op`]): the division of an
/// average comes once, at the end ([`ReduceOp::finish`] by the whole group's size).
pub const fn stage_op(op: ReduceOp) -> ReduceOp {
    op.step_op()
}

impl HostPlan {
    /// The plan of a group whose rank `r` is on host `hosts[r]` (any value that tells hosts
    /// apart: the transports' host keys).
    pub fn new<K: PartialEq>(hosts: &[K]) -> HostPlan {
        let mut keys: Vec<&K> = Vec::new();
        let mut groups: Vec<Vec<usize>> = Vec::new();
        let mut host_of = Vec::with_capacity(hosts.len());
        let mut host_rank = Vec::with_capacity(hosts.len());
        for (rank, key) in hosts.iter().enumerate() {
            let h = match keys.iter().position(|k| *k == key) {
                Some(h) => h,
                None => {
                    keys.push(key);
                    groups.push(Vec::new());
                    keys.len() - 1
                }
            };
            host_rank.push(groups[h].len());
            groups[h].push(rank);
            host_of.push(h);
        }
        HostPlan {
            hosts: groups,
            host_of,
            host_rank,
        }
    }

    /// Whether collectives gain from running hierarchically: the group spans at least two
    /// hosts and at least one host has two ranks or more (with one rank per host the leaders
    /// are the whole group, and the flat collectives are the same thing without the stages).
    pub fn is_hierarchical(&self) -> bool {
        self.hosts.len() > 1 && self.hosts.iter().any(|h| h.len() > 1)
    }

    /// The group's size.
    pub fn world(&self) -> usize {
        self.host_of.len()
    }

    /// The group ranks on each host, hosts ordered by their lowest rank.
    pub fn hosts(&self) -> &[Vec<usize>] {
        &self.hosts
    }

    /// The host of group rank `rank` (an index into [`hosts`](Self::hosts), and its leader's
    /// rank in the leaders' group).
    pub fn host_of(&self, rank: usize) -> usize {
        self.host_of[rank]
    }

    /// Group rank `rank`'s place on its host (its rank in its host's group).
    pub fn host_rank(&self, rank: usize) -> usize {
        self.host_rank[rank]
    }

    /// Each host's leader (its lowest rank), by host.
    pub fn leaders(&self) -> Vec<usize> {
        self.hosts.iter().map(|h| h[0]).collect()
    }

    /// Whether group rank `rank` leads its host.
    pub fn is_leader(&self, rank: usize) -> bool {
        self.host_rank[rank] == 0
    }

    /// The stages group rank `rank` runs for `op`, in order. A root out of range gives no
    /// stages (the caller refuses it first, as the flat collectives do).
    pub fn stages(&self, rank: usize, op: HierOp) -> Vec<Stage> {
        let h = self.host_of[rank];
        let in_host = self.hosts[h].len() > 1;
        let leader = self.is_leader(rank);
        let mut stages = Vec::with_capacity(3);
        let mut host = |step| {
            if in_host {
                stages.push(Stage::Host(step));
            }
        };
        match op {
            HierOp::Barrier => {
                host(Step::Barrier);
                if leader {
                    stages.push(Stage::Leaders(Step::Barrier));
                }
                if in_host {
                    stages.push(Stage::Host(Step::Barrier));
                }
            }
            HierOp::AllReduce => {
                host(Step::Reduce { root: 0 });
                if leader {
                    stages.push(Stage::Leaders(Step::AllReduce));
                }
                if in_host {
                    stages.push(Stage::Host(Step::Broadcast { root: 0 }));
                }
            }
            HierOp::Reduce { root } => {
                let Some(&rh) = self.host_of.get(root) else {
                    return Vec::new();
                };
                host(Step::Reduce { root: 0 });
                if leader {
                    stages.push(Stage::Leaders(Step::Reduce { root: rh }));
                }
                if in_host && h == rh && self.host_rank[root] != 0 {
                    stages.push(Stage::Host(Step::Broadcast { root: 0 }));
                }
            }
            HierOp::Broadcast { root } => {
                let Some(&rh) = self.host_of.get(root) else {
                    return Vec::new();
                };
                if h == rh {
                    host(Step::Broadcast {
                        root: self.host_rank[root],
                    });
                }
                if leader {
                    stages.push(Stage::Leaders(Step::Broadcast { root: rh }));
                }
                if in_host && h != rh {
                    stages.push(Stage::Host(Step::Broadcast { root: 0 }));
                }
            }
            HierOp::AllGather => {
                host(Step::Gather { root: 0 });
                if leader {
                    stages.push(Stage::Leaders(Step::AllGather));
                }
                if in_host {
                    stages.push(Stage::Host(Step::Broadcast { root: 0 }));
                }
            }
        }
        stages
    }

    /// Every rank's block, in group rank order and packed ([`pack_blocks`]), from each host's
    /// packed blocks (`per_host[h]`: host `h`'s ranks' blocks, as its leader packed them after
    /// the host's gather).
    ///
    /// # Errors
    /// [`Malformed`] naming the first host whose packed blocks are not as many blocks as it
    /// has ranks, or do not parse.
    pub fn assemble(&self, per_host: &[&[u8]]) -> Result<Vec<u8>, Malformed> {
        if per_host.len() != self.hosts.len() {
            return Err(Malformed {
                host: per_host.len().min(self.hosts.len()),
            });
        }
        let mut ranges: Vec<Range<usize>> = vec![0..0; self.world()];
        for (h, packed) in per_host.iter().enumerate() {
            let blocks = unpack_blocks(packed, self.hosts[h].len()).ok_or(Malformed { host: h })?;
            for (rank, block) in self.hosts[h].iter().zip(blocks) {
                ranges[*rank] = block;
            }
        }
        let blocks: Vec<&[u8]> = (0..self.world())
            .map(|r| &per_host[self.host_of[r]][ranges[r].clone()])
            .collect();
        Ok(pack_blocks(&blocks))
    }
}

/// Packed blocks that do not parse: those of host `host` (an index into
/// [`HostPlan::hosts`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("host {host}'s leader sent blocks that do not parse")]
pub struct Malformed {
    /// The host whose blocks are malformed.
    pub host: usize,
}

/// Blocks of any length as one message: each block's length (8 bytes, little-endian), then the
/// blocks, in order.
pub fn pack_blocks(blocks: &[&[u8]]) -> Vec<u8> {
    let total: usize = blocks.iter().map(|b| b.len()).sum();
    let mut out = Vec::with_capacity(8 * blocks.len() + total);
    for b in blocks {
        out.extend_from_slice(&(b.len() as u64).to_le_bytes());
    }
    for b in blocks {
        out.extend_from_slice(b);
    }
    out
}

/// Where each of the `count` blocks of `packed` ([`pack_blocks`]) lies in it, or `None` when
/// `packed` is not exactly `count` blocks.
pub fn unpack_blocks(packed: &[u8], count: usize) -> Option<Vec<Range<usize>>> {
    let header = count.checked_mul(8)?;
    let lens = packed.get(..header)?;
    let mut at = header;
    let mut out = Vec::with_capacity(count);
    for len in lens.chunks_exact(8) {
        let len = usize::try_from(u64::from_le_bytes(len.try_into().ok()?)).ok()?;
        let end = at.checked_add(len)?;
        out.push(at..end);
        at = end;
    }
    (at == packed.len()).then_some(out)
}

#[cfg(test)]
#[path = "hierarchy_sim.rs"]
mod sim;
