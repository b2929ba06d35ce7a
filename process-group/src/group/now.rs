//! The synchronous arena path of the awaited collectives (the port's
//! [`run_now`](ProcessGroup::run_now)): a barrier, broadcast, all_reduce, reduce or all_gather
//! of known block lengths (equal or given: no round of lengths first) of a group on its arena
//! (no hierarchy), whose plan core says runs now (a kept plan:
//! [`Planned::runs_now`](tensorwire_core::collective::arena_cache::Planned::runs_now)), runs in
//! the issuing call when the arena's turn is free: no boxed future, no work handle, no expiry
//! subscription and no deadline (no clock read but the spin budget's). When a wait's spin
//! budget runs out, the rest is [`Group::arena_exec`]'s future from where the run stopped,
//! with today's waits (sleep, deadline from then, liveness, failures); when the turn is not
//! free, or the collective is another, the whole is [`run_op`](ProcessGroup::run_op)'s.
//!
//! The caller's runtime gets its turns as through the future: each collective run here spends
//! one unit of the task's cooperative budget (tokio's, which the turn's lock spends on the
//! future path), and once it is spent the collective takes the future, which yields.

use std::ops::DerefMut;
use std::task::{Context, Poll};

use tensorwire_core::collective::arena as plans;
use tensorwire_core::collective::arena::ArenaPlan;
use tensorwire_core::collective::arena_cache::{PlanKey, Planned};
use tensorwire_core::collective::CollectiveError;
use tensorwire_core::ports::process_group::{Buf, HostMut, Now};
use tensorwire_transport_shm::arena::Unfinished;

use super::arena::{barrier_word, split, ArenaReduce, Exec, Turn};
use super::*;

impl Group {
    /// [`ProcessGroup::run_now`] of every collective but the barrier ([`Group::barrier_now`])
    /// (see the module's docs). Not inlined into `run_now`: the barrier's path there saves
    /// and restores the few registers it needs, not all of this one's.
    #[inline(never)]
    pub(super) fn now<'a>(&'a self, op: Op<'a>, cx: &mut Context<'_>) -> Now<'a> {
        // An all_gather whose lengths are known (no round of lengths first) on the arena.
        let gather = match &op {
            Op::AllGather { input, lens }
                if self.inner.hierarchy.get().is_none() && self.uses_arena() =>
            {
                lens.known(self.rank(), self.size(), input.len())
                    .ok()
                    .flatten()
            }
            _ => None,
        };
        if gather.is_none() && !self.alone_on_arena(&op) {
            return Now::Later(self.run_op(op));
        }
        let Some(turn) = self.turn_now(cx) else {
            return Now::Later(self.run_op(op));
        };
        let (rank, world) = (self.rank(), self.size());
        match op {
            Op::AllGather { input, lens: given } => {
                // Moved out whole (a part left in `op` would be dropped through its glue).
                drop(given);
                let lens = gather.expect("an all_gather runs here with its lengths known");
                self.all_gather_now(turn, input, lens)
            }
            Op::AllReduce { data, element, op } => {
                let data = match data.into_host_mut("all_reduce", self) {
                    Ok(data) => data,
                    Err(e) => return Now::Done(Err(e)),
                };
                let count = match whole_elements("all_reduce", data.len(), element) {
                    Ok(count) => count,
                    Err(e) => return Now::Done(Err(e)),
                };
                let signature = Signature::AllReduce {
                    op,
                    element,
                    count: count as u64,
                }
                .word(&[]);
                self.now_or_later(
                    turn,
                    "all_reduce",
                    PlanKey::all_reduce(count, element, op),
                    move |s| plans::all_reduce(rank, world, count, element, op, s),
                    data,
                    signature,
                    move |mut data: HostMut<'a>| {
                        op.finish(element, &mut data, world);
                        data.done()
                    },
                )
            }
            Op::Broadcast { data, root } => {
                let data = match data.into_host_mut("broadcast", self) {
                    Ok(data) => data,
                    Err(e) => return Now::Done(Err(e)),
                };
                let len = data.len();
                let signature = Signature::Broadcast {
                    root: root as u32,
                    len: len as u64,
                }
                .word(&[]);
                self.now_or_later(
                    turn,
                    "broadcast",
                    PlanKey::broadcast(root, len),
                    move |s| plans::broadcast(rank, world, root, len, s),
                    data,
                    signature,
                    |data: HostMut<'a>| data.done(),
                )
            }
            Op::Reduce {
                data,
                element,
                op,
                root,
            } => {
                let data = match data.into_host_mut("reduce", self) {
                    Ok(data) => data,
                    Err(e) => return Now::Done(Err(e)),
                };
                let r = match ArenaReduce::new(self, data.len(), element, op, root) {
                    Ok(r) => r,
                    Err(e) => return Now::Done(Err(e)),
                };
                let (key, make, signature) = (r.key, r.make(), r.signature);
                if r.at_root() {
                    let finish = move |mut data: HostMut<'a>| {
                        op.finish(element, &mut data, world);
                        data.done()
                    };
                    self.now_or_later(turn, "reduce", key, make, data, signature, finish)
                } else {
                    let scratch = ArenaReduce::scratch(&data);
                    let finish = |_: Vec<u8>| Done::Unit;
                    self.now_or_later(turn, "reduce", key, make, scratch, signature, finish)
                }
            }
            // Not reached (the ops above are those taken here); with its turn taken, the future
            // runs it (the op moves there: nothing of it is dropped in the call).
            other => Now::Later(Box::pin(async move {
                let mut turn = turn;
                self.on_arena(&mut turn, other).await
            })),
        }
    }

    /// The arena's turn for a collective run in this call: `None` when the task's cooperative
    /// budget is spent (the future yields then, and its lock sees the same) or the turn is
    /// not free.
    #[inline(always)]
    fn turn_now(&self, cx: &mut Context<'_>) -> Option<Turn<'_>> {
        let Poll::Ready(coop) = tokio::task::coop::poll_proceed(cx) else {
            return None;
        };
        let turn = self.try_turn()?;
        coop.made_progress();
        Some(turn)
    }

    /// A barrier in this call as far as the arena's spin allows: its plan, the same at every
    /// call, is the one the arena's
    /// [`PlanCache`](tensorwire_core::collective::arena_cache::PlanCache) keeps resolved (no
    /// key to make or compare); the rest, from where it stopped, through
    /// [`Group::arena_exec`]'s future; the whole through [`run_op`](ProcessGroup::run_op)'s
    /// when it is not run here.
    pub(super) fn barrier_now(&self, cx: &mut Context<'_>) -> Now<'_> {
        let on_arena = self.alone_on_arena(&Op::Barrier);
        let Some(mut turn) = on_arena.then(|| self.turn_now(cx)).flatten() else {
            return Now::Later(self.run_op(Op::Barrier));
        };
        let signature = barrier_word();
        let ran = self.arena_now_with(
            &mut turn,
            "barrier",
            |cache, _| cache.barrier().map(Planned::Kept),
            |arena, plan| arena.try_run(plan, &mut [], signature),
        );
        let from = match ran {
            Ok(Some(None)) => return Now::Done(Ok(Done::Unit)),
            Err(e) => return Now::Done(Err(e)),
            Ok(Some(Some(from))) => from,
            Ok(None) => Unfinished::NOT_BEGUN,
        };
        let (rank, world) = (self.rank(), self.size());
        Now::Later(Box::pin(async move {
            self.arena_exec(
                &mut turn,
                "barrier",
                PlanKey::barrier(),
                |s| plans::barrier(rank, world, s),
                Exec::InPlace(&mut []),
                signature,
                Some(from),
            )
            .await?;
            Ok(Done::Unit)
        }))
    }

    /// An all_gather of known block lengths `lens` (this rank's block: `input`) in this call
    /// as far as the arena's spin allows, as [`Group::arena_all_gather`] runs it (over a buffer
    /// of its own); the rest, or the whole when it is not run here, through
    /// [`Group::arena_exec`]'s future.
    fn all_gather_now<'a>(
        &'a self,
        mut turn: Turn<'a>,
        input: Buf<'a>,
        lens: Vec<usize>,
    ) -> Now<'a> {
        let (rank, collective) = (self.rank(), "all_gather");
        let key = PlanKey::all_gather(&lens);
        let signature = Signature::all_gather(&lens).word(&[]);
        let ran = match input.host(collective, self) {
            Ok(data) => self.arena_now_with(
                &mut turn,
                collective,
                |cache, slot| cache.plan(key, || plans::all_gather(rank, &lens, slot)),
                |arena, plan| arena.try_run_fresh(plan, data, signature),
            ),
            Err(e) => Err(e),
        };
        let rest = match ran {
            Err(e) => return Now::Done(Err(e)),
            Ok(Some(Ok(buffer))) => return Now::Done(Ok(Done::from(split(buffer.into(), &lens)))),
            Ok(Some(Err(rest))) => Some(rest),
            Ok(None) => None,
        };
        Now::Later(Box::pin(async move {
            let data = input.host(collective, self)?;
            let exec = match rest {
                Some(rest) => Exec::FreshRest(rest),
                None => Exec::Fresh(data),
            };
            let make = |s| plans::all_gather(rank, &lens, s);
            let out = self
                .arena_exec(&mut turn, collective, key, make, exec, signature, None)
                .await?;
            Ok(Done::from(split(out.unwrap_or_default().into(), &lens)))
        }))
    }

    /// Runs one round of the arena on `buffer` in this call as far as its spin allows
    /// ([`Group::arena_now`]), then `finish` makes the result: at once when it ran to its end,
    /// else after [`Group::arena_exec`]'s future ran the rest from where it stopped.
    #[allow(clippy::too_many_arguments)]
    fn now_or_later<'a, B, M, F>(
        &'a self,
        mut turn: Turn<'a>,
        collective: &'static str,
        key: Option<PlanKey>,
        make: M,
        mut buffer: B,
        signature: u64,
        finish: F,
    ) -> Now<'a>
    where
        B: DerefMut<Target = [u8]> + Send + 'a,
        M: Fn(usize) -> Result<ArenaPlan, CollectiveError> + Copy + Send + 'a,
        F: FnOnce(B) -> Done + Send + 'a,
    {
        match self.arena_now(&mut turn, collective, key, make, &mut buffer, signature) {
            Ok(None) => Now::Done(Ok(finish(buffer))),
            Err(e) => Now::Done(Err(e)),
            Ok(Some(from)) => Now::Later(Box::pin(async move {
                let exec = Exec::InPlace(&mut buffer);
                self.arena_exec(
                    &mut turn,
                    collective,
                    key,
                    make,
                    exec,
                    signature,
                    Some(from),
                )
                .await?;
                Ok(finish(buffer))
            })),
        }
    }
}
