//! The local optimizers a distributed optimizer runs on each parameter's owner, with
//! `torch.optim`'s update rules (the algorithm boxes of its documentation, in the order its
//! single-tensor implementation computes them), over plain `f32` or `f64` slices.
//!
//! - [`Sgd`]: momentum, dampening, Nesterov, weight decay (`torch.optim.SGD`);
//! - [`Adam`] and [`AdamW`]: weight decay (coupled, decoupled), amsgrad;
//! - [`RmsProp`]: alpha, eps, weight decay, momentum, centered (`torch.optim.RMSprop`);
//! - [`Adagrad`]: lr decay, weight decay, initial accumulator value, eps.
//!
//! Each has PyTorch's defaults in `new(lr)` and a builder method per hyper-parameter;
//! [`Optimizer`] holds any of them. Hyper-parameters are `f64` (Python floats, as in PyTorch)
//! and the arithmetic is done in the parameter's own precision, as PyTorch does; the bias
//! corrections and learning-rate decays, which PyTorch computes in Python, are computed in
//! `f64`, and an addition with a scale (`add(x, alpha=a)`) is fused into one rounding, as
//! PyTorch's vectorized CPU kernels do it: `f32` results agree with PyTorch's to about one
//! rounding, not only to `f32`'s accuracy. Bad hyper-parameters are refused with PyTorch's checks ([`Optimizer::validate`]).
//!
//! candle (the engine adapter) has no optimizer in its core crate, and candle-nn's lacks most of
//! these options; the rules are short and engine-independent, so they live here, tested alone
//! against vectors `torch.optim` computed.
//!
//! ```
//! use tensorwire_core::autograd::optim::{Optimizer, OptimizerState, Sgd};
//! let sgd: Optimizer = Sgd::new(0.1).into();
//! let mut state = OptimizerState::default();
//! let mut p = vec![1.0f32, 2.0];
//! sgd.step(&mut state, &mut p, &[1.0, -1.0]).unwrap();
//! assert_eq!(p, vec![0.9, 2.1]);
//!
//! // f64 parameters, Nesterov momentum with weight decay.
//! let nesterov: Optimizer = Sgd::new(0.1).momentum(0.9).nesterov(true).weight_decay(1e-4).into();
//! let mut state = OptimizerState::default();
//! let mut p = vec![1.0f64];
//! nesterov.step(&mut state, &mut p, &[0.5]).unwrap();
//! assert!((p[0] - (1.0 - 0.1 * 1.9 * (0.5 + 1e-4))).abs() < 1e-12);
//! ```

use std::fmt::Debug;
use std::ops::{Add, Div, Mul, Neg, Sub};

use serde::{Deserialize, Serialize};

/// The element types the optimizers update: `f32` and `f64`.
pub trait Float:
    Copy
    + Debug
    + PartialOrd
    + Add<Output = Self>
    + Sub<Output = Self>
    + Mul<Output = Self>
    + Div<Output = Self>
    + Neg<Output = Self>
    + Send
    + Sync
    + 'static
{
    /// Zero.
    const ZERO: Self;
    /// `v` in this precision (rounded to nearest, as PyTorch casts a Python float).
    fn from_f64(v: f64) -> Self;
    /// The square root.
    fn sqrt(self) -> Self;
    /// `self * a + b`, rounded once (PyTorch's vectorized `add(x, alpha=a)` fuses it).
    fn mul_add(self, a: Self, b: Self) -> Self;
}

impl Float for f32 {
    const ZERO: Self = 0.0;
    fn from_f64(v: f64) -> Self {
        v as f32
    }
    fn sqrt(self) -> Self {
        f32::sqrt(self)
    }
    fn mul_add(self, a: Self, b: Self) -> Self {
        f32::mul_add(self, a, b)
    }
}

impl Float for f64 {
    const ZERO: Self = 0.0;
    fn from_f64(v: f64) -> Self {
        v
    }
    fn sqrt(self) -> Self {
        f64::sqrt(self)
    }
    fn mul_add(self, a: Self, b: Self) -> Self {
        f64::mul_add(self, a, b)
    }
}

/// `torch.optim.SGD`: `g += weight_decay * p`; with momentum, `b = g` on the first step and
/// `b = momentum * b + (1 - dampening) * g` after, then `g = g + momentum * b` (Nesterov) or
/// `g = b`; `p -= lr * g`.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[non_exhaustive]
pub struct Sgd {
    /// Learning rate.
    pub lr: f64,
    /// Momentum factor (default 0: plain SGD).
    pub momentum: f64,
    /// Dampening of the momentum (default 0).
    pub dampening: f64,
    /// Nesterov momentum (default off; needs momentum > 0 and no dampening).
    pub nesterov: bool,
    /// L2 penalty (default 0).
    pub weight_decay: f64,
}

impl Sgd {
    /// SGD with learning rate `lr` and PyTorch's defaults for the rest.
    pub const fn new(lr: f64) -> Self {
        Self {
            lr,
            momentum: 0.0,
            dampening: 0.0,
            nesterov: false,
            weight_decay: 0.0,
        }
    }
    /// Sets the momentum factor.
    pub const fn momentum(mut self, momentum: f64) -> Self {
        self.momentum = momentum;
        self
    }
    /// Sets the dampening.
    pub const fn dampening(mut self, dampening: f64) -> Self {
        self.dampening = dampening;
        self
    }
    /// Turns Nesterov momentum on or off.
    pub const fn nesterov(mut self, nesterov: bool) -> Self {
        self.nesterov = nesterov;
        self
    }
    /// Sets the L2 penalty.
    pub const fn weight_decay(mut self, weight_decay: f64) -> Self {
        self.weight_decay = weight_decay;
        self
    }
}

/// `torch.optim.Adam`: `g += weight_decay * p`; `m = lerp(m, g, 1 - beta1)`,
/// `v = beta2 * v + (1 - beta2) * g²`; with amsgrad `v_max = max(v_max, v)` is used for `v`;
/// `p -= lr / (1 - beta1^t) * m / (sqrt(v) / sqrt(1 - beta2^t) + eps)`.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[non_exhaustive]
pub struct Adam {
    /// Learning rate (PyTorch's default 1e-3).
    pub lr: f64,
    /// Decay of the first moment (default 0.9).
    pub beta1: f64,
    /// Decay of the second moment (default 0.999).
    pub beta2: f64,
    /// Added to the denominator (default 1e-8).
    pub eps: f64,
    /// L2 penalty, added to the gradient (default 0).
    pub weight_decay: f64,
    /// The AMSGrad variant (default off).
    pub amsgrad: bool,
}

impl Adam {
    /// Adam with learning rate `lr` and PyTorch's defaults for the rest.
    pub const fn new(lr: f64) -> Self {
        Self {
            lr,
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay: 0.0,
            amsgrad: false,
        }
    }
    /// Sets `(beta1, beta2)`.
    pub const fn betas(mut self, beta1: f64, beta2: f64) -> Self {
        self.beta1 = beta1;
        self.beta2 = beta2;
        self
    }
    /// Sets eps.
    pub const fn eps(mut self, eps: f64) -> Self {
        self.eps = eps;
        self
    }
    /// Sets the L2 penalty.
    pub const fn weight_decay(mut self, weight_decay: f64) -> Self {
        self.weight_decay = weight_decay;
        self
    }
    /// Turns AMSGrad on or off.
    pub const fn amsgrad(mut self, amsgrad: bool) -> Self {
        self.amsgrad = amsgrad;
        self
    }
}

/// `torch.optim.AdamW`: Adam with decoupled weight decay, `p *= 1 - lr * weight_decay` before
/// the Adam update (which then sees the plain gradient).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[non_exhaustive]
pub struct AdamW {
    /// Learning rate (PyTorch's default 1e-3).
    pub lr: f64,
    /// Decay of the first moment (default 0.9).
    pub beta1: f64,
    /// Decay of the second moment (default 0.999).
    pub beta2: f64,
    /// Added to the denominator (default 1e-8).
    pub eps: f64,
    /// Decoupled weight decay (default 0.01).
    pub weight_decay: f64,
    /// The AMSGrad variant (default off).
    pub amsgrad: bool,
}

impl AdamW {
    /// AdamW with learning rate `lr` and PyTorch's defaults for the rest.
    pub const fn new(lr: f64) -> Self {
        Self {
            lr,
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay: 0.01,
            amsgrad: false,
        }
    }
    /// Sets `(beta1, beta2)`.
    pub const fn betas(mut self, beta1: f64, beta2: f64) -> Self {
        self.beta1 = beta1;
        self.beta2 = beta2;
        self
    }
    /// Sets eps.
    pub const fn eps(mut self, eps: f64) -> Self {
        self.eps = eps;
        self
    }
    /// Sets the decoupled weight decay.
    pub const fn weight_decay(mut self, weight_decay: f64) -> Self {
        self.weight_decay = weight_decay;
        self
    }
    /// Turns AMSGrad on or off.
    pub const fn amsgrad(mut self, amsgrad: bool) -> Self {
        self.amsgrad = amsgrad;
        self
    }
}

/// `torch.optim.RMSprop`: `g += weight_decay * p`; `v = alpha * v + (1 - alpha) * g²`;
/// centered: `a = lerp(a, g, 1 - alpha)`, `v~ = v - a²`; `d = sqrt(v~) + eps`; with momentum
/// `b = momentum * b + g / d`, `p -= lr * b`, else `p -= lr * g / d`.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[non_exhaustive]
pub struct RmsProp {
    /// Learning rate (PyTorch's default 1e-2).
    pub lr: f64,
    /// Smoothing constant (default 0.99).
    pub alpha: f64,
    /// Added to the denominator (default 1e-8).
    pub eps: f64,
    /// L2 penalty (default 0).
    pub weight_decay: f64,
    /// Momentum factor (default 0).
    pub momentum: f64,
    /// Normalize by the estimated variance of the gradient (default off).
    pub centered: bool,
}

impl RmsProp {
    /// RMSprop with learning rate `lr` and PyTorch's defaults for the rest.
    pub const fn new(lr: f64) -> Self {
        Self {
            lr,
            alpha: 0.99,
            eps: 1e-8,
            weight_decay: 0.0,
            momentum: 0.0,
            centered: false,
        }
    }
    /// Sets the smoothing constant.
    pub const fn alpha(mut self, alpha: f64) -> Self {
        self.alpha = alpha;
        self
    }
    /// Sets eps.
    pub const fn eps(mut self, eps: f64) -> Self {
        self.eps = eps;
        self
    }
    /// Sets the L2 penalty.
    pub const fn weight_decay(mut self, weight_decay: f64) -> Self {
        self.weight_decay = weight_decay;
        self
    }
    /// Sets the momentum factor.
    pub const fn momentum(mut self, momentum: f64) -> Self {
        self.momentum = momentum;
        self
    }
    /// Turns the centered variant on or off.
    pub const fn centered(mut self, centered: bool) -> Self {
        self.centered = centered;
        self
    }
}

/// `torch.optim.Adagrad`: `clr = lr / (1 + (t - 1) * lr_decay)`; `g += weight_decay * p`;
/// `s += g²` (`s` starts at `initial_accumulator_value`); `p -= clr * g / (sqrt(s) + eps)`.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[non_exhaustive]
pub struct Adagrad {
    /// Learning rate (PyTorch's default 1e-2).
    pub lr: f64,
    /// Learning-rate decay (default 0).
    pub lr_decay: f64,
    /// L2 penalty (default 0).
    pub weight_decay: f64,
    /// The accumulator's starting value (default 0).
    pub initial_accumulator_value: f64,
    /// Added to the denominator (default 1e-10).
    pub eps: f64,
}

impl Adagrad {
    /// Adagrad with learning rate `lr` and PyTorch's defaults for the rest.
    pub const fn new(lr: f64) -> Self {
        Self {
            lr,
            lr_decay: 0.0,
            weight_decay: 0.0,
            initial_accumulator_value: 0.0,
            eps: 1e-10,
        }
    }
    /// Sets the learning-rate decay.
    pub const fn lr_decay(mut self, lr_decay: f64) -> Self {
        self.lr_decay = lr_decay;
        self
    }
    /// Sets the L2 penalty.
    pub const fn weight_decay(mut self, weight_decay: f64) -> Self {
        self.weight_decay = weight_decay;
        self
    }
    /// Sets the accumulator's starting value.
    pub const fn initial_accumulator_value(mut self, value: f64) -> Self {
        self.initial_accumulator_value = value;
        self
    }
    /// Sets eps.
    pub const fn eps(mut self, eps: f64) -> Self {
        self.eps = eps;
        self
    }
}

/// A local optimizer and its hyper-parameters: one of `torch.optim`'s.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[non_exhaustive]
pub enum Optimizer {
    /// `torch.optim.SGD`.
    Sgd(Sgd),
    /// `torch.optim.Adam`.
    Adam(Adam),
    /// `torch.optim.AdamW`.
    AdamW(AdamW),
    /// `torch.optim.RMSprop`.
    RmsProp(RmsProp),
    /// `torch.optim.Adagrad`.
    Adagrad(Adagrad),
}

impl From<Sgd> for Optimizer {
    fn from(o: Sgd) -> Self {
        Optimizer::Sgd(o)
    }
}
impl From<Adam> for Optimizer {
    fn from(o: Adam) -> Self {
        Optimizer::Adam(o)
    }
}
impl From<AdamW> for Optimizer {
    fn from(o: AdamW) -> Self {
        Optimizer::AdamW(o)
    }
}
impl From<RmsProp> for Optimizer {
    fn from(o: RmsProp) -> Self {
        Optimizer::RmsProp(o)
    }
}
impl From<Adagrad> for Optimizer {
    fn from(o: Adagrad) -> Self {
        Optimizer::Adagrad(o)
    }
}

/// A parameter's optimizer state (momentum buffer, moments, sums, step count), in the
/// parameter's precision. It belongs to one kind of optimizer: stepping it with another is an
/// error ([`OptimError::StateOfAnother`]).
#[derive(Debug, Clone, PartialEq)]
pub struct OptimizerState<F = f32> {
    step: u64,
    /// The optimizer that made it (`None`: not stepped yet).
    kind: Option<&'static str>,
    /// SGD and RMSprop: the momentum buffer; Adam: the first moment; Adagrad: the sum.
    first: Vec<F>,
    /// Adam, RMSprop: the second moment (square average).
    second: Vec<F>,
    /// Adam with amsgrad: the running maximum of the second moment; centered RMSprop: the
    /// gradient average.
    third: Vec<F>,
}

impl<F> Default for OptimizerState<F> {
    fn default() -> Self {
        Self {
            step: 0,
            kind: None,
            first: Vec::new(),
            second: Vec::new(),
            third: Vec::new(),
        }
    }
}

impl<F> OptimizerState<F> {
    /// Steps taken.
    pub fn steps(&self) -> u64 {
        self.step
    }
}

/// A step that cannot be taken. Nothing was changed.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum OptimError {
    /// Parameter and gradient (or the state) differ in length.
    #[error("a parameter of {param} values with a gradient (or optimizer state) of {grad} values")]
    LengthMismatch {
        /// Parameter length.
        param: usize,
        /// Gradient (or state) length.
        grad: usize,
    },
    /// A hyper-parameter out of its range (PyTorch's checks: learning rates, eps, momentum,
    /// weight decay, alpha, lr decay and the initial accumulator value are `>= 0`, betas in
    /// `[0, 1)`, every value finite).
    #[error("{optimizer}: invalid {name}: {value}")]
    InvalidHyperParameter {
        /// The optimizer (`SGD`, `Adam`, ...).
        optimizer: &'static str,
        /// The hyper-parameter.
        name: &'static str,
        /// Its value.
        value: f64,
    },
    /// Nesterov momentum without momentum, or with dampening.
    #[error("SGD: Nesterov momentum requires a momentum > 0 and zero dampening (momentum {momentum}, dampening {dampening})")]
    Nesterov {
        /// The momentum.
        momentum: f64,
        /// The dampening.
        dampening: f64,
    },
    /// The state was made by another kind of optimizer.
    #[error("the optimizer state belongs to {state}, not {optimizer}")]
    StateOfAnother {
        /// The optimizer that made the state.
        state: &'static str,
        /// The optimizer asked to step.
        optimizer: &'static str,
    },
    /// A parameter of an element type the optimizers do not update (the distributed optimizer
    /// reports this; the local step is typed).
    #[error("the optimizers update f32 and f64 parameters, not {0}")]
    Unsupported(String),
}

fn check(
    optimizer: &'static str,
    name: &'static str,
    value: f64,
    ok: impl Fn(f64) -> bool,
) -> Result<(), OptimError> {
    if value.is_finite() && ok(value) {
        Ok(())
    } else {
        Err(OptimError::InvalidHyperParameter {
            optimizer,
            name,
            value,
        })
    }
}

fn non_negative(v: f64) -> bool {
    v >= 0.0
}

fn beta(v: f64) -> bool {
    (0.0..1.0).contains(&v)
}

/// PyTorch's `lerp` on the CPU: `a + w * (b - a)` for `w < 0.5`, else `b - (b - a) * (1 - w)`.
fn lerp<F: Float>(a: F, b: F, w: f64) -> F {
    if w < 0.5 {
        a + F::from_f64(w) * (b - a)
    } else {
        b - (b - a) * F::from_f64(1.0 - w)
    }
}

impl Optimizer {
    /// The optimizer's name, as `torch.optim` spells it.
    pub fn name(&self) -> &'static str {
        match self {
            Optimizer::Sgd(_) => "SGD",
            Optimizer::Adam(_) => "Adam",
            Optimizer::AdamW(_) => "AdamW",
            Optimizer::RmsProp(_) => "RMSprop",
            Optimizer::Adagrad(_) => "Adagrad",
        }
    }

    /// The learning rate.
    pub fn lr(&self) -> f64 {
        match self {
            Optimizer::Sgd(o) => o.lr,
            Optimizer::Adam(o) => o.lr,
            Optimizer::AdamW(o) => o.lr,
            Optimizer::RmsProp(o) => o.lr,
            Optimizer::Adagrad(o) => o.lr,
        }
    }

    /// Checks the hyper-parameters as `torch.optim`'s constructors do.
    pub fn validate(&self) -> Result<(), OptimError> {
        let n = self.name();
        check(n, "learning rate", self.lr(), non_negative)?;
        match *self {
            Optimizer::Sgd(o) => {
                check(n, "momentum value", o.momentum, non_negative)?;
                check(n, "dampening value", o.dampening, |_| true)?;
                check(n, "weight_decay value", o.weight_decay, non_negative)?;
                if o.nesterov && (o.momentum <= 0.0 || o.dampening != 0.0) {
                    return Err(OptimError::Nesterov {
                        momentum: o.momentum,
                        dampening: o.dampening,
                    });
                }
            }
            Optimizer::Adam(Adam {
                beta1,
                beta2,
                eps,
                weight_decay,
                ..
            })
            | Optimizer::AdamW(AdamW {
                beta1,
                beta2,
                eps,
                weight_decay,
                ..
            }) => {
                check(n, "epsilon value", eps, non_negative)?;
                check(n, "beta parameter at index 0", beta1, beta)?;
                check(n, "beta parameter at index 1", beta2, beta)?;
                check(n, "weight_decay value", weight_decay, non_negative)?;
            }
            Optimizer::RmsProp(o) => {
                check(n, "epsilon value", o.eps, non_negative)?;
                check(n, "momentum value", o.momentum, non_negative)?;
                check(n, "weight_decay value", o.weight_decay, non_negative)?;
                check(n, "alpha value", o.alpha, non_negative)?;
            }
            Optimizer::Adagrad(o) => {
                check(n, "lr_decay value", o.lr_decay, non_negative)?;
                check(n, "weight_decay value", o.weight_decay, non_negative)?;
                check(
                    n,
                    "initial_accumulator_value value",
                    o.initial_accumulator_value,
                    non_negative,
                )?;
                check(n, "epsilon value", o.eps, non_negative)?;
            }
        }
        Ok(())
    }

    /// Updates `param` in place with `grad`. Refused, with nothing changed, when the
    /// hyper-parameters are invalid, the lengths differ or `state` is another optimizer's.
    pub fn step<F: Float>(
        &self,
        state: &mut OptimizerState<F>,
        param: &mut [F],
        grad: &[F],
    ) -> Result<(), OptimError> {
        self.validate()?;
        let n = param.len();
        if grad.len() != n {
            return Err(OptimError::LengthMismatch {
                param: n,
                grad: grad.len(),
            });
        }
        for buf in [&state.first, &state.second, &state.third] {
            if !buf.is_empty() && buf.len() != n {
                return Err(OptimError::LengthMismatch {
                    param: n,
                    grad: buf.len(),
                });
            }
        }
        match state.kind {
            Some(kind) if kind != self.name() => {
                return Err(OptimError::StateOfAnother {
                    state: kind,
                    optimizer: self.name(),
                })
            }
            _ => state.kind = Some(self.name()),
        }
        state.step += 1;
        match *self {
            Optimizer::Sgd(o) => sgd(o, state, param, grad),
            Optimizer::Adam(o) => adam(
                AdamRule {
                    lr: o.lr,
                    beta1: o.beta1,
                    beta2: o.beta2,
                    eps: o.eps,
                    l2: o.weight_decay,
                    decoupled: 0.0,
                    amsgrad: o.amsgrad,
                },
                state,
                param,
                grad,
            ),
            Optimizer::AdamW(o) => adam(
                AdamRule {
                    lr: o.lr,
                    beta1: o.beta1,
                    beta2: o.beta2,
                    eps: o.eps,
                    l2: 0.0,
                    decoupled: o.weight_decay,
                    amsgrad: o.amsgrad,
                },
                state,
                param,
                grad,
            ),
            Optimizer::RmsProp(o) => rmsprop(o, state, param, grad),
            Optimizer::Adagrad(o) => adagrad(o, state, param, grad),
        }
        Ok(())
    }
}

/// `grad + weight_decay * param` (PyTorch's `grad.add(param, alpha=weight_decay)`).
fn decayed<F: Float>(g: F, p: F, weight_decay: f64) -> F {
    if weight_decay == 0.0 {
        g
    } else {
        p.mul_add(F::from_f64(weight_decay), g)
    }
}

fn sgd<F: Float>(o: Sgd, state: &mut OptimizerState<F>, param: &mut [F], grad: &[F]) {
    let lr = F::from_f64(-o.lr);
    let first = state.first.is_empty();
    if o.momentum != 0.0 && first {
        state.first = vec![F::ZERO; param.len()];
    }
    let (mu, damp) = (F::from_f64(o.momentum), F::from_f64(1.0 - o.dampening));
    for i in 0..param.len() {
        let mut g = decayed(grad[i], param[i], o.weight_decay);
        if o.momentum != 0.0 {
            let b = &mut state.first[i];
            *b = if first { g } else { g.mul_add(damp, *b * mu) };
            g = if o.nesterov { b.mul_add(mu, g) } else { *b };
        }
        param[i] = g.mul_add(lr, param[i]);
    }
}

struct AdamRule {
    lr: f64,
    beta1: f64,
    beta2: f64,
    eps: f64,
    /// Weight decay added to the gradient (Adam).
    l2: f64,
    /// Weight decay applied to the parameter (AdamW).
    decoupled: f64,
    amsgrad: bool,
}

fn adam<F: Float>(o: AdamRule, state: &mut OptimizerState<F>, param: &mut [F], grad: &[F]) {
    let n = param.len();
    if state.first.is_empty() {
        state.first = vec![F::ZERO; n];
        state.second = vec![F::ZERO; n];
        if o.amsgrad {
            state.third = vec![F::ZERO; n];
        }
    }
    // PyTorch computes these in Python (f64).
    let t = state.step as f64;
    let bias1 = 1.0 - o.beta1.powf(t);
    let bias2_sqrt = (1.0 - o.beta2.powf(t)).sqrt();
    let step_size = F::from_f64(-(o.lr / bias1));
    let (b2, c2) = (F::from_f64(o.beta2), F::from_f64(1.0 - o.beta2));
    let (bias2_sqrt, eps) = (F::from_f64(bias2_sqrt), F::from_f64(o.eps));
    let shrink = F::from_f64(1.0 - o.lr * o.decoupled);
    for i in 0..n {
        if o.decoupled != 0.0 {
            param[i] = param[i] * shrink;
        }
        let g = decayed(grad[i], param[i], o.l2);
        let m = lerp(state.first[i], g, 1.0 - o.beta1);
        state.first[i] = m;
        let v = state.second[i] * b2 + c2 * g * g;
        state.second[i] = v;
        let v = if o.amsgrad {
            let max = &mut state.third[i];
            if v > *max {
                *max = v;
            }
            *max
        } else {
            v
        };
        let denom = v.sqrt() / bias2_sqrt + eps;
        param[i] = param[i] + step_size * (m / denom);
    }
}

fn rmsprop<F: Float>(o: RmsProp, state: &mut OptimizerState<F>, param: &mut [F], grad: &[F]) {
    let n = param.len();
    if state.second.is_empty() {
        state.second = vec![F::ZERO; n];
        if o.momentum > 0.0 {
            state.first = vec![F::ZERO; n];
        }
        if o.centered {
            state.third = vec![F::ZERO; n];
        }
    }
    let (alpha, c) = (F::from_f64(o.alpha), F::from_f64(1.0 - o.alpha));
    let (eps, lr, mu) = (
        F::from_f64(o.eps),
        F::from_f64(-o.lr),
        F::from_f64(o.momentum),
    );
    for i in 0..n {
        let g = decayed(grad[i], param[i], o.weight_decay);
        let v = state.second[i] * alpha + c * g * g;
        state.second[i] = v;
        let avg = if o.centered {
            let a = lerp(state.third[i], g, 1.0 - o.alpha);
            state.third[i] = a;
            (v - a * a).sqrt()
        } else {
            v.sqrt()
        } + eps;
        if o.momentum > 0.0 {
            let b = state.first[i] * mu + g / avg;
            state.first[i] = b;
            param[i] = b.mul_add(lr, param[i]);
        } else {
            param[i] = param[i] + lr * (g / avg);
        }
    }
}

fn adagrad<F: Float>(o: Adagrad, state: &mut OptimizerState<F>, param: &mut [F], grad: &[F]) {
    let n = param.len();
    if state.first.is_empty() {
        state.first = vec![F::from_f64(o.initial_accumulator_value); n];
    }
    let clr = o.lr / (1.0 + (state.step as f64 - 1.0) * o.lr_decay);
    let (clr, eps) = (F::from_f64(-clr), F::from_f64(o.eps));
    for i in 0..n {
        let g = decayed(grad[i], param[i], o.weight_decay);
        let s = state.first[i] + g * g;
        state.first[i] = s;
        param[i] = param[i] + clr * (g / (s.sqrt() + eps));
    }
}

#[cfg(test)]
mod tests;
