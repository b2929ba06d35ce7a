//! What a context holds here, for inspection (PyTorch's `DistAutogradContext` internals and
//! `dist_autograd._get_debug_info`): the workers it reached, its send and recv functions, and
//! how many backward passes have work running here. Read-only views of the core's records and
//! the tensors the driver keeps under them; nothing here changes a context.

use tensorwire_core::autograd::AutogradMessageId;
use tensorwire_core::protocol::WorkerId;

use crate::{AutogradContext, AutogradEngine, DistAutograd};

/// One send or recv function of a context: the message that carried its tensors, the worker
/// at the other end, and the tensors (sent from here, or received here as tracked leaves).
#[derive(Debug, Clone)]
pub struct FunctionRecord<T> {
    /// The autograd message id the tensors travelled under.
    pub message: AutogradMessageId,
    /// The receiver (a send function) or the sender (a recv function).
    pub peer: WorkerId,
    /// The tracked tensors the message carried.
    pub tensors: Vec<T>,
}

impl<E: AutogradEngine> AutogradContext<E> {
    /// The workers this worker sent a message to or received one from in this context (every
    /// call made in a context counts, tracked tensors or not, as PyTorch records a call's
    /// destination): those its release is sent to. Empty once the context is gone here.
    pub fn known_workers(&self) -> Vec<WorkerId> {
        self.inner
            .lock()
            .state
            .known_workers(self.id)
            .unwrap_or_default()
    }

    /// The send functions of this context here, by message id: the messages that carried
    /// tracked tensors out of this worker, with the tensors kept for them. A call that carried
    /// none has a send record (its callee holds the context) but no send function, as in
    /// PyTorch.
    pub fn send_functions(&self) -> Vec<FunctionRecord<E::Tensor>> {
        self.functions(Side::Send)
    }

    /// The recv functions of this context here, by message id: the messages that brought
    /// tracked tensors in, with those tensors (leaves of this worker's graph).
    pub fn recv_functions(&self) -> Vec<FunctionRecord<E::Tensor>> {
        self.functions(Side::Recv)
    }

    /// The core's records of one side joined with the tensors the driver keeps under them
    /// (a record without tracked tensors is no function).
    fn functions(&self, side: Side) -> Vec<FunctionRecord<E::Tensor>> {
        let sh = self.inner.lock();
        let Some(data) = sh.data.get(&self.id) else {
            return Vec::new();
        };
        let (records, kept) = match side {
            Side::Send => (sh.state.send_records(self.id), &data.sends),
            Side::Recv => (sh.state.recv_records(self.id), &data.recvs),
        };
        records
            .into_iter()
            .filter_map(|(message, peer)| {
                let tensors = kept.get(&message)?;
                (!tensors.is_empty()).then(|| FunctionRecord {
                    message,
                    peer,
                    tensors: tensors.clone(),
                })
            })
            .collect()
    }
}

/// Which functions of a context [`AutogradContext::functions`] reads.
#[derive(Clone, Copy)]
enum Side {
    Send,
    Recv,
}

impl<E: AutogradEngine> DistAutograd<E> {
    /// How many contexts have backward work running here now (a local pass, or a gradient
    /// request awaiting its answer): PyTorch's `num_current_backward_passes`.
    pub fn backward_passes(&self) -> usize {
        let sh = self.inner.lock();
        sh.state.contexts().filter(|c| sh.state.is_busy(*c)).count()
    }
}
