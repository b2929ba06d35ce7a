//! The future of a call's result ([`RpcFuture`]), made by the agent and counted by its
//! metrics.

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};

use tensorwire_core::protocol::{CallError, MessageId};

use crate::error::RpcError;
use crate::state::{Agent, Body, Waiter};

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
/// channel of its own. Dropped unread, it takes its waiter with it.
pub(crate) struct Outcome {
    agent: Agent,
    id: MessageId,
    /// Read (or found gone): nothing of it is left in the agent.
    read: bool,
}

impl Outcome {
    /// The outcome of message `id`, whose waiter `agent` holds.
    pub(crate) fn new(agent: Agent, id: MessageId) -> Self {
        Self {
            agent,
            id,
            read: false,
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
        let mut st = this.agent.lock();
        if let Some(Waiter::Waiting(waker)) = st.waiters.get_mut(this.id) {
            if !waker.as_ref().is_some_and(|w| w.will_wake(cx.waker())) {
                *waker = Some(cx.waker().clone());
            }
            return Poll::Pending;
        }
        this.read = true;
        Poll::Ready(match st.waiters.remove(this.id) {
            Some(Waiter::Done(outcome)) => Ok(outcome),
            _ => Err(Closed),
        })
    }
}

impl Drop for Outcome {
    fn drop(&mut self) {
        if !self.read {
            // Its body (if it ended) is dropped after the lock.
            let left = self.agent.lock().waiters.remove(self.id);
            drop(left);
        }
    }
}
