#!/usr/bin/env bash
# The measured case for disaggregation on this machine (BENCHMARKS.md, "Disaggregated against
# colocated"): 1 prefill + 1 decode node against 2 colocated nodes, each node pinned to its own
# core, same model and workload, swept over request rate. Run on an otherwise idle machine.
#
#   bench/scripts/disagg_vs_colocated.sh [MODEL] [OUT]
#
# Steps: (1) profile the engine with one thread (the cost model of `bench simulate`), (2) predict
# both configurations with the simulator, (3) measure them with `bench sweep`.
set -euo pipefail
cd "$(dirname "$0")/../.."
MODEL="${1:-models/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf}"
OUT="${2:-bench/results/disagg-vs-colocated}"
BIN=./target/release/cleave
IN=${IN:-384}
OUTLEN=${OUTLEN:-32}
SLO_TTFT=${SLO_TTFT:-5000}
SLO_TPOT=${SLO_TPOT:-70}
RATES=${RATES:-0.15,0.2,0.3,0.4,0.5}
N=${N:-40}
mkdir -p "$OUT"

if [ ! -f "$OUT/profile.json" ]; then
  taskset -c 0 "$BIN" bench profile --model "$MODEL" --threads 1 --output "$OUT/profile.json"
fi
"$BIN" bench simulate --profile "$OUT/profile.json" --config 1p1d,2c --search \
  --input-len "$IN" --output-len "$OUTLEN" --goodput "ttft:$SLO_TTFT" "tpot:$SLO_TPOT" \
  --output "$OUT/simulated.json" | tee "$OUT/simulated.txt"
"$BIN" bench sweep --model "$MODEL" \
  --config "1p1d=--prefill 1 --decode 1 --pin" --config "2c=--colocated 2 --pin" --baseline 2c \
  --request-rates "$RATES" --num-prompts "$N" --seed 0 \
  --dataset-name random --random-input-len "$IN" --random-output-len "$OUTLEN" \
  --goodput "ttft:$SLO_TTFT" "tpot:$SLO_TPOT" --disable-tqdm --output-dir "$OUT" | tee "$OUT/sweep.txt"
# Predicted against measured: every measured point replayed through the simulator.
"$BIN" bench simulate --profile "$OUT/profile.json" --compare-sweep "$OUT" \
  --goodput "ttft:$SLO_TTFT" "tpot:$SLO_TPOT" --output "$OUT/predicted-vs-measured.json" | tee "$OUT/predicted-vs-measured.txt"
# Where colocated wins: the same runs judged by TPOT SLOs loose enough to absorb prefill stalls.
for t in 100 150; do
  "$BIN" bench sweep --reanalyze "$OUT" --goodput "ttft:$SLO_TTFT" "tpot:$t" \
    --output-dir "$OUT/tpot$t" > "$OUT/tpot$t.txt"
done
