//! The agent's handle: the API a user holds ([`Agent`], cheap to clone) — calls, remote
//! references, collectives of the agent, options and the debug view. Each call locks the
//! state, hands the endpoint of `core::protocol` a command and moves its output along.
//!
//! The rest of the agent lives beside it: what it holds in `state`, its connections in
//! `links`, the driver task in `driver`, running functions in `serve`, its start in `init`
//! and its end in `shutdown`.

use std::any::Any;
use std::fmt;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError, TryLockError};
use std::time::{Duration, Instant};
use tensorwire_core::hashing::HashMap;

use bytes::Bytes;
use serde::de::DeserializeOwned;
use serde::Serialize;
use tensorwire_core::device::{Device, DeviceMap, DeviceMaps};
use tensorwire_core::ports::process_group::{Collectives, ProcessGroupError};
use tensorwire_core::ports::store::Store;
use tensorwire_core::ports::transport::Connection;

use crate::future::Outcome;
use tensorwire_core::protocol::node::Node;
use tensorwire_core::protocol::{
    CallError, Endpoint, MessageId, MethodTarget, RRefFailure, RRefForkData, RRefHandle, RRefId,
    WorkerId,
};
use tensorwire_process_group::{Group, Rendezvous};
use tokio::sync::{oneshot, Notify};

pub use crate::debug::AgentDebugInfo;
use crate::error::{RRefError, RpcError};
use crate::functions::Value;
pub use crate::future::RpcFuture;
use crate::metrics::{message_bytes, RpcMetrics};
use crate::options::RpcOptions;
use crate::rref::RRef;
use crate::runtime::Runtime;
pub use crate::state::Agent;
use crate::state::{Abandoned, Body, Functions, Inner, Owned, State, WorkerRecord};
use crate::tensors::{self, TensorTransferError};
use crate::typed::{Call, Function};
use crate::{driver, links, shutdown};
use tensorwire_core::placement::Direction;
use tensorwire_core::ports::device::DeviceBackend;
use tensorwire_core::protocol::gather;
use tensorwire_core::protocol::membership::Directory;
pub use tensorwire_core::protocol::membership::{WorkerInfo, WorkerRef};
use tensorwire_core::protocol::value as codec;

/// The connection to one peer: [`Agent::connections`].
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct PeerConnection {
    /// The peer.
    pub peer: WorkerInfo,
    /// The transport chosen for it: `"tcp"`, `"shm"` (shared memory, for a peer on this host),
    /// `"quic"` or `"memory"` (the in-memory transport of tests).
    pub transport: &'static str,
}

impl fmt::Debug for Agent {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // Never waits for the lock: an agent may be printed where it is held.
        let world = (self.inner.state.try_lock()).map(|st| st.node.directory().len());
        let mut d = f.debug_struct("Agent");
        d.field("me", &self.inner.me);
        match world {
            Ok(world) => d.field("world", &world),
            Err(_) => d.field("world", &format_args!("(the state is busy)")),
        };
        d.finish()
    }
}

impl Agent {
    /// A new agent (not yet connected) for worker `name` among `records`.
    pub(crate) fn new(
        name: &str,
        me_id: WorkerId,
        dynamic: bool,
        records: &[WorkerRecord],
        rdv: &Rendezvous,
        options: &RpcOptions,
        budget: tensorwire_core::budget::Budget,
    ) -> Agent {
        let members = Directory::new(name, &options.devices, &options.device_maps, records);
        let (abandoned, abandoned_rx) = tokio::sync::mpsc::unbounded_channel();
        let inner = Arc::new(Inner {
            me: WorkerInfo {
                name: name.to_owned(),
                id: me_id,
            },
            dynamic,
            rpc_timeout_nanos: std::sync::atomic::AtomicU64::new(duration_nanos(
                options.rpc_timeout,
            )),
            functions: options.functions.clone(),
            backend: Arc::clone(&options.device_backend),
            state: Mutex::new(State {
                node: Node::new(
                    {
                        // The key of the capabilities of the references made here: real
                        // entropy, so that no peer can compute them.
                        let mut ep = Endpoint::new(me_id, options.endpoint.clone());
                        // One budget per peer for everything: the endpoint's records, the
                        // writers' queues, the world group's inboxes, the readers' frames.
                        ep.set_budget(budget);
                        let mut key = [0u8; 32];
                        rand::RngCore::fill_bytes(&mut rand::rngs::OsRng, &mut key);
                        ep.set_secret_key(key);
                        ep
                    },
                    dynamic,
                    crate::ipc::state(
                        &*options.device_backend,
                        options.share_device_memory,
                        options.ipc_limits,
                    ),
                    members,
                ),
                dyn_state: crate::state::DynState::default(),
                gathers_waiting: HashMap::default(),
                waiters: Default::default(),
                abandoned: abandoned_rx,
                values: HashMap::default(),
                peers: HashMap::default(),
                confirm_waits: HashMap::default(),
                shutdown_waiter: None,
                owned: Owned {
                    store: Some(Arc::clone(&rdv.store)),
                    rendezvous: None,
                    group: None,
                    writers: tokio::task::JoinSet::new(),
                    others: tokio::task::JoinSet::new(),
                    closed: false,
                },
            }),
            wake: Notify::new(),
            device_maps: options.device_maps.clone(),
            metrics: crate::metrics::AgentMetrics::new(name),
            runtime: Arc::clone(&options.runtime),
            peer_events: crate::peer_events::PeerEventHub::new(),
            serving: std::sync::atomic::AtomicUsize::new(0),
            queued_bytes: Arc::new(std::sync::atomic::AtomicUsize::new(0)),
            abandoned,
        });
        Agent { inner }
    }
}

/// The name of worker `id` in the directory of `st`, or `rank {id}` for one it does not know
/// (for errors made under the lock: taking it again there would deadlock).
fn name_in(st: &State, id: WorkerId) -> String {
    st.node
        .directory()
        .get(id)
        .map_or_else(|| format!("rank {id}"), |w| w.name.clone())
}

/// [`Agent::rref_error`] under the lock, held as `st`: core says which error it is.
fn rref_error_in(st: &State, handle: RRefHandle, e: CallError) -> RpcError {
    let rref = handle.rref.to_string();
    match RRefFailure::of(e) {
        RRefFailure::NotRunning => RpcError::NotRunning,
        RRefFailure::Creation(source) => RpcError::RRefCreation {
            rref,
            owner: name_in(st, handle.owner),
            source,
        },
        RRefFailure::Refused(reason) => RpcError::RRef { rref, reason },
    }
}

/// A duration in nanoseconds, saturating (584 years).
fn duration_nanos(d: Duration) -> u64 {
    u64::try_from(d.as_nanos()).unwrap_or(u64::MAX)
}

impl Agent {
    /// The current time, from the agent's one runtime (see [`crate::runtime`]).
    pub(crate) fn now(&self) -> Instant {
        self.inner.runtime.now()
    }

    /// The agent's runtime: its clock, timers and spawner.
    pub(crate) fn runtime(&self) -> &dyn Runtime {
        &*self.inner.runtime
    }

    pub(crate) fn lock(&self) -> MutexGuard<'_, State> {
        self.inner
            .state
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
    }

    /// Runs `task` as one of the agent's tasks: shutdown ends it and waits until it has ended.
    /// After shutdown nothing new starts (`task` is dropped, outside the lock: it may hold
    /// user values).
    pub fn spawn(&self, task: impl std::future::Future<Output = ()> + Send + 'static) {
        self.track(false, task);
    }

    pub(crate) fn track(
        &self,
        writer: bool,
        task: impl std::future::Future<Output = ()> + Send + 'static,
    ) {
        let mut ended = Vec::new();
        let refused = {
            let mut st = self.lock();
            let tasks = &mut st.owned;
            if tasks.closed {
                Some(task)
            } else {
                let set = if writer {
                    &mut tasks.writers
                } else {
                    &mut tasks.others
                };
                // Forget the ones that ended, so the set holds the running ones only (a panic's
                // payload, the user's, is dropped after the lock).
                while let Some(end) = set.try_join_next() {
                    ended.extend(end.err());
                }
                set.spawn(task);
                None
            }
        };
        drop((refused, ended));
    }

    pub(crate) fn wake(&self) {
        self.inner.wake.notify_one();
    }

    /// This worker.
    pub fn worker_info(&self) -> &WorkerInfo {
        &self.inner.me
    }

    /// Every worker of the group now, in rank order.
    pub fn worker_infos(&self) -> Vec<WorkerInfo> {
        self.lock().node.directory().workers().cloned().collect()
    }

    /// The worker named `name`.
    pub fn get_worker_info(&self, name: &str) -> Result<WorkerInfo, RpcError> {
        let id = self.resolve(&WorkerRef::Name(name.to_owned()))?;
        Ok(WorkerInfo {
            name: name.to_owned(),
            id,
        })
    }

    /// Whether the group's membership can change (`world_size = None` at init).
    pub fn is_dynamic(&self) -> bool {
        self.inner.dynamic
    }

    /// The devices this agent handles (sorted, without the CPU).
    pub fn devices(&self) -> Vec<Device> {
        self.lock().node.directory().devices().to_vec()
    }

    /// This worker's device maps.
    pub fn device_maps(&self) -> &DeviceMaps {
        &self.inner.device_maps
    }

    /// This worker's reverse device maps (where its responses' tensors land).
    pub fn reverse_device_maps(&self) -> DeviceMaps {
        self.lock().node.directory().reverse().clone()
    }

    /// The functions this worker serves; functions registered later are served too.
    pub fn functions(&self) -> &Functions {
        &self.inner.functions
    }

    /// How many values this worker keeps for remote references it owns.
    pub fn owned_value_count(&self) -> usize {
        self.lock().values.len()
    }

    /// The group's store; [`RpcError::NotRunning`] once [`shutdown`](Self::shutdown) has let
    /// go of it.
    pub fn store(&self) -> Result<Arc<dyn Store>, RpcError> {
        self.lock().owned.store.clone().ok_or(RpcError::NotRunning)
    }

    fn resolve(&self, to: &WorkerRef) -> Result<WorkerId, RpcError> {
        self.lock()
            .node
            .directory()
            .resolve(to)
            .map_err(|e| RpcError::UnknownWorker {
                worker: e.worker,
                known: e.known,
            })
    }

    /// Worker `id`, named as [`name_of`](Self::name_of) does.
    pub(crate) fn worker(&self, id: WorkerId) -> WorkerInfo {
        WorkerInfo {
            name: self.name_of(id),
            id,
        }
    }

    /// The name of worker `id`, or `rank {id}` for one this worker does not know.
    pub fn name_of(&self, id: WorkerId) -> String {
        name_in(&self.lock(), id)
    }

    fn timeout_or_default(&self, timeout: Option<Duration>) -> Duration {
        timeout.unwrap_or_else(|| self.rpc_timeout())
    }

    /// The default timeout of calls made without one (PyTorch's `get_rpc_timeout`); zero
    /// means none.
    pub fn rpc_timeout(&self) -> Duration {
        Duration::from_nanos(
            self.inner
                .rpc_timeout_nanos
                .load(std::sync::atomic::Ordering::Relaxed),
        )
    }

    /// Changes the default timeout of calls made from now on without one (PyTorch's
    /// `_set_rpc_timeout`); zero means none. Calls already sent keep theirs.
    pub fn set_rpc_timeout(&self, timeout: Duration) {
        self.inner.rpc_timeout_nanos.store(
            duration_nanos(timeout),
            std::sync::atomic::Ordering::Relaxed,
        );
    }

    /// Calls `function(args)` on `to` and waits for its result. `timeout` overrides the default
    /// (zero: none). Tensors in `args` move by this worker's device map for `to`.
    pub async fn rpc_sync<A, R>(
        &self,
        to: impl Into<WorkerRef>,
        function: &str,
        args: &A,
        timeout: Option<Duration>,
    ) -> Result<R, RpcError>
    where
        A: Serialize + ?Sized,
        R: DeserializeOwned + Send + 'static,
    {
        // Awaited here, where `function` lives: no future to box, no copy of the name.
        let to = self.resolve(&to.into())?;
        // This task's waker goes in with the call's waiter: the outcome's first poll, by this
        // task, has nothing to register (no second lock a call).
        let waker = std::future::poll_fn(|cx| std::task::Poll::Ready(cx.waker().clone())).await;
        let how = CallHow {
            target: None,
            placement: Direction::Request,
            waker: Some(waker),
        };
        let (rx, watch) = self.begin_call(to, function, args, timeout, how)?;
        watch.watch(|| self.call_result(rx, to, function)).await
    }

    /// Sends `function(args)` to `to` now and returns a future of its result, to await later.
    /// A tensor that cannot go to `to` (a CUDA tensor without a device map entry) fails here,
    /// before anything is sent.
    pub fn rpc_async<A, R>(
        &self,
        to: impl Into<WorkerRef>,
        function: &str,
        args: &A,
        timeout: Option<Duration>,
    ) -> Result<RpcFuture<R>, RpcError>
    where
        A: Serialize + ?Sized,
        R: DeserializeOwned + Send + 'static,
    {
        let to = self.resolve(&to.into())?;
        self.send_call(to, function, args, None, timeout)
    }

    fn transfer_error(&self, to: WorkerId, function: &str, e: TensorTransferError) -> RpcError {
        match e {
            TensorTransferError::Encode(e) => RpcError::Serialization {
                what: format!("encode the arguments of {function:?}"),
                source: Box::new(e),
            },
            other => RpcError::Tensors {
                to: self.name_of(to),
                function: function.to_owned(),
                source: Box::new(other),
            },
        }
    }

    pub(crate) fn send_call<A, R>(
        &self,
        to: WorkerId,
        function: &str,
        args: &A,
        target: Option<RRefHandle>,
        timeout: Option<Duration>,
    ) -> Result<RpcFuture<R>, RpcError>
    where
        A: Serialize + ?Sized,
        R: DeserializeOwned + Send + 'static,
    {
        self.send_call_placed(to, function, args, target, timeout, Direction::Request)
    }

    /// Which way device tensors went to each peer, in rank order: by CUDA IPC handle (same
    /// host, same GPU, both sides able to share) or staged through host memory, with the
    /// reason for the last staged one and the buffers held for the peer awaiting its release.
    pub fn device_paths(&self) -> Vec<tensorwire_core::ipc::PeerPaths> {
        self.lock().node.ipc().report()
    }

    /// The device backend this agent moves tensors with.
    pub fn device_backend(&self) -> &Arc<dyn DeviceBackend> {
        &self.inner.backend
    }

    /// `rpc_async` to rank `to`, with the tensors of `args` placed as `placement` says: by
    /// this worker's map for `to` (a request) or by its reverse map for `to` (the way a
    /// response goes; distributed autograd sends a gradient back by the reverse of the map
    /// its forward message took).
    pub fn rpc_async_placed<A, R>(
        &self,
        to: WorkerId,
        function: &str,
        args: &A,
        timeout: Option<Duration>,
        placement: Direction,
    ) -> Result<RpcFuture<R>, RpcError>
    where
        A: Serialize + ?Sized,
        R: DeserializeOwned + Send + 'static,
    {
        self.send_call_placed(to, function, args, None, timeout, placement)
    }

    fn send_call_placed<A, R>(
        &self,
        to: WorkerId,
        function: &str,
        args: &A,
        target: Option<RRefHandle>,
        timeout: Option<Duration>,
        placement: Direction,
    ) -> Result<RpcFuture<R>, RpcError>
    where
        A: Serialize + ?Sized,
        R: DeserializeOwned + Send + 'static,
    {
        let how = CallHow {
            target,
            placement,
            waker: None,
        };
        let (rx, watch) = self.begin_call(to, function, args, timeout, how)?;
        let (agent, function) = (self.clone(), function.to_owned());
        let result = move || async move { agent.call_result(rx, to, &function).await };
        Ok(RpcFuture {
            inner: Box::pin(watch.watch(result)),
        })
    }

    /// Sends a call: the receiver of its outcome and its watch (counted, in its span).
    fn begin_call<A: Serialize + ?Sized>(
        &self,
        to: WorkerId,
        function: &str,
        args: &A,
        timeout: Option<Duration>,
        how: CallHow,
    ) -> Result<(Outcome, crate::metrics::CallWatch), RpcError> {
        let CallHow {
            target,
            placement,
            waker,
        } = how;
        let prepared = tensors::prepare(self, to, args, placement)
            .map_err(|e| self.transfer_error(to, function, e))?;
        let timeout = self.timeout_or_default(timeout);
        let bytes = message_bytes(prepared.data.len(), prepared.tensors.iter().map(|t| &t.0));
        let registered = waker
            .as_ref()
            .map(tensorwire_core::protocol::by_id::Registered::of);
        let ((), id, alone) = self.submit(to, target, prepared, waker, |ep, body, now| {
            match body {
                Some(body) => ep.call(to, function, body, timeout, now),
                None => ep.call_deferred(to, function, timeout, now),
            }
            .map(|id| ((), id))
        })?;
        let rx = Outcome::new(self.clone(), id, registered);
        // The only call waiting: nothing would join it in the writer's batch, so it is
        // written here and now. With others in flight, the writer batches them.
        if alone {
            driver::pump_now(self);
        } else {
            self.pump();
        }
        let watch = (self.inner.metrics).call(&|id| self.name_of(id), to, function, id, bytes);
        Ok((rx, watch))
    }

    /// Hands a call or a remote with `prepared` arguments for `to` to the endpoint, under one
    /// lock with the check of its `target` and its waiter `tx`: `enter` gets its body when
    /// every tensor is in host memory, else `None`, and then takes the message's place now (id,
    /// deadline, order among our messages to `to`) for the body supplied once the device
    /// tensors are copied to host memory. Gives what `enter` made, the message's id, and
    /// whether it went with its body as the only call waiting.
    fn submit<T>(
        &self,
        to: WorkerId,
        target: Option<RRefHandle>,
        prepared: tensors::Prepared,
        waker: Option<std::task::Waker>,
        enter: impl FnOnce(
            &mut Endpoint<Body>,
            Option<Body>,
            Instant,
        ) -> Result<(T, MessageId), CallError>,
    ) -> Result<(T, MessageId, bool), RpcError> {
        let method = target.map(MethodTarget::from);
        let (body, later) = if prepared.on_host() {
            let body = Body {
                target: method,
                data: prepared.data,
                tensors: tensors::host_to_wire(prepared.tensors),
                forks: prepared.forks,
            };
            (Some(body), None)
        } else {
            (None, Some(prepared))
        };
        let (made, id, alone) = {
            let mut st = self.lock();
            Self::check_target(&st, target)?;
            let now = self.now();
            let (made, id) =
                enter(st.node.ep_mut(), body, now).map_err(|_| RpcError::NotRunning)?;
            st.waiters.wait(id, waker);
            (made, id, later.is_none() && st.waiters.len() == 1)
        };
        if let Some(prepared) = later {
            links::supply_when_copied(self, id, to, method, prepared);
        }
        Ok((made, id, alone))
    }

    /// Undoes the forks made for `to` by an encode whose bytes will not be sent.
    pub(crate) fn cancel_forks(
        &self,
        to: WorkerId,
        forks: &[tensorwire_core::protocol::RRefForkData],
    ) {
        if forks.is_empty() {
            return;
        }
        {
            let mut st = self.lock();
            for f in forks {
                st.node.ep_mut().cancel_fork(*f, to, self.now());
            }
        }
        self.wake();
    }

    /// Creates a value on `to` by running `function(args)` there, and returns a reference to it
    /// at once. The value lives on `to` until every reference to it is dropped.
    ///
    /// Tensors in the arguments move by this worker's device map for `to`, CUDA ones too:
    /// their copies off the device run after `remote` returns, and the creation leaves once
    /// they are done, ahead of anything this worker sends `to` afterwards.
    pub fn remote<A, T>(
        &self,
        to: impl Into<WorkerRef>,
        function: &str,
        args: &A,
        timeout: Option<Duration>,
    ) -> Result<RRef<T>, RpcError>
    where
        A: Serialize + ?Sized,
        T: Send + Sync + 'static,
    {
        let to = self.resolve(&to.into())?;
        self.send_remote(to, function, args, None, timeout)
    }

    /// `remote`, also for methods: with `target`, `function` runs on the value of that
    /// reference (owned by `to`).
    pub(crate) fn send_remote<A, T>(
        &self,
        to: WorkerId,
        function: &str,
        args: &A,
        target: Option<RRefHandle>,
        timeout: Option<Duration>,
    ) -> Result<RRef<T>, RpcError>
    where
        A: Serialize + ?Sized,
        T: Send + Sync + 'static,
    {
        let prepared = tensors::prepare(self, to, args, Direction::Request)
            .map_err(|e| self.transfer_error(to, function, e))?;
        let timeout = self.timeout_or_default(timeout);
        let bytes = message_bytes(prepared.data.len(), prepared.tensors.iter().map(|t| &t.0));
        self.inner
            .metrics
            .remote(&|id| self.name_of(id), to, function, bytes);
        let (handle, id, _) =
            self.submit(to, target, prepared, None, |ep, body, now| match body {
                Some(body) => ep.remote(to, function, body, timeout, now),
                None => ep.remote_deferred(to, function, timeout, now),
            })?;
        let rx = Outcome::new(self.clone(), id, None);
        self.pump();
        Ok(RRef::from_handle(self.clone(), handle, Some(rx)))
    }

    /// A reference to `value`, owned by this worker (PyTorch's `RRef(value)`): it can be passed
    /// in arguments and results like any other, and the value lives until no worker refers to
    /// it. [`RRef::new`] is the same.
    pub fn local_rref<T>(&self, value: T) -> Result<RRef<T>, RpcError>
    where
        T: Serialize + Send + Sync + 'static,
    {
        let handle = {
            let mut st = self.lock();
            let handle = st
                .node
                .ep_mut()
                .local_rref()
                .map_err(|_| RpcError::NotRunning)?;
            st.values
                .insert(handle.rref, Arc::new(value) as Arc<dyn Value>);
            handle
        };
        Ok(RRef::from_handle(self.clone(), handle, None))
    }

    /// What this agent holds and waits for (PyTorch's `_get_debug_info` and
    /// `_rref_context_get_debug_info`): values kept for references, the forks of references
    /// it owns held elsewhere, forks it holds (a *pending user* until the owner confirms),
    /// calls in flight per peer.
    pub fn debug_info(&self) -> AgentDebugInfo {
        let (kept_values, protocol) = {
            let st = self.lock();
            (st.values.len(), st.node.ep().debug_info())
        };
        AgentDebugInfo {
            worker: self.inner.me.clone(),
            kept_values,
            protocol,
            gathers: crate::gather::debug_info(self),
        }
    }

    /// The connections to the peers this worker is connected to, in rank order, each with the
    /// transport chosen for it (shared memory for a peer on this host unless
    /// `TENSORWIRE_TRANSPORT=tcp`; TCP across hosts). A lost peer is not listed.
    pub fn connections(&self) -> Vec<PeerConnection> {
        let mut out: Vec<(WorkerId, &'static str)> = self
            .lock()
            .peers
            .iter()
            .map(|(id, link)| (*id, link.transport))
            .collect();
        out.sort_unstable_by_key(|(id, _)| *id);
        out.into_iter()
            .map(|(id, transport)| PeerConnection {
                peer: WorkerInfo {
                    name: self.name_of(id),
                    id,
                },
                transport,
            })
            .collect()
    }

    /// Bytes of frames queued for the peers' writers and not yet handed to the transport, over
    /// every peer (a peer that does not read keeps its share here, within its memory budget,
    /// [`RpcOptions::with_peer_budget`](crate::RpcOptions::with_peer_budget); past it the peer
    /// is dropped and its share freed, as it is when the connection breaks).
    pub fn queued_bytes(&self) -> usize {
        self.inner
            .queued_bytes
            .load(std::sync::atomic::Ordering::Acquire)
    }

    /// The memory budget of each peer ([`RpcOptions::with_peer_budget`](crate::RpcOptions::with_peer_budget)):
    /// what each peer holds here now, by use, and the most it held at once.
    pub fn budget(&self) -> tensorwire_core::budget::Budget {
        self.lock().node.ep().budget().clone()
    }

    /// Calls `function(args)` on `to` (by name, rank or [`WorkerInfo`]): `.await` the returned
    /// [`Call`] for the result, or use its `timeout`, `send` and `remote`. The argument and
    /// result types come from the descriptor, so they cannot disagree with what
    /// `serve` on [`Functions`] registered in the same codebase; across binaries the callee checks
    /// them (see the [`typed`](crate::typed) module).
    pub fn call<'a, A, R>(
        &'a self,
        function: &Function<A, R>,
        to: impl Into<WorkerRef>,
        args: &'a A,
    ) -> Call<'a, A, R>
    where
        A: Serialize + 'static,
        R: 'static,
    {
        Call::new(self, function, to.into(), args)
    }

    /// This agent's counters: calls, bytes, errors and calls in flight, in total and per peer.
    /// The same numbers go to the [`metrics`] facade (see the [`metrics`](crate::metrics)
    /// module).
    pub fn metrics(&self) -> RpcMetrics {
        self.inner.metrics.read()
    }

    /// A reference handle of this worker's is gone (its last [`RRef`] clone dropped): the
    /// endpoint tells the owner when it may (the driver moves that along). Never waits for
    /// the lock ([`let_go`](Self::let_go)).
    pub(crate) fn drop_reference(&self, handle: RRefHandle) {
        self.let_go(Abandoned::Reference(handle, self.now()));
        self.wake();
    }

    /// Does what a dropped handle of the application's (a call's unread outcome, a
    /// reference's last clone) leaves the agent to do, never waiting for the lock: whoever
    /// holds it (this very thread, dropping the handle from under it, or another that waits
    /// for this one) would deadlock or stall the drop, which may run anywhere (a user value,
    /// a task's panic, a future dropped under the lock). Free (or poisoned), it is done now;
    /// busy, `item` goes to the driver, which does it under the lock on its next pass
    /// ([`State::sweep_abandoned`]). That channel is unbounded but holds at most one item per
    /// handle of this process (each sends once, from its `Drop`), drained on every pass.
    pub(crate) fn let_go(&self, item: Abandoned) {
        let left = match self.inner.state.try_lock() {
            Ok(mut st) => st.let_go(item),
            Err(TryLockError::Poisoned(st)) => st.into_inner().let_go(item),
            Err(TryLockError::WouldBlock) => {
                // Refused only once the state (the receiver's holder) is gone, which this
                // agent keeps alive.
                let _ = self.inner.abandoned.send(item);
                self.wake();
                None
            }
        };
        drop(left);
    }

    /// Whether the owner has confirmed this worker's `handle`.
    pub(crate) fn reference_confirmed(&self, handle: RRefHandle) -> bool {
        self.lock()
            .node
            .ep_mut()
            .is_confirmed(handle)
            .unwrap_or(false)
    }

    /// Forks `handle` for worker `to` (a reference being sent to it).
    pub(crate) fn fork_reference(
        &self,
        handle: RRefHandle,
        to: WorkerId,
    ) -> Result<RRefForkData, CallError> {
        self.lock().node.ep_mut().fork_for(handle, to)
    }

    /// Accepts a fork received from a peer, as a handle of this worker's.
    pub(crate) fn accept_reference(&self, data: RRefForkData) -> RRefHandle {
        let now = self.now();
        let handle = self.lock().node.ep_mut().accept_fork(data, now);
        self.wake();
        handle
    }

    /// A number that tells this agent (and its clones) apart from every other agent alive.
    pub(crate) fn identity(&self) -> u64 {
        Arc::as_ptr(&self.inner) as usize as u64
    }

    /// The value of a reference this worker owns.
    pub(crate) fn local_value(&self, rref: RRefId) -> Option<Arc<dyn Any + Send + Sync>> {
        self.lock()
            .values
            .get(&rref)
            .map(|v| Arc::clone(v).into_any())
    }

    pub(crate) fn fetch(
        &self,
        handle: RRefHandle,
        timeout: Option<Duration>,
    ) -> Result<Outcome, RpcError> {
        let timeout = self.timeout_or_default(timeout);
        let id = {
            let mut st = self.lock();
            let id = match st.node.ep_mut().fetch(handle, timeout, self.now()) {
                Ok(id) => id,
                Err(e) => return Err(rref_error_in(&st, handle, e)),
            };
            st.waiters.wait(id, None);
            id
        };
        let rx = Outcome::new(self.clone(), id, None);
        self.pump();
        Ok(rx)
    }

    /// A method call (or remote method) on `target` may go: the endpoint still holds the
    /// reference. Checked under the same lock as the call is made, so a reference whose owner
    /// leaves (and whose rank a new worker takes) in between cannot slip through to the new
    /// worker, which never had the value.
    fn check_target(st: &State, target: Option<RRefHandle>) -> Result<(), RpcError> {
        match target {
            Some(h) => st
                .node
                .ep()
                .check_reference(h)
                .map_err(|e| rref_error_in(st, h, e)),
            None => Ok(()),
        }
    }

    /// The error of a reference that cannot be used: a failed or timed-out creation is
    /// [`RpcError::RRefCreation`], naming the reference and its owner.
    pub(crate) fn rref_error(&self, handle: RRefHandle, e: CallError) -> RpcError {
        rref_error_in(&self.lock(), handle, e)
    }

    /// Gathers one value from every worker, in rank order.
    ///
    /// In a static group it runs as an `all_gather_object` of the world process group, over
    /// the agent's connections (no store key): every worker calls `all_gather`s and
    /// [`barrier`](Self::barrier)s in the same order, and `name` only labels errors. It is
    /// bounded by `timeout`; a timeout breaks the group, so later barriers and all_gathers fail
    /// with the same error (calls go on).
    ///
    /// In a dynamic group (which has no process group) it runs over RPC, as PyTorch's
    /// `rpc.api._all_gather`: every member sends its value to the leader (the lowest rank among
    /// the members), which answers them all once every member has sent; every member calls it
    /// with the same `name`, which may be used again once it has returned. Nothing goes
    /// through the store. A member that joins or leaves meanwhile makes it fail, saying so; on
    /// timeout the error names the members that did not send. (Values in rank order; a
    /// dynamic group's ranks need not be contiguous.)
    pub async fn all_gather<T: Serialize + DeserializeOwned>(
        &self,
        name: &str,
        value: &T,
        timeout: Duration,
    ) -> Result<Vec<T>, RpcError> {
        let what = format!("all_gather {name:?}");
        let bytes = gather::encode_value(value).map_err(|e| RpcError::Serialization {
            what: format!("encode the {what} value"),
            source: Box::new(e),
        })?;
        let blocks = match self.group() {
            Some(group) => group
                .all_gather_work(bytes)
                .wait(timeout)
                .await
                .map_err(|e| self.group_error(e, &what, timeout))?,
            None => crate::gather::gather_dynamic(self, &what, name, bytes, timeout)
                .await?
                .into_iter()
                .map(Bytes::from)
                .collect(),
        };
        blocks
            .iter()
            .enumerate()
            .map(|(r, b)| {
                gather::decode_value(b).map_err(|e| RpcError::Serialization {
                    what: format!("decode the {what} value of member {r}"),
                    source: Box::new(e),
                })
            })
            .collect()
    }

    /// Waits until every worker reached the barrier `name`. On timeout the error names the
    /// workers that did not arrive.
    ///
    /// In a static group it is a monitored barrier of the world process group, over the
    /// agent's connections (no store key); workers call barriers and
    /// [`all_gather`](Self::all_gather)s in the same order, and `name` only labels errors. In
    /// a dynamic group it is an [`all_gather`](Self::all_gather) of nothing over RPC (through
    /// the leader; no store key).
    pub async fn barrier(&self, name: &str, timeout: Duration) -> Result<(), RpcError> {
        if let Some(group) = self.group() {
            return group
                .monitored_barrier(Some(timeout), true)
                .await
                .map_err(|e| self.group_error(e, &format!("barrier {name:?}"), timeout));
        }
        let what = format!("barrier {name:?}");
        crate::gather::gather_dynamic(self, &what, &format!("barrier/{name}"), Vec::new(), timeout)
            .await
            .map(drop)
    }

    /// A barrier among `workers` only (PyTorch's `rpc.api._barrier(worker_names)`): each of
    /// them calls it with the same list and name, and it returns once all of them have; the
    /// others take no part. It runs over RPC through the lowest-ranked of them (as the dynamic
    /// group's barrier does), in static and dynamic groups alike, and writes nothing to the
    /// store. This worker must be in the list; an unknown worker fails with
    /// [`RpcError::UnknownWorker`]. A timeout (zero: none) names the workers that did not come.
    pub async fn barrier_among<W: Into<WorkerRef>>(
        &self,
        name: &str,
        workers: impl IntoIterator<Item = W>,
        timeout: Duration,
    ) -> Result<(), RpcError> {
        let mut members = std::collections::BTreeSet::new();
        for w in workers {
            members.insert(self.resolve(&w.into())?);
        }
        let me = (self.inner.me.id, self.inner.me.name.as_str());
        gather::check_among(name, me, &members)
            .map_err(|e| RpcError::InvalidArgument(e.to_string()))?;
        let what = format!("barrier {name:?} among {} workers", members.len());
        crate::gather::gather_among(
            self,
            &what,
            &format!("barrier-among/{name}"),
            Vec::new(),
            timeout,
            members,
        )
        .await
        .map(drop)
    }

    /// A static group's world process group: the group init ran over, whose connections the
    /// agent shares (`None` in a dynamic group, which has none, as in PyTorch). Its
    /// collectives (and subgroups) run beside the calls on the same connections; they are
    /// numbered with the agent's own [`barrier`](Self::barrier)s and
    /// [`all_gather`](Self::all_gather)s, so every worker issues all of them in the same
    /// order. The agent's shutdown shuts it down.
    pub fn process_group(&self) -> Option<Group> {
        self.group()
    }

    /// A static group's world process group.
    pub(crate) fn group(&self) -> Option<Group> {
        self.lock().owned.group.clone()
    }

    /// A failed collective of the agent's group: a timeout names the workers it waited for.
    fn group_error(&self, e: ProcessGroupError, what: &str, after: Duration) -> RpcError {
        match e {
            ProcessGroupError::Timeout { waiting_on, .. }
            | ProcessGroupError::MonitoredBarrier {
                missing: waiting_on,
                ..
            } => RpcError::Timeout {
                what: what.to_owned(),
                after,
                waiting_for: Some(crate::error::WaitingFor::Workers(
                    waiting_on
                        .iter()
                        .map(|r| self.worker(*r as WorkerId))
                        .collect(),
                )),
            },
            ProcessGroupError::ShutDown => RpcError::NotRunning,
            other => RpcError::ProcessGroup(other),
        }
    }

    /// Stops the agent, [`Shutdown::Graceful`](crate::Shutdown::Graceful) within its
    /// `timeout` in all.
    ///
    /// Graceful: a termination detection over the members' connections — every worker, once
    /// idle, reports how much it has sent and received, in rounds, until two rounds in a row
    /// agree everywhere — so that nothing in flight anywhere is refused, however far the calls
    /// that functions started without awaiting them spread; then it stops; rank 0, which
    /// hosts the store, then waits for the others to leave it. One deadline bounds all of it:
    /// a stage that cannot finish (a dead or frozen peer) fails by the deadline with an error
    /// that names the workers that did not arrive. [`Shutdown::Immediate`](crate::Shutdown::Immediate): pending calls
    /// fail at once.
    ///
    /// When it returns, whether it succeeded or not: every call of this agent has failed or
    /// completed ("RPC is no longer running" afterwards); every task of the agent has ended, so
    /// no connection of the agent is open any more (queued messages were sent and the
    /// connections closed where the deadline allowed it); and the agent has let go of the store
    /// — the store server this worker hosts is closed and its port free, and a `file://`
    /// store's handle is dropped (the last worker's removes the file), also while clones of the
    /// [`Agent`] live on. A store operation the user started and has not finished keeps its
    /// own handle until it ends.
    pub async fn shutdown(&self, how: crate::Shutdown) -> Result<(), RpcError> {
        shutdown::shutdown(self, how).await
    }

    /// Registers the connection to `peer` and starts its reader and writer tasks.
    pub(crate) fn attach(&self, peer: WorkerId, conn: Box<dyn Connection>) {
        driver::attach(self, peer, Arc::from(conn));
    }

    /// Moves what the endpoint produced along, on the calling task (see [`driver::pump`]).
    pub(crate) fn pump(&self) {
        driver::pump(self);
    }

    /// [`pump`](Self::pump) writing on the calling task (see [`driver::pump_now`]).
    pub(crate) fn pump_now(&self) {
        driver::pump_now(self);
    }

    /// Member `peer` left a dynamic group (see [`links::member_left`]).
    pub(crate) fn member_left(&self, peer: WorkerId) {
        links::member_left(self, peer);
    }

    /// Drops every connection (a join that failed, before it is tried again).
    pub(crate) fn close_links(&self) {
        links::close_links(self);
    }

    /// Stops the endpoint, ends every task and lets go of the store (see
    /// [`shutdown::stop_and_release`]).
    pub(crate) async fn stop_and_release(&self, deadline: Instant) {
        shutdown::stop_and_release(self, deadline).await;
    }

    /// Starts a shutdown of the endpoint with `begin` and waits for its outcome (see
    /// [`shutdown::run_shutdown`]).
    pub(crate) async fn run_shutdown(
        &self,
        timeout: Duration,
        begin: impl FnOnce(&mut Endpoint<Body>),
    ) -> Result<(), RpcError> {
        shutdown::run_shutdown(self, timeout, begin).await
    }

    /// Drops `peer` for `violation` found by a protocol layered on this agent (distributed
    /// autograd), as a frame's violation drops it: lost as `LostCause::Misbehaved`, its
    /// connection closed. Never this worker; a peer lost already keeps its first cause.
    pub fn fail_peer(
        &self,
        peer: WorkerId,
        violation: tensorwire_core::protocol::ProtocolViolation,
    ) {
        links::fail_peer(self, peer, violation);
    }

    /// Subscribes to what happens to peers: a peer lost (its connection broke; told once per
    /// loss, whether or not a call to it was pending) or a worker joined. Each subscription
    /// sees every event after it was made, in order; it ends when the agent shuts down.
    pub fn peer_events(&self) -> crate::peer_events::PeerEvents {
        self.inner.peer_events.subscribe()
    }

    /// Waits until the owners confirm every reference of `handles` (PyTorch runs a function
    /// only then): the endpoint parks the wait, with `deadline` among its deadlines, and
    /// decides when it ends, and why it failed ([`RRefError::Unconfirmed`]).
    pub(crate) async fn wait_confirmed(
        &self,
        handles: &[RRefHandle],
        deadline: Option<Instant>,
    ) -> Result<(), RpcError> {
        let rx = {
            let mut st = self.lock();
            let Some(wait) = st.node.ep_mut().wait_confirmed(handles, deadline) else {
                return Ok(());
            };
            let (tx, rx) = oneshot::channel();
            st.confirm_waits.insert(wait, tx);
            rx
        };
        // The driver's timer may have to wake earlier now (and an outcome known at once is
        // the driver's to deliver).
        self.wake();
        let source = match rx.await {
            Ok(Ok(())) => return Ok(()),
            Ok(Err(e)) => e,
            Err(_) => return Err(RpcError::NotRunning),
        };
        // Core names the owner among `handles`.
        let owner = source.owner_among(handles);
        Err(RpcError::RRef {
            rref: source.rref().to_string(),
            reason: RRefError::Unconfirmed {
                owner: self.worker(owner),
                source,
            },
        })
    }
}

impl codec::References for Agent {
    fn identity(&self) -> u64 {
        Agent::identity(self)
    }

    fn fork(&self, handle: RRefHandle, to: WorkerId) -> Result<RRefForkData, CallError> {
        self.fork_reference(handle, to)
    }

    fn cancel_forks(&self, to: WorkerId, forks: &[RRefForkData]) {
        Agent::cancel_forks(self, to, forks);
    }

    fn accept(&self, data: RRefForkData) -> RRefHandle {
        self.accept_reference(data)
    }

    fn hand_over(&self, handle: RRefHandle) -> u64 {
        crate::rref::handoff::issue(self, handle)
    }

    fn take_back(&self, ticket: u64) {
        crate::rref::handoff::cancel(ticket);
    }
}

impl tensors::Routes for Agent {
    fn name_of(&self, id: WorkerId) -> String {
        Agent::name_of(self, id)
    }

    fn device_map(&self, to_name: &str, direction: Direction) -> Option<DeviceMap> {
        match direction {
            Direction::Request => self.device_maps().get(to_name).cloned(),
            Direction::Response => self.reverse_device_maps().get(to_name).cloned(),
        }
    }
}

/// How a call is sent besides its arguments: the reference whose method it calls, where its
/// tensors go, and the waker of the task that will await it, if known now (see
/// [`Outcome::new`]).
struct CallHow {
    target: Option<RRefHandle>,
    placement: Direction,
    waker: Option<std::task::Waker>,
}

impl Agent {
    /// The value of the call whose outcome `rx` receives.
    async fn call_result<R: DeserializeOwned>(
        &self,
        rx: Outcome,
        to: WorkerId,
        function: &str,
    ) -> Result<R, RpcError> {
        match rx.await {
            // The peer's name is looked up only for an error (not on every call).
            Ok(Ok(body)) => self.decode_body(body, to, None, function).await,
            Ok(Err(source)) => Err(RpcError::Call {
                to: self.name_of(to),
                function: function.to_owned(),
                source,
            }),
            Err(_) => Err(RpcError::NotRunning),
        }
    }

    /// Places a received body's tensors and decodes its value. `from` names the sender in an
    /// error (`None`: its name now, looked up only then).
    pub(crate) async fn decode_body<R: DeserializeOwned>(
        &self,
        body: Body,
        from_id: WorkerId,
        from: Option<&str>,
        what: &str,
    ) -> Result<R, RpcError> {
        let name = || from.map_or_else(|| self.name_of(from_id), str::to_owned);
        // Most results carry no tensor: no placing future made and polled for none.
        let tensors = if body.tensors.is_empty() {
            Vec::new()
        } else {
            crate::ipc::from_wire(self, from_id, body.tensors)
                .await
                .map_err(|source| RpcError::Tensors {
                    to: name(),
                    function: what.to_owned(),
                    source: Box::new(source),
                })?
        };
        codec::decode(self, &body.data, tensors, &body.forks).map_err(|e| RpcError::Serialization {
            what: format!("decode the result of {what:?} from {}", name()),
            source: Box::new(e),
        })
    }
}
