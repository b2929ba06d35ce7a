//! The workspace's shape, checked on its sources: no source file of a crate (`*/src/**.rs`,
//! test modules aside) is over 1,200 lines, so that a module keeps to one concern and a reader
//! can hold it. A file that grows past the bound is split into submodules by concern. And the
//! agent (`rpc/src`) holds no more code lines than the protocol it drives (`core/src/protocol`).

use std::path::PathBuf;

/// The bound, in lines.
const MAX_LINES: usize = 1200;

/// Files over the bound that are known and waiting for their split (each on the branch of the
/// work that is changing it now). Nothing new joins them; each leaves once split.
const WAITING: [&str; 0] = [];

use tensorwire_tests::source_files as sources;

/// Every crate's `src` file with its line count, paths relative to the workspace root.
fn line_counts() -> Vec<(String, usize)> {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .unwrap()
        .to_owned();
    let mut files = Vec::new();
    for entry in std::fs::read_dir(&root).unwrap() {
        let krate = entry.unwrap().path();
        let name = krate.file_name().unwrap().to_string_lossy().into_owned();
        // Build output and the fuzz workspace's own target directory are not sources.
        if name == "target" || name.starts_with('.') || !krate.join("Cargo.toml").is_file() {
            continue;
        }
        sources(&krate.join("src"), &mut files);
    }
    assert!(files.len() > 100, "found only {} source files", files.len());
    let mut out: Vec<(String, usize)> = files
        .into_iter()
        .map(|f| {
            let lines = std::fs::read_to_string(&f).unwrap().lines().count();
            let rel = f.strip_prefix(&root).unwrap().display().to_string();
            (rel, lines)
        })
        .collect();
    out.sort();
    out
}

#[test]
fn no_source_file_is_over_1200_lines() {
    let counts = line_counts();
    assert!(
        counts.iter().any(|(f, _)| f == "rpc/src/agent.rs"),
        "the walk missed rpc/src: {counts:?}"
    );
    let long: Vec<&(String, usize)> = counts
        .iter()
        .filter(|(f, lines)| *lines > MAX_LINES && !WAITING.contains(&f.as_str()))
        .collect();
    assert!(
        long.is_empty(),
        "files over {MAX_LINES} lines (split them into submodules by concern): {long:?}"
    );
    // A waiting file that was split leaves the list.
    let done: Vec<&&str> = WAITING
        .iter()
        .filter(|w| counts.iter().any(|(f, l)| f == *w && *l <= MAX_LINES))
        .collect();
    assert!(
        done.is_empty(),
        "no longer over the bound; remove from WAITING: {done:?}"
    );
}

/// Code lines of a source: not blank, not a comment, and before the file's test module (a
/// top-level `#[cfg(test)]` followed by `mod`).
fn code_lines(text: &str) -> usize {
    let lines: Vec<&str> = text.lines().collect();
    let mut n = 0;
    for (i, line) in lines.iter().enumerate() {
        let l = line.trim();
        let next_is_mod = lines.get(i + 1).is_some_and(|next| {
            let next = next.trim_start();
            next.starts_with("mod ") || next.starts_with("pub mod ") || next.contains(" mod ")
        });
        if l == "#[cfg(test)]" && !line.starts_with(' ') && next_is_mod {
            break;
        }
        if !l.is_empty() && !l.starts_with("//") {
            n += 1;
        }
    }
    n
}

/// Code lines of the sources under `dir` (a path from the workspace root).
fn code_lines_under(dir: &str) -> usize {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .unwrap()
        .join(dir);
    let mut files = Vec::new();
    sources(&root, &mut files);
    assert!(!files.is_empty(), "no sources under {dir}");
    files
        .iter()
        .map(|f| code_lines(&std::fs::read_to_string(f).unwrap()))
        .sum()
}

/// The agent is a driver of core's endpoint, not a second decision-maker: the RPC crate holds
/// no more code than the protocol it drives (issue "The house as it is drawn"). A change that
/// puts a decision in `rpc/src` instead of `core/src/protocol` shows here.
#[test]
fn the_agent_holds_no_more_code_than_the_protocol_it_drives() {
    let rpc = code_lines_under("rpc/src");
    let protocol = code_lines_under("core/src/protocol");
    eprintln!(
        "code lines: rpc/src {rpc}, core/src/protocol {protocol} (ratio {:.3}; the ratchet {}%, \
         the issue's target 60%)",
        rpc as f64 / protocol as f64,
        RPC_PERCENT_OF_PROTOCOL
    );
    assert!(
        rpc * 100 <= protocol * RPC_PERCENT_OF_PROTOCOL,
        "rpc/src has {rpc} code lines, more than {RPC_PERCENT_OF_PROTOCOL}% of \
         core/src/protocol's {protocol}: move decisions into core"
    );
}

/// The most code lines `rpc/src` may hold, in percent of `core/src/protocol`'s: a ratchet at
/// the ratio reached (0.897 when it was set at 100, 0.836 at 84, 0.805 at 81 with the
/// membership's actions and introductions decided by core's node, then 0.814 and 82 with a
/// served call's reply sent from the thread that ran it, `Reply::take`; 0.801 and 81 with the
/// typed call's fingerprint header in core; 0.766 and 77 with a dynamic join's tries, which
/// gather calls are a peer's violation, a hello's reading and certification, and the graceful
/// shutdown's deadline decided by core, `set_device_map`'s rules in `core::device`; 0.753 and
/// 76 with what a served call's caller is told of its failure, `core::protocol::served`;
/// 0.746 and 75 with what a shutdown does, `Shutdown::plan` in core; 0.729 and 73 with
/// `init_rpc`'s checks and rendezvous URL and the group's kind, `core::protocol::start`, and
/// the endpoint's settings checked at start, `EndpointConfig::check`: new, not moved; 0.726
/// with which credentials certify a static member's record, `membership::check_certified`;
/// 0.722 with the words of a typed call's refusal and of a method's missing or mistyped
/// value, `HandlerError`'s constructors in `served`; 0.716 and 72 with which hellos on the
/// listener are a joiner's and the joiner's hello and wait, and what dropping a peer does
/// (never this worker; a static peer told by an abort), `Node::handle_hello` and
/// `Node::handle_dropped`; 0.705 and 71 with the directory of members kept by core's node,
/// which applies the membership's changes to it, and a message frame made by core's one
/// encoder, `Envelope::frame`, of core's `FrameBody`, which the agent's messages carry; 0.658 and 66
/// with the counters per peer and their rules, `core::protocol::metrics` (a dropped call no
/// error, a dropped handler one), what is queued for a peer's writer counted against its
/// budget, `core::protocol::queued`, the table of served functions and its refusals,
/// `core::protocol::functions`, a typed call's signature text, `Signature::function`, and a
/// call and a remote handed to the endpoint by one helper, not two); 0.593 and 60 (the issue's
/// target) with a message's tensors encoded and placed for a peer and a received one's landing
/// checked, and their errors, `core::protocol::tensors`; why a reference cannot be used and
/// which error a refusal is, `RRefError` and `RRefFailure`; the debug view's words,
/// `DebugInfo`'s and `GatherDebugInfo`'s `Display`; an introduction's end as the join's
/// `TryEnd`, not a copy; when the driver's timer is woken, `Node::arm_timer` and
/// `Node::timer_moved_earlier`; what a member is told of a failed gather and who may take
/// part in a barrier among workers, `GatherFailure::told` and `gather::check_among`; the
/// counters' table per peer, `metrics::PeerTable`; how a request is served and what its
/// caller is told of a result not sent or a function that failed, `ServeMode`,
/// `ServeFailure::result_not_sent` and `ServeFailure::ran`. Lowered as decisions move into
/// core.
const RPC_PERCENT_OF_PROTOCOL: usize = 60;

/// The agent's shared state (`Inner` in `rpc/src/state.rs`) holds one lock (the issue's
/// target): core's node (with the directory of members), what waits on it, and what the agent
/// holds until shutdown and its tasks, all under `state`. (It held 9 when the issue was filed;
/// 3 before the last merge: the node under `state`, what shutdown lets go of under `owned`,
/// and the directory under a read-write lock, which moved into the node.) A new `Mutex`,
/// `RwLock`, `Notify` or atomic field there shows here.
#[test]
fn the_agents_state_holds_few_locks() {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .unwrap()
        .join("rpc/src/state.rs");
    let (locks, notifies, atomics) = inner_sync_fields(&std::fs::read_to_string(root).unwrap());
    eprintln!("Inner: {locks} locks, {notifies} Notify, {atomics} atomics");
    assert!(
        locks <= 1,
        "Inner has {locks} locks (Mutex/RwLock fields), more than 1"
    );
    assert!(
        notifies <= 1,
        "Inner has {notifies} Notify fields, more than 1"
    );
    assert!(
        atomics <= 3,
        "Inner has {atomics} atomic fields, more than 3"
    );
}

/// The `Mutex`/`RwLock`, `Notify` and atomic fields of `struct Inner` in `text`.
fn inner_sync_fields(text: &str) -> (usize, usize, usize) {
    let start = text
        .find("pub(crate) struct Inner {")
        .expect("rpc/src/state.rs defines Inner");
    let body = &text[start..];
    let body = &body[..body.find("\n}").expect("Inner's body ends")];
    let fields: Vec<&str> = body
        .lines()
        .map(str::trim)
        .filter(|l| !l.starts_with("//") && l.contains(": "))
        .collect();
    let count = |pred: &dyn Fn(&str) -> bool| fields.iter().filter(|f| pred(f)).count();
    (
        count(&|f| f.contains("Mutex<") || f.contains("RwLock<")),
        count(&|f| f.contains("Notify")),
        count(&|f| f.contains("Atomic")),
    )
}

#[test]
fn inner_sync_fields_counts_each_kind() {
    let text = "pub(crate) struct Inner {\n    /// a Mutex<doc>\n    pub(crate) a: Mutex<A>,\n    \
                pub(crate) b: std::sync::RwLock<B>,\n    pub(crate) c: Notify,\n    \
                pub(crate) d: Arc<AtomicUsize>,\n    pub(crate) e: u32,\n}\n";
    assert_eq!(inner_sync_fields(text), (2, 1, 1));
}

#[test]
fn code_lines_skip_blanks_comments_and_the_test_module() {
    let text = "//! doc\nfn a() {}\n\n    // note\nfn b() {}\n#[cfg(test)]\nmod tests {\n    fn c() {}\n}\n";
    assert_eq!(code_lines(text), 2);
}

/// The drivers read time only through core's `Runtime` port (issue "One node in core, one
/// driver in rpc"): in the agent, the mesh and the process groups no module but a `runtime`
/// module names `tokio::time` or reads `Instant::now()`, so that one clock (virtual under a
/// paused tokio runtime, or a test's own) governs every deadline. Test modules aside.
#[test]
fn the_drivers_read_time_only_through_the_runtime() {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .unwrap()
        .to_owned();
    let mut offenders = Vec::new();
    for krate in ["rpc/src", "mesh/src", "process-group/src"] {
        let mut files = Vec::new();
        sources(&root.join(krate), &mut files);
        assert!(!files.is_empty(), "no sources under {krate}");
        for file in files {
            if file.file_stem().is_some_and(|s| s == "runtime") {
                continue;
            }
            let text = std::fs::read_to_string(&file).unwrap();
            for (n, line) in code_before_tests(&text).lines().enumerate() {
                let code = line.split("//").next().unwrap_or_default();
                if code.contains("tokio::time") || code.contains("Instant::now(") {
                    let rel = file.strip_prefix(&root).unwrap().display().to_string();
                    offenders.push(format!("{rel}:{}: {}", n + 1, line.trim()));
                }
            }
        }
    }
    assert!(
        offenders.is_empty(),
        "time read outside the runtime (use the `Runtime` the driver was given):\n  {}",
        offenders.join("\n  ")
    );
}

/// The source up to its test module (a top-level `#[cfg(test)]` followed by `mod`).
fn code_before_tests(text: &str) -> String {
    let lines: Vec<&str> = text.lines().collect();
    let mut out = String::new();
    for (i, line) in lines.iter().enumerate() {
        let next_is_mod = lines.get(i + 1).is_some_and(|next| {
            let next = next.trim_start();
            next.starts_with("mod ") || next.starts_with("pub mod ") || next.contains(" mod ")
        });
        if line.trim() == "#[cfg(test)]" && !line.starts_with(' ') && next_is_mod {
            break;
        }
        out.push_str(line);
        out.push('\n');
    }
    out
}

/// The agent's message envelope has one encoder and one decoder, core's `Envelope::encode` and
/// `Envelope::decode` (issue "One node in core, one driver in rpc"): no other source — the
/// agent, the fuzz helpers, the test kit, the fuzz targets — runs postcard on an `Envelope`,
/// so that the fuzz targets and the fault injectors read frames as the agent does.
#[test]
fn the_envelope_is_encoded_and_decoded_in_core_only() {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .unwrap()
        .to_owned();
    let mut files = Vec::new();
    for entry in std::fs::read_dir(&root).unwrap() {
        let krate = entry.unwrap().path();
        let name = krate.file_name().unwrap().to_string_lossy().into_owned();
        if name == "target" || name.starts_with('.') || !krate.join("Cargo.toml").is_file() {
            continue;
        }
        sources(&krate.join("src"), &mut files);
        sources(&krate.join("fuzz_targets"), &mut files);
    }
    assert!(
        files
            .iter()
            .any(|f| f.ends_with("fuzz/fuzz_targets/rpc.rs")),
        "the fuzz targets were not found"
    );
    let own = root.join("core/src/protocol/envelope.rs");
    let mut offenders = Vec::new();
    for file in files.iter().filter(|f| **f != own) {
        let text = code_before_tests(&std::fs::read_to_string(file).unwrap());
        let code: String = text
            .lines()
            .map(|l| l.split("//").next().unwrap_or_default())
            .collect::<Vec<_>>()
            .join("\n");
        // A postcard call whose statement names `Envelope` (as a type or a literal).
        for statement in code.split(';') {
            if statement.contains("postcard::") && statement.contains("Envelope") {
                let rel = file.strip_prefix(&root).unwrap().display().to_string();
                offenders.push(format!("{rel}: {}", statement.trim()));
            }
        }
    }
    assert!(
        offenders.is_empty(),
        "an Envelope coded outside core (use Envelope::encode / Envelope::decode):\n  {}",
        offenders.join("\n  ")
    );
}
