//! A reduce through the arena as both paths make it (the future's `Group::arena_reduce` and
//! the synchronous path's): one place for its signature, plan key, plan and copy.

use super::*;

/// A reduce through the arena, as both paths run it ([`Group::arena_reduce`], and the
/// synchronous one): its signature, plan key and plan, and the copy a rank that is not the
/// root reduces.
#[derive(Debug, Clone, Copy)]
pub(in crate::group) struct ArenaReduce {
    pub(in crate::group) signature: u64,
    pub(in crate::group) key: Option<PlanKey>,
    rank: usize,
    world: usize,
    root: usize,
    count: usize,
    element: ElementType,
    op: ReduceOp,
}

impl ArenaReduce {
    /// A reduce of `len` bytes of `element` to `root` by `group`'s rank, or the caller's error
    /// for bytes that are not whole elements.
    pub(in crate::group) fn new(
        group: &Group,
        len: usize,
        element: ElementType,
        op: ReduceOp,
        root: usize,
    ) -> Result<Self, ProcessGroupError> {
        let count = whole_elements("reduce", len, element)?;
        let signature = Signature::Reduce {
            op,
            element,
            root: root as u32,
            count: count as u64,
        }
        .word(&[]);
        Ok(ArenaReduce {
            signature,
            key: PlanKey::reduce(root, count, element, op),
            rank: group.rank(),
            world: group.size(),
            root,
            count,
            element,
            op,
        })
    }

    /// Whether this rank is the root (it reduces into its own tensor).
    pub(in crate::group) fn at_root(&self) -> bool {
        self.rank == self.root
    }

    /// The plan, from the arena's slot size.
    pub(in crate::group) fn make(
        self,
    ) -> impl Fn(usize) -> Result<ArenaPlan, CollectiveError> + Copy + Send + 'static {
        let r = self;
        move |s| plans::reduce(r.rank, r.world, r.root, r.count, r.element, r.op, s)
    }

    /// What a rank that is not the root reduces: a copy, so that its own tensor stays as it
    /// was.
    pub(in crate::group) fn scratch(data: &[u8]) -> Vec<u8> {
        data.to_vec()
    }
}
