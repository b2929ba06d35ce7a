//! tensorwire's autograd-engine adapter on [candle](https://github.com/huggingface/candle):
//! the local backward pass of distributed autograd.
//!
//! [`CandleEngine`] implements [`AutogradEngine`]: received tensors become candle variables
//! (the recv functions), a backward pass runs from roots with seed gradients, and gradients of
//! every variable reached come back. candle keeps the graph in the tensors themselves, so a
//! send function can run once per gradient that reaches it (FAST mode) without the graph being
//! consumed; burn's autodiff backend frees its graph on the first backward (see the guide's
//! distributed autograd page, `tensorwire::guide::autograd`).
//!
//! Tensors are `f32` or `f64` on the CPU. Conversions: a tensorwire tensor's bytes are read
//! once into candle's own storage (candle owns a `Vec` per tensor, so sharing the bytes is not
//! possible); a candle tensor's values are read once out of candle and then handed to
//! tensorwire without another copy.
//!
//! ```
//! use tensorwire_autograd_candle::CandleEngine;
//! use tensorwire_core::ports::autograd::AutogradEngine;
//! use tensorwire_core::tensor::Tensor;
//!
//! let engine = CandleEngine::new();
//! let w = engine.import(&Tensor::from_f32(vec![2], &[1.0, 2.0]).unwrap(), true).unwrap();
//! let y = w.sqr().unwrap();
//! // d/dw sum(y * [1, 3]) = 2 w * [1, 3]
//! let seed = candle_core::Tensor::new(&[1.0f32, 3.0], &candle_core::Device::Cpu).unwrap();
//! let grads = engine.backward(&[(y, Some(seed))]).unwrap();
//! let g = grads.iter().find(|(id, _)| *id == w.id()).unwrap();
//! assert_eq!(g.1.to_vec1::<f32>().unwrap(), vec![2.0, 12.0]);
//! ```

use bytes::Bytes;
use candle_core::{DType as CDType, Device, Tensor as CTensor, TensorId, Var};
use tensorwire_core::ports::autograd::{AutogradEngine, EngineError, LeafGradients};
use tensorwire_core::tensor::{DType, Storage, Tensor};

pub use candle_core;

/// The candle engine (CPU).
#[derive(Debug, Clone, Default)]
pub struct CandleEngine {
    _private: (),
}

impl CandleEngine {
    /// The engine.
    pub fn new() -> Self {
        Self::default()
    }

    /// A parameter: a variable holding `values` with `shape` (`f32`).
    pub fn parameter(&self, shape: &[usize], values: &[f32]) -> Result<CTensor, EngineError> {
        let t = CTensor::from_slice(values, shape, &Device::Cpu).map_err(err)?;
        Ok(Var::from_tensor(&t).map_err(err)?.as_tensor().clone())
    }
}

fn err(e: candle_core::Error) -> EngineError {
    EngineError(e.to_string())
}

/// A `Vec` of plain numbers seen as its little-endian bytes (what tensorwire tensors hold).
struct LeBytes<T>(Vec<T>);

impl<T: bytemuck_free::Plain> AsRef<[u8]> for LeBytes<T> {
    fn as_ref(&self) -> &[u8] {
        // SAFETY: `T` is f32 or f64 (no padding, every byte initialised); the slice covers
        // exactly the vector's elements and lives as long as `self`.
        unsafe {
            std::slice::from_raw_parts(
                self.0.as_ptr().cast::<u8>(),
                std::mem::size_of_val(self.0.as_slice()),
            )
        }
    }
}

mod bytemuck_free {
    /// Numbers without padding whose in-memory bytes are their value.
    pub(crate) trait Plain: Copy + Send + 'static {}
    impl Plain for f32 {}
    impl Plain for f64 {}
}

fn le_bytes<T: bytemuck_free::Plain>(v: Vec<T>, to_le: impl Fn(T) -> Vec<u8>) -> Bytes {
    if cfg!(target_endian = "little") {
        Bytes::from_owner(LeBytes(v))
    } else {
        v.into_iter().flat_map(to_le).collect::<Vec<u8>>().into()
    }
}

impl AutogradEngine for CandleEngine {
    type Tensor = CTensor;
    type LeafId = TensorId;

    fn leaf_id(&self, tensor: &CTensor) -> TensorId {
        tensor.id()
    }

    fn requires_grad(&self, tensor: &CTensor) -> bool {
        // A variable, or the result of an operation on one (candle records the operation only
        // then).
        tensor.track_op()
    }

    fn has_grad_fn(&self, tensor: &CTensor) -> bool {
        // Tracked, and not a variable itself: candle records an operation only on a result.
        tensor.track_op() && !tensor.is_variable()
    }

    fn shape(&self, tensor: &CTensor) -> Vec<usize> {
        tensor.dims().to_vec()
    }

    fn dtype(&self, tensor: &CTensor) -> Option<DType> {
        Some(match tensor.dtype() {
            CDType::U8 => DType::U8,
            CDType::I64 => DType::I64,
            CDType::F16 => DType::F16,
            CDType::BF16 => DType::BF16,
            CDType::F32 => DType::F32,
            CDType::F64 => DType::F64,
            _ => return None,
        })
    }

    fn import(&self, tensor: &Tensor, requires_grad: bool) -> Result<CTensor, EngineError> {
        let Storage::Host(bytes) = tensor.storage() else {
            return Err(EngineError(format!(
                "the candle engine computes on the CPU; a tensor on {} must be copied to the host first",
                tensor.device()
            )));
        };
        let shape = tensor.shape().to_vec();
        let t = match tensor.dtype() {
            DType::F32 => {
                let v: Vec<f32> = bytes
                    .chunks_exact(4)
                    .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                    .collect();
                CTensor::from_vec(v, shape, &Device::Cpu)
            }
            DType::F64 => {
                let v: Vec<f64> = bytes
                    .chunks_exact(8)
                    .map(|c| f64::from_le_bytes(c.try_into().expect("8 bytes")))
                    .collect();
                CTensor::from_vec(v, shape, &Device::Cpu)
            }
            other => {
                return Err(EngineError(format!(
                    "the candle engine takes f32 and f64 tensors, not {other:?}"
                )))
            }
        }
        .map_err(err)?;
        if requires_grad {
            Ok(Var::from_tensor(&t).map_err(err)?.as_tensor().clone())
        } else {
            Ok(t)
        }
    }

    fn export(&self, tensor: &CTensor) -> Result<Tensor, EngineError> {
        let shape = tensor.dims().to_vec();
        let flat = tensor.flatten_all().map_err(err)?;
        let (dtype, bytes) = match tensor.dtype() {
            CDType::F32 => (
                DType::F32,
                le_bytes(flat.to_vec1::<f32>().map_err(err)?, |x| {
                    x.to_le_bytes().to_vec()
                }),
            ),
            CDType::F64 => (
                DType::F64,
                le_bytes(flat.to_vec1::<f64>().map_err(err)?, |x| {
                    x.to_le_bytes().to_vec()
                }),
            ),
            other => {
                return Err(EngineError(format!(
                    "only f32 and f64 tensors can be sent, not {other:?}"
                )))
            }
        };
        Tensor::new(dtype, shape, Storage::Host(bytes)).map_err(|e| EngineError(e.to_string()))
    }

    fn backward(
        &self,
        roots: &[(CTensor, Option<CTensor>)],
    ) -> Result<LeafGradients<Self>, EngineError> {
        // One scalar whose gradient w.r.t. each root is that root's seed: sum(root * seed).
        let mut total: Option<CTensor> = None;
        for (root, seed) in roots {
            let term = match seed {
                Some(seed) => {
                    if seed.dims() != root.dims() {
                        return Err(EngineError(format!(
                            "a seed gradient of shape {:?} for a root of shape {:?}",
                            seed.dims(),
                            root.dims()
                        )));
                    }
                    root.mul(&seed.detach())
                        .map_err(err)?
                        .sum_all()
                        .map_err(err)?
                }
                None => root.sum_all().map_err(err)?,
            };
            total = Some(match total {
                Some(t) => t.add(&term).map_err(err)?,
                None => term,
            });
        }
        let Some(total) = total else {
            return Ok(Vec::new());
        };
        let store = total.backward().map_err(err)?;
        // The store also holds gradients of constants the graph touched (the seeds): keep the
        // variables' only.
        Ok(total
            .sorted_nodes()
            .into_iter()
            .filter(|n| n.is_variable())
            .filter_map(|n| store.get_id(n.id()).map(|g| (n.id(), g.clone())))
            .collect())
    }

    fn assign(&self, leaf: &CTensor, values: &Tensor) -> Result<(), EngineError> {
        if !leaf.is_variable() {
            return Err(EngineError(
                "only a variable (a parameter) can be assigned".into(),
            ));
        }
        let src = self.import(values, false)?;
        // A variable's `Var` shares its storage: `set` writes in place.
        Var::from_tensor(leaf)
            .map_err(err)?
            .set(&src.to_dtype(leaf.dtype()).map_err(err)?)
            .map_err(err)
    }

    fn accumulate(&self, sum: &CTensor, grad: &CTensor) -> Result<CTensor, EngineError> {
        sum.add(grad).map_err(err)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn grad_of(grads: &LeafGradients<CandleEngine>, t: &CTensor) -> Vec<f32> {
        grads
            .iter()
            .find(|(id, _)| *id == t.id())
            .map(|(_, g)| g.to_vec1::<f32>().unwrap())
            .expect("a gradient")
    }

    #[test]
    fn backward_keeps_the_graph_and_takes_seeds() {
        let e = CandleEngine::new();
        let w = e.parameter(&[3], &[1.0, 2.0, 3.0]).unwrap();
        let y = w.sqr().unwrap();
        let seed = CTensor::new(&[1.0f32, 1.0, 2.0], &Device::Cpu).unwrap();
        let g1 = e.backward(&[(y.clone(), Some(seed.clone()))]).unwrap();
        // The same send function run again for a second gradient: the graph is still there.
        let g2 = e.backward(&[(y, Some(seed))]).unwrap();
        assert_eq!(grad_of(&g1, &w), vec![2.0, 4.0, 12.0]);
        assert_eq!(grad_of(&g2, &w), vec![2.0, 4.0, 12.0]);
        assert_eq!((g1.len(), g2.len()), (1, 1), "only the variable's gradient");
        let sum = e
            .accumulate(&g1[0].1, &g2[0].1)
            .unwrap()
            .to_vec1::<f32>()
            .unwrap();
        assert_eq!(sum, vec![4.0, 8.0, 24.0]);
        // An optimizer step writes in place: same leaf, new values.
        let id = w.id();
        e.assign(&w, &Tensor::from_f32(vec![3], &[0.0, 1.0, 2.0]).unwrap())
            .unwrap();
        assert_eq!(
            (w.id(), w.to_vec1::<f32>().unwrap()),
            (id, vec![0.0, 1.0, 2.0])
        );
    }

    /// Only a result of a recorded operation has a gradient function: not a parameter (a leaf
    /// that requires grad), not an untracked tensor nor what is computed from one.
    #[test]
    fn only_results_of_recorded_operations_have_a_gradient_function() {
        let e = CandleEngine::new();
        let w = e.parameter(&[2], &[1.0, 2.0]).unwrap();
        let plain = CTensor::new(&[1.0f32, 2.0], &Device::Cpu).unwrap();
        assert!(e.requires_grad(&w) && !e.has_grad_fn(&w));
        assert!(e.has_grad_fn(&w.sqr().unwrap().sum_all().unwrap()));
        assert!(!e.requires_grad(&plain) && !e.has_grad_fn(&plain));
        assert!(!e.has_grad_fn(&plain.sqr().unwrap()));
    }

    #[test]
    fn tensors_round_trip_and_bad_input_is_an_error() {
        let e = CandleEngine::new();
        let t = Tensor::from_f32(vec![2, 2], &[1.0, -2.0, 3.5, 4.0]).unwrap();
        let c = e.import(&t, true).unwrap();
        assert!(c.is_variable());
        assert_eq!(c.dims(), &[2, 2]);
        let back = e.export(&c).unwrap();
        assert_eq!(back.shape(), &[2, 2]);
        assert_eq!(back.to_f32_vec().unwrap(), vec![1.0, -2.0, 3.5, 4.0]);
        let i = Tensor::new(DType::I32, vec![1], Storage::Host(vec![0u8; 4].into())).unwrap();
        assert!(e.import(&i, false).unwrap_err().0.contains("f32 and f64"));
        let w = e.parameter(&[2], &[1.0, 2.0]).unwrap();
        let bad = CTensor::new(&[1.0f32], &Device::Cpu).unwrap();
        assert!(e.backward(&[(w.clone(), Some(bad.clone()))]).is_err());
        // What root checks read: a variable and what is computed from it require grad, a
        // constant does not; shapes.
        assert!(e.requires_grad(&w) && e.requires_grad(&w.sqr().unwrap()));
        assert!(!e.requires_grad(&bad) && !e.requires_grad(&bad.sqr().unwrap()));
        assert_eq!(e.shape(&w), vec![2]);
        assert_eq!(e.shape(&w.sum_all().unwrap()), Vec::<usize>::new());
    }
}
