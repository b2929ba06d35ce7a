//! Leaving a context: the release without waiting, and the release on drop.

use tracing::Instrument;

use crate::{AutogradContext, AutogradEngine, DistAutogradError};

impl<E: AutogradEngine> AutogradContext<E> {
    /// Releases the context here, once, for [`release`](Self::release),
    /// [`release_in_background`](Self::release_in_background) and the drop: whether a release
    /// started (its messages to the other workers are then the caller's to send). A context
    /// a failure dropped earlier is not an error: the cause kept for this handle goes.
    pub(crate) fn release_here(&mut self) -> Result<bool, DistAutogradError> {
        self.owned = false;
        let mut sh = self.inner.lock();
        if sh.state.has_context(self.id) {
            sh.state.release(self.id)?;
            Ok(true)
        } else {
            sh.state.forget(self.id);
            Ok(false)
        }
    }

    /// Releases the context here now and tells every worker it reached without waiting for
    /// their answers (PyTorch's `DistAutogradContainer::releaseContext`, whose cleanup
    /// messages are not waited for either): the release fan-out costs the caller no round
    /// trip. The other workers drop the context once the release reaches them; an error there
    /// is logged, and a peer found lost meanwhile is handled as by any other message. Calls
    /// made afterwards in other contexts may overtake the release; a late gradient for the
    /// context is dropped and counted as usual. Releasing a context already released (a
    /// failed backward releases it) is not an error. Must be called inside a tokio runtime
    /// (the fan-out is a task); [`release`](Self::release) waits for it instead.
    pub fn release_in_background(mut self) -> Result<(), DistAutogradError> {
        let started = self.release_here()?;
        if started {
            // The local drop happens here (pump_collect frees the context's tensors); only
            // the messages to the other workers are left to the task.
            let releases = self.inner.pump_collect();
            let waits = {
                let _span = self.span.enter();
                self.inner.start_releases(releases)
            };
            if !waits.is_empty() {
                let inner = self.inner.clone();
                let span = self.span.clone();
                tokio::spawn(async move { inner.await_releases(waits).instrument(span).await });
            }
        }
        Ok(())
    }
}

impl<E: AutogradEngine> Drop for AutogradContext<E> {
    fn drop(&mut self) {
        if !self.owned {
            return;
        }
        let released = self.release_here().unwrap_or(false);
        if released {
            if let Ok(rt) = tokio::runtime::Handle::try_current() {
                let inner = self.inner.clone();
                rt.spawn(async move { inner.pump_and_wait_releases().await });
            }
        }
    }
}
