//! Fuzzes the QUIC transport's per-stream prefix (`tag`, then the ordering dependencies
//! `below: u64, n: u8, n × u64`) and the receiver's reorder buffer it feeds
//! (`tensorwire_transport_quic::fuzzing`, the code `read_carried` runs).
//!
//! Input: a sequence of streams, each `[seq: u8][len: u8][len bytes]`, decoded as the prefix
//! of stream `seq` (fed in growing pieces, as a stream's bytes arrive) and, when it is a frame
//! or goodbye, handed to the reorder buffer; a cancelled stream (`len` 0) and a goodbye's
//! answer are skipped there; a stream that ends inside its prefix ends the input (the
//! connection fails).
//! Checks:
//! - decoding is the same whole or byte by byte: an incomplete prefix asks for more bytes than
//!   it has, never more than the largest prefix, and never fails where the whole would not;
//! - accepted dependencies pass `check`: all below the stream's own number, at most
//!   `MAX_EXTRA`; a decoded prefix encodes back to the bytes it came from;
//! - the reorder buffer delivers each stream at most once, and never before a stream it
//!   depends on was delivered or skipped.
#![no_main]

use std::collections::BTreeSet;

use libfuzzer_sys::fuzz_target;
use tensorwire_transport_quic::fuzzing::{
    check, decode_prefix, encode, Decoded, Prefix, RecvOrder, MAX_EXTRA, TAG_FRAME, TAG_GOODBYE,
    TAG_GOODBYE_ACK,
};

const LONGEST: usize = 10 + 8 * MAX_EXTRA;

fuzz_target!(|data: &[u8]| {
    let mut order: RecvOrder<u64> = RecvOrder::starting_at(0);
    // Streams done at the receiver: delivered, or skipped; and every dependency of each.
    let mut done: BTreeSet<u64> = BTreeSet::new();
    let mut deps_of = std::collections::BTreeMap::new();
    let mut seen = BTreeSet::new();
    let mut rest = data;
    while let [seq, len, tail @ ..] = rest {
        let seq = u64::from(*seq);
        let n = usize::from(*len).min(tail.len());
        let (bytes, after) = tail.split_at(n);
        rest = after;
        if !seen.insert(seq) {
            continue; // a stream number comes once
        }
        let whole = decode_prefix(bytes, seq);
        // Byte by byte, as a stream arrives: the same answer once enough has arrived.
        let mut have = 0;
        let piecewise = loop {
            match decode_prefix(&bytes[..have], seq) {
                Ok(Decoded::Incomplete { need }) => {
                    assert!(need > have && need <= LONGEST, "need {need} with {have}");
                    if need > bytes.len() {
                        break Ok(Decoded::Incomplete { need });
                    }
                    have = need;
                }
                other => break other,
            }
        };
        assert_eq!(piecewise, whole, "decoding depends on how the bytes arrive");
        let delivered = match whole {
            Err(e) => {
                assert!(!e.to_string().is_empty());
                continue;
            }
            // Reset before any byte: a cancelled send, skipped.
            Ok(Decoded::Incomplete { .. }) if bytes.is_empty() => order.skip(seq),
            // Ended mid-prefix: the connection fails as malformed; nothing more arrives.
            Ok(Decoded::Incomplete { .. }) => break,
            Ok(Decoded::Complete(prefix, used)) => {
                assert!(used <= bytes.len());
                let mut again = vec![match &prefix {
                    Prefix::Frame(_) => TAG_FRAME,
                    Prefix::Goodbye(_) => TAG_GOODBYE,
                    Prefix::GoodbyeAck => TAG_GOODBYE_ACK,
                }];
                match prefix {
                    Prefix::Frame(deps) | Prefix::Goodbye(deps) => {
                        assert_eq!(check(&deps, seq), Ok(()));
                        assert!(deps.extra.len() <= MAX_EXTRA);
                        encode(&deps, &mut again);
                        assert_eq!(again, bytes[..used], "a prefix re-encodes to its bytes");
                        deps_of.insert(seq, deps.clone());
                        order.arrive(seq, deps, seq)
                    }
                    Prefix::GoodbyeAck => {
                        assert_eq!(used, 1);
                        order.skip(seq)
                    }
                }
            }
        };
        // A skipped stream is done too, but is not delivered.
        if !deps_of.contains_key(&seq) {
            done.insert(seq);
        }
        for s in delivered {
            let deps = &deps_of[&s];
            // Dependencies are below the stream's own number (at most 255 here).
            for d in 0..deps.below {
                assert!(done.contains(&d), "stream {s} delivered before {d}");
            }
            for d in &deps.extra {
                assert!(done.contains(d), "stream {s} delivered before {d}");
            }
            assert!(done.insert(s), "stream {s} delivered twice");
        }
    }
    assert!(order.waiting() <= seen.len());
});
