"""What disaggregation costs at zero load: TTFT and TPOT of one streamed request on an idle
`cleave up` (whatever shape it runs), with the coordinator's handoff telemetry broken down.

usage: idle_handoff.py URL MODEL PROMPT_WORDS MAX_TOKENS RUNS

Prints one line per run and the medians. Standard library only.
"""
import json
import statistics
import sys
import time
import urllib.request

url, model, words, max_tokens, runs = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])


def one(i):
    # A distinct first word per run defeats the prefix cache (every run prefills in full).
    prompt = f"run{i} " + " ".join(f"w{j % 97}" for j in range(words))
    body = json.dumps({"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                       "ignore_eos": True, "stream": True,
                       "stream_options": {"include_usage": True}}).encode()
    req = urllib.request.Request(url + "/v1/completions", body, {"content-type": "application/json"})
    t0 = time.perf_counter()
    times, usage = [], None
    with urllib.request.urlopen(req) as r:
        for raw in r:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            ev = json.loads(line[6:])
            if ev.get("choices") and ev["choices"][0].get("text"):
                times.append(time.perf_counter() - t0)
            if ev.get("usage"):
                usage = ev["usage"]
    ttft = times[0]
    tpot = (times[-1] - times[0]) / max(1, len(times) - 1)
    return ttft, tpot, usage["prompt_tokens"], usage["completion_tokens"]


def metrics():
    text = urllib.request.urlopen(url + "/metrics").read().decode()
    out = {}
    for line in text.splitlines():
        if line.startswith("cleave_handoff_") and ("_sum" in line or "_count" in line):
            name = line.split("{")[0]
            out[name] = out.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
    return out


one(-1)  # warm-up (connections, first allocations)
before = metrics()
rows = [one(i) for i in range(runs)]
after = metrics()
for ttft, tpot, p, c in rows:
    print(f"prompt {p} tok, {c} out: TTFT {ttft * 1e3:.1f} ms, TPOT {tpot * 1e3:.2f} ms")
print(f"median TTFT {statistics.median(r[0] for r in rows) * 1e3:.1f} ms, "
      f"median TPOT {statistics.median(r[1] for r in rows) * 1e3:.2f} ms")
for stage in ["queue", "reservation", "prefill", "ticket_wait", "transfer", "transfer_tail", "decode_first_step"]:
    s = after.get(f"cleave_handoff_{stage}_seconds_sum", 0) - before.get(f"cleave_handoff_{stage}_seconds_sum", 0)
    n = after.get(f"cleave_handoff_{stage}_seconds_count", 0) - before.get(f"cleave_handoff_{stage}_seconds_count", 0)
    if n:
        print(f"  handoff {stage:18s} mean {s / n * 1e3:8.2f} ms over {int(n)}")
b = after.get("cleave_handoff_transfer_bytes_sum", 0) - before.get("cleave_handoff_transfer_bytes_sum", 0)
n = after.get("cleave_handoff_transfer_bytes_count", 0) - before.get("cleave_handoff_transfer_bytes_count", 0)
if n:
    print(f"  handoff transfer bytes     mean {b / n / 1e6:8.2f} MB")
