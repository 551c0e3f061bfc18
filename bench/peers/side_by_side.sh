#!/bin/bash
# Runs `cleave bench engine` and llama.cpp (bench/peers/llama_cpp_bench.py) on the same GGUF
# files, back to back, both with 2 threads (llama.cpp also with 1), so their ratio comes from one
# window of machine load (ROUNDS="1 2" repeats the whole sequence). Output: one log per run under OUT.
#
#   bench/peers/side_by_side.sh VENV OUT MODEL.gguf [MODEL.gguf ...]
#
# VENV: llama-cpp-python built by scripts/peers/llama-cpp.sh. Build cleave first
# (`cargo build --release`).
set -euo pipefail
venv=${1:?usage: side_by_side.sh VENV OUT MODEL...}
out=${2:?}
shift 2
here=$(cd "$(dirname "$0")" && pwd)
cleave=$here/../../target/release/cleave
mkdir -p "$out"
for round in ${ROUNDS:-1}; do
  for model in "$@"; do
    name=$(basename "$model" .gguf)
    "$cleave" bench engine --model "$model" --threads 2 --prefill 128,512 --decode 1,8,32 \
      >"$out/$name.cleave.$round.txt" 2>/dev/null
    # llama.cpp at 2 threads (the comparison asked for) and at 1: its spin-barrier thread pool
    # collapses when another process holds one of the two cores, and the 1-thread run shows it.
    for t in 2 1; do
      "$venv/bin/python" "$here/llama_cpp_bench.py" --model "$model" --threads $t --no-extra-bufts \
        --prefill 128,512 --decode 1,8,32 >"$out/$name.llamacpp-t$t.$round.txt" 2>/dev/null || true
    done
    echo "== $name round $round"; cat "$out/$name".*."$round".txt
  done
done
