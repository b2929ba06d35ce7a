//! How a [`Group`] runs its collectives: sequence numbers reserved per collective, the
//! timeout and abort around each run, numbered point-to-point messages, and the rounds of
//! all_to_all and of gathers of blocks of any length.

use super::*;

impl Group {
    /// Takes `rounds` consecutive sequence numbers and returns the first. Called when a
    /// collective is issued, after its arguments were checked and before its first await.
    pub(super) fn reserve(&self, rounds: u64) -> u64 {
        self.inner.next_seq.fetch_add(rounds, Ordering::Relaxed)
    }

    pub(super) async fn run(
        &self,
        seq: u64,
        signature: Signature,
        schedule: &Schedule,
        buffer: &mut [u8],
    ) -> Result<(), ProcessGroupError> {
        self.run_held(
            seq,
            signature,
            schedule,
            buffer,
            &mut Held::default(),
            false,
        )
        .await
    }

    pub(super) async fn run_held(
        &self,
        seq: u64,
        signature: Signature,
        schedule: &Schedule,
        buffer: &mut [u8],
        held: &mut Held,
        defer: bool,
    ) -> Result<(), ProcessGroupError> {
        self.run_within(
            seq,
            signature,
            schedule,
            buffer,
            held,
            defer,
            self.op_timeout(),
        )
        .await
    }

    #[allow(clippy::too_many_arguments)] // the executor's inputs, passed straight through
    pub(super) async fn run_within(
        &self,
        seq: u64,
        signature: Signature,
        schedule: &Schedule,
        buffer: &mut [u8],
        held: &mut Held,
        defer: bool,
        timeout: Duration,
    ) -> Result<(), ProcessGroupError> {
        let deadline = self.inner.mesh.runtime().deadline_after(timeout);
        let span = tracing::debug_span!(
            "collective",
            group = %self.name(),
            %signature,
            seq,
            rank = self.rank(),
            bytes = buffer.len()
        );
        let op = executor::Op {
            seq,
            signature,
            deadline,
            timeout,
        };
        // Under `TENSORWIRE_DEBUG=detail` the ranks first make sure they all run this
        // collective (core's agreement check), so that none returns `Ok` from a mismatch.
        let check = self
            .inner
            .debug
            .checks(&signature)
            .then_some(&self.inner.check);
        let result = executor::run(&self.inner.mesh, op, check, schedule, buffer, held, defer)
            .instrument(span)
            .await;
        match &result {
            // The ranks no longer agree on where the collectives stand (some sent their
            // messages for this sequence number, others never will): break the group, as
            // PyTorch's watchdog aborts a communicator after a timeout.
            Err(e @ ProcessGroupError::Timeout { .. }) => self.inner.mesh.fail(e.clone()),
            // Another rank ran something else: fail this collective and the later ones here
            // and tell the others, so that every rank fails them, senders included (the
            // earlier ones still complete everywhere).
            Err(e @ ProcessGroupError::Disagreement { here: true, .. }) => {
                self.inner.mesh.report_disagreement(e).await
            }
            _ => {}
        }
        result
    }

    /// Checks a point-to-point peer (not this rank, below the world size).
    pub(super) fn check_peer(
        &self,
        collective: &'static str,
        peer: usize,
    ) -> Result<(), ProcessGroupError> {
        let (rank, world) = (self.rank(), self.size());
        let source = if peer >= world {
            CollectiveError::RankOutOfRange { rank: peer, world }
        } else if peer == rank {
            CollectiveError::PeerIsSelf { rank }
        } else {
            return Ok(());
        };
        Err(ProcessGroupError::Arguments { collective, source })
    }

    pub(super) async fn send_numbered(
        &self,
        data: Bytes,
        dst: usize,
        tag: u32,
        n: u64,
    ) -> Result<(), ProcessGroupError> {
        if let Some(e) = self.inner.mesh.failure(p2p::key(tag, n)) {
            return Err(e);
        }
        let signature = Signature::Send { tag }.encode();
        let timeout = self.inner.timeout;
        let span = tracing::debug_span!("send", rank = self.rank(), dst, tag, n);
        let send = self
            .inner
            .mesh
            .send(dst, p2p::key(tag, n), &signature, data);
        work::bounded(&**self.inner.mesh.runtime(), timeout, send)
            .instrument(span)
            .await
            .map_err(|timeout| ProcessGroupError::Timeout {
                collective: "send",
                seq: n,
                rank: self.rank(),
                waiting_on: vec![dst],
                timeout,
            })?
    }

    pub(super) async fn recv_numbered(
        &self,
        src: usize,
        tag: u32,
        n: u64,
    ) -> Result<Bytes, ProcessGroupError> {
        let key = p2p::key(tag, n);
        if let Some(e) = self.inner.mesh.failure(key) {
            return Err(e);
        }
        let timeout = self.inner.timeout;
        let mesh = &self.inner.mesh;
        let span = tracing::debug_span!("recv", rank = self.rank(), src, tag, n);
        let message = work::bounded(&**mesh.runtime(), timeout, mesh.recv(src, key))
            .instrument(span)
            .await;
        // The message is taken (or never will be): forget its slot either way.
        mesh.release(src, key);
        let message = match message {
            Ok(Some(m)) => m,
            Ok(None) => {
                return Err(mesh
                    .failure(key)
                    .unwrap_or_else(|| mesh.closed_error(src, "recv", n)))
            }
            Err(timeout) => {
                return Err(ProcessGroupError::Timeout {
                    collective: "recv",
                    seq: n,
                    rank: self.rank(),
                    waiting_on: vec![src],
                    timeout,
                })
            }
        };
        let ours = Signature::Send { tag };
        if message.signature != ours.encode() {
            return Err(ProcessGroupError::Mismatch {
                peer: src,
                collective: "recv",
                seq: n,
                reason: format!(
                    "its message is {:?}, not {ours}",
                    Signature::decode(&message.signature)
                ),
            });
        }
        Ok(message.payload)
    }

    /// Checks an all_to_all's arguments and numbers it.
    pub(super) fn issue_all_to_all(
        &self,
        send: &[usize],
        recv: &[usize],
    ) -> Result<(Schedule, u64), ProcessGroupError> {
        let arguments = |source| ProcessGroupError::Arguments {
            collective: "all_to_all",
            source,
        };
        for lens in [send, recv] {
            if lens.len() != self.size() {
                return Err(arguments(CollectiveError::LengthsCount {
                    lens: lens.len(),
                    world: self.size(),
                }));
            }
        }
        let schedule = collective::all_to_all(self.rank(), send, recv).map_err(arguments)?;
        Ok((schedule, self.reserve(1)))
    }

    /// Runs an all_to_all of `inputs` (block `p` goes to rank `p`; `output_lens[p]` bytes come
    /// from it) without copying a byte here: each block is sent as it is (held at its range,
    /// so the executor forwards it), each received message is kept as it came (deferred) and
    /// returned as its block, and this rank's own block is its own output. No buffer is made.
    /// A schedule that would need one (a send that is not exactly one block, a receive that is
    /// not one whole store) runs the copying way instead (the input copied into a buffer, and
    /// the blocks stored there); all_to_all's never does.
    pub(super) async fn all_to_all_blocks(
        &self,
        seq: u64,
        schedule: &Schedule,
        inputs: &[Bytes],
        output_lens: &[usize],
    ) -> Result<Vec<Bytes>, ProcessGroupError> {
        let mut held = Held::default();
        let mut offset = 0;
        for input in inputs {
            if !input.is_empty() {
                held.insert(offset..offset + input.len(), input.clone(), false);
            }
            offset += input.len();
        }
        let forwarded = schedule.steps().iter().all(|step| {
            let sends = step
                .sends()
                .iter()
                .all(|t| t.is_empty() || matches!(t.ranges(), [one] if held.get(one).is_some()));
            let receives = step.receives().iter().all(|r| {
                r.is_empty()
                    || (matches!(r.action(), tensorwire_core::collective::Apply::Store)
                        && r.ranges().len() == 1)
            });
            sends && receives
        });
        let mut buffer = Vec::new();
        if !forwarded {
            buffer = vec![0u8; schedule.buffer_len()];
            held.materialize(&[schedule.input_range()], &mut buffer);
            if let Some((from, to)) = schedule.local_copy() {
                buffer.copy_within(from, to.start);
            }
        }
        self.run_held(
            seq,
            Signature::AllToAll,
            schedule,
            &mut buffer,
            &mut held,
            forwarded,
        )
        .await?;
        let rank = self.rank();
        let mut start = schedule.output_range().start;
        let mut blocks = Vec::with_capacity(output_lens.len());
        for (p, &len) in output_lens.iter().enumerate() {
            let range = start..start + len;
            start += len;
            let block = if len == 0 {
                Bytes::new()
            } else if p == rank {
                inputs[p].clone()
            } else if let Some(b) = held.get(&range) {
                b
            } else if forwarded {
                // Every store was deferred: a block without its message cannot be.
                return Err(ProcessGroupError::Mismatch {
                    peer: p,
                    collective: "all_to_all",
                    seq,
                    reason: format!("no message of {len} bytes was kept for its block"),
                });
            } else {
                Bytes::copy_from_slice(&buffer[range])
            };
            blocks.push(block);
        }
        Ok(blocks)
    }

    /// The second round of a gather, on the root: receives the blocks too large for a slot
    /// (`lens[i]` is rank i's length, 0 when its block came inline or is the root's own).
    pub(super) async fn gather_large(
        &self,
        seq: u64,
        root: usize,
        lens: &[usize],
    ) -> Result<Vec<u8>, ProcessGroupError> {
        let schedule = collective::gather(self.rank(), root, lens).map_err(|source| {
            ProcessGroupError::Arguments {
                collective: "gather",
                source,
            }
        })?;
        let mut buffer = vec![0u8; schedule.buffer_len()];
        let signature = Signature::Gather { root: root as u32 };
        self.run(seq, signature, &schedule, &mut buffer).await?;
        Ok(buffer)
    }

    /// All-gather of blocks whose lengths every rank already knows (`lens[i]` is rank i's);
    /// skips the exchange of lengths that [`all_gather`](Collectives::all_gather) does first,
    /// through the group arena when the group has one, else over the links. Returns the
    /// blocks in rank order. Every rank must pass the same `lens` (ranks that do not fail with
    /// [`ProcessGroupError::Disagreement`] over the links, or the arena's account naming the
    /// rank: [`ProcessGroupError::Mismatch`] or [`ProcessGroupError::PeerAborted`]).
    ///
    /// # Errors
    /// [`ProcessGroupError::Arguments`] when `input` is not `lens[rank]` bytes or `lens` does
    /// not have one entry per rank (the call then takes no place in the group's sequence);
    /// the errors of every collective.
    pub async fn all_gather_with_lens(
        &self,
        input: &[u8],
        lens: &[usize],
    ) -> Result<Vec<Bytes>, ProcessGroupError> {
        use tensorwire_core::ports::process_group::Buf;
        use tensorwire_core::tensor::Storage;
        let op = Op::AllGather {
            input: Buf::Ref(input),
            lens: BlockLens::Given(lens.to_vec()),
        };
        let unexpected = |kind: String| ProcessGroupError::Backend {
            backend: self.backend(),
            collective: "all_gather",
            seq: 0,
            rank: self.rank(),
            reason: format!("the group gave {kind} back"),
        };
        match self.execute(op).await? {
            Done::Buffers(blocks) => blocks
                .into_iter()
                .map(|block| match block {
                    Storage::Host(bytes) => Ok(bytes),
                    Storage::Device(_) => Err(unexpected("a device buffer".to_owned())),
                })
                .collect(),
            other => Err(unexpected(other.kind())),
        }
    }

    /// The data round of an all_gather, as collective `seq`, once the lengths are known.
    pub(super) async fn gather_known(
        &self,
        seq: u64,
        schedule: Schedule,
        input: &[u8],
        lens: &[usize],
    ) -> Result<Vec<Bytes>, ProcessGroupError> {
        // Blocks that arrive whole stay the messages they came in; the buffer (zeroed pages
        // the OS has not even mapped yet) is written only where a schedule needs contiguous
        // bytes, so a ring all_gather copies nothing but this rank's input.
        let mut buffer = vec![0u8; schedule.buffer_len()];
        let mut held = Held::default();
        held.insert(schedule.input_range(), Bytes::copy_from_slice(input), false);
        let signature = Signature::all_gather(lens);
        self.run_held(seq, signature, &schedule, &mut buffer, &mut held, true)
            .await?;
        let mut ranges = Vec::with_capacity(lens.len());
        let mut offset = 0;
        for len in lens {
            ranges.push(offset..offset + len);
            offset += len;
        }
        let missing: Vec<_> = ranges
            .iter()
            .filter(|r| held.get(r).is_none())
            .cloned()
            .collect();
        held.materialize(&missing, &mut buffer);
        let buffer = Bytes::from(buffer);
        Ok(ranges
            .into_iter()
            .map(|r| held.get(&r).unwrap_or_else(|| buffer.slice(r)))
            .collect())
    }
}
