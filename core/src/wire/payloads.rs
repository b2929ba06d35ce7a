//! [`Payloads`]: a frame's list of payloads, with no allocation of its own for one payload.

use bytes::Bytes;

/// A frame's payloads, in order. Holds one payload (a message's encoded value without tensors:
/// the usual frame) or none in place; only a frame with several has a list of its own. Reads
/// as a slice of [`Bytes`].
#[derive(Clone, Default)]
pub struct Payloads(Repr);

#[derive(Clone, Default)]
enum Repr {
    #[default]
    Empty,
    One(Bytes),
    Many(Vec<Bytes>),
}

impl Payloads {
    /// No payloads.
    pub const fn new() -> Self {
        Payloads(Repr::Empty)
    }

    /// One payload, held in place.
    pub fn one(payload: Bytes) -> Self {
        Payloads(Repr::One(payload))
    }

    /// No payloads, with room for `n` of them (a list only when `n` is more than one).
    pub fn with_capacity(n: usize) -> Self {
        if n > 1 {
            Payloads(Repr::Many(Vec::with_capacity(n)))
        } else {
            Payloads(Repr::Empty)
        }
    }

    /// Appends `payload`.
    pub fn push(&mut self, payload: Bytes) {
        self.0 = match std::mem::take(&mut self.0) {
            Repr::Empty => Repr::One(payload),
            Repr::One(first) => Repr::Many(vec![first, payload]),
            Repr::Many(mut all) => {
                all.push(payload);
                Repr::Many(all)
            }
        };
    }

    /// Removes the last payload and returns it, if any.
    pub fn pop(&mut self) -> Option<Bytes> {
        match &mut self.0 {
            Repr::Empty => None,
            Repr::One(_) => match std::mem::take(&mut self.0) {
                Repr::One(only) => Some(only),
                _ => None,
            },
            Repr::Many(all) => all.pop(),
        }
    }

    /// The payloads as a list of their own.
    pub fn into_vec(self) -> Vec<Bytes> {
        match self.0 {
            Repr::Empty => Vec::new(),
            Repr::One(only) => vec![only],
            Repr::Many(all) => all,
        }
    }
}

impl std::ops::Deref for Payloads {
    type Target = [Bytes];

    fn deref(&self) -> &[Bytes] {
        match &self.0 {
            Repr::Empty => &[],
            Repr::One(only) => std::slice::from_ref(only),
            Repr::Many(all) => all,
        }
    }
}

impl std::ops::DerefMut for Payloads {
    fn deref_mut(&mut self) -> &mut [Bytes] {
        match &mut self.0 {
            Repr::Empty => &mut [],
            Repr::One(only) => std::slice::from_mut(only),
            Repr::Many(all) => all,
        }
    }
}

/// Shows lengths, not contents: payloads can be gigabytes.
impl std::fmt::Debug for Payloads {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_list()
            .entries(self.iter().map(|p| super::ByteLen(p.len())))
            .finish()
    }
}

impl PartialEq for Payloads {
    fn eq(&self, other: &Self) -> bool {
        **self == **other
    }
}

impl Eq for Payloads {}

impl PartialEq<Vec<Bytes>> for Payloads {
    fn eq(&self, other: &Vec<Bytes>) -> bool {
        **self == other[..]
    }
}

impl From<Vec<Bytes>> for Payloads {
    /// A list of one or none gives up its allocation.
    fn from(mut all: Vec<Bytes>) -> Self {
        match all.len() {
            0 => Payloads::new(),
            1 => Payloads(all.pop().map_or(Repr::Empty, Repr::One)),
            _ => Payloads(Repr::Many(all)),
        }
    }
}

impl From<Payloads> for Vec<Bytes> {
    fn from(payloads: Payloads) -> Self {
        payloads.into_vec()
    }
}

impl FromIterator<Bytes> for Payloads {
    fn from_iter<I: IntoIterator<Item = Bytes>>(iter: I) -> Self {
        let mut iter = iter.into_iter();
        let Some(first) = iter.next() else {
            return Payloads::new();
        };
        let Some(second) = iter.next() else {
            return Payloads::one(first);
        };
        let mut all = Vec::with_capacity(2 + iter.size_hint().0);
        all.push(first);
        all.push(second);
        all.extend(iter);
        Payloads(Repr::Many(all))
    }
}

impl Extend<Bytes> for Payloads {
    fn extend<I: IntoIterator<Item = Bytes>>(&mut self, iter: I) {
        for payload in iter {
            self.push(payload);
        }
    }
}

/// The payloads of a [`Payloads`], by value.
#[derive(Debug)]
pub struct PayloadsIntoIter(IntoIterRepr);

#[derive(Debug)]
enum IntoIterRepr {
    Few(Option<Bytes>),
    Many(std::vec::IntoIter<Bytes>),
}

impl Iterator for PayloadsIntoIter {
    type Item = Bytes;

    fn next(&mut self) -> Option<Bytes> {
        match &mut self.0 {
            IntoIterRepr::Few(next) => next.take(),
            IntoIterRepr::Many(all) => all.next(),
        }
    }

    fn size_hint(&self) -> (usize, Option<usize>) {
        match &self.0 {
            IntoIterRepr::Few(next) => {
                let n = usize::from(next.is_some());
                (n, Some(n))
            }
            IntoIterRepr::Many(all) => all.size_hint(),
        }
    }
}

impl ExactSizeIterator for PayloadsIntoIter {}

impl IntoIterator for Payloads {
    type Item = Bytes;
    type IntoIter = PayloadsIntoIter;

    fn into_iter(self) -> PayloadsIntoIter {
        PayloadsIntoIter(match self.0 {
            Repr::Empty => IntoIterRepr::Few(None),
            Repr::One(only) => IntoIterRepr::Few(Some(only)),
            Repr::Many(all) => IntoIterRepr::Many(all.into_iter()),
        })
    }
}

impl<'a> IntoIterator for &'a Payloads {
    type Item = &'a Bytes;
    type IntoIter = std::slice::Iter<'a, Bytes>;

    fn into_iter(self) -> Self::IntoIter {
        self.iter()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn b(n: u8) -> Bytes {
        Bytes::from(vec![n])
    }

    #[test]
    fn one_payload_is_held_in_place_and_reads_as_a_slice() {
        let mut p = Payloads::new();
        assert!(p.is_empty());
        p.push(b(1));
        assert!(matches!(p.0, Repr::One(_)));
        assert_eq!(&p[..], &[b(1)]);
        p.push(b(2));
        p.extend([b(3)]);
        assert_eq!(p, vec![b(1), b(2), b(3)]);
        assert_eq!(p.pop(), Some(b(3)));
        assert_eq!(p.into_iter().collect::<Vec<_>>(), vec![b(1), b(2)]);
    }

    #[test]
    fn conversions_keep_order_and_count() {
        for n in 0..4u8 {
            let all: Vec<Bytes> = (0..n).map(b).collect();
            let p = Payloads::from(all.clone());
            assert_eq!(p.len(), usize::from(n));
            assert_eq!(p, all);
            assert_eq!(p.clone().into_iter().len(), usize::from(n));
            assert_eq!(all.iter().cloned().collect::<Payloads>(), p);
            assert_eq!(p.into_vec(), all);
        }
        let mut one = Payloads::one(b(9));
        assert_eq!(one.pop(), Some(b(9)));
        assert_eq!((one.pop(), one.len()), (None, 0));
    }
}
