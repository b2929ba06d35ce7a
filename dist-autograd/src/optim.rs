//! The distributed optimizer: parameters held in [`RRef`]s on their owners, each owner running
//! a local optimizer on the gradients a context left there (PyTorch's
//! `torch.distributed.optim.DistributedOptimizer`, without TorchScript).
//!
//! A parameter server makes its parameters with [`Parameter::new`] and hands out
//! [`RRef`]s to them ([`Agent::local_rref`](crate::Agent::local_rref)); a trainer builds a
//! [`DistributedOptimizer`] over those references and calls
//! [`step`](DistributedOptimizer::step) with each context after its backward pass.
//!
//! The local optimizers are `torch.optim`'s ([`Optimizer`]: SGD, Adam, AdamW, RMSprop,
//! Adagrad, with their options and PyTorch's update rules), on `f32` and `f64` parameters. A
//! user brings their own by implementing [`LocalOptimizer`] and registering it on every owner
//! ([`DistAutograd::register_optimizer`]).
//!
//! Where this differs from PyTorch on purpose: an optimizer's state (momentum buffers,
//! moments) lives with the parameter on its owner, one state per parameter and kind of
//! optimizer ([`LocalOptimizer::NAME`]), rather than one per `DistributedOptimizer` instance;
//! two trainers stepping one parameter with SGD share its momentum buffer, and steps on one
//! owner run one at a time, as in PyTorch.

use std::any::Any;
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::Duration;

use serde::de::DeserializeOwned;
use serde::{Serialize, Serializer};
use tensorwire_core::autograd::optim::{Float, OptimError, Optimizer, OptimizerState};
use tensorwire_core::autograd::ContextId;
use tensorwire_core::ports::autograd::AutogradEngine;
use tensorwire_core::protocol::WorkerId;
use tensorwire_core::tensor::{DType, Tensor};

use crate::{DistAutograd, DistAutogradError};
use tensorwire_rpc::RRef;

pub(crate) const STEP: &str = "__tw_autograd/optim_step/";

/// A local optimizer that a [`DistributedOptimizer`] runs on each parameter's owner.
///
/// [`Optimizer`] (`torch.optim`'s) implements it; implement it to bring your own, and register
/// it on every worker that owns parameters with [`DistAutograd::register_optimizer`] (the
/// built-in one is registered by [`DistAutograd::new`]). It travels to the owners with each
/// step, so it is `Serialize` and `DeserializeOwned`.
///
/// ```
/// use serde::{Deserialize, Serialize};
/// use tensorwire_core::tensor::Tensor;
/// use tensorwire_dist_autograd::LocalOptimizer;
///
/// /// Sign SGD: p -= lr * sign(g), f32 only.
/// #[derive(Serialize, Deserialize)]
/// struct SignSgd { lr: f32 }
///
/// impl LocalOptimizer for SignSgd {
///     const NAME: &'static str = "sign-sgd";
///     type State = ();
///     type Error = String;
///     fn step(&self, _: &mut (), param: &Tensor, grad: &Tensor) -> Result<Tensor, String> {
///         let (Some(p), Some(g)) = (param.to_f32_vec(), grad.to_f32_vec()) else {
///             return Err("sign-sgd updates f32 parameters".into());
///         };
///         let new: Vec<f32> = p.iter().zip(&g).map(|(p, g)| p - self.lr * g.signum()).collect();
///         Tensor::from_f32(param.shape().to_vec(), &new).map_err(|e| e.to_string())
///     }
/// }
/// ```
pub trait LocalOptimizer: Serialize + DeserializeOwned + Send + Sync + 'static {
    /// The name its step is registered under on the owners; unique per optimizer type, the
    /// same on every worker. A parameter keeps one state per name.
    const NAME: &'static str;
    /// A parameter's state (momentum buffers, moments, step count).
    type State: Default + Send + 'static;
    /// Why a step or the optimizer is refused.
    type Error: std::fmt::Display;

    /// Checks the hyper-parameters (run by [`DistributedOptimizer::new`]); by default none.
    fn validate(&self) -> Result<(), Self::Error> {
        Ok(())
    }

    /// The parameter's new values from its current values `param` and gradient `grad` (host
    /// tensors of the same shape and element type). An error leaves the parameter unchanged.
    fn step(
        &self,
        state: &mut Self::State,
        param: &Tensor,
        grad: &Tensor,
    ) -> Result<Tensor, Self::Error>;
}

/// The state of a `torch.optim` optimizer, in the parameter's precision.
#[derive(Debug, Default)]
pub enum BuiltinState {
    /// Not stepped yet.
    #[default]
    Empty,
    /// An `f32` parameter's state.
    F32(OptimizerState<f32>),
    /// An `f64` parameter's state.
    F64(OptimizerState<f64>),
}

fn step_values<F: Float>(
    o: &Optimizer,
    state: &mut OptimizerState<F>,
    mut param: Vec<F>,
    grad: &[F],
) -> Result<Vec<F>, OptimError> {
    o.step(state, &mut param, grad)?;
    Ok(param)
}

impl LocalOptimizer for Optimizer {
    const NAME: &'static str = "torch.optim";
    type State = BuiltinState;
    type Error = OptimError;

    fn validate(&self) -> Result<(), OptimError> {
        Optimizer::validate(self)
    }

    fn step(
        &self,
        state: &mut BuiltinState,
        param: &Tensor,
        grad: &Tensor,
    ) -> Result<Tensor, OptimError> {
        let unsupported = || {
            OptimError::Unsupported(format!(
                "a {:?} parameter with a {:?} gradient",
                param.dtype(),
                grad.dtype()
            ))
        };
        let shape = param.shape().to_vec();
        if matches!(state, BuiltinState::Empty) {
            *state = match param.dtype() {
                DType::F32 => BuiltinState::F32(OptimizerState::default()),
                DType::F64 => BuiltinState::F64(OptimizerState::default()),
                _ => return Err(unsupported()),
            };
        }
        let built = match state {
            BuiltinState::F32(s) => {
                let (Some(p), Some(g)) = (param.to_f32_vec(), grad.to_f32_vec()) else {
                    return Err(unsupported());
                };
                Tensor::from_f32(shape, &step_values(self, s, p, &g)?)
            }
            BuiltinState::F64(s) => {
                let (Some(p), Some(g)) = (param.to_f64_vec(), grad.to_f64_vec()) else {
                    return Err(unsupported());
                };
                Tensor::from_f64(shape, &step_values(self, s, p, &g)?)
            }
            BuiltinState::Empty => unreachable!("set above"),
        };
        built.map_err(|e| OptimError::Unsupported(e.to_string()))
    }
}

/// A parameter: a leaf tensor of the engine, kept on its owner (in an [`RRef`]) with its
/// optimizer state.
///
/// It lives on its owner: use it there (autograd methods registered with
/// [`DistAutograd::register_method`] get it as `Arc<Parameter<E>>`), or fetch a tracked copy
/// into a context with [`AutogradContext::to_here`](crate::AutogradContext::to_here)
/// (gradients flow back to it). It is `Serialize` only because values kept in references and
/// results of functions must be; what travels is a **copy of its current values**, as a plain
/// [`Tensor`] (read it as one: a function returning a `Parameter` called with
/// `rpc_sync::<_, Tensor>`). That copy is detached: no gradient flows back through it, it
/// carries no optimizer state, and later steps on the owner do not reach it.
/// `RRef<Parameter<E>>::to_here` does not compile (a parameter cannot be rebuilt without its
/// engine).
pub struct Parameter<E: AutogradEngine> {
    tensor: E::Tensor,
    engine: E,
    /// One state per kind of optimizer ([`LocalOptimizer::NAME`]).
    states: Mutex<HashMap<&'static str, Box<dyn Any + Send>>>,
    steps: AtomicU64,
}

impl<E: AutogradEngine + Clone> Parameter<E> {
    /// `tensor` (a leaf that requires gradients) as a parameter.
    pub fn new(engine: &E, tensor: E::Tensor) -> Self {
        Self {
            tensor,
            engine: engine.clone(),
            states: Mutex::new(HashMap::new()),
            steps: AtomicU64::new(0),
        }
    }
}

impl<E: AutogradEngine> Parameter<E> {
    /// The tensor (use it in the forward pass on the owner).
    pub fn tensor(&self) -> &E::Tensor {
        &self.tensor
    }

    /// Optimizer steps taken on it (by any optimizer).
    pub fn steps(&self) -> u64 {
        self.steps.load(Ordering::Relaxed)
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
pub(crate) async fn owner_step<E: AutogradEngine, O: LocalOptimizer>(
    dist: &DistAutograd<E>,
    context: ContextId,
    optimizer: O,
    params: Vec<RRef<Parameter<E>>>,
) -> Result<usize, String> {
    optimizer
        .validate()
        .map_err(|e| format!("{}: {e}", O::NAME))?;
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
        let new = {
            let mut states = p.states.lock().unwrap_or_else(|e| e.into_inner());
            let state = states
                .entry(O::NAME)
                .or_insert_with(|| Box::new(O::State::default()))
                .downcast_mut::<O::State>()
                .ok_or_else(|| {
                    format!(
                        "two optimizer types are registered as {:?}: their states differ",
                        O::NAME
                    )
                })?;
            optimizer
                .step(state, &current, &g)
                .map_err(|e| format!("{}: {e}", O::NAME))?
        };
        if new.dtype() != current.dtype() || new.shape() != current.shape() {
            return Err(format!(
                "{} returned a {:?} tensor of shape {:?} for a {:?} parameter of shape {:?}",
                O::NAME,
                new.dtype(),
                new.shape(),
                current.dtype(),
                current.shape()
            ));
        }
        engine.assign(&p.tensor, &new).map_err(|e| e.to_string())?;
        p.steps.fetch_add(1, Ordering::Relaxed);
        updated += 1;
    }
    Ok(updated)
}

/// Applies a context's gradients to parameters on their owners.
///
/// ```no_run
/// # async fn f(
/// #     dist: tensorwire_dist_autograd::DistAutograd<tensorwire_autograd_candle::CandleEngine>,
/// #     params: Vec<tensorwire_rpc::RRef<tensorwire_dist_autograd::Parameter<tensorwire_autograd_candle::CandleEngine>>>,
/// #     ctx: tensorwire_dist_autograd::AutogradContext<tensorwire_autograd_candle::CandleEngine>,
/// # ) -> Result<(), tensorwire_dist_autograd::DistAutogradError> {
/// use tensorwire_dist_autograd::{DistributedOptimizer, Optimizer, Sgd};
/// let opt = DistributedOptimizer::new(
///     &dist,
///     params,
///     Optimizer::from(Sgd::new(0.05).momentum(0.9).nesterov(true)),
/// )?;
/// // ... forward and ctx.backward(...) ...
/// opt.step(ctx.id()).await?;
/// # Ok(()) }
/// ```
pub struct DistributedOptimizer<E: AutogradEngine, O: LocalOptimizer = Optimizer> {
    dist: DistAutograd<E>,
    optimizer: O,
    /// Parameters grouped by owner.
    by_owner: Vec<(WorkerId, Vec<RRef<Parameter<E>>>)>,
    timeout: Option<Duration>,
}

impl<E: AutogradEngine, O: LocalOptimizer> DistributedOptimizer<E, O> {
    /// An optimizer over `params` (references to [`Parameter`]s on any workers), running
    /// `optimizer` on each owner. Invalid hyper-parameters are refused here
    /// ([`DistAutogradError::Optimizer`]), as `torch.optim`'s constructors refuse them.
    pub fn new(
        dist: &DistAutograd<E>,
        params: Vec<RRef<Parameter<E>>>,
        optimizer: O,
    ) -> Result<Self, DistAutogradError> {
        optimizer
            .validate()
            .map_err(|e| DistAutogradError::Optimizer {
                optimizer: O::NAME,
                message: e.to_string(),
            })?;
        let mut by_owner: Vec<(WorkerId, Vec<RRef<Parameter<E>>>)> = Vec::new();
        for p in params {
            let owner = p.owner().id;
            match by_owner.iter_mut().find(|(o, _)| *o == owner) {
                Some((_, v)) => v.push(p),
                None => by_owner.push((owner, vec![p])),
            }
        }
        Ok(Self {
            dist: dist.clone(),
            optimizer,
            by_owner,
            timeout: None,
        })
    }

    /// Sets the timeout of each owner's step (default: the agent's RPC timeout).
    pub fn set_timeout(&mut self, timeout: Duration) {
        self.timeout = Some(timeout);
    }

    /// Runs each owner's optimizer on the gradients `context` left there, owners in parallel;
    /// returns how many parameters were updated. Parameters without a gradient are left alone.
    pub async fn step(&self, context: ContextId) -> Result<usize, DistAutogradError> {
        let agent = self.dist.agent();
        let function = format!("{STEP}{}", O::NAME);
        let mut pending = Vec::with_capacity(self.by_owner.len());
        for (owner, params) in &self.by_owner {
            // Sent now: the owners work at once, while we wait on the first.
            pending.push(agent.rpc_async::<_, usize>(
                *owner,
                &function,
                &(context, &self.optimizer, params),
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

impl<E: AutogradEngine, O: LocalOptimizer> std::fmt::Debug for DistributedOptimizer<E, O> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DistributedOptimizer")
            .field("optimizer", &O::NAME)
            .field("owners", &self.by_owner.len())
            .finish_non_exhaustive()
    }
}
