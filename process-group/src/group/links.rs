//! The link path of a [`Group`]'s collectives: each over the mesh, with core's schedules
//! and the executor ([`Group::execute`](super::Group) picks this path or the arena's).

use super::*;

impl Group {
    pub(super) async fn links_barrier(&self) -> Result<(), ProcessGroupError> {
        let seq = self.reserve(1);
        self.run(seq, Signature::Barrier, &self.inner.barrier, &mut [])
            .await
    }

    /// An all_gather over the links: with its lengths known ([`BlockLens::known`]), the data
    /// round alone, under the first of its [`varlen::ROUNDS`] numbers (where a rank that
    /// exchanges them sends its lengths: ranks that disagree on it are told); otherwise the
    /// lengths first: two rounds, both numbered when the call is issued, one slot per rank
    /// with its block's length (and the block itself up to [`INLINE_GATHER_BYTES`]), then,
    /// unless every block fitted, the blocks.
    pub(super) async fn links_all_gather(
        &self,
        input: &[u8],
        lens: &BlockLens,
    ) -> Result<Vec<Bytes>, ProcessGroupError> {
        let world = self.size();
        let rank = self.rank();
        let arguments = |source| ProcessGroupError::Arguments {
            collective: "all_gather",
            source,
        };
        if let Some(lens) = lens.known(rank, world, input.len()).map_err(arguments)? {
            let schedule = collective::all_gather(rank, &lens, AllGatherAlgorithm::select(&lens))
                .map_err(arguments)?;
            let seq = self.reserve(varlen::ROUNDS);
            return self.gather_known(seq, schedule, input, &lens).await;
        }
        let mut first = vec![0u8; SLOT_BYTES * world];
        let mine: &mut [u8; SLOT_BYTES] = (&mut first[SLOT_BYTES * rank..SLOT_BYTES * (rank + 1)])
            .try_into()
            .expect("a slot is SLOT_BYTES long");
        varlen::write_slot(mine, input);
        let seq = self.reserve(varlen::ROUNDS);
        self.run(
            seq,
            Signature::AllGatherLengths,
            &self.inner.lengths,
            &mut first,
        )
        .await?;
        let lens: Vec<u64> = first
            .chunks_exact(SLOT_BYTES)
            .map(|c| varlen::slot_len(c.try_into().expect("slot-sized chunk")))
            .collect();
        if let Some((peer, len)) = lens
            .iter()
            .enumerate()
            .find(|(_, len)| **len > MAX_BLOCK_BYTES as u64)
        {
            return Err(ProcessGroupError::Mismatch {
                peer,
                collective: "all_gather",
                seq,
                reason: format!(
                    "it announced a block of {len} bytes, more than one frame carries \
                     ({MAX_BLOCK_BYTES} bytes)"
                ),
            });
        }
        let inline: Option<Vec<_>> = lens.iter().map(|len| varlen::inline_range(*len)).collect();
        if let Some(inline) = inline {
            let first = Bytes::from(first);
            return Ok(inline
                .into_iter()
                .enumerate()
                .map(|(r, range)| {
                    first.slice(SLOT_BYTES * r + range.start..SLOT_BYTES * r + range.end)
                })
                .collect());
        }
        let lens: Vec<usize> = lens.into_iter().map(|len| len as usize).collect();
        let schedule = collective::all_gather(rank, &lens, AllGatherAlgorithm::select(&lens))
            .map_err(|source| ProcessGroupError::Arguments {
                collective: "all_gather",
                source,
            })?;
        self.gather_known(seq + 1, schedule, input, &lens).await
    }

    pub(super) async fn links_broadcast(
        &self,
        data: &mut [u8],
        root: usize,
    ) -> Result<(), ProcessGroupError> {
        let schedule = collective::broadcast(self.rank(), self.size(), root, data.len()).map_err(
            |source| ProcessGroupError::Arguments {
                collective: "broadcast",
                source,
            },
        )?;
        let signature = Signature::Broadcast {
            root: root as u32,
            len: data.len() as u64,
        };
        let seq = self.reserve(1);
        self.run(seq, signature, &schedule, data).await
    }

    /// Two rounds, both numbered when the call is issued: the root's length slot (with the
    /// bytes, up to [`INLINE_GATHER_BYTES`]), then, unless they fitted, the bytes.
    pub(super) async fn links_broadcast_bytes(
        &self,
        data: &[u8],
        root: usize,
    ) -> Result<Bytes, ProcessGroupError> {
        let (rank, world) = (self.rank(), self.size());
        let arguments = |source| ProcessGroupError::Arguments {
            collective: "broadcast",
            source,
        };
        let first = collective::broadcast(rank, world, root, SLOT_BYTES).map_err(arguments)?;
        let mut slot = [0u8; SLOT_BYTES];
        if rank == root {
            varlen::write_slot(&mut slot, data);
        }
        let seq = self.reserve(varlen::ROUNDS);
        let signature = Signature::BroadcastLength { root: root as u32 };
        self.run(seq, signature, &first, &mut slot).await?;
        let len = varlen::slot_len(&slot);
        if let Some(range) = varlen::inline_range(len) {
            return Ok(Bytes::copy_from_slice(&slot[range]));
        }
        if len > MAX_BLOCK_BYTES as u64 {
            return Err(ProcessGroupError::Mismatch {
                peer: root,
                collective: "broadcast",
                seq,
                reason: format!("it announced {len} bytes, more than {MAX_BLOCK_BYTES}"),
            });
        }
        let len = len as usize;
        let schedule = collective::broadcast(rank, world, root, len).map_err(arguments)?;
        let mut out = if rank == root {
            data.to_vec()
        } else {
            vec![0u8; len]
        };
        let signature = Signature::Broadcast {
            root: root as u32,
            len: len as u64,
        };
        self.run(seq + 1, signature, &schedule, &mut out).await?;
        Ok(out.into())
    }

    pub(super) async fn links_all_reduce(
        &self,
        data: &mut [u8],
        element: ElementType,
        op: ReduceOp,
    ) -> Result<(), ProcessGroupError> {
        let arguments = |source| ProcessGroupError::Arguments {
            collective: "all_reduce",
            source,
        };
        let count = whole_elements("all_reduce", data.len(), element)?;
        let algorithm = AllReduceAlgorithm::select(self.size(), count, element);
        let schedule =
            collective::all_reduce(self.rank(), self.size(), count, element, op, algorithm)
                .map_err(arguments)?;
        let signature = Signature::AllReduce {
            op,
            element,
            count: count as u64,
        };
        let seq = self.reserve(1);
        self.run(seq, signature, &schedule, data).await?;
        op.finish(element, data, self.size());
        Ok(())
    }

    /// One round of slots to the root (each rank's length, and its block up to
    /// [`INLINE_GATHER_BYTES`]), then, for the ranks whose blocks did not fit, the blocks;
    /// both rounds numbered when the call is issued.
    pub(super) async fn links_gather(
        &self,
        input: &[u8],
        root: usize,
    ) -> Result<Option<Vec<Bytes>>, ProcessGroupError> {
        let (rank, world) = (self.rank(), self.size());
        let arguments = |source| ProcessGroupError::Arguments {
            collective: "gather",
            source,
        };
        let first = collective::gather(rank, root, &vec![SLOT_BYTES; world]).map_err(arguments)?;
        let mut slots = vec![0u8; first.buffer_len()];
        let mine: &mut [u8; SLOT_BYTES] = (&mut slots[first.input_range()])
            .try_into()
            .expect("a slot is SLOT_BYTES long");
        varlen::write_slot(mine, input);
        let seq = self.reserve(varlen::ROUNDS);
        let signature = Signature::GatherLengths { root: root as u32 };
        self.run(seq, signature, &first, &mut slots).await?;
        if rank != root {
            if input.len() > INLINE_GATHER_BYTES {
                let mut lens = vec![0; world];
                lens[rank] = input.len();
                let second = collective::gather(rank, root, &lens).map_err(arguments)?;
                let mut data = input.to_vec();
                let signature = Signature::Gather { root: root as u32 };
                self.run(seq + 1, signature, &second, &mut data).await?;
            }
            return Ok(None);
        }
        let lens: Vec<u64> = slots
            .chunks_exact(SLOT_BYTES)
            .map(|c| varlen::slot_len(c.try_into().expect("slot-sized chunk")))
            .collect();
        check_block_lens("gather", seq, &lens, |i| i)?;
        let large: Vec<usize> = lens
            .iter()
            .enumerate()
            .map(|(r, len)| match varlen::inline_range(*len) {
                Some(_) => 0,
                None if r == root => 0,
                None => *len as usize,
            })
            .collect();
        let data = if large.iter().any(|len| *len > 0) {
            self.gather_large(seq + 1, root, &large).await?
        } else {
            Vec::new()
        };
        let (slots, data) = (Bytes::from(slots), Bytes::from(data));
        let mut offset = 0;
        let mut blocks = Vec::with_capacity(world);
        for (r, len) in lens.iter().enumerate() {
            blocks.push(if r == root {
                Bytes::copy_from_slice(input)
            } else if let Some(inline) = varlen::inline_range(*len) {
                slots.slice(SLOT_BYTES * r + inline.start..SLOT_BYTES * r + inline.end)
            } else {
                offset += large[r];
                data.slice(offset - large[r]..offset)
            });
        }
        Ok(Some(blocks))
    }

    /// One round of slots from the root (each rank's length, and its block up to
    /// [`INLINE_GATHER_BYTES`]), then the blocks that did not fit; both rounds numbered when
    /// the call is issued.
    pub(super) async fn links_scatter(
        &self,
        blocks: &[Bytes],
        root: usize,
    ) -> Result<Bytes, ProcessGroupError> {
        let (rank, world) = (self.rank(), self.size());
        let arguments = |source| ProcessGroupError::Arguments {
            collective: "scatter",
            source,
        };
        let first = collective::scatter(rank, root, &vec![SLOT_BYTES; world]).map_err(arguments)?;
        if rank == root && blocks.len() != world {
            return Err(arguments(CollectiveError::LengthsCount {
                lens: blocks.len(),
                world,
            }));
        }
        let mut slots = vec![0u8; first.buffer_len()];
        if rank == root {
            for (slot, block) in slots.chunks_exact_mut(SLOT_BYTES).zip(blocks) {
                varlen::write_slot(slot.try_into().expect("slot-sized chunk"), block);
            }
        }
        let seq = self.reserve(varlen::ROUNDS);
        let signature = Signature::ScatterLengths { root: root as u32 };
        self.run(seq, signature, &first, &mut slots).await?;
        let second_signature = Signature::Scatter { root: root as u32 };
        if rank == root {
            let large: Vec<usize> = blocks
                .iter()
                .enumerate()
                .map(|(r, b)| {
                    if r == root || b.len() <= INLINE_GATHER_BYTES {
                        0
                    } else {
                        b.len()
                    }
                })
                .collect();
            if large.iter().any(|len| *len > 0) {
                let second = collective::scatter(rank, root, &large).map_err(arguments)?;
                let mut data = Vec::with_capacity(second.buffer_len());
                for (b, len) in blocks.iter().zip(&large) {
                    if *len > 0 {
                        data.extend_from_slice(b);
                    }
                }
                self.run(seq + 1, second_signature, &second, &mut data)
                    .await?;
            }
            return Ok(blocks[root].clone());
        }
        let slot: &[u8; SLOT_BYTES] = slots[..].try_into().expect("one slot");
        let len = varlen::slot_len(slot);
        if let Some(inline) = varlen::inline_range(len) {
            return Ok(Bytes::copy_from_slice(&slot[inline]));
        }
        check_block_lens("scatter", seq, &[len], |_| root)?;
        let mut lens = vec![0; world];
        lens[rank] = len as usize;
        let second = collective::scatter(rank, root, &lens).map_err(arguments)?;
        let mut data = vec![0u8; second.buffer_len()];
        self.run(seq + 1, second_signature, &second, &mut data)
            .await?;
        Ok(data.into())
    }

    pub(super) async fn links_reduce(
        &self,
        data: &mut [u8],
        element: ElementType,
        op: ReduceOp,
        root: usize,
    ) -> Result<(), ProcessGroupError> {
        let (rank, world) = (self.rank(), self.size());
        let count = whole_elements("reduce", data.len(), element)?;
        let schedule =
            collective::reduce(rank, world, root, count, element, op).map_err(|source| {
                ProcessGroupError::Arguments {
                    collective: "reduce",
                    source,
                }
            })?;
        let signature = Signature::Reduce {
            op,
            element,
            root: root as u32,
            count: count as u64,
        };
        let seq = self.reserve(1);
        if rank == root {
            self.run(seq, signature, &schedule, data).await?;
            op.finish(element, data, world);
            Ok(())
        } else {
            self.run(seq, signature, &schedule, &mut data.to_vec())
                .await
        }
    }

    pub(super) async fn links_all_to_all_single(
        &self,
        input: &[u8],
        input_splits: &[usize],
        output_splits: &[usize],
    ) -> Result<Vec<u8>, ProcessGroupError> {
        let (schedule, seq) = self.issue_all_to_all(input_splits, output_splits)?;
        // Two copies in all: the input into one shared message (its blocks are sent as slices
        // of it), and the blocks received into the output.
        let input = Bytes::copy_from_slice(input);
        let mut start = 0;
        let inputs: Vec<Bytes> = input_splits
            .iter()
            .map(|len| {
                start += len;
                input.slice(start - len..start)
            })
            .collect();
        let blocks = self
            .all_to_all_blocks(seq, &schedule, &inputs, output_splits)
            .await?;
        let mut out = Vec::with_capacity(output_splits.iter().sum());
        for block in &blocks {
            out.extend_from_slice(block);
        }
        Ok(out)
    }

    /// Waits until a message with `tag` from some peer is the next one that peer's receives
    /// expect, claims its number, then takes it as a receive from that peer would. A
    /// receive from a given source issued while this waits may take that number first; this
    /// then waits for the next message.
    pub(super) async fn links_recv_any(
        &self,
        tag: u32,
    ) -> Result<(usize, Bytes), ProcessGroupError> {
        // A disagreement fails every point-to-point key alike; the number does not matter.
        if let Some(e) = self.inner.mesh.failure(p2p::key(tag, 0)) {
            return Err(e);
        }
        let (rank, world) = (self.rank(), self.size());
        if world == 1 {
            // The only rank that could send is this one: refuse instead of waiting.
            return Err(ProcessGroupError::Arguments {
                collective: "recv",
                source: CollectiveError::PeerIsSelf { rank },
            });
        }
        let peers: Vec<usize> = (0..world).filter(|p| *p != rank).collect();
        let mesh = &self.inner.mesh;
        let received = &self.inner.received;
        let claim = std::future::poll_fn(|cx| {
            let mut open = false;
            for &peer in &peers {
                let global = self.world_rank(peer);
                let n = received.peek(global, tag);
                match mesh.poll_arrived(peer, p2p::key(tag, n), cx) {
                    std::task::Poll::Ready(true) => {
                        if received.claim(global, tag, n) {
                            return std::task::Poll::Ready(Ok((peer, n)));
                        }
                        // A receive from that peer took the number: look again.
                        cx.waker().wake_by_ref();
                        return std::task::Poll::Pending;
                    }
                    std::task::Poll::Ready(false) => {}
                    std::task::Poll::Pending => open = true,
                }
            }
            if open {
                std::task::Poll::Pending
            } else {
                let last = peers.last().copied().unwrap_or(rank);
                std::task::Poll::Ready(Err(mesh
                    .failure(p2p::key(tag, 0))
                    .unwrap_or_else(|| mesh.closed_error(last, "recv", 0))))
            }
        });
        let span = tracing::debug_span!("recv_any", rank, tag);
        let (src, n) = work::bounded(&**self.inner.mesh.runtime(), self.inner.timeout, claim)
            .instrument(span)
            .await
            .map_err(|timeout| ProcessGroupError::Timeout {
                collective: "recv",
                seq: 0,
                rank,
                waiting_on: peers.clone(),
                timeout,
            })??;
        let bytes = self.recv_numbered(src, tag, n).await?;
        Ok((src, bytes))
    }

    /// Rank 0 receives an empty message from every other rank in one step (in rank order),
    /// then answers each; on timeout it knows which ranks had not arrived.
    pub(super) async fn links_monitored_barrier(
        &self,
        timeout: Option<Duration>,
        wait_all_ranks: bool,
    ) -> Result<(), ProcessGroupError> {
        let rank = self.rank();
        let schedule = collective::monitored_barrier(rank, self.size()).map_err(|source| {
            ProcessGroupError::Arguments {
                collective: "monitored_barrier",
                source,
            }
        })?;
        let timeout = timeout.unwrap_or(self.inner.timeout);
        let seq = self.reserve(1);
        let result = self
            .run_within(
                seq,
                Signature::MonitoredBarrier,
                &schedule,
                &mut [],
                &mut Held::default(),
                false,
                timeout,
            )
            .await;
        match result {
            Err(ProcessGroupError::Timeout { waiting_on, .. }) if rank == 0 => {
                Err(ProcessGroupError::MonitoredBarrier {
                    rank,
                    missing: collective::monitored_barrier_missing(&waiting_on, wait_all_ranks),
                    timeout,
                })
            }
            other => other,
        }
    }
}
