//! The gather's wire formats, both directions in one place: a member's [`Contribution`] (the
//! argument of its call to the leader), the leader's [`GatherOutcome`] (the call's result),
//! and the all_gather values they carry ([`encode_value`], [`decode_value`]). The agent and the
//! `membership` fuzz target read them with these decoders.

use serde::de::DeserializeOwned;
use serde::Serialize;

use super::{Contribution, GatherOutcome};
use crate::codec::{self, Format, Undecodable};

impl Contribution {
    /// Encodes the contribution as the argument of a member's call to the leader.
    pub fn encode(&self) -> Vec<u8> {
        codec::encode(self)
    }

    /// Reads a member's contribution.
    ///
    /// # Errors
    /// [`Undecodable`] ([`Format::GatherContribution`]) when the bytes are no contribution.
    pub fn decode(bytes: &[u8]) -> Result<Contribution, Undecodable> {
        codec::decode(Format::GatherContribution, bytes)
    }
}

impl GatherOutcome {
    /// Encodes the leader's answer as the result of a member's call.
    pub fn encode(&self) -> Vec<u8> {
        codec::encode(self)
    }

    /// Reads the leader's answer (check it with [`resolve`](super::resolve)).
    ///
    /// # Errors
    /// [`Undecodable`] ([`Format::GatherAnswer`]) when the bytes are no answer.
    pub fn decode(bytes: &[u8]) -> Result<GatherOutcome, Undecodable> {
        codec::decode(Format::GatherAnswer, bytes)
    }
}

/// Encodes one member's all_gather value (a [`Contribution`]'s `value`, or a block of a process
/// group's all_gather).
///
/// # Errors
/// postcard's, when the value's `Serialize` fails (its own error, or a sequence of unknown
/// length).
pub fn encode_value<T: Serialize + ?Sized>(value: &T) -> Result<Vec<u8>, postcard::Error> {
    postcard::to_allocvec(value)
}

/// Reads one member's all_gather value.
///
/// # Errors
/// [`Undecodable`] ([`Format::GatherValue`]) when the bytes are no `T`.
pub fn decode_value<T: DeserializeOwned>(bytes: &[u8]) -> Result<T, Undecodable> {
    codec::decode(Format::GatherValue, bytes)
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::protocol::gather::GatherError;

    #[test]
    fn contributions_answers_and_values_round_trip() {
        let c = Contribution {
            name: "b".into(),
            expected: vec![0, 2],
            wait: Duration::from_secs(3),
            value: encode_value(&(7u32, "x")).unwrap(),
        };
        assert_eq!(Contribution::decode(&c.encode()), Ok(c.clone()));
        assert_eq!(decode_value::<(u32, String)>(&c.value), Ok((7, "x".into())));
        for o in [
            GatherOutcome::Done(vec![(0, vec![1]), (2, vec![])]),
            GatherOutcome::Missing(vec![2]),
            GatherOutcome::Failed(GatherError::NoMembers { name: "b".into() }),
        ] {
            assert_eq!(GatherOutcome::decode(&o.encode()), Ok(o));
        }
    }

    #[test]
    fn what_does_not_parse_names_its_format() {
        let bad = [0xff, 0xff, 0xff, 0xff, 0xff, 0xff];
        assert_eq!(
            Contribution::decode(&bad).unwrap_err().format,
            Format::GatherContribution
        );
        assert_eq!(
            GatherOutcome::decode(&bad).unwrap_err().format,
            Format::GatherAnswer
        );
        let e = decode_value::<String>(&bad).unwrap_err();
        assert_eq!(e.format, Format::GatherValue);
        assert!(
            e.to_string()
                .starts_with("an all_gather value that does not parse ("),
            "{e}"
        );
    }
}
