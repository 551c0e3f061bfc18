//! The real SmolLM2-135M-Instruct Q4_1 GGUF: config, tokenizer and tensors against references
//! computed in Python (`tests/fixtures/smollm2_*_reference.json`, each holding the script and
//! command that made it).
//!
//! The GGUF is found at `$CLEAVE_SMOLLM2_GGUF` or in the usual places that
//! `scripts/peers/smollm2.sh DIR` fills; when absent the test prints how to get it and passes.

use std::path::PathBuf;
use std::time::Instant;

use cleave_engine::model::gguf::GgufModel;
use serde::Deserialize;

const FILE: &str = "SmolLM2-135M-Instruct.Q4_1.gguf";

fn find_gguf() -> Option<PathBuf> {
    if let Some(p) = std::env::var_os("CLEAVE_SMOLLM2_GGUF") {
        return Some(PathBuf::from(p));
    }
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..");
    [root.join("../models/smollm2"), root.join("models/smollm2"), PathBuf::from("/work/models/smollm2")]
        .into_iter()
        .map(|d| d.join(FILE))
        .find(|p| p.is_file())
}

#[derive(Deserialize)]
struct TokCase {
    text: String,
    ids: Vec<u32>,
}

#[derive(Deserialize)]
struct TokFixture {
    cases: Vec<TokCase>,
}

#[derive(Deserialize)]
struct TensorCase {
    hf_name: String,
    shape: Vec<usize>,
    sum: f64,
    abs_sum: f64,
    #[serde(default)]
    rows: std::collections::BTreeMap<String, Vec<f32>>,
    #[serde(default)]
    first: Vec<f32>,
}

#[derive(Deserialize)]
struct TensorFixture {
    cases: Vec<TensorCase>,
}

fn open() -> Option<GgufModel> {
    let Some(path) = find_gguf() else {
        assert!(
            std::env::var_os("CLEAVE_REQUIRE_SMOLLM2").is_none(),
            "CLEAVE_REQUIRE_SMOLLM2 is set but {FILE} is missing"
        );
        println!(
            "SKIP: {FILE} not found; run scripts/peers/smollm2.sh models/smollm2 \
             or set CLEAVE_SMOLLM2_GGUF"
        );
        return None;
    };
    let t = Instant::now();
    let m = GgufModel::open(&path).unwrap();
    println!("opened {} in {:?}", path.display(), t.elapsed());
    Some(m)
}

#[test]
fn smollm2_config() {
    let Some(m) = open() else { return };
    let c = &m.config;
    assert_eq!(c.architecture, "llama");
    assert_eq!((c.num_layers, c.num_heads, c.num_kv_heads), (30, 9, 3));
    assert_eq!((c.hidden_size, c.intermediate_size, c.head_dim), (576, 1536, 64));
    assert_eq!((c.vocab_size, c.max_position_embeddings), (49152, 8192));
    assert_eq!(c.rope_theta, 100_000.0);
    assert!((c.rms_norm_eps - 1e-5).abs() < 1e-9);
    assert!(c.tie_word_embeddings && c.rope_scaling.is_none());
    assert_eq!((c.bos_token_id, c.eos_token_id), (Some(1), Some(2)));
    let tpl = m.chat_template.as_deref().unwrap();
    assert!(tpl.contains("<|im_start|>"), "{tpl}");
}

#[test]
fn smollm2_tokenizer_matches_reference() {
    let Some(m) = open() else { return };
    let fx: TokFixture = serde_json::from_str(include_str!("fixtures/smollm2_tokenizer_reference.json")).unwrap();
    assert!(fx.cases.len() >= 20);
    for case in &fx.cases {
        let enc = m.tokenizer.encode(case.text.as_str(), true).unwrap();
        assert_eq!(enc.get_ids(), &case.ids[..], "encoding {:?}", case.text);
        let back = m.tokenizer.decode(&case.ids, false).unwrap();
        assert_eq!(back, case.text, "decoding {:?}", case.ids);
    }
}

#[test]
fn smollm2_tensors_match_reference_and_full_load_time() {
    let Some(m) = open() else { return };
    let fx: TensorFixture = serde_json::from_str(include_str!("fixtures/smollm2_tensor_reference.json")).unwrap();
    for case in &fx.cases {
        let (shape, data) = m.tensor_f32(&case.hf_name).unwrap();
        assert_eq!(shape, case.shape, "{}", case.hf_name);
        let sum: f64 = data.iter().map(|&x| f64::from(x)).sum();
        let abs: f64 = data.iter().map(|&x| f64::from(x).abs()).sum();
        assert!(
            (abs - case.abs_sum).abs() <= 1e-5 * case.abs_sum,
            "{}: abs sum {abs} vs {}",
            case.hf_name,
            case.abs_sum
        );
        assert!((sum - case.sum).abs() <= 1e-5 * case.abs_sum, "{}: sum {sum} vs {}", case.hf_name, case.sum);
        let cols = shape.get(1).copied().unwrap_or(0);
        for (row, want) in &case.rows {
            let r: usize = row.parse().unwrap();
            assert_eq!(&data[r * cols..r * cols + want.len()], &want[..], "{} row {r}", case.hf_name);
        }
        assert_eq!(&data[..case.first.len()], &case.first[..], "{}", case.hf_name);
    }

    // Every tensor the config implies: right shape, finite values; report the time.
    let t = Instant::now();
    let mut values = 0usize;
    for (name, expected) in m.expected_tensors() {
        let (shape, data) = m.tensor_f32(&name).unwrap();
        assert_eq!(shape, expected, "{name}");
        assert_eq!(data.len(), expected.iter().product::<usize>(), "{name}");
        assert!(data.iter().all(|x| x.is_finite()), "{name}");
        values += data.len();
    }
    println!(
        "dequantized {} tensors, {values} values ({:.0} MB f32) in {:?}",
        m.expected_tensors().len(),
        values as f64 * 4.0 / 1e6,
        t.elapsed()
    );
    assert_eq!(m.tensor_names().len(), 272);
}
