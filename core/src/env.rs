//! Settings read from environment variables: how a value is read, and what a bad one is.
//!
//! ```
//! use tensorwire_core::env::whole_number;
//!
//! let env = |v: &'static str| move |_: &str| Some(v.to_string());
//! assert_eq!(whole_number("N", env(" 7 "), "a count"), Ok(Some(7)));
//! assert_eq!(whole_number("N", |_: &str| None, "a count"), Ok(None));
//! let bad = whole_number("N", env("seven"), "a count").unwrap_err();
//! assert_eq!(bad.to_string(), "N=\"seven\": expected a count");
//! ```

/// An environment variable whose value its setting does not take.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{var}={value:?}: expected {expected}")]
pub struct BadVariable {
    /// The variable.
    pub var: String,
    /// Its value, as found.
    pub value: String,
    /// What the setting takes.
    pub expected: &'static str,
}

impl BadVariable {
    /// `var` holds `value`, which is not `expected`.
    pub fn new(var: impl Into<String>, value: impl Into<String>, expected: &'static str) -> Self {
        BadVariable {
            var: var.into(),
            value: value.into(),
            expected,
        }
    }
}

/// The variable `name`, as `env` looks it up, read as a whole number (blanks around it
/// ignored): `Ok(None)` when it is unset; a value that is not one is a [`BadVariable`] that
/// says `expected`.
pub fn whole_number(
    name: &str,
    env: impl Fn(&str) -> Option<String>,
    expected: &'static str,
) -> Result<Option<u64>, BadVariable> {
    let Some(value) = env(name) else {
        return Ok(None);
    };
    match value.trim().parse() {
        Ok(n) => Ok(Some(n)),
        Err(_) => Err(BadVariable::new(name, value, expected)),
    }
}
