//! The table of the functions a worker serves, by name, and its rules: a name is registered
//! once (a second registration is refused, never a silent replacement, as the backend
//! registries refuse theirs); a removed name is unknown to later calls (calls running
//! finish); a call of a name not in the table fails as [`ServeFailure::UnknownFunction`],
//! which lists the names registered, sorted. The agent keeps its handlers (`H`) in one,
//! behind its lock.
//!
//! ```
//! use tensorwire_core::protocol::functions::{AlreadyRegistered, FunctionTable};
//!
//! let mut table = FunctionTable::default();
//! table.insert("add", 1)?;
//! assert_eq!(table.insert("add", 2), Err(AlreadyRegistered("add".into())));
//! assert_eq!(table.lookup("add", "w0"), Ok(1));
//! assert!(table.lookup("mul", "w0").is_err());
//! # Ok::<(), AlreadyRegistered>(())
//! ```

use super::served::ServeFailure;
use crate::hashing::HashMap;

/// A name registered already: the second registration is refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("function {0:?} is already registered on this worker")]
pub struct AlreadyRegistered(pub String);

/// The functions a worker serves, by name (see the module's documentation).
#[derive(Debug, Clone)]
pub struct FunctionTable<H> {
    by_name: HashMap<String, H>,
}

impl<H> Default for FunctionTable<H> {
    fn default() -> Self {
        Self {
            by_name: HashMap::default(),
        }
    }
}

impl<H: Clone> FunctionTable<H> {
    /// Registers `handler` as `name`, unless `name` is taken.
    pub fn insert(&mut self, name: &str, handler: H) -> Result<(), AlreadyRegistered> {
        if self.by_name.contains_key(name) {
            return Err(AlreadyRegistered(name.to_owned()));
        }
        self.by_name.insert(name.to_owned(), handler);
        Ok(())
    }

    /// Removes `name`; whether it was registered.
    pub fn remove(&mut self, name: &str) -> bool {
        self.by_name.remove(name).is_some()
    }

    /// The names registered, sorted.
    pub fn names(&self) -> Vec<String> {
        let mut names: Vec<String> = self.by_name.keys().cloned().collect();
        names.sort();
        names
    }

    /// The handler a call of `name` runs on worker `worker`, or what its caller is told.
    pub fn lookup(&self, name: &str, worker: &str) -> Result<H, ServeFailure> {
        self.by_name
            .get(name)
            .cloned()
            .ok_or_else(|| ServeFailure::UnknownFunction {
                function: name.to_owned(),
                worker: worker.to_owned(),
                registered: self.names(),
            })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::protocol::RemoteErrorKind;

    #[test]
    fn a_name_is_registered_once_and_a_removed_one_is_free_again() {
        let mut t = FunctionTable::default();
        t.insert("add", "first").unwrap();
        let refused = t.insert("add", "second").unwrap_err();
        assert_eq!(refused, AlreadyRegistered("add".into()));
        assert_eq!(
            refused.to_string(),
            "function \"add\" is already registered on this worker"
        );
        // The first stays: no silent replacement.
        assert_eq!(t.lookup("add", "w0"), Ok("first"));
        assert!(t.remove("add"));
        assert!(!t.remove("add"));
        t.insert("add", "again").unwrap();
        assert_eq!(t.lookup("add", "w0"), Ok("again"));
    }

    #[test]
    fn an_unknown_name_fails_listing_the_registered_ones_sorted() {
        let mut t = FunctionTable::default();
        for name in ["mul", "add", "sub"] {
            t.insert(name, ()).unwrap();
        }
        assert_eq!(t.names(), ["add", "mul", "sub"]);
        let failure = t.lookup("div", "w3").unwrap_err();
        assert_eq!(
            failure,
            ServeFailure::UnknownFunction {
                function: "div".into(),
                worker: "w3".into(),
                registered: vec!["add".into(), "mul".into(), "sub".into()],
            }
        );
        let told = failure.to_caller(3);
        assert_eq!(told.kind, RemoteErrorKind::UnknownFunction);
        assert_eq!(
            told.message,
            "no function \"div\" is registered on w3 (registered: add, mul, sub)"
        );
    }
}
