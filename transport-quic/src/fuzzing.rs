//! The pure decoding of what a peer writes in front of each QUIC stream, for the `quic_prefix`
//! fuzz target in `fuzz/` and its seeds. Not part of the API: it may change at any time.

pub use crate::order::{
    check, decode_prefix, encode, encoded_len, Decoded, Deps, DepsError, Prefix, PrefixError,
    RecvOrder, MAX_EXTRA, TAG_FRAME, TAG_GOODBYE, TAG_GOODBYE_ACK,
};
