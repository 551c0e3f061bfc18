//! Golden tests against the repository's `testdata/tiny-llama` (transformers + tokenizers
//! reference outputs in golden.json).

use std::path::PathBuf;

use cleave_tokenizer::{
    ChatMessage, ChatOptions, IncrementalDecoder, NamedTemplate, Tokenizer, TokenizerConfig, TokenizerError,
};
use serde::Deserialize;

/// The repository's `testdata/` folder (the tiny reference model and its golden outputs).
fn testdata_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../testdata")
}

fn model_dir() -> PathBuf {
    testdata_dir().join("tiny-llama")
}

#[derive(Deserialize)]
struct Golden {
    cases: Vec<Case>,
}

#[derive(Deserialize)]
struct Case {
    name: String,
    prompt: Option<String>,
    messages: Option<Vec<ChatMessage>>,
    add_generation_prompt: Option<bool>,
    rendered_prompt: Option<String>,
    add_special_tokens: bool,
    prompt_ids: Vec<u32>,
    generated_ids: Vec<u32>,
    text_alone: String,
    text_incremental: String,
    text_alone_keep_special: String,
}

fn golden() -> Golden {
    let path = model_dir().join("golden.json");
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("cannot read {}: {e}", path.display()));
    serde_json::from_str(&text).unwrap()
}

fn tokenizer() -> Tokenizer {
    Tokenizer::from_model_dir(model_dir()).unwrap()
}

#[test]
fn loads_tiny_llama() {
    let tok = tokenizer();
    assert_eq!(tok.vocab_size(), 32000);
    assert_eq!(tok.bos_token(), Some("<s>"));
    assert_eq!(tok.eos_token(), Some("</s>"));
    assert_eq!(tok.bos_token_id(), Some(1));
    assert_eq!(tok.eos_token_id(), Some(2));
    assert_eq!(tok.token_to_id("▁Hello"), Some(22557));
    assert_eq!(tok.id_to_token(22557).as_deref(), Some("▁Hello"));
    assert_eq!(tok.config().add_bos_token, Some(true));
    assert!(tok.has_chat_template());
    assert_eq!(tok.chat_template_names(), ["default"]);
}

#[test]
fn from_file_has_no_config() {
    let tok = Tokenizer::from_file(model_dir().join("tokenizer.json")).unwrap();
    assert_eq!(tok.bos_token_id(), None);
    assert!(!tok.has_chat_template());
    assert_eq!(tok.encode("Hello", true).unwrap(), [1, 22557]);
}

#[test]
fn golden_encode_and_decode() {
    let tok = tokenizer();
    let golden = golden();
    assert_eq!(golden.cases.len(), 7);
    for case in &golden.cases {
        let text = case.prompt.as_deref().or(case.rendered_prompt.as_deref()).unwrap();
        let ids = tok.encode(text, case.add_special_tokens).unwrap();
        assert_eq!(ids, case.prompt_ids, "case {}: prompt ids", case.name);
        let alone = tok.decode(&case.generated_ids, true).unwrap();
        assert_eq!(alone, case.text_alone, "case {}: text_alone", case.name);
        let keep = tok.decode(&case.generated_ids, false).unwrap();
        assert_eq!(keep, case.text_alone_keep_special, "case {}", case.name);
    }
}

#[test]
fn golden_incremental_one_by_one() {
    let tok = tokenizer();
    for case in &golden().cases {
        let mut dec = IncrementalDecoder::new(tok.clone(), &case.prompt_ids);
        let mut out = String::new();
        for &id in &case.generated_ids {
            let piece = dec.push(id).unwrap();
            assert!(!piece.contains('\u{FFFD}'), "case {}: {piece:?}", case.name);
            out.push_str(&piece);
        }
        out.push_str(&dec.finish().unwrap());
        assert_eq!(out, case.text_incremental, "case {}", case.name);

        // The same text when ids arrive in bursts.
        let mut dec = IncrementalDecoder::new(tok.clone(), &case.prompt_ids);
        let mut bursts = String::new();
        for chunk in case.generated_ids.chunks(3) {
            bursts.push_str(&dec.push_many(chunk).unwrap());
        }
        bursts.push_str(&dec.finish().unwrap());
        assert_eq!(bursts, case.text_incremental, "case {} (bursts)", case.name);
    }
}

/// Naive reference for the incremental decoder: decode everything, cut the prompt.
fn reference_incremental(tok: &Tokenizer, prompt: &[u32], gen: &[u32], skip: bool) -> String {
    let all: Vec<u32> = prompt.iter().chain(gen).copied().collect();
    let full = tok.decode(&all, skip).unwrap();
    let head = tok.decode(prompt, skip).unwrap();
    full[head.len()..].to_owned()
}

#[test]
fn incremental_handles_split_multibyte_characters() {
    let tok = tokenizer();
    let text = "héllo 日本語 🎉 naïve 🚀🤖 ok";
    let ids = tok.encode(text, false).unwrap();
    // The emoji are byte-fallback tokens (<0xF0> ...), i.e. split characters.
    assert!(ids.iter().any(|&id| tok.id_to_token(id).is_some_and(|t| t.starts_with("<0x"))));
    let mut dec = IncrementalDecoder::new(tok.clone(), &[]);
    let mut out = String::new();
    for &id in &ids {
        let piece = dec.push(id).unwrap();
        assert!(!piece.contains('\u{FFFD}'), "broken UTF-8 emitted: {piece:?}");
        out.push_str(&piece);
    }
    out.push_str(&dec.finish().unwrap());
    assert_eq!(out, tok.decode(&ids, true).unwrap());
    assert_eq!(out, text);

    // After a prompt, and with every split of the text into prompt/generation.
    for split in 0..ids.len() {
        let (prompt, gen) = ids.split_at(split);
        let mut dec = IncrementalDecoder::new(tok.clone(), prompt);
        let mut out = String::new();
        for &id in gen {
            out.push_str(&dec.push(id).unwrap());
        }
        out.push_str(&dec.finish().unwrap());
        assert!(!out.contains('\u{FFFD}'), "split {split}: {out:?}");
        if tok.decode(prompt, true).unwrap().contains('\u{FFFD}') {
            // The prompt ends inside a character: "the text after the prompt" is not
            // well defined; the decoder completes the split character.
            assert!(text.ends_with(&out), "split {split}: {out:?}");
        } else {
            assert_eq!(out, reference_incremental(&tok, prompt, gen, true), "split {split}");
        }
    }
}

#[test]
fn incremental_special_tokens_skip_or_keep() {
    let tok = tokenizer();
    let gen = tok.encode("Hello world", false).unwrap();
    // EOS in the middle, then more text: skipped vs kept.
    let seq: Vec<u32> = [gen.as_slice(), &[2], &gen].concat();
    for skip in [true, false] {
        let mut dec = IncrementalDecoder::new(tok.clone(), &[1]).with_skip_special_tokens(skip);
        let mut out = String::new();
        for &id in &seq {
            out.push_str(&dec.push(id).unwrap());
        }
        out.push_str(&dec.finish().unwrap());
        assert_eq!(out, reference_incremental(&tok, &[1], &seq, skip), "skip={skip}");
    }
}

#[test]
fn incremental_unfinished_character_released_by_finish() {
    let tok = tokenizer();
    let ids = tok.encode("a🎉", false).unwrap();
    let cut = &ids[..ids.len() - 1]; // drop the last byte of the emoji
    let mut dec = IncrementalDecoder::new(tok.clone(), &[]);
    let mut out = String::new();
    for &id in cut {
        out.push_str(&dec.push(id).unwrap());
    }
    assert!(!out.contains('\u{FFFD}'));
    out.push_str(&dec.finish().unwrap());
    assert_eq!(out, tok.decode(cut, true).unwrap());
}

#[test]
fn golden_chat_template() {
    let tok = tokenizer();
    let golden = golden();
    let case = golden.cases.iter().find(|c| c.name == "chat").unwrap();
    let messages = case.messages.as_ref().unwrap();
    let rendered = tok.render_chat(messages, case.add_generation_prompt.unwrap()).unwrap();
    assert_eq!(Some(&rendered), case.rendered_prompt.as_ref());
    assert_eq!(tok.encode(&rendered, false).unwrap(), case.prompt_ids);
}

#[test]
fn tiny_llama_template_rejects_system_role() {
    let tok = tokenizer();
    let err = tok.render_chat(&[ChatMessage::system("be brief"), ChatMessage::user("hi")], true).unwrap_err();
    match &err {
        TokenizerError::TemplateException { message, .. } => {
            assert_eq!(message, "Only user and assistant roles are supported!")
        }
        other => panic!("expected TemplateException, got {other:?}"),
    }
    assert!(err.to_string().contains("Only user and assistant roles"));
}

/// SmolLM2-135M-Instruct's template (ChatML with a default system prompt).
const SMOLLM2_TEMPLATE: &str = "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}";

fn with_template(template: &str) -> Tokenizer {
    let hf = tokenizer().hf().unwrap().clone();
    let mut config = TokenizerConfig {
        bos_token: Some("<|im_start|>".into()),
        eos_token: Some("<|im_end|>".into()),
        ..Default::default()
    };
    config.chat_templates.push(NamedTemplate { name: "default".into(), template: template.into() });
    Tokenizer::from_hf(hf, config)
}

#[test]
fn chatml_template_smollm2_style() {
    let tok = with_template(SMOLLM2_TEMPLATE);
    let msgs = [ChatMessage::user("Hi!"), ChatMessage::assistant("Hello."), ChatMessage::user("2+2?")];
    let with_prompt = tok.render_chat(&msgs, true).unwrap();
    assert_eq!(
        with_prompt,
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n\
         <|im_start|>user\nHi!<|im_end|>\n<|im_start|>assistant\nHello.<|im_end|>\n\
         <|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n"
    );
    let without = tok.render_chat(&msgs, false).unwrap();
    assert_eq!(format!("{without}<|im_start|>assistant\n"), with_prompt);

    let sys = [ChatMessage::system("Be terse."), ChatMessage::user("Hi")];
    assert_eq!(
        tok.render_chat(&sys, true).unwrap(),
        "<|im_start|>system\nBe terse.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    );
}

/// What Llama 3.x / Mistral templates use: namespace, strftime_now, pycompat string methods,
/// loop controls, `is defined` on tools, tojson.
const LLAMA3_STYLE_TEMPLATE: &str = r#"{{- bos_token }}
{%- set ns = namespace(system='') %}
{%- if messages[0]['role'] == 'system' %}
    {%- set ns.system = messages[0]['content'] | trim %}
    {%- set messages = messages[1:] %}
{%- endif %}
{%- if tools is not none and tools is defined %}{{ raise_exception('no tools') }}{% endif %}
{{- "<|start_header_id|>system<|end_header_id|>\n\n" }}
{{- "Today Date: " + strftime_now("%d %b %Y") + "\n" + ns.system + "<|eot_id|>" }}
{%- for message in messages %}
    {%- if message.content.startswith('STOP') %}{% break %}{% endif %}
    {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' + message['content'].strip() + '<|eot_id|>' }}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{%- endif %}
{{- {"n": messages | length} | tojson }}"#;

#[test]
fn llama3_style_template_features() {
    let template = LLAMA3_STYLE_TEMPLATE;
    let tok = with_template(template);
    let opts = ChatOptions {
        add_generation_prompt: true,
        now_unix_secs: Some(1_721_952_000), // 2024-07-26
        ..Default::default()
    };
    let out = tok
        .render_chat_with(
            &[
                ChatMessage::system("  Be terse. "),
                ChatMessage::user(" Hi "),
                ChatMessage::user("STOP here"),
                ChatMessage::user("never"),
            ],
            &opts,
        )
        .unwrap();
    assert_eq!(
        out,
        "<|im_start|><|start_header_id|>system<|end_header_id|>\n\nToday Date: 26 Jul 2024\nBe terse.<|eot_id|>\
         <|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>\
         <|start_header_id|>assistant<|end_header_id|>\n\n{\"n\": 3}"
    );
}

#[test]
fn long_conversations_fit_the_render_budget() {
    // RENDER_FUEL must not refuse real use: 5,000 turns through the heaviest template here.
    let conversation: Vec<ChatMessage> = (0..5000)
        .map(|i| if i % 2 == 0 { ChatMessage::user(format!("question {i}")) } else { ChatMessage::assistant("answer") })
        .collect();
    let opts = ChatOptions { add_generation_prompt: true, now_unix_secs: Some(0), ..Default::default() };
    for template in [SMOLLM2_TEMPLATE, LLAMA3_STYLE_TEMPLATE] {
        let out = with_template(template).render_chat_with(&conversation, &opts).unwrap();
        assert!(out.contains("question 4998"));
    }
}

#[test]
fn raise_exception_template_is_an_error_not_a_panic() {
    let tok = with_template(
        "{% for m in messages %}{% if m.role not in ['user', 'assistant'] %}\
         {{ raise_exception('Conversation roles must be user/assistant, got ' + m.role) }}\
         {% endif %}{{ m.content }}{% endfor %}",
    );
    assert_eq!(tok.render_chat(&[ChatMessage::user("ok")], false).unwrap(), "ok");
    let err = tok.render_chat(&[ChatMessage::new("tool", "x")], false).unwrap_err();
    assert!(
        matches!(&err, TokenizerError::TemplateException { message, .. }
            if message == "Conversation roles must be user/assistant, got tool"),
        "{err:?}"
    );
}

#[test]
fn model_without_template_uses_chatml_fallback() {
    let tok = Tokenizer::from_file(model_dir().join("tokenizer.json")).unwrap();
    let out = tok.render_chat(&[ChatMessage::user("Hi")], true).unwrap();
    assert_eq!(out, "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n");
}

#[test]
fn incremental_prompt_ending_in_special_tokens() {
    // The first window would hold only skipped special tokens; the decoder must widen
    // it, or the Strip decoder would eat the generated text's leading space.
    let tok = tokenizer();
    let prompt: Vec<u32> = [tok.encode("Hello world", true).unwrap(), vec![2; 6]].concat();
    let gen = tok.encode(" again and again", false).unwrap();
    let mut dec = IncrementalDecoder::new(tok.clone(), &prompt);
    let mut out = String::new();
    for &id in &gen {
        out.push_str(&dec.push(id).unwrap());
    }
    out.push_str(&dec.finish().unwrap());
    assert_eq!(out, reference_incremental(&tok, &prompt, &gen, true));
    assert!(out.starts_with(' '), "{out:?}");
}

#[test]
fn out_of_vocabulary_ids_do_not_fail() {
    let tok = tokenizer();
    let hello = tok.encode("Hello", false).unwrap();
    let ids = [hello.as_slice(), &[4_000_000]].concat();
    assert_eq!(tok.decode(&ids, true).unwrap(), "Hello");
    let mut dec = IncrementalDecoder::new(tok.clone(), &[1]);
    assert_eq!(dec.push(4_000_000).unwrap(), "");
    assert_eq!(dec.push(hello[0]).unwrap(), "Hello");
}

/// Writes the seed corpus of the `chat_template` fuzz target (`fuzz/`): the real templates
/// (the tiny model's, SmolLM2's, the ChatML fallback, the Llama 3 style one above) as template
/// sources (mode bytes 0 and 2), and conversations in the target's NUL-separated form (mode
/// bytes 1 and 3). Run by `scripts/fuzz --seeds`.
#[test]
#[ignore = "writes fuzz/corpus/chat_template; run by scripts/fuzz --seeds"]
fn write_fuzz_seeds() {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../fuzz/corpus/chat_template");
    std::fs::create_dir_all(&dir).unwrap();
    let tiny = tokenizer().config().chat_templates[0].template.clone();
    let templates = [
        ("tiny", tiny.as_str()),
        ("smollm2", SMOLLM2_TEMPLATE),
        ("chatml", cleave_tokenizer::CHATML_FALLBACK_TEMPLATE),
        ("llama3", LLAMA3_STYLE_TEMPLATE),
    ];
    for (name, t) in templates {
        for mode in [0u8, 2] {
            std::fs::write(dir.join(format!("seed-{name}-{mode}")), [&[mode][..], t.as_bytes()].concat()).unwrap();
        }
    }
    let conversations: [&[&str]; 3] = [
        &["user", "Hi!", "assistant", "Hello.", "user", "2+2?"],
        &["system", "Be terse.", "user", "é🎉 <|im_end|> {{ x }}"],
        &["tool", "{\"a\": 1}", "developer", ""],
    ];
    for (i, c) in conversations.iter().enumerate() {
        for mode in [1u8, 3] {
            std::fs::write(dir.join(format!("seed-conv{i}-{mode}")), [&[mode][..], c.join("\0").as_bytes()].concat())
                .unwrap();
        }
    }
}
