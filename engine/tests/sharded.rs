//! A model split over several safetensors shards (`model.safetensors.index.json`) loads and runs
//! exactly like the same weights in one file.

mod common;

use std::collections::BTreeMap;

use cleave_engine::model::synth::{self, SynthDtype};
use cleave_engine::EngineConfig;
use common::*;
use safetensors::tensor::TensorView;
use safetensors::SafeTensors;

#[test]
fn sharded_model_equals_single_file() {
    let base = std::env::temp_dir().join(format!("cleave-sharded-{}", std::process::id()));
    let (single, sharded) = (base.join("single"), base.join("sharded"));
    let _ = std::fs::remove_dir_all(&base);
    synth::write_model(&synth::preset("tiny").unwrap(), 7, SynthDtype::BF16, &single).unwrap();
    std::fs::create_dir_all(&sharded).unwrap();
    for f in ["config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"] {
        std::fs::copy(single.join(f), sharded.join(f)).unwrap();
    }
    let bytes = std::fs::read(single.join("model.safetensors")).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let mut names: Vec<String> = st.names().into_iter().map(str::to_string).collect();
    names.sort();
    let mut weight_map = BTreeMap::new();
    for (i, part) in names.chunks(names.len().div_ceil(3)).enumerate() {
        let file = format!("model-{:05}-of-00003.safetensors", i + 1);
        let views: Vec<(String, TensorView)> = part.iter().map(|n| (n.clone(), st.tensor(n).unwrap())).collect();
        safetensors::serialize_to_file(views, None, &sharded.join(&file)).unwrap();
        for n in part {
            weight_map.insert(n.clone(), file.clone());
        }
    }
    let index = serde_json::json!({"metadata": {}, "weight_map": weight_map});
    std::fs::write(sharded.join("model.safetensors.index.json"), index.to_string()).unwrap();

    let run = |dir: &std::path::Path| {
        let mut core = engine(dir, EngineConfig { kv_cache_memory: 8 << 20, ..Default::default() });
        core.add_request(greedy_request(1, vec![5, 17, 300, 42, 1000, 7], 24), std::time::Instant::now()).unwrap();
        token_ids(&run_to_end(&mut core)[&1])
    };
    let (a, b) = (run(&single), run(&sharded));
    assert_eq!(a.len(), 24);
    assert_eq!(a, b);
    let _ = std::fs::remove_dir_all(&base);
}
