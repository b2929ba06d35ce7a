//! Running registered functions for requests (and answering fetches of owned values): their
//! arguments placed and decoded, panics caught, results encoded and placed for the caller.

use std::any::Any;
use std::sync::Arc;
use std::time::Instant;

use serde::Serialize;
use tensorwire_core::protocol::served::{ServeFailure, ServeMode};
use tensorwire_core::protocol::tensors::Prepared;
use tensorwire_core::protocol::{RRefId, RemoteError, RequestToken, WorkerId};
use tracing::{warn, Instrument as _, Span};

use crate::functions::{HandlerError, Host as _, Invocation, Value};
use crate::state::Agent;
use crate::state::Body;

/// Encodes a result for `to`, with its tensors placed by the reverse map and copied to host;
/// what fails is said of the result of `function` (core decides the words).
pub(crate) async fn reply_body(
    this: &Agent,
    value: &dyn Value,
    to: WorkerId,
    function: Option<&str>,
) -> Result<Body, RemoteError> {
    match encode(this, value, to, function)? {
        Encoded::Body(body) => Ok(body),
        Encoded::Tensors(prepared) => place(this, prepared, to, function).await,
    }
}

/// A result encoded for its caller: whole, or with tensors still to copy ([`place`]).
enum Encoded {
    Body(Body),
    Tensors(Prepared),
}

/// [`reply_body`] up to its tensors: a result without any is whole at once.
fn encode(
    this: &Agent,
    value: &dyn Value,
    to: WorkerId,
    function: Option<&str>,
) -> Result<Encoded, RemoteError> {
    let prepared = value.prepare(this, to).map_err(|e| {
        ServeFailure::result_not_sent(function.map(str::to_owned), &e).to_caller(this.inner.me.id)
    })?;
    if !prepared.tensors.is_empty() {
        return Ok(Encoded::Tensors(prepared));
    }
    Ok(Encoded::Body(Body {
        target: None,
        data: prepared.data,
        tensors: Vec::new(),
        forks: prepared.forks,
    }))
}

/// The rest of [`reply_body`]: the tensors copied to host (or shared) for `to`.
async fn place(
    this: &Agent,
    prepared: Prepared,
    to: WorkerId,
    function: Option<&str>,
) -> Result<Body, RemoteError> {
    let wire = crate::ipc::to_wire(this, to, prepared.tensors)
        .await
        .map_err(|e| {
            ServeFailure::result_not_sent(function.map(str::to_owned), &e)
                .to_caller(this.inner.me.id)
        })?;
    Ok(Body {
        target: None,
        data: prepared.data,
        tensors: wire,
        forks: prepared.forks,
    })
}

/// How a function's run ended: its value or error, or its panic.
type Outcome = Result<Result<Arc<dyn Value>, HandlerError>, Box<dyn Any + Send>>;

/// What `outcome` answers to the caller of `function`: a value kept for a `remote()`
/// (`keep_as`), a result encoded, or the failure the caller is told.
fn answer_of(
    agent: &Agent,
    to: WorkerId,
    function: &str,
    keep_as: Option<RRefId>,
    outcome: Outcome,
) -> Result<Encoded, RemoteError> {
    let me = agent.inner.me.id;
    match outcome {
        Ok(Ok(value)) => match keep_as {
            Some(rref) => {
                let replaced = agent.lock().values.insert(rref, value);
                drop(replaced);
                Ok(Encoded::Body(Body::default()))
            }
            None => encode(agent, &*value, to, Some(function)),
        },
        Ok(Err(error)) => Err(ServeFailure::ran(function.to_owned(), Ok(error)).to_caller(me)),
        Err(panic) => Err(ServeFailure::ran(function.to_owned(), Err(panic)).to_caller(me)),
    }
}

/// Gives the node `answer` to request `token` (with the end of a running request, `from`);
/// a failure is told to the callee's operator too, and a value made for a creator lost
/// meanwhile is dropped.
fn give(
    agent: &Agent,
    (token, from): (RequestToken, Option<WorkerId>),
    function: &str,
    keep_as: Option<RRefId>,
    answer: Result<Body, RemoteError>,
) {
    if let Err(e) = &answer {
        // The caller gets the error; the callee's operator should see it too.
        warn!(
            function = %function,
            caller = %agent.name_of(token.from()),
            kind = %e.kind,
            "a call failed on this worker: {}",
            e.message
        );
    }
    let orphan = {
        let mut st = agent.lock();
        let created = keep_as.filter(|_| answer.is_ok());
        let expected = st.node.respond(token, answer, from.is_some());
        // A value made for a creator lost meanwhile: nobody will ever refer to it.
        created
            .filter(|_| !expected)
            .and_then(|rref| st.values.remove(&rref))
    };
    drop(orphan);
}

/// The end of a call's serving once its function ran: its `outcome` kept or encoded (its
/// tensors copied) and given to the node.
async fn conclude(
    agent: &Agent,
    request: (RequestToken, Option<WorkerId>),
    function: &str,
    keep_as: Option<RRefId>,
    outcome: Outcome,
) {
    let to = request.0.from();
    let answer = match answer_of(agent, to, function, keep_as, outcome) {
        Ok(Encoded::Tensors(prepared)) => place(agent, prepared, to, Some(function)).await,
        Ok(Encoded::Body(body)) => Ok(body),
        Err(e) => Err(e),
    };
    give(agent, request, function, keep_as, answer);
}

/// Runs a registered function for a request, catching errors and panics. A handler that
/// answered at once (or a call that failed before it ran) is done; one that waits goes on in
/// a task of its own, which pumps after.
pub(crate) fn serve(
    this: &Agent,
    (token, from): (RequestToken, Option<WorkerId>),
    function: String,
    body: Body,
    keep_as: Option<RRefId>,
    deadline: Option<Instant>,
) {
    let me = this.inner.me.id;
    // Core decides how it runs (inline on a current-thread runtime, for a peer's request;
    // whether its function may take its reply; the agent's own gather apart). One inline
    // that finishes at once has answered: the pump that dispatched this request sends the
    // reply, with whatever else it sends (replies to the other requests of the same read,
    // in one write). One that waits goes on in a task.
    let current_thread = || {
        tokio::runtime::Handle::try_current()
            .is_ok_and(|h| h.runtime_flavor() == tokio::runtime::RuntimeFlavor::CurrentThread)
    };
    let from_peer = token.from() != me;
    let mode = ServeMode::of(&function, from_peer, current_thread, keep_as.is_some());
    let (inline, takeable) = (mode.inline, mode.takeable);
    let handler = if mode.internal {
        Ok(crate::gather::handler())
    } else {
        this.inner.functions.lookup(&function, &this.inner.me.name)
    };
    let handler = match handler {
        Ok(handler) => handler,
        Err(unknown) => {
            let err = unknown.to_caller(me);
            warn!(
                function = %function,
                caller = %this.name_of(token.from()),
                "a call asked for a function that is not registered here"
            );
            this.lock().node.respond(token, Err(err), from.is_some());
            this.pump();
            return;
        }
    };
    // A call inline whose arguments carry no tensors (no copy to wait for) runs its
    // function here and now: one that finishes at once is answered with no task and no box
    // but its handler's future; one that waits goes on in a task, as does the copy of its
    // result's tensors, each pumping after.
    if inline && body.tensors.is_empty() {
        let Ok(target) = target_of(this, (token, from), body.target) else {
            return;
        };
        let inv = Invocation {
            agent: this.clone(),
            caller: token.from(),
            deadline,
            args: body.data,
            tensors: Vec::new(),
            forks: body.forks,
            target,
        };
        let (mut handler, served) = run_of(this, &function, mode.internal, &handler, inv);
        let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
        let mut poll = || std::future::Future::poll(std::pin::Pin::new(&mut handler), &mut cx);
        // Inside another call's reply scope (a handler whose own call's pump dispatched this
        // one), a scope of none hides that call's reply from this function's `Reply::take`.
        let first = match REPLY.try_with(|_| ()) {
            Ok(()) => REPLY.sync_scope(std::cell::Cell::new(None), poll),
            Err(_) => poll(),
        };
        let std::task::Poll::Ready(outcome) = first else {
            // It waits: the rest goes on in a task, which polls it again with its own waker.
            let (agent, serving) = (this.clone(), Serving::enter(this));
            this.spawn(async move {
                let outcome = handler.await;
                if let Some(served) = served {
                    served(matches!(outcome, Ok(Ok(_))));
                }
                conclude(&agent, (token, from), &function, keep_as, outcome).await;
                if serving.leave() > 0 {
                    tokio::task::yield_now().await;
                }
                agent.pump_now();
            });
            return;
        };
        if let Some(served) = served {
            served(matches!(outcome, Ok(Ok(_))));
        }
        let answer = match answer_of(this, token.from(), &function, keep_as, outcome) {
            Ok(Encoded::Body(body)) => Ok(body),
            Ok(Encoded::Tensors(prepared)) => {
                let agent = this.clone();
                this.spawn(async move {
                    let answer = place(&agent, prepared, token.from(), Some(&function)).await;
                    give(&agent, (token, from), &function, keep_as, answer);
                    agent.pump_now();
                });
                return;
            }
            Err(e) => Err(e),
        };
        give(this, (token, from), &function, keep_as, answer);
        return;
    }
    let (agent, serving) = (this.clone(), Serving::enter(this));
    let task = async move {
        let Ok(target) = target_of(&agent, (token, from), body.target) else {
            return Some(serving);
        };
        let tensors = match crate::ipc::from_wire(&agent, token.from(), body.tensors).await {
            Ok(t) => t,
            Err(e) => {
                let err = ServeFailure::Unplaceable {
                    function: function.clone(),
                    reason: e.to_string(),
                }
                .to_caller(me);
                agent.lock().node.respond(token, Err(err), from.is_some());
                return Some(serving);
            }
        };
        let inv = Invocation {
            agent: agent.clone(),
            caller: token.from(),
            deadline,
            args: body.data,
            tensors,
            forks: body.forks,
            target,
        };
        // A function called by name may take its reply ([`Reply::take`]) to send it from
        // elsewhere: then its outcome here is not sent.
        let reply = takeable.then(|| Reply {
            agent: agent.clone(),
            token,
            from,
            sent: false,
        });
        // Run in this task's box (no box of its own around the function's future).
        let (handler, served) = run_of(&agent, &function, mode.internal, &handler, inv);
        // A reply the function may take is in scope while it runs. One it may not (a call
        // run inline by the pump that received it, `reply` is `None`) needs a scope only
        // inside another call's (a handler whose own call's pump dispatched this one), to
        // hide that call's reply from this function's `Reply::take`; elsewhere `take` finds
        // no scope and gives `None` as a scope of `None` would, and the poll pays no
        // task-local swap (both ways, every poll).
        let scoped = takeable || REPLY.try_with(|_| ()).is_ok();
        let run = async {
            let outcome = handler.await;
            if let Some(served) = served {
                served(matches!(outcome, Ok(Ok(_))));
            }
            let kept = REPLY
                .try_with(|r| r.take().map(|mut r| r.sent = true))
                .ok()
                .flatten()
                .is_some();
            (kept || !takeable).then_some(outcome)
        };
        // `None` once the function took its reply.
        let outcome = if scoped {
            REPLY.scope(std::cell::Cell::new(reply), run).await
        } else {
            run.await
        }?;
        conclude(&agent, (token, from), &function, keep_as, outcome).await;
        Some(serving)
    };
    let mut task = Box::pin(task);
    if inline {
        let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
        if let std::task::Poll::Ready(serving) = std::future::Future::poll(task.as_mut(), &mut cx) {
            drop(serving);
            return;
        }
    }
    // The rest goes on in a task of its own, which then moves what it produced along,
    // writing on that task (its reply, those of the handlers that answered meanwhile, and
    // the requests its answer let run).
    let agent = this.clone();
    this.spawn(async move {
        // `None` when the function took its reply: it sends it itself.
        let Some(serving) = task.await else { return };
        // Let the other handlers that are ready answer too, so that their replies leave in
        // the same write (one scheduler turn). Alone, the reply leaves at once: a yield
        // would cost a turn of the runtime's I/O driver (a system call) for nothing.
        if serving.leave() > 0 {
            tokio::task::yield_now().await;
        }
        agent.pump_now();
    });
}

/// A method call's value (a call reaches serving only once it exists: the endpoint parks it
/// until then, by its caller's deadline); `Err` once the caller is told there is none.
fn target_of(
    agent: &Agent,
    (token, from): (RequestToken, Option<WorkerId>),
    target: Option<tensorwire_core::protocol::MethodTarget>,
) -> Result<Option<Arc<dyn Any + Send + Sync>>, ()> {
    let Some(t) = target else { return Ok(None) };
    if let Some(value) = agent.local_value(t.rref) {
        return Ok(Some(value));
    }
    let err = ServeFailure::NoValue {
        rref: t.rref,
        worker: agent.inner.me.name.clone(),
    };
    let err = err.to_caller(agent.inner.me.id);
    agent.lock().node.respond(token, Err(err), from.is_some());
    Err(())
}

/// A function's run for `inv`: counted in the metrics and run in an `rpc_serve` span (not
/// the agent's own gather, `internal`), its panics caught; and what to tell when it ended.
fn run_of<'a>(
    agent: &'a Agent,
    function: &'a str,
    internal: bool,
    handler: &crate::functions::Handler<Agent>,
    inv: Invocation<Agent>,
) -> (
    CatchPanic<tracing::instrument::Instrumented<crate::functions::HandlerFuture>>,
    Option<impl FnOnce(bool) + Send + 'static + use<'a>>,
) {
    let bytes = crate::metrics::message_bytes(inv.args.len(), inv.tensors.iter());
    let (span, served) = (!internal)
        .then(|| agent.serving(inv.caller, function, bytes))
        .unzip();
    let run = handler(inv).instrument(span.unwrap_or_else(Span::none));
    (CatchPanic { inner: run }, served)
}

tokio::task_local! {
    /// The reply of the call whose function is being polled, until the function takes it.
    static REPLY: std::cell::Cell<Option<Reply>>;
}

/// The reply to a call, taken by the function it called ([`Reply::take`]) to send it itself
/// from another thread: a function that hands its work to a thread of its own (a Python
/// runner) answers from there, with no hand-off back to a runtime worker. Dropped unsent, it
/// answers that the function failed to.
pub struct Reply {
    agent: Agent,
    token: RequestToken,
    from: Option<WorkerId>,
    sent: bool,
}

impl Reply {
    /// Takes the reply of the call whose registered function runs now, called by name or as
    /// a method (not a `remote()` constructor, whose reply is its value kept here, nor a
    /// call the pump that received it runs inline, on a current-thread runtime): the
    /// function's own outcome is then not sent. `None` otherwise, or once taken.
    pub fn take() -> Option<Reply> {
        REPLY.try_with(std::cell::Cell::take).ok().flatten()
    }

    /// Sends `outcome` as the reply, on this thread: encoded, and written where the caller's
    /// connection is idle (what must wait, a device copy or a full connection, goes on in a
    /// task). This thread must be in the agent's runtime's context (one of its threads, or
    /// one that entered it); elsewhere nothing is sent and the call times out.
    pub fn send<R: Serialize + Send + Sync + 'static>(mut self, outcome: Result<R, String>) {
        self.answer(outcome.map(|r| Arc::new(r) as Arc<dyn Value>));
    }

    fn answer(&mut self, outcome: Result<Arc<dyn Value>, String>) {
        if std::mem::replace(&mut self.sent, true) {
            return;
        }
        if tokio::runtime::Handle::try_current().is_err() {
            // Nothing can be written from here: say so on the callee too, or the caller's
            // timeout would be the only trace.
            warn!(
                caller = %self.agent.name_of(self.token.from()),
                "a reply was sent from a thread outside the agent's runtime and is lost: the \
                 caller's call will time out"
            );
            return;
        }
        let (agent, token, from) = (self.agent.clone(), self.token, self.from);
        let mut task = Box::pin(async move {
            let outcome = match outcome {
                Ok(value) => reply_body(&agent, &*value, token.from(), None).await,
                Err(m) => {
                    // As for a call answered by its task: the callee's operator sees it too.
                    warn!(
                        caller = %agent.name_of(token.from()),
                        "a call failed on this worker: {m}"
                    );
                    Err(ServeFailure::Handler {
                        function: String::new(),
                        error: HandlerError::Failed(m),
                    }
                    .to_caller(agent.inner.me.id))
                }
            };
            agent.lock().node.respond(token, outcome, from.is_some());
            agent.pump_now();
        });
        let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
        if std::future::Future::poll(task.as_mut(), &mut cx).is_pending() {
            self.agent.spawn(task);
        }
    }
}

impl Drop for Reply {
    fn drop(&mut self) {
        self.answer(Err("the function dropped its reply unsent".into()));
    }
}

/// A request being served, counted in `Inner::serving` until it leaves (or is dropped: a
/// cancelled handler).
struct Serving(Option<Agent>);

impl Serving {
    fn enter(agent: &Agent) -> Self {
        agent
            .inner
            .serving
            .fetch_add(1, std::sync::atomic::Ordering::AcqRel);
        Serving(Some(agent.clone()))
    }

    /// Stops counting this one; returns how many others are still being served.
    fn leave(mut self) -> usize {
        match self.0.take() {
            Some(agent) => {
                agent
                    .inner
                    .serving
                    .fetch_sub(1, std::sync::atomic::Ordering::AcqRel)
                    - 1
            }
            None => 0,
        }
    }
}

impl Drop for Serving {
    fn drop(&mut self) {
        if let Some(agent) = self.0.take() {
            agent
                .inner
                .serving
                .fetch_sub(1, std::sync::atomic::Ordering::AcqRel);
        }
    }
}

/// Polls a handler's future, turning a panic into an error (the handler is user code; one that
/// panics must not take the agent down, and need not cost a task of its own).
struct CatchPanic<F> {
    inner: F,
}

impl<F: std::future::Future + Unpin> std::future::Future for CatchPanic<F> {
    type Output = Result<F::Output, Box<dyn Any + Send>>;

    fn poll(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Self::Output> {
        let inner = &mut self.inner;
        match std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            std::pin::Pin::new(&mut *inner).poll(cx)
        })) {
            Ok(std::task::Poll::Ready(v)) => std::task::Poll::Ready(Ok(v)),
            Ok(std::task::Poll::Pending) => std::task::Poll::Pending,
            Err(panic) => std::task::Poll::Ready(Err(panic)),
        }
    }
}
