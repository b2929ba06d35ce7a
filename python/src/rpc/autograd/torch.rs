//! torch's autograd behind core's engine port: the engine adapter ([`TorchEngine`]) and the
//! tensors it holds ([`TorchTensor`]), each made a torch tensor by a thread that holds the GIL.

use std::hash::{Hash, Hasher};
use std::sync::Arc;

use bytes::Bytes;
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyList, PyTuple};
use tensorwire_core::ports::autograd::{AutogradEngine, EngineError, LeafGradients};
use tensorwire_core::tensor::{DType, Storage, Tensor};

use crate::rpc::{lent_bytes, WireBuffer};

/// The Python module that holds the engine's operations and serves calls made in a context.
const ENGINE_MODULE: &str = "tensorwire.rpc._autograd_engine";

/// A torch tensor, as the engine holds it (cloning shares the Python object).
///
/// A tensor about to be sent carries its wire form and `requires_grad`, taken while the GIL was
/// held anyway (by the thread that handed it over: the caller, or the job that served the call
/// or ran the backward pass). The driver asks for both on a runtime worker; answering from here
/// spares that worker a wait for the GIL, which the Python thread that just produced the tensor
/// usually still holds. A tensor sent, and a gradient received, carry their shape and dtype
/// too: the driver compares a gradient's with its tensor's (under its lock) for every gradient
/// a peer sends.
///
/// A dense tensor received (a message's tracked tensor, a peer's gradient) is *not* made a
/// torch tensor by the runtime worker that read it: that would take the GIL there (a wait
/// behind the Python thread that holds it, then a hand-off to the GIL runner anyway). It is
/// made by the first thread that needs it with the GIL held (the runner that serves the call
/// or runs the pass, the caller's thread that decodes the reply): see [`Object`].
#[derive(Clone)]
pub(crate) struct TorchTensor(Arc<Object>, Option<Arc<(Tensor, bool)>>, Option<Arc<Meta>>);

/// The Python object of a [`TorchTensor`], or what makes it once a thread holding the GIL asks
/// for it, and the key the tensor is known by as a leaf ([`Leaf`]).
pub(crate) struct Object {
    object: PyOnceLock<Py<PyAny>>,
    /// A received dense tensor not made yet: its bytes and `requires_grad`.
    pending: Option<Pending>,
    /// A held tensor's key is its Python object's address (even: CPython's objects are
    /// aligned); a received one's an odd number of its own, never reused, that its Python
    /// object carries as `_tensorwire_key` once made (if it required grad on its sender: only
    /// those are leaves the driver looks up), so that the tensor torch's engine hands back is
    /// known as the one received ([`TorchTensor::keyed`]).
    key: usize,
}

/// A received dense tensor's wire form, made a torch tensor on demand.
struct Pending {
    dtype: &'static str,
    shape: Vec<usize>,
    bytes: Bytes,
    requires_grad: bool,
}

/// The next key of a received tensor (odd: see [`Object::key`]).
fn next_key() -> usize {
    static NEXT: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(1);
    NEXT.fetch_add(2, std::sync::atomic::Ordering::Relaxed) | 1
}

impl TorchTensor {
    /// The Python object, made now if the tensor was received and not made yet.
    pub(super) fn bind<'py>(&self, py: Python<'py>) -> PyResult<&Bound<'py, PyAny>> {
        let object = self.0.object.get_or_try_init(py, || {
            let pending = self.0.pending.as_ref().ok_or_else(|| {
                pyo3::exceptions::PyRuntimeError::new_err("a tensor without its Python object")
            })?;
            let buffer = Py::new(py, WireBuffer::new(pending.bytes.clone()))?;
            let t = engine_fn(py, "import_tensor")?.call1((
                pending.dtype,
                PyTuple::new(py, &pending.shape)?,
                buffer,
                pending.requires_grad,
            ))?;
            if pending.requires_grad {
                t.setattr("_tensorwire_key", self.0.key)?;
            }
            Ok::<_, PyErr>(t.unbind())
        })?;
        Ok(object.bind(py))
    }

    /// The Python object, a new reference.
    pub(super) fn object(&self, py: Python<'_>) -> PyResult<Py<PyAny>> {
        self.bind(py).map(|t| t.clone().unbind())
    }

    fn with_object(t: Bound<'_, PyAny>, key: usize) -> Arc<Object> {
        let object = PyOnceLock::new();
        let _ = object.set(t.py(), t.unbind());
        Arc::new(Object {
            object,
            pending: None,
            key,
        })
    }

    /// The tensor `t`, held as it is.
    pub(super) fn held(t: Bound<'_, PyAny>) -> TorchTensor {
        let key = t.as_ptr() as usize;
        TorchTensor(Self::with_object(t, key), None, None)
    }

    /// The tensor `t`, held as it is, known by the key it was received with if it was
    /// received (a leaf torch's engine hands back, a root).
    pub(super) fn keyed(t: Bound<'_, PyAny>) -> TorchTensor {
        let key = t
            .getattr_opt("_tensorwire_key")
            .ok()
            .flatten()
            .and_then(|k| k.extract::<usize>().ok())
            .filter(|k| k % 2 == 1)
            .unwrap_or(t.as_ptr() as usize);
        TorchTensor(Self::with_object(t, key), None, None)
    }

    /// The tensor `t`, held with its shape and dtype taken now.
    fn shaped(t: Bound<'_, PyAny>) -> TorchTensor {
        let meta = meta_of(&t);
        let key = t.as_ptr() as usize;
        TorchTensor(Self::with_object(t, key), None, meta)
    }

    /// A received dense tensor, made a torch tensor once a thread with the GIL needs it.
    fn pending(
        dtype: DType,
        name: &'static str,
        shape: Vec<usize>,
        bytes: Bytes,
        requires_grad: bool,
    ) -> TorchTensor {
        let meta = Arc::new(Meta {
            shape: shape.clone(),
            dtype: Some(dtype),
        });
        let object = Arc::new(Object {
            object: PyOnceLock::new(),
            pending: Some(Pending {
                dtype: name,
                shape,
                bytes,
                requires_grad,
            }),
            key: next_key(),
        });
        TorchTensor(object, None, Some(meta))
    }

    /// The tensor `t`, about to be sent: its wire form (and shape) taken now. A tensor the wire
    /// cannot carry is held as it is, so that the driver's own export reports why.
    ///
    /// One call of the Python layer gives all of it (`export_tensor`: the wire form and
    /// `requires_grad`); a dense tensor's shape and dtype are its wire form's, and only a
    /// sparse one (packed as `uint8` bytes) has its logical ones asked for.
    pub(super) fn to_send(t: Bound<'_, PyAny>) -> TorchTensor {
        let exported = export_now(&t).ok().and_then(Result::ok);
        let meta = match &exported {
            Some(e) if e.wire.dtype() != DType::U8 => Some(Arc::new(Meta {
                shape: e.wire.shape().to_vec(),
                dtype: Some(e.wire.dtype()),
            })),
            _ => meta_of(&t),
        };
        let prepared = exported.map(|e| Arc::new((e.wire, e.requires_grad)));
        let key = t.as_ptr() as usize;
        TorchTensor(Self::with_object(t, key), prepared, meta)
    }
}

/// A tensor's logical shape and dtype (a sparse one's: its size and its values' dtype; `None`
/// for a dtype tensorwire's tensors cannot carry).
pub(crate) struct Meta {
    shape: Vec<usize>,
    dtype: Option<DType>,
}

/// `t.shape` and `t.dtype` (the logical ones: a sparse tensor's too).
fn meta_of(t: &Bound<'_, PyAny>) -> Option<Arc<Meta>> {
    let shape = t
        .getattr("shape")
        .and_then(|s| s.extract::<Vec<usize>>())
        .ok()?;
    Some(Arc::new(Meta {
        shape,
        dtype: dtype_attr(t),
    }))
}

/// `t.dtype`, for the dtypes tensorwire's tensors carry.
fn dtype_attr(t: &Bound<'_, PyAny>) -> Option<DType> {
    let name = t.getattr("dtype").ok()?.str().ok()?;
    dtype_of(name.to_str().ok()?.strip_prefix("torch.")?)
}

/// A tensor's wire form, and whether the tensor requires grad (`export_tensor`'s answer).
struct Exported {
    wire: Tensor,
    requires_grad: bool,
}

/// `t`'s wire form: its bytes lent without a copy (the outer error is Python's, the inner one
/// says what the wire cannot carry).
fn export_now(t: &Bound<'_, PyAny>) -> PyResult<Result<Exported, EngineError>> {
    let py = t.py();
    let out = engine_fn(py, "export_tensor")?.call1((t,))?;
    let out = out.cast::<PyTuple>()?;
    let name: String = out.get_item(0)?.extract()?;
    let shape: Vec<usize> = out.get_item(1)?.extract()?;
    let Some(dtype) = dtype_of(&name) else {
        return Ok(Err(EngineError(format!(
            "a tensor of torch.{name} requires grad: distributed autograd carries float16, \
             bfloat16, float32 and float64 tensors, dense or sparse COO"
        ))));
    };
    let bytes: Bytes = lent_bytes(out.get_item(2)?)?;
    let requires_grad: bool = out.get_item(3)?.extract()?;
    Ok(Tensor::new(dtype, shape, Storage::Host(bytes))
        .map(|wire| Exported {
            wire,
            requires_grad,
        })
        .map_err(|e| EngineError(e.to_string())))
}

/// A leaf of the context (a parameter, or a received tensor: an output of its recv function
/// in torch's graph), by the identity of its Python object; it keeps the object alive, so the
/// identity is not reused while it is held.
#[derive(Clone)]
pub(crate) struct Leaf {
    address: usize,
    pub(super) tensor: TorchTensor,
}

impl PartialEq for Leaf {
    fn eq(&self, other: &Self) -> bool {
        self.address == other.address
    }
}

impl Eq for Leaf {}

impl Hash for Leaf {
    fn hash<H: Hasher>(&self, state: &mut H) {
        self.address.hash(state);
    }
}

impl std::fmt::Debug for Leaf {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Leaf({:#x})", self.address)
    }
}

/// torch's autograd, behind core's engine port (see the module's docs).
#[derive(Clone, Default)]
pub(crate) struct TorchEngine {
    _private: (),
}

/// A function of the engine's Python module.
pub(super) fn engine_fn<'py>(py: Python<'py>, name: &str) -> PyResult<Bound<'py, PyAny>> {
    static MODULE: PyOnceLock<Py<PyModule>> = PyOnceLock::new();
    let module = MODULE.get_or_try_init(py, || py.import(ENGINE_MODULE).map(Bound::unbind))?;
    module.bind(py).getattr(name)
}

/// torch's engine raised `e`: its message first (PyTorch's "Error on Node N: <message>"
/// puts it there), then the traceback and the exception's type, as Python prints them.
fn engine_error(py: Python<'_>, e: PyErr) -> EngineError {
    let traceback = e
        .traceback(py)
        .and_then(|t| t.format().ok())
        .unwrap_or_default();
    let message = e.value(py).str().map(|s| s.to_string()).unwrap_or_default();
    EngineError(format!("{message}\n{traceback}{e}"))
}

/// The name torch gives `dtype` (`torch.float32` is `"float32"`), for the dtypes a tracked
/// tensor may have on the wire: those that can require grad and that tensorwire carries, and
/// `uint8`, the engine's packed form of a sparse COO tensor (no dense tensor of an integer type
/// requires grad, so the form is unambiguous; the Python layer packs it, and unpacks it with
/// torch's invariant checks: `_autograd_engine.pack_sparse`).
fn dtype_name(dtype: DType) -> Option<&'static str> {
    Some(match dtype {
        DType::U8 => "uint8",
        DType::F16 => "float16",
        DType::BF16 => "bfloat16",
        DType::F32 => "float32",
        DType::F64 => "float64",
        _ => return None,
    })
}

fn dtype_of(name: &str) -> Option<DType> {
    Some(match name {
        "uint8" => DType::U8,
        "float16" => DType::F16,
        "bfloat16" => DType::BF16,
        "float32" => DType::F32,
        "float64" => DType::F64,
        _ => return None,
    })
}

impl AutogradEngine for TorchEngine {
    type Tensor = TorchTensor;
    type LeafId = Leaf;

    fn leaf_id(&self, tensor: &TorchTensor) -> Leaf {
        Leaf {
            address: tensor.0.key,
            tensor: tensor.clone(),
        }
    }

    fn requires_grad(&self, tensor: &TorchTensor) -> bool {
        if let Some(prepared) = &tensor.1 {
            return prepared.1;
        }
        Python::attach(|py| {
            tensor
                .bind(py)
                .and_then(|t| t.getattr("requires_grad"))
                .and_then(|r| r.extract::<bool>())
                .unwrap_or(false)
        })
    }

    fn has_grad_fn(&self, tensor: &TorchTensor) -> bool {
        Python::attach(|py| {
            tensor
                .bind(py)
                .and_then(|t| t.getattr("grad_fn"))
                .is_ok_and(|f| !f.is_none())
        })
    }

    fn shape(&self, tensor: &TorchTensor) -> Vec<usize> {
        if let Some(meta) = &tensor.2 {
            return meta.shape.clone();
        }
        Python::attach(|py| {
            tensor
                .bind(py)
                .ok()
                .and_then(meta_of)
                .map_or_else(Vec::new, |m| m.shape.clone())
        })
    }

    fn dtype(&self, tensor: &TorchTensor) -> Option<DType> {
        if let Some(meta) = &tensor.2 {
            return meta.dtype;
        }
        Python::attach(|py| tensor.bind(py).ok().and_then(dtype_attr))
    }

    fn import(&self, tensor: &Tensor, requires_grad: bool) -> Result<TorchTensor, EngineError> {
        let Storage::Host(bytes) = tensor.storage() else {
            return Err(EngineError(format!(
                "torch's engine gets host tensors; one on {} must be copied to the host first",
                tensor.device()
            )));
        };
        let dtype = dtype_name(tensor.dtype()).ok_or_else(|| {
            EngineError(format!(
                "a tracked tensor of {:?}: distributed autograd carries float16, bfloat16, \
                 float32 and float64 tensors, dense or sparse COO",
                tensor.dtype()
            ))
        })?;
        let bytes = bytes.clone();
        let shape = tensor.shape().to_vec();
        if tensor.dtype() != DType::U8 {
            // Dense: made a torch tensor by the thread that needs it with the GIL (see
            // [`TorchTensor`]); its bytes are its shape's (core's `Tensor` checked them).
            return Ok(TorchTensor::pending(
                tensor.dtype(),
                dtype,
                shape,
                bytes,
                requires_grad,
            ));
        }
        // A packed sparse COO tensor: unpacked now, with torch's invariant checks, so that a
        // malformed one is refused with its message.
        Python::attach(|py| {
            let run = || -> PyResult<TorchTensor> {
                let buffer = Py::new(py, WireBuffer::new(bytes))?;
                let t = engine_fn(py, "import_tensor")?.call1((
                    dtype,
                    PyTuple::new(py, &shape)?,
                    buffer,
                    requires_grad,
                ))?;
                Ok(TorchTensor::shaped(t))
            };
            run().map_err(|e| engine_error(py, e))
        })
    }

    fn export(&self, tensor: &TorchTensor) -> Result<Tensor, EngineError> {
        if let Some(prepared) = &tensor.1 {
            return Ok(prepared.0.clone());
        }
        Python::attach(|py| {
            let t = tensor.bind(py).map_err(|e| engine_error(py, e))?;
            Ok(export_now(t).map_err(|e| engine_error(py, e))??.wire)
        })
    }

    fn backward(
        &self,
        roots: &[(TorchTensor, Option<TorchTensor>)],
    ) -> Result<LeafGradients<Self>, EngineError> {
        Python::attach(|py| {
            let run = || -> PyResult<LeafGradients<Self>> {
                let tensors = roots
                    .iter()
                    .map(|(t, _)| t.bind(py).cloned())
                    .collect::<PyResult<Vec<_>>>()?;
                let tensors = PyList::new(py, tensors)?;
                let seeds = roots
                    .iter()
                    .map(|(_, s)| match s {
                        Some(s) => s.bind(py).cloned(),
                        None => Ok(py.None().into_bound(py)),
                    })
                    .collect::<PyResult<Vec<_>>>()?;
                let seeds = PyList::new(py, seeds)?;
                let out = engine_fn(py, "backward")?.call1((tensors, seeds))?;
                let mut grads = Vec::new();
                for pair in out.cast::<PyList>()?.iter() {
                    let pair = pair.cast::<PyTuple>()?;
                    // A received tensor's gradient goes back to its sender; the others stay here.
                    let (leaf, grad) = if pair.get_item(2)?.extract::<bool>()? {
                        (
                            TorchTensor::keyed(pair.get_item(0)?),
                            TorchTensor::to_send(pair.get_item(1)?),
                        )
                    } else {
                        (
                            TorchTensor::held(pair.get_item(0)?),
                            TorchTensor::held(pair.get_item(1)?),
                        )
                    };
                    grads.push((self.leaf_id(&leaf), grad));
                }
                Ok(grads)
            };
            run().map_err(|e| engine_error(py, e))
        })
    }

    fn assign(&self, leaf: &TorchTensor, values: &Tensor) -> Result<(), EngineError> {
        let values = self.import(values, false)?;
        Python::attach(|py| {
            engine_fn(py, "assign")
                .and_then(|f| f.call1((leaf.bind(py)?, values.bind(py)?)))
                .map(drop)
                .map_err(|e| engine_error(py, e))
        })
    }

    fn accumulate(
        &self,
        sum: &TorchTensor,
        grad: &TorchTensor,
    ) -> Result<TorchTensor, EngineError> {
        // torch's AccumulateGrad rules (a sparse sum and a dense gradient make a dense one,
        // which `sum.add(grad)` refuses) are the Python layer's `accumulate`.
        Python::attach(|py| {
            engine_fn(py, "accumulate")
                .and_then(|f| f.call1((sum.bind(py)?, grad.bind(py)?)))
                .map(|t| TorchTensor::held(t))
                .map_err(|e| engine_error(py, e))
        })
    }
}
