//! The `AutogradEngine` port: what distributed autograd needs from a local autodiff engine.
//!
//! Distributed autograd ([`crate::autograd`]) decides which gradients go where; an engine does
//! the arithmetic on one worker. It must:
//!
//! - turn a received host tensor into one of its tensors, as a leaf that records its gradient
//!   (the recv function of PyTorch: the gradient that reaches it goes back to the sender), and
//!   turn its tensors into host tensors to send ([`import`](AutogradEngine::import),
//!   [`export`](AutogradEngine::export));
//! - run a backward pass from given roots with given seed gradients, *keeping the graph*
//!   (FAST mode runs a send function again for every gradient that reaches it), and return the
//!   gradient of every leaf reached ([`backward`](AutogradEngine::backward));
//! - add gradients, so the context can accumulate them ([`accumulate`](AutogradEngine::accumulate));
//! - say whether a tensor requires grad, whether an operation computed it, and what its shape
//!   is, so that the roots of a backward pass are checked before anything runs
//!   ([`requires_grad`](AutogradEngine::requires_grad),
//!   [`has_grad_fn`](AutogradEngine::has_grad_fn), [`shape`](AutogradEngine::shape)), and its
//!   element type, so that a peer's gradient of another shape or type than its tensor is
//!   refused ([`dtype`](AutogradEngine::dtype)).
//!
//! The adapter is `tensorwire-autograd-candle` (candle's autodiff; burn's backward consumes its
//! graph, so a send function could not run twice).

use std::fmt::Debug;
use std::hash::Hash;

use crate::tensor::{DType, Tensor};

/// An engine operation failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("autograd engine: {0}")]
pub struct EngineError(pub String);

/// The gradients a backward pass computed: leaf and gradient.
pub type LeafGradients<E> = Vec<(<E as AutogradEngine>::LeafId, <E as AutogradEngine>::Tensor)>;

/// A local autodiff engine, as distributed autograd drives it.
///
/// Methods are synchronous: they compute on this thread (the driver runs them off its I/O
/// tasks where they are long).
pub trait AutogradEngine: Send + Sync + 'static {
    /// The engine's tensor (a cheap handle: cloning it shares the values and the graph).
    type Tensor: Clone + Send + Sync + 'static;
    /// The identity of a leaf (a parameter or a received tensor), under which a context keeps
    /// its gradient.
    type LeafId: Clone + Eq + Hash + Debug + Send + Sync + 'static;

    /// The identity of `tensor` as a leaf.
    fn leaf_id(&self, tensor: &Self::Tensor) -> Self::LeafId;

    /// Whether `tensor` requires grad: a leaf that records its gradient, or computed from one
    /// (a backward pass from it reaches a leaf). Roots that do not are refused.
    fn requires_grad(&self, tensor: &Self::Tensor) -> bool;

    /// Whether `tensor` was computed by an operation the engine recorded (it has a gradient
    /// function), rather than being a leaf or untracked. A root without one is refused
    /// (PyTorch: "does not have a valid gradient function"); a tensor received in a context
    /// counts as having one (its recv function) whatever the engine says.
    fn has_grad_fn(&self, tensor: &Self::Tensor) -> bool;

    /// The shape of `tensor` (roots without a seed must be scalars; a seed has its root's
    /// shape).
    fn shape(&self, tensor: &Self::Tensor) -> Vec<usize>;

    /// The element type of `tensor` (a sparse tensor's: its values'), `None` for one that
    /// tensorwire's tensors cannot carry. A gradient a peer sends for a tensor must have that
    /// tensor's shape and element type (the driver refuses another as the peer's violation):
    /// an engine computes a leaf's gradient in the leaf's own type (torch casts every gradient
    /// to its input's dtype), and a received tensor keeps its type on the wire.
    fn dtype(&self, tensor: &Self::Tensor) -> Option<DType>;

    /// A host tensor as an engine tensor; with `requires_grad`, a leaf whose gradient a
    /// backward pass computes. Fails for element types or devices the engine cannot hold.
    fn import(&self, tensor: &Tensor, requires_grad: bool) -> Result<Self::Tensor, EngineError>;

    /// The values of `tensor` as a host tensor (no graph).
    fn export(&self, tensor: &Self::Tensor) -> Result<Tensor, EngineError>;

    /// Runs backward from `roots`, each with its seed gradient (`None`: ones, for a scalar
    /// loss), keeping the graph, and returns the gradient of every leaf reached.
    fn backward(
        &self,
        roots: &[(Self::Tensor, Option<Self::Tensor>)],
    ) -> Result<LeafGradients<Self>, EngineError>;

    /// Writes `values` into the leaf `leaf` in place (an optimizer step): the leaf keeps its
    /// identity, so later graphs use the new values.
    fn assign(&self, leaf: &Self::Tensor, values: &Tensor) -> Result<(), EngineError>;

    /// `sum + grad` (shapes equal).
    fn accumulate(
        &self,
        sum: &Self::Tensor,
        grad: &Self::Tensor,
    ) -> Result<Self::Tensor, EngineError>;
}
