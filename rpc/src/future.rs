//! The future of a call's result ([`RpcFuture`]), made by the agent and counted by its
//! metrics.

use crate::error::RpcError;

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
