//! The local optimizers a distributed optimizer runs on each parameter's owner: SGD with
//! momentum and Adam, with PyTorch's update rules, over plain `f32` slices.
//!
//! candle (the engine adapter) has no optimizer in its core crate, and candle-nn's SGD has no
//! momentum; the rules are short and engine-independent, so they live here, tested alone.
//!
//! ```
//! use tensorwire_core::autograd::optim::{Optimizer, OptimizerState};
//! let sgd = Optimizer::Sgd { lr: 0.1, momentum: 0.0 };
//! let mut state = OptimizerState::default();
//! let mut p = vec![1.0f32, 2.0];
//! sgd.step(&mut state, &mut p, &[1.0, -1.0]).unwrap();
//! assert_eq!(p, vec![0.9, 2.1]);
//! ```

use serde::{Deserialize, Serialize};

/// A local optimizer and its hyper-parameters.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[non_exhaustive]
pub enum Optimizer {
    /// SGD with momentum (PyTorch's `torch.optim.SGD`, no dampening, no Nesterov):
    /// `buf = momentum * buf + grad` (`buf = grad` on the first step), `p -= lr * buf`.
    Sgd {
        /// Learning rate.
        lr: f32,
        /// Momentum (0: plain SGD).
        momentum: f32,
    },
    /// Adam (PyTorch's `torch.optim.Adam`, no weight decay, no amsgrad).
    Adam {
        /// Learning rate.
        lr: f32,
        /// Decay of the first moment.
        beta1: f32,
        /// Decay of the second moment.
        beta2: f32,
        /// Added to the denominator.
        eps: f32,
    },
}

impl Optimizer {
    /// Adam with PyTorch's defaults for everything but the learning rate.
    pub fn adam(lr: f32) -> Self {
        Optimizer::Adam {
            lr,
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
        }
    }
}

/// A parameter's optimizer state (momentum buffer, moments, step count).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct OptimizerState {
    step: u64,
    first: Vec<f32>,
    second: Vec<f32>,
}

impl OptimizerState {
    /// Steps taken.
    pub fn steps(&self) -> u64 {
        self.step
    }
}

/// A step that cannot be taken.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum OptimError {
    /// Parameter and gradient (or the state) differ in length.
    #[error("a parameter of {param} values with a gradient of {grad} values")]
    LengthMismatch {
        /// Parameter length.
        param: usize,
        /// Gradient length.
        grad: usize,
    },
}

impl Optimizer {
    /// Updates `param` in place with `grad`.
    pub fn step(
        &self,
        state: &mut OptimizerState,
        param: &mut [f32],
        grad: &[f32],
    ) -> Result<(), OptimError> {
        let n = param.len();
        if grad.len() != n || (state.step > 0 && !state.first.is_empty() && state.first.len() != n)
        {
            return Err(OptimError::LengthMismatch {
                param: n,
                grad: grad.len(),
            });
        }
        state.step += 1;
        match *self {
            Optimizer::Sgd { lr, momentum } => {
                if momentum == 0.0 {
                    for (p, g) in param.iter_mut().zip(grad) {
                        *p -= lr * g;
                    }
                    return Ok(());
                }
                if state.first.is_empty() {
                    state.first = grad.to_vec();
                } else {
                    for (b, g) in state.first.iter_mut().zip(grad) {
                        *b = momentum * *b + g;
                    }
                }
                for (p, b) in param.iter_mut().zip(&state.first) {
                    *p -= lr * b;
                }
            }
            Optimizer::Adam {
                lr,
                beta1,
                beta2,
                eps,
            } => {
                if state.first.is_empty() {
                    state.first = vec![0.0; n];
                    state.second = vec![0.0; n];
                }
                let t = state.step as i32;
                let c1 = 1.0 - beta1.powi(t);
                let c2 = 1.0 - beta2.powi(t);
                for i in 0..n {
                    let g = grad[i];
                    state.first[i] = beta1 * state.first[i] + (1.0 - beta1) * g;
                    state.second[i] = beta2 * state.second[i] + (1.0 - beta2) * g * g;
                    let m = state.first[i] / c1;
                    let v = state.second[i] / c2;
                    param[i] -= lr * m / (v.sqrt() + eps);
                }
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sgd_momentum_follows_pytorch() {
        let o = Optimizer::Sgd {
            lr: 0.1,
            momentum: 0.9,
        };
        let mut s = OptimizerState::default();
        let mut p = vec![1.0f32];
        o.step(&mut s, &mut p, &[1.0]).unwrap(); // buf 1, p 0.9
        o.step(&mut s, &mut p, &[1.0]).unwrap(); // buf 1.9, p 0.71
        assert!((p[0] - 0.71).abs() < 1e-6, "{p:?}");
        assert_eq!(s.steps(), 2);
        assert!(o.step(&mut s, &mut p, &[1.0, 2.0]).is_err());
    }

    #[test]
    fn adam_first_step_moves_by_lr() {
        // With bias correction the first step is lr * g / (|g| + eps) = lr * sign(g).
        let o = Optimizer::adam(0.01);
        let mut s = OptimizerState::default();
        let mut p = vec![1.0f32, 1.0];
        o.step(&mut s, &mut p, &[3.0, -0.5]).unwrap();
        assert!(
            (p[0] - 0.99).abs() < 1e-6 && (p[1] - 1.01).abs() < 1e-6,
            "{p:?}"
        );
        // Second step, same gradient: m̂ = g, v̂ = g², the same move again.
        o.step(&mut s, &mut p, &[3.0, -0.5]).unwrap();
        assert!((p[0] - 0.98).abs() < 1e-5, "{p:?}");
    }
}
