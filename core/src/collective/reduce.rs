//! Element-wise reductions over little-endian byte slices.
//!
//! Tensors travel as raw bytes in little-endian layout (the native layout of every host we run
//! on, so a tensor's storage goes on the wire untouched). The reductions here read and write
//! elements with `from_le_bytes`/`to_le_bytes` on fixed-size chunks, so they work on any
//! alignment and never panic; a length that is not a whole number of elements, or two slices of
//! different lengths, is a typed error.

use std::fmt;

use super::CollectiveError;

/// The element-wise operation a reduction applies.
///
/// Which operations an [`ElementType`] takes follows gloo (see [`ReduceOp::supports`]); a
/// schedule builder refuses any other pair with [`CollectiveError::UnsupportedReduction`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ReduceOp {
    /// Sum. Integers wrap on overflow (two's complement, as PyTorch's integer tensors do);
    /// on `bool` it is a logical or (gloo adds `bool`s and stores the result as a `bool`).
    Sum,
    /// Product. Integers wrap on overflow; on `bool` a logical and.
    Product,
    /// Minimum. For floats a NaN operand makes the result NaN (as `torch.minimum` does).
    Min,
    /// Maximum. For floats a NaN operand makes the result NaN (as `torch.maximum` does).
    Max,
    /// Average: the sum divided by the number of ranks, on floating types only. The sum is
    /// reduced as [`Sum`](Self::Sum) is, and every rank that gets a result divides the same
    /// sum by the same count ([`ReduceOp::finish`]), so results stay bitwise identical.
    Avg,
    /// Bitwise and, on integers and `bool`.
    BAnd,
    /// Bitwise or, on integers and `bool`.
    BOr,
    /// Bitwise exclusive or, on integers and `bool`.
    BXor,
}

impl ReduceOp {
    /// Every operation, for tests and command-line listings. The position of an operation is
    /// its code in a [`Signature`](super::Signature): new ones go at the end.
    pub const ALL: [ReduceOp; 8] = [
        ReduceOp::Sum,
        ReduceOp::Product,
        ReduceOp::Min,
        ReduceOp::Max,
        ReduceOp::Avg,
        ReduceOp::BAnd,
        ReduceOp::BOr,
        ReduceOp::BXor,
    ];

    /// Whether this operation is defined on `element`, as gloo defines it: sum, product, min
    /// and max on every type; band, bor and bxor on integers and `bool`; avg on floating
    /// types.
    pub const fn supports(self, element: ElementType) -> bool {
        match self {
            ReduceOp::Sum | ReduceOp::Product | ReduceOp::Min | ReduceOp::Max => true,
            ReduceOp::Avg => element.is_float(),
            ReduceOp::BAnd | ReduceOp::BOr | ReduceOp::BXor => !element.is_float(),
        }
    }

    /// `Ok` when [`supports`](Self::supports) says so, else the error naming both.
    ///
    /// # Errors
    /// [`CollectiveError::UnsupportedReduction`].
    pub const fn check(self, element: ElementType) -> Result<(), CollectiveError> {
        if self.supports(element) {
            Ok(())
        } else {
            Err(CollectiveError::UnsupportedReduction { op: self, element })
        }
    }

    /// The operation each step of a schedule applies: [`Sum`](Self::Sum) for
    /// [`Avg`](Self::Avg) (the division comes at the end, in [`finish`](Self::finish)), the
    /// operation itself otherwise.
    pub const fn step_op(self) -> ReduceOp {
        match self {
            ReduceOp::Avg => ReduceOp::Sum,
            op => op,
        }
    }

    /// Completes a reduction's result in place once every rank's data is in: divides each
    /// element by `world` for [`Avg`](Self::Avg), does nothing for the others. Floats of
    /// 16 bits are divided in `f32` and rounded back. `data` that is not whole elements is
    /// left as it is (the reduction itself refused it already).
    pub fn finish(self, element: ElementType, data: &mut [u8], world: usize) {
        if self != ReduceOp::Avg || !data.len().is_multiple_of(element.size()) {
            return;
        }
        match element {
            ElementType::F32 => map(data, f32::from_le_bytes, f32::to_le_bytes, |x| {
                x / world as f32
            }),
            ElementType::F64 => map(data, f64::from_le_bytes, f64::to_le_bytes, |x| {
                x / world as f64
            }),
            ElementType::F16 => map(data, f16_load, f16_store, |x| x / world as f32),
            ElementType::BF16 => map(data, bf16_load, bf16_store, |x| x / world as f32),
            _ => {}
        }
    }
}

impl fmt::Display for ReduceOp {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            ReduceOp::Sum => "sum",
            ReduceOp::Product => "product",
            ReduceOp::Min => "min",
            ReduceOp::Max => "max",
            ReduceOp::Avg => "avg",
            ReduceOp::BAnd => "band",
            ReduceOp::BOr => "bor",
            ReduceOp::BXor => "bxor",
        })
    }
}

/// The kind of element a reduction combines; a tensor's dtype maps onto one of these.
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
    /// 16-bit IEEE 754 float (half). Reduced by converting each operand to `f32`, applying
    /// the operation and rounding back to nearest (as gloo's `c10::Half` arithmetic does).
    F16,
    /// bfloat16. Reduced through `f32` like [`F16`](Self::F16).
    BF16,
    /// 8-bit unsigned integer.
    U8,
    /// 8-bit signed integer.
    I8,
    /// Boolean, one byte: 0 is false, anything else is true; results are 0 or 1.
    Bool,
    /// 16-bit signed integer.
    I16,
}

impl ElementType {
    /// Every element type, for tests and command-line listings. The position of a type is its
    /// code in a [`Signature`](super::Signature): new ones go at the end.
    pub const ALL: [ElementType; 10] = [
        ElementType::F32,
        ElementType::F64,
        ElementType::I32,
        ElementType::I64,
        ElementType::F16,
        ElementType::BF16,
        ElementType::U8,
        ElementType::I8,
        ElementType::Bool,
        ElementType::I16,
    ];

    /// The size of one element in bytes.
    pub const fn size(self) -> usize {
        match self {
            ElementType::U8 | ElementType::I8 | ElementType::Bool => 1,
            ElementType::F16 | ElementType::BF16 | ElementType::I16 => 2,
            ElementType::F32 | ElementType::I32 => 4,
            ElementType::F64 | ElementType::I64 => 8,
        }
    }

    /// The element type of a tensor's dtype (every dtype has one).
    pub const fn from_dtype(dtype: crate::tensor::DType) -> Option<Self> {
        use crate::tensor::DType;
        match dtype {
            DType::F32 => Some(ElementType::F32),
            DType::F64 => Some(ElementType::F64),
            DType::I32 => Some(ElementType::I32),
            DType::I64 => Some(ElementType::I64),
            DType::F16 => Some(ElementType::F16),
            DType::BF16 => Some(ElementType::BF16),
            DType::U8 => Some(ElementType::U8),
            DType::I8 => Some(ElementType::I8),
            DType::I16 => Some(ElementType::I16),
            DType::Bool => Some(ElementType::Bool),
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
            ElementType::F16 => DType::F16,
            ElementType::BF16 => DType::BF16,
            ElementType::U8 => DType::U8,
            ElementType::I8 => DType::I8,
            ElementType::I16 => DType::I16,
            ElementType::Bool => DType::Bool,
        }
    }

    /// Whether the type is a floating-point type (its sums depend on the order of operands).
    pub const fn is_float(self) -> bool {
        matches!(
            self,
            ElementType::F32 | ElementType::F64 | ElementType::F16 | ElementType::BF16
        )
    }
}

impl fmt::Display for ElementType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            ElementType::F32 => "f32",
            ElementType::F64 => "f64",
            ElementType::I32 => "i32",
            ElementType::I64 => "i64",
            ElementType::F16 => "f16",
            ElementType::BF16 => "bf16",
            ElementType::U8 => "u8",
            ElementType::I8 => "i8",
            ElementType::I16 => "i16",
            ElementType::Bool => "bool",
        })
    }
}

fn f16_load(b: [u8; 2]) -> f32 {
    half::f16::from_le_bytes(b).to_f32()
}

fn f16_store(x: f32) -> [u8; 2] {
    half::f16::from_f32(x).to_le_bytes()
}

fn bf16_load(b: [u8; 2]) -> f32 {
    half::bf16::from_le_bytes(b).to_f32()
}

fn bf16_store(x: f32) -> [u8; 2] {
    half::bf16::from_f32(x).to_le_bytes()
}

fn bool_load(b: [u8; 1]) -> bool {
    b[0] != 0
}

fn bool_store(x: bool) -> [u8; 1] {
    [u8::from(x)]
}

/// Picks the binary function for a float type (`op` is a step op: no avg, no bitwise op);
/// NaN propagates through min and max, and the left operand wins ties so the result depends
/// only on the (fixed) operand order.
macro_rules! float_op {
    ($op:expr, $t:ty, |$f:ident| $body:expr) => {
        // One arm per operation, so that each loop is compiled with its own operation inlined
        // (a function pointer chosen at run time would be an indirect call per element).
        match $op {
            ReduceOp::Product => {
                let $f = |a: $t, b: $t| a * b;
                $body
            }
            ReduceOp::Min => {
                let $f = |a: $t, b: $t| {
                    if a.is_nan() || (!b.is_nan() && a <= b) {
                        a
                    } else {
                        b
                    }
                };
                $body
            }
            ReduceOp::Max => {
                let $f = |a: $t, b: $t| {
                    if a.is_nan() || (!b.is_nan() && a >= b) {
                        a
                    } else {
                        b
                    }
                };
                $body
            }
            // Sum, and Avg's steps; the bitwise ops were refused before.
            _ => {
                let $f = |a: $t, b: $t| a + b;
                $body
            }
        }
    };
}

/// Picks the binary function for an integer type; sums and products wrap. As `float_op`,
/// one arm per operation.
macro_rules! int_op {
    ($op:expr, $t:ty, |$f:ident| $body:expr) => {
        match $op {
            ReduceOp::Product => {
                let $f = |a: $t, b: $t| a.wrapping_mul(b);
                $body
            }
            ReduceOp::Min => {
                let $f = |a: $t, b: $t| a.min(b);
                $body
            }
            ReduceOp::Max => {
                let $f = |a: $t, b: $t| a.max(b);
                $body
            }
            ReduceOp::BAnd => {
                let $f = |a: $t, b: $t| a & b;
                $body
            }
            ReduceOp::BOr => {
                let $f = |a: $t, b: $t| a | b;
                $body
            }
            ReduceOp::BXor => {
                let $f = |a: $t, b: $t| a ^ b;
                $body
            }
            // Sum (Avg was refused before).
            _ => {
                let $f = |a: $t, b: $t| a.wrapping_add(b);
                $body
            }
        }
    };
}

/// Combines `incoming` into `acc` element by element: `acc[i] = op(incoming[i], acc[i])` when
/// `incoming_first`, else `acc[i] = op(acc[i], incoming[i])`. For [`ReduceOp::Avg`] this is
/// the sum; the division is [`ReduceOp::finish`].
///
/// The operand order matters for bitwise reproducibility of floats (which NaN payload
/// propagates, which zero `min(-0.0, 0.0)` returns, how a sum rounds); the schedules fix it so
/// that every rank computes the same expression. Both slices are little-endian and may have
/// any alignment. `f16` and `bf16` operands are converted to `f32`, combined, and rounded back
/// to nearest at every step, so a result depends only on the operands and their order.
///
/// # Errors
/// [`CollectiveError::UnsupportedReduction`] for an operation the type does not take (see
/// [`ReduceOp::supports`]); [`CollectiveError::ReduceLength`] when the slices differ in length
/// or are not a whole number of elements.
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
    op.check(element)?;
    if acc.len() != incoming.len() || !acc.len().is_multiple_of(element.size()) {
        return Err(CollectiveError::ReduceLength {
            element,
            acc: acc.len(),
            incoming: incoming.len(),
        });
    }
    dispatch(
        op.step_op(),
        element,
        InPlace {
            acc,
            incoming,
            incoming_first,
        },
    );
    Ok(())
}

/// Combines `a` and `b` into `out` element by element: `out[i] = op(a[i], b[i])`, as
/// [`reduce_into`] combines (the same operations, conversions and rounding): the first step of
/// a fold whose first two operands are not its destination, or its last one into the
/// destination, without a copy first.
///
/// # Errors
/// As [`reduce_into`], for `out` and each operand.
pub(super) fn reduce_pair_into(
    op: ReduceOp,
    element: ElementType,
    out: &mut [u8],
    a: &[u8],
    b: &[u8],
) -> Result<(), CollectiveError> {
    op.check(element)?;
    for x in [a, b] {
        if out.len() != x.len() || !out.len().is_multiple_of(element.size()) {
            return Err(CollectiveError::ReduceLength {
                element,
                acc: out.len(),
                incoming: x.len(),
            });
        }
    }
    dispatch(op.step_op(), element, Pair { out, a, b });
    Ok(())
}

/// Runs `pass` with the loads, stores and function of `element` and `op` (a step op).
fn dispatch(op: ReduceOp, element: ElementType, pass: impl Pass) {
    match element {
        ElementType::F32 => float_op!(op, f32, |f| pass.run(
            f32::from_le_bytes,
            f32::to_le_bytes,
            f
        )),
        ElementType::F64 => float_op!(op, f64, |f| pass.run(
            f64::from_le_bytes,
            f64::to_le_bytes,
            f
        )),
        ElementType::F16 => float_op!(op, f32, |f| pass.run(f16_load, f16_store, f)),
        ElementType::BF16 => float_op!(op, f32, |f| pass.run(bf16_load, bf16_store, f)),
        ElementType::I32 => int_op!(op, i32, |f| pass.run(
            i32::from_le_bytes,
            i32::to_le_bytes,
            f
        )),
        ElementType::I64 => int_op!(op, i64, |f| pass.run(
            i64::from_le_bytes,
            i64::to_le_bytes,
            f
        )),
        ElementType::U8 => int_op!(op, u8, |f| pass.run(u8::from_le_bytes, u8::to_le_bytes, f)),
        ElementType::I8 => int_op!(op, i8, |f| pass.run(i8::from_le_bytes, i8::to_le_bytes, f)),
        ElementType::I16 => int_op!(op, i16, |f| pass.run(
            i16::from_le_bytes,
            i16::to_le_bytes,
            f
        )),
        ElementType::Bool => {
            let f: fn(bool, bool) -> bool = match op {
                ReduceOp::Product | ReduceOp::Min | ReduceOp::BAnd => |a, b| a & b,
                ReduceOp::BXor => |a, b| a ^ b,
                // Sum, Max, BOr: or (a sum of bools stored as a bool is true when any is).
                _ => |a, b| a | b,
            };
            pass.run(bool_load, bool_store, f)
        }
    }
}

/// One element-wise pass over bytes, given the element's load, store and binary function.
trait Pass {
    fn run<T: Copy, const W: usize>(
        self,
        load: impl Fn([u8; W]) -> T,
        store: impl Fn(T) -> [u8; W],
        f: impl Fn(T, T) -> T,
    );
}

/// [`reduce_into`]'s pass: into the accumulator.
struct InPlace<'a> {
    acc: &'a mut [u8],
    incoming: &'a [u8],
    incoming_first: bool,
}

impl Pass for InPlace<'_> {
    fn run<T: Copy, const W: usize>(
        self,
        load: impl Fn([u8; W]) -> T,
        store: impl Fn(T) -> [u8; W],
        f: impl Fn(T, T) -> T,
    ) {
        combine(self.acc, self.incoming, self.incoming_first, load, store, f);
    }
}

/// [`reduce_pair_into`]'s pass: two operands into a third place.
struct Pair<'a> {
    out: &'a mut [u8],
    a: &'a [u8],
    b: &'a [u8],
}

impl Pass for Pair<'_> {
    fn run<T: Copy, const W: usize>(
        self,
        load: impl Fn([u8; W]) -> T,
        store: impl Fn(T) -> [u8; W],
        f: impl Fn(T, T) -> T,
    ) {
        // As `combine`: arrays, indexed, one length for all three.
        let (out, _) = self.out.as_chunks_mut::<W>();
        let (a, _) = self.a.as_chunks::<W>();
        let (b, _) = self.b.as_chunks::<W>();
        let n = out.len().min(a.len()).min(b.len());
        let (out, a, b) = (&mut out[..n], &a[..n], &b[..n]);
        for i in 0..n {
            out[i] = store(f(load(a[i]), load(b[i])));
        }
    }
}

fn combine<T: Copy, const W: usize>(
    acc: &mut [u8],
    incoming: &[u8],
    incoming_first: bool,
    load: impl Fn([u8; W]) -> T,
    store: impl Fn(T) -> [u8; W],
    f: impl Fn(T, T) -> T,
) {
    // Whole elements as arrays, indexed: this loop vectorizes however the crate is built. The
    // same loop over `chunks_exact` zipped was about 50 times slower where nothing inlines
    // across codegen units (`lto = "off"` with several), 3.6 ms for 1 MiB of f32.
    let (acc, _) = acc.as_chunks_mut::<W>();
    let (incoming, _) = incoming.as_chunks::<W>();
    let n = acc.len().min(incoming.len());
    let (acc, incoming) = (&mut acc[..n], &incoming[..n]);
    // Two loops, so that neither tests the order per element.
    if incoming_first {
        for i in 0..n {
            acc[i] = store(f(load(incoming[i]), load(acc[i])));
        }
    } else {
        for i in 0..n {
            acc[i] = store(f(load(acc[i]), load(incoming[i])));
        }
    }
}

fn map<T: Copy, const W: usize>(
    data: &mut [u8],
    load: impl Fn([u8; W]) -> T,
    store: impl Fn(T) -> [u8; W],
    f: impl Fn(T) -> T,
) {
    // As `combine`: arrays, indexed.
    for a in data.as_chunks_mut::<W>().0 {
        *a = store(f(load(*a)));
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
        assert_eq!(
            ElementType::from_dtype(crate::tensor::DType::BF16),
            Some(ElementType::BF16)
        );
    }

    /// gloo's table: bitwise ops on integers and bool, avg on floating types, the rest on all.
    #[test]
    fn supported_pairs_follow_gloo_and_the_rest_are_refused_naming_both() {
        for element in ElementType::ALL {
            for op in ReduceOp::ALL {
                let want = match op {
                    ReduceOp::BAnd | ReduceOp::BOr | ReduceOp::BXor => !element.is_float(),
                    ReduceOp::Avg => element.is_float(),
                    _ => true,
                };
                assert_eq!(op.supports(element), want, "{op} on {element}");
                let mut acc = vec![0u8; element.size()];
                let r = reduce_into(op, element, &mut acc, &vec![0u8; element.size()], true);
                if want {
                    assert!(r.is_ok());
                } else {
                    let e = r.unwrap_err();
                    assert_eq!(e, CollectiveError::UnsupportedReduction { op, element });
                    let text = e.to_string();
                    assert!(text.contains(&op.to_string()) && text.contains(&element.to_string()));
                }
            }
        }
        assert_eq!(
            CollectiveError::UnsupportedReduction {
                op: ReduceOp::BXor,
                element: ElementType::BF16
            }
            .to_string(),
            "bxor is not defined on bf16 elements (as in gloo: band, bor and bxor take integers \
             and bool, avg takes floating types)"
        );
    }

    #[test]
    fn half_floats_reduce_through_f32_and_round_to_nearest() {
        use half::{bf16, f16};
        let a = [
            f16::from_f32(1.0),
            f16::from_f32(2048.0),
            f16::from_f32(-0.0),
        ];
        let b = [f16::from_f32(1e-4), f16::from_f32(1.0), f16::from_f32(0.0)];
        let mut acc: Vec<u8> = a.iter().flat_map(|x| x.to_le_bytes()).collect();
        let inc: Vec<u8> = b.iter().flat_map(|x| x.to_le_bytes()).collect();
        reduce_into(ReduceOp::Sum, ElementType::F16, &mut acc, &inc, false).unwrap();
        let got: Vec<f16> = acc
            .chunks_exact(2)
            .map(|c| f16::from_le_bytes([c[0], c[1]]))
            .collect();
        let want: Vec<f16> = a
            .iter()
            .zip(&b)
            .map(|(x, y)| f16::from_f32(x.to_f32() + y.to_f32()))
            .collect();
        assert_eq!(got, want);
        // 2048 + 1 is not representable in f16: rounds to even, back to 2048.
        assert_eq!(got[1], f16::from_f32(2048.0));
        let mut acc = bf16::from_f32(3.0).to_le_bytes().to_vec();
        let inc = bf16::from_f32(0.5).to_le_bytes();
        reduce_into(ReduceOp::Product, ElementType::BF16, &mut acc, &inc, true).unwrap();
        assert_eq!(acc, bf16::from_f32(1.5).to_le_bytes());
        let mut avg = f16::from_f32(3.0).to_le_bytes().to_vec();
        ReduceOp::Avg.finish(ElementType::F16, &mut avg, 4);
        assert_eq!(avg, f16::from_f32(0.75).to_le_bytes());
    }

    #[test]
    fn bytes_and_bools() {
        let mut acc = vec![250u8, 0b1100, 7];
        reduce_into(ReduceOp::Sum, ElementType::U8, &mut acc, &[10, 1, 0], true).unwrap();
        assert_eq!(acc, [4, 0b1101, 7]);
        let mut acc = vec![0b1100u8, 0b1100];
        reduce_into(
            ReduceOp::BXor,
            ElementType::U8,
            &mut acc,
            &[0b1010, 0],
            true,
        )
        .unwrap();
        assert_eq!(acc, [0b0110, 0b1100]);
        let mut acc = vec![(-128i8) as u8, 5];
        reduce_into(
            ReduceOp::Min,
            ElementType::I8,
            &mut acc,
            &[0, (-3i8) as u8],
            true,
        )
        .unwrap();
        assert_eq!(acc, [(-128i8) as u8, (-3i8) as u8]);
        let mut acc = vec![127u8];
        reduce_into(ReduceOp::Sum, ElementType::I8, &mut acc, &[1], true).unwrap();
        assert_eq!(acc, [(-128i8) as u8]);
        // Any nonzero byte is true; results are 0 or 1.
        for (op, want) in [
            (ReduceOp::Sum, [1u8, 1, 1, 0]),
            (ReduceOp::Max, [1, 1, 1, 0]),
            (ReduceOp::BOr, [1, 1, 1, 0]),
            (ReduceOp::Product, [1, 0, 0, 0]),
            (ReduceOp::Min, [1, 0, 0, 0]),
            (ReduceOp::BAnd, [1, 0, 0, 0]),
            (ReduceOp::BXor, [0, 1, 1, 0]),
        ] {
            let mut acc = vec![1u8, 7, 0, 0];
            reduce_into(op, ElementType::Bool, &mut acc, &[9, 0, 1, 0], true).unwrap();
            assert_eq!(acc, want, "{op}");
        }
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
            prop_assume!(op.supports(ElementType::I64));
            let a: Vec<i64> = pairs.iter().map(|p| p.0).collect();
            let b: Vec<i64> = pairs.iter().map(|p| p.1).collect();
            let mut acc = bytes(&a, i64::to_le_bytes);
            reduce_into(op, ElementType::I64, &mut acc, &bytes(&b, i64::to_le_bytes), true).unwrap();
            let want: Vec<i64> = a.iter().zip(&b).map(|(x, y)| match op {
                ReduceOp::Sum => y.wrapping_add(*x),
                ReduceOp::Product => y.wrapping_mul(*x),
                ReduceOp::Min => *x.min(y),
                ReduceOp::Max => *x.max(y),
                ReduceOp::BAnd => x & y,
                ReduceOp::BOr => x | y,
                _ => x ^ y,
            }).collect();
            prop_assert_eq!(acc, bytes(&want, i64::to_le_bytes));
        }
    }
}
