//! Arena plans kept between collectives: a plan is a pure function of the rank, the world, the
//! slot size and the collective's arguments ([`arena`](super::arena)), so a group that runs
//! the same small collective again (a barrier, an 8-byte all_reduce in a loop) may run the plan
//! it made last time instead of building the same phases again (several allocations and a walk
//! over the world per call, against a collective that takes a few microseconds).
//!
//! [`PlanCache`] decides what is kept: at most [`PLAN_CACHE_ENTRIES`] plans, each of at most
//! [`PLAN_CACHE_MAX_PHASES`] phases (a large message's plan, with a phase per chunk, is made
//! each time: its copies dwarf the plan), under a key that holds the collective's name and
//! every argument the plan depends on besides rank, world and slot (those are the arena's and
//! never change). A key that does not fit [`PlanKey::new`] is not cached.

use super::arena::ArenaPlan;
use super::{ElementType, ReduceOp};

/// How many plans a [`PlanCache`] keeps.
pub const PLAN_CACHE_ENTRIES: usize = 8;

/// The most phases a plan may have to be kept.
pub const PLAN_CACHE_MAX_PHASES: usize = 2;

/// The most argument words a [`PlanKey`] holds.
pub const PLAN_KEY_WORDS: usize = 4;

/// What a cached plan was made for: the collective and its arguments, exactly (no hash: two
/// keys are equal only when every word is).
#[derive(Debug, Clone, Copy, Eq)]
pub struct PlanKey {
    collective: &'static str,
    len: usize,
    words: [u64; PLAN_KEY_WORDS],
}

impl PartialEq for PlanKey {
    /// The words first, then the collective's name: by its address when both keys hold the
    /// same literal (a repeated collective's key, looked up at every call: no string compare),
    /// by its bytes otherwise.
    fn eq(&self, other: &Self) -> bool {
        self.len == other.len
            && self.words == other.words
            && (std::ptr::eq(self.collective, other.collective)
                || self.collective == other.collective)
    }
}

impl PlanKey {
    /// The key of `collective` with `words`, its arguments besides rank, world and slot (the
    /// arena's); `None` when there are more than [`PLAN_KEY_WORDS`] (such a plan is not kept).
    /// The keys of the collectives below are made by their own functions, which give every
    /// argument a word of its own.
    pub fn new(collective: &'static str, words: &[u64]) -> Option<Self> {
        let mut key = PlanKey {
            collective,
            len: words.len(),
            words: [0; PLAN_KEY_WORDS],
        };
        key.words.get_mut(..words.len())?.copy_from_slice(words);
        Some(key)
    }

    /// [`barrier`](super::arena::barrier)'s key: its plan is kept apart from the others
    /// ([`PlanCache::barrier`]).
    pub fn barrier() -> Option<Self> {
        Some(BARRIER)
    }

    /// [`all_reduce`](super::arena::all_reduce)'s key.
    pub fn all_reduce(count: usize, element: ElementType, op: ReduceOp) -> Option<Self> {
        Self::new(
            "all_reduce",
            &[count as u64, element_word(element), op_word(op)],
        )
    }

    /// [`reduce`](fn@super::arena::reduce)'s key.
    pub fn reduce(root: usize, count: usize, element: ElementType, op: ReduceOp) -> Option<Self> {
        Self::new(
            "reduce",
            &[
                root as u64,
                count as u64,
                element_word(element),
                op_word(op),
            ],
        )
    }

    /// [`broadcast`](super::arena::broadcast)'s key.
    pub fn broadcast(root: usize, len: usize) -> Option<Self> {
        Self::new("broadcast", &[root as u64, len as u64])
    }

    /// [`all_gather`](super::arena::all_gather)'s key when every block has the same length
    /// (`None` otherwise: such a plan is not kept).
    pub fn all_gather(lens: &[usize]) -> Option<Self> {
        let first = *lens.first()?;
        if lens.iter().any(|l| *l != first) {
            return None;
        }
        Self::new("all_gather", &[lens.len() as u64, first as u64])
    }
}

/// The barrier's key (no arguments).
const BARRIER: PlanKey = PlanKey {
    collective: "barrier",
    len: 0,
    words: [0; PLAN_KEY_WORDS],
};

/// `element`'s word: its code in a [`Signature`](super::Signature) (one coder for both).
fn element_word(element: ElementType) -> u64 {
    u64::from(super::signature::element_code(element))
}

/// `op`'s word: its code in a [`Signature`](super::Signature).
fn op_word(op: ReduceOp) -> u64 {
    u64::from(super::signature::op_code(op))
}

/// The plans of one arena, kept between its collectives (see the [module docs](self)). Made
/// for one rank, world and slot size: a plan made for others is never kept.
#[derive(Debug, Clone)]
pub struct PlanCache {
    rank: usize,
    world: usize,
    slot: usize,
    /// The plans, each with the tick of its last use (the least recently used goes first).
    plans: Vec<(PlanKey, ArenaPlan, u64)>,
    /// Counts the uses: the tick of the latest.
    tick: u64,
    /// The barrier's plan, once made: the same at every call, kept apart from the others
    /// (never dropped for them) and lent without a look-up ([`PlanCache::barrier`]).
    barrier: Option<ArenaPlan>,
}

/// A plan from [`PlanCache::plan`]: lent by the cache, or made for this collective alone (one
/// the cache does not keep).
#[derive(Debug)]
pub enum Planned<'c> {
    /// Kept in the cache.
    Kept(&'c ArenaPlan),
    /// Made now, kept nowhere.
    Made(ArenaPlan),
}

impl std::ops::Deref for Planned<'_> {
    type Target = ArenaPlan;

    fn deref(&self) -> &ArenaPlan {
        match self {
            Planned::Kept(plan) => plan,
            Planned::Made(plan) => plan,
        }
    }
}

impl Planned<'_> {
    /// Whether the group runs this plan in the issuing call first (the port's
    /// [`run_now`](crate::ports::process_group::ProcessGroup::run_now): no future, each wait
    /// spinning for at most the spin budget before the rest goes to a future): a kept plan,
    /// a small collective that repeats (a barrier, an 8-byte all_reduce), whose run is a few
    /// microseconds against the future's cost. A plan made for one call (a large message's,
    /// a phase per chunk, or one without a key) runs in a future from its start, whose waits
    /// hand the caller's runtime a turn while they spin.
    pub fn runs_now(&self) -> bool {
        matches!(self, Planned::Kept(_))
    }
}

impl PlanCache {
    /// An empty cache for the plans of `rank` of `world`, with slots of `slot` bytes.
    pub fn new(rank: usize, world: usize, slot: usize) -> Self {
        PlanCache {
            rank,
            world,
            slot,
            plans: Vec::with_capacity(PLAN_CACHE_ENTRIES),
            tick: 0,
            barrier: None,
        }
    }

    /// The barrier's plan for this cache's rank, world and slot size, made the first time
    /// ([`barrier`](super::arena::barrier)) and kept: a barrier, the same every time, takes
    /// its plan without a key to compare. [`plan`](Self::plan) lends the same plan under
    /// [`PlanKey::barrier`] (the plans [`take`](Self::take) and [`keep`](Self::keep) move are
    /// the others).
    ///
    /// # Errors
    /// As [`barrier`](super::arena::barrier) (the first time; nothing is kept then).
    #[inline]
    pub fn barrier(&mut self) -> Result<&ArenaPlan, super::CollectiveError> {
        if self.barrier.is_none() {
            self.barrier = Some(super::arena::barrier(self.rank, self.world, self.slot)?);
        }
        Ok(self.barrier.as_ref().expect("made above"))
    }

    /// The plan kept under `key`, taken out (give it back with [`keep`](Self::keep)), or
    /// `None`.
    pub fn take(&mut self, key: &PlanKey) -> Option<ArenaPlan> {
        let at = self.plans.iter().position(|(k, ..)| k == key)?;
        Some(self.plans.swap_remove(at).1)
    }

    /// The plan under `key`, lent where it is kept (then the most recently used), else made by
    /// `make` and kept if [`keep`](Self::keep) would keep it (lent from there), else made for
    /// this call alone. A plan `make` refuses is returned as its error, and nothing is kept.
    /// Nothing moves when the plan is kept already: the small collectives that repeat (a
    /// barrier, an 8-byte all_reduce in a loop) run their plan where it lies.
    pub fn plan<E>(
        &mut self,
        key: Option<PlanKey>,
        make: impl FnOnce() -> Result<ArenaPlan, E>,
    ) -> Result<Planned<'_>, E> {
        let Some(key) = key else {
            return make().map(Planned::Made);
        };
        if key == BARRIER {
            if self.barrier.is_none() {
                let plan = make()?;
                if !self.keepable(&plan) {
                    return Ok(Planned::Made(plan));
                }
                self.barrier = Some(plan);
            }
            return Ok(Planned::Kept(self.barrier.as_ref().expect("kept above")));
        }
        self.tick += 1;
        if let Some(at) = self.plans.iter().position(|(k, ..)| *k == key) {
            self.plans[at].2 = self.tick;
            return Ok(Planned::Kept(&self.plans[at].1));
        }
        let plan = make()?;
        if !self.keepable(&plan) {
            return Ok(Planned::Made(plan));
        }
        self.insert(key, plan);
        let last = self.plans.len() - 1;
        Ok(Planned::Kept(&self.plans[last].1))
    }

    /// Whether a plan may be kept: of at most [`PLAN_CACHE_MAX_PHASES`] phases, made for this
    /// cache's rank, world and slot size.
    fn keepable(&self, plan: &ArenaPlan) -> bool {
        plan.phases().len() <= PLAN_CACHE_MAX_PHASES
            && (plan.rank(), plan.world(), plan.slot_bytes()) == (self.rank, self.world, self.slot)
    }

    /// Keeps `plan` under `key` (replacing a plan kept under it) as the most recently used,
    /// dropping the least recently used past [`PLAN_CACHE_ENTRIES`].
    fn insert(&mut self, key: PlanKey, plan: ArenaPlan) {
        self.plans.retain(|(k, ..)| *k != key);
        if self.plans.len() >= PLAN_CACHE_ENTRIES {
            if let Some(oldest) = (0..self.plans.len()).min_by_key(|i| self.plans[*i].2) {
                self.plans.swap_remove(oldest);
            }
        }
        self.tick += 1;
        self.plans.push((key, plan, self.tick));
    }

    /// The plan under `key`, from the cache or made by `make` (a plan `make` refuses is
    /// returned as its error, and nothing is kept).
    pub fn take_or<E>(
        &mut self,
        key: Option<PlanKey>,
        make: impl FnOnce() -> Result<ArenaPlan, E>,
    ) -> Result<ArenaPlan, E> {
        match key.and_then(|k| self.take(&k)) {
            Some(plan) => Ok(plan),
            None => make(),
        }
    }

    /// Keeps `plan` under `key` as the most recently used, dropping the least recently used
    /// past [`PLAN_CACHE_ENTRIES`]. Not kept: a plan of more than [`PLAN_CACHE_MAX_PHASES`]
    /// phases, one made for another rank, world or slot size, or one without a key. Returns
    /// whether it was kept.
    pub fn keep(&mut self, key: Option<PlanKey>, plan: ArenaPlan) -> bool {
        let Some(key) = key else {
            return false;
        };
        if !self.keepable(&plan) {
            return false;
        }
        self.insert(key, plan);
        true
    }

    /// How many plans are kept (besides the barrier's).
    pub fn len(&self) -> usize {
        self.plans.len()
    }

    /// Whether no plan is kept (besides the barrier's).
    pub fn is_empty(&self) -> bool {
        self.plans.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::super::arena as plans;
    use super::*;

    const SLOT: usize = 4096;

    fn all_reduce(count: usize) -> ArenaPlan {
        plans::all_reduce(1, 4, count, ElementType::F32, ReduceOp::Sum, SLOT).unwrap()
    }

    fn key(count: u64) -> Option<PlanKey> {
        PlanKey::new("all_reduce", &[0, 401, count])
    }

    #[test]
    fn a_kept_plan_comes_back_only_under_its_own_key() {
        let mut cache = PlanCache::new(1, 4, SLOT);
        assert!(cache.keep(key(2), all_reduce(2)));
        assert_eq!(cache.take(&key(3).unwrap()), None);
        assert_eq!(
            cache.take(&PlanKey::new("reduce", &[0, 401, 2]).unwrap()),
            None
        );
        // A key with fewer words is another key, even where the words it has agree.
        assert_eq!(
            cache.take(&PlanKey::new("all_reduce", &[0, 401]).unwrap()),
            None
        );
        assert_eq!(cache.take(&key(2).unwrap()), Some(all_reduce(2)));
        // Taken out: not there again until it is given back.
        assert_eq!(cache.take(&key(2).unwrap()), None);
        assert!(cache.is_empty());
    }

    #[test]
    fn take_or_makes_a_plan_it_does_not_hold_and_keeps_none_itself() {
        let mut cache = PlanCache::new(1, 4, SLOT);
        let mut made = 0;
        let mut make = || {
            made += 1;
            Ok::<_, ()>(all_reduce(2))
        };
        let plan = cache.take_or(key(2), &mut make).unwrap();
        assert!(cache.is_empty());
        cache.keep(key(2), plan);
        assert_eq!(cache.take_or(key(2), &mut make), Ok(all_reduce(2)));
        assert_eq!(made, 1);
        // A refused plan is the caller's error, and nothing is kept.
        assert_eq!(
            cache.take_or(key(5), || Err::<ArenaPlan, _>("bad")),
            Err("bad")
        );
        assert!(cache.is_empty());
    }

    #[test]
    fn plan_lends_what_it_keeps_and_makes_it_once() {
        let mut cache = PlanCache::new(1, 4, SLOT);
        let mut made = 0;
        for _ in 0..3 {
            let plan = cache
                .plan(key(2), || {
                    made += 1;
                    Ok::<_, ()>(all_reduce(2))
                })
                .unwrap();
            assert!(matches!(plan, Planned::Kept(_)));
            assert_eq!(*plan, all_reduce(2));
        }
        assert_eq!((made, cache.len()), (1, 1));
        assert!(cache.plan(key(2), || Err(())).unwrap().runs_now());
        // Without a key, or too long to keep: made for the call, kept nowhere.
        let plan = cache.plan(None, || Ok::<_, ()>(all_reduce(3))).unwrap();
        assert!(matches!(plan, Planned::Made(_)));
        assert!(!plan.runs_now());
        let long =
            plans::all_reduce(1, 4, 64 * SLOT, ElementType::F32, ReduceOp::Sum, SLOT).unwrap();
        assert!(long.phases().len() > PLAN_CACHE_MAX_PHASES);
        let plan = cache
            .plan(key(64 * SLOT as u64), || Ok::<_, ()>(long.clone()))
            .unwrap();
        assert!(matches!(plan, Planned::Made(ref p) if *p == long));
        assert!(!plan.runs_now());
        // A refused plan is the caller's error, and nothing is kept.
        assert_eq!(
            cache
                .plan(key(5), || Err::<ArenaPlan, _>("bad"))
                .unwrap_err(),
            "bad"
        );
        assert_eq!(cache.len(), 1);
    }

    #[test]
    fn plan_keeps_the_most_recently_used() {
        let mut cache = PlanCache::new(1, 4, SLOT);
        for c in 0..PLAN_CACHE_ENTRIES as u64 {
            cache
                .plan(key(c + 1), || Ok::<_, ()>(all_reduce(c as usize + 1)))
                .unwrap();
        }
        // Key 1, the oldest, is used again: key 2 is now the least recently used.
        let used = cache.plan(key(1), || Err("kept: not made")).unwrap();
        assert_eq!(*used, all_reduce(1));
        cache
            .plan(key(100), || Ok::<_, ()>(all_reduce(100)))
            .unwrap();
        assert_eq!(cache.len(), PLAN_CACHE_ENTRIES);
        assert_eq!(cache.take(&key(2).unwrap()), None);
        assert!(cache.take(&key(1).unwrap()).is_some());
        assert!(cache.take(&key(100).unwrap()).is_some());
    }

    #[test]
    fn every_element_type_and_op_has_a_key_of_its_own() {
        let mut keys = Vec::new();
        for element in ElementType::ALL {
            for op in ReduceOp::ALL {
                keys.push(PlanKey::all_reduce(8, element, op).unwrap());
                keys.push(PlanKey::reduce(0, 8, element, op).unwrap());
            }
        }
        keys.extend([
            PlanKey::all_reduce(9, ElementType::F32, ReduceOp::Sum).unwrap(),
            PlanKey::reduce(1, 8, ElementType::F32, ReduceOp::Sum).unwrap(),
            PlanKey::barrier().unwrap(),
            PlanKey::broadcast(0, 8).unwrap(),
            PlanKey::broadcast(1, 8).unwrap(),
            PlanKey::all_gather(&[8, 8]).unwrap(),
            PlanKey::all_gather(&[8, 8, 8]).unwrap(),
        ]);
        for (i, a) in keys.iter().enumerate() {
            for b in &keys[i + 1..] {
                assert_ne!(a, b);
            }
        }
        // Blocks of different lengths: not kept.
        assert_eq!(PlanKey::all_gather(&[8, 16]), None);
        assert_eq!(PlanKey::all_gather(&[]), None);
    }

    #[test]
    fn keys_are_equal_by_the_names_bytes_not_only_their_address() {
        // The same name at another address (not the literal's) is the same key.
        let elsewhere: &'static str = String::from("barrier").leak();
        assert_eq!(PlanKey::new(elsewhere, &[]), PlanKey::barrier());
        assert_ne!(
            PlanKey::new("broadcast", &[0, 8]),
            PlanKey::new("reduce", &[0, 8])
        );
        assert_ne!(
            PlanKey::new("all_gather", &[2, 8]),
            PlanKey::new("all_gather", &[2, 9])
        );
        assert_ne!(PlanKey::new("barrier", &[]), PlanKey::new("barrier", &[0]));
    }

    #[test]
    fn keys_longer_than_the_words_are_not_cached() {
        assert!(PlanKey::new("all_gather", &[1, 2, 3, 4, 5]).is_none());
        assert!(PlanKey::new("all_gather", &[1, 2, 3, 4]).is_some());
        let mut cache = PlanCache::new(1, 4, SLOT);
        assert!(!cache.keep(None, all_reduce(2)));
        assert!(cache.is_empty());
    }

    #[test]
    fn the_cache_is_bounded_and_drops_the_least_recently_used() {
        let mut cache = PlanCache::new(1, 4, SLOT);
        for c in 0..PLAN_CACHE_ENTRIES as u64 {
            assert!(cache.keep(key(c + 1), all_reduce(c as usize + 1)));
        }
        // Use the oldest: it becomes the newest.
        let oldest = cache.take(&key(1).unwrap()).unwrap();
        cache.keep(key(1), oldest);
        assert!(cache.keep(key(100), all_reduce(100)));
        assert_eq!(cache.len(), PLAN_CACHE_ENTRIES);
        // The one dropped is the second kept, now the least recently used.
        assert_eq!(cache.take(&key(2).unwrap()), None);
        assert!(cache.take(&key(1).unwrap()).is_some());
        assert!(cache.take(&key(100).unwrap()).is_some());
        // Keeping a key again replaces its plan rather than holding two.
        let mut cache = PlanCache::new(1, 4, SLOT);
        cache.keep(key(2), all_reduce(2));
        cache.keep(key(2), all_reduce(2));
        assert_eq!(cache.len(), 1);
    }

    #[test]
    fn long_plans_and_plans_of_another_arena_are_not_kept() {
        let mut cache = PlanCache::new(1, 4, SLOT);
        // A message of many slots: a phase (or two) per chunk.
        let long = all_reduce(64 * SLOT);
        assert!(long.phases().len() > PLAN_CACHE_MAX_PHASES);
        assert!(!cache.keep(key(64 * SLOT as u64), long));
        for other in [
            plans::barrier(2, 4, SLOT).unwrap(),
            plans::barrier(1, 5, SLOT).unwrap(),
            plans::barrier(1, 4, 2 * SLOT).unwrap(),
        ] {
            assert!(!cache.keep(PlanKey::new("barrier", &[]), other));
        }
        assert!(cache.is_empty());
        assert!(cache.keep(
            PlanKey::new("barrier", &[]),
            plans::barrier(1, 4, SLOT).unwrap()
        ));
    }

    #[test]
    fn the_barriers_plan_is_made_once_kept_apart_and_lent_under_its_key_too() {
        let mut cache = PlanCache::new(1, 4, SLOT);
        let first: *const ArenaPlan = cache.barrier().unwrap();
        assert_eq!(
            cache.barrier().unwrap(),
            &plans::barrier(1, 4, SLOT).unwrap()
        );
        // Under its key: the same plan where it lies, not made again.
        let mut made = 0;
        let under_key: *const ArenaPlan = match cache
            .plan(PlanKey::barrier(), || {
                made += 1;
                plans::barrier(1, 4, SLOT)
            })
            .unwrap()
        {
            Planned::Kept(plan) => plan,
            Planned::Made(_) => panic!("the barrier's plan was not kept"),
        };
        assert_eq!((made, under_key), (0, first));
        // The other plans neither count it nor push it out.
        assert!(cache.is_empty());
        for c in 0..2 * PLAN_CACHE_ENTRIES as u64 {
            cache
                .plan(key(c + 1), || Ok::<_, ()>(all_reduce(c as usize + 1)))
                .unwrap();
        }
        assert_eq!(cache.len(), PLAN_CACHE_ENTRIES);
        assert_eq!(cache.barrier().unwrap() as *const ArenaPlan, first);
        // A slot too small for the world: refused, and nothing kept.
        let mut small = PlanCache::new(1, 4, 64);
        assert!(small.barrier().is_err());
        assert!(small.barrier.is_none());
        // Made under its key by a caller for another rank: lent for this call, not kept.
        let mut other = PlanCache::new(1, 4, SLOT);
        let lent = other.plan(PlanKey::barrier(), || plans::barrier(2, 4, SLOT));
        assert!(matches!(lent, Ok(Planned::Made(_))));
        assert!(other.barrier.is_none());
    }
}
