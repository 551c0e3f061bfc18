#!/usr/bin/env python3
"""Paired comparison of planner runs against a static configuration (BENCHMARKS.md, "The planner
on a shifting load"): reads the `cleave bench serve` result files that bench/planner/shift.sh
wrote, pairs each planner run NAME-x with the static run STATIC-x of the same letter (run next to
it, so both saw the same state of a noisy machine), and prints attainment, goodput, the
differences with their mean and spread, the recovery times and the role changes.

    bench/planner/pairs.py DIR auto 2c-2048 [DIR auto 2c-128 ...]
"""
import json
import math
import pathlib
import sys


def load(path):
    return json.loads(pathlib.Path(path).read_text())


def role_changes(decisions_path):
    p = pathlib.Path(decisions_path)
    if not p.exists():
        return None
    d = load(p)
    ds = d if isinstance(d, list) else d.get("decisions", [])
    return sum(1 for x in ds if x.get("applied") for a in x.get("actions", []) if a.get("kind") == "switch_role")


def goodput(r):
    """Requests that met both SLOs per second of the load's schedule (the same denominator for
    every run of the same phases, as `cleave bench timeline` counts it)."""
    span = sum(p["duration_s"] for p in r["phases"]) if r.get("phases") else r["duration"]
    return r["slo_attainment"] * r["num_prompts"] / span


def recoveries(r):
    out = []
    for x in r["timeline"]["recoveries"]:
        v = x["recovered_after_s"]
        out.append("never" if v is None else f"{v:.0f}")
    return "/".join(out)


def summary(xs):
    n = len(xs)
    mean = sum(xs) / n
    sd = math.sqrt(sum((x - mean) ** 2 for x in xs) / (n - 1)) if n > 1 else float("nan")
    return mean, sd


def main(args):
    if len(args) % 3 != 0 or not args:
        sys.exit(__doc__)
    for i in range(0, len(args), 3):
        d, plan, static = pathlib.Path(args[i]), args[i + 1], args[i + 2]
        print(f"== {d}: {plan}-x against {static}-x")
        print(f"{'pair':>4} {'planner att':>11} {'static att':>10} {'diff':>7} {'planner gp':>10} {'static gp':>9}"
              f" {'planner recovery s':>19} {'static recovery s':>18} {'role chg':>8}")
        diffs, gdiffs = [], []
        for f in sorted(d.glob(f"{plan}-*.json")):
            if f.name.endswith((".decisions.json", ".nodes.json")):
                continue
            tag = f.stem[len(plan) + 1:]
            s = d / f"{static}-{tag}.json"
            if not s.exists():
                continue
            a, b = load(f), load(s)
            diff = 100 * (a["slo_attainment"] - b["slo_attainment"])
            diffs.append(diff)
            gdiffs.append(goodput(a) - goodput(b))
            rc = role_changes(d / f"{plan}-{tag}.decisions.json")
            print(f"{tag:>4} {100 * a['slo_attainment']:>10.1f}% {100 * b['slo_attainment']:>9.1f}% {diff:>+6.1f}"
                  f" {goodput(a):>10.3f} {goodput(b):>9.3f} {recoveries(a):>19} {recoveries(b):>18}"
                  f" {rc if rc is not None else '-':>8}")
        if diffs:
            m, sd = summary(diffs)
            gm, gsd = summary(gdiffs)
            print(f"mean difference over {len(diffs)} pairs: attainment {m:+.1f} points (sd {sd:.1f}),"
                  f" goodput {gm:+.3f} req/s (sd {gsd:.3f})")


if __name__ == "__main__":
    main(sys.argv[1:])
