//! A node keeps a decode-only copy of the tokenizer (`Tokenizer::for_decoding`) while the
//! coordinator keeps the whole one. Both fold the vocabulary into the model identity they
//! compare at registration, so the copy must fold it identically, and it must decode a real
//! vocabulary (SmolLM2's 49,152 byte-level tokens) exactly as the whole one does.

mod common;

use std::path::PathBuf;

use cleave_engine::model::identity::with_vocabulary;
use cleave_engine::model::ModelFiles;

fn same_identity_and_text(path: &std::path::Path) {
    let mut files = ModelFiles::open(path).unwrap();
    let whole = files.tokenizer.clone();
    let slim = whole.for_decoding().unwrap();
    assert_eq!(with_vocabulary(0x5eed, &slim), with_vocabulary(0x5eed, &whole));
    let by_whole = files.identity().unwrap();
    files.tokenizer = slim.clone();
    assert_eq!(files.identity().unwrap(), by_whole, "{}", path.display());
    let n = whole.vocab_size() as u32;
    for id in 0..n {
        assert_eq!(slim.decode(&[id], false).unwrap(), whole.decode(&[id], false).unwrap(), "id {id}");
    }
    // Runs of neighbouring ids: multi-byte characters split across byte tokens, specials
    // among them.
    for start in (0..n).step_by(97) {
        let ids: Vec<u32> = (start..(start + 24).min(n)).chain([0, 1, 2]).collect();
        for skip in [false, true] {
            assert_eq!(slim.decode(&ids, skip).unwrap(), whole.decode(&ids, skip).unwrap(), "{ids:?}");
        }
    }
}

#[test]
fn the_tiny_models_identity_and_text_are_the_same_with_a_decode_only_tokenizer() {
    same_identity_and_text(&PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../testdata/tiny-llama"));
}

#[test]
fn smollm2s_identity_and_text_are_the_same_with_a_decode_only_tokenizer() {
    let Some(path) = common::smollm2() else { return };
    same_identity_and_text(&path);
}
