//! Fuzzes the store's cluster-secret step (`tensorwire_store::handshake`) on the server's
//! own request handling: a scripted client mixes arbitrary bytes with honest steps (a hello, the
//! proof computed with the right secret or a wrong one, `VALIDATE`) and hangs up at will.
//!
//! Must hold: the server never panics; its challenge carries a correct server proof; a
//! connection gets past the step only right after the honest proof with the right secret; a
//! wrong proof is answered "rejected" and closes the connection.
#![no_main]

use libfuzzer_sys::fuzz_target;
use tensorwire_core::auth::ClusterSecret;
use tensorwire_store::fuzzing::Session;
use tensorwire_store::protocol::{Limits, Request, AUTH_LEN, VALIDATION_MAGIC};

const LIMITS: Limits = Limits {
    max_key_len: 64,
    max_value_len: 128,
    max_keys: 8,
    max_request_len: 512,
};
/// The labels of the store's MACs (store/src/handshake.rs).
const SERVER_LABEL: &[u8] = b"tensorwire-store-v1 server";
const CLIENT_LABEL: &[u8] = b"tensorwire-store-v1 client";

fuzz_target!(|data: &[u8]| {
    let secret = ClusterSecret::new("fuzz-secret").unwrap();
    let wrong = ClusterSecret::new("not-the-secret").unwrap();
    let mut session = Session::new(Some(secret.clone()), LIMITS, 4, 1);
    let mut rest = data;
    while let [op, tail @ ..] = rest {
        rest = tail;
        let was_authenticated = session.is_authenticated(0);
        let mut honest_proof = false;
        let bytes = match op % 6 {
            0 => {
                let Some((&len, tail)) = rest.split_first() else {
                    break;
                };
                let n = usize::from(len).min(tail.len());
                let (piece, after) = tail.split_at(n);
                rest = after;
                piece.to_vec()
            }
            1 => {
                let mut nonce = [0u8; AUTH_LEN];
                let n = rest.len().min(AUTH_LEN);
                nonce[..n].copy_from_slice(&rest[..n]);
                rest = &rest[n..];
                let mut out = Vec::new();
                Request::AuthHello { nonce }.encode(&mut out);
                out
            }
            op @ (2 | 3) => {
                let Some((cn, sn)) = session.challenge(0) else {
                    continue;
                };
                honest_proof = op == 2;
                let key = if honest_proof { &secret } else { &wrong };
                let mut out = Vec::new();
                Request::AuthProof {
                    mac: key.mac(CLIENT_LABEL, &cn, &sn),
                }
                .encode(&mut out);
                out
            }
            4 => {
                let mut out = Vec::new();
                Request::Validate {
                    magic: VALIDATION_MAGIC,
                }
                .encode(&mut out);
                out
            }
            _ => {
                session.close(0);
                continue;
            }
        };
        let had_challenge = session.challenge(0).is_some();
        let clean = session.pending(0) == 0;
        match session.deliver(0, &bytes) {
            Ok(answer) => {
                if let Some((cn, sn)) = session.challenge(0).filter(|_| !had_challenge) {
                    // The challenge just sent: status 0, the server nonce, the server's proof.
                    assert_eq!(answer.len(), 1 + 2 * AUTH_LEN);
                    assert_eq!(answer[0], 0);
                    assert_eq!(answer[1..1 + AUTH_LEN], sn);
                    assert_eq!(answer[1 + AUTH_LEN..], secret.mac(SERVER_LABEL, &cn, &sn));
                }
                if !was_authenticated && session.is_authenticated(0) {
                    assert!(honest_proof, "authenticated without the right proof");
                    assert_eq!(answer.first(), Some(&0));
                }
            }
            Err((why, answer)) => {
                assert!(!session.is_authenticated(0));
                if had_challenge && clean && op % 6 == 3 {
                    assert_eq!(answer, [2], "a wrong proof is answered 'rejected'");
                    assert!(why.contains("wrong cluster secret"), "{why}");
                }
            }
        }
    }
});
