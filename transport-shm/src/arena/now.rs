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

    /// Where it stopped and what it ran (for the tests).
    #[cfg(test)]
    pub(super) fn parts(&self) -> (At, Option<(u64, usize, usize)>) {
        (self.at, self.ran)
    }

    /// Where [`Arena::advance`] leaves a run of `plan` (one that only signals) that published
    /// its phase (`published`: its half and number) and spent the spin budget waiting.
    pub(super) fn signal_spun(plan: &ArenaPlan, published: (usize, u64), signature: u64) -> Self {
        Unfinished {
            at: At {
                phase: 0,
                published: Some(published),
                copied: true,
                spun: true,
            },
            ran: Some((signature, plan.buffer_len(), plan.phases().len())),
        }
    }
}

/// A run of [`Arena::try_run_fresh`] that a wait's spin budget left unfinished: the run's own
/// buffer as far as it is written, and where it stopped. Give it to [`Arena::resume_fresh`] with
/// the same plan and signature, before the arena runs anything else.
#[derive(Debug)]
#[must_use = "the run is finished by `Arena::resume_fresh`: the other ranks wait for it"]
pub struct UnfinishedFresh {
    /// The buffer: its allocation holds the plan's length; initialised (and its length set)
    /// only when the plan does not fill it (then it was cleared before the input went in).
    buffer: Vec<u8>,
    rest: Unfinished,
}

impl Arena {
    /// [`Arena::try_run`] over a buffer of the run's own that starts with `input` in the plan's
    /// input range, as [`Arena::run_fresh`] makes it (never cleared when the plan fills it):
    /// `Ok(buffer)` when the plan ran to its end, else where it stopped (finish it with
    /// [`Arena::resume_fresh`]).
    ///
    /// # Errors
    /// As [`Arena::run_fresh`].
    pub fn try_run_fresh(
        &mut self,
        plan: &ArenaPlan,
        input: &[u8],
        signature: u64,
    ) -> Result<Result<Vec<u8>, UnfinishedFresh>, ArenaError> {
        let mut buffer = match Fresh::start(plan, input)? {
            Fresh::Zeroed(mut buffer) => {
                return Ok(match self.try_run(plan, &mut buffer, signature)? {
                    None => Ok(buffer),
                    Some(rest) => Err(UnfinishedFresh { buffer, rest }),
                });
            }
            Fresh::Filled(buffer) => buffer,
        };
        let len = plan.buffer_len();
        self.check_plan(plan, len)?;
        if let Some(failure) = self.reported() {
            return Err(self.failed(failure));
        }
        let raw = Fresh::with_input(&mut buffer, plan, input);
        let mut at = At::START;
        // The plan fills its buffer (core's check above): it draws only on bytes the input or
        // its own reads have written (see `Arena::run_fresh`).
        match self.advance(plan, raw, &mut at, signature, Look::Spin) {
            Ok(None) => {
                // SAFETY: the plan ran to its end, and a plan that fills its buffer has then
                // written every byte of it.
                unsafe { buffer.set_len(len) };
                Ok(Ok(buffer))
            }
            Ok(Some(_)) => {
                at.spun = true;
                let ran = Some((signature, len, plan.phases().len()));
                Ok(Err(UnfinishedFresh {
                    buffer,
                    rest: Unfinished { at, ran },
                }))
            }
            Err(failure) => Err(self.failed(failure)),
        }
    }

    /// Finishes the run [`Arena::try_run_fresh`] left (the same plan and signature, nothing
    /// run through the arena in between) as [`Arena::resume`] does, and returns its buffer.
    ///
    /// # Errors
    /// As [`Arena::resume`].
    pub async fn resume_fresh(
        &mut self,
        plan: &ArenaPlan,
        from: UnfinishedFresh,
        bounds: &Bounds<'_>,
        give_up: GiveUp<'_>,
    ) -> Result<Vec<u8>, ArenaError> {
        let UnfinishedFresh { mut buffer, rest } = from;
        if buffer.len() == plan.buffer_len() {
            self.resume(plan, &mut buffer, bounds, give_up, rest)
                .await?;
            return Ok(buffer);
        }
        let len = plan.buffer_len();
        self.check_plan(plan, len)?;
        let ran = (bounds.signature, len, plan.phases().len());
        if rest.ran != Some(ran) || !plan.fills_buffer() || buffer.capacity() < len {
            return Err(ArenaError::PlanMismatch {
                plan_world: plan.world(),
                plan_slot: plan.slot_bytes(),
            });
        }
        let raw = Buffer {
            ptr: buffer.as_mut_ptr(),
            len,
        };
        // SAFETY: the allocation holds `len` bytes (checked), the input and what the run read
        // so far are in it, and the plan fills its buffer (checked): as in `Arena::run_fresh`.
        // The allocation does not move while the run goes on (only the vector's handle may).
        unsafe { self.run_over(plan, raw, bounds, give_up, rest.at) }.await?;
        // SAFETY: the plan ran to its end, and a plan that fills its buffer has then written
        // every byte of it.
        unsafe { buffer.set_len(len) };
        Ok(buffer)
    }

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
    #[inline]
    pub fn try_run(
        &mut self,
        plan: &ArenaPlan,
        buffer: &mut [u8],
        signature: u64,
    ) -> Result<Option<Unfinished>, ArenaError> {
        // A plan that only signals takes its own short path (a function of its own, which
        // saves and restores fewer registers than the general step's caller).
        if plan.signals_only() && buffer.is_empty() {
            return self.try_signal(plan, signature);
        }
        self.try_run_steps(plan, buffer, signature)
    }

    /// [`Arena::try_run`] through the general step ([`Arena::advance`]).
    fn try_run_steps(
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
