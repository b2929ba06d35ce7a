//! The argument checks and byte layouts the port's default collectives share: a root, a count
//! or a tensor list in range, a rank's share of a buffer, and blocks packed with their lengths.

use bytes::Bytes;

use crate::collective::{CollectiveError, ElementType};
use crate::tensor::Tensor;

use super::{ProcessGroup, ProcessGroupError};

/// [`ProcessGroupError::Arguments`] with [`CollectiveError::RootOutOfRange`] unless `root` is a
/// rank.
pub(super) fn check_root(
    collective: &'static str,
    root: usize,
    world: usize,
) -> Result<(), ProcessGroupError> {
    if root < world {
        Ok(())
    } else {
        Err(ProcessGroupError::Arguments {
            collective,
            source: CollectiveError::RootOutOfRange { root, world },
        })
    }
}

/// [`ProcessGroupError::Arguments`] with [`CollectiveError::LengthsCount`] unless there is one
/// entry per rank.
pub(super) fn check_count(
    collective: &'static str,
    count: usize,
    world: usize,
) -> Result<(), ProcessGroupError> {
    if count == world {
        Ok(())
    } else {
        Err(ProcessGroupError::Arguments {
            collective,
            source: CollectiveError::LengthsCount { lens: count, world },
        })
    }
}

/// Checks a reduce_scatter's arguments and returns the byte range of this rank's chunk.
pub(super) fn chunk_range<P: ProcessGroup + ?Sized>(
    collective: &'static str,
    input_len: usize,
    counts: &[usize],
    element: ElementType,
    group: &P,
) -> Result<std::ops::Range<usize>, ProcessGroupError> {
    check_count(collective, counts.len(), group.size())?;
    let arguments = |source| ProcessGroupError::Arguments { collective, source };
    let bytes = |n: usize| n.checked_mul(element.size());
    let total = counts
        .iter()
        .try_fold(0usize, |acc, c| acc.checked_add(*c))
        .and_then(bytes)
        .ok_or(arguments(CollectiveError::SizeOverflow))?;
    if total != input_len {
        return Err(arguments(CollectiveError::SplitsSum {
            sum: total,
            actual: input_len,
        }));
    }
    let start = bytes(counts[..group.rank()].iter().sum()).unwrap_or(0);
    Ok(start..start + bytes(counts[group.rank()]).unwrap_or(0))
}

/// Blocks as one byte string: their count and lengths (`u64` LE each), then their bytes.
pub(super) fn encode_blocks(blocks: &[Bytes]) -> Vec<u8> {
    let mut out =
        Vec::with_capacity(8 * (blocks.len() + 1) + blocks.iter().map(Bytes::len).sum::<usize>());
    out.extend((blocks.len() as u64).to_le_bytes());
    for b in blocks {
        out.extend((b.len() as u64).to_le_bytes());
    }
    for b in blocks {
        out.extend_from_slice(b);
    }
    out
}

/// The inverse of [`encode_blocks`], for exactly `count` blocks; `None` for anything else.
pub(super) fn decode_blocks(bytes: &[u8], count: usize) -> Option<Vec<Bytes>> {
    let word = |i: usize| -> Option<usize> {
        let raw = bytes.get(8 * i..8 * i + 8)?;
        usize::try_from(u64::from_le_bytes(raw.try_into().ok()?)).ok()
    };
    if word(0)? != count {
        return None;
    }
    let mut offset = 8usize.checked_mul(count.checked_add(1)?)?;
    let mut out = Vec::with_capacity(count);
    for i in 0..count {
        let len = word(i + 1)?;
        let end = offset.checked_add(len)?;
        out.push(Bytes::copy_from_slice(bytes.get(offset..end)?));
        offset = end;
    }
    (offset == bytes.len()).then_some(out)
}

/// Checks that `stacked` (the tensor named `which`) has `one`'s dtype and holds `world` of
/// it along the first dimension (gloo's checks of the `_tensor` collectives).
pub(super) fn check_stacked(
    collective: &'static str,
    which: &'static str,
    stacked: &Tensor,
    one: &Tensor,
    world: usize,
) -> Result<(), ProcessGroupError> {
    let arguments = |source| ProcessGroupError::Arguments { collective, source };
    if stacked.dtype() != one.dtype() {
        return Err(arguments(CollectiveError::TensorType {
            tensor: which,
            expected: format!("{:?}", one.dtype()),
            actual: format!("{:?}", stacked.dtype()),
        }));
    }
    let expected = match one.shape() {
        [] => vec![world],
        [first, rest @ ..] => std::iter::once(first.saturating_mul(world))
            .chain(rest.iter().copied())
            .collect(),
    };
    if stacked.shape() != expected.as_slice() {
        return Err(arguments(CollectiveError::TensorSize {
            tensor: which,
            expected,
            actual: stacked.shape().to_vec(),
        }));
    }
    Ok(())
}

/// Checks a gather's or scatter's tensor list: present (one tensor per rank, each of `one`'s
/// dtype and shape) on the root, absent elsewhere.
pub(super) fn check_list<P: ProcessGroup + ?Sized>(
    collective: &'static str,
    name: &'static str,
    list: Option<&[Tensor]>,
    one: &Tensor,
    root: usize,
    group: &P,
) -> Result<(), ProcessGroupError> {
    let arguments = |source| ProcessGroupError::Arguments { collective, source };
    let on_root = group.rank() == root;
    match list {
        Some(list) if on_root => {
            check_count(collective, list.len(), group.size())?;
            for t in list {
                if t.dtype() != one.dtype() {
                    return Err(arguments(CollectiveError::TensorType {
                        tensor: name,
                        expected: format!("{:?}", one.dtype()),
                        actual: format!("{:?}", t.dtype()),
                    }));
                }
                if t.shape() != one.shape() {
                    return Err(arguments(CollectiveError::TensorSize {
                        tensor: name,
                        expected: one.shape().to_vec(),
                        actual: t.shape().to_vec(),
                    }));
                }
            }
            Ok(())
        }
        None if !on_root => Ok(()),
        _ => Err(arguments(CollectiveError::TensorList {
            list: name,
            on_root,
        })),
    }
}
