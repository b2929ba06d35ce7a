//! Errors are typed to the edge (issue "One node in core, one driver in rpc", item 4): in the
//! error enums of `core` and `rpc` (every `enum` named `*Error`, `*Violation`, `*Failure` or
//! `Malformed*`), no variant is a bare `(String)` and no field is a `what: String`: a cause is
//! data (ids, sizes, the inner error as a `#[source]`), rendered only when displayed, never the
//! text of another error flattened into a string (`RpcError::Init(String)` was one, made at 7
//! places from `format!` and `e.to_string()`).
//!
//! The few that are free text by nature are listed in [`ALLOWED`], each with why; nothing new
//! joins without a reason, and one that is gone leaves the list.

use std::path::PathBuf;

/// `(enum, variant or field)` that may stay `String`, and why.
const ALLOWED: &[(&str, &str, &str)] = &[
    (
        "RpcError",
        "FunctionRegistered",
        "a function's name as the user registered it: data, not a cause",
    ),
    (
        "RpcError",
        "InvalidArgument",
        "the agent's own sentence about an argument the caller gave (which one and why), not \
         another error's text",
    ),
    (
        "RpcError",
        "Serialization.what",
        "the thing being (de)serialized, named by the agent (\"the all_gather \\\"x\\\" value of \
         member 2\")",
    ),
    (
        "RpcError",
        "Timeout.what",
        "the operation that timed out, named by the agent (\"barrier \\\"b\\\"\"); who it waited \
         for is data (`WaitingFor`)",
    ),
    (
        "HandlerError",
        "BadArguments",
        "becomes a `RemoteError`'s message on the wire, which is text between processes",
    ),
    (
        "HandlerError",
        "Failed",
        "a user function's own error, known only by its `Display` (a `Result<_, E: Display>`); \
         it travels as a `RemoteError`'s message",
    ),
    (
        "HandlerError",
        "Target",
        "becomes a `RemoteError`'s message on the wire, which is text between processes",
    ),
    (
        "CallError",
        "Local",
        "the driver's reason a deferred call was abandoned, handed to the sans-IO endpoint as \
         text (`Endpoint::abandon`) and kept beside the remote errors it stands for",
    ),
    (
        "OptimError",
        "Unsupported",
        "the element type or optimizer a Python or candle caller named, as that caller spells it",
    ),
];

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .unwrap()
        .to_owned()
}

use tensorwire_tests::source_files as sources;

/// The text without comments (whole-line `//` comments and doc comments).
fn code(text: &str) -> String {
    text.lines()
        .filter(|l| !l.trim_start().starts_with("//"))
        .collect::<Vec<_>>()
        .join("\n")
}

fn is_error_name(name: &str) -> bool {
    ["Error", "Violation", "Failure"]
        .iter()
        .any(|s| name.ends_with(s))
        || name.starts_with("Malformed")
}

/// Each error enum in `code`: its name and body (between its braces).
fn error_enums(code: &str) -> Vec<(String, String)> {
    let mut out = Vec::new();
    let mut rest = code;
    while let Some(at) = rest.find("enum ") {
        let after = &rest[at + 5..];
        let name: String = after
            .chars()
            .take_while(|c| c.is_alphanumeric() || *c == '_')
            .collect();
        let Some(open) = after.find('{') else { break };
        let mut depth = 0usize;
        let mut end = open;
        for (i, c) in after[open..].char_indices() {
            match c {
                '{' => depth += 1,
                '}' => {
                    depth -= 1;
                    if depth == 0 {
                        end = open + i;
                        break;
                    }
                }
                _ => {}
            }
        }
        if is_error_name(&name) {
            out.push((name, after[open + 1..end].to_owned()));
        }
        rest = &after[end..];
    }
    out
}

/// The `String` shapes refused in an enum's body: `Variant(String)` and `what: String` (named
/// `Variant.what`, the variant being the last one declared before the field).
fn string_causes(body: &str) -> Vec<String> {
    let mut found = Vec::new();
    let mut variant = String::new();
    for line in body.lines() {
        let t = line.trim();
        if t.starts_with('#') {
            continue;
        }
        let ident: String = t
            .chars()
            .take_while(|c| c.is_alphanumeric() || *c == '_')
            .collect();
        if ident.chars().next().is_some_and(char::is_uppercase) {
            variant = ident.clone();
            let tuple = t[ident.len()..].replace(' ', "");
            if tuple.starts_with("(String)") {
                found.push(ident);
            }
        } else if t.replace(' ', "").starts_with("what:String") {
            found.push(format!("{variant}.what"));
        }
    }
    found
}

#[test]
fn error_enums_of_core_and_rpc_carry_no_string_cause() {
    let root = root();
    let mut files = Vec::new();
    for krate in ["core", "rpc"] {
        sources(&root.join(krate).join("src"), &mut files);
    }
    assert!(files.len() > 50, "found only {} files", files.len());
    let mut seen = Vec::new();
    let mut refused = Vec::new();
    let mut enums = 0;
    for file in &files {
        let text = std::fs::read_to_string(file).unwrap();
        for (name, body) in error_enums(&code(&text)) {
            enums += 1;
            for what in string_causes(&body) {
                let allowed = ALLOWED.iter().any(|(e, v, _)| *e == name && *v == what);
                if allowed {
                    seen.push((name.clone(), what));
                } else {
                    let rel = file.strip_prefix(&root).unwrap().display();
                    refused.push(format!("{rel}: {name}::{what}"));
                }
            }
        }
    }
    assert!(enums > 20, "found only {enums} error enums");
    assert!(
        refused.is_empty(),
        "error variants that carry a String cause (make it data, or the inner error as a \
         #[source], rendered in Display; or list it in ALLOWED with why):\n  {}",
        refused.join("\n  ")
    );
    let gone: Vec<_> = ALLOWED
        .iter()
        .filter(|(e, v, _)| !seen.iter().any(|(n, w)| n == e && w == v))
        .map(|(e, v, _)| format!("{e}::{v}"))
        .collect();
    assert!(
        gone.is_empty(),
        "allowed String causes that are gone (remove them from ALLOWED): {gone:?}"
    );
}

/// The check itself finds what it must refuse.
#[test]
fn the_check_finds_string_causes() {
    let code = code(
        "/// doc\npub enum InitError {\n    /// x\n    #[error(\"{0}\")]\n    Init(String),\n    \
         Other {\n        what: String,\n        id: u32,\n    },\n    Typed(#[source] Inner),\n}\n\
         enum Plain { A(String) }\n",
    );
    let enums = error_enums(&code);
    assert_eq!(enums.len(), 1, "{enums:?}");
    assert_eq!(string_causes(&enums[0].1), ["Init", "Other.what"]);
}
