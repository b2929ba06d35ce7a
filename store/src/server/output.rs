//! The replies queued to one connection: small answers copied together, values as the shared
//! [`Bytes`] the table holds, written as the socket accepts them.

use std::collections::VecDeque;
use std::io::IoSlice;

use bytes::{Buf, BufMut, Bytes, BytesMut};
use tokio::io::{AsyncWrite, AsyncWriteExt};

use crate::protocol;

/// Values below this size are copied into the reply instead of queued as their own chunk.
const COPY_BELOW: usize = crate::table::SHARED_FROM;

/// The bytes of `value` a reply copies (small values are copied, larger ones shared).
pub(crate) fn copied_len(value: &Bytes) -> usize {
    if value.len() < COPY_BELOW {
        value.len()
    } else {
        0
    }
}

/// Most chunks handed to one vectored write.
const MAX_SLICES: usize = 32;

/// Replies waiting to be written, in order.
#[derive(Default)]
pub(crate) struct Output {
    /// Each chunk, and whether it is a value the table shares (not counted as the
    /// connection's own memory).
    chunks: VecDeque<(Bytes, bool)>,
    small: BytesMut,
    len: usize,
    /// Bytes queued that are this connection's own: everything but shared values.
    own: usize,
    /// The client asked for tagged replies and named refusals
    /// ([`protocol::CLOSING_REASONS_KEY`]).
    tagged: bool,
}

impl Output {
    /// From now on replies are tagged and refusals named (see [`protocol::CLOSING_REASONS_KEY`]).
    pub(crate) fn tag_replies(&mut self) {
        self.tagged = true;
    }

    /// Whether replies are tagged.
    pub(crate) fn is_tagged(&self) -> bool {
        self.tagged
    }

    /// Starts a reply: its status byte, on a connection that asked for tagged replies.
    pub(crate) fn reply(&mut self) {
        if self.tagged {
            self.push(protocol::REPLY_OK);
        }
    }

    /// Queues the refusal of a request (on a connection that asked for reasons): the bound's
    /// name and the reason. Does nothing on another connection (c10d has no error reply).
    pub(crate) fn refuse(&mut self, bound: &str, reason: &str) {
        if self.tagged {
            self.push(protocol::REPLY_REFUSED);
            self.extend_from_slice(&(bound.len() as u64).to_ne_bytes());
            self.extend_from_slice(bound.as_bytes());
            self.extend_from_slice(&(reason.len() as u64).to_ne_bytes());
            self.extend_from_slice(reason.as_bytes());
        }
    }

    /// Bytes queued.
    pub(crate) fn len(&self) -> usize {
        self.len
    }

    /// Bytes queued that only this connection holds (copies, and values no longer in the
    /// table): what counts against the memory budget besides the table.
    pub(crate) fn own(&self) -> usize {
        self.own
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub(crate) fn push(&mut self, byte: u8) {
        self.small.put_u8(byte);
        self.len += 1;
        self.own += 1;
    }

    pub(crate) fn extend_from_slice(&mut self, bytes: &[u8]) {
        self.small.extend_from_slice(bytes);
        self.len += bytes.len();
        self.own += bytes.len();
    }

    /// Queues a c10d string: `u64` length, then the bytes of a value the table holds (shared,
    /// not copied, unless small).
    pub(crate) fn put_value(&mut self, value: Bytes) {
        self.put(value, true);
    }

    /// Queues a c10d string whose value the table no longer holds (a popped queue item): it
    /// counts as this connection's own.
    pub(crate) fn put_owned_value(&mut self, value: Bytes) {
        self.put(value, false);
    }

    fn put(&mut self, value: Bytes, shared: bool) {
        self.extend_from_slice(&(value.len() as u64).to_ne_bytes());
        if value.len() < COPY_BELOW {
            self.extend_from_slice(&value);
        } else {
            self.seal();
            self.len += value.len();
            if !shared {
                self.own += value.len();
            }
            self.chunks.push_back((value, shared));
        }
    }

    fn seal(&mut self) {
        if !self.small.is_empty() {
            self.chunks.push_back((self.small.split().freeze(), false));
        }
    }

    /// Writes what the socket accepts in one vectored write; returns how many bytes.
    pub(crate) async fn write_some<W: AsyncWrite + Unpin>(
        &mut self,
        writer: &mut W,
    ) -> std::io::Result<usize> {
        self.seal();
        let mut slices = [IoSlice::new(&[]); MAX_SLICES];
        let mut count = 0;
        for (slot, (chunk, _)) in slices.iter_mut().zip(&self.chunks) {
            *slot = IoSlice::new(chunk);
            count += 1;
        }
        let n = writer.write_vectored(&slices[..count]).await?;
        if n == 0 {
            return Err(std::io::ErrorKind::WriteZero.into());
        }
        self.advance(n);
        Ok(n)
    }

    /// Writes what the socket takes now, without waiting: a reply usually fits its buffer, so
    /// it leaves in the turn that made it (one `writev`), with no turn of the connection's
    /// `select!` and no stall timer armed for it. What the socket does not take waits for
    /// [`write_some`](Self::write_some).
    pub(crate) fn try_write_now(
        &mut self,
        writer: &tokio::net::tcp::WriteHalf<'_>,
    ) -> std::io::Result<()> {
        self.seal();
        while !self.is_empty() {
            let mut slices = [IoSlice::new(&[]); MAX_SLICES];
            let mut count = 0;
            for (slot, (chunk, _)) in slices.iter_mut().zip(&self.chunks) {
                *slot = IoSlice::new(chunk);
                count += 1;
            }
            // One chunk (the usual small reply) is a plain `send`, cheaper than a `writev`.
            let written = if count == 1 {
                writer.try_write(&slices[0])
            } else {
                writer.try_write_vectored(&slices[..count])
            };
            match written {
                Ok(0) => return Err(std::io::ErrorKind::WriteZero.into()),
                Ok(n) => self.advance(n),
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => return Ok(()),
                Err(e) => return Err(e),
            }
        }
        Ok(())
    }

    /// Writes everything queued.
    pub(crate) async fn write_all<W: AsyncWrite + Unpin>(
        &mut self,
        writer: &mut W,
    ) -> std::io::Result<()> {
        while !self.is_empty() {
            self.write_some(writer).await?;
        }
        Ok(())
    }

    fn advance(&mut self, mut n: usize) {
        self.len -= n;
        while n > 0 {
            let (front, shared) = self.chunks.front_mut().expect("written bytes were queued");
            let done = front.len().min(n);
            if !*shared {
                self.own -= done;
            }
            if front.len() <= n {
                n -= front.len();
                self.chunks.pop_front();
            } else {
                front.advance(n);
                n = 0;
            }
        }
    }

    /// Everything queued, as one buffer (for the fuzz targets).
    pub(crate) fn into_vec(mut self) -> Vec<u8> {
        self.seal();
        let mut all = Vec::with_capacity(self.len);
        for (chunk, _) in &self.chunks {
            all.extend_from_slice(chunk);
        }
        all
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn values_are_written_in_order_whatever_the_socket_accepts() {
        let mut out = Output::default();
        out.push(7);
        out.put_value(Bytes::from(vec![1; 3000]));
        out.put_value(Bytes::from_static(b"abc"));
        out.extend_from_slice(&[9, 9]);
        let expected = {
            let mut v = vec![7];
            v.extend_from_slice(&3000u64.to_ne_bytes());
            v.extend_from_slice(&[1; 3000]);
            v.extend_from_slice(&3u64.to_ne_bytes());
            v.extend_from_slice(b"abc");
            v.extend_from_slice(&[9, 9]);
            v
        };
        assert_eq!(out.len(), expected.len());
        // The shared value is the table's memory, not the connection's.
        assert_eq!(out.own(), expected.len() - 3000);
        // A pipe that takes 100 bytes at a time.
        let (mut w, mut r) = tokio::io::duplex(100);
        let reader = tokio::spawn(async move {
            let mut got = Vec::new();
            tokio::io::AsyncReadExt::read_to_end(&mut r, &mut got)
                .await
                .unwrap();
            got
        });
        out.write_all(&mut w).await.unwrap();
        assert!(out.is_empty());
        assert_eq!(out.own(), 0);
        drop(w);
        assert_eq!(reader.await.unwrap(), expected);
    }
}
