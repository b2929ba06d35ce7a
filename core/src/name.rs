//! Workers' names and ids.
//!
//! PyTorch's rule: a worker name uses only `A-Z a-z 0-9 _ : -` and is shorter than 128
//! characters. We also refuse the empty name, which no one can address.

use std::fmt;

/// A worker's id within its group (its rank in a static group). Defined here, with the
/// names, so that every module can name a worker without importing the protocol.
pub type WorkerId = u32;

/// Names must be shorter than this many characters (PyTorch's `MAX_NAME_LEN`).
pub const MAX_NAME_LEN: usize = 128;

/// Why a string is not a worker name.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum NameError {
    /// The name is empty.
    #[error("worker name is empty")]
    Empty,
    /// The name is 128 characters or longer.
    #[error("worker name {name:?} is {len} characters long; names must be shorter than {max}")]
    TooLong {
        /// The name.
        name: String,
        /// Its length in characters.
        len: usize,
        /// The limit (exclusive).
        max: usize,
    },
    /// The name has a character outside `[A-Za-z0-9_:-]`.
    #[error("worker name {name:?} has the character {bad:?}; only A-Z, a-z, 0-9, '_', ':' and '-' are allowed")]
    BadCharacter {
        /// The name.
        name: String,
        /// The first character that is not allowed.
        bad: char,
    },
}

/// Checks a worker name against PyTorch's rule (and refuses the empty name).
///
/// ```
/// use tensorwire_core::name::check_worker_name;
/// assert!(check_worker_name("trainer:0").is_ok());
/// assert!(check_worker_name("trainer 0").is_err());
/// ```
pub fn check_worker_name(name: &str) -> Result<(), NameError> {
    if name.is_empty() {
        return Err(NameError::Empty);
    }
    if let Some(bad) = name
        .chars()
        .find(|c| !(c.is_ascii_alphanumeric() || matches!(c, '_' | ':' | '-')))
    {
        return Err(NameError::BadCharacter {
            name: name.to_owned(),
            bad,
        });
    }
    // Only ASCII is left, so bytes are characters.
    if name.len() >= MAX_NAME_LEN {
        return Err(NameError::TooLong {
            name: name.to_owned(),
            len: name.len(),
            max: MAX_NAME_LEN,
        });
    }
    Ok(())
}

/// A checked worker name.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct WorkerName(String);

impl WorkerName {
    /// Checks `name` and wraps it.
    pub fn new(name: impl Into<String>) -> Result<Self, NameError> {
        let name = name.into();
        check_worker_name(&name)?;
        Ok(Self(name))
    }

    /// The name as a string.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for WorkerName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl AsRef<str> for WorkerName {
    fn as_ref(&self) -> &str {
        &self.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn accepts_pytorch_names() {
        for n in ["worker0", "a", "trainer:3", "ps-1_b", &"x".repeat(127)] {
            assert!(check_worker_name(n).is_ok(), "{n}");
        }
    }

    #[test]
    fn refuses_bad_names() {
        assert_eq!(check_worker_name(""), Err(NameError::Empty));
        assert!(matches!(
            check_worker_name(&"x".repeat(128)),
            Err(NameError::TooLong { len: 128, .. })
        ));
        assert!(matches!(
            check_worker_name("a b"),
            Err(NameError::BadCharacter { bad: ' ', .. })
        ));
        assert!(matches!(
            check_worker_name("wörker"),
            Err(NameError::BadCharacter { bad: 'ö', .. })
        ));
        assert!(matches!(
            check_worker_name("a/b"),
            Err(NameError::BadCharacter { bad: '/', .. })
        ));
    }
}
