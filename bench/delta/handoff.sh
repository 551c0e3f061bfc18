#!/usr/bin/env bash
# Delta handoffs against full ones (BENCHMARKS.md, "Handoffs that send only what the decode node
# lacks"): one coordinator, one prefill node pinned to core 0 and one decode node pinned to core
# 1, every prompt prefilled remotely; `cleave bench serve` sends prompts that share a
# PREFIX-token prefix (--random-prefix-len) before INPUT random tokens. Configurations:
#   delta  the decode node keeps its prefix cache: it reserves a prompt with the blocks it holds
#          and the prefill node sends only the rest;
#   full   the decode node runs --no-prefix-caching: every handoff moves the whole prompt (what
#          every handoff did before delta handoffs; the prefill node keeps its cache either way).
# Prints TTFT and TPOT (bench serve) and the handoff bytes per request (coordinator metrics).
#
#   bench/delta/handoff.sh MODEL OUT_DIR [CONFIG ...]     (CONFIG: delta | full; default both)
#
# PREFIX (1024), INPUT (128), OUTPUT (16), RATE (0.5), PROMPTS (40) and SEED (0) override.
set -euo pipefail
model="${1:?model}"
out="${2:?output folder}"
shift 2
configs=("$@")
[ ${#configs[@]} -eq 0 ] && configs=(delta full)
exe="$(cd "$(dirname "$0")/../.." && pwd)/target/release/cleave"
prefix="${PREFIX:-1024}" input="${INPUT:-128}" output="${OUTPUT:-16}" rate="${RATE:-0.5}"
prompts="${PROMPTS:-40}" seed="${SEED:-0}"
mkdir -p "$out"
certs="$(mktemp -d)"
"$exe" certs --dir "$certs" --nodes coordinator --roles coordinator >/dev/null
"$exe" certs --dir "$certs" --nodes prefill,decode --roles node >/dev/null
trap 'kill $(jobs -p) 2>/dev/null; rm -rf "$certs"' EXIT
ready() { for _ in $(seq 1 600); do grep -qs "^READY" "$1" && return 0; sleep 0.2; done; echo "no READY in $1"; exit 1; }
field() { grep "^READY" "$1" | tr ' ' '\n' | sed -n "s/^$2=//p"; }
for c in "${configs[@]}"; do
  case "$c" in
    delta) extra=() ;;
    full) extra=(--no-prefix-caching) ;;
    *) echo "unknown config $c"; exit 1 ;;
  esac
  echo "== $c"
  "$exe" coordinator --model "$model" --listen 127.0.0.1:0 --cluster-listen 127.0.0.1:0 --name coordinator \
      --certs "$certs" --local-prefill-max-tokens 0 >"$out/$c.coordinator.log" 2>&1 &
  ready "$out/$c.coordinator.log"
  http="$(field "$out/$c.coordinator.log" http)" cluster="$(field "$out/$c.coordinator.log" cluster)"
  taskset -c 0 "$exe" node --role prefill --name prefill --model "$model" --coordinator "$cluster" \
      --certs "$certs" --threads 1 >"$out/$c.prefill.log" 2>&1 &
  taskset -c 1 "$exe" node --role decode --name decode --model "$model" --coordinator "$cluster" \
      --certs "$certs" --threads 1 "${extra[@]}" >"$out/$c.decode.log" 2>&1 &
  ready "$out/$c.prefill.log"
  ready "$out/$c.decode.log"
  sleep 2
  "$exe" bench serve --base-url "http://$http" --model "$model" --dataset-name random \
      --random-prefix-len "$prefix" --random-input-len "$input" --random-output-len "$output" \
      --request-rate "$rate" --num-prompts "$prompts" --seed "$seed" \
      --save-result --result-file "$out/$c.json" >"$out/$c.txt" 2>&1
  curl -s "http://$http/metrics" >"$out/$c.metrics"
  sum=$(awk '/^cleave_handoff_transfer_bytes_sum/ {s += $2} END {print s + 0}' "$out/$c.metrics")
  count=$(awk '/^cleave_handoff_transfer_bytes_count/ {s += $2} END {print s + 0}' "$out/$c.metrics")
  grep -E "Mean TTFT|Median TTFT|P90 TTFT|P99 TTFT|Median TPOT|P90 TPOT|Successful" "$out/$c.txt" | sed "s/^/$c: /"
  awk -v s="$sum" -v n="$count" -v c="$c" 'BEGIN { printf "%s: handoffs %d, bytes per handoff %.0f\n", c, n, s / (n ? n : 1) }'
  kill $(jobs -p) 2>/dev/null || true
  wait 2>/dev/null || true
done
