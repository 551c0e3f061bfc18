//! `--mix`: a load of several request shapes at once, for soak tests that must exercise every
//! path of a server (streamed and whole answers, both endpoints, several choices, clients that
//! leave mid-stream, and bursts past the server's admission limits).
//!
//! Each arrival of the schedule draws one [`Shape`] with probability proportional to its
//! weight, from an RNG seeded by `--seed`: two runs with the same arguments send the same
//! shapes in the same order. A [`Shape::Burst`] arrival sends `--burst-size` streamed
//! completions at once instead of one request.

use std::fmt;
use std::str::FromStr;

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde::Serialize;

use crate::{BenchError, Result};

/// What one arrival of a mixed load sends.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Shape {
    /// /v1/completions, streamed.
    Stream,
    /// /v1/completions, one JSON answer.
    Full,
    /// /v1/chat/completions, streamed.
    ChatStream,
    /// /v1/chat/completions, one JSON answer.
    Chat,
    /// /v1/completions, streamed, with `n` = `--mix-choices` (> 1).
    Multi,
    /// /v1/completions, streamed; the client drops the connection after `--disconnect-after`
    /// text chunks (a disconnect by design, not an error).
    Disconnect,
    /// `--burst-size` streamed completions sent at the same moment (meant to exceed the
    /// server's admission queue or per-key limit: some are refused with 429 or 503).
    Burst,
}

impl Shape {
    pub const ALL: [Shape; 7] =
        [Shape::Stream, Shape::Full, Shape::ChatStream, Shape::Chat, Shape::Multi, Shape::Disconnect, Shape::Burst];

    pub fn as_str(self) -> &'static str {
        match self {
            Shape::Stream => "stream",
            Shape::Full => "full",
            Shape::ChatStream => "chat_stream",
            Shape::Chat => "chat",
            Shape::Multi => "multi",
            Shape::Disconnect => "disconnect",
            Shape::Burst => "burst",
        }
    }

    /// Whether the request goes to /v1/chat/completions.
    pub fn chat(self) -> bool {
        matches!(self, Shape::ChatStream | Shape::Chat)
    }

    /// Whether the answer is an SSE stream.
    pub fn streamed(self) -> bool {
        !matches!(self, Shape::Full | Shape::Chat)
    }
}

impl fmt::Display for Shape {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for Shape {
    type Err = BenchError;

    fn from_str(s: &str) -> Result<Shape> {
        Shape::ALL.into_iter().find(|k| k.as_str() == s).ok_or_else(|| {
            let names: Vec<&str> = Shape::ALL.iter().map(|k| k.as_str()).collect();
            BenchError::InvalidArg(format!("--mix: unknown shape {s:?} (one of {})", names.join(", ")))
        })
    }
}

/// Weights of the shapes, as `--mix stream=4,full=2,chat=1,...` gives them.
///
/// Invariant: at least one weight is positive; each shape appears at most once.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Mix {
    weights: Vec<(Shape, u32)>,
}

impl Mix {
    /// Parses `SHAPE=WEIGHT` pairs separated by commas (a bare `SHAPE` weighs 1).
    pub fn parse(s: &str) -> Result<Mix> {
        let mut weights: Vec<(Shape, u32)> = Vec::new();
        for part in s.split(',').map(str::trim).filter(|p| !p.is_empty()) {
            let (name, w) = part.split_once('=').unwrap_or((part, "1"));
            let shape: Shape = name.trim().parse()?;
            let w: u32 = w
                .trim()
                .parse()
                .map_err(|_| BenchError::InvalidArg(format!("--mix {part:?}: the weight must be a whole number")))?;
            if weights.iter().any(|(k, _)| *k == shape) {
                return Err(BenchError::InvalidArg(format!("--mix gives {shape} twice")));
            }
            weights.push((shape, w));
        }
        if weights.iter().all(|(_, w)| *w == 0) {
            return Err(BenchError::InvalidArg(format!("--mix {s:?}: no shape has a positive weight")));
        }
        Ok(Mix { weights })
    }

    pub fn weights(&self) -> &[(Shape, u32)] {
        &self.weights
    }

    /// The shape of each of `count` arrivals, drawn by weight from an RNG seeded with `seed`.
    pub fn assign(&self, count: usize, seed: u64) -> Vec<Shape> {
        let total: u64 = self.weights.iter().map(|(_, w)| u64::from(*w)).sum();
        let mut rng = ChaCha8Rng::seed_from_u64(seed ^ 0x6d69_785f_7368_6170);
        (0..count)
            .map(|_| {
                let mut x = rng.random_range(0..total);
                for (shape, w) in &self.weights {
                    if x < u64::from(*w) {
                        return *shape;
                    }
                    x -= u64::from(*w);
                }
                unreachable!("x < total = the sum of the weights")
            })
            .collect()
    }
}

impl FromStr for Mix {
    type Err = BenchError;
    fn from_str(s: &str) -> Result<Mix> {
        Mix::parse(s)
    }
}

/// Clap's value parser for `--mix`.
pub fn mix_arg(s: &str) -> std::result::Result<Mix, String> {
    Mix::parse(s).map_err(|e| e.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_weights_and_bare_names() {
        let m = Mix::parse("stream=4, full=2,chat_stream,burst=0").unwrap();
        assert_eq!(m.weights(), &[(Shape::Stream, 4), (Shape::Full, 2), (Shape::ChatStream, 1), (Shape::Burst, 0)]);
        for s in Shape::ALL {
            assert_eq!(s.as_str().parse::<Shape>().unwrap(), s);
        }
    }

    #[test]
    fn rejects_unknown_duplicate_negative_and_all_zero() {
        let err = |s: &str| Mix::parse(s).unwrap_err().to_string();
        assert!(err("stream=1,nope=2").contains("unknown shape \"nope\""), "{}", err("stream=1,nope=2"));
        assert!(err("stream=1,stream=2").contains("stream twice"));
        assert!(err("stream=-1").contains("whole number"));
        assert!(err("stream=x").contains("whole number"));
        assert!(err("stream=0,full=0").contains("no shape has a positive weight"));
        assert!(err("").contains("no shape has a positive weight"));
    }

    #[test]
    fn assignment_follows_the_weights_and_the_seed() {
        let m = Mix::parse("stream=3,chat=1,burst=0").unwrap();
        let a = m.assign(4000, 7);
        assert_eq!(a, m.assign(4000, 7), "same seed, same shapes");
        assert_ne!(a, m.assign(4000, 8), "another seed, other shapes");
        let streams = a.iter().filter(|s| **s == Shape::Stream).count();
        let chats = a.iter().filter(|s| **s == Shape::Chat).count();
        assert_eq!(streams + chats, 4000, "a zero weight is never drawn");
        // 3:1 within a few standard deviations (sd of the stream count is about 27).
        assert!((2850..=3150).contains(&streams), "{streams} streams of 4000");
    }

    #[test]
    fn shapes_know_their_endpoint_and_streaming() {
        assert!(Shape::Chat.chat() && !Shape::Chat.streamed());
        assert!(Shape::ChatStream.chat() && Shape::ChatStream.streamed());
        assert!(!Shape::Full.chat() && !Shape::Full.streamed());
        for s in [Shape::Stream, Shape::Multi, Shape::Disconnect, Shape::Burst] {
            assert!(!s.chat() && s.streamed(), "{s}");
        }
    }
}
