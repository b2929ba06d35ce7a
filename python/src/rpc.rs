//! The native half of `tensorwire.rpc`: one tensorwire RPC agent per process, and the one
//! generic function through which every Python call travels.
//!
//! A Python call is a call of [`PY_CALL`] carrying the function's qualified name, its
//! arguments pickled by the Python layer with every tensor taken out of the pickle, and those
//! tensors' bytes beside the message (the agent's tensor sidecar: no copy on the way out for a
//! contiguous CPU tensor, whose storage is sent where it lies), and the remote references it
//! refers to as the agent's own references (forked for the destination when sent, accepted
//! when received). Method calls on a reference's value (`rref.rpc_sync().f()`) travel the same
//! way as methods of the agent's references ([`PY_METHOD`], [`PY_METHOD_REMOTE`]). A function
//! may answer later: the Python layer hands back a `torch.futures.Future` (PyTorch's
//! `async_execution`), and the call completes when it does, holding no thread meanwhile. This
//! module decides nothing
//! about what may run: the callee's Python layer (its `serve` function) resolves the name among
//! what it exposed and unpickles with its allow-list. What this module guarantees is where
//! Python runs: with the GIL on a blocking thread, never on a runtime worker, and every wait of
//! ours (init, a call, shutdown) releases the GIL.

/// Distributed autograd on the agent (`tensorwire.rpc.dist_autograd`): part of the RPC
/// module, as the Python package has it.
pub(crate) mod autograd;
use std::ffi::c_int;
use std::sync::Arc;
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyList, PyTuple};
use serde::{Deserialize, Serialize};
use tensorwire_core::device::{Device, DeviceMap, DeviceMaps};
use tensorwire_core::protocol::start::StartError;
use tensorwire_core::protocol::CallError;
use tensorwire_core::tensor::{DType, Storage, Tensor};
use tensorwire_rpc::{Agent, CallContext, Functions, RRef, RpcError, RpcOptions, Shutdown};
use tokio::sync::oneshot;

use crate::{runtime, TensorwireError};
use autograd::PyDistAutograd;

/// The name of the one function every Python call goes through.
pub(crate) const PY_CALL: &str = "tensorwire.py_call";

/// The name of the function that creates a value for `remote()`: a Python call whose result
/// its owner keeps.
pub(crate) const PY_REMOTE: &str = "tensorwire.py_remote";

/// The method that copies a remote reference's value for `to_here()`: pickled on its owner,
/// when asked (so the copy is the value as it is then).
pub(crate) const PY_FETCH: &str = "tensorwire.py_fetch";

/// The method every `rref.rpc_sync()` / `rref.rpc_async()` proxy call goes through: a Python
/// call whose target is the reference's value.
pub(crate) const PY_METHOD: &str = "tensorwire.py_method";

/// The method of `rref.remote()` proxies: a Python call on the reference's value whose result
/// its owner keeps as a new value.
pub(crate) const PY_METHOD_REMOTE: &str = "tensorwire.py_method_remote";

/// A Python call as it travels: what to run and its pickled arguments, with the tensors and
/// the remote references the pickle refers to by index. A reference is the agent's own: sending
/// it forks it for the destination, receiving it accepts the fork (PyTorch's fork protocol, as
/// the agent implements it), and the function runs once the owner confirmed every one.
#[derive(Serialize, Deserialize)]
pub(crate) struct PyCall {
    pub(crate) function: String,
    pub(crate) payload: Vec<u8>,
    pub(crate) tensors: Vec<Tensor>,
    pub(crate) rrefs: Vec<RRef<PyValue>>,
}

/// What a Python call ended with: a pickled value (with its tensors), or the exception the
/// function raised (its type's qualified name, its message and the remote traceback's text).
#[derive(Serialize, Deserialize)]
pub(crate) enum PyReply {
    Returned {
        payload: Vec<u8>,
        tensors: Vec<Tensor>,
        rrefs: Vec<RRef<PyValue>>,
    },
    Raised {
        exc_type: String,
        message: String,
        traceback: String,
    },
}

/// What a remote reference's owner keeps for `remote()`: the Python object the function
/// returned, or the exception it raised (raised again by every `to_here` and `local_value`).
pub(crate) enum PyValue {
    Object(Held),
    Raised {
        exc_type: String,
        message: String,
        traceback: String,
    },
}

/// A Python object the agent keeps (a reference's value). When the agent lets go of it (the
/// last holder released it, or was lost), it is released with the GIL by a runner job at once:
/// dropped without the GIL, pyo3 would only queue the release until some thread next takes the
/// GIL through pyo3, which on an idle owner may be never, and the object (a parameter's memory,
/// a local optimizer's state) would stay.
pub(crate) struct Held(Option<Py<PyAny>>);

impl Held {
    pub(crate) fn new(object: Py<PyAny>) -> Self {
        Held(Some(object))
    }
}

impl std::ops::Deref for Held {
    type Target = Py<PyAny>;

    fn deref(&self) -> &Py<PyAny> {
        self.0
            .as_ref()
            .expect("a Held object is taken only by its drop")
    }
}

impl Drop for Held {
    fn drop(&mut self) {
        let Some(object) = self.0.take() else { return };
        // Once the interpreter exits, pyo3's own queue of releases is the safe place: no
        // runner may take the GIL any more.
        if crate::gil::interpreter_exiting() {
            drop(object);
            return;
        }
        crate::gil::submit(Box::new(move |_py| drop(object)));
    }
}

impl Serialize for PyValue {
    /// A Python value is never encoded by the agent: `to_here` pickles it on its owner
    /// ([`PY_FETCH`]).
    fn serialize<S: serde::Serializer>(&self, _: S) -> Result<S::Ok, S::Error> {
        Err(serde::ser::Error::custom(
            "a Python value leaves its owner only pickled, through tensorwire.py_fetch",
        ))
    }
}

impl PyValue {
    /// The value as the Python layer sees it: `("returned", object)` or `("raised", type,
    /// message, traceback)`.
    pub(crate) fn outcome<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        match self {
            PyValue::Object(o) => ("returned", o.clone_ref(py))
                .into_pyobject(py)
                .map(|t| t.into_any()),
            PyValue::Raised {
                exc_type,
                message,
                traceback,
            } => ("raised", exc_type, message, traceback)
                .into_pyobject(py)
                .map(|t| t.into_any()),
        }
    }
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
pub(crate) fn lend(tensors: &Bound<'_, PyList>) -> PyResult<Vec<Tensor>> {
    tensors
        .iter()
        .map(|t| {
            let bytes = lent_bytes(t)?;
            Tensor::new(DType::U8, vec![bytes.len()], Storage::Host(bytes))
                .map_err(|e| PyValueError::new_err(e.to_string()))
        })
        .collect()
}

/// The storage of one contiguous CPU tensor, lent without a copy (see [`Lent`]).
pub(crate) fn lent_bytes(t: Bound<'_, PyAny>) -> PyResult<Bytes> {
    let ptr: usize = t.call_method0("data_ptr")?.extract()?;
    let len: usize = t.getattr("nbytes")?.extract()?;
    Ok(Bytes::from_owner(Lent {
        ptr,
        len,
        _tensor: t.unbind(),
    }))
}

/// Received tensor bytes as a writable Python buffer (`torch.frombuffer` takes it without a
/// copy). The bytes are the buffer's own: taken without a copy when the message's bytes were
/// ours alone and suitably aligned; when they lie in the sending peer's shared-memory slab, a
/// private copy-on-write mapping of them (no copy unless written, and then only the pages
/// written: [`tensorwire_transport_shm::private_view`]); else copied once (into a [`Recycled`]
/// buffer when one fits).
#[pyclass(module = "tensorwire._native", frozen)]
pub(crate) struct WireBuffer {
    ptr: usize,
    len: usize,
    owner: Owner,
}

/// What holds a [`WireBuffer`]'s memory.
enum Owner {
    Owned(BytesMut),
    Mapped(#[allow(dead_code)] tensorwire_transport_shm::PrivateView),
}

/// 16: the alignment of any element type torch computes with.
const ALIGN: usize = 16;

impl WireBuffer {
    pub(crate) fn new(bytes: Bytes) -> WireBuffer {
        let owned = |mut owner: BytesMut| WireBuffer {
            ptr: owner.as_mut_ptr() as usize,
            len: owner.len(),
            owner: Owner::Owned(owner),
        };
        match bytes.try_into_mut() {
            Ok(unique) if (unique.as_ptr() as usize).is_multiple_of(ALIGN) => owned(unique),
            Ok(unique) => owned(Recycled::copy(&unique)),
            Err(shared) => match tensorwire_transport_shm::private_view(&shared) {
                Some(view) if (view.as_mut_ptr() as usize).is_multiple_of(ALIGN) => WireBuffer {
                    ptr: view.as_mut_ptr() as usize,
                    len: view.len(),
                    owner: Owner::Mapped(view),
                },
                _ => owned(Recycled::copy(&shared)),
            },
        }
    }
}

impl Drop for WireBuffer {
    fn drop(&mut self) {
        if let Owner::Owned(buf) = &mut self.owner {
            Recycled::give_back(std::mem::take(buf));
        }
    }
}

/// Large receive buffers kept for the next tensors of about their size.
///
/// A received tensor that must be copied (its bytes are shared with the rest of the message,
/// or lie in a transport's read-only mapping) needs fresh memory of its size, and fresh memory
/// of a megabyte and more comes from the kernel page by page: zeroing, mapping and, when freed,
/// unmapping 64 MiB costs about three times the copy itself. A program that receives tensors of
/// the same sizes again and again (every training step) gets back the buffers of the tensors
/// it has dropped instead. At most [`RECYCLED_MAX_BYTES`] are kept, in buffers of at least
/// [`RECYCLED_MIN_BYTES`]; a buffer is reused for a tensor of at least half its size.
struct Recycled;

/// Buffers smaller than this are not kept (the allocator reuses small blocks itself).
const RECYCLED_MIN_BYTES: usize = 1 << 20;
/// The most bytes kept in idle buffers, per process.
const RECYCLED_MAX_BYTES: usize = 256 << 20;

static RECYCLED: std::sync::Mutex<Vec<BytesMut>> = std::sync::Mutex::new(Vec::new());

impl Recycled {
    fn idle() -> std::sync::MutexGuard<'static, Vec<BytesMut>> {
        RECYCLED.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// `bytes` copied into a kept buffer that fits, else into a new one.
    fn copy(bytes: &[u8]) -> BytesMut {
        let len = bytes.len();
        let kept = if len >= RECYCLED_MIN_BYTES / 2 {
            let mut idle = Self::idle();
            let best = idle
                .iter()
                .enumerate()
                .filter(|(_, b)| b.capacity() >= len && b.capacity() / 2 <= len)
                .min_by_key(|(_, b)| b.capacity())
                .map(|(i, _)| i);
            best.map(|i| idle.swap_remove(i))
        } else {
            None
        };
        match kept {
            Some(mut buf) => {
                buf.extend_from_slice(bytes);
                buf
            }
            None => BytesMut::from(bytes),
        }
    }

    /// Keeps `buf` for a later tensor, if it is large and the budget allows.
    fn give_back(mut buf: BytesMut) {
        if buf.capacity() < RECYCLED_MIN_BYTES {
            return;
        }
        buf.clear();
        let mut idle = Self::idle();
        let kept: usize = idle.iter().map(BytesMut::capacity).sum();
        if kept + buf.capacity() <= RECYCLED_MAX_BYTES {
            idle.push(buf);
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

pub(crate) fn buffers<'py>(py: Python<'py>, tensors: Vec<Tensor>) -> PyResult<Bound<'py, PyList>> {
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
pub(crate) fn rpc_error(e: &RpcError) -> PyErr {
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
        | RpcError::Start(StartError::RankOutOfRange { .. })
        | RpcError::InvalidArgument(_) => "argument",
        RpcError::Rendezvous(_) | RpcError::Store(_) | RpcError::Transport(_) => "network",
        RpcError::DeviceMaps(_) | RpcError::DeviceMapConfig { .. } | RpcError::Device(_) => {
            "device_map"
        }
        // torch's init_rpc and its device copies raise RuntimeError: an agent that cannot
        // start (whichever `InitError`) or tensors that cannot travel are that.
        RpcError::Init(_) | RpcError::Tensors { .. } => "backend",
        _ => "backend",
    };
    TensorwireError::new_err((kind, e.to_string(), Vec::<usize>::new()))
}

/// Wakes the thread that polls a future in [`wait_here`].
struct Unpark(std::thread::Thread);

impl std::task::Wake for Unpark {
    fn wake(self: Arc<Self>) {
        self.0.unpark();
    }

    fn wake_by_ref(self: &Arc<Self>) {
        self.0.unpark();
    }
}

/// Waits for `future` without the GIL by polling it on this thread (inside the runtime's
/// context, so that it may register timers and I/O and spawn tasks), parked between polls:
/// whoever completes it (the runtime worker that read a reply) wakes this thread directly.
/// [`wait`] spawns a task instead, which costs a worker's wake-up to start it (the task is
/// scheduled from outside the runtime) and a poll on that worker before this thread is
/// woken. For futures that are only woken by others (a call's reply, a backward pass's end):
/// nothing here drives the runtime. From any thread, a runtime worker included once Python
/// runs there (it is in `block_in_place`).
pub(crate) fn wait_here<T: Send>(
    py: Python<'_>,
    future: impl std::future::Future<Output = T> + Send,
) -> T {
    py.detach(move || {
        let _runtime = runtime().enter();
        let waker = std::task::Waker::from(Arc::new(Unpark(std::thread::current())));
        let mut cx = std::task::Context::from_waker(&waker);
        let mut future = std::pin::pin!(future);
        loop {
            if let std::task::Poll::Ready(v) = future.as_mut().poll(&mut cx) {
                return v;
            }
            std::thread::park();
        }
    })
}

/// Runs `future` on the runtime and waits for it without the GIL, from any thread (also a
/// blocking thread of the runtime's own, where `block_on` may not be used).
pub(crate) fn wait<T: Send + 'static>(
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

pub(crate) fn duration(what: &str, seconds: f64) -> PyResult<Duration> {
    if !(seconds.is_finite() && seconds >= 0.0) {
        return Err(PyValueError::new_err(format!(
            "{what} must be a non-negative number of seconds, not {seconds}"
        )));
    }
    Ok(Duration::from_secs_f64(seconds))
}

/// The agent's references behind the Python layer's `PyRRef` objects (to send them).
pub(crate) fn references(rrefs: &Bound<'_, PyList>) -> PyResult<Vec<RRef<PyValue>>> {
    rrefs
        .iter()
        .map(|r| Ok(r.cast::<PyRRef>()?.get().rref.clone()))
        .collect()
}

/// Received references as `PyRRef` objects for the Python layer.
pub(crate) fn py_references<'py>(
    py: Python<'py>,
    rrefs: Vec<RRef<PyValue>>,
) -> PyResult<Bound<'py, PyList>> {
    let objects = rrefs
        .into_iter()
        .map(|rref| Py::new(py, PyRRef { rref }))
        .collect::<PyResult<Vec<_>>>()?;
    PyList::new(py, objects)
}

/// A call as it travels, from what the Python layer hands over.
fn py_call(
    function: String,
    payload: &[u8],
    tensors: &Bound<'_, PyList>,
    rrefs: &Bound<'_, PyList>,
) -> PyResult<PyCall> {
    Ok(PyCall {
        function,
        payload: payload.to_vec(),
        tensors: lend(tensors)?,
        rrefs: references(rrefs)?,
    })
}

/// What the Python layer answered for a call it serves: the outcome now, or later, when the
/// `torch.futures.Future` an `async_execution` function returned completes.
enum Served<T> {
    Now(T),
    Later(oneshot::Receiver<Result<T, String>>),
}

type Settle = Box<dyn FnOnce(Python<'_>, PyResult<Bound<'_, PyAny>>) + Send + Sync>;

/// The done-callback attached to the future of an `async_execution` function: it reads the
/// future's outcome (the Python layer's `("returned", ...)` or `("raised", ...)` tuple), converts
/// it and completes the call, once.
#[pyclass(module = "tensorwire._native", frozen)]
pub(crate) struct Settler {
    settle: std::sync::Mutex<Option<Settle>>,
}

#[pymethods]
impl Settler {
    fn __call__(&self, py: Python<'_>, future: &Bound<'_, PyAny>) {
        let settle = self
            .settle
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .take();
        if let Some(settle) = settle {
            settle(py, future.call_method0("value"));
        }
    }
}

/// Runs one of the Python layer's serving functions (`serve` or `create`) with the GIL, on a
/// blocking thread: `f(caller, function, payload, buffers, rrefs, target)`, where `target` is
/// the value a method call runs on (`None` for a function). Its answer is an outcome tuple,
/// converted by `convert`, or `("future", fut)` where `fut` completes with one.
fn run_python<T: Send + 'static>(
    f: &Py<PyAny>,
    caller: String,
    call: PyCall,
    target: Option<&Py<PyAny>>,
    convert: fn(&Bound<'_, PyAny>) -> PyResult<T>,
    what: &'static str,
) -> Result<Served<T>, String> {
    Python::attach(|py| {
        let run = || -> PyResult<Served<T>> {
            let buffers = buffers(py, call.tensors)?;
            let rrefs = py_references(py, call.rrefs)?;
            let target = target.map(|t| t.clone_ref(py));
            let args = (
                caller,
                call.function,
                PyBytes::new(py, &call.payload),
                buffers,
                rrefs,
                target,
            );
            let out = f.bind(py).call1(args)?;
            let tuple = out.cast::<PyTuple>()?;
            if tuple.get_item(0)?.extract::<String>()? != "future" {
                return Ok(Served::Now(convert(&out)?));
            }
            let (tx, rx) = oneshot::channel();
            let settle: Settle = Box::new(move |_py, outcome| {
                let converted = outcome
                    .and_then(|o| convert(&o))
                    .map_err(|e| format!("tensorwire.rpc could not {what}: {e}"));
                let _ = tx.send(converted);
            });
            let settler = Settler {
                settle: std::sync::Mutex::new(Some(settle)),
            };
            tuple
                .get_item(1)?
                .call_method1("add_done_callback", (Py::new(py, settler)?,))?;
            Ok(Served::Later(rx))
        };
        run().map_err(|e| format!("tensorwire.rpc could not {what}: {e}"))
    })
}

/// Serves a call in a task of the agent's: runs the Python layer (see [`run_python`]) on a
/// blocking thread (a [`gil`](crate::gil) job), then waits, without a thread, for a future it
/// returned.
async fn serve_python<T: Send + 'static>(
    f: Arc<Py<PyAny>>,
    caller: String,
    call: PyCall,
    target: Option<Arc<PyValue>>,
    convert: fn(&Bound<'_, PyAny>) -> PyResult<T>,
    what: &'static str,
) -> Result<T, String> {
    // A job of the runners (see crate::gil), not a blocking thread of its own.
    let served = crate::gil::on_python(move |_py| {
        let object = match target.as_deref() {
            None => None,
            Some(PyValue::Object(o)) => Some(&**o),
            // The method handlers answer for a value whose creation failed before coming here.
            Some(PyValue::Raised { message, .. }) => {
                return Err(format!("the value was not created: {message}"))
            }
        };
        run_python(&f, caller, call, object, convert, what)
    })
    .await??;
    match served {
        Served::Now(v) => Ok(v),
        Served::Later(rx) => rx.await.map_err(|_| {
            format!("tensorwire.rpc could not {what}: the future returned was dropped unset")
        })?,
    }
}

/// A method call on a value whose creation failed: the creation's exception, as the reply.
fn raised_target(value: &PyValue) -> Option<PyReply> {
    match value {
        PyValue::Raised {
            exc_type,
            message,
            traceback,
        } => Some(PyReply::Raised {
            exc_type: exc_type.clone(),
            message: message.clone(),
            traceback: traceback.clone(),
        }),
        PyValue::Object(_) => None,
    }
}

/// The Python layer's `("returned", object)` or `("raised", type, message, traceback)` as a
/// value its owner keeps.
fn kept(out: &Bound<'_, PyAny>) -> PyResult<PyValue> {
    let out = out.cast::<PyTuple>()?;
    let tag: String = out.get_item(0)?.extract()?;
    if tag == "returned" {
        Ok(PyValue::Object(Held::new(out.get_item(1)?.unbind())))
    } else {
        Ok(PyValue::Raised {
            exc_type: out.get_item(1)?.extract()?,
            message: out.get_item(2)?.extract()?,
            traceback: out.get_item(3)?.extract()?,
        })
    }
}

/// Pickles a reference's value on its owner for `to_here`: the Python layer's
/// `fetch(object)`, which returns `("returned", payload, tensors, rrefs)` or `("raised", ...)`.
fn fetch(fetch: &Py<PyAny>, value: &PyValue) -> Result<PyReply, String> {
    if let Some(raised) = raised_target(value) {
        return Ok(raised);
    }
    let PyValue::Object(object) = value else {
        unreachable!("raised_target handled the other variant")
    };
    Python::attach(|py| {
        let run = || -> PyResult<PyReply> {
            let out = fetch.call1(py, (object.clone_ref(py),))?;
            reply(out.bind(py))
        };
        run().map_err(|e| format!("tensorwire.rpc could not send the value: {e}"))
    })
}

/// The Python layer's `("returned", payload, tensors, rrefs)` or `("raised", type, message,
/// traceback)` as a reply.
pub(crate) fn reply(out: &Bound<'_, PyAny>) -> PyResult<PyReply> {
    let out = out.cast::<PyTuple>()?;
    let tag: String = out.get_item(0)?.extract()?;
    if tag == "returned" {
        let payload: Vec<u8> = out.get_item(1)?.extract()?;
        let tensors = lend(out.get_item(2)?.cast::<PyList>()?)?;
        let rrefs = references(out.get_item(3)?.cast::<PyList>()?)?;
        Ok(PyReply::Returned {
            payload,
            tensors,
            rrefs,
        })
    } else {
        Ok(PyReply::Raised {
            exc_type: out.get_item(1)?.extract()?,
            message: out.get_item(2)?.extract()?,
            traceback: out.get_item(3)?.extract()?,
        })
    }
}

/// A call's reply as the Python layer takes it: `("returned", payload, buffers, rrefs)`,
/// `("raised", type, message, traceback)`, or the `TensorwireError` of a failed call.
pub(crate) fn outcome(py: Python<'_>, reply: Result<PyReply, RpcError>) -> Bound<'_, PyAny> {
    let outcome = match reply {
        Ok(PyReply::Returned {
            payload,
            tensors,
            rrefs,
        }) => buffers(py, tensors).and_then(|b| {
            let r = py_references(py, rrefs)?;
            ("returned", PyBytes::new(py, &payload), b, r)
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
    outcome.unwrap_or_else(|e| e.into_value(py).into_bound(py).into_any())
}

/// Hands `reply` (or the call's failure) to `on_done` with the GIL, on a blocking thread (a
/// [`gil`](crate::gil) job, so that replies arriving together are completed under one GIL
/// hold).
pub(crate) fn complete(on_done: Py<PyAny>, reply: Result<PyReply, RpcError>) {
    crate::gil::submit(Box::new(move |py| {
        let outcome = outcome(py, reply);
        if let Err(e) = on_done.call1(py, (outcome,)) {
            e.write_unraisable(py, Some(on_done.bind(py)));
        }
    }));
}

/// Sends `future`'s outcome to `on_done` once it resolves.
fn complete_later(
    future: impl std::future::Future<Output = Result<PyReply, RpcError>> + Send + 'static,
    on_done: Py<PyAny>,
) {
    runtime().spawn(async move { complete(on_done, future.await) });
}

/// A remote reference to a Python value (`tensorwire.rpc.RRef` wraps it): the agent's own
/// reference, counted by its owner.
#[pyclass(module = "tensorwire._native", frozen)]
pub(crate) struct PyRRef {
    pub(crate) rref: RRef<PyValue>,
}

#[pymethods]
impl PyRRef {
    /// The owner: `(name, id)`.
    fn owner(&self) -> (String, u32) {
        let o = self.rref.owner();
        (o.name, o.id)
    }

    /// Whether this worker owns the value.
    fn is_owner(&self) -> bool {
        self.rref.is_owner()
    }

    /// Whether the owner has confirmed this worker's reference.
    fn confirmed_by_owner(&self) -> bool {
        self.rref.confirmed_by_owner()
    }

    /// The reference's id on the wire (`owner:local id`), for `repr` and debugging.
    fn id(&self) -> String {
        format!("{:?}", self.rref)
    }

    /// Copies the value from its owner, pickled there now (`timeout` seconds; `None`: the
    /// default; zero: none); `on_done` gets the outcome as for [`RpcAgent::call`].
    #[pyo3(signature = (timeout, on_done))]
    fn fetch(&self, timeout: Option<f64>, on_done: Py<PyAny>) -> PyResult<()> {
        let timeout = timeout.map(|t| duration("timeout", t)).transpose()?;
        let _runtime = runtime().enter();
        let future = self
            .rref
            .rpc_async::<(), PyReply>(PY_FETCH, &(), timeout)
            .map_err(|e| rpc_error(&e))?;
        complete_later(future, on_done);
        Ok(())
    }

    /// Copies the value from its owner as [`fetch`](Self::fetch) does and waits for it
    /// without the GIL: returns the outcome `fetch` hands to `on_done` (for `to_here`, which
    /// needs no future: the waiting thread takes the reply itself).
    #[pyo3(signature = (timeout))]
    fn fetch_wait<'py>(
        &self,
        py: Python<'py>,
        timeout: Option<f64>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let timeout = timeout.map(|t| duration("timeout", t)).transpose()?;
        let future = {
            let _runtime = runtime().enter();
            self.rref
                .rpc_async::<(), PyReply>(PY_FETCH, &(), timeout)
                .map_err(|e| rpc_error(&e))?
        };
        let reply = wait_here(py, future);
        Ok(outcome(py, reply))
    }

    /// Calls `function` (a method's name) on the value, on its owner, as [`RpcAgent::call`]
    /// calls a function (`rref.rpc_async().method(...)`); the owner's Python layer gets the
    /// value as the call's target.
    #[pyo3(signature = (function, payload, tensors, rrefs, timeout, on_done))]
    fn call(
        &self,
        function: String,
        payload: &[u8],
        tensors: &Bound<'_, PyList>,
        rrefs: &Bound<'_, PyList>,
        timeout: Option<f64>,
        on_done: Py<PyAny>,
    ) -> PyResult<()> {
        let timeout = timeout.map(|t| duration("timeout", t)).transpose()?;
        let call = py_call(function, payload, tensors, rrefs)?;
        let _runtime = runtime().enter();
        let future = self
            .rref
            .rpc_async::<PyCall, PyReply>(PY_METHOD, &call, timeout)
            .map_err(|e| rpc_error(&e))?;
        drop(call);
        complete_later(future, on_done);
        Ok(())
    }

    /// Runs `function` (a method's name) on the value, on its owner, which keeps the result
    /// as a new value (`rref.remote().method(...)`): a reference to it, at once.
    #[pyo3(signature = (function, payload, tensors, rrefs, timeout))]
    fn remote(
        &self,
        function: String,
        payload: &[u8],
        tensors: &Bound<'_, PyList>,
        rrefs: &Bound<'_, PyList>,
        timeout: Option<f64>,
    ) -> PyResult<PyRRef> {
        let timeout = timeout.map(|t| duration("timeout", t)).transpose()?;
        let call = py_call(function, payload, tensors, rrefs)?;
        let _runtime = runtime().enter();
        let rref = self
            .rref
            .remote::<PyCall, PyValue>(PY_METHOD_REMOTE, &call, timeout)
            .map_err(|e| rpc_error(&e))?;
        Ok(PyRRef { rref })
    }

    /// The value, on its owner (waits without the GIL for a creation still running):
    /// `("returned", object)` or `("raised", type, message, traceback)`.
    fn local_value<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        let rref = self.rref.clone();
        let value =
            wait(py, async move { rref.local_value().await })?.map_err(|e| rpc_error(&e))?;
        value.outcome(py)
    }

    /// Waits (without the GIL) until the owner created the value; raises the creation's
    /// failure (a timeout, a lost owner), not the function's exception, which the value keeps
    /// (PyTorch's `rref._get_future().wait()`).
    fn created(&self, py: Python<'_>) -> PyResult<()> {
        let rref = self.rref.clone();
        wait(py, async move { rref.created().await })?.map_err(|e| rpc_error(&e))
    }
}

/// The device maps and devices of `init_rpc`'s options, as the agent takes them. Entries are
/// kept as given (the group's validation at init reports a map that is not one-to-one, in
/// PyTorch's words); a device string that does not parse is refused here.
fn device_options(
    options: RpcOptions,
    device_maps: Vec<(String, Vec<(String, String)>)>,
    devices: Vec<String>,
) -> Result<RpcOptions, RpcError> {
    let mut maps = DeviceMaps::new();
    for (to, entries) in device_maps {
        let mut map = DeviceMap::new();
        for (source, target) in entries {
            map.insert(source.parse::<Device>()?, target.parse::<Device>()?);
        }
        maps.insert(to, map);
    }
    let devices = devices
        .iter()
        .map(|d| d.parse::<Device>())
        .collect::<Result<Vec<_>, _>>()?;
    let mut options = options.with_devices(devices);
    options.device_maps = maps;
    Ok(options)
}

/// Checks a worker name against the naming rule (PyTorch's: `A-Z a-z 0-9 _ : -`, non-empty,
/// shorter than 128): `TensorwireError("argument", why)` if it breaks it.
#[pyfunction]
pub(crate) fn check_worker_name(name: &str) -> PyResult<()> {
    tensorwire_core::name::check_worker_name(name)
        .map_err(|e| TensorwireError::new_err(("argument", e.to_string(), Vec::<usize>::new())))
}

/// This process's RPC agent, as `tensorwire.rpc` holds it.
#[pyclass(module = "tensorwire._native", frozen)]
pub(crate) struct RpcAgent {
    agent: Agent,
    /// Distributed autograd on this agent (`tensorwire.rpc.dist_autograd`).
    autograd: Py<PyDistAutograd>,
}

#[pymethods]
impl RpcAgent {
    /// Starts this worker's agent (PyTorch's `init_rpc`): rendezvous at `init_method`, connect
    /// to every worker (`world_size = None`: a dynamic group), validate the group's device
    /// maps, and serve Python calls through `serve` (functions and methods), `create`
    /// (`remote()`) and `fetch` (`to_here()`). Blocks without the GIL until the group is up or
    /// `init_timeout` passed.
    #[staticmethod]
    #[pyo3(signature = (name, rank, world_size, init_method, rpc_timeout, init_timeout, device_maps, devices, serve, create, fetch))]
    #[allow(clippy::too_many_arguments)]
    fn start(
        py: Python<'_>,
        name: String,
        rank: usize,
        world_size: Option<usize>,
        init_method: String,
        rpc_timeout: f64,
        init_timeout: f64,
        device_maps: Vec<(String, Vec<(String, String)>)>,
        devices: Vec<String>,
        serve: Py<PyAny>,
        create: Py<PyAny>,
        fetch: Py<PyAny>,
    ) -> PyResult<RpcAgent> {
        let functions = Functions::new();
        let (serve, create, fetch) = (Arc::new(serve), Arc::new(create), Arc::new(fetch));
        let register = |result: Result<(), RpcError>| result.map_err(|e| rpc_error(&e));
        let f = Arc::clone(&serve);
        register(functions.register_with_context(
            PY_CALL,
            move |ctx: CallContext, call: PyCall| {
                let caller = ctx.caller().name.clone();
                serve_python(Arc::clone(&f), caller, call, None, reply, "serve the call")
            },
        ))?;
        let f = Arc::clone(&create);
        register(functions.register_with_context(
            PY_REMOTE,
            move |ctx: CallContext, call: PyCall| {
                let caller = ctx.caller().name.clone();
                serve_python(Arc::clone(&f), caller, call, None, kept, "create the value")
            },
        ))?;
        let f = Arc::clone(&serve);
        register(functions.register_method_with_context(
            PY_METHOD,
            move |ctx: CallContext, value: Arc<PyValue>, call: PyCall| {
                let caller = ctx.caller().name.clone();
                let f = Arc::clone(&f);
                async move {
                    if let Some(raised) = raised_target(&value) {
                        return Ok(raised);
                    }
                    serve_python(f, caller, call, Some(value), reply, "serve the call").await
                }
            },
        ))?;
        let f = Arc::clone(&create);
        register(functions.register_method_with_context(
            PY_METHOD_REMOTE,
            move |ctx: CallContext, value: Arc<PyValue>, call: PyCall| {
                let caller = ctx.caller().name.clone();
                let f = Arc::clone(&f);
                async move {
                    if let Some(PyReply::Raised {
                        exc_type,
                        message,
                        traceback,
                    }) = raised_target(&value)
                    {
                        return Ok(PyValue::Raised {
                            exc_type,
                            message,
                            traceback,
                        });
                    }
                    serve_python(f, caller, call, Some(value), kept, "create the value").await
                }
            },
        ))?;
        register(
            functions.register_method(PY_FETCH, move |value: Arc<PyValue>, (): ()| {
                let fetch = Arc::clone(&fetch);
                async move { crate::gil::on_python(move |_py| self::fetch(&fetch, &value)).await? }
            }),
        )?;
        let init_timeout = duration("init_timeout", init_timeout)?;
        let options = RpcOptions::new()
            .with_functions(functions)
            .with_rpc_timeout(duration("rpc_timeout", rpc_timeout)?)
            .with_init_method(init_method)
            .with_init_timeout(init_timeout);
        let options = device_options(options, device_maps, devices).map_err(|e| rpc_error(&e))?;
        let (agent, autograd) = wait(py, async move {
            let agent = tensorwire_rpc::init_rpc(&name, rank, world_size, options).await?;
            let autograd = autograd::start(&agent)?;
            // Distributed autograd's functions are registered once the agent runs: in a static
            // group nobody returns from init (and calls in a context) before everybody has
            // registered them.
            if world_size.is_some() {
                agent.barrier(autograd::READY_BARRIER, init_timeout).await?;
            }
            Ok::<_, RpcError>((agent, autograd))
        })?
        .map_err(|e| rpc_error(&e))?;
        let autograd = Py::new(py, PyDistAutograd::new(autograd))?;
        Ok(RpcAgent { agent, autograd })
    }

    /// Distributed autograd on this agent.
    fn dist_autograd(&self, py: Python<'_>) -> Py<PyDistAutograd> {
        self.autograd.clone_ref(py)
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

    /// Changes the default call timeout (seconds; zero: none).
    fn set_rpc_timeout(&self, seconds: f64) -> PyResult<()> {
        self.agent
            .set_rpc_timeout(duration("rpc_timeout", seconds)?);
        Ok(())
    }

    /// Calls `function` on worker `to` with `payload` (the pickled arguments), `tensors`
    /// (contiguous CPU tensors the pickle refers to by index; held, not copied, until sent) and
    /// `rrefs` (the `PyRRef`s it refers to by index, forked for `to`), within `timeout`
    /// seconds (`None`: the default; zero: none). Returns at once; `on_done(outcome)` runs
    /// later, with the GIL, on a blocking thread, where `outcome` is `("returned", payload,
    /// buffers, rrefs)`, `("raised", type, message, traceback)` or a `TensorwireError` for a
    /// call that failed (timeout, lost peer, refused by the callee's machinery). A call that
    /// cannot be sent (unknown worker) raises here.
    #[pyo3(signature = (to, function, payload, tensors, rrefs, timeout, on_done))]
    #[allow(clippy::too_many_arguments)]
    fn call(
        &self,
        to: &str,
        function: String,
        payload: &[u8],
        tensors: &Bound<'_, PyList>,
        rrefs: &Bound<'_, PyList>,
        timeout: Option<f64>,
        on_done: Py<PyAny>,
    ) -> PyResult<()> {
        let timeout = timeout.map(|t| duration("timeout", t)).transpose()?;
        let call = py_call(function, payload, tensors, rrefs)?;
        let _runtime = runtime().enter();
        let future = self
            .agent
            .rpc_async::<PyCall, PyReply>(to, PY_CALL, &call, timeout)
            .map_err(|e| rpc_error(&e))?;
        drop(call);
        complete_later(future, on_done);
        Ok(())
    }

    /// Calls `function` on worker `to` as [`call`](Self::call) does and waits for the reply
    /// without the GIL: returns the outcome `call` hands to `on_done` (for `rpc_sync`, which
    /// needs no future: the waiting thread takes the reply itself, one thread hand-over less).
    #[pyo3(signature = (to, function, payload, tensors, rrefs, timeout))]
    #[allow(clippy::too_many_arguments)]
    fn call_wait<'py>(
        &self,
        py: Python<'py>,
        to: &str,
        function: String,
        payload: &[u8],
        tensors: &Bound<'_, PyList>,
        rrefs: &Bound<'_, PyList>,
        timeout: Option<f64>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let timeout = timeout.map(|t| duration("timeout", t)).transpose()?;
        let call = py_call(function, payload, tensors, rrefs)?;
        let future = {
            let _runtime = runtime().enter();
            self.agent
                .rpc_async::<PyCall, PyReply>(to, PY_CALL, &call, timeout)
                .map_err(|e| rpc_error(&e))?
        };
        drop(call);
        let reply = wait_here(py, future);
        Ok(outcome(py, reply))
    }

    /// Runs `function` on worker `to` as [`call`](Self::call) does, and keeps its result
    /// there: returns a reference to it at once (PyTorch's `remote`). A failure of the
    /// function is kept too, and raised by `to_here` and `local_value`.
    #[pyo3(signature = (to, function, payload, tensors, rrefs, timeout))]
    fn remote(
        &self,
        to: &str,
        function: String,
        payload: &[u8],
        tensors: &Bound<'_, PyList>,
        rrefs: &Bound<'_, PyList>,
        timeout: Option<f64>,
    ) -> PyResult<PyRRef> {
        let timeout = timeout.map(|t| duration("timeout", t)).transpose()?;
        let call = py_call(function, payload, tensors, rrefs)?;
        let _runtime = runtime().enter();
        let rref = self
            .agent
            .remote::<PyCall, PyValue>(to, PY_REMOTE, &call, timeout)
            .map_err(|e| rpc_error(&e))?;
        Ok(PyRRef { rref })
    }

    /// A reference to `value`, owned by this worker (PyTorch's `RRef(value)`).
    fn local_rref(&self, value: Py<PyAny>) -> PyResult<PyRRef> {
        let _runtime = runtime().enter();
        let rref =
            RRef::new(&self.agent, PyValue::Object(Held::new(value))).map_err(|e| rpc_error(&e))?;
        Ok(PyRRef { rref })
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
        let stopped = wait(py, async move { agent.shutdown(how).await })?;
        // The jobs the last messages started finish before the interpreter may exit. The
        // bound is for a job blocked for good (a served function waiting for an event).
        if !py.detach(|| crate::gil::wait_idle(Duration::from_secs(2))) {
            tracing::warn!("tensorwire.rpc: Python jobs still running 2 s after shutdown");
        }
        stopped.map_err(|e| rpc_error(&e))
    }
}
