//! A phase's folds ([`ArenaFold`]): the same range of several ranks' halves and this rank's
//! own bytes, folded in the plan's order into this rank's buffer in one pass (core's
//! [`fold_in_order`]), after the phase's reads.

use tensorwire_core::collective::arena::ArenaFold;
use tensorwire_core::collective::fold_in_order;

use super::*;

impl Arena {
    /// Applies `fold` of a plan whose reduction is `reduction`, over `buffer`, from the halves
    /// `half` of the ranks it names (they published the phase: the caller waited for them).
    pub(super) fn fold(
        &self,
        fold: &ArenaFold,
        reduction: Option<(ElementType, ReduceOp)>,
        half: usize,
        buffer: Buffer,
    ) {
        let len = fold.to.len();
        assert!(
            fold.from + len <= self.slot
                && fold.to.end <= buffer.len
                && fold.order.iter().all(|q| *q < self.world)
        );
        let (element, op) = reduction.expect("checked before the phases");
        // SAFETY: the destination is in the buffer (asserted), which is not in the mapping,
        // initialised (the caller's promise: the plan's own bytes are its input) and referred
        // to by nothing else meanwhile.
        let dst = unsafe { std::slice::from_raw_parts_mut(buffer.ptr.add(fold.to.start), len) };
        let operands = fold.order.iter().map(|&q| {
            (q != self.rank).then(|| {
                // SAFETY: in the mapping (asserted above: `from + len` within a half of rank
                // q's slot); the writer published this half before the counter we waited for
                // and does not write it again before we publish the next phase. A misbehaving
                // rank of the group could still change the bytes: they are plain bytes to us.
                unsafe {
                    std::slice::from_raw_parts(
                        self.slot_ptr(q, half).add(fold.from) as *const u8,
                        len,
                    )
                }
            })
        });
        fold_in_order(op, element, dst, operands).expect("reductions checked before the phases");
    }
}
