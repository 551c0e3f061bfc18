//! The chat-template renderer (`cleave_tokenizer::chat`, through [`Tokenizer::render_chat_with`],
//! the call the coordinator makes for every chat request).
//!
//! The first byte picks what the rest is:
//! - even: a template source, rendered against a fixed conversation. Whatever the template
//!   does (loops, recursion, `tojson`, Python methods), the render ends with a string or a
//!   [`TokenizerError`], never a panic, a hang (libFuzzer's `-timeout`) or a stack overflow;
//!   a string is at most `MAX_RENDERED_BYTES`. Memory is watched by the RSS limit and, per
//!   allocation, at 1 GiB here: legitimate renders hold up to 64 MiB of output plus strings of
//!   minijinja's 100 MB, and a template may still concatenate strings past that within its
//!   fuel (the renderer's documented limit), which this target reports only when it is large.
//! - odd: a conversation (fields separated by NUL: role, content, role, content, ...) rendered
//!   with real templates: the ChatML fallback, whose output is known exactly; SmolLM2-135M-
//!   Instruct's template, which accepts any conversation; and the tiny reference model's
//!   Llama-2 template (testdata/tiny-llama), which may only reject a conversation through its
//!   own `raise_exception`.
#![no_main]

use std::sync::OnceLock;

use cleave_tokenizer::chat::MAX_RENDERED_BYTES;
use cleave_tokenizer::{ChatMessage, ChatOptions, Tokenizer, TokenizerConfig, TokenizerError};
use libfuzzer_sys::fuzz_target;

const SMOLLM2_TEMPLATE: &str = include_str!("../templates/smollm2.jinja");

/// A tokenizer whose only interesting part is `template` (rendering never touches the vocabulary).
fn with_template(template: Option<&str>) -> Tokenizer {
    let hf = tokenizers::Tokenizer::new(tokenizers::models::bpe::BPE::default());
    let mut config =
        TokenizerConfig { bos_token: Some("<s>".into()), eos_token: Some("</s>".into()), ..Default::default() };
    if let Some(t) = template {
        config.set_chat_template(cleave_tokenizer::DEFAULT_TEMPLATE_NAME, t.to_owned());
    }
    Tokenizer::from_hf(hf, config)
}

struct Real {
    chatml: Tokenizer,
    smollm2: Tokenizer,
    tiny: Tokenizer,
}

fn real() -> &'static Real {
    static REAL: OnceLock<Real> = OnceLock::new();
    REAL.get_or_init(|| Real {
        chatml: with_template(None),
        smollm2: with_template(Some(SMOLLM2_TEMPLATE)),
        tiny: Tokenizer::from_model_dir(concat!(env!("CARGO_MANIFEST_DIR"), "/../testdata/tiny-llama"))
            .expect("the tiny reference model's tokenizer loads"),
    })
}

fn opts(mode: u8) -> ChatOptions {
    ChatOptions { add_generation_prompt: mode & 2 != 0, now_unix_secs: Some(1_721_865_600), ..Default::default() }
}

fn conversation(bytes: &[u8]) -> Vec<ChatMessage> {
    let fields: Vec<String> = bytes.split(|&b| b == 0).map(|f| String::from_utf8_lossy(f).into_owned()).collect();
    fields.chunks(2).take(64).map(|p| ChatMessage::new(p[0].clone(), p.get(1).cloned().unwrap_or_default())).collect()
}

fuzz_target!(init: {
    cleave_fuzz::MAX_ALLOC_BYTES.store(1 << 30, std::sync::atomic::Ordering::Relaxed);
}, |data: &[u8]| {
    let Some((&mode, rest)) = data.split_first() else { return };
    let opts = opts(mode);
    if mode % 2 == 0 {
        let tok = with_template(Some(&String::from_utf8_lossy(rest)));
        let messages = [
            ChatMessage::system("You are {{ terse }}."),
            ChatMessage::user("Hi <|im_start|> \u{e9}\u{1f389}"),
            ChatMessage::assistant("Hello."),
            ChatMessage::new("tool", "{\"a\": [1, 2]}"),
        ];
        match tok.render_chat_with(&messages, &opts) {
            Ok(out) => assert!(out.len() <= MAX_RENDERED_BYTES),
            Err(
                TokenizerError::TemplateSyntax { .. }
                | TokenizerError::TemplateRender { .. }
                | TokenizerError::TemplateException { .. }
                | TokenizerError::TemplateLimit { .. },
            ) => {}
            Err(e) => panic!("a render failed with a non-template error: {e:?}"),
        }
        return;
    }
    let messages = conversation(rest);
    let r = real();

    let out = r.chatml.render_chat_with(&messages, &opts).expect("ChatML renders any conversation");
    let mut want: String =
        messages.iter().map(|m| format!("<|im_start|>{}\n{}<|im_end|>\n", m.role, m.content)).collect();
    if opts.add_generation_prompt {
        want.push_str("<|im_start|>assistant\n");
    }
    assert_eq!(out, want);

    let out = r.smollm2.render_chat_with(&messages, &opts).expect("SmolLM2's template renders any conversation");
    for m in &messages {
        assert!(out.contains(&format!("<|im_start|>{}\n{}<|im_end|>\n", m.role, m.content)));
    }

    match r.tiny.render_chat_with(&messages, &opts) {
        Ok(out) => assert!(out.starts_with("<s>")),
        Err(TokenizerError::TemplateException { .. }) => {
            assert!(messages.iter().any(|m| m.role != "user" && m.role != "assistant"));
        }
        Err(e) => panic!("the tiny model's template failed other than by raise_exception: {e}"),
    }
});
