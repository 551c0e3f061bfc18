#!/usr/bin/env bash
# Simulated against measured (BENCHMARKS.md, "Simulated against measured, with SLO admission"):
# replays measured `bench serve --phases` runs through `cleave bench simulate` on the same
# profile, targets, pacing and SLO admission, and prints each run's phases side by side.
#
#   bench/planner/replay.sh PROFILE RUN=CONFIG [RUN=CONFIG ...]
#
# RUN is a result file of bench/planner/shift.sh; CONFIG is how that run's cluster was set up:
# `auto` (the planner from its default start: 2 colocated nodes at a 128-token budget),
# `auto:BUDGET` (the planner started at that budget: runs before 2026-12-07's start change
# started at 256) or `static:BUDGET` (2 colocated nodes at that budget, no planner). TTFT_MS and TPOT_MS are the
# run's targets (default 3000 and 100); EDGE_MS the edge's latency to add (default 0);
# ADMISSION=0 replays without SLO admission in the simulator (to see what leaving it out of the
# model costs: the measured runs all had it); EXTRA more flags for `cleave bench simulate`. A
# run's NAME.nodes.json, when there, scales the profile to the speed its nodes had
# (--scale-to-nodes). After the runs, the p90 latencies within 20% over all of them. Needs
# target/release/cleave.
set -euo pipefail
profile="${1:?profile (cleave bench profile output)}"
shift
exe="$(cd "$(dirname "$0")/../.." && pwd)/target/release/cleave"
ttft="${TTFT_MS:-3000}"
tpot="${TPOT_MS:-100}"
edge="${EDGE_MS:-0}"
admission=(--slo-admission)
if [ "${ADMISSION:-1}" = 0 ]; then admission=(); fi
within=0
of=0
for spec in "$@"; do
  run="${spec%%=*}"
  config="${spec#*=}"
  case "$config" in
    auto) flags=(--planner auto --max-num-batched-tokens 128) ;;
    auto:*) flags=(--planner auto --max-num-batched-tokens "${config#auto:}") ;;
    static:*) flags=(--planner off --max-num-batched-tokens "${config#static:}") ;;
    *) echo "config $config: expected auto, auto:BUDGET or static:BUDGET" >&2; exit 2 ;;
  esac
  nodes="${run%.json}.nodes.json"
  scale=()
  if [ -f "$nodes" ]; then scale=(--scale-to-nodes "$nodes"); fi
  echo "== $run ($config)"
  # shellcheck disable=SC2086
  table=$("$exe" bench simulate --profile "$profile" --ttft-target-ms "$ttft" --tpot-target-ms "$tpot" \
      --max-nodes 2 --fixed-nodes --initial 2c --pacing "${admission[@]}" --edge-latency-ms "$edge" \
      --no-baseline --report-window-s 80 --replay "$run" "${scale[@]}" "${flags[@]}" ${EXTRA:-} \
    | sed -n '/^speed of/p; /^phase/,/^replayed run: p90/p')
  echo "$table"
  read -r w o < <(echo "$table" | sed -n 's/^replayed run: p90 latencies within 20% of the measured: \([0-9]*\) of \([0-9]*\)$/\1 \2/p')
  within=$((within + ${w:?no p90 count in the replay}))
  of=$((of + o))
done
echo "p90 latencies within 20% of the measured over $# runs: $within of $of"
