//! The `relay` scenario (issue 44's relay-first race across processes).

use super::*;

/// The relay-first race across processes (4 workers): `w3` guesses `w1`'s first context id and
/// reaches `w0` with it first (a forward call with a made-up capability, which makes a copy of
/// the context on `w0`); then `w1` runs a pass in that context through `w2`, which passes it on
/// to `w0` (the relay: `w0`'s first honest message in the context). `w0` asks `w1`, which
/// vouches for the relay's capability: the call goes through and `w1`'s backward gives the
/// gradient one engine computes. Nobody is dropped.
pub(crate) async fn relay() -> Result<(), String> {
    let (agent, dist, p, rank) = start("relay").await?;
    let mut events = agent.peer_events();
    let guessed = ContextId::new(1, 0);
    if rank == 3 {
        // The autograd layer's messages as it encodes them.
        #[derive(serde::Serialize)]
        struct ForwardRequest {
            context: ContextId,
            capability: u128,
            message: Option<AutogradMessageId>,
            tensors: Vec<Tensor>,
            requires_grad: Vec<bool>,
            args: (Vec<f32>, Vec<String>),
        }
        #[derive(serde::Deserialize)]
        struct ForwardResponse {
            _message: Option<AutogradMessageId>,
            _tensors: Vec<Tensor>,
            _requires_grad: Vec<bool>,
            _result: (),
        }
        let guess = ForwardRequest {
            context: guessed,
            capability: 5,
            message: Some(AutogradMessageId::new(3, 1 << 20)),
            tensors: Vec::new(),
            requires_grad: Vec::new(),
            args: (vec![0.5, -1.0, 2.0], Vec::new()),
        };
        agent
            .rpc_sync::<_, ForwardResponse>("w0", "__tw_autograd/fn/stage", &guess, None)
            .await
            .map_err(|e| format!("the guess was refused on w0: {e}"))?;
        println!("OK guessed {guessed} on w0");
    }
    // w0 holds the guess's copy before w1 makes the context.
    agent
        .barrier("guessed", Duration::from_secs(60))
        .await
        .map_err(|e| e.to_string())?;
    if rank == 0 && dist.context_count() != 1 {
        return Err(format!(
            "w0 holds {} contexts after the guess",
            dist.context_count()
        ));
    }
    if rank == 1 {
        let ctx = dist.context().map_err(|e| e.to_string())?;
        if ctx.id() != guessed {
            return Err(format!("w1's first context is {}, not {guessed}", ctx.id()));
        }
        let x = hop(&input(), &p);
        let ((), out) = ctx
            .rpc_sync("w2", "hop", &vec!["w0".to_owned()], &[x], None)
            .await
            .map_err(|e| format!("the pass through the relay failed: {e}"))?;
        ctx.backward(&[(loss(&out[0]), None)], false)
            .await
            .map_err(|e| e.to_string())?;
        // One engine: w1's hop, w2's hop, w0's hop (doubled), doubled on w2.
        let params: Vec<CTensor> = (0..3).map(param).collect();
        let y = (hop(&hop(&hop(&input(), &params[1]), &params[2]), &params[0]) * 4.0).unwrap();
        let want = loss(&y).backward().unwrap();
        let want = want.get(&params[1]).unwrap().to_vec1::<f32>().unwrap();
        let got = ctx
            .gradient(&p)
            .ok_or("no gradient of w1's parameter")?
            .to_vec1::<f32>()
            .unwrap();
        if !close(&got, &want) {
            return Err(format!("w1's gradient {got:?}, one engine's {want:?}"));
        }
        ctx.release().await.map_err(|e| e.to_string())?;
        println!("OK relayed through w2 to w0 after the guess: gradient {got:?}");
    }
    agent
        .barrier("relayed", Duration::from_secs(60))
        .await
        .map_err(|e| e.to_string())?;
    if let Some(event) = events.try_recv() {
        return Err(format!("rank {rank} saw {event:?}"));
    }
    if dist.violations() != 0 {
        return Err(format!(
            "rank {rank} counted {} violations",
            dist.violations()
        ));
    }
    finish(agent, true).await?;
    println!("OK relay rank {rank}");
    Ok(())
}
