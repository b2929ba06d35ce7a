//! The synchronous arena path of the awaited collectives (the port's
//! [`run_now`](ProcessGroup::run_now)): a barrier or an all_reduce of a group on its arena
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

use std::task::{Context, Poll};

use tensorwire_core::collective::arena as plans;
use tensorwire_core::collective::arena_cache::PlanKey;
use tensorwire_core::ports::process_group::{HostMut, Now};

use super::arena::{barrier_word, Exec};
use super::*;

impl Group {
    /// [`ProcessGroup::run_now`] (see the module's docs).
    pub(super) fn now<'a>(&'a self, op: Op<'a>, cx: &mut Context<'_>) -> Now<'a> {
        if !matches!(op, Op::Barrier | Op::AllReduce { .. }) || !self.alone_on_arena(&op) {
            return Now::Later(self.run_op(op));
        }
        let Poll::Ready(coop) = tokio::task::coop::poll_proceed(cx) else {
            // The task's budget is spent: the future yields (its lock sees the same).
            return Now::Later(self.run_op(op));
        };
        let Some(mut turn) = self.try_turn() else {
            return Now::Later(self.run_op(op));
        };
        coop.made_progress();
        let (rank, world) = (self.rank(), self.size());
        match op {
            Op::AllReduce { data, element, op } => {
                let mut data = match data.into_host_mut("all_reduce", self) {
                    Ok(data) => data,
                    Err(e) => return Now::Done(Err(e)),
                };
                let count = match whole_elements("all_reduce", data.len(), element) {
                    Ok(count) => count,
                    Err(e) => return Now::Done(Err(e)),
                };
                let key = PlanKey::all_reduce(count, element, op);
                let make = move |s| plans::all_reduce(rank, world, count, element, op, s);
                let signature = Signature::AllReduce {
                    op,
                    element,
                    count: count as u64,
                }
                .word(&[]);
                let rest = self.arena_now(&mut turn, "all_reduce", key, make, &mut data, signature);
                let finish = move |mut data: HostMut<'a>| {
                    op.finish(element, &mut data, world);
                    data.done()
                };
                match rest {
                    Ok(None) => Now::Done(Ok(finish(data))),
                    Err(e) => Now::Done(Err(e)),
                    Ok(Some(from)) => Now::Later(Box::pin(async move {
                        let buffer = Exec::InPlace(&mut data);
                        let from = Some(from);
                        self.arena_exec(
                            &mut turn,
                            "all_reduce",
                            key,
                            make,
                            buffer,
                            signature,
                            from,
                        )
                        .await?;
                        Ok(finish(data))
                    })),
                }
            }
            _ => {
                let key = PlanKey::barrier();
                let make = move |s| plans::barrier(rank, world, s);
                match self.arena_now(&mut turn, "barrier", key, make, &mut [], barrier_word()) {
                    Ok(None) => Now::Done(Ok(Done::Unit)),
                    Err(e) => Now::Done(Err(e)),
                    Ok(Some(from)) => Now::Later(Box::pin(async move {
                        let buffer = Exec::InPlace(&mut []);
                        let (signature, from) = (barrier_word(), Some(from));
                        self.arena_exec(&mut turn, "barrier", key, make, buffer, signature, from)
                            .await?;
                        Ok(Done::Unit)
                    })),
                }
            }
        }
    }
}
