//! The maps on the per-message path: std's `HashMap` and `HashSet` with foldhash's hasher.
//!
//! Every message passes through a dozen maps keyed by small ids (calls by message id, requests
//! by token, budgets and counts by worker). With std's SipHash the hashing alone was about a
//! tenth of the instructions an `rpc_sync` cost each side (`docs/bench/README.md`, "Where the
//! instructions of a call go"). foldhash is seeded per process, as std's hasher is, so a peer
//! cannot choose ids that collide on every worker; and every map a peer fills is bounded
//! (`EndpointConfig`), so one that finds collisions anyway gains a longer probe, never memory.

/// The hasher of [`HashMap`] and [`HashSet`] (foldhash's, seeded per process).
pub type BuildHasher = foldhash::fast::RandomState;

/// std's `HashMap` with [`BuildHasher`]: make one with `HashMap::default()`.
pub type HashMap<K, V> = std::collections::HashMap<K, V, BuildHasher>;

/// std's `HashSet` with [`BuildHasher`]: make one with `HashSet::default()`.
pub type HashSet<K> = std::collections::HashSet<K, BuildHasher>;
