//! The key-value table with parked waiters, shared by the TCP store server and the in-memory
//! store.
//!
//! A waiter is registered with the number of keys it still misses and a channel. Every write
//! to a key (set, add, append, a successful compare_set) decrements the waiters parked on that
//! key; a waiter whose count reaches zero gets its id sent on its channel. Nothing polls.
//!
//! A barrier arrival that does not complete its barrier is parked on the barrier's key in the
//! same way, missing one key, so whatever next writes the key releases it: the arrival that
//! completes the count, or a set, add or append by anyone (as in PyTorch's server, whose
//! barrier waiters share the key's waiting list). An arrival that does not complete the count
//! writes the key without waking anyone, also as PyTorch's server does.
//!
//! The table keeps to a [`Budget`]: how many entries it holds, how large one value may grow
//! (`APPEND` included) and how many bytes of keys and values it holds in all. A write that would
//! pass a bound is refused with a [`BudgetError`] naming it, and changes nothing. Values are
//! shared [`Bytes`], so a reply hands out the stored value without copying it.

use std::collections::{HashMap, VecDeque};

use bytes::Bytes;
use tokio::sync::mpsc::UnboundedSender;

use crate::protocol::parse_c10d_int;

/// Values of at least this many bytes are shared with replies rather than copied into them
/// (so only they can stay in memory after leaving the table).
pub(crate) const SHARED_FROM: usize = 512;

/// Whether a reply still shares `value`.
fn shared_by_a_reply(value: &Bytes) -> bool {
    value.len() >= SHARED_FROM && !value.is_unique()
}

/// The bounds of a table. [`Budget::UNLIMITED`] has none (PyTorch's server has none).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Budget {
    /// Largest value, in bytes, including what `APPEND` grows a value to.
    pub(crate) max_value_len: usize,
    /// Most entries held: keys with a value plus items waiting in queues.
    pub(crate) max_entries: usize,
    /// Most bytes held in all: keys and values (queue names and items included), values
    /// still being written to clients after they left the table, and what the server's
    /// connections hold ([`KvState::set_outside`]).
    pub(crate) max_bytes: usize,
    /// Bytes of `max_bytes` that keys and values may not take, kept for the connections'
    /// requests and replies (so that a full table does not stop the server reading).
    pub(crate) reserve: usize,
}

impl Budget {
    /// No bounds.
    pub(crate) const UNLIMITED: Budget = Budget {
        max_value_len: usize::MAX,
        max_entries: usize::MAX,
        max_bytes: usize::MAX,
        reserve: 0,
    };
}

/// A write refused because it would pass a bound of the table's [`Budget`].
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub(crate) enum BudgetError {
    /// The value would be larger than `max_value_len`.
    #[error("the value would be {len} bytes, over the value size bound of {max} bytes")]
    ValueTooLarge { len: usize, max: usize },
    /// A new entry would pass `max_entries`.
    #[error("the store holds {max} keys, its bound on keys")]
    TooManyEntries { max: usize },
    /// The bytes held would pass what `max_bytes` leaves keys and values.
    #[error(
        "the store would hold {needed} bytes of keys and values, over the {max} bytes its memory \
         budget leaves them now (the rest holds requests, replies and values being written)"
    )]
    OverBudget { needed: usize, max: usize },
}

/// Why a write to the table failed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum AddOrBudget {
    Add(AddError),
    Budget(BudgetError),
}

impl From<AddError> for AddOrBudget {
    fn from(e: AddError) -> Self {
        AddOrBudget::Add(e)
    }
}

impl From<BudgetError> for AddOrBudget {
    fn from(e: BudgetError) -> Self {
        AddOrBudget::Budget(e)
    }
}

/// Identifies one registered wait.
pub(crate) type WaiterId = u64;

struct Waiter {
    remaining: usize,
    owner: u64,
    notify: UnboundedSender<WaiterId>,
}

/// `add` found a value that is not a decimal integer, or the sum overflowed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum AddError {
    NotAnInteger(Vec<u8>),
    Overflow,
}

/// What a barrier arrival found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Arrival {
    /// The count reached the world size (now or earlier): go on.
    Released,
    /// Parked under this id until the count reaches the world size.
    Parked(WaiterId),
}

/// The table. Not synchronised: callers hold it in a mutex that is never held across `.await`.
pub(crate) struct KvState {
    map: HashMap<Vec<u8>, Bytes>,
    queues: HashMap<Vec<u8>, VecDeque<Bytes>>,
    parked: HashMap<Vec<u8>, Vec<WaiterId>>,
    waiters: HashMap<WaiterId, Waiter>,
    next_waiter: WaiterId,
    budget: Budget,
    /// Keys with a value plus queued items.
    entries: usize,
    /// Bytes of keys and values held (a queue's name counted with each of its items).
    held: usize,
    /// Values that left the table (overwritten or deleted) while a reply still shared them,
    /// with their bytes: still memory until the last reply is written ([`sweep`](Self::sweep)).
    detached: Vec<Bytes>,
    detached_bytes: usize,
    /// What the server's connections hold (request buffers, reply copies), told by the server.
    outside: usize,
}

impl Default for KvState {
    fn default() -> Self {
        KvState::with_budget(Budget::UNLIMITED)
    }
}

impl KvState {
    pub(crate) fn with_budget(budget: Budget) -> Self {
        KvState {
            map: HashMap::new(),
            queues: HashMap::new(),
            parked: HashMap::new(),
            waiters: HashMap::new(),
            next_waiter: 0,
            budget,
            entries: 0,
            held: 0,
            detached: Vec::new(),
            detached_bytes: 0,
            outside: 0,
        }
    }

    /// Bytes of keys and values held, with the values that left the table but are still being
    /// written to clients.
    pub(crate) fn bytes_held(&self) -> usize {
        self.held + self.detached_bytes
    }

    /// The server's connections hold `bytes` now (counted against the memory budget).
    pub(crate) fn set_outside(&mut self, bytes: usize) {
        self.outside = bytes;
    }

    /// Bytes of the memory budget not used by anything: keys, values (detached ones
    /// included) and what the connections hold.
    pub(crate) fn room(&self) -> usize {
        self.budget
            .max_bytes
            .saturating_sub(self.bytes_held() + self.outside)
    }

    /// Most bytes keys and values may take now: the budget less the connections' reserve,
    /// what the connections hold and the detached values.
    fn table_limit(&self) -> usize {
        self.budget
            .max_bytes
            .saturating_sub(self.budget.reserve.max(self.outside) + self.detached_bytes)
    }

    /// Forgets the detached values that no reply shares any more.
    pub(crate) fn sweep(&mut self) {
        let mut freed = 0;
        self.detached.retain(|v| {
            let gone = !shared_by_a_reply(v);
            if gone {
                freed += v.len();
            }
            !gone
        });
        self.detached_bytes -= freed;
    }

    /// A value left the table: while a reply shares it, it still counts.
    fn detach(&mut self, value: Bytes) {
        if shared_by_a_reply(&value) {
            self.detached_bytes += value.len();
            self.detached.push(value);
        }
    }

    /// Keys with a value plus items in queues (what the bound on keys bounds).
    pub(crate) fn entries(&self) -> usize {
        self.entries
    }

    /// Checks that `key` may hold a value of `len` bytes; returns the bytes then held.
    fn admit(&self, key: &[u8], len: usize) -> Result<usize, BudgetError> {
        let limit = self.table_limit();
        admit(
            &self.budget,
            self.held,
            self.entries,
            limit,
            key,
            len,
            self.map.get(key),
        )
    }

    /// Stores `value` under `key` within the budget, without waking anyone. The key is
    /// looked up once (hashing it is much of a set's cost) for the check and the store.
    fn put(&mut self, key: &[u8], value: Bytes) -> Result<(), BudgetError> {
        let mut swept = false;
        loop {
            let limit = self.table_limit();
            let (budget, held, entries) = (self.budget, self.held, self.entries);
            let slot = self.map.get_mut(key);
            let admitted = admit(
                &budget,
                held,
                entries,
                limit,
                key,
                value.len(),
                slot.as_deref(),
            );
            match admitted {
                Ok(now_held) => {
                    self.held = now_held;
                    // A key set again keeps its allocation: the value is swapped in place.
                    match slot {
                        Some(slot) => {
                            let old = std::mem::replace(slot, value);
                            self.detach(old);
                        }
                        None => {
                            self.map.insert(key.to_vec(), value);
                            self.entries += 1;
                        }
                    }
                    return Ok(());
                }
                // Values that replies no longer share may be forgotten: then look again.
                Err(BudgetError::OverBudget { .. }) if !swept => {
                    swept = true;
                    self.sweep();
                }
                Err(e) => return Err(e),
            }
        }
    }

    pub(crate) fn set(&mut self, key: &[u8], value: Bytes) -> Result<(), BudgetError> {
        self.put(key, value)?;
        self.wake(key);
        Ok(())
    }

    /// Sets every pair, in order, or none: a pair past a bound refuses them all.
    pub(crate) fn set_all(&mut self, pairs: Vec<(Vec<u8>, Bytes)>) -> Result<(), BudgetError> {
        let b = self.budget;
        self.sweep();
        // Old values still shared by replies are counted as staying in memory.
        let limit = self.table_limit().saturating_sub(
            pairs
                .iter()
                .filter_map(|(k, _)| self.map.get(k).filter(|v| shared_by_a_reply(v)))
                .map(Bytes::len)
                .sum(),
        );
        // What each key would hold after the pairs before it.
        let mut after: HashMap<&[u8], usize> = HashMap::new();
        let (mut entries, mut held) = (self.entries, self.held);
        for (key, value) in &pairs {
            if value.len() > b.max_value_len {
                return Err(BudgetError::ValueTooLarge {
                    len: value.len(),
                    max: b.max_value_len,
                });
            }
            let before = match after.get(key.as_slice()) {
                Some(len) => Some(*len),
                None => self.map.get(key).map(Bytes::len),
            };
            match before {
                Some(len) => held -= key.len() + len,
                None if entries >= b.max_entries => {
                    return Err(BudgetError::TooManyEntries { max: b.max_entries })
                }
                None => entries += 1,
            }
            held = held.saturating_add(key.len() + value.len());
            if held > limit {
                return Err(BudgetError::OverBudget {
                    needed: held,
                    max: limit,
                });
            }
            after.insert(key, value.len());
        }
        drop(after);
        for (key, value) in pairs {
            self.set(&key, value)?;
        }
        Ok(())
    }

    pub(crate) fn get(&self, key: &[u8]) -> Option<&Bytes> {
        self.map.get(key)
    }

    pub(crate) fn add(&mut self, key: &[u8], delta: i64) -> Result<i64, AddOrBudget> {
        let sum = self.sum(key, delta)?;
        self.set(key, Bytes::from(sum.to_string()))?;
        Ok(sum)
    }

    /// The integer held by `key` (missing counts as 0) plus `delta`.
    fn sum(&self, key: &[u8], delta: i64) -> Result<i64, AddError> {
        let current = match self.map.get(key) {
            Some(v) => parse_c10d_int(v).ok_or_else(|| AddError::NotAnInteger(v.to_vec()))?,
            None => 0,
        };
        current.checked_add(delta).ok_or(AddError::Overflow)
    }

    /// Counts one arrival at the barrier `key` on behalf of `owner`. Once the count reaches
    /// `world_size` the arrival is released, with every arrival parked on the key; before that
    /// it is parked and its id will be sent on `notify`. A value that is not an integer, a
    /// count past `i64::MAX` or a count the budget has no room for is an error and leaves the
    /// value as it was.
    pub(crate) fn barrier(
        &mut self,
        key: &[u8],
        world_size: i64,
        owner: u64,
        notify: UnboundedSender<WaiterId>,
    ) -> Result<Arrival, AddOrBudget> {
        let count = self.sum(key, 1)?;
        self.put(key, Bytes::from(count.to_string()))?;
        if count >= world_size {
            self.wake(key);
            return Ok(Arrival::Released);
        }
        Ok(Arrival::Parked(self.register(&[key], owner, notify)))
    }

    pub(crate) fn check<K: AsRef<[u8]>>(&self, keys: &[K]) -> bool {
        keys.iter().all(|k| self.present(k.as_ref()))
    }

    /// A key is present when it has a value or names a non-empty queue (as in c10d).
    fn present(&self, key: &[u8]) -> bool {
        self.map.contains_key(key) || self.queues.get(key).is_some_and(|q| !q.is_empty())
    }

    /// All keys with a value (queues are not keys).
    pub(crate) fn keys(&self) -> impl Iterator<Item = &Vec<u8>> {
        self.map.keys()
    }

    /// Pushes onto a queue and releases one waiter parked on its name.
    pub(crate) fn queue_push(&mut self, key: &[u8], value: Bytes) -> Result<(), BudgetError> {
        let b = &self.budget;
        if value.len() > b.max_value_len {
            return Err(BudgetError::ValueTooLarge {
                len: value.len(),
                max: b.max_value_len,
            });
        }
        if self.entries >= b.max_entries {
            return Err(BudgetError::TooManyEntries { max: b.max_entries });
        }
        let needed = self.held.saturating_add(key.len() + value.len());
        if needed > self.table_limit() {
            self.sweep();
            let max = self.table_limit();
            if needed > max {
                return Err(BudgetError::OverBudget { needed, max });
            }
        }
        self.held = needed;
        self.entries += 1;
        self.queues
            .entry(key.to_vec())
            .or_default()
            .push_back(value);
        self.wake_one(key);
        Ok(())
    }

    /// The length of the queue before the pop, and the popped item when there was one.
    pub(crate) fn queue_pop(&mut self, key: &[u8]) -> (usize, Option<Bytes>) {
        let Some(queue) = self.queues.get_mut(key) else {
            return (0, None);
        };
        let len = queue.len();
        let item = queue.pop_front();
        if let Some(item) = &item {
            self.held -= key.len() + item.len();
            self.entries -= 1;
        }
        if queue.is_empty() {
            self.queues.remove(key);
        }
        (len, item)
    }

    pub(crate) fn queue_len(&self, key: &[u8]) -> usize {
        self.queues.get(key).map_or(0, VecDeque::len)
    }

    /// c10d semantics: a missing key matches an empty `expected`; a missing key with a
    /// non-empty `expected` is left alone and `expected` is returned.
    pub(crate) fn compare_set(
        &mut self,
        key: &[u8],
        expected: &[u8],
        desired: Bytes,
    ) -> Result<Bytes, BudgetError> {
        match self.map.get(key) {
            None if expected.is_empty() => {
                self.set(key, desired.clone())?;
                Ok(desired)
            }
            None => Ok(Bytes::copy_from_slice(expected)),
            Some(current) if current.as_ref() == expected => {
                self.set(key, desired.clone())?;
                Ok(desired)
            }
            Some(current) => Ok(current.clone()),
        }
    }

    pub(crate) fn delete(&mut self, key: &[u8]) -> bool {
        match self.map.remove(key) {
            Some(value) => {
                self.held -= key.len() + value.len();
                self.entries -= 1;
                self.detach(value);
                true
            }
            None => false,
        }
    }

    pub(crate) fn len(&self) -> usize {
        self.map.len()
    }

    /// Appends `value` to the value of `key` (a missing key counts as empty); the grown value
    /// is bound by the value size bound as any other.
    pub(crate) fn append(&mut self, key: &[u8], value: &[u8]) -> Result<(), BudgetError> {
        let old = self.map.get(key).map_or(0, Bytes::len);
        // Checked before anything is allocated.
        self.admit(key, old.saturating_add(value.len()))?;
        let mut grown = Vec::with_capacity(old + value.len());
        grown.extend_from_slice(self.map.get(key).map_or(&[][..], |v| v.as_ref()));
        grown.extend_from_slice(value);
        self.set(key, Bytes::from(grown))
    }

    /// Parks a wait for `keys` on behalf of `owner`. Returns `None` when every key already
    /// exists (answer at once), else the id that will be sent on `notify` once they all do.
    pub(crate) fn park<K: AsRef<[u8]>>(
        &mut self,
        keys: &[K],
        owner: u64,
        notify: UnboundedSender<WaiterId>,
    ) -> Option<WaiterId> {
        let missing: Vec<&[u8]> = keys
            .iter()
            .map(|k| k.as_ref())
            .filter(|k| !self.present(k))
            .collect();
        if missing.is_empty() {
            return None;
        }
        Some(self.register(&missing, owner, notify))
    }

    /// Parks a new waiter on every one of `keys` (each missing once).
    fn register(
        &mut self,
        keys: &[&[u8]],
        owner: u64,
        notify: UnboundedSender<WaiterId>,
    ) -> WaiterId {
        let id = self.next_waiter;
        self.next_waiter += 1;
        for key in keys {
            self.parked.entry(key.to_vec()).or_default().push(id);
        }
        self.waiters.insert(
            id,
            Waiter {
                remaining: keys.len(),
                owner,
                notify,
            },
        );
        id
    }

    /// Removes every parked wait of `owner`; returns how many there were.
    pub(crate) fn cancel_owner(&mut self, owner: u64) -> usize {
        let ids: Vec<WaiterId> = self
            .waiters
            .iter()
            .filter(|(_, w)| w.owner == owner)
            .map(|(id, _)| *id)
            .collect();
        if ids.is_empty() {
            return 0;
        }
        for id in &ids {
            self.waiters.remove(id);
        }
        self.parked.retain(|_, list| {
            list.retain(|id| !ids.contains(id));
            !list.is_empty()
        });
        ids.len()
    }

    /// How many waits `owner` has parked.
    pub(crate) fn parked_by(&self, owner: u64) -> usize {
        self.waiters.values().filter(|w| w.owner == owner).count()
    }

    /// Moves the first waiter parked on `key` one key closer to release (a queue item is
    /// for one consumer only).
    fn wake_one(&mut self, key: &[u8]) {
        let Some(list) = self.parked.get_mut(key) else {
            return;
        };
        let id = list.remove(0);
        if list.is_empty() {
            self.parked.remove(key);
        }
        self.decrement(id);
    }

    fn decrement(&mut self, id: WaiterId) {
        let done = match self.waiters.get_mut(&id) {
            Some(w) => {
                w.remaining -= 1;
                w.remaining == 0
            }
            None => false,
        };
        if done {
            if let Some(w) = self.waiters.remove(&id) {
                // The receiver may be gone (connection closed); nothing to do then.
                let _ = w.notify.send(id);
            }
        }
    }

    fn wake(&mut self, key: &[u8]) {
        let Some(ids) = self.parked.remove(key) else {
            return;
        };
        for id in ids {
            self.decrement(id);
        }
    }
}

/// Whether `key`, whose value now is `old`, may hold a value of `len` bytes in a table that
/// holds `held` bytes in `entries` entries and may hold `limit`; the bytes then held.
fn admit(
    b: &Budget,
    held: usize,
    entries: usize,
    limit: usize,
    key: &[u8],
    len: usize,
    old: Option<&Bytes>,
) -> Result<usize, BudgetError> {
    if len > b.max_value_len {
        return Err(BudgetError::ValueTooLarge {
            len,
            max: b.max_value_len,
        });
    }
    if old.is_none() && entries >= b.max_entries {
        return Err(BudgetError::TooManyEntries { max: b.max_entries });
    }
    let old_len = old.map_or(0, |v| key.len() + v.len());
    let needed = (held - old_len).saturating_add(key.len() + len);
    // An old value that a reply still shares stays in memory (detached).
    let staying = old.filter(|v| shared_by_a_reply(v)).map_or(0, Bytes::len);
    let max = limit.saturating_sub(staying);
    if needed > max {
        return Err(BudgetError::OverBudget { needed, max });
    }
    Ok(needed)
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::sync::mpsc::unbounded_channel;

    fn budget(max_value_len: usize, max_entries: usize, max_bytes: usize) -> Budget {
        Budget {
            max_value_len,
            max_entries,
            max_bytes,
            reserve: 0,
        }
    }

    /// One budget for everything: what the connections hold and the connections' reserve
    /// leave less for keys and values, and a value a reply still shares counts until the
    /// reply lets go of it.
    #[test]
    fn the_budget_counts_connections_and_values_still_being_written() {
        let mut s = KvState::with_budget(Budget {
            reserve: 100,
            ..budget(2000, 100, 2000)
        });
        let value = |n: usize| Bytes::from(vec![0; n]);
        // The reserve is the connections': keys and values get 1900.
        assert!(matches!(
            s.set(b"k", value(1900)),
            Err(BudgetError::OverBudget { max: 1900, .. })
        ));
        s.set(b"k", value(1000)).unwrap();
        // Connections holding more than the reserve leave less still.
        s.set_outside(300);
        assert_eq!(s.room(), 2000 - 1001 - 300);
        assert!(matches!(
            s.set(b"j", value(900)),
            Err(BudgetError::OverBudget { max: 1700, .. })
        ));
        s.set_outside(0);
        // A reply shares the value; deleting it leaves its bytes counted.
        let reply = s.get(b"k").unwrap().clone();
        assert!(s.delete(b"k"));
        assert_eq!(s.bytes_held(), 1000);
        assert!(matches!(
            s.set(b"j", value(1000)),
            Err(BudgetError::OverBudget { max: 900, .. })
        ));
        // Once the reply is written, the bytes are free again.
        drop(reply);
        s.set(b"j", value(1000)).unwrap();
        assert_eq!(s.bytes_held(), 1001);
        // Overwriting a shared value keeps the old one counted too.
        let reply = s.get(b"j").unwrap().clone();
        assert!(matches!(
            s.set(b"j", value(1000)),
            Err(BudgetError::OverBudget { max: 900, .. })
        ));
        s.set(b"j", value(600)).unwrap();
        assert_eq!(s.bytes_held(), 601 + 1000);
        drop(reply);
        s.sweep();
        assert_eq!(s.bytes_held(), 601);
        // Small values are copied into replies, never shared: a clone does not hold them.
        s.set(b"s", value(100)).unwrap();
        let small = s.get(b"s").unwrap().clone();
        assert!(s.delete(b"s"));
        assert_eq!(s.bytes_held(), 601);
        drop(small);
    }

    #[test]
    fn append_stops_at_the_value_size_bound_and_changes_nothing() {
        let mut s = KvState::with_budget(budget(8, 100, 1000));
        s.append(b"k", b"12345").unwrap();
        assert_eq!(
            s.append(b"k", b"6789"),
            Err(BudgetError::ValueTooLarge { len: 9, max: 8 })
        );
        assert_eq!(s.get(b"k").unwrap(), b"12345".as_slice());
        s.append(b"k", b"678").unwrap();
        assert_eq!(s.get(b"k").unwrap(), b"12345678".as_slice());
        assert_eq!(s.bytes_held(), 1 + 8);
        let err = s.append(b"k", b"9").unwrap_err();
        assert!(
            err.to_string().contains("value size bound of 8 bytes"),
            "{err}"
        );
    }

    #[test]
    fn the_bound_on_keys_counts_values_and_queue_items() {
        let mut s = KvState::with_budget(budget(100, 2, 1000));
        s.set(b"a", Bytes::from_static(b"1")).unwrap();
        s.queue_push(b"q", Bytes::from_static(b"x")).unwrap();
        assert_eq!(
            s.set(b"b", Bytes::new()),
            Err(BudgetError::TooManyEntries { max: 2 })
        );
        assert_eq!(
            s.queue_push(b"q", Bytes::new()),
            Err(BudgetError::TooManyEntries { max: 2 })
        );
        assert_eq!(
            s.add(b"c", 1),
            Err(BudgetError::TooManyEntries { max: 2 }.into())
        );
        // Overwriting is no new key; deleting or popping makes room.
        s.set(b"a", Bytes::from_static(b"2")).unwrap();
        assert!(s.delete(b"a"));
        s.set(b"b", Bytes::new()).unwrap();
        assert_eq!(s.queue_pop(b"q").0, 1);
        s.add(b"c", 1).unwrap();
        assert_eq!(s.entries(), 2);
    }

    #[test]
    fn a_multi_set_past_a_bound_sets_nothing() {
        let mut s = KvState::with_budget(budget(10, 3, 30));
        s.set(b"a", Bytes::from_static(b"1")).unwrap();
        let pairs = |list: &[(&[u8], usize)]| -> Vec<(Vec<u8>, Bytes)> {
            list.iter()
                .map(|(k, n)| (k.to_vec(), Bytes::from(vec![0; *n])))
                .collect()
        };
        // Three new keys where two fit.
        assert_eq!(
            s.set_all(pairs(&[(b"b", 1), (b"c", 1), (b"d", 1)])),
            Err(BudgetError::TooManyEntries { max: 3 })
        );
        // The same key twice counts once, with its last value.
        s.set_all(pairs(&[(b"b", 9), (b"b", 2), (b"c", 2)]))
            .unwrap();
        assert_eq!(s.get(b"b").unwrap().len(), 2);
        assert_eq!((s.entries(), s.bytes_held()), (3, 2 + 3 + 3));
        // Growing three values past the bytes: none grows.
        assert!(matches!(
            s.set_all(pairs(&[(b"b", 9), (b"c", 9), (b"a", 10)])),
            Err(BudgetError::OverBudget {
                needed: 31,
                max: 30
            })
        ));
        assert_eq!(s.get(b"b").unwrap().len(), 2);
        assert_eq!(
            s.set_all(pairs(&[(b"a", 1), (b"b", 11)])),
            Err(BudgetError::ValueTooLarge { len: 11, max: 10 })
        );
        assert_eq!(s.get(b"a").unwrap().as_ref(), b"1");
        assert_eq!(s.bytes_held(), 8);
    }

    #[test]
    fn the_memory_budget_counts_keys_and_values_and_is_given_back() {
        let mut s = KvState::with_budget(budget(100, 100, 20));
        s.set(b"k1", Bytes::from(vec![0; 8])).unwrap();
        assert_eq!(s.bytes_held(), 10);
        assert_eq!(
            s.set(b"k2", Bytes::from(vec![0; 9])),
            Err(BudgetError::OverBudget {
                needed: 21,
                max: 20
            })
        );
        assert!(s.get(b"k2").is_none());
        // Replacing a value frees the old one first.
        s.set(b"k1", Bytes::from(vec![0; 18])).unwrap();
        assert_eq!(s.bytes_held(), 20);
        let (tx, _rx) = unbounded_channel();
        assert!(matches!(
            s.barrier(b"b", 2, 1, tx),
            Err(AddOrBudget::Budget(BudgetError::OverBudget { .. }))
        ));
        assert!(s.get(b"b").is_none());
        assert!(matches!(
            s.compare_set(b"k1", &[0; 18], Bytes::from(vec![1; 19])),
            Err(BudgetError::OverBudget {
                needed: 21,
                max: 20
            })
        ));
        assert!(s.delete(b"k1"));
        assert_eq!(s.bytes_held(), 0);
        s.queue_push(b"q", Bytes::from(vec![0; 19])).unwrap();
        assert_eq!(s.bytes_held(), 20);
        s.queue_pop(b"q");
        assert_eq!((s.bytes_held(), s.entries()), (0, 0));
    }

    #[test]
    fn add_keeps_a_decimal_string() {
        let mut s = KvState::default();
        assert_eq!(s.add(b"c", 3), Ok(3));
        assert_eq!(s.add(b"c", -10), Ok(-7));
        assert_eq!(s.get(b"c").unwrap(), b"-7".as_slice());
        s.set(b"x", Bytes::from_static(b"abc")).unwrap();
        assert_eq!(
            s.add(b"x", 1),
            Err(AddError::NotAnInteger(b"abc".to_vec()).into())
        );
        s.set(b"m", Bytes::from(i64::MAX.to_string().into_bytes()))
            .unwrap();
        assert_eq!(s.add(b"m", 1), Err(AddError::Overflow.into()));
    }

    #[test]
    fn compare_set_follows_c10d() {
        let mut s = KvState::default();
        assert_eq!(
            s.compare_set(b"k", b"x", Bytes::from_static(b"new"))
                .unwrap(),
            b"x".as_slice()
        );
        assert!(s.get(b"k").is_none());
        assert_eq!(
            s.compare_set(b"k", b"", Bytes::from_static(b"first"))
                .unwrap(),
            b"first".as_slice()
        );
        assert_eq!(
            s.compare_set(b"k", b"wrong", Bytes::from_static(b"second"))
                .unwrap(),
            b"first".as_slice()
        );
        assert_eq!(
            s.compare_set(b"k", b"first", Bytes::from_static(b"second"))
                .unwrap(),
            b"second".as_slice()
        );
        assert_eq!(s.get(b"k").unwrap(), b"second".as_slice());
    }

    #[test]
    fn a_waiter_fires_once_all_its_keys_exist() {
        let mut s = KvState::default();
        let (tx, mut rx) = unbounded_channel();
        s.set(b"a", Bytes::new()).unwrap();
        assert_eq!(s.park(&[b"a".as_slice()], 1, tx.clone()), None);
        let id = s.park(&[b"a".as_slice(), b"b", b"c"], 1, tx).unwrap();
        s.set(b"b", Bytes::from(vec![1])).unwrap();
        assert!(rx.try_recv().is_err());
        s.append(b"c", b"x").unwrap();
        assert_eq!(rx.try_recv().unwrap(), id);
        assert_eq!(s.parked_by(1), 0);
    }

    #[test]
    fn cancel_removes_only_that_owners_waits() {
        let mut s = KvState::default();
        let (tx1, mut rx1) = unbounded_channel();
        let (tx2, mut rx2) = unbounded_channel();
        s.park(&[b"k".as_slice()], 1, tx1).unwrap();
        let id2 = s.park(&[b"k".as_slice()], 2, tx2).unwrap();
        assert_eq!(s.cancel_owner(1), 1);
        assert_eq!(s.cancel_owner(1), 0);
        s.add(b"k", 1).unwrap();
        assert!(rx1.try_recv().is_err());
        assert_eq!(rx2.try_recv().unwrap(), id2);
    }

    #[test]
    fn a_queue_push_releases_one_waiter_and_queues_are_not_keys() {
        let mut s = KvState::default();
        let (tx, mut rx) = unbounded_channel();
        let first = s.park(&[b"q".as_slice()], 1, tx.clone()).unwrap();
        let second = s.park(&[b"q".as_slice()], 2, tx).unwrap();
        s.queue_push(b"q", Bytes::from_static(b"a")).unwrap();
        assert_eq!(rx.try_recv().unwrap(), first);
        assert!(rx.try_recv().is_err());
        s.queue_push(b"q", Bytes::from_static(b"b")).unwrap();
        assert_eq!(rx.try_recv().unwrap(), second);
        assert!(s.check(&[b"q".as_slice()]));
        assert_eq!(s.len(), 0);
        assert_eq!(s.queue_len(b"q"), 2);
        assert_eq!(s.queue_pop(b"q"), (2, Some(Bytes::from_static(b"a"))));
        assert_eq!(s.queue_pop(b"q"), (1, Some(Bytes::from_static(b"b"))));
        assert_eq!(s.queue_pop(b"q"), (0, None));
        assert!(!s.check(&[b"q".as_slice()]));
    }

    #[test]
    fn a_barrier_releases_every_arrival_once_the_count_reaches_the_world_size() {
        let mut s = KvState::default();
        let (tx, mut rx) = unbounded_channel();
        let first = s.barrier(b"b", 3, 1, tx.clone()).unwrap();
        let Arrival::Parked(first) = first else {
            panic!("the first of three went through: {first:?}")
        };
        let Arrival::Parked(second) = s.barrier(b"b", 3, 2, tx.clone()).unwrap() else {
            panic!("the second of three went through")
        };
        // The count is an ordinary key, and an arrival short of the world size wakes nobody.
        assert_eq!(s.get(b"b").unwrap(), b"2".as_slice());
        assert_eq!(s.len(), 1);
        assert!(rx.try_recv().is_err());
        assert_eq!(s.barrier(b"b", 3, 3, tx.clone()), Ok(Arrival::Released));
        let mut released = [rx.try_recv().unwrap(), rx.try_recv().unwrap()];
        released.sort_unstable();
        assert_eq!(released, [first, second]);
        assert!(rx.try_recv().is_err());
        // Never reset: a later arrival on the key goes through at once.
        assert_eq!(s.barrier(b"b", 3, 4, tx), Ok(Arrival::Released));
        assert_eq!(s.get(b"b").unwrap(), b"4".as_slice());
    }

    #[test]
    fn a_cancelled_arrival_has_still_counted() {
        let mut s = KvState::default();
        let (tx, mut rx) = unbounded_channel();
        assert!(matches!(
            s.barrier(b"lonely", 2, 1, tx.clone()),
            Ok(Arrival::Parked(_))
        ));
        assert_eq!(s.cancel_owner(1), 1);
        assert_eq!(s.barrier(b"lonely", 2, 2, tx), Ok(Arrival::Released));
        assert!(rx.try_recv().is_err());
        assert_eq!(s.get(b"lonely").unwrap(), b"2".as_slice());
    }

    #[test]
    fn a_world_size_of_one_or_less_goes_through_at_once() {
        let mut s = KvState::default();
        let (tx, _rx) = unbounded_channel();
        for (key, world_size) in [(b"one", 1), (b"nil", 0), (b"neg", -5)] {
            assert_eq!(
                s.barrier(key, world_size, 1, tx.clone()),
                Ok(Arrival::Released)
            );
            assert_eq!(s.get(key).unwrap(), b"1".as_slice());
        }
    }

    #[test]
    fn a_wait_on_the_key_is_released_with_the_barrier_not_by_an_earlier_arrival() {
        // PyTorch's server, observed: a `wait` parked before the first arrival stays parked
        // until the count reaches the world size.
        let mut s = KvState::default();
        let (tx, mut rx) = unbounded_channel();
        let waiting = s.park(&[b"w".as_slice()], 1, tx.clone()).unwrap();
        let Arrival::Parked(arrived) = s.barrier(b"w", 2, 2, tx.clone()).unwrap() else {
            panic!("the first of two went through")
        };
        assert!(rx.try_recv().is_err());
        assert_eq!(s.barrier(b"w", 2, 3, tx), Ok(Arrival::Released));
        let mut released = [rx.try_recv().unwrap(), rx.try_recv().unwrap()];
        released.sort_unstable();
        assert_eq!(released, [waiting, arrived]);
    }

    #[test]
    fn a_set_on_the_key_releases_a_parked_arrival() {
        // PyTorch's server, observed: barrier arrivals wait in the key's waiting list.
        let mut s = KvState::default();
        let (tx, mut rx) = unbounded_channel();
        let Arrival::Parked(id) = s.barrier(b"s", 5, 1, tx).unwrap() else {
            panic!("went through")
        };
        s.set(b"s", Bytes::from_static(b"7")).unwrap();
        assert_eq!(rx.try_recv().unwrap(), id);
    }

    #[test]
    fn a_barrier_on_a_bad_count_changes_nothing() {
        let mut s = KvState::default();
        let (tx, _rx) = unbounded_channel();
        s.set(b"text", Bytes::from_static(b"abc")).unwrap();
        assert_eq!(
            s.barrier(b"text", 2, 1, tx.clone()),
            Err(AddError::NotAnInteger(b"abc".to_vec()).into())
        );
        assert_eq!(s.get(b"text").unwrap(), b"abc".as_slice());
        let max = i64::MAX.to_string().into_bytes();
        s.set(b"full", Bytes::from(max.clone())).unwrap();
        assert_eq!(s.barrier(b"full", 2, 1, tx), Err(AddError::Overflow.into()));
        assert_eq!(s.get(b"full").unwrap(), &max);
        assert_eq!(s.parked_by(1), 0);
    }

    #[test]
    fn deletes_and_counts() {
        let mut s = KvState::default();
        s.set(b"a", Bytes::new()).unwrap();
        s.set(b"b", Bytes::new()).unwrap();
        assert_eq!(s.len(), 2);
        assert!(s.delete(b"a"));
        assert!(!s.delete(b"a"));
        assert_eq!(s.len(), 1);
        assert!(s.check(&[b"b".as_slice()]));
        assert!(!s.check(&[b"a".as_slice(), b"b"]));
    }
}
