//! The future of a call's result ([`RpcFuture`]), made by the agent and counted by its
//! metrics.

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};

use tensorwire_core::protocol::{CallError, MessageId};

use crate::error::RpcError;
use crate::state::{Abandoned, Agent, Body};
use tensorwire_core::protocol::by_id::Registered;

/// The result of [`Agent::rpc_async`](crate::Agent::rpc_async): await it for the callee's result.
pub struct RpcFuture<R> {
    pub(crate) inner:
        std::pin::Pin<Box<dyn std::future::Future<Output = Result<R, RpcError>> + Send>>,
}

impl<R> std::future::Future for RpcFuture<R> {
    type Output = Result<R, RpcError>;

    fn poll(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Self::Output> {
        self.inner.as_mut().poll(cx)
    }
}

/// The agent stopped before a call ended (its waiter was let go of).
#[derive(Debug)]
pub(crate) struct Closed;

/// How a call (a fetch, a remote) ended, read from the agent's waiter under its id: no
/// channel of its own. Dropped unread, it takes its waiter with it (never waiting for the
/// agent's lock: `Agent::let_go`).
pub(crate) struct Outcome {
    agent: Agent,
    id: MessageId,
    /// Read (or found gone): nothing of it is left in the agent.
    read: bool,
    /// The waker its waiter was made with, until the first poll.
    registered: Option<Registered>,
}

impl Outcome {
    /// The outcome of message `id`, whose waiter `agent` holds, made with the waker that
    /// `registered` identifies (if any): a first poll with that waker returns `Pending` at
    /// once, as the waiter will wake it.
    pub(crate) fn new(agent: Agent, id: MessageId, registered: Option<Registered>) -> Self {
        Self {
            agent,
            id,
            read: false,
            registered,
        }
    }
}

impl Future for Outcome {
    type Output = Result<Result<Body, CallError>, Closed>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = &mut *self;
        if this.read {
            return Poll::Ready(Err(Closed));
        }
        // Polled first by the task whose waker the waiter holds: nothing to register, and an
        // outcome already in has woken that task, which polls again.
        if this.registered.take() == Some(Registered::of(cx.waker())) {
            return Poll::Pending;
        }
        match this.agent.lock().waiters.poll(this.id, cx.waker()) {
            Poll::Pending => Poll::Pending,
            Poll::Ready(outcome) => {
                this.read = true;
                Poll::Ready(outcome.ok_or(Closed))
            }
        }
    }
}

impl Drop for Outcome {
    fn drop(&mut self) {
        if !self.read {
            self.agent.let_go(Abandoned::Waiter(self.id));
        }
    }
}

#[cfg(test)]
mod tests;
