//! Users' own serde types in arguments and results: remote references anywhere inside them
//! travel (the codec hands its context to every nested value), a type's own serialization
//! errors reach the caller with their message, and a reference outside a call neither
//! serializes nor deserializes. In-process agents over the in-memory transport, in virtual
//! time.

use std::collections::BTreeMap;
use std::time::Duration;

use serde::{Deserialize, Deserializer, Serialize, Serializer};
use tensorwire_rpc::{Agent, Functions, RRef, RpcError};
use tensorwire_testkit::MemoryCluster;

/// References in every shape serde has: a sequence of options, a map, an enum's newtype and
/// struct variants, and a plain field.
#[derive(Serialize, Deserialize)]
struct Batch {
    label: String,
    parts: Vec<Option<RRef<Vec<i64>>>>,
    named: BTreeMap<String, RRef<Vec<i64>>>,
    extra: Extra,
    last: Extra,
}

#[derive(Serialize, Deserialize)]
enum Extra {
    Nothing,
    One(RRef<Vec<i64>>),
    Scaled { by: i64, rref: RRef<Vec<i64>> },
}

/// A value that refuses to be serialized, saying why.
struct Secret;

impl Serialize for Secret {
    fn serialize<S: Serializer>(&self, _: S) -> Result<S::Ok, S::Error> {
        Err(serde::ser::Error::custom(
            "the secret may not leave this worker",
        ))
    }
}

/// A number that refuses to be deserialized when it is odd, saying why.
struct Even(u32);

impl<'de> Deserialize<'de> for Even {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let n = u32::deserialize(d)?;
        if n % 2 == 1 {
            return Err(serde::de::Error::custom(format!("{n} is odd")));
        }
        Ok(Even(n))
    }
}

async fn sum(r: &RRef<Vec<i64>>) -> Result<i64, String> {
    let v = r.to_here(None).await.map_err(|e| e.to_string())?;
    Ok(v.iter().sum())
}

fn functions() -> Functions {
    let f = Functions::new();
    f.register("make_vec", |n: usize| async move {
        Ok::<_, String>((1..=n as i64).collect::<Vec<i64>>())
    })
    .unwrap();
    f.register("total", |b: Batch| async move {
        let mut total = 0;
        for r in b.parts.iter().flatten() {
            total += sum(r).await?;
        }
        for r in b.named.values() {
            total += sum(r).await?;
        }
        for extra in [&b.extra, &b.last] {
            total += match extra {
                Extra::Nothing => 0,
                Extra::One(r) => sum(r).await?,
                Extra::Scaled { by, rref } => by * sum(rref).await?,
            };
        }
        Ok::<_, String>((b.label, total))
    })
    .unwrap();
    // Hands a reference back inside a user type (forked for the caller on the way).
    f.register("wrap", |r: RRef<Vec<i64>>| async move {
        Ok::<_, String>(Extra::Scaled { by: 10, rref: r })
    })
    .unwrap();
    f.register("half", |n: Even| async move { Ok::<_, String>(n.0 / 2) })
        .unwrap();
    f
}

async fn group(n: usize) -> Vec<Agent> {
    MemoryCluster::new()
        .group(n, |_, o| o.functions = functions())
        .await
        .unwrap()
}

async fn shutdown_all(agents: Vec<Agent>) {
    let tasks: Vec<_> = agents
        .into_iter()
        .map(|a| {
            tokio::spawn(async move {
                a.shutdown(tensorwire_rpc::Shutdown::graceful(Duration::from_secs(20)))
                    .await
            })
        })
        .collect();
    for t in tasks {
        t.await.unwrap().unwrap();
    }
}

async fn wait_until(what: &str, cond: impl Fn() -> bool) {
    tensorwire_testkit::wait_until(what, Duration::from_secs(10), cond).await;
}

#[tokio::test(start_paused = true)]
async fn references_anywhere_inside_a_users_type_travel_and_are_freed() {
    let agents = group(3).await;
    let (a, owner) = (&agents[0], &agents[2]);
    let make = |n: usize| a.remote::<_, Vec<i64>>("w2", "make_vec", &n, None).unwrap();
    let (one, two, three, four) = (make(1), make(2), make(3), make(4));
    let batch = Batch {
        label: "b".into(),
        parts: vec![Some(one.clone()), None, Some(two.clone())],
        named: BTreeMap::from([("three".to_owned(), three.clone())]),
        extra: Extra::One(four.clone()),
        last: Extra::Scaled {
            by: 100,
            rref: one.clone(),
        },
    };
    // 1 + 3 + 6 + 10 + 100 * 1
    let (label, total): (String, i64) = a.rpc_sync("w1", "total", &batch, None).await.unwrap();
    assert_eq!((label.as_str(), total), ("b", 120));

    // A reference comes back inside a user type, accepted by the caller.
    let back: Extra = a.rpc_sync("w1", "wrap", &three, None).await.unwrap();
    let Extra::Scaled { by: 10, rref } = back else {
        panic!("wrap returned another variant");
    };
    assert_eq!(rref.to_here(None).await.unwrap(), vec![1, 2, 3]);

    assert_eq!(owner.owned_value_count(), 4);
    drop((batch, rref, one, two, three, four));
    wait_until("every value is freed", || owner.owned_value_count() == 0).await;
    shutdown_all(agents).await;
}

#[tokio::test(start_paused = true)]
async fn a_value_that_refuses_to_serialize_is_named_and_its_forks_undone() {
    let agents = group(3).await;
    let (a, owner) = (&agents[0], &agents[2]);
    let r: RRef<Vec<i64>> = a.remote("w2", "make_vec", &2usize, None).unwrap();
    r.created().await.unwrap();
    // The reference is forked for w1 before the secret fails: the fork is undone.
    let e = a
        .rpc_sync::<_, i64>("w1", "total", &(&r, Secret), None)
        .await
        .unwrap_err();
    assert!(matches!(e, RpcError::Serialization { .. }), "{e}");
    assert!(
        e.to_string()
            .contains("the secret may not leave this worker"),
        "{e}"
    );
    drop(r);
    wait_until("the value is freed", || owner.owned_value_count() == 0).await;
    assert!(a.debug_info().protocol.forks.is_empty());
    shutdown_all(agents).await;
}

#[tokio::test(start_paused = true)]
async fn a_value_that_refuses_to_deserialize_says_why_to_the_caller() {
    let agents = group(2).await;
    let half: u32 = agents[0].rpc_sync("w1", "half", &8u32, None).await.unwrap();
    assert_eq!(half, 4);
    let e = agents[0]
        .rpc_sync::<_, u32>("w1", "half", &7u32, None)
        .await
        .unwrap_err();
    assert!(e.to_string().contains("7 is odd"), "{e}");
    shutdown_all(agents).await;
}

#[tokio::test(start_paused = true)]
async fn a_reference_outside_a_call_neither_serializes_nor_deserializes() {
    let agents = group(2).await;
    let r: RRef<Vec<i64>> = agents[0].remote("w1", "make_vec", &2usize, None).unwrap();
    r.created().await.unwrap();
    assert!(postcard::to_allocvec(&r).is_err());
    assert!(postcard::to_allocvec(&Extra::One(r.clone())).is_err());
    // Bytes that would be a fork inside a call are nothing outside one (and accept nothing).
    let bytes = postcard::to_allocvec(&(1u64, 2u64, 3u64, 4u64, 5u64, 6u64)).unwrap();
    let e = postcard::from_bytes::<RRef<Vec<i64>>>(&bytes).unwrap_err();
    assert!(matches!(e, postcard::Error::SerdeDeCustom), "{e:?}");
    drop(r);
    wait_until("the value is freed", || agents[1].owned_value_count() == 0).await;
    shutdown_all(agents).await;
}
