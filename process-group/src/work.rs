//! [`Work`]: an operation issued now and completed later, on a task of its own (PyTorch's
//! `Work`, as `async_op=True` collectives and `isend`/`irecv` return it).
//!
//! # Issuing
//! [`Group::issue`](crate::Group::issue), like every call that returns a [`Work`], polls the
//! operation's future once, on the caller's task: a collective checks its arguments and takes
//! its sequence numbers in that first poll, before it awaits anything, so **the call that returns the `Work` is the ordering point**. What is left runs
//! on a spawned task, which makes progress whether or not anyone waits on the `Work`.
//!
//! # Timeouts
//! Every operation has its group's timeout. [`Work::wait`] takes another, shorter or longer:
//! when it passes first, the operation is made to time out at once, as if its own deadline had
//! come, and fails with [`ProcessGroupError::Timeout`] naming the ranks whose messages it was
//! still waiting for. A collective that times out either way breaks its group on this rank
//! (the ranks no longer agree where the group's collectives stand): every later collective
//! here fails with that same error. The other ranks that joined it are not told; they fail
//! when their own timeout passes, or on their next collective that needs this rank.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll, Waker};
use std::time::Duration;

use tensorwire_core::ports::process_group::{Pending, ProcessGroupError, WorkHandle};
use tensorwire_core::ports::runtime::Runtime;
use tokio::sync::watch;
use tokio::task::JoinHandle;

tokio::task_local! {
    /// The expiry of the `Work` whose task runs the current future.
    static EXPIRY: Arc<watch::Sender<Option<Duration>>>;
}

/// Resolves, with the timeout that passed, once a [`Work::wait`] gives up on the operation
/// running on the current task; never for an operation that no `Work` runs. Subscribes when
/// called, so call it when the operation starts (its first poll).
pub(crate) fn expired() -> impl Future<Output = Duration> + Send + 'static {
    let receiver = EXPIRY.try_with(|e| e.subscribe()).ok();
    async move {
        if let Some(mut receiver) = receiver {
            if let Ok(after) = receiver.wait_for(Option::is_some).await {
                if let Some(after) = *after {
                    return after;
                }
            }
        }
        std::future::pending().await
    }
}

/// Runs `operation` bounded by `timeout` and by the current [`Work`]'s wait: `Err` with the
/// bound that passed first.
pub(crate) async fn bounded<T>(
    rt: &dyn Runtime,
    timeout: Duration,
    operation: impl Future<Output = T>,
) -> Result<T, Duration> {
    tokio::select! {
        biased;
        r = rt.timeout(timeout, operation) => r.map_err(|_| timeout),
        after = expired() => Err(after),
    }
}

/// An operation in progress: a collective issued with [`Group::issue`](crate::Group::issue)
/// (or one of its `*_work` shorthands), or an `isend`/`irecv` (boxed as a future).
///
/// It runs on its own task from the moment it is issued. Wait for its result with
/// [`wait`](Work::wait) (bounded) or by awaiting it (bounded by the group's timeout); ask
/// [`is_completed`](Work::is_completed) without waiting. Dropping a `Work` does not cancel the
/// operation (a collective cut off halfway would leave its peers waiting): it runs to the end,
/// and its result is lost.
///
/// ```no_run
/// # async fn demo(group: tensorwire_process_group::Group) -> Result<(), Box<dyn std::error::Error>> {
/// use std::time::Duration;
/// use tensorwire_core::collective::ReduceOp;
/// let a = group.all_reduce_typed_work(vec![1.0f32; 4], ReduceOp::Sum); // issued here
/// let b = group.barrier_work();                                        // then this one
/// // ... other work; both make progress meanwhile ...
/// b.wait(Duration::from_secs(60)).await?;
/// assert!(a.is_completed() || !a.is_completed()); // no waiting
/// let sums = a.wait(Duration::from_secs(60)).await?;
/// # Ok(()) }
/// ```
#[must_use = "wait for the Work to learn whether the operation succeeded"]
#[derive(Debug)]
pub struct Work<T> {
    state: State<T>,
}

#[derive(Debug)]
enum State<T> {
    /// Finished when it was issued (refused, or done in its first poll).
    Done(Option<Result<T, ProcessGroupError>>),
    Running {
        task: JoinHandle<Result<T, ProcessGroupError>>,
        /// The clock `wait`'s timeout runs on (the group's).
        runtime: Arc<dyn Runtime>,
        expiry: Arc<watch::Sender<Option<Duration>>>,
        /// The rank named if the task ends abnormally.
        rank: usize,
        what: &'static str,
    },
}

impl<T: Send + 'static> Work<T> {
    /// Issues `operation`: polls it once here (where a collective takes its place in the
    /// sequence), then runs the rest on a spawned task. `what` and `rank` name it should the
    /// task end abnormally.
    pub(crate) fn issue(
        runtime: Arc<dyn Runtime>,
        what: &'static str,
        rank: usize,
        operation: impl Future<Output = Result<T, ProcessGroupError>> + Send + 'static,
    ) -> Self {
        let expiry = Arc::new(watch::Sender::new(None));
        let mut operation = Box::pin(EXPIRY.scope(expiry.clone(), operation));
        let mut cx = Context::from_waker(Waker::noop());
        let state = match operation.as_mut().poll(&mut cx) {
            Poll::Ready(result) => State::Done(Some(result)),
            // The task's first poll registers its own wakers in place of the no-op one.
            Poll::Pending => State::Running {
                task: tokio::spawn(operation),
                runtime,
                expiry,
                rank,
                what,
            },
        };
        Work { state }
    }
}

impl<T> Work<T> {
    /// Whether the operation has finished (successfully or not), without waiting.
    pub fn is_completed(&self) -> bool {
        match &self.state {
            State::Done(_) => true,
            State::Running { task, .. } => task.is_finished(),
        }
    }

    /// Waits for the result, at most `timeout`: when it passes first, the operation times out
    /// at once and fails with [`ProcessGroupError::Timeout`] naming the ranks it was waiting
    /// for (breaking the group, as any timed-out collective; see the [module docs](self)).
    ///
    /// # Errors
    /// The operation's error, or the timeout.
    pub async fn wait(mut self, timeout: Duration) -> Result<T, ProcessGroupError> {
        if let State::Running {
            task,
            runtime,
            expiry,
            rank,
            what,
        } = &mut self.state
        {
            match runtime.clone().timeout(timeout, &mut *task).await {
                Ok(joined) => return ended(joined, *rank, what),
                // The task sees this and fails the operation; it then ends soon.
                Err(_) => {
                    expiry.send_replace(Some(timeout));
                }
            }
        }
        self.await
    }
}

impl<T: Send + 'static> Work<T> {
    /// Takes the result of a finished task into the `Work` (without waiting), so that it can
    /// be looked at and still be returned by `wait`.
    fn settle(&mut self) {
        if let State::Running {
            task, rank, what, ..
        } = &mut self.state
        {
            if task.is_finished() {
                let mut cx = Context::from_waker(Waker::noop());
                if let Poll::Ready(joined) = Pin::new(&mut *task).poll(&mut cx) {
                    let result = ended(joined, *rank, what);
                    self.state = State::Done(Some(result));
                }
            }
        }
    }

    /// The operation's error, once it has finished with one (c10d's `Work.exception()`);
    /// `None` while it runs or after it succeeded. The result stays for [`wait`](Self::wait).
    pub fn error(&mut self) -> Option<ProcessGroupError> {
        self.settle();
        match &self.state {
            State::Done(Some(Err(e))) => Some(e.clone()),
            _ => None,
        }
    }
}

/// A `Work` behind the port, for collectives issued on a `dyn ProcessGroup`: it runs on its
/// own task, and `wait`'s timeout makes it time out.
impl<'a, T: Send + 'static> WorkHandle<'a, T> for Work<T> {
    /// Keeps the result of a finished task, so that `wait` gives it at its first poll.
    fn is_completed(&mut self) -> bool {
        self.settle();
        Work::is_completed(self)
    }

    fn error(&mut self) -> Option<ProcessGroupError> {
        Work::error(self)
    }

    fn wait(self: Box<Self>, timeout: Duration) -> Pending<'a, T> {
        Box::pin(Work::wait(*self, timeout))
    }
}

// A `Work` never pins its result: it only moves it out once finished.
impl<T> Unpin for Work<T> {}

impl<T> Future for Work<T> {
    type Output = Result<T, ProcessGroupError>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        match &mut self.get_mut().state {
            State::Done(result) => Poll::Ready(result.take().unwrap_or(Err(
                ProcessGroupError::ShutDown, // polled again after it returned its result
            ))),
            State::Running {
                task, rank, what, ..
            } => Pin::new(task)
                .poll(cx)
                .map(|joined| ended(joined, *rank, what)),
        }
    }
}

/// The result of a `Work`'s task as it ended.
fn ended<T>(
    joined: Result<Result<T, ProcessGroupError>, tokio::task::JoinError>,
    rank: usize,
    what: &'static str,
) -> Result<T, ProcessGroupError> {
    joined.unwrap_or_else(|e| {
        Err(ProcessGroupError::TaskFailed {
            collective: what,
            rank,
            panicked: e.is_panic(),
        })
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicBool, Ordering};

    #[tokio::test(start_paused = true)]
    async fn the_issuing_call_runs_the_first_poll_and_a_task_the_rest() {
        let started = Arc::new(AtomicBool::new(false));
        let (tx, rx) = tokio::sync::oneshot::channel::<u32>();
        let flag = started.clone();
        let work = Work::issue(
            Arc::new(tensorwire_mesh::TokioRuntime),
            "test",
            0,
            async move {
                flag.store(true, Ordering::SeqCst);
                rx.await.map_err(|_| ProcessGroupError::ShutDown)
            },
        );
        assert!(
            started.load(Ordering::SeqCst),
            "started in the issuing call"
        );
        assert!(!work.is_completed());
        tx.send(5).unwrap();
        // Nobody polls the Work: its task finishes by itself.
        while !work.is_completed() {
            tokio::task::yield_now().await;
        }
        assert_eq!(work.wait(Duration::from_secs(1)).await, Ok(5));
    }

    #[tokio::test(start_paused = true)]
    async fn a_wait_that_passes_first_makes_the_operation_time_out_with_its_timeout() {
        let work = Work::issue(Arc::new(tensorwire_mesh::TokioRuntime), "test", 0, async {
            // What the executor does: its timer also goes off when the wait gives up.
            let r = bounded(
                &tensorwire_mesh::TokioRuntime,
                Duration::from_secs(3600),
                std::future::pending::<()>(),
            )
            .await;
            Err::<(), _>(ProcessGroupError::Timeout {
                collective: "test",
                seq: 0,
                rank: 0,
                waiting_on: vec![3],
                timeout: r.unwrap_err(),
            })
        });
        let err = work.wait(Duration::from_millis(250)).await.unwrap_err();
        assert_eq!(
            err.to_string(),
            "test #0 on rank 0 timed out after 250ms waiting for rank(s) 3"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn outside_a_work_only_the_operations_own_timeout_applies() {
        let r = bounded(
            &tensorwire_mesh::TokioRuntime,
            Duration::from_millis(40),
            std::future::pending::<()>(),
        )
        .await;
        assert_eq!(r, Err(Duration::from_millis(40)));
        let done = Work::issue(Arc::new(tensorwire_mesh::TokioRuntime), "test", 0, async {
            Ok::<_, ProcessGroupError>(1)
        });
        assert!(done.is_completed(), "finished in its first poll");
        assert_eq!(done.await, Ok(1));
    }
}
