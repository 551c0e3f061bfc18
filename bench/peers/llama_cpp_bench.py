#!/usr/bin/env python3
"""llama.cpp's prefill and decode throughput on one GGUF file, measured the way `cleave bench
engine` measures cleave: random prompt ids, greedy-free (no sampling, logits only), the clock
around the forward passes.

Uses llama.cpp's C API through `llama-cpp-python` (PyPI; scripts/peers/llama-cpp.sh builds
it from source, so ggml is compiled for this CPU). The pip package ships no `llama-bench`, so
this script plays its role:
- prefill N: one `llama_decode` of an N-token batch into an empty KV cache (best of `--reps`);
- decode batch B: B sequences, each with a `--decode-context`-token prompt, then `--decode-steps`
  steps of one token per sequence in one `llama_decode` (tokens/s = B * steps / seconds).

    python llama_cpp_bench.py --model FILE.gguf [--threads 2] [--prefill 128,512] [--decode 1,8,32]
"""
import argparse
import random
import time

import llama_cpp as L


def fill(batch, toks, poss, seqs, want_logits):
    batch.n_tokens = len(toks)
    for i, (t, p, s, lg) in enumerate(zip(toks, poss, seqs, want_logits)):
        batch.token[i] = t
        batch.pos[i] = p
        batch.n_seq_id[i] = 1
        batch.seq_id[i][0] = s
        batch.logits[i] = 1 if lg else 0


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prefill", default="128,512")
    ap.add_argument("--decode", default="1,8,32")
    ap.add_argument("--decode-context", type=int, default=128)
    ap.add_argument("--decode-steps", type=int, default=32)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--no-extra-bufts", action="store_true", help="no AMX / repacked weights")
    args = ap.parse_args()
    prefill = [int(x) for x in args.prefill.split(",") if x]
    decode = [int(x) for x in args.decode.split(",") if x]
    max_b = max(decode + [1])
    n_ctx = max(max(prefill + [0]) + 16, max_b * (args.decode_context + args.decode_steps + 8))

    L.llama_backend_init()
    mp = L.llama_model_default_params()
    # The native build compiles ggml's AMX kernels (the CPU reports amx_tile), but this VM faults on
    # `tileloadd`; extra buffer types (AMX, weight repacking) are therefore off.
    mp.use_extra_bufts = not args.no_extra_bufts
    model = L.llama_model_load_from_file(args.model.encode(), mp)
    vocab = L.llama_n_vocab(L.llama_model_get_vocab(model))
    cp = L.llama_context_default_params()
    cp.n_ctx = n_ctx
    cp.n_batch = max(prefill + [max_b])
    cp.n_ubatch = cp.n_batch
    cp.n_seq_max = max_b
    cp.kv_unified = True  # one KV pool shared by all sequences (else each gets n_ctx / n_seq_max)
    cp.n_threads = args.threads
    cp.n_threads_batch = args.threads
    ctx = L.llama_init_from_model(model, cp)
    mem = L.llama_get_memory(ctx)
    batch = L.llama_batch_init(cp.n_batch, 0, max_b)
    rng = random.Random(0)
    ids = lambda n: [rng.randrange(256, vocab) for _ in range(n)]

    print(f"model: {args.model} (vocab {vocab}), threads {args.threads}, n_ctx {n_ctx}")
    print(f"{'phase':<22} {'tokens/s':>12}")
    for n in prefill:
        best = float("inf")
        for _ in range(args.reps + 1):  # the first run warms up
            L.llama_memory_clear(mem, True)
            fill(batch, ids(n), range(n), [0] * n, [False] * (n - 1) + [True])
            t = time.perf_counter()
            assert L.llama_decode(ctx, batch) == 0
            L.llama_synchronize(ctx)
            best = min(best, time.perf_counter() - t)
        print(f"{'prefill ' + str(n):<22} {n / best:>12.1f}")
    base = None
    for b in decode:
        L.llama_memory_clear(mem, True)
        c = args.decode_context
        for s in range(b):  # prompts, one sequence at a time (untimed)
            fill(batch, ids(c), range(c), [s] * c, [False] * (c - 1) + [True])
            assert L.llama_decode(ctx, batch) == 0
        pos = c
        step = lambda: (fill(batch, ids(b), [pos] * b, range(b), [True] * b), L.llama_decode(ctx, batch))
        assert step()[1] == 0  # one untimed decode step
        pos += 1
        t = time.perf_counter()
        for _ in range(args.decode_steps):
            assert step()[1] == 0
            pos += 1
        L.llama_synchronize(ctx)
        rate = b * args.decode_steps / (time.perf_counter() - t)
        base = base or rate
        print(f"{'decode batch ' + str(b):<22} {rate:>12.1f}  ({rate / base:.1f}x batch 1)")
    L.llama_batch_free(batch)
    L.llama_free(ctx)
    L.llama_model_free(model)


if __name__ == "__main__":
    main()
