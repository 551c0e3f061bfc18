#!/usr/bin/env bash
# A lone request, cleave against vLLM's CPU build, same machine, same run (issue 12: "a lone
# request at least as fast as vLLM's CPU build on TTFT and TPOT").
#
#   bench/peers/lone_request.sh VLLM_VENV HF_DIR OUT [PROMPTS]
#
# HF_DIR: SmolLM2-135M-Instruct as a Hugging Face f32 folder (scripts/peers/README.md:
# convert_smollm2_gguf_to_hf.py ... float32); both servers load it. One server at a time, on
# cores 0-1 (the machine's two), each driven by `cleave bench serve` with one request in flight
# (--max-concurrency 1), 256-token random prompts, 64 output tokens, EOS ignored; the servers in
# turn: vLLM, cleave up (its default on two cores: 1 prefill + 1 decode node, pinned), cleave up
# --colocated 1 (one node, two threads). Prints each one's TTFT and TPOT (median, p90) and writes
# the bench results and server logs under OUT.
set -euo pipefail
venv=${1:?usage: lone_request.sh VLLM_VENV HF_DIR OUT [PROMPTS]}
hf=${2:?HF_DIR}
out=${3:?OUT}
prompts=${4:-12}
root=$(cd "$(dirname "$0")/../.." && pwd)
cleave=${CLEAVE_BIN:-$root/target/release/cleave}
mkdir -p "$out"
port=8093

wait_ready() { # URL SECONDS
  local t=0
  until curl -sf "$1" >/dev/null 2>&1; do
    sleep 1; t=$((t + 1))
    if [ "$t" -ge "$2" ]; then echo "not ready after $2 s: $1" >&2; return 1; fi
  done
}

bench() { # NAME BASE_URL MODEL_NAME [API_KEY]
  local key=()
  [ -n "${4:-}" ] && key=(--api-key "$4")
  # One warm-up request, then the measured ones.
  "$cleave" bench serve --base-url "$2" --served-model-name "$3" --tokenizer "$hf" "${key[@]}" \
    --dataset-name random --random-input-len 256 --random-output-len 64 --random-range-ratio 0 \
    --num-prompts 1 --max-concurrency 1 --seed 7 --disable-tqdm --result-file "$out/$1-warmup.json" >/dev/null
  "$cleave" bench serve --base-url "$2" --served-model-name "$3" --tokenizer "$hf" "${key[@]}" \
    --dataset-name random --random-input-len 256 --random-output-len 64 --random-range-ratio 0 \
    --num-prompts "$prompts" --max-concurrency 1 --seed 1 --disable-tqdm --result-file "$out/$1.json" \
    > "$out/$1.txt"
}

# vLLM (float32, as the f32 folder; its CPU KV cache 1 GiB).
HF_HUB_OFFLINE=1 VLLM_TARGET_DEVICE=cpu VLLM_CPU_KVCACHE_SPACE=1 VLLM_CPU_OMP_THREADS_BIND=0-1 \
  taskset -c 0-1 "$venv/bin/vllm" serve "$hf" --served-model-name smollm2 --host 127.0.0.1 --port $port \
  --dtype float32 --max-model-len 2048 > "$out/vllm.log" 2>&1 &
vpid=$!
trap 'kill $vpid 2>/dev/null || true' EXIT
wait_ready "http://127.0.0.1:$port/v1/models" 400
bench vllm "http://127.0.0.1:$port" smollm2
kill $vpid; wait $vpid 2>/dev/null || true
trap - EXIT

run_cleave() { # NAME ARGS...
  local name=$1; shift
  "$cleave" up --model "$hf" --port $port --api-key lone "$@" > "$out/$name.log" 2>&1 &
  local upid=$!
  trap "kill $upid 2>/dev/null || true" EXIT
  wait_ready "http://127.0.0.1:$port/health" 300
  local model t=0
  model=$(curl -sf -H "Authorization: Bearer lone" "http://127.0.0.1:$port/v1/models" |
    python3 -c 'import json, sys; print(json.load(sys.stdin)["data"][0]["id"])')
  # /health answers before the nodes have registered: wait for a completion to go through.
  until curl -sf -H "Authorization: Bearer lone" -H "Content-Type: application/json" \
      -d "{\"model\": \"$model\", \"prompt\": \"Hi\", \"max_tokens\": 1}" \
      "http://127.0.0.1:$port/v1/completions" >/dev/null 2>&1; do
    sleep 1; t=$((t + 1))
    if [ "$t" -ge 300 ]; then echo "$name: no completion after 300 s" >&2; return 1; fi
  done
  bench "$name" "http://127.0.0.1:$port" "$model" lone
  kill $upid; wait $upid 2>/dev/null || true
  trap - EXIT
  sleep 2
}
run_cleave cleave-1p1d
run_cleave cleave-colocated --colocated 1

python3 - "$out" <<'PY'
import json, sys, os
out = sys.argv[1]
print(f"{'server':<18}{'TTFT p50 (ms)':>15}{'TTFT p90':>10}{'TPOT p50 (ms)':>15}{'TPOT p90':>10}")
for name in ["vllm", "cleave-1p1d", "cleave-colocated"]:
    r = json.load(open(os.path.join(out, name + ".json")))
    print(f"{name:<18}{r['median_ttft_ms']:>15.1f}{r['p90_ttft_ms']:>10.1f}{r['median_tpot_ms']:>15.1f}{r['p90_tpot_ms']:>10.1f}")
PY
