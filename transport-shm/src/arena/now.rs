//! The arena's synchronous path: a plan's phases run in the caller's call, without a future,
//! as long as each wait ends within the spin budget ([`Arena::try_run`]); where one does not,
//! the run stops as it stands ([`Unfinished`]) and [`Arena::resume`] finishes it with the
//! waits of [`Arena::run`] (sleeps, deadline, liveness, the caller's bound), starting with the
//! sleep: the budget was spent.
//!
//! No clock but the spin budget's is read on the synchronous part: the deadline ([`Bounds`])
//! is only made by the caller once it resumes, so a collective's timeout counts from there (at
//! most a spin budget per phase after it began).

use super::*;

/// Where a run of a plan stands: the next phase, and whether this rank has published it
/// (with the half and the number of the phase, for the signature check after the wait).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct At {
    /// The phase it is in.
    pub(super) phase: usize,
    /// The phase's half and number once this rank published it.
    pub(super) published: Option<(usize, u64)>,
    /// Whether the plan's local copy was made.
    pub(super) copied: bool,
    /// Whether it stopped after spending the spin budget on the wait it stopped at.
    pub(super) spun: bool,
}

impl At {
    /// A run that has not begun.
    pub(super) const START: At = At {
        phase: 0,
        published: None,
        copied: false,
        spun: false,
    };

    /// Whether nothing of the run was done.
    pub(super) fn is_start(&self) -> bool {
        self.phase == 0 && self.published.is_none() && !self.copied
    }
}

/// How [`Arena::advance`] looks at the counters it waits for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Look {
    /// Once: a wait not over stops the run there.
    Once,
    /// For the spin budget, polling or yielding as the arena's [`SpinPolicy`] says, then
    /// stops it.
    Spin,
}

/// What a run stopped at.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Blocked {
    /// The readers of this rank's half, before it writes it again
    /// ([`ArenaState::free_wait`]).
    Free,
    /// The ranks of the phase's `waits_on`, after this rank published it.
    Phase,
}

/// A run of [`Arena::try_run`] that a wait's spin budget left unfinished: give it to
/// [`Arena::resume`] with the same plan, buffer and signature, before the arena runs anything
/// else.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[must_use = "the run is finished by `Arena::resume`: the other ranks wait for it"]
pub struct Unfinished {
    at: At,
    /// What it ran: the signature, the plan's buffer length and phases (a plan that does not
    /// match is refused).
    ran: Option<(u64, usize, usize)>,
}

impl Unfinished {
    /// A run that has not begun: [`Arena::resume`] runs the whole plan, as [`Arena::run`]
    /// does (for a caller that decides not to run it now).
    pub const NOT_BEGUN: Unfinished = Unfinished {
        at: At::START,
        ran: None,
    };
}

impl Arena {
    /// Runs `plan` over `buffer` (of the plan's length, input in place) as [`Arena::run`]
    /// does, in this call and without a future, for as long as each wait ends within the
    /// spin budget: `None` when the plan ran to its end, else where it stopped (finish it
    /// with [`Arena::resume`]). Nothing here reads a clock but the spin budget's, sleeps or
    /// allocates; the waits poll or yield as the arena's spin policy says (core's
    /// [`SpinPolicy::for_host`]), without handing the caller's runtime a turn: a caller on
    /// an async runtime spends up to a spin budget per phase in one poll.
    ///
    /// # Errors
    /// As [`Arena::run`]: a failure seen without waiting (a disagreement reported or seen in
    /// a signature, an earlier failure), or a plan that does not fit.
    pub fn try_run(
        &mut self,
        plan: &ArenaPlan,
        buffer: &mut [u8],
        signature: u64,
    ) -> Result<Option<Unfinished>, ArenaError> {
        self.check_plan(plan, buffer.len())?;
        if let Some(failure) = self.reported() {
            return Err(self.failed(failure));
        }
        let buffer = Buffer {
            ptr: buffer.as_mut_ptr(),
            len: buffer.len(),
        };
        let mut at = At::START;
        // The slice is initialised and ours for the whole call (see `run_over`).
        match self.advance(plan, buffer, &mut at, signature, Look::Spin) {
            Ok(None) => Ok(None),
            Ok(Some(_)) => {
                at.spun = true;
                let ran = Some((signature, plan.buffer_len(), plan.phases().len()));
                Ok(Some(Unfinished { at, ran }))
            }
            Err(failure) => Err(self.failed(failure)),
        }
    }

    /// Finishes the run of `plan` over `buffer` that [`Arena::try_run`] left at `from`
    /// (the same plan, buffer and signature, nothing run through the arena in between), with
    /// the waits of [`Arena::run`] within `bounds` or until `give_up` resolves.
    ///
    /// # Errors
    /// As [`Arena::run`]; [`ArenaError::PlanMismatch`] for a signature, plan or buffer that
    /// does not match `from`'s (nothing is run then).
    pub async fn resume(
        &mut self,
        plan: &ArenaPlan,
        buffer: &mut [u8],
        bounds: &Bounds<'_>,
        give_up: GiveUp<'_>,
        from: Unfinished,
    ) -> Result<(), ArenaError> {
        self.check_plan(plan, buffer.len())?;
        let ran = (bounds.signature, plan.buffer_len(), plan.phases().len());
        if from.ran.is_some_and(|r| r != ran) {
            return Err(ArenaError::PlanMismatch {
                plan_world: plan.world(),
                plan_slot: plan.slot_bytes(),
            });
        }
        let buffer = Buffer {
            ptr: buffer.as_mut_ptr(),
            len: buffer.len(),
        };
        // SAFETY: every byte of a slice is initialised, and the slice is ours (borrowed
        // mutably) for the whole call.
        unsafe { self.run_over(plan, buffer, bounds, give_up, from.at) }.await
    }

    /// Whether every rank of `ranks` has published `target`: looked at once, or (`Look::Spin`)
    /// for the spin budget, without a future (see [`Arena::try_run`]).
    pub(super) fn reached(&self, ranks: &[usize], target: u32, look: Look) -> bool {
        let done = || all_reached(ranks, target, |q| self.counter_value(q));
        if done() {
            return true;
        }
        if look == Look::Once {
            return false;
        }
        // The first step at the time the wait began (one clock read fewer per wait).
        let mut now = Instant::now();
        let spin = self.spin.begin(true, now);
        loop {
            match spin.step(now) {
                SpinStep::Poll => {
                    for _ in 0..16 {
                        if done() {
                            return true;
                        }
                        std::hint::spin_loop();
                    }
                }
                SpinStep::Yield => {
                    std::thread::yield_now();
                    if done() {
                        return true;
                    }
                }
                SpinStep::Sleep => return false,
            }
            now = Instant::now();
        }
    }
}
