//! What a registered function learns about its call ([`CallContext`]), and what the registry
//! needs of the agent it runs on ([`Host`], implemented here for [`Agent`]): the registry is
//! generic over its agent, so that the agent can hold it.

use std::future::Future;
use std::time::Instant;

use tensorwire_core::protocol::{RRefHandle, WorkerId};

use crate::functions::Host;
use crate::state::Agent;
use tensorwire_core::protocol::membership::WorkerInfo;

/// What a function registered with
/// `register_with_context` on [`Functions`](crate::Functions) learns about
/// its call: who called, the agent it runs on (for nested calls, without a global), and the caller's
/// deadline.
#[derive(Debug, Clone)]
pub struct CallContext {
    caller: WorkerInfo,
    agent: Agent,
    deadline: Option<Instant>,
}

impl CallContext {
    /// The worker that made the call.
    pub fn caller(&self) -> &WorkerInfo {
        &self.caller
    }

    /// The agent this function runs on.
    pub fn agent(&self) -> &Agent {
        &self.agent
    }

    /// When the caller stops waiting for the result (`None`: the call has no timeout), on the
    /// agent's runtime clock (see [`RpcOptions::runtime`](crate::RpcOptions::runtime)). A
    /// nested call can use what is left: [`remaining`](Self::remaining).
    pub fn deadline(&self) -> Option<Instant> {
        self.deadline
    }

    /// The time left until [`deadline`](Self::deadline) (`None`: no deadline; zero once past).
    pub fn remaining(&self) -> Option<std::time::Duration> {
        self.deadline
            .map(|d| d.saturating_duration_since(self.agent.runtime().now()))
    }
}

impl Host for Agent {
    type Context = CallContext;

    fn context(&self, caller: WorkerId, deadline: Option<Instant>) -> CallContext {
        CallContext {
            caller: WorkerInfo {
                name: self.name_of(caller),
                id: caller,
            },
            agent: self.clone(),
            deadline,
        }
    }

    fn confirmed(
        &self,
        handles: &[RRefHandle],
        deadline: Option<Instant>,
    ) -> impl Future<Output = Result<(), crate::error::RpcError>> + Send {
        self.wait_confirmed(handles, deadline)
    }

    fn serving(
        &self,
        caller: WorkerId,
        function: &str,
        bytes: u64,
    ) -> (tracing::Span, impl FnOnce(bool) + Send + 'static) {
        let (span, served) =
            self.inner
                .metrics
                .serve(&|id| self.name_of(id), caller, function, bytes);
        (span, move |ok| served.finish(ok))
    }
}
