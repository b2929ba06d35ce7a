//! Typed functions: a descriptor names a function together with its argument and result types,
//! and is used both to serve it and to call it, so that within one codebase a mismatch is a
//! compile error (tarpc's typed clients, without a macro).
//!
//! ```no_run
//! use tensorwire_rpc::{init_rpc, Function, Functions, RpcOptions};
//!
//! /// Shared by every binary of the cluster (put it in a crate they all use).
//! const ADD: Function<(i64, i64), i64> = Function::new("add");
//!
//! # async fn run() -> Result<(), tensorwire_rpc::RpcError> {
//! let functions = Functions::new();
//! functions.serve(&ADD, |(a, b)| async move { Ok::<_, String>(a + b) })?;
//! let agent = init_rpc("worker0", 0, Some(2), RpcOptions::default().with_functions(functions)).await?;
//!
//! let sum = agent.call(&ADD, "worker1", &(2, 3)).await?; // an i64
//! // agent.call(&ADD, "worker1", &"two") does not compile: ADD takes (i64, i64).
//! let later = agent.call(&ADD, 1u32, &(4, 5)).timeout(std::time::Duration::from_secs(5)).send()?;
//! assert_eq!((sum, later.await?), (5, 9));
//! # Ok(()) }
//! ```
//!
//! Across binaries the compiler cannot help, and postcard is not self-describing: a caller and a
//! callee that disagree on the types could decode garbage. So a typed call carries a *type
//! fingerprint* in front of its arguments: a magic tag, a 64-bit hash of the signature
//! (`std::any::type_name` of the arguments and the result) and the signature itself. The
//! callee's typed handler checks it before decoding anything, and refuses a mismatch with an
//! error naming the function and both signatures:
//!
//! ```text
//! RPC "add" to worker1: ... bad arguments for "add": called as `(i32, i32) -> i64`
//! (fingerprint 5c8e...), but this worker serves it as `(i64, i64) -> i64` (fingerprint 9f1d...)
//! ```
//!
//! Type names include the defining crate's path, so define the types calls carry in a crate
//! every binary uses, as tarpc's service traits are. A typed function can only be called
//! through its descriptor; the dynamic form (`register` on [`Functions`] and
//! [`Agent::rpc_sync`] by name) stays for names chosen at run time.

use std::fmt;
use std::future::{Future, IntoFuture};
use std::marker::PhantomData;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use serde::de::DeserializeOwned;
use serde::Serialize;

use crate::context::CallContext;
use crate::error::RpcError;
use crate::functions::{finish, method_target, HandlerError, Invocation};
use crate::future::RpcFuture;
use crate::rref::RRef;
use crate::state::{Agent, Functions};
use tensorwire_core::protocol::membership::WorkerRef;
pub use tensorwire_core::protocol::typed::Signature;

/// A function served by name with arguments `A` and result `R`. Make it a `const` shared by
/// the callers and the callee: `serve` on [`Functions`] registers it, [`Agent::call`] calls it.
pub struct Function<A, R> {
    name: &'static str,
    types: PhantomData<fn(A) -> R>,
}

impl<A, R> Function<A, R> {
    /// The function registered as `name`.
    pub const fn new(name: &'static str) -> Self {
        Self {
            name,
            types: PhantomData,
        }
    }

    /// Its registered name.
    pub const fn name(&self) -> &'static str {
        self.name
    }
}

impl<A: 'static, R: 'static> Function<A, R> {
    /// Its signature: `type_name` of the arguments and the result, and their hash.
    pub fn signature(&self) -> Signature {
        Signature::function::<A, R>()
    }
}

impl<A, R> Clone for Function<A, R> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<A, R> Copy for Function<A, R> {}

impl<A: 'static, R: 'static> fmt::Debug for Function<A, R> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Function({:?}: {})", self.name, self.signature().text())
    }
}

/// A method on values of type `T` behind remote references, with arguments `A` and result `R`:
/// `serve_method` on [`Functions`] registers it, [`RRef::call`] calls it on the value's owner. The
/// reference's type must be `T`, so calling it on another reference does not compile.
pub struct Method<T, A, R> {
    name: &'static str,
    types: PhantomData<fn(&T, A) -> R>,
}

impl<T, A, R> Method<T, A, R> {
    /// The method registered as `name`.
    pub const fn new(name: &'static str) -> Self {
        Self {
            name,
            types: PhantomData,
        }
    }

    /// Its registered name.
    pub const fn name(&self) -> &'static str {
        self.name
    }
}

impl<T: 'static, A: 'static, R: 'static> Method<T, A, R> {
    /// Its signature: `type_name` of the value, the arguments and the result, and their hash.
    pub fn signature(&self) -> Signature {
        Signature::method::<T, A, R>()
    }
}

impl<T, A, R> Clone for Method<T, A, R> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<T, A, R> Copy for Method<T, A, R> {}

impl<T: 'static, A: 'static, R: 'static> fmt::Debug for Method<T, A, R> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Method({:?}: {})", self.name, self.signature().text())
    }
}

/// Checks the fingerprint in front of `inv`'s arguments against `ours`, and leaves only the
/// arguments in `inv`.
fn check_header(
    name: &str,
    ours: &Signature,
    inv: &mut Invocation<Agent>,
) -> Result<(), HandlerError> {
    let start = (ours.check(&inv.args)).map_err(|e| HandlerError::type_mismatch(name, ours, &e))?;
    inv.args = Bytes::slice(&inv.args, start..);
    Ok(())
}

impl Functions {
    /// Registers `f` as `function`: calls must come through the same descriptor
    /// ([`Agent::call`]), and a call whose types differ (another binary's idea of them) is
    /// refused before its arguments are decoded.
    ///
    /// # Errors
    /// [`RpcError::FunctionRegistered`] when the name is taken already.
    ///
    /// ```
    /// use tensorwire_rpc::{Function, Functions};
    ///
    /// const ADD: Function<(i64, i64), i64> = Function::new("add");
    /// let functions = Functions::new();
    /// functions.serve(&ADD, |(a, b)| async move { Ok::<_, String>(a + b) })?;
    /// # Ok::<(), tensorwire_rpc::RpcError>(())
    /// ```
    pub fn serve<A, R, E, F, Fut>(&self, function: &Function<A, R>, f: F) -> Result<(), RpcError>
    where
        A: DeserializeOwned + Send + 'static,
        R: Serialize + Send + Sync + 'static,
        E: fmt::Display + Send + 'static,
        F: Fn(A) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Result<R, E>> + Send + 'static,
    {
        self.serve_with_context(function, move |_: CallContext, args: A| f(args))
    }

    /// [`serve`](Self::serve), with the [`CallContext`] (caller, agent, deadline).
    pub fn serve_with_context<A, R, E, F, Fut>(
        &self,
        function: &Function<A, R>,
        f: F,
    ) -> Result<(), RpcError>
    where
        A: DeserializeOwned + Send + 'static,
        R: Serialize + Send + Sync + 'static,
        E: fmt::Display + Send + 'static,
        F: Fn(CallContext, A) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Result<R, E>> + Send + 'static,
    {
        let f = Arc::new(f);
        let name = function.name();
        let signature = Arc::new(function.signature());
        self.insert(
            name,
            Arc::new(move |mut inv: Invocation<Agent>| {
                let f = Arc::clone(&f);
                let signature = Arc::clone(&signature);
                Box::pin(async move {
                    check_header(name, &signature, &mut inv)?;
                    let args: A = inv.arguments().await?;
                    finish(f(inv.context(), args).await)
                })
            }),
        )
    }

    /// Registers `f` as `method` on values of type `T` owned here: [`RRef::call`] on an
    /// `RRef<T>` runs `f(value, args)` on the owner, with the same type check as
    /// [`serve`](Self::serve).
    pub fn serve_method<T, A, R, E, F, Fut>(
        &self,
        method: &Method<T, A, R>,
        f: F,
    ) -> Result<(), RpcError>
    where
        T: Send + Sync + 'static,
        A: DeserializeOwned + Send + 'static,
        R: Serialize + Send + Sync + 'static,
        E: fmt::Display + Send + 'static,
        F: Fn(Arc<T>, A) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Result<R, E>> + Send + 'static,
    {
        let f = Arc::new(f);
        let name = method.name();
        let signature = Arc::new(method.signature());
        self.insert(
            name,
            Arc::new(move |mut inv: Invocation<Agent>| {
                let f = Arc::clone(&f);
                let signature = Arc::clone(&signature);
                Box::pin(async move {
                    let value = method_target::<T>(name, inv.target.take())?;
                    check_header(name, &signature, &mut inv)?;
                    let args: A = inv.arguments().await?;
                    finish(f(value, args).await)
                })
            }),
        )
    }
}

/// A typed call being prepared: `.await` it for the result, or [`send`](Self::send) it now and
/// await later, or [`remote`](Self::remote) it to keep the result on the callee.
#[must_use = "a call does nothing until awaited, sent or made remote"]
pub struct Call<'a, A: ?Sized, R> {
    agent: &'a Agent,
    name: &'static str,
    signature: Signature,
    to: WorkerRef,
    args: &'a A,
    timeout: Option<Duration>,
    result: PhantomData<fn() -> R>,
}

impl<A: ?Sized, R> fmt::Debug for Call<'_, A, R> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Call")
            .field("function", &self.name)
            .field("signature", &self.signature.text())
            .field("to", &self.to)
            .field("timeout", &self.timeout)
            .finish()
    }
}

impl<'a, A, R> Call<'a, A, R>
where
    A: Serialize + ?Sized,
    R: DeserializeOwned + Send + 'static,
{
    /// This call's timeout instead of the agent's default (zero: none).
    pub fn timeout(mut self, timeout: Duration) -> Self {
        self.timeout = Some(timeout);
        self
    }

    /// Sends the call now; the future of its result can be awaited later (`rpc_async`).
    pub fn send(self) -> Result<RpcFuture<R>, RpcError> {
        self.agent.rpc_async(
            self.to,
            self.name,
            &self.signature.with(self.args),
            self.timeout,
        )
    }
}

impl<A, R> Call<'_, A, R>
where
    A: Serialize + ?Sized,
    R: Send + Sync + 'static,
{
    /// Runs the function on the callee and keeps its result there, returning a reference to
    /// it at once (`remote`); the result type needs no `Deserialize`.
    pub fn remote(self) -> Result<RRef<R>, RpcError> {
        self.agent.remote(
            self.to,
            self.name,
            &self.signature.with(self.args),
            self.timeout,
        )
    }
}

impl<'a, A, R> IntoFuture for Call<'a, A, R>
where
    A: Serialize + ?Sized,
    R: DeserializeOwned + Send + 'static,
{
    type Output = Result<R, RpcError>;
    type IntoFuture = Pin<Box<dyn Future<Output = Result<R, RpcError>> + Send>>;

    fn into_future(self) -> Self::IntoFuture {
        let sent = self.send();
        Box::pin(async move { sent?.await })
    }
}

impl<'a, A, R> Call<'a, A, R>
where
    A: Serialize + 'static,
    R: 'static,
{
    /// A call of `function(args)` on `to` by `agent`, not sent yet (see [`Agent::call`]).
    pub(crate) fn new(
        agent: &'a Agent,
        function: &Function<A, R>,
        to: WorkerRef,
        args: &'a A,
    ) -> Self {
        Call {
            agent,
            name: function.name,
            signature: function.signature(),
            to,
            args,
            timeout: None,
            result: PhantomData,
        }
    }
}

/// A typed method call being prepared (see [`RRef::call`]).
#[must_use = "a call does nothing until awaited, sent or made remote"]
pub struct MethodCall<'a, T, A: ?Sized, R> {
    rref: &'a RRef<T>,
    name: &'static str,
    signature: Signature,
    args: &'a A,
    timeout: Option<Duration>,
    result: PhantomData<fn() -> R>,
}

impl<T, A: ?Sized, R> fmt::Debug for MethodCall<'_, T, A, R> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MethodCall")
            .field("method", &self.name)
            .field("signature", &self.signature.text())
            .field("timeout", &self.timeout)
            .finish()
    }
}

impl<'a, T, A, R> MethodCall<'a, T, A, R>
where
    T: Send + Sync + 'static,
    A: Serialize + ?Sized,
    R: DeserializeOwned + Send + 'static,
{
    /// This call's timeout instead of the agent's default (zero: none).
    pub fn timeout(mut self, timeout: Duration) -> Self {
        self.timeout = Some(timeout);
        self
    }

    /// Sends the call now; the future of its result can be awaited later.
    pub fn send(self) -> Result<RpcFuture<R>, RpcError> {
        self.rref
            .rpc_async(self.name, &self.signature.with(self.args), self.timeout)
    }
}

impl<T, A, R> MethodCall<'_, T, A, R>
where
    T: Send + Sync + 'static,
    A: Serialize + ?Sized,
    R: Send + Sync + 'static,
{
    /// Runs the method on the owner and keeps its result there, as a new reference.
    pub fn remote(self) -> Result<RRef<R>, RpcError> {
        self.rref
            .remote(self.name, &self.signature.with(self.args), self.timeout)
    }
}

impl<'a, T, A, R> IntoFuture for MethodCall<'a, T, A, R>
where
    T: Send + Sync + 'static,
    A: Serialize + ?Sized,
    R: DeserializeOwned + Send + 'static,
{
    type Output = Result<R, RpcError>;
    type IntoFuture = Pin<Box<dyn Future<Output = Result<R, RpcError>> + Send>>;

    fn into_future(self) -> Self::IntoFuture {
        let sent = self.send();
        Box::pin(async move { sent?.await })
    }
}

impl<T: Send + Sync + 'static> RRef<T> {
    /// Calls `method(args)` on the value behind this reference, on its owner: `.await` it for
    /// the result, or use `timeout`, `send`, `remote`. The method's value type must be `T`.
    pub fn call<'a, A, R>(
        &'a self,
        method: &Method<T, A, R>,
        args: &'a A,
    ) -> MethodCall<'a, T, A, R>
    where
        A: Serialize + 'static,
        R: 'static,
    {
        MethodCall {
            rref: self,
            name: method.name,
            signature: method.signature(),
            args,
            timeout: None,
            result: PhantomData,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const ADD: Function<(i64, i64), i64> = Function::new("add");

    #[test]
    fn signatures_name_the_types_and_hash_stably() {
        let s = ADD.signature();
        assert_eq!(s.text(), "(i64, i64) -> i64");
        // FNV-1a of the text: the same in every build, so binaries agree.
        assert_eq!(
            s.fingerprint(),
            Signature::new(s.text().to_owned()).fingerprint()
        );
        let other: Function<(i32, i32), i64> = Function::new("add");
        assert_ne!(other.signature().fingerprint(), s.fingerprint());
        assert!(format!("{s}").contains("(i64, i64) -> i64"));
        let m: Method<String, u8, bool> = Method::new("m");
        assert_eq!(m.signature().text(), "alloc::string::String::(u8) -> bool");
    }

    #[test]
    fn serving_a_name_twice_is_an_error() {
        let f = Functions::new();
        f.serve(&ADD, |(a, b)| async move { Ok::<_, String>(a + b) })
            .unwrap();
        let e = f
            .register("add", |x: i64| async move { Ok::<_, String>(x) })
            .unwrap_err();
        assert_eq!(
            e.to_string(),
            "function \"add\" is already registered on this worker"
        );
    }
}
