//! API keys: who may call the API, under which name its requests are logged and counted, and how
//! many requests each may have in flight.
//!
//! Keys come from `--api-key` (one key, named `default`) and `--api-keys-file`, a text file of
//! one key per line: `NAME KEY [MAX_CONCURRENT]` (whitespace-separated; `#` starts a comment;
//! names are letters, digits, `-`, `_` and `.`, so they are safe as metric labels). A key
//! without a limit gets `--api-key-max-concurrent` (0: none).
//!
//! Invariants:
//! - a request counts against its key from admission until its response body is done or
//!   dropped (a streamed answer counts until its last byte, a client that disconnects stops
//!   counting at once): the [`KeyGuard`] travels with the body;
//! - the in-flight count of a key never exceeds its limit: admission is one atomic
//!   increment-if-below, so concurrent requests cannot both take the last slot;
//! - a key's secret is never logged; its name is.

use std::path::Path;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;

use crate::error::CoordinatorError;

/// Metric names of the API keys.
pub mod metric {
    /// Responses by `key` (its name) and `status`.
    pub const REQUESTS_TOTAL: &str = "cleave_api_key_requests_total";
    /// Requests in flight by `key`.
    pub const IN_FLIGHT: &str = "cleave_api_key_requests_in_flight";
}

#[derive(Debug)]
struct Key {
    name: String,
    secret: String,
    /// Most requests in flight; `None`: no limit.
    limit: Option<u32>,
    in_flight: AtomicU32,
}

/// The keys the API accepts. Empty: the API is open.
#[derive(Debug, Default)]
pub struct ApiKeys {
    keys: Vec<Key>,
}

impl ApiKeys {
    /// Keys from `--api-key` and the text of `--api-keys-file`, with `default_limit` (0: none)
    /// for those that name no limit. Names and secrets must be unique.
    pub fn new(
        single: Option<&str>,
        file: Option<(&Path, &str)>,
        default_limit: u32,
    ) -> Result<Self, CoordinatorError> {
        let limit = (default_limit > 0).then_some(default_limit);
        let mut keys = Vec::new();
        if let Some(secret) = single.filter(|s| !s.is_empty()) {
            keys.push(Key { name: "default".into(), secret: secret.into(), limit, in_flight: AtomicU32::new(0) });
        }
        if let Some((path, text)) = file {
            let bad = |line: usize, reason: String| CoordinatorError::KeysFile {
                path: path.display().to_string(),
                reason: format!("line {line}: {reason}"),
            };
            for (i, raw) in text.lines().enumerate() {
                let line = raw.split('#').next().unwrap_or("").trim();
                if line.is_empty() {
                    continue;
                }
                let fields: Vec<&str> = line.split_whitespace().collect();
                let (name, secret, own_limit) = match fields[..] {
                    [n, s] => (n, s, None),
                    [n, s, l] => {
                        let l: u32 = l.parse().map_err(|_| bad(i + 1, format!("limit {l:?} is not a number")))?;
                        (n, s, Some(l))
                    }
                    _ => return Err(bad(i + 1, "expected NAME KEY [MAX_CONCURRENT]".into())),
                };
                if !name.chars().all(|c| c.is_ascii_alphanumeric() || "-_.".contains(c)) {
                    return Err(bad(i + 1, format!("name {name:?} has characters other than letters, digits, -_.")));
                }
                if keys.iter().any(|k: &Key| k.name == name) {
                    return Err(bad(i + 1, format!("name {name:?} appears twice")));
                }
                if keys.iter().any(|k: &Key| k.secret == secret) {
                    return Err(bad(i + 1, format!("the key of {name:?} is another name's key too")));
                }
                let limit = match own_limit {
                    Some(0) => None,
                    Some(l) => Some(l),
                    None => limit,
                };
                keys.push(Key { name: name.into(), secret: secret.into(), limit, in_flight: AtomicU32::new(0) });
            }
            if keys.is_empty() {
                return Err(CoordinatorError::KeysFile {
                    path: path.display().to_string(),
                    reason: "no key in the file (an open API is the default; give no file for that)".into(),
                });
            }
        }
        Ok(ApiKeys { keys })
    }

    /// Whether any key is required.
    pub fn required(&self) -> bool {
        !self.keys.is_empty()
    }

    /// The names of the keys, in order.
    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.keys.iter().map(|k| k.name.as_str())
    }

    /// Admits a request carrying `bearer`: the guard that counts it against its key, or why not.
    pub fn admit(self: &Arc<Self>, bearer: Option<&str>) -> Result<KeyGuard, CoordinatorError> {
        let given = bearer.ok_or(CoordinatorError::Unauthorized)?;
        // Every key is compared in full, so the time taken says nothing of which one matched.
        let mut found = None;
        for (i, k) in self.keys.iter().enumerate() {
            if constant_time_eq(k.secret.as_bytes(), given.as_bytes()) {
                found = Some(i);
            }
        }
        let index = found.ok_or(CoordinatorError::Unauthorized)?;
        let key = &self.keys[index];
        let limit = key.limit.unwrap_or(u32::MAX);
        key.in_flight
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| (n < limit).then_some(n + 1))
            .map_err(|_| CoordinatorError::KeyLimit { key: key.name.clone(), limit })?;
        metrics::gauge!(metric::IN_FLIGHT, "key" => key.name.clone()).increment(1.0);
        Ok(KeyGuard { keys: self.clone(), index })
    }

    /// Requests in flight under the key named `name` (tests, the admin view).
    pub fn in_flight(&self, name: &str) -> Option<u32> {
        self.keys.iter().find(|k| k.name == name).map(|k| k.in_flight.load(Ordering::Acquire))
    }
}

fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    if a.len() != b.len() {
        return false;
    }
    a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// One admitted request's place under its key; dropping it gives the place back.
#[derive(Debug)]
pub struct KeyGuard {
    keys: Arc<ApiKeys>,
    index: usize,
}

impl KeyGuard {
    /// The key's name.
    pub fn name(&self) -> &str {
        &self.keys.keys[self.index].name
    }
}

impl Drop for KeyGuard {
    fn drop(&mut self) {
        let key = &self.keys.keys[self.index];
        key.in_flight.fetch_sub(1, Ordering::AcqRel);
        metrics::gauge!(metric::IN_FLIGHT, "key" => key.name.clone()).decrement(1.0);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn keys(text: &str, default_limit: u32) -> Result<Arc<ApiKeys>, CoordinatorError> {
        ApiKeys::new(None, Some((Path::new("keys.txt"), text)), default_limit).map(Arc::new)
    }

    #[test]
    fn a_key_admits_up_to_its_limit_and_a_guard_gives_its_place_back() {
        let k = keys("# team keys\nalpha sk-a 2\nbeta sk-b   # no limit of its own\n", 0).unwrap();
        assert_eq!(k.names().collect::<Vec<_>>(), ["alpha", "beta"]);
        let g1 = k.admit(Some("sk-a")).unwrap();
        let g2 = k.admit(Some("sk-a")).unwrap();
        assert_eq!(g1.name(), "alpha");
        let e = k.admit(Some("sk-a")).unwrap_err();
        assert!(matches!(&e, CoordinatorError::KeyLimit { key, limit: 2 } if key == "alpha"), "{e}");
        // Another key is not held up by alpha's limit.
        let many: Vec<_> = (0..50).map(|_| k.admit(Some("sk-b")).unwrap()).collect();
        assert_eq!(k.in_flight("beta"), Some(50));
        drop(g1);
        let g3 = k.admit(Some("sk-a")).unwrap();
        assert_eq!(k.in_flight("alpha"), Some(2));
        drop((g2, g3, many));
        assert_eq!((k.in_flight("alpha"), k.in_flight("beta")), (Some(0), Some(0)));
    }

    #[test]
    fn wrong_or_missing_keys_are_unauthorized() {
        let k = keys("alpha sk-a\n", 0).unwrap();
        for given in [None, Some(""), Some("sk-"), Some("sk-ab"), Some("SK-A")] {
            assert!(matches!(k.admit(given), Err(CoordinatorError::Unauthorized)), "{given:?}");
        }
    }

    #[test]
    fn the_default_limit_applies_where_a_line_names_none_and_zero_means_none() {
        let k = keys("a sk-a\nb sk-b 0\n", 1).unwrap();
        let _g = k.admit(Some("sk-a")).unwrap();
        assert!(k.admit(Some("sk-a")).is_err());
        let _b: Vec<_> = (0..5).map(|_| k.admit(Some("sk-b")).unwrap()).collect();
        let single = Arc::new(ApiKeys::new(Some("sk-x"), None, 0).unwrap());
        assert_eq!(single.admit(Some("sk-x")).unwrap().name(), "default");
        assert!(!ApiKeys::new(None, None, 0).unwrap().required());
    }

    #[test]
    fn bad_files_are_refused_naming_the_line() {
        for (text, want) in [
            ("alpha\n", "line 1: expected NAME KEY"),
            ("alpha sk-a x\n", "line 1: limit \"x\""),
            ("a sk-a\na sk-b\n", "line 2: name \"a\" appears twice"),
            ("a sk-a\nb sk-a\n", "line 2: the key of \"b\""),
            ("a{x} sk-a\n", "line 1: name \"a{x}\""),
            ("# nothing\n\n", "no key in the file"),
        ] {
            let e = keys(text, 0).unwrap_err().to_string();
            assert!(e.contains(want) && e.contains("keys.txt"), "{text:?}: {e}");
        }
    }
}
