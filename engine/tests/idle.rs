//! `EngineCore::on_idle`: an engine that has been idle gives back an activation workspace grown
//! by a long prompt (it keeps the largest step's size otherwise, tens of MB for a real model),
//! keeps a small one, and answers exactly as before afterwards.

mod common;

use cleave_engine::runner::IDLE_KEEP_ROWS;
use cleave_engine::EngineConfig;
use common::*;

#[test]
fn an_idle_engine_gives_back_a_long_prompts_workspace_and_answers_the_same_after() {
    let cfg = EngineConfig { enable_prefix_caching: false, ..EngineConfig::default() };
    let mut core = engine(&tiny_llama_dir(), cfg);
    assert_eq!(core.workspace_rows(), 0);
    let long: Vec<u32> = (0..300u32).map(|i| 3 + (i * 7919) % 31_000).collect();
    core.add_request(greedy_request(1, long.clone(), 4), std::time::Instant::now()).unwrap();
    let first = token_ids(&run_to_end(&mut core)[&1]);
    assert!(core.workspace_rows() >= long.len(), "a one-step prefill sizes it: {}", core.workspace_rows());
    core.on_idle();
    assert_eq!(core.workspace_rows(), 0);
    core.add_request(greedy_request(2, long, 4), std::time::Instant::now()).unwrap();
    assert_eq!(token_ids(&run_to_end(&mut core)[&2]), first);

    // A short prompt's workspace stays through an idle spell.
    let mut core = engine(&tiny_llama_dir(), EngineConfig::default());
    core.add_request(greedy_request(3, vec![1, 450, 7483, 310], 2), std::time::Instant::now()).unwrap();
    run_to_end(&mut core);
    let rows = core.workspace_rows();
    assert!(rows > 0 && rows <= IDLE_KEEP_ROWS, "{rows}");
    core.on_idle();
    assert_eq!(core.workspace_rows(), rows);
}
