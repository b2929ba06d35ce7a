//! The roots of a backward pass and PyTorch's checks of them, made before anything runs.

/// What [`DistAutograd::backward`](super::DistAutograd::backward) checks of one root before
/// anything runs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Root {
    /// The root's shape (a scalar: every dimension 1, or none).
    pub shape: Vec<usize>,
    /// Whether the root requires grad (it was computed from a tensor that records gradients).
    pub requires_grad: bool,
    /// Whether the root has a gradient function: it was computed by an operation the engine
    /// recorded, or received in the context (its recv function sends the gradient back). A
    /// leaf (a tensor that requires grad and that no operation made, a parameter) has none:
    /// a backward from it has nothing to run, and PyTorch refuses it.
    pub has_grad_fn: bool,
    /// The shape of the seed gradient given with it, if one is.
    pub seed: Option<Vec<usize>>,
}

/// What is wrong with the roots of a backward pass.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum RootProblem {
    /// No root was given.
    #[error("no tensors were given as roots")]
    Empty,
    /// A root does not require grad: no gradient could flow from it.
    #[error("root {index} does not require grad (no leaf that records gradients reaches it)")]
    NoGrad {
        /// The root's position.
        index: usize,
    },
    /// A root is a leaf (it requires grad, but no operation computed it): it has no gradient
    /// function to start from (PyTorch's "does not have a valid gradient function").
    #[error(
        "root {index} does not have a valid gradient function: it is a leaf (it requires grad \
         but no operation computed it); start the backward from a tensor computed from it"
    )]
    NoGradFn {
        /// The root's position.
        index: usize,
    },
    /// A root that is not a scalar came without a seed gradient.
    #[error("root {index} has shape {shape:?}: a gradient can be created implicitly only for a scalar; pass a seed gradient")]
    NotScalar {
        /// The root's position.
        index: usize,
        /// Its shape.
        shape: Vec<usize>,
    },
    /// A seed gradient whose shape differs from its root's.
    #[error("root {index} has shape {root:?} but its seed gradient has shape {seed:?}")]
    SeedShape {
        /// The root's position.
        index: usize,
        /// The root's shape.
        root: Vec<usize>,
        /// The seed's shape.
        seed: Vec<usize>,
    },
}

impl Root {
    /// A scalar root that requires grad, computed by an operation, without a seed (a loss).
    pub fn scalar() -> Self {
        Self {
            shape: Vec::new(),
            requires_grad: true,
            has_grad_fn: true,
            seed: None,
        }
    }
}

/// Checks roots as PyTorch does before a backward pass (with seeds allowed for non-scalars),
/// in its order: each requires grad, is a scalar (or has a seed of its shape), and has a
/// gradient function.
pub fn check_roots(roots: &[Root]) -> Result<(), RootProblem> {
    if roots.is_empty() {
        return Err(RootProblem::Empty);
    }
    for (index, r) in roots.iter().enumerate() {
        if !r.requires_grad {
            return Err(RootProblem::NoGrad { index });
        }
        match &r.seed {
            None if r.shape.iter().product::<usize>() != 1 => {
                return Err(RootProblem::NotScalar {
                    index,
                    shape: r.shape.clone(),
                })
            }
            Some(seed) if *seed != r.shape => {
                return Err(RootProblem::SeedShape {
                    index,
                    root: r.shape.clone(),
                    seed: seed.clone(),
                })
            }
            _ => {}
        }
        if !r.has_grad_fn {
            return Err(RootProblem::NoGradFn { index });
        }
    }
    Ok(())
}
