#!/usr/bin/env python3
"""Writes cleave.json, the Grafana dashboard of a cleave cluster: one row per pool (prefill,
decode, colocated) with the views of the coordinator's built-in page, plus the handoff and the
planner. Run it after changing a panel; the Prometheus test (tests/prometheus.rs) evaluates
every query in the JSON against a live cluster.

    python3 deploy/grafana/generate.py   # rewrites deploy/grafana/cleave.json
"""
import json
import pathlib

DS = {"type": "prometheus", "uid": "${datasource}"}
panels = []
next_id = 1
y = 0


def row(title):
    global next_id, y
    panels.append({"id": next_id, "type": "row", "title": title, "collapsed": False,
                   "gridPos": {"h": 1, "w": 24, "x": 0, "y": y}, "panels": []})
    next_id += 1
    y += 1


def ts(title, targets, unit="short", x=0, w=8, h=8, thresholds=None):
    """A time series panel; `targets` is [(expr, legend)]."""
    global next_id
    p = {
        "id": next_id,
        "type": "timeseries",
        "title": title,
        "datasource": DS,
        "gridPos": {"h": h, "w": w, "x": x, "y": y},
        "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
        "options": {"legend": {"displayMode": "list", "placement": "bottom", "showLegend": True},
                    "tooltip": {"mode": "multi", "sort": "none"}},
        "targets": [{"datasource": DS, "expr": e, "legendFormat": l, "refId": chr(ord("A") + i)}
                    for i, (e, l) in enumerate(targets)],
    }
    next_id += 1
    panels.append(p)


def line_of_three(items):
    global y
    for i, (title, targets, unit) in enumerate(items):
        ts(title, targets, unit, x=8 * i)
    y += 8


TTFT_TARGET = ('max(cleave_planner_target_seconds{slo="ttft"})', "target")
TPOT_TARGET = ('max(cleave_planner_target_seconds{slo="tpot"})', "target")

row("Overview")
line_of_three([
    ("SLO attainment over the planner's window",
     [("cleave:slo_attainment:window", "{{pool}}"),
      ("cleave_planner_predicted_slo_attainment", "predicted for the running configuration")], "percentunit"),
    ("Requests per second by path", [("sum by (path) (cleave:requests:rate1m)", "{{path}}")], "reqps"),
    ("Nodes per pool (live / planner's target)",
     [("cleave_pool_nodes", "{{pool}}"), ("cleave_planner_desired_nodes", "{{pool}} target")], "short"),
])

for pool in ["prefill", "decode", "colocated"]:
    row(f"{pool.capitalize()} pool")
    sel = f'pool="{pool}"'
    first = []
    if pool in ("prefill", "colocated"):
        first.append(("TTFT p50 / p90 (first tokens from this pool)",
                      [(f"cleave:ttft_seconds:p50_1m{{{sel}}}", "p50"), (f"cleave:ttft_seconds:p90_1m{{{sel}}}", "p90"),
                       TTFT_TARGET], "s"))
    if pool in ("decode", "colocated"):
        first.append(("TPOT p50 / p90",
                      [(f"cleave:tpot_seconds:p50_1m{{{sel}}}", "p50"), (f"cleave:tpot_seconds:p90_1m{{{sel}}}", "p90"),
                       TPOT_TARGET], "s"))
    if pool == "decode":
        first.insert(0, ("TTFT p90 of requests prefilled here (local)",
                         [(f"cleave:ttft_seconds:p90_1m{{{sel}}}", "p90"), TTFT_TARGET], "s"))
    first.append(("Queued prefill tokens", [(f"cleave_pool_queued_prefill_tokens{{{sel}}}", "queued")], "short"))
    line_of_three(first[:3])
    line_of_three([
        ("Running sequences by node", [(f'sum by (node) (cleave_node_running_seqs{{{sel}}})', "{{node}}")], "short"),
        ("KV cache usage", [(f"cleave_pool_kv_usage_ratio{{{sel}}}", "pool"),
                            (f'max by (node) (cleave_node_kv_usage_ratio{{{sel}}})', "{{node}}")], "percentunit"),
        ("Nodes", [(f"cleave_pool_nodes{{{sel}}}", "live"), (f"cleave_planner_desired_nodes{{{sel}}}", "target")],
         "short"),
    ])

row("Handoff")
line_of_three([
    ("KV received per second by decode node", [("cleave:handoff_bytes:rate1m", "{{node}}")], "Bps"),
    ("Transfer tail p90 (first token to KV landed)", [("cleave:handoff_tail_seconds:p90_1m", "p90")], "s"),
    ("Routing: remote and local (and why)", [("cleave:route_decisions:rate1m", "{{path}} {{reason}}")], "reqps"),
])

row("Planner")
line_of_three([
    ("Decisions by reason", [("sum by (reason) (increase(cleave_planner_decisions_total[5m]))", "{{reason}}")],
     "short"),
    ("Saturation line for local prefill (tokens)", [("cleave_planner_saturation_tokens", "tokens")], "short"),
    ("Requests held while nodes switch roles",
     [("sum(increase(cleave_requests_held_for_switch_total[5m]))", "held")], "short"),
])

dashboard = {
    "title": "cleave",
    "uid": "cleave-pools",
    "tags": ["cleave", "llm-serving"],
    "timezone": "browser",
    "schemaVersion": 39,
    "version": 1,
    "editable": True,
    "refresh": "5s",
    "time": {"from": "now-15m", "to": "now"},
    "templating": {"list": [{
        "name": "datasource", "label": "Prometheus", "type": "datasource", "query": "prometheus",
        "current": {}, "hide": 0, "refresh": 1, "options": [],
    }]},
    "annotations": {"list": [{
        "name": "Planner decisions", "datasource": DS, "enable": True, "iconColor": "orange",
        "expr": "changes(cleave_planner_decisions_total[1m]) > 0", "titleFormat": "{{reason}}",
    }]},
    "panels": panels,
}
out = pathlib.Path(__file__).with_name("cleave.json")
out.write_text(json.dumps(dashboard, indent=2) + "\n")
print(f"wrote {out} ({len(panels)} panels)")
