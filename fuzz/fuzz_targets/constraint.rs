//! Output constraints and tool-call parsing (`cleave-constrain`): what a client sends in
//! `response_format`, `guided_*` and `tools`, compiled by the coordinator and again by every node.
//!
//! The first byte picks what the rest is:
//! - 0-3: a JSON Schema, a regex, a Lark grammar, or choices separated by NUL, compiled against
//!   the tiny reference model's vocabulary. Compiling ends in a state or a `ConstrainError`,
//!   never a panic or a hang (llguidance's fuel and item limits; libFuzzer's `-timeout`); a
//!   state then takes up to 16 steps, each a mask and the commit of an allowed token picked by
//!   the next input byte: the committed token is always accepted (the mask is the truth).
//! - 4-5: model output for the Hermes or the Llama 3 tool-call parser, fed in pieces whose
//!   lengths come from the second byte: what it collects equals what it collects from the whole
//!   text at once (the property streaming relies on).
#![no_main]

use std::sync::OnceLock;

use cleave_constrain::tools::{Collected, ToolCallParser, ToolFormat};
use cleave_constrain::{Compiler, Mask};
use cleave_protocol::Constraint;
use cleave_tokenizer::Tokenizer;
use libfuzzer_sys::fuzz_target;

fn compiler() -> &'static Compiler {
    static C: OnceLock<Compiler> = OnceLock::new();
    C.get_or_init(|| {
        let tok = Tokenizer::from_model_dir(concat!(env!("CARGO_MANIFEST_DIR"), "/../testdata/tiny-llama"))
            .expect("the tiny reference model's tokenizer loads");
        Compiler::new(&tok, tok.vocab_size(), &[2]).expect("the tiny vocabulary reads as bytes")
    })
}

fuzz_target!(|data: &[u8]| {
    let Some((&mode, rest)) = data.split_first() else { return };
    match mode % 6 {
        m @ 0..=3 => {
            // The text ends at the first 0xff byte; what follows picks the tokens of the walk.
            let cut = rest.iter().position(|&b| b == 0xff).unwrap_or(rest.len());
            let text = String::from_utf8_lossy(&rest[..cut]).into_owned();
            let picks = rest.get(cut + 1..).unwrap_or(&[]);
            let c = match m {
                0 => Constraint::JsonSchema(text),
                1 => Constraint::Regex(text),
                2 => Constraint::Lark(text),
                _ => Constraint::Choice(text.split('\0').map(str::to_owned).collect()),
            };
            if c.validate().is_err() {
                return;
            }
            let Ok(mut state) = compiler().start(&c, &[]) else { return };
            let mut mask = Mask::default();
            for &p in picks.iter().take(16) {
                if state.is_done() || state.fill_mask(&mut mask).is_err() {
                    return;
                }
                let allowed: Vec<u32> = (0..compiler().vocab_size() as u32).filter(|&t| mask.allows(t)).collect();
                let token = allowed[p as usize % allowed.len()];
                state.commit(token).unwrap_or_else(|e| panic!("token {token} was in the mask but refused: {e}"));
            }
        }
        m => {
            let format = if m == 4 { ToolFormat::Hermes } else { ToolFormat::Llama3Json };
            let Some((&step, text)) = rest.split_first() else { return };
            let text = String::from_utf8_lossy(text);
            let whole = Collected::parse(format, &text);
            let mut parser = ToolCallParser::new(format);
            let mut pieces = Collected::default();
            let (mut at, width) = (0, step as usize % 7 + 1);
            while at < text.len() {
                let mut end = (at + width).min(text.len());
                while !text.is_char_boundary(end) {
                    end += 1;
                }
                parser.push(&text[at..end]).into_iter().for_each(|e| pieces.apply(e));
                at = end;
            }
            parser.finish().into_iter().for_each(|e| pieces.apply(e));
            assert_eq!(pieces, whole, "pieces of {width} bytes");
        }
    }
});
