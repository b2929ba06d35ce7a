//! Work handles: an operation started on a [`ProcessGroup`](super::ProcessGroup) and completed
//! later (c10d's `Work`).

use std::time::Duration;

use super::{Done, ProcessGroupError};

/// An operation in progress, as a future of its result.
pub type Pending<'a, T> =
    std::pin::Pin<Box<dyn std::future::Future<Output = Result<T, ProcessGroupError>> + Send + 'a>>;

/// What [`ProcessGroup::run_now`](super::ProcessGroup::run_now) did with an operation: ran it
/// to its end in the call, or gave the future that runs it (or its rest).
#[must_use = "a `Later` is the operation's rest: the peers wait for it"]
pub enum Now<'a> {
    /// Finished in the call: its result.
    Done(Result<Done, ProcessGroupError>),
    /// Issued (it has its place in the group's sequence, and may have begun): await the
    /// future for the result, as [`run_op`](super::ProcessGroup::run_op)'s.
    Later(Pending<'a, Done>),
}

impl std::fmt::Debug for Now<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Now::Done(r) => f.debug_tuple("Done").field(r).finish(),
            Now::Later(_) => f.write_str("Later(..)"),
        }
    }
}

/// What [`ProcessGroup::start`](super::ProcessGroup::start) returns: the operation's handle.
pub type Started<'a> = Box<dyn WorkHandle<'a, Done> + 'a>;

/// A collective issued on a [`ProcessGroup`](super::ProcessGroup) and completed later (c10d's
/// `Work`, as the `async_op=True` collectives return it).
///
/// | c10d's `Work` | here |
/// | --- | --- |
/// | `is_completed()` | [`is_completed`](Self::is_completed) |
/// | `exception()` | [`error`](Self::error) |
/// | `is_success()` | `is_completed() && error().is_none()` |
/// | `wait(timeout)`, then `result()` | [`wait`](Self::wait), which gives the result |
pub trait WorkHandle<'a, T>: Send + 'a {
    /// Whether the collective has finished, successfully or not, without waiting.
    fn is_completed(&mut self) -> bool;

    /// The collective's error, once it has finished with one (`None` while it runs or after
    /// it succeeded).
    fn error(&mut self) -> Option<ProcessGroupError>;

    /// Waits for the result, at most `timeout` where the backend has a timer (see
    /// [`ProcessGroup::spawn`](super::ProcessGroup::spawn)): when it passes first, the
    /// collective times out with [`ProcessGroupError::Timeout`] naming the ranks it waited
    /// for. Once [`is_completed`](Self::is_completed) has said `true`, the future is ready at
    /// its first poll (the handle keeps the result it finished with).
    fn wait(self: Box<Self>, timeout: Duration) -> Pending<'a, T>;
}

/// A handle on `future`, polled once here (where a collective takes its place in the group's
/// sequence), then whenever the handle is asked ([`is_completed`](WorkHandle::is_completed),
/// [`error`](WorkHandle::error)) or waited on. Its `wait` is bounded by the group's own
/// timeout, not its argument (it has no timer).
pub fn lazy<'a, T: Send + 'a>(future: Pending<'a, T>) -> Box<dyn WorkHandle<'a, T> + 'a> {
    Box::new(LazyWork::new(future))
}

/// A handle that has already finished with `error` (an operation refused in the call).
pub fn failed<'a, T: Send + 'a>(error: ProcessGroupError) -> Box<dyn WorkHandle<'a, T> + 'a> {
    Box::new(LazyWork {
        future: None,
        done: Some(Err(error)),
    })
}

/// `work` with `f` applied to its result, as soon as `work` has finished: `is_completed` and
/// `error` report the mapped result (an error `f` finds shows there too).
pub fn map<'a, T, U, F>(
    work: Box<dyn WorkHandle<'a, T> + 'a>,
    f: F,
) -> Box<dyn WorkHandle<'a, U> + 'a>
where
    T: Send + 'a,
    U: Send + 'a,
    F: FnOnce(T) -> Result<U, ProcessGroupError> + Send + 'a,
{
    Box::new(Mapped {
        state: MapState::Running(work),
        f: Some(f),
    })
}

/// The default [`WorkHandle`] ([`lazy`]): the collective's future, polled when the handle is
/// issued, asked or waited on.
pub(super) struct LazyWork<'a, T> {
    future: Option<Pending<'a, T>>,
    done: Option<Result<T, ProcessGroupError>>,
}

impl<'a, T: Send + 'a> LazyWork<'a, T> {
    /// Issues `future`: its first poll (where a collective takes its place) happens here.
    pub(super) fn new(future: Pending<'a, T>) -> Self {
        let mut work = LazyWork {
            future: Some(future),
            done: None,
        };
        work.poll_once();
        work
    }

    fn poll_once(&mut self) {
        if let Some(future) = self.future.as_mut() {
            let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
            if let std::task::Poll::Ready(result) = future.as_mut().poll(&mut cx) {
                self.done = Some(result);
                self.future = None;
            }
        }
    }
}

impl<'a, T: Send + 'a> WorkHandle<'a, T> for LazyWork<'a, T> {
    fn is_completed(&mut self) -> bool {
        self.poll_once();
        self.done.is_some()
    }

    fn error(&mut self) -> Option<ProcessGroupError> {
        self.poll_once();
        self.done.as_ref().and_then(|r| r.as_ref().err().cloned())
    }

    fn wait(self: Box<Self>, _timeout: Duration) -> Pending<'a, T> {
        match *self {
            LazyWork {
                done: Some(result), ..
            } => Box::pin(std::future::ready(result)),
            LazyWork {
                future: Some(future),
                ..
            } => future,
            LazyWork { .. } => Box::pin(std::future::ready(Err(ProcessGroupError::ShutDown))),
        }
    }
}

/// A handle whose result goes through `f`: as soon as the handle it wraps has finished (asked
/// with `is_completed` or `error`), so that what they say is the mapped result's.
struct Mapped<'a, T, U, F> {
    state: MapState<'a, T, U>,
    f: Option<F>,
}

enum MapState<'a, T, U> {
    Running(Box<dyn WorkHandle<'a, T> + 'a>),
    /// Finished, its result not yet taken (a handle that broke its contract and was not ready
    /// at once).
    Taking(Pending<'a, T>),
    Done(Result<U, ProcessGroupError>),
}

impl<'a, T, U, F> Mapped<'a, T, U, F>
where
    T: Send + 'a,
    U: Send + 'a,
    F: FnOnce(T) -> Result<U, ProcessGroupError> + Send + 'a,
{
    /// Takes the wrapped handle's result once it has finished, and maps it.
    fn settle(&mut self) {
        let finished = match &mut self.state {
            MapState::Running(work) => work.is_completed(),
            MapState::Taking(_) => true,
            MapState::Done(_) => return,
        };
        if !finished {
            return;
        }
        let mut taking = match std::mem::replace(
            &mut self.state,
            MapState::Done(Err(ProcessGroupError::ShutDown)),
        ) {
            MapState::Running(work) => work.wait(Duration::ZERO),
            MapState::Taking(taking) => taking,
            MapState::Done(_) => unreachable!("returned above"),
        };
        let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
        self.state = match taking.as_mut().poll(&mut cx) {
            std::task::Poll::Ready(result) => {
                let f = self.f.take().expect("mapped once");
                MapState::Done(result.and_then(f))
            }
            std::task::Poll::Pending => MapState::Taking(taking),
        };
    }
}

impl<'a, T, U, F> WorkHandle<'a, U> for Mapped<'a, T, U, F>
where
    T: Send + 'a,
    U: Send + 'a,
    F: FnOnce(T) -> Result<U, ProcessGroupError> + Send + 'a,
{
    fn is_completed(&mut self) -> bool {
        self.settle();
        matches!(self.state, MapState::Done(_))
    }

    fn error(&mut self) -> Option<ProcessGroupError> {
        self.settle();
        match &self.state {
            MapState::Done(Err(e)) => Some(e.clone()),
            _ => None,
        }
    }

    fn wait(self: Box<Self>, timeout: Duration) -> Pending<'a, U> {
        let Mapped { state, f } = *self;
        match (state, f) {
            (MapState::Done(result), _) => Box::pin(std::future::ready(result)),
            (MapState::Running(work), Some(f)) => {
                let result = work.wait(timeout);
                Box::pin(async move { f(result.await?) })
            }
            (MapState::Taking(taking), Some(f)) => Box::pin(async move { f(taking.await?) }),
            (_, None) => Box::pin(std::future::ready(Err(ProcessGroupError::ShutDown))),
        }
    }
}
