#!/usr/bin/env bash
# The planner against static configurations on one shifting load (BENCHMARKS.md, "The planner
# on a shifting load"). For each configuration: a fresh `cleave up` on this machine's cores, one
# `cleave bench serve --phases` run (prefill-heavy, decode-heavy, prefill-heavy, then a rate
# step), its attainment timeline, and the planner's decisions (auto runs).
#
#   bench/planner/shift.sh MODEL OUT_DIR [CONFIG ...]
#
# CONFIG is NAME=ARGS for `cleave up`; the default set is the planner in auto mode from 1p1d and
# the static 1p1d and 2 colocated nodes at step budgets 64, 128, 256 and 2048. PHASES, TTFT_MS,
# TPOT_MS and SEED override the load and the targets; PROFILE names a `cleave bench profile` file
# for the planner's cost model. While each run lasts, the planner's view (`GET /admin/planner`:
# its inputs and predictions for the current configuration) is recorded every 2 s to
# NAME.planner.jsonl. Afterwards `cleave bench timeline` compares the runs. Needs
# target/release/cleave, or CLEAVE_EXE naming another build of it (to compare two builds on
# one load: run this once per build into one OUT_DIR, then `cleave bench timeline` over both).
set -euo pipefail
model="${1:?model (HF folder or .gguf)}"
out="${2:?output folder}"
shift 2
exe="${CLEAVE_EXE:-$(cd "$(dirname "$0")/../.." && pwd)/target/release/cleave}"
ttft="${TTFT_MS:-3000}"
tpot="${TPOT_MS:-100}"
seed="${SEED:-0}"
profile_args=()
if [ -n "${PROFILE:-}" ]; then profile_args=(--planner-profile "$PROFILE"); fi
phases="${PHASES:-90:0.4:512:16,90:0.5:32:128,90:0.4:512:16,90:1.0:32:128}"
configs=("$@")
if [ ${#configs[@]} -eq 0 ]; then
  configs=(
    "auto=--prefill 1 --decode 1 --planner auto"
    "1p1d=--prefill 1 --decode 1 --planner off"
    "2c-64=--colocated 2 --planner off --node-arg=--max-num-batched-tokens=64"
    "2c-128=--colocated 2 --planner off --node-arg=--max-num-batched-tokens=128"
    "2c-256=--colocated 2 --planner off --node-arg=--max-num-batched-tokens=256"
    "2c-2048=--colocated 2 --planner off"
  )
fi
mkdir -p "$out"
port=18000
for c in "${configs[@]}"; do
  name="${c%%=*}"
  args="${c#*=}"
  port=$((port + 1))
  token="bench-$name"
  echo "== $name: cleave up $args"
  # shellcheck disable=SC2086
  "$exe" up --model "$model" --port "$port" --admin-token "$token" --ttft-target-ms "$ttft" \
      --tpot-target-ms "$tpot" "${profile_args[@]}" $args >"$out/$name.up.log" 2>&1 &
  up=$!
  for _ in $(seq 1 600); do
    grep -q "cleave is serving" "$out/$name.up.log" && break
    sleep 0.5
  done
  grep -q "cleave is serving" "$out/$name.up.log" || { echo "$name did not start"; kill $up; exit 1; }
  (
    while sleep 2; do
      curl -sf -H "Authorization: Bearer $token" "http://127.0.0.1:$port/admin/planner" || break
      echo
    done
  ) >"$out/$name.planner.jsonl" 2>/dev/null &
  poll=$!
  "$exe" bench serve --base-url "http://127.0.0.1:$port" --model "$model" --dataset-name random \
      --phases "$phases" --seed "$seed" --goodput "ttft:$ttft" "tpot:$tpot" --disable-tqdm \
      --result-file "$out/$name.json" | tee "$out/$name.txt"
  kill $poll 2>/dev/null || true
  CLEAVE_ADMIN_TOKEN="$token" "$exe" admin --url "http://127.0.0.1:$port" decisions >"$out/$name.decisions.json" || true
  CLEAVE_ADMIN_TOKEN="$token" "$exe" admin --url "http://127.0.0.1:$port" nodes >"$out/$name.nodes.json" || true
  kill -TERM $up
  wait $up || true
done
names=()
for c in "${configs[@]}"; do names+=("${c%%=*}=$out/${c%%=*}.json"); done
"$exe" bench timeline "${names[@]}" --goodput "ttft:$ttft" "tpot:$tpot" --plot "$out/attainment" \
    --output "$out/timeline.json" | tee "$out/timeline.txt"
echo "results in $out"
