//! Element-wise reductions over little-endian byte slices.
//!
//! Tensors travel as raw bytes in little-endian layout (the native layout of every host we run
//! on, so a tensor's storage goes on the wire untouched). The reductions here read and write
//! elements with `from_le_bytes`/`to_le_bytes` on fixed-size chunks, so they work on any
//! alignment and never panic; a length that is not a whole number of elements, or two slices of
//! different lengths, is a typed error.

use std::fmt;

use super::CollectiveError;

/// The element-wise operation an `all_reduce` applies.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ReduceOp {
    /// Sum. Integers wrap on overflow (two's complement, as PyTorch's integer tensors do).
    Sum,
    /// Product. Integers wrap on overflow.
    Product,
    /// Minimum. For floats a NaN operand makes the result NaN (as `torch.minimum` does).
    Min,
    /// Maximum. For floats a NaN operand makes the result NaN (as `torch.maximum` does).
    Max,
}

impl ReduceOp {
    /// Every operation, for tests and command-line listings.
    pub const ALL: [ReduceOp; 4] = [
        ReduceOp::Sum,
        ReduceOp::Product,
        ReduceOp::Min,
        ReduceOp::Max,
    ];
}

impl fmt::Display for ReduceOp {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            ReduceOp::Sum => "sum",
            ReduceOp::Product => "product",
            ReduceOp::Min => "min",
            ReduceOp::Max => "max",
        })
    }
}

/// The kind of element an `all_reduce` combines; a tensor's dtype maps onto one of these.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ElementType {
    /// 32-bit IEEE 754 float.
    F32,
    /// 64-bit IEEE 754 float.
    F64,
    /// 32-bit signed integer.
    I32,
    /// 64-bit signed integer.
    I64,
}

impl ElementType {
    /// Every element type, for tests and command-line listings.
    pub const ALL: [ElementType; 4] = [
        ElementType::F32,
        ElementType::F64,
        ElementType::I32,
        ElementType::I64,
    ];

    /// The size of one element in bytes.
    pub const fn size(self) -> usize {
        match self {
            ElementType::F32 | ElementType::I32 => 4,
            ElementType::F64 | ElementType::I64 => 8,
        }
    }

    /// The element type of a tensor's dtype, when host reductions support it (`U8`, `F16` and
    /// `BF16` they do not).
    pub const fn from_dtype(dtype: crate::tensor::DType) -> Option<Self> {
        use crate::tensor::DType;
        match dtype {
            DType::F32 => Some(ElementType::F32),
            DType::F64 => Some(ElementType::F64),
            DType::I32 => Some(ElementType::I32),
            DType::I64 => Some(ElementType::I64),
            _ => None,
        }
    }

    /// The tensor dtype of this element type (the inverse of [`from_dtype`](Self::from_dtype)).
    pub const fn dtype(self) -> crate::tensor::DType {
        use crate::tensor::DType;
        match self {
            ElementType::F32 => DType::F32,
            ElementType::F64 => DType::F64,
            ElementType::I32 => DType::I32,
            ElementType::I64 => DType::I64,
        }
    }

    /// Whether the type is a floating-point type (its sums depend on the order of operands).
    pub const fn is_float(self) -> bool {
        matches!(self, ElementType::F32 | ElementType::F64)
    }
}

impl fmt::Display for ElementType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            ElementType::F32 => "f32",
            ElementType::F64 => "f64",
            ElementType::I32 => "i32",
            ElementType::I64 => "i64",
        })
    }
}

/// Picks the binary function for a float type; NaN propagates through min and max, and the
/// left operand wins ties so the result depends only on the (fixed) operand order.
macro_rules! float_op {
    ($op:expr, $t:ty) => {
        match $op {
            ReduceOp::Sum => |a: $t, b: $t| a + b,
            ReduceOp::Product => |a: $t, b: $t| a * b,
            ReduceOp::Min => |a: $t, b: $t| {
                if a.is_nan() || (!b.is_nan() && a <= b) {
                    a
                } else {
                    b
                }
            },
            ReduceOp::Max => |a: $t, b: $t| {
                if a.is_nan() || (!b.is_nan() && a >= b) {
                    a
                } else {
                    b
                }
            },
        }
    };
}

/// Picks the binary function for an integer type; sums and products wrap.
macro_rules! int_op {
    ($op:expr, $t:ty) => {
        match $op {
            ReduceOp::Sum => |a: $t, b: $t| a.wrapping_add(b),
            ReduceOp::Product => |a: $t, b: $t| a.wrapping_mul(b),
            ReduceOp::Min => |a: $t, b: $t| a.min(b),
            ReduceOp::Max => |a: $t, b: $t| a.max(b),
        }
    };
}

/// Combines `incoming` into `acc` element by element: `acc[i] = op(incoming[i], acc[i])` when
/// `incoming_first`, else `acc[i] = op(acc[i], incoming[i])`.
///
/// The operand order matters for bitwise reproducibility of floats (which NaN payload
/// propagates, which zero `min(-0.0, 0.0)` returns); the schedules fix it so that every rank
/// computes the same expression. Both slices are little-endian and may have any alignment.
///
/// # Errors
/// [`CollectiveError::ReduceLength`] when the slices differ in length or are not a whole
/// number of elements.
///
/// ```
/// use tensorwire_core::collective::{reduce_into, ElementType, ReduceOp};
/// let mut acc: Vec<u8> = [1i32, 5].iter().flat_map(|v| v.to_le_bytes()).collect();
/// let incoming: Vec<u8> = [3i32, 2].iter().flat_map(|v| v.to_le_bytes()).collect();
/// reduce_into(ReduceOp::Max, ElementType::I32, &mut acc, &incoming, true).unwrap();
/// assert_eq!(acc, [3i32, 5].iter().flat_map(|v| v.to_le_bytes()).collect::<Vec<u8>>());
/// ```
pub fn reduce_into(
    op: ReduceOp,
    element: ElementType,
    acc: &mut [u8],
    incoming: &[u8],
    incoming_first: bool,
) -> Result<(), CollectiveError> {
    if acc.len() != incoming.len() || acc.len() % element.size() != 0 {
        return Err(CollectiveError::ReduceLength {
            element,
            acc: acc.len(),
            incoming: incoming.len(),
        });
    }
    match element {
        ElementType::F32 => combine(
            acc,
            incoming,
            incoming_first,
            f32::from_le_bytes,
            f32::to_le_bytes,
            float_op!(op, f32),
        ),
        ElementType::F64 => combine(
            acc,
            incoming,
            incoming_first,
            f64::from_le_bytes,
            f64::to_le_bytes,
            float_op!(op, f64),
        ),
        ElementType::I32 => combine(
            acc,
            incoming,
            incoming_first,
            i32::from_le_bytes,
            i32::to_le_bytes,
            int_op!(op, i32),
        ),
        ElementType::I64 => combine(
            acc,
            incoming,
            incoming_first,
            i64::from_le_bytes,
            i64::to_le_bytes,
            int_op!(op, i64),
        ),
    }
    Ok(())
}

fn combine<T: Copy, const W: usize>(
    acc: &mut [u8],
    incoming: &[u8],
    incoming_first: bool,
    load: fn([u8; W]) -> T,
    store: fn(T) -> [u8; W],
    f: fn(T, T) -> T,
) {
    for (a, b) in acc.chunks_exact_mut(W).zip(incoming.chunks_exact(W)) {
        let mut x = [0u8; W];
        x.copy_from_slice(a);
        let mut y = [0u8; W];
        y.copy_from_slice(b);
        let (x, y) = (load(x), load(y));
        let r = if incoming_first { f(y, x) } else { f(x, y) };
        a.copy_from_slice(&store(r));
    }
}

#[cfg(test)]
mod tests {

    #[test]
    fn element_types_and_dtypes_map_both_ways() {
        for e in ElementType::ALL {
            assert_eq!(ElementType::from_dtype(e.dtype()), Some(e));
            assert_eq!(e.dtype().size(), e.size());
        }
        assert_eq!(ElementType::from_dtype(crate::tensor::DType::F16), None);
    }

    use super::*;
    use proptest::prelude::*;

    fn bytes<T: Copy, const W: usize>(v: &[T], f: fn(T) -> [u8; W]) -> Vec<u8> {
        v.iter().flat_map(|x| f(*x)).collect()
    }

    #[test]
    fn integer_ops_wrap_and_order() {
        let mut acc = bytes(&[i32::MAX, 7, -3, 2], i32::to_le_bytes);
        let inc = bytes(&[1, 8, -4, i32::MIN], i32::to_le_bytes);
        let mut sum = acc.clone();
        reduce_into(ReduceOp::Sum, ElementType::I32, &mut sum, &inc, false).unwrap();
        assert_eq!(
            sum,
            bytes(&[i32::MIN, 15, -7, i32::MIN + 2], i32::to_le_bytes)
        );
        reduce_into(ReduceOp::Min, ElementType::I32, &mut acc, &inc, true).unwrap();
        assert_eq!(acc, bytes(&[1, 7, -4, i32::MIN], i32::to_le_bytes));
    }

    #[test]
    fn float_min_max_propagate_nan_and_respect_order() {
        let nan = f64::NAN;
        let mut acc = bytes(&[1.0f64, nan, -0.0, 2.0], f64::to_le_bytes);
        let inc = bytes(&[nan, 1.0, 0.0, 3.0], f64::to_le_bytes);
        reduce_into(ReduceOp::Min, ElementType::F64, &mut acc, &inc, false).unwrap();
        let out: Vec<f64> = acc
            .chunks_exact(8)
            .map(|c| f64::from_le_bytes(c.try_into().unwrap()))
            .collect();
        assert!(out[0].is_nan() && out[1].is_nan());
        // Ties keep the left operand: -0.0 here, +0.0 with the order reversed.
        assert!(out[2] == 0.0 && out[2].is_sign_negative());
        assert_eq!(out[3], 2.0);
        let mut acc = bytes(&[-0.0f64], f64::to_le_bytes);
        reduce_into(
            ReduceOp::Max,
            ElementType::F64,
            &mut acc,
            &bytes(&[0.0f64], f64::to_le_bytes),
            true,
        )
        .unwrap();
        assert!(f64::from_le_bytes(acc.try_into().unwrap()).is_sign_positive());
    }

    #[test]
    fn bad_lengths_are_errors_not_panics() {
        let mut acc = vec![0u8; 8];
        assert_eq!(
            reduce_into(ReduceOp::Sum, ElementType::F64, &mut acc, &[0u8; 4], true),
            Err(CollectiveError::ReduceLength {
                element: ElementType::F64,
                acc: 8,
                incoming: 4
            })
        );
        let mut acc = vec![0u8; 6];
        assert!(reduce_into(ReduceOp::Sum, ElementType::I32, &mut acc, &[0u8; 6], true).is_err());
        let mut acc: Vec<u8> = Vec::new();
        assert!(reduce_into(ReduceOp::Product, ElementType::I64, &mut acc, &[], true).is_ok());
    }

    proptest! {
        // Misaligned views of the same values reduce exactly like the aligned typed loop.
        #[test]
        fn misaligned_f32_sum_matches_typed(
            a in proptest::collection::vec(-1e6f32..1e6, 0..40),
            shift in 0usize..4,
        ) {
            let b: Vec<f32> = a.iter().map(|x| x * 0.5 - 1.0).collect();
            let mut backing = vec![0u8; shift];
            backing.extend(bytes(&a, f32::to_le_bytes));
            let mut inc = vec![0u8; (shift + 1) % 4];
            let inc_start = inc.len();
            inc.extend(bytes(&b, f32::to_le_bytes));
            reduce_into(ReduceOp::Sum, ElementType::F32, &mut backing[shift..], &inc[inc_start..], false)
                .unwrap();
            let want: Vec<f32> = a.iter().zip(&b).map(|(x, y)| x + y).collect();
            prop_assert_eq!(&backing[shift..], &bytes(&want, f32::to_le_bytes)[..]);
        }

        #[test]
        fn i64_ops_match_typed(
            pairs in proptest::collection::vec((any::<i64>(), any::<i64>()), 0..30),
            op in proptest::sample::select(ReduceOp::ALL.to_vec()),
        ) {
            let a: Vec<i64> = pairs.iter().map(|p| p.0).collect();
            let b: Vec<i64> = pairs.iter().map(|p| p.1).collect();
            let mut acc = bytes(&a, i64::to_le_bytes);
            reduce_into(op, ElementType::I64, &mut acc, &bytes(&b, i64::to_le_bytes), true).unwrap();
            let want: Vec<i64> = a.iter().zip(&b).map(|(x, y)| match op {
                ReduceOp::Sum => y.wrapping_add(*x),
                ReduceOp::Product => y.wrapping_mul(*x),
                ReduceOp::Min => *x.min(y),
                ReduceOp::Max => *x.max(y),
            }).collect();
            prop_assert_eq!(acc, bytes(&want, i64::to_le_bytes));
        }
    }
}
