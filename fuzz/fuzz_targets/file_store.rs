//! Fuzzes `FileStore` reading a file in PyTorch `FileStore`'s format: the input is the file's
//! contents (as another process, or a torn write, may have left it) followed by store
//! operations, run through the public `Store` API on a real file.
//!
//! Input: `u16` length (little-endian), that many bytes of file, then operations of
//! `[op, key index, len, len bytes of value]`.
//!
//! Must hold: no panic and no hang, and every operation's result is the one a model of the table
//! (parsed here independently) predicts. A torn last record (its writer died mid-append) is not
//! part of the table: readers ignore it and the next writer cuts it off.
#![no_main]

use std::collections::HashMap;
use std::sync::OnceLock;
use std::time::Duration;

use libfuzzer_sys::fuzz_target;
use tensorwire_store::protocol::parse_c10d_int;
use tensorwire_store::{FileStore, Store, StoreError};

const KEYS: [&str; 5] = ["a", "b", "a/b", "", "-"];

fn runtime() -> &'static tokio::runtime::Runtime {
    static RT: OnceLock<tokio::runtime::Runtime> = OnceLock::new();
    RT.get_or_init(|| {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap()
    })
}

/// Parses the log as PyTorch writes it, up to a torn last record if there is one.
fn model_of(file: &[u8]) -> HashMap<Vec<u8>, Vec<u8>> {
    let mut map = HashMap::new();
    let mut at = 0;
    let field = |at: &mut usize| -> Option<Vec<u8>> {
        let len = u32::from_ne_bytes(file.get(*at..*at + 4)?.try_into().ok()?) as usize;
        let bytes = file.get(*at + 4..(*at + 4).checked_add(len)?)?.to_vec();
        *at += 4 + len;
        Some(bytes)
    };
    while at < file.len() {
        let (Some(key), Some(value)) = (field(&mut at), field(&mut at)) else {
            break;
        };
        match key.strip_prefix(b"-") {
            Some(deleted) => {
                map.remove(deleted);
            }
            None => {
                map.insert(key, value);
            }
        }
    }
    map
}

fn full(key: &str) -> Vec<u8> {
    format!("/{key}").into_bytes()
}

fuzz_target!(|data: &[u8]| {
    let Some((len, rest)) = data.split_first_chunk::<2>() else {
        return;
    };
    let n = usize::from(u16::from_le_bytes(*len)).min(rest.len());
    let (file, mut ops) = rest.split_at(n);
    let path = std::env::temp_dir().join(format!("tw-fuzz-file-store-{}", std::process::id()));
    std::fs::write(&path, file).unwrap();
    let mut model = model_of(file);
    let store = FileStore::with_timeout(&path, None, Duration::ZERO);
    runtime().block_on(async {
        while let [op, key, len, tail @ ..] = ops {
            let k = KEYS[usize::from(*key) % KEYS.len()];
            let k2 = KEYS[usize::from(*key / 8) % KEYS.len()];
            let n = usize::from(*len).min(tail.len());
            let (value, after) = tail.split_at(n);
            ops = after;
            match op % 9 {
                0 => {
                    let got = store.get(k).await;
                    {
                        let m = &model;
                        match m.get(&full(k)) {
                            Some(v) => assert_eq!(got.unwrap(), *v),
                            None => assert!(matches!(got, Err(StoreError::Timeout { .. }))),
                        }
                    }
                }
                1 => {
                    let got = store.set(k, value).await;
                    {
                        let m = &mut model;
                        got.unwrap();
                        m.insert(full(k), value.to_vec());
                    }
                }
                2 => {
                    let delta = i64::from_le_bytes(
                        value
                            .get(..8)
                            .and_then(|b| b.try_into().ok())
                            .unwrap_or([1, 0, 0, 0, 0, 0, 0, 0]),
                    );
                    let got = store.add(k, delta).await;
                    {
                        let m = &mut model;
                        let current = match m.get(&full(k)) {
                            Some(v) if !v.is_empty() => parse_c10d_int(v),
                            _ => Some(0),
                        };
                        match current.map(|c| c.checked_add(delta)) {
                            Some(Some(sum)) => {
                                assert_eq!(got.unwrap(), sum);
                                m.insert(full(k), sum.to_string().into_bytes());
                            }
                            Some(None) => {
                                assert!(matches!(got, Err(StoreError::InvalidArgument { .. })))
                            }
                            None => assert!(matches!(got, Err(StoreError::NotAnInteger { .. }))),
                        }
                    }
                }
                3 => {
                    let got = store.check(&[k, k2]).await;
                    {
                        let m = &model;
                        let want = m.contains_key(&full(k)) && m.contains_key(&full(k2));
                        assert_eq!(got.unwrap(), want);
                    }
                }
                4 => {
                    let got = store.num_keys().await;
                    {
                        let m = &model;
                        assert_eq!(got.unwrap(), m.len() as i64);
                    }
                }
                5 => {
                    let got = store.delete_key(k).await;
                    {
                        let m = &mut model;
                        assert_eq!(got.unwrap(), m.remove(&full(k)).is_some());
                    }
                }
                6 => {
                    let (expected, desired) = value.split_at(value.len() / 2);
                    let got = store.compare_set(k, expected, desired).await;
                    {
                        let m = &mut model;
                        let want = match m.get(&full(k)) {
                            None if expected.is_empty() => {
                                m.insert(full(k), desired.to_vec());
                                desired.to_vec()
                            }
                            None => expected.to_vec(),
                            Some(v) if v.as_slice() == expected => {
                                m.insert(full(k), desired.to_vec());
                                desired.to_vec()
                            }
                            Some(v) => v.clone(),
                        };
                        assert_eq!(got.unwrap(), want);
                    }
                }
                7 => {
                    let got = store.append(k, value).await;
                    {
                        let m = &mut model;
                        got.unwrap();
                        m.entry(full(k)).or_default().extend_from_slice(value);
                    }
                }
                _ => {
                    let got = store.multi_get(&[k, k2]).await;
                    {
                        let m = &model;
                        match (m.get(&full(k)), m.get(&full(k2))) {
                            (Some(a), Some(b)) => assert_eq!(got.unwrap(), [a.clone(), b.clone()]),
                            _ => assert!(matches!(got, Err(StoreError::Timeout { .. }))),
                        }
                    }
                }
            }
        }
    });
    drop(store);
    let _ = std::fs::remove_file(&path);
});
