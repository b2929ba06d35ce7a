//! Functions that answer from a thread of their own: the reply of a call is sent by whichever
//! thread finishes its work (a Python runner), with no hand-off back to a runtime worker.

use std::marker::PhantomData;
use std::sync::Arc;

use serde::de::DeserializeOwned;
use serde::Serialize;
use tensorwire_core::autograd::ContextId;
use tensorwire_core::ports::autograd::AutogradEngine;
use tensorwire_core::protocol::WorkerId;
use tensorwire_rpc::{CallContext, Reply, RpcError};
use tokio::sync::oneshot;

use crate::{upgrade, AutogradCall, DistAutograd, ForwardRequest, ForwardResponse, Inner};

/// The reply to a call of a function registered with
/// [`DistAutograd::register_responding`], sent by whichever thread holds it. Dropped unsent,
/// the call fails saying so.
pub struct Responder<E: AutogradEngine, R> {
    inner: Arc<Inner<E>>,
    context: ContextId,
    caller: WorkerId,
    to: To<R>,
    result: PhantomData<fn(R)>,
}

/// Where a [`Responder`] sends: the call's reply itself, or (when the agent could not hand it
/// over: a call run inline by a current-thread runtime) back to the call's task.
enum To<R> {
    Reply(Reply),
    Task(oneshot::Sender<Result<ForwardResponse<R>, String>>),
}

/// What the function registered with `register_responding` answers the agent: nothing to
/// send when its responder holds the reply, else what the responder sent back (written as
/// the response alone).
#[derive(Serialize)]
#[serde(untagged)]
enum Answered<R> {
    Here(ForwardResponse<R>),
    Elsewhere,
}

impl<E: AutogradEngine, R: Serialize + Send + Sync + 'static> Responder<E, R> {
    /// Sends the function's result and the tensors it returns (their send to the caller
    /// recorded in the context first), from this thread, which must be in the agent's
    /// runtime's context (one of its threads, or one that entered it).
    pub fn send(self, result: Result<(R, Vec<E::Tensor>), String>) {
        let (inner, context, caller) = (self.inner, self.context, self.caller);
        let response = result.and_then(|(r, out)| inner.respond(context, caller, out, r));
        match self.to {
            To::Reply(reply) => reply.send(response),
            To::Task(tx) => drop(tx.send(response)),
        }
    }
}

impl<E: AutogradEngine> DistAutograd<E> {
    /// [`register`](Self::register) for a function that answers from a thread of its own: `f`
    /// gets the call, its tracked tensors and a [`Responder`], and returns once it has handed
    /// the work on; whoever holds the responder sends the result (recording the send of its
    /// tensors), and the reply is written from that thread, with no hand-off back to a
    /// runtime worker (the Python layer's runners answer so). A responder dropped unsent
    /// fails the call, saying so.
    pub fn register_responding<A, R, F>(&self, name: &str, f: F) -> Result<(), RpcError>
    where
        A: DeserializeOwned + Send + 'static,
        R: Serialize + Send + Sync + 'static,
        F: Fn(AutogradCall<E>, A, Vec<E::Tensor>, Responder<E, R>) + Send + Sync + 'static,
    {
        let f = Arc::new(f);
        let weak = Arc::downgrade(&self.inner);
        self.inner.agent.functions().register_with_context(
            &format!("{}{name}", crate::FN_PREFIX),
            move |cx: CallContext, req: ForwardRequest<A>| {
                let (f, weak) = (f.clone(), weak.clone());
                async move {
                    let inner = upgrade(&weak)?;
                    let caller = cx.caller().id;
                    let (context, tracked) = inner.receive(caller, req.received()).await?;
                    let (to, here) = match Reply::take() {
                        Some(reply) => (To::Reply(reply), None),
                        None => {
                            let (tx, rx) = oneshot::channel();
                            (To::Task(tx), Some(rx))
                        }
                    };
                    let responder = Responder {
                        inner,
                        context: req.context,
                        caller,
                        to,
                        result: PhantomData,
                    };
                    f(
                        AutogradCall { call: cx, context },
                        req.args,
                        tracked,
                        responder,
                    );
                    match here {
                        None => Ok(Answered::Elsewhere),
                        Some(rx) => match rx.await {
                            Ok(response) => response.map(Answered::Here),
                            Err(_) => Err("the function dropped its reply unsent".to_owned()),
                        },
                    }
                }
            },
        )
    }
}
