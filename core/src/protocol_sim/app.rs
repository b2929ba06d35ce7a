//! The model application on every simulated worker: what it does with the endpoint's events
//! (running functions, some nested or chained to a third worker, keeping values, accepting the
//! references that came with a body) and how it answers.

use super::*;

impl Cluster {
    pub(super) fn accept_all(&mut self, w: WorkerId, forks: &[RRefForkData]) -> Vec<RRefHandle> {
        self.given.extend(forks.iter().map(|f| (w, f.rref)));
        forks
            .iter()
            .map(|f| self.eps[w as usize].accept_fork(*f, self.clock.now()))
            .collect()
    }

    pub(super) fn app(&mut self, w: WorkerId, ev: Event<Body>) {
        let now = self.clock.now();
        if std::env::var_os("TW_SIM_TRACE").is_some() {
            eprintln!("event at {w}: {ev:?}");
        }
        match ev {
            Event::Call {
                token,
                function,
                body,
                deadline,
            } => {
                if let Some(t) = body.target {
                    self.check_holder(w, token, t.rref, "method call");
                }
                let handles = self.accept_all(w, &body.forks);
                let mut serving = Serving {
                    token,
                    keep_as: None,
                    body: Body {
                        data: body.data,
                        forks: vec![],
                        target: None,
                    },
                    waits_for: None,
                    handles,
                    confirming: None,
                };
                // A function runs once the references in its arguments are confirmed (the
                // endpoint parks the wait, by the caller's deadline).
                if !serving.handles.is_empty() {
                    if let Some(wait) =
                        self.eps[w as usize].wait_confirmed(&serving.handles, deadline)
                    {
                        self.stats.confirm_waits += 1;
                        serving.confirming = Some((wait, function, body.target));
                        self.apps[w as usize].serving.push(serving);
                        return;
                    }
                }
                self.run_function(w, serving, &function, body.target);
            }
            Event::ConfirmWaitDone { wait, outcome } => {
                let serving = &mut self.apps[w as usize].serving;
                let Some(i) = serving
                    .iter()
                    .position(|s| s.confirming.as_ref().is_some_and(|c| c.0 == wait))
                else {
                    return; // answered already (the end of the run answers everything)
                };
                let mut s = serving.remove(i);
                let Some((_, function, target)) = s.confirming.take() else {
                    return;
                };
                match outcome {
                    Ok(()) => self.run_function(w, s, &function, target),
                    Err(e) => {
                        self.stats.confirm_waits_failed += 1;
                        self.answer(w, s, Err(e.to_string()));
                    }
                }
            }
            Event::Remote {
                token,
                function,
                body,
                rref,
                ..
            } => {
                let handles = self.accept_all(w, &body.forks);
                let serving = Serving {
                    token,
                    keep_as: Some(rref),
                    body: Body {
                        data: body.data,
                        forks: vec![],
                        target: None,
                    },
                    waits_for: None,
                    handles,
                    confirming: None,
                };
                // `make` values keep the references they were given; `broken` fails.
                let outcome = if function == "make" {
                    Ok(())
                } else {
                    Err("cannot make".to_owned())
                };
                self.answer(w, serving, outcome);
            }
            Event::Fetch { token, rref } => {
                self.check_holder(w, token, rref, "fetch");
                let Some(inside) = self.apps[w as usize].values.get(&rref).cloned() else {
                    self.fail(format!(
                        "worker {w} was asked to serialize {rref}, which it does not keep"
                    ));
                };
                // The value's references travel with it, forked for the fetcher.
                let to = token.from();
                let forks = inside
                    .iter()
                    .filter_map(|h| self.eps[w as usize].fork_for(*h, to).ok())
                    .collect();
                self.eps[w as usize].respond(
                    token,
                    Ok(Body {
                        data: vec![2],
                        forks,
                        target: None,
                    }),
                );
            }
            Event::Completed { id, outcome } => {
                let app = &mut self.apps[w as usize];
                let Some(deadline) = app.calls.get(&id).copied() else {
                    self.fail(format!(
                        "worker {w}: call {id} completed but was never made"
                    ));
                };
                if !app.resolved.insert(id) {
                    self.fail(format!("worker {w}: call {id} resolved twice"));
                }
                let _ = deadline; // `check` holds every call to its deadline after each step.
                if let (true, Err(e)) = (self.chain_calls.contains(&(w, id)), &outcome) {
                    self.chain_failures.push((w, id, e.clone()));
                }
                match &outcome {
                    Err(CallError::Timeout { .. } | CallError::RRefCreationTimedOut { .. }) => {
                        self.stats.timeouts += 1;
                    }
                    Ok(body) if !body.forks.is_empty() => {
                        let got = self.accept_all(w, &body.forks);
                        self.apps[w as usize].held.extend(got);
                    }
                    _ => {}
                }
                // Requests waiting for this nested call can answer now.
                let serving = std::mem::take(&mut self.apps[w as usize].serving);
                let (ready, waiting): (Vec<_>, Vec<_>) =
                    serving.into_iter().partition(|s| s.waits_for == Some(id));
                self.apps[w as usize].serving = waiting;
                for s in ready {
                    self.answer(w, s, Ok(()));
                }
            }
            Event::Confirmed { .. } => {}
            // The simulation reports every loss itself (its own driver).
            Event::PeerLost { .. } => {}
            // Honest workers never forge a capability.
            Event::Misbehaved { peer, violation } => self.fail(format!(
                "worker {w} found honest worker {peer} forging: {violation}"
            )),
            Event::ShutdownComplete { outcome } => {
                let step = self.shutdown_step;
                self.apps[w as usize].shutdown.push((step, outcome));
                // The driver stops the endpoint either way (pending calls fail); a leaver's
                // once its membership leave is over.
                if !self
                    .group
                    .as_ref()
                    .is_some_and(|g| g.leaving.contains_key(&w))
                {
                    self.eps[w as usize].stop();
                }
            }
            Event::ReleaseValue { rref } => {
                let Some(inside) = self.apps[w as usize].values.remove(&rref) else {
                    self.fail(format!("worker {w} released {rref}, which it did not keep"));
                };
                if !self.released.insert(rref) {
                    self.fail(format!("{rref} released twice"));
                }
                self.stats.released += 1;
                // After a death the promise is weaker: a worker that dies while a fork it passed
                // on is unconfirmed leaves the owner unaware of that fork (as in PyTorch).
                if let Some(holder) = self.dead.is_empty().then(|| self.holder_of(rref)).flatten() {
                    self.fail(format!(
                        "worker {w} released {rref} while {holder} still refers to it; deferred {:?}",
                        self.apps.iter().map(|a| &a.deferred).collect::<Vec<_>>()
                    ));
                }
                // The value's own references go with it.
                for h in inside {
                    self.eps[w as usize].drop_handle(h, now);
                }
            }
        }
    }

    /// Runs the model function `function` for a request whose references are confirmed.
    pub(super) fn run_function(
        &mut self,
        w: WorkerId,
        mut serving: Serving,
        function: &str,
        target: Option<MethodTarget>,
    ) {
        match function {
            "method" => {
                let target = target.map(|t| t.rref).unwrap_or_else(|| {
                    self.fail(format!("worker {w}: a method call without a target"))
                });
                if !self.apps[w as usize].values.contains_key(&target) {
                    self.fail(format!(
                        "worker {w} was asked to run a method on {target}, which it does not keep (yet)"
                    ));
                }
                self.answer(w, serving, Ok(()));
            }
            "slow" => self.apps[w as usize].serving.push(serving),
            "nested" => {
                // Call a third worker (or anyone) before answering.
                let alive = self.alive();
                let third = alive[(w as usize + 1) % alive.len()];
                if let Ok(id) = self.eps[w as usize].call(
                    third,
                    "echo",
                    Body::default(),
                    Duration::from_secs(1),
                    self.clock.now(),
                ) {
                    self.stats.calls += 1;
                    self.track_call(w, id, Duration::from_secs(1));
                    serving.waits_for = Some(id);
                    self.apps[w as usize].serving.push(serving);
                } else {
                    self.answer(w, serving, Ok(()));
                }
            }
            "keep" => {
                let kept = std::mem::take(&mut serving.handles);
                self.apps[w as usize].held.extend(kept);
                self.answer(w, serving, Ok(()));
            }
            "chain" => {
                // A hop of a fire-and-forget chain: start the next hop (passing on the
                // references it got) and answer at once, without waiting for it.
                self.stats.chain_hops += 1;
                let left = serving.body.data.first().copied().unwrap_or(0);
                if left > 0 {
                    let alive = self.alive();
                    let next = alive[(w as usize + 1) % alive.len()];
                    let handles = serving.handles.clone();
                    self.start_chain(w, next, left - 1, &handles);
                }
                self.answer(w, serving, Ok(()));
            }
            "fail" => self.answer(w, serving, Err("refused".into())),
            _ => self.answer(w, serving, Ok(())),
        }
    }

    /// Worker `w` calls hop `left` of a fire-and-forget chain on `to`, passing on `handles`.
    pub(super) fn start_chain(
        &mut self,
        w: WorkerId,
        to: WorkerId,
        left: u8,
        handles: &[RRefHandle],
    ) {
        let forks = handles
            .iter()
            .filter_map(|h| self.eps[w as usize].fork_for(*h, to).ok())
            .collect();
        let body = Body {
            data: vec![left],
            forks,
            target: None,
        };
        match self.eps[w as usize].call(to, "chain", body, Duration::ZERO, self.clock.now()) {
            Ok(id) => {
                self.stats.calls += 1;
                self.track_call(w, id, Duration::ZERO);
                self.chain_calls.insert((w, id));
            }
            Err(e) => self.chain_failures.push((w, 0, e)),
        }
    }

    /// Answers a request; a `remote` keeps the references it got inside the value.
    pub(super) fn answer(&mut self, w: WorkerId, s: Serving, outcome: Result<(), String>) {
        let now = self.clock.now();
        match outcome {
            Ok(()) => {
                if let Some(rref) = s.keep_as {
                    if self.apps[w as usize]
                        .values
                        .insert(rref, s.handles)
                        .is_some()
                    {
                        self.fail(format!("worker {w} created {rref} twice"));
                    }
                    if !self.eps[w as usize].respond(s.token, Ok(s.body)) {
                        // The creator was lost meanwhile: nobody will ever refer to it.
                        let inside = self.apps[w as usize].values.remove(&rref);
                        for h in inside.into_iter().flatten() {
                            self.eps[w as usize].drop_handle(h, now);
                        }
                    }
                    return;
                }
                for h in s.handles {
                    self.eps[w as usize].drop_handle(h, now);
                }
                self.eps[w as usize].respond(s.token, Ok(s.body));
            }
            Err(message) => {
                for h in s.handles {
                    self.eps[w as usize].drop_handle(h, now);
                }
                let e = RemoteError {
                    worker: w,
                    kind: RemoteErrorKind::Failed,
                    message,
                };
                self.eps[w as usize].respond(s.token, Err(e));
            }
        }
    }

    pub(super) fn finish_slow_request(&mut self, w: WorkerId, rng: &mut SimRng) {
        let serving = &mut self.apps[w as usize].serving;
        let slow: Vec<usize> = (0..serving.len())
            .filter(|i| serving[*i].waits_for.is_none() && serving[*i].confirming.is_none())
            .collect();
        if !slow.is_empty() {
            let s = serving.remove(slow[rng.below(slow.len())]);
            self.answer(w, s, Ok(()));
        }
    }
}
