//! The HTTP edge in front of an echo backend (each dispatch generates its own prompt's
//! tokens again, cyclically, up to max_tokens): a way to try OpenAI clients and load
//! generators against the edge alone, without nodes.
//!
//! `cargo run -p cleave-coordinator --example echo_edge -- --model testdata/tiny-llama --listen 127.0.0.1:8000`

use clap::Parser;
use cleave_coordinator::{dispatch_channel, AppState, CoordinatorArgs, DispatchEvent, ModelInfo};
use cleave_protocol::{FinishReason, TokenEvent};

#[derive(Parser)]
struct Cli {
    #[command(flatten)]
    args: CoordinatorArgs,
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() -> anyhow::Result<()> {
    let args = Cli::parse().args;
    let model = ModelInfo::from_args(&args)?;
    let (tx, mut rx) = dispatch_channel(args.max_queued_requests);
    tokio::spawn(async move {
        while let Some(d) = rx.recv().await {
            tokio::spawn(async move {
                let max = d.stop.max_tokens as usize;
                // Skip the prompt's special tokens (BOS) so the echo reads as text.
                let ids: Vec<u32> = d.prompt.iter().copied().filter(|&t| t > 2).collect();
                let ids = if ids.is_empty() { vec![22557] } else { ids };
                for i in 0..max {
                    let finish = (i + 1 == max).then_some(FinishReason::Length);
                    let ev = TokenEvent {
                        request_id: d.id,
                        token_id: Some(ids[i % ids.len()]),
                        text: String::new(),
                        logprobs: None,
                        finish_reason: finish,
                        prompt_tokens: d.prompt.len() as u32,
                        cached_tokens: 0,
                        completion_tokens: i as u32 + 1,
                        error: None,
                    };
                    tokio::select! {
                        _ = d.cancel.cancelled() => return,
                        sent = d.events.send(DispatchEvent::Token(ev)) => if sent.is_err() { return },
                    }
                }
            });
        }
    });
    let listener = cleave_coordinator::bind(&args).await?;
    println!("listening on http://{}", listener.local_addr()?);
    let listener = cleave_coordinator::edge::EdgeListener::from_args(listener, &args)?;
    cleave_coordinator::serve(listener, AppState::new(&args, model, tx)?).await?;
    Ok(())
}
