//! Each wire format once, in core (issue "One node in core, one driver in rpc", item 3): the
//! dynamic group's messages and records and the gather's contributions and answers are encoded
//! and decoded by their own methods in core (`core/src/protocol/membership/coding.rs`,
//! `core/src/protocol/gather/coding.rs`, read through `core::codec`), as the envelope is by
//! `Envelope::encode`/`decode` (checked in `layout.rs`). So:
//!
//! - no source outside those files (the agent, its tests, the test kit, the fuzz targets and
//!   their seeds) runs postcard on one of these types: a fuzz target or a fault injector that
//!   decoded with a copy would test the copy;
//! - the agent (`rpc/src`) runs postcard nowhere but in [`RPC_POSTCARD`], the files whose
//!   formats are rpc's own (none today).

use std::path::{Path, PathBuf};

/// The types whose format lives in core, and the files allowed to run postcard on them.
const TYPES: &[&str] = &[
    "DynMessage",
    "MemberRecord",
    "Contribution",
    "GatherOutcome",
    "IpcMessage",
];
const OWNERS: &[&str] = &[
    "core/src/codec.rs",
    "core/src/protocol/membership/coding.rs",
    "core/src/protocol/gather/coding.rs",
    "core/src/ipc.rs",
];

/// Files of `rpc/src` that may run postcard, and why: none since the typed call's fingerprint
/// header moved into core (`core/src/protocol/typed.rs`). A format rpc needs of its own would be
/// listed here with its reason.
const RPC_POSTCARD: &[(&str, &str)] = &[];

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .unwrap()
        .to_owned()
}

/// Every `.rs` file under `dir`, test modules and `tests/` folders included.
fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for entry in entries {
        let path = entry.unwrap().path();
        if path.is_dir() {
            rust_files(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

/// The code of `text`, comments dropped, split into statements.
fn statements(text: &str) -> Vec<String> {
    let code: String = text
        .lines()
        .map(|l| l.split("//").next().unwrap_or_default())
        .collect::<Vec<_>>()
        .join("\n");
    code.split(';').map(|s| s.trim().to_owned()).collect()
}

/// Whether `statement` names `ty` as a whole word.
fn names(statement: &str, ty: &str) -> bool {
    statement.match_indices(ty).any(|(i, _)| {
        let before = statement[..i].chars().next_back();
        let after = statement[i + ty.len()..].chars().next();
        let word = |c: Option<char>| c.is_some_and(|c| c.is_alphanumeric() || c == '_');
        !word(before) && !word(after)
    })
}

#[test]
fn core_formats_are_coded_in_core_only() {
    let root = root();
    let mut files = Vec::new();
    for entry in std::fs::read_dir(&root).unwrap() {
        let krate = entry.unwrap().path();
        let name = krate.file_name().unwrap().to_string_lossy().into_owned();
        if name == "target" || name.starts_with('.') || !krate.join("Cargo.toml").is_file() {
            continue;
        }
        for sub in ["src", "tests", "fuzz_targets", "seeds/src"] {
            rust_files(&krate.join(sub), &mut files);
        }
    }
    for must in [
        "fuzz/fuzz_targets/membership.rs",
        "fuzz/seeds/src/main.rs",
        "rpc/tests/hostile_membership.rs",
        "rpc/src/membership.rs",
    ] {
        assert!(
            files.iter().any(|f| f.ends_with(must)),
            "the walk missed {must}"
        );
    }
    let mut offenders = Vec::new();
    for file in &files {
        let rel = file.strip_prefix(&root).unwrap().display().to_string();
        // The owners, and this check (whose self-test names a copy).
        if OWNERS.contains(&rel.as_str()) || rel == "tests/tests/layout_wire.rs" {
            continue;
        }
        let text = std::fs::read_to_string(file).unwrap();
        for s in statements(&text) {
            if !s.contains("postcard::") {
                continue;
            }
            if let Some(ty) = TYPES.iter().find(|ty| names(&s, ty)) {
                offenders.push(format!("{rel}: postcard on {ty}: {s}"));
            }
        }
    }
    assert!(
        offenders.is_empty(),
        "a core wire format coded outside core (use the type's encode / decode):\n  {}",
        offenders.join("\n  ")
    );
}

#[test]
fn the_agent_runs_postcard_only_on_its_own_formats() {
    let root = root();
    let mut files = Vec::new();
    rust_files(&root.join("rpc/src"), &mut files);
    assert!(files.len() > 20, "found only {} files", files.len());
    let mut offenders = Vec::new();
    let mut used = Vec::new();
    for file in &files {
        let rel = file.strip_prefix(&root).unwrap().display().to_string();
        let text = std::fs::read_to_string(file).unwrap();
        if statements(&text).iter().any(|s| s.contains("postcard::")) {
            if RPC_POSTCARD.iter().any(|(f, _)| *f == rel) {
                used.push(rel);
            } else {
                offenders.push(rel);
            }
        }
    }
    assert!(
        offenders.is_empty(),
        "postcard in the agent (a format belongs in core, beside its type): {offenders:?}"
    );
    for (f, _) in RPC_POSTCARD {
        assert!(
            used.iter().any(|u| u == f),
            "{f} no longer runs postcard: remove it from RPC_POSTCARD"
        );
    }
}

/// The check itself finds a copy of a decoder.
#[test]
fn the_check_finds_a_copy() {
    let s = statements("let m = postcard::from_bytes::<DynMessage>(b) // x\n;");
    assert!(s[0].contains("postcard::") && names(&s[0], "DynMessage"));
    assert!(!names("MyDynMessageX", "DynMessage"));
}
