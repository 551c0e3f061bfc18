//! Stop strings over a streamed text.
//!
//! Invariants, for any split of a text into pushed pieces:
//! * the concatenation of everything emitted (pushes, then [`StopMatcher::flush`]) is the
//!   text truncated before the earliest occurrence of any stop string (the whole text if
//!   none occurs);
//! * nothing emitted ever contains a stop string or its beginning when that beginning
//!   might still complete into one: a suffix of the seen text that is a prefix of some
//!   stop string is held back until it is disproved.

/// What one [`StopMatcher::push`] releases.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct StopOutput {
    /// Text that is final and safe to send.
    pub emit: String,
    /// A stop string matched; nothing more will be emitted.
    pub stopped: bool,
}

/// Finds stop strings in a text that arrives in pieces.
#[derive(Debug, Clone)]
pub struct StopMatcher {
    /// Non-empty stop strings.
    stops: Vec<String>,
    /// Seen but not emitted: always a proper prefix of some stop string (or empty).
    held: String,
    /// Index into `stops` of the string that matched, once stopped.
    matched: Option<usize>,
}

impl StopMatcher {
    /// Empty stop strings are ignored (they would match before any text).
    pub fn new<S: Into<String>>(stops: impl IntoIterator<Item = S>) -> Self {
        StopMatcher {
            stops: stops.into_iter().map(Into::into).filter(|s: &String| !s.is_empty()).collect(),
            held: String::new(),
            matched: None,
        }
    }

    /// Feeds the next piece of text.
    pub fn push(&mut self, text: &str) -> StopOutput {
        if self.matched.is_some() {
            return StopOutput { emit: String::new(), stopped: true };
        }
        self.held.push_str(text);
        // Earliest occurrence of any stop string; ties go to the first listed.
        let found =
            self.stops.iter().enumerate().filter_map(|(i, s)| self.held.find(s.as_str()).map(|at| (at, i))).min();
        if let Some((at, i)) = found {
            self.matched = Some(i);
            self.held.truncate(at);
            return StopOutput { emit: std::mem::take(&mut self.held), stopped: true };
        }
        let keep_from = self.partial_match_start();
        let rest = self.held.split_off(keep_from);
        StopOutput { emit: std::mem::replace(&mut self.held, rest), stopped: false }
    }

    /// Releases held-back text at the end of the stream (empty once stopped).
    pub fn flush(&mut self) -> String {
        std::mem::take(&mut self.held)
    }

    /// Whether a stop string matched.
    pub fn stopped(&self) -> bool {
        self.matched.is_some()
    }

    /// The stop string that matched, if any.
    pub fn matched(&self) -> Option<&str> {
        self.matched.map(|i| self.stops[i].as_str())
    }

    /// Start of the longest suffix of `held` that is a proper prefix of a stop string;
    /// `held.len()` when there is none.
    fn partial_match_start(&self) -> usize {
        let longest = self.stops.iter().map(String::len).max().unwrap_or(0);
        let earliest = self.held.len().saturating_sub(longest.saturating_sub(1));
        (earliest..self.held.len())
            .filter(|&i| self.held.is_char_boundary(i))
            .find(|&i| {
                let suffix = &self.held[i..];
                self.stops.iter().any(|s| s.starts_with(suffix))
            })
            .unwrap_or(self.held.len())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// Naive reference: truncate before the earliest occurrence of any stop string.
    fn reference(text: &str, stops: &[String]) -> (String, bool) {
        let cut = stops.iter().filter(|s| !s.is_empty()).filter_map(|s| text.find(s.as_str())).min();
        match cut {
            Some(at) => (text[..at].to_owned(), true),
            None => (text.to_owned(), false),
        }
    }

    fn run(stops: &[String], pieces: &[&str]) -> (String, bool, Vec<String>) {
        let mut m = StopMatcher::new(stops.iter().cloned());
        let mut out = String::new();
        let mut emitted_prefixes = Vec::new();
        let mut stopped = false;
        for p in pieces {
            let o = m.push(p);
            out.push_str(&o.emit);
            emitted_prefixes.push(out.clone());
            stopped |= o.stopped;
        }
        out.push_str(&m.flush());
        emitted_prefixes.push(out.clone());
        (out, stopped, emitted_prefixes)
    }

    #[test]
    fn holds_back_partial_stop_and_drops_stop() {
        let mut m = StopMatcher::new(["</end>"]);
        assert_eq!(m.push("hello </").emit, "hello ");
        assert_eq!(m.push("e").emit, "");
        let o = m.push("nd> trailing");
        assert_eq!((o.emit.as_str(), o.stopped), ("", true));
        assert_eq!(m.matched(), Some("</end>"));
        assert_eq!(m.push("more"), StopOutput { emit: String::new(), stopped: true });
        assert_eq!(m.flush(), "");
    }

    #[test]
    fn released_when_disproved_or_flushed() {
        let mut m = StopMatcher::new(["abc"]);
        assert_eq!(m.push("xab").emit, "x");
        assert_eq!(m.push("d").emit, "abd");
        assert_eq!(m.push("a").emit, "");
        assert_eq!(m.flush(), "a");
        assert!(!m.stopped());
    }

    #[test]
    fn multibyte_and_overlapping_stops() {
        let stops = vec!["日本".to_owned(), "本語!".to_owned()];
        let (out, stopped, _) = run(&stops, &["ab日", "本語!"]);
        assert_eq!((out.as_str(), stopped), ("ab", true));
        let stops = vec!["ana".to_owned()];
        let (out, stopped, _) = run(&stops, &["ban", "an", "a"]);
        assert_eq!((out.as_str(), stopped), ("b", true));
        let (out, stopped, _) = run(&[String::new()], &["x"]);
        assert_eq!((out.as_str(), stopped), ("x", false));
    }

    fn split_points(text: &str, raw: &[usize]) -> Vec<usize> {
        let mut cuts: Vec<usize> =
            raw.iter().map(|r| r % (text.len() + 1)).filter(|&c| text.is_char_boundary(c)).collect();
        cuts.sort_unstable();
        cuts.dedup();
        cuts
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 2000, rng_seed: proptest::test_runner::RngSeed::Fixed(7), ..ProptestConfig::default() })]
        #[test]
        fn matches_truncate_reference(
            text in "[abé日 ]{0,40}",
            stops in proptest::collection::vec("[abé日 ]{0,4}", 0..4),
            raw_cuts in proptest::collection::vec(any::<usize>(), 0..10),
        ) {
            let cuts = split_points(&text, &raw_cuts);
            let mut pieces = Vec::new();
            let mut last = 0;
            for c in cuts {
                pieces.push(&text[last..c]);
                last = c;
            }
            pieces.push(&text[last..]);
            let (out, stopped, prefixes) = run(&stops, &pieces);
            let (want, want_stopped) = reference(&text, &stops);
            prop_assert_eq!(&out, &want);
            prop_assert_eq!(stopped, want_stopped);
            for p in &prefixes {
                for s in stops.iter().filter(|s| !s.is_empty()) {
                    prop_assert!(!p.contains(s.as_str()), "emitted {:?} contains stop {:?}", p, s);
                }
            }
        }
    }
}
