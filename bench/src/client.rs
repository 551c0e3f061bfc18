//! The streaming client: one POST per request to an OpenAI-compatible endpoint, the SSE stream
//! parsed as it arrives, and every text-carrying chunk timestamped with a monotonic clock.
//!
//! [`SseParser`] is sans-IO (bytes in, events out) so that chunk boundaries that split lines or
//! UTF-8 sequences are tested without a server. Failures never escape as errors: they become a
//! failed [`RequestRecord`] with an [`ErrorKind`].

use std::time::{Duration, Instant};

use futures::StreamExt;
use serde::Deserialize;

use crate::metrics::{tpot, ErrorKind, RequestRecord};

/// One SSE event's payload.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SseEvent {
    /// The text after `data:` (one line; OpenAI servers never use multi-line data).
    Data(String),
    /// `data: [DONE]`.
    Done,
}

/// Splits a byte stream into SSE `data:` lines. Invariant: `buf` holds only the bytes of the
/// current unfinished line.
#[derive(Debug, Default)]
pub struct SseParser {
    buf: Vec<u8>,
}

impl SseParser {
    /// Feeds bytes; returns the events completed by them. Comments (`:`), other fields (`event:`,
    /// `id:`) and blank lines are skipped.
    pub fn push(&mut self, bytes: &[u8]) -> Vec<SseEvent> {
        self.buf.extend_from_slice(bytes);
        let mut out = Vec::new();
        while let Some(nl) = self.buf.iter().position(|&b| b == b'\n') {
            let line: Vec<u8> = self.buf.drain(..=nl).collect();
            let line = String::from_utf8_lossy(&line);
            let line = line.trim_end_matches(['\n', '\r']);
            if let Some(data) = line.strip_prefix("data:") {
                let data = data.strip_prefix(' ').unwrap_or(data);
                out.push(if data.trim() == "[DONE]" { SseEvent::Done } else { SseEvent::Data(data.to_string()) });
            }
        }
        out
    }

    /// Whether bytes of an unfinished line remain (a stream that ends here was cut).
    pub fn has_partial(&self) -> bool {
        self.buf.iter().any(|b| !b.is_ascii_whitespace())
    }
}

/// The parts of a streamed chunk the benchmark reads (completions and chat completions).
#[derive(Debug, Deserialize)]
pub struct Chunk {
    #[serde(default)]
    pub choices: Vec<ChunkChoice>,
    pub usage: Option<Usage>,
    pub error: Option<serde_json::Value>,
}

#[derive(Debug, Deserialize)]
pub struct ChunkChoice {
    pub text: Option<String>,
    pub delta: Option<Delta>,
    pub finish_reason: Option<String>,
}

#[derive(Debug, Deserialize)]
pub struct Delta {
    pub content: Option<String>,
    pub reasoning_content: Option<String>,
}

#[derive(Debug, Deserialize)]
pub struct Usage {
    pub completion_tokens: Option<usize>,
}

impl Chunk {
    /// The text this chunk carries, if any (empty strings do not count as tokens).
    pub fn text(&self) -> Option<&str> {
        let c = self.choices.first()?;
        let t = c.text.as_deref().or_else(|| {
            let d = c.delta.as_ref()?;
            d.content.as_deref().or(d.reasoning_content.as_deref())
        })?;
        (!t.is_empty()).then_some(t)
    }
}

/// Folds timestamped chunks into a request's timings. Sans-IO: times are passed in.
#[derive(Debug)]
pub struct StreamState {
    sent: Instant,
    last: Option<Instant>,
    pub ttft_s: Option<f64>,
    pub itls_s: Vec<f64>,
    pub chunks_with_text: usize,
    pub usage_tokens: Option<usize>,
    pub text: String,
    pub finished: bool,
    pub done: bool,
    pub error: Option<String>,
}

impl StreamState {
    pub fn new(sent: Instant) -> Self {
        StreamState {
            sent,
            last: None,
            ttft_s: None,
            itls_s: Vec::new(),
            chunks_with_text: 0,
            usage_tokens: None,
            text: String::new(),
            finished: false,
            done: false,
            error: None,
        }
    }

    /// Applies one SSE event received at `now`.
    pub fn on_event(&mut self, ev: SseEvent, now: Instant) {
        let data = match ev {
            SseEvent::Done => {
                self.done = true;
                return;
            }
            SseEvent::Data(d) => d,
        };
        let chunk: Chunk = match serde_json::from_str(&data) {
            Ok(c) => c,
            Err(e) => {
                self.error.get_or_insert_with(|| format!("unparseable chunk ({e}): {data}"));
                return;
            }
        };
        if let Some(err) = &chunk.error {
            self.error.get_or_insert_with(|| err.to_string());
        }
        if let Some(n) = chunk.usage.as_ref().and_then(|u| u.completion_tokens) {
            self.usage_tokens = Some(n);
        }
        if chunk.choices.iter().any(|c| c.finish_reason.is_some()) {
            self.finished = true;
        }
        if let Some(t) = chunk.text() {
            match self.last {
                None => self.ttft_s = Some(now.duration_since(self.sent).as_secs_f64()),
                Some(last) => self.itls_s.push(now.duration_since(last).as_secs_f64()),
            }
            self.last = Some(now);
            self.chunks_with_text += 1;
            self.text.push_str(t);
        }
    }
}

/// What to send.
#[derive(Debug, Clone)]
pub struct RequestSpec {
    /// Full URL of the endpoint.
    pub url: String,
    pub chat: bool,
    pub model: String,
    pub prompt: String,
    pub prompt_len: usize,
    pub output_len: usize,
    pub ignore_eos: bool,
    pub temperature: f64,
    pub api_key: Option<String>,
    pub timeout: Duration,
}

impl RequestSpec {
    pub fn body(&self) -> serde_json::Value {
        let mut body = serde_json::json!({
            "model": self.model,
            "max_tokens": self.output_len,
            "temperature": self.temperature,
            "stream": true,
            "stream_options": {"include_usage": true},
            "ignore_eos": self.ignore_eos,
        });
        if self.chat {
            body["messages"] = serde_json::json!([{"role": "user", "content": self.prompt}]);
        } else {
            body["prompt"] = serde_json::Value::String(self.prompt.clone());
        }
        body
    }
}

/// Sends one request and records its outcome. `t0` is the benchmark's start; `scheduled_s` the
/// planned offset; `sent` the moment the benchmark dispatched it (its start: latencies count
/// from there, so time the request waited for a runtime worker is the client's, as a user
/// would see it). Never fails: errors are recorded in the returned record.
pub async fn send(
    http: &reqwest::Client,
    spec: &RequestSpec,
    index: usize,
    t0: Instant,
    scheduled_s: f64,
    sent: Instant,
) -> RequestRecord {
    let mut rec = RequestRecord {
        index,
        prompt_len: spec.prompt_len,
        scheduled_s,
        start_s: sent.duration_since(t0).as_secs_f64(),
        ..Default::default()
    };
    let mut st = StreamState::new(sent);
    let outcome = tokio::time::timeout(spec.timeout, stream(http, spec, &mut st)).await;
    let end = Instant::now();
    let failure = match outcome {
        Err(_) => Some((ErrorKind::Timeout, format!("no complete response within {:?}", spec.timeout))),
        Ok(Err(e)) => Some(e),
        Ok(Ok(())) => match &st.error {
            Some(msg) => Some((ErrorKind::StreamError, msg.clone())),
            None if !(st.done || st.finished) => {
                Some((ErrorKind::Truncated, "stream ended without [DONE] or a finish reason".into()))
            }
            None => None,
        },
    };
    rec.output_tokens = st.usage_tokens.unwrap_or(st.chunks_with_text);
    rec.generated_text = std::mem::take(&mut st.text);
    match failure {
        Some(e) => rec.error = Some(e),
        None => {
            rec.success = true;
            let e2el = end.duration_since(sent).as_secs_f64();
            rec.e2el_s = Some(e2el);
            rec.ttft_s = st.ttft_s;
            rec.tpot_s = st.ttft_s.and_then(|t| tpot(t, e2el, rec.output_tokens));
            rec.itls_s = std::mem::take(&mut st.itls_s);
        }
    }
    rec
}

async fn stream(http: &reqwest::Client, spec: &RequestSpec, st: &mut StreamState) -> Result<(), (ErrorKind, String)> {
    let mut req = http.post(&spec.url).json(&spec.body());
    if let Some(key) = &spec.api_key {
        req = req.bearer_auth(key);
    }
    let resp = req.send().await.map_err(|e| (ErrorKind::Connection, error_chain(&e)))?;
    let status = resp.status();
    if !status.is_success() {
        let kind = if status.is_client_error() { ErrorKind::Http4xx } else { ErrorKind::Http5xx };
        let body = resp.text().await.unwrap_or_default();
        return Err((kind, format!("HTTP {status}: {}", body.chars().take(500).collect::<String>())));
    }
    let mut parser = SseParser::default();
    let mut body = resp.bytes_stream();
    while let Some(bytes) = body.next().await {
        let bytes = bytes.map_err(|e| (ErrorKind::Connection, error_chain(&e)))?;
        let now = Instant::now();
        for ev in parser.push(&bytes) {
            st.on_event(ev, now);
        }
        if st.done {
            break;
        }
    }
    if parser.has_partial() && !st.done {
        return Err((ErrorKind::Truncated, "stream ended inside an SSE line".into()));
    }
    Ok(())
}

/// The error and its sources on one line (reqwest's Display hides the cause).
pub fn error_chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut src = e.source();
    while let Some(c) = src {
        s.push_str(": ");
        s.push_str(&c.to_string());
        src = c.source();
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    const TRANSCRIPT: &str = "data: {\"choices\":[{\"text\":\"Hé\",\"finish_reason\":null}]}\n\n\
        : keep-alive\n\n\
        data: {\"choices\":[{\"text\":\" llo\",\"finish_reason\":null}]}\r\n\r\n\
        data: {\"choices\":[{\"text\":\"\",\"finish_reason\":\"length\"}]}\n\n\
        data: {\"choices\":[],\"usage\":{\"prompt_tokens\":3,\"completion_tokens\":2}}\n\n\
        data: [DONE]\n\n";

    fn parse_in_pieces(sizes: &[usize]) -> Vec<SseEvent> {
        let bytes = TRANSCRIPT.as_bytes();
        let mut p = SseParser::default();
        let mut out = Vec::new();
        let mut at = 0;
        let mut k = 0;
        while at < bytes.len() {
            let n = sizes[k % sizes.len()].min(bytes.len() - at);
            out.extend(p.push(&bytes[at..at + n]));
            at += n;
            k += 1;
        }
        assert!(!p.has_partial());
        out
    }

    #[test]
    fn sse_parser_is_independent_of_chunk_boundaries() {
        let whole = parse_in_pieces(&[TRANSCRIPT.len()]);
        assert_eq!(whole.len(), 5);
        assert_eq!(whole[4], SseEvent::Done);
        // Every split, including ones inside the two-byte 'é' and inside "\r\n".
        for sizes in [&[1usize][..], &[2], &[3, 7], &[5, 1, 11], &[64]] {
            assert_eq!(parse_in_pieces(sizes), whole, "{sizes:?}");
        }
    }

    #[test]
    fn stream_state_times_text_chunks_and_reads_usage() {
        let t0 = Instant::now();
        let mut st = StreamState::new(t0);
        let at = |ms: u64| t0 + Duration::from_millis(ms);
        for (ev, ms) in parse_in_pieces(&[9]).into_iter().zip([100, 130, 180, 181, 182]) {
            st.on_event(ev, at(ms));
        }
        assert_eq!(st.text, "Hé llo");
        assert!((st.ttft_s.unwrap() - 0.1).abs() < 1e-9);
        assert_eq!(st.itls_s.len(), 1);
        assert!((st.itls_s[0] - 0.03).abs() < 1e-9);
        assert_eq!((st.chunks_with_text, st.usage_tokens), (2, Some(2)));
        assert!(st.done && st.finished && st.error.is_none());
    }

    #[test]
    fn chat_deltas_and_error_events() {
        let mut st = StreamState::new(Instant::now());
        st.on_event(SseEvent::Data(r#"{"choices":[{"delta":{"role":"assistant"}}]}"#.into()), Instant::now());
        st.on_event(SseEvent::Data(r#"{"choices":[{"delta":{"content":"hi"}}]}"#.into()), Instant::now());
        assert_eq!(st.chunks_with_text, 1);
        st.on_event(SseEvent::Data(r#"{"error":{"message":"engine died"}}"#.into()), Instant::now());
        assert!(st.error.as_deref().unwrap().contains("engine died"));
    }
}
