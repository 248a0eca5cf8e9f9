"""`spec-run serve` measured against the API in one run: HTTP streaming overhead and second-turn TTFT.

    python tools/serve_bench.py BUNDLE [--repeats 3] [--max-new-tokens 96] [--drafter auto]

1. Overhead: the same greedy chat request through HTTP streaming (SSE, the openai client) and through
   ``SpecDecoder.generate`` on the same decoder, interleaved; decode tok/s of each (client-side for HTTP: tokens
   after the first chunk / time after the first chunk) and the ratio (goal >= 0.97).
2. Multi-turn: TTFT of a second chat turn right after the first (its prefix reused from the cache) and after an
   unrelated request replaced the cache (no reuse), as the client sees it (request sent -> first content chunk).
Loopback only; the server runs in this process.
"""

from __future__ import annotations

import argparse
import socket
import statistics
import sys
import threading
import time
from pathlib import Path


def main() -> int:
    import openai
    import uvicorn

    from specedge.runtime import SamplingParams, SpecDecoder
    from specedge.runtime.bench.runner import machine_info
    from specedge.runtime.server import Server

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("bundle")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--drafter", default="auto")
    ap.add_argument("--soak", type=int, default=0, help="then N sequential requests; RSS every N/5 (flat within 5%%?)")
    a = ap.parse_args()
    m = machine_info()
    print(f"machine: {m['cpu']} ({m['cpu_flags']}), {m['cpus']} CPUs; bundle {a.bundle}; drafter {a.drafter}")
    dec = SpecDecoder.load(a.bundle, verify="size")
    name = Path(a.bundle).resolve().name
    srv = Server(dec, name)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    uv = uvicorn.Server(uvicorn.Config(srv.app, host="127.0.0.1", port=port, log_level="error"))
    threading.Thread(target=uv.run, daemon=True).start()
    while not uv.started:
        time.sleep(0.05)
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", timeout=600, max_retries=0)
    spec = {"speculation": {"drafter": a.drafter}}

    def http_stream(messages, max_tokens):
        t0 = time.perf_counter()
        first, chunks, usage = None, 0, None
        for ch in client.chat.completions.create(model=name, messages=messages, temperature=0, max_tokens=max_tokens,
                                                 stream=True, stream_options={"include_usage": True},
                                                 extra_body=spec):
            if ch.choices and ch.choices[0].delta.content:
                chunks += 1
                if first is None:
                    first = time.perf_counter()
            if ch.usage:
                usage = ch.usage
        end = time.perf_counter()
        n = usage.completion_tokens
        return (n - 1) / (end - first) if first and n > 1 else 0.0, (first or end) - t0, usage

    msgs = [{"role": "user", "content": "Write a Python function that merges two sorted lists, with a docstring."}]
    http_speed, api_speed = [], []
    for r in range(a.repeats):
        for kind in (("http", "api") if r % 2 == 0 else ("api", "http")):
            if kind == "http":
                http_speed.append(http_stream(msgs, a.max_new_tokens)[0])
            else:
                res = dec.generate(msgs, SamplingParams(max_new_tokens=a.max_new_tokens), drafter=a.drafter,
                                   reuse_prefix=False)
                api_speed.append(res.stats.decode_tok_s)
    h, p = statistics.median(http_speed), statistics.median(api_speed)
    print(f"decode tok/s: HTTP streaming {h:.1f} (n={len(http_speed)}), generate() {p:.1f}; ratio {h / p:.3f}")

    turn1 = [{"role": "user", "content": "Explain what a Python generator is, briefly."}]
    reply = client.chat.completions.create(model=name, messages=turn1, temperature=0, max_tokens=64,
                                           extra_body=spec).choices[0].message.content
    turn2 = turn1 + [{"role": "assistant", "content": reply}, {"role": "user", "content": "Now give an example."}]
    other = [{"role": "user", "content": "Unrelated: name three prime numbers."}]
    with_reuse, without = [], []
    for _ in range(a.repeats):
        http_stream(turn1 + [{"role": "assistant", "content": reply}], 1)  # cache: turn 1 + reply
        _, ttft, usage = http_stream(turn2, 8)
        with_reuse.append((ttft, usage.model_extra["specedge"]["reused_tokens"], usage.prompt_tokens))
        http_stream(other, 1)  # cache: something else
        _, ttft, usage = http_stream(turn2, 8)
        without.append((ttft, usage.model_extra["specedge"]["reused_tokens"], usage.prompt_tokens))
    for label, rows in (("with reuse", with_reuse), ("without", without)):
        print(f"second-turn TTFT {label:10s}: {statistics.median(t for t, _, _ in rows) * 1000:.0f} ms "
              f"(reused {rows[0][1]} of {rows[0][2]} prompt tokens)")
    ok = True
    if a.soak:  # RSS of this process (server + decoder) over sequential HTTP requests
        from soak import rss_mb  # tools/soak.py, next to this script

        marks = {}
        prompts = ["def add(a, b):", "Name a color.", "Sort [3, 1, 2] in Python.", "What is 2 + 2?", "Say hi."]
        for i in range(1, a.soak + 1):
            client.chat.completions.create(model=name, messages=[{"role": "user", "content": prompts[i % 5]}],
                                           temperature=0.7 if i % 2 else 0, seed=i, max_tokens=8, extra_body=spec)
            if i % max(1, a.soak // 5) == 0 or i == 1:
                marks[i] = rss_mb()
        first = marks[min(k for k in marks if k > 1)]
        growth = (marks[a.soak] - first) / first
        print(f"RSS over {a.soak} sequential requests: " + ", ".join(f"{k}: {v:.0f} MB" for k, v in marks.items())
              + f"; after warm-up {growth:+.1%}")
        ok = growth <= 0.05
    uv.should_exit = True
    srv.stop()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
