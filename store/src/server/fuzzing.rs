//! The store server's request handling without sockets, for the fuzz targets in `fuzz/`
//! (`store`, `store_auth`). Not part of the API: it may change at any time.
//!
//! A [`Session`] is a server with a fixed number of client connections. Bytes delivered on a
//! connection go through the code a real connection runs ([`protocol::decode_request`], then the
//! server's `handle`), against one shared table, so waits and barriers parked by one connection
//! are released by another. Only the socket is missing.

use bytes::{Buf, BytesMut};
use tokio::sync::mpsc::{unbounded_channel, UnboundedReceiver, UnboundedSender};

use super::{handle, Output, Phase, ServerConfig, Shared};
use crate::protocol::{self, Limits, AUTH_LEN, WAIT_STOP_WAITING};
use tensorwire_core::auth::ClusterSecret;

struct Conn {
    id: u64,
    phase: Phase,
    input: BytesMut,
    notify: UnboundedSender<u64>,
    fired: UnboundedReceiver<u64>,
    /// Answers to parked waits released by another connection, not yet taken.
    released: Vec<u8>,
    /// The client asked for tagged replies and named refusals.
    tagged: bool,
}

/// A store server with `n` client connections; see the [module documentation](self).
pub struct Session {
    shared: Shared,
    conns: Vec<Conn>,
}

impl Session {
    /// A server with `connections` open connections, `limits`, at most `max_waits` parked waits
    /// per connection and, when `secret` is set, the authentication step first.
    pub fn new(
        secret: Option<ClusterSecret>,
        limits: Limits,
        max_waits: usize,
        connections: usize,
    ) -> Self {
        let shared = Shared::new(ServerConfig {
            limits,
            secret,
            max_waits_per_connection: max_waits,
            ..ServerConfig::default()
        });
        let mut session = Session {
            shared,
            conns: Vec::new(),
        };
        for _ in 0..connections {
            let conn = session.connect();
            session.conns.push(conn);
        }
        session
    }

    fn connect(&self) -> Conn {
        let (notify, fired) = unbounded_channel();
        Conn {
            id: self
                .shared
                .next_conn
                .fetch_add(1, std::sync::atomic::Ordering::Relaxed),
            phase: if self.shared.config.secret.is_some() {
                Phase::AuthHello
            } else {
                Phase::Validate
            },
            input: BytesMut::new(),
            notify,
            fired,
            released: Vec::new(),
            tagged: false,
        }
    }

    /// The number of connections.
    pub fn connections(&self) -> usize {
        self.conns.len()
    }

    /// Delivers `bytes` from the client of connection `conn` (an index below
    /// [`connections`](Session::connections)). Returns what the server sends back, or, when
    /// the server closes the connection, why, with what it sent before closing.
    pub fn deliver(&mut self, conn: usize, bytes: &[u8]) -> Result<Vec<u8>, (String, Vec<u8>)> {
        let limits = self.shared.config.limits;
        let c = &mut self.conns[conn];
        c.input.extend_from_slice(bytes);
        let mut out = Output::default();
        if c.tagged {
            out.tag_replies();
        }
        out.extend_from_slice(&std::mem::take(&mut c.released));
        let result = loop {
            let (request, used) = match protocol::decode_request(&c.input, &limits) {
                Ok(Some(decoded)) => decoded,
                Ok(None) => break Ok(()),
                Err(e) => {
                    let refusal = super::malformed(e);
                    out.refuse(refusal.bound, &refusal.reason);
                    break Err(refusal.reason);
                }
            };
            c.input.advance(used);
            if let Err(refusal) = handle(
                request,
                &mut c.phase,
                c.id,
                &self.shared,
                &c.notify,
                &mut c.fired,
                &mut out,
            ) {
                out.refuse(refusal.bound, &refusal.reason);
                break Err(refusal.reason);
            }
        };
        c.tagged = out.is_tagged();
        if let Err(why) = result {
            self.close(conn);
            return Err((why, out.into_vec()));
        }
        // Waits released by this delivery, on any connection (as each connection's task
        // would be woken).
        for (i, other) in self.conns.iter_mut().enumerate() {
            while other.fired.try_recv().is_ok() {
                if i == conn {
                    out.reply();
                    out.push(WAIT_STOP_WAITING);
                } else {
                    if other.tagged {
                        other.released.push(protocol::REPLY_OK);
                    }
                    other.released.push(WAIT_STOP_WAITING);
                }
            }
        }
        Ok(out.into_vec())
    }

    /// The client of `conn` hung up (or the server closed it): its parked waits are dropped,
    /// and a fresh connection takes its place.
    pub fn close(&mut self, conn: usize) {
        let id = self.conns[conn].id;
        self.shared.lock().cancel_owner(id);
        self.conns[conn] = self.connect();
    }

    /// Whether connection `conn` has passed the authentication step (if any) and `VALIDATE`.
    pub fn is_validated(&self, conn: usize) -> bool {
        self.conns[conn].phase == Phase::Ready
    }

    /// Whether connection `conn` has authenticated (or needs not): it is past the
    /// authentication step.
    pub fn is_authenticated(&self, conn: usize) -> bool {
        matches!(self.conns[conn].phase, Phase::Validate | Phase::Ready)
    }

    /// The nonces of the pending challenge of connection `conn` (client's, server's).
    pub fn challenge(&self, conn: usize) -> Option<([u8; AUTH_LEN], [u8; AUTH_LEN])> {
        match self.conns[conn].phase {
            Phase::AuthProof {
                client_nonce,
                server_nonce,
            } => Some((client_nonce, server_nonce)),
            _ => None,
        }
    }

    /// How many bytes of connection `conn` wait for the rest of their request.
    pub fn pending(&self, conn: usize) -> usize {
        self.conns[conn].input.len()
    }

    /// How many waits connection `conn` has parked.
    pub fn parked_by(&self, conn: usize) -> usize {
        self.shared.lock().parked_by(self.conns[conn].id)
    }

    /// The number of keys in the table.
    pub fn num_keys(&self) -> usize {
        self.shared.lock().len()
    }
}
