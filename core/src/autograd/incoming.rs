//! The messages other workers send a context: the recv of a tracked tensor, the creator's word
//! on a capability, gradients, their answers, and releases.

use super::*;

impl DistAutograd {
    /// A message from `from` in `context`, presenting the context's `capability`, carried
    /// tracked tensors under `message`: keep a recv record (the driver attaches a recv
    /// function to them). The context is created here if this is its first message (with the
    /// capability presented), unless it is one of this worker's own: a context made here and
    /// dropped since is not made again ([`RecvError::ContextGone`]), and one never made here is
    /// refused ([`RecvError::NeverMade`]). A message in a context held here must present its
    /// capability ([`RecvError::WrongCapability`]). A message from a worker already declared
    /// lost is refused ([`RecvError::PeerLost`]), so that no context is made that its loss can
    /// no longer drop.
    ///
    /// The creator of a context is the authority on its capability: when it presents one other
    /// than that of a copy a non-creator's message made here, that copy was a forgery's, and
    /// it is discarded ([`Recv::ReplacedForgery`]). When another worker presents one other
    /// than that of a copy the creator has not vouched for (a worker that guessed the id
    /// reached this worker before the context's first honest message, which a relay brought),
    /// nothing is recorded yet ([`Recv::AskCreator`]): the driver asks the creator
    /// ([`vouches`](Self::vouches)) and hands its answer to [`handle_vouch`](Self::handle_vouch).
    ///
    /// We differ from PyTorch, which trusts every context id: there a worker that guesses an id
    /// joins the context and can release it under its members. Here a guess joins nothing
    /// that an honest message made, and an honest message is recorded whichever came first.
    pub fn handle_recv(
        &mut self,
        from: WorkerId,
        context: ContextId,
        capability: Capability,
        message: AutogradMessageId,
    ) -> Result<Recv, RecvError> {
        self.recv(from, context, capability, message, false)
    }

    /// The tensors of `message`, recorded by [`handle_recv`](Self::handle_recv), came in a
    /// request (a call's arguments) and landed on the host: a gradient for them may go back in
    /// the answer to a gradient request from their sender (an answer travels as a response
    /// does, which is how a request's gradients go back), see [`Output::ReplyWithGradients`].
    /// A message not recorded here is ignored.
    pub fn recv_came_in_request(&mut self, context: ContextId, message: AutogradMessageId) {
        if let Some(ctx) = self.contexts.get_mut(&context) {
            if ctx.recvs.contains_key(&message) {
                ctx.answerable.insert(message);
            }
        }
    }

    /// The creator's answer to [`Recv::AskCreator`] for the message `handle_recv` was given:
    /// `vouched` says whether the creator said the message's capability is the context's
    /// (a failed or unanswered question is `false`). Vouched for, the copy held here was a
    /// forgery's: it is discarded ([`Recv::ReplacedForgery`], as when the creator's own
    /// message comes) and the message recorded in a copy made from it, which no message
    /// presenting another capability joins afterwards. Not vouched for, the message is refused
    /// ([`RecvError::WrongCapability`], nobody dropped: its sender may be an honest worker
    /// passing a forged context on). The message is checked again as by `handle_recv`, so
    /// whatever changed while the creator was asked (the context replaced, released, a peer
    /// lost) is taken into account.
    pub fn handle_vouch(
        &mut self,
        from: WorkerId,
        context: ContextId,
        capability: Capability,
        message: AutogradMessageId,
        vouched: bool,
    ) -> Result<Recv, RecvError> {
        // Not vouched for, the message is recorded only in a copy held now with its
        // capability (the creator's own message made one while it was asked): never in a
        // copy made from it.
        let agrees = self
            .contexts
            .get(&context)
            .is_some_and(|c| same(c.capability, capability));
        if !vouched && !agrees {
            return Err(RecvError::WrongCapability { from, context });
        }
        self.recv(from, context, capability, message, vouched)
    }

    fn recv(
        &mut self,
        from: WorkerId,
        context: ContextId,
        capability: Capability,
        message: AutogradMessageId,
        vouched: bool,
    ) -> Result<Recv, RecvError> {
        let bad = ProtocolViolation::BadMessageId {
            from,
            context,
            message,
        };
        if message.worker() != from {
            return Err(bad.into());
        }
        if self
            .contexts
            .get(&context)
            .is_some_and(|c| c.recvs.contains_key(&message))
        {
            return Err(bad.into());
        }
        if context.worker() == self.me && !self.contexts.contains_key(&context) {
            // Only this worker makes its contexts: one it does not have is either dropped
            // (the message is late) or was never made (forged).
            if context.counter() >= self.next_context {
                return Err(RecvError::NeverMade { from, context });
            }
            return Err(RecvError::ContextGone { from, context });
        }
        if self.lost.contains(&from) || self.lost.contains(&context.worker()) {
            return Err(RecvError::PeerLost { from, context });
        }
        let creator = context.worker();
        // The creator's word on the capability: its own message, or its answer.
        let vouched = vouched || from == creator;
        let mut recv = Recv::Recorded;
        if let Some(ctx) = self.contexts.get(&context) {
            if !same(ctx.capability, capability) {
                if ctx.vouched {
                    return Err(RecvError::WrongCapability { from, context });
                }
                if !vouched {
                    return Ok(Recv::AskCreator);
                }
                self.discard_forged(context);
                recv = Recv::ReplacedForgery;
            }
        }
        if !self.contexts.contains_key(&context) {
            let made = self.made_by_peer.entry(from).or_insert(0);
            if *made >= self.contexts_per_peer {
                return Err(RecvError::TooManyContexts {
                    from,
                    context,
                    limit: self.contexts_per_peer,
                });
            }
            *made += 1;
            let mut ctx = Context::new(capability);
            ctx.made_by = Some(from);
            ctx.vouched = false;
            self.contexts.insert(context, ctx);
        }
        let ctx = self.contexts.get_mut(&context).expect("made above");
        ctx.vouched |= vouched;
        ctx.recvs.insert(message, from);
        ctx.known.insert(from);
        Ok(recv)
    }

    /// Discards the copy of `context` that a forgery's message made here (its creator has just
    /// presented another capability): its work fails, and nobody is told. Its members hold the
    /// forgery's copy too, or were told the forgery's capability; a release from here could
    /// reach the creator's real context through a member it shares. The driver drops what it
    /// kept for the context when `handle_recv` says [`Recv::ReplacedForgery`].
    fn discard_forged(&mut self, context: ContextId) {
        let error = BackwardError::Released {
            worker: self.me,
            context,
        };
        self.remove_context(context, &error);
    }

    /// `from` sent the gradient for the send function of `message` (request `request`), `grads`
    /// gradients (present or not), one for each tensor the message carried: run it. The driver
    /// gets [`Output::RunLocal`] and, once the work and everything it started are done,
    /// [`Output::Reply`] for `request`; the task is returned. Another count than the message's
    /// tensors is a violation ([`ProtocolViolation::MismatchedGradients`]): the receiver
    /// computed them against the very tensors it received.
    ///
    /// A gradient for a context already dropped here (it crossed the release, or the loss that
    /// dropped it) is late: it is dropped, counted ([`late_gradients`](Self::late_gradients)),
    /// and `request` is answered at once ([`Output::Reply`]) with the error the context went
    /// with; `Ok(None)` is returned and nothing else changes. A gradient for a context this
    /// worker never had is a violation.
    pub fn handle_gradient(
        &mut self,
        from: WorkerId,
        context: ContextId,
        message: AutogradMessageId,
        grads: usize,
        request: RequestToken,
    ) -> Result<Option<TaskId>, ProtocolViolation> {
        let Some(ctx) = self.contexts.get(&context) else {
            let Some(why) = self.gone.get(&context) else {
                return Err(ProtocolViolation::UnknownContext { from, context });
            };
            self.late_gradients += 1;
            self.out.push_back(Output::Reply {
                to: from,
                request,
                result: Err(why.clone()),
            });
            return Ok(None);
        };
        if !ctx.known.contains(&from) {
            return Err(ProtocolViolation::NotInContext { from, context });
        }
        let Some(&(_, tensors)) = ctx.sends.get(&message).filter(|(to, _)| *to == from) else {
            return Err(ProtocolViolation::UnknownMessage {
                from,
                context,
                message,
            });
        };
        if grads != tensors {
            return Err(ProtocolViolation::MismatchedGradients {
                from,
                context,
                message,
                detail: format!("{grads} gradients for {tensors} tensors"),
            });
        }
        Ok(Some(self.start_task(
            context,
            Origin::Gradient { from, request },
            Entry::Send(message),
        )))
    }

    /// The answer to gradient request `gradient`: the receiver's work (and all it started)
    /// succeeded or failed. Answers to requests of work already failed or dropped are ignored.
    pub fn handle_gradient_reply(
        &mut self,
        gradient: GradientId,
        result: Result<(), BackwardError>,
    ) {
        let Some(Outgoing { task, .. }) = self.outgoing.remove(&gradient) else {
            return;
        };
        if let Some(t) = self.tasks.get_mut(&task) {
            t.outstanding.remove(&gradient);
        }
        match result {
            Ok(()) => self.maybe_complete(task),
            Err(e) => self.fail_task(task, e),
        }
    }

    /// The answer to gradient request `gradient` carried the gradients for the send functions
    /// of `messages` ([`Output::ReplyWithGradients`] on the receiver): each is run here as part
    /// of the work that sent the request (an [`Output::RunLocal`] with [`Entry::Send`] each, a
    /// task returned for each, in order, for the driver to seed). The work completes once they
    /// are done. With no messages this is a plain successful answer. Each message must be one
    /// this worker sent, in the request's context, to the worker the request went to;
    /// otherwise this is a violation and nothing changes (the request stays awaited: the driver
    /// fails it). An answer to a request of work already failed or dropped is ignored.
    pub fn handle_gradient_reply_with(
        &mut self,
        gradient: GradientId,
        messages: &[AutogradMessageId],
    ) -> Result<Vec<TaskId>, ProtocolViolation> {
        let Some(out) = self.outgoing.get(&gradient) else {
            return Ok(Vec::new());
        };
        let (task, from) = (out.task, out.to);
        let Some(context) = self.tasks.get(&task).map(|t| t.context) else {
            return Ok(Vec::new());
        };
        let Some(ctx) = self.contexts.get(&context) else {
            return Ok(Vec::new());
        };
        let mut seen = BTreeSet::new();
        for m in messages {
            if ctx.sends.get(m).map(|(to, _)| *to) != Some(from) || !seen.insert(*m) {
                return Err(ProtocolViolation::UnknownMessage {
                    from,
                    context,
                    message: *m,
                });
            }
        }
        self.outgoing.remove(&gradient);
        let mut started = Vec::with_capacity(messages.len());
        for m in messages {
            let child = self.start_task(
                context,
                Origin::Continuation { parent: task },
                Entry::Send(*m),
            );
            started.push(child);
        }
        if let Some(t) = self.tasks.get_mut(&task) {
            t.outstanding.remove(&gradient);
            t.children.extend(started.iter().copied());
        }
        self.maybe_complete(task);
        Ok(started)
    }

    /// `from` says `context` is released: drop it here and tell the other known workers. A
    /// release for a context this worker no longer holds is normal (fan-outs cross) and
    /// ignored; one from a worker outside the context is a violation.
    pub fn handle_release(
        &mut self,
        from: WorkerId,
        context: ContextId,
        cause: Option<BackwardError>,
    ) -> Result<(), ProtocolViolation> {
        let Some(ctx) = self.contexts.get(&context) else {
            return Ok(());
        };
        if !ctx.known.contains(&from) {
            return Err(ProtocolViolation::NotInContext { from, context });
        }
        let failure = cause.is_some();
        let error = cause.unwrap_or(BackwardError::Released {
            worker: from,
            context,
        });
        self.drop_context(context, Some(from), &error, failure);
        Ok(())
    }
}
