//! A fold of many operands into one destination in one pass: what a rank of the group arena
//! does with its share of a large reduction (see [`arena`](super::arena)'s `ArenaFold`).
//!
//! Folding the operands one by one into the destination ([`reduce_into`] per operand) reads
//! and writes the whole destination once per operand; this folds each block of
//! [`FOLD_BLOCK`] bytes through a scratch block that stays in the first-level cache (the first
//! two operands combined into it, the last one with it into the destination: nothing copied
//! first), so each operand is read once and the destination written once, and one of the
//! operands may be the destination's own bytes (a rank's own input, never copied anywhere). The result is
//! bitwise the one of folding the operands in their order with [`reduce_into`]: the same
//! operations on the same values in the same order.

use super::reduce::reduce_pair_into;
use super::{reduce_into, CollectiveError, ElementType, ReduceOp};

/// Bytes folded at a time: a multiple of every element's size, small enough for the scratch
/// block and a block of each operand to stay in the first-level cache.
pub const FOLD_BLOCK: usize = 4096;

/// Folds `operands`, in their order, into `dst`: `dst = (((o0 op o1) op o2) ...)` element by
/// element, each combination as [`reduce_into`] makes it (`acc = op(acc, next)`). An operand
/// is `Some(bytes)` (as long as `dst`) or `None`: `dst`'s own bytes as they were before the
/// fold. With no operand `dst` is left as it is.
///
/// # Errors
/// As [`reduce_into`]: an operation the type does not take, an operand of another length than
/// `dst`, or a length that is not whole elements; `dst` is unchanged then.
///
/// ```
/// use tensorwire_core::collective::{fold_in_order, ElementType, ReduceOp};
/// let mut mine: Vec<u8> = [1i32, 5].iter().flat_map(|v| v.to_le_bytes()).collect();
/// let a: Vec<u8> = [3i32, 2].iter().flat_map(|v| v.to_le_bytes()).collect();
/// let b: Vec<u8> = [10i32, 20].iter().flat_map(|v| v.to_le_bytes()).collect();
/// fold_in_order(ReduceOp::Sum, ElementType::I32, &mut mine, [Some(&a[..]), None, Some(&b[..])])
///     .unwrap();
/// assert_eq!(mine, [14i32, 27].iter().flat_map(|v| v.to_le_bytes()).collect::<Vec<u8>>());
/// ```
pub fn fold_in_order<'a, I>(
    op: ReduceOp,
    element: ElementType,
    dst: &mut [u8],
    operands: I,
) -> Result<(), CollectiveError>
where
    I: IntoIterator<Item = Option<&'a [u8]>>,
    I::IntoIter: Clone,
{
    let operands = operands.into_iter();
    op.check(element)?;
    let len = dst.len();
    if let Some(bad) = operands
        .clone()
        .flatten()
        .map(<[u8]>::len)
        .find(|l| *l != len)
        .or((!len.is_multiple_of(element.size())).then_some(len))
    {
        return Err(CollectiveError::ReduceLength {
            element,
            acc: len,
            incoming: bad,
        });
    }
    let mut scratch = [0u8; FOLD_BLOCK];
    let mut start = 0;
    while start < len {
        let end = (start + FOLD_BLOCK).min(len);
        let n = end - start;
        let mut rest = operands.clone().peekable();
        let Some(first) = rest.next() else {
            // No operand: nothing to fold.
            return Ok(());
        };
        let Some(second) = rest.next() else {
            if let Some(only) = first {
                dst[start..end].copy_from_slice(&only[start..end]);
            }
            start = end;
            continue;
        };
        if rest.peek().is_none() {
            // Two operands: straight into the destination.
            let d = &mut dst[start..end];
            match (first, second) {
                (None, Some(b)) => reduce_into(op, element, d, &b[start..end], false)?,
                (Some(a), None) => reduce_into(op, element, d, &a[start..end], true)?,
                (Some(a), Some(b)) => {
                    reduce_pair_into(op, element, d, &a[start..end], &b[start..end])?;
                }
                (None, None) => {
                    scratch[..n].copy_from_slice(d);
                    reduce_into(op, element, d, &scratch[..n], false)?;
                }
            }
            start = end;
            continue;
        }
        // The first two into the scratch block, the middle ones into it, the last one with
        // it into the destination: no operand copied anywhere first.
        let acc = &mut scratch[..n];
        {
            let own = &dst[start..end];
            let block = |o: Option<&'a [u8]>| o.map_or(own, |b| &b[start..end]);
            reduce_pair_into(op, element, acc, block(first), block(second))?;
        }
        while let Some(operand) = rest.next() {
            if rest.peek().is_some() {
                let own = &dst[start..end];
                reduce_into(
                    op,
                    element,
                    acc,
                    operand.map_or(own, |b| &b[start..end]),
                    false,
                )?;
                continue;
            }
            let d = &mut dst[start..end];
            match operand {
                None => reduce_into(op, element, d, acc, true)?,
                Some(b) => reduce_pair_into(op, element, d, acc, &b[start..end])?,
            }
        }
        start = end;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn f32s(values: impl IntoIterator<Item = f32>) -> Vec<u8> {
        values.into_iter().flat_map(f32::to_le_bytes).collect()
    }

    /// Every element type and operation, lengths around the block, the own bytes at every
    /// place in the order: bitwise the fold with `reduce_into`, one operand at a time.
    #[test]
    fn a_fold_is_bitwise_the_fold_one_operand_at_a_time() {
        let mut rng = crate::sim::SimRng::new(47);
        for element in ElementType::ALL {
            for op in ReduceOp::ALL.into_iter().filter(|op| op.supports(element)) {
                for (count, k) in [0, 1, 3, FOLD_BLOCK / element.size() + 1, 2 * FOLD_BLOCK + 5]
                    .into_iter()
                    .flat_map(|c| (1..=5).map(move |k| (c, k)))
                {
                    let len = count * element.size();
                    let inputs: Vec<Vec<u8>> = (0..k)
                        .map(|_| (0..len).map(|_| rng.next_u64() as u8).collect())
                        .collect();
                    for own in 0..inputs.len() {
                        let mut want = inputs[0].clone();
                        for x in &inputs[1..] {
                            reduce_into(op, element, &mut want, x, false).unwrap();
                        }
                        let mut got = inputs[own].clone();
                        let order = (0..inputs.len()).map(|q| (q != own).then_some(&inputs[q][..]));
                        fold_in_order(op, element, &mut got, order).unwrap();
                        assert_eq!(got, want, "{element:?} {op} {count} x {k}, own {own}");
                        // The own bytes twice (a fold of a rank's own bytes with themselves).
                        let mut want = inputs[own].clone();
                        reduce_into(op, element, &mut want, &inputs[own], false).unwrap();
                        let mut got = inputs[own].clone();
                        fold_in_order(op, element, &mut got, [None, None]).unwrap();
                        assert_eq!(got, want, "{element:?} {op} {count}, own twice");
                    }
                }
            }
        }
    }

    /// Floats whose sum depends on the order: the fold keeps the order given.
    #[test]
    fn a_fold_keeps_the_order_of_its_operands() {
        let big = f32s([1e8; 3]);
        let small = f32s([1.0; 3]);
        let negative = f32s([-1e8; 3]);
        let mut dst = small.clone();
        fold_in_order(
            ReduceOp::Sum,
            ElementType::F32,
            &mut dst,
            [Some(&big[..]), None, Some(&negative[..])],
        )
        .unwrap();
        // (1e8 + 1) rounds to 1e8 in f32: the small one is lost, as in that order.
        assert_eq!(dst, f32s([0.0; 3]));
        let mut dst = small.clone();
        fold_in_order(
            ReduceOp::Sum,
            ElementType::F32,
            &mut dst,
            [Some(&big[..]), Some(&negative[..]), None],
        )
        .unwrap();
        assert_eq!(dst, small);
    }

    #[test]
    fn a_fold_refuses_operands_that_do_not_fit_and_leaves_its_destination() {
        let mut dst = f32s([1.0, 2.0]);
        let short = f32s([1.0]);
        let err = fold_in_order(
            ReduceOp::Sum,
            ElementType::F32,
            &mut dst,
            [None, Some(&short[..])],
        )
        .unwrap_err();
        assert!(
            matches!(
                err,
                CollectiveError::ReduceLength {
                    acc: 8,
                    incoming: 4,
                    ..
                }
            ),
            "{err}"
        );
        let err =
            fold_in_order(ReduceOp::BXor, ElementType::F32, &mut dst, [None, None]).unwrap_err();
        assert!(
            matches!(err, CollectiveError::UnsupportedReduction { .. }),
            "{err}"
        );
        let mut odd = vec![0u8; 6];
        assert!(fold_in_order(ReduceOp::Sum, ElementType::F32, &mut odd, [None]).is_err());
        assert_eq!(dst, f32s([1.0, 2.0]));
        // No operand: nothing changes.
        fold_in_order(
            ReduceOp::Sum,
            ElementType::F32,
            &mut dst,
            std::iter::empty(),
        )
        .unwrap();
        assert_eq!(dst, f32s([1.0, 2.0]));
    }
}
