//! Remote references.
//!
//! An [`RRef<T>`] names a value of type `T` that lives on its owner. Dropping the last clone of
//! an `RRef` on a worker tells the owner (once the owner has confirmed this worker's fork);
//! the owner frees the value when no worker refers to it any more. Passing an `RRef` inside
//! call arguments forks it for the receiver: the sender's reference stays alive until the
//! owner has confirmed the receiver's.

use std::marker::PhantomData;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use serde::de::{DeserializeOwned, Error as _, Visitor};
use serde::{Deserialize, Deserializer, Serialize, Serializer};
use tensorwire_core::protocol::{CallError, RRefHandle};

use crate::error::{RRefError, RpcError};
use crate::future::RpcFuture;
use crate::state::Agent;
use tensorwire_core::protocol::membership::WorkerInfo;
use tensorwire_core::protocol::value as codec;

type Created = crate::future::Outcome;

struct Shared {
    agent: Agent,
    handle: RRefHandle,
    /// For the worker that called `remote`: the creation's outcome, until it is read.
    created: tokio::sync::Mutex<Option<Created>>,
    /// The creation's outcome once read (`None`: not known yet, or not the creator).
    creation: Mutex<Option<Result<(), CallError>>>,
}

impl Drop for Shared {
    fn drop(&mut self) {
        self.agent.drop_reference(self.handle);
    }
}

/// A reference to a value of type `T` owned by some worker.
///
/// Made by [`Agent::remote`] (the value is created on another worker), by [`RRef::new`] (a
/// value this worker holds) or by receiving one in arguments or results. Cloning is cheap;
/// the value lives on its owner until no worker holds a reference to it.
pub struct RRef<T> {
    shared: Arc<Shared>,
    _value: PhantomData<fn() -> T>,
}

impl<T> Clone for RRef<T> {
    fn clone(&self) -> Self {
        Self {
            shared: Arc::clone(&self.shared),
            _value: PhantomData,
        }
    }
}

impl<T> std::fmt::Debug for RRef<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RRef")
            .field("rref", &self.shared.handle.rref.to_string())
            .field("owner", &self.shared.handle.owner)
            .finish()
    }
}

impl<T: Serialize + Send + Sync + 'static> RRef<T> {
    /// A reference to `value`, owned by this worker (PyTorch's `RRef(value)`), to pass to
    /// others in arguments or results. Fails only when the agent is shut down.
    ///
    /// ```no_run
    /// # async fn f(agent: tensorwire_rpc::Agent) -> Result<(), tensorwire_rpc::RpcError> {
    /// use tensorwire_rpc::RRef;
    /// let weights = RRef::new(&agent, vec![0.5f32; 4])?;
    /// let sum: f32 = agent.rpc_sync("trainer", "sum_weights", &weights, None).await?;
    /// # Ok(()) }
    /// ```
    pub fn new(agent: &Agent, value: T) -> Result<Self, RpcError> {
        agent.local_rref(value)
    }
}

impl<T: Send + Sync + 'static> RRef<T> {
    pub(crate) fn from_handle(agent: Agent, handle: RRefHandle, created: Option<Created>) -> Self {
        Self {
            shared: Arc::new(Shared {
                agent,
                handle,
                created: tokio::sync::Mutex::new(created),
                creation: Mutex::new(None),
            }),
            _value: PhantomData,
        }
    }

    fn agent(&self) -> &Agent {
        &self.shared.agent
    }

    /// The owner.
    pub fn owner(&self) -> WorkerInfo {
        let id = self.shared.handle.owner;
        WorkerInfo {
            name: self.agent().name_of(id),
            id,
        }
    }

    /// Whether this worker owns the value.
    pub fn is_owner(&self) -> bool {
        self.shared.handle.owner == self.agent().worker_info().id
    }

    /// Whether the owner has confirmed this worker's reference.
    pub fn confirmed_by_owner(&self) -> bool {
        self.agent().reference_confirmed(self.shared.handle)
    }

    /// Waits until the owner has created the value, and says whether that worked (PyTorch's
    /// `rref._get_future()`). Only the worker that called `remote` waits: elsewhere a
    /// reference exists only once its value does, and this returns at once. Bounded by the
    /// `remote()` call's own timeout: a creation that outlives it fails with
    /// [`RpcError::RRefCreation`] (and [`CallError::RRefCreationTimedOut`] inside). Cancel
    /// safe: dropping the future loses nothing.
    pub async fn created(&self) -> Result<(), RpcError> {
        let mut created = self.shared.created.lock().await;
        if let Some(rx) = created.as_mut() {
            let outcome = match rx.await {
                Ok(Ok(_)) => Ok(()),
                Ok(Err(e)) => Err(e),
                Err(_) => Err(CallError::NotRunning),
            };
            *created = None;
            *self.creation() = Some(outcome);
        }
        drop(created);
        self.known_creation()
    }

    fn creation(&self) -> std::sync::MutexGuard<'_, Option<Result<(), CallError>>> {
        self.shared
            .creation
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
    }

    /// The creation's error, if it is known to have failed.
    fn known_creation(&self) -> Result<(), RpcError> {
        match &*self.creation() {
            Some(Err(e)) => Err(self.agent().rref_error(self.shared.handle, e.clone())),
            _ => Ok(()),
        }
    }

    /// Copies the value here from its owner (`timeout` overrides the default; zero: none).
    /// A reference whose creation failed or timed out fails with [`RpcError::RRefCreation`].
    /// The copy is never tracked by distributed autograd; inside an autograd context use
    /// `AutogradContext::to_here` (crate `tensorwire-dist-autograd`), whose tensors carry
    /// their gradients back to the owner.
    pub async fn to_here(&self, timeout: Option<Duration>) -> Result<T, RpcError>
    where
        T: DeserializeOwned,
    {
        let rx = self.agent().fetch(self.shared.handle, timeout)?;
        let WorkerInfo { name: owner, id } = self.owner();
        match rx.await {
            Ok(Ok(body)) => {
                self.agent()
                    .decode_body(body, id, Some(&owner), "to_here")
                    .await
            }
            Ok(Err(source)) => Err(RpcError::Call {
                to: owner,
                function: "to_here".into(),
                source,
            }),
            Err(_) => Err(RpcError::NotRunning),
        }
    }

    /// The value itself, on its owner. A value still being created here (the function of a
    /// `remote()` to this worker is still running) is waited for, as PyTorch's owner does,
    /// within the agent's default RPC timeout ([`Agent::rpc_timeout`]; zero: no bound); a
    /// creation that fails fails this with its error.
    pub async fn local_value(&self) -> Result<Arc<T>, RpcError> {
        let rref = self.shared.handle.rref.to_string();
        if !self.is_owner() {
            return Err(RpcError::RRef {
                rref,
                reason: RRefError::NotOwner {
                    owner: self.owner(),
                },
            });
        }
        self.created().await?;
        let bound = self.agent().rpc_timeout();
        let deadline = (!bound.is_zero()).then(|| self.agent().runtime().deadline_after(bound));
        self.agent()
            .wait_confirmed(&[self.shared.handle], deadline)
            .await?;
        let any = self
            .agent()
            .local_value(self.shared.handle.rref)
            .ok_or_else(|| RpcError::RRef {
                rref: rref.clone(),
                reason: RRefError::Gone,
            })?;
        any.downcast::<T>().map_err(|_| RpcError::RRef {
            rref,
            reason: RRefError::OtherType {
                expected: std::any::type_name::<T>(),
            },
        })
    }

    /// Calls the registered method `method` on the value, on its owner, and waits for the
    /// result (`rref.rpc_sync().method(args)` in PyTorch).
    pub async fn rpc_sync<A, R>(
        &self,
        method: &str,
        args: &A,
        timeout: Option<Duration>,
    ) -> Result<R, RpcError>
    where
        A: Serialize + ?Sized,
        R: DeserializeOwned + Send + 'static,
    {
        self.rpc_async(method, args, timeout)?.await
    }

    /// Sends a call of the registered method `method` on the value to its owner now, and
    /// returns a future of its result (`rref.rpc_async().method(args)` in PyTorch). A value
    /// still being created is waited for on the owner, within the call's timeout; a creation
    /// known to have failed fails here.
    pub fn rpc_async<A, R>(
        &self,
        method: &str,
        args: &A,
        timeout: Option<Duration>,
    ) -> Result<RpcFuture<R>, RpcError>
    where
        A: Serialize + ?Sized,
        R: DeserializeOwned + Send + 'static,
    {
        self.known_creation()?;
        self.agent().send_call(
            self.shared.handle.owner,
            method,
            args,
            Some(self.shared.handle),
            timeout,
        )
    }

    /// Runs the registered method `method` on the value, on its owner, and keeps its result
    /// there as a new value (`rref.remote().method(args)` in PyTorch): returns a reference to
    /// it at once.
    pub fn remote<A, R>(
        &self,
        method: &str,
        args: &A,
        timeout: Option<Duration>,
    ) -> Result<RRef<R>, RpcError>
    where
        A: Serialize + ?Sized,
        R: Send + Sync + 'static,
    {
        self.known_creation()?;
        self.agent().send_remote(
            self.shared.handle.owner,
            method,
            args,
            Some(self.shared.handle),
            timeout,
        )
    }
}

impl<T> Serialize for RRef<T> {
    /// Forks the reference for the call's destination; only the codec's encoder can (see
    /// `codec`): anywhere else this fails, saying that an `RRef` travels only in a call.
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        let token = codec::Outgoing {
            agent: self.shared.agent.identity(),
            handle: self.shared.handle,
        };
        serializer.serialize_newtype_struct(codec::RREF_TOKEN, &token)
    }
}

/// Receives the reference the codec's decoder accepted (handed over by ticket).
struct Incoming<T>(PhantomData<fn() -> T>);

const NOT_IN_A_CALL: &str = "an RRef can only be received through a tensorwire call";

impl<'de, T: Send + Sync + 'static> Visitor<'de> for Incoming<T> {
    type Value = RRef<T>;

    fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(NOT_IN_A_CALL)
    }

    fn visit_u64<E: serde::de::Error>(self, ticket: u64) -> Result<RRef<T>, E> {
        let (agent, handle) = handoff::redeem(ticket).ok_or_else(|| E::custom(NOT_IN_A_CALL))?;
        Ok(RRef::from_handle(agent, handle, None))
    }

    fn visit_newtype_struct<D: Deserializer<'de>>(self, _: D) -> Result<RRef<T>, D::Error> {
        Err(D::Error::custom(NOT_IN_A_CALL))
    }
}

impl<'de, T: Send + Sync + 'static> Deserialize<'de> for RRef<T> {
    /// Accepts the fork that came for this worker; only the codec's decoder can (see `codec`).
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        deserializer.deserialize_newtype_struct(codec::RREF_TOKEN, Incoming(PhantomData))
    }
}

/// How a reference the codec's decoder accepted reaches its visitor ([`Incoming`]), which serde
/// lets the decoder hand nothing but data: the agent files the handle under a ticket
/// (`codec::References::hand_over`), the decoder gives the visitor the ticket's number,
/// and takes back whatever was not redeemed once the visitor returns.
pub(crate) mod handoff {
    use std::collections::HashMap;
    use std::sync::atomic::{AtomicU64, Ordering};
    use std::sync::{Mutex, PoisonError};

    use tensorwire_core::protocol::RRefHandle;

    use crate::state::Agent;

    type Filed = Mutex<Option<HashMap<u64, (Agent, RRefHandle)>>>;

    static FILED: Filed = Mutex::new(None);
    static NEXT: AtomicU64 = AtomicU64::new(1);

    fn filed() -> std::sync::MutexGuard<'static, Option<HashMap<u64, (Agent, RRefHandle)>>> {
        FILED.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Files `handle`, accepted by `agent`, under a new ticket.
    pub(crate) fn issue(agent: &Agent, handle: RRefHandle) -> u64 {
        let ticket = NEXT.fetch_add(1, Ordering::Relaxed);
        filed()
            .get_or_insert_with(HashMap::new)
            .insert(ticket, (agent.clone(), handle));
        ticket
    }

    /// The agent and handle filed under `ticket`, once.
    pub(crate) fn redeem(ticket: u64) -> Option<(Agent, RRefHandle)> {
        filed().as_mut()?.remove(&ticket)
    }

    /// Lets go of the handle under `ticket` if its visitor did not take it (the reference is
    /// dropped as a reference would be).
    pub(crate) fn cancel(ticket: u64) {
        let left = redeem(ticket);
        if let Some((agent, handle)) = left {
            agent.drop_reference(handle);
        }
    }
}

#[cfg(test)]
mod tests;
