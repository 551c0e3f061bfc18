//! Test harness: a coordinator on a port-0 listener in front of a scripted backend task that
//! answers [`Dispatch`]es with token ids (a stand-in for the router and its nodes).

#![allow(dead_code)]

use std::path::PathBuf;
use std::time::Duration;

use cleave_coordinator::{dispatch_channel, AppState, CoordinatorArgs, Dispatch, DispatchEvent, ModelInfo};
use cleave_protocol::{FinishReason, Logprobs, RequestId, SamplingParams, StopConditions, TokenEvent, TokenLogprob};
use tokio::sync::mpsc;

/// The tiny reference model (`testdata/tiny-llama` in the repository: Hugging Face
/// files with transformers' golden outputs).
pub fn tiny_llama() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../testdata/tiny-llama")
}
/// Bound on every wait in the tests (never reached when things work).
pub const WAIT: Duration = Duration::from_secs(20);

pub fn args() -> CoordinatorArgs {
    CoordinatorArgs { model: Some(tiny_llama()), ..CoordinatorArgs::default() }
}

/// How the scripted backend answers each dispatch.
#[derive(Debug, Clone)]
pub enum Mode {
    /// Emit these ids (up to max_tokens), then finish: `Stop` when the script ran out first,
    /// `Length` at max_tokens.
    Script(Vec<u32>),
    /// Emit these ids cyclically until cancelled; report the cancellation.
    Endless(Vec<u32>),
    /// Answer that no node can serve.
    Refuse,
    /// Keep the dispatch and never answer.
    Hang,
    /// Emit one token, then an error event.
    FailAfterOne(u32),
}

/// What a test can observe of the backend.
#[derive(Debug, Clone, PartialEq)]
pub struct Seen {
    pub id: RequestId,
    pub prompt: Vec<u32>,
    pub params: SamplingParams,
    pub stop: StopConditions,
}

pub struct Harness {
    pub base: String,
    pub client: reqwest::Client,
    pub seen: mpsc::UnboundedReceiver<Seen>,
    pub cancelled: mpsc::UnboundedReceiver<RequestId>,
    pub model: ModelInfo,
    /// Held for `Mode::Hang`-style tests that never receive: keeps the queue full.
    pub parked: Option<mpsc::Receiver<Dispatch>>,
}

impl Harness {
    pub fn url(&self, path: &str) -> String {
        format!("{}{}", self.base, path)
    }

    pub async fn post(&self, path: &str, body: serde_json::Value) -> reqwest::Response {
        tokio::time::timeout(WAIT, self.client.post(self.url(path)).json(&body).send())
            .await
            .expect("request timed out")
            .expect("request failed")
    }

    pub async fn next_seen(&mut self) -> Seen {
        tokio::time::timeout(WAIT, self.seen.recv()).await.expect("no dispatch seen").expect("backend gone")
    }
}

fn event(
    id: RequestId,
    token: Option<u32>,
    n: u32,
    prompt: u32,
    finish: Option<FinishReason>,
    params: &SamplingParams,
) -> TokenEvent {
    let logprobs = match (token, params.logprobs) {
        (Some(t), Some(k)) => Some(Logprobs {
            chosen: TokenLogprob { token_id: t, logprob: -0.25 },
            top: (0..k).map(|i| TokenLogprob { token_id: 100 + i, logprob: -1.0 - i as f32 }).collect(),
        }),
        _ => None,
    };
    TokenEvent {
        request_id: id,
        token_id: token,
        text: "ignored by the coordinator".into(),
        logprobs,
        finish_reason: finish,
        prompt_tokens: prompt,
        cached_tokens: 3,
        completion_tokens: n,
        error: (finish == Some(FinishReason::Error)).then(|| "scripted failure".to_owned()),
    }
}

async fn answer(d: Dispatch, mode: Mode, cancelled: mpsc::UnboundedSender<RequestId>) {
    let prompt = d.prompt.len() as u32;
    let send = |ev: TokenEvent| {
        let tx = d.events.clone();
        async move { tx.send(DispatchEvent::Token(ev)).await.is_ok() }
    };
    match mode {
        Mode::Script(ids) => {
            let max = d.stop.max_tokens as usize;
            let take = ids.len().min(max);
            for (i, &t) in ids[..take].iter().enumerate() {
                let last = i + 1 == take;
                let finish = last.then_some(if take == max { FinishReason::Length } else { FinishReason::Stop });
                if !send(event(d.id, Some(t), i as u32 + 1, prompt, finish, &d.params)).await {
                    return;
                }
            }
        }
        Mode::Endless(ids) => {
            let mut n = 0u32;
            loop {
                let t = ids[n as usize % ids.len()];
                n += 1;
                tokio::select! {
                    _ = d.cancel.cancelled() => {
                        let _ = cancelled.send(d.id);
                        return;
                    }
                    ok = send(event(d.id, Some(t), n, prompt, None, &d.params)) => {
                        if !ok {
                            // Receiver dropped; the cancel token must have fired too.
                            d.cancel.cancelled().await;
                            let _ = cancelled.send(d.id);
                            return;
                        }
                    }
                }
            }
        }
        Mode::Refuse => {
            let _ = d.events.send(DispatchEvent::Refused { reason: "no decode node registered".into() }).await;
        }
        Mode::Hang => {
            d.cancel.cancelled().await;
            let _ = cancelled.send(d.id);
        }
        Mode::FailAfterOne(t) => {
            send(event(d.id, Some(t), 1, prompt, None, &d.params)).await;
            send(event(d.id, None, 1, prompt, Some(FinishReason::Error), &d.params)).await;
        }
    }
}

/// Starts a coordinator with `args` whose backend answers every dispatch with `mode`.
pub async fn start(args: CoordinatorArgs, mode: Mode) -> Harness {
    start_inner(args, Some(mode)).await
}

/// Starts a coordinator whose dispatch queue is never drained (admission fills up).
pub async fn start_parked(args: CoordinatorArgs) -> Harness {
    start_inner(args, None).await
}

async fn start_inner(args: CoordinatorArgs, mode: Option<Mode>) -> Harness {
    let model = ModelInfo::from_args(&args).expect("tiny-llama loads");
    let (tx, mut rx) = dispatch_channel(args.max_queued_requests);
    let (seen_tx, seen) = mpsc::unbounded_channel();
    let (cancel_tx, cancelled) = mpsc::unbounded_channel();
    let parked = match mode {
        Some(mode) => {
            tokio::spawn(async move {
                while let Some(d) = rx.recv().await {
                    let _ = seen_tx.send(Seen {
                        id: d.id,
                        prompt: d.prompt.clone(),
                        params: d.params.clone(),
                        stop: d.stop.clone(),
                    });
                    tokio::spawn(answer(d, mode.clone(), cancel_tx.clone()));
                }
            });
            None
        }
        None => Some(rx),
    };
    let state = AppState::new(&args, model.clone(), tx).unwrap();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let base = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(cleave_coordinator::serve(cleave_coordinator::edge::EdgeListener::plain(listener).unwrap(), state));
    Harness { base, client: reqwest::Client::new(), seen, cancelled, model, parked }
}

/// Token ids of `text` (no BOS), from the tiny-llama tokenizer.
pub fn ids(model: &ModelInfo, text: &str) -> Vec<u32> {
    model.tokenizer.encode(text, false).unwrap()
}

/// What a client should see when `generated` follows `prompt`: the incremental text.
pub fn expected_text(model: &ModelInfo, prompt: &[u32], generated: &[u32]) -> String {
    let all: Vec<u32> = prompt.iter().chain(generated).copied().collect();
    let full = model.tokenizer.decode(&all, true).unwrap();
    let head = model.tokenizer.decode(prompt, true).unwrap();
    full[head.len()..].to_owned()
}

/// The `data:` payloads of an SSE body, in order.
pub fn sse_data(body: &str) -> Vec<String> {
    body.split("\n\n")
        .filter(|frame| !frame.trim().is_empty())
        .filter_map(|frame| frame.lines().find_map(|l| l.strip_prefix("data: ").or_else(|| l.strip_prefix("data:"))))
        .map(|s| s.trim_start().to_owned())
        .collect()
}

/// Parses the JSON chunks of an SSE body, checking it ends with exactly one `[DONE]`.
pub fn sse_chunks(body: &str) -> Vec<serde_json::Value> {
    let data = sse_data(body);
    assert_eq!(data.last().map(String::as_str), Some("[DONE]"), "stream must end with [DONE]: {body}");
    assert_eq!(data.iter().filter(|d| *d == "[DONE]").count(), 1);
    data[..data.len() - 1].iter().map(|d| serde_json::from_str(d).expect("chunk is JSON")).collect()
}
