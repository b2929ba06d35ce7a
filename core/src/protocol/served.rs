//! What the caller of a call served here is told when it fails here: for every way a call
//! can fail on its callee (no function of that name, a method's value not kept, its tensors
//! not placeable, its arguments not decodable, the function's own error or panic, a result
//! that cannot be encoded or sent back), which [`RemoteErrorKind`] it is and which words say
//! it. The agent runs the function and sends what [`ServeFailure::to_caller`] gives.
//!
//! ```
//! use tensorwire_core::protocol::served::{HandlerError, ServeFailure};
//! use tensorwire_core::protocol::RemoteErrorKind;
//!
//! let failure = ServeFailure::Handler {
//!     function: "add".into(),
//!     error: HandlerError::BadArguments("expected a pair".into()),
//! };
//! let told = failure.to_caller(3);
//! assert_eq!(told.kind, RemoteErrorKind::Serialization);
//! assert_eq!(told.message, "bad arguments for \"add\": expected a pair");
//! ```

use std::any::Any;

use super::tensors::TensorTransferError;
use super::typed::{Signature, TypeMismatch};
use super::{RRefId, RemoteError, RemoteErrorKind, WorkerId};

/// Why a handler (a registered function run for a call) failed, as the handler says it.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum HandlerError {
    /// The arguments did not decode as the function's.
    BadArguments(String),
    /// The function returned an error (its text).
    Failed(String),
    /// A method was called without a value, or on a value of another type; or a reference in
    /// the arguments was not confirmed by its owner in time.
    Target(String),
}

impl HandlerError {
    /// A typed function `function`, served here as `ours`, called with arguments whose type
    /// fingerprint does not match ([`Signature::check`]'s `mismatch`).
    pub fn type_mismatch(function: &str, ours: &Signature, mismatch: &TypeMismatch) -> Self {
        HandlerError::BadArguments(match mismatch {
            TypeMismatch::Untyped => format!(
                "{function:?} is a typed function ({ours}) and the call carries no type \
                 fingerprint: call it through its Function descriptor (Agent::call), not by name"
            ),
            other => format!("{other}, but this worker serves it as {ours}"),
        })
    }

    /// Method `method` called without a value to call it on (not through a reference).
    pub fn no_target(method: &str) -> Self {
        HandlerError::Target(format!(
            "method {method:?} needs a remote reference to call it on"
        ))
    }

    /// Method `method`, which takes a value of type `expected`, called on a value of another
    /// type.
    pub fn target_of_another_type(method: &str, expected: &str) -> Self {
        HandlerError::Target(format!(
            "method {method:?} expects a value of type {expected}"
        ))
    }
}

/// Why a call served here failed, before its caller is told ([`ServeFailure::to_caller`]).
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum ServeFailure {
    /// No function of this name is registered here.
    UnknownFunction {
        /// The name the caller asked for.
        function: String,
        /// This worker's name.
        worker: String,
        /// The names registered here.
        registered: Vec<String>,
    },
    /// A method's value is not kept here (any more).
    NoValue {
        /// The reference the method was called on.
        rref: RRefId,
        /// This worker's name.
        worker: String,
    },
    /// The tensors of the arguments cannot be placed here.
    Unplaceable {
        /// The function called.
        function: String,
        /// Why (the placement's error).
        reason: String,
    },
    /// The handler failed.
    Handler {
        /// The function called.
        function: String,
        /// How.
        error: HandlerError,
    },
    /// The function panicked.
    Panicked {
        /// The function called.
        function: String,
        /// The panic's message ([`panic_message`]).
        message: String,
    },
    /// The result cannot be encoded.
    ResultUnencodable {
        /// The function whose result it is (`None`: a reply sent by the function itself).
        function: Option<String>,
        /// The codec's error.
        reason: String,
    },
    /// The result's tensors cannot go back to the caller (no reverse map entry for their
    /// device, or a device copy that failed).
    ResultUnplaceable {
        /// The function whose result it is (`None`: a reply sent by the function itself).
        function: Option<String>,
        /// Why.
        reason: String,
    },
}

impl ServeFailure {
    /// The error the caller gets from worker `me`: the kind, and a message that names the
    /// function (and the worker, where the caller could not know which values or functions
    /// it holds).
    pub fn to_caller(&self, me: WorkerId) -> RemoteError {
        let (kind, message) = match self {
            Self::UnknownFunction {
                function,
                worker,
                registered,
            } => (
                RemoteErrorKind::UnknownFunction,
                format!(
                    "no function {function:?} is registered on {worker} (registered: {})",
                    registered.join(", ")
                ),
            ),
            Self::NoValue { rref, worker } => (
                RemoteErrorKind::RRef,
                format!("no value is kept for {rref} on {worker}"),
            ),
            Self::Unplaceable { function, reason } => (
                RemoteErrorKind::DeviceMap,
                format!("cannot place the tensors of {function:?}: {reason}"),
            ),
            Self::Handler { function, error } => match error {
                HandlerError::BadArguments(m) => (
                    RemoteErrorKind::Serialization,
                    format!("bad arguments for {function:?}: {m}"),
                ),
                HandlerError::Failed(m) => (RemoteErrorKind::Failed, m.clone()),
                HandlerError::Target(m) => (RemoteErrorKind::RRef, m.clone()),
            },
            Self::Panicked { function, message } => (
                RemoteErrorKind::Panicked,
                format!("{function:?} panicked: {message}"),
            ),
            Self::ResultUnencodable { function, reason } => (
                RemoteErrorKind::Serialization,
                of_result(function.as_deref(), &format!("cannot encode: {reason}")),
            ),
            Self::ResultUnplaceable { function, reason } => (
                RemoteErrorKind::DeviceMap,
                of_result(function.as_deref(), reason),
            ),
        };
        RemoteError {
            worker: me,
            kind,
            message,
        }
    }
}

impl ServeFailure {
    /// A result of `function` (`None`: a reply sent by the function itself) that cannot go
    /// back to its caller: unencodable, or its tensors unplaceable (no reverse map entry for
    /// their device, a device copy that failed).
    pub fn result_not_sent(function: Option<String>, e: &TensorTransferError) -> Self {
        match e {
            TensorTransferError::Encode(e) => Self::ResultUnencodable {
                function,
                reason: e.to_string(),
            },
            other => Self::ResultUnplaceable {
                function,
                reason: other.to_string(),
            },
        }
    }

    /// Function `function` ran and did not succeed: it returned `Ok(error)`, or panicked with
    /// the payload `Err(panic)`.
    pub fn ran(function: String, failed: Result<HandlerError, Box<dyn Any + Send>>) -> Self {
        match failed {
            Ok(error) => Self::Handler { function, error },
            Err(panic) => Self::Panicked {
                function,
                message: panic_message(&*panic),
            },
        }
    }
}

/// How a request is served here ([`ServeMode::of`]); the agent runs it so.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ServeMode {
    /// The agent's own gather ([`GATHER_FUNCTION`](super::gather::GATHER_FUNCTION)): not a
    /// registered function, not looked up in the table nor counted as a function served.
    pub internal: bool,
    /// Started on the task that received it, instead of in a task of its own.
    pub inline: bool,
    /// Its function may take its reply to send it itself (`Reply::take`).
    pub takeable: bool,
}

impl ServeMode {
    /// How a request of `function` is served: inline only for a peer's request on a
    /// current-thread runtime (`current_thread`, asked only for a peer's request), where every
    /// task runs on this thread anyway (no spawn, no turn of the scheduler; a call to this
    /// worker itself is dispatched from inside its caller's `rpc_async`, where the caller may
    /// hold locks its handler takes, so it gets a task, as every handler does on a
    /// multi-thread runtime, to run in parallel). Its reply is the
    /// function's to take only when it is sent (not when a `remote()` keeps the value here,
    /// `keeps_value`) and not by the pump that runs it inline.
    pub fn of(
        function: &str,
        from_peer: bool,
        current_thread: impl FnOnce() -> bool,
        keeps_value: bool,
    ) -> Self {
        let inline = from_peer && current_thread();
        ServeMode {
            internal: function == super::gather::GATHER_FUNCTION,
            inline,
            takeable: !keeps_value && !inline,
        }
    }
}

/// `message`, said of the result of `function` when there is one.
fn of_result(function: Option<&str>, message: &str) -> String {
    match function {
        Some(f) => format!("the result of {f:?}: {message}"),
        None => message.to_owned(),
    }
}

/// The message of a panic's payload: the text `panic!` was given (a `&str` or a `String`), or
/// "unknown panic" for any other payload.
pub fn panic_message(payload: &(dyn Any + Send)) -> String {
    payload
        .downcast_ref::<&str>()
        .map(|s| (*s).to_owned())
        .or_else(|| payload.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "unknown panic".into())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::protocol::GlobalId;

    fn told(f: ServeFailure) -> (RemoteErrorKind, String) {
        let e = f.to_caller(7);
        assert_eq!(e.worker, 7, "the callee names itself");
        (e.kind, e.message)
    }

    #[test]
    fn each_failure_has_its_kind_and_names_the_function() {
        let unknown = ServeFailure::UnknownFunction {
            function: "nope".into(),
            worker: "w7".into(),
            registered: vec!["add".into(), "mul".into()],
        };
        assert_eq!(
            told(unknown),
            (
                RemoteErrorKind::UnknownFunction,
                "no function \"nope\" is registered on w7 (registered: add, mul)".into()
            )
        );
        let rref = GlobalId {
            created_on: 1,
            local: 4,
        };
        let (kind, message) = told(ServeFailure::NoValue {
            rref,
            worker: "w7".into(),
        });
        assert_eq!(kind, RemoteErrorKind::RRef);
        assert_eq!(message, format!("no value is kept for {rref} on w7"));
        assert_eq!(
            told(ServeFailure::Unplaceable {
                function: "f".into(),
                reason: "no cuda:3".into()
            }),
            (
                RemoteErrorKind::DeviceMap,
                "cannot place the tensors of \"f\": no cuda:3".into()
            )
        );
        assert_eq!(
            told(ServeFailure::Panicked {
                function: "f".into(),
                message: "boom".into()
            }),
            (RemoteErrorKind::Panicked, "\"f\" panicked: boom".into())
        );
    }

    #[test]
    fn a_handlers_own_error_keeps_its_words_and_bad_arguments_name_the_function() {
        let handler = |error| ServeFailure::Handler {
            function: "f".into(),
            error,
        };
        assert_eq!(
            told(handler(HandlerError::Failed("out of stock".into()))),
            (RemoteErrorKind::Failed, "out of stock".into())
        );
        assert_eq!(
            told(handler(HandlerError::Target("no value".into()))),
            (RemoteErrorKind::RRef, "no value".into())
        );
        assert_eq!(
            told(handler(HandlerError::BadArguments("eof".into()))),
            (
                RemoteErrorKind::Serialization,
                "bad arguments for \"f\": eof".into()
            )
        );
    }

    #[test]
    fn a_results_failure_names_its_function_only_when_one_is_known() {
        let unencodable = |function: Option<&str>| ServeFailure::ResultUnencodable {
            function: function.map(str::to_owned),
            reason: "map keys".into(),
        };
        assert_eq!(
            told(unencodable(Some("f"))),
            (
                RemoteErrorKind::Serialization,
                "the result of \"f\": cannot encode: map keys".into()
            )
        );
        assert_eq!(
            told(unencodable(None)),
            (
                RemoteErrorKind::Serialization,
                "cannot encode: map keys".into()
            )
        );
        let unplaceable = ServeFailure::ResultUnplaceable {
            function: Some("f".into()),
            reason: "no reverse map for cuda:1".into(),
        };
        assert_eq!(
            told(unplaceable),
            (
                RemoteErrorKind::DeviceMap,
                "the result of \"f\": no reverse map for cuda:1".into()
            )
        );
    }

    #[test]
    fn a_panics_message_is_its_text_whatever_its_payload() {
        let caught = |f: fn()| std::panic::catch_unwind(f).unwrap_err();
        let literal = caught(|| panic!("static text"));
        let formatted = caught(|| panic!("formatted {}", 42));
        let other = caught(|| std::panic::panic_any(17_u8));
        assert_eq!(panic_message(&*literal), "static text");
        assert_eq!(panic_message(&*formatted), "formatted 42");
        assert_eq!(panic_message(&*other), "unknown panic");
    }

    #[test]
    fn a_typed_functions_refusal_names_both_signatures_or_says_how_to_call_it() {
        let ours = Signature::new("fn(u32) -> u32".into());
        let HandlerError::BadArguments(untyped) =
            HandlerError::type_mismatch("add", &ours, &TypeMismatch::Untyped)
        else {
            panic!("a type mismatch is a matter of arguments");
        };
        assert!(
            untyped.starts_with("\"add\" is a typed function (`fn(u32) -> u32`"),
            "{untyped}"
        );
        assert!(untyped.ends_with("(Agent::call), not by name"), "{untyped}");
        let other = TypeMismatch::Other {
            called_as: "fn(i64) -> u32".into(),
            fingerprint: 7,
        };
        let HandlerError::BadArguments(m) = HandlerError::type_mismatch("add", &ours, &other)
        else {
            panic!("a type mismatch is a matter of arguments");
        };
        assert_eq!(m, format!("{other}, but this worker serves it as {ours}"));
        assert_eq!(
            HandlerError::no_target("get"),
            HandlerError::Target("method \"get\" needs a remote reference to call it on".into())
        );
        assert_eq!(
            HandlerError::target_of_another_type("get", "u8"),
            HandlerError::Target("method \"get\" expects a value of type u8".into())
        );
    }

    #[test]
    fn a_result_not_sent_and_a_function_that_failed_are_told_apart() {
        let unencodable = TensorTransferError::Encode(serde::ser::Error::custom("no"));
        assert_eq!(
            told(ServeFailure::result_not_sent(
                Some("f".into()),
                &unencodable
            )),
            (
                RemoteErrorKind::Serialization,
                "the result of \"f\": cannot encode: no".into()
            )
        );
        let nowhere = TensorTransferError::NoSuchDevice {
            device: crate::device::Device::Cuda(3),
            count: 1,
        };
        let (kind, message) = told(ServeFailure::result_not_sent(None, &nowhere));
        assert_eq!(kind, RemoteErrorKind::DeviceMap);
        assert_eq!(message, nowhere.to_string());
        let failed = ServeFailure::ran("f".into(), Ok(HandlerError::Failed("bad".into())));
        assert_eq!(told(failed), (RemoteErrorKind::Failed, "bad".into()));
        let panicked = ServeFailure::ran("f".into(), Err(Box::new("boom")));
        assert_eq!(
            told(panicked),
            (RemoteErrorKind::Panicked, "\"f\" panicked: boom".into())
        );
    }

    #[test]
    fn only_a_peers_request_on_a_current_thread_runtime_runs_inline() {
        let gather = super::super::gather::GATHER_FUNCTION;
        let mode = ServeMode::of("f", true, || true, false);
        assert_eq!(
            (mode.internal, mode.inline, mode.takeable),
            (false, true, false),
            "run inline, its reply is the pump's"
        );
        let mode = ServeMode::of("f", false, || panic!("asked only for a peer"), false);
        assert_eq!(
            (mode.inline, mode.takeable),
            (false, true),
            "a call to itself"
        );
        let mode = ServeMode::of("f", true, || false, true);
        assert_eq!(
            (mode.inline, mode.takeable),
            (false, false),
            "a remote() keeps its value"
        );
        assert!(ServeMode::of(gather, true, || false, false).internal);
    }
}
