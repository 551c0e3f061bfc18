//! The engine on the CUDA backend (feature `cuda`; needs a GPU, else each test says so and
//! passes, unless CLEAVE_REQUIRE_GPU is set): the tiny model's Hugging Face golden outputs on the
//! GPU, and KV handed off between a GPU engine and a CPU engine in both directions, its greedy
//! output equal to one engine's.
#![cfg(feature = "cuda")]

mod common;

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use cleave_engine::model::{Model, ModelFiles};
use cleave_engine::{EngineConfig, EngineCore, ImportStart, KvExport, KvExportEvent};
use cleave_kernels::cuda::{CudaBackend, GemmDtype};
use cleave_kernels::{Backend, CpuBackend};
use cleave_protocol::KvDtype;
use common::*;

fn gpu(gemm: GemmDtype) -> Option<CudaBackend> {
    match CudaBackend::new(0, gemm) {
        Ok(b) => Some(b),
        Err(e) if std::env::var_os("CLEAVE_REQUIRE_GPU").is_some() => panic!("CLEAVE_REQUIRE_GPU: {e}"),
        Err(e) => {
            eprintln!("skipped: no usable GPU ({e})");
            None
        }
    }
}

#[test]
fn gpu_last_logits_match_transformers() {
    for (gemm, rel) in [(GemmDtype::F32, 1e-4f32), (GemmDtype::Bf16, 3e-2)] {
        let Some(backend) = gpu(gemm) else { return };
        let files = ModelFiles::open(&tiny_llama_dir()).unwrap();
        let model = Model::load(&backend, files.config.clone(), files.source.as_ref()).unwrap();
        let mut worst = 0f32;
        for case in golden()["cases"].as_array().unwrap() {
            let logits = last_logits(&model, &backend, &ids(&case["prompt_ids"]));
            let top = &case["last_logits_top5"];
            let want_ids = ids(&top["ids"]);
            let best = (0..logits.len()).max_by(|&a, &b| logits[a].total_cmp(&logits[b])).unwrap() as u32;
            assert_eq!(best, want_ids[0], "{gemm:?} case {}: top-1 id", case["name"]);
            for (id, want) in want_ids.iter().zip(top["values"].as_array().unwrap()) {
                let (got, want) = (logits[*id as usize], want.as_f64().unwrap() as f32);
                let err = ((got - want) / want).abs();
                worst = worst.max(err);
                assert!(err < rel, "{gemm:?} case {}: logit of {id}: {got} vs {want}", case["name"]);
            }
        }
        println!("GOLDEN-LOGITS gemm={gemm:?} worst_rel_err={worst:.2e}");
    }
}

fn gpu_engine(gemm: GemmDtype, kv_dtype: KvDtype) -> Option<EngineCore<CudaBackend>> {
    let backend = gpu(gemm)?;
    let files = ModelFiles::open(&tiny_llama_dir()).unwrap();
    let cfg = EngineConfig { kv_cache_memory: 64 << 20, kv_dtype, ..Default::default() };
    Some(EngineCore::load(backend, files, &cfg).unwrap())
}

fn run<B: Backend>(core: &mut EngineCore<B>) -> BTreeMap<u64, Vec<cleave_protocol::TokenEvent>> {
    let mut out: BTreeMap<u64, Vec<_>> = BTreeMap::new();
    let mut steps = 0;
    while core.has_work() {
        for ev in core.step(Instant::now()).unwrap() {
            out.entry(ev.request_id.0).or_default().push(ev);
        }
        steps += 1;
        assert!(steps < 100_000, "engine does not finish");
    }
    out
}

#[test]
fn gpu_greedy_continuations_and_text_match_transformers() {
    let Some(mut core) = gpu_engine(GemmDtype::F32, KvDtype::F32) else { return };
    let cases = golden()["cases"].as_array().unwrap().clone();
    for (i, case) in cases.iter().enumerate() {
        core.add_request(greedy_request(i as u64, ids(&case["prompt_ids"]), 32), Instant::now()).unwrap();
    }
    let out = run(&mut core);
    for (i, case) in cases.iter().enumerate() {
        let events = &out[&(i as u64)];
        assert_eq!(token_ids(events), ids(&case["generated_ids"]), "case {}", case["name"]);
        assert_eq!(text(events), case["text_incremental"].as_str().unwrap(), "case {}", case["name"]);
    }
    assert_eq!(core.scheduler().kv().num_in_use(), 0, "blocks leaked");
    println!("GOLDEN-GREEDY gemm=F32 cases={} identical", cases.len());
}

/// With 16-bit weights (bf16 GEMM) greedy tokens may part from the f32 ones where two logits
/// are closer than bf16's rounding; a bf16 KV cache rounds exactly as the CPU's does, so the GPU
/// and CPU agree token for token given the same weights precision.
#[test]
fn gpu_bf16_runs_agree_with_the_cpu_on_what_they_share() {
    let cases = golden()["cases"].as_array().unwrap().clone();
    let prompts: Vec<Vec<u32>> = cases.iter().map(|c| ids(&c["prompt_ids"])).collect();
    let greedy = |out: &BTreeMap<u64, Vec<cleave_protocol::TokenEvent>>| -> Vec<Vec<u32>> {
        (0..prompts.len() as u64).map(|i| token_ids(&out[&i])).collect()
    };
    // bf16 KV, f32 weights: identical to the CPU with a bf16 KV cache.
    let Some(mut g) = gpu_engine(GemmDtype::F32, KvDtype::Bf16) else { return };
    let files = ModelFiles::open(&tiny_llama_dir()).unwrap();
    let cfg = EngineConfig { kv_cache_memory: 64 << 20, kv_dtype: KvDtype::Bf16, ..Default::default() };
    let mut c = EngineCore::load(CpuBackend::default(), files, &cfg).unwrap();
    for (i, p) in prompts.iter().enumerate() {
        g.add_request(greedy_request(i as u64, p.clone(), 32), Instant::now()).unwrap();
        c.add_request(greedy_request(i as u64, p.clone(), 32), Instant::now()).unwrap();
    }
    assert_eq!(greedy(&run(&mut g)), greedy(&run(&mut c)), "bf16 KV: GPU vs CPU");
    // bf16 weights: count the tokens that agree with the f32 golden continuations.
    let Some(mut g) = gpu_engine(GemmDtype::Bf16, KvDtype::F32) else { return };
    for (i, p) in prompts.iter().enumerate() {
        g.add_request(greedy_request(i as u64, p.clone(), 32), Instant::now()).unwrap();
    }
    let got = greedy(&run(&mut g));
    let (mut same, mut total) = (0, 0);
    for (g, case) in got.iter().zip(&cases) {
        let want = ids(&case["generated_ids"]);
        assert_eq!(g[0], want[0], "bf16 weights: first token of case {}", case["name"]);
        // Tokens up to the first disagreement (after it the contexts differ).
        same += g.iter().zip(&want).take_while(|(a, b)| a == b).count();
        total += want.len();
    }
    println!("GOLDEN-GREEDY gemm=Bf16 tokens agreeing before the first divergence: {same}/{total}");
}

/// Prefill on `a`, K/V exported layer by layer as bytes and imported into `b`, decode on `b`.
fn handoff<A: Backend, B: Backend>(a: &mut EngineCore<A>, b: &mut EngineCore<B>) -> Vec<Vec<u32>> {
    let cases = golden()["cases"].as_array().unwrap().clone();
    let log = Arc::new(Mutex::new(Vec::new()));
    let now = Instant::now();
    let reqs: Vec<_> =
        cases.iter().enumerate().map(|(i, c)| greedy_request(i as u64, ids(&c["prompt_ids"]), 32)).collect();
    for r in &reqs {
        let sink = log.clone();
        a.add_prefill_only(
            r.clone(),
            KvExport::new(move |ev| {
                sink.lock().unwrap().push(ev);
                Ok(())
            }),
            now,
        )
        .unwrap();
        b.reserve_import_prompt(r.id, &r.prompt).unwrap();
    }
    let mut out: BTreeMap<u64, Vec<u32>> = BTreeMap::new();
    let mut steps = 0;
    while a.has_work() || b.has_work() || !log.lock().unwrap().is_empty() {
        if a.has_work() {
            for ev in a.step(now).unwrap() {
                out.entry(ev.request_id.0).or_default().extend(ev.token_id);
            }
        }
        for ev in log.lock().unwrap().drain(..) {
            match ev {
                KvExportEvent::Chunk(c) => b.import_kv(c.request_id, c.layer, c.token_start, &c.k, &c.v).unwrap(),
                KvExportEvent::Done(d) => {
                    let start = ImportStart {
                        first_token: d.first_token,
                        sampler_seed: Some(d.sampler_seed),
                        cached_tokens: d.cached_tokens,
                    };
                    b.add_imported(reqs[d.request_id.0 as usize].clone(), start, now).unwrap();
                }
            }
        }
        if b.has_work() {
            for ev in b.step(now).unwrap() {
                out.entry(ev.request_id.0).or_default().extend(ev.token_id);
            }
        }
        steps += 1;
        assert!(steps < 10_000, "handoff does not finish");
    }
    for core_snap in [a.snapshot(), b.snapshot()] {
        assert_eq!((core_snap.kv_blocks_in_use, core_snap.kv_blocks_reserved), (0, 0), "{core_snap:?}");
    }
    out.into_values().collect()
}

#[test]
fn kv_handed_off_from_and_to_gpu_memory_continues_exactly() {
    let want: Vec<Vec<u32>> = golden()["cases"].as_array().unwrap().iter().map(|c| ids(&c["generated_ids"])).collect();
    let cpu = || {
        let files = ModelFiles::open(&tiny_llama_dir()).unwrap();
        let cfg = EngineConfig { kv_cache_memory: 64 << 20, ..Default::default() };
        EngineCore::load(CpuBackend::default(), files, &cfg).unwrap()
    };
    let Some(mut g) = gpu_engine(GemmDtype::F32, KvDtype::F32) else { return };
    let mut c = cpu();
    assert_eq!(handoff(&mut g, &mut c), want, "GPU prefill -> CPU decode");
    assert_eq!(handoff(&mut c, &mut g), want, "CPU prefill -> GPU decode");
    let Some(mut g2) = gpu_engine(GemmDtype::F32, KvDtype::F32) else { return };
    assert_eq!(handoff(&mut g, &mut g2), want, "GPU prefill -> GPU decode");
    println!("HANDOFF gpu->cpu cpu->gpu gpu->gpu identical to golden");
}
