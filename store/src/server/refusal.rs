//! Why a request was refused: the bound it reached, named as its [`ServerConfig`] field and
//! `store serve` flag, and what happened.

use super::Shared;
#[cfg(doc)]
use super::{protocol, ServerConfig};
use crate::protocol::{KeyDisplay, WireError};
use crate::table::{AddError, AddOrBudget, BudgetError};

/// Why a request was refused (and its connection closed): the bound it reached, by its
/// [`ServerConfig`] field name (empty when the request was malformed rather than over a bound),
/// and what happened. Logged, and told to a client that asked (see [`protocol`]).
pub(super) struct Refusal {
    pub(super) bound: &'static str,
    pub(super) reason: String,
}

impl Refusal {
    pub(super) fn at(bound: &'static str, reason: String) -> Self {
        Refusal { bound, reason }
    }
}

impl From<String> for Refusal {
    /// A malformed request: no bound.
    fn from(reason: String) -> Self {
        Refusal { bound: "", reason }
    }
}

/// The refusal of a request that could not be decoded, naming the bound for a length over one.
pub(super) fn malformed(e: WireError) -> Refusal {
    let bound = match e {
        WireError::KeyTooLarge { .. } => "limits.max_key_len",
        WireError::ValueTooLarge { .. } => "limits.max_value_len",
        WireError::TooManyKeys { .. } => "limits.max_keys",
        WireError::RequestTooLarge { .. } => "limits.max_request_len",
        _ => "",
    };
    Refusal::at(bound, format!("malformed request: {e}"))
}

pub(super) fn too_many_waits(shared: &Shared) -> Refusal {
    Refusal::at(
        "max_waits_per_connection",
        format!(
            "more than {} waits parked by one connection, the bound max_waits_per_connection",
            shared.config.max_waits_per_connection
        ),
    )
}

/// Why a write of `op` to `key` was refused by the table's budget, naming the bound.
pub(super) fn refused_write(op: &str, key: &[u8], e: BudgetError) -> Refusal {
    let (bound, flag) = match e {
        BudgetError::ValueTooLarge { .. } => ("limits.max_value_len", "--max-value-size"),
        BudgetError::TooManyEntries { .. } => ("max_stored_keys", "--max-keys"),
        BudgetError::OverBudget { .. } => ("memory_budget", "--memory-budget"),
    };
    Refusal::at(
        bound,
        format!(
            "{op} on key {} refused: {e}; the bound {bound} ({flag})",
            KeyDisplay(key)
        ),
    )
}

/// Why a request whose reply would be `len` bytes was refused.
pub(super) fn too_long_a_reply(op: &str, keys: usize, len: usize, shared: &Shared) -> Refusal {
    Refusal::at(
        "max_response_len",
        format!(
            "{op} of {keys} keys would be answered with {len} bytes, over the bound \
             max_response_len = {} (--max-response-size)",
            shared.config.max_response_len
        ),
    )
}

/// Why a request whose reply needs `len` bytes of the memory budget, which has `room`, was
/// refused.
pub(super) fn no_room(op: &str, len: usize, room: usize, shared: &Shared) -> Refusal {
    Refusal::at(
        "memory_budget",
        format!(
            "{op} would be answered with {len} bytes of copies, and the memory budget of {} \
             bytes (the bound memory_budget, --memory-budget) has {room} left",
            shared.config.memory_budget
        ),
    )
}

/// Why an `add` or a `barrier` on `key` was refused.
pub(super) fn refused_count(op: &str, key: &[u8], e: AddOrBudget) -> Refusal {
    let e = match e {
        AddOrBudget::Add(e) => e,
        AddOrBudget::Budget(e) => return refused_write(op, key, e),
    };
    match e {
        AddError::NotAnInteger(v) => format!(
            "{op} on key {} whose value {} is not a decimal integer",
            KeyDisplay(key),
            KeyDisplay(&v)
        )
        .into(),
        AddError::Overflow => format!("{op} on key {} overflows i64", KeyDisplay(key)).into(),
    }
}
