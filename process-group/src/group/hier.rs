//! The hierarchical path: a group whose ranks span several hosts (with two ranks or more on at
//! least one) runs barrier, all_reduce, reduce, broadcast and all_gather in stages, within each
//! host through that host's arena and between hosts among one leader per host over the links,
//! as core's [`HostPlan`] says. Its other collectives keep the links' schedules over the whole
//! group.
//!
//! The plan and two internal groups are made with the group, on every rank alike from the host
//! records the world exchanged when it connected ([`Group::set_up_arena`]): the ranks of this
//! rank's host (a subgroup whose arena is made on its first collective, as any subgroup on one
//! host) and the leaders (a subgroup over the links). They take two subgroup ids after the
//! group's own, so their messages never mix with a user's group's. [`CollectivePath::Links`]
//! (or `TENSORWIRE_DEBUG=detail`) leaves the world without host records and so every group
//! flat.
//!
//! Hierarchical collectives run one at a time, in the order they were issued (a fair lock taken
//! in the issuing call), so every rank runs the internal groups' collectives in one order.
//!
//! # A failed stage
//! Each stage runs within its bound from core's [`stage_bounds`] (measured from the start of
//! the collective: the first host stage gives up earliest, the last latest), and a stage that
//! fails here on ranks this rank waited for (a timeout, a death: core's [`stage_report`]) is
//! reported to every other rank of the group before the error returns. A rank that receives
//! the report breaks its connections with it (the mesh checks it first), so its own stage,
//! waiting on another host's ranks or on its leader, fails at once naming the rank that
//! failed, not the rank it waited for.

use std::time::Instant;

use tensorwire_core::collective::hierarchy::{unpack_blocks, HierOp, HostPlan, Stage, Step};
use tensorwire_core::collective::stage_failure::stage_bounds;
use tensorwire_core::ports::process_group::stage_report;

use super::*;

tokio::task_local! {
    /// The deadline, on the group's clock, of the stage of a hierarchical collective that runs
    /// on this task: the internal group's collective gives up by it.
    static STAGE_DEADLINE: Instant;
}

impl Group {
    /// The bound on a collective that starts now: the group's timeout, or what is left of the
    /// stage's bound when it runs as a stage of a hierarchical collective.
    pub(super) fn op_timeout(&self) -> Duration {
        let timeout = self.inner.timeout;
        STAGE_DEADLINE
            .try_with(|d| d.saturating_duration_since(self.inner.mesh.runtime().now()))
            .map_or(timeout, |left| left.min(timeout))
    }

    /// Sets the group's hierarchy, and tells the mesh its hosts (reports of failed stages are
    /// checked against them).
    pub(super) fn set_hierarchy(&self, h: Hierarchy) {
        self.inner.mesh.register_hosts(h.plan.hosts());
        let _ = self.inner.hierarchy.set(h);
    }
}

/// A group's hierarchy: its plan and internal groups.
pub(super) struct Hierarchy {
    /// In the group's ranks.
    plan: HostPlan,
    /// The ranks of this rank's host (none when it is alone there).
    host: Option<Group>,
    /// The leaders (on the leaders only).
    leaders: Option<Group>,
    /// One hierarchical collective at a time, in issue order.
    turn: tokio::sync::Mutex<()>,
    /// Collectives this rank ran through the hierarchy.
    runs: AtomicU64,
}

impl Hierarchy {
    /// The plan of the group of world ranks `members` from the world's host records, when its
    /// collectives run hierarchically.
    pub(super) fn plan(
        hosts: Option<&Vec<arena::HostRecord>>,
        members: &[usize],
    ) -> Option<HostPlan> {
        let hosts = hosts?;
        let keys: Option<Vec<&str>> = members
            .iter()
            .map(|m| hosts.get(*m).map(|r| r.host.as_str()))
            .collect();
        let plan = HostPlan::new(&keys?);
        plan.is_hierarchical().then_some(plan)
    }
}

impl Group {
    /// Makes the internal groups of the group of world ranks `members` (named `name`) over
    /// `world`'s connections, with subgroup ids `ids` and `ids + 1`: on every rank of the
    /// world, members or not (each registers the ids). `None` on a rank outside the group.
    pub(super) fn hierarchy_for(
        world: &Group,
        plan: HostPlan,
        members: &[usize],
        name: &str,
        ids: u64,
    ) -> Result<Option<Hierarchy>, ProcessGroupError> {
        let here = world.rank();
        let leaders: Arc<[usize]> = plan.leaders().iter().map(|l| members[*l]).collect();
        let leaders_mesh = world.inner.mesh.subgroup(ids + 1, leaders);
        let Some(me) = members.iter().position(|m| *m == here) else {
            return Ok(None);
        };
        let inner = &world.inner;
        let make = |mesh, name, slot| {
            Group::over(
                mesh,
                name,
                inner.timeout,
                inner.debug,
                inner._store.clone(),
                (inner.sent.clone(), inner.received.clone()),
                (inner.collectives, inner.arena_bytes, slot),
            )
        };
        let h = plan.host_of(me);
        let on_host: Arc<[usize]> = plan.hosts()[h].iter().map(|r| members[*r]).collect();
        let host = if on_host.len() > 1 {
            let slot = Group::subgroup_arena(inner.hosts.get(), &on_host, inner.collectives);
            let mesh = inner
                .mesh
                .subgroup(ids, on_host)
                .expect("this rank is on its host");
            Some(make(mesh, format!("{name}/{ids}/host{h}"), slot)?)
        } else {
            None
        };
        let leaders = match leaders_mesh {
            Some(mesh) => Some(make(
                mesh,
                format!("{name}/{}/leaders", ids + 1),
                arena::ArenaSlot::Off,
            )?),
            None => None,
        };
        Ok(Some(Hierarchy {
            plan,
            host,
            leaders,
            turn: tokio::sync::Mutex::new(()),
            runs: AtomicU64::new(0),
        }))
    }

    /// Whether this group runs its barrier, all_reduce, reduce, broadcast and all_gather
    /// hierarchically (its ranks span several hosts, two or more on at least one; see the
    /// guide's collectives chapter, "Across hosts").
    pub fn is_hierarchical(&self) -> bool {
        self.inner.hierarchy.get().is_some()
    }

    /// How many collectives this rank has run through the hierarchy (0 on a flat group).
    pub fn hierarchical_runs(&self) -> u64 {
        self.inner
            .hierarchy
            .get()
            .map_or(0, |h| h.runs.load(Ordering::Relaxed))
    }

    /// The group's hosts and leaders, when it is hierarchical.
    pub fn host_plan(&self) -> Option<&HostPlan> {
        self.inner.hierarchy.get().map(|h| &h.plan)
    }

    /// `op` through the hierarchy, or `Err(op)` back for one the hierarchy does not run.
    pub(super) async fn on_hierarchy<'a>(
        &self,
        op: Op<'a>,
    ) -> Result<Result<Done, ProcessGroupError>, Op<'a>> {
        let Some(h) = self.inner.hierarchy.get() else {
            return Err(op);
        };
        let (rank, world) = (self.rank(), self.size());
        let name = op.name();
        let root_check = |root: usize| {
            if root < world {
                Ok(())
            } else {
                Err(ProcessGroupError::Arguments {
                    collective: name,
                    source: CollectiveError::RootOutOfRange { root, world },
                })
            }
        };
        let reduction = |element: ElementType, op: ReduceOp, len: usize| {
            whole_elements(name, len, element)?;
            op.check(element)
                .map_err(|source| ProcessGroupError::Arguments {
                    collective: name,
                    source,
                })
        };
        // Checked, numbered and queued in the issuing call.
        let checked = match &op {
            // Given lengths take the flat path (its data round alone, as before); equal ones
            // are checked against what the stages gather.
            Op::AllGather {
                lens: BlockLens::Given(_),
                ..
            } => return Err(op),
            Op::Barrier | Op::AllGather { .. } => Ok(()),
            Op::AllReduce { data, element, op } => reduction(*element, *op, data.len()),
            Op::Reduce {
                data,
                element,
                op,
                root,
            } => reduction(*element, *op, data.len()).and_then(|()| root_check(*root)),
            Op::Broadcast { root, .. } => root_check(*root),
            _ => return Err(op),
        };
        if let Err(e) = checked {
            return Ok(Err(e));
        }
        let seq = self.reserve(1);
        let _turn = h.turn.lock().await;
        h.runs.fetch_add(1, Ordering::Relaxed);
        let staged = Staged {
            group: self,
            h,
            name,
            seq,
            start: self.inner.mesh.runtime().now(),
        };
        let span = tracing::debug_span!("hierarchical", collective = name, seq, rank);
        Ok(async {
            match op {
                Op::Barrier => staged
                    .run(HierOp::Barrier, &mut [], None)
                    .await
                    .map(|()| Done::Unit),
                Op::AllReduce { data, element, op } => {
                    let mut data = data.into_host_mut(name, self)?;
                    staged
                        .run(HierOp::AllReduce, &mut data, Some((element, op)))
                        .await?;
                    op.finish(element, &mut data, world);
                    Ok(data.done())
                }
                Op::Reduce {
                    data,
                    element,
                    op,
                    root,
                } => {
                    let mut data = data.into_host_mut(name, self)?;
                    if rank != root {
                        let mut scratch = data.to_vec();
                        staged
                            .run(HierOp::Reduce { root }, &mut scratch, Some((element, op)))
                            .await?;
                        return Ok(Done::Unit);
                    }
                    staged
                        .run(HierOp::Reduce { root }, &mut data, Some((element, op)))
                        .await?;
                    op.finish(element, &mut data, world);
                    Ok(data.done())
                }
                Op::Broadcast { data, root } => {
                    let mut data = data.into_host_mut(name, self)?;
                    staged
                        .run(HierOp::Broadcast { root }, &mut data, None)
                        .await?;
                    Ok(data.done())
                }
                Op::AllGather { input, lens } => {
                    let input = input.host(name, self)?;
                    let blocks = staged.all_gather(input).await?;
                    if lens == BlockLens::Equal {
                        // Every block must be as long as this rank's, as on the other paths
                        // (whose signatures hold the lengths): a rank of another size is named.
                        if let Some(peer) = blocks.iter().position(|b| b.len() != input.len()) {
                            return Err(ProcessGroupError::Mismatch {
                                peer,
                                collective: name,
                                seq: staged.seq,
                                reason: format!(
                                    "its block has {} bytes, this rank's {}",
                                    blocks[peer].len(),
                                    input.len()
                                ),
                            });
                        }
                    }
                    Ok(Done::from(blocks))
                }
                _ => unreachable!("refused above"),
            }
        }
        .instrument(span)
        .await)
    }
}

/// One hierarchical collective under way.
struct Staged<'g> {
    group: &'g Group,
    h: &'g Hierarchy,
    name: &'static str,
    seq: u64,
    /// When it started, on the group's clock: its stages' bounds count from here.
    start: Instant,
}

impl Staged<'_> {
    fn host(&self) -> &Group {
        self.h
            .host
            .as_ref()
            .expect("the plan has host stages only with a host group")
    }

    fn leaders(&self) -> &Group {
        self.h
            .leaders
            .as_ref()
            .expect("the plan has leaders' stages only on leaders")
    }

    /// The stages of a barrier, reduction or broadcast over `data`; `reduction` for the
    /// reductions (each stage applies its [`ReduceOp::step_op`]).
    async fn run(
        &self,
        op: HierOp,
        data: &mut [u8],
        reduction: Option<(ElementType, ReduceOp)>,
    ) -> Result<(), ProcessGroupError> {
        let (element, reduce) = reduction.unwrap_or((ElementType::U8, ReduceOp::Sum));
        let reduce = reduce.step_op();
        for (stage, bound) in self.bounds(op) {
            let (on, step) = match stage {
                Stage::Host(step) => (self.host(), step),
                Stage::Leaders(step) => (self.leaders(), step),
            };
            let result = self
                .within(bound, on, async {
                    match step {
                        Step::Barrier => on.barrier().await,
                        Step::Reduce { root } => on.reduce(data, element, reduce, root).await,
                        Step::AllReduce => on.all_reduce(data, element, reduce).await,
                        Step::Broadcast { root } => on.broadcast(data, root).await,
                        Step::Gather { .. } | Step::AllGather => {
                            unreachable!("only all_gather's plan has gathers")
                        }
                    }
                })
                .await;
            result?;
        }
        Ok(())
    }

    /// This rank's stages for `op`, each with its bound from the start.
    fn bounds(&self, op: HierOp) -> Vec<(Stage, Duration)> {
        stage_bounds(
            &self.h.plan,
            self.group.rank(),
            op,
            self.group.inner.timeout,
        )
    }

    /// Runs one stage on internal group `on`, bounded by `bound` from the collective's start;
    /// a failure this rank saw itself on ranks it waited for is reported to every other rank
    /// of the group before the error (in the group's ranks) returns.
    async fn within<T>(
        &self,
        bound: Duration,
        on: &Group,
        stage: impl std::future::Future<Output = Result<T, ProcessGroupError>>,
    ) -> Result<T, ProcessGroupError> {
        let deadline = self.start.checked_add(bound).unwrap_or(self.start);
        let result = STAGE_DEADLINE.scope(deadline, stage).await;
        let Err(e) = result else { return result };
        let report = stage_report(&e, on.global_ranks());
        let e = self.lift(on, e);
        if let Some(report) = report {
            tracing::warn!(
                collective = self.name,
                seq = self.seq,
                error = %e,
                "a stage failed: telling the group's other ranks"
            );
            // The group is broken here (a timeout or a dead rank in any group breaks every
            // group over the connections), as it is for the ranks told.
            self.group.inner.mesh.fail(e.clone());
            self.group.inner.mesh.report_stage_failure(report).await;
        }
        Err(e)
    }

    /// all_gather's stages: each host's blocks gathered on its leader and packed, the leaders'
    /// packed blocks gathered and put in rank order, and that broadcast in each host.
    async fn all_gather(&self, input: &[u8]) -> Result<Vec<Bytes>, ProcessGroupError> {
        use tensorwire_core::collective::hierarchy::pack_blocks;
        let (rank, world) = (self.group.rank(), self.group.size());
        let mut packed = Bytes::from(pack_blocks(&[input]));
        for (stage, bound) in self.bounds(HierOp::AllGather) {
            match stage {
                Stage::Host(Step::Gather { root }) => {
                    let host = self.host();
                    let blocks = self.within(bound, host, host.gather(input, root)).await?;
                    if let Some(blocks) = blocks {
                        let blocks: Vec<&[u8]> = blocks.iter().map(|b| &b[..]).collect();
                        packed = pack_blocks(&blocks).into();
                    }
                }
                Stage::Leaders(Step::AllGather) => {
                    let leaders = self.leaders();
                    let per_host = self
                        .within(bound, leaders, leaders.all_gather(&packed))
                        .await?;
                    let per_host: Vec<&[u8]> = per_host.iter().map(|b| &b[..]).collect();
                    packed = self
                        .h
                        .plan
                        .assemble(&per_host)
                        .map_err(|m| self.malformed(self.h.plan.hosts()[m.host][0]))?
                        .into();
                }
                Stage::Host(Step::Broadcast { root }) => {
                    let host = self.host();
                    packed = self
                        .within(bound, host, host.broadcast_bytes(&packed, root))
                        .await?;
                }
                other => unreachable!("all_gather's plan has no {other:?}"),
            }
        }
        let leader = self.h.plan.hosts()[self.h.plan.host_of(rank)][0];
        let ranges = unpack_blocks(&packed, world).ok_or_else(|| self.malformed(leader))?;
        Ok(ranges.into_iter().map(|r| packed.slice(r)).collect())
    }

    fn malformed(&self, peer: usize) -> ProcessGroupError {
        ProcessGroupError::Mismatch {
            peer,
            collective: self.name,
            seq: self.seq,
            reason: "its host's blocks do not parse".to_owned(),
        }
    }

    /// An internal group's error as the group's: its ranks in the group's numbering (the world
    /// ranks a dead, departed or aborting peer is named by stay as they are, as on the links),
    /// and the group's collective and sequence number.
    fn lift(&self, internal: &Group, e: ProcessGroupError) -> ProcessGroupError {
        let group = self.group;
        let rank = |r: usize| {
            internal
                .global_rank(r)
                .and_then(|w| group.group_rank(w))
                .unwrap_or(r)
        };
        match e {
            ProcessGroupError::Timeout {
                waiting_on,
                timeout,
                ..
            } => ProcessGroupError::Timeout {
                collective: self.name,
                seq: self.seq,
                rank: group.rank(),
                waiting_on: waiting_on.into_iter().map(rank).collect(),
                timeout,
            },
            ProcessGroupError::Mismatch { peer, reason, .. } => ProcessGroupError::Mismatch {
                peer: rank(peer),
                collective: self.name,
                seq: self.seq,
                reason,
            },
            ProcessGroupError::Disagreement {
                peer,
                theirs,
                rank: saw,
                ours,
                here,
                ..
            } => ProcessGroupError::Disagreement {
                seq: self.seq,
                peer: rank(peer),
                theirs,
                rank: rank(saw),
                ours,
                here,
            },
            // This rank, in the group's numbering rather than the internal group's.
            ProcessGroupError::Setup { reason, .. } => ProcessGroupError::Setup {
                rank: group.rank(),
                reason,
            },
            ProcessGroupError::SetupStore { doing, source, .. } => ProcessGroupError::SetupStore {
                rank: group.rank(),
                doing,
                source,
            },
            ProcessGroupError::SetupTransport { doing, source, .. } => {
                ProcessGroupError::SetupTransport {
                    rank: group.rank(),
                    doing,
                    source,
                }
            }
            other => other,
        }
    }
}
