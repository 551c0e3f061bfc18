//! Sliding windows of arrivals and completions.
//!
//! Invariant: each window's deque is ordered by time (`at`); an out-of-order entry is inserted
//! at its place. An entry is in the window at `now` iff `at > now - window`; `prune` drops the
//! rest from the front, and the statistics skip a stale prefix not yet pruned (so `&self`
//! readers such as `Planner::estimate` agree with `tick`).
//!
//! The arrival window keeps running sums, so its statistics cost O(stale prefix); the
//! completion window is scanned per call (O(n), with linear-time selection for percentiles).

use std::collections::VecDeque;
use std::time::Duration;

use crate::types::{Arrival, Completion};

/// Inserts `item` keeping `q` ordered by `at`.
fn insert_ordered<T>(q: &mut VecDeque<T>, item: T, at: impl Fn(&T) -> Duration) {
    let t = at(&item);
    if q.back().is_none_or(|b| at(b) <= t) {
        q.push_back(item);
    } else {
        let i = q.partition_point(|x| at(x) <= t);
        q.insert(i, item);
    }
}

/// Whether an entry at `at` is out of the window whose oldest admissible time is after `cutoff`.
fn stale(at: Duration, cutoff: Option<Duration>) -> bool {
    cutoff.is_some_and(|c| at <= c)
}

/// Demand statistics of the arrivals in the window.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub(crate) struct ArrivalStats {
    pub count: u64,
    pub mean_prompt: f64,
    pub sd_prompt: f64,
    pub mean_max_tokens: f64,
}

#[derive(Debug, Clone, Copy, Default)]
struct Sums {
    count: u64,
    prompt: u64,
    prompt2: u128,
    max_tokens: u64,
}

impl Sums {
    fn add(&mut self, a: &Arrival, sign: bool) {
        let p = u64::from(a.prompt_tokens);
        if sign {
            self.count += 1;
            self.prompt += p;
            self.prompt2 += u128::from(p * p);
            self.max_tokens += u64::from(a.max_tokens);
        } else {
            self.count -= 1;
            self.prompt -= p;
            self.prompt2 -= u128::from(p * p);
            self.max_tokens -= u64::from(a.max_tokens);
        }
    }
}

impl ArrivalStats {
    /// The arrivals of `self` that are not in `part` (a later part of the same window).
    pub fn without(&self, part: &ArrivalStats) -> ArrivalStats {
        let count = self.count.saturating_sub(part.count);
        if count == 0 {
            return ArrivalStats::default();
        }
        let (n, m) = (self.count as f64, part.count as f64);
        let k = count as f64;
        let mean = (self.mean_prompt * n - part.mean_prompt * m) / k;
        let sq = |s: &ArrivalStats, c: f64| (s.sd_prompt * s.sd_prompt + s.mean_prompt * s.mean_prompt) * c;
        let var = ((sq(self, n) - sq(part, m)) / k - mean * mean).max(0.0);
        ArrivalStats {
            count,
            mean_prompt: mean.max(0.0),
            sd_prompt: var.sqrt(),
            mean_max_tokens: ((self.mean_max_tokens * n - part.mean_max_tokens * m) / k).max(0.0),
        }
    }
}

/// Arrivals a half window needs before it can say that demand shifted.
pub(crate) const SHIFT_MIN_ARRIVALS: u64 = 4;

/// Whether the demand of the recent half of a window (`recent`) differs from that of the older
/// half (`older`, the same length of time) by more than noise: a mean prompt or a mean
/// `max_tokens` off by half again either way (the mix moved), or clearly more arrivals (more
/// than `older + 2 sqrt(older + 1) + 1`: about two Poisson standard deviations, so a steady
/// rate trips it on few ticks, and the hysteresis downstream absorbs those). Fewer arrivals
/// are not a shift: capacity is removed on the whole window's evidence, added on the recent
/// half's.
pub(crate) fn shifted(older: &ArrivalStats, recent: &ArrivalStats) -> bool {
    if recent.count < SHIFT_MIN_ARRIVALS {
        return false;
    }
    let (o, r) = (older.count as f64, recent.count as f64);
    if r > o + 2.0 * (o + 1.0).sqrt() + 1.0 {
        return true;
    }
    let apart = |a: f64, b: f64| {
        let (lo, hi) = if a < b { (a, b) } else { (b, a) };
        hi > 1.5 * lo.max(1.0)
    };
    older.count > 0
        && (apart(older.mean_prompt, recent.mean_prompt) || apart(older.mean_max_tokens, recent.mean_max_tokens))
}

/// Arrivals in the window, with exact integer running sums.
#[derive(Debug, Default)]
pub(crate) struct ArrivalWindow {
    q: VecDeque<Arrival>,
    sums: Sums,
}

impl ArrivalWindow {
    pub fn push(&mut self, a: Arrival) {
        self.sums.add(&a, true);
        insert_ordered(&mut self.q, a, |a| a.at);
    }

    /// Drops arrivals at or before `cutoff`.
    pub fn prune(&mut self, cutoff: Option<Duration>) {
        while let Some(front) = self.q.front() {
            if !stale(front.at, cutoff) {
                break;
            }
            let a = *front;
            self.sums.add(&a, false);
            self.q.pop_front();
        }
    }

    pub fn stats(&self, cutoff: Option<Duration>) -> ArrivalStats {
        let mut s = self.sums;
        for a in self.q.iter().take_while(|a| stale(a.at, cutoff)) {
            s.add(a, false);
        }
        if s.count == 0 {
            return ArrivalStats::default();
        }
        let n = s.count as f64;
        let mean = s.prompt as f64 / n;
        let var = (s.prompt2 as f64 / n - mean * mean).max(0.0);
        ArrivalStats {
            count: s.count,
            mean_prompt: mean,
            sd_prompt: var.sqrt(),
            mean_max_tokens: s.max_tokens as f64 / n,
        }
    }
}

/// What clients experienced in the window.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub(crate) struct CompletionStats {
    /// All completions in the window, failed ones included.
    pub count: u32,
    /// Successful ones.
    pub ok: u32,
    /// TTFT seconds at the quantile over successful completions.
    pub ttft_q: Option<f64>,
    /// TPOT seconds at the quantile over successful completions with a TPOT.
    pub tpot_q: Option<f64>,
    /// Share of all completions that succeeded within both targets.
    pub attainment: Option<f64>,
    /// Mean output tokens of successful completions.
    pub mean_output: Option<f64>,
    /// Their outputs over their `max_tokens` (sums, at most 1).
    pub output_share: Option<f64>,
    /// Successful completions that started at or after the configured start.
    pub since_count: u32,
    /// Their TTFT at the quantile.
    pub since_ttft_q: Option<f64>,
    /// Those of them with a TPOT.
    pub since_tpot_count: u32,
    /// Their TPOT at the quantile.
    pub since_tpot_q: Option<f64>,
}

/// A log-bucketed histogram of seconds: buckets `[MIN * R^i, MIN * R^(i+1))` with `R = 1.01`
/// from 0.1 ms to 10^4 s (values outside are clamped into the end buckets). A quantile reads
/// as its bucket's upper edge, at most 1% high: plenty for control, and O(1) to update, where
/// exact selection over a 300 req/s window cost more than all the rest of a tick.
#[derive(Debug, Clone)]
struct Hist {
    counts: Vec<u32>,
    n: u32,
}

impl Hist {
    const MIN_S: f64 = 1e-4;
    const RATIO: f64 = 1.01;
    /// ln(1e8) / ln(1.01) ~ 1851.3 buckets span 0.1 ms .. 10^4 s.
    const BUCKETS: usize = 1852;

    fn new() -> Self {
        Self { counts: vec![0; Self::BUCKETS], n: 0 }
    }

    fn bucket(x: f64) -> usize {
        let i = ((x / Self::MIN_S).ln() / Self::RATIO.ln()).floor();
        if i.is_nan() || i < 0.0 {
            0
        } else {
            (i as usize).min(Self::BUCKETS - 1)
        }
    }

    fn add(&mut self, x: f64) {
        self.counts[Self::bucket(x)] += 1;
        self.n += 1;
    }

    fn remove(&mut self, x: f64) {
        self.counts[Self::bucket(x)] -= 1;
        self.n -= 1;
    }

    fn clear(&mut self) {
        self.counts.iter_mut().for_each(|c| *c = 0);
        self.n = 0;
    }

    /// Nearest-rank quantile of the samples less `minus` (the buckets of samples to leave
    /// out, each of them counted in the histogram).
    fn quantile(&self, q: f64, minus: &mut [usize]) -> Option<f64> {
        let n = self.n as usize - minus.len();
        if n == 0 {
            return None;
        }
        minus.sort_unstable();
        let rank = ((q * n as f64).ceil() as usize).clamp(1, n);
        let (mut seen, mut m) = (0usize, 0usize);
        for (i, &c) in self.counts.iter().enumerate() {
            let mut c = c as usize;
            while m < minus.len() && minus[m] == i {
                c -= 1;
                m += 1;
            }
            seen += c;
            if seen >= rank {
                return Some(Self::MIN_S * Self::RATIO.powi(i as i32 + 1));
            }
        }
        None
    }
}

/// A completion as the statistics need it, converted once on arrival.
#[derive(Debug, Clone, Copy)]
struct Done {
    at: Duration,
    started: Duration,
    ttft: f64,
    /// NaN for one-token outputs.
    tpot: f64,
    output: u32,
    max_tokens: u32,
    ok: bool,
    /// Met both targets (as configured when counted).
    met: bool,
    /// Counted in the `since_*` histograms.
    recent: bool,
}

/// Completions in the window, with running counts and histograms kept in step with the deque
/// (every push and prune updates them), so that statistics cost O(buckets + stale prefix), not
/// O(window).
#[derive(Debug)]
pub(crate) struct CompletionWindow {
    q: VecDeque<Done>,
    /// When the current configuration began.
    changed: Duration,
    /// Completions that started at or after it are `recent`: `changed`, or later while requests
    /// that started before the change still waited for their first token (see
    /// [`CompletionWindow::settle`]).
    since: Duration,
    /// The latest first token (start + TTFT) of a completion that started before `changed`.
    settle_to: Duration,
    ttft_target_s: f64,
    tpot_target_s: f64,
    count: u32,
    ok: u32,
    met: u32,
    outputs: u64,
    /// `max_tokens` of the successful completions, beside `outputs`.
    max_tokens: u64,
    ttft: Hist,
    tpot: Hist,
    since_ttft: Hist,
    since_tpot: Hist,
}

/// When a completion's first token came out.
fn first_token(d: &Done) -> Duration {
    d.started + Duration::from_secs_f64(d.ttft.max(0.0))
}

/// Sums over the stale prefix, to leave out of the running totals.
#[derive(Debug, Default)]
struct Stale {
    count: u32,
    ok: u32,
    met: u32,
    outputs: u64,
    max_tokens: u64,
    ttft: Vec<usize>,
    tpot: Vec<usize>,
    since_ttft: Vec<usize>,
    since_tpot: Vec<usize>,
}

impl CompletionWindow {
    pub fn new(ttft_target_s: f64, tpot_target_s: f64) -> Self {
        Self {
            q: VecDeque::new(),
            changed: Duration::ZERO,
            since: Duration::ZERO,
            settle_to: Duration::ZERO,
            ttft_target_s,
            tpot_target_s,
            count: 0,
            ok: 0,
            met: 0,
            outputs: 0,
            max_tokens: 0,
            ttft: Hist::new(),
            tpot: Hist::new(),
            since_ttft: Hist::new(),
            since_tpot: Hist::new(),
        }
    }

    /// Sets the start of the current configuration and the targets; recounts only what
    /// changed (O(window), once per configuration or target change).
    pub fn configure(&mut self, changed: Duration, ttft_target_s: f64, tpot_target_s: f64) {
        if (ttft_target_s, tpot_target_s) != (self.ttft_target_s, self.tpot_target_s) {
            self.ttft_target_s = ttft_target_s;
            self.tpot_target_s = tpot_target_s;
            self.met = 0;
            for i in 0..self.q.len() {
                let met = self.meets(&self.q[i]);
                self.q[i].met = met;
                self.met += u32::from(met);
            }
        }
        if changed != self.changed {
            self.changed = changed;
            self.settle_to = self.q.iter().filter(|d| d.started < changed).map(first_token).max().unwrap_or_default();
            self.recount(changed.max(self.settle_to));
        }
    }

    /// Moves `since` past the first token of every request that started before the change and
    /// has completed since: a request that arrived while the old configuration's queue was still
    /// being served waited behind it (a switch from one prefill node to two colocated ones
    /// inherits the prefill node's backlog: the first requests after it saw 4-7 s TTFT that no
    /// colocated node caused), so it says nothing about the new configuration. O(window) when
    /// it moves, at most once a tick.
    pub fn settle(&mut self) {
        if self.settle_to > self.since {
            self.recount(self.settle_to);
        }
    }

    /// Completions that started at or after this judge the current configuration.
    pub fn since(&self) -> Duration {
        self.since
    }

    fn recount(&mut self, since: Duration) {
        if since == self.since {
            return;
        }
        self.since = since;
        self.since_ttft.clear();
        self.since_tpot.clear();
        for d in &mut self.q {
            d.recent = d.ok && d.started >= since;
            if d.recent {
                self.since_ttft.add(d.ttft);
                if !d.tpot.is_nan() {
                    self.since_tpot.add(d.tpot);
                }
            }
        }
    }

    fn meets(&self, d: &Done) -> bool {
        d.ok && d.ttft <= self.ttft_target_s && (d.tpot.is_nan() || d.tpot <= self.tpot_target_s)
    }

    pub fn push(&mut self, c: Completion) {
        let mut d = Done {
            at: c.at,
            started: c.started(),
            ttft: c.ttft.as_secs_f64(),
            tpot: c.tpot.map_or(f64::NAN, |d| d.as_secs_f64()),
            output: c.output_tokens,
            max_tokens: c.max_tokens,
            ok: c.ok,
            met: false,
            recent: false,
        };
        d.met = self.meets(&d);
        d.recent = d.ok && d.started >= self.since;
        if d.started < self.changed {
            self.settle_to = self.settle_to.max(first_token(&d));
        }
        self.count += 1;
        self.met += u32::from(d.met);
        if d.ok {
            self.ok += 1;
            self.outputs += u64::from(d.output);
            self.max_tokens += u64::from(d.max_tokens);
            self.ttft.add(d.ttft);
            if !d.tpot.is_nan() {
                self.tpot.add(d.tpot);
            }
        }
        if d.recent {
            self.since_ttft.add(d.ttft);
            if !d.tpot.is_nan() {
                self.since_tpot.add(d.tpot);
            }
        }
        insert_ordered(&mut self.q, d, |d| d.at);
    }

    pub fn prune(&mut self, cutoff: Option<Duration>) {
        while let Some(d) = self.q.front().copied() {
            if !stale(d.at, cutoff) {
                break;
            }
            self.q.pop_front();
            self.count -= 1;
            self.met -= u32::from(d.met);
            if d.ok {
                self.ok -= 1;
                self.outputs -= u64::from(d.output);
                self.max_tokens -= u64::from(d.max_tokens);
                self.ttft.remove(d.ttft);
                if !d.tpot.is_nan() {
                    self.tpot.remove(d.tpot);
                }
            }
            if d.recent {
                self.since_ttft.remove(d.ttft);
                if !d.tpot.is_nan() {
                    self.since_tpot.remove(d.tpot);
                }
            }
        }
    }

    /// Statistics of the window at `cutoff`, leaving out a stale prefix not pruned yet. The
    /// `since_*` figures are for the start last configured.
    pub fn stats(&self, cutoff: Option<Duration>, quantile: f64) -> CompletionStats {
        let mut s = Stale::default();
        for d in self.q.iter().take_while(|d| stale(d.at, cutoff)) {
            s.count += 1;
            s.met += u32::from(d.met);
            if d.ok {
                s.ok += 1;
                s.outputs += u64::from(d.output);
                s.max_tokens += u64::from(d.max_tokens);
                s.ttft.push(Hist::bucket(d.ttft));
                if !d.tpot.is_nan() {
                    s.tpot.push(Hist::bucket(d.tpot));
                }
            }
            if d.recent {
                s.since_ttft.push(Hist::bucket(d.ttft));
                if !d.tpot.is_nan() {
                    s.since_tpot.push(Hist::bucket(d.tpot));
                }
            }
        }
        let count = self.count - s.count;
        let ok = self.ok - s.ok;
        CompletionStats {
            count,
            ok,
            ttft_q: self.ttft.quantile(quantile, &mut s.ttft),
            tpot_q: self.tpot.quantile(quantile, &mut s.tpot),
            attainment: (count > 0).then(|| f64::from(self.met - s.met) / f64::from(count)),
            mean_output: (ok > 0).then(|| (self.outputs - s.outputs) as f64 / f64::from(ok)),
            output_share: {
                let asked = self.max_tokens - s.max_tokens;
                (ok > 0 && asked > 0).then(|| ((self.outputs - s.outputs) as f64 / asked as f64).min(1.0))
            },
            since_count: self.since_ttft.n - s.since_ttft.len() as u32,
            since_ttft_q: self.since_ttft.quantile(quantile, &mut s.since_ttft),
            since_tpot_count: self.since_tpot.n - s.since_tpot.len() as u32,
            since_tpot_q: self.since_tpot.quantile(quantile, &mut s.since_tpot),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn arrival(ms: u64, prompt: u32) -> Arrival {
        Arrival { at: Duration::from_millis(ms), prompt_tokens: prompt, max_tokens: 10 }
    }

    #[test]
    fn old_arrivals_leave_the_window_and_stats_skip_unpruned_ones() {
        let mut w = ArrivalWindow::default();
        w.push(arrival(1000, 100));
        w.push(arrival(3000, 300));
        w.push(arrival(2000, 200)); // out of order
        let all = w.stats(None);
        assert_eq!(all.count, 3);
        assert!((all.mean_prompt - 200.0).abs() < 1e-9);
        assert!((all.sd_prompt - (20_000.0f64 / 3.0).sqrt()).abs() < 1e-9);
        let cutoff = Some(Duration::from_millis(2000));
        let late = w.stats(cutoff);
        assert_eq!(late.count, 1);
        assert!((late.mean_prompt - 300.0).abs() < 1e-9);
        w.prune(cutoff);
        assert_eq!(w.stats(None), late);
    }

    #[test]
    fn histogram_quantiles_are_nearest_rank_within_one_percent() {
        let mut h = Hist::new();
        for i in 1..=10 {
            h.add(f64::from(i));
        }
        let q90 = h.quantile(0.9, &mut []).unwrap();
        assert!((9.0..=9.0 * 1.01).contains(&q90), "{q90}");
        let q95 = h.quantile(0.95, &mut []).unwrap();
        assert!((10.0..=10.1).contains(&q95), "{q95}");
        // Leaving the two largest out.
        let mut minus = [Hist::bucket(10.0), Hist::bucket(9.0)];
        let q = h.quantile(0.9, &mut minus).unwrap();
        assert!((8.0..=8.08).contains(&q), "{q}");
        h.remove(5.0);
        assert_eq!(h.n, 9);
        assert_eq!(Hist::new().quantile(0.9, &mut []), None);
        assert!(Hist::bucket(0.0) == 0 && Hist::bucket(1e9) == Hist::BUCKETS - 1);
    }

    #[test]
    fn a_shift_is_a_mix_or_a_rate_clearly_apart_and_never_a_few_arrivals() {
        let mut w = ArrivalWindow::default();
        for i in 0..6u64 {
            w.push(Arrival { at: Duration::from_millis(1000 * i), prompt_tokens: 384, max_tokens: 32 });
        }
        for i in 0..6u64 {
            w.push(Arrival { at: Duration::from_millis(10_000 + 1000 * i), prompt_tokens: 32, max_tokens: 128 });
        }
        let all = w.stats(None);
        let recent = w.stats(Some(Duration::from_millis(9_999)));
        let older = all.without(&recent);
        assert_eq!((older.count, recent.count), (6, 6));
        assert!((older.mean_prompt - 384.0).abs() < 1e-6 && older.sd_prompt < 1e-3, "{older:?}");
        assert!((older.mean_max_tokens - 32.0).abs() < 1e-6);
        assert!(shifted(&older, &recent));
        // The same mix on both sides: no shift, until the rate is clearly up.
        let same = |count| ArrivalStats { count, mean_prompt: 100.0, sd_prompt: 0.0, mean_max_tokens: 64.0 };
        assert!(!shifted(&same(6), &same(6)));
        assert!(!shifted(&same(6), &same(11)));
        assert!(shifted(&same(6), &same(13)));
        assert!(!shifted(&same(6), &same(1)), "fewer arrivals are not a shift");
        // Prompts within half again: noise; three arrivals: too few to say anything.
        let p = |count, mean_prompt| ArrivalStats { count, mean_prompt, sd_prompt: 0.0, mean_max_tokens: 64.0 };
        assert!(!shifted(&p(6, 100.0), &p(6, 140.0)));
        assert!(shifted(&p(6, 100.0), &p(6, 160.0)));
        assert!(!shifted(&p(6, 100.0), &p(3, 400.0)));
        // From idle, four arrivals are demand.
        assert!(shifted(&ArrivalStats::default(), &p(4, 100.0)));
    }

    #[test]
    fn completion_stats_follow_pushes_prunes_and_configuration() {
        let mut w = CompletionWindow::new(0.5, 0.1);
        let ms = Duration::from_millis;
        for i in 0..10u64 {
            w.push(Completion {
                at: ms(10_000 + i),
                ttft: ms(100 * (i + 1)),
                tpot: Some(ms(20)),
                output_tokens: 5,
                max_tokens: 8 + (i as u32 % 2) * 4,
                ok: true,
            });
        }
        w.push(Completion { at: ms(10_005), ttft: ms(1), tpot: None, output_tokens: 0, max_tokens: 99, ok: false });
        let s = w.stats(None, 0.9);
        assert_eq!((s.count, s.ok), (11, 10));
        assert!((0.9..=0.9 * 1.01).contains(&s.ttft_q.unwrap()), "{s:?}");
        assert_eq!(s.attainment, Some(5.0 / 11.0));
        assert_eq!(s.mean_output, Some(5.0));
        // 50 tokens out of 5 x 8 + 5 x 12 asked (the failure counts in neither).
        assert_eq!(s.output_share, Some(0.5));
        assert_eq!(s.since_count, 10);
        // A later configuration start: only completions that started after it count there
        // (started = at - ttft - 4 x 20 ms = 9820 - 99 i ms), and only once the requests that
        // started before it had their first tokens (the last at 9424 + 500 = 9924 ms, after
        // the four that started from 9523 ms on: see the test below).
        w.configure(ms(9_500), 0.5, 0.1);
        let s = w.stats(None, 0.9);
        assert_eq!(s.since_count, 0, "{s:?}");
        // Stricter targets recount attainment.
        w.configure(ms(9_500), 0.25, 0.1);
        assert_eq!(w.stats(None, 0.9).attainment, Some(2.0 / 11.0));
        // A stale prefix is left out before it is pruned, and the same after.
        let cutoff = Some(ms(10_004));
        let s = w.stats(cutoff, 0.9);
        assert_eq!((s.count, s.ok, s.since_count), (6, 5, 0), "{s:?}");
        w.prune(cutoff);
        assert_eq!(w.stats(None, 0.9), s);
    }

    #[test]
    fn requests_that_queued_behind_the_old_configuration_do_not_judge_the_new_one() {
        let ms = Duration::from_millis;
        // One-token replies: a request started at `at - ttft`.
        let done = |started: u64, ttft: u64| Completion {
            at: ms(started + ttft),
            ttft: ms(ttft),
            tpot: None,
            output_tokens: 1,
            max_tokens: 8,
            ok: true,
        };
        let mut w = CompletionWindow::new(3.0, 0.1);
        w.configure(ms(10_000), 3.0, 0.1);
        // Started after the change while one from before it still waited for its first token.
        w.push(done(10_500, 2_000));
        assert_eq!(w.stats(None, 0.9).since_count, 1);
        // The old request's first token came at 12 s: the one above queued behind it.
        w.push(done(8_000, 4_000));
        w.settle();
        assert_eq!(w.stats(None, 0.9).since_count, 0);
        // After it, the new configuration's own requests count...
        w.push(done(12_200, 200));
        w.settle();
        let s = w.stats(None, 0.9);
        assert_eq!(s.since_count, 1);
        assert!((0.2..=0.21).contains(&s.since_ttft_q.unwrap()), "{s:?}");
        // ...and an old request whose first token came before that moves nothing back.
        w.push(done(9_000, 500));
        w.settle();
        assert_eq!(w.stats(None, 0.9).since_count, 1);
        // The next change starts afresh from what the window holds: every request that started
        // before 13 s had its first token before it (the last at 12.5 s), so nothing waits.
        w.configure(ms(13_000), 3.0, 0.1);
        assert_eq!(w.stats(None, 0.9).since_count, 0);
        w.push(done(13_100, 100));
        w.settle();
        assert_eq!(w.stats(None, 0.9).since_count, 1);
    }
}
