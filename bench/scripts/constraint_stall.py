#!/usr/bin/env python3
"""Does a node's first constrained request stall the streams it is already decoding?

Usage: start a node, e.g. `cleave up --model M --colocated 1 --port 8330`, then
`python3 bench/scripts/constraint_stall.py 8330`. One 600-token greedy stream starts; 0.8 s later a
JSON-mode request arrives (the node's first constrained request, which builds its constraint
compiler). Prints the constrained request's latency and the stream's median and largest gap
between chunks: the largest gap is the stall, if any.
"""
import json
import sys
import threading
import time
import urllib.request

port = int(sys.argv[1]) if len(sys.argv) > 1 else 8330
url = f"http://127.0.0.1:{port}/v1/chat/completions"


def post(body):
    return urllib.request.Request(url, data=json.dumps(body).encode(), headers={"content-type": "application/json"})


def stream():
    body = {"messages": [{"role": "user", "content": "Tell me a long story about a dragon."}],
            "max_tokens": 600, "temperature": 0, "ignore_eos": True, "stream": True}
    ts = []
    with urllib.request.urlopen(post(body)) as r:
        for line in r:
            if line.startswith(b"data: {"):
                ts.append(time.perf_counter())
    gaps = sorted(b - a for a, b in zip(ts, ts[1:]))
    print("stream: %d chunks, median gap %.1f ms, largest gap %.1f ms"
          % (len(ts), gaps[len(gaps) // 2] * 1e3, gaps[-1] * 1e3))


t = threading.Thread(target=stream)
t.start()
time.sleep(0.8)
body = {"messages": [{"role": "user", "content": "Give me a JSON object with the capital of France."}],
        "max_tokens": 16, "temperature": 0, "response_format": {"type": "json_object"}}
t0 = time.perf_counter()
reply = json.load(urllib.request.urlopen(post(body)))
print("constrained request: %.0f ms, %r" % ((time.perf_counter() - t0) * 1e3,
                                             reply["choices"][0]["message"]["content"][:40]))
t.join()
