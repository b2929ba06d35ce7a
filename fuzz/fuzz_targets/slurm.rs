//! Fuzzes the Slurm host-list parser (`SLURM_JOB_NODELIST`, `node[01-04,7],gpu[1-3]`) and its
//! expansion (`tensorwire_rendezvous::hostlist`). Whatever the text:
//! - parsing gives a list or a typed error, never a panic;
//! - a parsed list's `first()` is the first host of its expansion, and `len()` its length;
//! - expanding more hosts than the limit is refused (`TooLong`) before anything is built, so
//!   `n[0-999999999]` costs nothing; every expanded name is at most `MAX_HOST_LEN` bytes.
#![no_main]

use libfuzzer_sys::fuzz_target;
use tensorwire_rendezvous::hostlist::{HostList, HostListError, MAX_HOST_LEN};

/// Hosts a run may expand (enough for every limit check, small enough to stay fast).
const LIMIT: usize = 4096;

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    let list = match HostList::parse(text) {
        Ok(list) => list,
        Err(e) => {
            assert!(!e.to_string().is_empty());
            return;
        }
    };
    let first = list.first();
    assert!(first.len() <= MAX_HOST_LEN, "first host {first:?} too long");
    let count = list.len();
    assert!(count >= 1);
    match list.expand(LIMIT) {
        Ok(hosts) => {
            assert_eq!(hosts.len() as u128, count, "len() counts the expansion");
            assert_eq!(hosts[0], first, "first() is the first host");
            for h in &hosts {
                assert!(h.len() <= MAX_HOST_LEN, "host {h:?} longer than the limit");
            }
        }
        Err(HostListError::TooLong {
            count: c, limit, ..
        }) => {
            assert_eq!((c, limit), (count, LIMIT));
            assert!(count > LIMIT as u128);
        }
        Err(other) => panic!("expand failed with {other:?} after a successful parse"),
    }
});
