//! The type fingerprint of a typed call: what a call made through a typed descriptor sends in
//! front of its arguments, and the callee's check of it, before anything else is decoded.
//!
//! postcard is not self-describing, so a caller and a callee built from different sources that
//! disagree on a function's types could decode garbage. A typed call therefore carries a
//! [`TypeHeader`]: a magic tag, the 64-bit FNV-1a hash of the signature's text (stable across
//! Rust releases and platforms, which std's hasher is not) and the text itself, so that a
//! mismatch is refused naming both signatures ([`TypeMismatch`]).

use std::fmt;

use serde::{Deserialize, Serialize};

/// The tag in front of a typed call's arguments: "tensorwire typed, version 1".
pub const TYPED_MAGIC: [u8; 4] = *b"twT1";

/// What a typed call sends in front of its arguments (encoded with postcard, followed by the
/// arguments in the same encoding).
#[derive(Debug, Serialize, Deserialize, PartialEq, Eq)]
pub struct TypeHeader<'a> {
    /// [`TYPED_MAGIC`].
    pub magic: [u8; 4],
    /// The signature's hash.
    pub fingerprint: u64,
    /// The signature's text.
    #[serde(borrow)]
    pub signature: &'a str,
}

/// A signature and its hash, as a typed call carries it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Signature {
    text: String,
    fingerprint: u64,
}

impl Signature {
    /// The signature of this text (e.g. `(i64, i64) -> i64`), hashed with FNV-1a.
    pub fn new(text: String) -> Self {
        let fingerprint = text.bytes().fold(0xcbf2_9ce4_8422_2325_u64, |h, b| {
            (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3)
        });
        Self { text, fingerprint }
    }

    /// The signature of a function with arguments `A` and result `R`: `A -> R`, each by
    /// `std::any::type_name` (the text a callee built from other sources compares).
    pub fn function<A: ?Sized, R: ?Sized>() -> Self {
        Self::new(format!(
            "{} -> {}",
            std::any::type_name::<A>(),
            std::any::type_name::<R>()
        ))
    }

    /// The signature of a method on values of type `T` with arguments `A` and result `R`:
    /// `T::(A) -> R`, each by `std::any::type_name`.
    pub fn method<T: ?Sized, A: ?Sized, R: ?Sized>() -> Self {
        Self::new(format!(
            "{}::({}) -> {}",
            std::any::type_name::<T>(),
            std::any::type_name::<A>(),
            std::any::type_name::<R>()
        ))
    }

    /// The arguments as a call of this signature sends them: its header, then `args`.
    pub fn with<'a, A: ?Sized>(&'a self, args: &'a A) -> (TypeHeader<'a>, &'a A) {
        (self.header(), args)
    }

    /// The signature as text, e.g. `(i64, i64) -> i64`.
    pub fn text(&self) -> &str {
        &self.text
    }

    /// The 64-bit hash of [`text`](Self::text) a typed call carries.
    pub fn fingerprint(&self) -> u64 {
        self.fingerprint
    }

    /// The header a call of this signature sends in front of its arguments.
    pub fn header(&self) -> TypeHeader<'_> {
        TypeHeader {
            magic: TYPED_MAGIC,
            fingerprint: self.fingerprint,
            signature: &self.text,
        }
    }

    /// Checks the header in front of `args` against this signature (the callee's): where the
    /// arguments start after it, or why the call is refused.
    ///
    /// # Errors
    /// [`TypeMismatch::Untyped`] when `args` does not start with a header (a call by name),
    /// [`TypeMismatch::Other`] when it names another signature.
    pub fn check(&self, args: &[u8]) -> Result<usize, TypeMismatch> {
        let (header, rest) =
            postcard::take_from_bytes::<TypeHeader<'_>>(args).map_err(|_| TypeMismatch::Untyped)?;
        if header.magic != TYPED_MAGIC {
            return Err(TypeMismatch::Untyped);
        }
        if header.fingerprint != self.fingerprint || header.signature != self.text {
            return Err(TypeMismatch::Other {
                called_as: header.signature.to_owned(),
                fingerprint: header.fingerprint,
            });
        }
        Ok(args.len() - rest.len())
    }
}

impl fmt::Display for Signature {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "`{}` (fingerprint {:016x})", self.text, self.fingerprint)
    }
}

/// Why a typed function refused a call's header ([`Signature::check`]).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TypeMismatch {
    /// The arguments carry no header: the function was called by name.
    #[error("the call carries no type fingerprint")]
    Untyped,
    /// The caller's signature is another.
    #[error("called as `{called_as}` (fingerprint {fingerprint:016x})")]
    Other {
        /// The caller's signature text.
        called_as: String,
        /// The caller's fingerprint.
        fingerprint: u64,
    },
}

#[cfg(test)]
mod tests {
    use super::*;

    fn add() -> Signature {
        Signature::new("(i64, i64) -> i64".to_owned())
    }

    #[test]
    fn a_function_and_a_method_are_signed_by_their_types_names() {
        let f = Signature::function::<(i64, i64), String>();
        assert_eq!(f.text(), "(i64, i64) -> alloc::string::String");
        assert_eq!(f, Signature::new(f.text().to_owned()));
        assert_ne!(f, Signature::function::<(i32, i32), String>());
        let m = Signature::method::<Vec<u8>, u32, ()>();
        assert_eq!(m.text(), "alloc::vec::Vec<u8>::(u32) -> ()");
        // A method's value type is part of it: the same arguments on another type differ.
        assert_ne!(m, Signature::method::<Vec<u16>, u32, ()>());
        let args = 7u32;
        let (header, sent) = m.with(&args);
        assert_eq!((header, *sent), (m.header(), 7));
    }

    #[test]
    fn the_fingerprint_is_fnv1a_of_the_text() {
        // Known FNV-1a 64 values: the empty string and "a".
        assert_eq!(
            Signature::new(String::new()).fingerprint(),
            0xcbf2_9ce4_8422_2325
        );
        assert_eq!(
            Signature::new("a".into()).fingerprint(),
            0xaf63_dc4c_8601_ec8c
        );
        assert_ne!(
            add().fingerprint(),
            Signature::new("(i32, i32) -> i64".into()).fingerprint()
        );
        assert!(add().to_string().contains("(i64, i64) -> i64"));
    }

    #[test]
    fn the_header_goes_in_front_of_the_arguments_and_is_checked() {
        let sig = add();
        let bytes = postcard::to_allocvec(&(sig.header(), (2i64, 3i64))).unwrap();
        let start = sig.check(&bytes).unwrap();
        assert_eq!(
            postcard::from_bytes::<(i64, i64)>(&bytes[start..]).unwrap(),
            (2, 3)
        );

        let other = Signature::new("(i32, i32) -> i64".into());
        let theirs = postcard::to_allocvec(&(other.header(), (2i32, 3i32))).unwrap();
        assert_eq!(
            sig.check(&theirs),
            Err(TypeMismatch::Other {
                called_as: other.text().to_owned(),
                fingerprint: other.fingerprint(),
            })
        );
        // A matching hash with another text (a collision) is refused too.
        let forged = TypeHeader {
            magic: TYPED_MAGIC,
            fingerprint: sig.fingerprint(),
            signature: "(u8,) -> u8",
        };
        let forged = postcard::to_allocvec(&forged).unwrap();
        assert!(matches!(
            sig.check(&forged),
            Err(TypeMismatch::Other { .. })
        ));
    }

    #[test]
    fn arguments_without_a_header_are_untyped() {
        let sig = add();
        assert_eq!(sig.check(&[]), Err(TypeMismatch::Untyped));
        let by_name = postcard::to_allocvec(&(2i64, 3i64)).unwrap();
        assert_eq!(sig.check(&by_name), Err(TypeMismatch::Untyped));
        let wrong_magic = TypeHeader {
            magic: *b"twT0",
            ..sig.header()
        };
        let wrong_magic = postcard::to_allocvec(&wrong_magic).unwrap();
        assert_eq!(sig.check(&wrong_magic), Err(TypeMismatch::Untyped));
    }
}
