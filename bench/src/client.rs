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
use crate::outcome::Outcome;

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
    /// The first error's outcome (an `error` object, or a chunk that is not JSON).
    pub error_outcome: Option<Outcome>,
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
            error_outcome: None,
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
                self.error_outcome.get_or_insert(Outcome::StreamError { error_type: None });
                return;
            }
        };
        if let Some(err) = &chunk.error {
            self.error.get_or_insert_with(|| err.to_string());
            self.error_outcome.get_or_insert_with(|| Outcome::stream_error(err));
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
    /// Ask for an SSE stream (else one JSON answer).
    pub stream: bool,
    /// Choices per request (OpenAI's `n`); 1 sends no `n`.
    pub n: u32,
    /// Drop the stream after this many text-carrying chunks (a client that leaves).
    pub disconnect_after: Option<usize>,
}

impl RequestSpec {
    pub fn body(&self) -> serde_json::Value {
        let mut body = serde_json::json!({
            "model": self.model,
            "max_tokens": self.output_len,
            "temperature": self.temperature,
            "stream": self.stream,
            "ignore_eos": self.ignore_eos,
        });
        if self.stream {
            body["stream_options"] = serde_json::json!({"include_usage": true});
        }
        if self.n > 1 {
            body["n"] = self.n.into();
        }
        if self.chat {
            body["messages"] = serde_json::json!([{"role": "user", "content": self.prompt}]);
        } else {
            body["prompt"] = serde_json::Value::String(self.prompt.clone());
        }
        body
    }
}

/// How a request that did not fail ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Ended {
    Complete,
    /// The client dropped the stream on purpose (`disconnect_after`).
    Disconnected,
}

/// A failed request: its outcome and what happened, for the record.
type Failure = (Outcome, String);

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
    let exchange = async {
        if spec.stream {
            stream(http, spec, &mut st).await
        } else {
            whole(http, spec, &mut st).await
        }
    };
    let outcome = tokio::time::timeout(spec.timeout, exchange).await;
    let end = Instant::now();
    rec.end_s = end.duration_since(t0).as_secs_f64();
    let ended: Result<Ended, Failure> = match outcome {
        Err(_) => Err((Outcome::Timeout, format!("no complete response within {:?}", spec.timeout))),
        Ok(Err(e)) => Err(e),
        Ok(Ok(Ended::Disconnected)) => Ok(Ended::Disconnected),
        Ok(Ok(Ended::Complete)) => match (&st.error, &st.error_outcome) {
            (Some(msg), o) => Err((o.clone().unwrap_or(Outcome::StreamError { error_type: None }), msg.clone())),
            (None, _) if !(st.done || st.finished) => {
                Err((Outcome::Truncated, "stream ended without [DONE] or a finish reason".into()))
            }
            (None, _) => Ok(Ended::Complete),
        },
    };
    rec.output_tokens = st.usage_tokens.unwrap_or(st.chunks_with_text);
    rec.generated_text = std::mem::take(&mut st.text);
    match ended {
        Err((outcome, msg)) => {
            rec.error = ErrorKind::of(&outcome).map(|k| (k, msg));
            rec.outcome = outcome;
        }
        Ok(Ended::Disconnected) => rec.outcome = Outcome::Disconnected,
        Ok(Ended::Complete) => {
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

/// Posts the request; a non-2xx answer is a failure with its status and error type.
async fn post(http: &reqwest::Client, spec: &RequestSpec) -> Result<reqwest::Response, Failure> {
    let mut req = http.post(&spec.url).json(&spec.body());
    if let Some(key) = &spec.api_key {
        req = req.bearer_auth(key);
    }
    let resp = req.send().await.map_err(|e| (Outcome::Transport, error_chain(&e)))?;
    let status = resp.status();
    if !status.is_success() {
        let body = resp.text().await.unwrap_or_default();
        let msg = format!("HTTP {status}: {}", body.chars().take(500).collect::<String>());
        return Err((Outcome::http(status.as_u16(), &body), msg));
    }
    Ok(resp)
}

async fn stream(http: &reqwest::Client, spec: &RequestSpec, st: &mut StreamState) -> Result<Ended, Failure> {
    let resp = post(http, spec).await?;
    let mut parser = SseParser::default();
    let mut body = resp.bytes_stream();
    while let Some(bytes) = body.next().await {
        let bytes = bytes.map_err(|e| (Outcome::Transport, error_chain(&e)))?;
        let now = Instant::now();
        for ev in parser.push(&bytes) {
            st.on_event(ev, now);
        }
        if st.done {
            break;
        }
        if spec.disconnect_after.is_some_and(|k| st.chunks_with_text >= k) && st.error.is_none() {
            // Dropping the body closes the connection: the server sees the client leave.
            return Ok(Ended::Disconnected);
        }
    }
    if parser.has_partial() && !st.done {
        return Err((Outcome::Truncated, "stream ended inside an SSE line".into()));
    }
    Ok(Ended::Complete)
}

/// A non-streamed answer: the whole body at once. It has no time to first token (the record's
/// TTFT and TPOT stay unset; its end-to-end latency is the whole answer's).
async fn whole(http: &reqwest::Client, spec: &RequestSpec, st: &mut StreamState) -> Result<Ended, Failure> {
    let resp = post(http, spec).await?;
    let body = resp.bytes().await.map_err(|e| (Outcome::Transport, error_chain(&e)))?;
    read_whole(&body, st)?;
    Ok(Ended::Complete)
}

/// Folds a non-streamed answer (completions or chat) into `st`.
fn read_whole(body: &[u8], st: &mut StreamState) -> Result<(), Failure> {
    #[derive(Deserialize)]
    struct Whole {
        choices: Vec<WholeChoice>,
        usage: Option<Usage>,
    }
    #[derive(Deserialize)]
    struct WholeChoice {
        text: Option<String>,
        message: Option<Delta>,
        finish_reason: Option<String>,
    }
    let answer: Whole = serde_json::from_slice(body).map_err(|e| {
        let text = String::from_utf8_lossy(body).chars().take(300).collect::<String>();
        (Outcome::Truncated, format!("not a completion ({e}): {text}"))
    })?;
    if answer.choices.is_empty() || answer.choices.iter().any(|c| c.finish_reason.is_none()) {
        return Err((Outcome::Truncated, "an answer without choices or a choice without a finish reason".into()));
    }
    for c in &answer.choices {
        let text = c.text.as_deref().or_else(|| c.message.as_ref().and_then(|m| m.content.as_deref()));
        st.text.push_str(text.unwrap_or_default());
    }
    st.usage_tokens = answer.usage.and_then(|u| u.completion_tokens);
    st.finished = true;
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

    fn spec(stream: bool, n: u32, chat: bool) -> RequestSpec {
        RequestSpec {
            url: "http://x/v1/completions".into(),
            chat,
            model: "m".into(),
            prompt: "hi".into(),
            prompt_len: 1,
            output_len: 4,
            ignore_eos: true,
            temperature: 0.0,
            api_key: None,
            timeout: Duration::from_secs(1),
            stream,
            n,
            disconnect_after: None,
        }
    }

    #[test]
    fn bodies_ask_for_what_the_shape_needs() {
        let b = spec(true, 1, false).body();
        assert_eq!((b["stream"].as_bool(), b["stream_options"]["include_usage"].as_bool()), (Some(true), Some(true)));
        assert!(b.get("n").is_none() && b["prompt"] == "hi");
        let b = spec(false, 3, true).body();
        assert_eq!(b["stream"], false);
        assert!(b.get("stream_options").is_none(), "stream_options without stream is an error in OpenAI's API");
        assert_eq!(b["n"], 3);
        assert_eq!(b["messages"][0]["content"], "hi");
    }

    #[test]
    fn whole_answers_are_read_and_malformed_ones_are_truncations() {
        let mut st = StreamState::new(Instant::now());
        let chat = r#"{"choices":[{"message":{"role":"assistant","content":"ab"},"finish_reason":"length"},
            {"message":{"content":"c"},"finish_reason":"stop"}],"usage":{"completion_tokens":3}}"#;
        read_whole(chat.as_bytes(), &mut st).unwrap();
        assert_eq!((st.text.as_str(), st.usage_tokens, st.finished, st.ttft_s), ("abc", Some(3), true, None));
        for bad in [r#"{"choices":[]}"#, r#"{"choices":[{"text":"a"}]}"#, "<html>", r#"{"error":{"message":"m"}}"#] {
            let err = read_whole(bad.as_bytes(), &mut StreamState::new(Instant::now())).unwrap_err();
            assert_eq!(err.0, Outcome::Truncated, "{bad}");
        }
    }

    #[test]
    fn chat_deltas_and_error_events() {
        let mut st = StreamState::new(Instant::now());
        st.on_event(SseEvent::Data(r#"{"choices":[{"delta":{"role":"assistant"}}]}"#.into()), Instant::now());
        st.on_event(SseEvent::Data(r#"{"choices":[{"delta":{"content":"hi"}}]}"#.into()), Instant::now());
        assert_eq!(st.chunks_with_text, 1);
        st.on_event(SseEvent::Data(r#"{"error":{"message":"engine died"}}"#.into()), Instant::now());
        assert!(st.error.as_deref().unwrap().contains("engine died"));
        assert_eq!(st.error_outcome, Some(Outcome::StreamError { error_type: None }), "no type: not OpenAI's shape");
        let mut st = StreamState::new(Instant::now());
        st.on_event(SseEvent::Data(r#"{"error":{"message":"m","type":"server_error"}}"#.into()), Instant::now());
        assert_eq!(st.error_outcome.unwrap().label(), "stream_error_server_error");
        let mut st = StreamState::new(Instant::now());
        st.on_event(SseEvent::Data("{not json".into()), Instant::now());
        assert_eq!(st.error_outcome.unwrap().label(), "stream_error_unshaped");
    }
}
