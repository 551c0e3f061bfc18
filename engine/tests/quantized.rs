//! SmolLM2-135M-Instruct Q4_1 with its weights kept quantized (the default) against the same
//! file dequantized to f32 at load (`EngineConfig::dequantize_weights`), skipped with a message
//! when the GGUF is absent (unless CLEAVE_REQUIRE_SMOLLM2 is set):
//! - the greedy chat answer to "What is the capital of France?" names Paris on both, with the
//!   quantized kernels of every instruction set the machine has (AVX2 is the EPYC class's);
//! - the perplexity of the fixed text of `kv_dtype.rs` (`fixtures/perplexity_text.txt`, by
//!   teacher forcing in prefill chunks of 64 and 8) is within 1% of the dequantized path's;
//! - both loads have the same model fingerprint, and the quantized one reads 5x fewer weight
//!   bytes a decode step.
//!
//! Every format on a small model, and the tiny safetensors model, are covered by the engine's
//! unit tests (`model::quantized_tests`) and `golden.rs`.

mod common;

use std::time::Instant;

use cleave_engine::model::{LoadOptions, Model, ModelFiles};
use cleave_engine::{EngineConfig, EngineCore};
use cleave_kernels::cpu::{CpuBackend, Isa};
use cleave_protocol::{FinishReason, KvDtype};
use cleave_tokenizer::ChatMessage;
use common::*;

fn config(dequantize_weights: bool) -> EngineConfig {
    EngineConfig { kv_cache_memory: 64 << 20, dequantize_weights, ..Default::default() }
}

#[test]
fn smollm2_quantized_answers_the_capital_of_france() {
    let Some(path) = smollm2() else { return };
    let base = CpuBackend::default();
    let mut runs = vec![(base.clone(), true)];
    for isa in [Isa::Portable, Isa::Avx2Fma, Isa::Avx512] {
        if base.clone().with_isa(isa).isa() == isa {
            runs.push((base.clone().with_isa(isa), false));
        }
    }
    for (backend, dequantize) in runs {
        let what = format!("dequantize_weights={dequantize} {}", backend.quant_isa().name());
        let mut core = EngineCore::load(backend, ModelFiles::open(&path).unwrap(), &config(dequantize)).unwrap();
        let text = core.tokenizer().render_chat(&[ChatMessage::user("What is the capital of France?")], true).unwrap();
        let prompt = core.tokenizer().encode(&text, false).unwrap();
        let mut req = greedy_request(1, prompt, 24);
        req.stop.ignore_eos = false;
        core.add_request(req, Instant::now()).unwrap();
        let events = run_to_end(&mut core).remove(&1).unwrap();
        let answer = common::text(&events);
        let finish = events.last().and_then(|e| e.finish_reason);
        println!("{what}: {answer:?} ({finish:?}); weights {}", core.weight_bytes());
        assert!(answer.contains("Paris"), "{what}: {answer:?}");
        assert!(matches!(finish, Some(FinishReason::Stop | FinishReason::Length)));
    }
}

#[test]
fn smollm2_quantized_perplexity_is_within_one_percent_of_dequantized() {
    let Some(path) = smollm2() else { return };
    let files = ModelFiles::open(&path).unwrap();
    let tokens = files.tokenizer.encode(&fixture("perplexity_text.txt"), true).unwrap();
    let backend = CpuBackend::default();
    let mut ppl = Vec::new();
    let mut fingerprints = Vec::new();
    let mut bytes = Vec::new();
    for dequantize_weights in [false, true] {
        let opts = LoadOptions { dequantize_weights };
        let model = Model::load_with(&backend, files.config.clone(), files.source.as_ref(), opts).unwrap();
        let t = Instant::now();
        ppl.push(perplexity(&model, &backend, &tokens, KvDtype::F32));
        println!(
            "dequantize_weights={dequantize_weights}: perplexity {:.5} ({} tokens, {:.1?}), weights {}",
            ppl.last().unwrap(),
            tokens.len(),
            t.elapsed(),
            model.weight_bytes(&backend)
        );
        fingerprints.push(model.fingerprint());
        bytes.push(model.weight_bytes(&backend).per_step);
    }
    println!(
        "SmolLM2-135M-Instruct Q4_1: quantized kernels {:.5}, dequantized {:.5} ({:+.4}%)",
        ppl[0],
        ppl[1],
        100.0 * (ppl[0] / ppl[1] - 1.0)
    );
    assert!(ppl[1] > 1.0 && ppl[1] < 50.0, "dequantized perplexity {}", ppl[1]);
    assert!((ppl[0] / ppl[1] - 1.0).abs() < 0.01, "quantized {} vs dequantized {}", ppl[0], ppl[1]);
    assert_eq!(fingerprints[0], fingerprints[1], "one model, whichever way it is loaded");
    // Q4_1 layers (5 bits a weight) and a Q8_0 head (8.5) against 32 bits.
    assert!(bytes[1] > 4 * bytes[0], "quantized {} B vs f32 {} B a step", bytes[0], bytes[1]);
}
