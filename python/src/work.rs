//! Work handles as Python sees them: an operation issued on a group, its tensors held until it
//! ends, its result waited for without the GIL, and callbacks run when it ends.

use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use pyo3::prelude::*;
use tensorwire_core::ports::process_group::ProcessGroupError;

use crate::{runtime, to_py, TensorwireError};

/// What a finished operation tells its waiter: nothing, or (a receive from any rank) which
/// rank sent.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Outcome {
    Done,
    From(usize),
}

/// A tensor's storage: its address and length in bytes, as `data_ptr()` and `nbytes` gave
/// them. The work that holds a `Raw` also holds the tensor (its `keep` list), so the storage
/// lives until the operation ends; c10d's contract is that nobody else touches the tensor
/// before the work is waited for.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Raw {
    pub(crate) ptr: usize,
    pub(crate) len: usize,
}

impl Raw {
    /// # Safety
    /// The tensor must be alive and not written by anyone else meanwhile.
    pub(crate) unsafe fn bytes<'a>(&self) -> &'a [u8] {
        if self.len == 0 {
            return &[];
        }
        // SAFETY: the caller's promise; a non-empty tensor's data_ptr is non-null.
        unsafe { std::slice::from_raw_parts(self.ptr as *const u8, self.len) }
    }

    /// # Safety
    /// The tensor must be alive and not read or written by anyone else meanwhile.
    #[allow(clippy::mut_from_ref)]
    pub(crate) unsafe fn bytes_mut<'a>(&self) -> &'a mut [u8] {
        if self.len == 0 {
            return &mut [];
        }
        // SAFETY: as in `bytes`.
        unsafe { std::slice::from_raw_parts_mut(self.ptr as *mut u8, self.len) }
    }

    /// `parts` equal consecutive pieces of this storage.
    pub(crate) fn split(&self, parts: usize) -> Vec<Raw> {
        let each = self.len / parts.max(1);
        (0..parts)
            .map(|i| Raw {
                ptr: self.ptr + i * each,
                len: each,
            })
            .collect()
    }
}

/// Runs `pending` to completion, polling every one of them at each wake-up in list order, so
/// that all of them are issued (take their places in the group's order) in the first poll,
/// as a group's contract asks; returns their results in order, or the first error.
pub(crate) async fn all_in_order<T, F>(pending: Vec<F>) -> Result<Vec<T>, ProcessGroupError>
where
    F: Future<Output = Result<T, ProcessGroupError>>,
{
    // Each future pinned in its own box, with the value it gave once it has.
    let mut slots: Vec<_> = pending
        .into_iter()
        .map(|f| (Some(Box::pin(f)), None::<T>))
        .collect();
    std::future::poll_fn(move |cx: &mut Context<'_>| {
        let mut done = true;
        for (future, out) in slots.iter_mut() {
            if let Some(f) = future {
                match f.as_mut().poll(cx) {
                    Poll::Ready(Ok(value)) => {
                        *out = Some(value);
                        *future = None;
                    }
                    Poll::Ready(Err(e)) => return Poll::Ready(Err(e)),
                    Poll::Pending => done = false,
                }
            }
        }
        if done {
            Poll::Ready(Ok(slots.iter_mut().filter_map(|(_, v)| v.take()).collect()))
        } else {
            Poll::Pending
        }
    })
    .await
}

/// What runs when an operation ends.
enum Callback {
    /// `callback()`.
    Call(Py<PyAny>),
    /// `future.set_result(value)` on success, else `otherwise()` (which maps the error).
    Resolve {
        future: Py<PyAny>,
        value: Py<PyAny>,
        otherwise: Py<PyAny>,
    },
}

impl Callback {
    fn run(self, py: Python<'_>, ok: bool) {
        let (callable, result) = match self {
            Callback::Call(callback) => {
                let result = callback.call0(py);
                (callback, result)
            }
            Callback::Resolve { future, value, .. } if ok => {
                let result = future.call_method1(py, "set_result", (value,));
                (future, result)
            }
            Callback::Resolve { otherwise, .. } => {
                let result = otherwise.call0(py);
                (otherwise, result)
            }
        };
        if let Err(e) = result {
            e.write_unraisable(py, Some(callable.bind(py)));
        }
    }
}

#[derive(Default)]
struct State {
    result: Option<Result<Outcome, ProcessGroupError>>,
    callbacks: Vec<Callback>,
}

#[derive(Default)]
struct Shared {
    state: Mutex<State>,
    ended: Condvar,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// An operation issued on a group: `wait`, `is_completed`, and callbacks when it ends.
#[pyclass(module = "tensorwire._native", frozen)]
pub(crate) struct Work {
    shared: Arc<Shared>,
}

impl Work {
    /// Follows `work` to its end on the runtime; `keep` (the tensors it reads and writes) is
    /// released only then.
    pub(crate) fn start(
        mut work: tensorwire_process_group::Work<Outcome>,
        keep: Vec<Py<PyAny>>,
    ) -> Work {
        let shared = Arc::new(Shared::default());
        // An operation that ended in its issuing call (a group of one, a refused argument)
        // is settled here, without a task and a wake-up on the runtime.
        if work.is_completed() {
            let mut cx = Context::from_waker(std::task::Waker::noop());
            if let Poll::Ready(result) = Pin::new(&mut work).poll(&mut cx) {
                drop(keep);
                shared.lock().result = Some(result);
                return Work { shared };
            }
        }
        let ending = shared.clone();
        runtime().spawn(async move {
            let result = work.await;
            // Released without the GIL: pyo3 defers the reference counts to the next holder.
            drop(keep);
            let ok = result.is_ok();
            {
                let mut state = ending.lock();
                state.result = Some(result);
                let callbacks = std::mem::take(&mut state.callbacks);
                if !callbacks.is_empty() {
                    // Python code runs on a GIL runner, never on the runtime's workers; a
                    // runner's jobs finish before the interpreter exits (`gil::mark_exiting`).
                    // Queued before the result is seen (under the lock that publishes it): a
                    // script that returns after `wait()` finds them queued, and its exit waits
                    // for them. (`submit` takes only the runners' queue lock.)
                    crate::gil::submit(Box::new(move |py| {
                        for callback in callbacks {
                            callback.run(py, ok);
                        }
                    }));
                }
            }
            ending.ended.notify_all();
        });
        Work { shared }
    }
}

impl Work {
    fn when_done(&self, py: Python<'_>, callback: Callback) {
        let ok = {
            let mut state = self.shared.lock();
            match &state.result {
                None => {
                    state.callbacks.push(callback);
                    return;
                }
                Some(result) => result.is_ok(),
            }
        };
        callback.run(py, ok);
    }
}

#[pymethods]
impl Work {
    /// Waits (without the GIL) for the operation to end, at most `timeout` seconds (`None`:
    /// as long as the group's own timeout lets it run). Returns the sending rank for a receive
    /// from any rank, else `None`; raises `TensorwireError` for a failure, or for a wait that
    /// ran out (the operation itself goes on, bounded by the group's timeout).
    #[pyo3(signature = (timeout=None))]
    fn wait(&self, py: Python<'_>, timeout: Option<f64>) -> PyResult<Option<usize>> {
        let deadline = match timeout {
            Some(t) if !(t.is_finite() && t >= 0.0) => {
                return Err(pyo3::exceptions::PyValueError::new_err(format!(
                    "timeout must be a non-negative number of seconds, not {t}"
                )))
            }
            Some(t) => Some(Instant::now() + Duration::from_secs_f64(t)),
            None => None,
        };
        let shared = self.shared.clone();
        let result = py.detach(move || {
            let mut state = shared.lock();
            loop {
                if let Some(result) = &state.result {
                    return Some(result.clone());
                }
                state = match deadline {
                    None => shared.ended.wait(state).unwrap_or_else(|e| e.into_inner()),
                    Some(deadline) => {
                        let left = deadline.saturating_duration_since(Instant::now());
                        if left.is_zero() {
                            return None;
                        }
                        shared
                            .ended
                            .wait_timeout(state, left)
                            .unwrap_or_else(|e| e.into_inner())
                            .0
                    }
                };
            }
        });
        match result {
            Some(Ok(Outcome::Done)) => Ok(None),
            Some(Ok(Outcome::From(rank))) => Ok(Some(rank)),
            Some(Err(e)) => Err(to_py(&e)),
            None => Err(TensorwireError::new_err((
                "timeout",
                format!(
                    "the operation did not end within the wait's timeout of {:?}",
                    Duration::from_secs_f64(timeout.unwrap_or_default())
                ),
                Vec::<usize>::new(),
            ))),
        }
    }

    /// Whether the operation has ended (successfully or not).
    fn is_completed(&self) -> bool {
        self.shared.lock().result.is_some()
    }

    /// Whether the operation ended successfully (`False` while it runs).
    fn is_success(&self) -> bool {
        matches!(self.shared.lock().result, Some(Ok(_)))
    }

    /// The operation's failure as a `TensorwireError` (not raised), once it has ended with
    /// one; `None` while it runs or after it succeeded. Never waits (c10d's
    /// `Work.exception()`).
    fn exception(&self, py: Python<'_>) -> Option<Py<PyAny>> {
        let error = match &self.shared.lock().result {
            Some(Err(e)) => e.clone(),
            _ => return None,
        };
        Some(to_py(&error).into_value(py).into_any())
    }

    /// Runs `callback()` (no arguments) once the operation has ended: at once if it has, else
    /// on a thread of tensorwire's, with the GIL.
    fn add_done_callback(&self, py: Python<'_>, callback: Py<PyAny>) {
        self.when_done(py, Callback::Call(callback));
    }

    /// Completes `future` with `value` when the operation succeeds (straight from here, no
    /// Python function in between: the path DDP's gradient buckets take), else calls
    /// `otherwise()`, which sets the mapped error.
    fn resolve(&self, py: Python<'_>, future: Py<PyAny>, value: Py<PyAny>, otherwise: Py<PyAny>) {
        self.when_done(
            py,
            Callback::Resolve {
                future,
                value,
                otherwise,
            },
        );
    }
}
