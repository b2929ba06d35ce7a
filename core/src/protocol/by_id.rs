//! What waits on our own messages, kept by message id without hashing: an endpoint's ids
//! only grow ([`MessageId`]s are handed out one after another), so a waiter taken just after
//! its message's id is made goes to the back of a queue kept in id order, and is found again
//! by a binary search over the few in flight (one, for a caller that waits on each call).

use std::collections::VecDeque;
use std::task::{Poll, Waker};

use super::MessageId;

/// At least this many entries taken out of the middle before the queue is swept of them.
const SWEEP_FROM: usize = 32;

/// Values under message ids, in id order. One taken from the front goes with the taken ones
/// behind it; one taken from elsewhere leaves an empty entry until it reaches the front or the
/// empty entries are as many as the live ones (then they are swept): the queue holds at most
/// about twice the live values, however many come and go. An id lower than the last one held
/// is put in its place (a binary search and an insert), not refused.
#[derive(Debug)]
pub struct ById<T> {
    queue: VecDeque<(MessageId, Option<T>)>,
    /// Values held (the entries that are not empty).
    live: usize,
}

impl<T> Default for ById<T> {
    fn default() -> Self {
        Self {
            queue: VecDeque::new(),
            live: 0,
        }
    }
}

impl<T> ById<T> {
    /// Keeps `value` under `id`, in place of (and giving back) the one held under it.
    pub fn insert(&mut self, id: MessageId, value: T) -> Option<T> {
        if self.queue.back().is_none_or(|(last, _)| *last < id) {
            self.queue.push_back((id, Some(value)));
            self.live += 1;
            return None;
        }
        match self.position(id) {
            Ok(i) => {
                let old = self.queue[i].1.replace(value);
                if old.is_none() {
                    self.live += 1;
                }
                old
            }
            Err(i) => {
                self.queue.insert(i, (id, Some(value)));
                self.live += 1;
                None
            }
        }
    }

    /// Takes the value under `id`, if one is held.
    pub fn remove(&mut self, id: MessageId) -> Option<T> {
        // The usual case first: the oldest (or the only) one in flight.
        let i = match self.queue.front() {
            Some((first, _)) if *first == id => 0,
            _ => self.position(id).ok()?,
        };
        let value = self.queue[i].1.take()?;
        self.live -= 1;
        while self.queue.front().is_some_and(|(_, v)| v.is_none()) {
            self.queue.pop_front();
        }
        while self.queue.back().is_some_and(|(_, v)| v.is_none()) {
            self.queue.pop_back();
        }
        let empty = self.queue.len() - self.live;
        if empty >= SWEEP_FROM && empty >= self.live {
            self.queue.retain(|(_, v)| v.is_some());
        }
        Some(value)
    }

    /// The value under `id`, if one is held.
    pub fn get_mut(&mut self, id: MessageId) -> Option<&mut T> {
        let i = match self.queue.front() {
            Some((first, _)) if *first == id => 0,
            _ => self.position(id).ok()?,
        };
        self.queue[i].1.as_mut()
    }

    /// The values held, in id order.
    pub fn into_values(self) -> impl Iterator<Item = T> {
        self.queue.into_iter().filter_map(|(_, v)| v)
    }

    /// How many values are held.
    pub fn len(&self) -> usize {
        self.live
    }

    /// Whether no value is held.
    pub fn is_empty(&self) -> bool {
        self.live == 0
    }

    /// Entries kept, empty ones included (what the sweep bounds).
    pub fn entries(&self) -> usize {
        self.queue.len()
    }

    fn position(&self, id: MessageId) -> Result<usize, usize> {
        self.queue.binary_search_by_key(&id, |(at, _)| *at)
    }
}

/// A call's waiter in [`Waiters`]: the task to wake once the call ends, then how it ended.
#[derive(Debug)]
pub enum Waiter<T> {
    /// Not ended: the task to wake when it does (none until first polled).
    Waiting(Option<Waker>),
    /// Ended, not read yet.
    Done(T),
}

/// The waiters of our calls (fetches, remotes) by message id, each read once by the call's
/// future: made when the call is sent, ended by its outcome, taken when read or let go of.
#[derive(Debug)]
pub struct Waiters<T> {
    by_id: ById<Waiter<T>>,
}

impl<T> Default for Waiters<T> {
    fn default() -> Self {
        Self {
            by_id: ById::default(),
        }
    }
}

impl<T> Waiters<T> {
    /// A waiter for call `id`, which wakes `waker` (when known now) once the call ends.
    pub fn wait(&mut self, id: MessageId, waker: Option<Waker>) {
        self.by_id.insert(id, Waiter::Waiting(waker));
    }

    /// Call `id` ended with `outcome`: kept for its future, and the task to wake (after the
    /// caller's lock), if one waits. A call ends once only: a later outcome is dropped, as is
    /// one for a call no longer waited for.
    pub fn end(&mut self, id: MessageId, outcome: T) -> Option<Waker> {
        let waiter = self.by_id.get_mut(id)?;
        match waiter {
            Waiter::Waiting(waker) => {
                let waker = waker.take();
                *waiter = Waiter::Done(outcome);
                waker
            }
            Waiter::Done(_) => None,
        }
    }

    /// Call `id`'s outcome for the task of `waker`: pending while it has not ended (`waker`
    /// kept to be woken, unless the one kept wakes the same task), then its outcome once (the
    /// waiter goes), or `None` when no waiter is left (taken at shutdown, or read already).
    pub fn poll(&mut self, id: MessageId, waker: &Waker) -> Poll<Option<T>> {
        if let Some(Waiter::Waiting(kept)) = self.by_id.get_mut(id) {
            if !kept.as_ref().is_some_and(|k| k.will_wake(waker)) {
                *kept = Some(waker.clone());
            }
            return Poll::Pending;
        }
        Poll::Ready(match self.by_id.remove(id) {
            Some(Waiter::Done(outcome)) => Some(outcome),
            _ => None,
        })
    }

    /// Takes call `id`'s waiter (its future let go of it).
    pub fn remove(&mut self, id: MessageId) -> Option<Waiter<T>> {
        self.by_id.remove(id)
    }

    /// How many calls are waited for (or ended and not read).
    pub fn len(&self) -> usize {
        self.by_id.len()
    }

    /// Whether no call is waited for.
    pub fn is_empty(&self) -> bool {
        self.by_id.is_empty()
    }

    /// At shutdown: takes out the calls still waited for and gives their tasks, to wake once
    /// the caller's lock is let go (each finds its waiter gone). The calls that ended stay for
    /// their futures to read: an outcome that came before the shutdown is still the call's
    /// result (a call awaited only after the shutdown returned).
    pub fn take_waiting(&mut self) -> Vec<Waker> {
        let mut wakers = Vec::new();
        let held = std::mem::take(&mut self.by_id);
        for (id, waiter) in held.queue.into_iter().filter_map(|(id, w)| Some((id, w?))) {
            match waiter {
                Waiter::Waiting(waker) => wakers.extend(waker),
                done @ Waiter::Done(_) => {
                    self.by_id.insert(id, done);
                }
            }
        }
        wakers
    }
}

/// Which waker a waiter was made with (its data and vtable, as [`Waker::will_wake`] compares
/// them), kept without a reference to it: a call's future polled first with that waker has
/// nothing to register.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Registered(usize, usize);

impl Registered {
    /// The identity of `waker`.
    pub fn of(waker: &Waker) -> Self {
        Self(
            waker.data() as usize,
            std::ptr::from_ref(waker.vtable()) as usize,
        )
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use super::*;

    /// The map's answers agree with a `HashMap`'s through ids coming and going in any order,
    /// and the empty entries stay bounded while one value stays held at the front.
    #[test]
    fn agrees_with_a_hash_map_and_stays_bounded() {
        let mut by_id = ById::default();
        let mut map = HashMap::new();
        let mut seed = 0x2545_f491_4f6c_dd1d_u64;
        let mut next = || {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            seed
        };
        assert_eq!(by_id.insert(0, u64::MAX), None);
        map.insert(0, u64::MAX);
        for id in 1..20_000u64 {
            assert_eq!(by_id.insert(id, id), map.insert(id, id));
            // Take some live one now and then, and an id never held or long gone.
            if next() % 3 != 0 {
                let live: Vec<u64> = map.keys().copied().filter(|k| *k != 0).collect();
                if !live.is_empty() {
                    let pick = live[(next() as usize) % live.len()];
                    assert_eq!(by_id.remove(pick), map.remove(&pick));
                }
            }
            let other = next() % (id + 2);
            assert_eq!(by_id.remove(other).is_some(), map.remove(&other).is_some());
            assert_eq!(by_id.len(), map.len());
            assert!(by_id.entries() <= 2 * by_id.len() + SWEEP_FROM, "{id}");
        }
    }

    #[test]
    fn an_id_out_of_order_goes_in_its_place_and_a_held_one_is_replaced() {
        let mut by_id = ById::default();
        by_id.insert(5, 'a');
        by_id.insert(9, 'b');
        assert_eq!(by_id.insert(7, 'c'), None);
        assert_eq!(by_id.insert(9, 'd'), Some('b'));
        *by_id.get_mut(5).unwrap() = 'e';
        assert_eq!(by_id.get_mut(6), None);
        assert_eq!(by_id.remove(5), Some('e'));
        by_id.insert(5, 'a');
        assert_eq!(by_id.len(), 3);
        assert_eq!(by_id.remove(7), Some('c'));
        assert_eq!(by_id.remove(7), None);
        assert_eq!(by_id.remove(5), Some('a'));
        assert_eq!(by_id.remove(9), Some('d'));
        assert!(by_id.is_empty());
        assert_eq!(by_id.entries(), 0);
        by_id.insert(3, 'x');
        by_id.insert(4, 'y');
        by_id.remove(3);
        by_id.insert(2, 'z');
        assert_eq!(by_id.into_values().collect::<String>(), "zy");
    }

    /// Counts its wake-ups.
    struct Count(std::sync::atomic::AtomicUsize);

    impl std::task::Wake for Count {
        fn wake(self: std::sync::Arc<Self>) {
            self.0.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        }
    }

    fn counting() -> (std::sync::Arc<Count>, Waker) {
        let count = std::sync::Arc::new(Count(Default::default()));
        (count.clone(), Waker::from(count))
    }

    fn woken(count: &Count) -> usize {
        count.0.load(std::sync::atomic::Ordering::SeqCst)
    }

    #[test]
    fn a_waiter_wakes_its_latest_task_once_and_gives_its_first_outcome_once() {
        let mut waiters = Waiters::default();
        let (a, waker_a) = counting();
        let (b, waker_b) = counting();
        // Made with no waker: the first poll keeps one; a poll by another task replaces it.
        waiters.wait(1, None);
        assert_eq!(waiters.poll(1, &waker_a), Poll::Pending);
        assert_eq!(waiters.poll(1, &waker_b), Poll::Pending);
        let waker = waiters.end(1, "first").expect("a task waits");
        waker.wake();
        assert_eq!((woken(&a), woken(&b)), (0, 1));
        // Ended once only; read once.
        assert!(waiters.end(1, "second").is_none());
        assert_eq!(waiters.poll(1, &waker_b), Poll::Ready(Some("first")));
        assert_eq!(waiters.poll(1, &waker_b), Poll::Ready(None));
        assert!(waiters.end(1, "late").is_none());
        assert!(waiters.is_empty());
        // Made with a waker: no poll needed to be woken; ended before any poll, read at once.
        waiters.wait(2, Some(waker_a.clone()));
        assert!(waiters
            .end(2, "done")
            .is_some_and(|w| w.will_wake(&waker_a)));
        assert_eq!(waiters.poll(2, &waker_a), Poll::Ready(Some("done")));
        // Shutdown: the calls still waited for are taken out, their tasks handed back, and
        // find nothing; a call that ended before it keeps its outcome for its future (read
        // after the shutdown returned, as the processes' chains test does).
        waiters.wait(3, Some(waker_a.clone()));
        waiters.wait(4, None);
        waiters.wait(5, None);
        waiters.end(5, "unread");
        waiters.wait(6, Some(waker_b.clone()));
        assert_eq!(waiters.len(), 4);
        let wakers = waiters.take_waiting();
        assert_eq!(wakers.len(), 2);
        assert!(wakers[0].will_wake(&waker_a));
        assert!(wakers[1].will_wake(&waker_b));
        assert_eq!(waiters.len(), 1);
        assert_eq!(waiters.poll(3, &waker_a), Poll::Ready(None));
        assert!(waiters.remove(4).is_none());
        assert_eq!(waiters.poll(6, &waker_b), Poll::Ready(None));
        assert_eq!(waiters.poll(5, &waker_a), Poll::Ready(Some("unread")));
        assert!(waiters.is_empty());
        assert_eq!(Registered::of(&waker_a), Registered::of(&waker_a.clone()));
        assert_ne!(Registered::of(&waker_a), Registered::of(&waker_b));
    }
}
