//! Registered functions: the only code a peer can make this worker run.
//!
//! A function has a name, typed arguments and a typed result (serde). A *method* also takes the
//! value of a remote reference owned here (`rref.rpc_sync("method", args)`), so state kept on
//! its owner (a parameter server's weights) is shared by every call.

use std::any::Any;
use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, RwLock};

use bytes::Bytes;
use serde::de::DeserializeOwned;
use serde::Serialize;

use crate::error::RpcError;
use crate::tensors::{self, Prepared, Routes, TensorTransferError};
use std::time::Instant;
use tensorwire_core::placement::Direction;
use tensorwire_core::protocol::functions::{AlreadyRegistered, FunctionTable};
use tensorwire_core::protocol::served::ServeFailure;
use tensorwire_core::protocol::value as codec;
use tensorwire_core::protocol::{RRefForkData, RRefHandle, WorkerId};
use tensorwire_core::tensor::Tensor;

/// A value a function produced: kept on its owner (remote references) or encoded for a reply.
pub(crate) trait Value: Any + Send + Sync {
    /// Encodes the value for worker `to`, with its tensors placed by the reverse device map.
    fn prepare(&self, agent: &dyn Routes, to: u32) -> Result<Prepared, TensorTransferError>;
    /// The value as `Any`, for typed access on its owner.
    fn into_any(self: Arc<Self>) -> Arc<dyn Any + Send + Sync>;
}

impl<T: Serialize + Send + Sync + 'static> Value for T {
    fn prepare(&self, agent: &dyn Routes, to: u32) -> Result<Prepared, TensorTransferError> {
        tensors::prepare(agent, to, self, Direction::Response)
    }
    fn into_any(self: Arc<Self>) -> Arc<dyn Any + Send + Sync> {
        self
    }
}

/// Why a handler failed, before it is reported to the caller (core decides what the caller
/// is told: `ServeFailure::Handler`).
pub(crate) use tensorwire_core::protocol::served::HandlerError;

pub(crate) type HandlerFuture =
    Pin<Box<dyn Future<Output = Result<Arc<dyn Value>, HandlerError>> + Send>>;

/// What the functions need of the agent they run on: the registry is generic over it, so that
/// it names no agent type (the agent holds the registry). The agent implements it.
pub trait Host: Routes + Clone + Send + Sync + 'static {
    /// What a function registered with a context gets about its call (the agent's
    /// [`CallContext`](crate::CallContext)).
    type Context: Send + 'static;

    /// The context of a call from `caller` that it waits for until `deadline`.
    fn context(&self, caller: WorkerId, deadline: Option<Instant>) -> Self::Context;

    /// Waits until the owners of `handles` have confirmed them, at most until `deadline`
    /// (the error says which was not: [`RpcError::RRef`]).
    fn confirmed(
        &self,
        handles: &[RRefHandle],
        deadline: Option<Instant>,
    ) -> impl Future<Output = Result<(), RpcError>> + Send;

    /// Counts a call of `function` from `caller` with `bytes` as being served, and gives the
    /// span it runs in and what to tell when it finished (`true`: it succeeded).
    fn serving(
        &self,
        caller: WorkerId,
        function: &str,
        bytes: u64,
    ) -> (tracing::Span, impl FnOnce(bool) + Send + 'static);
}

/// What a handler gets.
pub(crate) struct Invocation<H> {
    pub(crate) agent: H,
    pub(crate) caller: WorkerId,
    /// When the caller stops waiting.
    pub(crate) deadline: Option<Instant>,
    pub(crate) args: Bytes,
    pub(crate) tensors: Vec<Tensor>,
    /// The forks the request announced: the only references its arguments may hold.
    pub(crate) forks: Vec<RRefForkData>,
    pub(crate) target: Option<Arc<dyn Any + Send + Sync>>,
}

impl<H: Host> Invocation<H> {
    /// Decodes the arguments and waits until the owner of every remote reference in them has
    /// confirmed it (PyTorch runs a function only then), bounded by the call's deadline.
    pub(crate) async fn arguments<A: DeserializeOwned>(&mut self) -> Result<A, HandlerError> {
        let (args, references) = codec::decode_with_references(
            &self.agent,
            &self.args,
            std::mem::take(&mut self.tensors),
            &self.forks,
        )
        .map_err(|e| HandlerError::BadArguments(e.to_string()))?;
        // Most arguments hold no reference: then nothing waits, and the agent's lock is not
        // taken to learn so (core's `wait_confirmed` gives no wait for an empty list).
        if references.is_empty() {
            return Ok(args);
        }
        self.agent
            .confirmed(&references, self.deadline)
            .await
            // Text from here: it travels to the caller as a remote error's message.
            .map_err(|e| HandlerError::Target(e.to_string()))?;
        Ok(args)
    }

    /// What a function registered with a context gets about this call.
    pub(crate) fn context(&self) -> H::Context {
        self.agent.context(self.caller, self.deadline)
    }
}

pub(crate) type Handler<H> = Arc<dyn Fn(Invocation<H>) -> HandlerFuture + Send + Sync>;

/// The result of a user function, as the agent keeps or sends it.
pub(crate) fn finish<R, E>(outcome: Result<R, E>) -> Result<Arc<dyn Value>, HandlerError>
where
    R: Serialize + Send + Sync + 'static,
    E: fmt::Display,
{
    match outcome {
        Ok(r) => Ok(Arc::new(r) as Arc<dyn Value>),
        Err(e) => Err(HandlerError::Failed(e.to_string())),
    }
}

/// The value a method is called on, as a `T`.
pub(crate) fn method_target<T: Send + Sync + 'static>(
    name: &str,
    target: Option<Arc<dyn Any + Send + Sync>>,
) -> Result<Arc<T>, HandlerError> {
    let target = target.ok_or_else(|| HandlerError::no_target(name))?;
    target
        .downcast::<T>()
        .map_err(|_| HandlerError::target_of_another_type(name, std::any::type_name::<T>()))
}

/// The functions a worker serves, run on an agent of type `H` (the crate's
/// [`Functions`](crate::Functions)). Cloning shares the table.
pub struct Registry<H> {
    table: Arc<RwLock<FunctionTable<Handler<H>>>>,
}

impl<H> Clone for Registry<H> {
    fn clone(&self) -> Self {
        Registry {
            table: Arc::clone(&self.table),
        }
    }
}

impl<H> Default for Registry<H> {
    fn default() -> Self {
        Registry {
            table: Arc::default(),
        }
    }
}

impl<H> fmt::Debug for Registry<H> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_tuple("Functions").field(&self.names()).finish()
    }
}

impl<H> Registry<H> {
    /// No functions.
    pub fn new() -> Self {
        Self::default()
    }

    fn read(&self) -> std::sync::RwLockReadGuard<'_, FunctionTable<Handler<H>>> {
        self.table
            .read()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    fn write(&self) -> std::sync::RwLockWriteGuard<'_, FunctionTable<Handler<H>>> {
        self.table
            .write()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Adds `handler` under `name`; a name taken already is an error (core's table refuses
    /// it), never a silent replacement.
    pub(crate) fn insert(&self, name: &str, handler: Handler<H>) -> Result<(), RpcError>
    where
        H: Host,
    {
        (self.write().insert(name, handler))
            .map_err(|AlreadyRegistered(name)| RpcError::FunctionRegistered(name))
    }

    /// Removes the function registered under `name`; whether there was one. Calls already
    /// running finish; later calls of `name` fail as calls of an unknown function.
    pub fn unregister(&self, name: &str) -> bool {
        self.write().remove(name)
    }

    /// The handler of a call of `name` on worker `worker`, or what its caller is told.
    pub(crate) fn lookup(&self, name: &str, worker: &str) -> Result<Handler<H>, ServeFailure> {
        self.read().lookup(name, worker)
    }

    /// Registered names, sorted.
    pub fn names(&self) -> Vec<String> {
        self.read().names()
    }
}

impl<H: Host> Registry<H> {
    /// Registers `f` under `name`, for calls by name (the dynamic form; a
    /// [`Function`](crate::Function) descriptor with [`serve`](Self::serve) checks the types).
    /// The function runs once every remote reference in its arguments is confirmed by its
    /// owner.
    ///
    /// # Errors
    /// [`RpcError::FunctionRegistered`] when `name` is taken already.
    ///
    /// ```
    /// let fns = tensorwire_rpc::Functions::new();
    /// fns.register("add", |(a, b): (i64, i64)| async move { Ok::<_, String>(a + b) })?;
    /// assert!(fns.register("add", |x: i64| async move { Ok::<_, String>(x) }).is_err());
    /// # Ok::<(), tensorwire_rpc::RpcError>(())
    /// ```
    pub fn register<A, R, E, F, Fut>(&self, name: &str, f: F) -> Result<(), RpcError>
    where
        A: DeserializeOwned + Send + 'static,
        R: Serialize + Send + Sync + 'static,
        E: fmt::Display + Send + 'static,
        F: Fn(A) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Result<R, E>> + Send + 'static,
    {
        let f = Arc::new(f);
        self.insert(
            name,
            Arc::new(move |mut inv: Invocation<H>| {
                let f = Arc::clone(&f);
                // No context made (its caller's name looked up) for a function that takes none.
                Box::pin(async move { finish(f(inv.arguments().await?).await) })
            }),
        )
    }

    /// Registers `f` under `name`; `f` also gets the [`CallContext`](crate::CallContext): the caller, the agent
    /// (for nested calls) and the deadline. A name taken already is an error.
    ///
    /// ```
    /// use tensorwire_rpc::{CallContext, Functions};
    ///
    /// let fns = Functions::new();
    /// // Forwards to the next worker and says who asked.
    /// fns.register_with_context("relay", |ctx: CallContext, (to, x): (String, i64)| async move {
    ///     let doubled: i64 = ctx.agent().rpc_sync(to.as_str(), "double", &x, ctx.remaining()).await
    ///         .map_err(|e| e.to_string())?;
    ///     Ok::<_, String>(format!("{} asked; {doubled}", ctx.caller().name))
    /// })?;
    /// # Ok::<(), tensorwire_rpc::RpcError>(())
    /// ```
    pub fn register_with_context<A, R, E, F, Fut>(&self, name: &str, f: F) -> Result<(), RpcError>
    where
        A: DeserializeOwned + Send + 'static,
        R: Serialize + Send + Sync + 'static,
        E: fmt::Display + Send + 'static,
        F: Fn(H::Context, A) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Result<R, E>> + Send + 'static,
    {
        let f = Arc::new(f);
        self.insert(
            name,
            Arc::new(move |mut inv: Invocation<H>| {
                let f = Arc::clone(&f);
                Box::pin(async move {
                    let args: A = inv.arguments().await?;
                    finish(f(inv.context(), args).await)
                })
            }),
        )
    }

    /// Registers a method on values of type `T` owned here: `rref.rpc_sync(name, args)` on an
    /// `RRef<T>` runs `f(value, args)` on the owner. A name taken already is an error.
    pub fn register_method<T, A, R, E, F, Fut>(&self, name: &str, f: F) -> Result<(), RpcError>
    where
        T: Send + Sync + 'static,
        A: DeserializeOwned + Send + 'static,
        R: Serialize + Send + Sync + 'static,
        E: fmt::Display + Send + 'static,
        F: Fn(Arc<T>, A) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Result<R, E>> + Send + 'static,
    {
        self.register_method_with_context(name, move |_: H::Context, value: Arc<T>, args: A| {
            f(value, args)
        })
    }

    /// [`register_method`](Self::register_method) with the [`CallContext`](crate::CallContext).
    pub fn register_method_with_context<T, A, R, E, F, Fut>(
        &self,
        name: &str,
        f: F,
    ) -> Result<(), RpcError>
    where
        T: Send + Sync + 'static,
        A: DeserializeOwned + Send + 'static,
        R: Serialize + Send + Sync + 'static,
        E: fmt::Display + Send + 'static,
        F: Fn(H::Context, Arc<T>, A) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Result<R, E>> + Send + 'static,
    {
        let f = Arc::new(f);
        let name_owned = name.to_owned();
        self.insert(
            name,
            Arc::new(move |mut inv: Invocation<H>| {
                let f = Arc::clone(&f);
                let name = name_owned.clone();
                Box::pin(async move {
                    let value = method_target::<T>(&name, inv.target.take())?;
                    let args: A = inv.arguments().await?;
                    finish(f(inv.context(), value, args).await)
                })
            }),
        )
    }
}
