//! A plan that only signals on the synchronous path ([`Arena::try_run`]): core says so when it
//! makes the plan ([`ArenaPlan::signals_only`]: a barrier's one phase, nothing copied), and
//! its run is then one publication and one wait, without the general step's
//! ([`Arena::advance`]) copies, reads and bookkeeping. Where the wait does not end within the
//! spin budget, the run stops exactly where the general step would have stopped it (its
//! phase published, waiting for its ranks), so that [`Arena::resume`] finishes it with the
//! waits of every other plan (sleep, deadline, liveness, failures).

use super::*;

impl Arena {
    /// [`Arena::try_run`] of a plan that [`ArenaPlan::signals_only`] (over an empty buffer):
    /// checks the plan against this arena and the disagreements reported, as for every plan;
    /// then publishes its phase, waits for its `waits_on` for the spin budget and checks their
    /// signatures.
    pub(super) fn try_signal(
        &mut self,
        plan: &ArenaPlan,
        signature: u64,
    ) -> Result<Option<Unfinished>, ArenaError> {
        debug_assert!(plan.signals_only());
        self.check_plan(plan, 0)?;
        if let Some(failure) = self.reported() {
            return Err(self.failed(failure));
        }
        let phase = &plan.phases()[0];
        let published = self.publish(signature, false, phase);
        if !self.reached(&phase.waits_on, self.state.phase_target(), Look::Spin) {
            return Ok(Some(Unfinished::signal_spun(plan, published, signature)));
        }
        match self.check_signatures(&phase.waits_on, published, signature) {
            Ok(()) => Ok(None),
            Err(failure) => Err(self.failed(failure)),
        }
    }
}
