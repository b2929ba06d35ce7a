//! References' capabilities: who may become a holder.
//!
//! Reference and fork ids are `{created_on, counter}`, easy to guess, so an id proves nothing.
//! Each reference has a capability ([`RRefSecret`], 128 bits): its creator derives it from
//! its own key (`HMAC-SHA256(key, id)`, the key set by the driver from real entropy, seeded in
//! simulations) and tells the owner in the creation; every worker the reference is passed to
//! receives it in the fork data; a child's fork request presents it, and the owner registers
//! the fork only if it matches ([`ProtocolViolation::ForgedFork`]). A worker that was never
//! given the reference cannot present it, so it never becomes a holder, and only holders are
//! served (`check_holder`).
//!
//! A fork request can overtake the creation (it comes from a third worker, on another link):
//! the owner then keeps the capability presented beside the fork and checks it when the
//! creation arrives, before the value exists and so before anything is served; a forged one
//! then drops its sender ([`Event::Misbehaved`]).
//!
//! Honest use is unchanged: a child's fork request still travels ahead of its fetches and
//! calls on the same link, and is registered at once.

use std::time::Instant;

use crate::capability::{derive, same};

use super::*;

impl<B: Payload> Endpoint<B> {
    /// Sets the key the capabilities of the references created here are derived from. The
    /// driver passes 32 bytes of real entropy (simulations: a seeded generator) before making
    /// any reference; with the default key a peer could compute them.
    pub fn set_secret_key(&mut self, key: [u8; 32]) {
        self.secret_key = key;
    }

    /// The capability of `rref`, a reference created here.
    pub(super) fn secret_of(&self, rref: RRefId) -> RRefSecret {
        derive(
            &self.secret_key,
            b"tensorwire rref capability",
            &[u64::from(rref.created_on), rref.local],
        )
    }

    /// The capability this worker knows for `handle`'s reference (as owner or holder).
    pub(super) fn secret_for(&self, handle: RRefHandle) -> RRefSecret {
        if handle.owner == self.me {
            self.owned
                .get(&handle.rref)
                .and_then(|o| o.secret)
                .unwrap_or_default()
        } else {
            self.used.get(&handle.fork).map_or(0, |u| u.secret)
        }
    }

    /// Whether a fork request from `from` for `fork` of `rref`, presenting `secret`, may be
    /// registered: a reference whose creation has arrived checks it now; otherwise it is
    /// kept and checked then ([`settle_claims`](Self::settle_claims)).
    pub(super) fn check_capability(
        &self,
        from: WorkerId,
        rref: RRefId,
        fork: ForkId,
        secret: RRefSecret,
    ) -> Result<(), ProtocolViolation> {
        match self.owned.get(&rref).and_then(|o| o.secret) {
            Some(known) if !same(known, secret) => Err(ProtocolViolation::ForgedFork {
                rref,
                fork,
                sender: from,
            }),
            _ => Ok(()),
        }
    }

    /// The creation of `rref` arrived with its capability `secret`: the fork requests that
    /// came before it are checked, and the sender of each forged one is handled as lost (its
    /// forks, fetches and calls dropped, so nothing is served to it) and reported. Each claim
    /// is judged by its own sender and capability; claims of the creator's own fork by anyone
    /// else never get here (`check_message` refuses them whatever the order).
    pub(super) fn settle_claims(&mut self, rref: RRefId, secret: RRefSecret, now: Instant) {
        let Some(o) = self.owned.get_mut(&rref) else {
            return;
        };
        o.secret = Some(secret);
        let claims = std::mem::take(&mut o.claims);
        let mut forged = Vec::new();
        for ((fork, sender), claim) in claims {
            if !same(claim, secret) {
                forged.push((sender, ProtocolViolation::ForgedFork { rref, fork, sender }));
            }
        }
        for (sender, violation) in forged {
            let cause = LostCause::Misbehaved(Box::new(violation.clone()));
            // The driver drops the connection on `Misbehaved`, before the loss that
            // `handle_peer_lost` reports after it reaches anyone who might still call the
            // peer through that connection.
            self.events.push_back(Event::Misbehaved {
                peer: sender,
                violation,
            });
            self.handle_peer_lost(sender, cause, now);
        }
    }
}
