//! Python work handed over by the runtime: calls to serve, replies to complete, the callbacks
//! of c10d works that ended.
//!
//! Python may not run on a runtime worker (it would hold the worker while it waits for the GIL),
//! so every such job runs on a blocking thread. Handing each job to a thread of its own
//! (`spawn_blocking` per job) costs a thread wake-up and a GIL hand-over per job, and with many
//! calls in flight the threads contend for the GIL. Here jobs queue up, and a *runner* (a
//! blocking thread) takes the GIL once and runs the queued jobs one after another until none
//! is left.
//!
//! A job may block (a served function that waits for an event, a future's callback that waits
//! for another call, perhaps one queued behind it). So a runner that is running a job is busy,
//! and the queue keeps this invariant: while jobs are queued, at least one runner is *ready*
//! (waiting for the GIL, or between jobs, about to take the next). A job submitted while no
//! runner is ready starts one, and so does a runner that takes a job and leaves others queued
//! with no runner ready: a queued job never waits behind a blocked one, as with a thread per
//! job.
//!
//! A job that arrives while nothing is queued, running or ready (the common case of calls
//! served one at a time) costs a runner's wake-up on its critical path:
//! the worker that read the message wakes a runner and the job waits until it is scheduled.
//! Such a job on a training step's critical path (a call served in a distributed autograd
//! context, a backward pass, an owner's optimizer step) runs on the worker itself instead
//! ([`run_here_or_submit`], [`on_python_here`]), which first hands its other tasks to another
//! thread (`block_in_place`), so the runtime is never held while Python runs or waits for the
//! GIL. It counts as running: jobs that arrive meanwhile queue for a runner as before.
//!
//! A run of torch's engine that comes back to a worker whose caller waits in
//! `dist_autograd.backward` (the gradients an answer carries for its sends) is run by that
//! waiting thread when it is parked idle ([`wait_helping`], [`offer_to_waiter`]): it is woken
//! when the pass ends anyway, and the worker that read the answer hands nothing off.

use std::collections::VecDeque;
use std::panic::AssertUnwindSafe;
use std::sync::{Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use pyo3::prelude::PyAnyMethods;
use pyo3::Python;

/// A piece of Python work: it runs with the GIL held, on a blocking thread.
pub(crate) type Job = Box<dyn FnOnce(Python<'_>) + Send>;

struct Queue {
    jobs: VecDeque<Job>,
    /// Runners that will look at the queue before running anything that may block.
    ready: usize,
    /// Jobs being run.
    running: usize,
}

static QUEUE: Mutex<Queue> = Mutex::new(Queue {
    jobs: VecDeque::new(),
    ready: 0,
    running: 0,
});

/// Set by an `atexit` handler: the interpreter is about to finalize, and a thread that takes
/// the GIL from then on may be ended on the spot (see [`wait_idle`]).
static EXITING: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// Set once the `atexit` handler has let the jobs already handed over finish: from then on a
/// runner drops the jobs it finds instead of taking the GIL for them.
static CLOSED: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// How long the interpreter's exit waits for jobs already handed over (a callback still
/// running, a reply being completed) before it goes on without them.
const EXIT_WAIT: Duration = Duration::from_secs(2);

/// Registered with `atexit` when the module loads. No job runs on the calling thread from now
/// on; the jobs queued or running finish first, the GIL released for them, so that no runner
/// is inside Python when the interpreter finalizes: CPython 3.11 ends a thread that takes the
/// GIL back after that with `pthread_exit`, and its unwinding through a C++ frame (torch's
/// `Future.set_result` releases the GIL while it runs the future's callbacks) aborts the
/// process ("terminate called without an active exception"). Jobs handed over later are
/// dropped, not run.
#[pyo3::pyfunction]
pub(crate) fn mark_exiting(py: Python<'_>) {
    EXITING.store(true, std::sync::atomic::Ordering::Release);
    if !py.detach(|| wait_idle(EXIT_WAIT)) {
        tracing::warn!(
            "tensorwire: Python callbacks still running {} s into the interpreter's exit",
            EXIT_WAIT.as_secs()
        );
    }
    CLOSED.store(true, std::sync::atomic::Ordering::Release);
}

fn closed() -> bool {
    CLOSED.load(std::sync::atomic::Ordering::Acquire)
}

/// Whether the interpreter has begun to exit (its `atexit` handlers ran).
pub(crate) fn interpreter_exiting() -> bool {
    EXITING.load(std::sync::atomic::Ordering::Acquire)
}

/// Signalled when the last running job ends with none queued (see [`wait_idle`]).
static IDLE: Condvar = Condvar::new();

fn queue() -> MutexGuard<'static, Queue> {
    // A job never runs under the lock, so a poisoned lock still guards consistent state.
    QUEUE.lock().unwrap_or_else(|e| e.into_inner())
}

/// Jobs run by the thread that had them ([`run_here_or_submit`] and kin), and jobs queued for
/// the runners, since the module loaded.
static RUN_HERE: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
static QUEUED: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// `(jobs run in place, jobs queued for the runners)` in this process so far: what the tests
/// check the hand-offs by.
#[pyo3::pyfunction]
pub(crate) fn job_counts() -> (u64, u64) {
    (
        RUN_HERE.load(std::sync::atomic::Ordering::Relaxed),
        QUEUED.load(std::sync::atomic::Ordering::Relaxed),
    )
}

/// Runs `job` with the GIL on a blocking thread, soon, in submission order with other jobs
/// (jobs may overlap when one blocks). Callable from any thread.
pub(crate) fn submit(job: Job) {
    QUEUED.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let start = {
        let mut q = queue();
        q.jobs.push_back(job);
        let start = q.ready == 0;
        if start {
            q.ready += 1;
        }
        start
    };
    if start {
        crate::runtime().spawn_blocking(run);
    }
}

/// Whether this thread may run a job itself, blocking: a worker of a multi-thread runtime
/// (`block_in_place` hands the worker's other tasks to another thread first) or a thread
/// outside any runtime's workers; never a current-thread runtime's only thread, nor a thread
/// once the interpreter has begun to exit (see [`wait_idle`]).
fn may_run_here() -> bool {
    !interpreter_exiting()
        && tokio::runtime::Handle::try_current()
            .is_ok_and(|h| h.runtime_flavor() != tokio::runtime::RuntimeFlavor::CurrentThread)
}

/// Counts a job about to run on the calling thread, if no job is queued, running, or waited
/// for by a ready runner: a ready runner takes a new job with no wake-up (it holds or is taking
/// the GIL), a queued job must not be overtaken, and one job at a time runs so (jobs that
/// arrive together queue for one runner, which takes the GIL once for all, as before).
/// `false`: submit instead.
fn claim_here() -> bool {
    if !may_run_here() {
        return false;
    }
    let mut q = queue();
    if !q.jobs.is_empty() || q.ready > 0 || q.running > 0 {
        return false;
    }
    q.running += 1;
    RUN_HERE.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    true
}

/// The end of a job counted by [`claim_here`].
fn done_here() {
    let mut q = queue();
    q.running -= 1;
    if q.running == 0 && q.jobs.is_empty() {
        IDLE.notify_all();
    }
}

/// Runs `job` as [`submit`] does, but on this thread and now when no runner would take it
/// without a wake-up (no job queued or running, no runner ready) and this thread may block (see
/// [`may_run_here`]): a runtime worker that read a call runs its Python itself, its other
/// tasks handed to another worker thread meanwhile (`block_in_place`), instead of waking a
/// runner and waiting for it to be scheduled. The job counts as running, as a runner's does,
/// so jobs submitted meanwhile start runners of their own.
pub(crate) fn run_here_or_submit(job: Job) {
    if !claim_here() {
        submit(job);
        return;
    }
    if run_claimed(|| Python::attach(job)).is_err() {
        tracing::error!("a tensorwire.rpc job panicked");
    }
}

/// Runs `f` on this thread for a job [`claim_here`] counted, the worker's other tasks handed
/// to another thread meanwhile (`block_in_place`), catching a panic; then ends the claim.
fn run_claimed<T>(f: impl FnOnce() -> T) -> std::thread::Result<T> {
    let ran = tokio::task::block_in_place(|| std::panic::catch_unwind(AssertUnwindSafe(f)));
    done_here();
    ran
}

/// What a job that panicked gives the one waiting for it.
const ABNORMAL: &str = "the Python call ended abnormally";

/// Runs `job`, which may take the GIL itself (it is called without it), on this thread and
/// now under the conditions of [`run_here_or_submit`], else as a job of the runners with the
/// GIL released around it; resolves once it has run. `Err` if it did not complete (it
/// panicked).
pub(crate) async fn run_detached_here_or_submit(
    job: Box<dyn FnOnce() + Send>,
) -> Result<(), String> {
    if !claim_here() {
        return on_python(move |py| py.detach(job)).await;
    }
    run_claimed(job).map_err(|_| ABNORMAL.to_owned())
}

/// A runner: takes the GIL and runs jobs until the queue is empty; once the interpreter's
/// exit has closed the queue (see [`mark_exiting`]), drops them instead.
fn run() {
    if closed() {
        abandon();
        return;
    }
    let ran = Python::try_attach(|py| loop {
        let job = {
            let mut q = queue();
            q.ready -= 1;
            if closed() {
                let jobs = std::mem::take(&mut q.jobs);
                drop(q);
                drop(jobs);
                IDLE.notify_all();
                return;
            }
            let Some(job) = q.jobs.pop_front() else {
                return;
            };
            if !q.jobs.is_empty() && q.ready == 0 {
                // This runner is busy from now on: the jobs behind this one need another.
                q.ready += 1;
                crate::runtime().spawn_blocking(run);
            }
            q.running += 1;
            job
        };
        // A job reports its own failures (a reply's callback, a call's sender); a panic in
        // one must not take the runner's count with it.
        if std::panic::catch_unwind(AssertUnwindSafe(|| job(py))).is_err() {
            tracing::error!("a tensorwire.rpc job panicked");
        }
        let mut q = queue();
        q.ready += 1;
        q.running -= 1;
        if q.running == 0 && q.jobs.is_empty() {
            IDLE.notify_all();
        }
    });
    if ran.is_none() {
        // The interpreter is finalizing (or gone): this runner may not take the GIL.
        abandon();
    }
}

/// A runner that may not take the GIL any more gives up its place and drops the queued jobs
/// unrun (their Python objects are released by pyo3's own queue, without the GIL).
fn abandon() {
    let jobs = {
        let mut q = queue();
        q.ready -= 1;
        std::mem::take(&mut q.jobs)
    };
    drop(jobs);
    IDLE.notify_all();
}

/// Waits, at most `bound`, until no job runs or waits (call it without the GIL, which the jobs
/// need). `shutdown` does, so that the interpreter does not begin to exit while a job is half
/// run: a thread that takes the GIL once the interpreter is finalizing is ended on the spot
/// (CPython's `pthread_exit`), and that unwinding through a job aborts the process. `false` if
/// jobs were still running at the bound (one blocked for good).
pub(crate) fn wait_idle(bound: Duration) -> bool {
    let deadline = Instant::now() + bound;
    let mut q = queue();
    while q.running > 0 || !q.jobs.is_empty() {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return false;
        }
        q = IDLE
            .wait_timeout(q, left)
            .map(|(q, _)| q)
            .unwrap_or_else(|e| e.into_inner().0);
    }
    true
}

/// [`on_python`], run on this thread, blocking, when [`run_here_or_submit`] would: for a job
/// on a step's critical path (an owner's optimizer step). Jobs that come in bursts (plain
/// calls served, replies completed: `rpc_async` with many calls in flight) stay with
/// [`on_python`] and [`submit`]: run in place, each would cost a `block_in_place` hand-off and
/// contend with the runner for the GIL (measured: 64 calls in flight, 20-25 % fewer calls a
/// second).
pub(crate) async fn on_python_here<T: Send + 'static>(
    f: impl FnOnce(Python<'_>) -> T + Send + 'static,
) -> Result<T, String> {
    if claim_here() {
        return run_claimed(|| Python::attach(f)).map_err(|_| ABNORMAL.to_owned());
    }
    on_python(f).await
}

/// Runs `f` as a job and waits for its result without holding a runtime worker. `Err` if the
/// job did not complete (it panicked).
pub(crate) async fn on_python<T: Send + 'static>(
    f: impl FnOnce(Python<'_>) -> T + Send + 'static,
) -> Result<T, String> {
    let (tx, rx) = tokio::sync::oneshot::channel();
    submit(Box::new(move |py| {
        let _ = tx.send(f(py));
    }));
    rx.await.map_err(|_| ABNORMAL.to_owned())
}

// --- a thread waiting for a backward pass runs the engine's runs meanwhile ---------------

/// The thread waiting in [`wait_helping`] (at most one per process at a time): `Idle` while
/// it is parked there and would take a job at once, `Busy` while it has one to run.
enum Waiter {
    Idle(std::thread::Thread),
    Busy,
}

/// A job handed to the waiting thread, and who is told once it has run (`true`) or panicked.
type Handed = (Box<dyn FnOnce() + Send>, tokio::sync::oneshot::Sender<bool>);

struct Waiting {
    waiter: Option<Waiter>,
    job: Option<Handed>,
}

static WAITING: Mutex<Waiting> = Mutex::new(Waiting {
    waiter: None,
    job: None,
});

/// Jobs run by a thread waiting in [`wait_helping`], since the module loaded.
static RUN_BY_WAITER: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// Jobs run by a thread that waited for a backward pass (`dist_autograd.backward`) and took the
/// engine's runs that came in meanwhile, in this process so far.
#[pyo3::pyfunction]
pub(crate) fn waiter_runs() -> u64 {
    RUN_BY_WAITER.load(std::sync::atomic::Ordering::Relaxed)
}

/// Wakes the thread that polls a future in [`wait_helping`].
struct Unpark(std::thread::Thread);

impl std::task::Wake for Unpark {
    fn wake(self: std::sync::Arc<Self>) {
        self.0.unpark();
    }

    fn wake_by_ref(self: &std::sync::Arc<Self>) {
        self.0.unpark();
    }
}

fn waiting() -> MutexGuard<'static, Waiting> {
    // A job never runs under the lock.
    WAITING.lock().unwrap_or_else(|e| e.into_inner())
}

/// Hands `job` (called without the GIL; it takes the GIL itself) to the thread parked in
/// [`wait_helping`], if one is and has nothing to run: that thread is woken anyway when the
/// pass it waits for ends, and a run it takes is one wake-up instead of the reading worker's
/// `block_in_place` hand-off (a thread woken to take its other tasks) and the waiter's own.
/// Resolves once the job has run (`Err` if it panicked). `job` comes back when no thread
/// waits idle: a waiter that is running a job (a user's hook blocked in it, say) never holds
/// up another.
pub(crate) fn offer_to_waiter(
    job: Box<dyn FnOnce() + Send>,
) -> Result<impl std::future::Future<Output = Result<(), String>>, Box<dyn FnOnce() + Send>> {
    if interpreter_exiting() {
        return Err(job);
    }
    let (tx, rx) = tokio::sync::oneshot::channel();
    {
        let mut w = waiting();
        let Some(Waiter::Idle(thread)) = w.waiter.take() else {
            return Err(job);
        };
        w.waiter = Some(Waiter::Busy);
        w.job = Some((job, tx));
        thread.unpark();
    }
    Ok(async move {
        match rx.await {
            Ok(true) => Ok(()),
            _ => Err(ABNORMAL.to_owned()),
        }
    })
}

/// Makes `context` the distributed autograd context current on this thread (Python's
/// `_autograd_engine.set_current`); returns the one it replaces (`None` if that failed).
fn set_current_context(context: Option<u64>) -> Option<u64> {
    Python::attach(|py| {
        py.import("tensorwire.rpc._autograd_engine")
            .and_then(|m| m.getattr("set_current"))
            .and_then(|f| f.call1((context,)))
            .and_then(|previous| previous.extract::<Option<u64>>())
            .unwrap_or_else(|e| {
                tracing::error!("tensorwire.rpc could not set the current context: {e}");
                None
            })
    })
}

/// Runs a job handed to this waiting thread, counted as a running job (see [`wait_idle`]).
/// The thread's caller may have a context current (its `with dist_autograd.context()`); the
/// run, perhaps another context's pass, runs as a runtime worker would run it, with none
/// current (a hook's calls are not recorded in the waiter's context), and it is restored
/// after.
fn run_handed((job, tx): Handed) {
    queue().running += 1;
    RUN_BY_WAITER.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let previous = set_current_context(None);
    let ran = std::panic::catch_unwind(AssertUnwindSafe(job)).is_ok();
    if previous.is_some() {
        set_current_context(previous);
    }
    done_here();
    if !ran {
        tracing::error!("a tensorwire.rpc job panicked");
    }
    let _ = tx.send(ran);
}

/// `rpc::wait_here` for a thread that waits for a backward pass: while it is parked,
/// a run of torch's engine that comes in ([`offer_to_waiter`]) is run by it. Only one thread
/// per process waits so at a time; another waits as `wait_here` does.
pub(crate) fn wait_helping<T: Send>(
    py: Python<'_>,
    future: impl std::future::Future<Output = T> + Send,
) -> T {
    py.detach(move || {
        let _runtime = crate::runtime().enter();
        let me = std::thread::current();
        let helping = {
            let mut w = waiting();
            if w.waiter.is_none() && !interpreter_exiting() {
                w.waiter = Some(Waiter::Idle(me.clone()));
                true
            } else {
                false
            }
        };
        let waker = std::task::Waker::from(std::sync::Arc::new(Unpark(me.clone())));
        let mut cx = std::task::Context::from_waker(&waker);
        let mut future = std::pin::pin!(future);
        loop {
            if let std::task::Poll::Ready(v) = future.as_mut().poll(&mut cx) {
                if helping {
                    // A job handed over before the slot closes is run here; none after.
                    let left = {
                        let mut w = waiting();
                        w.waiter = None;
                        w.job.take()
                    };
                    if let Some(handed) = left {
                        run_handed(handed);
                    }
                }
                return v;
            }
            if helping {
                let handed = {
                    let mut w = waiting();
                    let handed = w.job.take();
                    if handed.is_some() {
                        w.waiter = Some(Waiter::Busy);
                    }
                    handed
                };
                if let Some(handed) = handed {
                    run_handed(handed);
                    waiting().waiter = Some(Waiter::Idle(me.clone()));
                    continue;
                }
            }
            std::thread::park();
        }
    })
}
