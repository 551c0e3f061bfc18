//! Helpers shared by the crate's integration tests: the tiny model's tokenizer and a walk
//! through a constraint's masks by a "model" that knows nothing.
#![allow(dead_code)]

use cleave_constrain::{ConstraintState, Mask};
use cleave_tokenizer::Tokenizer;
use rand::Rng;
use rand_chacha::ChaCha8Rng;

/// The tiny model's end-of-sequence id.
pub const EOS: u32 = 2;

pub fn tokenizer() -> Tokenizer {
    Tokenizer::from_model_dir(concat!(env!("CARGO_MANIFEST_DIR"), "/../testdata/tiny-llama")).unwrap()
}

/// Samples uniformly among the allowed tokens (EOS with probability one half whenever it is
/// allowed) until the constraint is done: only the mask keeps the text in the language.
pub fn random_walk(state: &mut ConstraintState, rng: &mut ChaCha8Rng, max_tokens: usize) -> Vec<u32> {
    let mut mask = Mask::default();
    let mut out = Vec::new();
    for _ in 0..max_tokens {
        state.fill_mask(&mut mask).unwrap();
        let allowed: Vec<u32> = (0..32000u32).filter(|&t| mask.allows(t)).collect();
        assert_eq!(allowed.len(), mask.count());
        let t =
            if mask.allows(EOS) && rng.random_bool(0.5) { EOS } else { allowed[rng.random_range(0..allowed.len())] };
        state.commit(t).unwrap();
        if t == EOS {
            assert!(state.is_done(), "EOS was allowed, so the text was complete");
            return out;
        }
        out.push(t);
    }
    panic!("no end after {max_tokens} tokens: {out:?}");
}
