//! The one dispatch of a [`Group`]'s operations: every [`Op`] goes through
//! [`Group::execute`], which takes the group arena's path for the collectives it has plans for
//! (when the group has an arena) and the links' otherwise. An operation the group has no code
//! of its own for runs as core's schedule for it ([`Op::schedule`]) over the links.

use tensorwire_core::ports::process_group::Scheduled;
use tensorwire_core::tensor::Storage;

use super::*;

/// How many sequence numbers an operation the arena runs takes (its link path's rounds), or
/// `None` for one that always takes the links.
fn arena_rounds(op: &Op<'_>) -> Option<u64> {
    match op {
        Op::AllGather { .. }
        | Op::BroadcastBytes { .. }
        | Op::Gather { .. }
        | Op::Scatter { .. } => Some(varlen::ROUNDS),
        Op::Barrier
        | Op::Broadcast { .. }
        | Op::AllReduce { .. }
        | Op::Reduce { .. }
        | Op::ReduceScatter { .. }
        | Op::AllToAll { .. }
        | Op::AllToAllSingle { .. } => Some(1),
        _ => None,
    }
}

impl Group {
    /// Runs `op` to its end on this rank. Its arguments are checked and its sequence numbers
    /// taken in its first poll, before it awaits anything the peers do (see
    /// [`Group::issue`]).
    pub(super) async fn execute(&self, op: Op<'_>) -> Result<Done, ProcessGroupError> {
        if let Op::AllToAllSingle {
            input,
            input_splits,
            ..
        } = &op
        {
            check_splits(input.len(), input_splits)?;
        }
        if let Op::AllGather { input, lens } = &op {
            // Given lengths that do not fit this rank are its own error, before any turn.
            lens.known(self.rank(), self.size(), input.len())
                .map_err(|source| ProcessGroupError::Arguments {
                    collective: "all_gather",
                    source,
                })?;
        }
        let op = match self.on_hierarchy(op).await {
            Ok(done) => return done,
            Err(op) => op,
        };
        if let Some(rounds) = arena_rounds(&op) {
            if let Some(mut turn) = self.arena_turn(rounds).await {
                return self.on_arena(&mut turn, op).await;
            }
        }
        self.on_links(op).await
    }

    /// A barrier, broadcast, all_reduce or reduce, as [`Group::execute`] runs it, for a group
    /// whose collectives go through its arena (no hierarchy; see
    /// [`Group::start`](ProcessGroup::start)): the port boxes the operation's future at every
    /// call, and this one holds only these collectives' state, not that of every collective on
    /// every path (in a release build, 1.9 KB moved into the heap instead of `execute`'s 4.9
    /// KB). The same turn, plan, waits and failures as through `execute`.
    pub(super) async fn arena_alone(&self, op: Op<'_>) -> Result<Done, ProcessGroupError> {
        // Not reached: the arena path, once on, stays on. Were it off, `execute` runs it.
        let Some(mut turn) = self.arena_turn(1).await else {
            return Box::pin(self.execute(op)).await;
        };
        self.one_round_on_arena(&mut turn, op).await
    }

    /// A barrier, broadcast, all_reduce or reduce through the group arena (its future holds
    /// only these four's state: [`Group::arena_alone`] boxes it alone); any other `op` goes to
    /// [`Group::on_arena`].
    async fn one_round_on_arena(
        &self,
        turn: &mut arena::Turn<'_>,
        op: Op<'_>,
    ) -> Result<Done, ProcessGroupError> {
        let name = op.name();
        match op {
            Op::Barrier => self.arena_barrier(turn).await.map(|()| Done::Unit),
            Op::AllReduce { data, element, op } => {
                let mut data = data.into_host_mut(name, self)?;
                self.arena_all_reduce(turn, &mut data, element, op).await?;
                Ok(data.done())
            }
            Op::Broadcast { data, root } => {
                let mut data = data.into_host_mut(name, self)?;
                self.arena_broadcast(turn, &mut data, root).await?;
                Ok(data.done())
            }
            Op::Reduce {
                data,
                element,
                op,
                root,
            } => {
                let mut data = data.into_host_mut(name, self)?;
                self.arena_reduce(turn, &mut data, element, op, root)
                    .await?;
                Ok(self.reduced(data, root))
            }
            other => Box::pin(self.on_arena(turn, other)).await,
        }
    }

    /// Whether `op` may take [`Group::arena_alone`]: a barrier, broadcast, all_reduce or
    /// reduce (one round each) of a group on its arena without a hierarchy.
    pub(super) fn alone_on_arena(&self, op: &Op<'_>) -> bool {
        matches!(
            op,
            Op::Barrier | Op::AllReduce { .. } | Op::Broadcast { .. } | Op::Reduce { .. }
        ) && self.inner.hierarchy.get().is_none()
            && self.uses_arena()
    }

    /// `op` through the group arena (one of those [`arena_rounds`] names).
    pub(super) async fn on_arena(
        &self,
        turn: &mut arena::Turn<'_>,
        op: Op<'_>,
    ) -> Result<Done, ProcessGroupError> {
        let name = op.name();
        match op {
            op
            @ (Op::Barrier | Op::AllReduce { .. } | Op::Broadcast { .. } | Op::Reduce { .. }) => {
                Box::pin(self.one_round_on_arena(turn, op)).await
            }
            Op::AllGather { input, lens } => {
                let input = input.host(name, self)?;
                self.arena_all_gather(turn, input, &lens)
                    .await
                    .map(Done::from)
            }
            Op::BroadcastBytes { data, root } => {
                let data = data.host(name, self)?;
                self.arena_broadcast_bytes(turn, data, root)
                    .await
                    .map(Done::from)
            }
            Op::Gather { input, root } => {
                let input = input.host(name, self)?;
                let blocks = self.arena_gather(turn, input, root).await?;
                Ok(gathered(blocks))
            }
            Op::Scatter { blocks, root } => self
                .arena_scatter(turn, &blocks, root)
                .await
                .map(Done::from),
            Op::ReduceScatter {
                input,
                counts,
                element,
                op,
            } => {
                let input = input.host(name, self)?;
                self.arena_reduce_scatter(turn, input, &counts, element, op)
                    .await
                    .map(Done::from)
            }
            Op::AllToAll {
                inputs,
                output_lens,
            } => self
                .arena_all_to_all(turn, &inputs, &output_lens)
                .await
                .map(Done::from),
            Op::AllToAllSingle {
                input,
                input_splits,
                output_splits,
            } => {
                let inputs = split(input.into_bytes(name, self)?, &input_splits);
                let blocks = self.arena_all_to_all(turn, &inputs, &output_splits).await?;
                Ok(Done::from(blocks.concat()))
            }
            other => Err(ProcessGroupError::Unsupported {
                collective: other.name(),
                backend: self.backend(),
            }),
        }
    }

    /// `op` over the links.
    async fn on_links(&self, op: Op<'_>) -> Result<Done, ProcessGroupError> {
        let name = op.name();
        match op {
            Op::Barrier => self.links_barrier().await.map(|()| Done::Unit),
            Op::MonitoredBarrier {
                timeout,
                wait_all_ranks,
            } => self
                .links_monitored_barrier(timeout, wait_all_ranks)
                .await
                .map(|()| Done::Unit),
            Op::AllGather { input, lens } => {
                let input = input.host(name, self)?;
                self.links_all_gather(input, &lens).await.map(Done::from)
            }
            Op::Broadcast { data, root } => {
                let mut data = data.into_host_mut(name, self)?;
                self.links_broadcast(&mut data, root).await?;
                Ok(data.done())
            }
            Op::BroadcastBytes { data, root } => {
                let data = data.host(name, self)?;
                self.links_broadcast_bytes(data, root).await.map(Done::from)
            }
            Op::AllReduce { data, element, op } => {
                let mut data = data.into_host_mut(name, self)?;
                self.links_all_reduce(&mut data, element, op).await?;
                Ok(data.done())
            }
            Op::Reduce {
                data,
                element,
                op,
                root,
            } => {
                let mut data = data.into_host_mut(name, self)?;
                self.links_reduce(&mut data, element, op, root).await?;
                Ok(self.reduced(data, root))
            }
            Op::Gather { input, root } => {
                let input = input.host(name, self)?;
                let blocks = self.links_gather(input, root).await?;
                Ok(gathered(blocks))
            }
            Op::Scatter { blocks, root } => self.links_scatter(&blocks, root).await.map(Done::from),
            Op::AllToAll {
                inputs,
                output_lens,
            } => {
                let splits: Vec<usize> = inputs.iter().map(Bytes::len).collect();
                let (schedule, seq) = self.issue_all_to_all(&splits, &output_lens)?;
                self.all_to_all_blocks(seq, &schedule, &inputs, &output_lens)
                    .await
                    .map(Done::from)
            }
            Op::AllToAllSingle {
                input,
                input_splits,
                output_splits,
            } => {
                let input = input.host(name, self)?;
                self.links_all_to_all_single(input, &input_splits, &output_splits)
                    .await
                    .map(Done::from)
            }
            Op::Send { data, dst, tag } => {
                self.check_peer(name, dst)?;
                let data = data.into_bytes(name, self)?;
                let n = self.inner.sent.take(self.world_rank(dst), tag);
                self.send_numbered(data, dst, tag, n)
                    .await
                    .map(|()| Done::Unit)
            }
            Op::Recv { src, tag } => {
                self.check_peer(name, src)?;
                let n = self.inner.received.take(self.world_rank(src), tag);
                self.recv_numbered(src, tag, n).await.map(Done::from)
            }
            Op::RecvAny { tag } => {
                let (src, data) = self.links_recv_any(tag).await?;
                Ok(Done::Received {
                    src,
                    data: Storage::Host(data),
                })
            }
            op => self.run_scheduled(op).await,
        }
    }

    /// An operation that is one of core's schedules ([`Op::schedule`]), over the links.
    async fn run_scheduled(&self, op: Op<'_>) -> Result<Done, ProcessGroupError> {
        let name = op.name();
        let Some(scheduled) = op.schedule(self.rank(), self.size()) else {
            return Err(ProcessGroupError::Unsupported {
                collective: name,
                backend: self.backend(),
            });
        };
        let Scheduled {
            schedule,
            signature,
            input,
            finish,
        } = scheduled?;
        let mut buffer = vec![0u8; schedule.buffer_len()];
        buffer[schedule.input_range()].copy_from_slice(input.host(name, self)?);
        let seq = self.reserve(1);
        self.run(seq, signature, &schedule, &mut buffer).await?;
        let mut out = buffer[schedule.output_range()].to_vec();
        if let Some((op, element)) = finish {
            op.finish(element, &mut out, self.size());
        }
        Ok(Done::from(out))
    }

    /// A reduce's result here: the root's data, nothing elsewhere (their data is unchanged).
    fn reduced(
        &self,
        data: tensorwire_core::ports::process_group::HostMut<'_>,
        root: usize,
    ) -> Done {
        if self.rank() == root {
            data.done()
        } else {
            Done::Unit
        }
    }
}

/// A gather's blocks as its result.
fn gathered(blocks: Option<Vec<Bytes>>) -> Done {
    Done::Gathered(blocks.map(|b| b.into_iter().map(Storage::Host).collect()))
}

/// The all_to_all_single splits must add up to the input.
fn check_splits(len: usize, splits: &[usize]) -> Result<(), ProcessGroupError> {
    let sum = splits.iter().try_fold(0usize, |acc, s| acc.checked_add(*s));
    if sum == Some(len) {
        return Ok(());
    }
    Err(ProcessGroupError::Arguments {
        collective: "all_to_all",
        source: CollectiveError::SplitsSum {
            sum: sum.unwrap_or(usize::MAX),
            actual: len,
        },
    })
}

/// `input` cut into blocks of `lens` bytes (slices of it, no copy).
fn split(input: Bytes, lens: &[usize]) -> Vec<Bytes> {
    let mut start = 0;
    lens.iter()
        .map(|len| {
            start += len;
            input.slice(start - len..start)
        })
        .collect()
}
