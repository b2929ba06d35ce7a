//! What a peer can make this endpoint hold, counted per peer and bounded: the references it
//! holds on values owned here (`EndpointConfig::references_per_peer`) and its parked fetches.

use std::time::Instant;

use super::*;

impl<B: Payload> Endpoint<B> {
    /// The forks `peer` holds of values owned here.
    pub(super) fn references_of(&self, peer: WorkerId) -> usize {
        self.references.get(&peer).copied().unwrap_or(0)
    }

    /// A fork record for `holder` was made (`new`: not there before).
    pub(super) fn count_reference(&mut self, holder: WorkerId, new: bool) {
        if new && holder != self.me {
            *self.references.entry(holder).or_insert(0) += 1;
        }
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
        let mut counted: HashMap<WorkerId, usize> = HashMap::new();
        for o in self.owned.values() {
            for &(_, holder) in &o.forks {
                if holder != self.me {
                    *counted.entry(holder).or_insert(0) += 1;
                }
            }
        }
        counted == self.references
    }

    /// Fetches from `peer` parked on values being created here. Counted when a fetch would
    /// park (rare: only values still being created hold any), so no count has to follow every
    /// way a parked fetch ends.
    pub(super) fn parked_fetches_of(&self, peer: WorkerId) -> usize {
        self.owned
            .values()
            .filter(|o| !o.fetches.is_empty())
            .map(|o| o.fetches.iter().filter(|f| f.0 == peer).count())
            .sum()
    }
}
