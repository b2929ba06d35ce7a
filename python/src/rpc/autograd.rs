//! The native half of `tensorwire.rpc.dist_autograd`: tensorwire's distributed autograd
//! (`tensorwire-dist-autograd`, which drives `tensorwire_core::autograd`) with **torch's own
//! autograd** as its local engine.
//!
//! Nothing about the protocol is decided here or in Python: contexts and their capabilities,
//! send and recv records keyed by autograd message id, which gradient goes to which worker,
//! completion, release fan-out, the per-peer bound on contexts and a lost peer dropping its
//! contexts are the core's state machine, run by the `dist-autograd` driver on the agent of
//! `tensorwire.rpc`. This module is
//!
//! - [`TorchEngine`]: the adapter behind core's [`AutogradEngine`] port. Its tensors are torch
//!   tensors (Python objects); each method calls one small function of the Python layer
//!   (`tensorwire.rpc._autograd_engine`) with the GIL. The received tensors of a message that
//!   required grad on their sender become, once the Python layer has them, the outputs of one
//!   node of torch's graph, the message's recv function (named as PyTorch's
//!   `RecvRpcBackward`): the gradient the engine computes for each goes back to the sender;
//!   the tensors a message sent are kept by the driver (the send function: a gradient that
//!   comes back for them starts a local pass from them). A local pass is one run of torch's
//!   engine from the roots to the leaves and recv functions they reach, keeping the graph, so
//!   FAST mode may run a send function once per gradient; nothing lands in `.grad`.
//! - the functions a Python call in a context travels through ([`PY_FN`], [`PY_REMOTE`],
//!   [`PY_FETCH`]), registered with the driver, which records the recv (and the send of the
//!   result) before and after the Python layer runs the user's function;
//! - [`PyDistAutograd`], the handle `tensorwire.rpc.dist_autograd` calls.
//!
//! Lock order: the driver's lock is taken before the GIL (the engine's methods attach to the
//! interpreter while the driver holds its lock), so every method here that reaches the driver
//! releases the GIL first; Python never waits for the driver while it holds the GIL.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyList, PyTuple};
use serde::{Deserialize, Serialize};
use tensorwire_core::autograd::{AutogradError, BackwardError, ContextId, RootProblem};
use tensorwire_core::tensor::Tensor;
use tensorwire_dist_autograd::{AutogradContext, DistAutograd, DistAutogradError};
use tensorwire_rpc::{Agent, RpcError};

use super::{
    buffers, duration, lend, py_references, references, reply, rpc_error, wait_here, PyCall,
    PyRRef, PyReply, PyValue,
};
use crate::{runtime, TensorwireError};

/// The reply of a Python call sent in a context, with its tracked tensors.
type TrackedFuture = tensorwire_dist_autograd::BoxFuture<
    tensorwire_dist_autograd::CallResult<TrackedReply, TorchEngine>,
>;
use tensorwire_rpc::RRef;

/// The autograd function a Python call made in a context travels through.
const PY_FN: &str = "tensorwire.py_call";
/// The constructor of a `remote()` value made in a context.
const PY_REMOTE: &str = "tensorwire.py_remote";
/// The method that fetches a reference's value into a context (`to_here()` in a context).
const PY_FETCH: &str = "tensorwire.py_fetch";

/// The method that runs one of tensorwire's own owner-side functions on a reference's value
/// (the distributed optimizer hands its parameters to their owners' optimizers with it).
const PY_OWNER_CALL: &str = "tensorwire.py_owner_call";

/// The barrier of a static group's workers once distributed autograd is set up on each.
pub(crate) const READY_BARRIER: &str = "tensorwire.dist_autograd.ready";

mod torch;

use torch::{engine_fn, TorchEngine, TorchTensor};

/// What a Python call in a context ended with: a pickled value whose tensors travel partly
/// beside it (`tensors`, untracked) and partly as the driver's tracked tensors, with
/// `tracked_at` saying where in the pickle's tensor list each tracked one goes; or the
/// exception the function raised.
#[derive(Serialize, Deserialize)]
enum TrackedReply {
    Returned {
        payload: Vec<u8>,
        tensors: Vec<Tensor>,
        rrefs: Vec<RRef<PyValue>>,
        tracked_at: Vec<u32>,
    },
    Raised {
        exc_type: String,
        message: String,
        traceback: String,
    },
}

/// A Python call in a context as it travels: [`PyCall`] and where its tracked tensors go in
/// the pickle's tensor list.
#[derive(Serialize, Deserialize)]
struct TrackedCall {
    call: PyCall,
    tracked_at: Vec<u32>,
}

fn tensors_of<'py>(py: Python<'py>, tracked: &[TorchTensor]) -> PyResult<Bound<'py, PyList>> {
    let tensors = tracked
        .iter()
        .map(|t| t.bind(py).cloned())
        .collect::<PyResult<Vec<_>>>()?;
    PyList::new(py, tensors)
}

/// The tensors of a Python list about to be sent (tracked arguments or results).
fn tracked_of(list: &Bound<'_, PyAny>) -> PyResult<Vec<TorchTensor>> {
    Ok(list
        .cast::<PyList>()?
        .iter()
        .map(TorchTensor::to_send)
        .collect())
}

/// `("returned", payload, tensors, rrefs, tracked_at, tracked)` or `("raised", type, message,
/// traceback)` from the Python layer, as a reply and its tracked tensors.
fn tracked_reply(out: &Bound<'_, PyAny>) -> PyResult<(TrackedReply, Vec<TorchTensor>)> {
    let out = out.cast::<PyTuple>()?;
    let tag: String = out.get_item(0)?.extract()?;
    if tag == "returned" {
        Ok((
            TrackedReply::Returned {
                payload: out.get_item(1)?.extract()?,
                tensors: lend(out.get_item(2)?.cast::<PyList>()?)?,
                rrefs: references(out.get_item(3)?.cast::<PyList>()?)?,
                tracked_at: out.get_item(4)?.extract()?,
            },
            tracked_of(&out.get_item(5)?)?,
        ))
    } else {
        Ok((
            TrackedReply::Raised {
                exc_type: out.get_item(1)?.extract()?,
                message: out.get_item(2)?.extract()?,
                traceback: out.get_item(3)?.extract()?,
            },
            Vec::new(),
        ))
    }
}

/// Runs `what` (`serve` or `create`) of the engine's module for a call in `context` from
/// `caller`, with the GIL, on this (blocking) thread.
fn call_python(
    py: Python<'_>,
    what: &str,
    caller: String,
    context: ContextId,
    call: TrackedCall,
    tracked: &[TorchTensor],
) -> PyResult<Py<PyAny>> {
    let plain = buffers(py, call.call.tensors)?;
    let rrefs = py_references(py, call.call.rrefs)?;
    Ok(engine_fn(py, what)?
        .call1((
            caller,
            context.0,
            call.call.function,
            PyBytes::new(py, &call.call.payload),
            plain,
            rrefs,
            call.tracked_at,
            tensors_of(py, tracked)?,
        ))?
        .unbind())
}

/// Registers the functions Python calls in a context travel through, on `dist`'s agent.
fn register(dist: &DistAutograd<TorchEngine>) -> Result<(), RpcError> {
    // The runner that serves the call sends its reply: one hand-off (to the runner) per call.
    dist.register_responding(
        PY_FN,
        |call, args: TrackedCall, tracked: Vec<TorchTensor>, responder| {
            let caller = call.call().caller().name.clone();
            let context = call.context().id();
            // On the thread that read the call when no runner would take it at once (no
            // wake-up of another thread before the function runs), else by a runner.
            crate::gil::run_here_or_submit(Box::new(move |py| {
                let run = || {
                    let out = call_python(py, "serve", caller, context, args, &tracked)?;
                    tracked_reply(out.bind(py))
                };
                let served =
                    run().map_err(|e| format!("tensorwire.rpc could not serve the call: {e}"));
                // Without the GIL: recording the send takes the driver's lock, which is taken
                // before the GIL (see the module's docs).
                py.detach(move || responder.send(served));
            }));
        },
    )?;
    dist.register_remote(
        PY_REMOTE,
        |call, args: TrackedCall, tracked: Vec<TorchTensor>| {
            let caller = call.call().caller().name.clone();
            let context = call.context().id();
            async move {
                crate::gil::on_python(move |py| {
                    let run = || -> PyResult<PyValue> {
                        let out = call_python(py, "create", caller, context, args, &tracked)?;
                        let out = out.bind(py).cast::<PyTuple>()?;
                        let tag: String = out.get_item(0)?.extract()?;
                        if tag == "returned" {
                            Ok(PyValue::Object(crate::rpc::Held::new(
                                out.get_item(1)?.unbind(),
                            )))
                        } else {
                            Ok(PyValue::Raised {
                                exc_type: out.get_item(1)?.extract()?,
                                message: out.get_item(2)?.extract()?,
                                traceback: out.get_item(3)?.extract()?,
                            })
                        }
                    };
                    run().map_err(|e| format!("tensorwire.rpc could not create the value: {e}"))
                })
                .await?
            }
        },
    )?;
    dist.register_method(
        PY_FETCH,
        |_call, value: Arc<PyValue>, (): (), _tracked: Vec<TorchTensor>| async move {
            crate::gil::on_python(move |py| {
                let run = || -> PyResult<(TrackedReply, Vec<TorchTensor>)> {
                    match &*value {
                        PyValue::Object(o) => {
                            let out = engine_fn(py, "fetch")?.call1((o.clone_ref(py),))?;
                            tracked_reply(&out)
                        }
                        PyValue::Raised {
                            exc_type,
                            message,
                            traceback,
                        } => Ok((
                            TrackedReply::Raised {
                                exc_type: exc_type.clone(),
                                message: message.clone(),
                                traceback: traceback.clone(),
                            },
                            Vec::new(),
                        )),
                    }
                };
                run().map_err(|e| format!("tensorwire.rpc could not send the value: {e}"))
            })
            .await?
        },
    )?;
    dist.agent().functions().register_method(
        PY_OWNER_CALL,
        |value: Arc<PyValue>, call: PyCall| async move {
            // On the worker that read it when no runner would take it at once: an owner's
            // optimizer step is on the training step's critical path.
            crate::gil::on_python_here(move |py| {
                let run = || -> PyResult<PyReply> {
                    let (object, call) = match &*value {
                        PyValue::Object(o) => (o.clone_ref(py), call),
                        PyValue::Raised {
                            exc_type,
                            message,
                            traceback,
                        } => {
                            return Ok(PyReply::Raised {
                                exc_type: exc_type.clone(),
                                message: message.clone(),
                                traceback: traceback.clone(),
                            })
                        }
                    };
                    let out = engine_fn(py, "owner_call")?.call1((
                        object,
                        call.function,
                        PyBytes::new(py, &call.payload),
                        buffers(py, call.tensors)?,
                        py_references(py, call.rrefs)?,
                    ))?;
                    reply(&out)
                };
                run().map_err(|e| format!("tensorwire.rpc could not serve the call: {e}"))
            })
            .await?
        },
    )?;
    Ok(())
}

/// Sets distributed autograd up on `agent` (inside the runtime): the driver, with torch's
/// engine, and the functions calls in a context travel through. Every worker does it as its
/// agent starts, before it serves a call.
pub(crate) fn start(agent: &Agent) -> Result<DistAutograd<TorchEngine>, RpcError> {
    let dist = DistAutograd::new(agent, TorchEngine::default())?;
    // A pass of torch's engine costs more than a hand-off to a blocking thread, and Python
    // runs on blocking threads, not on the runtime's workers: every pass is a Python job, run
    // by a thread that holds the GIL already (`gil`), not by a blocking thread of its own, or
    // by the worker that read the gradient, its other tasks handed off (`block_in_place`),
    // when no runner would take the job at once.
    dist.set_inline_bound(Duration::ZERO);
    dist.set_executor(Arc::new(|job: tensorwire_dist_autograd::BlockingJob| {
        Box::pin(async move {
            // An error here is a job that panicked: the driver reports the run as failed. The
            // job takes the driver's lock after the pass (to report it and send its
            // gradients), and the driver's lock comes before the GIL: it runs without the GIL,
            // which the pass takes back at once (this runner released it, so no other thread
            // waits for it in between unless one was already waiting).
            //
            // A thread parked in `dist_autograd.backward` (the driver's, waiting for the pass
            // to come back to it) takes the run if it is idle: it is woken when the pass ends
            // anyway, and this worker hands nothing off (see `gil::offer_to_waiter`).
            let _ = match crate::gil::offer_to_waiter(job) {
                Ok(ran) => ran.await,
                Err(job) => crate::gil::run_detached_here_or_submit(job).await,
            };
        })
    }));
    register(&dist)?;
    Ok(dist)
}

/// The exception for a distributed autograd failure: `TensorwireError(kind, message, ranks)`
/// with PyTorch's wording where PyTorch has one (its tests match on it), then ours.
fn autograd_error(e: &DistAutogradError) -> PyErr {
    let (kind, message, ranks) = match e {
        DistAutogradError::Rpc(e) => return rpc_error(e),
        DistAutogradError::State(AutogradError::UnknownContext(id)) => (
            "argument",
            format!("Could not find autograd context with id: {} ({e})", id.0),
            Vec::new(),
        ),
        DistAutogradError::State(AutogradError::Dropped { context, cause }) => (
            "network",
            format!(
                "Could not find autograd context with id: {}: it was dropped ({cause})",
                context.0
            ),
            vec![cause.worker() as usize],
        ),
        DistAutogradError::State(AutogradError::InvalidRoots { problem, .. }) => {
            let torch = match problem {
                RootProblem::Empty => "No tensors were given as roots".to_owned(),
                RootProblem::NoGrad { index } => format!(
                    "element {index} of tensors does not require grad and does not have a grad_fn"
                ),
                RootProblem::NotScalar { .. } => {
                    "grad can be implicitly created only for scalar outputs".to_owned()
                }
                RootProblem::NoGradFn { index } => {
                    format!("element {index} of tensors does not have a valid gradient function")
                }
                _ => String::new(),
            };
            ("argument", format!("{torch} ({problem})"), Vec::new())
        }
        DistAutogradError::Backward {
            worker,
            source: BackwardError::Engine {
                reason, context, ..
            },
            ..
        } => (
            "backend",
            // PyTorch's wording for an engine that raised on a worker, then where.
            format!(
                "Error on Node {worker}: {reason}\n(distributed backward failed: the autograd \
                 engine of rank {worker} raised in {context})"
            ),
            vec![*worker as usize],
        ),
        DistAutogradError::Backward { worker, .. } => {
            ("backend", e.to_string(), vec![*worker as usize])
        }
        _ => ("backend", e.to_string(), Vec::new()),
    };
    TensorwireError::new_err((kind, message, ranks))
}

/// A tracked call's outcome as the Python layer takes it: `("returned", payload, buffers,
/// rrefs, tracked_at, tracked)`, `("raised", type, message, traceback)` or the exception of a
/// call that failed (as a value, not raised).
fn tracked_outcome(
    py: Python<'_>,
    outcome: Result<(TrackedReply, Vec<TorchTensor>), DistAutogradError>,
) -> Bound<'_, PyAny> {
    let value = match outcome {
        Ok((
            TrackedReply::Returned {
                payload,
                tensors,
                rrefs,
                tracked_at,
            },
            tracked,
        )) => buffers(py, tensors).and_then(|b| {
            (
                "returned",
                PyBytes::new(py, &payload),
                b,
                py_references(py, rrefs)?,
                tracked_at,
                tensors_of(py, &tracked)?,
            )
                .into_pyobject(py)
                .map(|t| t.into_any())
        }),
        Ok((
            TrackedReply::Raised {
                exc_type,
                message,
                traceback,
            },
            _,
        )) => ("raised", exc_type, message, traceback)
            .into_pyobject(py)
            .map(|t| t.into_any()),
        Err(e) => Ok(autograd_error(&e).into_value(py).into_bound(py).into_any()),
    };
    value.unwrap_or_else(|e| e.into_value(py).into_bound(py).into_any())
}

/// Hands a tracked call's outcome ([`tracked_outcome`]) to `on_done`, as a Python job.
fn complete(
    on_done: Py<PyAny>,
    outcome: Result<(TrackedReply, Vec<TorchTensor>), DistAutogradError>,
) {
    crate::gil::submit(Box::new(move |py| {
        let value = tracked_outcome(py, outcome);
        if let Err(e) = on_done.call1(py, (value,)) {
            e.write_unraisable(py, Some(on_done.bind(py)));
        }
    }));
}

/// Distributed autograd on this worker, as `tensorwire.rpc.dist_autograd` uses it. Context
/// ids are Python ints (the creating worker's id in the high 32 bits).
#[pyclass(module = "tensorwire._native", frozen)]
pub(crate) struct PyDistAutograd {
    dist: DistAutograd<TorchEngine>,
    /// The contexts made here and not yet released, by id.
    owned: Mutex<HashMap<u64, AutogradContext<TorchEngine>>>,
}

impl PyDistAutograd {
    pub(crate) fn new(dist: DistAutograd<TorchEngine>) -> Self {
        Self {
            dist,
            owned: Mutex::new(HashMap::new()),
        }
    }

    /// Sends a Python call in `context` (see [`call`](PyDistAutograd::call)): the reply's future.
    #[allow(clippy::too_many_arguments)]
    fn send_call(
        &self,
        py: Python<'_>,
        context: u64,
        to: &str,
        function: String,
        payload: &[u8],
        tensors: &Bound<'_, PyList>,
        rrefs: &Bound<'_, PyList>,
        tracked_at: Vec<u32>,
        tracked: &Bound<'_, PyList>,
        timeout: Option<f64>,
    ) -> PyResult<TrackedFuture> {
        let timeout = timeout_of(timeout)?;
        let call = tracked_call(function, payload, tensors, rrefs, tracked_at)?;
        let tracked = tracked_list(tracked)?;
        py.detach(|| {
            let _runtime = runtime().enter();
            let handle = self.retrieve(context)?;
            handle
                .rpc_async::<TrackedCall, TrackedReply>(to, PY_FN, &call, &tracked, timeout)
                .map_err(|e| autograd_error(&e))
        })
    }

    fn retrieve(&self, context: u64) -> PyResult<AutogradContext<TorchEngine>> {
        self.dist
            .retrieve(ContextId(context))
            .map_err(|e| autograd_error(&e))
    }
}

/// A send or recv function as Python sees it: message id, the peer's rank, the tensors.
type FunctionRow = (u64, u32, Vec<Py<PyAny>>);

fn function_rows(
    py: Python<'_>,
    records: Vec<tensorwire_dist_autograd::FunctionRecord<TorchTensor>>,
) -> PyResult<Vec<FunctionRow>> {
    records
        .into_iter()
        .map(|r| {
            let tensors = r
                .tensors
                .iter()
                .map(|t| t.object(py))
                .collect::<PyResult<_>>()?;
            Ok((r.message.0, r.peer, tensors))
        })
        .collect()
}

/// The tracked tensors of a Python list.
fn tracked_list(list: &Bound<'_, PyList>) -> PyResult<Vec<TorchTensor>> {
    tracked_of(list.as_any())
}

fn timeout_of(timeout: Option<f64>) -> PyResult<Option<Duration>> {
    timeout.map(|t| duration("timeout", t)).transpose()
}

fn tracked_call(
    function: String,
    payload: &[u8],
    tensors: &Bound<'_, PyList>,
    rrefs: &Bound<'_, PyList>,
    tracked_at: Vec<u32>,
) -> PyResult<TrackedCall> {
    Ok(TrackedCall {
        call: PyCall {
            function,
            payload: payload.to_vec(),
            tensors: lend(tensors)?,
            rrefs: references(rrefs)?,
        },
        tracked_at,
    })
}

#[pymethods]
impl PyDistAutograd {
    /// A new context made by this worker; its id.
    fn new_context(&self, py: Python<'_>) -> PyResult<u64> {
        py.detach(|| {
            let context = self.dist.context().map_err(|e| autograd_error(&e))?;
            let id = context.id().0;
            self.owned
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .insert(id, context);
            Ok(id)
        })
    }

    /// Releases `context` here at once and tells every worker it reached without waiting for
    /// their answers, as PyTorch's context manager does (its cleanup messages are not waited
    /// for either): leaving a context costs no round trip. The other workers drop it when the
    /// release reaches them. A context this worker does not hold raises PyTorch's "Could not
    /// find autograd context" error.
    fn release(&self, py: Python<'_>, context: u64) -> PyResult<()> {
        py.detach(|| {
            let owned = self
                .owned
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .remove(&context);
            let handle = match owned {
                Some(h) => h,
                None => self.retrieve(context)?,
            };
            let _runtime = runtime().enter();
            handle
                .release_in_background()
                .map_err(|e| autograd_error(&e))
        })
    }

    /// Whether this worker holds `context` (made here, or brought in by a call).
    fn has_context(&self, py: Python<'_>, context: u64) -> bool {
        py.detach(|| self.dist.retrieve(ContextId(context)).is_ok())
    }

    /// Raises the error for a context this worker does not hold (PyTorch's
    /// `_retrieve_context`); nothing for one it holds.
    fn check_context(&self, py: Python<'_>, context: u64) -> PyResult<()> {
        py.detach(|| self.retrieve(context).map(drop))
    }

    /// How many contexts this worker holds.
    fn context_count(&self, py: Python<'_>) -> usize {
        py.detach(|| self.dist.context_count())
    }

    /// `(contexts held here, contexts with backward work running here)`: PyTorch's
    /// `num_autograd_contexts` and `num_current_backward_passes`.
    fn debug_info(&self, py: Python<'_>) -> (usize, usize) {
        py.detach(|| (self.dist.context_count(), self.dist.backward_passes()))
    }

    /// The ranks of the workers `context` reached from here (PyTorch's `_known_worker_ids`).
    fn known_workers(&self, py: Python<'_>, context: u64) -> PyResult<Vec<u32>> {
        py.detach(|| Ok(self.retrieve(context)?.known_workers()))
    }

    /// The send functions of `context` here: `[(message id, receiver's rank, [tensors])]`, the
    /// tensors each message carried that require grad.
    fn send_functions(&self, py: Python<'_>, context: u64) -> PyResult<Vec<FunctionRow>> {
        let records = py.detach(|| Ok::<_, PyErr>(self.retrieve(context)?.send_functions()))?;
        function_rows(py, records)
    }

    /// The recv functions of `context` here: `[(message id, sender's rank, [tensors])]`, the
    /// tracked tensors each message brought in.
    fn recv_functions(&self, py: Python<'_>, context: u64) -> PyResult<Vec<FunctionRow>> {
        let records = py.detach(|| Ok::<_, PyErr>(self.retrieve(context)?.recv_functions()))?;
        function_rows(py, records)
    }

    /// Calls `function` on `to` in `context`: `payload` is the pickled arguments, `tensors`
    /// the untracked tensors it refers to (held until sent) and `tracked` the tensors that
    /// require grad, at the positions `tracked_at` of the pickle's tensor list. Returns at
    /// once; `on_done(outcome)` runs later with the GIL (see `complete`).
    #[pyo3(signature = (context, to, function, payload, tensors, rrefs, tracked_at, tracked, timeout, on_done))]
    #[allow(clippy::too_many_arguments)]
    fn call(
        &self,
        py: Python<'_>,
        context: u64,
        to: String,
        function: String,
        payload: &[u8],
        tensors: &Bound<'_, PyList>,
        rrefs: &Bound<'_, PyList>,
        tracked_at: Vec<u32>,
        tracked: &Bound<'_, PyList>,
        timeout: Option<f64>,
        on_done: Py<PyAny>,
    ) -> PyResult<()> {
        let future = self.send_call(
            py, context, &to, function, payload, tensors, rrefs, tracked_at, tracked, timeout,
        )?;
        runtime().spawn(async move { complete(on_done, future.await) });
        Ok(())
    }

    /// [`call`](Self::call), waited for here without the GIL: returns the outcome
    /// `on_done` would get (`rpc_sync` in a context; no thread hand-over for the reply).
    #[pyo3(signature = (context, to, function, payload, tensors, rrefs, tracked_at, tracked, timeout))]
    #[allow(clippy::too_many_arguments)]
    fn call_wait<'py>(
        &self,
        py: Python<'py>,
        context: u64,
        to: String,
        function: String,
        payload: &[u8],
        tensors: &Bound<'_, PyList>,
        rrefs: &Bound<'_, PyList>,
        tracked_at: Vec<u32>,
        tracked: &Bound<'_, PyList>,
        timeout: Option<f64>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let future = self.send_call(
            py, context, &to, function, payload, tensors, rrefs, tracked_at, tracked, timeout,
        )?;
        let outcome = wait_here(py, future);
        Ok(tracked_outcome(py, outcome))
    }

    /// `remote()` in `context` (arguments as for [`call`](Self::call)): a reference to the
    /// value `function` makes on `to`.
    #[pyo3(signature = (context, to, function, payload, tensors, rrefs, tracked_at, tracked, timeout))]
    #[allow(clippy::too_many_arguments)]
    fn remote(
        &self,
        py: Python<'_>,
        context: u64,
        to: String,
        function: String,
        payload: &[u8],
        tensors: &Bound<'_, PyList>,
        rrefs: &Bound<'_, PyList>,
        tracked_at: Vec<u32>,
        tracked: &Bound<'_, PyList>,
        timeout: Option<f64>,
    ) -> PyResult<PyRRef> {
        let timeout = timeout_of(timeout)?;
        let call = tracked_call(function, payload, tensors, rrefs, tracked_at)?;
        let tracked = tracked_list(tracked)?;
        let rref = py.detach(|| {
            let _runtime = runtime().enter();
            let handle = self.retrieve(context)?;
            handle
                .remote::<TrackedCall, PyValue>(&to, PY_REMOTE, &call, &tracked, timeout)
                .map_err(|e| autograd_error(&e))
        })?;
        Ok(PyRRef { rref })
    }

    /// `rref.to_here()` in `context`: the value pickled on its owner, its tensors that
    /// require grad tracked; `on_done` as for [`call`](Self::call).
    #[pyo3(signature = (context, rref, timeout, on_done))]
    fn fetch(
        &self,
        py: Python<'_>,
        context: u64,
        rref: &PyRRef,
        timeout: Option<f64>,
        on_done: Py<PyAny>,
    ) -> PyResult<()> {
        let timeout = timeout_of(timeout)?;
        let rref = rref.rref.clone();
        let handle = py.detach(|| self.retrieve(context))?;
        runtime().spawn(async move {
            let outcome = handle
                .rref_rpc_sync::<PyValue, (), TrackedReply>(&rref, PY_FETCH, &(), &[], timeout)
                .await;
            complete(on_done, outcome)
        });
        Ok(())
    }

    /// Runs `function`, one of tensorwire's own owner-side functions (the Python layer's
    /// `owner_call` refuses any other), on the owner of `rref` with its value as the first
    /// argument; `on_done` gets the outcome as for `RpcAgent.call`.
    #[pyo3(signature = (rref, function, payload, tensors, timeout, on_done))]
    fn owner_call(
        &self,
        rref: &PyRRef,
        function: String,
        payload: &[u8],
        tensors: &Bound<'_, PyList>,
        timeout: Option<f64>,
        on_done: Py<PyAny>,
    ) -> PyResult<()> {
        let timeout = timeout_of(timeout)?;
        let call = PyCall {
            function,
            payload: payload.to_vec(),
            tensors: lend(tensors)?,
            rrefs: Vec::new(),
        };
        let _runtime = runtime().enter();
        let future = rref
            .rref
            .rpc_async::<PyCall, PyReply>(PY_OWNER_CALL, &call, timeout)
            .map_err(|e| rpc_error(&e))?;
        drop(call);
        runtime().spawn(async move { super::complete(on_done, future.await) });
        Ok(())
    }

    /// Runs `function`, one of tensorwire's own owner-side functions, on the owner of each of
    /// `rrefs` (references this worker does not own) with its value as the first argument, all
    /// at once; then calls `meanwhile()` (the part the caller runs itself, with the GIL) and
    /// waits once, without the GIL, for every owner's answer. Returns `meanwhile`'s result and
    /// the outcomes in `rrefs`' order, each as `owner_call`'s `on_done` gets it (a call that
    /// could not be sent is its exception, as a value). One wait for all, on this thread:
    /// no Python job and no future per answer (`DistributedOptimizer.step`).
    #[pyo3(signature = (rrefs, function, payload, tensors, timeout, meanwhile))]
    #[allow(clippy::too_many_arguments)]
    fn owner_call_all<'py>(
        &self,
        py: Python<'py>,
        rrefs: Vec<PyRef<'py, PyRRef>>,
        function: String,
        payload: &[u8],
        tensors: &Bound<'py, PyList>,
        timeout: Option<f64>,
        meanwhile: &Bound<'py, PyAny>,
    ) -> PyResult<(Bound<'py, PyAny>, Vec<Bound<'py, PyAny>>)> {
        let timeout = timeout_of(timeout)?;
        let call = PyCall {
            function,
            payload: payload.to_vec(),
            tensors: lend(tensors)?,
            rrefs: Vec::new(),
        };
        let sent: Vec<Result<_, RpcError>> = {
            let _runtime = runtime().enter();
            rrefs
                .iter()
                .map(|r| {
                    r.rref
                        .rpc_async::<PyCall, PyReply>(PY_OWNER_CALL, &call, timeout)
                })
                .collect()
        };
        drop(call);
        // Every call is on its way (a failed send is its outcome): the caller's own part runs
        // now, beside the owners', and its exceptions are its own to report.
        let own = meanwhile.call0();
        let replies = wait_here(py, async move {
            let mut out = Vec::with_capacity(sent.len());
            for s in sent {
                out.push(match s {
                    Ok(f) => f.await,
                    Err(e) => Err(e),
                });
            }
            out
        });
        Ok((
            own?,
            replies.into_iter().map(|r| super::outcome(py, r)).collect(),
        ))
    }

    /// Runs the backward pass in `context` from `roots` (scalars that require grad) and
    /// waits, without the GIL, until every worker it reached is done.
    #[pyo3(signature = (context, roots, retain_graph))]
    fn backward(
        &self,
        py: Python<'_>,
        context: u64,
        roots: &Bound<'_, PyList>,
        retain_graph: bool,
    ) -> PyResult<()> {
        let roots: Vec<(TorchTensor, Option<TorchTensor>)> = roots
            .iter()
            .map(|t| (TorchTensor::keyed(t), None))
            .collect();
        // This thread checks the roots and runs this worker's first local pass itself (it
        // may run Python: the user's thread, the GIL released until the pass takes it), then
        // waits for the rest.
        let rest = py.detach(|| {
            let handle = self.retrieve(context)?;
            let _runtime = runtime().enter();
            handle
                .backward_here(&roots, retain_graph)
                .map_err(|e| autograd_error(&e))
        })?;
        // While it waits, this thread runs the passes that come back to this worker (the
        // gradients a pass's answers carry for its sends), in place of a runtime worker.
        crate::gil::wait_helping(py, rest).map_err(|e| autograd_error(&e))
    }

    /// The gradients this worker holds in `context`: `[(leaf, gradient)]`.
    // A `Leaf` hashes and compares by its key alone, which never changes; the cell that may
    // make its Python object later is no part of it.
    #[allow(clippy::mutable_key_type)]
    fn gradients<'py>(
        &self,
        py: Python<'py>,
        context: u64,
    ) -> PyResult<Vec<(Py<PyAny>, Py<PyAny>)>> {
        let grads = py
            .detach(|| self.dist.gradients(ContextId(context)))
            .ok_or_else(|| {
                autograd_error(&DistAutogradError::State(AutogradError::UnknownContext(
                    ContextId(context),
                )))
            })?;
        grads
            .into_iter()
            .map(|(leaf, grad)| Ok((leaf.tensor.object(py)?, grad.object(py)?)))
            .collect()
    }
}
