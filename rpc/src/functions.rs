//! Registered functions: the only code a peer can make this worker run.
//!
//! A function has a name, typed arguments and a typed result (serde). A *method* also takes the
//! value of a remote reference owned here (`rref.rpc_sync("method", args)`), so state kept on
//! its owner (a parameter server's weights) is shared by every call.

use std::any::Any;
use std::collections::HashMap;
use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, RwLock};

use bytes::Bytes;
use serde::de::DeserializeOwned;
use serde::Serialize;

use crate::agent::Agent;
use crate::codec;
use crate::tensors::{self, Prepared, TensorTransferError};
use tensorwire_core::placement::Direction;
use tensorwire_core::tensor::Tensor;

/// A value a function produced: kept on its owner (remote references) or encoded for a reply.
pub(crate) trait Value: Any + Send + Sync {
    /// Encodes the value for worker `to`, with its tensors placed by the reverse device map.
    fn prepare(&self, agent: &Agent, to: u32) -> Result<Prepared, TensorTransferError>;
    /// The value as `Any`, for typed access on its owner.
    fn into_any(self: Arc<Self>) -> Arc<dyn Any + Send + Sync>;
}

impl<T: Serialize + Send + Sync + 'static> Value for T {
    fn prepare(&self, agent: &Agent, to: u32) -> Result<Prepared, TensorTransferError> {
        tensors::prepare(agent, to, self, Direction::Response)
    }
    fn into_any(self: Arc<Self>) -> Arc<dyn Any + Send + Sync> {
        self
    }
}

/// Why a handler failed, before it is reported to the caller.
#[derive(Debug)]
pub(crate) enum HandlerError {
    /// The arguments did not decode.
    BadArguments(String),
    /// The function returned an error.
    Failed(String),
    /// A method was called without a value, or on a value of another type.
    Target(String),
}

pub(crate) type HandlerFuture =
    Pin<Box<dyn Future<Output = Result<Arc<dyn Value>, HandlerError>> + Send>>;

/// What a handler gets.
pub(crate) struct Invocation {
    pub(crate) agent: Agent,
    pub(crate) args: Bytes,
    pub(crate) tensors: Vec<Tensor>,
    pub(crate) target: Option<Arc<dyn Any + Send + Sync>>,
}

pub(crate) type Handler = Arc<dyn Fn(Invocation) -> HandlerFuture + Send + Sync>;

/// The functions a worker serves. Cloning shares the table.
#[derive(Clone, Default)]
pub struct Functions {
    table: Arc<RwLock<HashMap<String, Handler>>>,
}

impl fmt::Debug for Functions {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut names: Vec<String> = self.read().keys().cloned().collect();
        names.sort();
        f.debug_tuple("Functions").field(&names).finish()
    }
}

impl Functions {
    /// No functions.
    pub fn new() -> Self {
        Self::default()
    }

    fn read(&self) -> std::sync::RwLockReadGuard<'_, HashMap<String, Handler>> {
        self.table
            .read()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    fn insert(&self, name: &str, handler: Handler) {
        self.table
            .write()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .insert(name.to_owned(), handler);
    }

    pub(crate) fn get(&self, name: &str) -> Option<Handler> {
        self.read().get(name).cloned()
    }

    /// Registered names, sorted.
    pub fn names(&self) -> Vec<String> {
        let mut v: Vec<String> = self.read().keys().cloned().collect();
        v.sort();
        v
    }

    /// Registers `f` under `name` (replacing an earlier function of that name).
    ///
    /// ```
    /// let fns = tensorwire_rpc::Functions::new();
    /// fns.register("add", |(a, b): (i64, i64)| async move { Ok::<_, String>(a + b) });
    /// ```
    pub fn register<A, R, E, F, Fut>(&self, name: &str, f: F)
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
            Arc::new(move |inv: Invocation| {
                let f = Arc::clone(&f);
                Box::pin(async move {
                    let args: A = codec::decode(&inv.agent, &inv.args, inv.tensors)
                        .map_err(|e| HandlerError::BadArguments(e.to_string()))?;
                    match f(args).await {
                        Ok(r) => Ok(Arc::new(r) as Arc<dyn Value>),
                        Err(e) => Err(HandlerError::Failed(e.to_string())),
                    }
                })
            }),
        );
    }

    /// Registers a method on values of type `T` owned here: `rref.rpc_sync(name, args)` on an
    /// `RRef<T>` runs `f(value, args)` on the owner.
    pub fn register_method<T, A, R, E, F, Fut>(&self, name: &str, f: F)
    where
        T: Send + Sync + 'static,
        A: DeserializeOwned + Send + 'static,
        R: Serialize + Send + Sync + 'static,
        E: fmt::Display + Send + 'static,
        F: Fn(Arc<T>, A) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Result<R, E>> + Send + 'static,
    {
        let f = Arc::new(f);
        let name_owned = name.to_owned();
        self.insert(
            name,
            Arc::new(move |inv: Invocation| {
                let f = Arc::clone(&f);
                let name = name_owned.clone();
                Box::pin(async move {
                    let target = inv.target.ok_or_else(|| {
                        HandlerError::Target(format!(
                            "method {name:?} needs a remote reference to call it on"
                        ))
                    })?;
                    let value = target.downcast::<T>().map_err(|_| {
                        HandlerError::Target(format!(
                            "method {name:?} expects a value of type {}",
                            std::any::type_name::<T>()
                        ))
                    })?;
                    let args: A = codec::decode(&inv.agent, &inv.args, inv.tensors)
                        .map_err(|e| HandlerError::BadArguments(e.to_string()))?;
                    match f(value, args).await {
                        Ok(r) => Ok(Arc::new(r) as Arc<dyn Value>),
                        Err(e) => Err(HandlerError::Failed(e.to_string())),
                    }
                })
            }),
        );
    }
}
