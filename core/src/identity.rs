//! What a peer's credentials prove about who it is, and whether they let it claim a rank.
//!
//! A transport authenticates every connection before a frame is read, but credentials differ
//! in what they prove:
//!
//! - a **cluster secret** (TCP, shared memory) is the same bytes on every member: it proves
//!   membership only ([`Credentials::Membership`]); any member may claim any rank or name;
//! - a **node certificate** (QUIC) is issued for names ([`Credentials::Certified`]). A
//!   certificate issued for [`rank_name`]`(n)` (`rank-N`, as `tensorwire launch` issues them)
//!   is a *rank certificate*: its holder may claim rank `n` and no other.
//!
//! [`check_rank_claim`] is the one decision: the mesh asks it of every hello (the accepting
//! side: the rank the dialler says it is) and of every connection it dials (the rank it meant
//! to reach). It binds ranks wherever a certificate names one, and, once this worker's own
//! certificate names a rank (a rank-certified cluster), refuses peers whose certificate names
//! none. What it proves holds only while the CA key is held by no worker.
//!
//! ```
//! use tensorwire_core::identity::{check_rank_claim, rank_name, Credentials, RankBinding};
//!
//! let own = Credentials::certified([rank_name(0)]);
//! let peer = Credentials::certified([rank_name(1)]);
//! assert_eq!(check_rank_claim(&own, &peer, 1), Ok(RankBinding::Certified(1)));
//! let err = check_rank_claim(&own, &peer, 2).unwrap_err();
//! assert_eq!((err.claimed, err.certified.as_slice()), (2, &[1][..]));
//! // A cluster secret proves membership only.
//! let secret = Credentials::Membership;
//! assert_eq!(check_rank_claim(&secret, &secret, 7), Ok(RankBinding::Membership));
//! ```

/// The prefix of a rank certificate's name: `rank-0`, `rank-1`, ...
pub const RANK_NAME_PREFIX: &str = "rank-";

/// The name a certificate for rank `rank` is issued for (its common name and a DNS name):
/// `rank-N`.
pub fn rank_name(rank: u32) -> String {
    format!("{RANK_NAME_PREFIX}{rank}")
}

/// The rank a certificate name certifies: `Some(n)` for exactly `rank-N` (decimal, no sign, no
/// leading zero, within `u32`), `None` for any other name.
pub fn rank_of_name(name: &str) -> Option<u32> {
    let digits = name.strip_prefix(RANK_NAME_PREFIX)?;
    let canonical = !digits.is_empty()
        && digits.bytes().all(|b| b.is_ascii_digit())
        && (digits == "0" || !digits.starts_with('0'));
    if !canonical {
        return None;
    }
    digits.parse().ok()
}

/// What a peer's (or this worker's own) credentials say about who it is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Credentials {
    /// A shared secret (or no authentication): membership of the cluster, no identity.
    Membership,
    /// A certificate (verified against the cluster CA by the transport) issued for these
    /// names: its common names and DNS subject alternative names.
    Certified {
        /// The names, as the certificate spells them.
        names: Vec<String>,
    },
}

impl Credentials {
    /// Credentials certified for `names`.
    pub fn certified<S: Into<String>>(names: impl IntoIterator<Item = S>) -> Self {
        Credentials::Certified {
            names: names.into_iter().map(Into::into).collect(),
        }
    }

    /// The ranks these credentials certify, ascending and without repeats (empty for
    /// membership, or a certificate that names no `rank-N`).
    pub fn ranks(&self) -> Vec<u32> {
        let Credentials::Certified { names } = self else {
            return Vec::new();
        };
        let mut ranks: Vec<u32> = names.iter().filter_map(|n| rank_of_name(n)).collect();
        ranks.sort_unstable();
        ranks.dedup();
        ranks
    }

    /// Whether these are a rank certificate's (they certify at least one rank).
    pub fn is_rank_certified(&self) -> bool {
        !self.ranks().is_empty()
    }
}

/// What a rank claim that passed [`check_rank_claim`] is worth.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RankBinding {
    /// Nothing binds the rank: the peer proved membership only (a secret, or a certificate
    /// that names no rank in a cluster that does not require rank certificates).
    Membership,
    /// The peer's certificate is issued for this rank: no other member can claim it.
    Certified(u32),
}

/// A peer's credentials do not let it be the rank it claims (or the rank this worker dialled).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{}", self.describe())]
pub struct RankClaimError {
    /// The rank claimed (or expected of the peer dialled).
    pub claimed: u32,
    /// The ranks its certificate is issued for (empty: it names none).
    pub certified: Vec<u32>,
    /// The names its certificate is issued for, for the message.
    pub names: Vec<String>,
}

impl RankClaimError {
    fn describe(&self) -> String {
        match self.certified.as_slice() {
            [] => format!(
                "a peer claimed rank {} with a certificate that names no rank (issued for {}), \
                 in a cluster of rank certificates",
                self.claimed,
                if self.names.is_empty() {
                    "no name".to_owned()
                } else {
                    self.names.join(", ")
                }
            ),
            ranks => format!(
                "a peer claimed rank {} with a certificate issued for rank {}",
                self.claimed,
                ranks
                    .iter()
                    .map(u32::to_string)
                    .collect::<Vec<_>>()
                    .join(", ")
            ),
        }
    }
}

/// Whether a peer with credentials `peer` may be rank `claimed`, as seen by a worker whose own
/// credentials are `own`:
///
/// - a peer whose certificate names ranks may be one of those ranks only;
/// - when this worker's own certificate names a rank (a cluster of rank certificates), a peer
///   whose certificate names none is refused too (it cannot be told from an impostor);
/// - otherwise (a secret, or certificates of names only) the claim is believed as a member's:
///   [`RankBinding::Membership`].
pub fn check_rank_claim(
    own: &Credentials,
    peer: &Credentials,
    claimed: u32,
) -> Result<RankBinding, RankClaimError> {
    let certified = peer.ranks();
    let refused = |certified: Vec<u32>| {
        let names = match peer {
            Credentials::Certified { names } => names.clone(),
            Credentials::Membership => Vec::new(),
        };
        RankClaimError {
            claimed,
            certified,
            names,
        }
    };
    if certified.is_empty() {
        if own.is_rank_certified() {
            return Err(refused(certified));
        }
        return Ok(RankBinding::Membership);
    }
    if certified.contains(&claimed) {
        Ok(RankBinding::Certified(claimed))
    } else {
        Err(refused(certified))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rank_names_round_trip_and_nothing_else_is_one() {
        for r in [0, 1, 9, 10, 4095, u32::MAX] {
            assert_eq!(rank_of_name(&rank_name(r)), Some(r));
        }
        for not in [
            "rank-",
            "rank-01",
            "rank--1",
            "rank-+1",
            "rank-1a",
            "Rank-1",
            "rank-1 ",
            "rank1",
            "w1",
            "rank-4294967296",
            "",
            "xrank-1",
        ] {
            assert_eq!(rank_of_name(not), None, "{not:?}");
        }
    }

    #[test]
    fn a_rank_certificate_lets_its_holder_claim_that_rank_only() {
        let own = Credentials::certified([rank_name(0)]);
        let one = Credentials::certified(["tensorwire.cluster".to_owned(), rank_name(1)]);
        assert_eq!(
            check_rank_claim(&own, &one, 1),
            Ok(RankBinding::Certified(1))
        );
        let err = check_rank_claim(&own, &one, 2).unwrap_err();
        assert_eq!(err.claimed, 2);
        assert_eq!(err.certified, vec![1]);
        let text = err.to_string();
        assert!(
            text.contains("claimed rank 2") && text.contains("issued for rank 1"),
            "{text}"
        );
        // It binds whatever this worker holds: a secret-less membership or a name certificate.
        for own in [Credentials::Membership, Credentials::certified(["w0"])] {
            assert!(check_rank_claim(&own, &one, 2).is_err());
            assert_eq!(
                check_rank_claim(&own, &one, 1),
                Ok(RankBinding::Certified(1))
            );
        }
    }

    #[test]
    fn a_cluster_of_rank_certificates_refuses_peers_that_name_no_rank() {
        let own = Credentials::certified([rank_name(3)]);
        for peer in [Credentials::Membership, Credentials::certified(["w1"])] {
            let err = check_rank_claim(&own, &peer, 1).unwrap_err();
            assert!(err.certified.is_empty());
            assert!(err.to_string().contains("names no rank"), "{err}");
        }
        // Without a rank certificate of its own, a worker believes members' claims.
        for own in [Credentials::Membership, Credentials::certified(["w0"])] {
            for peer in [Credentials::Membership, Credentials::certified(["w1"])] {
                assert_eq!(
                    check_rank_claim(&own, &peer, 5),
                    Ok(RankBinding::Membership)
                );
            }
        }
    }

    #[test]
    fn ranks_are_sorted_and_unique() {
        let c = Credentials::certified([rank_name(4), "x".into(), rank_name(2), rank_name(4)]);
        assert_eq!(c.ranks(), vec![2, 4]);
        assert!(c.is_rank_certified());
        assert!(!Credentials::Membership.is_rank_certified());
        // A certificate for two ranks may claim either (its issuer meant it), nothing else.
        assert!(check_rank_claim(&Credentials::Membership, &c, 2).is_ok());
        assert!(check_rank_claim(&Credentials::Membership, &c, 4).is_ok());
        assert!(check_rank_claim(&Credentials::Membership, &c, 3).is_err());
    }
}
