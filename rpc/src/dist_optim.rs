//! The distributed optimizer: parameters held in [`RRef`]s on their owners, each owner running
//! a local optimizer on the gradients a context left there (PyTorch's
//! `torch.distributed.optim.DistributedOptimizer`, without TorchScript).
//!
//! A parameter server makes its parameters with [`Parameter::new`] and hands out
//! [`RRef`]s to them ([`Agent::local_rref`](crate::Agent::local_rref)); a trainer builds a
//! [`DistributedOptimizer`] over those references and calls
//! [`step`](DistributedOptimizer::step) with each context after its backward pass.

use std::sync::Mutex;
use std::time::Duration;

use serde::{Serialize, Serializer};
use tensorwire_core::autograd::optim::{Optimizer, OptimizerState};
use tensorwire_core::autograd::ContextId;
use tensorwire_core::ports::autograd::AutogradEngine;
use tensorwire_core::protocol::WorkerId;
use tensorwire_core::tensor::Tensor;

use crate::autograd::{DistAutograd, DistAutogradError};
use crate::rref::RRef;

pub(crate) const STEP: &str = "__tw_autograd/optim_step";

/// A parameter: a leaf tensor of the engine, kept on its owner (in an [`RRef`]) with its
/// optimizer state.
///
/// It lives on its owner: use it there (autograd methods registered with
/// [`DistAutograd::register_method`] get it as `Arc<Parameter<E>>`). It is `Serialize` only
/// because values kept in references and results of functions must be; what travels is a
/// **copy of its current values**, as a plain [`Tensor`] (read it as one: a function returning
/// a `Parameter` called with `rpc_sync::<_, Tensor>`). The copy is detached: no gradient
/// flows back through it, it carries no optimizer state, and later steps on the owner do not
/// reach it. `RRef<Parameter<E>>::to_here` does not compile (a parameter cannot be rebuilt
/// without its engine); call a method on the owner that returns its values instead.
pub struct Parameter<E: AutogradEngine> {
    tensor: E::Tensor,
    engine: E,
    state: Mutex<OptimizerState>,
}

impl<E: AutogradEngine + Clone> Parameter<E> {
    /// `tensor` (a leaf that requires gradients) as a parameter.
    pub fn new(engine: &E, tensor: E::Tensor) -> Self {
        Self {
            tensor,
            engine: engine.clone(),
            state: Mutex::new(OptimizerState::default()),
        }
    }
}

impl<E: AutogradEngine> Parameter<E> {
    /// The tensor (use it in the forward pass on the owner).
    pub fn tensor(&self) -> &E::Tensor {
        &self.tensor
    }

    /// Optimizer steps taken on it.
    pub fn steps(&self) -> u64 {
        self.state.lock().unwrap_or_else(|e| e.into_inner()).steps()
    }
}

/// A parameter travels as a detached [`Tensor`] copy of its current values (see
/// [`Parameter`]).
impl<E: AutogradEngine> Serialize for Parameter<E> {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        self.engine
            .export(&self.tensor)
            .map_err(serde::ser::Error::custom)?
            .serialize(s)
    }
}

/// Runs one owner's share of a step: every parameter in `params` that has a gradient in
/// `context` here is updated by `optimizer`. Returns how many were.
pub(crate) async fn owner_step<E: AutogradEngine>(
    dist: &DistAutograd<E>,
    context: ContextId,
    optimizer: Optimizer,
    params: Vec<RRef<Parameter<E>>>,
) -> Result<usize, String> {
    // Steps from several trainers on one owner run one at a time (as PyTorch's local
    // optimizer lock does).
    let _serial = dist.optimizer_lock().await;
    let grads = dist
        .gradients(context)
        .ok_or_else(|| format!("{context} does not exist on this owner"))?;
    let engine = dist.engine();
    let mut updated = 0;
    for rref in params {
        let p = rref.local_value().await.map_err(|e| e.to_string())?;
        let Some(g) = grads.get(&engine.leaf_id(&p.tensor)) else {
            continue;
        };
        let g = engine.export(g).map_err(|e| e.to_string())?;
        let current = engine.export(&p.tensor).map_err(|e| e.to_string())?;
        let (Some(gv), Some(mut pv)) = (g.to_f32_vec(), current.to_f32_vec()) else {
            return Err("the distributed optimizer updates f32 parameters".into());
        };
        {
            let mut state = p.state.lock().unwrap_or_else(|e| e.into_inner());
            optimizer
                .step(&mut state, &mut pv, &gv)
                .map_err(|e| e.to_string())?;
        }
        let new = Tensor::from_f32(current.shape().to_vec(), &pv).map_err(|e| e.to_string())?;
        engine.assign(&p.tensor, &new).map_err(|e| e.to_string())?;
        updated += 1;
    }
    Ok(updated)
}

/// Applies a context's gradients to parameters on their owners.
pub struct DistributedOptimizer<E: AutogradEngine> {
    dist: DistAutograd<E>,
    optimizer: Optimizer,
    /// Parameters grouped by owner.
    by_owner: Vec<(WorkerId, Vec<RRef<Parameter<E>>>)>,
    timeout: Option<Duration>,
}

impl<E: AutogradEngine> DistributedOptimizer<E> {
    /// An optimizer over `params` (references to [`Parameter`]s on any workers), running
    /// `optimizer` on each owner.
    pub fn new(
        dist: &DistAutograd<E>,
        params: Vec<RRef<Parameter<E>>>,
        optimizer: Optimizer,
    ) -> Self {
        let mut by_owner: Vec<(WorkerId, Vec<RRef<Parameter<E>>>)> = Vec::new();
        for p in params {
            let owner = p.owner().id;
            match by_owner.iter_mut().find(|(o, _)| *o == owner) {
                Some((_, v)) => v.push(p),
                None => by_owner.push((owner, vec![p])),
            }
        }
        Self {
            dist: dist.clone(),
            optimizer,
            by_owner,
            timeout: None,
        }
    }

    /// Sets the timeout of each owner's step (default: the agent's RPC timeout).
    pub fn set_timeout(&mut self, timeout: Duration) {
        self.timeout = Some(timeout);
    }

    /// Runs each owner's optimizer on the gradients `context` left there, owners in parallel;
    /// returns how many parameters were updated. Parameters without a gradient are left alone.
    pub async fn step(&self, context: ContextId) -> Result<usize, DistAutogradError> {
        let agent = self.dist.agent();
        let mut pending = Vec::with_capacity(self.by_owner.len());
        for (owner, params) in &self.by_owner {
            // Sent now: the owners work at once, while we wait on the first.
            pending.push(agent.rpc_async::<_, usize>(
                *owner,
                STEP,
                &(context, self.optimizer, params),
                self.timeout,
            )?);
        }
        let mut updated = 0;
        for p in pending {
            updated += p.await?;
        }
        Ok(updated)
    }
}

impl<E: AutogradEngine> std::fmt::Debug for DistributedOptimizer<E> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DistributedOptimizer")
            .field("optimizer", &self.optimizer)
            .field("owners", &self.by_owner.len())
            .finish_non_exhaustive()
    }
}
