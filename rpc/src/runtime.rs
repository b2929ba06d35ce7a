//! The runtime the agent reads time from, waits on and spawns with: core's
//! [`Runtime`] port, injected once through
//! [`RpcOptions::runtime`](crate::RpcOptions) and shared with the mesh the agent runs on. The
//! default, [`TokioRuntime`], is tokio's clock (real time in production, virtual time under a
//! paused runtime, where agent tests then run without real sleeps).
//!
//! The agent's own tasks (readers, writers, handlers) are tracked in tokio `JoinSet`s, so
//! that shutdown can end and await them; [`Runtime::spawn`] is for the tasks that must outlive
//! the caller's (the last stage of a shutdown).

pub use tensorwire_core::ports::runtime::{BoxFuture, Runtime};
pub use tensorwire_mesh::TokioRuntime;

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn a_spawned_task_runs_to_its_end_and_is_awaited() {
        let rt: &dyn Runtime = &TokioRuntime;
        let (tx, rx) = tokio::sync::oneshot::channel();
        rt.spawn(Box::pin(async move {
            let _ = tx.send(42);
        }))
        .await;
        assert_eq!(rx.await, Ok(42));
    }
}
