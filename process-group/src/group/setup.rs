//! Making a [`Group`]: connecting its mesh, routing frames, and subgroups (`new_group`,
//! `split_group`) over the same connections.

use super::*;

impl Group {
    /// Sets up `rank` of a group of `world` ranks: publishes this rank's address in `store`
    /// and connects to every other rank over `transport`.
    ///
    /// # Errors
    /// [`ProcessGroupError::Setup`] naming what failed (and, on timeout, the ranks that did
    /// not show up).
    pub async fn connect(
        store: Arc<dyn Store>,
        transport: Arc<dyn Transport>,
        rank: usize,
        world: usize,
        options: GroupOptions,
    ) -> Result<Group, ProcessGroupError> {
        let bad_variable = |source| ProcessGroupError::BadVariable { rank, source };
        if let Some(bad) = options.bad_env.first() {
            return Err(bad_variable(bad.clone()));
        }
        let debug = match options.debug {
            Some(level) => level,
            None => {
                let value = std::env::var(DEBUG_ENV).unwrap_or_default();
                DebugLevel::parse(&value).map_err(|_| {
                    bad_variable(BadVariable::new(DEBUG_ENV, value, "off, info or detail"))
                })?
            }
        };
        let span = tracing::debug_span!("pg_connect", group = %options.name, rank, world);
        let mesh = Mesh::connect(MeshSetup {
            store: store.as_ref(),
            transport: transport.as_ref(),
            group: &options.name,
            rank,
            world,
            listen: options.listen,
            timeout: options.timeout,
            limits: options.inbox_limits,
            runtime: options.runtime.clone(),
            budget: options
                .budget
                .clone()
                .unwrap_or_else(|| tensorwire_core::budget::Budget::new(options.peer_budget)),
        })
        .instrument(span)
        .await?;
        let counters = Default::default();
        // The agreement check (`Detail`) runs on the links: the arena carries no signatures.
        let path = match debug {
            DebugLevel::Detail => CollectivePath::Links,
            _ => options.collectives,
        };
        let group = Group::over(
            GroupMesh::whole(mesh),
            options.name,
            options.timeout,
            debug,
            store,
            counters,
            (
                options.collectives,
                options.arena_bytes,
                arena::ArenaSlot::Off,
            ),
        )?;
        group.set_up_arena(path, options.arena_bytes).await?;
        let members: Vec<usize> = (0..world).collect();
        if let Some(plan) = hier::Hierarchy::plan(group.inner.hosts.get(), &members) {
            let ids = group.take_ids(2)?;
            let name = group.name().to_owned();
            if let Some(h) = Group::hierarchy_for(&group, plan, &members, &name, ids)? {
                group.set_hierarchy(h);
            }
        }
        Ok(group)
    }

    /// Multiplexes another layer's traffic (the RPC agent's) over this group's connections:
    /// frames of every kind but [`FrameKind::Collective`](tensorwire_core::wire::FrameKind)
    /// that arrive on them go to `sink`, on the connection's reader task; the layer sends its
    /// own frames on [`connections`](Group::connections). This is how the RPC agent and its
    /// world group share one connection per pair of workers.
    ///
    /// Set once, on the world group (not a subgroup), before any peer sends such a frame (a
    /// frame that comes first breaks the group, as one from a stranger would).
    ///
    /// # Errors
    /// [`ProcessGroupError::Setup`] on a subgroup or when a sink is set already.
    pub fn route_frames(
        &self,
        sink: Arc<dyn tensorwire_mesh::FrameSink>,
    ) -> Result<(), ProcessGroupError> {
        if self.inner.mesh.route_frames(sink) {
            Ok(())
        } else {
            Err(ProcessGroupError::Setup {
                rank: self.inner.mesh.rank(),
                reason: "frames are routed on the world group only, and once".to_owned(),
            })
        }
    }

    /// The connection to each other rank of the world, by world rank (one per pair of ranks,
    /// shared by the world group and its subgroups).
    pub fn connections(&self) -> Vec<(usize, Arc<dyn Connection>)> {
        self.inner.mesh.connections()
    }

    /// The group over `mesh`, with its fixed schedules.
    pub(super) fn over(
        mesh: GroupMesh,
        name: String,
        timeout: Duration,
        debug: DebugLevel,
        store: Arc<dyn Store>,
        counters: (Arc<Counters>, Arc<Counters>),
        (collectives, arena_bytes, slot): (CollectivePath, usize, arena::ArenaSlot),
    ) -> Result<Group, ProcessGroupError> {
        let arena_on = matches!(slot, arena::ArenaSlot::Pending { .. });
        let (rank, world) = (mesh.rank(), mesh.world());
        let setup = |e: CollectiveError| ProcessGroupError::Setup {
            rank,
            reason: e.to_string(),
        };
        let barrier = collective::barrier(rank, world).map_err(setup)?;
        let check = collective::agreement_check(rank, world).map_err(setup)?;
        let slots = vec![SLOT_BYTES; world];
        let lengths = collective::all_gather(rank, &slots, AllGatherAlgorithm::select(&slots))
            .map_err(setup)?;
        Ok(Group {
            inner: Arc::new(Inner {
                mesh,
                barrier,
                lengths,
                check,
                debug,
                name,
                next_seq: AtomicU64::new(0),
                sent: counters.0,
                received: counters.1,
                timeout,
                next_group: AtomicU64::new(1),
                _store: store,
                arena: turn::TurnLock::new(slot),
                arena_on: std::sync::atomic::AtomicBool::new(arena_on),
                hosts: std::sync::OnceLock::new(),
                collectives,
                arena_bytes,
                hierarchy: std::sync::OnceLock::new(),
            }),
        })
    }

    /// A group of some of the world's `ranks` (PyTorch's `new_group(ranks=...)`), over the
    /// world group's connections: `Some` on its members, `None` on every other rank (PyTorch's
    /// `GroupMember.NON_GROUP_MEMBER`: a rank outside the group has nothing to issue
    /// collectives on).
    ///
    /// Every rank of the world calls it, members or not, with the same `ranks` and in the same
    /// order relative to its other `new_group` and [`split_group`](Group::split_group) calls:
    /// each call takes the next subgroup id, with no message exchanged, and the subgroup's
    /// messages are filed under that id (a subgroup across hosts, which runs hierarchically,
    /// takes two more for its internal groups: see [`Group::is_hierarchical`]). Group rank `i` is the `i`-th lowest world rank of
    /// `ranks` (as PyTorch sorts them); an empty `ranks` means the whole world. The subgroup
    /// numbers its collectives from zero under its own id, so it can be used at the same time
    /// as the world group and other subgroups. Point-to-point messages are the exception:
    /// they belong to the pair of ranks (see `send`), so a `recv` on any group gets the next
    /// message its peer sent here with that tag on any group.
    ///
    /// The subgroup shares the world's connections, and so their failures: a dead peer, a
    /// timed-out collective or a disagreement in any group breaks them all. Shutting a
    /// subgroup down only stops it taking collectives; shutting the world group down closes
    /// the connections under every subgroup.
    ///
    /// ```no_run
    /// # async fn demo(world: tensorwire_process_group::Group) -> Result<(), Box<dyn std::error::Error>> {
    /// use tensorwire_core::ports::process_group::{Collectives, ProcessGroup};
    /// // On every rank of a world of 4:
    /// if let Some(odd) = world.new_group(&[1, 3])? {
    ///     assert_eq!(odd.global_rank(odd.rank()), Some(world.rank()));
    ///     odd.barrier().await?;
    /// }
    /// # Ok(()) }
    /// ```
    ///
    /// # Errors
    /// [`ProcessGroupError::Setup`] when a rank is out of range or listed twice, when called on
    /// a subgroup (subgroups are made from the world group, whose ranks every rank knows), or
    /// when the subgroup ids are used up. The call then takes no id.
    pub fn new_group(&self, ranks: &[usize]) -> Result<Option<Group>, ProcessGroupError> {
        let mut ranks = ranks.to_vec();
        if ranks.is_empty() {
            ranks = (0..self.size()).collect();
        }
        self.split_group(&[ranks])
    }

    /// Splits the world into disjoint subgroups (PyTorch's `split_group(split_ranks=...)`):
    /// returns the one this rank is in, or `None` for a rank in none of them.
    ///
    /// Every rank of the world calls it with the same `split_ranks`; each subgroup takes the
    /// next id in turn, as if [`new_group`](Group::new_group) were called for each, in order.
    ///
    /// # Errors
    /// [`ProcessGroupError::Setup`] when a rank is out of range, listed twice (in one subgroup
    /// or two), a subgroup is empty, or as [`new_group`](Group::new_group).
    pub fn split_group(
        &self,
        split_ranks: &[Vec<usize>],
    ) -> Result<Option<Group>, ProcessGroupError> {
        let rank = self.rank();
        let setup = |reason: String| ProcessGroupError::Setup { rank, reason };
        if self.inner.mesh.id() != 0 {
            return Err(setup(format!(
                "subgroups are made from the world group, not from subgroup {:?}",
                self.name()
            )));
        }
        let world = self.size();
        let mut seen = vec![false; world];
        let mut groups: Vec<Arc<[usize]>> = Vec::with_capacity(split_ranks.len());
        for ranks in split_ranks {
            if ranks.is_empty() {
                return Err(setup("a subgroup needs at least one rank".to_owned()));
            }
            let mut sorted = ranks.clone();
            sorted.sort_unstable();
            for r in &sorted {
                if *r >= world {
                    return Err(setup(format!(
                        "rank {r} is out of range for a world of {world} ranks"
                    )));
                }
                if std::mem::replace(&mut seen[*r], true) {
                    return Err(setup(format!(
                        "rank {r} is listed twice in {split_ranks:?}"
                    )));
                }
            }
            groups.push(sorted.into());
        }
        let first = self.take_ids(groups.len() as u64)?;
        let mut made = None;
        for (id, members) in (first..).zip(groups) {
            let name = format!("{}/{id}", self.name());
            // A group across hosts runs hierarchically: its internal groups take two more
            // ids, on every rank alike (the host records are the same everywhere).
            let hierarchy = match hier::Hierarchy::plan(self.inner.hosts.get(), &members) {
                Some(plan) => {
                    let ids = self.take_ids(2)?;
                    Group::hierarchy_for(self, plan, &members, &name, ids)?
                }
                None => None,
            };
            let slot =
                Group::subgroup_arena(self.inner.hosts.get(), &members, self.inner.collectives);
            if let Some(mesh) = self.inner.mesh.subgroup(id, members) {
                let store = self.inner._store.clone();
                let counters = (self.inner.sent.clone(), self.inner.received.clone());
                let group = Group::over(
                    mesh,
                    name,
                    self.inner.timeout,
                    self.inner.debug,
                    store,
                    counters,
                    (self.inner.collectives, self.inner.arena_bytes, slot),
                )?;
                if let Some(h) = hierarchy {
                    group.set_hierarchy(h);
                }
                made = Some(group);
            }
        }
        Ok(made)
    }

    /// Takes `count` consecutive subgroup ids (every rank of the world takes them in the same
    /// order) and returns the first.
    pub(super) fn take_ids(&self, count: u64) -> Result<u64, ProcessGroupError> {
        self.inner
            .next_group
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |next| {
                (next + count <= MAX_GROUP_ID + 1).then_some(next + count)
            })
            .map_err(|_| ProcessGroupError::Setup {
                rank: self.rank(),
                reason: format!("more than {MAX_GROUP_ID} subgroups"),
            })
    }
}
