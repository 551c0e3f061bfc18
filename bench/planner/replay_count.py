#!/usr/bin/env python3
"""Reads bench/planner/replay.sh's output on stdin and prints, per replayed run, measured and
simulated attainment and how many of its p90 latencies (TTFT and TPOT per phase) the simulator
got within 20% of the measured figure; then the totals. BENCHMARKS.md, "Simulated against
measured, with SLO admission"."""
import re
import sys

runs = []
for line in sys.stdin:
    if line.startswith("== "):
        runs.append({"name": line[3:].strip(), "within": 0, "pairs": 0, "att": None})
        continue
    m = re.match(r"\s*\d+\s+\d+\s+\|[^|]+\|[^|]+\|\s*(\d+)\s*/\s*(\d+)\s*\|\s*(\d+)\s*/\s*(\d+)\s*\|", line)
    if m and runs:
        v = list(map(int, m.groups()))
        for meas, sim in ((v[0], v[1]), (v[2], v[3])):
            runs[-1]["pairs"] += 1
            if meas > 0 and abs(sim - meas) <= 0.2 * meas:
                runs[-1]["within"] += 1
        continue
    m = re.match(r"replayed run: attainment measured ([\d.]+), simulated ([\d.]+)", line)
    if m and runs:
        runs[-1]["att"] = (float(m.group(1)), float(m.group(2)))
tw = tp = 0
for r in runs:
    att = r["att"] or (float("nan"), float("nan"))
    print(f"{r['name']:<80} attainment {100*att[0]:5.1f} / {100*att[1]:5.1f}%  p90s within 20%: {r['within']}/{r['pairs']}")
    tw += r["within"]
    tp += r["pairs"]
print(f"p90s within 20% over {len(runs)} runs: {tw} of {tp}")
