//! The native half of `tensorwire.rpc`: one tensorwire RPC agent per process, and the one
//! generic function through which every Python call travels.
//!
//! A Python call is a call of [`PY_CALL`] carrying the function's qualified name, its
//! arguments pickled by the Python layer with every tensor taken out of the pickle, and those
//! tensors' bytes beside the message (the agent's tensor sidecar: no copy on the way out for a
//! contiguous CPU tensor, whose storage is sent where it lies). This module decides nothing
//! about what may run: the callee's Python layer (its `serve` function) resolves the name among
//! what it exposed and unpickles with its allow-list. What this module guarantees is where
//! Python runs: with the GIL on a blocking thread, never on a runtime worker, and every wait of
//! ours (init, a call, shutdown) releases the GIL.

use std::ffi::c_int;
use std::sync::Arc;
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyList, PyTuple};
use serde::{Deserialize, Serialize};
use tensorwire_core::protocol::CallError;
use tensorwire_core::tensor::{DType, Storage, Tensor};
use tensorwire_rpc::{Agent, CallContext, Functions, RpcError, RpcOptions, Shutdown};

use crate::{runtime, TensorwireError};

/// The name of the one function every Python call goes through.
pub(crate) const PY_CALL: &str = "tensorwire.py_call";

/// A Python call as it travels: what to run and its pickled arguments, with the tensors the
/// pickle refers to by index.
#[derive(Serialize, Deserialize)]
struct PyCall {
    function: String,
    payload: Vec<u8>,
    tensors: Vec<Tensor>,
}

/// What a Python call ended with: a pickled value (with its tensors), or the exception the
/// function raised (its type's qualified name, its message and the remote traceback's text).
#[derive(Serialize, Deserialize)]
enum PyReply {
    Returned {
        payload: Vec<u8>,
        tensors: Vec<Tensor>,
    },
    Raised {
        exc_type: String,
        message: String,
        traceback: String,
    },
}

/// A tensor's storage lent to the sidecar without a copy: the tensor is held until the bytes
/// are dropped (after they were written to the connection).
struct Lent {
    ptr: usize,
    len: usize,
    _tensor: Py<PyAny>,
}

impl AsRef<[u8]> for Lent {
    fn as_ref(&self) -> &[u8] {
        if self.len == 0 {
            return &[];
        }
        // SAFETY: `ptr` and `len` are the held tensor's `data_ptr()` and `nbytes`; its storage
        // lives while the tensor does. The Python layer's contract (documented) is that the
        // caller does not write the tensor until the call's future completes.
        unsafe { std::slice::from_raw_parts(self.ptr as *const u8, self.len) }
    }
}

/// The tensors of a pickle, as the sidecar carries them: each a byte blob (dtype and shape
/// travel in the pickle). The Python layer hands contiguous CPU tensors only.
fn lend(tensors: &Bound<'_, PyList>) -> PyResult<Vec<Tensor>> {
    tensors
        .iter()
        .map(|t| {
            let ptr: usize = t.call_method0("data_ptr")?.extract()?;
            let len: usize = t.getattr("nbytes")?.extract()?;
            let bytes = Bytes::from_owner(Lent {
                ptr,
                len,
                _tensor: t.unbind(),
            });
            Tensor::new(DType::U8, vec![len], Storage::Host(bytes))
                .map_err(|e| PyValueError::new_err(e.to_string()))
        })
        .collect()
}

/// Received tensor bytes as a writable Python buffer (`torch.frombuffer` takes it without a
/// copy). The bytes are the buffer's own: taken without a copy when the message's bytes were
/// ours alone and suitably aligned, else copied once.
#[pyclass(module = "tensorwire._native", frozen)]
pub(crate) struct WireBuffer {
    ptr: usize,
    len: usize,
    _owner: BytesMut,
}

impl WireBuffer {
    fn new(bytes: Bytes) -> WireBuffer {
        let mut owner = match bytes.try_into_mut() {
            // 16: the alignment of any element type torch computes with.
            Ok(unique) if (unique.as_ptr() as usize).is_multiple_of(16) => unique,
            Ok(unique) => BytesMut::from(&unique[..]),
            Err(shared) => BytesMut::from(&shared[..]),
        };
        WireBuffer {
            ptr: owner.as_mut_ptr() as usize,
            len: owner.len(),
            _owner: owner,
        }
    }
}

#[pymethods]
impl WireBuffer {
    /// The bytes, writable (the buffer owns them alone).
    unsafe fn __getbuffer__(
        slf: Bound<'_, Self>,
        view: *mut pyo3::ffi::Py_buffer,
        flags: c_int,
    ) -> PyResult<()> {
        let this = slf.get();
        let len = isize::try_from(this.len)
            .map_err(|_| PyValueError::new_err("a buffer larger than isize::MAX bytes"))?;
        // SAFETY: `view` is the interpreter's; the memory lives as long as `slf`, which the
        // view holds a reference to (`PyBuffer_FillInfo` sets `view.obj`).
        let filled = unsafe {
            pyo3::ffi::PyBuffer_FillInfo(
                view,
                slf.as_ptr(),
                this.ptr as *mut std::ffi::c_void,
                len,
                0,
                flags,
            )
        };
        if filled == -1 {
            return Err(PyErr::fetch(slf.py()));
        }
        Ok(())
    }

    fn __len__(&self) -> usize {
        self.len
    }
}

fn buffers<'py>(py: Python<'py>, tensors: Vec<Tensor>) -> PyResult<Bound<'py, PyList>> {
    let mut out = Vec::with_capacity(tensors.len());
    for t in tensors {
        let bytes = t.host_bytes().cloned().ok_or_else(|| {
            TensorwireError::new_err((
                "argument",
                "a tensor arrived in device memory; tensorwire.rpc carries CPU tensors",
                Vec::<usize>::new(),
            ))
        })?;
        drop(t);
        out.push(Py::new(py, WireBuffer::new(bytes))?);
    }
    PyList::new(py, out)
}

/// The exception for a failed call or setup: `TensorwireError(kind, message, ranks)`.
fn rpc_error(e: &RpcError) -> PyErr {
    let kind = match e {
        RpcError::Call { source, .. } => match source {
            CallError::Timeout { .. } => "timeout",
            CallError::PeerLost { .. } | CallError::OwnerLost { .. } => "network",
            CallError::NotRunning => "not_running",
            _ => "backend",
        },
        RpcError::Timeout { .. } => "timeout",
        RpcError::NotRunning => "not_running",
        RpcError::UnknownWorker { .. }
        | RpcError::Name(_)
        | RpcError::RankOutOfRange { .. }
        | RpcError::InvalidArgument(_) => "argument",
        RpcError::Rendezvous(_) | RpcError::Store(_) | RpcError::Transport(_) => "network",
        _ => "backend",
    };
    TensorwireError::new_err((kind, e.to_string(), Vec::<usize>::new()))
}

/// Runs `future` on the runtime and waits for it without the GIL, from any thread (also a
/// blocking thread of the runtime's own, where `block_on` may not be used).
fn wait<T: Send + 'static>(
    py: Python<'_>,
    future: impl std::future::Future<Output = T> + Send + 'static,
) -> PyResult<T> {
    let (tx, rx) = std::sync::mpsc::sync_channel(1);
    runtime().spawn(async move {
        let _ = tx.send(future.await);
    });
    py.detach(move || rx.recv()).map_err(|_| {
        TensorwireError::new_err((
            "backend",
            "the tensorwire runtime dropped the operation",
            Vec::<usize>::new(),
        ))
    })
}

fn duration(what: &str, seconds: f64) -> PyResult<Duration> {
    if !(seconds.is_finite() && seconds >= 0.0) {
        return Err(PyValueError::new_err(format!(
            "{what} must be a non-negative number of seconds, not {seconds}"
        )));
    }
    Ok(Duration::from_secs_f64(seconds))
}

/// Runs a call on this worker: the Python layer's `serve(caller, function, payload, buffers)`
/// with the GIL, on a blocking thread. `serve` returns `("returned", payload, tensors)` or
/// `("raised", type, message, traceback)`; it never raises for the user function's failures.
fn serve(serve: &Py<PyAny>, caller: String, call: PyCall) -> Result<PyReply, String> {
    Python::attach(|py| {
        let run = || -> PyResult<PyReply> {
            let buffers = buffers(py, call.tensors)?;
            let out = serve.call1(
                py,
                (
                    caller,
                    call.function,
                    PyBytes::new(py, &call.payload),
                    buffers,
                ),
            )?;
            let out = out.bind(py).cast::<PyTuple>()?;
            let tag: String = out.get_item(0)?.extract()?;
            if tag == "returned" {
                let payload: Vec<u8> = out.get_item(1)?.extract()?;
                let tensors = lend(out.get_item(2)?.cast::<PyList>()?)?;
                Ok(PyReply::Returned { payload, tensors })
            } else {
                Ok(PyReply::Raised {
                    exc_type: out.get_item(1)?.extract()?,
                    message: out.get_item(2)?.extract()?,
                    traceback: out.get_item(3)?.extract()?,
                })
            }
        };
        // A failure of the serving machinery itself (not of the user's function) fails the
        // call with its text.
        run().map_err(|e| format!("tensorwire.rpc could not serve the call: {e}"))
    })
}

/// This process's RPC agent, as `tensorwire.rpc` holds it.
#[pyclass(module = "tensorwire._native", frozen)]
pub(crate) struct RpcAgent {
    agent: Agent,
}

#[pymethods]
impl RpcAgent {
    /// Starts this worker's agent (PyTorch's `init_rpc`): rendezvous at `init_method`, connect
    /// to every worker (`world_size = None`: a dynamic group), and serve Python calls through
    /// `serve`. Blocks without the GIL until the group is up or `init_timeout` passed.
    #[staticmethod]
    #[pyo3(signature = (name, rank, world_size, init_method, rpc_timeout, init_timeout, serve))]
    #[allow(clippy::too_many_arguments)]
    fn start(
        py: Python<'_>,
        name: String,
        rank: usize,
        world_size: Option<usize>,
        init_method: String,
        rpc_timeout: f64,
        init_timeout: f64,
        serve: Py<PyAny>,
    ) -> PyResult<RpcAgent> {
        let functions = Functions::new();
        let serve = Arc::new(serve);
        functions
            .register_with_context(PY_CALL, move |ctx: CallContext, call: PyCall| {
                let serve = Arc::clone(&serve);
                let caller = ctx.caller().name.clone();
                async move {
                    tokio::task::spawn_blocking(move || self::serve(&serve, caller, call))
                        .await
                        .map_err(|e| format!("the Python call ended abnormally: {e}"))?
                }
            })
            .map_err(|e| rpc_error(&e))?;
        let options = RpcOptions::new()
            .with_functions(functions)
            .with_rpc_timeout(duration("rpc_timeout", rpc_timeout)?)
            .with_init_method(init_method)
            .with_init_timeout(duration("init_timeout", init_timeout)?);
        let agent = wait(py, async move {
            tensorwire_rpc::init_rpc(&name, rank, world_size, options).await
        })?
        .map_err(|e| rpc_error(&e))?;
        Ok(RpcAgent { agent })
    }

    /// This worker: `(name, id)`.
    fn me(&self) -> (String, u32) {
        let me = self.agent.worker_info();
        (me.name.clone(), me.id)
    }

    /// The worker named `name`: `(name, id)`; `TensorwireError("argument", ...)` if none is.
    fn worker(&self, name: &str) -> PyResult<(String, u32)> {
        let w = self
            .agent
            .get_worker_info(name)
            .map_err(|e| rpc_error(&e))?;
        Ok((w.name, w.id))
    }

    /// Every worker of the group, in rank order: `[(name, id)]`.
    fn workers(&self) -> Vec<(String, u32)> {
        self.agent
            .worker_infos()
            .into_iter()
            .map(|w| (w.name, w.id))
            .collect()
    }

    /// The default call timeout in seconds (zero: none).
    fn rpc_timeout(&self) -> f64 {
        self.agent.rpc_timeout().as_secs_f64()
    }

    /// Calls `function` on worker `to` with `payload` (the pickled arguments) and `tensors`
    /// (contiguous CPU tensors the pickle refers to by index; held, not copied, until sent),
    /// within `timeout` seconds (`None`: the default; zero: none). Returns at once;
    /// `on_done(outcome)` runs later, with the GIL, on a blocking thread, where `outcome` is
    /// `("returned", payload, buffers)`, `("raised", type, message, traceback)` or a
    /// `TensorwireError` for a call that failed (timeout, lost peer, refused by the callee's
    /// machinery). A call that cannot be sent (unknown worker) raises here.
    #[pyo3(signature = (to, function, payload, tensors, timeout, on_done))]
    fn call(
        &self,
        to: &str,
        function: String,
        payload: &[u8],
        tensors: &Bound<'_, PyList>,
        timeout: Option<f64>,
        on_done: Py<PyAny>,
    ) -> PyResult<()> {
        let timeout = timeout.map(|t| duration("timeout", t)).transpose()?;
        let call = PyCall {
            function,
            payload: payload.to_vec(),
            tensors: lend(tensors)?,
        };
        let _runtime = runtime().enter();
        let future = self
            .agent
            .rpc_async::<PyCall, PyReply>(to, PY_CALL, &call, timeout)
            .map_err(|e| rpc_error(&e))?;
        drop(call);
        runtime().spawn(async move {
            let reply = future.await;
            // Python runs on a blocking thread, never on the runtime's workers.
            tokio::task::spawn_blocking(move || {
                Python::attach(|py| {
                    let outcome = match reply {
                        Ok(PyReply::Returned { payload, tensors }) => buffers(py, tensors)
                            .and_then(|b| {
                                ("returned", PyBytes::new(py, &payload), b)
                                    .into_pyobject(py)
                                    .map(|t| t.into_any())
                            }),
                        Ok(PyReply::Raised {
                            exc_type,
                            message,
                            traceback,
                        }) => ("raised", exc_type, message, traceback)
                            .into_pyobject(py)
                            .map(|t| t.into_any()),
                        Err(e) => Ok(rpc_error(&e).into_value(py).into_bound(py).into_any()),
                    };
                    let outcome =
                        outcome.unwrap_or_else(|e| e.into_value(py).into_bound(py).into_any());
                    if let Err(e) = on_done.call1(py, (outcome,)) {
                        e.write_unraisable(py, Some(on_done.bind(py)));
                    }
                })
            });
        });
        Ok(())
    }

    /// Stops the agent: gracefully (once no call is in flight anywhere) within `timeout`
    /// seconds, or at once (pending calls fail). Blocks without the GIL; calls this worker
    /// serves meanwhile still run.
    #[pyo3(signature = (graceful, timeout))]
    fn shutdown(&self, py: Python<'_>, graceful: bool, timeout: f64) -> PyResult<()> {
        let how = if graceful {
            Shutdown::graceful(duration("timeout", timeout)?)
        } else {
            Shutdown::Immediate
        };
        let agent = self.agent.clone();
        wait(py, async move { agent.shutdown(how).await })?.map_err(|e| rpc_error(&e))
    }
}
