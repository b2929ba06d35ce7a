//! Running registered functions for requests (and answering fetches of owned values): their
//! arguments placed and decoded, panics caught, results encoded and placed for the caller.

use std::any::Any;
use std::sync::Arc;
use std::time::Instant;

use serde::Serialize;
use tensorwire_core::protocol::served::{ServeFailure, ServeMode};
use tensorwire_core::protocol::{RRefId, RemoteError, RequestToken, WorkerId};
use tracing::warn;

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
    let me = this.inner.me.id;
    let function = || function.map(str::to_owned);
    let prepared = value
        .prepare(this, to)
        .map_err(|e| ServeFailure::result_not_sent(function(), &e).to_caller(me))?;
    let wire = crate::ipc::to_wire(this, to, prepared.tensors)
        .await
        .map_err(|e| ServeFailure::result_not_sent(function(), &e).to_caller(me))?;
    Ok(Body {
        target: None,
        data: prepared.data,
        tensors: wire,
        forks: prepared.forks,
    })
}

/// Runs a registered function for a request, catching errors and panics. A handler that
/// answered at once (or a call that failed before it ran) is done; one that waits comes back
/// as the rest of its serving, for the driver to run in a task of its own and to pump after.
pub(crate) fn serve(
    this: &Agent,
    (token, from): (RequestToken, Option<WorkerId>),
    function: String,
    body: Body,
    keep_as: Option<RRefId>,
    deadline: Option<Instant>,
) -> Option<impl std::future::Future<Output = bool> + Send + 'static> {
    let me = this.inner.me.id;
    let agent = this.clone();
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
            return None;
        }
    };
    let serving = Serving::enter(this);
    let task = async move {
        // A method call reaches this point only once its value exists (the endpoint parks
        // it until then, by its caller's deadline).
        let target = match body.target {
            Some(t) => match agent.local_value(t.rref) {
                Some(v) => Some(v),
                None => {
                    let err = ServeFailure::NoValue {
                        rref: t.rref,
                        worker: agent.inner.me.name.clone(),
                    }
                    .to_caller(me);
                    agent.lock().node.respond(token, Err(err), from.is_some());
                    return Some(serving);
                }
            },
            None => None,
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
        // Counted in the metrics and run in an `rpc_serve` span, in this task's box (no box
        // of its own around the function's future).
        let bytes = crate::metrics::message_bytes(body.data.len(), tensors.iter());
        let (span, served) = (!mode.internal)
            .then(|| agent.serving(token.from(), &function, bytes))
            .unzip();
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
        let handler = CatchPanic {
            inner: tracing::Instrument::instrument(
                handler(inv),
                span.unwrap_or_else(tracing::Span::none),
            ),
        };
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
        let outcome = match outcome {
            Ok(Ok(value)) => match keep_as {
                Some(rref) => {
                    let replaced = agent.lock().values.insert(rref, value);
                    drop(replaced);
                    Ok(Body::default())
                }
                None => reply_body(&agent, &*value, token.from(), Some(&function)).await,
            },
            Ok(Err(error)) => Err(ServeFailure::ran(function.clone(), Ok(error)).to_caller(me)),
            Err(panic) => Err(ServeFailure::ran(function.clone(), Err(panic)).to_caller(me)),
        };
        if let Err(e) = &outcome {
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
            let created = keep_as.filter(|_| outcome.is_ok());
            let expected = st.node.respond(token, outcome, from.is_some());
            // A value made for a creator lost meanwhile: nobody will ever refer to it.
            created
                .filter(|_| !expected)
                .and_then(|rref| st.values.remove(&rref))
        };
        drop(orphan);
        Some(serving)
    };
    let mut task = Box::pin(task);
    if inline {
        let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
        if let std::task::Poll::Ready(serving) = std::future::Future::poll(task.as_mut(), &mut cx) {
            drop(serving);
            return None;
        }
    }
    // `true` once answered here; `false` when the function took its reply.
    Some(async move {
        let Some(serving) = task.await else {
            return false;
        };
        // Let the other handlers that are ready answer too, so that their replies leave in
        // the same write (one scheduler turn). Alone, the reply leaves at once: a yield
        // would cost a turn of the runtime's I/O driver (a system call) for nothing.
        if serving.leave() > 0 {
            tokio::task::yield_now().await;
        }
        true
    })
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
            crate::driver::pump_now(&agent);
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
