//! `tensorwire._native`: the native half of the `tensorwire` Python package.
//!
//! It holds tensorwire's process groups ([`tensorwire_process_group::Group`]) for the c10d
//! backend of `tensorwire.c10d` and runs their collectives on tensorwire's own tokio runtime.
//! Python decides nothing here but which collective to issue on which tensors: the group,
//! its schedules and its failure handling are the Rust crates'.
//!
//! - Tensors cross without copies: the Python layer hands contiguous CPU tensors, and this
//!   module reads and writes their storage in place through `data_ptr()` and `nbytes`. The
//!   work keeps a reference to every tensor it touches until the operation has ended, so the
//!   storage outlives every access, whether or not anybody waits.
//! - The GIL is released around every wait (setting a group up, waiting for a work).
//! - `tensorwire.rpc`'s agent (the module `rpc`): one tensorwire RPC agent per process, through which
//!   every Python call travels as one generic function; Python runs on blocking threads.
//! - Errors are this module's exception classes, which the Python layer turns into torch's
//!   own (`DistBackendError`, `DistNetworkError`, `DistStoreError`, `ValueError`).

mod gil;
mod rpc;
mod store;
mod work;

use std::sync::{Arc, OnceLock};
use std::time::Duration;

use bytes::Bytes;
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::PyList;
use tensorwire_core::collective::{ElementType, ReduceOp};
use tensorwire_core::ports::process_group::{Collectives, ProcessGroup, ProcessGroupError};
use tensorwire_process_group::{Group, TensorwireFactory};

use crate::store::PyStore;
use crate::work::{Outcome, Raw, Work};

pyo3::create_exception!(
    _native,
    TensorwireError,
    pyo3::exceptions::PyRuntimeError,
    "A tensorwire failure; `kind` says which (backend, network, store, argument, unsupported)."
);

/// The runtime every group and work of this process runs on (worker threads:
/// `TENSORWIRE_THREADS`, default 2).
pub(crate) fn runtime() -> &'static tokio::runtime::Runtime {
    static RUNTIME: OnceLock<tokio::runtime::Runtime> = OnceLock::new();
    RUNTIME.get_or_init(|| {
        let threads = std::env::var("TENSORWIRE_THREADS")
            .ok()
            .and_then(|v| v.parse::<usize>().ok())
            .filter(|n| *n > 0)
            .unwrap_or(2);
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(threads)
            .thread_name("tensorwire")
            .enable_all()
            .build()
            .expect("the tensorwire runtime starts")
    })
}

/// The kind of a failure, as the Python layer maps it to torch's exception types.
pub(crate) fn kind_of(error: &ProcessGroupError) -> &'static str {
    match error {
        ProcessGroupError::Arguments { .. }
        | ProcessGroupError::WrongDevice { .. }
        | ProcessGroupError::UnsupportedType { .. }
        | ProcessGroupError::NoRootValue { .. }
        | ProcessGroupError::BadOption { .. }
        | ProcessGroupError::BadVariable { .. } => "argument",
        ProcessGroupError::Unsupported { .. } => "unsupported",
        ProcessGroupError::Setup { .. }
        | ProcessGroupError::SetupStore { .. }
        | ProcessGroupError::SetupTransport { .. }
        | ProcessGroupError::SetupTimeout { .. }
        | ProcessGroupError::ClaimedTwice { .. } => "network",
        _ => "backend",
    }
}

/// The Python exception for `error`: `TensorwireError(kind, message, ranks)`, where `ranks` are
/// the ranks the failure names (the dead, missing or disagreeing ones).
pub(crate) fn to_py(error: &ProcessGroupError) -> PyErr {
    let ranks: Vec<usize> = match error {
        ProcessGroupError::Timeout { waiting_on, .. }
        | ProcessGroupError::SetupTimeout { waiting_on, .. }
        | ProcessGroupError::StageTimedOut { waiting_on, .. } => waiting_on.clone(),
        ProcessGroupError::PeerDied { rank, .. }
        | ProcessGroupError::PeerAborted { rank, .. }
        | ProcessGroupError::Misbehaved { rank, .. }
        | ProcessGroupError::RefusedFrame { rank, .. }
        | ProcessGroupError::PeerLeft { rank, .. } => vec![*rank],
        ProcessGroupError::Mismatch { peer, .. } | ProcessGroupError::Disagreement { peer, .. } => {
            vec![*peer]
        }
        ProcessGroupError::MonitoredBarrier { missing, .. } => missing.clone(),
        _ => Vec::new(),
    };
    TensorwireError::new_err((kind_of(error), error.to_string(), ranks))
}

fn argument(message: String) -> PyErr {
    TensorwireError::new_err(("argument", message, Vec::<usize>::new()))
}

/// The element type of a torch dtype, by its name (`str(tensor.dtype)`).
fn element(dtype: &str) -> PyResult<ElementType> {
    Ok(match dtype {
        "torch.float32" => ElementType::F32,
        "torch.float64" => ElementType::F64,
        "torch.float16" => ElementType::F16,
        "torch.bfloat16" => ElementType::BF16,
        "torch.int32" => ElementType::I32,
        "torch.int64" => ElementType::I64,
        "torch.int16" => ElementType::I16,
        "torch.int8" => ElementType::I8,
        "torch.uint8" => ElementType::U8,
        "torch.bool" => ElementType::Bool,
        other => {
            return Err(argument(format!(
                "the tensorwire backend does not reduce {other} tensors"
            )))
        }
    })
}

/// A reduction by the name of its `torch.distributed.ReduceOp` member.
fn reduce_op(op: &str) -> PyResult<ReduceOp> {
    Ok(match op {
        "SUM" => ReduceOp::Sum,
        "PRODUCT" => ReduceOp::Product,
        "MIN" => ReduceOp::Min,
        "MAX" => ReduceOp::Max,
        "AVG" => ReduceOp::Avg,
        "BAND" => ReduceOp::BAnd,
        "BOR" => ReduceOp::BOr,
        "BXOR" => ReduceOp::BXor,
        other => {
            return Err(TensorwireError::new_err((
                "unsupported",
                format!("the tensorwire backend does not support ReduceOp.{other}"),
                Vec::<usize>::new(),
            )))
        }
    })
}

/// A tensor's storage, read where Python put it, with the tensor kept alive beside it.
// `data_ptr` and `nbytes` rather than a DLPack crate: a collective needs an address and a
// length, and the work holds the tensor object itself (DLPack would add nothing for CPU).
fn raw(tensor: &Bound<'_, PyAny>, keep: &mut Vec<Py<PyAny>>) -> PyResult<Raw> {
    let ptr: usize = tensor.call_method0("data_ptr")?.extract()?;
    let len: usize = tensor.getattr("nbytes")?.extract()?;
    keep.push(tensor.clone().unbind());
    Ok(Raw { ptr, len })
}

fn raws(tensors: &Bound<'_, PyList>, keep: &mut Vec<Py<PyAny>>) -> PyResult<Vec<Raw>> {
    tensors.iter().map(|t| raw(&t, keep)).collect()
}

/// Copies `blocks` into `outputs`, which must have the same lengths: a peer whose block does
/// not fit is named.
fn copy_blocks(
    collective: &'static str,
    blocks: &[Bytes],
    outputs: &[Raw],
) -> Result<(), ProcessGroupError> {
    for (peer, (block, out)) in blocks.iter().zip(outputs).enumerate() {
        if block.len() != out.len {
            return Err(ProcessGroupError::Mismatch {
                peer,
                collective,
                seq: 0,
                reason: format!(
                    "it sent {} bytes where this rank's output holds {}",
                    block.len(),
                    out.len
                ),
            });
        }
        // SAFETY: the work holds the output tensor (see `Raw`).
        unsafe { out.bytes_mut() }.copy_from_slice(block);
    }
    Ok(())
}

/// One rank of a tensorwire process group, as the c10d backend holds it.
#[pyclass(module = "tensorwire._native", frozen)]
struct ProcessGroupHandle {
    group: Group,
}

impl ProcessGroupHandle {
    /// Issues `operation` on the group now (its place in the group's order is taken in this
    /// call), keeping `keep` alive until it ends.
    fn issue<F, Fut>(&self, what: &'static str, keep: Vec<Py<PyAny>>, operation: F) -> Work
    where
        F: FnOnce(Group) -> Fut,
        Fut: std::future::Future<Output = Result<Outcome, ProcessGroupError>> + Send + 'static,
    {
        let _runtime = runtime().enter();
        Work::start(self.group.issue(what, operation), keep)
    }
}

#[pymethods]
impl ProcessGroupHandle {
    /// Sets up this rank: meets the others through `store` (any object with c10d's `Store`
    /// methods), proves the cluster secret and connects (shared memory to ranks on this
    /// host). Blocks without the GIL until every rank is connected or `timeout` passed.
    #[staticmethod]
    #[pyo3(signature = (store, rank, world_size, timeout, options))]
    fn connect(
        py: Python<'_>,
        store: Py<PyAny>,
        rank: usize,
        world_size: usize,
        timeout: f64,
        options: Vec<(String, String)>,
    ) -> PyResult<ProcessGroupHandle> {
        if !(timeout.is_finite() && timeout > 0.0) {
            return Err(PyValueError::new_err(format!(
                "timeout must be a positive number of seconds, not {timeout}"
            )));
        }
        let timeout = Duration::from_secs_f64(timeout);
        let store = Arc::new(PyStore::new(store, timeout));
        let group = py.detach(|| {
            runtime().block_on(TensorwireFactory::connect(
                store, rank, world_size, timeout, options,
            ))
        });
        group
            .map(|group| ProcessGroupHandle { group })
            .map_err(|e| to_py(&e))
    }

    /// This rank in the group.
    #[getter]
    fn rank(&self) -> usize {
        self.group.rank()
    }

    /// The number of ranks.
    #[getter]
    fn size(&self) -> usize {
        self.group.size()
    }

    /// The group's name (its store keys are under it).
    #[getter]
    fn name(&self) -> &str {
        self.group.name()
    }

    /// All-reduces each tensor in place, one collective per tensor, in list order.
    fn all_reduce(&self, tensors: &Bound<'_, PyList>, dtype: &str, op: &str) -> PyResult<Work> {
        let (element, op) = (element(dtype)?, reduce_op(op)?);
        let mut keep = Vec::new();
        let bufs = raws(tensors, &mut keep)?;
        Ok(self.issue("allreduce", keep, move |g| async move {
            let mut pending = Vec::with_capacity(bufs.len());
            for b in &bufs {
                // SAFETY: the work holds the tensor; each buffer is a distinct tensor.
                pending.push(g.all_reduce(unsafe { b.bytes_mut() }, element, op));
            }
            work::all_in_order(pending).await?;
            Ok(Outcome::Done)
        }))
    }

    /// Reduces each tensor into `root`'s, in place.
    fn reduce(
        &self,
        tensors: &Bound<'_, PyList>,
        dtype: &str,
        op: &str,
        root: usize,
    ) -> PyResult<Work> {
        let (element, op) = (element(dtype)?, reduce_op(op)?);
        let mut keep = Vec::new();
        let bufs = raws(tensors, &mut keep)?;
        Ok(self.issue("reduce", keep, move |g| async move {
            let mut pending = Vec::with_capacity(bufs.len());
            for b in &bufs {
                // SAFETY: as in all_reduce.
                pending.push(g.reduce(unsafe { b.bytes_mut() }, element, op, root));
            }
            work::all_in_order(pending).await?;
            Ok(Outcome::Done)
        }))
    }

    /// Broadcasts each tensor from `root`, in place.
    fn broadcast(&self, tensors: &Bound<'_, PyList>, root: usize) -> PyResult<Work> {
        let mut keep = Vec::new();
        let bufs = raws(tensors, &mut keep)?;
        Ok(self.issue("broadcast", keep, move |g| async move {
            let mut pending = Vec::with_capacity(bufs.len());
            for b in &bufs {
                // SAFETY: as in all_reduce.
                pending.push(g.broadcast(unsafe { b.bytes_mut() }, root));
            }
            work::all_in_order(pending).await?;
            Ok(Outcome::Done)
        }))
    }

    /// Gathers each input from every rank into the matching list of outputs (one per rank).
    fn all_gather(
        &self,
        outputs: &Bound<'_, PyList>,
        inputs: &Bound<'_, PyList>,
    ) -> PyResult<Work> {
        let mut keep = Vec::new();
        let ins = raws(inputs, &mut keep)?;
        let outs = outputs
            .iter()
            .map(|list| raws(list.cast::<PyList>()?, &mut keep))
            .collect::<PyResult<Vec<_>>>()?;
        Ok(self.issue("allgather", keep, move |g| async move {
            let mut pending = Vec::with_capacity(ins.len());
            for b in &ins {
                // Every output is the input's size (the Python layer checks, as gloo does), so
                // no round exchanges the lengths; a rank whose block differs is named.
                // SAFETY: the work holds the input tensor.
                pending.push(g.all_gather_equal(unsafe { b.bytes() }));
            }
            let gathered = work::all_in_order(pending).await?;
            for (blocks, outs) in gathered.iter().zip(&outs) {
                copy_blocks("allgather", blocks, outs)?;
            }
            Ok(Outcome::Done)
        }))
    }

    /// Gathers `input` from every rank into `output`, rank after rank
    /// (`all_gather_into_tensor`).
    fn all_gather_into(
        &self,
        output: &Bound<'_, PyAny>,
        input: &Bound<'_, PyAny>,
    ) -> PyResult<Work> {
        let mut keep = Vec::new();
        let (out, inp) = (raw(output, &mut keep)?, raw(input, &mut keep)?);
        let world = self.group.size();
        if out.len != inp.len * world {
            return Err(argument(format!(
                "all_gather_into_tensor: the output holds {} bytes, but {world} ranks of {} \
                 bytes need {}",
                out.len,
                inp.len,
                inp.len * world
            )));
        }
        Ok(self.issue("_allgather_base", keep, move |g| async move {
            // SAFETY: the work holds both tensors.
            let blocks = g.all_gather_equal(unsafe { inp.bytes() }).await?;
            copy_blocks("_allgather_base", &blocks, &out.split(world))?;
            Ok(Outcome::Done)
        }))
    }

    /// Reduces `input` (every rank's chunk in rank order; `counts` elements each) and writes
    /// this rank's chunk of the result into `output` (`reduce_scatter_tensor`; the list form
    /// is concatenated by the Python layer).
    fn reduce_scatter(
        &self,
        output: &Bound<'_, PyAny>,
        input: &Bound<'_, PyAny>,
        counts: Vec<usize>,
        dtype: &str,
        op: &str,
    ) -> PyResult<Work> {
        let (element, op) = (element(dtype)?, reduce_op(op)?);
        let mut keep = Vec::new();
        let (out, inp) = (raw(output, &mut keep)?, raw(input, &mut keep)?);
        Ok(self.issue("reduce_scatter", keep, move |g| async move {
            // SAFETY: the work holds both tensors.
            let chunk = g
                .reduce_scatter(unsafe { inp.bytes() }, &counts, element, op)
                .await?;
            copy_blocks("reduce_scatter", &[chunk.into()], &[out])?;
            Ok(Outcome::Done)
        }))
    }

    /// Sends `inputs[i]` to rank i and receives rank i's block into `outputs[i]`.
    fn all_to_all(
        &self,
        outputs: &Bound<'_, PyList>,
        inputs: &Bound<'_, PyList>,
    ) -> PyResult<Work> {
        let mut keep = Vec::new();
        let outs = raws(outputs, &mut keep)?;
        // The list form is built on the block form, which takes owned blocks: one copy in.
        let ins: Vec<Bytes> = raws(inputs, &mut keep)?
            .iter()
            // SAFETY: the tensors are alive (held in `keep`) during this call.
            .map(|b| Bytes::copy_from_slice(unsafe { b.bytes() }))
            .collect();
        let lens: Vec<usize> = outs.iter().map(|o| o.len).collect();
        Ok(self.issue("alltoall", keep, move |g| async move {
            let blocks = g.all_to_all(&ins, &lens).await?;
            copy_blocks("alltoall", &blocks, &outs)?;
            Ok(Outcome::Done)
        }))
    }

    /// `all_to_all_single`: `input` split by `input_splits` bytes, `output` by
    /// `output_splits` bytes.
    fn all_to_all_single(
        &self,
        output: &Bound<'_, PyAny>,
        input: &Bound<'_, PyAny>,
        output_splits: Vec<usize>,
        input_splits: Vec<usize>,
    ) -> PyResult<Work> {
        let mut keep = Vec::new();
        let (out, inp) = (raw(output, &mut keep)?, raw(input, &mut keep)?);
        let expected: usize = output_splits.iter().sum();
        if expected != out.len {
            return Err(argument(format!(
                "all_to_all_single: the output splits add up to {expected} bytes, but the \
                 output holds {}",
                out.len
            )));
        }
        Ok(self.issue("alltoall_base", keep, move |g| async move {
            // SAFETY: the work holds both tensors.
            let received = g
                .all_to_all_single(unsafe { inp.bytes() }, &input_splits, &output_splits)
                .await?;
            copy_blocks("alltoall_base", &[received.into()], &[out])?;
            Ok(Outcome::Done)
        }))
    }

    /// Gathers `input` from every rank into `outputs` on `root` (empty elsewhere).
    fn gather(
        &self,
        outputs: &Bound<'_, PyList>,
        input: &Bound<'_, PyAny>,
        root: usize,
    ) -> PyResult<Work> {
        let mut keep = Vec::new();
        let outs = raws(outputs, &mut keep)?;
        let inp = raw(input, &mut keep)?;
        Ok(self.issue("gather", keep, move |g| async move {
            // SAFETY: the work holds the tensors.
            if let Some(blocks) = g.gather(unsafe { inp.bytes() }, root).await? {
                copy_blocks("gather", &blocks, &outs)?;
            }
            Ok(Outcome::Done)
        }))
    }

    /// Scatters `inputs` (on `root`; empty elsewhere) so that rank i receives `inputs[i]`
    /// into `output`.
    fn scatter(
        &self,
        output: &Bound<'_, PyAny>,
        inputs: &Bound<'_, PyList>,
        root: usize,
    ) -> PyResult<Work> {
        let mut keep = Vec::new();
        let out = raw(output, &mut keep)?;
        let blocks: Vec<Bytes> = raws(inputs, &mut keep)?
            .iter()
            // SAFETY: the tensors are alive (held in `keep`) during this call.
            .map(|b| Bytes::copy_from_slice(unsafe { b.bytes() }))
            .collect();
        Ok(self.issue("scatter", keep, move |g| async move {
            let block = g.scatter(&blocks, root).await?;
            copy_blocks("scatter", &[block], &[out])?;
            Ok(Outcome::Done)
        }))
    }

    /// Returns once every rank has entered.
    fn barrier(&self) -> Work {
        self.issue("barrier", Vec::new(), |g| async move {
            g.barrier().await?;
            Ok(Outcome::Done)
        })
    }

    /// PyTorch's `monitored_barrier`: rank 0 names the ranks that did not arrive in time.
    #[pyo3(signature = (timeout, wait_all_ranks))]
    fn monitored_barrier(&self, timeout: Option<f64>, wait_all_ranks: bool) -> Work {
        let timeout = timeout.map(Duration::from_secs_f64);
        self.issue("monitored_barrier", Vec::new(), move |g| async move {
            g.monitored_barrier(timeout, wait_all_ranks).await?;
            Ok(Outcome::Done)
        })
    }

    /// Sends each tensor to `dst` under `tag`.
    fn send(&self, tensors: &Bound<'_, PyList>, dst: usize, tag: u32) -> PyResult<Work> {
        let mut keep = Vec::new();
        let bufs = raws(tensors, &mut keep)?;
        Ok(self.issue("send", keep, move |g| async move {
            let mut pending = Vec::with_capacity(bufs.len());
            for b in &bufs {
                // SAFETY: the work holds the tensor.
                pending.push(g.send(unsafe { b.bytes() }, dst, tag));
            }
            work::all_in_order(pending).await?;
            Ok(Outcome::Done)
        }))
    }

    /// Receives into each tensor from `src` under `tag`, or from any rank when `src` is
    /// `None` (the work then knows the sender).
    #[pyo3(signature = (tensors, src, tag))]
    fn recv(&self, tensors: &Bound<'_, PyList>, src: Option<usize>, tag: u32) -> PyResult<Work> {
        let mut keep = Vec::new();
        let bufs = raws(tensors, &mut keep)?;
        if bufs.len() != 1 {
            return Err(argument(format!(
                "recv takes exactly one tensor, not {}",
                bufs.len()
            )));
        }
        let out = bufs[0];
        Ok(self.issue("recv", keep, move |g| async move {
            let (from, block) = match src {
                Some(src) => (src, g.recv(src, tag).await?),
                None => g.recv_any(tag).await?,
            };
            if block.len() != out.len {
                return Err(ProcessGroupError::Mismatch {
                    peer: from,
                    collective: "recv",
                    seq: 0,
                    reason: format!(
                        "it sent {} bytes to a tensor of {} bytes",
                        block.len(),
                        out.len
                    ),
                });
            }
            // SAFETY: the work holds the tensor.
            unsafe { out.bytes_mut() }.copy_from_slice(&block);
            Ok(Outcome::From(from))
        }))
    }

    /// Says goodbye to the peers and closes the connections (this group and the subgroups
    /// over them). Blocks without the GIL for at most a few seconds.
    fn shutdown(&self, py: Python<'_>) {
        let group = self.group.clone();
        py.detach(|| runtime().block_on(async move { group.shutdown().await }));
    }
}

/// The native module.
/// Sends the Rust side's log to stderr, filtered by `TENSORWIRE_LOG` (the `tracing` filter
/// syntax, e.g. `debug` or `tensorwire_rpc=debug`; default `warn`, so that a dropped peer or a
/// refused message is said). A subscriber installed already (an embedding program's) is kept.
fn init_logging() {
    let filter = tracing_subscriber::EnvFilter::try_from_env("TENSORWIRE_LOG")
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn"));
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .try_init();
}

#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<ProcessGroupHandle>()?;
    m.add_class::<Work>()?;
    m.add_class::<rpc::RpcAgent>()?;
    m.add_class::<rpc::WireBuffer>()?;
    m.add_class::<rpc::PyRRef>()?;
    m.add_class::<rpc::autograd::PyDistAutograd>()?;
    m.add_class::<rpc::Settler>()?;
    m.add_function(wrap_pyfunction!(rpc::check_worker_name, m)?)?;
    m.add_function(wrap_pyfunction!(gil::job_counts, m)?)?;
    m.add_function(wrap_pyfunction!(gil::waiter_runs, m)?)?;
    m.add("TensorwireError", m.py().get_type::<TensorwireError>())?;
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    init_logging();
    // From the interpreter's exit on, nothing more is handed to the runners (see
    // `gil::interpreter_exiting`).
    let atexit = m.py().import("atexit")?;
    atexit.call_method1("register", (wrap_pyfunction!(gil::mark_exiting, m)?,))?;
    Ok(())
}
