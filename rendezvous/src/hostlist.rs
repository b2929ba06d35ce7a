//! Slurm's compressed host lists: `node[01-03,07],gpu-a[1-2]` is `node01 node02 node03 node07
//! gpu-a1 gpu-a2`, as `scontrol show hostnames` expands it.
//!
//! A list is comma-separated entries (commas inside brackets belong to the bracket). An entry is
//! text with any number of bracket groups; each group lists numbers and ranges `lo-hi`, and an
//! entry with several groups expands to their cartesian product, leftmost slowest
//! (`r[1-2]n[1-2]` is `r1n1 r1n2 r2n1 r2n2`). A range's numbers are zero-padded to the width of
//! its lower bound (`01-10` gives `01 ... 10`; `8-10` gives `8 9 10`), as Slurm pads them.
//!
//! Parsing checks the whole list and never expands it: [`HostList::first`] is cheap for any
//! size, and [`HostList::expand`] refuses lists longer than a limit. A host name longer than
//! [`MAX_HOST_LEN`] bytes is refused when parsing (zero padding as wide as the list itself
//! could otherwise make each expanded name as long as the list), so an expansion of at most
//! `limit` hosts holds at most `limit * MAX_HOST_LEN` bytes of names.
//!
//! ```
//! use tensorwire_rendezvous::hostlist::HostList;
//!
//! let hosts = HostList::parse("node[01-03,07],gpu-a[1-2]")?;
//! assert_eq!(hosts.first(), "node01");
//! assert_eq!(hosts.len(), 6);
//! assert_eq!(hosts.expand(100)?, ["node01", "node02", "node03", "node07", "gpu-a1", "gpu-a2"]);
//! # Ok::<(), tensorwire_rendezvous::hostlist::HostListError>(())
//! ```

use std::fmt::Write as _;

/// Longest host name a list may give, in bytes: a DNS name's limit (253) with room to spare.
pub const MAX_HOST_LEN: usize = 255;

/// Why a host list cannot be read.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum HostListError {
    /// The list names no host at all.
    #[error("host list {list:?} is empty")]
    Empty {
        /// The list.
        list: String,
    },
    /// An entry between commas is empty (`a,,b`).
    #[error("host list {list:?} has an empty entry")]
    EmptyEntry {
        /// The list.
        list: String,
    },
    /// A `[` without its `]`, a `]` without its `[`, or a `[` inside brackets.
    #[error("host list {list:?} has unbalanced brackets")]
    Unbalanced {
        /// The list.
        list: String,
    },
    /// Something in brackets is not a number or a range `lo-hi` of numbers.
    #[error("host list {list:?}: {item:?} in brackets is not a number or a range lo-hi")]
    BadRange {
        /// The list.
        list: String,
        /// The offending piece.
        item: String,
    },
    /// A range whose upper bound is below its lower bound.
    #[error("host list {list:?}: range {item:?} goes backwards")]
    Backwards {
        /// The list.
        list: String,
        /// The offending range.
        item: String,
    },
    /// An entry gives host names longer than [`MAX_HOST_LEN`] bytes.
    #[error("host list {list:?}: entry {entry:?} gives host names of up to {len} bytes, more than the limit of {max}")]
    HostTooLong {
        /// The list.
        list: String,
        /// The entry (at most its first 64 characters).
        entry: String,
        /// The length of its longest host name.
        len: usize,
        /// The limit, [`MAX_HOST_LEN`].
        max: usize,
    },
    /// Expanding would give more hosts than allowed.
    #[error("host list {list:?} names {count} hosts, more than the limit of {limit}")]
    TooLong {
        /// The list.
        list: String,
        /// Hosts it names (saturated at `u128::MAX`).
        count: u128,
        /// The limit given.
        limit: usize,
    },
}

/// A range of numbers in brackets, padded to `width` digits.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Range {
    lo: u64,
    hi: u64,
    width: usize,
}

impl Range {
    fn len(&self) -> u128 {
        u128::from(self.hi - self.lo) + 1
    }
}

/// A piece of an entry: literal text or a bracket group (a list of ranges).
#[derive(Debug, Clone, PartialEq, Eq)]
enum Piece {
    Text(String),
    Group(Vec<Range>),
}

/// A parsed, validated Slurm host list (see the [module](self) documentation).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HostList {
    source: String,
    entries: Vec<Vec<Piece>>,
}

impl HostList {
    /// Parses `list` (surrounding whitespace is ignored).
    ///
    /// # Errors
    /// [`HostListError`] naming the list and, where there is one, the bad piece.
    pub fn parse(list: &str) -> Result<HostList, HostListError> {
        let source = list.trim().to_owned();
        if source.is_empty() {
            return Err(HostListError::Empty { list: source });
        }
        let mut entries = Vec::new();
        for entry in split_top_level(&source)? {
            if entry.is_empty() {
                return Err(HostListError::EmptyEntry { list: source });
            }
            let pieces = parse_entry(&source, entry)?;
            let len = longest_host(&pieces);
            if len > MAX_HOST_LEN {
                return Err(HostListError::HostTooLong {
                    entry: entry.chars().take(64).collect(),
                    list: source,
                    len,
                    max: MAX_HOST_LEN,
                });
            }
            entries.push(pieces);
        }
        Ok(HostList { source, entries })
    }

    /// The first host: what Slurm jobs use as the master (`MASTER_ADDR`).
    pub fn first(&self) -> String {
        let mut host = String::new();
        for piece in &self.entries[0] {
            match piece {
                Piece::Text(t) => host.push_str(t),
                Piece::Group(ranges) => push_number(&mut host, ranges[0].lo, ranges[0].width),
            }
        }
        host
    }

    /// How many hosts the list names (duplicates included; saturates at `u128::MAX`).
    pub fn len(&self) -> u128 {
        self.entries
            .iter()
            .map(|e| entry_len(e))
            .fold(0u128, u128::saturating_add)
    }

    /// Always false: a parsed list names at least one host.
    pub fn is_empty(&self) -> bool {
        false
    }

    /// Every host, in order.
    ///
    /// # Errors
    /// [`HostListError::TooLong`] when the list names more than `limit` hosts.
    pub fn expand(&self, limit: usize) -> Result<Vec<String>, HostListError> {
        let count = self.len();
        if count > limit as u128 {
            return Err(HostListError::TooLong {
                list: self.source.clone(),
                count,
                limit,
            });
        }
        let mut hosts = Vec::with_capacity(count as usize);
        for entry in &self.entries {
            let mut partial = vec![String::new()];
            for piece in entry {
                match piece {
                    Piece::Text(t) => partial.iter_mut().for_each(|h| h.push_str(t)),
                    Piece::Group(ranges) => {
                        let mut next = Vec::new();
                        for h in &partial {
                            for r in ranges {
                                for n in r.lo..=r.hi {
                                    let mut host = h.clone();
                                    push_number(&mut host, n, r.width);
                                    next.push(host);
                                }
                            }
                        }
                        partial = next;
                    }
                }
            }
            hosts.extend(partial);
        }
        Ok(hosts)
    }
}

fn entry_len(entry: &[Piece]) -> u128 {
    entry
        .iter()
        .map(|p| match p {
            Piece::Text(_) => 1,
            Piece::Group(ranges) => ranges
                .iter()
                .map(Range::len)
                .fold(0u128, u128::saturating_add),
        })
        .fold(1u128, u128::saturating_mul)
}

/// The length of the longest host name an entry gives: a number takes its range's width, or
/// more digits when the upper bound has more.
fn longest_host(entry: &[Piece]) -> usize {
    entry
        .iter()
        .map(|p| match p {
            Piece::Text(t) => t.len(),
            Piece::Group(ranges) => ranges
                .iter()
                .map(|r| r.width.max(digits(r.hi)))
                .max()
                .unwrap_or(0),
        })
        .fold(0usize, usize::saturating_add)
}

fn digits(n: u64) -> usize {
    n.checked_ilog10().map_or(1, |d| d as usize + 1)
}

fn push_number(out: &mut String, n: u64, width: usize) {
    let _ = write!(out, "{n:0width$}");
}

/// Splits at commas outside brackets, checking that brackets balance and do not nest.
fn split_top_level(list: &str) -> Result<Vec<&str>, HostListError> {
    let unbalanced = || HostListError::Unbalanced {
        list: list.to_owned(),
    };
    let mut parts = Vec::new();
    let mut depth = false;
    let mut start = 0;
    for (i, c) in list.char_indices() {
        match c {
            '[' if depth => return Err(unbalanced()),
            '[' => depth = true,
            ']' if !depth => return Err(unbalanced()),
            ']' => depth = false,
            ',' if !depth => {
                parts.push(list[start..i].trim());
                start = i + 1;
            }
            _ => {}
        }
    }
    if depth {
        return Err(unbalanced());
    }
    parts.push(list[start..].trim());
    Ok(parts)
}

fn parse_entry(list: &str, entry: &str) -> Result<Vec<Piece>, HostListError> {
    let mut pieces = Vec::new();
    let mut rest = entry;
    while !rest.is_empty() {
        match rest.find('[') {
            None => {
                pieces.push(Piece::Text(rest.to_owned()));
                break;
            }
            Some(open) => {
                if open > 0 {
                    pieces.push(Piece::Text(rest[..open].to_owned()));
                }
                // Balanced and unnested: checked by split_top_level.
                let close = open + rest[open..].find(']').unwrap_or(rest.len() - open);
                let inside = &rest[open + 1..close];
                pieces.push(Piece::Group(parse_group(list, inside)?));
                rest = &rest[(close + 1).min(rest.len())..];
            }
        }
    }
    Ok(pieces)
}

fn parse_group(list: &str, inside: &str) -> Result<Vec<Range>, HostListError> {
    inside
        .split(',')
        .map(|item| {
            let item = item.trim();
            let bad = || HostListError::BadRange {
                list: list.to_owned(),
                item: item.to_owned(),
            };
            let number = |s: &str| -> Result<u64, HostListError> {
                if s.is_empty() || !s.bytes().all(|b| b.is_ascii_digit()) {
                    return Err(bad());
                }
                s.parse().map_err(|_| bad())
            };
            let (lo_text, hi_text) = item.split_once('-').unwrap_or((item, item));
            let (lo, hi) = (number(lo_text)?, number(hi_text)?);
            if hi < lo {
                return Err(HostListError::Backwards {
                    list: list.to_owned(),
                    item: item.to_owned(),
                });
            }
            Ok(Range {
                lo,
                hi,
                width: lo_text.len(),
            })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn expand(s: &str) -> Vec<String> {
        HostList::parse(s).unwrap().expand(1 << 20).unwrap()
    }

    #[test]
    fn slurm_examples_expand_as_scontrol_does() {
        assert_eq!(
            expand("node[01-03,07],gpu-a[1-2]"),
            ["node01", "node02", "node03", "node07", "gpu-a1", "gpu-a2"]
        );
        assert_eq!(expand("single"), ["single"]);
        assert_eq!(expand("a, b ,c"), ["a", "b", "c"]);
        assert_eq!(expand("n[8-10]"), ["n8", "n9", "n10"]);
        assert_eq!(expand("n[098-101]"), ["n098", "n099", "n100", "n101"]);
        assert_eq!(expand("r[1-2]n[1-2]"), ["r1n1", "r1n2", "r2n1", "r2n2"]);
        assert_eq!(expand("n[3]-ib"), ["n3-ib"]);
        assert_eq!(expand("[1-2]"), ["1", "2"]);
        assert_eq!(HostList::parse("gpu[007-100],x").unwrap().first(), "gpu007");
        // A huge list is validated and its first host found without expanding it.
        let huge = HostList::parse("n[0-99999999999]").unwrap();
        assert_eq!((huge.first().as_str(), huge.len()), ("n0", 100_000_000_000));
        assert!(matches!(
            huge.expand(10),
            Err(HostListError::TooLong { limit: 10, .. })
        ));
    }

    /// The bug this guards against: zero padding as wide as the list made every expanded
    /// name as long as the list, so `expand(limit)` could hold `limit` times the list's length
    /// (a 10 kB list of 100000 hosts: a gigabyte).
    #[test]
    fn host_names_past_the_limit_are_refused_before_expanding() {
        let wide = format!("n[{}-99999]", "0".repeat(10_000));
        match HostList::parse(&wide) {
            Err(HostListError::HostTooLong { len, max, .. }) => {
                assert_eq!((len, max), (10_001, MAX_HOST_LEN));
            }
            other => panic!("expected HostTooLong, got {other:?}"),
        }
        let long_text = format!("{}[1-2]", "a".repeat(MAX_HOST_LEN));
        assert!(matches!(
            HostList::parse(&long_text),
            Err(HostListError::HostTooLong { len: 256, .. })
        ));
        // Exactly at the limit is fine, and so is a list of many such names.
        let at_limit = format!("{}[1-9]", "a".repeat(MAX_HOST_LEN - 1));
        let hosts = HostList::parse(&at_limit).unwrap().expand(9).unwrap();
        assert!(hosts.iter().all(|h| h.len() == MAX_HOST_LEN));
        // The width counts the upper bound's digits too.
        let wider_hi = format!("{}[1-10]", "a".repeat(MAX_HOST_LEN - 1));
        assert!(matches!(
            HostList::parse(&wider_hi),
            Err(HostListError::HostTooLong { len: 256, .. })
        ));
        // A list naming a billion hosts is refused with a typed error, not expanded.
        let huge = HostList::parse("n[0-999999999]").unwrap();
        assert!(matches!(
            huge.expand(1 << 20),
            Err(HostListError::TooLong {
                count: 1_000_000_000,
                ..
            })
        ));
    }

    #[test]
    fn malformed_lists_name_the_problem() {
        let err = |s: &str| HostList::parse(s).unwrap_err().to_string();
        assert_eq!(err("  "), "host list \"\" is empty");
        assert_eq!(err("a,,b"), "host list \"a,,b\" has an empty entry");
        assert_eq!(err("n[1-2"), "host list \"n[1-2\" has unbalanced brackets");
        assert_eq!(err("n1-2]"), "host list \"n1-2]\" has unbalanced brackets");
        assert_eq!(
            err("n[[1]]"),
            "host list \"n[[1]]\" has unbalanced brackets"
        );
        assert_eq!(
            err("n[1-x]"),
            "host list \"n[1-x]\": \"1-x\" in brackets is not a number or a range lo-hi"
        );
        assert!(err("n[]").contains("\"\" in brackets"));
        assert!(err("n[1,]").contains("\"\" in brackets"));
        assert!(err("n[-3]").contains("\"-3\" in brackets"));
        assert!(err("n[1-2-3]").contains("\"1-2-3\""));
        assert_eq!(
            err("n[5-3]"),
            "host list \"n[5-3]\": range \"5-3\" goes backwards"
        );
        assert!(err("n[99999999999999999999]").contains("not a number"));
    }

    /// Host names and a compressed list that names them, built from random prefixes and
    /// numbers: ranges of consecutive numbers, single numbers, padded and not.
    fn compressed() -> impl Strategy<Value = (String, Vec<String>)> {
        let group = (
            "[a-z][a-z0-9-]{0,6}",
            1usize..4,
            proptest::collection::vec((0u64..500, 0u64..5), 1..4),
        );
        proptest::collection::vec(group, 1..4).prop_map(|groups| {
            let mut hosts = Vec::new();
            let mut entries = Vec::new();
            for (prefix, width, ranges) in groups {
                let mut items = Vec::new();
                for (lo, extra) in ranges {
                    let hi = lo + extra;
                    for n in lo..=hi {
                        hosts.push(format!("{prefix}{n:0width$}"));
                    }
                    let lo_text = format!("{lo:0width$}");
                    items.push(if extra == 0 {
                        lo_text
                    } else {
                        format!("{lo_text}-{hi}")
                    });
                }
                entries.push(format!("{prefix}[{}]", items.join(",")));
            }
            (entries.join(","), hosts)
        })
    }

    proptest! {
        #[test]
        fn compressed_lists_expand_to_their_hosts((list, hosts) in compressed()) {
            let parsed = HostList::parse(&list).unwrap();
            prop_assert_eq!(parsed.len(), hosts.len() as u128);
            prop_assert_eq!(parsed.first(), hosts[0].clone());
            prop_assert_eq!(parsed.expand(hosts.len()).unwrap(), hosts);
        }

        #[test]
        fn plain_names_are_themselves(names in proptest::collection::vec("[a-z][a-z0-9.-]{0,10}", 1..6)) {
            let parsed = HostList::parse(&names.join(",")).unwrap();
            prop_assert_eq!(parsed.expand(names.len()).unwrap(), names);
        }

        #[test]
        fn arbitrary_text_never_panics(s in "[a-z0-9,\\[\\]-]{0,24}") {
            if let Ok(parsed) = HostList::parse(&s) {
                let first = parsed.first();
                if let Ok(all) = parsed.expand(10_000) {
                    prop_assert_eq!(all.first(), Some(&first));
                }
            }
        }
    }
}
