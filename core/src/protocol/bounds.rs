//! What a peer can make this endpoint hold, counted per peer and bounded: the references it
//! holds on values owned here (`EndpointConfig::references_per_peer`), the owner records its
//! fork requests made for references not created here (`pending_forks_per_peer`) and its
//! fetches parked on values being created (`parked_fetches_per_peer`).
//!
//! Every count a bound reads is kept up to date as records come and go, so reading it is
//! O(1) whatever the peer holds: a peer that floods up to a bound costs time linear in its
//! messages. (The pending forks were counted by walking the sender's records for each fork
//! request: 16,384 forged requests, the bound, cost the victim about 34 s of CPU.)

use std::time::Instant;

use super::*;
use crate::budget::{Admit, OverBudget, Use};

/// What one idempotence record is counted as in the peer's budget (an id in an ordered set).
pub const IDEMPOTENCE_RECORD_BYTES: usize = 16;
/// What one reference a peer holds here (a fork record), or one owner record its fork request
/// made, is counted as in the peer's budget.
pub const REFERENCE_RECORD_BYTES: usize = 64;
/// What one fetch parked on a value being created is counted as in the caller's budget.
pub const PARKED_FETCH_BYTES: usize = 64;

impl<B: Payload> Endpoint<B> {
    /// The forks `peer` holds of values owned here.
    pub(super) fn references_of(&self, peer: WorkerId) -> usize {
        self.references.get(&peer).copied().unwrap_or(0)
    }

    /// A fork record for `holder` was made (`new`: not there before).
    pub(super) fn count_reference(&mut self, holder: WorkerId, new: bool) {
        if new && holder != self.me {
            *self.references.entry(holder).or_insert(0) += 1;
            self.charge_records(holder);
        }
    }

    /// The bytes of `peer`'s records here, as its budget counts them: idempotence records,
    /// references it holds, owner records its fork requests made, fetches it parked.
    pub(super) fn records_bytes(&self, peer: WorkerId) -> usize {
        let idempotence = self.seen_control.get(&peer).map_or(0, |s| s.ids.len());
        idempotence * IDEMPOTENCE_RECORD_BYTES
            + (self.references_of(peer) + self.pending_forks_of(peer)) * REFERENCE_RECORD_BYTES
            + self.parked_fetches_of(peer) * PARKED_FETCH_BYTES
    }

    /// Brings `peer`'s charge for records in the budget ([`EndpointConfig::peer_budget`]) to
    /// what its records hold now. The records exist already, so a growth is always counted;
    /// what may be refused is refused before a record is made ([`Self::records_fit`]).
    pub(super) fn charge_records(&mut self, peer: WorkerId) {
        if peer == self.me {
            return;
        }
        let bytes = self.records_bytes(peer);
        let before = self.records_charged.get(&peer).copied().unwrap_or(0);
        if bytes == before {
            return;
        }
        let account = self.budget.account(peer);
        if bytes > before {
            let _ = account.take(Use::Records, bytes - before, Admit::Always);
        } else {
            account.release(Use::Records, before - bytes);
        }
        if bytes == 0 {
            self.records_charged.remove(&peer);
        } else {
            self.records_charged.insert(peer, bytes);
        }
    }

    /// Whether `bytes` more of records for `peer` fit in its budget.
    pub(super) fn records_fit(&self, peer: WorkerId, bytes: usize) -> Result<(), OverBudget> {
        if peer == self.me {
            return Ok(());
        }
        self.budget.account(peer).check(Use::Records, bytes)
    }

    /// Answers request `id` from `from` with [`RemoteErrorKind::Busy`] naming the budget it
    /// would pass (`over`).
    pub(super) fn refuse_over_budget(&mut self, from: WorkerId, id: MessageId, over: &OverBudget) {
        let err = RemoteError {
            worker: self.me,
            kind: RemoteErrorKind::Busy,
            message: format!("worker {} refused it: {over}", self.me),
        };
        self.reply(from, id, Err(err));
    }

    /// The fork record of `holder` (if one was removed) is gone.
    pub(super) fn uncount_reference(&mut self, holder: Option<WorkerId>) {
        let Some(holder) = holder else {
            return;
        };
        if let Some(n) = self.references.get_mut(&holder) {
            *n = n.saturating_sub(1);
            if *n == 0 {
                self.references.remove(&holder);
            }
        }
        self.charge_records(holder);
    }

    /// Answers `remote` request `id` from `from` with [`RemoteErrorKind::Busy`]: `from` holds
    /// its share of references here ([`EndpointConfig::references_per_peer`]).
    pub(super) fn refuse_references(
        &mut self,
        from: WorkerId,
        id: MessageId,
        body: Option<B>,
        now: Instant,
    ) {
        let limit = self.config.references_per_peer;
        let err = RemoteError {
            worker: self.me,
            kind: RemoteErrorKind::Busy,
            message: format!(
                "worker {} already holds {limit} references for worker {from}, its bound per \
                 peer (references_per_peer)",
                self.me
            ),
        };
        self.reply(from, id, Err(err));
        if let Some(b) = body {
            self.release_forks(b.forks(), now);
        }
    }

    /// Whether the per-peer counts of references agree with the fork records (tests).
    #[cfg(test)]
    pub(crate) fn reference_counts_agree(&self) -> bool {
        let mut counted: HashMap<WorkerId, usize> = HashMap::default();
        for o in self.owned.values() {
            for &(_, holder) in &o.forks {
                if holder != self.me {
                    *counted.entry(holder).or_insert(0) += 1;
                }
            }
        }
        counted == self.references
    }

    /// Owner records `peer`'s fork requests made for references not created here (being
    /// created, or failed) and not released since.
    pub(super) fn pending_forks_of(&self, peer: WorkerId) -> usize {
        self.placeholders.get(&peer).copied().unwrap_or(0)
    }

    /// `from`'s fork request made the owner record of `rref`, not created here: it counts
    /// against `from`'s bound until the value is kept or the record goes.
    pub(super) fn note_placeholder(&mut self, from: WorkerId, rref: RRefId) {
        let Some(o) = self.owned.get_mut(&rref) else {
            return;
        };
        if o.placeholder_of.is_none() && !matches!(o.state, Some(Ok(()))) {
            o.placeholder_of = Some(from);
            *self.placeholders.entry(from).or_insert(0) += 1;
            self.charge_records(from);
        }
    }

    /// The value of `rref` is kept now: its record no longer counts as a placeholder.
    pub(super) fn placeholder_kept(&mut self, rref: RRefId) {
        let of = self
            .owned
            .get_mut(&rref)
            .and_then(|o| o.placeholder_of.take());
        self.uncount_placeholder(of);
    }

    /// A placeholder record of `of` (if any) is gone.
    pub(super) fn uncount_placeholder(&mut self, of: Option<WorkerId>) {
        let Some(peer) = of else {
            return;
        };
        if let Some(n) = self.placeholders.get_mut(&peer) {
            *n = n.saturating_sub(1);
            if *n == 0 {
                self.placeholders.remove(&peer);
            }
        }
        self.charge_records(peer);
    }

    /// `peer` is gone (lost, or a new incarnation joined): the placeholder records it made
    /// count for nobody (they stay while others hold forks of them).
    pub(super) fn forget_placeholders_of(&mut self, peer: WorkerId) {
        if self.placeholders.remove(&peer).is_none() {
            return;
        }
        for o in self.owned.values_mut() {
            if o.placeholder_of == Some(peer) {
                o.placeholder_of = None;
            }
        }
        self.charge_records(peer);
    }

    /// Fetches from `peer` parked on values being created here.
    pub(super) fn parked_fetches_of(&self, peer: WorkerId) -> usize {
        self.parked.of(peer)
    }

    /// Takes the fetches parked on `rref` (to answer them, or because they are gone).
    pub(super) fn take_parked_fetches(&mut self, rref: RRefId) -> Vec<ParkedFetch> {
        let fetches = self
            .owned
            .get_mut(&rref)
            .map(|o| std::mem::take(&mut o.fetches))
            .unwrap_or_default();
        for &(from, id, _) in &fetches {
            self.parked.remove(from, id);
            self.charge_records(from);
        }
        fetches
    }

    /// Whether the per-peer counts of the bounds (pending forks, parked fetches) agree with
    /// the records they count (tests).
    #[cfg(test)]
    pub(crate) fn pending_counts_agree(&self) -> bool {
        let mut placeholders: HashMap<WorkerId, usize> = HashMap::default();
        let mut parked = ParkedCounts::default();
        for o in self.owned.values() {
            if let Some(peer) = o.placeholder_of {
                if matches!(o.state, Some(Ok(()))) {
                    return false;
                }
                *placeholders.entry(peer).or_insert(0) += 1;
            }
            for &(from, id, _) in &o.fetches {
                parked.add(from, id);
            }
        }
        // Every peer's charge is what its records hold, in the budget too.
        let charged = self.records_charged.iter().all(|(&peer, &bytes)| {
            bytes > 0
                && bytes == self.records_bytes(peer)
                && self.budget.held(peer).records == bytes
        });
        let every_peer_charged = self
            .seen_control
            .keys()
            .chain(self.references.keys())
            .chain(self.placeholders.keys())
            .all(|peer| {
                *peer == self.me
                    || self.records_bytes(*peer)
                        == self.records_charged.get(peer).copied().unwrap_or(0)
            });
        placeholders == self.placeholders && parked == self.parked && charged && every_peer_charged
    }
}

/// A value that counts each use of it (each access through `Deref`: one lookup, or one walk,
/// of the map it holds), for tests that bound the work a message costs. Only in the crate's
/// tests (`OwnedRecords`).
#[cfg(test)]
#[derive(Debug, Default)]
pub(crate) struct Lookups<T> {
    inner: T,
    uses: std::sync::atomic::AtomicU64,
}

#[cfg(test)]
impl<T> Lookups<T> {
    /// How many times it was used so far.
    pub(crate) fn uses(&self) -> u64 {
        self.uses.load(std::sync::atomic::Ordering::Relaxed)
    }
}

#[cfg(test)]
impl<T> std::ops::Deref for Lookups<T> {
    type Target = T;
    fn deref(&self) -> &T {
        self.uses.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        &self.inner
    }
}

#[cfg(test)]
impl<T> std::ops::DerefMut for Lookups<T> {
    fn deref_mut(&mut self) -> &mut T {
        *self.uses.get_mut() += 1;
        &mut self.inner
    }
}

#[cfg(test)]
impl<B: Payload> Endpoint<B> {
    /// How many times the owner records were looked up (or walked) so far.
    pub(crate) fn owned_lookups(&self) -> u64 {
        self.owned.uses()
    }
}

/// A fetch parked on a value being created: its caller, the caller's id, its deadline.
pub(super) type ParkedFetch = (WorkerId, MessageId, Option<Instant>);

/// The fetches parked on values being created here (their records are the owners'
/// `Owned::fetches`), counted per caller for
/// [`EndpointConfig::parked_fetches_per_peer`] and by id (a fetch repeated while it is parked
/// is refused), so that neither check walks them.
#[derive(Debug, Default, PartialEq, Eq)]
pub(super) struct ParkedCounts {
    per_peer: HashMap<WorkerId, usize>,
    ids: HashSet<(WorkerId, MessageId)>,
}

impl ParkedCounts {
    /// Fetch `id` from `from` parked.
    pub(super) fn add(&mut self, from: WorkerId, id: MessageId) {
        if self.ids.insert((from, id)) {
            *self.per_peer.entry(from).or_insert(0) += 1;
        }
    }

    /// Fetch `id` from `from` is no longer parked.
    pub(super) fn remove(&mut self, from: WorkerId, id: MessageId) {
        if self.ids.remove(&(from, id)) {
            if let Some(n) = self.per_peer.get_mut(&from) {
                *n -= 1;
                if *n == 0 {
                    self.per_peer.remove(&from);
                }
            }
        }
    }

    /// Whether fetch `id` from `from` is parked.
    pub(super) fn contains(&self, from: WorkerId, id: MessageId) -> bool {
        self.ids.contains(&(from, id))
    }

    /// How many fetches from `peer` are parked.
    pub(super) fn of(&self, peer: WorkerId) -> usize {
        self.per_peer.get(&peer).copied().unwrap_or(0)
    }

    /// `peer` is lost: its parked fetches are dropped.
    pub(super) fn forget(&mut self, peer: WorkerId) {
        if self.per_peer.remove(&peer).is_some() {
            self.ids.retain(|&(from, _)| from != peer);
        }
    }
}
