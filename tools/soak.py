"""Soak: RSS of one decoder over many sequential requests (a leak shows as growth after warm-up).

    python tools/soak.py engines/smollm2-int8 [--requests 1000] [--max-new-tokens 16] [--drafter auto]

Cycles the built-in suite prompts, alternating greedy and seeded sampling; prints RSS every 100 requests and
the growth from request 100 to the end (the goal: flat within 5 %). Exit 1 if it grew more.
"""

from __future__ import annotations

import argparse
import sys
import time

from specedge.runtime import SamplingParams, SpecDecoder
from specedge.runtime.bench.suites import suite_prompts


def rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("bundle")
    ap.add_argument("--requests", type=int, default=1000)
    ap.add_argument("--max-new-tokens", type=int, default=16)
    ap.add_argument("--drafter", default="auto")
    a = ap.parse_args()
    dec = SpecDecoder.load(a.bundle, verify="size")
    prompts = [p.prompt for p in suite_prompts(["code", "edit", "chat", "summarize", "json"])]
    marks = {}
    t0 = time.perf_counter()
    for i in range(1, a.requests + 1):
        p = prompts[i % len(prompts)]
        msgs = [{"role": "user", "content": p}] if isinstance(p, str) else list(p)
        params = SamplingParams(max_new_tokens=a.max_new_tokens, temperature=0.8 if i % 2 else 0.0, seed=i)
        dec.generate(msgs, params, drafter=a.drafter)
        if i % 100 == 0 or i == 1:
            marks[i] = rss_mb()
            print(f"request {i:5d}: RSS {marks[i]:.1f} MB ({time.perf_counter() - t0:.0f} s)", flush=True)
    base = marks.get(100, marks[1])
    growth = (marks[max(marks)] - base) / base
    print(f"RSS from request 100 to {max(marks)}: {base:.1f} -> {marks[max(marks)]:.1f} MB ({growth:+.1%})")
    return 0 if growth <= 0.05 else 1


if __name__ == "__main__":
    sys.exit(main())
