//! Fuzzes the c10d store server's request decoder and request handling: three client
//! connections to one table deliver arbitrary bytes in arbitrary pieces (and hang up), through
//! the server's own decode-and-handle code (`tensorwire_store::fuzzing::Session`).
//!
//! Input: a sequence of `[selector, len, len bytes...]`; the selector picks the connection
//! (`% 3`), and with bit 6 set the client hangs up instead. Every delivered piece is also
//! checked on its own against the decoder's contract:
//! - a decoded request re-encodes to exactly the bytes it was decoded from;
//! - every strict prefix of a request is "incomplete", never an error (a request is refused
//!   for the same reason however its bytes arrive);
//! - bytes after a decoded request, or after an error, do not change the result.
//!
//! The server must never panic, must close a connection (with a reason) for any bad request,
//! keep at most `MAX_WAITS` waits parked per connection, and drop a connection's waits when it
//! closes.
#![no_main]

use libfuzzer_sys::fuzz_target;
use tensorwire_store::fuzzing::Session;
use tensorwire_store::protocol::{decode_request, Limits};

/// Small limits, so that every limit is reachable.
const LIMITS: Limits = Limits {
    max_key_len: 64,
    max_value_len: 128,
    max_keys: 8,
    max_request_len: 200,
};
const MAX_WAITS: usize = 4;

fn check_decoder(piece: &[u8]) {
    let result = decode_request(piece, &LIMITS);
    match &result {
        Ok(Some((request, used))) => {
            let mut again = Vec::new();
            request.encode(&mut again);
            assert_eq!(
                again,
                piece[..*used],
                "a request re-encodes to its own bytes"
            );
            for cut in 0..*used {
                assert_eq!(
                    decode_request(&piece[..cut], &LIMITS),
                    Ok(None),
                    "the first {cut} bytes of a {used}-byte request are incomplete"
                );
            }
        }
        Ok(None) => return,
        Err(_) => {}
    }
    let mut longer = piece.to_vec();
    longer.extend_from_slice(&[0xA5; 40]);
    assert_eq!(
        decode_request(&longer, &LIMITS),
        result,
        "more bytes change nothing"
    );
}

fuzz_target!(|data: &[u8]| {
    let mut session = Session::new(None, LIMITS, MAX_WAITS, 3);
    let mut rest = data;
    while let [selector, len, tail @ ..] = rest {
        let conn = usize::from(*selector) % session.connections();
        if selector & 0x40 != 0 {
            session.close(conn);
            assert_eq!(session.parked_by(conn), 0);
            rest = &rest[1..];
            continue;
        }
        let n = usize::from(*len).min(tail.len());
        let (piece, after) = tail.split_at(n);
        rest = after;
        check_decoder(piece);
        match session.deliver(conn, piece) {
            Ok(_) => assert!(session.parked_by(conn) <= MAX_WAITS),
            Err((why, _)) => {
                assert!(!why.is_empty());
                assert_eq!(
                    session.parked_by(conn),
                    0,
                    "a closed connection's waits are gone"
                );
            }
        }
    }
});
